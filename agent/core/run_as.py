"""Who a gang member runs as: the gang's owner, mapped to a local account.

Pure: the policy document and the account lookup come in, a decision comes
out; ``agent.process`` performs it (docs/launcher.md "Who members run as").

The policy (``python -m agent --run-as FILE``, YAML)::

    default: nobody            # owners not listed below (the default: nobody)
    owners:                    # gang owner -> local user name, or "UID:GID"
      admin/alice: alice
      queue/team-a: "1001:1001"
      "": nobody               # gangs submitted over plaintext have owner ""
    allow_root: [admin/ops]    # the only owners whose members may run as uid 0

A member whose owner maps to uid 0 and is not in ``allow_root`` is refused:
nothing runs. An agent that is not root cannot switch users, so its members
run as the agent's own user, whatever the policy says: root is never gained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

DEFAULT_USER = "nobody"
ROOT_UID = 0
FIELDS = ("default", "owners", "allow_root")
# Linux reserves (uid_t)-1 ("no change"); anything above is not an id.
MAX_ID = 2**32 - 2


class RunAsError(ValueError):
    """A policy document that cannot be used: which field, and why."""

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


@dataclass(frozen=True)
class Account:
    """A local account a member can run as."""

    name: str  # the user name, or "UID:GID" for an entry given by ids
    uid: int
    gid: int
    groups: tuple[int, ...] = ()  # supplementary groups: the account's own, never the agent's


# Resolves one policy entry ("alice" or "1001:1001") to an account; raises
# LookupError (KeyError) when the node has no such user.
Resolve = Callable[[str], Account]


@dataclass(frozen=True)
class RunAsPolicy:
    default: Account
    owners: Mapping[str, Account] = field(default_factory=dict)
    allow_root: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RunAs:
    """Start the member as ``account``; ``switch`` False: as the agent's own
    user (``account`` is None then), because the agent cannot switch."""

    account: Account | None
    switch: bool


@dataclass(frozen=True)
class Refused:
    reason: str


def parse_ids(text: str) -> tuple[int, int] | None:
    """(uid, gid) of a "UID:GID" entry; None when ``text`` is not of that
    form (then it is a user name). RunAsError for ids out of range."""
    uid_text, sep, gid_text = text.partition(":")
    if not sep:
        return None
    if not (uid_text.isdigit() and gid_text.isdigit()) or not uid_text.isascii() or not gid_text.isascii():
        raise RunAsError("user", f"{text!r} is neither a user name nor UID:GID (two decimal numbers)")
    uid, gid = int(uid_text), int(gid_text)
    if uid > MAX_ID or gid > MAX_ID:
        raise RunAsError("user", f"{text!r}: ids must be at most {MAX_ID}")
    return uid, gid


def _entry(value: Any, where: str, resolve: Resolve) -> Account:
    if not isinstance(value, str) or not value.strip():
        raise RunAsError(where, f"must be a user name or \"UID:GID\", got {value!r}")
    text = value.strip()
    try:
        ids = parse_ids(text)
    except RunAsError as exc:
        raise RunAsError(where, exc.reason) from None
    if ids is not None:
        return Account(name=text, uid=ids[0], gid=ids[1])
    try:
        return resolve(text)
    except LookupError:
        raise RunAsError(where, f"no user {text!r} on this node") from None


def parse_policy(doc: Any, resolve: Resolve) -> RunAsPolicy:
    """The policy in a loaded YAML document (None: an empty file = the
    defaults). RunAsError naming the first bad field and why."""
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise RunAsError("(document)", f"must be a mapping with fields {', '.join(FIELDS)}, got {type(doc).__name__}")
    for key in doc:
        if key not in FIELDS:
            raise RunAsError(str(key), f"unknown field (expected one of {', '.join(FIELDS)})")
    default = _entry(doc.get("default", DEFAULT_USER), "default", resolve)
    owners_doc = doc.get("owners") or {}
    if not isinstance(owners_doc, dict):
        raise RunAsError("owners", f"must be a mapping of owner to user, got {type(owners_doc).__name__}")
    owners: dict[str, Account] = {}
    for owner, user in owners_doc.items():
        if not isinstance(owner, str):
            raise RunAsError("owners", f"owner {owner!r} must be a string (\"<role>/<name>\", or \"\" for plaintext)")
        owners[owner] = _entry(user, f"owners.{owner}", resolve)
    allow_doc = doc.get("allow_root") or []
    if not isinstance(allow_doc, list):
        raise RunAsError("allow_root", f"must be a list of owners, got {type(allow_doc).__name__}")
    for i, owner in enumerate(allow_doc):
        if not isinstance(owner, str):
            raise RunAsError(f"allow_root[{i}]", f"must be an owner string, got {owner!r}")
    return RunAsPolicy(default=default, owners=owners, allow_root=frozenset(allow_doc))


def decide(owner: str, policy: RunAsPolicy | None, agent_uid: int) -> RunAs | Refused:
    """Whom the member of a gang owned by ``owner`` runs as, on an agent
    running as ``agent_uid``. ``policy`` None: no policy was loaded, which
    only an agent that cannot switch users may lack."""
    if agent_uid != ROOT_UID:
        # Only root can change user; anything else would fail in the child.
        # Running as the agent's own (non-root) user gains nothing.
        return RunAs(account=None, switch=False)
    if policy is None:
        return Refused("the agent runs as root and has no run-as policy: members never run as root")
    account = policy.owners.get(owner, policy.default)
    if account.uid == ROOT_UID and owner not in policy.allow_root:
        how = "is mapped to" if owner in policy.owners else "falls to the default user"
        return Refused(f"owner {owner!r} {how} {account.name!r} (uid 0), and the agent's run-as "
                       f"policy does not list it in allow_root: members never run as root")
    return RunAs(account=account, switch=True)
