"""The two-phase driver's store effects (docs/two-phase.md "Driver"): the
participant's hold (write, commit, release), the owner's decision (created
alone, or folded with the gang's RESERVED record: coordinator/core/twophase_fold.py
decides when, and whether a lost reply was ours), the attempt record and the
RESERVED write. Each is a fenced etcd txn (``Store.fenced_txn``);
``CreateDecision`` is ``Store.create_if_absent`` (anyone may create a decision
key: the first writer wins). Each returns what came of it as ``Routed`` events."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, stop_after_delay, wait_incrementing

from coordinator.core import events as gang_events
from coordinator.core import gang_effects
from coordinator.core.records import UNREADABLE, GangRecord, MemberAssignment, NodeRecord
from coordinator.core.twophase import (
    AttemptWriteFailed,
    AttemptWritten,
    CommitWriteFailed,
    CommitWritten,
    CreateDecision,
    DecisionCreated,
    DecisionCreateFailed,
    DecisionRecord,
    HoldFound,
    HoldReleased,
    HoldReleaseFailed,
    HoldWriteFailed,
    HoldWritten,
    MarkCommitted,
    MarkGangReserved,
    Outcome,
    ReleaseHold,
    Routed,
    WriteAttempt,
    WriteHold,
)
from coordinator.core.twophase_fold import Fold, can_fold, decided_here, fold_failed
from coordinator.twophase.context import Context, Part
from phalanx import failpoints
from phalanx.errors import Conflict, NotLeader
from phalanx.model import GangState
from phalanx.reservation import HoldState, Reservation
from phalanx.store import Delete, Get, Put, StoreUnavailable, absent, unchanged_since

log = logging.getLogger(__name__)


def decision_of(kv: Any, gang: str, incarnation: int) -> DecisionRecord:
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


def _to_participant(event: type, e: Any, **fields: Any) -> list[Routed]:
    """What came of the participant's effect ``e``: ``event`` of its gang and incarnation, for the participant."""
    return [Routed.participant(event(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation, **fields))]


