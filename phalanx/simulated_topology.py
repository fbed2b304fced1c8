"""Synthetic DGX-like nodes and fabrics, for simulated agents (`phalanx up`,
agent/sim.py, which also reach them as agent.topology.simulated), tests and
benchmarks.

A simulated node has the shape discovery reports on an HGX H100: GPUs split
over two NUMA nodes, NVLink islands, one RoCE NIC per PCIe switch, GPU↔NIC
distances PIX / PXB / NODE / SYS. Everything that does not depend on the node's
name (NICs, distance table, peers) is built once per shape and shared, so a
1000-node fabric builds in a few tens of milliseconds.
"""

from __future__ import annotations

import uuid as uuidlib
from functools import lru_cache

from phalanx.model import PcieDistance
from phalanx.topology import Gpu, GpuNicLink, Nic, NodeTopology

SIMULATED = "simulated"
_UUID_NAMESPACE = uuidlib.UUID("6f1c6a52-3d55-4c1e-9a3e-7b0c1c0d9a11")

# MiB as NVML reports them for the common parts; anything else gets 80 GiB.
_MEMORY_MIB = {
    "A100": 81920,
    "H100": 81559,
    "H200": 143771,
    "B200": 183359,
    "GB200": 189471,
    "L40S": 46068,
}


def simulated_node(
    node: str,
    az: str,
    *,
    spine: str = "",
    leaf: str = "",
    region: str = "local",
    gpus: int = 8,
    nics: int = 8,
    model: str = "H100",
    islands: int = 1,
    nvlink_domain: str = "",
    rail_optimised: bool = True,
) -> NodeTopology:
    """One synthetic node.

    - GPU ``i`` sits on NUMA node ``i // (gpus / 2)`` (two sockets) and in
      NVLink island ``i // (gpus // islands)`` (the last island takes any
      remainder); peers are the other GPUs of its island.
    - There are ``min(gpus, nics)`` PCIe switches; GPU ``g`` and NIC ``j``
      share switch ``g * S // gpus == j * S // nics``. NIC ``mlx5_j`` is a
      400 Gb/s RoCE port, ACTIVE, on rail ``j`` when ``rail_optimised``.
    - Distances: same switch PIX; switches ``2k`` and ``2k+1`` on one NUMA
      node share a parent switch, PXB; same NUMA node NODE; else SYS.
    """
    if gpus < 0 or nics < 0:
        raise ValueError(f"simulated node {node!r}: gpus and nics must be >= 0 (got {gpus}, {nics})")
    if islands < 1:
        raise ValueError(f"simulated node {node!r}: islands must be >= 1 (got {islands})")
    shape = _shape(gpus, nics, model, min(islands, max(gpus, 1)), rail_optimised)
    return NodeTopology(
        node=node,
        az=az,
        region=region,
        spine=spine,
        leaf=leaf,
        nvlink_domain=nvlink_domain,
        gpus=tuple(
            Gpu(
                index=i,
                uuid=f"GPU-{uuidlib.uuid5(_UUID_NAMESPACE, f'{node}/{i}')}",
                model=model,
                memory_mib=shape.memory_mib,
                pci_bus_id=shape.gpu_bus[i],
                numa_node=shape.gpu_numa[i],
                nvlink_island=shape.island[i],
                nvlink_peers=shape.peers[i],
                pcie_switch=shape.gpu_switch[i],
            )
            for i in range(gpus)
        ),
        nics=shape.nics,
        links=shape.links,
        labels={},
        sources=(SIMULATED,),
    )


