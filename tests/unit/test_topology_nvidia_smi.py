"""``nvidia-smi topo -m`` parsing: the recorded texts and the format variants
seen in the wild."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.topology import merge
from agent.topology.nvidia_smi import capture_topo_matrix, parse_topo_matrix
from phalanx.model import PcieDistance

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "topology"
PIX, PXB, PHB, NODE, SYS = (PcieDistance.PIX, PcieDistance.PXB, PcieDistance.PHB, PcieDistance.NODE, PcieDistance.SYS)


@pytest.mark.parametrize(
    "machine, gpus, nics, numa, islands, rails, distances",
    [
        (
            "dgx-h100",
            8,
            [f"mlx5_{j}" for j in range(12)],
            [0, 0, 0, 0, 1, 1, 1, 1],
            [0] * 8,
            # compute ports mlx5_0,3,4,5,6,9,10,11 pair with GPUs 0..7; the
            # dual-port storage NICs (1/2, 7/8) get no rail
            {"mlx5_0": 0, "mlx5_3": 1, "mlx5_4": 2, "mlx5_5": 3, "mlx5_6": 4, "mlx5_9": 5, "mlx5_10": 6, "mlx5_11": 7,
             "mlx5_1": -1, "mlx5_2": -1, "mlx5_7": -1, "mlx5_8": -1},
            {(1, "mlx5_3"): PXB, (0, "mlx5_1"): NODE, (0, "mlx5_6"): SYS, (7, "mlx5_11"): PXB},
        ),
        (
            "hgx-h100",
            8,
            [f"mlx5_{j}" for j in range(9)],
            [0, 0, 0, 0, 1, 1, 1, 1],
            [0] * 8,
            {**{f"mlx5_{k}": k for k in range(8)}, "mlx5_8": -1},
            {(0, "mlx5_0"): PIX, (1, "mlx5_8"): PHB, (5, "mlx5_0"): SYS},
        ),
        (
            "l40s-pcie",
            8,
            [f"mlx5_{j}" for j in range(5)],  # nvidia-smi cannot tell the VF mlx5_4 apart
            [0, 0, 0, 0, 1, 1, 1, 1],
            list(range(8)),
            {"mlx5_0": 0, "mlx5_4": 1, "mlx5_1": 2, "mlx5_2": 3, "mlx5_3": 4},
            {(0, "mlx5_0"): PIX, (1, "mlx5_4"): PIX, (0, "mlx5_1"): NODE, (7, "mlx5_0"): SYS},
        ),
        (
            "gb200-nvl72",
            4,
            [f"mlx5_{j}" for j in range(6)],
            [0, 0, 1, 1],  # first node of "0,3-9,11-17"
            [0] * 4,
            {f"mlx5_{j}": -1 for j in range(6)},  # all SYS: no NUMA-local NIC to pair
            {(0, "mlx5_0"): SYS, (3, "mlx5_3"): SYS},
        ),
    ],
    ids=["dgx-h100", "hgx-h100", "l40s-pcie", "gb200-nvl72"],
)
def test_recorded_matrix(machine: str, gpus: int, nics: list[str], numa: list[int], islands: list[int], rails: dict[str, int], distances: dict) -> None:
    part = parse_topo_matrix((FIXTURES / machine / "nvidia-smi-topo.txt").read_text())
    assert part.problems == () and part.defines_gpus
    topo = merge(machine, [part])
    assert topo.gpu_indices == tuple(range(gpus))
    assert [n.name for n in topo.nics] == nics
    assert [g.numa_node for g in topo.gpus] == numa
    assert [g.nvlink_island for g in topo.gpus] == islands
    assert {n.name: n.rail for n in topo.nics} == rails
    for (gpu, nic), d in distances.items():
        assert topo.distance(gpu, nic) == d
    assert len(topo.links) == gpus * len(nics)


LEGACY = """\
\tGPU0\tGPU1\tGPU2\tmlx5_0\tmlx5_1\tCPU Affinity
GPU0\t X \tNV2\tSOC\tPIX\tSOC\t0-11,24-35
GPU1\tNV2\t X \tSOC\tPIX\tSOC\t0-11,24-35
GPU2\tSOC\tSOC\t X \tSOC\tPIX\t12-23,36-47
mlx5_0\tPIX\tPIX\tSOC\t X \tSOC\t
mlx5_1\tSOC\tSOC\tPIX\tSOC\t X \t

Legend:

  X   = Self
  SOC  = Connection traversing PCIe as well as the SMP link between CPU sockets(e.g. QPI)
"""


def test_legacy_format_names_nic_columns_by_device_and_says_soc() -> None:
    """Pre-R470 drivers: no NIC legend, no NUMA column, SOC for SYS."""
    topo = merge("old", [parse_topo_matrix(LEGACY)])
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1"]
    assert [(g.nvlink_island, g.numa_node) for g in topo.gpus] == [(0, -1), (0, -1), (1, -1)]
    assert topo.distance(2, "mlx5_0") == SYS and topo.distance(2, "mlx5_1") == PIX


def test_space_aligned_copy_with_ansi_header_and_preamble() -> None:
    """Copied from a terminal: tabs expanded (``mlx5_10 mlx5_11`` one space
    apart), the header underlined with ANSI codes, a NIC-count note first."""
    text = (
        "14 NICs found in the topology, only displaying 12 in the matrix.\n"
        "        \x1b[4mGPU0    GPU1    mlx5_10 mlx5_11 CPU Affinity    NUMA Affinity   GPU NUMA ID\x1b[0m\n"
        "GPU0     X      NV12    PXB     SYS     0-47    0               N/A\n"
        "GPU1    NV12     X      SYS     PXB     48-95   N/A             N/A\n"
        "mlx5_10 PXB     SYS      X      SYS\n"
        "\n"
    )
    part = parse_topo_matrix(text)
    topo = merge("copied", [part])
    assert [n.name for n in topo.nics] == ["mlx5_10", "mlx5_11"]
    assert [(g.numa_node, g.nvlink_peers) for g in topo.gpus] == [(0, (1,)), (-1, (0,))]
    assert topo.distance(1, "mlx5_11") == PXB


def test_header_without_indent_and_single_gpu() -> None:
    text = "GPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-63\t0\t\tN/A\n"
    topo = merge("one", [parse_topo_matrix(text)])
    assert [(g.index, g.numa_node, g.nvlink_peers) for g in topo.gpus] == [(0, 0, ())]


@pytest.mark.parametrize(
    "text", ["", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"], ids=["empty", "driver-error"]
)
def test_text_without_a_matrix_yields_nothing(text: str) -> None:
    part = parse_topo_matrix(text)
    assert part.gpus == () and part.nics == ()
    assert part.problems == ("nvidia-smi: no topology matrix header found",)


def test_unknown_cells_are_ignored_not_guessed() -> None:
    text = "\tGPU0\tNIC0\n" "GPU0\t X \tC2C\n" "\nNIC Legend:\n\n  NIC0: mlx5_0\n"
    part = parse_topo_matrix(text)
    assert part.links == () and [n.name for n in part.nics] == ["mlx5_0"]


def test_capture_returns_none_without_the_tool() -> None:
    assert capture_topo_matrix("nvidia-smi-not-installed-here") is None
