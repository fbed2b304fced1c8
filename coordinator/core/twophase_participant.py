"""The participant side of two-phase reservations: one per AZ leader.

Holds the AZ's authoritative device ledger (which gang holds which GPUs and
NICs, PREPARED or COMMITTED), answers Prepare with a vote, learns decisions,
and resolves holds whose owner went quiet (the in-doubt rule). Modelled on
dask's ``WorkerState``: ``handle(event, now)`` mutates this object and
returns effects for the driver; nothing here does I/O or reads a clock.

Rules this module enforces (docs/two-phase.md has the full story):

* a YES vote is sent only after the PREPARED record is durable;
* a hold is dropped from the ledger only when its decision is ABORT (durable,
  learned from the owner, the watch, or our own create-if-absent), its gang
  finished, or its write definitely failed; a COMMITTED hold is dropped only
  when its gang finished; a written PREPARED hold is dropped only once its
  decision is known, even when its gang finished first (``_on_gang_finished``
  says why);
* conflicts are settled by ``ordering.gang_order_key``: an older gang aborts
  a younger gang's undecided hold by winning its decision key, a younger gang
  is refused; a prepare never waits on another gang's progress, only on our
  own create-if-absent write, so nothing can wait in a cycle;
* single-AZ reservations (``PrepareReceived(local=True)``) go through the
  same ledger and order, and are COMMITTED by their own write.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from coordinator.core.ordering import GangOrderKey, gang_order_key, is_older
from coordinator.core.twophase_events import (
    AbortReceived,
    CommitReceived,
    CommitWriteFailed,
    CommitWritten,
    Core,
    CreateDecision,
    DecisionCreateFailed,
    DecisionCreated,
    DecisionObserved,
    DispatchGang,
    Effect,
    Event,
    GangFinished,
    GangForgotten,
    HoldFound,
    HoldReleaseFailed,
    HoldReleased,
    HoldWriteFailed,
    HoldWritten,
    InventoryChanged,
    MarkCommitted,
    ParticipantRecovered,
    PrepareReceived,
    PrepareTimedOut,
    ReleaseHold,
    RetryDue,
    ScheduleTimeout,
    SendDecisionAck,
    SendVote,
    WriteHold,
)
from coordinator.core.twophase_model import (
    DecisionKey,
    Device,
    NodeDevices,
    Outcome,
    TwoPhaseConfig,
    describe_devices,
    normalize_slice,
    slice_devices,
)
from phalanx.reservation import HoldState


@dataclass(frozen=True, kw_only=True)
class Hold:
    """One gang's hold in this AZ: the in-memory twin of
    ``reservations/<az>/<gang>`` (at most one per gang, like the key)."""

    gang: str
    incarnation: int
    owner_az: str
    priority: int
    submitted_at: float
    nodes: Mapping[str, NodeDevices]
    state: HoldState
    """PREPARED until a COMMIT decision is known; COMMITTED from then on,
    even before the COMMITTED record is written (the decision key is what
    makes it committed; the record only follows)."""
    written: bool
    """The durable record holds this incarnation. False between ``WriteHold``
    and ``HoldWritten``: the devices are already claimed in memory so that no
    other prepare can take them meanwhile, but no YES vote has gone out."""
    commit_written: bool = False
    deadline: float | None = None
    """In-doubt deadline of a written, undecided hold; None while our own
    in-doubt ``CreateDecision`` is in flight (so a duplicate timer does not
    issue a second one) and for holds that are not PREPARED+written."""
    local: bool = False
    """Reserved by the single-AZ path: COMMITTED from the start, no decision
    key. A COMMITTED record without a decision key is read back as one."""
    replaces: int | None = None
    """While being written over an older incarnation's record: that
    record's mod revision (``_on_hold_found``). Set once per claim."""

    @property
    def key(self) -> DecisionKey:
        return (self.gang, self.incarnation)

    @property
    def order_key(self) -> GangOrderKey:
        return gang_order_key(self.priority, self.submitted_at, self.gang)

    @property
    def devices(self) -> frozenset[Device]:
        return slice_devices(self.nodes)


@dataclass(frozen=True, kw_only=True)
class ParkedPrepare:
    """A prepare from an older gang that waits for our own create-if-absent
    ABORT on the decision keys in ``waiting_on`` (the younger holds it
    preempts, or its own previous incarnation). While parked it still blocks
    younger gangs from the devices it asked for, so it cannot be starved."""

    prepare: PrepareReceived
    waiting_on: frozenset[DecisionKey]

    @property
    def order_key(self) -> GangOrderKey:
        p = self.prepare
        return gang_order_key(p.priority, p.submitted_at, p.gang)


