"""The CoordinatorPeer service (cross-AZ two-phase reservations, docs/two-phase.md
"Peer calls"): the gRPC side of the participant's Prepare / Commit / Abort.

Every call is checked before it touches any state: under TLS the caller must
hold a coordinator certificate of this cluster whose name is the coordinator
id in ``leader/<caller az>`` (read here; coordinator/core/peer_auth.py
decides); then the two-phase driver's peer calls (coordinator/twophase/peer_calls.py)
check the epoch and the records (coordinator/core/peer_calls.py decides). A
refused call changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from coordinator import refusals
from coordinator.agents import caller_identity
from coordinator.core import peer_auth
from coordinator.twophase.peer_calls import PeerCalls, PeerRefused
from coordinator.serving import ServingContext
from phalanx.errors import NotLeader
from phalanx.leader_record import LeaderInfo
from phalanx.store import StoreUnavailable
from phalanx.v1 import peer_pb2, peer_pb2_grpc

log = logging.getLogger(__name__)


class PeerServicer(peer_pb2_grpc.CoordinatorPeerServicer):
    """``coordinator``: the replica serving (its config, store, current
    leader and TLS)."""

    def __init__(self, coordinator: ServingContext):
        self.c = coordinator

    async def _authenticate(self, request: Any, context: grpc.aio.ServicerContext) -> bool:
        """Refuse (abort) a caller that is not the current leader of the AZ
        it speaks for; nothing when serving plaintext. Whether it read
        ``leader/<caller az>`` (counted once the driver is known)."""
        identity = await caller_identity(self.c, context, "CoordinatorPeer")
        if identity is None:
            return False
        refusal = peer_auth.peer_refusal(identity, self.c.config.cluster)
        read = False
        if refusal is None:
            caller = request.caller
            try:
                read = bool(caller.az)
                kv = await self.c.store.get(self.c.store.keys.leader(caller.az)) if caller.az else None
            except StoreUnavailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd: {exc}")
            leader = None
            if kv is not None:
                try:
                    info = LeaderInfo.from_kv(caller.az, kv)
                    leader = (info.coordinator_id, info.epoch)
                except (ValueError, AttributeError):  # an unreadable leader key vouches for nobody
                    leader = None
            refusal = peer_auth.leader_refusal(identity, caller.az, caller.epoch, leader)
        if refusal is not None:
            log.warning("CoordinatorPeer refused: %s", refusal.message)
            await refusals.abort(context, refusal)
        return read

    async def _peer_calls(self, context: grpc.aio.ServicerContext) -> PeerCalls:
        leader = self.c.leader
        if leader is None or leader.stopped.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.c.config.coordinator_id} is not the leader of {self.c.config.az}")
        try:
            await leader.until_rebuilt()
        except NotLeader as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return leader.twophase.peers

    async def _checked(self, request: Any, context: grpc.aio.ServicerContext) -> PeerCalls:
        """Authenticate the call and find this leader's peer calls; the
        servicer's read of the caller's leader key is counted with the
        gang's other etcd requests (its ``auth_reads``)."""
        read = await self._authenticate(request, context)
        peers = await self._peer_calls(context)
        if read and request.gang:
            peers.auth_read(request.gang)
        return peers

    async def _call(self, context: grpc.aio.ServicerContext, coro_fn: Any) -> Any:
        try:
            return await coro_fn()
        except PeerRefused as exc:
            await context.abort(exc.code, str(exc))
        except NotLeader as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except StoreUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd: {exc}")
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer in time")

    async def Prepare(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        peers = await self._checked(request, context)
        if not request.gang or request.incarnation <= 0 or not request.nodes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "gang, incarnation > 0 and nodes are required")
        yes, reason = await self._call(context, lambda: peers.handle_prepare_rpc(request))
        return peer_pb2.PrepareResponse(vote=peer_pb2.VOTE_YES if yes else peer_pb2.VOTE_NO, reason=reason)

    async def _decision(self, request: Any, context: grpc.aio.ServicerContext, commit: bool) -> Any:
        peers = await self._checked(request, context)
        if not request.gang or request.incarnation <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "gang and incarnation > 0 are required")
        applied, state = await self._call(context, lambda: peers.handle_decision_rpc(request, commit))
        return peer_pb2.DecisionResponse(applied=applied, state=state)

    async def Commit(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._decision(request, context, True)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._decision(request, context, False)
