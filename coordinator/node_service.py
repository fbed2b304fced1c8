"""GangService's node RPCs (docs/nodes.md): ListNodes and ClusterStatus,
served from etcd by any replica (a node's last heartbeat asked of its AZ's
leader), and CordonNode, DrainNode and DeleteNode, done by the node's AZ
leader (forwarded like a write).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from coordinator import convert
from coordinator.core import authz, capacity
from coordinator.core.records import GangRecord, NodeRecord, read_records
from coordinator.election import observe_all
from coordinator.service_base import EXPLAIN_SHARE_OF_DEADLINE, FORWARDED, ServicerBase, handled
from phalanx import limits
from phalanx.errors import InvalidArgument, NotLeader, StoreUnavailable as Unavailable
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import gang_pb2_grpc as ggrpc
from phalanx.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

def _valid_node(request: Any) -> tuple[str, str]:
    """(az, node) of a node lifecycle request (docs/nodes.md), both
    required and valid names, before anything is read or forwarded."""
    for field, pattern, most, what in (("az", limits.LABEL_VALUE, limits.MAX_AZ_NAME_LEN, limits.LABEL_VALUE_WHAT),
                                       ("node", limits.NODE_NAME, limits.MAX_NODE_NAME_LEN, limits.NODE_NAME_WHAT)):
        why = limits.name_error(getattr(request, field), pattern, most, what)
        if why:
            raise InvalidArgument(f"{field}: {why[:160]}")
    return request.az, request.node


class NodeRpcs(ServicerBase):
    """The node and cluster-status RPCs of GangServicer."""

    @handled
    async def ListNodes(self, request: gpb.ListNodesRequest, context: grpc.aio.ServicerContext) -> gpb.ListNodesResponse:
        await self._authorize(context, "nodes")
        return await self._within_deadline(context, self._list_nodes(request, context), "the reads of the node list")

    async def _list_nodes(self, request: gpb.ListNodesRequest, context: grpc.aio.ServicerContext) -> gpb.ListNodesResponse:
        azs = [request.az] if request.az else sorted(await self._azs())
        out = []
        for az in azs:
            out.extend(await self._az_nodes(az, context))
        return gpb.ListNodesResponse(nodes=out)

    async def _az_nodes(self, az: str, context: grpc.aio.ServicerContext) -> list[pb.NodeStatus]:
        """One AZ's nodes with their last heartbeats, which only its leader
        knows (its memory: no etcd write refreshes them, docs/design.md
        D17). Another AZ's, or a standby's, are asked of that AZ's leader
        (one hop); one that cannot be asked is answered from etcd, each
        node's last heartbeat then being its registration's."""
        leader = self.c.leader
        heartbeats: dict[str, float] = {}
        if leader is not None and self.c.config.az == az:
            heartbeats = leader.heartbeats()  # (none before its rebuild: the records')
        elif not self._forwarded(context):
            info = await self._leader_of(az)
            if info is not None and info.address and info.coordinator_id != self.c.config.coordinator_id:
                stub = ggrpc.GangServiceStub(self.c.peer_channel(info.address))
                try:
                    answer = await stub.ListNodes(gpb.ListNodesRequest(az=az), metadata=((FORWARDED, "1"),),
                                                  timeout=self._forward_timeout(context, EXPLAIN_SHARE_OF_DEADLINE))
                    return list(answer.nodes)
                except grpc.aio.AioRpcError as exc:
                    log.info("nodes of %s from etcd: its leader %s did not answer: %s", az, info.coordinator_id,
                             exc.code().name)
        nodes, ledger = await self._az_state(az)
        return [convert.node_to_pb(nodes[name], ledger.used_gpus(name), heartbeats.get(name))
                for name in sorted(nodes)]

    @handled
    async def ClusterStatus(self, request: gpb.ClusterStatusRequest, context: grpc.aio.ServicerContext) -> gpb.ClusterStatusResponse:
        await self._authorize(context, "status")
        return await self._within_deadline(context, self._cluster_status(), "the reads of a cluster status")

    async def _cluster_status(self) -> gpb.ClusterStatusResponse:
        leaders = await observe_all(self.store)
        azs = sorted(set(leaders) | await self._azs())
        resp = gpb.ClusterStatusResponse(cluster=self.keys.cluster, served_by=self.c.config.coordinator_id)
        for az in azs:
            nodes, ledger = await self._az_state(az)
            info = leaders.get(az)
            total = sum(len(n.topology.gpus) for n in nodes.values())
            used = sum(len(ledger.used_gpus(n)) for n in nodes)
            states = [capacity.node_state(n, n.ready) for n in nodes.values()]
            usable = [n for n in nodes.values() if capacity.node_state(n, n.ready) == "ready"]
            usable_gpus = sum(len(n.topology.gpus) for n in usable)
            resp.azs.append(gpb.AzStatus(
                az=az,
                has_leader=info is not None,
                leader_id=info.coordinator_id if info else "",
                leader_address=info.address if info else "",
                epoch=info.epoch if info else 0,
                nodes_ready=states.count("ready"),
                nodes_total=len(nodes),
                gpus_total=total,
                gpus_free=total - used,
                nodes_not_ready=states.count("not_ready"),
                nodes_cordoned=states.count("cordoned"),
                nodes_expired=states.count("expired"),
                gpus_usable=usable_gpus,
                gpus_usable_free=usable_gpus - sum(len(ledger.used_gpus(n.name)) for n in usable),
            ))
        kvs, _ = await self.store.get_prefix_paged(self.keys.gangs())
        # Parsed as every reader parses a gang record: one that GetGang would
        # answer DATA_LOSS for is counted as UNREADABLE, not fatal.
        gangs, bad = read_records(kvs, GangRecord.from_dict)
        for g in gangs:
            resp.gangs_by_state[g.state.name] = resp.gangs_by_state[g.state.name] + 1
        if bad:
            resp.gangs_by_state["UNREADABLE"] = resp.gangs_by_state["UNREADABLE"] + len(bad)
        try:
            space = await self.c.space_watch.read()  # afresh: an alarm shows at once
        except Unavailable as exc:
            resp.etcd.error = str(exc)
        else:
            resp.etcd.CopyFrom(gpb.EtcdSpace(db_size_bytes=space.db_size, quota_bytes=space.quota,
                                             alarms=list(space.alarms), level=space.level.value,
                                             summary=space.describe()))
        return resp

    async def _node_leader(self, context: grpc.aio.ServicerContext, method: str, request: Any) -> tuple[Any, Any]:
        """Admin only; done by the node's AZ leader: (leader, None) here,
        else (None, that leader's answer), forwarded like a write."""
        az, _ = _valid_node(request)
        await self._authorize(context, authz.NODE_ADMIN)
        if az == self.c.config.az:
            return await self._leader_or_forward(context, method, request)
        if self._forwarded(context):
            raise NotLeader(f"coordinator {self.c.config.coordinator_id} is not the leader of {az}; retry")
        info = await self._leader_of(az)
        if info is None or not info.address:
            raise Unavailable(f"{az} has no leader right now; retry shortly")
        return None, await self._forward(context, info, method, request)

    async def _node_status(self, leader: Any, rec: NodeRecord) -> pb.NodeStatus:
        return convert.node_to_pb(rec, leader.book.ledger.used_gpus(rec.name), leader.heartbeats().get(rec.name))

    @handled
    async def CordonNode(self, request: gpb.CordonNodeRequest, context: grpc.aio.ServicerContext) -> pb.NodeStatus:
        leader, forwarded = await self._node_leader(context, "CordonNode", request)
        if forwarded is not None:
            return forwarded
        return await self._node_status(leader, await leader.cordon(request.node, request.cordoned))

    @handled
    async def DrainNode(self, request: gpb.DrainNodeRequest, context: grpc.aio.ServicerContext) -> gpb.DrainNodeResponse:
        leader, forwarded = await self._node_leader(context, "DrainNode", request)
        if forwarded is not None:
            return forwarded
        rec, gangs, requeued = await leader.drain(request.node, request.requeue)
        return gpb.DrainNodeResponse(node=await self._node_status(leader, rec), gangs=gangs, requeued=requeued)

    @handled
    async def DeleteNode(self, request: gpb.DeleteNodeRequest, context: grpc.aio.ServicerContext) -> gpb.DeleteNodeResponse:
        leader, forwarded = await self._node_leader(context, "DeleteNode", request)
        if forwarded is not None:
            return forwarded
        return gpb.DeleteNodeResponse(gangs=await leader.delete_node(request.node, request.force))
