"""The GangService decision table (coordinator/core/authz.py) and the policy
file's validation."""

from __future__ import annotations

import json

import pytest

from phalanx import strict_docs

from coordinator.core.authz import (
    ACTIONS, DEFAULT_MAX_PRIORITY, GET_POLICY, MAX_POLICY_JSON_BYTES, NODE_ADMIN, READS, SET_POLICY, Policy, PolicyError, decide,
    owner_of, policy_from_yaml, parse_policy, parse_policy_json, valid_owner, visible,
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


def test_policy_from_yaml_names_the_file_and_field() -> None:
    assert policy_from_yaml("max_priority:\n  submitter: 50\n", "p.yaml").max_priority["submitter"] == 50
    with pytest.raises(PolicyError, match="p.yaml: not valid YAML"):
        policy_from_yaml("max_priority:\n  submitter: [1\n", "p.yaml")
    with pytest.raises(PolicyError) as e:
        policy_from_yaml("max_priority:\n  viewer: 3\n", "p.yaml")
    assert "p.yaml" in str(e.value) and "max_priority.viewer" in str(e.value)


# --- per-submitter overrides, visibility, the policy as data -------------------------

OVERRIDES = parse_policy({"max_priority": {"submitter": 10}, "submitters": {"alice": {"max_priority": 500}, "carol": {"max_priority": -1}}})
CAROL = Identity("local", "submitter", "carol", queues=("a",))


@pytest.mark.parametrize("identity,priority,allowed,where", [
    (ALICE, 500, True, ""),
    (ALICE, 501, False, "submitters.alice.max_priority"),
    (BOB, 10, True, ""),
    (BOB, 11, False, "max_priority.submitter"),
    (CAROL, 0, False, "submitters.carol.max_priority"),
    (CAROL, -1, True, ""),
    # An override names a submitter: an admin called alice is not capped by it.
    (Identity("local", "admin", "alice"), MAX_PRIORITY, True, ""),
])
def test_per_submitter_override(identity: Identity, priority: int, allowed: bool, where: str) -> None:
    d = decide(identity, "submit", policy=OVERRIDES, queue="a", priority=priority)
    assert d.allowed is allowed, d.reason
    assert where in d.reason


OWN = parse_policy({"visibility": "own"})


@pytest.mark.parametrize("identity,policy,owner,forwarded,seen", [
    (ALICE, P, "submitter/bob", False, True),
    (ALICE, OWN, "submitter/alice", False, True),
    (ALICE, OWN, "submitter/bob", False, False),
    (ALICE, OWN, "", False, False),
    (ALICE, OWN, "admin/alice", False, False),
    (ADMIN, OWN, "submitter/bob", False, True),
    (VIEWER, OWN, "submitter/bob", False, True),
    (COORD, OWN, "submitter/bob", True, True),
    (COORD, P, "submitter/bob", False, False),
    (AGENT, P, "submitter/bob", False, False),
])
def test_visibility_table(identity: Identity, policy: Policy, owner: str, forwarded: bool, seen: bool) -> None:
    assert visible(identity, policy, owner, forwarded=forwarded) is seen


# SetPolicy is never forwarded: a coordinator certificate may not set it.
# Node lifecycle (docs/nodes.md) is forwarded to the node's leader by the
# coordinator that decided.
@pytest.mark.parametrize("action,forward_ok,words", [(SET_POLICY, False, "change the policy"),
                                                     (NODE_ADMIN, True, "only an admin may cordon")])
@pytest.mark.parametrize("identity,forwarded", [(ADMIN, False), (ALICE, False), (VIEWER, False), (AGENT, False),
                                                (COORD, True), (COORD, False)])
def test_admin_only_actions(action: str, forward_ok: bool, words: str, identity: Identity, forwarded: bool) -> None:
    d = decide(identity, action, policy=P, forwarded=forwarded)
    assert d.allowed is (identity is ADMIN or (identity is COORD and forwarded and forward_ok)), d.reason
    if not d.allowed:
        assert owner_of(identity) in d.reason, d.reason
        assert words in d.reason or identity in (AGENT, COORD), d.reason


def test_every_reading_role_reads_the_policy() -> None:
    for who in (ADMIN, ALICE, VIEWER):
        assert decide(who, GET_POLICY, policy=OWN).allowed


@pytest.mark.parametrize("data,words", [
    ({"submitters": []}, ("submitters: must be a mapping",)),
    ({"submitters": {"alice": 5}}, ("submitters.alice", "one key max_priority")),
    ({"submitters": {"alice": {"max_priority": 5, "x": 1}}}, ("submitters.alice", "one key max_priority")),
    ({"submitters": {"alice": {"max_priority": "hi"}}}, ("submitters.alice.max_priority", "must be an integer")),
    ({"submitters": {"alice": {"max_priority": MAX_PRIORITY + 1}}}, ("submitters.alice.max_priority", "between")),
    ({"submitters": {"a/b": {"max_priority": 1}}}, ("submitters.a/b", "node name")),
    ({"submitters": {7: {"max_priority": 1}}}, ("submitters.7", "must be a string")),
    ({"visibility": "mine"}, ("visibility", "all, own", "'mine'")),
    ({"visibility": None}, ("visibility",)),
])
def test_bad_overrides_and_visibility_name_the_field(data: object, words: tuple[str, ...]) -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(data)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_policy_round_trips_as_data() -> None:
    for p in (P, OVERRIDES, OWN):
        assert parse_policy(p.to_data()) == p
        assert parse_policy_json(json.dumps(p.to_data())) == p
    assert P.to_data() == {"max_priority": dict(sorted(DEFAULT_MAX_PRIORITY.items())), "submitters": {}, "visibility": "all"}


@pytest.mark.parametrize("text,words", [
    ("", ("policy_json", "is required")),
    ("{", ("policy_json", "not JSON")),
    ("null", ("policy_json", "JSON object")),
    ('{"visibility": "x"}', ("policy_json", "visibility")),
    ('{"max_priority": {"viewer": 1}}', ("policy_json", "max_priority.viewer")),
    (" " * (MAX_POLICY_JSON_BYTES + 1), ("policy_json", "above the limit")),
])
def test_policy_json_errors(text: str, words: tuple[str, ...]) -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy_json(text)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# The JSON (SetPolicy) and YAML (--policy, `phalanx policy set`) paths agree:
# the same document in either form is refused for the same reason, at the
# place it happens, never with a RecursionError or the last duplicate winning.
@pytest.mark.parametrize("json_text,yaml_text,words", [
    ('{"visibility": "all", "visibility": "own"}', "visibility: all\nvisibility: own\n",
     ("duplicate key 'visibility'", "line 1")),
    ('{"submitters": {"al": {"max_priority": 1}, "al": {"max_priority": 9}}}',
     "submitters:\n  al: {max_priority: 1}\n  al: {max_priority: 9}\n", ("duplicate key 'al'",)),
    ('{"max_priority": {"submitter": 1,\n "submitter": 2}}', "max_priority: {submitter: 1,\n submitter: 2}\n",
     ("duplicate key 'submitter'", "line 2")),
    ('{"visibility": ' + "[" * 100_000, "visibility: " + "[" * 100_000, ("nested more than 32 levels deep",)),
    ('{"max_priority": ' + "{\"a\": " * 40 + "1" + "}" * 41,
     "max_priority: " + "{a: " * 40 + "1" + "}" * 40, ("nested more than 32 levels deep",)),
])
def test_json_and_yaml_policies_are_refused_alike(json_text: str, yaml_text: str, words: tuple[str, ...]) -> None:
    for text, parse in ((json_text, parse_policy_json), (yaml_text, lambda t: policy_from_yaml(t, "p.yaml"))):
        with pytest.raises(PolicyError) as e:
            parse(text)
        for w in words:
            assert w in str(e.value), (w, str(e.value)[:300])


def test_strict_json_accepts_what_json_accepts() -> None:
    """Keys that only look alike, strings holding brackets and escaped
    quotes, and the same key in sibling objects are not duplicates."""
    text = ('{"submitters": {"a": {"max_priority": 1}, "b": {"max_priority": 2}}, '
            '"max_priority": {"submitter": 3}, "visibility": "all"}')
    assert parse_policy_json(text).submitters == {"a": 1, "b": 2}
    assert strict_docs.load_json('{"a": "[[[{\\"a\\"", "b": {"a": 1}, "c": [{"a": 1}, {"a": 2}]}') == {
        "a": '[[[{"a"', "b": {"a": 1}, "c": [{"a": 1}, {"a": 2}]}
    assert strict_docs.load_json("[" * 32 + "]" * 32) is not None
