"""Cross-AZ two-phase reservations (docs/design.md §8) as pure state machines.

This module is the public face; the pieces live in:

* ``twophase_model``       plans, outcomes, durable records, config
* ``twophase_events``      events (past tense) and effects (imperative)
* ``twophase_participant`` ``ParticipantState``: one per AZ leader, its ledger
* ``twophase_owner``       ``OwnerState``: one per gang, run by its owner AZ leader
* ``twophase_invariants``  ``check(WorldSnapshot)``: the invariants as code
* ``ordering``             ``gang_order_key``: the deadlock-free conflict order

A driver (not here) owns the I/O: it turns each effect into an etcd txn, a
CoordinatorPeer RPC or a timer, and feeds what happened back as events::

    effects = participant.handle(PrepareReceived(...), now)
    for effect in effects:
        match effect:
            case WriteHold(): ...   # fenced txn -> HoldWritten / HoldFound / HoldWriteFailed
            case SendVote(): ...    # PrepareResponse
            ...

See docs/two-phase.md for states, rules and invariants.
"""

from __future__ import annotations

from coordinator.core.ordering import GangOrderKey, gang_order_key, is_older
from coordinator.core.twophase_events import (
    AbortReceived,
    AttemptEvent,
    AttemptWriteFailed,
    AttemptWritten,
    CommitReceived,
    CommitWriteFailed,
    CommitWritten,
    Core,
    CreateDecision,
    DecisionCreated,
    DecisionCreateFailed,
    DecisionObserved,
    DispatchGang,
    Effect,
    Event,
    GangFinished,
    GangForgotten,
    GangSubmitted,
    HoldReleased,
    HoldFound,
    HoldReleaseFailed,
    HoldWriteFailed,
    HoldWritten,
    InventoryChanged,
    MarkCommitted,
    MarkGangFailed,
    MarkGangPending,
    MarkGangReserved,
    OwnerEvent,
    OwnerRecovered,
    ParticipantEvent,
    ParticipantRecovered,
    PlacementMade,
    PrepareReceived,
    PrepareTimedOut,
    ReleaseHold,
    RetryDue,
    Routed,
    ScheduleTimeout,
    SendAbort,
    SendCommit,
    SendDecisionAck,
    SendFinish,
    SendPrepare,
    SendVote,
    VoteReceived,
    VotesTimedOut,
    WriteAttempt,
    WriteHold,
)
from coordinator.core.twophase_invariants import (
    InvariantViolated,
    Violation,
    WorldSnapshot,
    assert_invariants,
    check,
)
from coordinator.core.twophase_model import (
    DecisionKey,
    DecisionRecord,
    NodeDevices,
    NodeSlice,
    Outcome,
    Plan,
    TwoPhaseConfig,
    normalize_plan,
    normalize_slice,
)
from coordinator.core.twophase_owner import OwnerPhase, OwnerState
from phalanx.reservation import HoldState, Reservation
from coordinator.core.twophase_participant import Hold, ParkedPrepare, ParticipantState

__all__ = [
    # ordering
    "GangOrderKey", "gang_order_key", "is_older",
    # model
    "DecisionKey", "DecisionRecord", "HoldState", "NodeDevices", "NodeSlice", "Outcome",
    "Plan", "Reservation", "TwoPhaseConfig", "normalize_plan", "normalize_slice",
    # state machines
    "Hold", "ParkedPrepare", "ParticipantState", "OwnerPhase", "OwnerState",
    # invariants
    "InvariantViolated", "Violation", "WorldSnapshot", "assert_invariants", "check",
    # events, and where the driver feeds them
    "Core", "Routed", "Event", "AttemptEvent", "ParticipantEvent", "OwnerEvent",
    "AbortReceived", "AttemptWriteFailed", "AttemptWritten", "CommitReceived",
    "CommitWriteFailed", "CommitWritten", "DecisionCreated", "DecisionCreateFailed",
    "DecisionObserved", "GangFinished", "GangForgotten", "GangSubmitted", "HoldReleased", "HoldReleaseFailed",
    "HoldFound", "HoldWriteFailed", "HoldWritten", "InventoryChanged", "OwnerRecovered",
    "ParticipantRecovered", "PlacementMade", "PrepareReceived",
    "PrepareTimedOut", "RetryDue", "VoteReceived", "VotesTimedOut",
    # effects
    "Effect", "CreateDecision", "DispatchGang", "MarkCommitted", "MarkGangFailed",
    "MarkGangPending", "MarkGangReserved", "ReleaseHold",
    "ScheduleTimeout", "SendAbort", "SendCommit", "SendDecisionAck", "SendFinish",
    "SendPrepare", "SendVote", "WriteAttempt", "WriteHold",
]
