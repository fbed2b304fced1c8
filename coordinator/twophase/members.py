"""The cross-AZ members side of the two-phase driver (docs/two-phase.md
"Driver"): a committed hold's members are dispatched from the gang record
(and sent again to an agent that reconnects); this AZ's member reports are
published as its summary for the owner (``members/<gang>/<az>``), the
owner's view is fed from the summaries, and a hold whose gang is over is
finished (``cross_az_members.hold_over`` decides each step)."""

from __future__ import annotations

import logging
from typing import Any

from coordinator.core import cross_az_members, gang_effects, progress
from coordinator.core.records import GangRecord, MemberSummary
from coordinator.core.twophase import DispatchGang, GangFinished, Routed
from coordinator.twophase.context import Context, Part
from coordinator.twophase.store_effects import StoreEffects
from phalanx.agent_messages import Revoke
from phalanx.logfmt import bind_event
from phalanx.model import GangState, MemberPhase
from phalanx.reservation import HoldState
from phalanx.store import Compare, Put

log = logging.getLogger(__name__)


class Members(Part):
    """One per ``TwoPhaseDriver``."""

    def __init__(self, ctx: Context, store_fx: StoreEffects):
        super().__init__(ctx)
        self.store_fx = store_fx
        self._publishing: set[tuple[str, int]] = set()  # member summaries being written

    def republish(self) -> None:
        """The leader's tick: publish again any summary whose write did not land."""
        for (gang, inc) in list(self.book.local_reports):
            if self.book.published.get((gang, inc)) != self._summary(gang, inc) and (gang, inc) not in self._publishing:
                hold = self.book.participant.holds.get(gang)
                if hold is not None and hold.incarnation == inc:
                    self.lead.spawn(self._publish_members(gang, inc), f"members-{gang}")

    async def gang_record(self, gang: str) -> GangRecord | None:
        g = self.book.known_gang(gang)
        if g is None:
            kv = await self.store_fx.read(self.keys.gang(gang), gang)
            if kv is None:
                return None
            g = GangRecord.from_dict(kv.json(), kv.mod_revision)
            self.book.gang_cached(g)
        return g

    async def dispatch(self, e: DispatchGang) -> None:
        bind_event(e)
        g = await self.gang_record(e.gang)
        self.counts.report(e.gang, e.incarnation, "participant")
        if g is None or g.incarnation != e.incarnation or g.state.terminal or g.state == GangState.RESTARTING:
            g2 = await self._fresh_gang(e.gang)
            if g2 is None or g2.incarnation != e.incarnation:
                return
            g = g2
            if g.state.terminal or g.state == GangState.RESTARTING:
                self.maybe_finish(g)
                return
        log.info("two-phase %s: dispatching %s#%d to %s", self.az, g.id, g.incarnation, sorted(e.nodes))
        await self.run_time.perform(gang_effects.SendAssignments(g, stimulus_id=e.stimulus_id))

    async def on_register(self, node: str, reported: dict[tuple[str, int], set[int]]) -> None:
        """An agent (re)connected: members of committed cross-AZ holds on its
        node that it does not run and that never finished are (re)sent; the
        dispatch may have gone out while it was away (e.g. right after a
        leader change)."""
        for gang, hold in list(self.book.participant.holds.items()):
            if hold.state is not HoldState.COMMITTED or node not in hold.nodes:
                continue
            g = await self.gang_record(gang)
            if g is None or g.incarnation != hold.incarnation or g.state.terminal or g.state == GangState.RESTARTING:
                continue
            skip = cross_az_members.to_send_again(g, node, reported.get((gang, hold.incarnation), ()),
                                                  self.book.local_reports.get((gang, hold.incarnation), {}))
            if skip is not None:
                await self.run_time.perform(gang_effects.SendAssignments(g, only_node=node, skip_ranks=skip))

    async def _fresh_gang(self, gang: str) -> GangRecord | None:
        kv = await self.store_fx.read(self.keys.gang(gang))
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
        self.lead.spawn(self._publish_members(m.gang, m.incarnation), f"members-{m.gang}")
        g = self.book.gang_cache.get(m.gang) or self.book.gangs.get(m.gang)
        if g is not None:
            self.maybe_finish(g)

    async def on_node_lost(self, node: str, reason: str) -> None:
        """A node of this AZ is past its fence deadline: its members of
        committed cross-AZ holds are gone; tell their owners."""
        log.debug("two-phase %s: node %s lost: %s", self.az, node, reason)
        for gang, hold in list(self.book.participant.holds.items()):
            if hold.state is not HoldState.COMMITTED or node not in hold.nodes:
                continue
            g = await self.gang_record(gang)
            if g is None or g.incarnation != hold.incarnation:
                continue
            reps = self.book.local_reports.get((gang, hold.incarnation), {})
            stopped = cross_az_members.lost_members(g, node, self.az, reps, reason)
            self.book.local_members_reported(gang, hold.incarnation, stopped)
            if stopped:
                log.info("two-phase %s: members of %s#%d on %s are gone: %s", self.az, gang, hold.incarnation, node, reason)
                self.maybe_finish(g)
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
            res = await self.store_fx.fenced([held], [Put(self.keys.member_summary(gang, self.az), body.to_dict())])
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
            self.lead.spawn(self._publish_members(gang, inc), f"members-{gang}")  # changed meanwhile

    def on_member_summary(self, gang: str, summary: MemberSummary) -> None:
        """Owner side: a participant's summary arrived on the watch."""
        g = self.book.gangs.get(gang)
        if g is None or summary.incarnation != g.incarnation:
            return
        self.book.members_reported(gang, g.incarnation, summary.members)
        self.lead.spawn(self.run_time.evaluate(gang), f"evaluate-{gang}")

    # --------------------------------------------------------- finishing
    def maybe_finish(self, g: GangRecord) -> None:
        """Participant: the gang record may say the held incarnation is over;
        do what ``cross_az_members.hold_over`` decides (revoke our members,
        wait for them, publish how they ended, then GangFinished)."""
        hold = self.book.participant.holds.get(g.id)
        if hold is None:
            return
        inc, key_, now = hold.incarnation, (g.id, hold.incarnation), self.lead.mono()
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
            self.lead.spawn(self._publish_members(g.id, inc), f"members-{g.id}")
        elif step.finish:
            self.book.finish_fed(g.id, inc)
            self.feed(Routed.participant(GangFinished(stimulus_id=f"gang-over:{g.id}:{inc}", gang=g.id, incarnation=inc)))

