"""A node's hardware and network position (docs/design.md §11), as plain data.

Produced by agent discovery (``agent/topology/``), carried in the
``NodeTopology`` wire message, stored in ``nodes/<az>/<node>`` and consumed by
placement (``coordinator/core/placement.py``). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from phalanx.model import Level, PcieDistance


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str = ""
    model: str = ""
    memory_mib: int = 0
    pci_bus_id: str = ""
    numa_node: int = -1
    nvlink_island: int = 0  # GPUs with the same island id are joined by NVLink/NVSwitch
    nvlink_peers: tuple[int, ...] = ()
    pcie_switch: str = ""


@dataclass(frozen=True)
class Nic:
    name: str
    pci_bus_id: str = ""
    numa_node: int = -1
    rate_gbps: int = 0
    link_layer: str = ""  # "Ethernet" (RoCE) or "InfiniBand"
    state: str = "ACTIVE"
    rail: int = -1  # -1: the fabric is not rail-optimised
    pcie_switch: str = ""

    @property
    def usable(self) -> bool:
        return self.state.upper() == "ACTIVE"


@dataclass(frozen=True)
class GpuNicLink:
    gpu: int
    nic: str
    distance: PcieDistance


@dataclass(frozen=True)
class NodeTopology:
    node: str
    az: str = ""
    region: str = ""
    spine: str = ""
    leaf: str = ""
    rack: str = ""
    nvlink_domain: str = ""  # multi-node NVLink clique (GB200 NVL72), "" if none
    gpus: tuple[Gpu, ...] = ()
    nics: tuple[Nic, ...] = ()
    links: tuple[GpuNicLink, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    sources: tuple[str, ...] = ()

    @property
    def gpu_indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    def distance(self, gpu: int, nic: str) -> PcieDistance:
        for link in self.links:
            if link.gpu == gpu and link.nic == nic:
                return link.distance
        return PcieDistance.SYS

    def domain(self, level: Level) -> str:
        """Name of the domain of ``level`` that contains this node; names are
        qualified by their parents so equal leaf names in two spines differ."""
        if level == Level.REGION:
            return self.region or "region"
        if level == Level.AZ:
            return self.az
        if level == Level.SPINE:
            return f"{self.az}/{self.spine or '-'}"
        if level == Level.LEAF:
            return f"{self.az}/{self.spine or '-'}/{self.leaf or '-'}"
        if level == Level.NODE:
            return f"{self.az}/{self.node}"
        # NVLINK_DOMAIN: a multi-node clique if there is one, else the node.
        if self.nvlink_domain:
            return f"{self.az}/nvl:{self.nvlink_domain}"
        return f"{self.az}/{self.node}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "az": self.az,
            "region": self.region,
            "spine": self.spine,
            "leaf": self.leaf,
            "rack": self.rack,
            "nvlink_domain": self.nvlink_domain,
            "gpus": [
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "model": g.model,
                    "memory_mib": g.memory_mib,
                    "pci_bus_id": g.pci_bus_id,
                    "numa_node": g.numa_node,
                    "nvlink_island": g.nvlink_island,
                    "nvlink_peers": list(g.nvlink_peers),
                    "pcie_switch": g.pcie_switch,
                }
                for g in self.gpus
            ],
            "nics": [
                {
                    "name": n.name,
                    "pci_bus_id": n.pci_bus_id,
                    "numa_node": n.numa_node,
                    "rate_gbps": n.rate_gbps,
                    "link_layer": n.link_layer,
                    "state": n.state,
                    "rail": n.rail,
                    "pcie_switch": n.pcie_switch,
                }
                for n in self.nics
            ],
            "links": [[l.gpu, l.nic, l.distance.name] for l in self.links],
            "labels": dict(self.labels),
            "sources": list(self.sources),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "NodeTopology":
        return cls(
            node=d["node"],
            az=d.get("az", ""),
            region=d.get("region", ""),
            spine=d.get("spine", ""),
            leaf=d.get("leaf", ""),
            rack=d.get("rack", ""),
            nvlink_domain=d.get("nvlink_domain", ""),
            gpus=tuple(
                Gpu(**{**g, "nvlink_peers": tuple(g.get("nvlink_peers", ()))}) for g in d.get("gpus", ())
            ),
            nics=tuple(Nic(**n) for n in d.get("nics", ())),
            links=tuple(GpuNicLink(int(g), str(n), PcieDistance[dist]) for g, n, dist in d.get("links", ())),
            labels=dict(d.get("labels", {})),
            sources=tuple(d.get("sources", ())),
        )
