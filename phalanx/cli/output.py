"""How the ``phalanx`` command shows what the cluster answered: the human
forms of a gang (``get``, ``describe``), its events, nodes and status
lines, and ``-o json|yaml`` (``dump``). Tables and ages: phalanx/text_tables.py.
Pure functions of protobuf messages; protobuf and YAML are imported on
first use (docs/cli.md "Start-up time")."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from phalanx.client_names import parse_states, state_name
from phalanx.model import GangState, Level
from phalanx.text_tables import format_age, format_table

if TYPE_CHECKING:  # annotations only
    from phalanx.v1 import gang_pb2
    from phalanx.v1 import types_pb2 as pb


def age_since(timestamp: float, now: float | None = None) -> str:
    if not timestamp:
        return "-"
    return format_age((time.time() if now is None else now) - timestamp)


def level_label(value: int) -> str:
    try:
        return Level(value).label if value else "-"
    except ValueError:
        return str(value)


def message_to_dict(msg: Any) -> Any:
    """phalanx.wire.message_to_dict (protobuf is imported on first use)."""
    from phalanx.wire import message_to_dict as to_dict

    return to_dict(msg)


def dump(msg: Any, fmt: str) -> str:
    import yaml

    data = message_to_dict(msg) if not isinstance(msg, (dict, list)) else msg
    # Text as the user wrote it (a spec's "2×A100" stays so), as `describe` prints it.
    if fmt == "json":
        return json.dumps(data, indent=2, sort_keys=False, ensure_ascii=False)
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip("\n")


def gang_gpus(gang: pb.Gang) -> int:
    return gang.spec.members * gang.spec.resources.gpus


def describe_gang(gang: pb.Gang, now: float | None = None) -> str:
    """The human form of ``phalanx get``."""
    spec = gang.spec
    topo = []
    if spec.topology.required:
        topo.append(f"required {level_label(spec.topology.required)}")
    if spec.topology.preferred:
        topo.append(f"preferred {level_label(spec.topology.preferred)}")
    if spec.topology.allow_cross_az:
        topo.append("cross-AZ allowed")
    if gang.span:
        topo.append(f"span {level_label(gang.span)}")
    model = f" {spec.resources.gpu_model}" if spec.resources.gpu_model else ""
    nics = f", {spec.resources.rdma_nics} RDMA NIC" if spec.resources.rdma_nics else ""
    fields = [
        ("id", gang.id),
        ("name", spec.name),
        ("state", f"{state_name(gang)} (incarnation {gang.incarnation}, restarts {gang.restarts})"),
        ("owner az", gang.owner_az or "-"),
        ("members", f"{spec.members} x {spec.resources.gpus}{model} GPU{nics} = {gang_gpus(gang)} GPUs"),
        ("queue", f"{spec.queue or 'default'} (priority {spec.priority})"),
        ("topology", ", ".join(topo) or "-"),
        ("submitted", f"{_clock(gang.submitted_at)} ({age_since(gang.submitted_at, now)} ago)" if gang.submitted_at else "-"),
        ("updated", f"{_clock(gang.updated_at)} ({age_since(gang.updated_at, now)} ago)" if gang.updated_at else "-"),
    ]
    if gang.owner:
        # Only a TLS cluster records who submitted a gang; a plaintext one's
        # output stays as it was.
        fields.insert(4, ("submitted by", gang.owner))
    if gang.reason:
        fields.append(("reason", gang.reason))
    width = max(len(k) for k, _ in fields) + 1
    out = [f"{(k + ':').ljust(width)} {v}" for k, v in fields]
    if gang.placement:
        out.append("placement:")
        rows = [
            [m.rank, m.az, m.node, ",".join(str(g) for g in m.gpus) or "-", ",".join(m.nics) or "-"]
            for m in sorted(gang.placement, key=lambda m: m.rank)
        ]
        out.extend("  " + line for line in format_table(["RANK", "AZ", "NODE", "GPUS", "NICS"], rows).splitlines())
    return "\n".join(out)


def _clock(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def gang_rows(gangs: Sequence[pb.Gang], now: float | None = None) -> list[list[Any]]:
    return [
        [
            g.id,
            g.spec.name,
            state_name(g),
            g.owner_az or "-",
            g.spec.members,
            gang_gpus(g),
            age_since(g.submitted_at, now),
            g.reason,
        ]
        for g in gangs
    ]


GANG_HEADERS = ["ID", "NAME", "STATE", "AZ", "MEMBERS", "GPUS", "AGE", "REASON"]


def watch_line(gang: pb.Gang) -> str:
    """One line per change for ``phalanx watch``, stamped with when the
    record changed (``updated_at``), not when the line is printed: the
    first line shows a state reached before the watch began."""
    stamp = time.strftime("%H:%M:%S", time.localtime(gang.updated_at)) if gang.updated_at else time.strftime("%H:%M:%S")
    parts = [stamp, gang.id, state_name(gang), f"inc={gang.incarnation}"]
    if gang.placement:
        nodes = {(m.az, m.node) for m in gang.placement}
        azs = {m.az for m in gang.placement}
        parts.append(f"nodes={len(nodes)}" + (f" azs={len(azs)}" if len(azs) > 1 else ""))
    if gang.span:
        parts.append(f"span={level_label(gang.span)}")
    if gang.reason:
        parts.append(gang.reason)
    return "  ".join(parts)


def event_line(e: pb.GangEventRecord) -> str:
    """One event, as `phalanx events` and `phalanx describe` print it."""
    inc = f"inc={e.incarnation}" if e.incarnation else "inc=-"
    return f"{_clock(e.at)}  epoch={e.epoch}  {inc}  {e.kind:<13}  {e.message}"


def describe_full(gang: pb.Gang, now: float | None = None) -> str:
    """`phalanx describe`: spec, state, placement, events, in reading order."""
    import yaml

    from phalanx.wire import spec_from_pb

    spec = yaml.safe_dump(spec_from_pb(gang.spec).to_dict(), sort_keys=False, allow_unicode=True).rstrip("\n")
    out = [f"gang {gang.id}", "spec:"] + ["  " + line for line in spec.splitlines()]
    state = [
        ("state", f"{state_name(gang)} (incarnation {gang.incarnation}, restarts {gang.restarts})"),
        ("owner az", gang.owner_az or "-"),
        ("submitted", f"{_clock(gang.submitted_at)} ({age_since(gang.submitted_at, now)} ago)" if gang.submitted_at else "-"),
        ("updated", f"{_clock(gang.updated_at)} ({age_since(gang.updated_at, now)} ago)" if gang.updated_at else "-"),
    ]
    if gang.owner:
        state.insert(2, ("submitted by", gang.owner))
    if gang.reason:
        state.append(("reason", gang.reason))
    if gang.span:
        state.append(("span", level_label(gang.span)))
    width = max(len(k) for k, _ in state) + 1
    out.append("state:")
    out.extend(f"  {(k + ':').ljust(width)} {v}" for k, v in state)
    if gang.placement:
        out.append("placement:")
        rows = [[m.rank, m.az, m.node, ",".join(str(g) for g in m.gpus) or "-", ",".join(m.nics) or "-"]
                for m in sorted(gang.placement, key=lambda m: m.rank)]
        out.extend("  " + line for line in format_table(["RANK", "AZ", "NODE", "GPUS", "NICS"], rows).splitlines())
    else:
        out.append("placement: -")
    if gang.events:
        out.append("events:")
        # Each event's stimulus (the decision that wrote it), as the
        # coordinator's log lines name it: grep the logs for it.
        out.extend("  " + event_line(e) + (f"  [stimulus={e.stimulus}]" if e.stimulus else "") for e in gang.events)
    else:
        out.append("events: - (none recorded: a coordinator older than events wrote this gang)")
    return "\n".join(out)


def cluster_event_line(ce: gang_pb2.ClusterEvent) -> str:
    """One event of the cluster stream: the gang (name and id), then the
    event as `phalanx events ID` prints it."""
    return f"{ce.gang_name} ({ce.gang_id})  {event_line(ce.event)}"


def node_rows(nodes: Sequence[pb.NodeStatus], now: float | None = None) -> list[list[Any]]:
    rows = []
    for n in sorted(nodes, key=lambda n: (n.topology.az, n.topology.node)):
        t = n.topology
        rows.append(
            [
                t.node,
                t.az or "-",
                f"{t.spine or '-'}/{t.leaf or '-'}",
                "yes" if n.ready else "no",
                f"{n.gpus_used}/{n.gpus_total}",
                age_since(n.last_heartbeat, now),
                n.reason,
            ]
        )
    return rows


def node_states_note(az: Any) -> str:
    """" (1 not ready, 2 cordoned, 1 expired)" for an AzStatus, or ""
    when every node is ready (docs/nodes.md)."""
    parts = [f"{n} {what}" for n, what in ((az.nodes_not_ready, "not ready"), (az.nodes_cordoned, "cordoned"),
                                           (az.nodes_expired, "expired")) if n]
    return f" ({', '.join(parts)})" if parts else ""


def etcd_space_line(etcd: Any) -> str:
    """The status line about etcd's space (a gang_pb2.EtcdSpace): an error
    line while its NOSPACE alarm stops every write, a warning from 80 % of
    its quota, else the plain figures."""
    where = 'docs/etcd-keys.md "When etcd is full"'
    if etcd.level == "alarm":
        return (f"error: etcd's space alarm (NOSPACE) is active: {etcd.summary}; etcd refuses every write, so no gang "
                f"is admitted, started or finished until an operator recovers ({where})")
    if etcd.level == "warning":
        return (f"warning: etcd is nearly full: {etcd.summary}; at the quota it refuses every write: keep fewer "
                f"finished gangs or raise the quota ({where})")
    if etcd.error:
        return f"etcd: its space could not be read: {etcd.error}"
    return etcd.summary or "etcd: space not reported (an older coordinator answered)"


def format_state_counts(counts: dict[str, int]) -> str:
    """``PENDING 1, RUNNING 3`` in lifecycle order; keys may be names with or
    without the ``GANG_STATE_`` prefix."""

    def order(name: str) -> tuple[int, str]:
        try:
            return (min(int(s) for s in parse_states(name)), name)
        except ValueError:
            return (len(GangState) + 1, name)

    items = sorted(((k, v) for k, v in counts.items() if v), key=lambda kv: order(kv[0]))
    return ", ".join(f"{k.removeprefix('GANG_STATE_')} {v}" for k, v in items)
