"""Topology discovery against recorded machines (tests/fixtures/topology/),
merge precedence, NVML edge cases, and the no-GPU path.

Fixtures are data: NVML answers replayed by ``ReplayNvml``, sysfs trees
materialised by ``write_sysfs``, ``nvidia-smi topo -m`` texts. No mocks.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import pynvml
import pytest

from agent.topology import DiscoveryConfig, discover, merge
from agent.topology.base import GpuFacts, LinkFacts, NicFacts, PartialTopology
from agent.topology.nvml import NvmlSource
from agent.topology.recording import ReplayNvml, write_sysfs
from phalanx.model import Level, PcieDistance
from phalanx.topology import NodeTopology
from phalanx.wire import topology_from_pb, topology_to_pb

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "topology"
MACHINES = ("hgx-h100", "l40s-pcie", "gb200-nvl72", "no-driver", "h200-vm")
GB200_DOMAIN = "3f2b0a6c-9d8e-4f1a-a7b5-c4d3e2f1a0b9.32766"
PIX, PXB, PHB, NODE, SYS = (PcieDistance.PIX, PcieDistance.PXB, PcieDistance.PHB, PcieDistance.NODE, PcieDistance.SYS)


def load(machine: str, name: str) -> Any:
    path = FIXTURES / machine / name
    if not path.exists():
        return None
    return path.read_text() if path.suffix == ".txt" else json.loads(path.read_text())


@pytest.fixture(scope="module")
def sys_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each recorded machine's sysfs, materialised once per module."""
    roots = {}
    for machine in MACHINES:
        roots[machine] = write_sysfs(load(machine, "sysfs.json"), tmp_path_factory.mktemp(machine) / "sys")
    return roots


def config_for(machine: str, roots: Mapping[str, Path], **overrides: Any) -> DiscoveryConfig:
    args: dict[str, Any] = dict(
        node=machine,
        sysfs_root=roots[machine],
        nvml=ReplayNvml(load(machine, "nvml.json")),
        nvidia_smi_topo=load(machine, "nvidia-smi-topo.txt"),
        labels=load(machine, "labels.json") or {},
    )
    args.update(overrides)
    return DiscoveryConfig(**args)


# --- every recorded machine, all sources ----------------------------------------------


@dataclass(frozen=True)
class Expect:
    machine: str
    model: str
    memory_mib: int
    islands: tuple[int, ...]
    numa: tuple[int, ...]
    rails: Mapping[str, int]
    distances: Mapping[tuple[int, str], PcieDistance]
    location: Mapping[str, str]
    nvlink_domain: str = ""
    down_nics: frozenset[str] = frozenset()
    link_layer: str = "Ethernet"
    sources: tuple[str, ...] = ("nvml", "sysfs", "nvidia-smi", "labels")
    pcie_switch_of_gpu0: str = field(default="")


