"""Participant of two-phase reservations: one table row per transition.

Each row builds a participant from durable records (the same way a new leader
starts), feeds a few events, and compares the effects of the *last* event
with the expected ones, written compactly (``Vote("g1", 1, no="older")``).
No mocks: the core is pure, so a row is just data in, effects out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import pytest

from coordinator.core.twophase import (
    AbortReceived,
    CommitReceived,
    CommitWriteFailed,
    CommitWritten,
    CreateDecision,
    DecisionCreated,
    DecisionCreateFailed,
    DecisionObserved,
    DecisionRecord,
    DispatchGang,
    Effect,
    Event,
    GangFinished,
    GangForgotten,
    HoldFound,
    HoldReleased,
    HoldReleaseFailed,
    HoldState,
    HoldWriteFailed,
    HoldWritten,
    InventoryChanged,
    MarkCommitted,
    Outcome,
    ParticipantRecovered,
    ParticipantState,
    PrepareReceived,
    PrepareTimedOut,
    ReleaseHold,
    Reservation,
    RetryDue,
    ScheduleTimeout,
    SendDecisionAck,
    SendVote,
    TwoPhaseConfig,
    WriteHold,
)

AZ = "a"
CONFIG = TwoPhaseConfig(vote_timeout_s=5.0, prepare_timeout_s=15.0, store_retry_s=1.0)
NOW = 100.0
N1_01 = {"n1": ((0, 1), ("mlx0",))}
N1_1 = {"n1": ((1,), ())}
N1_23 = {"n1": ((2, 3), ())}

# ------------------------------------------------------------------ builders


def prepare(gang: str = "g1", inc: int = 1, nodes: dict[str, Any] | None = None,
            priority: int = 0, submitted_at: float = 10.0, owner_az: str = "b",
            local: bool = False) -> PrepareReceived:
    return PrepareReceived(stimulus_id=f"prep-{gang}-{inc}", gang=gang, incarnation=inc,
                           owner_az=owner_az, priority=priority, submitted_at=submitted_at,
                           nodes=N1_01 if nodes is None else nodes, local=local)


def local(gang: str = "g1", inc: int = 1, **kw: Any) -> PrepareReceived:
    """The single-AZ path's request to its own participant."""
    return prepare(gang, inc, owner_az=AZ, local=True, **kw)


def record(gang: str = "g1", inc: int = 1, state: HoldState = HoldState.PREPARED,
           nodes: dict[str, Any] | None = None, priority: int = 0, submitted_at: float = 10.0,
           az: str = AZ) -> Reservation:
    return Reservation(az=az, gang=gang, incarnation=inc, state=state, two_phase=True,
                       nodes=N1_01 if nodes is None else nodes, owner_az="b",
                       priority=priority, submitted_at=submitted_at)


def decided(gang: str, inc: int, outcome: Outcome) -> DecisionRecord:
    return DecisionRecord(gang=gang, incarnation=inc, outcome=outcome)


def ev(cls: type[Event], gang: str = "g1", inc: int = 1, **kw: Any) -> Event:
    return cls(stimulus_id=f"{cls.__name__}-{gang}-{inc}", gang=gang, incarnation=inc, **kw)  # type: ignore[call-arg]


def participant(records: Sequence[Reservation] = (), decisions: Sequence[DecisionRecord] = (),
                finished: Sequence[tuple[str, int]] = (), inventory: Any = None) -> ParticipantState:
    """A participant as a new leader builds it: from durable state only."""
    p = ParticipantState(AZ, CONFIG, inventory)
    p.handle(ParticipantRecovered(stimulus_id="boot", reservations=list(records),
                                  decisions=list(decisions), finished=list(finished)), NOW - 50)
    return p


def written(gang: str = "g1", inc: int = 1, **kw: Any) -> list[Event]:
    """Events that leave a PREPARED, written hold (vote YES sent)."""
    return [prepare(gang, inc, **kw), ev(HoldWritten, gang, inc)]


# ------------------------------------------------------------ effect matchers


@dataclass(frozen=True)
class Vote:
    gang: str
    inc: int
    yes: bool = False
    no: str = ""  # substring of the NO reason

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Vote):
            return (self.gang, self.inc, self.yes, self.no) == (other.gang, other.inc, other.yes, other.no)
        return (isinstance(other, SendVote) and other.gang == self.gang
                and other.incarnation == self.inc and other.yes == (not self.no)
                and self.no in other.reason and other.from_az == AZ)


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


