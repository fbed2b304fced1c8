"""This AZ's agent sessions and node records (docs/nodes.md).

``NodeSessions`` is the part of a leadership that talks to agents: their
sessions (``AgentConn``), registrations and what they report, heartbeats and
the liveness verdicts the core decides from them (not ready, lost, expired),
node-record writes (one at a time) and an admin's cordon, drain and delete.
Gang decisions stay the leader's: it is given the leader's gang-effect
interpreter, ``evaluate`` and the run-time transition as callables, and the
two-phase driver for cross-AZ members. ``AzLeader`` keeps the public methods
the agent service, the node service and tests call, delegating here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from coordinator.book import Book
from coordinator.core import capacity, lifecycle, peer_auth, progress
from coordinator.core import gang_effects
from coordinator.core.admission import spans_azs
from coordinator.core.placement import FabricIndex
from coordinator.core.records import GangRecord, NodeRecord
from coordinator.gang_writer import GangWriter
from coordinator.leadership import Leadership, current_stimulus
from coordinator.twophase import TwoPhaseDriver
from phalanx import failpoints
from phalanx.agent_messages import Assign, Revoke
from phalanx.errors import FailedPrecondition, NotFound
from phalanx.logfmt import current
from phalanx.model import GangState, MemberPhase
from phalanx.ports import DEFAULT_PORTS
from phalanx.store import Delete, Put
from phalanx.topology import NodeTopology

log = logging.getLogger(__name__)


@dataclass
class AgentConn:
    """One agent's live Session stream at this leader."""

    node: str
    agent_id: str
    topology: NodeTopology
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_seen: float = 0.0  # monotonic
    closed: bool = False
    address: str = ""  # advertised for rendezvous ("" = older agent: the node name is used)
    ports: tuple[int, int] = DEFAULT_PORTS  # its rendezvous port range
    identity: Any = None  # phalanx.certs.Identity of its client certificate (None: plaintext)