CASES = [
    Expect(
        machine="hgx-h100",
        model="NVIDIA H100 80GB HBM3",
        memory_mib=81559,
        islands=(0,) * 8,  # NVSwitch: one island
        numa=(0, 0, 0, 0, 1, 1, 1, 1),
        rails={**{f"mlx5_{k}": k for k in range(8)}, "mlx5_8": -1},  # storage NIC: no rail
        distances={
            (0, "mlx5_0"): PIX,
            (7, "mlx5_7"): PIX,
            (0, "mlx5_1"): NODE,
            (1, "mlx5_8"): PHB,  # storage NIC on GPU1's host bridge
            (0, "mlx5_8"): NODE,
            (0, "mlx5_4"): SYS,
            (4, "mlx5_8"): SYS,
        },
        location={"region": "us-central1", "az": "us-central1-b", "spine": "b-4f2a", "leaf": "sb-91c3", "rack": "sb-91c3"},
        pcie_switch_of_gpu0="0000:16:00.0",
    ),
    Expect(
        machine="l40s-pcie",
        model="NVIDIA L40S",
        memory_mib=46068,
        islands=tuple(range(8)),  # no NVLink: 8 islands of one
        numa=(0, 0, 0, 0, 1, 1, 1, 1),
        rails={"mlx5_0": 0, "mlx5_1": 1, "mlx5_2": 2, "mlx5_3": 3},  # VF mlx5_4 skipped
        distances={(0, "mlx5_0"): PIX, (1, "mlx5_0"): PIX, (2, "mlx5_1"): PIX, (0, "mlx5_1"): NODE, (0, "mlx5_2"): SYS},
        location={"region": "onprem-eu", "az": "dc1-hall-a", "spine": "spine-2", "leaf": "leaf-07"},
        down_nics=frozenset({"mlx5_3"}),
        pcie_switch_of_gpu0="0000:16:00.0",
    ),
    Expect(
        machine="gb200-nvl72",
        model="NVIDIA GB200",
        memory_mib=189471,
        islands=(0, 0, 0, 0),  # all four reach the rack's NVSwitch trays
        numa=(0, 0, 1, 1),
        rails={"mlx5_0": 0, "mlx5_1": 1, "mlx5_2": 2, "mlx5_3": 3, "mlx5_4": -1, "mlx5_5": -1},
        # sysfs outranks nvidia-smi, which prints SYS for every pair on Grace.
        distances={(0, "mlx5_0"): NODE, (1, "mlx5_1"): NODE, (0, "mlx5_2"): SYS, (2, "mlx5_2"): NODE, (3, "mlx5_4"): SYS},
        location={"region": "us-east", "az": "us-east-1a", "spine": "ib-spine-1", "leaf": "ib-leaf-03"},
        nvlink_domain=GB200_DOMAIN,
        link_layer="InfiniBand",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.machine for c in CASES])
def test_recorded_machine_discovers_its_layout(case: Expect, sys_roots: dict[str, Path]) -> None:
    topo = discover(config_for(case.machine, sys_roots))

    assert topo.node == case.machine
    assert topo.gpu_indices == tuple(range(len(case.islands)))
    assert {g.model for g in topo.gpus} == {case.model}
    assert {g.memory_mib for g in topo.gpus} == {case.memory_mib}
    assert all(g.uuid.startswith("GPU-") and g.pci_bus_id for g in topo.gpus)
    assert tuple(g.nvlink_island for g in topo.gpus) == case.islands
    assert tuple(g.numa_node for g in topo.gpus) == case.numa
    for g in topo.gpus:  # peers are exactly the rest of the island
        assert set(g.nvlink_peers) == {h.index for h in topo.gpus if h.nvlink_island == g.nvlink_island} - {g.index}
    assert topo.gpus[0].pcie_switch == case.pcie_switch_of_gpu0

    assert {n.name: n.rail for n in topo.nics} == dict(case.rails)
    assert {n.name for n in topo.nics if not n.usable} == case.down_nics
    compute = [n for n in topo.nics if n.rail >= 0]
    assert {n.link_layer for n in compute} == {case.link_layer}
    assert {n.rate_gbps for n in compute} == {400}
    for rail_nic in compute:  # a rail NIC shares its NUMA node with its closest GPU
        closest = min(topo.gpus, key=lambda g: (topo.distance(g.index, rail_nic.name), g.index))
        assert rail_nic.numa_node == closest.numa_node
    for (gpu, nic_name), distance in case.distances.items():
        assert topo.distance(gpu, nic_name) == distance, (gpu, nic_name)
    assert len(topo.links) == len(topo.gpus) * len(topo.nics)  # every pair related

    assert {k: getattr(topo, k) for k in case.location} == dict(case.location)
    assert topo.nvlink_domain == case.nvlink_domain
    assert topo.sources == case.sources
    assert topo.labels == load(case.machine, "labels.json")


@pytest.mark.parametrize("machine", ["hgx-h100", "l40s-pcie"])
def test_sysfs_distances_agree_with_nvidia_smi(machine: str, sys_roots: dict[str, Path]) -> None:
    """The PCIe classification from sysfs paths reproduces the matrix
    nvidia-smi printed for the same machine (written independently)."""
    from_sysfs = discover(config_for(machine, sys_roots, sources=frozenset({"nvml", "sysfs"})))
    from_smi = discover(config_for(machine, sys_roots, sources=frozenset({"nvidia-smi"})))
    smi = {(l.gpu, l.nic): l.distance for l in from_smi.links}
    assert from_sysfs.links and all(smi[(l.gpu, l.nic)] == l.distance for l in from_sysfs.links)


