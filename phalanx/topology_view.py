"""Text tree of the fleet for ``phalanx topology``: AZ → spine → leaf → node →
GPUs / NICs, with GPU counts at every level.

Counts: ``total`` GPUs, ``used`` (held by a member), ``free`` (not used, on a
ready node: what placement could hand out now). A not-ready node's unused GPUs
are neither used nor free, so ``free + used <= total`` and the gap is capacity
that is down. Order is deterministic (natural name order at every level), so
two renders of the same state are byte-identical and diffable.

Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from phalanx.topology import Gpu, Nic, NodeTopology

NodeEntry = tuple[NodeTopology, frozenset[int], bool]  # (topology, used GPU indices, ready)

_DIGITS = re.compile(r"(\d+)")


def _natural(name: str) -> tuple[object, ...]:
    # node-10 after node-9; mirrors agent.topology.base.natural_key (the
    # client package does not import the agent).
    return tuple(int(p) if i % 2 else p.lower() for i, p in enumerate(_DIGITS.split(name)))


@dataclass(frozen=True)
class Counts:
    total: int = 0
    used: int = 0
    free: int = 0
    nodes: int = 0
    ready: int = 0

    def __add__(self, other: "Counts") -> "Counts":
        return Counts(
            self.total + other.total,
            self.used + other.used,
            self.free + other.free,
            self.nodes + other.nodes,
            self.ready + other.ready,
        )

    def summary(self, *, nodes: bool = True) -> str:
        text = f"gpus {self.free} free / {self.used} used / {self.total} total"
        if self.total - self.used - self.free:
            text += f" ({self.total - self.used - self.free} down)"
        if nodes:
            text += f", nodes {self.ready}/{self.nodes} ready"
        return text


def node_counts(topology: NodeTopology, used: frozenset[int], ready: bool) -> Counts:
    indices = set(topology.gpu_indices)
    n_used = len(indices & used)
    return Counts(
        total=len(indices),
        used=n_used,
        free=len(indices) - n_used if ready else 0,
        nodes=1,
        ready=1 if ready else 0,
    )


def render_tree(nodes: Sequence[NodeEntry], *, devices: bool = True) -> str:
    """The tree as text, one line per AZ, spine, leaf, node and (with
    ``devices``) GPU and NIC. Missing spine/leaf names print as ``-``."""
    if not nodes:
        return "no nodes"
    tree: dict[str, dict[str, dict[str, list[NodeEntry]]]] = {}
    for entry in nodes:
        t = entry[0]
        tree.setdefault(t.az or "-", {}).setdefault(t.spine or "-", {}).setdefault(t.leaf or "-", []).append(entry)

    lines: list[str] = []
    grand = _sum(node_counts(*e) for e in nodes)
    lines.append(f"fleet: {len(tree)} AZs, {grand.summary()}")
    for az_i, az in enumerate(sorted(tree, key=_natural)):
        spines = tree[az]
        az_last = az_i == len(tree) - 1
        az_counts = _sum(node_counts(*e) for s in spines.values() for l in s.values() for e in l)
        lines.append(f"{_branch(az_last)}az {az}: {az_counts.summary()}")
        az_pad = _pad(az_last)
        for sp_i, spine in enumerate(sorted(spines, key=_natural)):
            leaves = spines[spine]
            sp_last = sp_i == len(spines) - 1
            sp_counts = _sum(node_counts(*e) for l in leaves.values() for e in l)
            lines.append(f"{az_pad}{_branch(sp_last)}spine {spine}: {sp_counts.summary()}")
            sp_pad = az_pad + _pad(sp_last)
            for lf_i, leaf in enumerate(sorted(leaves, key=_natural)):
                entries = sorted(leaves[leaf], key=lambda e: _natural(e[0].node))
                lf_last = lf_i == len(leaves) - 1
                lf_counts = _sum(node_counts(*e) for e in entries)
                lines.append(f"{sp_pad}{_branch(lf_last)}leaf {leaf}: {lf_counts.summary()}")
                lf_pad = sp_pad + _pad(lf_last)
                for n_i, (topo, used, ready) in enumerate(entries):
                    n_last = n_i == len(entries) - 1
                    lines.append(f"{lf_pad}{_branch(n_last)}{_node_line(topo, used, ready)}")
                    if devices:
                        _device_lines(lines, lf_pad + _pad(n_last), topo, used, ready)
    return "\n".join(lines)


def _node_line(topo: NodeTopology, used: frozenset[int], ready: bool) -> str:
    text = f"node {topo.node} [{'ready' if ready else 'NOT READY'}] {node_counts(topo, used, ready).summary(nodes=False)}"
    if topo.rack:
        text += f", rack {topo.rack}"
    if topo.nvlink_domain:
        text += f", nvlink domain {topo.nvlink_domain}"
    return text


def _device_lines(lines: list[str], pad: str, topo: NodeTopology, used: frozenset[int], ready: bool) -> None:
    items: list[str] = [_gpu_line(g, used, ready) for g in sorted(topo.gpus, key=lambda g: g.index)]
    items += [_nic_line(n) for n in sorted(topo.nics, key=lambda n: _natural(n.name))]
    for k, text in enumerate(items):
        lines.append(f"{pad}{_branch(k == len(items) - 1)}{text}")


def _gpu_line(g: Gpu, used: frozenset[int], ready: bool) -> str:
    state = "used" if g.index in used else ("free" if ready else "down")
    numa = g.numa_node if g.numa_node >= 0 else "-"
    return f"gpu {g.index} {g.model or '?'} island {g.nvlink_island} numa {numa} {state}"


def _nic_line(n: Nic) -> str:
    rate = f"{n.rate_gbps}G" if n.rate_gbps else "?G"
    rail = n.rail if n.rail >= 0 else "-"
    layer = {"Ethernet": "RoCE", "InfiniBand": "IB"}.get(n.link_layer, n.link_layer or "?")
    return f"nic {n.name} {rate} {layer} rail {rail} {n.state or '?'}"


def _branch(last: bool) -> str:
    return "└─ " if last else "├─ "


def _pad(last: bool) -> str:
    return "   " if last else "│  "


def _sum(items: Iterable[Counts]) -> Counts:
    total = Counts()
    for c in items:
        total = total + c
    return total
