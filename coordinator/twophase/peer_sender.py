"""The peer calls the two-phase driver makes (docs/two-phase.md "Driver"):
``SendPrepare`` / ``SendCommit`` / ``SendAbort`` are CoordinatorPeer RPCs to
the leader found in ``leader/<az>`` (its address cached), with deadlines;
the owner's own AZ is handled in-process. The calls this AZ answers are
coordinator/twophase/peer_calls.py's."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import grpc

from coordinator.core.twophase import (
    AbortReceived,
    CommitReceived,
    PrepareReceived,
    Routed,
    SendAbort,
    SendCommit,
    SendPrepare,
    TwoPhaseConfig,
    VoteReceived,
)
from coordinator.election import observe
from coordinator.twophase.context import Context, Part
from phalanx import failpoints
from phalanx.errors import NotLeader
from phalanx.logfmt import bind_event
from phalanx.v1 import peer_pb2, peer_pb2_grpc

log = logging.getLogger(__name__)


class PeerSender(Part):
    """One per ``TwoPhaseDriver``: sends its owners' Prepares and decisions.
    ``local_prepare`` answers a Prepare to this AZ in-process
    (PeerCalls.local_prepare)."""

    def __init__(self, ctx: Context, cfg: TwoPhaseConfig, peer_channel: Any,
                 local_prepare: Callable[[PrepareReceived], Awaitable[tuple[bool, str]]]):
        super().__init__(ctx)
        self.cfg = cfg
        self.peer_channel = peer_channel
        self.local_prepare = local_prepare
        self._leaders: dict[str, Any] = {}  # az -> LeaderInfo (peer address cache)

    async def _peer_call(self, az: str, gang: str, method: str, req: Any) -> Any:
        """One CoordinatorPeer call to the leader of ``az``. Its address is
        cached from ``leader/<az>``; a failed call drops it, and a call that
        finds the cached address dead (UNAVAILABLE) is retried once at a
        freshly read one. Returns None when the AZ has no leader."""
        if self.peer_channel is None:
            return None
        for attempt in (0, 1):
            info = self._leaders.get(az)
            cached = info is not None
            if info is None:
                info = await observe(self.store, az)
                self.counts.count(gang)
                if info is None:
                    return None
                self._leaders[az] = info
            stub = peer_pb2_grpc.CoordinatorPeerStub(self.peer_channel(info.address))
            try:
                return await getattr(stub, method)(req, timeout=self.cfg.vote_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED):
                    self._leaders.pop(az, None)
                if cached and attempt == 0 and exc.code() == grpc.StatusCode.UNAVAILABLE:
                    continue
                raise
        return None

    def identity(self) -> Any:
        return peer_pb2.PeerIdentity(az=self.az, epoch=self.lead.epoch, coordinator_id=self.lead.info.coordinator_id)

    async def send_prepares(self, prepares: list[SendPrepare]) -> None:
        """Every Prepare of an attempt at once, each performed by
        ``prepare``; once all are answered (or timed out), the votes go to
        the owner (a peer that did not answer is left to the vote timer)."""
        bind_event(prepares[0])
        results = await asyncio.gather(*(self.prepare(p) for p in prepares), return_exceptions=True)
        await failpoints.hit("owner.after_prepare")
        votes = []
        for r in results:
            if isinstance(r, NotLeader):
                raise r
            if isinstance(r, list):
                votes.extend(r)
        self.feed(*votes)

    async def prepare(self, p: SendPrepare) -> list[Routed]:
        """One Prepare; its vote for the owner, or nothing if none came."""
        r = await self._prepare_one(p)
        if r is None:
            return []
        yes, reason = r
        return [Routed.owner(VoteReceived(stimulus_id=p.stimulus_id, gang=p.gang, incarnation=p.incarnation,
                                          from_az=p.to_az, yes=yes, reason=reason))]

    async def _prepare_one(self, p: SendPrepare) -> tuple[bool, str] | None:
        if p.to_az == self.az:
            received = PrepareReceived(stimulus_id=p.stimulus_id, gang=p.gang, incarnation=p.incarnation,
                                       owner_az=p.owner_az, priority=p.priority, submitted_at=p.submitted_at, nodes=p.nodes)
            try:
                return await asyncio.wait_for(self.local_prepare(received), self.cfg.vote_timeout_s)
            except asyncio.TimeoutError:
                return None
        req = peer_pb2.PrepareRequest(
            caller=self.identity(), gang=p.gang, incarnation=p.incarnation, priority=p.priority,
            submitted_at=p.submitted_at,
            nodes=[peer_pb2.NodeDevices(node=n, gpus=list(g), nics=list(c)) for n, (g, c) in p.nodes.items()],
        )
        try:
            resp = await self._peer_call(p.to_az, p.gang, "Prepare", req)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED):
                return False, f"{p.to_az} refused: {exc.details()}"
            log.info("prepare %s#%d -> %s: %s", p.gang, p.incarnation, p.to_az, exc.code().name)
            return None
        if resp is None:
            return None  # no leader there: the vote timer decides
        return resp.vote == peer_pb2.VOTE_YES, resp.reason

    async def send_decision(self, e: SendCommit | SendAbort) -> list[Routed]:
        if e.to_az == self.az:
            cls = CommitReceived if isinstance(e, SendCommit) else AbortReceived
            return [Routed.participant(cls(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation, from_az=self.az))]
        req = peer_pb2.DecisionRequest(caller=self.identity(), gang=e.gang, incarnation=e.incarnation)
        try:
            await self._peer_call(e.to_az, e.gang, "Commit" if isinstance(e, SendCommit) else "Abort", req)
        except grpc.aio.AioRpcError as exc:
            log.info("%s %s#%d -> %s: %s %s", type(e).__name__, e.gang, e.incarnation, e.to_az, exc.code().name, exc.details())
        return []