class ParticipantState:
    """The two-phase participant of one AZ leader.

    Create it empty, feed ``ParticipantRecovered`` (what the new leader read
    from etcd), then every event in arrival order. Not thread-safe; the driver
    serialises calls.
    """

    def __init__(
        self,
        az: str,
        config: TwoPhaseConfig | None = None,
        inventory: Mapping[str, NodeDevices] | None = None,
    ) -> None:
        self.az = az
        self.config = config or TwoPhaseConfig()
        self._inventory: frozenset[Device] | None = (
            None if inventory is None else slice_devices(normalize_slice(inventory))
        )
        self._holds: dict[str, Hold] = {}
        self._known: dict[DecisionKey, Outcome] = {}
        self._highest: dict[str, int] = {}
        self._parked: dict[str, ParkedPrepare] = {}
        # Records this leader still has to delete -> the devices the hold
        # held here, kept taken until the delete commits (None: no hold of
        # that incarnation was held when its release was decided).
        self._releases: dict[DecisionKey, Mapping[str, NodeDevices] | None] = {}
        self._finished: set[DecisionKey] = set()

    # ------------------------------------------------------------------ API

    def handle(self, event: Event, now: float) -> list[Effect]:
        """Apply one event at time ``now``; return the effects to perform, in
        order. Raises ``TypeError`` for an event this role does not handle
        (a driver bug, not a runtime condition)."""
        match event:
            case PrepareReceived():
                return self._on_prepare(event, now)
            case HoldWritten():
                return self._on_hold_written(event, now)
            case HoldWriteFailed():
                return self._on_hold_write_failed(event, now)
            case HoldFound():
                return self._on_hold_found(event, now)
            case CommitWritten():
                return self._on_commit_written(event, now)
            case CommitWriteFailed():
                return self._on_commit_write_failed(event, now)
            case HoldReleased():
                return self._on_hold_released(event, now)
            case HoldReleaseFailed():
                return self._on_hold_release_failed(event, now)
            case CommitReceived():
                return self._on_commit_received(event, now)
            case AbortReceived():
                return self._on_abort_received(event, now)
            case DecisionObserved():
                return self._on_decision_observed(event, now)
            case DecisionCreated():
                return self._on_decision_created(event, now)
            case DecisionCreateFailed():
                return self._on_decision_create_failed(event, now)
            case PrepareTimedOut():
                return self._on_prepare_timed_out(event, now)
            case RetryDue():
                return self._on_retry_due(event, now)
            case GangFinished():
                return self._on_gang_finished(event, now)
            case InventoryChanged():
                return self._on_inventory_changed(event, now)
            case GangForgotten():
                return self._on_gang_forgotten(event, now)
            case ParticipantRecovered():
                return self._on_recovered(event, now)
        raise TypeError(f"participant {self.az}: unexpected event {type(event).__name__}")

    @property
    def holds(self) -> Mapping[str, Hold]:
        """gang -> hold; read-only view for the invariant checker and explain."""
        return MappingProxyType(self._holds)

    @property
    def known_decisions(self) -> Mapping[DecisionKey, Outcome]:
        return MappingProxyType(self._known)

    @property
    def parked(self) -> Mapping[str, ParkedPrepare]:
        return MappingProxyType(self._parked)

    @property
    def pending_releases(self) -> frozenset[DecisionKey]:
        """Records this leader still has to delete (ABORTed or finished)."""
        return frozenset(self._releases)

    @property
    def releasing(self) -> Mapping[DecisionKey, Mapping[str, NodeDevices]]:
        """Holds whose release is decided but whose record delete has not
        committed (``HoldReleased``) -> the devices they held here: still
        taken, so etcd never holds two reservations on one GPU (chaos
        finding 7). Only releases of a hold held here when decided."""
        return MappingProxyType({k: n for k, n in self._releases.items() if n is not None})

    def holder_of(self, device: Device) -> str | None:
        """Which gang holds ``device`` in this AZ's ledger, if any."""
        for hold in self._holds.values():
            if device in hold.devices:
                return hold.gang
        return None

    def held_devices(self) -> dict[Device, str]:
        """Every held device (PREPARED, COMMITTED, or being written) -> gang:
        what placement must treat as taken in this AZ."""
        return {device: hold.gang for hold in self._holds.values() for device in hold.devices}

    def validate(self) -> list[str]:
        """Internal consistency of this ledger (dask ``validate_state``);
        empty when fine. ``twophase_invariants.check`` calls it."""
        problems: list[str] = []
        owner_of: dict[Device, str] = {}
        for gang, hold in self._holds.items():
            if gang != hold.gang:
                problems.append(f"{self.az}: hold filed under {gang} is for {hold.gang}")
            for device in hold.devices:
                other = owner_of.setdefault(device, gang)
                if other != gang:
                    problems.append(
                        f"{self.az}: device {describe_devices([device])} held by {other} and {gang}"
                    )
            known = self._known.get(hold.key)
            if hold.state is HoldState.COMMITTED and known is not Outcome.COMMIT and not hold.local:
                problems.append(f"{self.az}: {hold.key} COMMITTED without a known COMMIT")
            if hold.state is HoldState.PREPARED and known is not None:
                problems.append(f"{self.az}: {hold.key} still PREPARED though {known.value} is known")
            if hold.commit_written and hold.state is not HoldState.COMMITTED:
                problems.append(f"{self.az}: {hold.key} commit written but not committed")
            if hold.key in self._releases:
                problems.append(f"{self.az}: {hold.key} both held and being released")
        for gang, parked in self._parked.items():
            if not parked.waiting_on:
                problems.append(f"{self.az}: prepare of {gang} parked on nothing")
        return problems

    # ----------------------------------------------------------- prepare

    def _on_prepare(self, ev: PrepareReceived, now: float) -> list[Effect]:
        effects: list[Effect] = []
        parked = self._parked.get(ev.gang)
        if parked is not None:
            if parked.prepare.incarnation == ev.incarnation:
                return []  # duplicate; the vote follows when the wait ends
            if parked.prepare.incarnation < ev.incarnation:
                # The owner moved on (its vote timer fired); the old attempt
                # gets its NO so every pending Prepare RPC is answered.
                del self._parked[ev.gang]
                effects.append(self._vote(parked.prepare, False, "superseded by a newer incarnation"))
        effects += self._evaluate(ev)
        return effects

    def _evaluate(self, ev: PrepareReceived) -> list[Effect]:
        """Decide one prepare: vote NO now, park it, or claim and write."""
        gang, inc = ev.gang, ev.incarnation
        highest = self._highest.get(gang, 0)
        if inc < highest:
            return [self._vote(ev, False, f"stale incarnation {inc}: already saw {highest}")]
        # Remember the newest incarnation even if we refuse it: the owner has
        # moved past everything older, so a late prepare of those is stale.
        self._highest[gang] = inc
        if ev.key in self._finished:
            return [self._vote(ev, False, f"incarnation {inc} already finished")]
        known = self._known.get(ev.key)
        hold = self._holds.get(gang)
        if known is Outcome.ABORT:
            return [self._vote(ev, False, f"incarnation {inc} already aborted")]
        if known is Outcome.COMMIT:
            # Only a late duplicate of a prepare we voted YES on can get here.
            held = hold is not None and hold.incarnation == inc
            return [self._vote(ev, held, "already committed" if held else "already decided")]
        if not ev.nodes:
            return [self._vote(ev, False, "empty slice")]
        devices = slice_devices(ev.nodes)
        if self._inventory is not None:
            unknown = devices - self._inventory
            if unknown:
                # The owner's view is stale (node gone, device renamed);
                # refusing is what makes the plan get recomputed.
                return [self._vote(ev, False, f"unknown devices: {describe_devices(unknown)}")]

        waits: set[DecisionKey] = set()
        if hold is not None:
            if hold.incarnation == inc:
                if dict(hold.nodes) != dict(ev.nodes):
                    return [self._vote(ev, False, f"incarnation {inc} was prepared with another slice")]
                # Duplicate: YES again if durable, else the vote follows
                # HoldWritten (answering now would promise an unwritten hold).
                return [self._vote(ev, True, "prepared")] if hold.written else []
            if hold.incarnation > inc:
                return [self._vote(ev, False, f"stale incarnation {inc}: holding {hold.incarnation}")]
            if hold.state is HoldState.COMMITTED:
                return [self._vote(ev, False,
                                   f"gang committed at incarnation {hold.incarnation}; finish it first")]
            # An owner starts incarnation n+1 only once n is decided, so the
            # older hold is dead; but we only learn that by reading its key,
            # and create-if-absent ABORT is the read that is always safe.
            waits.add(hold.key)

        mine = gang_order_key(ev.priority, ev.submitted_at, gang)
        # (order key, gang, overlapping devices); the reason names the oldest.
        committed: list[tuple[GangOrderKey, str, frozenset[Device]]] = []
        older: list[tuple[GangOrderKey, str, frozenset[Device]]] = []
        victims: list[Hold] = []
        for other in self._holds.values():
            if other.gang == gang:
                continue
            overlap = devices & other.devices
            if not overlap:
                continue
            if other.state is HoldState.COMMITTED:
                committed.append((other.order_key, other.gang, overlap))
            elif is_older(other.order_key, mine):
                older.append((other.order_key, other.gang, overlap))
            else:
                victims.append(other)
        for other_parked in self._parked.values():
            if other_parked.prepare.gang == gang or not is_older(other_parked.order_key, mine):
                continue
            overlap = devices & slice_devices(other_parked.prepare.nodes)
            if overlap:
                older.append((other_parked.order_key, other_parked.prepare.gang, overlap))
        if committed:
            _, other_gang, overlap = min(committed, key=lambda c: c[:2])
            return [self._vote(ev, False,
                               f"devices committed to gang {other_gang}: {describe_devices(overlap)}")]
        if older:
            _, other_gang, overlap = min(older, key=lambda c: c[:2])
            return [self._vote(ev, False,
                               f"conflict with older gang {other_gang}: {describe_devices(overlap)}")]

        waits.update(v.key for v in victims)
        if waits:
            self._parked[gang] = ParkedPrepare(prepare=ev, waiting_on=frozenset(waits))
            return [
                CreateDecision(
                    stimulus_id=ev.stimulus_id, gang=g, incarnation=n, outcome=Outcome.ABORT,
                    reason=(f"superseded by incarnation {inc}" if g == gang
                            else f"preempted by older gang {gang}"),
                )
                for g, n in sorted(waits)
            ]
        # A local (single-AZ) reservation is COMMITTED from the moment it is
        # claimed: its write is the commit point, and while it is in flight
        # no older gang may take the devices away from under it.
        self._holds[gang] = Hold(
            gang=gang, incarnation=inc, owner_az=ev.owner_az, priority=ev.priority,
            submitted_at=ev.submitted_at, nodes=ev.nodes,
            state=HoldState.COMMITTED if ev.local else HoldState.PREPARED,
            written=False, local=ev.local,
        )
        return [WriteHold(
            stimulus_id=ev.stimulus_id, az=self.az, gang=gang, incarnation=inc,
            owner_az=ev.owner_az, priority=ev.priority, submitted_at=ev.submitted_at,
            nodes=ev.nodes, commit=ev.local,
        )]

    def _vote(self, ev: PrepareReceived, yes: bool, reason: str) -> SendVote:
        return SendVote(
            stimulus_id=ev.stimulus_id, to_az=ev.owner_az, from_az=self.az,
            gang=ev.gang, incarnation=ev.incarnation, yes=yes, reason=reason,
        )

    # ------------------------------------------------------ store results

    def _on_hold_written(self, ev: HoldWritten, now: float) -> list[Effect]:
        hold = self._holds.get(ev.gang)
        if hold is None or hold.incarnation != ev.incarnation:
            # The attempt was aborted or finished while its write was in
            # flight, and the record has only now appeared: delete it, or it
            # would be stranded (chaos invariant 5).
            self._releases.setdefault(ev.key, None)  # (a duplicate keeps what its release keeps taken)
            return [self._release(ev.stimulus_id, ev.gang, ev.incarnation, "aborted while being written")]
        if hold.written:
            return []
        if hold.local:
            self._holds[ev.gang] = dataclasses.replace(hold, written=True, commit_written=True)
            return [
                SendVote(stimulus_id=ev.stimulus_id, to_az=hold.owner_az, from_az=self.az,
                         gang=ev.gang, incarnation=ev.incarnation, yes=True, reason="reserved"),
                DispatchGang(stimulus_id=ev.stimulus_id, az=self.az, gang=ev.gang,
                             incarnation=ev.incarnation, nodes=hold.nodes),
            ]
        if hold.state is HoldState.COMMITTED:
            # Cannot happen (COMMIT needs our YES, sent after this event), but
            # if it does, the record must still become COMMITTED.
            self._holds[ev.gang] = dataclasses.replace(hold, written=True)
            return [self._mark_committed(ev.stimulus_id, hold)]
        deadline = now + self.config.prepare_timeout_s
        self._holds[ev.gang] = dataclasses.replace(hold, written=True, deadline=deadline)
        return [
            SendVote(stimulus_id=ev.stimulus_id, to_az=hold.owner_az, from_az=self.az,
                     gang=ev.gang, incarnation=ev.incarnation, yes=True, reason="prepared"),
            self._prepare_timer(ev.stimulus_id, hold, deadline),
        ]

    def _on_hold_write_failed(self, ev: HoldWriteFailed, now: float) -> list[Effect]:
        hold = self._holds.get(ev.gang)
        if hold is None or hold.incarnation != ev.incarnation or hold.written:
            return []
        del self._holds[ev.gang]
        return [SendVote(stimulus_id=ev.stimulus_id, to_az=hold.owner_az, from_az=self.az,
                         gang=ev.gang, incarnation=ev.incarnation, yes=False,
                         reason=f"hold not written: {ev.reason}")]

    def _on_hold_found(self, ev: HoldFound, now: float) -> list[Effect]:
        """Our hold write met a record already there: decide what to do
        with it (the driver only reports it)."""
        written = HoldWritten(stimulus_id=ev.stimulus_id, gang=ev.gang, incarnation=ev.incarnation)
        if ev.found == ev.incarnation:
            # Our own write (a timed-out txn that applied, or a duplicate):
            # exactly what HoldWritten means, including for a claim dropped
            # meanwhile (then the record is released).
            return self._on_hold_written(written, now)
        hold = self._holds.get(ev.gang)
        if hold is None or hold.incarnation != ev.incarnation or hold.written:
            return []  # the claim is gone (aborted, finished): nothing was written
        if ev.found is None:
            # It may name devices we do not know of: never overwrite it.
            why = "the stored record cannot be read"
        elif ev.found > ev.incarnation:
            why = f"a newer incarnation {ev.found} is recorded"
        elif hold.replaces is not None:
            # Our replacing write lost its compare and an older record is
            # there again: something else writes this key; let the owner retry.
            why = "record changed concurrently"
        else:
            # An older incarnation's record. Safe to overwrite: at most one
            # hold per gang, and this claim was made only once no older hold
            # of the gang was undecided or COMMITTED in this ledger (an
            # undecided one is ABORTed first, a COMMITTED one refuses), so the
            # record is a dead attempt's whose delete is pending or was lost
            # with an earlier leader. The write compares on its revision, so
            # a concurrent change makes it lose rather than clobber.
            self._holds[ev.gang] = dataclasses.replace(hold, replaces=ev.revision)
            return [WriteHold(
                stimulus_id=ev.stimulus_id, az=self.az, gang=ev.gang, incarnation=ev.incarnation,
                owner_az=hold.owner_az, priority=hold.priority, submitted_at=hold.submitted_at,
                nodes=hold.nodes, commit=hold.local, replaces=ev.revision,
            )]
        return self._on_hold_write_failed(
            HoldWriteFailed(stimulus_id=ev.stimulus_id, gang=ev.gang, incarnation=ev.incarnation, reason=why), now)

    def _on_commit_written(self, ev: CommitWritten, now: float) -> list[Effect]:
        hold = self._holds.get(ev.gang)
        if (hold is None or hold.incarnation != ev.incarnation
                or hold.state is not HoldState.COMMITTED or hold.commit_written):
            return []
        self._holds[ev.gang] = dataclasses.replace(hold, commit_written=True)
        return [DispatchGang(stimulus_id=ev.stimulus_id, az=self.az, gang=ev.gang,
                             incarnation=ev.incarnation, nodes=hold.nodes)]

    def _on_commit_write_failed(self, ev: CommitWriteFailed, now: float) -> list[Effect]:
        hold = self._holds.get(ev.gang)
        if hold is None or hold.incarnation != ev.incarnation or hold.commit_written:
            return []
        return [self._retry_timer(ev.stimulus_id, ev.gang, ev.incarnation, now)]

    def _on_hold_released(self, ev: HoldReleased, now: float) -> list[Effect]:
        self._releases.pop(ev.key, None)
        return []

    def _on_hold_release_failed(self, ev: HoldReleaseFailed, now: float) -> list[Effect]:
        if ev.key not in self._releases:
            return []
        return [self._retry_timer(ev.stimulus_id, ev.gang, ev.incarnation, now)]

    def _on_retry_due(self, ev: RetryDue, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if ev.key in self._releases:
            effects.append(self._release(ev.stimulus_id, ev.gang, ev.incarnation, "retry"))
        hold = self._holds.get(ev.gang)
        if (hold is not None and hold.incarnation == ev.incarnation and hold.written
                and hold.state is HoldState.COMMITTED and not hold.commit_written):
            effects.append(self._mark_committed(ev.stimulus_id, hold))
        return effects

    # ------------------------------------------------------------ decisions

    def _on_commit_received(self, ev: CommitReceived, now: float) -> list[Effect]:
        hold = self._holds.get(ev.gang)
        if hold is None or hold.incarnation != ev.incarnation:
            # Never prepared here (or long gone): refuse rather than invent a
            # hold out of an RPC; the owner's view is what is wrong.
            state = "FINISHED" if ev.key in self._finished else "NOT_PREPARED"
            return [self._ack(ev.stimulus_id, ev.from_az, ev.gang, ev.incarnation, False, state)]
        effects = self._learn(ev.stimulus_id, ev.key, Outcome.COMMIT, now)
        hold = self._holds.get(ev.gang)
        applied = hold is not None and hold.state is HoldState.COMMITTED
        effects.append(self._ack(ev.stimulus_id, ev.from_az, ev.gang, ev.incarnation, applied,
                                 HoldState.COMMITTED.value if applied else "REFUSED"))
        return effects

    def _on_abort_received(self, ev: AbortReceived, now: float) -> list[Effect]:
        hold = self._holds.get(ev.gang)
        held = hold is not None and hold.incarnation == ev.incarnation
        if held and hold is not None and hold.state is HoldState.COMMITTED:
            # Decisions are write-once, so this Abort contradicts the key we
            # learned COMMIT from: never release a committed hold on it.
            return [self._ack(ev.stimulus_id, ev.from_az, ev.gang, ev.incarnation, False,
                              HoldState.COMMITTED.value)]
        # Cached even without a hold: a late duplicate Prepare of this
        # incarnation must then be refused instead of creating a hold.
        effects = self._learn(ev.stimulus_id, ev.key, Outcome.ABORT, now)
        effects.append(self._ack(ev.stimulus_id, ev.from_az, ev.gang, ev.incarnation, held,
                                 "RELEASED" if held else "NOT_HELD"))
        return effects

    def _on_decision_observed(self, ev: DecisionObserved, now: float) -> list[Effect]:
        return self._learn(ev.stimulus_id, ev.key, ev.outcome, now)

    def _on_decision_created(self, ev: DecisionCreated, now: float) -> list[Effect]:
        return self._learn(ev.stimulus_id, ev.key, ev.outcome, now)

    def _on_decision_create_failed(self, ev: DecisionCreateFailed, now: float) -> list[Effect]:
        effects: list[Effect] = []
        hold = self._holds.get(ev.gang)
        if (hold is not None and hold.incarnation == ev.incarnation
                and hold.state is HoldState.PREPARED and hold.written and hold.deadline is None):
            # Our in-doubt ABORT did not reach etcd: try again later. (A
            # failed *preemption* create leaves the victim's own timer alone.)
            deadline = now + self.config.store_retry_s
            self._holds[ev.gang] = dataclasses.replace(hold, deadline=deadline)
            effects.append(self._prepare_timer(ev.stimulus_id, hold, deadline))
        # Prepares parked on this key get NO rather than a retry loop here:
        # their owners back off and retry, which paces a store outage.
        for gang, parked in sorted(self._parked.items(), key=lambda kv: kv[1].order_key):
            if ev.key in parked.waiting_on:
                del self._parked[gang]
                effects.append(self._vote(parked.prepare, False,
                                          f"could not resolve {ev.gang}/{ev.incarnation}: {ev.reason}"))
        return effects

    def _on_prepare_timed_out(self, ev: PrepareTimedOut, now: float) -> list[Effect]:
        hold = self._holds.get(ev.gang)
        if (hold is None or hold.incarnation != ev.incarnation or hold.state is not HoldState.PREPARED
                or not hold.written or hold.deadline is None):
            return []  # decided, gone, or our in-doubt create is already in flight
        if now < hold.deadline:
            return [self._prepare_timer(ev.stimulus_id, hold, hold.deadline)]
        # In doubt (docs/design.md §8.5): the owner may be dead. Create-if-absent
        # ABORT: if the owner already decided, we lose and learn its outcome.
        self._holds[ev.gang] = dataclasses.replace(hold, deadline=None)
        return [CreateDecision(
            stimulus_id=ev.stimulus_id, gang=ev.gang, incarnation=ev.incarnation,
            outcome=Outcome.ABORT,
            reason=f"in doubt: no decision within {self.config.prepare_timeout_s:g}s in {self.az}",
        )]

    def _learn(self, stimulus_id: str, key: DecisionKey, outcome: Outcome, now: float) -> list[Effect]:
        """Record a durable decision and apply it to the ledger and to the
        prepares parked on it. Idempotent."""
        gang, inc = key
        if self._known.setdefault(key, outcome) is not outcome:
            # Decisions are write-once; two outcomes for one key mean a bug
            # elsewhere. Keep the first and let the invariant checker say so.
            return []
        self._highest[gang] = max(self._highest.get(gang, 0), inc)
        effects: list[Effect] = []
        hold = self._holds.get(gang)
        if hold is not None and hold.incarnation == inc and hold.state is HoldState.PREPARED:
            if outcome is Outcome.COMMIT and key not in self._finished:
                committed = dataclasses.replace(hold, state=HoldState.COMMITTED, deadline=None)
                self._holds[gang] = committed
                if committed.written:
                    effects.append(self._mark_committed(stimulus_id, committed))
            else:
                # ABORT, or a COMMIT of an attempt that is already over (the
                # gang record says so): nothing will run on this hold, and
                # now that the key is decided nothing can change that.
                del self._holds[gang]
                if hold.written:
                    self._releases[key] = hold.nodes
                    effects.append(self._release(stimulus_id, gang, inc,
                                                 "aborted" if outcome is Outcome.ABORT else "gang finished"))
                # If the write is still in flight, HoldWritten releases it.
        effects += self._wake_parked(key)
        return effects

    def _wake_parked(self, key: DecisionKey) -> list[Effect]:
        """Re-evaluate, oldest first, the prepares that waited on ``key``."""
        effects: list[Effect] = []
        for gang, parked in sorted(self._parked.items(), key=lambda kv: kv[1].order_key):
            if key not in parked.waiting_on:
                continue
            rest = parked.waiting_on - {key}
            if rest:
                self._parked[gang] = dataclasses.replace(parked, waiting_on=rest)
                continue
            del self._parked[gang]
            effects += self._evaluate(parked.prepare)
        return effects

    # ------------------------------------------------------------ lifecycle

    def _on_gang_finished(self, ev: GangFinished, now: float) -> list[Effect]:
        self._finished.add(ev.key)
        self._highest[ev.gang] = max(self._highest.get(ev.gang, 0), ev.incarnation)
        effects: list[Effect] = []
        parked = self._parked.get(ev.gang)
        if parked is not None and parked.prepare.incarnation <= ev.incarnation:
            del self._parked[ev.gang]
            effects.append(self._vote(parked.prepare, False, "gang finished"))
        hold = self._holds.get(ev.gang)
        if hold is not None and hold.incarnation == ev.incarnation:
            if hold.state is HoldState.PREPARED and hold.written:
                # The one rule for a finished gang's PREPARED hold (the driver
                # feeds this event for it at once, docs/two-phase.md "A
                # finished gang's PREPARED hold"): keep it until its decision
                # is known. Our YES is out, so the owner may still create
                # COMMIT (a gang cancelled while RESERVING) and the other
                # participants act on that key; were the devices given away
                # first, the durable COMMIT would name a slice this AZ no
                # longer holds. Create-if-absent ABORT resolves it now instead
                # of at the in-doubt timeout: we win (the owner learns ABORT)
                # or learn the owner's outcome; either way ``_learn`` releases.
                if hold.deadline is None:
                    return effects  # our create for this key is in flight already
                self._holds[ev.gang] = dataclasses.replace(hold, deadline=None)
                effects.append(self._abort_finished(ev.stimulus_id, hold))
                return effects
            # COMMITTED (the lifecycle has stopped its members), or claimed
            # but not written: no YES went out, so no COMMIT can name it.
            del self._holds[ev.gang]
            if hold.written:
                self._releases[ev.key] = hold.nodes
                effects.append(self._release(ev.stimulus_id, ev.gang, ev.incarnation, "gang finished"))
        return effects

    def _on_inventory_changed(self, ev: InventoryChanged, now: float) -> list[Effect]:
        self._inventory = None if ev.nodes is None else slice_devices(normalize_slice(ev.nodes))
        return []

    def _on_gang_forgotten(self, ev: GangForgotten, now: float) -> list[Effect]:
        gang = ev.gang
        if gang in self._holds or gang in self._parked or any(k[0] == gang for k in self._releases):
            return []  # still in use here: never forget a gang we act on
        for key in [k for k in self._known if k[0] == gang]:
            del self._known[key]
        self._finished = {k for k in self._finished if k[0] != gang}
        self._highest.pop(gang, None)
        return []

    def _on_recovered(self, ev: ParticipantRecovered, now: float) -> list[Effect]:
        """Rebuild the ledger from durable state only; memory of the previous
        term (parked prepares, votes, timers) is gone and need not be
        recovered: owners time out on missing votes and retry."""
        self._holds.clear()
        self._known = {d.key: d.outcome for d in ev.decisions}
        self._finished = set(ev.finished)
        self._parked.clear()
        self._releases.clear()
        self._highest = {}
        for gang, inc in list(self._known) + list(self._finished):
            self._highest[gang] = max(self._highest.get(gang, 0), inc)
        effects: list[Effect] = []
        sid = ev.stimulus_id
        for rec in sorted(ev.reservations, key=lambda r: r.gang):
            if rec.az != self.az:
                continue
            self._highest[rec.gang] = max(self._highest.get(rec.gang, 0), rec.incarnation)
            key = (rec.gang, rec.incarnation)
            decision = self._known.get(key)
            aborted = decision is Outcome.ABORT and rec.state is HoldState.PREPARED
            if key in self._finished and rec.state is HoldState.PREPARED and decision is None:
                # Finished but undecided: the same rule as _on_gang_finished
                # (kept until decided; our ABORT create decides it now).
                hold = Hold(gang=rec.gang, incarnation=rec.incarnation, owner_az=rec.owner_az,
                            priority=rec.priority, submitted_at=rec.submitted_at, nodes=rec.nodes,
                            state=HoldState.PREPARED, written=True)
                self._holds[rec.gang] = hold
                effects.append(self._abort_finished(sid, hold))
                continue
            if key in self._finished or aborted:
                self._releases[key] = None  # (never held by this leadership: read only to delete)
                effects.append(self._release(sid, rec.gang, rec.incarnation,
                                             "finished" if key in self._finished else "aborted"))
                continue
            # A COMMITTED record without a decision key is a single-AZ
            # reservation. One next to an ABORT key should not exist at all;
            # it is kept as committed all the same, because releasing a
            # committed hold whose members may run is the worse mistake (the
            # invariant checker reports it).
            committed = decision is Outcome.COMMIT or rec.state is HoldState.COMMITTED
            hold = Hold(
                gang=rec.gang, incarnation=rec.incarnation, owner_az=rec.owner_az,
                priority=rec.priority, submitted_at=rec.submitted_at, nodes=rec.nodes,
                state=HoldState.COMMITTED if committed else HoldState.PREPARED, written=True,
                commit_written=rec.state is HoldState.COMMITTED,
                local=rec.state is HoldState.COMMITTED and decision is None,
            )
            if not committed:
                # The previous leader's timer is lost; restart it in full
                # rather than trust a timestamp written on another clock.
                deadline = now + self.config.prepare_timeout_s
                hold = dataclasses.replace(hold, deadline=deadline)
                effects.append(self._prepare_timer(sid, hold, deadline))
            elif not hold.commit_written:
                effects.append(self._mark_committed(sid, hold))
            else:
                # The old leader may have died between the COMMITTED write and
                # the dispatch; agents take a repeated assignment as a no-op.
                effects.append(DispatchGang(stimulus_id=sid, az=self.az, gang=rec.gang,
                                            incarnation=rec.incarnation, nodes=rec.nodes))
            self._holds[rec.gang] = hold
        return effects

    # ------------------------------------------------------------- helpers

    def _abort_finished(self, stimulus_id: str, hold: Hold) -> CreateDecision:
        return CreateDecision(
            stimulus_id=stimulus_id, gang=hold.gang, incarnation=hold.incarnation, outcome=Outcome.ABORT,
            reason=f"gang over before {hold.gang}#{hold.incarnation} was decided ({self.az})",
        )

    def _mark_committed(self, stimulus_id: str, hold: Hold) -> MarkCommitted:
        return MarkCommitted(stimulus_id=stimulus_id, az=self.az, gang=hold.gang,
                             incarnation=hold.incarnation, nodes=hold.nodes)

    def _release(self, stimulus_id: str, gang: str, inc: int, reason: str) -> ReleaseHold:
        return ReleaseHold(stimulus_id=stimulus_id, az=self.az, gang=gang, incarnation=inc,
                           reason=reason)

    def _ack(self, stimulus_id: str, to_az: str, gang: str, inc: int, applied: bool,
             state: str) -> SendDecisionAck:
        return SendDecisionAck(stimulus_id=stimulus_id, to_az=to_az, gang=gang,
                               incarnation=inc, applied=applied, state=state)

    def _prepare_timer(self, stimulus_id: str, hold: Hold, at: float) -> ScheduleTimeout:
        return ScheduleTimeout(
            to=Core.PARTICIPANT, stimulus_id=stimulus_id, at=at,
            event=PrepareTimedOut(stimulus_id=f"prepare-timeout:{self.az}:{hold.gang}:{hold.incarnation}",
                                  gang=hold.gang, incarnation=hold.incarnation),
        )

    def _retry_timer(self, stimulus_id: str, gang: str, inc: int, now: float) -> ScheduleTimeout:
        return ScheduleTimeout(
            to=Core.PARTICIPANT, stimulus_id=stimulus_id, at=now + self.config.store_retry_s,
            event=RetryDue(stimulus_id=f"store-retry:{self.az}:{gang}:{inc}",
                           gang=gang, incarnation=inc),
        )
