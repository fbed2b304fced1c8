"""What every discovery source returns, and the interface a source implements.

A source reports *facts* it observed, each field ``None``/``""`` when it does not
know it. ``discover.merge`` combines the facts of all sources into one
``phalanx.topology.NodeTopology``; keeping "unknown" distinct from a default
value (``numa_node=-1``, ``nvlink_island=0``) is what lets a lower-precedence
source fill a gap without overriding a higher one.

Nothing here does I/O; no grpc, asyncio or time (docs/design.md §3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Protocol, runtime_checkable

from phalanx.model import PcieDistance

# Source names, highest precedence first (docs/topology.md, "Precedence").
NVML = "nvml"
SYSFS = "sysfs"
NVIDIA_SMI = "nvidia-smi"
STATIC = "static"
LABELS = "labels"
SOURCE_ORDER: tuple[str, ...] = (NVML, SYSFS, NVIDIA_SMI, STATIC, LABELS)

# Location fields a source may report; the names of ``NodeTopology`` fields.
LOCATION_FIELDS: tuple[str, ...] = ("region", "az", "spine", "leaf", "rack", "nvlink_domain")


@dataclass(frozen=True)
class GpuFacts:
    """One GPU as one source saw it.

    ``index`` is the NVML/CUDA index when the source knows it (NVML,
    nvidia-smi); sysfs knows only the PCI address and leaves it ``None``.
    """

    index: int | None = None
    pci_bus_id: str = ""  # normalised by ``normalise_bus_id``
    uuid: str = ""
    model: str = ""
    memory_mib: int = 0
    numa_node: int | None = None
    nvlink_peers: tuple[int, ...] | None = None  # by index; None = source cannot tell
    pcie_switch: str = ""


@dataclass(frozen=True)
class NicFacts:
    name: str
    pci_bus_id: str = ""
    numa_node: int | None = None
    rate_gbps: int | None = None
    link_layer: str = ""
    state: str = ""
    pcie_switch: str = ""


@dataclass(frozen=True)
class LinkFacts:
    """GPU↔NIC PCIe relation. The GPU is named by index (nvidia-smi) or by PCI
    address (sysfs, which does not know NVML indices); ``merge`` resolves it."""

    nic: str
    distance: PcieDistance
    gpu_index: int | None = None
    gpu_pci_bus_id: str = ""


@dataclass(frozen=True)
class PartialTopology:
    """Everything one source found. ``defines_gpus``: this source is allowed
    to say which GPUs exist (NVML, nvidia-smi). sysfs is not: an NVIDIA PCI
    function without a working driver is not a GPU anyone can use."""

    source: str
    gpus: tuple[GpuFacts, ...] = ()
    nics: tuple[NicFacts, ...] = ()
    links: tuple[LinkFacts, ...] = ()
    location: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    defines_gpus: bool = False
    # Why the source saw less than it might have (driver missing, file
    # unreadable); reported in discovery's one summary log line.
    problems: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.gpus or self.nics or self.links or self.location or self.labels)


@runtime_checkable
class TopologySource(Protocol):
    """One place topology facts come from. ``discover`` must not raise for
    missing hardware or files; it reports them in ``problems``."""

    name: str

    def discover(self) -> PartialTopology: ...


_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def normalise_bus_id(text: str) -> str:
    """``00000000:1B:00.0`` (NVML) and ``0000:1b:00.0`` (sysfs) name the same
    function; compare them in the sysfs form. Unparseable input is returned
    lower-cased and stripped, so it can still be compared for equality."""
    text = text.strip()
    m = _BUS_ID.match(text)
    if not m:
        return text.lower()
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[object, ...]:
    """``mlx5_2`` before ``mlx5_10``; ``re.split`` with a group alternates
    text and digits, so the tuples always compare position by position."""
    return tuple(int(part) if i % 2 else part.lower() for i, part in enumerate(_DIGITS.split(name)))
