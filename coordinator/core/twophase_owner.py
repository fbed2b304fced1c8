"""The owner side of two-phase reservations: one per gang, run by the leader
of the AZ the gang was submitted to.

wait for the admission cycle to place it -> record the attempt -> prepare
every participant AZ -> collect votes
-> create the decision key (the commit point) -> tell participants -> finish,
or, after an ABORT, back off and retry with a *new* incarnation that keeps the
gang's original priority and submission time (so its place in the conflict
order never gets worse). Placement is not the owner's to ask for: the AZ
leader's admission cycle orders every pending gang it owns, single- and
cross-AZ, in one (priority, submit time, id) order (docs/admission.md) and
feeds ``PlacementMade`` to an UNPLACED owner whose gang it placed. ``handle(event, now)`` mutates this object and
returns effects; no I/O, no clock.

The one rule the participants rely on: an owner never sends Prepare for
incarnation n+1 before ``decisions/<gang>/<n>`` exists (as ABORT). So a
Prepare for n+1 proves that n is dead, and a participant may resolve an older
hold of the same gang by create-if-absent ABORT without asking anyone.
"""

from __future__ import annotations

import enum
from typing import Mapping

from coordinator.core.ordering import GangOrderKey, gang_order_key
from coordinator.core.twophase_events import (
    AttemptWriteFailed,
    AttemptWritten,
    Core,
    CreateDecision,
    DecisionCreateFailed,
    DecisionCreated,
    DecisionObserved,
    Effect,
    Event,
    GangFinished,
    GangSubmitted,
    MarkGangFailed,
    MarkGangPending,
    MarkGangReserved,
    OwnerRecovered,
    PlacementMade,
    RetryDue,
    ScheduleTimeout,
    SendAbort,
    SendCommit,
    SendFinish,
    SendPrepare,
    VoteReceived,
    VotesTimedOut,
    WriteAttempt,
)
from coordinator.core.twophase_model import NodeSlice, Outcome, TwoPhaseConfig


class OwnerPhase(str, enum.Enum):
    """Where one gang's admission stands, for this owner leader."""

    NEW = "NEW"
    UNPLACED = "UNPLACED"        # waits for the admission cycle's PlacementMade
    PERSISTING = "PERSISTING"    # WriteAttempt sent; no Prepare out yet
    PREPARING = "PREPARING"      # Prepares out, collecting votes
    DECIDING = "DECIDING"        # CreateDecision sent, outcome not yet known
    BACKOFF = "BACKOFF"          # ABORTed; next incarnation after RetryDue
    RESERVED = "RESERVED"        # COMMIT: the gang holds its devices
    FINISHED = "FINISHED"        # the committed incarnation is over
    FAILED = "FAILED"            # gave up (max_attempts)

    @property
    def settled(self) -> bool:
        """No timer or reply is needed to make progress from here."""
        return self in (OwnerPhase.NEW, OwnerPhase.UNPLACED, OwnerPhase.RESERVED,
                        OwnerPhase.FINISHED, OwnerPhase.FAILED)


