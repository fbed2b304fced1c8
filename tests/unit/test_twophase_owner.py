"""Owner of two-phase reservations: one table row per transition.

Each row starts an owner (fresh, or recovered from durable state), feeds
events, and compares the effects of the last event with the expected ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import pytest

from coordinator.core.twophase import (
    AttemptWriteFailed,
    AttemptWritten,
    CreateDecision,
    DecisionCreated,
    DecisionCreateFailed,
    DecisionObserved,
    Effect,
    Event,
    GangFinished,
    GangSubmitted,
    MarkGangFailed,
    MarkGangPending,
    MarkGangReserved,
    Outcome,
    OwnerPhase,
    OwnerRecovered,
    OwnerState,
    PlacementMade,
    RetryDue,
    ScheduleTimeout,
    SendAbort,
    SendCommit,
    SendFinish,
    SendPrepare,
    TwoPhaseConfig,
    VoteReceived,
    VotesTimedOut,
    WriteAttempt,
)

GANG = "g1"
NOW = 100.0
CONFIG = TwoPhaseConfig(vote_timeout_s=5.0, prepare_timeout_s=15.0, retry_backoff_s=0.5,
                        retry_backoff_max_s=8.0, store_retry_s=1.0)
PLAN = {"a": {"n1": ((0, 1), ())}, "b": {"n7": ((2,), ("mlx2",))}}


# ------------------------------------------------------------------ builders


def ev(cls: type[Event], inc: int = 1, **kw: Any) -> Event:
    return cls(stimulus_id=f"{cls.__name__}-{inc}", gang=GANG, incarnation=inc, **kw)  # type: ignore[call-arg]


def vote(az: str, yes: bool = True, inc: int = 1, reason: str = "") -> VoteReceived:
    return VoteReceived(stimulus_id=f"vote-{az}-{inc}", gang=GANG, incarnation=inc, from_az=az,
                        yes=yes, reason=reason)


def created(outcome: Outcome, won: bool = True, inc: int = 1) -> DecisionCreated:
    return DecisionCreated(stimulus_id=f"created-{inc}", gang=GANG, incarnation=inc, won=won,
                           outcome=outcome)


def owner(config: TwoPhaseConfig = CONFIG) -> OwnerState:
    return OwnerState(GANG, "a", priority=3, submitted_at=42.0, config=config)


def recovered(inc: int = 1, plan: Any = PLAN, decision: Outcome | None = None,
              finished: bool = False) -> OwnerRecovered:
    return OwnerRecovered(stimulus_id="recover", gang=GANG, incarnation=inc, plan=plan,
                          decision=decision, finished=finished)


def up_to_prepare(inc: int = 1) -> list[Event]:
    """A fresh gang through placement and the recorded attempt."""
    return [ev(GangSubmitted, inc), ev(PlacementMade, inc, plan=PLAN), ev(AttemptWritten, inc)]


def up_to_abort(reason_az: str = "b") -> list[Event]:
    return [*up_to_prepare(), vote(reason_az, yes=False, reason="busy"), created(Outcome.ABORT)]


@dataclass(frozen=True)
class Is:
    """Effect of type ``cls`` whose listed attributes equal ``attrs``."""

    cls: type[Effect]
    attrs: dict[str, Any] = field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Is):
            return self.cls is other.cls and self.attrs == other.attrs
        return isinstance(other, self.cls) and all(
            getattr(other, k) == v for k, v in self.attrs.items())

    def __repr__(self) -> str:
        return f"{self.cls.__name__}({', '.join(f'{k}={v!r}' for k, v in self.attrs.items())})"


@dataclass(frozen=True)
class Timer:
    event_cls: type[Event]
    at: float
    inc: int = 1

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Timer):
            return (self.event_cls, self.at, self.inc) == (other.event_cls, other.at, other.inc)
        return (isinstance(other, ScheduleTimeout) and other.at == self.at
                and type(other.event) is self.event_cls
                and getattr(other.event, "incarnation", None) == self.inc)


def decide(outcome: Outcome, reason: str = "", inc: int = 1) -> "Decide":
    return Decide(outcome, reason, inc)


@dataclass(frozen=True)
class Decide:
    outcome: Outcome
    reason: str
    inc: int

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Decide):
            return (self.outcome, self.reason, self.inc) == (other.outcome, other.reason, other.inc)
        return (isinstance(other, CreateDecision) and other.outcome is self.outcome
                and other.incarnation == self.inc and self.reason in other.reason)


def prepare_to(az: str, inc: int = 1) -> Is:
    return Is(SendPrepare, {"to_az": az, "incarnation": inc, "priority": 3, "submitted_at": 42.0,
                            "owner_az": "a", "nodes": PLAN[az]})


def commit_to(az: str, inc: int = 1) -> Is:
    return Is(SendCommit, {"to_az": az, "incarnation": inc})


def abort_to(az: str, inc: int = 1) -> Is:
    return Is(SendAbort, {"to_az": az, "incarnation": inc})


# ---------------------------------------------------------------------- table


@dataclass(frozen=True)
class Row:
    id: str
    events: Sequence[Event | tuple[float, Event]]
    expect: list[Any]
    phase: OwnerPhase
    config: TwoPhaseConfig = CONFIG


def at(t: float, event: Event) -> tuple[float, Event]:
    return (t, event)


ROWS = [
    # --- happy path
    Row("submitted gang waits for the admission cycle (no placement request, no timer)",
        [ev(GangSubmitted)], [Is(MarkGangPending, {"incarnation": 1, "reason": "waiting for the admission cycle to place it"})], OwnerPhase.UNPLACED),
    Row("placement is recorded as the attempt before any prepare goes out",
        [ev(GangSubmitted), ev(PlacementMade, plan=PLAN)],
        [Is(WriteAttempt, {"incarnation": 1, "plan": PLAN, "priority": 3, "submitted_at": 42.0})],
        OwnerPhase.PERSISTING),
    Row("recorded attempt sends prepare to every participant AZ and arms the vote timer",
        up_to_prepare(), [prepare_to("a"), prepare_to("b"), Timer(VotesTimedOut, NOW + 5)],
        OwnerPhase.PREPARING),
    Row("one YES of two waits for the other",
        [*up_to_prepare(), vote("a")], [], OwnerPhase.PREPARING),
    Row("every participant YES creates COMMIT",
        [*up_to_prepare(), vote("a"), vote("b")], [decide(Outcome.COMMIT)], OwnerPhase.DECIDING),
    Row("duplicate YES votes do not stand in for a missing AZ",
        [*up_to_prepare(), vote("a"), vote("a")], [], OwnerPhase.PREPARING),
    Row("a vote from an AZ outside the plan is ignored",
        [*up_to_prepare(), vote("a"), vote("z")], [], OwnerPhase.PREPARING),
    Row("a NO from an AZ outside the plan does not abort the attempt",
        [*up_to_prepare(), vote("z", yes=False, reason="busy")], [], OwnerPhase.PREPARING),
    Row("COMMIT created: participants are told and the gang is RESERVED",
        [*up_to_prepare(), vote("a"), vote("b"), created(Outcome.COMMIT)],
        [commit_to("a"), commit_to("b"), Is(MarkGangReserved, {"incarnation": 1, "plan": PLAN})],
        OwnerPhase.RESERVED),
    Row("finished gang tells every participant to release",
        [*up_to_prepare(), vote("a"), vote("b"), created(Outcome.COMMIT), ev(GangFinished)],
        [Is(SendFinish, {"to_az": "a"}), Is(SendFinish, {"to_az": "b"})], OwnerPhase.FINISHED),
    # --- abort paths
    Row("one NO creates ABORT at once, with the participant's reason",
        [*up_to_prepare(), vote("b", yes=False, reason="conflict with older gang g0")],
        [decide(Outcome.ABORT, "b voted NO: conflict with older gang g0")], OwnerPhase.DECIDING),
    Row("vote timeout creates ABORT naming the silent AZs",
        [*up_to_prepare(), vote("a"), at(NOW + 5, ev(VotesTimedOut))],
        [decide(Outcome.ABORT, "no vote from b within 5s")], OwnerPhase.DECIDING),
    Row("vote timer firing early re-arms",
        [*up_to_prepare(), at(NOW + 1, ev(VotesTimedOut))], [Timer(VotesTimedOut, NOW + 5)],
        OwnerPhase.PREPARING),
    Row("ABORT created: participants are told and the retry is scheduled",
        up_to_abort(), [abort_to("a"), abort_to("b"), Timer(RetryDue, NOW + 0.5)], OwnerPhase.BACKOFF),
    Row("COMMIT lost to an in-doubt participant's ABORT is an ABORT",
        [*up_to_prepare(), vote("a"), vote("b"), created(Outcome.ABORT, won=False)],
        [abort_to("a"), abort_to("b"), Timer(RetryDue, NOW + 0.5)], OwnerPhase.BACKOFF),
    Row("ABORT seen on the watch while collecting votes aborts without a create",
        [*up_to_prepare(), DecisionObserved(stimulus_id="w", gang=GANG, incarnation=1,
                                            outcome=Outcome.ABORT)],
        [abort_to("a"), abort_to("b"), Timer(RetryDue, NOW + 0.5)], OwnerPhase.BACKOFF),
    Row("retry uses a new incarnation, placed by the admission cycle",
        [*up_to_abort(), ev(RetryDue)], [Is(MarkGangPending, {"incarnation": 2, "reason": "waiting for the admission cycle to place it"})], OwnerPhase.UNPLACED),
    Row("retry keeps the original priority and submission time",
        [*up_to_abort(), ev(RetryDue), ev(PlacementMade, 2, plan=PLAN), ev(AttemptWritten, 2)],
        [prepare_to("a", 2), prepare_to("b", 2), Timer(VotesTimedOut, NOW + 5, inc=2)],
        OwnerPhase.PREPARING),
    Row("backoff doubles per attempt",
        [*up_to_abort(), ev(RetryDue), ev(PlacementMade, 2, plan=PLAN), ev(AttemptWritten, 2),
         vote("a", yes=False, inc=2), created(Outcome.ABORT, inc=2)],
        [abort_to("a", 2), abort_to("b", 2), Timer(RetryDue, NOW + 1.0, inc=2)], OwnerPhase.BACKOFF),
    Row("max attempts exhausted marks the gang failed with the last reason",
        up_to_abort(), [abort_to("a"), abort_to("b"),
                        Is(MarkGangFailed, {"reason": "gave up after 1 attempts; last: b voted NO: busy"})],
        OwnerPhase.FAILED, TwoPhaseConfig(max_attempts=1)),
    Row("late YES for an ABORTed incarnation re-sends Abort to that AZ",
        [*up_to_abort(), ev(RetryDue), vote("a", inc=1)], [abort_to("a", 1)], OwnerPhase.UNPLACED),
    Row("late YES after COMMIT re-sends Commit to that AZ",
        [*up_to_prepare(), vote("a"), vote("b"), created(Outcome.COMMIT), vote("a")],
        [commit_to("a")], OwnerPhase.RESERVED),
    Row("vote while the decision is being created is ignored",
        [*up_to_prepare(), vote("b", yes=False), vote("a")], [], OwnerPhase.DECIDING),
    Row("late YES of an ABORTed incarnation does not count for the next one",
        [*up_to_abort(), ev(RetryDue), ev(PlacementMade, 2, plan=PLAN), ev(AttemptWritten, 2),
         vote("a", inc=1), vote("b", inc=2)], [], OwnerPhase.PREPARING),
    Row("votes of an incarnation never decided here are ignored",
        [*up_to_prepare(2), vote("a", inc=1)], [], OwnerPhase.PREPARING),
    Row("a late COMMIT of an older incarnation does not reserve the current one",
        [*up_to_prepare(2), DecisionObserved(stimulus_id="w", gang=GANG, incarnation=1, outcome=Outcome.COMMIT)],
        [], OwnerPhase.PREPARING),
    Row("duplicate decision result changes nothing",
        [*up_to_abort(), created(Outcome.ABORT)], [], OwnerPhase.BACKOFF),
    # --- placement and store failures
    Row("a cycle's placement of the waiting incarnation is recorded as its attempt",
        [*up_to_abort(), ev(RetryDue), ev(PlacementMade, 2, plan=PLAN)],
        [Is(WriteAttempt, {"incarnation": 2, "plan": PLAN})], OwnerPhase.PERSISTING),
    Row("a placement while the attempt is being recorded is ignored (one attempt at a time)",
        [ev(GangSubmitted), ev(PlacementMade, plan=PLAN), ev(PlacementMade, plan=PLAN)], [],
        OwnerPhase.PERSISTING),
    Row("a placement during the backoff is ignored (the next incarnation is not open yet)",
        [*up_to_abort(), ev(PlacementMade, 2, plan=PLAN)], [], OwnerPhase.BACKOFF),
    Row("a placement while reserved is ignored",
        [*up_to_prepare(), vote("a"), vote("b"), created(Outcome.COMMIT), ev(PlacementMade, plan=PLAN)], [],
        OwnerPhase.RESERVED),
    Row("empty plan leaves the gang waiting for the next cycle",
        [ev(GangSubmitted), ev(PlacementMade, plan={"a": {}})],
        [Is(MarkGangPending, {"reason": "placement returned an empty plan"})], OwnerPhase.UNPLACED),
    Row("attempt write failure retries the same incarnation after the store delay",
        [ev(GangSubmitted), ev(PlacementMade, plan=PLAN), ev(AttemptWriteFailed, reason="x")],
        [Timer(RetryDue, NOW + 1)], OwnerPhase.PERSISTING),
    Row("retry due re-issues the attempt write",
        [ev(GangSubmitted), ev(PlacementMade, plan=PLAN), ev(AttemptWriteFailed, reason="x"), ev(RetryDue)],
        [Is(WriteAttempt, {"incarnation": 1})], OwnerPhase.PERSISTING),
    Row("decision create failure retries the same outcome",
        [*up_to_prepare(), vote("a"), vote("b"), ev(DecisionCreateFailed, reason="x"), ev(RetryDue)],
        [decide(Outcome.COMMIT)], OwnerPhase.DECIDING),
    Row("stale placement result is ignored",
        [*up_to_abort(), ev(RetryDue), ev(PlacementMade, 1, plan=PLAN)], [], OwnerPhase.UNPLACED),
    Row("duplicate submit while admitting is ignored",
        [*up_to_prepare(), ev(GangSubmitted)], [], OwnerPhase.PREPARING),
    Row("restart after finish admits the next incarnation",
        [*up_to_prepare(), vote("a"), vote("b"), created(Outcome.COMMIT), ev(GangFinished),
         ev(GangSubmitted, 2)],
        [Is(MarkGangPending, {"incarnation": 2, "reason": "waiting for the admission cycle to place it"})], OwnerPhase.UNPLACED),
    # --- recovery (the last event is the recovery itself)
    Row("recovered with COMMIT re-sends commit and marks the gang reserved",
        [recovered(decision=Outcome.COMMIT)],
        [commit_to("a"), commit_to("b"), Is(MarkGangReserved, {"incarnation": 1})], OwnerPhase.RESERVED),
    Row("recovered with ABORT re-sends abort and backs off",
        [recovered(decision=Outcome.ABORT)],
        [abort_to("a"), abort_to("b"), Timer(RetryDue, NOW + 0.5)], OwnerPhase.BACKOFF),
    Row("recovered undecided attempt is ABORTed (create-if-absent), never re-driven",
        [recovered()], [decide(Outcome.ABORT, "owner leader changed")], OwnerPhase.DECIDING),
    Row("recovered undecided attempt that lost to a COMMIT is reserved",
        [recovered(), created(Outcome.COMMIT, won=False)],
        [commit_to("a"), commit_to("b"), Is(MarkGangReserved, {"incarnation": 1})], OwnerPhase.RESERVED),
    Row("recovered without a recorded attempt waits for the admission cycle",
        [recovered(inc=0, plan=None)], [Is(MarkGangPending, {"incarnation": 1, "reason": "waiting for the admission cycle to place it"})], OwnerPhase.UNPLACED),
    Row("recovered restart request keeps its incarnation",
        [recovered(inc=4, plan=None)], [Is(MarkGangPending, {"incarnation": 4, "reason": "waiting for the admission cycle to place it"})], OwnerPhase.UNPLACED),
    Row("recovered finished attempt re-sends finish",
        [recovered(decision=Outcome.COMMIT, finished=True)],
        [Is(SendFinish, {"to_az": "a"}), Is(SendFinish, {"to_az": "b"})], OwnerPhase.FINISHED),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_owner_transition(row: Row) -> None:
    o = owner(row.config)
    effects: list[Effect] = []
    for item in row.events:
        now, event = item if isinstance(item, tuple) else (NOW, item)
        effects = o.handle(event, now)
    assert effects == row.expect
    assert o.phase is row.phase
    assert o.validate() == []


def test_backoff_is_capped() -> None:
    o = owner(TwoPhaseConfig(retry_backoff_s=1.0, retry_backoff_max_s=3.0))
    o.handle(ev(GangSubmitted), NOW)
    delays = []
    for inc in range(1, 6):
        o.handle(ev(PlacementMade, inc, plan=PLAN), NOW)
        o.handle(ev(AttemptWritten, inc), NOW)
        effects = o.handle(vote("a", yes=False, inc=inc), NOW) + o.handle(created(Outcome.ABORT, inc=inc), NOW)
        timer = next(e for e in effects if isinstance(e, ScheduleTimeout))
        delays.append(timer.at - NOW)
        o.handle(ev(RetryDue, inc), NOW)
    assert delays == [1.0, 2.0, 3.0, 3.0, 3.0]


def test_last_reason_explains_an_abort_decided_elsewhere() -> None:
    o = owner()
    for event in [*up_to_prepare(), vote("a"), vote("b"), created(Outcome.ABORT, won=False)]:
        o.handle(event, NOW)
    assert "decision key already held ABORT" in o.last_reason


def test_event_for_another_gang_is_a_driver_bug() -> None:
    with pytest.raises(ValueError, match="event for g2"):
        owner().handle(GangSubmitted(stimulus_id="x", gang="g2", incarnation=1), NOW)


def test_unexpected_event_type_is_a_driver_bug() -> None:
    with pytest.raises(TypeError, match="unexpected event"):
        owner().handle(Event(stimulus_id="x"), NOW)


# ------------------------------------------------------------ validate() itself
#
# The table above asserts validate() == [] after every row; these rows show it
# is not vacuous: a consistent owner reached by real events, then one public
# field set to what no transition produces, must be reported, and only that.


@dataclass(frozen=True)
class Broken:
    id: str
    events: Sequence[Event]
    phase: OwnerPhase  # where the events leave the (still consistent) owner
    tamper: dict[str, Any]
    problems: list[str]


RESERVED_EVENTS = [*up_to_prepare(), vote("a"), vote("b"), created(Outcome.COMMIT)]

BROKEN = [
    Broken("PERSISTING without a plan", [ev(GangSubmitted), ev(PlacementMade, plan=PLAN)],
           OwnerPhase.PERSISTING, {"plan": None}, ["owner g1: PERSISTING without a plan"]),
    Broken("PREPARING with an empty plan", up_to_prepare(), OwnerPhase.PREPARING, {"plan": {}},
           ["owner g1: PREPARING without a plan"]),
    Broken("RESERVED without a plan", RESERVED_EVENTS, OwnerPhase.RESERVED, {"plan": None},
           ["owner g1: RESERVED without a plan"]),
    Broken("RESERVED with no decision", RESERVED_EVENTS, OwnerPhase.RESERVED, {"decision": None},
           ["owner g1: RESERVED without COMMIT"]),
    Broken("RESERVED holding ABORT (which was never recorded either)", RESERVED_EVENTS, OwnerPhase.RESERVED,
           {"decision": Outcome.ABORT}, ["owner g1: RESERVED without COMMIT", "owner g1: decision not recorded"]),
    Broken("BACKOFF with no decision", up_to_abort(), OwnerPhase.BACKOFF, {"decision": None},
           ["owner g1: BACKOFF without ABORT"]),
    Broken("BACKOFF holding COMMIT", up_to_abort(), OwnerPhase.BACKOFF, {"decision": Outcome.COMMIT},
           ["owner g1: BACKOFF without ABORT", "owner g1: decision not recorded"]),
    Broken("decision of another incarnation than the one recorded", RESERVED_EVENTS, OwnerPhase.RESERVED,
           {"incarnation": 2}, ["owner g1: decision not recorded"]),
    Broken("decision that no event ever produced", [], OwnerPhase.NEW,
           {"decision": Outcome.COMMIT}, ["owner g1: decision not recorded"]),
    Broken("phase jumped to RESERVED from a fresh owner", [], OwnerPhase.NEW,
           {"phase": OwnerPhase.RESERVED},
           ["owner g1: RESERVED without a plan", "owner g1: RESERVED without COMMIT"]),
]


@pytest.mark.parametrize("row", BROKEN, ids=[r.id for r in BROKEN])
def test_validate_reports_each_inconsistency(row: Broken) -> None:
    o = owner()
    for event in row.events:
        o.handle(event, NOW)
    assert o.phase is row.phase and o.validate() == []
    for name, value in row.tamper.items():
        setattr(o, name, value)
    assert o.validate() == row.problems
