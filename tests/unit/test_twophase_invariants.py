"""The invariant checker, the conflict order, the config and the purity rule.

The checker must be right before anything it approves can be trusted: each
row builds a small world that breaks exactly one invariant (or none) and
expects exactly that invariant to be reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from coordinator.core.twophase import (
    CommitReceived,
    DecisionKey,
    DecisionRecord,
    HoldState,
    HoldWritten,
    InvariantViolated,
    Outcome,
    OwnerPhase,
    OwnerState,
    ParticipantRecovered,
    ParticipantState,
    Plan,
    PrepareReceived,
    Reservation,
    TwoPhaseConfig,
    WorldSnapshot,
    assert_invariants,
    check,
    gang_order_key,
    is_older,
)
from coordinator.core.twophase_invariants import (
    AGREEMENT,
    COMMIT_NEEDS_PREPARED,
    COMMITTED_KEPT,
    EXCLUSIVE_DEVICES,
    LEDGER_DURABLE,
    RESOLVED,
    SINGLE_DECISION,
)

SLICE = {"n1": ((0, 1), ())}
OTHER = {"n1": ((2,), ())}


def rec(az: str, gang: str, inc: int = 1, state: HoldState = HoldState.COMMITTED,
        nodes: Any = SLICE) -> Reservation:
    return Reservation(az=az, gang=gang, incarnation=inc, state=state, nodes=nodes, two_phase=True,
                       owner_az="a", priority=0, submitted_at=1.0)


def participant_from(az: str, records: list[Reservation],
                     decisions: dict[DecisionKey, Outcome]) -> ParticipantState:
    p = ParticipantState(az, TwoPhaseConfig())
    p.handle(ParticipantRecovered(
        stimulus_id="r", reservations=records,
        decisions=[DecisionRecord(gang=g, incarnation=n, outcome=o) for (g, n), o in decisions.items()],
    ), 0.0)
    return p


@dataclass
class World:
    """Builder: a committed gang g1 over AZs a and b, everything consistent."""

    decisions: dict[DecisionKey, Outcome] = field(default_factory=lambda: {("g1", 1): Outcome.COMMIT})
    writes: list[tuple[DecisionKey, Outcome]] = field(
        default_factory=lambda: [(("g1", 1), Outcome.COMMIT)])
    reservations: dict[tuple[str, str], Reservation] = field(default_factory=lambda: {
        ("a", "g1"): rec("a", "g1"), ("b", "g1"): rec("b", "g1")})
    plans: dict[DecisionKey, Plan] = field(default_factory=lambda: {("g1", 1): {"a": SLICE, "b": SLICE}})
    finished: set[DecisionKey] = field(default_factory=set)
    live: tuple[str, ...] = ("a", "b")
    owners: dict[str, OwnerState] = field(default_factory=dict)
    participants: dict[str, ParticipantState] | None = None

    def snapshot(self) -> WorldSnapshot:
        participants = self.participants
        if participants is None:
            participants = {
                az: participant_from(az, [r for (raz, _), r in self.reservations.items() if raz == az],
                                     self.decisions)
                for az in self.live
            }
        return WorldSnapshot(decisions=self.decisions, reservations=self.reservations,
                             plans=self.plans, finished=frozenset(self.finished),
                             decision_writes=self.writes, participants=participants,
                             owners=self.owners)


def broken(**changes: Any) -> World:
    world = World()
    for name, value in changes.items():
        setattr(world, name, value)
    return world


def invariants_of(world: World, quiescent: bool = False) -> set[str]:
    return {v.invariant for v in check(world.snapshot(), quiescent=quiescent)}


def participant_with_extra_hold() -> dict[str, ParticipantState]:
    """Participant a believes g2 holds n1/gpu1 (written) while etcd has no
    record of it, and also holds g1 as recovered."""
    p = participant_from("a", [rec("a", "g1")], {("g1", 1): Outcome.COMMIT})
    p.handle(PrepareReceived(stimulus_id="p", gang="g2", incarnation=1, owner_az="a", priority=0,
                             submitted_at=5.0, nodes=OTHER), 0.0)
    p.handle(HoldWritten(stimulus_id="w", gang="g2", incarnation=1), 0.0)
    return {"a": p, "b": participant_from("b", [rec("b", "g1")], {("g1", 1): Outcome.COMMIT})}


def owner_in(phase: OwnerPhase) -> OwnerState:
    owner = OwnerState("g5", "a", 0, 1.0)
    owner.phase, owner.plan = phase, {"a": OTHER}
    return owner


ROWS: list[tuple[str, World, set[str]]] = [
    ("a consistent committed gang violates nothing", World(), set()),
    ("a decision key created twice is reported",
     broken(writes=[(("g1", 1), Outcome.COMMIT), (("g1", 1), Outcome.ABORT)]), {SINGLE_DECISION}),
    ("COMMIT without the PREPARED record of one participant is reported",
     broken(reservations={("a", "g1"): rec("a", "g1")}, live=("a",)), {COMMIT_NEEDS_PREPARED}),
    ("COMMIT whose record in one AZ is another incarnation is reported",
     broken(reservations={("a", "g1"): rec("a", "g1"), ("b", "g1"): rec("b", "g1", inc=2, state=HoldState.PREPARED)},
            live=()),
     {COMMIT_NEEDS_PREPARED}),
    ("COMMIT whose record holds another slice is reported",
     broken(reservations={("a", "g1"): rec("a", "g1"), ("b", "g1"): rec("b", "g1", nodes=OTHER)},
            live=()), {COMMIT_NEEDS_PREPARED}),
    ("COMMIT without a recorded plan is reported", broken(plans={}), {COMMIT_NEEDS_PREPARED}),
    ("a live leader that dropped a committed hold is reported",
     broken(participants={"a": ParticipantState("a"), "b": participant_from(
         "b", [rec("b", "g1")], {("g1", 1): Outcome.COMMIT})}), {COMMITTED_KEPT}),
    ("a finished gang's holds may go",
     broken(reservations={}, finished={("g1", 1)}), set()),
    ("COMMITTED record next to an ABORT key is reported",
     broken(decisions={("g1", 1): Outcome.ABORT}, writes=[(("g1", 1), Outcome.ABORT)], live=()),
     {AGREEMENT}),
    ("COMMITTED record without any key is a single-AZ reservation",
     broken(decisions={}, writes=[], plans={}), set()),
    ("a live leader that lost a single-AZ reservation is reported",
     broken(decisions={}, writes=[], plans={},
            participants={"a": ParticipantState("a"), "b": participant_from("b", [rec("b", "g1")], {})}),
     {COMMITTED_KEPT}),
    ("a leader acting on a decision that is not durable is reported",
     broken(decisions={}, writes=[], reservations={}, live=(), plans={},
            participants={"a": participant_from("a", [], {("g9", 1): Outcome.ABORT})}), {AGREEMENT}),
    ("two live durable records on one device are reported",
     broken(decisions={("g1", 1): Outcome.COMMIT, ("g2", 1): Outcome.COMMIT},
            reservations={("a", "g1"): rec("a", "g1"), ("b", "g1"): rec("b", "g1"),
                          ("a", "g2"): rec("a", "g2")},
            plans={("g1", 1): {"a": SLICE, "b": SLICE}, ("g2", 1): {"a": SLICE}},
            writes=[], live=()), {EXCLUSIVE_DEVICES}),
    ("an ABORTed record left on a device is garbage, not a double booking",
     broken(decisions={("g1", 1): Outcome.COMMIT, ("g2", 1): Outcome.ABORT},
            reservations={("a", "g1"): rec("a", "g1"), ("b", "g1"): rec("b", "g1"),
                          ("a", "g2"): rec("a", "g2", state=HoldState.PREPARED)},
            writes=[], live=()), set()),
    ("a hold the leader thinks is written but etcd lacks is reported",
     broken(participants=participant_with_extra_hold()), {LEDGER_DURABLE}),
]


@pytest.mark.parametrize("world,expected", [(w, e) for _, w, e in ROWS], ids=[i for i, _, _ in ROWS])
def test_invariant(world: World, expected: set[str]) -> None:
    assert invariants_of(world) == expected


QUIESCENT_ROWS: list[tuple[str, World, set[str]]] = [
    ("settled committed gang is quiescent", World(), set()),
    ("an undecided PREPARED record is unresolved",
     broken(decisions={("g1", 1): Outcome.COMMIT, ("g2", 1): Outcome.ABORT},
            reservations={("a", "g1"): rec("a", "g1"), ("b", "g1"): rec("b", "g1"),
                          ("c", "g3"): rec("c", "g3", state=HoldState.PREPARED)}, live=()),
     {RESOLVED}),
    ("an ABORTed record not yet deleted is unresolved",
     broken(decisions={("g1", 1): Outcome.COMMIT, ("g2", 1): Outcome.ABORT},
            reservations={("a", "g1"): rec("a", "g1"), ("b", "g1"): rec("b", "g1"),
                          ("c", "g2"): rec("c", "g2", state=HoldState.PREPARED)}, live=()),
     {RESOLVED}),
    ("a finished gang's record not yet deleted is unresolved",
     broken(finished={("g1", 1)}, live=()), {RESOLVED}),
    ("a COMMIT whose record is still PREPARED is unresolved",
     broken(reservations={("a", "g1"): rec("a", "g1", state=HoldState.PREPARED),
                          ("b", "g1"): rec("b", "g1")}, live=()), {RESOLVED}),
    ("an owner still collecting votes is unresolved",
     broken(owners={"g5": owner_in(OwnerPhase.PREPARING)}), {RESOLVED}),
    ("an owner waiting for room is settled",
     broken(owners={"g5": owner_in(OwnerPhase.UNPLACED)}), set()),
]


@pytest.mark.parametrize("world,expected", [(w, e) for _, w, e in QUIESCENT_ROWS],
                         ids=[i for i, _, _ in QUIESCENT_ROWS])
def test_quiescent_invariant(world: World, expected: set[str]) -> None:
    assert invariants_of(world, quiescent=True) == expected


def test_assert_invariants_lists_every_violation() -> None:
    world = broken(writes=[(("g1", 1), Outcome.COMMIT), (("g1", 1), Outcome.COMMIT)], plans={})
    with pytest.raises(InvariantViolated) as info:
        assert_invariants(world.snapshot())
    assert {v.invariant for v in info.value.violations} == {SINGLE_DECISION, COMMIT_NEEDS_PREPARED}
    assert "[single-decision]" in str(info.value)


def test_participant_state_is_checked_too() -> None:
    p = participant_from("a", [rec("a", "g1")], {("g1", 1): Outcome.COMMIT})
    p.handle(CommitReceived(stimulus_id="c", gang="g1", incarnation=1, from_az="a"), 0.0)
    assert p.validate() == []


# ------------------------------------------------------------------ ordering

ORDER_ROWS = [
    ("higher priority goes first whatever the submit time", (5, 99.0, "z"), (0, 1.0, "a")),
    ("same priority: earlier submission goes first", (0, 1.0, "z"), (0, 2.0, "a")),
    ("same priority and time: gang id breaks the tie", (0, 1.0, "a"), (0, 1.0, "b")),
    ("negative priority goes after zero", (0, 50.0, "z"), (-1, 1.0, "a")),
]


@pytest.mark.parametrize("older,younger", [(o, y) for _, o, y in ORDER_ROWS], ids=[i for i, _, _ in ORDER_ROWS])
def test_gang_order(older: tuple[int, float, str], younger: tuple[int, float, str]) -> None:
    a, b = gang_order_key(*older), gang_order_key(*younger)
    assert is_older(a, b) and not is_older(b, a)


def test_gang_order_is_total_and_irreflexive() -> None:
    keys = [gang_order_key(p, t, g) for p in (0, 1) for t in (1.0, 2.0) for g in ("a", "b")]
    for a in keys:
        assert not is_older(a, a)
        for b in keys:
            assert a == b or is_older(a, b) != is_older(b, a)


# ------------------------------------------------------------------ config


@pytest.mark.parametrize("kwargs,message", [
    ({"vote_timeout_s": 0}, "vote_timeout_s must be > 0"),
    ({"vote_timeout_s": 10, "prepare_timeout_s": 10}, "prepare_timeout_s must be > vote_timeout_s"),
    ({"retry_backoff_s": 5, "retry_backoff_max_s": 1}, "retry_backoff_max_s must be >= retry_backoff_s"),
    ({"max_attempts": 0}, "max_attempts must be >= 1"),
], ids=["timeouts must be positive", "participants wait longer than owners",
        "backoff cap is above the first backoff", "at least one attempt"])
def test_config_is_validated_together(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TwoPhaseConfig(**kwargs)


# The purity rule for every core module: tests/unit/test_core_purity.py.