def simulated_fabric(
    az: str,
    nodes: int,
    spines: int,
    leaves_per_spine: int,
    *,
    region: str = "local",
    gpus: int = 8,
    nics: int = 8,
    model: str = "H100",
    islands: int = 1,
    nodes_per_nvlink_domain: int = 0,
    rail_optimised: bool = True,
    prefix: str = "",
) -> list[NodeTopology]:
    """``nodes`` simulated nodes of one AZ spread evenly, in contiguous runs,
    over ``spines * leaves_per_spine`` leaves (leaf sizes differ by at most
    one). Names: ``<prefix or az>-n<k>``; spines ``spine-<s>``, leaves
    ``leaf-<s>-<l>``. With ``nodes_per_nvlink_domain > 0`` consecutive nodes
    form multi-node NVLink domains ``<az>-nvl<d>`` (GB200 NVL72: 18 trays)."""
    if nodes < 0 or spines < 1 or leaves_per_spine < 1:
        raise ValueError(
            f"simulated fabric {az!r}: need nodes >= 0, spines >= 1, leaves_per_spine >= 1 "
            f"(got {nodes}, {spines}, {leaves_per_spine})"
        )
    if nodes_per_nvlink_domain < 0:
        raise ValueError(f"simulated fabric {az!r}: nodes_per_nvlink_domain must be >= 0")
    leaves = spines * leaves_per_spine
    width = max(3, len(str(max(nodes - 1, 0))))
    stem = prefix or az
    out = []
    for k in range(nodes):
        leaf_index = k * leaves // nodes
        s, l = divmod(leaf_index, leaves_per_spine)
        domain = f"{az}-nvl{k // nodes_per_nvlink_domain}" if nodes_per_nvlink_domain else ""
        out.append(
            simulated_node(
                f"{stem}-n{k:0{width}d}",
                az,
                spine=f"spine-{s}",
                leaf=f"leaf-{s}-{l}",
                region=region,
                gpus=gpus,
                nics=nics,
                model=model,
                islands=islands,
                nvlink_domain=domain,
                rail_optimised=rail_optimised,
            )
        )
    return out


class _Shape:
    """Everything about a simulated node that its name does not change."""

    __slots__ = ("memory_mib", "gpu_bus", "gpu_numa", "gpu_switch", "island", "peers", "nics", "links")

    def __init__(self, gpus: int, nics: int, model: str, islands: int, rail_optimised: bool) -> None:
        switches = max(1, min(gpus, nics))
        per_island = max(1, gpus // islands) if gpus else 1
        self.memory_mib = _MEMORY_MIB.get(model.upper(), 81920)
        self.gpu_numa = tuple(i * 2 // gpus for i in range(gpus))
        self.island = tuple(min(i // per_island, islands - 1) for i in range(gpus))
        self.peers = tuple(tuple(j for j in range(gpus) if j != i and self.island[j] == self.island[i]) for i in range(gpus))
        gpu_sw = tuple(g * switches // gpus for g in range(gpus))
        nic_sw = tuple(j * switches // nics for j in range(nics))
        nic_numa = tuple(j * 2 // nics for j in range(nics))
        self.gpu_switch = tuple(f"sw{s}" for s in gpu_sw)
        self.gpu_bus = tuple(_bus(0x18, i) for i in range(gpus))
        self.nics = tuple(
            Nic(
                name=f"mlx5_{j}",
                pci_bus_id=_bus(0x19, j),
                numa_node=nic_numa[j],
                rate_gbps=400,
                link_layer="Ethernet",
                state="ACTIVE",
                rail=j if rail_optimised else -1,
                pcie_switch=f"sw{nic_sw[j]}",
            )
            for j in range(nics)
        )
        links = []
        for g in range(gpus):
            for j in range(nics):
                if gpu_sw[g] == nic_sw[j]:
                    d = PcieDistance.PIX
                elif self.gpu_numa[g] != nic_numa[j]:
                    d = PcieDistance.SYS
                elif gpu_sw[g] // 2 == nic_sw[j] // 2:
                    d = PcieDistance.PXB
                else:
                    d = PcieDistance.NODE
                links.append(GpuNicLink(g, f"mlx5_{j}", d))
        self.links = tuple(links)


@lru_cache(maxsize=64)
def _shape(gpus: int, nics: int, model: str, islands: int, rail_optimised: bool) -> _Shape:
    return _Shape(gpus, nics, model, islands, rail_optimised)


def _bus(base: int, k: int) -> str:
    """Distinct, plausible PCI addresses: 8 devices per domain, like an HGX
    board's 8 switch slots."""
    return f"{k // 8:04x}:{base + (k % 8) * 0x10:02x}:00.0"
