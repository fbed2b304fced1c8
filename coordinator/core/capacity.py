"""The free-capacity view: which devices of which nodes are free, from the
nodes' topologies and the holds on them. Pure: no I/O.

One function for every reader, so that the leader's placement, the owner's
cross-AZ view and ``explain`` from etcd count a device as taken for the same
reasons (a reservation in any state, a two-phase hold, a release not yet
done) and as free only on a usable NIC or a listed GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from coordinator.core.placement import NodeView
from coordinator.core.records import NodeRecord
from phalanx.reservation import NodeDevices
from phalanx.topology import NodeTopology

NodeKey = tuple[str, str]
"""(AZ, node): node names are unique within an AZ only."""


def held(holds: Iterable[tuple[str, Mapping[str, NodeDevices]]]) -> dict[NodeKey, NodeDevices]:
    """Every device the ``(az, node -> devices)`` holds take, per (AZ, node).
    Overlapping holds (which the invariants forbid) simply take the union."""
    gpus: dict[NodeKey, set[int]] = {}
    nics: dict[NodeKey, set[str]] = {}
    for az, nodes in holds:
        for node, (g, n) in nodes.items():
            gpus.setdefault((az, node), set()).update(g)
            nics.setdefault((az, node), set()).update(n)
    return {key: NodeDevices(tuple(sorted(gpus[key])), tuple(sorted(nics[key]))) for key in gpus}


def free_view(nodes: Iterable[tuple[NodeTopology, bool]], taken: Mapping[NodeKey, NodeDevices]) -> list[NodeView]:
    """A NodeView per ``(topology, ready)``, in the order given: its GPUs and
    usable NICs less what ``taken`` (from ``held``) holds on it."""
    out = []
    for topo, ready in nodes:
        used = taken.get((topo.az, topo.node), NodeDevices((), ()))
        out.append(NodeView(
            topology=topo,
            free_gpus=frozenset(topo.gpu_indices) - frozenset(used.gpus),
            free_nics=frozenset(n.name for n in topo.nics if n.usable) - frozenset(used.nics),
            ready=ready,
        ))
    return out


def unready_views(records: Mapping[str, NodeRecord], placeable: Iterable[str]) -> list[NodeView]:
    """A not-ready NodeView, nothing free, for every node of ``records``
    (name -> record) that takes work but is not in ``placeable`` (no session,
    not ready): placement skips them, shortfalls and never-fits count them."""
    up = set(placeable)
    return [NodeView(topology=rec.topology, free_gpus=frozenset(), free_nics=frozenset(), ready=False)
            for name, rec in records.items() if name not in up and takes_work(rec)]


# ------------------------------------------------------- node lifecycle
NODE_STATES = ("ready", "not_ready", "cordoned", "expired")
"""What a node is, one of these (docs/nodes.md): ``status`` and the
``phalanx_nodes`` gauge count each apart."""


def takes_work(rec: NodeRecord) -> bool:
    """Whether the node counts for never-fits (and explain): neither
    cordoned by an admin nor expired. A node that is only not ready may come
    back, so it counts."""
    return not rec.cordoned and not rec.expired


def node_state(rec: NodeRecord, ready: bool) -> str:
    """The node's state as status shows it; ``ready``: whether it can be
    placed on now (the leader's liveness, or the record's ``ready``)."""
    if rec.expired:
        return "expired"
    if rec.cordoned:
        return "cordoned"
    return "ready" if ready else "not_ready"


def keep_cordon(decided: NodeRecord, current: NodeRecord | None) -> NodeRecord:
    """A node record decided before it is written (a registration,
    NotReady) as it is written: with the cordon of the ``current`` record
    (None: none), so an admin's cordon written in between is not undone."""
    return decided if current is None else dataclasses.replace(decided, cordoned=current.cordoned)


def expires(rec: NodeRecord, ready: bool, silent: float, expire_after_s: float) -> bool:
    """Whether the leader expires the node now: not ready, not heard for
    ``expire_after_s`` (``silent``: since its last contact, or since this
    leader's takeover for a node it has not heard) and not expired yet."""
    return not ready and not rec.expired and silent >= expire_after_s
