"""Parse ``nvidia-smi topo -m``: the fallback source when NVML or sysfs cannot
be read (containers without ``/sys`` of the host, a captured text from an
operator).

Formats accepted (all seen in the wild):

- current drivers: device columns ``GPU0…``, ``NIC0…``, then ``CPU Affinity``,
  ``NUMA Affinity`` and (R530+) ``GPU NUMA ID``; a ``NIC Legend`` maps
  ``NIC0: mlx5_0``;
- older drivers: NIC columns named after the device (``mlx5_0``), no legend;
- tab-separated (as printed) or space-aligned (copied from a terminal, where
  ``mlx5_10\\tmlx5_11`` can collapse to a single space), with or without the
  ANSI underline codes nvidia-smi puts on the header.

Cells: ``X`` (self), ``NV#`` (# bonded NVLinks), ``PIX PXB PHB NODE SYS``
(``SOC`` is SYS on old drivers). Unknown cells are ignored, never guessed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Sequence

from phalanx.model import PcieDistance

from agent.topology.base import NVIDIA_SMI, GpuFacts, LinkFacts, NicFacts, PartialTopology

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_AFFINITY_HEADERS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_GPU = re.compile(r"^GPU(\d+)$")
_NIC_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_NVLINK = re.compile(r"^NV(\d+)$")
_DISTANCE = {
    "PIX": PcieDistance.PIX,
    "PXB": PcieDistance.PXB,
    "PHB": PcieDistance.PHB,
    "NODE": PcieDistance.NODE,
    "SYS": PcieDistance.SYS,
    "SOC": PcieDistance.SYS,
}


class NvidiaSmiSource:
    """``TopologySource`` over captured ``nvidia-smi topo -m`` text."""

    name = NVIDIA_SMI

    def __init__(self, text: str | None) -> None:
        self.text = text

    def discover(self) -> PartialTopology:
        if not self.text:
            return PartialTopology(NVIDIA_SMI, defines_gpus=True)
        return parse_topo_matrix(self.text)


def parse_topo_matrix(text: str) -> PartialTopology:
    """GPUs (index, NUMA affinity, NVLink peers), NICs (names) and GPU↔NIC
    distances from one ``nvidia-smi topo -m`` output."""
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header_at = next((i for i, line in enumerate(lines) if _is_header(line)), None)
    if header_at is None:
        return PartialTopology(NVIDIA_SMI, defines_gpus=True, problems=("nvidia-smi: no topology matrix header found",))
    columns, affinity_columns = _split_header(lines[header_at])
    legend = _nic_legend(lines)

    def nic_name(column: str) -> str:
        return legend.get(column, column)

    gpus: dict[int, GpuFacts] = {}
    links: list[LinkFacts] = []
    nics: list[str] = [nic_name(c) for c in columns if not _GPU.match(c)]
    for line in lines[header_at + 1 :]:
        if not line.strip():
            break  # the matrix ends at the first blank line, before "Legend:"
        cells = line.split()
        m = _GPU.match(cells[0])
        if not m:
            continue  # NIC rows repeat what the GPU rows say
        index = int(m.group(1))
        relations = cells[1 : 1 + len(columns)]
        extras = cells[1 + len(columns) :]
        peers: list[int] = []
        for column, cell in zip(columns, relations):
            gm = _GPU.match(column)
            if gm:
                if _NVLINK.match(cell) and int(gm.group(1)) != index:
                    peers.append(int(gm.group(1)))
                continue
            distance = _DISTANCE.get(cell.upper())
            if distance is not None:
                links.append(LinkFacts(nic=nic_name(column), distance=distance, gpu_index=index))
        numa = None
        if "NUMA Affinity" in affinity_columns:
            at = affinity_columns.index("NUMA Affinity")
            numa = _first_int(extras[at]) if at < len(extras) else None
        gpus[index] = GpuFacts(index=index, numa_node=numa, nvlink_peers=tuple(sorted(peers)))
    return PartialTopology(
        NVIDIA_SMI,
        gpus=tuple(gpus[i] for i in sorted(gpus)),
        nics=tuple(NicFacts(name=n) for n in nics),
        links=tuple(links),
        defines_gpus=True,
    )


def _is_header(line: str) -> bool:
    """The header names GPU0 as a column; the GPU0 *row* has ``X`` right
    after its name (nvidia-smi indents the header, but copies may not)."""
    tokens = line.split()
    if "GPU0" not in tokens:
        return False
    return line[:1].isspace() or tokens[0] != "GPU0" or (len(tokens) > 1 and tokens[1] != "X")


def _split_header(line: str) -> tuple[list[str], list[str]]:
    """Device columns, then affinity columns, in order. The multi-word
    affinity headers are cut off first so the rest splits on any whitespace."""
    affinity: list[tuple[int, str]] = []
    for name in _AFFINITY_HEADERS:
        at = line.find(name)
        if at >= 0:
            affinity.append((at, name))
    affinity.sort()
    device_part = line[: affinity[0][0]] if affinity else line
    return device_part.split(), [name for _, name in affinity]


def _nic_legend(lines: Sequence[str]) -> dict[str, str]:
    legend: dict[str, str] = {}
    in_legend = False
    for line in lines:
        if line.strip().startswith("NIC Legend"):
            in_legend = True
            continue
        if in_legend:
            m = _NIC_LEGEND.match(line)
            if m:
                legend[m.group(1)] = m.group(2)
    return legend


def _first_int(cell: str) -> int | None:
    """``0`` / ``0-1`` / ``0,3-9,11-17`` -> the first node; ``N/A`` -> None."""
    m = re.match(r"^(\d+)", cell)
    return int(m.group(1)) if m else None


def capture_topo_matrix(executable: str = "nvidia-smi", timeout_s: float = 30.0) -> str | None:
    """Run ``nvidia-smi topo -m`` and return its output; None when the tool is
    absent or fails. For the agent's shell and the recorder: ``discover``
    itself never starts processes. The timeout keeps a wedged driver (which
    can hang nvidia-smi for minutes) from blocking agent start-up."""
    path = shutil.which(executable)
    if path is None:
        return None
    try:
        done = subprocess.run([path, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None
