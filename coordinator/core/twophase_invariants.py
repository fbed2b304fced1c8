"""Invariants of two-phase reservations, as code (docs/style.md §12).

One ``check(world)`` for unit tests at teardown, the hypothesis model test
after every step, and the chaos checker on snapshots rebuilt from recorded
histories. It looks at the durable state (what etcd holds) and, where given,
at the in-memory state of live leaders, and returns every violation it finds
rather than stopping at the first, so a failing history explains itself.

All the properties are *state* properties checked after every step; together
with "checked after every step" they give the temporal ones (e.g. a COMMIT
key can only have been created while every participant's PREPARED record
existed, because the step that created it is followed by a check that finds
them, and nothing removes them until the gang finishes).

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Mapping, Sequence

from coordinator.core.twophase_model import (
    DecisionKey,
    Device,
    Outcome,
    Plan,
    describe_devices,
    normalize_slice,
    slice_devices,
)
from coordinator.core.twophase_owner import OwnerState
from coordinator.core.twophase_participant import ParticipantState
from phalanx.reservation import HoldState, Reservation

SINGLE_DECISION = "single-decision"
"""At most one decision is ever created per (gang, incarnation)."""
AGREEMENT = "agreement"
"""Nobody acts on an outcome that differs from (or precedes) the durable key.
(A COMMITTED record with no key at all is a single-AZ reservation.)"""
COMMIT_NEEDS_PREPARED = "commit-needs-prepared"
"""A COMMIT exists only while every participant AZ of that attempt holds a
durable record for exactly that incarnation and slice."""
COMMITTED_KEPT = "committed-kept"
"""A committed hold is released only by its gang finishing."""
EXCLUSIVE_DEVICES = "exclusive-devices"
"""No device is held by two gangs in one AZ (in memory, and among live
durable records)."""
LEDGER_DURABLE = "ledger-durable"
"""What a leader believes is written is written."""
STATE_VALID = "state-valid"
"""Internal consistency of each live state machine."""
RESOLVED = "resolved"
"""At quiescence every hold is resolved: nothing PREPARED, nothing stranded."""


@dataclass(frozen=True)
class Violation:
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.invariant}] {self.detail}"


class InvariantViolated(AssertionError):
    """Raised by ``assert_invariants``; the message lists every violation."""

    def __init__(self, violations: Sequence[Violation]):
        self.violations = list(violations)
        super().__init__("\n".join(str(v) for v in self.violations))


@dataclass(frozen=True, kw_only=True)
class WorldSnapshot:
    """Everything the invariants look at, at one instant.

    Durable part (from etcd): ``decisions`` (decisions/<gang>/<inc>),
    ``reservations`` ((az, gang) -> reservations/<az>/<gang>), ``plans``
    (the plan of every attempt ever recorded by WriteAttempt; a history, since
    gangs/<gang> only keeps the latest), ``finished`` (attempts whose gang is
    over). ``decision_writes``: every *successful* create of a decision key,
    in order (from the store's history), to check single-decision.

    Live part (optional): the in-memory state of the leaders that are up.
    """

    decisions: Mapping[DecisionKey, Outcome]
    reservations: Mapping[tuple[str, str], Reservation]
    plans: Mapping[DecisionKey, Plan]
    finished: AbstractSet[DecisionKey] = frozenset()
    decision_writes: Sequence[tuple[DecisionKey, Outcome]] = ()
    participants: Mapping[str, ParticipantState] = field(default_factory=dict)
    owners: Mapping[str, OwnerState] = field(default_factory=dict)


def check(world: WorldSnapshot, *, quiescent: bool = False) -> list[Violation]:
    """Every violated invariant of ``world``; empty when all hold.

    ``quiescent``: also require liveness, i.e. that all in-flight work is
    done: no PREPARED record left, nothing stranded, every owner settled.
    Only meaningful once faults have healed, every message has been
    delivered and time has run past every timeout.
    """
    out: list[Violation] = []
    _single_decision(world, out)
    _agreement(world, out)
    _commit_needs_prepared(world, out)
    _committed_kept(world, out)
    _exclusive_devices(world, out)
    _ledger_durable(world, out)
    for az, participant in sorted(world.participants.items()):
        out += [Violation(STATE_VALID, p) for p in participant.validate()]
    for gang, owner in sorted(world.owners.items()):
        out += [Violation(STATE_VALID, p) for p in owner.validate()]
    if quiescent:
        _resolved(world, out)
    return out


def assert_invariants(world: WorldSnapshot, *, quiescent: bool = False) -> None:
    """``check`` that raises ``InvariantViolated`` (for tests)."""
    violations = check(world, quiescent=quiescent)
    if violations:
        raise InvariantViolated(violations)


# ----------------------------------------------------------------- checks


def _single_decision(world: WorldSnapshot, out: list[Violation]) -> None:
    seen: dict[DecisionKey, Outcome] = {}
    for key, outcome in world.decision_writes:
        if key in seen:
            out.append(Violation(SINGLE_DECISION,
                                 f"{key} created twice: {seen[key].value} then {outcome.value}"))
        seen.setdefault(key, outcome)
    for key, outcome in seen.items():
        stored = world.decisions.get(key)
        if stored is not outcome:
            out.append(Violation(SINGLE_DECISION,
                                 f"{key} created as {outcome.value} but stored as {stored}"))


def _agreement(world: WorldSnapshot, out: list[Violation]) -> None:
    def compare(who: str, key: DecisionKey, believed: Outcome) -> None:
        stored = world.decisions.get(key)
        if stored is None:
            out.append(Violation(AGREEMENT, f"{who} acts on {believed.value} for {key}, not durable"))
        elif stored is not believed:
            out.append(Violation(AGREEMENT, f"{who} believes {believed.value} for {key}, "
                                            f"durable is {stored.value}"))

    for az, participant in sorted(world.participants.items()):
        for key, outcome in sorted(participant.known_decisions.items()):
            compare(f"participant {az}", key, outcome)
        for hold in participant.holds.values():
            if hold.state is HoldState.COMMITTED and not hold.local:
                compare(f"participant {az} (hold)", hold.key, Outcome.COMMIT)
    for gang, owner in sorted(world.owners.items()):
        for inc, outcome in sorted(owner.known_decisions().items()):
            compare(f"owner of {gang}", (gang, inc), outcome)
    for (az, gang), rec in sorted(world.reservations.items()):
        # Without a decision key, a COMMITTED record is a single-AZ
        # reservation (no vote to agree on); next to a key, it must be COMMIT.
        stored = world.decisions.get((gang, rec.incarnation))
        if rec.state is HoldState.COMMITTED and stored is not None and stored is not Outcome.COMMIT:
            out.append(Violation(AGREEMENT, f"record {az}/{gang} is COMMITTED but {(gang, rec.incarnation)} "
                                            f"is {stored.value}"))


def _live_commits(world: WorldSnapshot) -> list[DecisionKey]:
    """COMMITted attempts whose gang has not finished: their holds must stay."""
    return sorted(k for k, o in world.decisions.items()
                  if o is Outcome.COMMIT and k not in world.finished)


def _commit_needs_prepared(world: WorldSnapshot, out: list[Violation]) -> None:
    for key in _live_commits(world):
        gang, inc = key
        plan = world.plans.get(key)
        if not plan:
            out.append(Violation(COMMIT_NEEDS_PREPARED, f"COMMIT {key} without a recorded plan"))
            continue
        for az in sorted(plan):
            rec = world.reservations.get((az, gang))
            if rec is None:
                out.append(Violation(COMMIT_NEEDS_PREPARED, f"COMMIT {key}: no record in {az}"))
            elif rec.incarnation != inc:
                out.append(Violation(COMMIT_NEEDS_PREPARED,
                                     f"COMMIT {key}: record in {az} is for incarnation {rec.incarnation}"))
            elif dict(rec.nodes) != normalize_slice(plan[az]):
                out.append(Violation(COMMIT_NEEDS_PREPARED,
                                     f"COMMIT {key}: record in {az} holds another slice"))


def _committed_kept(world: WorldSnapshot, out: list[Violation]) -> None:
    for (az, gang), rec in sorted(world.reservations.items()):
        key = (gang, rec.incarnation)
        participant = world.participants.get(az)
        if rec.state is not HoldState.COMMITTED or key in world.finished or participant is None:
            continue
        hold = participant.holds.get(gang)
        if hold is None or hold.incarnation != rec.incarnation:
            out.append(Violation(COMMITTED_KEPT, f"{az}/{gang}: COMMITTED record of {key} not in the ledger"))
    for key in _live_commits(world):
        gang, inc = key
        for az in sorted(world.plans.get(key, {})):
            participant = world.participants.get(az)
            if participant is None:
                continue  # leader down; the durable check above still applies
            hold = participant.holds.get(gang)
            if hold is None or hold.incarnation != inc:
                held = "nothing" if hold is None else f"incarnation {hold.incarnation}"
                out.append(Violation(COMMITTED_KEPT,
                                     f"COMMIT {key} not finished but {az} holds {held}"))


def _exclusive_devices(world: WorldSnapshot, out: list[Violation]) -> None:
    for az, participant in sorted(world.participants.items()):
        owner_of: dict[Device, str] = {}
        for gang, hold in sorted(participant.holds.items()):
            for device in hold.devices:
                other = owner_of.setdefault(device, gang)
                if other != gang:
                    out.append(Violation(EXCLUSIVE_DEVICES,
                                         f"{az}: {describe_devices([device])} held by {other} and {gang}"))
    # Durable: a record whose decision is ABORT or whose gang finished is
    # garbage awaiting deletion, not a hold; all the others must be disjoint.
    by_az: dict[str, dict[Device, str]] = {}
    for (az, gang), rec in sorted(world.reservations.items()):
        key = (gang, rec.incarnation)
        if world.decisions.get(key) is Outcome.ABORT or key in world.finished:
            continue
        owner_of = by_az.setdefault(az, {})
        for device in slice_devices(rec.nodes):
            other = owner_of.setdefault(device, gang)
            if other != gang:
                out.append(Violation(EXCLUSIVE_DEVICES,
                                     f"{az}: durable records of {other} and {gang} "
                                     f"both hold {describe_devices([device])}"))


def _ledger_durable(world: WorldSnapshot, out: list[Violation]) -> None:
    for az, participant in sorted(world.participants.items()):
        for gang, hold in sorted(participant.holds.items()):
            if not hold.written:
                continue
            rec = world.reservations.get((az, gang))
            if rec is None or rec.incarnation != hold.incarnation:
                out.append(Violation(LEDGER_DURABLE,
                                     f"{az} holds {hold.key} as written but etcd has "
                                     f"{'nothing' if rec is None else rec.incarnation}"))
            elif dict(rec.nodes) != dict(hold.nodes):
                out.append(Violation(LEDGER_DURABLE, f"{az}: {hold.key} slice differs from etcd"))
            elif hold.commit_written and rec.state is not HoldState.COMMITTED:
                out.append(Violation(LEDGER_DURABLE, f"{az}: {hold.key} commit written but etcd says "
                                                     f"{rec.state.value}"))


def _resolved(world: WorldSnapshot, out: list[Violation]) -> None:
    for (az, gang), rec in sorted(world.reservations.items()):
        key = (gang, rec.incarnation)
        decision = world.decisions.get(key)
        if key in world.finished:
            out.append(Violation(RESOLVED, f"{az}/{gang}: record of finished {key} not released"))
        elif decision is Outcome.ABORT:
            out.append(Violation(RESOLVED, f"{az}/{gang}: record of ABORTed {key} not released"))
        elif decision is None and rec.state is HoldState.PREPARED:
            out.append(Violation(RESOLVED, f"{az}/{gang}: {key} still PREPARED with no decision"))
        elif decision is Outcome.COMMIT and rec.state is not HoldState.COMMITTED:
            out.append(Violation(RESOLVED, f"{az}/{gang}: {key} COMMIT but record still PREPARED"))
    for az, participant in sorted(world.participants.items()):
        for gang, hold in sorted(participant.holds.items()):
            if hold.state is not HoldState.COMMITTED or not hold.commit_written:
                out.append(Violation(RESOLVED, f"{az}: hold {hold.key} unresolved "
                                               f"({hold.state.value}, written={hold.written})"))
        for gang in sorted(participant.parked):
            out.append(Violation(RESOLVED, f"{az}: prepare of {gang} still parked"))
        for key in sorted(participant.pending_releases):
            out.append(Violation(RESOLVED, f"{az}: release of {key} still pending"))
    for gang, owner in sorted(world.owners.items()):
        if not owner.phase.settled:
            out.append(Violation(RESOLVED, f"owner of {gang} still {owner.phase.value} "
                                           f"at incarnation {owner.incarnation}"))