def test_captured_h200_vm_discovers_its_one_gpu(sys_roots: dict[str, Path]) -> None:
    """``h200-vm`` is not built from a published layout: it was captured on a
    real single-H200 cloud VM (driver 580.159.04) by scripts/gpu_node_check.sh
    (README of the fixture dir). What a VM really answers: NVLink
    NOT_SUPPORTED, sysfs ``numa_node`` -1 (NVML's memory affinity says 0),
    no RDMA NICs, and ``nvidia-smi topo -m`` with ANSI underline codes in its
    header row."""
    topo = discover(config_for("h200-vm", sys_roots))
    recorded = load("h200-vm", "nvml.json")["devices"][0]
    (gpu,) = topo.gpus
    assert (gpu.index, gpu.model, gpu.uuid) == (0, "NVIDIA H200", recorded["uuid"])
    assert gpu.memory_mib == recorded["memory_total"] // (1 << 20) == 143771
    assert gpu.pci_bus_id == "0000:00:06.0"  # NVML's 8-digit domain normalised to sysfs's
    assert gpu.numa_node == 0 and gpu.nvlink_island == 0 and gpu.nvlink_peers == ()
    assert topo.nics == () and topo.links == ()
    assert topo.sources == ("nvml", "sysfs", "nvidia-smi")
    # nvidia-smi alone still finds the GPU and its NUMA node through the escapes.
    smi = discover(config_for("h200-vm", sys_roots, sources=frozenset({"nvidia-smi"})))
    assert [(g.index, g.numa_node) for g in smi.gpus] == [(0, 0)]
    assert "\x1b[4m" in load("h200-vm", "nvidia-smi-topo.txt")  # the escapes are really there


def test_discovered_topology_survives_the_wire(sys_roots: dict[str, Path]) -> None:
    for machine in MACHINES:
        topo = discover(config_for(machine, sys_roots))
        assert topology_from_pb(topology_to_pb(topo)) == topo
        assert NodeTopology.from_dict(json.loads(json.dumps(topo.to_dict()))) == topo


# --- GB200 NVL72: 18 trays, one NVLink domain ------------------------------------------


def tray_recording(tray: int, *, clique: int | None = None) -> dict[str, Any]:
    """The recorded tray, as tray ``tray`` of the rack answers: same layout and
    fabric, its own GPU UUIDs (and optionally another clique)."""
    rec = copy.deepcopy(load("gb200-nvl72", "nvml.json"))
    for k, dev in enumerate(rec["devices"]):
        dev["uuid"] = f"GPU-00000000-0000-4000-8000-{tray:06d}{k:06d}"
        if clique is not None:
            dev["fabric"]["clique_id"] = clique
    return rec


def test_gb200_nvl72_rack_is_one_nvlink_domain(sys_roots: dict[str, Path]) -> None:
    rack = load("gb200-nvl72", "rack.json")
    nodes = [
        discover(config_for("gb200-nvl72", sys_roots, node=name, az="az-a", nvml=ReplayNvml(tray_recording(t))))
        for t, name in enumerate(rack["trays"])
    ]
    assert len(nodes) == 18
    assert sum(len(n.gpus) for n in nodes) == 72
    assert {len(n.gpus) for n in nodes} == {4}
    assert {n.nvlink_domain for n in nodes} == {f"{rack['cluster_uuid']}.{rack['clique_id']}"}
    assert len({n.domain(Level.NVLINK_DOMAIN) for n in nodes}) == 1
    assert len({g.uuid for n in nodes for g in n.gpus}) == 72

    other_rack = discover(config_for("gb200-nvl72", sys_roots, node="r02-t01", az="az-a", nvml=ReplayNvml(tray_recording(0, clique=7))))
    assert other_rack.domain(Level.NVLINK_DOMAIN) != nodes[0].domain(Level.NVLINK_DOMAIN)


