"""Who may read which token records through AgentService.ReadToken
(coordinator/core/token_read.py), by table."""

from __future__ import annotations

import pytest

from coordinator.core.peer_auth import Code
from coordinator.core.token_read import caller_refusal, reservation_refusal
from phalanx.certs import Identity

AGENT_N1 = Identity("local", "agent", "a1", node="n1")
AGENT_N1_AZ_B = Identity("local", "agent", "a1", node="n1", az="az-b")
AGENT_N1_AZ_A = Identity("local", "agent", "a1", node="n1", az="az-a")
BOB = Identity("local", "submitter", "bob", queues=("default",))
C0 = Identity("local", "coordinator", "c0")
DENIED, INVALID = Code.PERMISSION_DENIED, Code.INVALID_ARGUMENT


@pytest.mark.parametrize("identity, requested_az, gang, code, words", [
    (AGENT_N1, "az-a", "", None, ""),
    (AGENT_N1, "az-a", "g1", None, ""),
    (AGENT_N1_AZ_A, "az-a", "g1", None, ""),
    (None, "az-a", "g1", None, ""),                    # plaintext: nothing to check but the request
    (AGENT_N1, "az-b", "", DENIED, "this coordinator serves 'az-a'"),
    (None, "az-b", "", DENIED, "this coordinator serves 'az-a'"),
    (AGENT_N1_AZ_B, "az-a", "", DENIED, "bound to AZ 'az-b'"),
    (BOB, "az-a", "", DENIED, "AgentService.ReadToken needs an agent certificate"),
    (C0, "az-a", "", DENIED, "needs an agent certificate"),
    (AGENT_N1, "az-a", "a/b", INVALID, "not a gang id"),
    (AGENT_N1, "az-a", "x" * 257, INVALID, "not a gang id"),
    (AGENT_N1, "az-a", "g\n1", INVALID, "not a gang id"),
])
def test_caller_refusal(identity, requested_az, gang, code, words) -> None:
    r = caller_refusal(identity, "az-a", requested_az, gang)
    if code is None:
        assert r is None
    else:
        assert r is not None and r.code == code and words in r.message, r


PLACED = {"nodes": {"n1": {"gpus": [0], "nics": []}}}


@pytest.mark.parametrize("identity, record, refused", [
    (AGENT_N1, PLACED, False),
    (AGENT_N1, None, False),                           # absent: answered as absent
    (None, {"nodes": {}}, False),                      # plaintext
    (AGENT_N1, {"nodes": {"n2": {"gpus": [0], "nics": []}}}, True),
    (AGENT_N1, {"nodes": []}, True),
    (AGENT_N1, {}, True),
    (AGENT_N1, False, True),                           # unreadable record
    (AGENT_N1, ["n1"], True),
])
def test_reservation_refusal(identity, record, refused) -> None:
    r = reservation_refusal(identity, "g1", record)
    assert (r is not None) == refused
    if refused:
        assert r.code == DENIED and "places no member on node 'n1'" in r.message