class OwnerState:
    """Admission of one gang through two-phase reservations.

    Start it with ``GangSubmitted`` (a fresh gang, or the next incarnation
    after a restart) or with ``OwnerRecovered`` (a new leader picking up a
    gang it now owns).
    """

    def __init__(
        self,
        gang: str,
        owner_az: str,
        priority: int,
        submitted_at: float,
        config: TwoPhaseConfig | None = None,
    ) -> None:
        self.gang = gang
        self.owner_az = owner_az
        self.priority = priority
        self.submitted_at = submitted_at
        self.config = config or TwoPhaseConfig()
        self.phase = OwnerPhase.NEW
        self.incarnation = 0
        self.plan: Mapping[str, NodeSlice] | None = None
        self.votes: dict[str, bool] = {}
        self.vote_deadline: float | None = None
        self.pending_outcome: Outcome | None = None
        self.decision: Outcome | None = None
        """Decision of the current incarnation, once known."""
        self.attempts = 0
        """ABORTed incarnations in this leader term (bounded by max_attempts)."""
        self.last_reason = ""
        """Why the last attempt ended as it did, for ``explain``."""
        self._decided: dict[int, Outcome] = {}

    # ------------------------------------------------------------------ API

    def handle(self, event: Event, now: float) -> list[Effect]:
        """Apply one event at time ``now``; return the effects to perform, in
        order. Events for another gang are a driver bug (``ValueError``)."""
        gang = getattr(event, "gang", self.gang)
        if gang != self.gang:
            raise ValueError(f"owner of {self.gang} got an event for {gang}")
        match event:
            case GangSubmitted():
                return self._on_submitted(event, now)
            case PlacementMade():
                return self._on_placement_made(event, now)
            case AttemptWritten():
                return self._on_attempt_written(event, now)
            case AttemptWriteFailed():
                return self._on_attempt_write_failed(event, now)
            case VoteReceived():
                return self._on_vote(event, now)
            case VotesTimedOut():
                return self._on_votes_timed_out(event, now)
            case DecisionCreated():
                return self._on_decision_created(event, now)
            case DecisionObserved():
                return self._on_decision_observed(event, now)
            case DecisionCreateFailed():
                return self._on_decision_create_failed(event, now)
            case RetryDue():
                return self._on_retry_due(event, now)
            case GangFinished():
                return self._on_finished(event, now)
            case OwnerRecovered():
                return self._on_recovered(event, now)
        raise TypeError(f"owner of {self.gang}: unexpected event {type(event).__name__}")

    @property
    def order_key(self) -> GangOrderKey:
        return gang_order_key(self.priority, self.submitted_at, self.gang)

    @property
    def participants(self) -> tuple[str, ...]:
        return tuple(sorted(self.plan)) if self.plan else ()

    def known_decisions(self) -> Mapping[int, Outcome]:
        """incarnation -> outcome this owner learned in its term."""
        return dict(self._decided)

    def validate(self) -> list[str]:
        """Internal consistency (empty when fine)."""
        problems: list[str] = []
        needs_plan = (OwnerPhase.PERSISTING, OwnerPhase.PREPARING, OwnerPhase.RESERVED)
        if self.phase in needs_plan and not self.plan:
            problems.append(f"owner {self.gang}: {self.phase.value} without a plan")
        if self.phase is OwnerPhase.RESERVED and self.decision is not Outcome.COMMIT:
            problems.append(f"owner {self.gang}: RESERVED without COMMIT")
        if self.phase is OwnerPhase.BACKOFF and self.decision is not Outcome.ABORT:
            problems.append(f"owner {self.gang}: BACKOFF without ABORT")
        if self.decision is not None and self._decided.get(self.incarnation) is not self.decision:
            problems.append(f"owner {self.gang}: decision not recorded")
        return problems

    # ---------------------------------------------------------- placement

    def _on_submitted(self, ev: GangSubmitted, now: float) -> list[Effect]:
        restartable = (OwnerPhase.NEW, OwnerPhase.FINISHED, OwnerPhase.FAILED)
        if self.phase not in restartable or ev.incarnation <= self.incarnation:
            return []  # duplicate submit, or the gang is already being admitted
        self.attempts = 0
        return self._start_attempt(ev.stimulus_id, ev.incarnation)

    def _start_attempt(self, stimulus_id: str, incarnation: int) -> list[Effect]:
        """Wait for placement at ``incarnation``. No timer: the admission
        cycle places the gang when it is its turn and it fits (each cycle
        runs on a wake: capacity freed, a node registered, another AZ's
        inventory changed), so a gang that does not fit is simply still
        pending and spins on nothing."""
        self.phase = OwnerPhase.UNPLACED
        self.incarnation = incarnation
        self.plan = None
        self.votes = {}
        self.vote_deadline = None
        self.pending_outcome = None
        self.decision = None
        return [MarkGangPending(stimulus_id=stimulus_id, gang=self.gang, incarnation=incarnation,
                                reason="waiting for the admission cycle to place it")]

    def _on_placement_made(self, ev: PlacementMade, now: float) -> list[Effect]:
        if self.phase is not OwnerPhase.UNPLACED or ev.incarnation != self.incarnation:
            return []
        if not ev.plan:
            # A driver bug rather than a shortfall; stay unplaced (no
            # incarnation was recorded or sent, so the number is unused).
            self.last_reason = "placement returned an empty plan"
            return [MarkGangPending(stimulus_id=ev.stimulus_id, gang=self.gang,
                                    incarnation=self.incarnation, reason=self.last_reason)]
        self.plan = ev.plan
        self.phase = OwnerPhase.PERSISTING
        return [self._write_attempt(ev.stimulus_id)]

    def _write_attempt(self, stimulus_id: str) -> WriteAttempt:
        assert self.plan is not None
        return WriteAttempt(stimulus_id=stimulus_id, gang=self.gang, incarnation=self.incarnation,
                            owner_az=self.owner_az, priority=self.priority,
                            submitted_at=self.submitted_at, plan=self.plan)

    def _on_attempt_written(self, ev: AttemptWritten, now: float) -> list[Effect]:
        if self.phase is not OwnerPhase.PERSISTING or ev.incarnation != self.incarnation:
            return []
        assert self.plan is not None
        self.phase = OwnerPhase.PREPARING
        self.vote_deadline = now + self.config.vote_timeout_s
        effects: list[Effect] = [
            SendPrepare(stimulus_id=ev.stimulus_id, to_az=az, gang=self.gang,
                        incarnation=self.incarnation, owner_az=self.owner_az,
                        priority=self.priority, submitted_at=self.submitted_at,
                        nodes=self.plan[az])
            for az in self.participants
        ]
        effects.append(ScheduleTimeout(
            to=Core.OWNER, stimulus_id=ev.stimulus_id, at=self.vote_deadline,
            event=VotesTimedOut(stimulus_id=f"vote-timeout:{self.gang}:{self.incarnation}",
                                gang=self.gang, incarnation=self.incarnation),
        ))
        return effects

    def _on_attempt_write_failed(self, ev: AttemptWriteFailed, now: float) -> list[Effect]:
        if self.phase is not OwnerPhase.PERSISTING or ev.incarnation != self.incarnation:
            return []
        # Definitely not written, so nothing was sent: same incarnation later.
        self.last_reason = f"attempt not recorded: {ev.reason}"
        return [self._retry_timer(ev.stimulus_id, now + self.config.store_retry_s)]

    # -------------------------------------------------------------- votes

    def _on_vote(self, ev: VoteReceived, now: float) -> list[Effect]:
        decided = self._decided.get(ev.incarnation)
        if ev.incarnation != self.incarnation or self.phase is not OwnerPhase.PREPARING:
            # Late vote. A late YES means that participant still holds a
            # PREPARED record: if we know the outcome, say it again so the
            # hold is resolved now rather than at its prepare timeout.
            if ev.yes and decided is not None:
                return [self._send_decision(ev.stimulus_id, ev.from_az, ev.incarnation, decided)]
            return []
        if ev.from_az not in self.participants:
            return []
        if not ev.yes:
            return self._decide(ev.stimulus_id, Outcome.ABORT, f"{ev.from_az} voted NO: {ev.reason}")
        self.votes[ev.from_az] = True
        if all(self.votes.get(az) for az in self.participants):
            return self._decide(ev.stimulus_id, Outcome.COMMIT, "every participant voted YES")
        return []

    def _on_votes_timed_out(self, ev: VotesTimedOut, now: float) -> list[Effect]:
        if self.phase is not OwnerPhase.PREPARING or ev.incarnation != self.incarnation:
            return []
        assert self.vote_deadline is not None
        if now < self.vote_deadline:
            return [ScheduleTimeout(to=Core.OWNER, stimulus_id=ev.stimulus_id, at=self.vote_deadline, event=ev)]
        missing = [az for az in self.participants if not self.votes.get(az)]
        return self._decide(
            ev.stimulus_id, Outcome.ABORT,
            f"no vote from {', '.join(missing)} within {self.config.vote_timeout_s:g}s",
        )

    def _decide(self, stimulus_id: str, outcome: Outcome, reason: str) -> list[Effect]:
        self.phase = OwnerPhase.DECIDING
        self.pending_outcome = outcome
        self.last_reason = reason
        return [CreateDecision(stimulus_id=stimulus_id, gang=self.gang, incarnation=self.incarnation,
                               outcome=outcome, reason=reason)]

    # ---------------------------------------------------------- decisions

    def _on_decision_created(self, ev: DecisionCreated, now: float) -> list[Effect]:
        if not ev.won and ev.incarnation == self.incarnation and ev.outcome is not self.pending_outcome:
            self.last_reason = (f"decision key already held {ev.outcome.value} "
                                "(an in-doubt participant or an older gang decided first)")
        return self._on_decision(ev.stimulus_id, ev.incarnation, ev.outcome, now)

    def _on_decision_observed(self, ev: DecisionObserved, now: float) -> list[Effect]:
        if ev.incarnation == self.incarnation and self.decision is None and ev.outcome is Outcome.ABORT \
                and self.pending_outcome is not Outcome.ABORT:
            self.last_reason = "aborted by a participant (in doubt) or by an older gang"
        return self._on_decision(ev.stimulus_id, ev.incarnation, ev.outcome, now)

    def _on_decision(self, stimulus_id: str, incarnation: int, outcome: Outcome,
                     now: float) -> list[Effect]:
        self._decided.setdefault(incarnation, outcome)
        open_phases = (OwnerPhase.UNPLACED, OwnerPhase.PERSISTING,
                       OwnerPhase.PREPARING, OwnerPhase.DECIDING)
        if incarnation != self.incarnation or self.decision is not None or self.phase not in open_phases:
            return []
        if outcome is Outcome.COMMIT and self.plan is None:
            # Only an incarnation whose attempt (plan) we hold can have been
            # prepared, so this COMMIT is not about our attempt; ignore it
            # rather than reserve nothing. The invariant checker flags it.
            return []
        self.decision = outcome
        self.pending_outcome = None
        self.vote_deadline = None
        if outcome is Outcome.COMMIT:
            self.phase = OwnerPhase.RESERVED
            self.last_reason = "every participant voted YES"
            effects: list[Effect] = [
                SendCommit(stimulus_id=stimulus_id, to_az=az, gang=self.gang, incarnation=incarnation)
                for az in self.participants
            ]
            effects.append(MarkGangReserved(stimulus_id=stimulus_id, gang=self.gang,
                                            incarnation=incarnation, plan=self.plan or {}))
            return effects
        return self._after_abort(stimulus_id, now)

    def _after_abort(self, stimulus_id: str, now: float) -> list[Effect]:
        effects: list[Effect] = [
            SendAbort(stimulus_id=stimulus_id, to_az=az, gang=self.gang, incarnation=self.incarnation)
            for az in self.participants
        ]
        self.attempts += 1
        limit = self.config.max_attempts
        if limit is not None and self.attempts >= limit:
            self.phase = OwnerPhase.FAILED
            effects.append(MarkGangFailed(
                stimulus_id=stimulus_id, gang=self.gang, incarnation=self.incarnation,
                reason=f"gave up after {self.attempts} attempts; last: {self.last_reason}",
            ))
            return effects
        self.phase = OwnerPhase.BACKOFF
        backoff = min(self.config.retry_backoff_s * 2 ** (self.attempts - 1),
                      self.config.retry_backoff_max_s)
        effects.append(self._retry_timer(stimulus_id, now + backoff))
        return effects

    def _on_decision_create_failed(self, ev: DecisionCreateFailed, now: float) -> list[Effect]:
        if self.phase is not OwnerPhase.DECIDING or ev.incarnation != self.incarnation:
            return []
        return [self._retry_timer(ev.stimulus_id, now + self.config.store_retry_s)]

    def _on_retry_due(self, ev: RetryDue, now: float) -> list[Effect]:
        if ev.incarnation != self.incarnation:
            return []
        if self.phase is OwnerPhase.BACKOFF:
            # The decision key of this incarnation exists (ABORT), which is
            # what lets participants treat any older hold of ours as dead.
            return self._start_attempt(ev.stimulus_id, self.incarnation + 1)
        if self.phase is OwnerPhase.PERSISTING:
            return [self._write_attempt(ev.stimulus_id)]
        if self.phase is OwnerPhase.DECIDING and self.pending_outcome is not None:
            return [CreateDecision(stimulus_id=ev.stimulus_id, gang=self.gang,
                                   incarnation=self.incarnation, outcome=self.pending_outcome,
                                   reason=self.last_reason)]
        return []

    # ----------------------------------------------------------- lifecycle

    def _on_finished(self, ev: GangFinished, now: float) -> list[Effect]:
        if self.phase is not OwnerPhase.RESERVED or ev.incarnation != self.incarnation:
            return []
        self.phase = OwnerPhase.FINISHED
        return [SendFinish(stimulus_id=ev.stimulus_id, to_az=az, gang=self.gang, incarnation=ev.incarnation)
                for az in self.participants]

    def _on_recovered(self, ev: OwnerRecovered, now: float) -> list[Effect]:
        """Recovery rule (docs/two-phase.md): a decided incarnation is
        finished as decided; an undecided one is ABORTed (create-if-absent)
        and retried, because the votes lived in the old leader's memory and
        an abort costs one retry, never correctness."""
        sid = ev.stimulus_id
        self.attempts = 0
        self._decided = {}
        self.votes = {}
        self.vote_deadline = None
        self.pending_outcome = None
        self.decision = None
        self.incarnation = ev.incarnation
        self.plan = ev.plan
        if ev.plan is None:
            # No attempt was ever recorded, so no Prepare for it was ever
            # sent: the recorded number (or 1) is still unused.
            return self._start_attempt(sid, max(ev.incarnation, 1))
        if ev.decision is not None:
            self._decided[ev.incarnation] = ev.decision
            self.decision = ev.decision
        if ev.finished:
            self.phase = OwnerPhase.FINISHED
            # Re-drive cleanup: a participant may have missed the first one.
            return [SendFinish(stimulus_id=sid, to_az=az, gang=self.gang, incarnation=ev.incarnation)
                    for az in self.participants]
        if ev.decision is Outcome.COMMIT:
            self.phase = OwnerPhase.RESERVED
            effects: list[Effect] = [
                SendCommit(stimulus_id=sid, to_az=az, gang=self.gang, incarnation=ev.incarnation)
                for az in self.participants
            ]
            effects.append(MarkGangReserved(stimulus_id=sid, gang=self.gang,
                                            incarnation=ev.incarnation, plan=ev.plan))
            return effects
        if ev.decision is Outcome.ABORT:
            self.last_reason = "recovered an ABORTed attempt"
            return self._after_abort(sid, now)
        return self._decide(sid, Outcome.ABORT, "owner leader changed before the decision")

    # ------------------------------------------------------------- helpers

    def _send_decision(self, stimulus_id: str, az: str, incarnation: int, outcome: Outcome) -> Effect:
        if outcome is Outcome.COMMIT:
            return SendCommit(stimulus_id=stimulus_id, to_az=az, gang=self.gang, incarnation=incarnation)
        return SendAbort(stimulus_id=stimulus_id, to_az=az, gang=self.gang, incarnation=incarnation)

    def _retry_timer(self, stimulus_id: str, at: float) -> ScheduleTimeout:
        return ScheduleTimeout(
            to=Core.OWNER, stimulus_id=stimulus_id, at=at,
            event=RetryDue(stimulus_id=f"owner-retry:{self.gang}:{self.incarnation}",
                           gang=self.gang, incarnation=self.incarnation),
        )


__all__ = ["OwnerPhase", "OwnerState"]