# --- no GPU: empty inventory, one log line, never a crash -----------------------------


def topology_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "agent.topology"]


def test_gpu_without_driver_reports_no_gpus_and_one_log_line(sys_roots: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.topology")
    topo = discover(config_for("no-driver", sys_roots))

    assert topo.gpus == () and topo.links == ()
    assert [n.name for n in topo.nics] == ["mlx5_0"]  # the NIC is still reported
    assert topo.nics[0].numa_node == -1 and topo.nics[0].rail == -1
    (record,) = topology_records(caplog)
    assert record.levelno == logging.WARNING
    assert "no GPUs" in record.getMessage() and "Driver Not Loaded" in record.getMessage()


def test_missing_nvml_library_and_empty_sysfs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.topology")
    recording = {"format": "phalanx-nvml-recording/1", "init_error": "LIBRARY_NOT_FOUND", "devices": []}
    topo = discover(DiscoveryConfig(node="cpu-1", az="a", sysfs_root=tmp_path, nvml=ReplayNvml(recording)))

    assert (topo.gpus, topo.nics, topo.links) == ((), (), ())
    assert topo.az == "a" and topo.sources == ("static",)
    (record,) = topology_records(caplog)
    assert "NVML Shared Library Not Found" in record.getMessage()


def test_real_discovery_on_this_machine_does_not_crash(caplog: pytest.LogCaptureFixture) -> None:
    """Real pynvml, real /sys: on a machine without GPUs this is the
    empty-inventory path; on one with GPUs it must still just work."""
    caplog.set_level(logging.INFO, logger="agent.topology")
    topo = discover(DiscoveryConfig(node="this-machine"))
    assert isinstance(topo, NodeTopology) and topo.node == "this-machine"
    assert len(topology_records(caplog)) == 1
    if not topo.gpus:
        assert "no GPUs" in topology_records(caplog)[0].getMessage()


def test_a_broken_source_is_reported_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.topology")
    topo = discover(DiscoveryConfig(node="n", sysfs_root=tmp_path, nvml=object()))
    assert topo.gpus == ()
    (record,) = topology_records(caplog)
    assert "nvml: failed" in record.getMessage()


def test_disabled_sources_are_not_consulted(sys_roots: dict[str, Path]) -> None:
    topo = discover(config_for("hgx-h100", sys_roots, sources=frozenset({"sysfs", "static"}), az="z"))
    assert topo.gpus == ()  # sysfs alone never defines GPUs
    assert len(topo.nics) == 9 and topo.az == "z" and topo.spine == ""
    assert topo.sources == ("sysfs", "static")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"node": " "}, "node name"),
        ({"node": "n", "sources": frozenset({"nvml", "dcgm"})}, "unknown sources ['dcgm']"),
        ({"node": "n", "nic_rails": {"mlx5_0": -2}}, "nic_rails"),
    ],
    ids=["empty-node", "unknown-source", "negative-rail"],
)
def test_config_is_validated_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        DiscoveryConfig(**kwargs)


# --- merge precedence (pure) ----------------------------------------------------------


def nvml(*gpus: GpuFacts, domain: str = "") -> PartialTopology:
    return PartialTopology("nvml", gpus=gpus, location={"nvlink_domain": domain} if domain else {}, defines_gpus=True)


def smi(gpus: tuple[GpuFacts, ...] = (), nics: tuple[str, ...] = (), links: tuple[LinkFacts, ...] = ()) -> PartialTopology:
    return PartialTopology("nvidia-smi", gpus=gpus, nics=tuple(NicFacts(n) for n in nics), links=links, defines_gpus=True)


def sysfs(gpus: tuple[GpuFacts, ...] = (), nics: tuple[NicFacts, ...] = (), links: tuple[LinkFacts, ...] = ()) -> PartialTopology:
    return PartialTopology("sysfs", gpus=gpus, nics=nics, links=links)


