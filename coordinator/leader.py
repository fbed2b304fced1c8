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
import secrets
import time
from typing import Any, Callable

from coordinator.book import Book
from coordinator.book_check import BookCheck
from coordinator.config import CoordinatorConfig
from coordinator.core import events as ev
from coordinator.core import capacity, lifecycle
from coordinator.core import explanation, gang_effects as fx
from coordinator.core.explanation import Explanation
from coordinator.core.admission import FailAdmission, KeepPending, plan_admissions, spans_azs, without
from coordinator.core.placement import FabricIndex, NodeView, PlacementRequest, never_fits, place
from coordinator.core.rendezvous import pick_master_port, ports_taken_on
from phalanx.ports import DEFAULT_PORTS
from coordinator.core.records import (UNREADABLE, GangRecord, IdempotencyRecord, MemberAssignment, NameRecord,
                                      NodeRecord, holds_for_unreadable, read_records)
from phalanx.reservation import Reservation
from coordinator.gang_writer import GangWriter
from coordinator.leadership import Leadership, RunTime, current_stimulus
from coordinator.node_sessions import AgentConn, NodeSessions
from coordinator.metrics import CoordinatorMetrics, pending_class
from coordinator.retention import GangCollector
from coordinator.twophase import TwoPhaseDriver
from coordinator.election import LeaseLost, LeaseSession
from phalanx.leader_record import LeaderInfo
from phalanx.store import Delete, Get, Put, Store, StoreUnavailable, absent
from phalanx.timings import Timings
from phalanx import failpoints
from phalanx.agent_messages import Assign, Revoke
from phalanx.logfmt import bind, log_context, new_stimulus
from phalanx.errors import AlreadyExists, StoreUnavailable, Conflict, DataLoss, FailedPrecondition, NotFound, NotLeader
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
        self.pending_classes: dict[str, str] = {}  # the last cycle's reason class per pending gang
        self._last_view = float("-inf")
        # The one owner of this leadership's gang, hold and node state; the
        # two-phase driver and the collector are given it (coordinator/book.py).
        self.book = Book.of(self.az, self.lead.keys, self.timings)
        self.book_check = BookCheck(self.book, config.check_book)  # --check-book
        # The one writer of gang records, shared with the driver and the collector.
        self.writer = GangWriter(self.lead, self.book)
        # Never-fits answers by request shape, valid while the registered
        # nodes do not change (keyed by the FabricIndex they were built with).
        self._verdicts: dict[tuple, str] = {}
        # (the index, other AZs' node-record version) the memo was built for
        self._verdicts_for: tuple[FabricIndex, int, tuple[NodeTopology, ...]] | None = None
        self.led_since = mono()  # reset once rebuilt: when this leadership began to act
        # Set once rebuild() has loaded gangs and reservations from etcd. The
        # server publishes this leader (and agents may register) before run()
        # has rebuilt; reconciling a registration against an empty view would
        # revoke every running member as "no committed reservation".
        self.rebuilt = asyncio.Event()
        # Rendezvous ports picked for placements whose write is in flight
        # (gang -> (rank-0 node, port)): taken for concurrent picks too.
        self._picking: dict[str, tuple[str, int]] = {}
        # Reservation txns in flight at once (CoordinatorConfig.reserve_parallelism).
        self._reserve_slots = asyncio.Semaphore(config.reserve_parallelism)
        self.twophase = TwoPhaseDriver(self.lead, self.book, self.writer, self.run_time(), peer_channel)
        self.collector = GangCollector(self.lead, self.book, self.writer)
        self.writer.when_forgotten(self.twophase.forget)
        # Agent sessions and node records (coordinator/node_sessions.py).
        self.nodes = NodeSessions(self.lead, self.book, self.writer, self.twophase, perform=self.perform,
                                  evaluate=self.evaluate, transition=self._transition,
                                  until_rebuilt=self.until_rebuilt)

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
        """The write carrying the port ``rendezvous_for`` picked for the gang
        is done (or failed): the pick no longer holds the port for others."""
        self._picking.pop(gang_id, None)

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
                return await self._reserve(effect)
            case fx.StartTwoPhaseAttempt():
                # The plan took the devices from its free view;
                # attempt_devices keeps them out of later cycles' views until
                # its holds show.
                with log_context(gang=effect.gang.id, incarnation=effect.gang.incarnation):
                    self.twophase.place_attempt(effect.gang, effect.placement, effect.stimulus_id)
            case fx.FailAdmission():
                await self._fail_admission(effect)
            case fx.KeepWaiting():
                self._keep_waiting(effect)
            case fx.WriteTransition():
                return await self._write_transition(effect)
            case fx.Finish():
                try:
                    return fx.GangWritten(await self.finish(effect.gang, effect.state, effect.reason, list(effect.events)))
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

    # ----------------------------------------------------------- submission
    async def submit(self, spec: GangSpec, idempotency_key: str, owner: str = "") -> tuple[GangRecord, bool]:
        self.lead.check_valid()
        await self.until_rebuilt()
        await failpoints.hit("leader.before_submit")
        self.lead.check_valid()
        k = self.lead.keys
        # No pre-read of the idempotency key: the txn below creates it only if
        # absent, and only a lost compare costs the extra read.
        now = self.lead.wall()
        gang_id = f"{spec.name}-{secrets.token_hex(4)}"
        stimulus = new_stimulus(self.az)  # the submission: its event and its lines name it
        rec = GangRecord(
            id=gang_id, spec=spec, state=GangState.PENDING, owner_az=self.az, submitted_at=now,
            updated_at=now, idempotency_key=idempotency_key, reason="waiting for placement", owner=owner,
            events=ev.append((), [ev.submitted(now, self.epoch, owner, spec.queue, spec.priority).stamped(stimulus)]),
        )
        compares = [absent(k.name(spec.name))]
        ops = [Put(k.name(spec.name), NameRecord(gang_id).to_dict())]
        if idempotency_key:
            compares.append(absent(k.idempotency(idempotency_key)))
            ops.append(Put(k.idempotency(idempotency_key), IdempotencyRecord(gang_id).to_dict()))
        self.lead.check_valid()
        try:
            res = await self.lead.fenced_txn(
                [absent(k.gang(gang_id))] + compares, [Put(k.gang(gang_id), rec.to_dict())] + ops,
                [Get(k.name(spec.name))] + ([Get(k.idempotency(idempotency_key))] if idempotency_key else []),
            )
            if failpoints.on("leader.submit_reply_lost") and res.succeeded:
                raise StoreUnavailable("failpoint leader.submit_reply_lost: the submission's reply is lost")
        except StoreUnavailable:
            # The outcome is unknown: the txn may have committed although its
            # reply was lost. The client is told UNAVAILABLE and may retry with
            # its idempotency key (which finds the gang, below); if it never
            # does, the gang must still be admitted, so learn the outcome.
            self.lead.spawn(self._learn_submit_outcome(gang_id), f"learn-submit-{gang_id}")
            raise
        if not res.succeeded:
            if idempotency_key and res.results[1]:
                existing = await self._by_idempotency(idempotency_key, spec)
                if existing:
                    if fx.adopt_retried(existing, self.az, self.book.gangs):
                        self.book.owned(existing)
                        self.lead.metrics.submitted(existing.spec.queue)  # its first attempt's reply was lost
                        self.lead.wake.set()
                    return existing, False
            name_kvs, holder = res.results[0], None
            if name_kvs:
                try:
                    holder = NameRecord.from_dict(name_kvs[0].json()).id
                except UNREADABLE:
                    holder = "its name record cannot be read"  # still taken: the key exists
            raise fx.submission_refused(spec.name, holder)
        rec = rec.evolve(mod_revision=res.revision)
        self.book.owned(rec)
        # The RPC's task: its later lines (and the service's) carry the gang.
        bind(az=self.az, epoch=self.epoch, gang=gang_id, incarnation=rec.incarnation, stimulus=stimulus)
        log.info("gang %s submitted to queue %s (%d members)", gang_id, spec.queue, spec.members)
        self.lead.metrics.submitted(spec.queue)
        self.lead.wake.set()
        return rec, True

    async def _learn_submit_outcome(self, gang_id: str) -> None:
        """After a submission txn with an unknown outcome (docs/chaos.md
        finding 2): read ``gangs/<id>`` until etcd answers and, if the txn
        applied, take the gang on as if its reply had arrived. The first read
        waits one etcd timeout, so that a proposal still in flight when the
        call gave up has been applied or dropped by then. If the leadership
        ends first, the successor's rebuild finds the gang in etcd anyway."""
        await asyncio.sleep(self.timings.etcd_timeout_s)
        while True:
            self.lead.check_valid()
            try:
                kv = await self.lead.store.get(self.lead.keys.gang(gang_id))
                break
            except StoreUnavailable:
                await asyncio.sleep(self.timings.store_retry_pause_s)
        if kv is None:
            log.info("submission %s did not apply (reply lost)", gang_id)
            return
        rec = GangRecord.from_dict(kv.json(), kv.mod_revision)
        if rec.owner_az == self.az and not rec.state.terminal and gang_id not in self.book.gangs:
            log.info("submission %s applied although its reply was lost; admitting it", gang_id)
            self.book.owned(rec)
            self.lead.metrics.submitted(rec.spec.queue)
            self.lead.wake.set()

    async def _by_idempotency(self, key: str, spec: GangSpec) -> GangRecord | None:
        kv = await self.lead.store.get(self.lead.keys.idempotency(key))
        if kv is None:
            return None
        try:
            created = IdempotencyRecord.from_dict(kv.json()).id
        except UNREADABLE as exc:
            # The cluster's fault, not the caller's; the key stays taken.
            raise DataLoss(f"idempotency_key: the stored record of {key!r} cannot be read "
                           f"({type(exc).__name__}: {str(exc)[:200]}); an operator must delete or repair it") from None
        gkv = await self.lead.store.get(self.lead.keys.gang(created))
        if gkv is None:
            return None
        rec = GangRecord.from_dict(gkv.json(), gkv.mod_revision)
        if rec.spec != spec:
            raise AlreadyExists(f"idempotency_key: {key!r} was used for a different spec (gang {rec.id})")
        return rec

    # -------------------------------------------------------------- cancel
    async def cancel(self, gang_id: str, reason: str, by: str = "") -> GangRecord:
        bind(az=self.az, epoch=self.epoch, gang=gang_id, stimulus=new_stimulus(self.az))  # the RPC's task
        self.lead.check_valid()
        # Before rebuild() the reservations are unknown: cancelling then would
        # strand the gang's reservation.
        await self.until_rebuilt()
        g, attempt = self.book.gangs.get(gang_id), 1
        while True:
            if g is None:
                kv = await self.lead.store.get(self.lead.keys.gang(gang_id))
                if kv is None:
                    raise NotFound(f"id: no gang {gang_id!r} (finished gangs are deleted "
                                   f"gang_retention_s={self.timings.gang_retention_s:g}s after they end)")
                g = GangRecord.from_dict(kv.json(), kv.mod_revision)
            verdict = lifecycle.cancel(g, self.az, reason, by, self.lead.wall(), self.epoch)
            if isinstance(verdict, lifecycle.CancelRefused):
                raise FailedPrecondition(verdict.message)
            try:
                return await self.finish(g, GangState.CANCELLED, verdict.reason, list(verdict.events))
            except Conflict:
                # Lost its compare to another write of the gang (its start,
                # most often): decide again on the record etcd has now,
                # rather than make the client retry a cancel of a live gang.
                if attempt == lifecycle.CANCEL_ATTEMPTS:
                    raise
                log.info("cancel of %s lost a race with another write (attempt %d of %d); reading it again",
                         gang_id, attempt, lifecycle.CANCEL_ATTEMPTS)
                g, attempt = None, attempt + 1

    async def finish(self, g: GangRecord, state: GangState, reason: str, events: list = ()) -> GangRecord:
        """Tear an incarnation down: to a terminal state, or to RESTARTING.
        Its devices stay held (reservation RELEASING) until every member is
        known to be gone, so they are never handed to another gang (or to the
        gang's next incarnation) while an old member may still run: at most
        one incarnation of a gang is ever alive."""
        inc = g.incarnation
        t = lifecycle.teardown(g, state, reason, events, self.book.reservations.get(g.id),
                               lifecycle.live_member_nodes(g, self.book.members.get((g.id, inc), {})), self.lead.wall(), self.epoch)
        effect = fx.TearDown(g, t, current_stimulus())
        done = await self.perform(effect)
        if isinstance(done, fx.WriteRefused):
            raise Conflict(done.why)
        # Stop (or tell agents to forget) the members of this incarnation.
        for follow in fx.after_torn_down(effect, done):
            await self.perform(follow)
        held = "" if t.releasing is None and not t.delete_reservation else (
            "; devices held until its members are gone" if t.releasing is not None else "; devices released")
        log.info("gang %s#%d -> %s: %s%s", g.id, inc, state.name, reason, held, extra={"gang": g.id, "incarnation": inc})
        return done.record

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
    def placeable_nodes(self) -> list[NodeView]:
        """Nodes whose agent is connected and ready, less every device held
        here: reservations (and stand-ins for unreadable ones), cross-AZ
        holds (PREPARED or COMMITTED) and cross-AZ releases not yet done."""
        taken = capacity.held((self.az, s) for s in self.book.held_slices())
        up = [(rec.topology, True) for name, rec in self.book.nodes.items()
              if (live := self.book.liveness.get(name)) is not None and live.ready and name in self.nodes.conns
              and not rec.cordoned]
        return capacity.free_view(up, taken)

    async def cycle(self) -> None:
        self.lead.check_valid()
        await self.nodes.check_liveness()
        await self._check_start_barrier()
        self.twophase.tick()
        try:
            await self.twophase.adopt_orphans()
        except StoreUnavailable as exc:
            log.info("owner-AZ loss check: %s", exc)
        pending = self.waiting_gangs()
        if not pending:
            return
        started = time.perf_counter()
        decisions = self._plan(pending)
        self.lead.metrics.placement_decision.observe(time.perf_counter() - started)
        last_attempts = {d.gang.id: self.twophase.last_reason(d.gang.id) for d in decisions
                         if isinstance(d, FailAdmission) and spans_azs(d.gang) and not d.never_fits}
        effects = fx.admission_effects(decisions, az=self.az, epoch=self.epoch, now=self.lead.wall(),
                                       pending_class=pending_class, last_attempts=last_attempts,
                                       stimulus_id=current_stimulus())
        for e in effects:
            if isinstance(e, fx.ReserveDevices):
                # Hold the devices in memory now, so later decisions (this
                # cycle or the next) never see them free; undone on failure.
                self.book.held_in_memory(e.reservation)
                self.writer.start_acting(e.gang.id)
                with log_context(gang=e.gang.id, incarnation=e.gang.incarnation):  # the reserve task's lines
                    self.lead.spawn(self._admit(e), f"reserve-{e.gang.id}")
            elif isinstance(e, fx.FailAdmission):
                self.writer.start_acting(e.gang.id)
                with log_context(gang=e.gang.id, incarnation=e.gang.incarnation):
                    self.lead.spawn(self.perform(e), f"timeout-{e.gang.id}")
            else:
                await self.perform(e)  # no I/O: done before the next decision, as the plan ordered them

    def waiting_gangs(self) -> list[GangRecord]:
        """The gangs the admission plan orders, in one queue: single-AZ gangs
        PENDING here and cross-AZ gangs whose two-phase owner waits for a
        placement; none with a write in flight."""
        return [g for g in self.book.gangs.values() if not self.writer.busy(g.id)
                and (self.twophase.awaits_placement(g) if spans_azs(g) else g.state == GangState.PENDING)]

    def publish_view(self) -> None:
        """Set the metrics' gauges of this leader's view (pending gangs by
        reason class, reservations, holds, agents, nodes, GPUs); called from
        the run loop at most every metrics_view_interval_s."""
        pending: list[str] = []
        classes: dict[str, str] = {}
        for g in self.book.gangs.values():
            wide = spans_azs(g)
            c = fx.pending_gauge_class(g.state, wide, wide and self.twophase.awaits_placement(g),
                                       self.pending_classes.get(g.id, "no_room"))
            if c is None:
                continue
            classes[g.id] = c
            pending.append(c)
        self.pending_classes = classes  # forget gangs no longer pending
        views = self.placeable_nodes()
        up = {v.name for v in views}
        free = sum(len(v.free_gpus) for v in views)
        total = sum(len(v.topology.gpu_indices) for v in views)
        self.lead.metrics.view(
            pending=pending, reservations=[r.state.value for r in self.book.reservations.values()],
            holds=[h.state.name for h in self.book.participant.holds.values()],
            agents=sum(1 for c in self.nodes.conns.values() if not c.closed), nodes_ready=len(views),
            gpus_free=free, gpus_used=total - free,
            nodes=[capacity.node_state(rec, name in up) for name, rec in self.book.nodes.items()],
        )

    def judges_never_fits(self) -> bool:
        """Whether the registered nodes are complete enough to fail a gang
        as never fitting: this leadership has acted for
        node_register_grace_s, so agents starting with the cluster have
        registered by now (node records outlive a failover, so a successor
        knows every node its predecessor did)."""
        return self.lead.mono() - self.led_since >= self.timings.node_register_grace_s

    def registered_topologies(self) -> list[NodeTopology]:
        """Every node of this AZ with a record that can take work, ready or
        not: neither cordoned nor expired (docs/nodes.md)."""
        return [n.topology for n in self.book.nodes.values() if capacity.takes_work(n)]

    def _plan(self, pending: list[GangRecord]) -> list:
        """plan_admissions on the live view (pure; the cycle and explain both
        call it, so explain reports exactly what the next cycle decides)."""
        index = self.nodes.index
        inventory = (index, self.twophase.remote_version, tuple(self.registered_topologies()))
        if self._verdicts_for is None or self._verdicts_for[0] is not index or self._verdicts_for[1:] != inventory[1:]:
            self._verdicts, self._verdicts_for = {}, inventory
        wide = any(spans_azs(g) for g in pending)
        registered = None
        if self.judges_never_fits():
            registered = self.registered_topologies() + (self.twophase.other_azs_registered() if wide else [])
        views = self.placeable_nodes()
        # Nodes that cannot be placed on now (not ready, no session here) go
        # in as not ready: placement skips them, shortfalls count them.
        up = {v.name for v in views}
        views += [NodeView(topology=n.topology, free_gpus=frozenset(), free_nics=frozenset(), ready=False)
                  for name, n in self.book.nodes.items() if name not in up and capacity.takes_work(n)]
        if wide:
            # Cross-AZ gangs are placed over every AZ: the others as the
            # watch shows them (no etcd request; stale at worst, which the
            # participants' ledgers catch).
            views += self.twophase.other_azs_view()
        # Devices of two-phase attempts placed by earlier cycles whose holds
        # may not show yet are not free for anyone.
        views = without(views, self.twophase.attempt_devices())
        return plan_admissions(pending, views, self.lead.wall(), az=self.az,
                               backfill_window_s=self.timings.backfill_window_s, registered=registered,
                               verdicts=self._verdicts, index=self.twophase.placement_index(index) if wide else index)

    def queue_reason(self, d: KeepPending) -> str:
        return fx.queue_reason(d, self.az)

    def _keep_waiting(self, e: fx.KeepWaiting) -> None:
        self.pending_classes[e.gang.id] = e.pending_class
        if self.book.waiting(e.gang.id, e.reason):
            log.debug("gang %s pending: %s", e.gang.id, e.reason, extra={"gang": e.gang.id})

    async def _admit(self, e: fx.ReserveDevices) -> None:
        """The reserve task: the reservation, then what the core says follows
        from its outcome (dispatch, STARTING)."""
        done = await self.perform(e)
        for follow in fx.after_reserved(done, e.stimulus_id):
            await self.perform(follow)

    async def _reserve(self, e: fx.ReserveDevices) -> fx.Event:
        """All of a gang's devices in ONE fenced etcd transaction."""
        g, p, r = e.gang, e.placement, e.reservation
        try:
            async with self._reserve_slots:
                placement = fx.member_assignments(p)
                master = self.rendezvous_for(g, g.incarnation, placement, self.book.nodes.get(placement[0].node))
                new, events = fx.reserved_record(g, p, r, master, self.lead.wall(), self.epoch)
                key = self.lead.keys.reservation(self.az, g.id)
                await failpoints.hit("leader.before_reserve")
                try:
                    written = await self.writer.write(new, g, [Put(key, r.to_dict())], [absent(key)], events=list(events))
                except StoreUnavailable:
                    # Outcome unknown: the txn may have committed although
                    # its reply was lost. Keep the devices held and learn the
                    # outcome from etcd (we are its only writer), never guess.
                    learned = await self._learn_reserve_outcome(g, r)
                    if learned is None:
                        self.book.unheld(g.id, r)
                        return fx.NotApplied(g.id)  # still PENDING: the next cycle places it again
                    written = learned
                await failpoints.hit("leader.after_reserve")
        except BaseException:
            self.book.unheld(g.id, r)
            raise
        finally:
            self.writer.done_acting(g.id)
            self._picking.pop(g.id, None)
        self.book.placed(g.id)
        log.info("gang %s#%d admitted: %d members on %d nodes (%s)", g.id, g.incarnation, len(written.placement),
                 len(r.nodes), p.reason)
        return fx.GangWritten(written)

    async def _learn_reserve_outcome(self, g: GangRecord, r: Reservation) -> GangRecord | None:
        """After a reservation txn with an unknown outcome: read the gang and
        reservation keys (one consistent txn) until etcd answers. Returns the
        written gang record if the txn applied, None if it did not. While etcd
        does not answer, the devices stay held; if our lease runs out first,
        check_valid() ends this leadership and the successor rebuilds from
        etcd, which is always consistent."""
        gkey, rkey = self.lead.keys.gang(g.id), self.lead.keys.reservation(self.az, g.id)
        while True:
            self.lead.check_valid()
            try:
                res = await self.lead.store.txn([], [Get(gkey), Get(rkey)])
                break
            except StoreUnavailable:
                await asyncio.sleep(self.timings.store_retry_pause_s)
        gkvs, rkvs = res.results
        cur = GangRecord.from_dict(gkvs[0].json(), gkvs[0].mod_revision) if gkvs else None
        try:
            written = Reservation.from_dict(rkvs[0].json()) if rkvs else None
        except UNREADABLE:
            written = None  # not the record this txn writes
        applied = (written is not None and written.incarnation == r.incarnation and cur is not None
                   and cur.state != GangState.PENDING)
        if cur is not None:
            self.writer.read_back(g, cur, applied=applied)
        if applied:
            log.info("reservation of %s applied although its reply was lost", g.id)
            return cur
        log.info("reservation of %s did not apply (reply lost); devices released", g.id)
        return None

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

    async def _fail_admission(self, e: fx.FailAdmission) -> None:
        try:
            if e.never_fits:
                log.info("gang %s fails at once: %s", e.gang.id, e.reason)
            await self.finish(e.gang, GangState.FAILED, e.reason)
        finally:
            self.writer.done_acting(e.gang.id)

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
        """(MASTER_ADDR, MASTER_PORT) for placing ``incarnation`` of ``g``: the
        rank-0 node's advertised address (its name if its agent advertises
        none) and a port of its range that no other live gang this leader
        knows has there, and not this gang's previous port (a leftover of the
        last incarnation may still hold it). ``rank0`` is the rank-0 node's
        record (None: unknown, the default range). A record already placed
        for this incarnation keeps its rendezvous (a rewrite must not move
        it: members may have been told)."""
        node = placement[0].node
        if g.incarnation == incarnation and g.placement and g.master_port and g.placement[0].node == node:
            return g.master_addr, g.master_port
        live = [*self.book.gangs.values(), *self.book.gang_cache.values()]
        taken = ports_taken_on(node, ((o.id, o.placement[0].node, o.master_port) for o in live
                                      if o.placement and (not o.state.terminal or o.id in self.book.reservations)),
                               except_gang=g.id)
        taken |= {port for gid, (n, port) in self._picking.items() if n == node and gid != g.id}
        if g.master_port:
            taken.add(g.master_port)
        ports = rank0.ports if rank0 is not None else DEFAULT_PORTS
        port = pick_master_port(ports, g.id, incarnation, taken)
        self._picking[g.id] = (node, port)  # the caller drops it once its write is done
        return (rank0.address if rank0 is not None else "") or node, port

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
        """Why a gang this leader owns is not (yet) admitted, from the
        leader's own view: a single-AZ gang by a dry run of the same
        admission plan the next cycle runs (so what it says is what the cycle
        does, rule and all; that plan orders cross-AZ gangs with it), a
        cross-AZ gang from its two-phase owner state and the global view the
        plan places it on. None: not a waiting gang of this leader (the
        caller answers from etcd)."""
        self.lead.check_valid()
        await self.until_rebuilt()
        g = self.book.gangs.get(gang_id)
        if g is None or g.state not in (GangState.PENDING, GangState.RESERVING):
            return None
        waited = max(0.0, self.lead.wall() - g.submitted_at)
        head = f"{g.state.name} for {waited:.0f}s"
        grace = "" if self.judges_never_fits() else (
            f"; whether it can ever fit is judged once this leader has led node_register_grace_s="
            f"{self.timings.node_register_grace_s:g}s (agents may still be registering)")
        if spans_azs(g):
            return await self._explain_two_phase(g, head, grace)
        if self.writer.busy(g.id):
            return Explanation(f"{head}: the leader is writing its reservation (or its failure) now",
                               "a write for this gang is in flight at the leader")
        decisions = self._plan(self.waiting_gangs())
        pos, d = next((i, d) for i, d in enumerate(decisions, 1) if d.gang.id == g.id)
        return explanation.of_decision(d, pos, len(decisions), head, grace, self.az)

    async def _explain_two_phase(self, g: GangRecord, head: str, grace: str) -> Explanation:
        o = self.book.owners.get(g.id)
        phase = o.phase if o is not None else None
        views, registered, led = await self.twophase.snapshot()
        owner = explanation.owner_summary(phase, o.attempts if o is not None else 0,
                                          o.last_reason if o is not None else "", self.az,
                                          sorted({t.az for t in registered} - led))
        # RESERVING with its owner waiting for a placement again (an aborted
        # attempt's next incarnation): explained as pending, below.
        if g.state == GangState.RESERVING and not self.twophase.awaits_placement(g):
            azs = sorted({m.az for m in g.placement})
            return Explanation(f"{head}: prepared in {', '.join(azs)}; waiting for every vote and the decision",
                               owner)
        request = PlacementRequest.from_spec(g.id, g.spec)
        verdict = never_fits(request, registered) if not grace else ""
        return explanation.of_two_phase(phase, owner, head, grace, self.az, verdict,
                                        None if verdict else place(request, views))
