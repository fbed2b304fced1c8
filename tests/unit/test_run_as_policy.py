"""Table tests of agent.core.run_as: parsing the --run-as policy and the
decision owner + policy + agent uid -> account or refusal."""

from __future__ import annotations

import pytest

from agent.core.run_as import (
    DEFAULT_USER, Account, Refused, RunAs, RunAsError, RunAsPolicy, decide, parse_ids, parse_policy,
)

# The accounts a node has, for the resolver under test (a lookup table: the
# real resolver reads /etc/passwd and /etc/group).
USERS = {
    "nobody": Account("nobody", 65534, 65534, (65534,)),
    "alice": Account("alice", 1001, 1001, (1001, 27)),
    "root": Account("root", 0, 0, (0,)),
}


def resolve(name: str) -> Account:
    return USERS[name]


NOBODY, ALICE, ROOT = USERS["nobody"], USERS["alice"], USERS["root"]


@pytest.mark.parametrize("doc,expected", [
    (None, RunAsPolicy(default=NOBODY)),
    ({}, RunAsPolicy(default=NOBODY)),
    ({"default": "alice"}, RunAsPolicy(default=ALICE)),
    ({"owners": {"admin/alice": "alice", "": "2000:3000"}},
     RunAsPolicy(default=NOBODY, owners={"admin/alice": ALICE, "": Account("2000:3000", 2000, 3000)})),
    ({"owners": {"admin/ops": "root"}, "allow_root": ["admin/ops"]},
     RunAsPolicy(default=NOBODY, owners={"admin/ops": ROOT}, allow_root=frozenset({"admin/ops"}))),
    ({"owners": None, "allow_root": None}, RunAsPolicy(default=NOBODY)),
    ({"default": " 0:0 "}, RunAsPolicy(default=Account("0:0", 0, 0))),
])
def test_parse_policy_accepts(doc, expected) -> None:
    assert parse_policy(doc, resolve) == expected


@pytest.mark.parametrize("doc,field,reason_part", [
    ([], "(document)", "must be a mapping"),
    ("nobody", "(document)", "must be a mapping"),
    ({"users": {}}, "users", "unknown field"),
    ({"default": "mallory"}, "default", "no user 'mallory' on this node"),
    ({"default": ""}, "default", "must be a user name"),
    ({"default": 1001}, "default", "must be a user name"),
    ({"default": "10x:1"}, "default", "neither a user name nor UID:GID"),
    ({"default": "1:"}, "default", "neither a user name nor UID:GID"),
    ({"default": "-1:5"}, "default", "neither a user name nor UID:GID"),
    ({"default": "4294967295:0"}, "default", "ids must be at most"),
    ({"owners": ["admin/alice"]}, "owners", "must be a mapping of owner to user"),
    ({"owners": {5: "alice"}}, "owners", "must be a string"),
    ({"owners": {"admin/alice": "mallory"}}, "owners.admin/alice", "no user 'mallory'"),
    ({"owners": {"admin/alice": ["alice"]}}, "owners.admin/alice", "must be a user name"),
    ({"allow_root": "admin/ops"}, "allow_root", "must be a list of owners"),
    ({"allow_root": ["admin/ops", 7]}, "allow_root[1]", "must be an owner string"),
])
def test_parse_policy_refuses_naming_the_field(doc, field, reason_part) -> None:
    with pytest.raises(RunAsError) as err:
        parse_policy(doc, resolve)
    assert err.value.field == field
    assert reason_part in err.value.reason
    assert str(err.value).startswith(f"{field}: ")


@pytest.mark.parametrize("text,expected", [
    ("alice", None),
    ("1001:1002", (1001, 1002)),
    ("0:0", (0, 0)),
])
def test_parse_ids(text, expected) -> None:
    assert parse_ids(text) == expected


POLICY = RunAsPolicy(
    default=NOBODY,
    owners={"admin/alice": ALICE, "admin/ops": ROOT, "admin/eve": ROOT, "": Account("2000:2000", 2000, 2000)},
    allow_root=frozenset({"admin/ops"}),
)
ROOT_DEFAULT = RunAsPolicy(default=ROOT, allow_root=frozenset({"admin/ops"}))


@pytest.mark.parametrize("owner,policy,agent_uid,expected", [
    # An agent running as root switches to the mapped account...
    ("admin/alice", POLICY, 0, RunAs(ALICE, switch=True)),
    ("", POLICY, 0, RunAs(Account("2000:2000", 2000, 2000), switch=True)),
    # ... an unmapped owner gets the default user ...
    ("queue/team-a", POLICY, 0, RunAs(NOBODY, switch=True)),
    ("queue/team-a", RunAsPolicy(default=NOBODY), 0, RunAs(NOBODY, switch=True)),
    # ... root only for an owner in allow_root.
    ("admin/ops", POLICY, 0, RunAs(ROOT, switch=True)),
    ("admin/eve", POLICY, 0, Refused("owner 'admin/eve' is mapped to 'root' (uid 0), and the agent's run-as "
                                     "policy does not list it in allow_root: members never run as root")),
    ("queue/team-a", ROOT_DEFAULT, 0, Refused("owner 'queue/team-a' falls to the default user 'root' "
                                              "(uid 0), and the agent's run-as policy does not list it in "
                                              "allow_root: members never run as root")),
    ("admin/ops", ROOT_DEFAULT, 0, RunAs(ROOT, switch=True)),
    # An agent that is not root cannot switch: members run as the agent's
    # own user, whatever the mapping says (so not as root either).
    ("admin/alice", POLICY, 1001, RunAs(None, switch=False)),
    ("admin/eve", POLICY, 1001, RunAs(None, switch=False)),
    ("queue/team-a", ROOT_DEFAULT, 65534, RunAs(None, switch=False)),
    ("queue/team-a", None, 1001, RunAs(None, switch=False)),
    # A root agent without a policy runs nothing (the launcher always loads
    # one: the file's, or the default "everyone is nobody").
    ("queue/team-a", None, 0, Refused("the agent runs as root and has no run-as policy: "
                                      "members never run as root")),
])
def test_decide(owner, policy, agent_uid, expected) -> None:
    assert decide(owner, policy, agent_uid) == expected


def test_the_documented_default_user_is_nobody() -> None:
    assert DEFAULT_USER == "nobody"
    assert parse_policy({}, resolve).default == NOBODY


@pytest.mark.parametrize("account,arg", [
    (Account("nobody", 65534, 65534, (65534,)), "65534:65534:65534"),
    (Account("alice", 1001, 1001, (1001, 27)), "1001:1001:1001,27"),
    (Account("2000:3000", 2000, 3000), "2000:3000:"),
])
def test_the_launcher_hands_the_shim_exactly_the_accounts_ids_and_groups(account, arg) -> None:
    from agent.shim_call import account_arg
    from agent.shim import parse_user

    assert account_arg(account) == arg
    assert parse_user(arg) == (account.uid, account.gid, list(account.groups))


@pytest.mark.parametrize("arg", ["", "1001", "1001:1001", "a:1:", "1:2:x", "1:2:3:4"])
def test_the_shim_refuses_a_malformed_user(arg) -> None:
    from agent.shim import EXIT_USAGE, main, parse_user

    with pytest.raises(ValueError):
        parse_user(arg)
    assert main(["--lease", "/nonexistent", "--fence-after", "1", "--user", arg, "--", "true"]) == EXIT_USAGE