def write(gang: str = "g1", inc: int = 1) -> Is:
    return Is(WriteHold, {"gang": gang, "incarnation": inc, "az": AZ})


def create_abort(gang: str, inc: int) -> Is:
    return Is(CreateDecision, {"gang": gang, "incarnation": inc, "outcome": Outcome.ABORT})


def release(gang: str = "g1", inc: int = 1) -> Is:
    return Is(ReleaseHold, {"gang": gang, "incarnation": inc, "az": AZ})


def mark_committed(gang: str = "g1", inc: int = 1) -> Is:
    return Is(MarkCommitted, {"gang": gang, "incarnation": inc})


@dataclass(frozen=True)
class Timer:
    """``ScheduleTimeout`` at ``at`` of an ``event_cls`` for (gang, inc)."""

    event_cls: type[Event]
    at: float
    gang: str
    inc: int

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Timer):
            return (self.event_cls, self.at, self.gang, self.inc) == (
                other.event_cls, other.at, other.gang, other.inc)
        return (isinstance(other, ScheduleTimeout) and other.at == self.at
                and type(other.event) is self.event_cls
                and getattr(other.event, "gang", None) == self.gang
                and getattr(other.event, "incarnation", None) == self.inc)


def timer(event_cls: type[Event], at: float, gang: str = "g1", inc: int = 1) -> Timer:
    return Timer(event_cls, at, gang, inc)


def ack(applied: bool, state: str, inc: int = 1) -> Is:
    return Is(SendDecisionAck, {"applied": applied, "state": state, "incarnation": inc})


# ---------------------------------------------------------------------- table


def late(event: Event, after: float = 15.0) -> tuple[float, Event]:
    """``event`` handled ``after`` seconds after the others (a timer firing
    on time: the in-doubt deadline is NOW + 15)."""
    return (NOW + after, event)


@dataclass(frozen=True)
class Row:
    id: str
    events: Sequence[Event | tuple[float, Event]]
    expect: list[Any]
    records: Sequence[Reservation] = ()
    decisions: Sequence[DecisionRecord] = ()
    finished: Sequence[tuple[str, int]] = ()
    inventory: Any = None