class StoreEffects(Part):
    """One per ``TwoPhaseDriver``: performs the store effects of the cores,
    and keeps the MarkGangReserved parked behind a folded write in flight."""

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        # (gang, inc) -> MarkGangReserved that arrived while the COMMIT+RESERVED
        # txn was in flight (None: none yet): _commit_with_reserved.
        self._folding: dict[tuple[str, int], MarkGangReserved | None] = {}

    async def read(self, key: str, gang: str = "") -> Any:
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
                    self.counts.count(gang)
                    return await self.store.get(key)
        except StoreUnavailable:
            pass
        raise NotLeader(f"{self.az}: cannot read {key}; stepping down")

    async def fenced(self, compares: list, ops: list, failure: list = (), gang: str = "") -> Any:
        """A fenced txn; None when its outcome is unknown (timeout)."""
        self.lead.check_valid()
        try:
            self.counts.count(gang)
            return await self.store.fenced_txn(self.lead.fence, compares, ops, list(failure))
        except StoreUnavailable:
            return None

    def _record(self, e: WriteHold) -> Reservation:
        return dataclasses.replace(e.record(), epoch=self.lead.epoch)

    async def write_hold(self, e: WriteHold) -> list[Routed]:
        """Write the hold under the guard the core chose (absent, or
        unchanged since ``e.replaces``); what is found instead goes back to
        the core as ``HoldFound`` (it decides whether to overwrite)."""
        key = self.keys.reservation(self.az, e.gang)
        rec = self._record(e)
        guard = absent(key) if e.replaces is None else unchanged_since(key, e.replaces)
        res = await self.fenced([guard], [Put(key, rec.to_dict())], [Get(key)], gang=e.gang)
        if res is not None and res.succeeded:
            self.book.hold_written(e.gang, e.incarnation, res.revision)
            await failpoints.hit("participant.after_prepared")
            return _to_participant(HoldWritten, e)
        if res is None:  # outcome unknown: read it back
            kv = await self.read(key, e.gang)
        else:
            kv = res.results[0][0] if res.results[0] else None
        if kv is None:
            return _to_participant(HoldWriteFailed, e, reason="write timed out" if res is None else "raced with another write")
        cur = _stored(kv)
        if cur is not None and cur.incarnation == e.incarnation:
            await failpoints.hit("participant.after_prepared")  # a PREPARED record of ours is durable
        return _to_participant(HoldFound, e, found=cur.incarnation if cur is not None else None, revision=kv.mod_revision)

    async def mark_committed(self, e: MarkCommitted) -> list[Routed]:
        key = self.keys.reservation(self.az, e.gang)
        rev = self.book.hold_committing(e.gang, e.incarnation)
        if rev is not None:
            # Our own PREPARED write, unchanged since: commit it without a read.
            rec = Reservation(self.az, e.gang, e.incarnation, HoldState.COMMITTED, e.nodes, self.lead.epoch)
            hold = self.book.participant.holds.get(e.gang)
            if hold is not None and hold.incarnation == e.incarnation:
                rec = dataclasses.replace(rec, two_phase=True, owner_az=hold.owner_az, priority=hold.priority,
                                          submitted_at=hold.submitted_at)
                res = await self.fenced([unchanged_since(key, rev)], [Put(key, rec.to_dict())], gang=e.gang)
                if res is not None and res.succeeded:
                    return _to_participant(CommitWritten, e)
        kv = await self.read(key, e.gang)
        cur = _stored(kv) if kv is not None else None
        if cur is None or cur.incarnation != e.incarnation:
            return _to_participant(CommitWriteFailed, e, reason="record is not this incarnation")
        if cur.state is HoldState.COMMITTED:
            return _to_participant(CommitWritten, e)
        committed = dataclasses.replace(cur, state=HoldState.COMMITTED, epoch=self.lead.epoch)
        res = await self.fenced([unchanged_since(key, kv.mod_revision)], [Put(key, committed.to_dict())], gang=e.gang)
        if res is not None and res.succeeded:
            return _to_participant(CommitWritten, e)
        else:
            return _to_participant(CommitWriteFailed, e, reason="record changed or write timed out")

    async def release_hold(self, e: ReleaseHold) -> list[Routed]:
        key = self.keys.reservation(self.az, e.gang)
        kv = await self.read(key, e.gang)
        cur = _stored(kv) if kv is not None else None
        if kv is not None and cur is None:
            # A record we cannot read: it may name these devices, so they stay
            # held (safety before liveness) and the release is retried until
            # an operator repairs or deletes the key.
            return _to_participant(HoldReleaseFailed, e, reason="the stored record cannot be read")
        if cur is None or cur.incarnation != e.incarnation:
            return _to_participant(HoldReleased, e)
        ops: list = [Delete(key)]
        msum = self.keys.member_summary(e.gang, self.az)
        ops.append(Delete(msum))
        res = await self.fenced([unchanged_since(key, kv.mod_revision)], ops, gang=e.gang)
        self.lead.wake.set()  # released or not, the cycle looks again
        if res is not None and res.succeeded:
            self.book.hold_released(e.gang, e.incarnation)
            log.info("two-phase %s: released hold of %s#%d (%s)", self.az, e.gang, e.incarnation, e.reason)
            return _to_participant(HoldReleased, e)
        else:
            return _to_participant(HoldReleaseFailed, e, reason="record changed or delete timed out")

    async def create_decision(self, e: CreateDecision) -> list[Routed]:
        key = self.keys.decision(e.gang, e.incarnation)
        value = DecisionRecord(gang=e.gang, incarnation=e.incarnation, outcome=e.outcome, by=self.az,
                               reason=e.reason).to_dict()
        fold = Fold.NOT_FOLDED
        if e.outcome is Outcome.COMMIT and not failpoints.on("twophase.decision_overwrite"):
            fold = await self._commit_with_reserved(e, key, value)
        if fold is Fold.FOLDED:
            won, kv = True, None
        else:
            try:
                self.counts.count(e.gang)
                if failpoints.on("twophase.decision_overwrite"):  # a planted bug for the chaos checker: a plain Put
                    won, kv = True, (await self.store.txn([], [Put(key, value), Get(key)])).results[-1][0]
                else:
                    won, kv = await self.store.create_if_absent(key, value)
            except StoreUnavailable as exc:
                kv = await self.read(key, e.gang)
                if kv is None:
                    failed = DecisionCreateFailed(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                                  reason=str(exc))
                    return [Routed.both(failed)]
                won = False  # unknown whether ours; what the key holds is what counts
        outcome = e.outcome if kv is None else decision_of(kv, e.gang, e.incarnation).outcome
        # A folded COMMIT whose reply was lost may have applied: then the
        # create above found our own COMMIT (only an owner writes COMMIT, and
        # the record names who did). Counted and logged as decided here; the
        # cores are told what the create saw.
        ours = decided_here(won, fold, outcome, None if kv is None else decision_of(kv, e.gang, e.incarnation).by,
                            self.az)
        if ours:
            log.info("two-phase %s: decided %s#%d = %s (%s)", self.az, e.gang, e.incarnation, outcome.value, e.reason)
            self.lead.metrics.twophase_decided(outcome.value, e.reason)
            if e.gang in self.book.owners:
                await failpoints.hit("owner.after_decide")
        return [Routed.both(DecisionCreated(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                            won=won, outcome=outcome))]

    async def _commit_with_reserved(self, e: CreateDecision, key: str, value: dict) -> Fold:
        """The owner's COMMIT and its gang's RESERVED record in one fenced
        txn, when ``can_fold`` allows; FOLDED, NOT_FOLDED or UNKNOWN (what
        each means and why the one-decision rule holds: docs/two-phase.md
        "The driver", ``CreateDecision``)."""
        g = self.book.gangs.get(e.gang)
        if g is None or not can_fold(e.gang in self.book.owners, g.state, g.incarnation, e.incarnation,
                                     writing=self.writer.busy(g.id)):
            return Fold.NOT_FOLDED
        new, events = self._reserved(g)
        # The watch may show the COMMIT (and the owner emit MarkGangReserved)
        # before this write's reply is back: mark_reserved leaves it here.
        self._folding[(e.gang, e.incarnation)] = None
        try:
            with self.writer.acting_on(g.id):
                self.counts.count(e.gang)
                await self.writer.write(new, g, ops=[Put(key, value)], compares=[absent(key)], events=events)
            done = Fold.FOLDED
        except (Conflict, StoreUnavailable) as exc:
            log.info("two-phase %s: COMMIT of %s#%d not written with its RESERVED record (%s); creating it alone",
                     self.az, e.gang, e.incarnation, exc)
            done = fold_failed(timed_out=isinstance(exc, StoreUnavailable))
        finally:
            # Whatever ends the write (a lost leadership too), no later
            # MarkGangReserved may stay parked behind it.
            deferred = self._folding.pop((e.gang, e.incarnation), None)
        if deferred is not None:
            await self.mark_reserved(deferred)
        return done

    def _reserved(self, g: GangRecord) -> tuple[GangRecord, list]:
        """The RESERVED record of ``g`` and its event."""
        reason = "committed in every AZ of its plan"
        reserved = gang_events.reserved(self.lead.wall(), self.lead.epoch, g.incarnation,
                               f"{reason} ({', '.join(sorted({m.az for m in g.placement}))})")
        return g.evolve(state=GangState.RESERVED, reason=reason, updated_at=self.lead.wall()), [reserved]

    async def write_attempt(self, e: WriteAttempt) -> list[Routed]:
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
            self.counts.count(e.gang)
            placed = gang_events.placed(self.lead.wall(), self.lead.epoch, e.incarnation, placement,
                               f"two-phase across {', '.join(sorted(p.azs()))}: {p.reason}")
            await failpoints.hit("owner.before_attempt_write")
            await self.writer.write(new, g, events=[placed])
        except (Conflict, StoreUnavailable) as exc:
            return [Routed.owner(AttemptWriteFailed(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                                                    reason=str(exc)))]
        finally:
            self.run_time.rendezvous_settled(e.gang)
        return [Routed.owner(AttemptWritten(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation))]

    async def mark_reserved(self, e: MarkGangReserved) -> None:
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
                    self.counts.count(e.gang)
                    written = await self.writer.write(new, g, events=events)
            except Conflict as exc:
                log.info("gang %s: %s", e.gang, exc)
                cur = self.book.gangs.get(e.gang)  # (the gang writer keeps what it found)
                if cur is None or cur.incarnation != e.incarnation or cur.state != GangState.RESERVED:
                    return
                written = cur  # our folded write applied though its reply was lost
        self.counts.report(e.gang, e.incarnation, "owner")
        self.book.placed(e.gang)
        self.lead.spawn(self.run_time.perform(gang_effects.MarkStarting(written, stimulus_id=e.stimulus_id)), f"starting-{e.gang}")


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
