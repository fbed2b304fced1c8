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
from coordinator.core import events as gang_events
from coordinator.core.explanation import Explanation
from coordinator.core.placement import NodeView
from coordinator.core.records import GangRecord, MemberAssignment, NodeRecord, holds_for_unreadable, read_records
from phalanx.reservation import Reservation
from coordinator.admission_cycle import AdmissionCycle
from coordinator.gang_api import GangApi
from coordinator.gang_performer import GangPerformer
from coordinator.gang_writer import GangWriter
from coordinator.leadership import Leadership, RunTime
from coordinator.node_sessions import AgentConn, NodeSessions
from coordinator.metrics import CoordinatorMetrics
from coordinator.retention import GangCollector
from coordinator.twophase import TwoPhaseDriver
from coordinator.election import LeaseLost, LeaseSession
from phalanx.leader_record import LeaderInfo
from phalanx.store import Store, StoreUnavailable
from phalanx.timings import Timings
from phalanx import failpoints
from phalanx.agent_messages import Assign, Revoke
from phalanx.logfmt import bind, log_context, new_stimulus
from phalanx.errors import StoreUnavailable, NotLeader
from phalanx.errors import StoreSpaceExhausted
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
        # The gang-effect interpreter (coordinator/gang_performer.py): the
        # parts below are given its perform, and it is connected to them.
        self.performer = GangPerformer(self.lead, self.book, self.writer)
        perform = self.performer.perform
        self.twophase = TwoPhaseDriver(self.lead, self.book, self.writer, self.run_time(), peer_channel)
        self.collector = GangCollector(self.lead, self.book, self.writer)
        self.writer.when_forgotten(self.twophase.forget)
        # Agent sessions and node records (coordinator/node_sessions.py).
        self.nodes = NodeSessions(self.lead, self.book, self.writer, self.twophase, perform=perform,
                                  evaluate=self.performer.evaluate, transition=self.performer.transition,
                                  until_rebuilt=self.until_rebuilt)
        # Submit, cancel, finish (coordinator/gang_api.py); the admission
        # cycle and explain (coordinator/admission_cycle.py).
        self.api = GangApi(self.lead, self.book, perform=perform, until_rebuilt=self.until_rebuilt)
        self.admission = AdmissionCycle(self.lead, self.book, self.writer, self.twophase, self.nodes,
                                        perform=perform, finish=self.api.finish,
                                        until_rebuilt=self.until_rebuilt, led_since=lambda: self.led_since)
        self.performer.connect(twophase=self.twophase, nodes=self.nodes, admission=self.admission,
                               finish=self.api.finish)

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
        """What the two-phase driver asks of the run-time side (coordinator/leadership.py):
        the interpreter's own methods; the rest are delegates, as the parts
        they reach are built after the driver."""
        return RunTime(evaluate=self.performer.evaluate, perform=self.performer.perform, send=self.send,
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
                before = gang_events.last_epoch(g.events)
                if before and before != self.epoch and not g.state.terminal:
                    self.writer.ride_on_next_write(
                        g.id, [gang_events.fenced(self.lead.wall(), self.epoch, self.az, before, g.incarnation)])
            self.writer.note(g)  # finished gangs we own: collected after gang_retention_s
        for n in nodes:
            # Not placeable until its agent reaches us; lost only after a
            # full replace_after_s from now (it may be fencing right now).
            self.book.node_restored(n, now)

    # ------------------------------------------------ the gang API's delegates
    async def submit(self, spec: GangSpec, idempotency_key: str, owner: str = "") -> tuple[GangRecord, bool]:
        return await self.api.submit(spec, idempotency_key, owner)

    async def cancel(self, gang_id: str, reason: str, by: str = "") -> GangRecord:
        return await self.api.cancel(gang_id, reason, by)

    # ---------------------------------------------------------------- cycle
    async def cycle(self) -> None:
        self.lead.check_valid()
        await self.nodes.check_liveness()
        await self.performer.check_start_barrier()
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

    # ---------------------------------------------------------------- view
    async def explain(self, gang_id: str) -> Explanation | None:
        return await self.admission.explain(gang_id)
