"""Who may do what on GangService (docs/security.md "Roles on GangService").

Pure: the caller's ``Identity`` (from its client certificate), the action,
and what the action touches (the queue and priority of a submission, the
owner of a gang to cancel) go in; a ``Decision`` comes out. Only a
coordinator that serves TLS asks; without TLS nothing is checked.

The policy is data: a maximum priority per role that may submit, read from
an optional YAML file (``--policy FILE``) and validated at start-up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from phalanx.certs import MAX_NAME_LEN, ROLES, Identity
from phalanx.spec import MAX_PRIORITY

SUBMIT = "submit"
CANCEL = "cancel"
# Reads: every role that may call GangService at all may do these.
READS = ("get", "list", "watch", "explain", "nodes", "status")
ACTIONS = (SUBMIT, CANCEL) + READS

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
        # it has already authorized for its own caller.
        if forwarded:
            return ALLOW
        return _deny(identity, "a coordinator identity may not call GangService (only forward a call to its leader)")
    if role == "agent":
        return _deny(identity, "an agent identity may not call GangService")
    if role not in ("admin", "submitter", "viewer"):
        return _deny(identity, f"role {role!r} may not call GangService")
    if action in READS:
        # Every reading role sees every gang: see docs/security.md ("see").
        return ALLOW
    if role == "viewer":
        return _deny(identity, f"a viewer may only read (get, list, watch, explain, nodes, status), not {action}")
    if action == SUBMIT:
        if role == "submitter" and queue not in identity.queues:
            return _deny(identity, f"may not submit to queue {queue!r} (its queues: {', '.join(identity.queues)})")
        cap = policy.max_priority.get(role)
        if cap is None:
            return _deny(identity, f"the policy gives role {role!r} no max_priority")
        if priority > cap:
            return _deny(identity, f"priority {priority} is above the {role} maximum {cap} (policy max_priority.{role})")
        return ALLOW
    # CANCEL
    if role == "admin":
        return ALLOW
    if gang_owner != owner_of(identity):
        whose = f"owned by {gang_owner}" if gang_owner else "submitted without an owner (before TLS)"
        return _deny(identity, f"may not cancel gang {gang_id or '?'}: it is {whose}; only its owner or an admin may")
    return ALLOW


def parse_policy(data: Any) -> Policy:
    """A Policy from parsed YAML; PolicyError naming every bad field.
    ``None`` (an empty file) is the default policy."""
    if data is None:
        return Policy()
    if not isinstance(data, Mapping):
        raise PolicyError(f"the policy must be a mapping with the key max_priority, got {type(data).__name__}")
    errors = []
    for k in data:
        if k != "max_priority":
            errors.append(f"{k}: unknown field (known: max_priority)")
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
            elif isinstance(value, bool) or not isinstance(value, int):
                errors.append(f"{where}: must be an integer, got {value!r}")
            elif not -MAX_PRIORITY <= value <= MAX_PRIORITY:
                errors.append(f"{where}: must be between {-MAX_PRIORITY} and {MAX_PRIORITY} (the spec's priority range), got {value}")
            else:
                caps[role] = value
    if errors:
        raise PolicyError("; ".join(errors))
    return Policy(max_priority=caps)


def load_policy(path: Path | str) -> Policy:
    """The policy in the YAML file at ``path`` (the thin driver)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyError(f"{path}: not YAML: {' '.join(str(exc).split())}") from None
    try:
        return parse_policy(data)
    except PolicyError as exc:
        raise PolicyError(f"{path}: {exc}") from None
