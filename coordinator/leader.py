"""The AZ leader: the driver around the pure cores (docs/design.md §5-§10).

Everything here happens while this coordinator holds its AZ's leader key. It
is the only writer of its AZ's reservations and node records and of the gangs
it owns; every write is a fenced txn (``Store.fenced_txn``), so once deposed
it can change nothing. On takeover it rebuilds from one range read per prefix.

State lives in memory only as a cache of etcd plus what agents report; a new
leader starts from etcd and the agents' re-registrations.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from coordinator.book import Book
from coordinator.book_check import BookCheck
from coordinator.config import CoordinatorConfig
from coordinator.core import events as ev
from coordinator.core import lifecycle
from coordinator.core import gang_effects as fx
from coordinator.core.explanation import Explanation
from coordinator.core.admission import spans_azs
from coordinator.core.placement import NodeView
from coordinator.core.records import GangRecord, MemberAssignment, NodeRecord, holds_for_unreadable, read_records
from phalanx.reservation import Reservation
from coordinator.admission_cycle import AdmissionCycle
from coordinator.gang_api import GangApi
from coordinator.gang_writer import GangWriter
from coordinator.leadership import Leadership, RunTime, current_stimulus
from coordinator.node_sessions import AgentConn, NodeSessions
from coordinator.metrics import CoordinatorMetrics
from coordinator.retention import GangCollector
from coordinator.twophase import TwoPhaseDriver
from coordinator.election import LeaseLost, LeaseSession
from phalanx.leader_record import LeaderInfo
from phalanx.store import Delete, Put, Store, StoreUnavailable
from phalanx.timings import Timings
from phalanx import failpoints
from phalanx.agent_messages import Assign, Revoke
from phalanx.logfmt import bind, log_context, new_stimulus
from phalanx.errors import StoreUnavailable, Conflict, NotLeader
from phalanx.errors import StoreSpaceExhausted
from phalanx.model import GangState
from phalanx.spec import GangSpec
from phalanx.topology import NodeTopology

log = logging.getLogger(__name__)


class AzLeader:
    def __init__(
        self,
        store: Store,
        config: CoordinatorConfig,
        info: LeaderInfo,
        session: LeaseSession,
        *,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
        peer_channel: Callable[[str], Any] | None = None,
        metrics: CoordinatorMetrics | None = None,
    ):
        # What every part of this leadership shares (coordinator/leadership.py).
        self.lead = Leadership(store, config, info, session, wall=wall, mono=mono, metrics=metrics)
        self._last_view = float("-inf")
        # The one owner of this leadership's gang, hold and node state; the
        # two-phase driver and the collector are given it (coordinator/book.py).
        self.book = Book.of(self.az, self.lead.keys, self.timings)
        self.book_check = BookCheck(self.book, config.check_book)  # --check-book
        # The one writer of gang records, shared with the driver and the collector.
        self.writer = GangWriter(self.lead, self.book)
        self.led_since = mono()  # reset once rebuilt: when this leadership began to act
        # Set once rebuild() has loaded gangs and reservations from etcd. The
        # server publishes this leader (and agents may register) before run()
        # has rebuilt; reconciling a registration against an empty view would
        # revoke every running member as "no committed reservation".
        self.rebuilt = asyncio.Event()
        self.twophase = TwoPhaseDriver(self.lead, self.book, self.writer, self.run_time(), peer_channel)
        self.collector = GangCollector(self.lead, self.book, self.writer)
        self.writer.when_forgotten(self.twophase.forget)
        # Agent sessions and node records (coordinator/node_sessions.py).
        self.nodes = NodeSessions(self.lead, self.book, self.writer, self.twophase, perform=self.perform,
                                  evaluate=self.evaluate, transition=self._transition,
                                  until_rebuilt=self.until_rebuilt)
        # Submit, cancel, finish (coordinator/gang_api.py); the admission
        # cycle and explain (coordinator/admission_cycle.py).
        self.api = GangApi(self.lead, self.book, perform=self.perform, until_rebuilt=self.until_rebuilt)
        self.admission = AdmissionCycle(self.lead, self.book, self.writer, self.twophase, self.nodes,
                                        perform=self.perform, finish=self.api.finish,
                                        until_rebuilt=self.until_rebuilt, led_since=lambda: self.led_since)

    # What the server, the agent service and tests read of the leadership.
    @property
    def az(self) -> str:
        return self.lead.az

    @property
    def epoch(self) -> int:
        return self.lead.epoch

    @property
    def timings(self) -> Timings:
        return self.lead.timings

    @property
    def stopped(self) -> asyncio.Event:
        return self.lead.stopped

    @property
    def failure(self) -> BaseException | None:
        return self.lead.failure

    def run_time(self) -> RunTime:
        """What the two-phase driver asks of this leader (coordinator/leadership.py)."""
        return RunTime(evaluate=self.evaluate, perform=self.perform, send=self.send,
                       rendezvous_for=self.rendezvous_for, rendezvous_settled=self.rendezvous_settled,
                       placeable_nodes=self.placeable_nodes, registered_topologies=self.registered_topologies,
                       node_connected=self.node_connected)

    # ------------------------------------------------------------------ run
    async def run(self) -> None:
        """Lead until the lease is lost or a fenced write fails."""
        bind(az=self.az, epoch=self.epoch)  # this task's lines, and its spawned tasks'
        try:
            # The takeover is a stimulus too: what rebuild and recovery decide
            # (and the tasks they spawn, e.g. finishing a gang whose members
            # ended meanwhile) logs and records its id.
            with log_context(stimulus=new_stimulus(self.az)):
                await self._rebuild_while_valid()
                await self.twophase.recover()
            self.led_since = self.lead.mono()
            self.rebuilt.set()
            self.lead.spawn(self.twophase.watch(), "twophase-watch")
            self.lead.spawn(self.collector.run(), "gang-collector")
            log.info("leader of %s (epoch %d): %d gangs, %d finished, %d reservations, %d nodes", self.az, self.epoch,
                     len(self.book.gangs), len(self.book.finished), len(self.book.reservations), len(self.book.nodes))
            lost = asyncio.create_task(self.lead.session.lost.wait())
            try:
                while not self.lead.stopped.is_set():
                    waker = asyncio.create_task(self.lead.wake.wait())
                    done, _ = await asyncio.wait({waker, lost}, timeout=self.timings.cycle_wait_s, return_when=asyncio.FIRST_COMPLETED)
                    waker.cancel()
                    if lost in done:
                        raise LeaseLost("lease lost")
                    if self.lead.failure is not None:
                        raise self.lead.failure
                    self.lead.wake.clear()
                    try:
                        # One stimulus per admission cycle: its decisions (and
                        # the tasks they spawn) log it.
                        with log_context(stimulus=new_stimulus(self.az)):
                            started = time.perf_counter()
                            await self.cycle()
                            self.lead.metrics.admission_cycle.observe(time.perf_counter() - started)
                            self.book_check.after_cycle()  # not in the cycle's time
                    except StoreUnavailable as exc:
                        # A transient etcd error is not a lost leadership: the
                        # lease session decides that (docs/timing.md). Every
                        # write was fenced, so retrying next cycle is safe.
                        # etcd's space alarm would say the same every cycle:
                        # coordinator/etcd_space.py logs it once, at ERROR.
                        log.log(logging.DEBUG if isinstance(exc, StoreSpaceExhausted) else logging.INFO,
                                "cycle in %s: %s", self.az, exc)
                    if self.lead.mono() - self._last_view >= self.timings.metrics_view_interval_s:
                        self._last_view = self.lead.mono()
                        self.publish_view()
            finally:
                lost.cancel()
        finally:
            await self.stop()

    async def stop(self) -> None:
        self.lead.stop()
        self.nodes.close_all()

    # The leader's public face: what the server and the two-phase driver use
    # (docs/design.md §19.6). Nothing outside this class touches its private
    # members (tests/unit/test_no_private_reach.py).
    def node_connected(self, node: str) -> bool:
        """Whether the node's agent has a session with this leader."""
        return self.nodes.node_connected(node)

    def send(self, node: str, msg: Assign | Revoke) -> None:
        """Queue a message on the node's session (dropped if it has none)."""
        self.nodes.send(node, msg)

    @property
    def conns(self) -> dict[str, AgentConn]:
        """The agent sessions (coordinator/agents.py reads them)."""
        return self.nodes.conns

    # Agent events and an admin's node commands: coordinator/node_sessions.py.
    async def on_register(self, conn: AgentConn, members: list[Any]) -> None:
        await self.nodes.on_register(conn, members)

    def on_heartbeat(self, conn: AgentConn) -> bool:
        return self.nodes.on_heartbeat(conn)

    async def on_member(self, conn: AgentConn, m: Any) -> None:
        await self.nodes.on_member(conn, m)

    def on_disconnect(self, conn: AgentConn) -> None:
        self.nodes.on_disconnect(conn)

    def heartbeats(self) -> dict[str, float]:
        return self.nodes.heartbeats()

    async def cordon(self, node: str, cordoned: bool) -> NodeRecord:
        return await self.nodes.cordon(node, cordoned)

    async def drain(self, node: str, requeue: bool) -> tuple[NodeRecord, list[str], list[str]]:
        return await self.nodes.drain(node, requeue)

    async def delete_node(self, node: str, force: bool) -> list[str]:
        return await self.nodes.delete_node(node, force)

    def rendezvous_settled(self, gang_id: str) -> None:
        self.admission.rendezvous_settled(gang_id)
    # -------------------------------------------------------------- rebuild
    async def _rebuild_while_valid(self) -> None:
        """``rebuild()``, retried while the lease holds: an etcd member that
        times out (and makes the store move to another, docs/etcd-keys.md) is
        no reason to give a fresh leadership up and make the AZ elect again
        (docs/chaos.md finding 6). ``rebuild()`` reads everything before it
        changes any state, so a failed attempt leaves nothing to undo."""
        while True:
            self.lead.check_valid()
            try:
                await self.rebuild()
                return
            except StoreUnavailable as exc:
                log.info("rebuild of %s (epoch %d): %s; retrying", self.az, self.epoch, exc)
                await asyncio.sleep(self.timings.store_retry_pause_s)

    async def rebuild(self) -> None:
        # All reads first: an etcd error leaves this leader's state untouched.
        k = self.lead.keys
        if failpoints.on("leader.rebuild_unavailable"):
            raise StoreUnavailable("failpoint leader.rebuild_unavailable")
        # Paged (docs/limits.md "Paged reads"): no range reply grows with the
        # number of gangs, so a takeover never fails on the size of etcd.
        gang_kvs, _ = await self.lead.store.get_prefix_paged(k.gangs())
        res_kvs, _ = await self.lead.store.get_prefix_paged(k.reservations(self.az))
        node_kvs, _ = await self.lead.store.get_prefix_paged(k.nodes(self.az))
        now = self.lead.mono()
        # A record that cannot be read (corrupt, hostile, from a future
        # version) is logged, counted and skipped: retrying would read it
        # again, and an AZ without a leader admits nothing. A skipped
        # reservation's devices are still held, as far as its gang's record
        # names them (holds_for_unreadable), until a rebuild finds the
        # record readable or gone.
        reservations, bad_res = read_records(res_kvs, Reservation.from_dict)
        gangs, bad_gangs = read_records(gang_kvs, GangRecord.from_dict)
        nodes, bad_nodes = read_records(node_kvs, NodeRecord.from_dict)
        self.unreadable_records = dict(bad_res + bad_gangs + bad_nodes)
        for key, why in self.unreadable_records.items():
            log.warning("rebuild of %s (epoch %d): skipped unreadable record %s: %s", self.az, self.epoch, key[:200], why)
        # (two-phase reservations are the participant's: TwoPhaseDriver.recover)
        self.book.restored((r for r in reservations if not r.two_phase),
                           holds_for_unreadable((key for key, _ in bad_res), k.reservations(self.az), gangs, self.az))
        for g in gangs:
            if self.book.live_here(g):
                # (RESTARTING gangs are not terminal: they are kept too.)
                self.book.owned(g)
                before = ev.last_epoch(g.events)
                if before and before != self.epoch and not g.state.terminal:
                    self.writer.ride_on_next_write(
                        g.id, [ev.fenced(self.lead.wall(), self.epoch, self.az, before, g.incarnation)])
            self.writer.note(g)  # finished gangs we own: collected after gang_retention_s
        for n in nodes:
            # Not placeable until its agent reaches us; lost only after a
            # full replace_after_s from now (it may be fencing right now).
            self.book.node_restored(n, now)

    # -------------------------------------------------------------- effects
    async def perform(self, effect: fx.Effect) -> fx.Event:
        """Perform one gang effect a core decided (coordinator/core/
        gang_effects.py) and return what came of it: the interpreter of gang
        effects; the cross-AZ protocol's are the two-phase driver's own
        (docs/design.md §19.9). One handler per effect, each doing only the
        I/O and the cache updates; what follows (e.g. dispatch and STARTING
        once a reservation committed) is decided by the core from the
        returned event. A guarded gang write that loses its compare comes
        back as ``WriteRefused`` (only ``finish``, the API's, raises it)."""
        match effect:
            case fx.ReserveDevices():
                return await self.admission.reserve(effect)
            case fx.StartTwoPhaseAttempt():
                # The plan took the devices from its free view;
                # attempt_devices keeps them out of later cycles' views until
                # its holds show.
                with log_context(gang=effect.gang.id, incarnation=effect.gang.incarnation):
                    self.twophase.place_attempt(effect.gang, effect.placement, effect.stimulus_id)
            case fx.FailAdmission():
                await self.admission.fail_admission(effect)
            case fx.KeepWaiting():
                self.admission.keep_waiting(effect)
            case fx.WriteTransition():
                return await self._write_transition(effect)
            case fx.Finish():
                try:
                    return fx.GangWritten(await self.api.finish(effect.gang, effect.state, effect.reason,
                                                                list(effect.events)))
                except Conflict as exc:
                    return fx.WriteRefused(str(exc))
            case fx.TearDown():
                return await self._tear_down(effect)
            case fx.Requeue():
                return await self._requeue(effect)
            case fx.ReleaseDevices():
                await self._release(effect.gang)
            case fx.ForgetGang():
                self.book.not_owned(effect.gang.id)  # participants release their own holds
            case fx.SendAssignments():
                self.dispatch(effect.gang, effect.only_node, effect.skip_ranks)
            case fx.SendRevoke():
                self.send(effect.node, Revoke(effect.gang, effect.incarnation, effect.reason))
            case fx.MarkStarting():
                await self.mark_starting(effect.gang)
            case fx.CloseSession():
                self.nodes.close_session(effect.node)
            case fx.MarkNodeNotReady():
                await self.nodes.mark_not_ready(effect)
            case fx.NodeLost():
                await self.nodes.lose_node(effect)
            case fx.RegisterNode():
                await self.nodes.register_node(effect)
            case fx.IgnoreMemberReport():
                log.warning("ignored a member report at registration: %s", effect.why)
            case fx.PublishMemberReport():
                # Cross-AZ gang committed here: kept, and published for its owner.
                await self.twophase.on_member(effect.node, effect.member)
            case fx.TrackMembers():
                self.book.members_reported(effect.gang, effect.incarnation, effect.reports)
            case _:
                raise TypeError(f"AzLeader.perform: no handler for {type(effect).__name__}")
        return fx.Performed()

    # ------------------------------------------------ the gang API's delegates
    async def submit(self, spec: GangSpec, idempotency_key: str, owner: str = "") -> tuple[GangRecord, bool]:
        return await self.api.submit(spec, idempotency_key, owner)

    async def cancel(self, gang_id: str, reason: str, by: str = "") -> GangRecord:
        return await self.api.cancel(gang_id, reason, by)

    async def _tear_down(self, e: fx.TearDown) -> fx.Event:
        """One write: the gang record, the reservation RELEASING (members may
        still run on its devices) or deleted, the name freed."""
        g, t, k = e.gang, e.teardown, self.lead.keys
        ops: list = [Delete(k.name(g.spec.name))] if t.free_name else []
        if t.releasing is not None:
            ops.append(Put(k.reservation(self.az, g.id), t.releasing.to_dict()))
        elif t.delete_reservation:
            ops.append(Delete(k.reservation(self.az, g.id)))
        try:
            written = await self.writer.write(t.record, g, ops, events=list(t.events))
        except Conflict as exc:
            return fx.WriteRefused(str(exc))
        self.book.torn_down(g, t.releasing, t.delete_reservation, restarting=t.record.state == GangState.RESTARTING)
        return fx.GangWritten(written)

    async def _requeue(self, e: fx.Requeue) -> fx.Event:
        """RESTARTING -> PENDING as the next incarnation, once every member of
        the old one is gone (lifecycle.requeue: first submit time kept, the
        restart backoff waited out)."""
        g, q = e.gang, e.requeue
        ops: list = [Delete(self.lead.keys.reservation(self.az, g.id))] if q.delete_reservation else []
        try:
            written = await self.writer.write(q.record, g, ops)
        except Conflict as exc:
            return fx.WriteRefused(str(exc))
        self.book.requeued(g)
        log.info("gang %s restarts as incarnation %d in %.1fs", g.id, written.incarnation, q.backoff_s,
                 extra={"gang": g.id, "incarnation": written.incarnation})
        self.lead.wake.set()
        return fx.GangWritten(written)

    # ---------------------------------------------------------------- cycle
    async def cycle(self) -> None:
        self.lead.check_valid()
        await self.nodes.check_liveness()
        await self._check_start_barrier()
        self.twophase.tick()
        try:
            await self.twophase.adopt_orphans()
        except StoreUnavailable as exc:
            log.info("owner-AZ loss check: %s", exc)
        await self.admission.cycle()

    # The admission cycle's, for the run loop and the two-phase driver.
    def placeable_nodes(self) -> list[NodeView]:
        return self.admission.placeable_nodes()

    def registered_topologies(self) -> list[NodeTopology]:
        return self.admission.registered_topologies()

    def publish_view(self) -> None:
        self.admission.publish_view()

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

    # ------------------------------------------------------------ dispatch
    def dispatch(self, g: GangRecord, only_node: str | None = None, skip_ranks: set[int] = frozenset()) -> None:
        """Send this AZ's members of ``g`` their assignments (only to
        ``only_node`` and not ``skip_ranks`` when an agent re-registers)."""
        rank0 = g.placement[0] if g.placement else None
        rec0 = self.book.nodes.get(rank0.node) if rank0 is not None and rank0.az == self.az else None
        sent: set[str] = set()
        for node, msg in fx.assignments(g, self.az, rec0, only_node, skip_ranks):
            sent.add(node)
            self.nodes.send(node, msg)
        if sent:  # one line per dispatch (not per member): its stimulus is the assignments' stimulus_id
            log.info("gang %s#%d dispatched to %s", g.id, g.incarnation, ", ".join(sorted(sent)),
                     extra={"gang": g.id, "incarnation": g.incarnation})

    def rendezvous_for(self, g: GangRecord, incarnation: int, placement: tuple[MemberAssignment, ...],
                       rank0: NodeRecord | None) -> tuple[str, int]:
        return self.admission.rendezvous_for(g, incarnation, placement, rank0)

    async def until_rebuilt(self) -> None:
        """Wait for rebuild(); NotLeader if this leadership ends first."""
        if not self.rebuilt.is_set():
            waits = {asyncio.ensure_future(self.rebuilt.wait()), asyncio.ensure_future(self.lead.stopped.wait())}
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
        if not self.rebuilt.is_set():
            raise NotLeader(f"leadership of {self.az} (epoch {self.epoch}) ended before its state was rebuilt")
        self.lead.check_valid()

    async def _check_start_barrier(self) -> None:
        """A gang whose members have not all started within its
        start_timeout_s is torn down (all-or-nothing at run time too)."""
        now = self.lead.wall()
        for g in list(self.book.gangs.values()):
            if self.writer.busy(g.id):
                continue
            reports = self.book.members.get((g.id, g.incarnation), {})
            why = lifecycle.start_barrier(g, reports, now)
            if why is not None:
                await self._transition(g, lifecycle.run_time_step(g, GangState.FAILED, why, reports, now, self.epoch), now)

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
                effect = fx.after_teardown_effect(then, g, self.lead.wall(), self.timings, stimulus_id=current_stimulus(),
                                                  has_reservation=g.id in self.book.reservations)
                done = await self.perform(effect)
            if isinstance(done, fx.WriteRefused):
                log.info("gang %s: %s", gang_id, done.why)
            return
        now = self.lead.wall()
        step = lifecycle.member_progress(g, reports, now, self.epoch)
        if step is not None:
            await self._transition(g, step, now)

    async def _transition(self, g: GangRecord, step: lifecycle.RunTimeStep, now: float) -> None:
        """Perform a run-time step the core decided (lifecycle.run_time_step:
        the restart policy and the events already applied)."""
        with self.writer.acting_on(g.id):
            done = await self.perform(fx.run_time_effect(g, step, now, current_stimulus()))
        if isinstance(done, fx.WriteRefused):
            log.info("gang %s: %s", g.id, done.why)
        # A teardown may already allow the release (no live members).
        if fx.reevaluate_after(step, self.book.gangs.get(g.id)):
            await self.evaluate(g.id)

    async def _write_transition(self, e: fx.WriteTransition) -> fx.Event:
        g = e.old
        try:
            written = await self.writer.write(e.record, g, events=list(e.events))
        except Conflict as exc:
            return fx.WriteRefused(str(exc))
        log.info("gang %s#%d -> %s: %s", g.id, g.incarnation, e.record.state.name, e.record.reason,
                 extra={"gang": g.id, "incarnation": g.incarnation})
        return fx.GangWritten(written)

    async def _release(self, g: GangRecord) -> None:
        key = self.lead.keys.reservation(self.az, g.id)
        r = self.book.reservations.get(g.id)
        if r is None:
            return
        self.lead.check_valid()
        await self.lead.store.fenced_txn(self.lead.fence, [], [Delete(key)])
        log.info("gang %s#%d released its devices: every member is gone", g.id, g.incarnation,
                 extra={"gang": g.id, "incarnation": g.incarnation})
        self.book.released(g)
        self.lead.wake.set()

    # ---------------------------------------------------------------- view
    async def explain(self, gang_id: str) -> Explanation | None:
        return await self.admission.explain(gang_id)
