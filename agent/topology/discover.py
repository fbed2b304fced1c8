"""Discovery: run the enabled sources and merge their facts into one
``phalanx.topology.NodeTopology`` (docs/design.md §11).

Precedence (docs/topology.md): hardware facts — GPU and NIC fields, GPU↔NIC
distances, NVLink peers, the NVLink domain — take the first *known* value in
the order NVML, sysfs, nvidia-smi, static config, labels. Location facts
(region, AZ, spine, leaf, rack) come only from static config, then labels.
Which GPUs exist is decided by the highest-precedence source allowed to define
them that reported any (NVML, else nvidia-smi); which NICs exist by the first
source that lists any (sysfs, else nvidia-smi). The others only fill in fields
of those devices.

``merge`` is a pure function of the sources' results, so precedence is tested
with hand-written partial results; ``discover`` adds the I/O and exactly one
summary log line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from phalanx.model import PcieDistance
from phalanx.topology import Gpu, GpuNicLink, Nic, NodeTopology

from agent.topology.base import (
    LABELS,
    LOCATION_FIELDS,
    NVIDIA_SMI,
    NVML,
    SOURCE_ORDER,
    STATIC,
    SYSFS,
    GpuFacts,
    NicFacts,
    PartialTopology,
    TopologySource,
    natural_key,
)
from agent.topology.labels import DEFAULT_LABEL_RULES, LabelRule, LabelSource, StaticSource
from agent.topology.nvidia_smi import NvidiaSmiSource
from agent.topology.nvml import NvmlSource
from agent.topology.sysfs import SysfsSource

log = logging.getLogger("agent.topology")


@dataclass(frozen=True)
class DiscoveryConfig:
    """Everything discovery needs, validated at construction (fail fast at
    agent start-up, not at the first placement).

    ``nvml``: a pynvml-like module; None imports ``pynvml``. Tests pass
    ``recording.ReplayNvml``. ``nvidia_smi_topo``: captured
    ``nvidia-smi topo -m`` text (``nvidia_smi.capture_topo_matrix``), None to
    skip that source. ``nic_rails``: explicit rail per NIC name, for fabrics
    where inference from PCIe affinity is wrong; ``rail_optimised=False``
    reports every NIC with rail -1.
    """

    node: str
    az: str = ""
    region: str = ""
    spine: str = ""
    leaf: str = ""
    rack: str = ""
    nvlink_domain: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    sources: frozenset[str] = frozenset(SOURCE_ORDER)
    sysfs_root: Path = Path("/sys")
    nvml: Any = None
    nvidia_smi_topo: str | None = None
    rail_optimised: bool = True
    nic_rails: Mapping[str, int] = field(default_factory=dict)
    label_rules: tuple[LabelRule, ...] = DEFAULT_LABEL_RULES

    def __post_init__(self) -> None:
        if not self.node.strip():
            raise ValueError("discovery: node name must not be empty")
        unknown = set(self.sources) - set(SOURCE_ORDER)
        if unknown:
            raise ValueError(f"discovery: unknown sources {sorted(unknown)}; expected some of {list(SOURCE_ORDER)}")
        bad = {nic: rail for nic, rail in self.nic_rails.items() if rail < 0}
        if bad:
            raise ValueError(f"discovery: nic_rails must be >= 0, got {bad}")
        object.__setattr__(self, "sources", frozenset(self.sources))
        object.__setattr__(self, "sysfs_root", Path(self.sysfs_root))


def sources_for(config: DiscoveryConfig) -> list[TopologySource]:
    """The enabled sources, in precedence order."""
    built: dict[str, TopologySource] = {
        NVML: NvmlSource(config.nvml),
        SYSFS: SysfsSource(config.sysfs_root),
        NVIDIA_SMI: NvidiaSmiSource(config.nvidia_smi_topo),
        STATIC: StaticSource(
            region=config.region,
            az=config.az,
            spine=config.spine,
            leaf=config.leaf,
            rack=config.rack,
            nvlink_domain=config.nvlink_domain,
        ),
        LABELS: LabelSource(config.labels, config.label_rules),
    }
    return [built[name] for name in SOURCE_ORDER if name in config.sources]


def discover(config: DiscoveryConfig) -> NodeTopology:
    """Discover this node's topology. Never raises for missing hardware,
    drivers or files: a node with no GPU gets an empty GPU inventory, and one
    log line says why."""
    partials: list[PartialTopology] = []
    for source in sources_for(config):
        try:
            partials.append(source.discover())
        except Exception as exc:  # noqa: BLE001 — one broken source must not stop the agent
            partials.append(PartialTopology(source.name, problems=(f"{source.name}: failed: {exc!r}",)))
    topology = merge(config.node, partials, rail_optimised=config.rail_optimised, nic_rails=config.nic_rails)
    problems = [p for partial in partials for p in partial.problems]
    if not topology.gpus:
        log.warning(
            "node %s: no GPUs discovered (%s); reporting an empty GPU inventory with %d RDMA NICs",
            config.node,
            "; ".join(problems) or "no source reported any",
            len(topology.nics),
        )
    else:
        log.info(
            "node %s: %d GPUs in %d NVLink islands, %d RDMA NICs, nvlink domain %s, from %s%s",
            config.node,
            len(topology.gpus),
            len({g.nvlink_island for g in topology.gpus}),
            len(topology.nics),
            topology.nvlink_domain or "-",
            ",".join(topology.sources) or "-",
            f" ({'; '.join(problems)})" if problems else "",
        )
    return topology


def merge(
    node: str,
    partials: Sequence[PartialTopology],
    *,
    rail_optimised: bool = True,
    nic_rails: Mapping[str, int] | None = None,
) -> NodeTopology:
    """One ``NodeTopology`` from the sources' facts; see the module docstring
    for precedence. Deterministic: GPUs by index, NICs and links in natural
    name order, islands numbered by their lowest GPU index."""
    ordered = sorted(partials, key=lambda p: _rank(p.source))

    # 1. Which GPUs exist.
    inventory: list[GpuFacts] = []
    for partial in ordered:
        if partial.defines_gpus and partial.gpus:
            inventory = sorted((g for g in partial.gpus if g.index is not None), key=lambda g: g.index or 0)
            break
    indices = [g.index for g in inventory if g.index is not None]

    # 2. Join every source's GPU facts to those GPUs: by index where the
    # source knows NVML indices, else by PCI address.
    bus_of: dict[int, str] = {}
    for partial in ordered:
        for g in partial.gpus:
            if g.index is not None and g.pci_bus_id and g.index in indices:
                bus_of.setdefault(g.index, g.pci_bus_id)
    _adopt_bus_order(indices, bus_of, ordered)
    index_of_bus = {bus: i for i, bus in bus_of.items()}

    facts: dict[int, list[GpuFacts]] = {i: [] for i in indices}
    for partial in ordered:
        for g in partial.gpus:
            i = g.index if g.index is not None else index_of_bus.get(g.pci_bus_id)
            if i in facts and (g.index is not None or g.pci_bus_id):
                facts[i].append(g)

    # 3. NVLink islands: connected components of the (symmetrised) peer graph.
    present = set(indices)
    peers: dict[int, set[int]] = {i: set() for i in indices}
    for i in indices:
        known = _first(f.nvlink_peers for f in facts[i])
        for p in known or ():
            if p in present and p != i:
                peers[i].add(p)
                peers[p].add(i)
    island_of = _components(indices, peers)

    gpus = tuple(
        Gpu(
            index=i,
            uuid=_first(f.uuid for f in facts[i]) or "",
            model=_first(f.model for f in facts[i]) or "",
            memory_mib=_first(f.memory_mib or None for f in facts[i]) or 0,
            pci_bus_id=bus_of.get(i, ""),
            numa_node=_numa(_first(f.numa_node for f in facts[i])),
            nvlink_island=island_of[i],
            nvlink_peers=tuple(sorted(peers[i])),
            pcie_switch=_first(f.pcie_switch for f in facts[i]) or "",
        )
        for i in indices
    )

    # 4. NICs: the first source that lists any decides which exist (sysfs
    # skips SR-IOV VFs that nvidia-smi lists); the rest fill in fields by name.
    listed = next((p.nics for p in ordered if p.nics), ())
    nic_facts: dict[str, list[NicFacts]] = {n.name: [] for n in listed}
    for partial in ordered:
        for n in partial.nics:
            if n.name in nic_facts:
                nic_facts[n.name].append(n)
    names = sorted(nic_facts, key=natural_key)

    # 5. GPU↔NIC distances: first source that relates the pair.
    distance: dict[tuple[int, str], PcieDistance] = {}
    for partial in ordered:
        for link in partial.links:
            i = link.gpu_index if link.gpu_index is not None else index_of_bus.get(link.gpu_pci_bus_id)
            if i in present and link.nic in nic_facts:
                distance.setdefault((i, link.nic), link.distance)
    links = tuple(
        GpuNicLink(i, name, distance[(i, name)]) for i in indices for name in names if (i, name) in distance
    )

    rails = dict(nic_rails) if nic_rails else (infer_rails(indices, names, distance, nic_facts) if rail_optimised else {})
    nics = tuple(
        Nic(
            name=name,
            pci_bus_id=_first(n.pci_bus_id for n in nic_facts[name]) or "",
            numa_node=_numa(_first(n.numa_node for n in nic_facts[name])),
            rate_gbps=_first(n.rate_gbps or None for n in nic_facts[name]) or 0,
            link_layer=_first(n.link_layer for n in nic_facts[name]) or "",
            # A NIC whose state no source could read is not known to work:
            # do not offer it to placement as ACTIVE.
            state=_first(n.state for n in nic_facts[name]) or "UNKNOWN",
            rail=rails.get(name, -1),
            pcie_switch=_first(n.pcie_switch for n in nic_facts[name]) or "",
        )
        for name in names
    )

    # 6. Location: first source that knows each field.
    location = {f: _first(p.location.get(f, "") for p in ordered) or "" for f in LOCATION_FIELDS}
    labels: dict[str, str] = {}
    for partial in reversed(ordered):
        labels.update(partial.labels)
    return NodeTopology(
        node=node,
        gpus=gpus,
        nics=nics,
        links=links,
        labels=labels,
        sources=tuple(p.source for p in ordered if not p.empty),
        **location,
    )


def infer_rails(
    gpus: Sequence[int],
    nics: Sequence[str],
    distance: Mapping[tuple[int, str], PcieDistance],
    nic_facts: Mapping[str, Sequence[NicFacts]] | None = None,
) -> dict[str, int]:
    """Rail index per NIC on a rail-optimised fabric.

    Each GPU, in index order, takes its closest free NIC behind a common PCIe
    switch (PIX/PXB: HGX/DGX, where every GPU has its own NIC), in rounds
    until none is left (GPUs with two NICs each); when no GPU has one (Grace:
    GPUs hang off the CPU by NVLink-C2C, NICs off its PCIe), one closest free
    NIC on its NUMA node. Ties go to the faster NIC, then natural name order,
    so a slower storage/front-end NIC on the same node loses. Rails are
    numbered by (GPU, round) of the taker; NICs no GPU took (storage,
    management, a second GPU's share of a switch it has no NIC of) get none.
    """
    facts = nic_facts or {}
    rate = {n: _first(f.rate_gbps or None for f in facts.get(n, ())) or 0 for n in nics}
    order = {n: k for k, n in enumerate(nics)}

    def pair(limit: PcieDistance, rounds: int) -> dict[str, tuple[int, int]]:
        taken: dict[str, tuple[int, int]] = {}  # nic -> (gpu, round)
        for r in range(rounds):
            before = len(taken)
            for g in gpus:
                options = [
                    (distance[(g, n)], -rate[n], order[n], n)
                    for n in nics
                    if n not in taken and (g, n) in distance and distance[(g, n)] <= limit
                ]
                if options:
                    taken[min(options)[3]] = (g, r)
            if len(taken) == before:
                break
        return taken

    # Behind a shared switch a GPU may own several NICs (2 x 400G per GPU):
    # keep pairing in rounds. By NUMA node only one round, or the front-end
    # NIC on the same socket would become a rail.
    taken = pair(PcieDistance.PXB, len(nics)) or pair(PcieDistance.NODE, 1)
    by_gpu = sorted(taken, key=lambda n: (taken[n], order[n]))
    return {n: rail for rail, n in enumerate(by_gpu)}


def _adopt_bus_order(indices: list[int], bus_of: dict[int, str], ordered: Sequence[PartialTopology]) -> None:
    """GPUs known only by index (nvidia-smi without NVML) get PCI addresses
    from sysfs in bus order — the order NVML enumerates GPUs in by default —
    but only when the counts agree; a mismatch would pair the wrong GPU with
    the wrong NICs, so those GPUs stay without sysfs facts."""
    missing = [i for i in indices if i not in bus_of]
    if not missing:
        return
    for partial in ordered:
        if partial.defines_gpus:
            continue
        addresses = sorted({g.pci_bus_id for g in partial.gpus if g.index is None and g.pci_bus_id})
        if addresses and len(addresses) == len(indices) and not bus_of:
            bus_of.update(zip(sorted(indices), addresses))
            return


def _components(indices: Sequence[int], peers: Mapping[int, set[int]]) -> dict[int, int]:
    island: dict[int, int] = {}
    next_id = 0
    for start in sorted(indices):
        if start in island:
            continue
        stack = [start]
        island[start] = next_id
        while stack:
            for p in peers[stack.pop()]:
                if p not in island:
                    island[p] = next_id
                    stack.append(p)
        next_id += 1
    return island


def _first(values: Iterable[Any]) -> Any:
    """First known value in precedence order; None and "" mean "this source
    does not know". (0 is a real NUMA node, rail and index; fields where 0
    means "not reported", such as memory, pass ``or None``.)"""
    for v in values:
        if v is not None and v != "":
            return v
    return None


def _numa(value: int | None) -> int:
    return -1 if value is None else value


def _rank(source: str) -> int:
    try:
        return SOURCE_ORDER.index(source)
    except ValueError:
        return len(SOURCE_ORDER)