ROWS = [
    # --- prepare on free devices
    Row("prepare on free devices writes a hold and votes nothing yet",
        [prepare()], [write()]),
    Row("hold written votes YES and arms the in-doubt timer",
        written(), [Vote("g1", 1, yes=True), timer(PrepareTimedOut, NOW + 15)]),
    Row("hold write failure votes NO",
        [prepare(), ev(HoldWriteFailed, reason="etcd refused")], [Vote("g1", 1, no="etcd refused")]),
    # --- the hold write met a record: the driver reports it, the core decides
    Row("hold found at our incarnation counts as written: YES and the in-doubt timer",
        [prepare(), ev(HoldFound, found=1, revision=7)], [Vote("g1", 1, yes=True), timer(PrepareTimedOut, NOW + 15)]),
    Row("hold found at an older incarnation is replaced under a compare on its revision",
        [prepare(inc=2), ev(HoldFound, inc=2, found=1, revision=7)],
        [Is(WriteHold, {"gang": "g1", "incarnation": 2, "replaces": 7, "commit": False})]),
    Row("replacing write applied votes YES",
        [prepare(inc=2), ev(HoldFound, inc=2, found=1, revision=7), ev(HoldWritten, inc=2)],
        [Vote("g1", 2, yes=True), timer(PrepareTimedOut, NOW + 15, inc=2)]),
    Row("replacing write that finds an older record again votes NO (replaced once per claim)",
        [prepare(inc=2), ev(HoldFound, inc=2, found=1, revision=7), ev(HoldFound, inc=2, found=1, revision=9)],
        [Vote("g1", 2, no="record changed concurrently")]),
    Row("hold found at a newer incarnation votes NO",
        [prepare(), ev(HoldFound, found=2, revision=7)], [Vote("g1", 1, no="a newer incarnation 2 is recorded")]),
    Row("hold found unreadable votes NO and is never overwritten",
        [prepare(), ev(HoldFound, found=None, revision=7)], [Vote("g1", 1, no="cannot be read")]),
    Row("devices of a claim refused on a found record go to the next prepare",
        [prepare(), ev(HoldFound, found=None, revision=7), prepare("g2")], [write("g2")]),
    Row("hold found at our incarnation after the claim was dropped: the record is released",
        [prepare(), ev(GangFinished), ev(HoldFound, found=1, revision=7)], [release()]),
    Row("hold found at another incarnation after the claim was dropped: nothing to do",
        [prepare(), ev(GangFinished), ev(HoldFound, found=2, revision=7)], []),
    Row("local reservation found over an older record replaces it COMMITTED",
        [local(inc=2), ev(HoldFound, inc=2, found=1, revision=7)],
        [Is(WriteHold, {"gang": "g1", "incarnation": 2, "replaces": 7, "commit": True})]),
    Row("devices freed by a failed hold write go to the next prepare",
        [prepare(), ev(HoldWriteFailed, reason="x"), prepare("g2")], [write("g2")]),
    Row("disjoint prepares of two gangs both get holds",
        [*written(), prepare("g2", nodes=N1_23)], [write("g2")]),
    Row("empty slice is refused", [prepare(nodes={})], [Vote("g1", 1, no="empty slice")]),
    Row("device missing from the inventory is refused",
        [prepare(nodes={"n9": ((0,), ())})], [Vote("g1", 1, no="unknown devices: n9/gpu0")],
        inventory={"n1": ((0, 1, 2, 3), ("mlx0",))}),
    Row("inventory change applies to the next prepare",
        [InventoryChanged(stimulus_id="inv", nodes={"n9": ((0,), ())}), prepare(nodes={"n9": ((0,), ())})],
        [write()], inventory={"n1": ((0,), ())}),
    # --- idempotence and staleness
    Row("duplicate prepare while the hold is being written stays silent",
        [prepare(), prepare()], []),
    Row("duplicate prepare after the hold is written votes YES again",
        [*written(), prepare()], [Vote("g1", 1, yes=True)]),
    Row("duplicate prepare with another slice is refused",
        [*written(), prepare(nodes=N1_23)], [Vote("g1", 1, no="another slice")]),
    Row("prepare older than the held incarnation is refused as stale",
        [prepare(inc=1)], [Vote("g1", 1, no="stale incarnation 1")], records=[record(inc=2)]),
    Row("prepare older than an incarnation seen and refused is stale",
        [prepare("g0", nodes=N1_1), ev(HoldWritten, "g0"), prepare("g1", inc=3, submitted_at=20),
         prepare("g1", inc=2, nodes=N1_23)],
        [Vote("g1", 2, no="stale incarnation 2: already saw 3")]),
    Row("prepare of an incarnation known ABORTed is refused",
        [prepare()], [Vote("g1", 1, no="already aborted")], decisions=[decided("g1", 1, Outcome.ABORT)]),
    Row("prepare of a finished incarnation is refused",
        [prepare()], [Vote("g1", 1, no="already finished")], finished=[("g1", 1)]),
    Row("late duplicate prepare of a committed incarnation answers YES",
        [prepare()], [Vote("g1", 1, yes=True)],
        records=[record(state=HoldState.COMMITTED)], decisions=[decided("g1", 1, Outcome.COMMIT)]),
    Row("gang committed in another incarnation is refused until it finishes",
        [prepare(inc=2)], [Vote("g1", 2, no="committed at incarnation 1")],
        records=[record(state=HoldState.COMMITTED)], decisions=[decided("g1", 1, Outcome.COMMIT)]),
    Row("newer incarnation first resolves the gang's undecided older hold",
        [prepare(inc=2)], [create_abort("g1", 1)], records=[record(inc=1)]),
    Row("older hold resolved ABORT lets the newer incarnation in",
        [prepare(inc=2), DecisionCreated(stimulus_id="d", gang="g1", incarnation=1, won=True,
                                         outcome=Outcome.ABORT)],
        [release("g1", 1), write("g1", 2)], records=[record(inc=1)]),
    Row("newer prepare supersedes a parked one, which gets NO",
        [prepare(inc=2), prepare(inc=3)],
        [Vote("g1", 2, no="superseded"), create_abort("g1", 1)], records=[record(inc=1)]),
    # --- conflicts and the order
    Row("younger gang on an older gang's PREPARED devices is refused, naming it",
        [*written("g0", submitted_at=5), prepare("g1", submitted_at=10)],
        [Vote("g1", 1, no="conflict with older gang g0: n1/gpu0, n1/gpu1, n1/nicmlx0")]),
    Row("younger gang on a COMMITTED hold is refused",
        [prepare("g1", submitted_at=10)], [Vote("g1", 1, no="devices committed to gang g0")],
        records=[record("g0", state=HoldState.COMMITTED, submitted_at=50)],
        decisions=[decided("g0", 1, Outcome.COMMIT)]),
    Row("older gang never preempts a COMMITTED hold",
        [prepare("g1", submitted_at=1)], [Vote("g1", 1, no="devices committed to gang g0")],
        records=[record("g0", state=HoldState.COMMITTED, submitted_at=50)],
        decisions=[decided("g0", 1, Outcome.COMMIT)]),
    Row("older gang preempts a younger undecided hold by create-if-absent ABORT",
        [*written("g2", submitted_at=20), prepare("g1", submitted_at=10)], [create_abort("g2", 1)]),
    Row("older gang preempts a younger hold still being written",
        [prepare("g2", submitted_at=20), prepare("g1", submitted_at=10)], [create_abort("g2", 1)]),
    Row("higher priority is older than an earlier submission",
        [*written("g0", submitted_at=1), prepare("g1", priority=5, submitted_at=99)],
        [create_abort("g0", 1)]),
    Row("equal priority and time: the smaller gang id is older",
        [*written("g2"), prepare("g1")], [create_abort("g2", 1)]),
    Row("preemption won: victim released, parked prepare gets its hold",
        [*written("g2", submitted_at=20), prepare("g1", submitted_at=10),
         DecisionCreated(stimulus_id="d", gang="g2", incarnation=1, won=True, outcome=Outcome.ABORT)],
        [release("g2", 1), write("g1", 1)]),
    Row("preemption resolved by the watch first works the same",
        [*written("g2", submitted_at=20), prepare("g1", submitted_at=10),
         DecisionObserved(stimulus_id="w", gang="g2", incarnation=1, outcome=Outcome.ABORT)],
        [release("g2", 1), write("g1", 1)]),
    Row("preemption lost to the victim's COMMIT: victim committed, parked prepare refused",
        [*written("g2", submitted_at=20), prepare("g1", submitted_at=10),
         DecisionCreated(stimulus_id="d", gang="g2", incarnation=1, won=False, outcome=Outcome.COMMIT)],
        [mark_committed("g2", 1), Vote("g1", 1, no="devices committed to gang g2")]),
    Row("preempting two victims waits for both decisions",
        [*written("g2", nodes={"n1": ((0,), ())}, submitted_at=20),
         *written("g3", nodes={"n1": ((1,), ())}, submitted_at=30),
         prepare("g1", nodes={"n1": ((0, 1), ())}, submitted_at=10),
         DecisionCreated(stimulus_id="d", gang="g2", incarnation=1, won=True, outcome=Outcome.ABORT)],
        [release("g2", 1)]),
    Row("failed preemption create refuses the parked prepare",
        [*written("g2", submitted_at=20), prepare("g1", submitted_at=10),
         ev(DecisionCreateFailed, "g2", 1, reason="etcd down")],
        [Vote("g1", 1, no="could not resolve g2/1: etcd down")]),
    Row("parked older prepare keeps younger newcomers off its devices",
        [*written("g2", submitted_at=20), prepare("g1", submitted_at=10),
         prepare("g3", nodes=N1_1, submitted_at=30)],
        [Vote("g3", 1, no="conflict with older gang g1")]),
    Row("parked prepare does not block an even older newcomer",
        [*written("g2", submitted_at=20), prepare("g1", submitted_at=10),
         prepare("g0", nodes=N1_23, submitted_at=1)],
        [write("g0")]),
    Row("duplicate of a parked prepare stays silent",
        [*written("g2", submitted_at=20), prepare("g1", submitted_at=10), prepare("g1", submitted_at=10)],
        []),
    # --- decisions
    Row("COMMIT by RPC commits the hold and writes COMMITTED",
        [*written(), ev(CommitReceived, from_az="b")], [mark_committed(), ack(True, "COMMITTED")]),
    Row("COMMITTED written dispatches to the agents",
        [*written(), ev(CommitReceived, from_az="b"), ev(CommitWritten)],
        [Is(DispatchGang, {"gang": "g1", "incarnation": 1, "nodes": N1_01})]),
    Row("duplicate COMMIT is acknowledged and changes nothing",
        [*written(), ev(CommitReceived, from_az="b"), ev(CommitReceived, from_az="b")],
        [ack(True, "COMMITTED")]),
    Row("COMMIT for a gang never prepared is refused",
        [ev(CommitReceived, from_az="b")], [ack(False, "NOT_PREPARED")]),
    Row("COMMIT for another incarnation than the hold is refused",
        [*written(inc=2), ev(CommitReceived, inc=3, from_az="b")], [ack(False, "NOT_PREPARED", inc=3)]),
    Row("ABORT by RPC releases the hold (compare-delete on its incarnation)",
        [*written(), ev(AbortReceived, from_az="b")], [release(), ack(True, "RELEASED")]),
    Row("ABORT for a COMMITTED hold is refused: decisions are write-once",
        [*written(), ev(CommitReceived, from_az="b"), ev(AbortReceived, from_az="b")],
        [ack(False, "COMMITTED")]),
    Row("ABORT for an unknown attempt is cached so its late prepare is refused",
        [ev(AbortReceived, from_az="b"), prepare()], [Vote("g1", 1, no="already aborted")]),
    Row("ABORT while the hold is being written releases once the write lands",
        [prepare(), ev(AbortReceived, from_az="b"), ev(HoldWritten)], [release()]),
    Row("ABORT observed frees the devices for a refused younger gang's retry",
        [*written("g0", submitted_at=1), prepare("g1", submitted_at=10),
         DecisionObserved(stimulus_id="w", gang="g0", incarnation=1, outcome=Outcome.ABORT),
         prepare("g1", inc=2, submitted_at=10)],
        [write("g1", 2)]),
    # --- in doubt
    Row("in-doubt timer firing early re-arms for the deadline",
        [*written(), late(ev(PrepareTimedOut), 14.9)], [timer(PrepareTimedOut, NOW + 15)]),
    Row("in-doubt timeout creates ABORT if absent",
        [*written(), late(ev(PrepareTimedOut))], [create_abort("g1", 1)]),
    Row("in-doubt create lost to the owner's COMMIT commits the hold",
        [*written(), late(ev(PrepareTimedOut)),
         DecisionCreated(stimulus_id="d", gang="g1", incarnation=1, won=False, outcome=Outcome.COMMIT)],
        [mark_committed()]),
    Row("in-doubt create won releases the hold",
        [*written(), late(ev(PrepareTimedOut)),
         DecisionCreated(stimulus_id="d", gang="g1", incarnation=1, won=True, outcome=Outcome.ABORT)],
        [release()]),
    Row("duplicate timer while the in-doubt create is in flight is ignored",
        [*written(), late(ev(PrepareTimedOut)), late(ev(PrepareTimedOut))], []),
    Row("in-doubt create failure re-arms after the store retry delay",
        [*written(), late(ev(PrepareTimedOut)), late(ev(DecisionCreateFailed, reason="etcd down"))],
        [timer(PrepareTimedOut, NOW + 15 + 1)]),
    Row("timeout of a decided hold is ignored",
        [*written(), ev(CommitReceived, from_az="b"), late(ev(PrepareTimedOut))], []),
    # --- finish, retries
    Row("gang finished releases its committed hold",
        [*written(), ev(CommitReceived, from_az="b"), ev(CommitWritten), ev(GangFinished)], [release()]),
    # A finished gang's PREPARED hold: one rule (docs/two-phase.md "A
    # finished gang's PREPARED hold"), the driver and the model test feed it.
    Row("gang finished keeps its undecided PREPARED hold and decides it by create-if-absent ABORT",
        [*written(), ev(GangFinished)], [create_abort("g1", 1)]),
    Row("finished PREPARED hold: our ABORT won, the hold is released",
        [*written(), ev(GangFinished), ev(DecisionCreated, won=True, outcome=Outcome.ABORT)], [release()]),
    Row("finished PREPARED hold: the owner's COMMIT is learned and releases it, no commit, no dispatch",
        [*written(), ev(GangFinished), ev(DecisionCreated, won=False, outcome=Outcome.COMMIT)], [release()]),
    Row("finished PREPARED hold: a COMMIT on the watch releases it too",
        [*written(), ev(GangFinished), ev(DecisionObserved, outcome=Outcome.COMMIT)], [release()]),
    Row("finished PREPARED hold keeps its devices until decided",
        [*written(), ev(GangFinished), prepare("g2", submitted_at=20)],
        [Vote("g2", 1, no="conflict with older gang g1")]),
    Row("gang finished again while its ABORT create is in flight creates nothing more",
        [*written(), ev(GangFinished), ev(GangFinished)], []),
    Row("finished PREPARED hold whose ABORT create failed retries it at the store retry delay",
        [*written(), ev(GangFinished), ev(DecisionCreateFailed, reason="etcd down")],
        [timer(PrepareTimedOut, NOW + 1)]),
    Row("gang finished while its hold is being written drops the claim (no YES went out)",
        [prepare(), ev(GangFinished), ev(HoldWritten)], [release()]),
    Row("gang finished for another incarnation releases nothing",
        [*written(inc=2), ev(CommitReceived, inc=2, from_az="b"), ev(GangFinished, inc=1)], []),
    Row("commit write failure retries after the store retry delay",
        [*written(), ev(CommitReceived, from_az="b"), ev(CommitWriteFailed, reason="x")],
        [timer(RetryDue, NOW + 1)]),
    Row("retry due re-issues the COMMITTED write",
        [*written(), ev(CommitReceived, from_az="b"), ev(CommitWriteFailed, reason="x"), ev(RetryDue)],
        [mark_committed()]),
    Row("release failure retries, retry due re-issues the release",
        [*written(), ev(AbortReceived, from_az="b"), ev(HoldReleaseFailed, reason="x"), ev(RetryDue)],
        [release()]),
    Row("release done: a late retry does nothing",
        [*written(), ev(AbortReceived, from_az="b"), ev(HoldReleased), ev(RetryDue)], []),
    # --- retention: the gang was collected (gangs/ and decisions/ deleted)
    Row("forgotten gang: nothing to do",
        [*written(), ev(AbortReceived, from_az="b"), ev(HoldReleased), GangForgotten(stimulus_id="c", gang="g1")],
        []),
    # The core alone does not refuse a prepare for a gang it forgot (nor does
    # a new leader, which never read its keys): the driver's etcd check of
    # the gang record (unknown gang: FAILED_PRECONDITION) is what refuses it.
    Row("forgotten gang's old incarnation is not refused by memory any more",
        [GangForgotten(stimulus_id="c", gang="g1"), prepare(inc=1)], [write("g1", 1)],
        decisions=[decided("g1", 1, Outcome.ABORT), decided("g1", 2, Outcome.COMMIT)], finished=[("g1", 2)]),
    Row("forgetting a gang keeps other gangs' decisions",
        [GangForgotten(stimulus_id="c", gang="g1"), prepare("g2")], [Vote("g2", 1, no="already aborted")],
        decisions=[decided("g1", 1, Outcome.ABORT), decided("g2", 1, Outcome.ABORT)]),
    Row("a held gang is never forgotten",
        [*written(inc=3), GangForgotten(stimulus_id="c", gang="g1"), prepare(inc=2)],
        [Vote("g1", 2, no="stale incarnation 2")]),
    # --- the single-AZ path through the same ledger
    Row("local reservation on free devices is written COMMITTED at once",
        [local()], [Is(WriteHold, {"gang": "g1", "commit": True})]),
    Row("local reservation written answers YES and dispatches, with no decision key",
        [local(), ev(HoldWritten)],
        [Is(SendVote, {"yes": True, "to_az": AZ}), Is(DispatchGang, {"gang": "g1", "incarnation": 1})]),
    Row("local reservation write failure answers NO",
        [local(), ev(HoldWriteFailed, reason="gang record changed")],
        [Vote("g1", 1, no="gang record changed")]),
    Row("local reservation in flight is never preempted, even by an older gang",
        [local("g2", submitted_at=20), prepare("g1", submitted_at=1)],
        [Vote("g1", 1, no="devices committed to gang g2")]),
    Row("local reservation of an older gang preempts a younger PREPARED hold",
        [*written("g2", submitted_at=20), local("g1", submitted_at=10)], [create_abort("g2", 1)]),
    Row("local reservation is refused by an older gang's PREPARED hold",
        [*written("g0", submitted_at=1), local("g1", submitted_at=10)],
        [Vote("g1", 1, no="conflict with older gang g0")]),
    # --- recovery (the last event is the recovery itself)
    Row("recovery keeps an undecided hold and re-arms its timer in full",
        [ParticipantRecovered(stimulus_id="r", reservations=[record()], decisions=[])],
        [timer(PrepareTimedOut, NOW + 15)]),
    Row("recovery releases ABORTed records and finished decided ones",
        [ParticipantRecovered(stimulus_id="r", reservations=[record("g1"), record("g2", nodes=N1_23)],
                              decisions=[decided("g1", 1, Outcome.ABORT), decided("g2", 1, Outcome.COMMIT)],
                              finished=[("g2", 1)])],
        [release("g1", 1), release("g2", 1)]),
    Row("recovery releases a finished COMMITTED record",
        [ParticipantRecovered(stimulus_id="r", reservations=[record(state=HoldState.COMMITTED)],
                              decisions=[], finished=[("g1", 1)])],
        [release()]),
    Row("recovery keeps a finished undecided PREPARED record and decides it by ABORT",
        [ParticipantRecovered(stimulus_id="r", reservations=[record()], decisions=[], finished=[("g1", 1)])],
        [create_abort("g1", 1)]),
    Row("recovery completes a COMMIT whose record is still PREPARED",
        [ParticipantRecovered(stimulus_id="r", reservations=[record()],
                              decisions=[decided("g1", 1, Outcome.COMMIT)])],
        [mark_committed()]),
    Row("recovery re-dispatches COMMITTED records",
        [ParticipantRecovered(stimulus_id="r", reservations=[record(state=HoldState.COMMITTED)],
                              decisions=[decided("g1", 1, Outcome.COMMIT)])],
        [Is(DispatchGang, {"gang": "g1", "incarnation": 1})]),
    Row("recovery reads a COMMITTED record without a key as a single-AZ reservation",
        [ParticipantRecovered(stimulus_id="r", reservations=[record(state=HoldState.COMMITTED)],
                              decisions=[])],
        [Is(DispatchGang, {"gang": "g1", "incarnation": 1})]),
    Row("recovery keeps a COMMITTED record even next to an ABORT key",
        [ParticipantRecovered(stimulus_id="r", reservations=[record(state=HoldState.COMMITTED)],
                              decisions=[decided("g1", 1, Outcome.ABORT)])],
        [Is(DispatchGang, {"gang": "g1", "incarnation": 1})]),
    Row("recovery ignores records of other AZs",
        [ParticipantRecovered(stimulus_id="r", reservations=[record(az="z")], decisions=[])], []),
]