class NodeSessions:
    def __init__(self, lead: Leadership, book: Book, writer: GangWriter, twophase: TwoPhaseDriver, *,
                 perform: Callable[[gang_effects.Effect], Awaitable[gang_effects.Event]], evaluate: Callable[[str], Awaitable[None]],
                 transition: Callable[[GangRecord, lifecycle.RunTimeStep, float], Awaitable[None]],
                 until_rebuilt: Callable[[], Awaitable[None]]):
        self.lead = lead
        self.book = book
        self.writer = writer  # (drain skips a gang with a write in flight)
        self.twophase = twophase  # cross-AZ members: the participant's
        self.perform = perform  # the leader's gang-effect interpreter
        self.evaluate = evaluate
        self.transition = transition  # a run-time step the core decided (drain's restart)
        self.until_rebuilt = until_rebuilt
        self.conns: dict[str, AgentConn] = {}
        self.index = FabricIndex()  # static node facts, refreshed when a node registers
        self._node_writes = asyncio.Lock()  # one node-record write at a time (_write_node)

    def close_all(self) -> None:
        """The leadership ended: every session closes."""
        for conn in list(self.conns.values()):
            conn.closed = True
            conn.queue.put_nowait(None)
        self.conns.clear()

    def node_connected(self, node: str) -> bool:
        """Whether the node's agent has a session with this leader."""
        return node in self.conns

    def send(self, node: str, msg: Assign | Revoke) -> None:
        """Queue a message on the node's session (dropped if it has none)."""
        conn = self.conns.get(node)
        if conn is not None and not conn.closed:
            # The decision's stimulus id travels with it: the agent's lines
            # about this assignment or revocation carry it too.
            conn.queue.put_nowait(dataclasses.replace(msg, stimulus_id=str(current().get("stimulus", ""))))

    # -------------------------------------------------------- agent events
    async def on_register(self, conn: AgentConn, members: list[Any]) -> None:
        """An agent connected: record its node (fenced write), then reconcile
        what it runs against committed reservations. The core decides
        (``gang_effects.register_node``, ``reported_member_effects``,
        ``unreported_effects``); each member's facts and the gangs are read
        after the node record's write, as before: a reservation may commit
        while it is in flight."""
        self.lead.check_valid()
        await self.until_rebuilt()
        node = conn.node
        old = self.conns.get(node)
        await self.perform(gang_effects.register_node(conn, self.book.nodes.get(node), replaces_session=old is not None and old is not conn,
                                            wall=self.lead.wall(), stimulus_id=current_stimulus()))
        # Members the agent reports, one at a time (the two-phase call may
        # change the hold the next member's facts come from).
        reported: dict[tuple[str, int], set[int]] = {}
        for m in members:
            d = gang_effects.reported_member_effects(
                node, m, refused=self._report_refused(node, m),
                cross_az=self.twophase.owns_members(m.gang, m.incarnation), gang=self.book.gangs.get(m.gang),
                committed=self.book.reservations.get(m.gang), stimulus_id=current_stimulus())
            for effect in d.effects:
                await self.perform(effect)
            if d.runs:
                reported.setdefault((m.gang, m.incarnation), set()).add(m.rank)
        # Reservations on this node whose members the agent does not report.
        for effect in gang_effects.unreported_effects(node, self.lead.az, list(self.book.gangs.values()), reported, two_phase=spans_azs,
                                            stimulus_id=current_stimulus()):
            await self.perform(effect)
        await self.twophase.on_register(node, reported)
        for key_ in reported:
            await self.evaluate(key_[0])
        for g in list(self.book.gangs.values()):
            if any(m.node == node for m in g.placement):
                await self.evaluate(g.id)
        self.lead.wake.set()

    def on_heartbeat(self, conn: AgentConn) -> bool:
        """Returns whether to acknowledge: only while we are a valid leader."""
        conn.last_seen = self.lead.mono()
        live = self.book.liveness.get(conn.node)
        if live is not None:
            live.last_contact = conn.last_seen
        return self.lead.session.is_valid() and not self.lead.stopped.is_set()

    def _report_refused(self, node: str, m: Any) -> str | None:
        """Why a member report from ``node`` is not taken: the member is
        placed on another node (or nowhere in this AZ). None when it is, or
        when its incarnation is unknown here (the callers already drop or
        revoke those)."""
        hold = self.book.participant.holds.get(m.gang)
        g = (self.book.gang_cache.get(m.gang) if hold is not None else None) or self.book.gangs.get(m.gang)
        if g is not None and g.incarnation == m.incarnation:
            placed = next((p.node for p in g.placement if p.rank == m.rank and p.az == self.lead.az), None)
        elif hold is not None and hold.incarnation == m.incarnation:
            placed = node if node in hold.nodes else None
        else:
            return None
        return peer_auth.member_refusal(node, m.gang, m.rank, placed)

    async def on_member(self, conn: AgentConn, m: Any) -> None:
        conn.last_seen = self.lead.mono()
        why = self._report_refused(conn.node, m)
        if why is not None:
            log.warning("ignored a member report: %s", why)
            return
        for effect in gang_effects.stray_member_effects(conn.node, m, self.book.known_gang(m.gang), current_stimulus()):
            # Most often a report that crossed the revocation, which stops it
            # anyway; a second revocation is harmless, a missing one is not.
            log.debug("gang %s#%d: rank %d reported live on %s after its incarnation was torn down; revoking it again",
                     m.gang, m.incarnation, m.rank, conn.node, extra={"gang": m.gang, "incarnation": m.incarnation})
            await self.perform(effect)
        if m.gang in self.book.participant.holds:
            # Cross-AZ gang: this AZ publishes its members' status for the owner.
            await self.twophase.on_member(conn.node, m)
            return
        g = self.book.gangs.get(m.gang)
        if g is None or g.incarnation != m.incarnation:
            return
        report = progress.MemberReport(MemberPhase(m.phase), m.exit_code, m.reason, conn.node)
        self.book.members_reported(m.gang, m.incarnation, {m.rank: report})
        await self.evaluate(m.gang)

    def on_disconnect(self, conn: AgentConn) -> None:
        if self.conns.get(conn.node) is conn:
            del self.conns[conn.node]
            live = self.book.liveness.get(conn.node)
            if live is not None:
                live.ready = False
        conn.closed = True

    # ------------------------------------------------------------ liveness
    def heartbeats(self) -> dict[str, float]:
        """Each node's last heartbeat (wall clock) as `phalanx nodes` shows
        it: heard by this leadership, from memory (no etcd write refreshes
        it, docs/design.md D17); not yet heard, the record's (its
        registration)."""
        now, wall = self.lead.mono(), self.lead.wall()
        out = {}
        for node, rec in self.book.nodes.items():
            live = self.book.liveness.get(node)
            contact = live.last_contact if live is not None and live.heard else None
            out[node] = lifecycle.shown_heartbeat(rec.last_heartbeat, contact, now, wall)
        return out

    async def check_liveness(self) -> None:
        now = self.lead.mono()
        for node, live in list(self.book.liveness.items()):
            rec = self.book.nodes.get(node)
            v = lifecycle.node_verdict(node, last_contact=live.last_contact, ready=live.ready,
                                       record_ready=None if rec is None else rec.ready, now=now,
                                       not_ready_after_s=self.lead.timings.node_not_ready_after_s,
                                       replace_after_s=self.lead.timings.replace_after_s)
            for effect in gang_effects.liveness_effects(v, rec, current_stimulus()):
                await self.perform(effect)
            rec = self.book.nodes.get(node)
            if rec is not None and capacity.expires(rec, live.ready, v.silent_s, self.lead.timings.node_expire_after_s):
                await self._expire_node(rec, v.silent_s)

    async def _expire_node(self, rec: NodeRecord, silent: float) -> None:
        """Write the node's record expired (fenced): placement and
        never-fits leave it out, here and in every other AZ's view, until its
        agent registers again (docs/nodes.md)."""
        why = f"expired: its agent not heard for {silent:.0f}s (node_expire_after_s={self.lead.timings.node_expire_after_s:g})"

        def make(cur: NodeRecord | None) -> NodeRecord:
            if cur is None:
                raise NotFound(f"node {rec.name} was deleted")
            return dataclasses.replace(cur, ready=False, expired=True, reason=why)
        try:
            await self._write_node(rec.name, make)
        except NotFound:
            return  # deleted by an admin meanwhile: nothing to expire
        log.warning("node %s %s", rec.name, why, extra={"node": rec.name})
        self.lead.wake.set()

    def close_session(self, node: str) -> None:
        live = self.book.liveness.get(node)
        if live is not None:
            live.ready = False
        conn = self.conns.pop(node, None)
        if conn is not None:
            conn.closed = True
            conn.queue.put_nowait(None)

    async def _write_node(self, node: str, make: Callable[[NodeRecord | None], NodeRecord]) -> NodeRecord:
        """Put the record ``make`` derives from the node's current one (None:
        none), fenced, one node write at a time: so a write decided before
        an admin's cordon (a registration, NotReady) never undoes it, and a
        cordon never writes back an older registration."""
        async with self._node_writes:
            rec = make(self.book.nodes.get(node))
            await failpoints.hit("leader.before_node_write")
            self.lead.check_valid()
            res = await self.lead.store.fenced_txn(self.lead.fence, [], [Put(self.lead.keys.node(self.lead.az, node), rec.to_dict())])
            rec = dataclasses.replace(rec, mod_revision=res.revision)
            self.book.node_written(node, rec)
            return rec

    async def mark_not_ready(self, e: gang_effects.MarkNodeNotReady) -> None:
        await self._write_node(e.node, functools.partial(capacity.keep_cordon, e.record))
        log.warning("node %s not ready: %s", e.node, e.record.reason, extra={"node": e.node})

    async def register_node(self, e: gang_effects.RegisterNode) -> None:
        """The registration's node record and liveness: the replaced session
        ends before the write (its agent is gone or reconnected), the caches
        follow the write."""
        node = e.node
        old = self.conns.get(node)
        if e.replaces_session and old is not None:
            old.closed = True
            old.queue.put_nowait(None)
        if e.write:
            await self._write_node(node, functools.partial(capacity.keep_cordon, e.record))
            self.index = self.index.refreshed(n.topology for n in self.book.nodes.values())
        else:
            self.lead.check_valid()  # (the write's fence would have checked)
        conn = e.session  # the AgentConn on_register passed through the core
        assert isinstance(conn, AgentConn)
        self.conns[node] = conn
        conn.last_seen = self.lead.mono()
        self.book.node_registered(node, conn.last_seen)
        if e.announce_ready:
            log.info("node %s ready (agent %s)", node, e.record.agent_id)

    async def lose_node(self, e: gang_effects.NodeLost) -> None:
        """Past the node's fence deadline its agent has stopped every member:
        fail gangs that had members there and free devices."""
        await self.twophase.on_node_lost(e.node, e.reason)
        for g, stopped in lifecycle.lost_member_reports(list(self.book.gangs.values()), e.node, self.lead.az, e.reason):
            self.book.members_reported(g.id, g.incarnation, stopped)
            await self.evaluate(g.id)

    # ------------------------------------------------------ node lifecycle
    def _node_record(self, node: str) -> NodeRecord:
        rec = self.book.nodes.get(node)
        if rec is None:
            raise NotFound(f"node: no node {node!r} in {self.lead.az}")
        return rec

    async def cordon(self, node: str, cordoned: bool) -> NodeRecord:
        """Write the node's record (un)cordoned, fenced (docs/nodes.md):
        placement skips a cordoned node; what runs there stays."""
        self.lead.check_valid()
        await self.until_rebuilt()
        rec = self._node_record(node)
        if rec.cordoned != cordoned:
            def make(cur: NodeRecord | None) -> NodeRecord:
                if cur is None:
                    raise NotFound(f"node: no node {node!r} in {self.lead.az} (deleted just now)")
                return dataclasses.replace(cur, cordoned=cordoned)
            rec = await self._write_node(node, make)
            log.info("node %s %s", node, "cordoned" if cordoned else "uncordoned", extra={"node": node})
            self.lead.wake.set()
        return rec

    async def drain(self, node: str, requeue: bool) -> tuple[NodeRecord, list[str], list[str]]:
        """Cordon the node; with ``requeue``, restart every gang this AZ
        owns that runs there through the restart path (its members are
        revoked, its devices released once they stopped, its next
        incarnation placed on other nodes). The record, the gangs still
        holding its devices, the gangs restarted."""
        rec = await self.cordon(node, True)
        requeued = []
        if requeue:
            now = self.lead.wall()
            for gang in self.book.gangs_holding(node):
                g = self.book.gangs.get(gang)
                if g is None or self.writer.busy(gang) or g.state not in (GangState.RESERVED, GangState.STARTING,
                                                                   GangState.RUNNING):
                    continue
                reports = self.book.members.get((g.id, g.incarnation), {})
                why = f"node {node} drained by an admin: restarted on other nodes"
                await self.transition(g, lifecycle.run_time_step(g, GangState.RESTARTING, why, reports, now, self.lead.epoch),
                                       now)
                requeued.append(gang)
        return rec, self.book.gangs_holding(node), requeued

    async def delete_node(self, node: str, force: bool) -> list[str]:
        """Delete the node's record, fenced: refused while gangs hold its
        devices unless ``force`` (FailedPrecondition naming them). A live
        agent registers the node again (docs/nodes.md). The gangs that held
        its devices."""
        self.lead.check_valid()
        await self.until_rebuilt()
        self._node_record(node)
        held = self.book.gangs_holding(node)
        if held and not force:
            raise FailedPrecondition(f"node: {node} in {self.lead.az} holds devices of gang{'s' if len(held) > 1 else ''} "
                                     f"{', '.join(held)}; drain it first, or delete with force")
        async with self._node_writes:
            await self.lead.store.fenced_txn(self.lead.fence, [], [Delete(self.lead.keys.node(self.lead.az, node))])
            self.book.node_deleted(node)
        self.close_session(node)
        self.index = self.index.refreshed(n.topology for n in self.book.nodes.values())
        if held:
            # Forced: its members are taken as stopped, so their gangs
            # restart elsewhere or fail (no liveness is kept for it now).
            await self.lose_node(gang_effects.NodeLost(node, f"node {node} deleted by an admin (forced)"))
        log.warning("node %s deleted by an admin%s", node, f" while gangs {', '.join(held)} held its devices" if held else "",
                    extra={"node": node})
        self.lead.wake.set()
        return held
