"""Events (what happened, past tense) and effects (what to do, imperative) of
the two-phase reservation state machines.

The driver feeds events into ``ParticipantState.handle`` / ``OwnerState.handle``
and performs the effects they return; results of effects come back as events
(``WriteHold`` -> ``HoldWritten`` / ``HoldWriteFailed``). Every event and
effect carries ``stimulus_id``: an effect copies the id of the event that
caused it, so a log line or a chaos history can be traced back to the RPC,
watch notification or timer that started the chain.

Driver contract, per effect, is in each docstring. Two rules apply to all:

* A ``...Failed`` event means the write *definitely did not apply* (a lost
  compare, a refused request). When the outcome is unknown (deadline exceeded
  on the wire), the driver reads the key back linearizably and reports what it
  finds; it never guesses.
* A store write whose fencing compare fails (``NotLeader``) is not reported
  at all: the leader steps down and this state object is discarded. The next
  leader starts from ``ParticipantRecovered`` / ``OwnerRecovered``.

Pure: no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Sequence

from coordinator.core.twophase_model import (
    DecisionKey,
    DecisionRecord,
    NodeDevices,
    NodeSlice,
    Outcome,
    Plan,
    normalize_plan,
    normalize_slice,
)
from phalanx.reservation import HoldState, Reservation

# --------------------------------------------------------------------------
# Base classes
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Event:
    """Something that happened; input of ``handle``."""

    stimulus_id: str


@dataclass(frozen=True, kw_only=True)
class AttemptEvent(Event):
    """An event about one attempt (gang, incarnation)."""

    gang: str
    incarnation: int

    @property
    def key(self) -> DecisionKey:
        return (self.gang, self.incarnation)


@dataclass(frozen=True, kw_only=True)
class Effect:
    """Something the driver must do; output of ``handle``."""

    stimulus_id: str


class Core(enum.Enum):
    """The two state machines of a leader: its AZ's participant, and the
    owner of each cross-AZ gang it owns (keyed by the event's gang)."""

    PARTICIPANT = "participant"
    OWNER = "owner"


@dataclass(frozen=True)
class Routed:
    """An event with the core(s) it is fed to. What an effect's handler
    returns: the driver's one feed loop hands it to its core(s) and performs
    what they decide. Routing is not by the event's type alone: a timer's
    ``RetryDue`` or a ``GangFinished`` goes to the core it is about, and a
    decision's outcome (``DecisionCreated``/``...Observed``/``...Failed``)
    to both."""

    event: Event
    to: frozenset[Core]

    @staticmethod
    def participant(event: Event) -> "Routed":
        return Routed(event, frozenset({Core.PARTICIPANT}))

    @staticmethod
    def owner(event: Event) -> "Routed":
        return Routed(event, frozenset({Core.OWNER}))

    @staticmethod
    def both(event: Event) -> "Routed":
        return Routed(event, frozenset({Core.PARTICIPANT, Core.OWNER}))


# --------------------------------------------------------------------------
# Events shared by both roles
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DecisionCreated(AttemptEvent):
    """Result of ``CreateDecision``: the key now exists. ``won`` says whether
    our create made it; ``outcome`` is what the key holds either way (when
    we lost, someone else's decision, which is the one that counts)."""

    won: bool
    outcome: Outcome


@dataclass(frozen=True, kw_only=True)
class DecisionCreateFailed(AttemptEvent):
    """``CreateDecision`` definitely did not reach etcd (unavailable,
    refused). Not for "lost the race": that is ``DecisionCreated(won=False)``."""

    reason: str


@dataclass(frozen=True, kw_only=True)
class DecisionObserved(AttemptEvent):
    """The watch on ``decisions/`` (or a read) showed this decision."""

    outcome: Outcome


@dataclass(frozen=True, kw_only=True)
class GangFinished(AttemptEvent):
    """This incarnation of the gang is over (succeeded, failed, cancelled,
    or torn down to restart) and that fact is already durable in
    ``gangs/<gang>``. The only way a COMMITTED hold is ever released."""


@dataclass(frozen=True, kw_only=True)
class RetryDue(AttemptEvent):
    """A timer the core scheduled (``ScheduleTimeout``) to re-issue store
    work that failed, or, for the owner, to start the next incarnation after
    a backoff. Fired late or twice it is harmless."""


# --------------------------------------------------------------------------
# Participant events
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PrepareReceived(AttemptEvent):
    """A ``Prepare`` RPC (``PrepareRequest``) from the owner's AZ leader.

    ``local``: the single-AZ path (docs/design.md §8.7: one fenced txn).
    The gang lives in this AZ only, so this participant is the only voter and
    decides by itself: the hold is written COMMITTED at once (no decision
    key), and the vote is the answer to the local admission code. It goes
    through the same ledger and the same conflict order as cross-AZ
    prepares, which is what serialises single-AZ and cross-AZ contention.
    """

    owner_az: str
    priority: int
    submitted_at: float
    nodes: NodeSlice
    local: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", normalize_slice(self.nodes))


@dataclass(frozen=True, kw_only=True)
class HoldWritten(AttemptEvent):
    """``WriteHold`` applied: ``reservations/<az>/<gang>`` is PREPARED at this
    incarnation (or was already, at this incarnation)."""


@dataclass(frozen=True, kw_only=True)
class HoldWriteFailed(AttemptEvent):
    """``WriteHold`` definitely not applied (e.g. a newer incarnation's record
    is already there)."""

    reason: str


@dataclass(frozen=True, kw_only=True)
class HoldFound(AttemptEvent):
    """``WriteHold`` found ``reservations/<az>/<gang>`` present where its
    guard expected it absent (or at ``replaces``), or a timed-out write read
    back a record: what the key holds, for the core to decide on (the driver
    decides nothing). ``found``: the stored incarnation, None when the record
    cannot be read; ``revision``: its mod revision, what a replacing write
    compares on. The core: this incarnation is our write (as
    ``HoldWritten``); an older one is replaced once by ``WriteHold(replaces=
    revision)``; a newer or unreadable one, or an older one still there after
    our replacing write, gets NO."""

    found: int | None
    revision: int


@dataclass(frozen=True, kw_only=True)
class CommitWritten(AttemptEvent):
    """``MarkCommitted`` applied: the record is COMMITTED."""


@dataclass(frozen=True, kw_only=True)
class CommitWriteFailed(AttemptEvent):
    reason: str


@dataclass(frozen=True, kw_only=True)
class HoldReleased(AttemptEvent):
    """``ReleaseHold`` applied (or there was nothing left to delete)."""


@dataclass(frozen=True, kw_only=True)
class HoldReleaseFailed(AttemptEvent):
    reason: str


@dataclass(frozen=True, kw_only=True)
class CommitReceived(AttemptEvent):
    """A ``Commit`` RPC from the owner (``DecisionRequest``)."""

    from_az: str


@dataclass(frozen=True, kw_only=True)
class AbortReceived(AttemptEvent):
    """An ``Abort`` RPC from the owner (``DecisionRequest``)."""

    from_az: str


@dataclass(frozen=True, kw_only=True)
class PrepareTimedOut(AttemptEvent):
    """The timer from ``ScheduleTimeout`` for an undecided PREPARED hold."""


@dataclass(frozen=True, kw_only=True)
class InventoryChanged(Event):
    """The AZ's schedulable devices changed (node joined, left, drained).
    ``nodes`` None means "unknown": prepares are then checked against holds
    only. Existing holds are not touched: losing a node is the lifecycle's
    business (restart the gang), not the reservation protocol's."""

    nodes: Mapping[str, NodeDevices] | None


@dataclass(frozen=True, kw_only=True)
class GangForgotten(Event):
    """``gangs/<gang>`` and its ``decisions/<gang>/*`` were deleted: the gang
    finished long ago and its owner collected it (docs/etcd-keys.md
    "Retention"). The participant forgets the decisions, incarnations and
    finished attempts it remembers of it, so that its memory stays bounded in
    a long leadership. Ignored while a hold, a parked prepare or a release of
    the gang exists (the collector never deletes a gang that is still held).

    Forgetting is safe because a Prepare for a gang reaches the core only
    after the driver found its record ``RESERVING`` at that incarnation in
    etcd (a remote owner) or from the owner's own live state (a local one):
    a collected gang has neither. A new leader knows no more after its
    recovery read."""

    gang: str


@dataclass(frozen=True, kw_only=True)
class ParticipantRecovered(Event):
    """A new leader of this AZ read its durable state once (one range read,
    docs/design.md §8.10) and starts from it. ``reservations`` are this AZ's records,
    ``decisions`` every decision key, ``finished`` the attempts whose gang
    record says they are over."""

    reservations: Sequence[Reservation]
    decisions: Sequence[DecisionRecord]
    finished: Sequence[DecisionKey] = ()


# --------------------------------------------------------------------------
# Owner events
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GangSubmitted(AttemptEvent):
    """Start admitting the gang at ``incarnation`` (1 for a new gang, the next
    one after a restart). The gang record is already durable."""


@dataclass(frozen=True, kw_only=True)
class PlacementMade(AttemptEvent):
    """The AZ leader's admission cycle placed this attempt: its one order of
    every pending gang (docs/admission.md) reached this gang and found room.
    Fed only while the owner is UNPLACED at ``incarnation``; the cycle has
    taken the plan's devices from its free view already."""

    plan: Plan

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", normalize_plan(self.plan))


@dataclass(frozen=True, kw_only=True)
class AttemptWritten(AttemptEvent):
    """``WriteAttempt`` applied: ``gangs/<gang>`` names this incarnation and
    its plan."""


@dataclass(frozen=True, kw_only=True)
class AttemptWriteFailed(AttemptEvent):
    reason: str


@dataclass(frozen=True, kw_only=True)
class VoteReceived(AttemptEvent):
    """A participant's answer to ``Prepare`` (``PrepareResponse``)."""

    from_az: str
    yes: bool
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class VotesTimedOut(AttemptEvent):
    """The vote deadline timer of this incarnation."""


@dataclass(frozen=True, kw_only=True)
class OwnerRecovered(Event):
    """A new owner leader read ``gangs/<gang>`` and its decision once.

    ``incarnation`` / ``plan``: the last attempt recorded by ``WriteAttempt``
    (0 / None if none was ever recorded); ``decision``: the content of
    ``decisions/<gang>/<incarnation>`` if it exists; ``finished``: the gang
    record says that incarnation is over.
    """

    gang: str
    incarnation: int
    plan: Plan | None
    decision: Outcome | None
    finished: bool = False

    def __post_init__(self) -> None:
        if self.plan is not None:
            object.__setattr__(self, "plan", normalize_plan(self.plan))


# --------------------------------------------------------------------------
# Effects: store writes (the driver runs each as one fenced etcd txn)
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WriteHold(Effect):
    """Put ``reservations/<az>/<gang>`` = PREPARED (or COMMITTED when
    ``commit``: the single-AZ path, whose txn may also carry the gang record)
    at ``incarnation``.

    Guard: the key is absent, or, with ``replaces``, its mod revision is
    still ``replaces`` (an older incarnation's record the core decided to
    overwrite on ``HoldFound``). Not bound to the session lease: a hold
    outlives its leader. Report ``HoldWritten`` when applied; when the key is
    present instead (a lost guard, or a timed-out write read back),
    ``HoldFound`` with what it holds, never a write of the driver's own
    choosing (a late duplicate must never downgrade a COMMITTED record); when
    it is absent after all, ``HoldWriteFailed``.
    """

    az: str
    gang: str
    incarnation: int
    owner_az: str
    priority: int
    submitted_at: float
    nodes: NodeSlice
    commit: bool = False
    replaces: int | None = None

    def record(self) -> Reservation:
        """The record this effect writes (the driver adds its epoch)."""
        return Reservation(
            az=self.az, gang=self.gang, incarnation=self.incarnation,
            state=HoldState.COMMITTED if self.commit else HoldState.PREPARED,
            nodes=self.nodes, two_phase=True, owner_az=self.owner_az,
            priority=self.priority, submitted_at=self.submitted_at,
        )


@dataclass(frozen=True, kw_only=True)
class MarkCommitted(Effect):
    """Set the record's state to COMMITTED, only if it holds ``incarnation``.
    Report ``CommitWritten`` / ``CommitWriteFailed``."""

    az: str
    gang: str
    incarnation: int
    nodes: NodeSlice


@dataclass(frozen=True, kw_only=True)
class ReleaseHold(Effect):
    """Delete ``reservations/<az>/<gang>`` only if it holds ``incarnation``
    (compare on the stored incarnation, never a blind delete: the key may
    already carry the gang's next incarnation). Absent counts as done.
    Report ``HoldReleased`` / ``HoldReleaseFailed``."""

    az: str
    gang: str
    incarnation: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class CreateDecision(Effect):
    """Create ``decisions/<gang>/<incarnation>`` = ``outcome`` if absent
    (txn ``create_revision == 0``); this write is the commit point. Report
    ``DecisionCreated`` with what the key holds afterwards, or
    ``DecisionCreateFailed``. Re-issuing it is always safe."""

    gang: str
    incarnation: int
    outcome: Outcome
    reason: str


@dataclass(frozen=True, kw_only=True)
class WriteAttempt(Effect):
    """Owner: record in ``gangs/<gang>`` that ``incarnation`` is in flight
    with ``plan`` (state RESERVING), only if the stored incarnation is not
    higher. Done *before* any Prepare is sent, so that a new owner leader
    knows which incarnation may have holds out there and never reuses its
    number with a different plan. Report ``AttemptWritten`` /
    ``AttemptWriteFailed``."""

    gang: str
    incarnation: int
    owner_az: str
    priority: int
    submitted_at: float
    plan: Plan


# --------------------------------------------------------------------------
# Effects: messages to peers (CoordinatorPeer RPCs) and replies
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SendPrepare(Effect):
    """``CoordinatorPeer.Prepare`` to the leader of ``to_az`` (possibly our
    own AZ). Best effort: a lost Prepare ends in ``VotesTimedOut``."""

    to_az: str
    gang: str
    incarnation: int
    owner_az: str
    priority: int
    submitted_at: float
    nodes: NodeSlice


@dataclass(frozen=True, kw_only=True)
class SendVote(Effect):
    """Answer a Prepare (the ``PrepareResponse`` of every pending Prepare RPC
    for this (gang, incarnation), or a call back to the owner)."""

    to_az: str
    from_az: str
    gang: str
    incarnation: int
    yes: bool
    reason: str


@dataclass(frozen=True, kw_only=True)
class SendCommit(Effect):
    """``CoordinatorPeer.Commit``. Best effort: participants also learn the
    decision from the watch and, failing that, from their prepare timeout."""

    to_az: str
    gang: str
    incarnation: int


@dataclass(frozen=True, kw_only=True)
class SendAbort(Effect):
    """``CoordinatorPeer.Abort``. Best effort, like ``SendCommit``."""

    to_az: str
    gang: str
    incarnation: int


@dataclass(frozen=True, kw_only=True)
class SendFinish(Effect):
    """Tell ``to_az`` that this incarnation is over, so it releases its
    COMMITTED hold. Best effort: participants also watch ``gangs/``."""

    to_az: str
    gang: str
    incarnation: int


@dataclass(frozen=True, kw_only=True)
class SendDecisionAck(Effect):
    """The ``DecisionResponse`` to a Commit/Abort RPC."""

    to_az: str
    gang: str
    incarnation: int
    applied: bool
    state: str


# --------------------------------------------------------------------------
# Effects: timers, placement, lifecycle, agents
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ScheduleTimeout(Effect):
    """Feed ``event`` back at time ``at`` (same clock as ``now``) to the core
    ``to`` (the one that set the timer). Timers are in memory: a new leader
    re-creates the ones it needs on recovery, and the core ignores a timer
    that is no longer relevant."""

    at: float
    event: Event
    to: Core


@dataclass(frozen=True, kw_only=True)
class DispatchGang(Effect):
    """The record is durably COMMITTED: send the assignments to the agents of
    ``nodes`` (they re-check the record themselves, docs/design.md §9.3)."""

    az: str
    gang: str
    incarnation: int
    nodes: NodeSlice


@dataclass(frozen=True, kw_only=True)
class MarkGangReserved(Effect):
    """Lifecycle: the gang is RESERVED at ``incarnation`` with ``plan``."""

    gang: str
    incarnation: int
    plan: Plan


@dataclass(frozen=True, kw_only=True)
class MarkGangPending(Effect):
    """Lifecycle: the gang waits (PENDING) for the admission cycle to place
    this incarnation; ``reason`` for explain. The driver wakes the cycle: a
    gang that became placeable is placed by the next one, not by a timer."""

    gang: str
    incarnation: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class MarkGangFailed(Effect):
    """Lifecycle: give up admitting the gang (``max_attempts`` exhausted)."""

    gang: str
    incarnation: int
    reason: str


ParticipantEvent = (
    PrepareReceived | HoldWritten | HoldWriteFailed | HoldFound | CommitWritten | CommitWriteFailed
    | HoldReleased | HoldReleaseFailed | CommitReceived | AbortReceived | DecisionObserved
    | DecisionCreated | DecisionCreateFailed | PrepareTimedOut | RetryDue | GangFinished
    | InventoryChanged | GangForgotten | ParticipantRecovered
)
OwnerEvent = (
    GangSubmitted | PlacementMade | AttemptWritten | AttemptWriteFailed
    | VoteReceived | VotesTimedOut | DecisionCreated | DecisionCreateFailed | DecisionObserved
    | RetryDue | GangFinished | OwnerRecovered
)