# Rows whose world is deliberately inconsistent, so validate() must object.
INCONSISTENT = {"recovery keeps a COMMITTED record even next to an ABORT key"}


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_participant_transition(row: Row) -> None:
    p = participant(row.records, row.decisions, row.finished, row.inventory)
    effects: list[Effect] = []
    for item in row.events:
        now, event = item if isinstance(item, tuple) else (NOW, item)
        effects = p.handle(event, now)
    assert effects == row.expect
    assert (p.validate() != []) == (row.id in INCONSISTENT)


# ------------------------------------------------------------ state-based specs


def test_effects_carry_the_stimulus_id_of_their_event() -> None:
    p = participant()
    effects = p.handle(prepare(), NOW) + p.handle(ev(HoldWritten), NOW)
    assert [e.stimulus_id for e in effects] == ["prep-g1-1", "HoldWritten-g1-1", "HoldWritten-g1-1"]
    timeout = effects[-1]
    assert isinstance(timeout, ScheduleTimeout) and timeout.event.stimulus_id.startswith("prepare-timeout:")


def test_ledger_tracks_holders_of_devices() -> None:
    p = participant()
    for event in written("g1"):
        p.handle(event, NOW)
    assert p.holder_of(("n1", "gpu", 0)) == "g1"
    assert p.holder_of(("n1", "nic", "mlx0")) == "g1"
    assert p.holder_of(("n1", "gpu", 3)) is None
    p.handle(ev(AbortReceived, from_az="b"), NOW)
    assert p.holder_of(("n1", "gpu", 0)) is None
    assert p.pending_releases == {("g1", 1)}


