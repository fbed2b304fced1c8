"""AgentService servicer: the leader's end of each agent's Session stream.

Only the AZ leader accepts sessions (a standby answers FAILED_PRECONDITION
with the leader's address). Every downward message is stamped with the
leader's epoch; heartbeats are acknowledged only while the leader's lease is
locally valid, so an agent cut off from every valid leader fences.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import grpc

from coordinator import refusals
from coordinator.core import peer_auth, token_read
from coordinator.throttle import Throttled
from coordinator.leader import AzLeader
from coordinator.node_sessions import AgentConn
from coordinator.serving import ServingContext
from phalanx import agent_messages as am
from phalanx.logfmt import bind, log_context, new_stimulus
from phalanx.certs import Identity, IdentityError
from phalanx.errors import NotLeader, StoreUnavailable
from phalanx.store import KV, Get
from phalanx.tls import peer_identity, utc_now
from phalanx.v1 import agent_pb2 as apb
from phalanx.v1 import agent_pb2_grpc as agrpc

log = logging.getLogger(__name__)


def _report_context(leader: AzLeader, m: am.MemberStatus) -> Any:
    """A member report is a stimulus of its own: what the leader decides on
    it (a transition, a restart) logs its id, gang and incarnation."""
    return log_context(stimulus=new_stimulus(leader.az), gang=m.gang or None, incarnation=m.incarnation)


def _to_pb(leader: AzLeader, msg: am.ToAgent) -> apb.CoordinatorMessage:
    """Every downward message is stamped with this leader's epoch and AZ."""
    return am.FromLeader(epoch=leader.epoch, az=leader.az, body=msg).to_pb()


async def caller_identity(c: ServingContext, context: grpc.aio.ServicerContext, service: str) -> Identity | None:
    """The identity in the caller's client certificate, or None when this
    coordinator serves plaintext (nothing to check). A certificate that
    names no identity of this cluster aborts the call (peer_auth decides
    the status)."""
    if c.tls_source is None:
        return None
    try:
        return peer_identity(context, cas=c.tls_source.current.cas, cluster=c.config.cluster, now=utc_now())
    except IdentityError as exc:
        r = peer_auth.identity_refusal(service, exc.check, exc.detail)
        log.warning("%s refused: %s", service, r.message)
        await refusals.abort(context, r)
        raise  # unreachable: abort raises



