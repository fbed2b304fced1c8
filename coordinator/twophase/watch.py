"""The two-phase driver's watch and recovery (docs/two-phase.md "Driver"):
the participant (and owners) rebuilt from etcd alone, then one watch on the
cluster root that feeds ``DecisionObserved`` (``decisions/``), gang ends
(``gangs/``: participants release their holds without the owner), member
summaries (``members/``: the owner's run-time view), other AZs' nodes,
reservations and leaders (``leader/``: owner-AZ loss), and the adoption of
gangs whose AZ has lost its leader."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from coordinator.core import events as gang_events
from coordinator.core.records import UNREADABLE, GangRecord, MemberSummary, read_records
from coordinator.core.twophase import (
    DecisionObserved,
    DecisionRecord,
    GangForgotten,
    Outcome,
    OwnerRecovered,
    ParticipantRecovered,
    Routed,
)
from coordinator.twophase.context import Context, Part
from coordinator.twophase.members import Members
from coordinator.twophase.store_effects import StoreEffects, decision_of
from phalanx.errors import Conflict, NotLeader
from phalanx.logfmt import log_context
from phalanx.model import GangState
from phalanx.reservation import HoldState, Reservation
from phalanx.store import Compacted, StoreUnavailable

log = logging.getLogger(__name__)


def reserving(kv: Any) -> bool:
    """Whether a gang record's stored bytes say RESERVING: only those are
    kept from the watch (why, and why the bytes suffice: docs/two-phase.md
    "Which gang records the watch keeps")."""
    return b'"state":"RESERVING"' in kv.value


class Watcher(Part):
    """One per ``TwoPhaseDriver``."""

    def __init__(self, ctx: Context, store_fx: StoreEffects, members: Members):
        super().__init__(ctx)
        self.store_fx = store_fx
        self.members = members
        self.revision = 0  # of the recovery's reads: the watch starts after it
        self._last_leader_poll = 0.0

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
        self.book.watched_reset({kv.key[len(k.gangs()):]: kv for kv in gang_kvs if reserving(kv)})
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
                decisions.append(decision_of(kv, *DecisionRecord.key_of(kv.key[len(k.decisions()):])))
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
                    self.members.on_member_summary(gang, summary)
            except UNREADABLE as exc:
                log.warning("two-phase recovery in %s: skipped unreadable member summary %s: %r", self.az, kv.key[:200], exc)
        # RESTARTING / terminal gangs whose holds we still keep.
        for g in list(self.book.gang_cache.values()):
            self.members.maybe_finish(g)
        self.book.decisions_recovered(decisions)


    async def recover_owner(self, g: GangRecord, plan: Any, decision: Outcome | None) -> None:
        kv = await self.store_fx.read(self.keys.decision(g.id, g.incarnation))
        if kv is not None:
            decision = decision_of(kv, g.id, g.incarnation).outcome
        finished = g.state.terminal or g.state == GangState.RESTARTING
        if g.state in (GangState.RESERVING,) and plan is not None:
            # Rebuild the Placement for the ranks (WriteAttempt is not
            # re-issued for this incarnation, but MarkGangReserved needs none).
            pass
        self.feed(Routed.owner(OwnerRecovered(stimulus_id=f"owner-recover:{g.id}:{self.lead.epoch}", gang=g.id,
                                              incarnation=g.incarnation, plan=plan, decision=decision, finished=finished)))


    async def watch(self) -> None:
        """One watch on the cluster root from the recovery revision."""
        rev = self.revision + 1
        while not self.lead.stopped.is_set():
            try:
                async for batch in self.store.watch_prefix(self.keys.root, rev):
                    for change in batch:
                        rev = max(rev, change.revision + 1)
                        try:
                            # A watch event is a stimulus (its etcd revision
                            # names it): what this leader does on it logs it.
                            with log_context(stimulus=f"watch:{change.revision}"):
                                self._on_watch(change)
                        except (NotLeader, asyncio.CancelledError):
                            raise
                        except Exception:  # noqa: BLE001 - one bad record must not stop the watch
                            log.exception("two-phase watch: cannot handle %s", change.kv.key)
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

    def _on_watch(self, change: Any) -> None:
        k = self.keys
        key = change.kv.key
        if key.startswith(k.decisions()) and change.kind == "put":
            try:
                gang, inc = DecisionRecord.key_of(key[len(k.decisions()):])
                outcome = decision_of(change.kv, gang, inc).outcome
            except UNREADABLE as exc:
                log.warning("two-phase watch: skipped unreadable decision %s: %r", key[:200], exc)
                return
            de = DecisionObserved(stimulus_id=f"watch:{change.revision}", gang=gang, incarnation=inc, outcome=outcome)
            self.feed(Routed.both(de))
        elif key.startswith(k.gangs()):
            gang = key[len(k.gangs()):]
            if change.kind == "delete":
                # Collected by its owner past gang_retention_s (with its
                # decision keys, whose deletes this watch ignores).
                self.book.gang_watched(gang, None)
                self.forget(gang)
                return
            # (kept while RESERVING, for a Prepare's check; parsed only then)
            self.book.gang_watched(gang, change.kv if reserving(change.kv) else None)
            mine = self.book.gangs.get(gang)
            if mine is None and gang not in self.book.participant.holds and gang not in self.book.gang_cache:
                return  # (parse only the gangs this leader cares about)
            g = GangRecord.from_dict(change.kv.json(), change.kv.mod_revision)
            if mine is not None and g.owner_az != self.az and mine.owner_az == self.az:
                # Adopted by another AZ (owner-AZ loss): stop owning it here.
                log.warning("gang %s is now owned by %s", gang, g.owner_az)
                self.book.adopted_elsewhere(gang)
            if gang in self.book.participant.holds or gang in self.book.gang_cache:
                self.book.gang_cached(g)
                self.members.maybe_finish(g)
        elif key.startswith(k.member_summaries()) and change.kind == "put":
            gang = key[len(k.member_summaries()):].split("/", 1)[0]
            if gang in self.book.gangs:
                self.members.on_member_summary(gang, MemberSummary.from_dict(change.kv.json()))
        elif key.startswith(k.leaders()):
            az = key[len(k.leaders()):]
            if self.book.remote.on_leader(az, change.kv if change.kind == "put" else None, self.lead.mono()):
                self.lead.wake.set()  # its nodes may be placed on again
        elif key.startswith(k.nodes()):
            if self.book.remote.on_node(key, change.kv if change.kind == "put" else None):
                self.lead.wake.set()
        elif key.startswith(k.reservations()):
            if self.book.remote.on_reservation(key, change.kv if change.kind == "put" else None):
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
        self.counts.forget(gang)

    # ------------------------------------------------------ owner-AZ loss
    async def adopt_orphans(self) -> None:
        """Adopt PENDING gangs of AZs that have had no leader for
        ``owner_adopt_after_s`` (fenced txn guarded by the gang record's
        mod_revision: at most one leader wins each gang)."""
        now = self.lead.mono()
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
                await self.writer.write(new, g, events=[gang_events.adopted(self.lead.wall(), self.lead.epoch, g.incarnation, new.reason)])
                log.warning("adopted gang %s from leaderless AZ %s", g.id, g.owner_az)
                self.lead.wake.set()
            except Conflict:
                cur = self.book.gangs.get(g.id)
                if cur is not None and cur.owner_az != self.az:
                    self.book.not_owned(g.id)

