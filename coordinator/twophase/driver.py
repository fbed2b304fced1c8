"""The driver of two-phase (cross-AZ) reservations: ``TwoPhaseDriver``, one
per leadership, feeds the AZ's ``ParticipantState`` and its ``OwnerState``s
(kept in the leadership's Book) every stimulus (``feed``), performs their
effects (``enact`` a core's decisions, ``perform`` one with I/O: the
name the gang performer uses for the same job) through the parts it builds (store_effects,
peer_sender, watch, members; peer_calls.py answers the calls) and
answers the admission cycle's questions (docs/two-phase.md "The driver").
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

from coordinator.book import Book, two_phase_config
from coordinator.core import capacity, gang_effects
from coordinator.core.admission import spans_azs
from coordinator.core.effect_lines import effect_line
from coordinator.core.owner_lifecycle import StartOwner, owner_steps
from coordinator.core.placement import FabricIndex, NodeView, Placement
from coordinator.core.records import GangRecord, MemberSummary
from coordinator.core import twophase as protocol
from coordinator.core.twophase import Core, Effect, OwnerPhase, OwnerState, Routed
from coordinator.gang_writer import GangWriter
from coordinator.leadership import Leadership, RunTime
from coordinator.twophase.peer_calls import PeerCalls
from coordinator.twophase.context import Context
from coordinator.twophase.counts import RequestCounts
from coordinator.twophase.members import Members
from coordinator.twophase.peer_sender import PeerSender
from coordinator.twophase.store_effects import StoreEffects
from coordinator.twophase.watch import Watcher
from phalanx.logfmt import bind_event, log_context
from phalanx.model import GangState
from phalanx.topology import NodeTopology

log = logging.getLogger(__name__)


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
        # and its parts keep only their I/O: futures of calls waiting for a
        # vote or an ack, the peer-address cache, writes in flight, cadences.
        self.book = book
        self.cfg = two_phase_config(lead.timings)
        self.peers = PeerCalls(self)  # the participant side of the peer calls
        self.counts = RequestCounts(self.az, lambda gang: self.peers.auth_reads.pop(gang, 0))
        ctx = Context(lead, book, writer, run_time, self.counts, self.feed)
        self.store_fx = StoreEffects(ctx)
        self.sender = PeerSender(ctx, self.cfg, peer_channel, self.peers.local_prepare)
        self.members = Members(ctx, self.store_fx)
        self.watcher = Watcher(ctx, self.store_fx, self.members)
        self._last_eval = 0.0

    def now(self) -> float:
        return self.lead.mono()

    def feed(self, *routed: Routed) -> None:
        """The one feed loop: each event goes to its core(s), and what they
        decide is performed; what comes of each effect is fed back here as
        ``Routed`` events (``_performed``). Every stimulus (an RPC, the watch, a
        timer, the admission cycle, recovery) enters through this method."""
        for r in routed:
            if self.lead.stopped.is_set():
                return
            if Core.PARTICIPANT in r.to:
                # (a hold whose release is decided stays taken until its
                # delete commits: Book.participant_decides)
                self.enact(self.book.participant_decides(r.event, self.now()))
            if Core.OWNER in r.to:
                o = self.book.owners.get(getattr(r.event, "gang", ""))
                if o is not None:
                    self.enact(o.handle(r.event, self.now()))

    def enact(self, effects: Sequence[Effect]) -> None:
        """Carry out what a core decided. The effects without I/O take effect
        here, in order, before the feed returns: a vote or an ack answers
        the call waiting for it, a timer is set, a gang's pending reason is
        noted. Each effect with I/O is a task that ``perform`` does and
        whose result is fed back; an attempt's Prepares go out together as
        one task."""
        prepares = [e for e in effects if isinstance(e, protocol.SendPrepare)]
        if prepares:
            self.lead.spawn(self.sender.send_prepares(prepares), f"prepare-{prepares[0].gang}")
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
                case protocol.SendPrepare():
                    pass
                case protocol.ScheduleTimeout():
                    self._schedule(e)
                case protocol.SendVote():
                    self.peers.voted(e)
                case protocol.SendDecisionAck():
                    self.peers.acked(e)
                case protocol.SendFinish():
                    pass  # participants learn the end from the gangs/ watch
                case protocol.MarkGangPending():
                    # The owner waits for placement: the next admission
                    # cycle places it (one order with single-AZ gangs).
                    self.book.waiting(e.gang, e.reason)
                    self.lead.wake.set()
                case _:
                    self.lead.spawn(self._performed(e), f"{type(e).__name__}-{getattr(e, 'gang', '')}")

    def _schedule(self, e: protocol.ScheduleTimeout) -> None:
        # A task of the leadership, not a bare loop timer: the leader's stop
        # cancels it with the rest, so no timer outlives the leadership.
        self.lead.spawn(self._fire(e), f"timer-{type(e.event).__name__}-{e.event.gang}")

    async def _fire(self, e: protocol.ScheduleTimeout) -> None:
        await asyncio.sleep(max(0.0, e.at - self.now()))
        self.feed(Routed(e.event, frozenset({e.to})))

    async def _performed(self, e: Effect) -> None:
        """Perform an effect with I/O and feed back what came of it."""
        bind_event(e)  # this effect's task: its lines name the gang and the stimulus that caused it
        self.feed(*await self.perform(e))

    async def perform(self, e: Effect) -> list[Routed]:
        """Perform one protocol effect with I/O: do it, and return what
        came of it with the core(s) it goes to (``_performed`` feeds it)."""
        match e:
            case protocol.WriteHold():
                return await self.store_fx.write_hold(e)
            case protocol.MarkCommitted():
                return await self.store_fx.mark_committed(e)
            case protocol.ReleaseHold():
                return await self.store_fx.release_hold(e)
            case protocol.CreateDecision():
                return await self.store_fx.create_decision(e)
            case protocol.WriteAttempt():
                return await self.store_fx.write_attempt(e)
            case protocol.SendPrepare():
                return await self.sender.prepare(e)
            case protocol.SendCommit() | protocol.SendAbort():
                return await self.sender.send_decision(e)
            case protocol.DispatchGang():
                await self.members.dispatch(e)
            case protocol.MarkGangReserved():
                await self.store_fx.mark_reserved(e)
            case protocol.MarkGangFailed():
                await self._mark_failed(e)
            case _:
                raise TypeError(f"TwoPhaseDriver.perform: {type(e).__name__} has no I/O to perform")
        return []

    async def _mark_failed(self, e: protocol.MarkGangFailed) -> None:
        g = self.book.gangs.get(e.gang)
        if g is not None and not g.state.terminal:
            # A gang effect: the leader's gang-effect interpreter performs it
            # (docs/design.md §19.9).
            done = await self.run_time.perform(gang_effects.Finish(g, GangState.FAILED, e.reason, stimulus_id=e.stimulus_id))
            if isinstance(done, gang_effects.WriteRefused):
                log.info("gang %s: not failed (%s): %s", e.gang, e.reason, done.why)


    def start_owner(self, g: GangRecord) -> None:
        """Cycle: a two-phase gang we own that no OwnerState drives yet."""
        o = OwnerState(g.id, self.az, g.spec.priority, g.submitted_at, self.cfg)
        self.book.owner_started(o)
        if g.state == GangState.PENDING:
            self.feed(Routed.owner(protocol.GangSubmitted(stimulus_id=f"submit:{g.id}:{g.incarnation}", gang=g.id, incarnation=g.incarnation)))
            return
        plan = _plan_of(g) if g.placement else None
        decision = self.book.dec_by_key.get((g.id, g.incarnation))
        self.lead.spawn(self.watcher.recover_owner(g, plan, decision), f"owner-recover-{g.id}")


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
                    self.lead.spawn(self.run_time.evaluate(g.id), f"evaluate-{g.id}")
        for gang, o in list(self.book.owners.items()):
            if gang not in self.book.gangs and o.phase.settled:
                # Ended (or adopted elsewhere) and nothing in flight: forget it.
                self.book.owner_forgotten(gang)
        for g in list(self.book.gang_cache.values()):
            self.members.maybe_finish(g)
        self.members.republish()


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
        self.counts.count(gang, check=check)

    @property
    def etcd_requests(self) -> dict[str, int]:
        """gang -> etcd requests made for it (bench/admission.py, tests)."""
        return self.counts.etcd_requests

    @property
    def check_reads(self) -> dict[str, int]:
        """gang -> how many of those were a peer call's check read."""
        return self.counts.check_reads

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
        self.feed(Routed.owner(protocol.PlacementMade(stimulus_id=stimulus_id, gang=g.id, incarnation=o.incarnation,
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
        views += capacity.unready_views(self.book.nodes, (v.name for v in views))
        views += self.other_azs_view()
        registered = self.run_time.registered_topologies() + self.other_azs_registered()
        return views, registered, set(self.book.remote.led) | {self.az}


    # ------------------------------------------------- the parts' entry points
    async def recover(self) -> None:
        """Rebuild the participant (and owners) from etcd alone."""
        await self.watcher.recover()

    async def watch(self) -> None:
        """One watch on the cluster root from the recovery revision."""
        await self.watcher.watch()

    async def adopt_orphans(self) -> None:
        await self.watcher.adopt_orphans()

    def forget(self, gang: str) -> None:
        """``gangs/<gang>`` was deleted (retention): Watcher.forget."""
        self.watcher.forget(gang)

    def owns_members(self, gang: str, incarnation: int) -> bool:
        return self.members.owns_members(gang, incarnation)

    async def on_register(self, node: str, reported: dict[tuple[str, int], set[int]]) -> None:
        await self.members.on_register(node, reported)

    async def on_member(self, node: str, m: Any) -> None:
        await self.members.on_member(node, m)

    async def on_node_lost(self, node: str, reason: str) -> None:
        await self.members.on_node_lost(node, reason)

    def on_member_summary(self, gang: str, summary: MemberSummary) -> None:
        self.members.on_member_summary(gang, summary)
