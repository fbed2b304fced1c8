"""Coordinator records -> wire messages (servicers stay adapters, docs/style.md §8)."""

from __future__ import annotations

from coordinator.core.events import GangEvent
from coordinator.core.placement import Shortfall
from coordinator.core.records import GangRecord, NodeRecord
from phalanx import wire
from phalanx.v1 import types_pb2 as pb


def gang_to_pb(g: GangRecord) -> pb.Gang:
    return pb.Gang(
        id=g.id,
        spec=wire.spec_to_pb(g.spec),
        state=int(g.state),
        owner_az=g.owner_az,
        incarnation=g.incarnation,
        reason=g.reason,
        submitted_at=g.submitted_at,
        updated_at=g.updated_at,
        placement=[
            pb.MemberPlacement(rank=m.rank, az=m.az, node=m.node, gpus=list(m.gpus), nics=list(m.nics))
            for m in g.placement
        ],
        restarts=g.restarts,
        mod_revision=g.mod_revision,
        span=wire.level_to_pb(g.span),
        not_before=g.not_before,
        owner=g.owner,
        events=[event_to_pb(e) for e in g.events],
    )


def event_to_pb(e: GangEvent) -> pb.GangEventRecord:
    return pb.GangEventRecord(kind=e.kind, at=e.at, epoch=e.epoch, message=e.message, incarnation=e.incarnation,
                              by=e.by, rank=e.rank, exit_code=e.exit_code, dropped=e.dropped, seq=e.seq,
                              stimulus=e.stimulus)


def node_to_pb(n: NodeRecord, used_gpus: frozenset[int], last_heartbeat: float | None = None) -> pb.NodeStatus:
    """``last_heartbeat``: the leader's (AzLeader.heartbeats); None: the
    record's, written at registration."""
    return pb.NodeStatus(
        topology=wire.topology_to_pb(n.topology),
        ready=n.ready,
        gpus_total=len(n.topology.gpus),
        gpus_used=len(used_gpus),
        used_gpus=sorted(used_gpus),
        last_heartbeat=n.last_heartbeat if last_heartbeat is None else last_heartbeat,
        agent_id=n.agent_id,
        reason=n.reason,
        cordoned=n.cordoned,
        expired=n.expired,
    )


def shortfall_to_pb(s: Shortfall) -> pb.DomainShortfall:
    return pb.DomainShortfall(
        level=int(s.level),
        domain=s.domain,
        gpus_free=s.gpus_free,
        gpus_total=s.gpus_total,
        gpus_needed=s.gpus_needed,
        members_fit=s.members_fit,
        members_needed=s.members_needed,
        reason=s.reason,
    )