def test_nvml_beats_nvidia_smi_and_fills_from_lower_sources_only_when_unknown() -> None:
    topo = merge(
        "n",
        [
            smi(gpus=(GpuFacts(index=0, numa_node=0), GpuFacts(index=1, numa_node=0))),
            sysfs(gpus=(GpuFacts(pci_bus_id="0000:18:00.0", numa_node=1, pcie_switch="0000:16:00.0"),)),
            nvml(GpuFacts(index=0, pci_bus_id="0000:18:00.0", model="H100", numa_node=None), GpuFacts(index=1, pci_bus_id="0000:2a:00.0", numa_node=1)),
        ],
    )
    g0, g1 = topo.gpus
    assert (g0.model, g0.numa_node, g0.pcie_switch) == ("H100", 1, "0000:16:00.0")  # sysfs fills NVML's gap
    assert g1.numa_node == 1  # NVML's value beats nvidia-smi's 0
    assert topo.sources == ("nvml", "sysfs", "nvidia-smi")


def test_highest_source_that_reports_gpus_defines_the_inventory() -> None:
    seven = tuple(GpuFacts(index=i, pci_bus_id=f"0000:{0x18 + i:02x}:00.0") for i in range(7))
    eight = tuple(GpuFacts(index=i) for i in range(8))
    assert len(merge("n", [nvml(*seven), smi(gpus=eight)]).gpus) == 7  # a GPU fell off the bus
    assert len(merge("n", [nvml(), smi(gpus=eight)]).gpus) == 8  # NVML failed: fallback
    assert merge("n", [sysfs(gpus=(GpuFacts(pci_bus_id="0000:18:00.0"),))]).gpus == ()


def test_nvidia_smi_gpus_adopt_sysfs_addresses_in_bus_order_only_when_counts_match() -> None:
    functions = (GpuFacts(pci_bus_id="0000:9a:00.0", numa_node=1), GpuFacts(pci_bus_id="0000:18:00.0", numa_node=0))
    link = LinkFacts(nic="mlx5_0", distance=PIX, gpu_pci_bus_id="0000:9a:00.0")
    topo = merge("n", [smi(gpus=(GpuFacts(index=0), GpuFacts(index=1))), sysfs(gpus=functions, nics=(NicFacts("mlx5_0"),), links=(link,))])
    assert [(g.pci_bus_id, g.numa_node) for g in topo.gpus] == [("0000:18:00.0", 0), ("0000:9a:00.0", 1)]
    assert topo.distance(1, "mlx5_0") == PIX

    mismatch = merge("n", [smi(gpus=(GpuFacts(index=0),)), sysfs(gpus=functions)])
    assert [(g.pci_bus_id, g.numa_node) for g in mismatch.gpus] == [("", -1)]


def test_sysfs_distance_beats_nvidia_smi_which_fills_missing_pairs() -> None:
    gpus = (GpuFacts(index=0, pci_bus_id="0000:18:00.0"),)
    topo = merge(
        "n",
        [
            nvml(*gpus),
            sysfs(nics=(NicFacts("mlx5_0"), NicFacts("mlx5_1")), links=(LinkFacts("mlx5_0", NODE, gpu_pci_bus_id="0000:18:00.0"),)),
            smi(nics=("mlx5_0", "mlx5_1"), links=(LinkFacts("mlx5_0", SYS, gpu_index=0), LinkFacts("mlx5_1", PIX, gpu_index=0))),
        ],
    )
    assert [(l.nic, l.distance) for l in topo.links] == [("mlx5_0", NODE), ("mlx5_1", PIX)]


def test_nic_inventory_comes_from_the_first_source_that_lists_nics() -> None:
    """nvidia-smi lists SR-IOV VFs too; sysfs (which skips them) decides."""
    topo = merge(
        "n",
        [sysfs(nics=(NicFacts("mlx5_0", state="ACTIVE", rate_gbps=400),)), smi(nics=("mlx5_0", "mlx5_4"))],
    )
    assert [(n.name, n.state, n.rate_gbps) for n in topo.nics] == [("mlx5_0", "ACTIVE", 400)]
    only_smi = merge("n", [smi(nics=("mlx5_10", "mlx5_2"))])
    assert [(n.name, n.state) for n in only_smi.nics] == [("mlx5_2", "UNKNOWN"), ("mlx5_10", "UNKNOWN")]