# What stays taken after a release is decided (``releasing``): the devices
# of a hold held here, until its delete commits (HoldReleased). A record this
# leadership never held (recovery of a dead attempt, a write that landed after
# its claim was dropped) is deleted with nothing kept taken, as before.
@pytest.mark.parametrize("records, decisions, finished, events, want", [
    pytest.param((), (), (), [*written(), ev(AbortReceived, from_az="b")], {("g1", 1): N1_01}, id="aborted"),
    pytest.param((), (), (), [*written(), ev(DecisionObserved, outcome=Outcome.ABORT)], {("g1", 1): N1_01},
                 id="abort-observed"),
    pytest.param((), (), (), [*written(), ev(CommitReceived, from_az="b"), ev(GangFinished)],
                 {("g1", 1): N1_01}, id="committed-then-finished"),
    pytest.param((), (), (), [*written(), ev(GangFinished), ev(DecisionCreated, outcome=Outcome.ABORT, won=True)],
                 {("g1", 1): N1_01}, id="finished-prepared-then-decided"),
    pytest.param((), (), (), [*written(), ev(AbortReceived, from_az="b"), ev(HoldReleaseFailed, reason="x")],
                 {("g1", 1): N1_01}, id="delete-failed-still-taken"),
    pytest.param((), (), (), [*written(), ev(AbortReceived, from_az="b"), ev(HoldReleased)], {}, id="delete-committed"),
    pytest.param((), (), (), [*written(), ev(AbortReceived, from_az="b"), ev(HoldWritten)], {("g1", 1): N1_01},
                 id="a-late-duplicate-write-keeps-it-taken"),
    pytest.param((), (), (), [prepare(), ev(AbortReceived, from_az="b"), ev(HoldWritten)], {},
                 id="written-after-its-claim-was-dropped"),
    pytest.param([record()], [decided("g1", 1, Outcome.ABORT)], (), [], {}, id="recovered-aborted-record"),
    pytest.param([record(state=HoldState.COMMITTED)], [decided("g1", 1, Outcome.COMMIT)], [("g1", 1)], [], {},
                 id="recovered-finished-record"),
    pytest.param((), (), (), [*written(), *written("g2", nodes=N1_23), ev(AbortReceived, "g2", from_az="b")],
                 {("g2", 1): N1_23}, id="only-the-released-gang"),
])
def test_releasing_keeps_a_decided_release_taken_until_its_delete_commits(records, decisions, finished, events,
                                                                          want) -> None:
    p = participant(records, decisions, finished)
    for event in events:
        p.handle(event, NOW)
    assert {k: dict(v) for k, v in p.releasing.items()} == want
    assert set(want) <= p.pending_releases and not set(want) & {h.key for h in p.holds.values()}


