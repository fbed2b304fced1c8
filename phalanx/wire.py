"""Conversions between domain objects and the generated protobuf messages.

The one module on the client side that knows both shapes; everything else works
on the frozen dataclasses of ``phalanx.spec`` / ``phalanx.topology``.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message

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


# Wire fields that hold unix seconds: printed as RFC 3339 (UTC).
_TIME_FIELDS = frozenset({
    ("phalanx.v1.Gang", "submitted_at"),
    ("phalanx.v1.Gang", "updated_at"),
    ("phalanx.v1.Gang", "not_before"),
    ("phalanx.v1.NodeStatus", "last_heartbeat"),
    ("phalanx.v1.GangEventRecord", "at"),
})


def rfc3339(seconds: float) -> str:
    """``2024-06-01T08:27:47.123Z`` (UTC, milliseconds)."""
    stamp = datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def enum_text(enum: EnumDescriptor, number: int) -> str | int:
    """A wire enum value as a person (and a spec) spells it: gang states
    ``PENDING``, topology levels ``spine`` (the spec's words), other enums
    their name without the type prefix (``PIX``). An unknown number stays a
    number."""
    value = enum.values_by_number.get(number)
    if value is None:
        return number
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
    name = value.name.removeprefix(prefix)
    return name.lower() if enum.full_name == "phalanx.v1.TopologyLevel" else name


def message_to_dict(msg: Message) -> dict[str, Any]:
    """Readable form for ``-o json|yaml``: protobuf field names, enums as
    ``enum_text`` spells them, times as RFC 3339, 64-bit integers as
    numbers; every plain field is shown (``rank: 0`` too), unset messages,
    times and enums are left out. A ``GangSpec`` is written in exactly
    the form a spec file takes (every field, defaults included), so the
    ``spec:`` of ``phalanx get ID -o yaml`` can be submitted again."""
    if isinstance(msg, pb.GangSpec):
        try:
            return spec_from_pb(msg).to_dict()
        except InvalidSpec:
            pass  # not a valid spec (an old record?): show what is there
    out: dict[str, Any] = {}
    owner = msg.DESCRIPTOR.full_name
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.has_presence and not field.is_repeated and not msg.HasField(field.name):
            continue  # an unset message or optional field
        if (owner, field.name) in _TIME_FIELDS and not value:
            continue  # no time (e.g. never restarted): not 1970
        if field.type == FieldDescriptor.TYPE_ENUM and not field.is_repeated and value == 0:
            continue  # UNSPECIFIED
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _field_value(owner, value_field, v) for k, v in sorted(value.items())}
        elif field.is_repeated:
            out[field.name] = [_field_value(owner, field, v) for v in value]
        else:
            out[field.name] = _field_value(owner, field, value)
    return out


def _field_value(owner: str, field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_to_dict(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return enum_text(field.enum_type, value)
    if (owner, field.name) in _TIME_FIELDS:
        return rfc3339(value)
    return value