@pytest.mark.parametrize(
    "partials, expected",
    [
        (
            [PartialTopology("labels", location={"az": "label-az", "leaf": "label-leaf"}), PartialTopology("static", location={"az": "cfg-az"})],
            {"az": "cfg-az", "leaf": "label-leaf"},
        ),
        (
            [nvml(domain="uuid.1"), PartialTopology("static", location={"nvlink_domain": "cfg"}), PartialTopology("labels", location={"nvlink_domain": "lbl"})],
            {"nvlink_domain": "uuid.1"},
        ),
        (
            [nvml(), PartialTopology("labels", location={"nvlink_domain": "lbl"})],
            {"nvlink_domain": "lbl"},
        ),
    ],
    ids=["static-beats-labels", "nvml-domain-beats-config", "labels-fill-missing-domain"],
)
def test_location_precedence(partials: list[PartialTopology], expected: dict[str, str]) -> None:
    topo = merge("n", partials)
    assert {k: getattr(topo, k) for k in expected} == expected


def test_explicit_rails_and_non_rail_fabrics() -> None:
    gpus = tuple(GpuFacts(index=i, pci_bus_id=f"0000:{0x18 + i:02x}:00.0") for i in range(2))
    links = (LinkFacts("mlx5_0", PIX, gpu_index=0), LinkFacts("mlx5_1", PIX, gpu_index=1))
    parts = [nvml(*gpus), smi(nics=("mlx5_0", "mlx5_1"), links=links)]
    assert [n.rail for n in merge("n", parts).nics] == [0, 1]
    assert [n.rail for n in merge("n", parts, rail_optimised=False).nics] == [-1, -1]
    assert [n.rail for n in merge("n", parts, nic_rails={"mlx5_1": 0}).nics] == [-1, 0]


def test_islands_are_components_numbered_by_lowest_gpu() -> None:
    """Peers reported one way still join both GPUs; unknown peers are none."""
    gpus = (
        GpuFacts(index=0, nvlink_peers=()),
        GpuFacts(index=1, nvlink_peers=(3,)),
        GpuFacts(index=2, nvlink_peers=None),
        GpuFacts(index=3, nvlink_peers=(9,)),  # a peer that is not on this node
    )
    topo = merge("n", [nvml(*gpus)])
    assert [(g.nvlink_island, g.nvlink_peers) for g in topo.gpus] == [(0, ()), (1, (3,)), (2, ()), (1, (1,))]


# --- NVML edge cases, recorded as data -------------------------------------------------


