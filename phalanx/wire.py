"""Conversions between domain objects and the generated protobuf messages.

The one module on the client side that knows both shapes; everything else works
on the frozen dataclasses of ``phalanx.spec`` / ``phalanx.topology``.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from phalanx.model import Level, PcieDistance
from phalanx.spec import FieldError, InvalidSpec, parse_spec, GangSpec
from phalanx.topology import Gpu, GpuNicLink, Nic, NodeTopology
from phalanx.v1 import types_pb2 as pb


def level_to_pb(level: Level | None) -> int:
    return int(level) if level is not None else pb.TOPOLOGY_LEVEL_UNSPECIFIED


def level_from_pb(value: int) -> Level | None:
    return Level(value) if value else None


def spec_to_pb(spec: GangSpec) -> pb.GangSpec:
    return pb.GangSpec(
        name=spec.name,
        queue=spec.queue,
        priority=spec.priority,
        members=spec.members,
        resources=pb.Resources(
            gpus=spec.resources.gpus,
            gpu_model=spec.resources.gpu_model,
            rdma_nics=spec.resources.rdma_nics,
        ),
        topology=pb.TopologyConstraint(
            required=level_to_pb(spec.topology.required),
            preferred=level_to_pb(spec.topology.preferred),
            allow_cross_az=spec.topology.allow_cross_az,
        ),
        run=pb.RunSpec(
            command=list(spec.run.command),
            env=dict(spec.run.env),
            duration_s=spec.run.duration_s,
        ),
        policy=pb.Policy(
            admission_timeout_s=spec.policy.admission_timeout_s,
            max_restarts=spec.policy.max_restarts,
            start_timeout_s=spec.policy.start_timeout_s,
        ),
    )


def spec_from_pb(msg: pb.GangSpec) -> GangSpec:
    """Validate a spec received on the wire. Proto3 cannot tell "unset" from
    zero, so zero numbers mean "default" except where zero is itself invalid
    (members, gpus) — those are reported by name."""
    data: dict[str, Any] = {"name": msg.name, "members": msg.members}
    if msg.queue:
        data["queue"] = msg.queue
    if msg.priority:
        data["priority"] = msg.priority
    data["resources"] = {"gpus": msg.resources.gpus, "rdma_nics": msg.resources.rdma_nics}
    if msg.resources.gpu_model:
        data["resources"]["gpu_model"] = msg.resources.gpu_model
    # Only a true flag is passed on: proto3 cannot say "unset", and an unset
    # flag must not contradict required: region.
    topo: dict[str, Any] = {"allow_cross_az": True} if msg.topology.allow_cross_az else {}
    errors: list[FieldError] = []
    for key, value in (("required", msg.topology.required), ("preferred", msg.topology.preferred)):
        if value:
            try:
                topo[key] = Level(value).label
            except ValueError:
                errors.append(FieldError(f"topology.{key}", f"unknown topology level {value}"))
    data["topology"] = topo
    run: dict[str, Any] = {"command": list(msg.run.command), "env": dict(msg.run.env)}
    if msg.run.HasField("duration_s"):
        run["duration_s"] = msg.run.duration_s
    data["run"] = run
    policy: dict[str, Any] = {}
    if msg.policy.admission_timeout_s:
        policy["admission_timeout_s"] = msg.policy.admission_timeout_s
    if msg.HasField("policy"):
        policy["max_restarts"] = msg.policy.max_restarts
    if msg.policy.start_timeout_s:
        policy["start_timeout_s"] = msg.policy.start_timeout_s
    data["policy"] = policy
    try:
        spec = parse_spec(data)
    except InvalidSpec as exc:
        raise InvalidSpec(errors + exc.errors) from None
    if errors:
        raise InvalidSpec(errors)
    return spec


def topology_to_pb(t: NodeTopology) -> pb.NodeTopology:
    return pb.NodeTopology(
        node=t.node,
        az=t.az,
        region=t.region,
        spine=t.spine,
        leaf=t.leaf,
        rack=t.rack,
        nvlink_domain=t.nvlink_domain,
        gpus=[
            pb.Gpu(
                index=g.index,
                uuid=g.uuid,
                model=g.model,
                memory_mib=g.memory_mib,
                pci_bus_id=g.pci_bus_id,
                numa_node=g.numa_node,
                nvlink_island=g.nvlink_island,
                nvlink_peers=list(g.nvlink_peers),
                pcie_switch=g.pcie_switch,
            )
            for g in t.gpus
        ],
        nics=[
            pb.Nic(
                name=n.name,
                pci_bus_id=n.pci_bus_id,
                numa_node=n.numa_node,
                rate_gbps=n.rate_gbps,
                link_layer=n.link_layer,
                state=n.state,
                rail=n.rail,
                pcie_switch=n.pcie_switch,
            )
            for n in t.nics
        ],
        links=[pb.GpuNicLink(gpu=l.gpu, nic=l.nic, distance=int(l.distance)) for l in t.links],
        labels=dict(t.labels),
        sources=list(t.sources),
    )


def topology_from_pb(m: pb.NodeTopology) -> NodeTopology:
    return NodeTopology(
        node=m.node,
        az=m.az,
        region=m.region,
        spine=m.spine,
        leaf=m.leaf,
        rack=m.rack,
        nvlink_domain=m.nvlink_domain,
        gpus=tuple(
            Gpu(
                index=g.index,
                uuid=g.uuid,
                model=g.model,
                memory_mib=g.memory_mib,
                pci_bus_id=g.pci_bus_id,
                numa_node=g.numa_node,
                nvlink_island=g.nvlink_island,
                nvlink_peers=tuple(g.nvlink_peers),
                pcie_switch=g.pcie_switch,
            )
            for g in m.gpus
        ),
        nics=tuple(
            Nic(
                name=n.name,
                pci_bus_id=n.pci_bus_id,
                numa_node=n.numa_node,
                rate_gbps=n.rate_gbps,
                link_layer=n.link_layer,
                state=n.state,
                rail=n.rail,
                pcie_switch=n.pcie_switch,
            )
            for n in m.nics
        ),
        links=tuple(
            GpuNicLink(l.gpu, l.nic, PcieDistance(l.distance) if l.distance else PcieDistance.SYS)
            for l in m.links
        ),
        labels=dict(m.labels),
        sources=tuple(m.sources),
    )


def message_to_dict(msg: Any) -> dict[str, Any]:
    """Readable JSON form for ``-o json|yaml`` (enum names, snake_case)."""
    return json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=False
    )
