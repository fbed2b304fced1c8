"""Recording and replay of machines, and the sysfs readers underneath."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.topology.base import normalise_bus_id, natural_key
from agent.topology.recording import ReplayNvml, main, record_nvml, record_sysfs, write_sysfs
from agent.topology.sysfs import SysfsSource, parse_port_state, parse_rate_gbps, pcie_distance, switch_of
from phalanx.model import PcieDistance

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "topology"
RECORDED = sorted(p.parent.name for p in FIXTURES.glob("*/nvml.json"))
PIX, PXB, PHB, NODE, SYS = (PcieDistance.PIX, PcieDistance.PXB, PcieDistance.PHB, PcieDistance.NODE, PcieDistance.SYS)


@pytest.mark.parametrize("machine", RECORDED)
def test_recording_a_replay_reproduces_the_nvml_recording(machine: str) -> None:
    """The recorder asks exactly what discovery asks, and the replay answers
    it the way the recording says — including recorded errors."""
    fixture = json.loads((FIXTURES / machine / "nvml.json").read_text())
    assert record_nvml(ReplayNvml(fixture), description=fixture["description"]) == fixture


@pytest.mark.parametrize("machine", RECORDED)
def test_a_written_sysfs_tree_records_back_to_its_description(machine: str, tmp_path: Path) -> None:
    fixture = json.loads((FIXTURES / machine / "sysfs.json").read_text())
    root = write_sysfs(fixture, tmp_path / "sys")
    assert record_sysfs(root, description=fixture["description"]) == fixture
    links = [p for p in root.rglob("*") if p.is_symlink()]
    assert links and all(not p.readlink().is_absolute() for p in links)  # as the kernel makes them: movable


def test_recording_this_machine_does_not_crash(tmp_path: Path) -> None:
    """The operator's recorder on a real host (here: no GPU, maybe no RDMA)."""
    assert main([str(tmp_path / "rec"), "--description", "test host"]) == 0
    nvml = json.loads((tmp_path / "rec" / "nvml.json").read_text())
    sysfs = json.loads((tmp_path / "rec" / "sysfs.json").read_text())
    assert nvml["format"] == "phalanx-nvml-recording/1" and sysfs["format"] == "phalanx-sysfs-recording/1"
    ReplayNvml(nvml)  # what was recorded can be replayed


def test_wrong_formats_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a sysfs recording"):
        write_sysfs({"format": "phalanx-nvml-recording/1"}, tmp_path)
    with pytest.raises(ValueError, match="not an NVML recording"):
        ReplayNvml({"format": "phalanx-sysfs-recording/1"})


# --- sysfs readers ---------------------------------------------------------------------

H = "pci0000:15"


@pytest.mark.parametrize(
    "a, b, numa, expected",
    [
        ((H, "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0"), (H, "0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:19:00.0"), (0, 0), PIX),
        ((H, "0000:15:01.0", "0000:18:00.0"), (H, "0000:15:01.0", "0000:18:00.1"), (0, 0), PIX),  # two functions, one port
        (
            (H, "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0", "0000:19:00.0", "0000:1a:00.0"),
            (H, "0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:1b:00.0", "0000:1c:00.0", "0000:1d:00.0"),
            (0, 0),
            PXB,  # two switches under a common one (DGX H100 GPU<->CX7)
        ),
        ((H, "0000:15:01.0", "0000:16:00.0"), (H, "0000:15:02.0", "0000:20:00.0"), (0, 0), PHB),
        ((H, "0000:15:01.0", "0000:16:00.0"), ("pci0000:37", "0000:37:01.0", "0000:38:00.0"), (0, 0), NODE),
        ((H, "0000:15:01.0", "0000:16:00.0"), ("pci0000:97", "0000:97:01.0", "0000:98:00.0"), (0, 1), SYS),
        ((H, "0000:15:01.0", "0000:16:00.0"), ("pci0000:97", "0000:97:01.0", "0000:98:00.0"), (-1, -1), NODE),
        ((H, "0000:15:01.0", "0000:16:00.0"), ("pci0000:97", "0000:97:01.0", "0000:98:00.0"), (0, -1), SYS),
        ((), (H, "0000:15:01.0"), (0, 0), SYS),  # not on PCI: assume the worst
    ],
    ids=["same-switch", "same-port", "nested-switches", "two-root-ports", "two-host-bridges", "two-sockets",
         "numa-unknown-both", "numa-unknown-one", "no-path"],
)
def test_pcie_distance(a: tuple[str, ...], b: tuple[str, ...], numa: tuple[int, int], expected: PcieDistance) -> None:
    assert pcie_distance(a, b, *numa) == expected
    assert pcie_distance(b, a, numa[1], numa[0]) == expected


