"""Plain data shared by both roles of the two-phase reservation protocol.

Plans, device slices, outcomes, the decision record a leader reads back after
a restart, and the timing knobs (the reservation record is
``phalanx.reservation.Reservation``). Pure: no I/O. See ``docs/two-phase.md``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, TypeAlias

# The reservation record and its states are the one model shared with the
# agent (phalanx/reservation.py); a slice's devices per node are its
# NodeDevices, a (GPU indices, NIC names) tuple.
from phalanx.reservation import NodeDevices

from coordinator.core.records import BadRecord, expect_field, expect_object, expect_str

NodeSlice: TypeAlias = Mapping[str, NodeDevices]
"""One AZ's part of a plan: node -> devices."""

Plan: TypeAlias = Mapping[str, NodeSlice]
"""A whole placement: AZ -> node -> devices (the owner's proposal)."""

DecisionKey: TypeAlias = tuple[str, int]
"""(gang, incarnation): the identity of one attempt and of its decision key
``decisions/<gang>/<incarnation>``."""

Device: TypeAlias = tuple[str, str, int | str]
"""(node, "gpu" | "nic", index or name): one schedulable device in an AZ."""


class Outcome(str, enum.Enum):
    """The content of ``decisions/<gang>/<incarnation>`` (write-once)."""

    COMMIT = "COMMIT"
    ABORT = "ABORT"


def normalize_slice(nodes: NodeSlice) -> dict[str, NodeDevices]:
    """Canonical form of a slice: nodes and devices sorted, duplicates and
    empty nodes dropped.

    Two prepares for one (gang, incarnation) are the same request only if
    their slices are equal; comparing canonical forms keeps "(1, 0)" and
    "(0, 1)" from looking like a conflicting duplicate.
    """
    out: dict[str, NodeDevices] = {}
    for node in sorted(nodes):
        gpus, nics = nodes[node]
        devices = NodeDevices(tuple(sorted(set(gpus))), tuple(sorted(set(nics))))
        if devices[0] or devices[1]:
            out[node] = devices
    return out


def normalize_plan(plan: Plan) -> dict[str, dict[str, NodeDevices]]:
    """Canonical form of a plan; AZs whose slice is empty are dropped, since
    an AZ that contributes nothing is not a participant."""
    out: dict[str, dict[str, NodeDevices]] = {}
    for az in sorted(plan):
        nodes = normalize_slice(plan[az])
        if nodes:
            out[az] = nodes
    return out


def slice_devices(nodes: NodeSlice) -> frozenset[Device]:
    """Every device named by a slice, as a flat set for overlap tests."""
    out: set[Device] = set()
    for node, (gpus, nics) in nodes.items():
        out.update((node, "gpu", g) for g in gpus)
        out.update((node, "nic", n) for n in nics)
    return frozenset(out)


def describe_devices(devices: Iterable[Device], limit: int = 4) -> str:
    """Short human text for a set of devices, for NO-vote reasons."""
    items = sorted(devices, key=lambda d: (d[0], d[1], str(d[2])))
    text = ", ".join(f"{node}/{kind}{ident}" for node, kind, ident in items[:limit])
    if len(items) > limit:
        text += f" (+{len(items) - limit} more)"
    return text


@dataclass(frozen=True, kw_only=True)
class DecisionRecord:
    """``decisions/<gang>/<incarnation>``: the write-once outcome of one
    attempt. The gang and incarnation are the key's; the value stored is
    ``{"outcome", "by", "reason"}`` (who decided, and why)."""

    gang: str
    incarnation: int
    outcome: Outcome
    by: str = ""  # the AZ whose owner or participant created the key
    reason: str = ""

    @property
    def key(self) -> DecisionKey:
        return (self.gang, self.incarnation)

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome.value, "by": self.by, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Any, *, gang: str, incarnation: int) -> "DecisionRecord":
        """The one parser (``gang`` and ``incarnation`` from the key).
        Raises BadRecord naming the field."""
        what = "decision record"
        d = expect_object(d, what)
        value = expect_field(d, "outcome", what)
        try:
            outcome = Outcome(value)
        except ValueError:
            raise BadRecord(f"{what}: field 'outcome': {str(value)[:64]!r} is not one of "
                            + ", ".join(o.value for o in Outcome)) from None
        return cls(gang=gang, incarnation=incarnation, outcome=outcome,
                   by=expect_str(d.get("by", ""), "by", what), reason=expect_str(d.get("reason", ""), "reason", what))

    @classmethod
    def key_of(cls, suffix: str) -> DecisionKey:
        """(gang, incarnation) of a decision key, from the part after
        ``decisions/``. Raises BadRecord for a key that is not one."""
        gang, _, inc = suffix.partition("/")
        if not gang or not inc.isdecimal():
            raise BadRecord(f"decision record: key {suffix[:200]!r} is not <gang>/<incarnation>")
        return gang, int(inc)


@dataclass(frozen=True, kw_only=True)
class TwoPhaseConfig:
    """Timing knobs of both roles. Safety never depends on them (the
    create-if-absent decision key does); they only bound how long a hold can
    stay undecided and how hard a refused gang retries.
    """

    vote_timeout_s: float = 5.0
    """Owner: how long to wait for every vote before deciding ABORT."""
    prepare_timeout_s: float = 10.0
    """Participant: how long a PREPARED hold may wait for a decision before
    the participant resolves it itself (in-doubt rule). Longer than
    ``vote_timeout_s`` so that in the common case the owner decides."""
    retry_backoff_s: float = 0.5
    """Owner: first backoff after an ABORT; doubles per attempt."""
    retry_backoff_max_s: float = 8.0
    store_retry_s: float = 1.0
    """Both roles: delay before re-issuing a store write that failed."""
    max_attempts: int | None = None
    """Owner: give up (MarkGangFailed) after this many ABORTed incarnations
    in one leader term; None leaves the bound to the queue's admission
    timeout."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("vote_timeout_s", "prepare_timeout_s", "retry_backoff_s",
                     "retry_backoff_max_s", "store_retry_s"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0")
        if self.prepare_timeout_s <= self.vote_timeout_s:
            # Otherwise participants routinely race their own owner for the
            # decision key: still safe, but every slow vote becomes an ABORT.
            problems.append("prepare_timeout_s must be > vote_timeout_s")
        if self.retry_backoff_max_s < self.retry_backoff_s:
            problems.append("retry_backoff_max_s must be >= retry_backoff_s")
        if self.max_attempts is not None and self.max_attempts < 1:
            problems.append("max_attempts must be >= 1 or None")
        if problems:
            raise ValueError("invalid two-phase config: " + "; ".join(problems))
