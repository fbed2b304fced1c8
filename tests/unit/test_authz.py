"""The GangService decision table (coordinator/core/authz.py) and the policy
file's validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.core.authz import (
    ACTIONS, DEFAULT_MAX_PRIORITY, READS, Policy, PolicyError, decide, load_policy, owner_of, parse_policy, valid_owner,
)
from phalanx.certs import Identity
from phalanx.spec import MAX_PRIORITY

ADMIN = Identity("local", "admin", "root")
ALICE = Identity("local", "submitter", "alice", queues=("a",))
BOB = Identity("local", "submitter", "bob", queues=("a", "b"))
VIEWER = Identity("local", "viewer", "eve")
AGENT = Identity("local", "agent", "n1", node="n1")
COORD = Identity("local", "coordinator", "c1")
P = Policy()

# (identity, action, kwargs, allowed, words the reason must contain)
TABLE = [
    (ALICE, "submit", {"queue": "a"}, True, ()),
    (ALICE, "submit", {"queue": "b"}, False, ("submitter/alice", "queue 'b'", "a")),
    (BOB, "submit", {"queue": "b"}, True, ()),
    (ALICE, "submit", {"queue": "a", "priority": 100}, True, ()),
    (ALICE, "submit", {"queue": "a", "priority": 101}, False, ("priority 101", "maximum 100", "max_priority.submitter")),
    (ALICE, "submit", {"queue": "a", "priority": -5}, True, ()),
    (ADMIN, "submit", {"queue": "anything", "priority": MAX_PRIORITY}, True, ()),
    (ADMIN, "submit", {"queue": "x", "priority": 5, "forwarded": True}, True, ()),
    (VIEWER, "submit", {"queue": "a"}, False, ("viewer/eve", "only read")),
    (VIEWER, "cancel", {"gang_owner": "viewer/eve"}, False, ("only read",)),
    (AGENT, "submit", {"queue": "a"}, False, ("agent/n1", "agent identity")),
    (AGENT, "get", {}, False, ("agent identity",)),
    (AGENT, "submit", {"queue": "a", "forwarded": True}, False, ("agent identity",)),
    (COORD, "submit", {"queue": "a"}, False, ("coordinator/c1", "only forward")),
    (COORD, "list", {}, False, ("coordinator identity",)),
    (COORD, "submit", {"queue": "a", "priority": MAX_PRIORITY, "forwarded": True}, True, ()),
    (COORD, "cancel", {"gang_owner": "submitter/alice", "forwarded": True}, True, ()),
    (ALICE, "cancel", {"gang_owner": "submitter/alice", "gang_id": "g-1"}, True, ()),
    (BOB, "cancel", {"gang_owner": "submitter/alice", "gang_id": "g-1"}, False, ("submitter/bob", "g-1", "owned by submitter/alice")),
    (BOB, "cancel", {"gang_owner": "", "gang_id": "g-2"}, False, ("without an owner",)),
    # A submitter's name alone is not its identity: admin/alice is another owner.
    (ALICE, "cancel", {"gang_owner": "admin/alice", "gang_id": "g-3"}, False, ("owned by admin/alice",)),
    (ADMIN, "cancel", {"gang_owner": "submitter/alice"}, True, ()),
    (ADMIN, "cancel", {"gang_owner": ""}, True, ()),
    (ALICE, "delete-everything", {}, False, ("unknown action",)),
    (ADMIN, "delete-everything", {}, False, ("unknown action",)),
]


@pytest.mark.parametrize("identity,action,kw,allowed,words", TABLE)
def test_decision_table(identity: Identity, action: str, kw: dict, allowed: bool, words: tuple[str, ...]) -> None:
    d = decide(identity, action, policy=P, **kw)
    assert d.allowed is allowed, d.reason
    if not allowed:
        for w in words:
            assert w in d.reason, (w, d.reason)


@pytest.mark.parametrize("identity", [ADMIN, ALICE, BOB, VIEWER])
@pytest.mark.parametrize("action", READS)
def test_every_reading_role_sees_everything(identity: Identity, action: str) -> None:
    assert decide(identity, action, policy=P).allowed


@pytest.mark.parametrize("action", ACTIONS)
def test_agents_and_unforwarded_coordinators_are_refused_everything(action: str) -> None:
    assert not decide(AGENT, action, policy=P, queue="a").allowed
    assert not decide(COORD, action, policy=P, queue="a").allowed


def test_policy_caps_are_used() -> None:
    strict = parse_policy({"max_priority": {"submitter": 0, "admin": 10}})
    assert not decide(ALICE, "submit", policy=strict, queue="a", priority=1).allowed
    assert decide(ALICE, "submit", policy=strict, queue="a", priority=0).allowed
    d = decide(ADMIN, "submit", policy=strict, queue="a", priority=11)
    assert not d.allowed and "max_priority.admin" in d.reason


def test_owner_strings() -> None:
    assert owner_of(ALICE) == "submitter/alice"
    assert valid_owner("submitter/alice") and valid_owner("admin/root")
    for bad in ("", "alice", "root/alice", "submitter/", "submitter/a/b", "submitter/alice\n", "submitter/" + "x" * 300):
        assert not valid_owner(bad), bad


@pytest.mark.parametrize("data,words", [
    ([], ("must be a mapping",)),
    ({"max_prio": {}}, ("max_prio: unknown field",)),
    ({"max_priority": 5}, ("max_priority: must be a mapping",)),
    ({"max_priority": {"viewer": 1}}, ("max_priority.viewer", "may not submit")),
    ({"max_priority": {"agent": 1}}, ("max_priority.agent",)),
    ({"max_priority": {"wizard": 1}}, ("max_priority.wizard", "is not a role")),
    ({"max_priority": {"submitter": "high"}}, ("max_priority.submitter", "must be an integer")),
    ({"max_priority": {"submitter": True}}, ("max_priority.submitter", "must be an integer")),
    ({"max_priority": {"admin": MAX_PRIORITY + 1}}, ("max_priority.admin", "between")),
])
def test_bad_policies_name_the_field(data: object, words: tuple[str, ...]) -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(data)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_defaults_and_partial_policy() -> None:
    assert dict(parse_policy(None).max_priority) == dict(DEFAULT_MAX_PRIORITY)
    p = parse_policy({"max_priority": {"submitter": 7}})
    assert p.max_priority == {"admin": MAX_PRIORITY, "submitter": 7}


def test_load_policy_file(tmp_path: Path) -> None:
    f = tmp_path / "policy.yaml"
    f.write_text("max_priority:\n  submitter: 50\n")
    assert load_policy(f).max_priority["submitter"] == 50
    f.write_text("max_priority:\n  submitter: [1\n")
    with pytest.raises(PolicyError, match="not YAML"):
        load_policy(f)
    f.write_text("max_priority:\n  viewer: 3\n")
    with pytest.raises(PolicyError) as e:
        load_policy(f)
    assert str(f) in str(e.value) and "max_priority.viewer" in str(e.value)
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "absent.yaml")
