"""The admission cycle of a leadership (docs/design.md §19).

``AdmissionCycle`` orders the waiting gangs, runs the admission plan
(coordinator/core/admission.py) on the live view and performs what the core
decided from it: a single-AZ gang's reservation (one fenced txn, its outcome
learnt from etcd when the reply is lost), a cross-AZ gang's two-phase
attempt, a failure, or a pending reason. ``explain`` dry-runs the same plan.
It also owns what the plan keeps between cycles: the never-fits verdicts, the
rendezvous ports picked for writes in flight, the reason class per pending
gang. ``AzLeader`` builds it and keeps the public methods the server and the
two-phase driver call, delegating here; what it needs of the rest (finish, the
wait for rebuild, when the leadership began to act) is passed in as callables.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from coordinator.book import Book
from coordinator.core import capacity, explanation
from coordinator.core import gang_effects
from coordinator.core.admission import FailAdmission, KeepPending, plan_admissions, spans_azs, without
from coordinator.core.explanation import Explanation
from coordinator.core.placement import FabricIndex, NodeView, PlacementRequest, never_fits, place
from coordinator.core.records import UNREADABLE, GangRecord, MemberAssignment, NodeRecord
from coordinator.core.rendezvous import pick_master_port, ports_taken_on
from coordinator.gang_writer import GangWriter
from coordinator.leadership import Leadership, current_stimulus
from coordinator.metrics import pending_class
from coordinator.node_sessions import NodeSessions
from coordinator.twophase import TwoPhaseDriver
from phalanx import failpoints
from phalanx.errors import StoreUnavailable
from phalanx.logfmt import log_context
from phalanx.model import GangState
from phalanx.ports import DEFAULT_PORTS
from phalanx.reservation import Reservation
from phalanx.store import Get, Put, absent
from phalanx.topology import NodeTopology

log = logging.getLogger(__name__)


class AdmissionCycle:
    def __init__(self, lead: Leadership, book: Book, writer: GangWriter, twophase: TwoPhaseDriver,
                 nodes: NodeSessions, *, perform: Callable[[gang_effects.Effect], Awaitable[gang_effects.Event]],
                 finish: Callable[..., Awaitable[GangRecord]], until_rebuilt: Callable[[], Awaitable[None]],
                 led_since: Callable[[], float]):
        self.lead = lead
        self.book = book
        self.writer = writer
        self.twophase = twophase
        self.nodes = nodes  # sessions (placeable now) and the fabric index
        self.perform = perform  # the leader's gang-effect interpreter
        self.finish = finish  # the gang API's teardown (a failed admission)
        self.until_rebuilt = until_rebuilt
        self.led_since = led_since  # when this leadership began to act (monotonic)
        self.pending_classes: dict[str, str] = {}  # the last cycle's reason class per pending gang
        # Never-fits answers by request shape, valid while the registered
        # nodes do not change (keyed by the FabricIndex they were built with).
        self._verdicts: dict[tuple, str] = {}
        # (the index, other AZs' node-record version) the memo was built for
        self._verdicts_for: tuple[FabricIndex, int, tuple[NodeTopology, ...]] | None = None
        # Rendezvous ports picked for placements whose write is in flight
        # (gang -> (rank-0 node, port)): taken for concurrent picks too.
        self._picking: dict[str, tuple[str, int]] = {}
        # Reservation txns in flight at once (CoordinatorConfig.reserve_parallelism).
        self._reserve_slots = asyncio.Semaphore(lead.config.reserve_parallelism)

    def placeable_nodes(self) -> list[NodeView]:
        """Nodes whose agent is connected and ready, less every device held
        here: reservations (and stand-ins for unreadable ones), cross-AZ
        holds (PREPARED or COMMITTED) and cross-AZ releases not yet done."""
        taken = capacity.held((self.lead.az, s) for s in self.book.held_slices())
        up = [(rec.topology, True) for name, rec in self.book.nodes.items()
              if (live := self.book.liveness.get(name)) is not None and live.ready and name in self.nodes.conns
              and not rec.cordoned]
        return capacity.free_view(up, taken)

    async def cycle(self) -> None:
        """Plan the waiting gangs and perform what the plan decided: the
        reserve and failure writes as tasks, the rest before the next decision."""
        pending = self.waiting_gangs()
        if not pending:
            return
        started = time.perf_counter()
        decisions = self._plan(pending)
        self.lead.metrics.placement_decision.observe(time.perf_counter() - started)
        last_attempts = {d.gang.id: self.twophase.last_reason(d.gang.id) for d in decisions
                         if isinstance(d, FailAdmission) and spans_azs(d.gang) and not d.never_fits}
        effects = gang_effects.admission_effects(decisions, az=self.lead.az, epoch=self.lead.epoch, now=self.lead.wall(),
                                       pending_class=pending_class, last_attempts=last_attempts,
                                       stimulus_id=current_stimulus())
        for e in effects:
            if isinstance(e, gang_effects.ReserveDevices):
                # Hold the devices in memory now, so later decisions (this
                # cycle or the next) never see them free; undone on failure.
                self.book.held_in_memory(e.reservation)
                self.writer.start_acting(e.gang.id)
                with log_context(gang=e.gang.id, incarnation=e.gang.incarnation):  # the reserve task's lines
                    self.lead.spawn(self._admit(e), f"reserve-{e.gang.id}")
            elif isinstance(e, gang_effects.FailAdmission):
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
            c = gang_effects.pending_gauge_class(g.state, wide, wide and self.twophase.awaits_placement(g),
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
        return self.lead.mono() - self.led_since() >= self.lead.timings.node_register_grace_s

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
        views += capacity.unready_views(self.book.nodes, (v.name for v in views))
        if wide:
            # Cross-AZ gangs are placed over every AZ: the others as the
            # watch shows them (no etcd request; stale at worst, which the
            # participants' ledgers catch).
            views += self.twophase.other_azs_view()
        # Devices of two-phase attempts placed by earlier cycles whose holds
        # may not show yet are not free for anyone.
        views = without(views, self.twophase.attempt_devices())
        return plan_admissions(pending, views, self.lead.wall(), az=self.lead.az,
                               backfill_window_s=self.lead.timings.backfill_window_s, registered=registered,
                               verdicts=self._verdicts, index=self.twophase.placement_index(index) if wide else index)

    def queue_reason(self, d: KeepPending) -> str:
        return gang_effects.queue_reason(d, self.lead.az)

    def keep_waiting(self, e: gang_effects.KeepWaiting) -> None:
        self.pending_classes[e.gang.id] = e.pending_class
        if self.book.waiting(e.gang.id, e.reason):
            log.debug("gang %s pending: %s", e.gang.id, e.reason, extra={"gang": e.gang.id})

    async def _admit(self, e: gang_effects.ReserveDevices) -> None:
        """The reserve task: the reservation, then what the core says follows
        from its outcome (dispatch, STARTING)."""
        done = await self.perform(e)
        for follow in gang_effects.after_reserved(done, e.stimulus_id):
            await self.perform(follow)

    async def reserve(self, e: gang_effects.ReserveDevices) -> gang_effects.Event:
        """All of a gang's devices in ONE fenced etcd transaction."""
        g, p, r = e.gang, e.placement, e.reservation
        try:
            async with self._reserve_slots:
                placement = gang_effects.member_assignments(p)
                master = self.rendezvous_for(g, g.incarnation, placement, self.book.nodes.get(placement[0].node))
                new, events = gang_effects.reserved_record(g, p, r, master, self.lead.wall(), self.lead.epoch)
                key = self.lead.keys.reservation(self.lead.az, g.id)
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
                        return gang_effects.NotApplied(g.id)  # still PENDING: the next cycle places it again
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
        return gang_effects.GangWritten(written)

    async def _learn_reserve_outcome(self, g: GangRecord, r: Reservation) -> GangRecord | None:
        """After a reservation txn with an unknown outcome: read the gang and
        reservation keys (one consistent txn) until etcd answers. Returns the
        written gang record if the txn applied, None if it did not. While etcd
        does not answer, the devices stay held; if our lease runs out first,
        check_valid() ends this leadership and the successor rebuilds from
        etcd, which is always consistent."""
        gkey, rkey = self.lead.keys.gang(g.id), self.lead.keys.reservation(self.lead.az, g.id)
        while True:
            self.lead.check_valid()
            try:
                res = await self.lead.store.txn([], [Get(gkey), Get(rkey)])
                break
            except StoreUnavailable:
                await asyncio.sleep(self.lead.timings.store_retry_pause_s)
        gkvs, rkvs = res.results
        cur = GangRecord.from_dict(gkvs[0].json(), gkvs[0].mod_revision) if gkvs else None
        try:
            written = Reservation.from_dict(rkvs[0].json()) if rkvs else None
        except UNREADABLE:
            written = None  # not the record this txn writes
        applied = gang_effects.reservation_applied(cur, written, r)
        if cur is not None:
            self.writer.read_back(g, cur, applied=applied)
        if applied:
            log.info("reservation of %s applied although its reply was lost", g.id)
            return cur
        log.info("reservation of %s did not apply (reply lost); devices released", g.id)
        return None

    async def fail_admission(self, e: gang_effects.FailAdmission) -> None:
        try:
            if e.never_fits:
                log.info("gang %s fails at once: %s", e.gang.id, e.reason)
            await self.finish(e.gang, GangState.FAILED, e.reason)
        finally:
            self.writer.done_acting(e.gang.id)

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

    def rendezvous_settled(self, gang_id: str) -> None:
        """The write carrying the port ``rendezvous_for`` picked for the gang
        is done (or failed): the pick no longer holds the port for others."""
        self._picking.pop(gang_id, None)

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
        head = explanation.waiting_head(g, self.lead.wall())
        grace = "" if self.judges_never_fits() else (
            f"; whether it can ever fit is judged once this leader has led node_register_grace_s="
            f"{self.lead.timings.node_register_grace_s:g}s (agents may still be registering)")
        if spans_azs(g):
            return await self._explain_two_phase(g, head, grace)
        if self.writer.busy(g.id):
            return Explanation(f"{head}: the leader is writing its reservation (or its failure) now",
                               "a write for this gang is in flight at the leader")
        decisions = self._plan(self.waiting_gangs())
        pos, d = next((i, d) for i, d in enumerate(decisions, 1) if d.gang.id == g.id)
        return explanation.of_decision(d, pos, len(decisions), head, grace, self.lead.az)

    async def _explain_two_phase(self, g: GangRecord, head: str, grace: str) -> Explanation:
        o = self.book.owners.get(g.id)
        phase = o.phase if o is not None else None
        views, registered, led = await self.twophase.snapshot()
        owner = explanation.owner_summary(phase, o.attempts if o is not None else 0,
                                          o.last_reason if o is not None else "", self.lead.az,
                                          sorted({t.az for t in registered} - led))
        # RESERVING with its owner waiting for a placement again (an aborted
        # attempt's next incarnation): explained as pending, below.
        if g.state == GangState.RESERVING and not self.twophase.awaits_placement(g):
            azs = sorted({m.az for m in g.placement})
            return Explanation(f"{head}: prepared in {', '.join(azs)}; waiting for every vote and the decision",
                               owner)
        request = PlacementRequest.from_spec(g.id, g.spec)
        verdict = never_fits(request, registered) if not grace else ""
        return explanation.of_two_phase(phase, owner, head, grace, self.lead.az, verdict,
                                        None if verdict else place(request, views))
