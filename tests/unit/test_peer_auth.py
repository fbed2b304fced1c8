"""Tables for coordinator/core/peer_auth.py: who may register as which node,
replace a session, report a member, and call CoordinatorPeer."""

from __future__ import annotations

import grpc
import pytest

from coordinator import refusals
from coordinator.core import peer_auth
from phalanx.certs import CHECK_EXPIRED, CHECK_UNKNOWN_CA, CHECK_WRONG_CLUSTER, Identity

DENIED = peer_auth.Code.PERMISSION_DENIED
UNAUTH = peer_auth.Code.UNAUTHENTICATED

AGENT_N1 = Identity("local", "agent", "a1", node="n1")
AGENT_N1_OTHER = Identity("local", "agent", "a1b", node="n1")
AGENT_N2 = Identity("local", "agent", "a2", node="n2")
BOB = Identity("local", "submitter", "bob", queues=("default",))
VIEWER = Identity("local", "viewer", "vic")
ADMIN = Identity("local", "admin", "root")
C0 = Identity("local", "coordinator", "c0")
# Certificates bound to an AZ (phalanx certs issue --az).
AGENT_N1_A = Identity("local", "agent", "a1", node="n1", az="az-a")
C0_B = Identity("local", "coordinator", "c0", az="az-b")
C0_ELSEWHERE = Identity("other", "coordinator", "c0")


@pytest.mark.parametrize("identity,node,code,words", [
    (None, "n1", None, ()),                       # plaintext: nothing checked
    (None, None, None, ()),
    (AGENT_N1, "n1", None, ()),
    (AGENT_N1, None, None, ()),                   # before the registration is read: the role only
    (AGENT_N1, "n2", DENIED, ("'n1'", "'n2'", "a1")),
    (BOB, None, DENIED, ("agent certificate", "submitter", "bob")),
    (BOB, "n1", DENIED, ("submitter",)),
    (VIEWER, "n1", DENIED, ("viewer",)),
    (ADMIN, "n1", DENIED, ("admin",)),
    (C0, "n1", DENIED, ("coordinator", "c0")),
    # Bound to az-a: welcome at az-a's leader, refused at az-b's before and
    # after the registration is read (one certificate is one node in one AZ).
    (AGENT_N1_A, "n1", None, ()),
    (AGENT_N1_A, None, None, ()),
])
def test_session(identity, node, code, words) -> None:
    r = peer_auth.session_refusal(identity, node, "az-a")
    assert (r.code if r else None) == code, r
    for w in words:
        assert w in r.message, r.message


@pytest.mark.parametrize("node", [None, "n1"])
def test_session_at_another_az(node) -> None:
    r = peer_auth.session_refusal(AGENT_N1_A, node, "az-b")
    assert r is not None and r.code == DENIED, r
    assert "bound to AZ 'az-a'" in r.message and "'az-b'" in r.message, r.message
    # An unbound (older) certificate is not refused for its AZ.
    assert peer_auth.session_refusal(AGENT_N1, node, "az-b") is None


@pytest.mark.parametrize("current,new,refused", [
    (None, None, False),            # plaintext, as always: the newer session wins
    (None, AGENT_N1, False),        # no live identified session
    (AGENT_N1, AGENT_N1, False),    # the same agent reconnecting (or renewed)
    (AGENT_N1, AGENT_N1_OTHER, True),
])
def test_replacement(current, new, refused) -> None:
    r = peer_auth.replacement_refusal("n1", current, new)
    assert (r is not None) == refused
    if r:
        assert r.code == DENIED and "a1" in r.message and "a1b" in r.message and "'n1'" in r.message


@pytest.mark.parametrize("node,placed,words", [
    ("n1", "n1", None),
    ("n2", "n1", ("'n2'", "placed on 'n1'", "rank 3")),
    ("n2", None, ("not placed in this AZ",)),
])
def test_member(node, placed, words) -> None:
    why = peer_auth.member_refusal(node, "g-1", 3, placed)
    if words is None:
        assert why is None
    else:
        assert why and all(w in why for w in words), why


@pytest.mark.parametrize("identity,refused,words", [
    (None, False, ()),
    (C0, False, ()),
    (C0_ELSEWHERE, True, ("'other'", "'local'")),
    (AGENT_N1, True, ("agent", "a1")),
    (BOB, True, ("submitter", "bob")),
    (ADMIN, True, ("admin",)),
    (VIEWER, True, ("viewer",)),
])
def test_peer(identity, refused, words) -> None:
    r = peer_auth.peer_refusal(identity, "local")
    assert (r is not None) == refused
    if r:
        assert r.code == DENIED and all(w in r.message for w in words), r.message


@pytest.mark.parametrize("identity,az,epoch,leader,words", [
    (None, "az-b", 5, None, None),
    (C0, "az-b", 5, ("c0", 5), None),
    (C0, "az-b", 5, None, ("az-b", "no leader")),
    (C0, "az-b", 5, ("c1", 5), ("'c0'", "'c1'", "az-b")),
    (C0, "az-b", 4, ("c0", 5), ("epoch 4", "epoch 5")),
    (C0, "", 5, None, ("?",)),
    (C0_B, "az-b", 5, ("c0", 5), None),
    (C0_B, "az-c", 5, ("c0", 5), ("bound to AZ 'az-b'", "az-c")),
])
def test_leader(identity, az, epoch, leader, words) -> None:
    r = peer_auth.leader_refusal(identity, az, epoch, leader)
    if words is None:
        assert r is None
    else:
        assert r is not None and r.code == DENIED and all(w in r.message for w in words), r.message


@pytest.mark.parametrize("check,code", [
    (CHECK_WRONG_CLUSTER, DENIED),
    (CHECK_UNKNOWN_CA, UNAUTH),
    (CHECK_EXPIRED, UNAUTH),
    ("no certificate", UNAUTH),
])
def test_identity_refusal(check, code) -> None:
    r = peer_auth.identity_refusal("CoordinatorPeer", check, "why")
    assert r.code == code and "CoordinatorPeer" in r.message and check in r.message


@pytest.mark.parametrize("code", list(peer_auth.Code))
def test_every_refusal_code_is_the_grpc_status_of_its_name(code) -> None:
    """coordinator/refusals.py answers a refusal with the gRPC status of the same name."""
    assert refusals.status(code) is getattr(grpc.StatusCode, code.name)