async def _uncancelled(work: Any, node: str) -> None:
    """Run a report's handling to its end even if the session ends meanwhile.
    A session that closes cancels its reader; cancelling the leader in the
    middle of a fenced write leaves the write applied in etcd but unknown to
    the leader (its view is behind until its next write fails the compare),
    and a RESTARTING write lost that way held the gang's surviving members
    until they ended by themselves. The handling is shielded instead: the
    reader stops waiting for it, the write and the leader's update finish."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        # No one awaits it any more: its failure is logged here, not lost.
        def done(t: "asyncio.Future[Any]") -> None:
            if not t.cancelled() and t.exception() is not None:
                log.warning("handling a member report of %s failed after its session ended: %r", node, t.exception())

        task.add_done_callback(done)
        raise

def _record(kv: KV | None) -> apb.StoredRecord:
    if kv is None:
        return apb.StoredRecord(present=False)
    return apb.StoredRecord(present=True, value=kv.value, create_revision=kv.create_revision,
                            mod_revision=kv.mod_revision, version=kv.version)


def _json_or_none(kv: KV | None) -> Any:
    """The record's JSON; None when absent; ``False`` when unreadable (it
    names no node, so it is refused)."""
    if kv is None:
        return None
    try:
        return kv.json()
    except ValueError:
        return False


class AgentServicer(agrpc.AgentServiceServicer):
    def __init__(self, coordinator: ServingContext):
        self.c = coordinator
        # Registrations of one node are serialized under TLS so that "is
        # there a live session of another identity" and the replacement
        # cannot interleave with a second registration (on_register awaits
        # etcd before it records the new session).
        self._register_locks: dict[str, asyncio.Lock] = {}

    async def _refuse(self, context: grpc.aio.ServicerContext, r: peer_auth.Refusal) -> None:
        log.warning("AgentService.Session refused: %s", r.message)
        await refusals.abort(context, r)

    async def ReadToken(self, request: apb.TokenReadRequest, context: grpc.aio.ServicerContext) -> apb.TokenReadReply:
        """The agent's token-check read, on any replica of the AZ
        (coordinator/core/token_read.py decides who may read what)."""
        identity = await caller_identity(self.c, context, token_read.SERVICE)
        refusal = token_read.caller_refusal(identity, self.c.config.az, request.az, request.gang)
        if refusal is None:
            try:
                # Before etcd is read: a flood of token reads from one node
                # identity (each a linearizable etcd read) is refused here.
                self.c.throttle.token_read(identity.name if identity is not None else context.peer())
            except Throttled as exc:
                log.warning("%s refused: %s", token_read.SERVICE, exc)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"token read: {exc}")
                raise  # unreachable: abort raises
            keys = self.c.store.keys
            ops = [Get(keys.leader(request.az))] + ([Get(keys.reservation(request.az, request.gang))] if request.gang else [])
            try:
                res = await self.c.store.txn([], ops)  # linearizable
            except StoreUnavailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"token read: etcd did not answer: {exc}")
                raise  # unreachable: abort raises
            kvs = [r[0] if r else None for r in res.results]
            if request.gang:
                refusal = token_read.reservation_refusal(identity, request.gang, _json_or_none(kvs[1]))
        if refusal is not None:
            log.warning("%s refused: %s", token_read.SERVICE, refusal.message)
            await refusals.abort(context, refusal)
        reply = apb.TokenReadReply(leader=_record(kvs[0]), revision=res.revision)
        if request.gang:
            reply.reservation.CopyFrom(_record(kvs[1]))
        return reply

    async def Session(self, request_iterator: AsyncIterator[apb.AgentMessage], context: grpc.aio.ServicerContext) -> AsyncIterator[apb.CoordinatorMessage]:
        identity = await caller_identity(self.c, context, "AgentService.Session")
        refusal = peer_auth.session_refusal(identity, None, self.c.config.az)
        if refusal is not None:
            await self._refuse(context, refusal)
            return
        leader = self.c.leader
        if leader is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.c.config.coordinator_id} is not the leader of {self.c.config.az}")
            return
        bind(epoch=leader.epoch)  # this session's task and its reader task
        # An agent registers at once; one that has not within the time after
        # which a silent node counts as not ready is told why, not dropped
        # with OK.
        wait_s = leader.timings.node_not_ready_after_s
        try:
            first = await asyncio.wait_for(request_iterator.__anext__(), timeout=wait_s)
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "register: the session ended before its first message (register)")
            return
        except asyncio.TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"register: no first message within {wait_s:g}s; a session must start with register",
            )
            return
        if first.WhichOneof("kind") != "register":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "kind: the first message of a session must be register")
            return
        # Everything the registration would write is checked before any of
        # it is (docs/limits.md, Register.from_pb): a refused agent leaves no
        # node record, and a topology past a bound is INVALID_ARGUMENT, a
        # permanent answer (the agent would send the same topology again),
        # not UNAVAILABLE.
        try:
            reg = am.Register.from_pb(first.register)
        except am.MessageError as exc:
            log.warning("refused a registration: %s", exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"registration refused: {exc}")
            return
        topo = reg.topology
        bind(node=topo.node)
        if topo.az and topo.az != leader.az:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"register.topology.az: agent is in {topo.az}, this leader leads {leader.az}")
            return
        if reg.highest_epoch > leader.epoch:
            # The agent has heard a newer leader: we are stale. Step down.
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"stale leader: epoch {leader.epoch} < {reg.highest_epoch} seen by the agent")
            return
        refusal = peer_auth.session_refusal(identity, topo.node, leader.az)
        if refusal is not None:
            await self._refuse(context, refusal)
            return
        try:
            # Before anything is written: a flood of registrations from one
            # node identity (each a node-record write) is refused here.
            self.c.throttle.registration(identity.name if identity is not None else topo.node)
        except Throttled as exc:
            log.warning("AgentService.Session refused: %s", exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"register: {exc}")
            return
        if not topo.az:
            topo = topo.__class__(**{**topo.__dict__, "az": leader.az})
        conn = AgentConn(node=topo.node, agent_id=reg.agent_id, topology=topo, address=reg.address,
                         ports=reg.rendezvous_ports, identity=identity)
        bind(stimulus=new_stimulus(leader.az))  # the registration and its reconciliation
        try:
            if identity is None:
                await leader.on_register(conn, list(reg.members))
            else:
                lock = self._register_locks.setdefault(topo.node, asyncio.Lock())
                async with lock:
                    old = leader.conns.get(topo.node)
                    current = old.identity if old is not None and not old.closed else None
                    refusal = peer_auth.replacement_refusal(topo.node, current, identity)
                    if refusal is None:
                        await leader.on_register(conn, list(reg.members))
        except NotLeader as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            return
        except Exception as exc:  # noqa: BLE001
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"registration failed: {exc}")
            return
        if refusal is not None:
            await self._refuse(context, refusal)
            return

        yield _to_pb(leader, am.Welcome(coordinator_id=self.c.config.coordinator_id,
                                        heartbeat_interval_s=leader.timings.heartbeat_interval_s,
                                        fence_after_s=leader.timings.fence_after_s))
        # A message the reader could not take ends the session with it named
        # (INVALID_ARGUMENT), as a refused registration does.
        refused: list[am.MessageError] = []

        async def reader() -> None:
            try:
                async for pb in request_iterator:
                    msg = am.FromAgent.from_pb(pb).body
                    if isinstance(msg, am.Heartbeat):
                        if leader.on_heartbeat(conn):
                            conn.queue.put_nowait(am.HeartbeatAck(seq=msg.seq))
                        for m in msg.members:
                            with _report_context(leader, m):
                                await _uncancelled(leader.on_member(conn, m), conn.node)
                    elif isinstance(msg, am.MemberStatus):
                        with _report_context(leader, msg):
                            await _uncancelled(leader.on_member(conn, msg), conn.node)
            except am.MessageError as exc:
                log.warning("session of %s: refused a message: %s", conn.node, exc)
                refused.append(exc)
            except Exception as exc:  # noqa: BLE001
                if not isinstance(exc, (asyncio.CancelledError, grpc.aio.AioRpcError)):
                    log.info("session of %s ended: %r", conn.node, exc)
            finally:
                conn.queue.put_nowait(None)

        task = asyncio.create_task(reader(), name=f"session-{conn.node}")
        try:
            while True:
                item = await conn.queue.get()
                if item is None or conn.closed or leader.stopped.is_set():
                    break
                yield _to_pb(leader, item)
        finally:
            task.cancel()
            leader.on_disconnect(conn)
        if refused:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{refused[0]}")
