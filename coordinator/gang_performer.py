"""The gang-effect interpreter: performs what the cores decide for a gang
(docs/design.md §19.9).

``GangPerformer.perform(effect) -> event`` is the one interpreter of a gang's
effects (coordinator/core/gang_effects.py); the cross-AZ protocol's effects
are the two-phase driver's own. It also decides, from what members reported,
a gang's run-time transitions (``evaluate``) and the start barrier. It holds
no AzLeader: it is given the leadership, the book, the gang writer and the
parts it hands effects to (``connect``).
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

from coordinator.book import Book
from coordinator.core import gang_effects, lifecycle
from coordinator.core.admission import spans_azs
from coordinator.core.records import GangRecord
from coordinator.gang_writer import GangWriter
from coordinator.leadership import Leadership, current_stimulus
from coordinator.admission_cycle import AdmissionCycle
from coordinator.node_sessions import NodeSessions
from coordinator.twophase import TwoPhaseDriver
from phalanx.agent_messages import Revoke
from phalanx.errors import Conflict
from phalanx.logfmt import log_context
from phalanx.model import GangState
from phalanx.store import Delete, Put

log = logging.getLogger(__name__)

Finish = Callable[..., Awaitable[GangRecord]]


class GangPerformer:
    def __init__(self, lead: Leadership, book: Book, writer: GangWriter):
        self.lead = lead
        self.book = book
        self.writer = writer
        # Set by connect(): they are built with this performer's perform.
        self.twophase: TwoPhaseDriver | None = None
        self.nodes: NodeSessions | None = None
        self.admission: AdmissionCycle | None = None
        self.finish: Finish | None = None

    def connect(self, *, twophase: TwoPhaseDriver, nodes: NodeSessions, admission: AdmissionCycle,
                finish: Finish) -> None:
        """The parts this performer hands effects to (each is given ``perform``)."""
        self.twophase, self.nodes, self.admission, self.finish = twophase, nodes, admission, finish

    async def perform(self, effect: gang_effects.Effect) -> gang_effects.Event:
        """Perform one gang effect a core decided and return what came of it.
        One handler per effect, each doing only the I/O and the cache
        updates; what follows (e.g. dispatch and STARTING once a reservation
        committed) is decided by the core from the returned event. A guarded
        gang write that loses its compare comes back as ``WriteRefused``
        (only ``finish``, the API's, raises it)."""
        match effect:
            case gang_effects.ReserveDevices():
                return await self.admission.reserve(effect)
            case gang_effects.StartTwoPhaseAttempt():
                # The plan took the devices from its free view;
                # attempt_devices keeps them out of later cycles' views until
                # its holds show.
                with log_context(gang=effect.gang.id, incarnation=effect.gang.incarnation):
                    self.twophase.place_attempt(effect.gang, effect.placement, effect.stimulus_id)
            case gang_effects.FailAdmission():
                await self.admission.fail_admission(effect)
            case gang_effects.KeepWaiting():
                self.admission.keep_waiting(effect)
            case gang_effects.WriteTransition():
                return await self._write_transition(effect)
            case gang_effects.Finish():
                try:
                    return gang_effects.GangWritten(await self.finish(effect.gang, effect.state, effect.reason,
                                                                      list(effect.events)))
                except Conflict as exc:
                    return gang_effects.WriteRefused(str(exc))
            case gang_effects.TearDown():
                return await self._tear_down(effect)
            case gang_effects.Requeue():
                return await self._requeue(effect)
            case gang_effects.ReleaseDevices():
                await self._release(effect.gang)
            case gang_effects.ForgetGang():
                self.book.not_owned(effect.gang.id)  # participants release their own holds
            case gang_effects.SendAssignments():
                self.dispatch(effect.gang, effect.only_node, effect.skip_ranks)
            case gang_effects.SendRevoke():
                self.nodes.send(effect.node, Revoke(effect.gang, effect.incarnation, effect.reason))
            case gang_effects.MarkStarting():
                await self.mark_starting(effect.gang)
            case gang_effects.CloseSession():
                self.nodes.close_session(effect.node)
            case gang_effects.MarkNodeNotReady():
                await self.nodes.mark_not_ready(effect)
            case gang_effects.NodeLost():
                await self.nodes.lose_node(effect)
            case gang_effects.RegisterNode():
                await self.nodes.register_node(effect)
            case gang_effects.IgnoreMemberReport():
                log.warning("ignored a member report at registration: %s", effect.why)
            case gang_effects.PublishMemberReport():
                # Cross-AZ gang committed here: kept, and published for its owner.
                await self.twophase.on_member(effect.node, effect.member)
            case gang_effects.TrackMembers():
                self.book.members_reported(effect.gang, effect.incarnation, effect.reports)
            case _:
                raise TypeError(f"GangPerformer.perform: no handler for {type(effect).__name__}")
        return gang_effects.Performed()

    async def _tear_down(self, e: gang_effects.TearDown) -> gang_effects.Event:
        """One write: the gang record, the reservation RELEASING (members may
        still run on its devices) or deleted, the name freed."""
        g, t, k = e.gang, e.teardown, self.lead.keys
        ops: list = [Delete(k.name(g.spec.name))] if t.free_name else []
        if t.releasing is not None:
            ops.append(Put(k.reservation(self.lead.az, g.id), t.releasing.to_dict()))
        elif t.delete_reservation:
            ops.append(Delete(k.reservation(self.lead.az, g.id)))
        try:
            written = await self.writer.write(t.record, g, ops, events=list(t.events))
        except Conflict as exc:
            return gang_effects.WriteRefused(str(exc))
        self.book.torn_down(g, t.releasing, t.delete_reservation, restarting=t.record.state == GangState.RESTARTING)
        return gang_effects.GangWritten(written)

    async def _requeue(self, e: gang_effects.Requeue) -> gang_effects.Event:
        """RESTARTING -> PENDING as the next incarnation, once every member of
        the old one is gone (lifecycle.requeue: first submit time kept, the
        restart backoff waited out)."""
        g, q = e.gang, e.requeue
        ops: list = [Delete(self.lead.keys.reservation(self.lead.az, g.id))] if q.delete_reservation else []
        try:
            written = await self.writer.write(q.record, g, ops)
        except Conflict as exc:
            return gang_effects.WriteRefused(str(exc))
        self.book.requeued(g)
        log.info("gang %s restarts as incarnation %d in %.1fs", g.id, written.incarnation, q.backoff_s,
                 extra={"gang": g.id, "incarnation": written.incarnation})
        self.lead.wake.set()
        return gang_effects.GangWritten(written)

    async def mark_starting(self, g: GangRecord) -> None:
        """RESERVED -> STARTING once its assignments went out (a no-op if the
        record moved on meanwhile), then evaluate what members reported."""
        cur = self.book.gangs.get(g.id)
        if cur is None or cur.state != GangState.RESERVED or cur.incarnation != g.incarnation:
            return
        await self.writer.write(cur.evolve(state=GangState.STARTING, reason="assignments sent to agents", updated_at=self.lead.wall()), cur)
        log.info("gang %s#%d -> STARTING: assignments sent to agents", g.id, g.incarnation,
                 extra={"gang": g.id, "incarnation": g.incarnation})
        await self.evaluate(g.id)

    def dispatch(self, g: GangRecord, only_node: str | None = None, skip_ranks: set[int] = frozenset()) -> None:
        """Send this AZ's members of ``g`` their assignments (only to
        ``only_node`` and not ``skip_ranks`` when an agent re-registers)."""
        rank0 = g.placement[0] if g.placement else None
        rec0 = self.book.nodes.get(rank0.node) if rank0 is not None and rank0.az == self.lead.az else None
        sent: set[str] = set()
        for node, msg in gang_effects.assignments(g, self.lead.az, rec0, only_node, skip_ranks):
            sent.add(node)
            self.nodes.send(node, msg)
        if sent:  # one line per dispatch (not per member): its stimulus is the assignments' stimulus_id
            log.info("gang %s#%d dispatched to %s", g.id, g.incarnation, ", ".join(sorted(sent)),
                     extra={"gang": g.id, "incarnation": g.incarnation})

    async def check_start_barrier(self) -> None:
        """A gang whose members have not all started within its
        start_timeout_s is torn down (all-or-nothing at run time too)."""
        now = self.lead.wall()
        for g in list(self.book.gangs.values()):
            if self.writer.busy(g.id):
                continue
            reports = self.book.members.get((g.id, g.incarnation), {})
            why = lifecycle.start_barrier(g, reports, now)
            if why is not None:
                await self.transition(g, lifecycle.run_time_step(g, GangState.FAILED, why, reports, now, self.lead.epoch), now)

    async def evaluate(self, gang_id: str) -> None:
        """Decide on the gang from what its members reported: a run-time
        transition, or once a torn-down incarnation is gone, its requeue or
        release. Skipped while the gang is busy."""
        g = self.book.gangs.get(gang_id)
        if g is None or self.writer.busy(gang_id):
            return
        reports = self.book.members.get((g.id, g.incarnation), {})
        if lifecycle.torn_down(g.state):
            # Torn down: act once no member of this incarnation can be alive.
            then = lifecycle.after_teardown(g, reports, has_reservation=g.id in self.book.reservations,
                                            two_phase=spans_azs(g))
            if then is None:
                return
            with self.writer.acting_on(gang_id):
                effect = gang_effects.after_teardown_effect(then, g, self.lead.wall(), self.lead.timings,
                                                            stimulus_id=current_stimulus(),
                                                            has_reservation=g.id in self.book.reservations)
                done = await self.perform(effect)
            if isinstance(done, gang_effects.WriteRefused):
                log.info("gang %s: %s", gang_id, done.why)
            return
        now = self.lead.wall()
        step = lifecycle.member_progress(g, reports, now, self.lead.epoch)
        if step is not None:
            await self.transition(g, step, now)

    async def transition(self, g: GangRecord, step: lifecycle.RunTimeStep, now: float) -> None:
        """Perform a run-time step the core decided (lifecycle.run_time_step:
        the restart policy and the events already applied)."""
        with self.writer.acting_on(g.id):
            done = await self.perform(gang_effects.run_time_effect(g, step, now, current_stimulus()))
        if isinstance(done, gang_effects.WriteRefused):
            log.info("gang %s: %s", g.id, done.why)
        # A teardown may already allow the release (no live members).
        if gang_effects.reevaluate_after(step, self.book.gangs.get(g.id)):
            await self.evaluate(g.id)

    async def _write_transition(self, e: gang_effects.WriteTransition) -> gang_effects.Event:
        g = e.old
        try:
            written = await self.writer.write(e.record, g, events=list(e.events))
        except Conflict as exc:
            return gang_effects.WriteRefused(str(exc))
        log.info("gang %s#%d -> %s: %s", g.id, g.incarnation, e.record.state.name, e.record.reason,
                 extra={"gang": g.id, "incarnation": g.incarnation})
        return gang_effects.GangWritten(written)

    async def _release(self, g: GangRecord) -> None:
        r = self.book.reservations.get(g.id)
        if r is None:
            return
        self.lead.check_valid()
        await self.lead.store.fenced_txn(self.lead.fence, [], [Delete(self.lead.keys.reservation(self.lead.az, g.id))])
        log.info("gang %s#%d released its devices: every member is gone", g.id, g.incarnation,
                 extra={"gang": g.id, "incarnation": g.incarnation})
        self.book.released(g)
        self.lead.wake.set()