def test_switch_is_named_by_its_upstream_port() -> None:
    assert switch_of((H, "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0")) == "0000:16:00.0"
    assert switch_of((H, "0000:15:01.0", "0000:18:00.0")) == ""


@pytest.mark.parametrize(
    "text, gbps",
    [("400 Gb/sec (4X NDR)", 400), ("200 Gb/sec (2X NDR)", 200), ("2.5 Gb/sec (1X SDR)", 2), ("", None), ("junk", None)],
)
def test_rate(text: str, gbps: int | None) -> None:
    assert parse_rate_gbps(text) == gbps


@pytest.mark.parametrize("text, state", [("4: ACTIVE", "ACTIVE"), ("1: DOWN", "DOWN"), ("2: INIT", "INIT"), ("", "")])
def test_port_state(text: str, state: str) -> None:
    assert parse_port_state(text) == state


@pytest.mark.parametrize(
    "text, expected",
    [("00000000:1B:00.0", "0000:1b:00.0"), ("0000:1b:00.0", "0000:1b:00.0"), ("00000008:01:00.0", "0008:01:00.0"), ("1b:00.0", "0000:1b:00.0"), (" X ", "x")],
)
def test_bus_ids_compare_in_sysfs_form(text: str, expected: str) -> None:
    assert normalise_bus_id(text) == expected


def test_natural_order() -> None:
    assert sorted(["mlx5_10", "mlx5_2", "mlx5_bond_0", "mlx5_1"], key=natural_key) == ["mlx5_1", "mlx5_2", "mlx5_10", "mlx5_bond_0"]


def test_rdma_device_without_pci_or_ports_is_reported_with_unknowns(tmp_path: Path) -> None:
    """A soft-RoCE device (rxe0) has no PCI function; a half-initialised HCA
    has no ports yet. Both are listed, neither gets a distance or a rate."""
    write_sysfs({"format": "phalanx-sysfs-recording/1", "devices": [
        {"path": "pci0000:00/0000:00:01.0/0000:01:00.0", "vendor": "0x10de", "class": "0x030200", "numa_node": "0"},
        {"path": "pci0000:00/0000:00:02.0/0000:02:00.0", "numa_node": "0", "rdma": {"name": "mlx5_0", "ports": {}}},
    ]}, tmp_path)
    (tmp_path / "class" / "infiniband" / "rxe0" / "ports" / "1").mkdir(parents=True)
    (tmp_path / "class" / "infiniband" / "rxe0" / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    part = SysfsSource(tmp_path).discover()
    assert [(n.name, n.pci_bus_id, n.state, n.rate_gbps) for n in part.nics] == [("mlx5_0", "0000:02:00.0", "", None), ("rxe0", "", "ACTIVE", None)]
    assert [(l.nic, l.distance) for l in part.links] == [("mlx5_0", PHB)]
    assert [g.numa_node for g in part.gpus] == [0] and not part.defines_gpus


def test_missing_sysfs_is_a_problem_not_an_error(tmp_path: Path) -> None:
    part = SysfsSource(tmp_path / "nope").discover()
    assert part.empty and part.problems