def device(index: int, links: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    dev: dict[str, Any] = {
        "name": "NVIDIA A40",
        "uuid": f"GPU-{index}",
        "memory_total": 48 * 1024**3,
        "pci_bus_id": f"00000000:{0x20 + index:02X}:00.0",
        "memory_affinity_nodes": {"error": "NOT_SUPPORTED"},
        "nvlinks": links,
        "nvlink_error": "INVALID_ARGUMENT",
        "fabric": {"error": "NOT_SUPPORTED"},
    }
    dev.update(extra)
    return dev


def recording(*devices: dict[str, Any]) -> dict[str, Any]:
    return {"format": "phalanx-nvml-recording/1", "devices": list(devices)}


def bridge(to: int, link: int, remote_type: int | None = 0) -> dict[str, Any]:
    entry: dict[str, Any] = {"link": link, "state": 1, "remote_pci_bus_id": f"00000000:{0x20 + to:02X}:00.0"}
    if remote_type is not None:
        entry["remote_type"] = remote_type
    return entry


def read(rec: dict[str, Any]) -> PartialTopology:
    return NvmlSource(ReplayNvml(rec)).discover()


def test_nvlink_bridge_pairs_are_islands_of_two() -> None:
    """Four A40s with NVLink bridges 0-1 and 2-3 (4 links each)."""
    pairs = {0: 1, 1: 0, 2: 3, 3: 2}
    rec = recording(*(device(i, [bridge(pairs[i], k) for k in range(4)]) for i in range(4)))
    topo = merge("n", [read(rec)])
    assert [(g.nvlink_island, g.nvlink_peers) for g in topo.gpus] == [(0, (1,)), (0, (0,)), (1, (3,)), (1, (2,))]


def test_old_driver_without_remote_type_classifies_by_remote_address() -> None:
    """No nvmlDeviceGetNvLinkRemoteDeviceType: a remote that is a local GPU is
    a bridge; any other address is an NVSwitch."""
    rec = recording(
        device(0, [bridge(1, 0, remote_type=None)]),
        device(1, [bridge(0, 0, remote_type=None), {"link": 1, "state": 1, "remote_pci_bus_id": "00000008:00:00.0"}]),
        device(2, [{"link": 0, "state": 1, "remote_pci_bus_id": "00000008:00:00.0"}, {"link": 1, "state": 0}]),
        device(3, [], nvlink_error="NOT_SUPPORTED"),
    )
    assert [g.nvlink_peers for g in read(rec).gpus] == [(1,), (0, 2), (1,), ()]


@pytest.mark.parametrize(
    "fabric, expected",
    [
        ({"cluster_uuid": "ab" * 16, "clique_id": 5, "state": 3, "status": 0}, "abababab-abab-abab-abab-abababababab.5"),
        ({"cluster_uuid": "ab" * 16, "clique_id": 5, "state": 2, "status": 0}, ""),  # registration in progress
        ({"cluster_uuid": "ab" * 16, "clique_id": 5, "state": 3, "status": 999}, ""),  # probe failed
        ({"cluster_uuid": "00" * 16, "clique_id": 0, "state": 3, "status": 0}, ""),  # no multi-node fabric
        ({"error": "NOT_SUPPORTED"}, ""),
    ],
    ids=["completed", "in-progress", "probe-error", "zero-cluster", "not-supported"],
)
def test_fabric_clique_becomes_the_nvlink_domain_only_when_registered(fabric: dict[str, Any], expected: str) -> None:
    assert read(recording(device(0, [], fabric=fabric))).location.get("nvlink_domain", "") == expected


def test_gpus_in_different_cliques_are_reported() -> None:
    fab = lambda clique: {"cluster_uuid": "cd" * 16, "clique_id": clique, "state": 3, "status": 0}  # noqa: E731
    part = read(recording(device(0, [], fabric=fab(1)), device(1, [], fabric=fab(2))))
    assert part.location["nvlink_domain"].endswith(".1")
    assert any("different NVLink cliques" in p for p in part.problems)


def test_legacy_fabric_call_is_used_when_the_versioned_one_is_missing() -> None:
    class OldDriver(ReplayNvml):
        def nvmlDeviceGetGpuFabricInfoV(self, handle: Any, info: Any) -> int:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    fabric = {"cluster_uuid": "ef" * 16, "clique_id": 3, "state": 3, "status": 0}
    part = NvmlSource(OldDriver(recording(device(0, [], fabric=fabric)))).discover()
    assert part.location["nvlink_domain"].endswith(".3")


def test_numa_from_memory_affinity_takes_the_lowest_node() -> None:
    grace = device(0, [], memory_affinity_nodes=[1, *range(19, 26)])
    unknown = device(1, [])
    assert [g.numa_node for g in read(recording(grace, unknown)).gpus] == [1, None]


def test_a_scan_failure_reports_no_gpus_rather_than_half_an_inventory() -> None:
    broken = device(1, [], pci_bus_id={"error": "GPU_IS_LOST"})
    part = read(recording(device(0, []), broken))
    assert part.gpus == ()
    assert part.problems and "GPU is lost" in part.problems[0]


def test_replay_raises_pynvml_exception_classes() -> None:
    nv = ReplayNvml(recording(device(0, [], nvlink_error="NOT_SUPPORTED")))
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetNvLinkState(handle, 0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(ValueError, match="format"):
        ReplayNvml({"format": "something-else"})
