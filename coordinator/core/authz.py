"""Who may do what on GangService (docs/security.md "Roles on GangService").

Pure: the caller's ``Identity`` (from its client certificate or its bearer
token), the action, and what the action touches (the queue and priority of
a submission, the owner of a gang to cancel or read) go in; a ``Decision``
(or, for reads, whether the gang is visible) comes out. Only a coordinator
that serves TLS asks; without TLS nothing is checked.

The policy is data: a maximum priority per role that may submit, an
override per submitter name, and who a submitter sees (``visibility``).
One validator (``parse_policy``) serves the YAML file (``--policy FILE``)
and the record in etcd that ``SetPolicy`` writes (coordinator/policy_store.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from phalanx import strict_docs
from phalanx.certs import MAX_NAME_LEN, ROLES, Identity
from phalanx.limits import NODE_NAME, NODE_NAME_WHAT, name_error
from phalanx.spec import MAX_PRIORITY

SUBMIT = "submit"
CANCEL = "cancel"
SET_POLICY = "set-policy"
GET_POLICY = "policy"
# Cordon, drain, delete a node (docs/nodes.md): admin only.
NODE_ADMIN = "node-admin"
# Reads: every role that may call GangService at all may do these (which
# gangs a submitter sees is ``visible``'s answer).
READS = ("get", "list", "watch", "explain", "nodes", "status", GET_POLICY)
ACTIONS = (SUBMIT, CANCEL, SET_POLICY, NODE_ADMIN) + READS

# visibility: "all" (every reading role sees every gang) or "own" (a
# submitter sees only the gangs it owns; admins and viewers still see all).
VISIBILITIES = ("all", "own")
# Bounds of a policy (it is one etcd value, read on every staleness bound).
MAX_SUBMITTER_OVERRIDES = 4096
POLICY_FIELDS = ("max_priority", "submitters", "visibility")

# Roles that may submit, and so have a maximum priority.
SUBMITTING_ROLES = ("admin", "submitter")
# Defaults (docs/security.md): an admin up to the spec's own bound, a
# submitter up to 100, so that an admin can always put a gang ahead of every
# submitter's.
DEFAULT_MAX_PRIORITY: Mapping[str, int] = {"admin": MAX_PRIORITY, "submitter": 100}

# The owner recorded on a gang: "<role>/<name>", both parts from the
# certificate's alphabets (validated again when it arrives in metadata).
_OWNER = re.compile(r"(?:%s)/[A-Za-z0-9._-]{1,%d}" % ("|".join(ROLES), MAX_NAME_LEN))


class PolicyError(ValueError):
    """A policy that cannot be used; the message names the field."""


@dataclass(frozen=True)
class Policy:
    max_priority: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_MAX_PRIORITY))
    # Submitter name -> its own maximum priority (above or below its role's).
    submitters: Mapping[str, int] = field(default_factory=dict)
    visibility: str = "all"

    def cap(self, identity: Identity) -> tuple[int | None, str]:
        """The maximum priority of ``identity`` and the policy field it comes from."""
        if identity.role == "submitter" and identity.name in self.submitters:
            return self.submitters[identity.name], f"submitters.{identity.name}.max_priority"
        return self.max_priority.get(identity.role), f"max_priority.{identity.role}"

    def to_data(self) -> dict[str, Any]:
        """The whole policy as plain data (defaults filled in): what
        GetPolicy answers and the etcd record holds; ``parse_policy`` of it
        is this policy again."""
        return {
            "max_priority": dict(sorted(self.max_priority.items())),
            "submitters": {n: {"max_priority": v} for n, v in sorted(self.submitters.items())},
            "visibility": self.visibility,
        }


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str = ""


ALLOW = Decision(True)


def owner_of(identity: Identity) -> str:
    """The owner a gang submitted by ``identity`` records, e.g. ``submitter/alice``."""
    return f"{identity.role}/{identity.name}"


def valid_owner(value: str) -> bool:
    return _OWNER.fullmatch(value) is not None


def _deny(identity: Identity, why: str) -> Decision:
    return Decision(False, f"{owner_of(identity)}: {why}")


def visible(identity: Identity, policy: Policy, gang_owner: str, *, forwarded: bool = False) -> bool:
    """May ``identity`` see a gang owned by ``gang_owner`` (get, list,
    watch, explain, and cancel's "is there such a gang")? Under
    ``visibility: own`` a submitter sees only its own gangs: the others are
    answered as if they did not exist. A forwarded call was checked by the
    coordinator that forwarded it."""
    if identity.role == "coordinator":
        return forwarded
    if identity.role in ("admin", "viewer"):
        return True
    if identity.role == "submitter":
        return policy.visibility == "all" or gang_owner == owner_of(identity)
    return False


def decide(identity: Identity, action: str, *, policy: Policy, forwarded: bool = False, queue: str = "",
           priority: int = 0, gang_owner: str = "", gang_id: str = "") -> Decision:
    """May ``identity`` do ``action``? ``forwarded``: the call carries the
    forwarded mark (trusted only from a coordinator, which decided before it
    forwarded). ``queue``/``priority``: of a submission. ``gang_owner`` /
    ``gang_id``: of the gang a cancel names. Unknown actions and roles are
    refused (fail closed)."""
    role = identity.role
    if action not in ACTIONS:
        return _deny(identity, f"unknown action {action!r}")
    if role == "coordinator":
        # A coordinator calls another's GangService only to forward a call
        # it has already authorized for its own caller (SetPolicy is never
        # forwarded: every coordinator writes the record itself).
        if forwarded and action != SET_POLICY:
            return ALLOW
        return _deny(identity, "a coordinator identity may not call GangService (only forward a call to its leader)")
    if role == "agent":
        return _deny(identity, "an agent identity may not call GangService")
    if role not in ("admin", "submitter", "viewer"):
        return _deny(identity, f"role {role!r} may not call GangService")
    if action in READS:
        # Which gangs: ``visible`` (docs/security.md "See").
        return ALLOW
    if action == SET_POLICY:
        if role == "admin":
            return ALLOW
        return _deny(identity, "only an admin may change the policy (SetPolicy)")
    if action == NODE_ADMIN:
        if role == "admin":
            return ALLOW
        return _deny(identity, "only an admin may cordon, uncordon, drain or delete a node")
    if role == "viewer":
        return _deny(identity, f"a viewer may only read (get, list, watch, explain, nodes, status, policy), not {action}")
    if action == SUBMIT:
        if role == "submitter" and queue not in identity.queues:
            return _deny(identity, f"may not submit to queue {queue!r} (its queues: {', '.join(identity.queues)})")
        cap, where = policy.cap(identity)
        if cap is None:
            return _deny(identity, f"the policy gives role {role!r} no max_priority")
        if priority > cap:
            return _deny(identity, f"priority {priority} is above the {role} maximum {cap} (policy {where})")
        return ALLOW
    # CANCEL
    if role == "admin":
        return ALLOW
    if gang_owner != owner_of(identity):
        whose = f"owned by {gang_owner}" if gang_owner else "submitted without an owner (before TLS)"
        return _deny(identity, f"may not cancel gang {gang_id or '?'}: it is {whose}; only its owner or an admin may")
    return ALLOW


def _priority_error(where: str, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{where}: must be an integer, got {value!r}"
    if not -MAX_PRIORITY <= value <= MAX_PRIORITY:
        return f"{where}: must be between {-MAX_PRIORITY} and {MAX_PRIORITY} (the spec's priority range), got {value}"
    return None


def parse_policy(data: Any) -> Policy:
    """A Policy from parsed YAML or JSON; PolicyError naming every bad
    field. ``None`` (an empty file) is the default policy; a field left out
    keeps its default."""
    if data is None:
        return Policy()
    if not isinstance(data, Mapping):
        raise PolicyError(f"the policy must be a mapping with the keys {', '.join(POLICY_FIELDS)}, got {type(data).__name__}")
    errors = []
    for k in data:
        if k not in POLICY_FIELDS:
            errors.append(f"{k}: unknown field (known: {', '.join(POLICY_FIELDS)})")
    caps = dict(DEFAULT_MAX_PRIORITY)
    mp = data.get("max_priority")
    if mp is not None and not isinstance(mp, Mapping):
        errors.append(f"max_priority: must be a mapping of role to integer, got {type(mp).__name__}")
    elif mp is not None:
        for role, value in mp.items():
            where = f"max_priority.{role}"
            if role not in SUBMITTING_ROLES:
                why = "may not submit, so it has no max priority" if role in ROLES else "is not a role"
                errors.append(f"{where}: {role!r} {why} (roles that submit: {', '.join(SUBMITTING_ROLES)})")
            elif (why := _priority_error(where, value)) is not None:
                errors.append(why)
            else:
                caps[role] = value
    names: dict[str, int] = {}
    subs = data.get("submitters")
    if subs is not None and not isinstance(subs, Mapping):
        errors.append(f"submitters: must be a mapping of submitter name to {{max_priority: N}}, got {type(subs).__name__}")
    elif subs is not None:
        if len(subs) > MAX_SUBMITTER_OVERRIDES:
            errors.append(f"submitters: at most {MAX_SUBMITTER_OVERRIDES} names, got {len(subs)}")
        for name, entry in subs.items():
            where = f"submitters.{name}"
            why = name_error(name, NODE_NAME, MAX_NAME_LEN, NODE_NAME_WHAT) if isinstance(name, str) else "must be a string"
            if why:
                errors.append(f"{where}: the name {why}"[:300])
                continue
            if not isinstance(entry, Mapping) or set(entry) != {"max_priority"}:
                errors.append(f"{where}: must be a mapping with the one key max_priority, got {entry!r}"[:300])
                continue
            why = _priority_error(f"{where}.max_priority", entry["max_priority"])
            if why:
                errors.append(why)
            else:
                names[name] = entry["max_priority"]
    visibility = data.get("visibility", "all")
    if visibility not in VISIBILITIES:
        errors.append(f"visibility: must be one of {', '.join(VISIBILITIES)}, got {visibility!r}"[:300])
    if errors:
        raise PolicyError("; ".join(errors))
    return Policy(max_priority=caps, submitters=names, visibility=visibility)


def policy_from_yaml(text: str, where: str) -> Policy:
    """The policy in YAML ``text`` (``--policy FILE``, read by the driver);
    PolicyError naming ``where`` and the place or field. The same strict
    rules as the JSON path (phalanx.strict_docs)."""
    try:
        data = strict_docs.load_yaml(text)
    except strict_docs.DocumentError as exc:
        raise PolicyError(f"{where}: {exc}") from None
    try:
        return parse_policy(data)
    except PolicyError as exc:
        raise PolicyError(f"{where}: {exc}") from None


# A policy sent to SetPolicy or read from etcd is one JSON object; this
# bounds what a coordinator parses and stores.
MAX_POLICY_JSON_BYTES = 256 * 1024


def parse_policy_json(text: str, where: str = "policy_json") -> Policy:
    """A Policy from JSON text (SetPolicy's request, the etcd record's
    ``policy``); PolicyError naming ``where`` and the field."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_POLICY_JSON_BYTES:
        raise PolicyError(f"{where}: {size} bytes, above the limit of {MAX_POLICY_JSON_BYTES}")
    if not text.strip():
        raise PolicyError(f"{where}: is required (a JSON object; {{}} is the default policy)")
    try:
        data = strict_docs.load_json(text)
    except strict_docs.DocumentError as exc:
        raise PolicyError(f"{where}: {exc}") from None
    if data is None:
        raise PolicyError(f"{where}: must be a JSON object, got null")
    try:
        return parse_policy(data)
    except PolicyError as exc:
        raise PolicyError(f"{where}: {exc}") from None