def test_committed_hold_survives_everything_but_finish() -> None:
    p = participant()
    for event in [*written(), ev(CommitReceived, from_az="b")]:
        p.handle(event, NOW)
    hostile = [ev(AbortReceived, from_az="b"), ev(PrepareTimedOut),
               DecisionObserved(stimulus_id="w", gang="g1", incarnation=1, outcome=Outcome.ABORT),
               prepare("g0", submitted_at=0, priority=9), prepare("g1", inc=2), ev(HoldWriteFailed, reason="x")]
    for event in hostile:
        p.handle(event, NOW + 1000)
        assert p.holds["g1"].state is HoldState.COMMITTED
    p.handle(ev(GangFinished), NOW)
    assert "g1" not in p.holds


def test_unexpected_event_type_is_a_driver_bug() -> None:
    with pytest.raises(TypeError, match="unexpected event"):
        participant().handle(Event(stimulus_id="x"), NOW)


def test_recovered_participant_remembers_incarnations_from_decisions() -> None:
    p = participant(decisions=[decided("g1", 4, Outcome.ABORT)])
    assert p.handle(prepare(inc=3), NOW) == [Vote("g1", 3, no="stale incarnation 3: already saw 4")]


def test_forgetting_drops_everything_remembered_of_the_gang() -> None:
    p = participant(decisions=[decided("g1", 1, Outcome.ABORT), decided("g1", 2, Outcome.COMMIT),
                               decided("g2", 1, Outcome.COMMIT)], finished=[("g1", 2)])
    assert p.handle(GangForgotten(stimulus_id="c", gang="g1"), NOW) == []
    assert dict(p.known_decisions) == {("g2", 1): Outcome.COMMIT}
    assert p.validate() == []
