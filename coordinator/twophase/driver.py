"""The driver of two-phase (cross-AZ) reservations (docs/two-phase.md).

One ``TwoPhaseDriver`` per leadership. It owns the AZ's ``ParticipantState``
and one ``OwnerState`` per cross-AZ gang this leader owns, performs their
effects and feeds the results back as events:

- store effects are fenced etcd txns (``Store.fenced_txn``); ``CreateDecision``
  is ``Store.create_if_absent`` (anyone may create a decision key: the first
  writer wins);
- ``SendPrepare`` / ``SendCommit`` / ``SendAbort`` are CoordinatorPeer RPCs to
  the leader found in ``leader/<az>``, with deadlines; the owner's own AZ is
  handled in-process;
- ``ScheduleTimeout`` is a task of the leadership that sleeps, then feeds the
  event (the leader's stop cancels it);
- one watch on the cluster root feeds ``DecisionObserved`` (``decisions/``),
  gang ends (``gangs/``: participants release their holds without the
  owner), member summaries (``members/``: the owner's run-time view) and
  leader keys (``leader/``: owner-AZ loss).

One ledger per AZ: the leader's single-AZ ``DeviceLedger`` and the
participant's holds are checked against each other. Placement of single-AZ
gangs subtracts every participant hold (PREPARED and COMMITTED); a Prepare
whose slice touches a device of a single-AZ reservation is answered NO before
it reaches the participant core ("devices committed to single-AZ gang X",
``prepare_no_vote`` in coordinator/core/peer_calls.py, asked by
coordinator/peer_calls.py) — exactly what the core answers for a ``local`` COMMITTED hold, which is never
preempted. Both checks and both claims happen synchronously on one event loop,
so no device can be granted twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Sequence

import grpc
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, stop_after_delay, wait_incrementing

from coordinator.core import events as ev
from coordinator.core.admission import spans_azs
from coordinator.core import capacity, cross_az_members, progress
from coordinator.core import gang_effects as fx
from coordinator.core.owner_lifecycle import StartOwner, owner_steps
from coordinator.core.effect_lines import effect_line
from coordinator.core.placement import FabricIndex, NodeView, Placement
from coordinator.core.records import UNREADABLE, GangRecord, MemberAssignment, MemberSummary, NodeRecord, read_records
from coordinator.core.twophase import (
    AbortReceived,
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
    DecisionRecord,
    DispatchGang,
    Effect,
    Event,
    GangFinished,
    GangForgotten,
    GangSubmitted,
    HoldFound,
    HoldReleased,
    HoldReleaseFailed,
    HoldWriteFailed,
    HoldWritten,
    MarkCommitted,
    MarkGangFailed,
    MarkGangPending,
    MarkGangReserved,
    Outcome,
    OwnerPhase,
    OwnerRecovered,
    OwnerState,
    ParticipantRecovered,
    PlacementMade,
    PrepareReceived,
    ReleaseHold,
    Routed,
    ScheduleTimeout,
    SendAbort,
    SendCommit,
    SendDecisionAck,
    SendFinish,
    SendPrepare,
    SendVote,
    VoteReceived,
    WriteAttempt,
    WriteHold,
)
from coordinator.election import observe
from coordinator.peer_calls import PeerCalls
from coordinator.book import Book, two_phase_config
from coordinator.gang_writer import GangWriter
from coordinator.leadership import Leadership, RunTime
from phalanx.store import Compacted, Compare, Delete, Get, Put, StoreUnavailable, absent, unchanged_since
from phalanx.reservation import HoldState, Reservation
from phalanx import failpoints
from phalanx.agent_messages import Revoke
from phalanx.errors import Conflict, NotLeader
from phalanx.logfmt import bind_event, log_context
from phalanx.model import GangState, MemberPhase
from phalanx.topology import NodeTopology
from phalanx.v1 import peer_pb2, peer_pb2_grpc

log = logging.getLogger(__name__)


def _decision(kv: Any, gang: str, incarnation: int) -> DecisionRecord:
    """The decision ``kv`` holds for (gang, incarnation); raises BadRecord
    (a ValueError) when it cannot be read."""
    return DecisionRecord.from_dict(kv.json(), gang=gang, incarnation=incarnation)


def _stored(kv: Any) -> Reservation | None:
    """A reservation record read back; None when it cannot be read (the
    rebuild logged it; its devices stay held: records.holds_for_unreadable)."""
    try:
        return Reservation.from_dict(kv.json(), kv.mod_revision)
    except UNREADABLE:
        return None


# What _commit_with_reserved did: the COMMIT and RESERVED written in one txn,
# not written (a lost compare, or not tried), or unknown (the reply was lost).
FOLDED, NOT_FOLDED, FOLD_UNKNOWN = "folded", "not folded", "fold unknown"


def _reserving(kv: Any) -> bool:
    """Whether a gang record's stored bytes say RESERVING: only such a
    record lets a Prepare be checked from the watch, so only those are kept
    (the watch sees every gang of the cluster; keeping all of them would hold
    the whole ``gangs/`` prefix in memory for the retention period). The
    store writes compact JSON (phalanx/store.py), so a RESERVING record holds
    exactly these bytes; a user string cannot fake them (its quotes are
    escaped), and a nested match only keeps a record that the check parses
    anyway. A record left out takes the etcd read, as before."""
    return b'"state":"RESERVING"' in kv.value


def _plan_of(g: GangRecord) -> dict[str, dict[str, tuple[list[int], list[str]]]]:
    plan: dict[str, dict[str, tuple[list[int], list[str]]]] = {}
    for m in g.placement:
        gpus, nics = plan.setdefault(m.az, {}).setdefault(m.node, ([], []))
        gpus.extend(m.gpus)
        nics.extend(m.nics)
    return plan


class TwoPhaseDriver:
    def __init__(self, lead: Leadership, book: Book, writer: GangWriter, run_time: RunTime, peer_channel: Any = None):
        self.lead = lead
        self.writer = writer  # every gang-record write goes through it
        self.run_time = run_time  # what this driver asks of the leader (coordinator/leadership.py)
        self.az = lead.az
        self.store = lead.store
        self.keys = lead.keys
        # Every state of the protocol (the cores, the holds being released,
        # other AZs as watched, ...) is in the leadership's book; this driver
        # keeps only its I/O: futures of calls waiting for a vote or an ack,
        # the peer-address cache, writes in flight, cadences.
        self.book = book
        self.cfg = two_phase_config(lead.timings)
        self.peer_channel = peer_channel
        self.peers = PeerCalls(self)  # the participant side of the peer calls
        self._leaders: dict[str, Any] = {}  # az -> LeaderInfo (peer address cache)
        self._last_eval = 0.0
        self._publishing: set[tuple[str, int]] = set()  # member summaries being written
        self._last_leader_poll = 0.0
        self.revision = 0
        # (gang, inc) -> MarkGangReserved that arrived while the COMMIT+RESERVED
        # txn was in flight (None: none yet): _commit_with_reserved.
        self._folding: dict[tuple[str, int], MarkGangReserved | None] = {}
        self.etcd_requests: dict[str, int] = {}  # gang -> etcd requests made for it (bench/admission.py)
        # gang -> how many of those were a peer call's check read because the
        # watch did not show the attempt or the decision yet (a lagging watch).
        self.check_reads: dict[str, int] = {}

    # ------------------------------------------------------------ helpers
    def _rt(self, gang: str, n: int = 1, check: bool = False) -> None:
        """Count ``n`` etcd requests made for ``gang``; ``check``: a peer
        call's check read, taken because the watch was behind."""
        self.etcd_requests[gang] = self.etcd_requests.get(gang, 0) + n
        if check:
            self.check_reads[gang] = self.check_reads.get(gang, 0) + n

    def _report_requests(self, gang: str, inc: int, role: str) -> None:
        n = self.etcd_requests.pop(gang, 0)
        checks = self.check_reads.pop(gang, 0)
        auth = self.peers.auth_reads.pop(gang, 0)
        log.info("two-phase etcd-requests gang=%s inc=%d az=%s role=%s n=%d check_reads=%d auth_reads=%d",
                 gang, inc, self.az, role, n, checks, auth)

    def now(self) -> float:
        return self.lead.mono()

    def _spawn(self, coro: Any, name: str) -> None:
        self.lead.spawn(coro, name)

    def feed(self, *routed: Routed) -> None:
        """The one feed loop: each event goes to its core(s), and what they
        decide is performed; what comes of each effect is fed back here as
        ``Routed`` events (``_performed``). Every stimulus (an RPC, the watch, a
        timer, the admission cycle, recovery) enters through this method."""
        for r in routed:
            if self.lead.stopped.is_set():
                return
            if Core.PARTICIPANT in r.to:
                self.perform(self._participant_decides(r.event))
            if Core.OWNER in r.to:
                o = self.book.owners.get(getattr(r.event, "gang", ""))
                if o is not None:
                    self.perform(o.handle(r.event, self.now()))

    def _participant_decides(self, ev: Event) -> list[Effect]:
        # (a hold whose release is decided stays taken until its delete
        # commits: Book.participant_decides)
        return self.book.participant_decides(ev, self.now())

    def perform(self, effects: Sequence[Effect]) -> None:
        """Perform what a core decided. The effects without I/O take effect
        here, in order, before the feed returns: a vote or an ack answers
        the call waiting for it, a timer is set, a gang's pending reason is
        noted. Each effect with I/O is a task that ``handle`` performs and
        whose result is fed back; an attempt's Prepares go out together as
        one task."""
        prepares = [e for e in effects if isinstance(e, SendPrepare)]
        if prepares:
            self._spawn(self._send_prepares(prepares), f"prepare-{prepares[0].gang}")
        for e in effects:
            # One line per effect, under the stimulus that caused it: INFO
            # for those that change state, DEBUG for the chatty ones
            # (coordinator/core/effect_lines.py, docs/logging.md "Effects").
            level, what = effect_line(e)
            if log.isEnabledFor(level):
                with log_context(gang=getattr(e, "gang", None) or None, incarnation=getattr(e, "incarnation", None),
                                 stimulus=getattr(e, "stimulus_id", None) or None):
                    log.log(level, "two-phase %s: %s", self.az, what)
            match e:
                case SendPrepare():
                    pass
                case ScheduleTimeout():
                    self._schedule(e)
                case SendVote():
                    self.peers.voted(e)
                case SendDecisionAck():
                    self.peers.acked(e)
                case SendFinish():
                    pass  # participants learn the end from the gangs/ watch
                case MarkGangPending():
                    # The owner waits for placement: the next admission
                    # cycle places it (one order with single-AZ gangs).
                    self.book.waiting(e.gang, e.reason)
                    self.lead.wake.set()
                case _:
                    self._spawn(self._performed(e), f"{type(e).__name__}-{getattr(e, 'gang', '')}")

    def _schedule(self, e: ScheduleTimeout) -> None:
        # A task of the leadership, not a bare loop timer: the leader's stop
        # cancels it with the rest, so no timer outlives the leadership.
        self._spawn(self._fire(e), f"timer-{type(e.event).__name__}-{e.event.gang}")

    async def _fire(self, e: ScheduleTimeout) -> None:
        await asyncio.sleep(max(0.0, e.at - self.now()))
        self.feed(Routed(e.event, frozenset({e.to})))

    async def _performed(self, e: Effect) -> None:
        """Perform an effect with I/O and feed back what came of it."""
        bind_event(e)  # this effect's task: its lines name the gang and the stimulus that caused it
        self.feed(*await self.handle(e))

    async def handle(self, e: Effect) -> list[Routed]:
        """The handler of a protocol effect with I/O: do it, and return what
        came of it with the core(s) it goes to (``_performed`` feeds it)."""
        match e:
            case WriteHold():
                return await self._write_hold(e)
            case MarkCommitted():
                return await self._mark_committed(e)
            case ReleaseHold():
                return await self._release_hold(e)
            case CreateDecision():
                return await self._create_decision(e)
            case WriteAttempt():
                return await self._write_attempt(e)
            case SendPrepare():
                return await self._prepare(e)
            case SendCommit() | SendAbort():
                return await self._send_decision(e)
            case DispatchGang():
                await self._dispatch(e)
            case MarkGangReserved():
                await self._mark_reserved(e)
            case MarkGangFailed():
                g = self.book.gangs.get(e.gang)
                if g is not None and not g.state.terminal:
                    # A gang effect: the leader's gang-effect interpreter
                    # performs it (docs/design.md §19.9).
                    done = await self.run_time.perform(fx.Finish(g, GangState.FAILED, e.reason, stimulus_id=e.stimulus_id))
                    if isinstance(done, fx.WriteRefused):
                        log.info("gang %s: not failed (%s): %s", e.gang, e.reason, done.why)
            case _:
                raise TypeError(f"TwoPhaseDriver.handle: {type(e).__name__} has no I/O to perform")
        return []

    # ------------------------------------------------------- store effects
    async def _read(self, key: str, gang: str = "") -> Any:
        """A read retried briefly (a read is safe to repeat), never past the
        lease TTL; a leader that still cannot read steps down."""
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(StoreUnavailable),
                stop=stop_after_attempt(5) | stop_after_delay(self.lead.timings.lease_ttl_s),
                wait=wait_incrementing(start=self.lead.timings.store_retry_pause_s, increment=self.lead.timings.store_retry_pause_s),
                reraise=True,
            ):
                with attempt:
                    self._rt(gang)
                    return await self.store.get(key)
        except StoreUnavailable:
            pass
        raise NotLeader(f"{self.az}: cannot read {key}; stepping down")

    async def _fenced(self, compares: list, ops: list, failure: list = (), gang: str = "") -> Any:
        """A fenced txn; None when its outcome is unknown (timeout)."""
        self.lead.check_valid()
        try:
            self._rt(gang)
            return await self.store.fenced_txn(self.lead.fence, compares, ops, list(failure))
        except StoreUnavailable:
            return None

    def _record(self, e: WriteHold) -> Reservation:
        return dataclasses.replace(e.record(), epoch=self.lead.epoch)

    async def _write_hold(self, e: WriteHold) -> list[Routed]:
        """Write the hold under the guard the core chose (absent, or
        unchanged since ``e.replaces``); what is found instead goes back to
        the core as ``HoldFound`` (it decides whether to overwrite)."""
        key = self.keys.reservation(self.az, e.gang)
        rec = self._record(e)
        guard = absent(key) if e.replaces is None else unchanged_since(key, e.replaces)
        res = await self._fenced([guard], [Put(key, rec.to_dict())], [Get(key)], gang=e.gang)
        if res is not None and res.succeeded:
            self.book.hold_written(e.gang, e.incarnation, res.revision)
            await failpoints.hit("participant.after_prepared")
            return [Routed.participant(HoldWritten(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation))]
        if res is None:  # outcome unknown: read it back
            kv = await self._read(key, e.gang)
        else:
            kv = res.results[0][0] if res.results[0] else None
        if kv is None:
            return [Routed.participant(HoldWriteFailed(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                                       reason="write timed out" if res is None else "raced with another write"))]
        cur = _stored(kv)
        if cur is not None and cur.incarnation == e.incarnation:
            await failpoints.hit("participant.after_prepared")  # a PREPARED record of ours is durable
        return [Routed.participant(HoldFound(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                             found=cur.incarnation if cur is not None else None, revision=kv.mod_revision))]

    async def _mark_committed(self, e: MarkCommitted) -> list[Routed]:
        key = self.keys.reservation(self.az, e.gang)
        rev = self.book.hold_committing(e.gang, e.incarnation)
        if rev is not None:
            # Our own PREPARED write, unchanged since: commit it without a read.
            rec = Reservation(self.az, e.gang, e.incarnation, HoldState.COMMITTED, e.nodes, self.lead.epoch)
            hold = self.book.participant.holds.get(e.gang)
            if hold is not None and hold.incarnation == e.incarnation:
                rec = dataclasses.replace(rec, two_phase=True, owner_az=hold.owner_az, priority=hold.priority,
                                          submitted_at=hold.submitted_at)
                res = await self._fenced([unchanged_since(key, rev)], [Put(key, rec.to_dict())], gang=e.gang)
                if res is not None and res.succeeded:
                    return [Routed.participant(CommitWritten(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation))]
        kv = await self._read(key, e.gang)
        cur = _stored(kv) if kv is not None else None
        if cur is None or cur.incarnation != e.incarnation:
            return [Routed.participant(CommitWriteFailed(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                                         reason="record is not this incarnation"))]
        if cur.state is HoldState.COMMITTED:
            return [Routed.participant(CommitWritten(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation))]
        committed = dataclasses.replace(cur, state=HoldState.COMMITTED, epoch=self.lead.epoch)
        res = await self._fenced([unchanged_since(key, kv.mod_revision)], [Put(key, committed.to_dict())], gang=e.gang)
        if res is not None and res.succeeded:
            return [Routed.participant(CommitWritten(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation))]
        else:
            return [Routed.participant(CommitWriteFailed(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                                         reason="record changed or write timed out"))]

    async def _release_hold(self, e: ReleaseHold) -> list[Routed]:
        key = self.keys.reservation(self.az, e.gang)
        kv = await self._read(key, e.gang)
        cur = _stored(kv) if kv is not None else None
        if kv is not None and cur is None:
            # A record we cannot read: it may name these devices, so they stay
            # held (safety before liveness) and the release is retried until
            # an operator repairs or deletes the key.
            return [Routed.participant(HoldReleaseFailed(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                                         reason="the stored record cannot be read"))]
        if cur is None or cur.incarnation != e.incarnation:
            return [Routed.participant(HoldReleased(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation))]
        ops: list = [Delete(key)]
        msum = self.keys.member_summary(e.gang, self.az)
        ops.append(Delete(msum))
        res = await self._fenced([unchanged_since(key, kv.mod_revision)], ops, gang=e.gang)
        self.lead.wake.set()  # released or not, the cycle looks again
        if res is not None and res.succeeded:
            self.book.hold_released(e.gang, e.incarnation)
            log.info("two-phase %s: released hold of %s#%d (%s)", self.az, e.gang, e.incarnation, e.reason)
            return [Routed.participant(HoldReleased(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation))]
        else:
            return [Routed.participant(HoldReleaseFailed(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                                         reason="record changed or delete timed out"))]

    async def _create_decision(self, e: CreateDecision) -> list[Routed]:
        key = self.keys.decision(e.gang, e.incarnation)
        value = DecisionRecord(gang=e.gang, incarnation=e.incarnation, outcome=e.outcome, by=self.az,
                               reason=e.reason).to_dict()
        fold = NOT_FOLDED
        if e.outcome is Outcome.COMMIT and not failpoints.on("twophase.decision_overwrite"):
            fold = await self._commit_with_reserved(e, key, value)
        if fold == FOLDED:
            won, kv = True, None
        else:
            try:
                self._rt(e.gang)
                if failpoints.on("twophase.decision_overwrite"):  # a planted bug for the chaos checker: a plain Put
                    won, kv = True, (await self.store.txn([], [Put(key, value), Get(key)])).results[-1][0]
                else:
                    won, kv = await self.store.create_if_absent(key, value)
            except StoreUnavailable as exc:
                kv = await self._read(key, e.gang)
                if kv is None:
                    ev = DecisionCreateFailed(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                              reason=str(exc))
                    return [Routed.both(ev)]
                won = False  # unknown whether ours; what the key holds is what counts
        outcome = e.outcome if kv is None else _decision(kv, e.gang, e.incarnation).outcome
        # A folded COMMIT whose reply was lost may have applied: then the
        # create above found our own COMMIT (only an owner writes COMMIT, and
        # the record names who did). Counted and logged as decided here; the
        # cores are told what the create saw.
        ours = won or (fold == FOLD_UNKNOWN and outcome is Outcome.COMMIT and kv is not None
                       and _decision(kv, e.gang, e.incarnation).by == self.az)
        if ours:
            log.info("two-phase %s: decided %s#%d = %s (%s)", self.az, e.gang, e.incarnation, outcome.value, e.reason)
            self.lead.metrics.twophase_decided(outcome.value, e.reason)
            if e.gang in self.book.owners:
                await failpoints.hit("owner.after_decide")
        return [Routed.both(DecisionCreated(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                            won=won, outcome=outcome))]

    async def _commit_with_reserved(self, e: CreateDecision, key: str, value: dict) -> str:
        """The owner's COMMIT and its gang's RESERVED record in one fenced
        txn: the decision key's create-if-absent (``absent(key)``) plus the
        gang write guarded by the record's revision. Only while this leader
        owns the gang, its record is RESERVING at this incarnation and no
        other write of it is in flight. FOLDED when written; NOT_FOLDED when it
        did not apply (a lost compare: the key exists or the gang record
        moved; or not tried), FOLD_UNKNOWN when it may have (a timeout): then
        the decision is created alone as before, which reports what the key
        holds, and MarkGangReserved writes the record (or finds it written). One write less per admission; the
        one-decision rule is unchanged (the key is still created at most
        once), only a deposed owner can no longer create COMMIT this way."""
        g = self.book.gangs.get(e.gang)
        if (e.gang not in self.book.owners or g is None or g.incarnation != e.incarnation
                or g.state != GangState.RESERVING or self.writer.busy(g.id)):
            return NOT_FOLDED
        new, events = self._reserved(g)
        # The watch may show the COMMIT (and the owner emit MarkGangReserved)
        # before this write's reply is back: _mark_reserved leaves it here.
        self._folding[(e.gang, e.incarnation)] = None
        try:
            with self.writer.acting_on(g.id):
                self._rt(e.gang)
                await self.writer.write(new, g, ops=[Put(key, value)], compares=[absent(key)], events=events)
            done = FOLDED
        except (Conflict, StoreUnavailable) as exc:
            log.info("two-phase %s: COMMIT of %s#%d not written with its RESERVED record (%s); creating it alone",
                     self.az, e.gang, e.incarnation, exc)
            done = FOLD_UNKNOWN if isinstance(exc, StoreUnavailable) else NOT_FOLDED
        finally:
            # Whatever ends the write (a lost leadership too), no later
            # MarkGangReserved may stay parked behind it.
            deferred = self._folding.pop((e.gang, e.incarnation), None)
        if deferred is not None:
            await self._mark_reserved(deferred)
        return done

    def _reserved(self, g: GangRecord) -> tuple[GangRecord, list]:
        """The RESERVED record of ``g`` and its event."""
        reason = "committed in every AZ of its plan"
        reserved = ev.reserved(self.lead.wall(), self.lead.epoch, g.incarnation,
                               f"{reason} ({', '.join(sorted({m.az for m in g.placement}))})")
        return g.evolve(state=GangState.RESERVED, reason=reason, updated_at=self.lead.wall()), [reserved]

    async def _write_attempt(self, e: WriteAttempt) -> list[Routed]:
        g = self.book.gangs.get(e.gang)
        p = self.book.placements.get((e.gang, e.incarnation))
        if g is None or g.state.terminal:
            # Cancelled (or ended) before this attempt was recorded: nothing
            # was sent for it, so no participant holds anything for it. The
            # owner ends here; retrying would loop for the rest of the
            # leadership and its plan would keep devices out of every view.
            log.info("two-phase %s: %s ended before its attempt #%d was recorded; its owner stops", self.az, e.gang,
                     e.incarnation)
            self.book.owner_ended(e.gang)
            self.lead.wake.set()
            return []
        if p is None:
            return [Routed.owner(AttemptWriteFailed(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                                    reason="gang or plan gone"))]
        if g.incarnation > e.incarnation:
            return [Routed.owner(AttemptWriteFailed(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                                    reason=f"gang already at incarnation {g.incarnation}"))]
        placement = tuple(MemberAssignment(m.rank, m.az, m.node, tuple(m.gpus), tuple(m.nics)) for m in p.members)
        try:
            # The rendezvous goes into the record with the placement: every
            # AZ's leader dispatches its members from this record.
            addr, port = self.run_time.rendezvous_for(g, e.incarnation, placement, await self._node_record(placement[0].az, placement[0].node))
            new = g.evolve(state=GangState.RESERVING, incarnation=e.incarnation, placement=placement, span=p.span,
                           reason=f"two-phase reservation across {', '.join(sorted(p.azs()))}", updated_at=self.lead.wall(),
                           master_addr=addr, master_port=port)
            self._rt(e.gang)
            placed = ev.placed(self.lead.wall(), self.lead.epoch, e.incarnation, placement,
                               f"two-phase across {', '.join(sorted(p.azs()))}: {p.reason}")
            await failpoints.hit("owner.before_attempt_write")
            await self.writer.write(new, g, events=[placed])
        except (Conflict, StoreUnavailable) as exc:
            return [Routed.owner(AttemptWriteFailed(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                                    reason=str(exc)))]
        finally:
            self.run_time.rendezvous_settled(e.gang)
        return [Routed.owner(AttemptWritten(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation))]

    async def _mark_reserved(self, e: MarkGangReserved) -> None:
        if (e.gang, e.incarnation) in self._folding:
            self._folding[(e.gang, e.incarnation)] = e  # the folded write in flight finishes it
            return
        g = self.book.gangs.get(e.gang)
        if g is None or g.incarnation != e.incarnation or g.state not in (GangState.RESERVING, GangState.RESERVED):
            return
        written = g  # RESERVED already: written with the COMMIT (_commit_with_reserved)
        if g.state == GangState.RESERVING:
            try:
                new, events = self._reserved(g)
                with self.writer.acting_on(g.id):
                    self._rt(e.gang)
                    written = await self.writer.write(new, g, events=events)
            except Conflict as exc:
                log.info("gang %s: %s", e.gang, exc)
                cur = self.book.gangs.get(e.gang)  # (the gang writer keeps what it found)
                if cur is None or cur.incarnation != e.incarnation or cur.state != GangState.RESERVED:
                    return
                written = cur  # our folded write applied though its reply was lost
        self._report_requests(e.gang, e.incarnation, "owner")
        self.book.placed(e.gang)
        self._spawn(self.run_time.perform(fx.MarkStarting(written, stimulus_id=e.stimulus_id)), f"starting-{e.gang}")

    # -------------------------------------------------------------- peers
    async def _peer_call(self, az: str, gang: str, method: str, req: Any) -> Any:
        """One CoordinatorPeer call to the leader of ``az``. Its address is
        cached from ``leader/<az>``; a failed call drops it, and a call that
        finds the cached address dead (UNAVAILABLE) is retried once at a
        freshly read one. Returns None when the AZ has no leader."""
        if self.peer_channel is None:
            return None
        for attempt in (0, 1):
            info = self._leaders.get(az)
            cached = info is not None
            if info is None:
                info = await observe(self.store, az)
                self._rt(gang)
                if info is None:
                    return None
                self._leaders[az] = info
            stub = peer_pb2_grpc.CoordinatorPeerStub(self.peer_channel(info.address))
            try:
                return await getattr(stub, method)(req, timeout=self.cfg.vote_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED):
                    self._leaders.pop(az, None)
                if cached and attempt == 0 and exc.code() == grpc.StatusCode.UNAVAILABLE:
                    continue
                raise
        return None

    def identity(self) -> Any:
        return peer_pb2.PeerIdentity(az=self.az, epoch=self.lead.epoch, coordinator_id=self.lead.info.coordinator_id)

    async def _send_prepares(self, prepares: list[SendPrepare]) -> None:
        """Every Prepare of an attempt at once, each performed by
        ``handle``; once all are answered (or timed out), the votes go to
        the owner (a peer that did not answer is left to the vote timer)."""
        bind_event(prepares[0])
        results = await asyncio.gather(*(self.handle(p) for p in prepares), return_exceptions=True)
        await failpoints.hit("owner.after_prepare")
        votes = []
        for r in results:
            if isinstance(r, NotLeader):
                raise r
            if isinstance(r, list):
                votes.extend(r)
        self.feed(*votes)

    async def _prepare(self, p: SendPrepare) -> list[Routed]:
        """One Prepare; its vote for the owner, or nothing if none came."""
        r = await self._prepare_one(p)
        if r is None:
            return []
        yes, reason = r
        return [Routed.owner(VoteReceived(stimulus_id=p.stimulus_id, gang=p.gang, incarnation=p.incarnation,
                                          from_az=p.to_az, yes=yes, reason=reason))]

    async def _prepare_one(self, p: SendPrepare) -> tuple[bool, str] | None:
        if p.to_az == self.az:
            ev = PrepareReceived(stimulus_id=p.stimulus_id, gang=p.gang, incarnation=p.incarnation, owner_az=p.owner_az,
                                 priority=p.priority, submitted_at=p.submitted_at, nodes=p.nodes)
            try:
                return await asyncio.wait_for(self.peers.local_prepare(ev), self.cfg.vote_timeout_s)
            except asyncio.TimeoutError:
                return None
        req = peer_pb2.PrepareRequest(
            caller=self.identity(), gang=p.gang, incarnation=p.incarnation, priority=p.priority,
            submitted_at=p.submitted_at,
            nodes=[peer_pb2.NodeDevices(node=n, gpus=list(g), nics=list(c)) for n, (g, c) in p.nodes.items()],
        )
        try:
            resp = await self._peer_call(p.to_az, p.gang, "Prepare", req)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED):
                return False, f"{p.to_az} refused: {exc.details()}"
            log.info("prepare %s#%d -> %s: %s", p.gang, p.incarnation, p.to_az, exc.code().name)
            return None
        if resp is None:
            return None  # no leader there: the vote timer decides
        return resp.vote == peer_pb2.VOTE_YES, resp.reason

    async def _send_decision(self, e: SendCommit | SendAbort) -> list[Routed]:
        if e.to_az == self.az:
            cls = CommitReceived if isinstance(e, SendCommit) else AbortReceived
            return [Routed.participant(cls(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation, from_az=self.az))]
        req = peer_pb2.DecisionRequest(caller=self.identity(), gang=e.gang, incarnation=e.incarnation)
        try:
            await self._peer_call(e.to_az, e.gang, "Commit" if isinstance(e, SendCommit) else "Abort", req)
        except grpc.aio.AioRpcError as exc:
            log.info("%s %s#%d -> %s: %s %s", type(e).__name__, e.gang, e.incarnation, e.to_az, exc.code().name, exc.details())
        return []

    # ------------------------------------------------ what the peer calls use
    @property
    def epoch(self) -> int:
        return self.lead.epoch

    def node_connected(self, node: str) -> bool:
        """Whether ``node``'s agent has a live session with this leader."""
        return self.run_time.node_connected(node)

    @property
    def vote_timeout_s(self) -> float:
        return self.cfg.vote_timeout_s

    def count_request(self, gang: str, check: bool = False) -> None:
        """Count one etcd request made for ``gang`` (a peer call's check read: ``check``)."""
        self._rt(gang, check=check)

    # --------------------------------------------------------- placement
    def awaits_placement(self, g: GangRecord) -> bool:
        """Whether the admission cycle places ``g`` now: a cross-AZ gang
        whose owner waits for the placement of an attempt (UNPLACED: fresh,
        recovered, or the next incarnation after an aborted one's backoff)."""
        o = self.book.owners.get(g.id)
        return (o is not None and o.phase is OwnerPhase.UNPLACED and o.incarnation >= g.incarnation
                and g.state in (GangState.PENDING, GangState.RESERVING))

    def place_attempt(self, g: GangRecord, placement: Placement, stimulus_id: str) -> None:
        """The cycle reserved ``placement`` for cross-AZ gang ``g``: its
        two-phase attempt starts now with it (the cycle has taken its
        devices from the free view; attempt_devices keeps them out of later
        cycles' views until the holds show)."""
        o = self.book.owners.get(g.id)
        if o is None or o.phase is not OwnerPhase.UNPLACED:
            return
        self.book.attempt_placed(g.id, o.incarnation, placement)
        self.feed(Routed.owner(PlacementMade(stimulus_id=stimulus_id, gang=g.id, incarnation=o.incarnation,
                                             plan=placement.by_az())))

    def last_reason(self, gang: str) -> str:
        """Why the gang's last two-phase attempt ended as it did ("" if none)."""
        o = self.book.owners.get(gang)
        return o.last_reason if o is not None else ""

    def attempt_devices(self) -> dict[capacity.NodeKey, Any]:
        """(az, node) -> devices of the attempts this leader's owners placed
        and have not ended. The cycle that placed one took them from its
        free view; later cycles must not see them free either before the
        holds show (this AZ's participant hold is written only after the
        attempt record, other AZs' reach the watch later still). Where the
        holds already show, the two overlap, which costs nothing."""
        live = (OwnerPhase.PERSISTING, OwnerPhase.PREPARING, OwnerPhase.DECIDING, OwnerPhase.RESERVED)
        return capacity.held((az, nodes) for gang, o in self.book.owners.items() if o.phase in live and o.plan
                             and (o.phase is not OwnerPhase.PERSISTING or self._gang_goes_on(gang))
                             for az, nodes in o.plan.items())

    def _gang_goes_on(self, gang: str) -> bool:
        """The leader still holds the gang and it has not ended. An owner
        still PERSISTING has sent nothing, so for an ended gang it keeps
        nothing; later phases keep their plan until the owner settles (a
        prepare may be on its way)."""
        g = self.book.gangs.get(gang)
        return g is not None and not g.state.terminal

    @property
    def remote_version(self) -> int:
        """Changes when another AZ's registered nodes do (never-fits memo)."""
        return self.book.remote.version

    def other_azs_view(self) -> Sequence[NodeView]:
        """Other AZs' nodes from the watched records (no etcd request; cached
        until they change): every device minus every reservation there, of
        any state; ready only while the node's record says so and its AZ has
        a leader (an AZ without one cannot vote). Possibly stale, which the
        participants' ledgers catch."""
        return self.book.remote.view()

    def other_azs_registered(self) -> list[NodeTopology]:
        """Every other AZ's registered node that can take work, for never-fits."""
        return list(self.book.remote.registered())

    def placement_index(self, local: FabricIndex) -> FabricIndex:
        """``local`` joined with the other AZs' node facts: the index for a
        cycle that places over every AZ (kept until either side changes)."""
        return self.book.remote.placement_index(local)

    async def snapshot(self) -> tuple[list[NodeView], list[NodeTopology], set[str]]:
        """For explain: the global view cross-AZ gangs are placed on (this
        AZ's live view, other AZs' from the watch; nodes that cannot be
        placed on come as not ready, so shortfalls count them), every
        registered node's topology in every AZ (for never-fits), and the AZs
        that have a leader now. No etcd request."""
        views = list(self.run_time.placeable_nodes())
        placeable = {v.name for v in views}
        views += [NodeView(topology=n.topology, free_gpus=frozenset(), free_nics=frozenset(), ready=False)
                  for name, n in self.book.nodes.items() if name not in placeable and capacity.takes_work(n)]
        views += self.other_azs_view()
        registered = self.run_time.registered_topologies() + self.other_azs_registered()
        return views, registered, set(self.book.remote.led) | {self.az}

    # ------------------------------------------------------------ dispatch
    async def _node_record(self, az: str, node: str) -> NodeRecord | None:
        """A node's record: this AZ's from the leader's view, another AZ's
        from the watched records, else from etcd (the rank-0 node's address
        and ports, for the rendezvous)."""
        if az == self.az:
            return self.book.nodes.get(node)
        cached = self.book.remote.node(az, node)
        if cached is not None:
            return cached
        kv = await self.store.get(self.keys.node(az, node))
        return NodeRecord.from_dict(kv.json()) if kv is not None else None

    async def _gang(self, gang: str) -> GangRecord | None:
        g = self.book.known_gang(gang)
        if g is None:
            kv = await self._read(self.keys.gang(gang), gang)
            if kv is None:
                return None
            g = GangRecord.from_dict(kv.json(), kv.mod_revision)
            self.book.gang_cached(g)
        return g

    async def _dispatch(self, e: DispatchGang) -> None:
        bind_event(e)
        g = await self._gang(e.gang)
        self._report_requests(e.gang, e.incarnation, "participant")
        if g is None or g.incarnation != e.incarnation or g.state.terminal or g.state == GangState.RESTARTING:
            g2 = await self._fresh_gang(e.gang)
            if g2 is None or g2.incarnation != e.incarnation:
                return
            g = g2
            if g.state.terminal or g.state == GangState.RESTARTING:
                self._maybe_finish(g)
                return
        log.info("two-phase %s: dispatching %s#%d to %s", self.az, g.id, g.incarnation, sorted(e.nodes))
        await self.run_time.perform(fx.SendAssignments(g, stimulus_id=e.stimulus_id))

    async def on_register(self, node: str, reported: dict[tuple[str, int], set[int]]) -> None:
        """An agent (re)connected: members of committed cross-AZ holds on its
        node that it does not run and that never finished are (re)sent; the
        dispatch may have gone out while it was away (e.g. right after a
        leader change)."""
        for gang, hold in list(self.book.participant.holds.items()):
            if hold.state is not HoldState.COMMITTED or node not in hold.nodes:
                continue
            g = await self._gang(gang)
            if g is None or g.incarnation != hold.incarnation or g.state.terminal or g.state == GangState.RESTARTING:
                continue
            skip = cross_az_members.to_send_again(g, node, reported.get((gang, hold.incarnation), ()),
                                                  self.book.local_reports.get((gang, hold.incarnation), {}))
            if skip is not None:
                await self.run_time.perform(fx.SendAssignments(g, only_node=node, skip_ranks=skip))

    async def _fresh_gang(self, gang: str) -> GangRecord | None:
        kv = await self._read(self.keys.gang(gang))
        if kv is None:
            return None
        g = GangRecord.from_dict(kv.json(), kv.mod_revision)
        self.book.gang_cached(g)
        return g

    # --------------------------------------------------------- members
    def owns_members(self, gang: str, incarnation: int) -> bool:
        h = self.book.participant.holds.get(gang)
        return h is not None and h.incarnation == incarnation and h.state is HoldState.COMMITTED

    async def on_member(self, node: str, m: Any) -> None:
        """A member of a two-phase gang reported to this AZ's leader: keep it
        and publish this AZ's summary for the owner (members/<gang>/<az>)."""
        rep = progress.MemberReport(MemberPhase(m.phase), m.exit_code, m.reason, node)
        if not self.book.local_member_reported(m.gang, m.incarnation, m.rank, rep):
            return
        self._spawn(self._publish_members(m.gang, m.incarnation), f"members-{m.gang}")
        g = self.book.gang_cache.get(m.gang) or self.book.gangs.get(m.gang)
        if g is not None:
            self._maybe_finish(g)

    async def on_node_lost(self, node: str, reason: str) -> None:
        """A node of this AZ is past its fence deadline: its members of
        committed cross-AZ holds are gone; tell their owners."""
        log.debug("two-phase %s: node %s lost: %s", self.az, node, reason)
        for gang, hold in list(self.book.participant.holds.items()):
            if hold.state is not HoldState.COMMITTED or node not in hold.nodes:
                continue
            g = await self._gang(gang)
            if g is None or g.incarnation != hold.incarnation:
                continue
            reps = self.book.local_reports.get((gang, hold.incarnation), {})
            stopped = cross_az_members.lost_members(g, node, self.az, reps, reason)
            self.book.local_members_reported(gang, hold.incarnation, stopped)
            if stopped:
                log.info("two-phase %s: members of %s#%d on %s are gone: %s", self.az, gang, hold.incarnation, node, reason)
                self._maybe_finish(g)
            await self._publish_members(gang, hold.incarnation)

    def _summary(self, gang: str, inc: int) -> MemberSummary:
        return MemberSummary.of(inc, self.az, self.book.local_reports.get((gang, inc), {}))

    async def _publish_members(self, gang: str, inc: int) -> None:
        """Write this AZ's summary of (gang, inc) unless already written.
        Runs as a leader task (``on_member`` spawns it): an agent stream that
        closes right after its last report must not cancel the write. The
        leader's tick re-publishes any summary whose write did not land."""
        key_ = (gang, inc)
        # Only while our hold of this incarnation exists (no summary outlives it).
        hold = self.book.participant.holds.get(gang)
        if hold is None or hold.incarnation != inc or key_ in self._publishing:
            return
        body = self._summary(gang, inc)
        if self.book.published.get(key_) == body:
            return
        self._publishing.add(key_)
        try:
            # Only while our hold's record exists in etcd too: a publish that
            # lands after the hold's release would leave an orphan summary,
            # which nobody deletes and which keeps the gang from ever being
            # collected (docs/etcd-keys.md "Retention").
            held = Compare(self.keys.reservation(self.az, gang), "version", ">", 0)
            res = await self._fenced([held], [Put(self.keys.member_summary(gang, self.az), body.to_dict())])
        finally:
            self._publishing.discard(key_)
        if res is None:
            log.info("member summary of %s in %s: write timed out", gang, self.az)
            return
        if not res.succeeded:
            log.info("member summary of %s in %s not written: the hold is released", gang, self.az)
            return
        self.book.summary_published(gang, inc, body)
        if self._summary(gang, inc) != body:
            self._spawn(self._publish_members(gang, inc), f"members-{gang}")  # changed meanwhile

    def on_member_summary(self, gang: str, summary: MemberSummary) -> None:
        """Owner side: a participant's summary arrived on the watch."""
        g = self.book.gangs.get(gang)
        if g is None or summary.incarnation != g.incarnation:
            return
        self.book.members_reported(gang, g.incarnation, summary.members)
        self._spawn(self.run_time.evaluate(gang), f"evaluate-{gang}")

    # --------------------------------------------------------- finishing
    def _maybe_finish(self, g: GangRecord) -> None:
        """Participant: the gang record may say the held incarnation is over;
        do what ``cross_az_members.hold_over`` decides (revoke our members,
        wait for them, publish how they ended, then GangFinished)."""
        hold = self.book.participant.holds.get(g.id)
        if hold is None:
            return
        inc, key_, now = hold.incarnation, (g.id, hold.incarnation), self.now()
        # A PREPARED hold dispatched nothing here (members start only on a
        # COMMITTED record); the core keeps it until its decision is known
        # and decides it then (one rule, ParticipantState._on_gang_finished;
        # docs/two-phase.md).
        step = cross_az_members.hold_over(
            g, az=self.az, incarnation=inc, prepared=hold.state is HoldState.PREPARED,
            told=key_ in self.book.finished_fed, revoked_at=self.book.revoked_at.get(key_),
            reports=self.book.local_reports.get(key_, {}), published=self.book.published.get(key_), now=now,
            replace_after_s=self.lead.timings.replace_after_s)
        if step is None:
            return
        if step.revoke:
            self.book.hold_revoked(g.id, inc, now)
            for node in hold.nodes:
                self.run_time.send(node, Revoke(g.id, inc, g.reason or "gang over"))
        if step.stopped:
            # Past the fence deadline: whatever did not report is gone (its
            # agent has stopped it); say so, so that the owner stops waiting.
            self.book.local_members_reported(g.id, inc, step.stopped)
        if step.publish:
            self._spawn(self._publish_members(g.id, inc), f"members-{g.id}")
        elif step.finish:
            self.book.finish_fed(g.id, inc)
            self.feed(Routed.participant(GangFinished(stimulus_id=f"gang-over:{g.id}:{inc}", gang=g.id, incarnation=inc)))

    # -------------------------------------------------------------- watch
    async def recover(self) -> None:
        """Rebuild the participant (and owners) from etcd alone."""
        k = self.keys
        # One snapshot, read in pages at one revision (docs/limits.md "Paged
        # reads"): no range reply grows with the number of gangs. Records
        # that cannot be read are skipped (the rebuild has logged them).
        rev = await self.store.revision()
        all_res_kvs, _ = await self.store.get_prefix_paged(k.reservations(), revision=rev)
        dec_kvs, _ = await self.store.get_prefix_paged(k.decisions(), revision=rev)
        gang_kvs, _ = await self.store.get_prefix_paged(k.gangs(), revision=rev)
        sum_kvs, _ = await self.store.get_prefix_paged(k.member_summaries(), revision=rev)
        # Other AZs' nodes, reservations and leaders: the admission cycle's
        # global view, kept from the watch from here on (other_azs_view).
        node_kvs, _ = await self.store.get_prefix_paged(k.nodes(), revision=rev)
        leader_kvs, _ = await self.store.get_prefix_paged(k.leaders(), revision=rev)
        self.revision = rev
        self.book.watched_reset({kv.key[len(k.gangs()):]: kv for kv in gang_kvs if _reserving(kv)})
        mine = k.reservations(self.az)
        res_kvs = [kv for kv in all_res_kvs if kv.key.startswith(mine)]
        if self.book.remote.reset(node_kvs, all_res_kvs, leader_kvs):  # (skips this AZ's records; keeps every epoch)
            self.lead.wake.set()
        gangs = {g.id: g for g in read_records(gang_kvs, GangRecord.from_dict)[0]}
        for g in gangs.values():
            if not g.state.terminal and g.owner_az != self.az:
                self.book.remote.watch_for_loss(g.owner_az)
        decisions = []
        for kv in dec_kvs:
            try:
                decisions.append(_decision(kv, *DecisionRecord.key_of(kv.key[len(k.decisions()):])))
            except UNREADABLE as exc:
                # Skipped, as before: the key still exists, so nobody can
                # decide this attempt otherwise (create-if-absent).
                log.warning("two-phase recovery in %s: skipped unreadable decision %s: %r", self.az, kv.key[:200], exc)
        records, finished = [], []
        for r in read_records(res_kvs, Reservation.from_dict)[0]:
            if not r.two_phase or r.state is HoldState.RELEASING:
                continue  # the leader's (a release is its business, not the participant's)
            records.append(r)
            g = gangs.get(r.gang)
            if g is None or g.incarnation > r.incarnation or (g.incarnation == r.incarnation and g.state.terminal):
                finished.append((r.gang, r.incarnation))
            elif g is not None:
                self.book.gang_cached(g)
        self.feed(Routed.participant(ParticipantRecovered(stimulus_id=f"recover:{self.az}:{self.lead.epoch}", reservations=records,
                                                          decisions=decisions, finished=finished)))
        # Member summaries of this AZ (the agents will re-report anyway).
        for kv in sum_kvs:
            try:
                summary = MemberSummary.from_dict(kv.json())
                gang = kv.key.rsplit("/", 2)[-2]
                if summary.az == self.az:
                    self.book.summary_recovered(gang, summary.incarnation, summary)
                else:
                    self.on_member_summary(gang, summary)
            except UNREADABLE as exc:
                log.warning("two-phase recovery in %s: skipped unreadable member summary %s: %r", self.az, kv.key[:200], exc)
        # RESTARTING / terminal gangs whose holds we still keep.
        for g in list(self.book.gang_cache.values()):
            self._maybe_finish(g)
        self.book.decisions_recovered(decisions)

    def start_owner(self, g: GangRecord) -> None:
        """Cycle: a two-phase gang we own that no OwnerState drives yet."""
        o = OwnerState(g.id, self.az, g.spec.priority, g.submitted_at, self.cfg)
        self.book.owner_started(o)
        if g.state == GangState.PENDING:
            self.feed(Routed.owner(GangSubmitted(stimulus_id=f"submit:{g.id}:{g.incarnation}", gang=g.id, incarnation=g.incarnation)))
            return
        plan = _plan_of(g) if g.placement else None
        decision = self.book.dec_by_key.get((g.id, g.incarnation))
        self._spawn(self._recover_owner(g, plan, decision), f"owner-recover-{g.id}")

    async def _recover_owner(self, g: GangRecord, plan: Any, decision: Outcome | None) -> None:
        kv = await self._read(self.keys.decision(g.id, g.incarnation))
        if kv is not None:
            decision = _decision(kv, g.id, g.incarnation).outcome
        finished = g.state.terminal or g.state == GangState.RESTARTING
        if g.state in (GangState.RESERVING,) and plan is not None:
            # Rebuild the Placement for the ranks (WriteAttempt is not
            # re-issued for this incarnation, but MarkGangReserved needs none).
            pass
        self.feed(Routed.owner(OwnerRecovered(stimulus_id=f"owner-recover:{g.id}:{self.lead.epoch}", gang=g.id,
                                              incarnation=g.incarnation, plan=plan, decision=decision, finished=finished)))

    def tick(self) -> None:
        """Called from the leader's cycle, before its admission plan: owners
        for new cross-AZ gangs (they then wait, UNPLACED, for that plan to
        place them: no placement of their own, no retry timer; the
        admission timeout is the plan's rule 1, as for every gang)."""
        now = self.now()
        for step in owner_steps(list(self.book.gangs.values()), self.book.owners):
            if isinstance(step, StartOwner):
                self.start_owner(step.gang)
            else:
                self.feed(step)
        if now - self._last_eval > self.lead.timings.member_evaluate_interval_s:
            # Member summaries may arrive while a write of the gang is in
            # flight (then _evaluate skips them): re-evaluate owned cross-AZ
            # gangs periodically; it writes only on a transition.
            self._last_eval = now
            for g in list(self.book.gangs.values()):
                if spans_azs(g) and not self.writer.busy(g.id) and g.state not in (GangState.PENDING, GangState.RESERVING):
                    self._spawn(self.run_time.evaluate(g.id), f"evaluate-{g.id}")
        for gang, o in list(self.book.owners.items()):
            if gang not in self.book.gangs and o.phase.settled:
                # Ended (or adopted elsewhere) and nothing in flight: forget it.
                self.book.owner_forgotten(gang)
        for g in list(self.book.gang_cache.values()):
            self._maybe_finish(g)
        for (gang, inc) in list(self.book.local_reports):
            if self.book.published.get((gang, inc)) != self._summary(gang, inc) and (gang, inc) not in self._publishing:
                hold = self.book.participant.holds.get(gang)
                if hold is not None and hold.incarnation == inc:
                    self._spawn(self._publish_members(gang, inc), f"members-{gang}")

    async def watch(self) -> None:
        """One watch on the cluster root from the recovery revision."""
        rev = self.revision + 1
        while not self.lead.stopped.is_set():
            try:
                async for batch in self.store.watch_prefix(self.keys.root, rev):
                    for ev in batch:
                        rev = max(rev, ev.revision + 1)
                        try:
                            # A watch event is a stimulus (its etcd revision
                            # names it): what this leader does on it logs it.
                            with log_context(stimulus=f"watch:{ev.revision}"):
                                self._on_watch(ev)
                        except (NotLeader, asyncio.CancelledError):
                            raise
                        except Exception:  # noqa: BLE001 - one bad record must not stop the watch
                            log.exception("two-phase watch: cannot handle %s", ev.kv.key)
            except Compacted:
                log.warning("two-phase watch compacted; other AZs' inventory read again, resuming from now")
                # Events in between are lost: peer calls are checked against
                # etcd again until the watch has refilled these.
                self.book.watched_reset({})
                self.book.remote.on_compacted()
                while True:
                    try:
                        rev = (await self._reread_other_azs()) + 1
                        break
                    except StoreUnavailable as exc:
                        log.info("two-phase watch: cannot read other AZs' inventory (%s); retrying", exc)
                        await asyncio.sleep(self.lead.timings.store_retry_pause_s)
            except StoreUnavailable as exc:
                log.info("two-phase watch broke (%s); resuming from %d", exc, rev)
                await asyncio.sleep(self.lead.timings.store_retry_pause_s)

    def _on_watch(self, ev: Any) -> None:
        k = self.keys
        key = ev.kv.key
        if key.startswith(k.decisions()) and ev.kind == "put":
            try:
                gang, inc = DecisionRecord.key_of(key[len(k.decisions()):])
                outcome = _decision(ev.kv, gang, inc).outcome
            except UNREADABLE as exc:
                log.warning("two-phase watch: skipped unreadable decision %s: %r", key[:200], exc)
                return
            de = DecisionObserved(stimulus_id=f"watch:{ev.revision}", gang=gang, incarnation=inc, outcome=outcome)
            self.feed(Routed.both(de))
        elif key.startswith(k.gangs()):
            gang = key[len(k.gangs()):]
            if ev.kind == "delete":
                # Collected by its owner past gang_retention_s (with its
                # decision keys, whose deletes this watch ignores).
                self.book.gang_watched(gang, None)
                self.forget(gang)
                return
            # (kept while RESERVING, for a Prepare's check; parsed only then)
            self.book.gang_watched(gang, ev.kv if _reserving(ev.kv) else None)
            mine = self.book.gangs.get(gang)
            if mine is None and gang not in self.book.participant.holds and gang not in self.book.gang_cache:
                return  # (parse only the gangs this leader cares about)
            g = GangRecord.from_dict(ev.kv.json(), ev.kv.mod_revision)
            if mine is not None and g.owner_az != self.az and mine.owner_az == self.az:
                # Adopted by another AZ (owner-AZ loss): stop owning it here.
                log.warning("gang %s is now owned by %s", gang, g.owner_az)
                self.book.adopted_elsewhere(gang)
            if gang in self.book.participant.holds or gang in self.book.gang_cache:
                self.book.gang_cached(g)
                self._maybe_finish(g)
        elif key.startswith(k.member_summaries()) and ev.kind == "put":
            gang = key[len(k.member_summaries()):].split("/", 1)[0]
            if gang in self.book.gangs:
                self.on_member_summary(gang, MemberSummary.from_dict(ev.kv.json()))
        elif key.startswith(k.leaders()):
            az = key[len(k.leaders()):]
            if self.book.remote.on_leader(az, ev.kv if ev.kind == "put" else None, self.now()):
                self.lead.wake.set()  # its nodes may be placed on again
        elif key.startswith(k.nodes()):
            if self.book.remote.on_node(key, ev.kv if ev.kind == "put" else None):
                self.lead.wake.set()
        elif key.startswith(k.reservations()):
            if self.book.remote.on_reservation(key, ev.kv if ev.kind == "put" else None):
                self.lead.wake.set()

    # ------------------------------------------------- other AZs' inventory
    async def _reread_other_azs(self) -> int:
        """After a compacted watch: the events in between are lost, so read
        other AZs' nodes, reservations and leaders again (RemoteInventory
        keeps them); returns the revision read at (the watch resumes after
        it)."""
        k = self.keys
        rev = await self.store.revision()
        node_kvs, _ = await self.store.get_prefix_paged(k.nodes(), revision=rev)
        res_kvs, _ = await self.store.get_prefix_paged(k.reservations(), revision=rev)
        leader_kvs, _ = await self.store.get_prefix_paged(k.leaders(), revision=rev)
        # The reset also restores the epochs peer calls are checked against,
        # as of ``rev`` (the watch resumes after it, as after recover()); the
        # gangs' records refill from the watch, since an attempt's write
        # precedes its Prepare.
        if self.book.remote.reset(node_kvs, res_kvs, leader_kvs):
            self.lead.wake.set()
        return rev

    def forget(self, gang: str) -> None:
        """``gangs/<gang>`` was deleted (retention): drop what this leader
        remembers of it, participant and owner side. A gang still held here,
        or whose owner state is not settled, is kept (the collector never
        deletes a held gang; this is the belt to its braces)."""
        if gang in self.book.participant.holds or gang in self.book.participant.parked:
            return
        o = self.book.owners.get(gang)
        if o is not None and not o.phase.settled:
            return
        self.feed(Routed.participant(GangForgotten(stimulus_id=f"collected:{gang}", gang=gang)))
        self.book.forget_cross_az(gang)
        self.etcd_requests.pop(gang, None)
        self.check_reads.pop(gang, None)
        self.peers.auth_reads.pop(gang, None)

    # ------------------------------------------------------ owner-AZ loss
    async def adopt_orphans(self) -> None:
        """Adopt PENDING gangs of AZs that have had no leader for
        ``owner_adopt_after_s`` (fenced txn guarded by the gang record's
        mod_revision: at most one leader wins each gang)."""
        now = self.now()
        if now - self._last_leader_poll < self.lead.timings.owner_loss_poll_s:
            return
        self._last_leader_poll = now
        kvs, _ = await self.store.get_prefix(self.keys.leaders())
        self.book.remote.on_leaders_polled((kv.key[len(self.keys.leaders()):] for kv in kvs), now)
        orphaned = self.book.remote.orphaned(now, self.lead.timings.owner_adopt_after_s)
        if not orphaned:
            return
        gkvs, _ = await self.store.get_prefix_paged(self.keys.gangs())
        for g in read_records(gkvs, GangRecord.from_dict)[0]:
            if g.owner_az not in orphaned or g.state != GangState.PENDING:
                continue
            new = g.evolve(owner_az=self.az, updated_at=self.lead.wall(),
                           reason=f"adopted by {self.az}: {g.owner_az} has had no leader for over {self.lead.timings.owner_adopt_after_s:g}s")
            try:
                await self.writer.write(new, g, events=[ev.adopted(self.lead.wall(), self.lead.epoch, g.incarnation, new.reason)])
                log.warning("adopted gang %s from leaderless AZ %s", g.id, g.owner_az)
                self.lead.wake.set()
            except Conflict:
                cur = self.book.gangs.get(g.id)
                if cur is not None and cur.owner_az != self.az:
                    self.book.not_owned(g.id)

