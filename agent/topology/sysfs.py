"""RDMA NICs, NUMA affinity and GPU↔NIC PCIe distance, from sysfs.

Reads, under a configurable root (``/sys`` in production, a recorded tree in
tests):

- ``class/infiniband/<dev>/ports/<n>/{state,rate,link_layer}``: every RDMA
  device (InfiniBand or RoCE). SR-IOV virtual functions (``device/physfn``
  exists) are skipped: they belong to whoever the VF is passed to.
- ``class/infiniband/<dev>/device``: the NIC's PCI function; its real path
  under ``devices/`` is its place in the PCIe tree.
- ``bus/pci/devices/<addr>/{vendor,class,numa_node}``: NVIDIA GPU functions
  and NUMA nodes.

The GPU↔NIC distance is derived from the two PCI paths the way
``nvidia-smi topo -m`` classifies it (``pcie_distance``). sysfs does not know
NVML indices, so GPU facts and links name GPUs by PCI address; ``merge``
joins them to NVML's GPUs. GPUs seen only here (no driver) are never
advertised: sysfs does not define the GPU inventory.

Every read tolerates a missing or unreadable file: the field is unknown.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

from phalanx.model import PcieDistance

from agent.topology.base import SYSFS, GpuFacts, LinkFacts, NicFacts, PartialTopology, natural_key

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA / 3D controller (NVSwitch bridges are 0x0680: excluded)


class SysfsSource:
    """``TopologySource`` over a sysfs tree rooted at ``root``."""

    name = SYSFS

    def __init__(self, root: str | Path = "/sys") -> None:
        self.root = Path(root)

    def discover(self) -> PartialTopology:
        problems: list[str] = []
        if not (self.root / "bus" / "pci" / "devices").is_dir():
            problems.append(f"sysfs: {self.root}/bus/pci/devices not readable")
        gpus = [PciFunction.read(self.root, addr) for addr in self._gpu_addresses()]
        nics = self._nics()
        links = [
            LinkFacts(nic=nic.name, distance=pcie_distance(g.path, nic.path, g.numa_node, nic.numa_node), gpu_pci_bus_id=g.address)
            for g in gpus
            if g.path
            for nic in nics
            if nic.path
        ]
        return PartialTopology(
            SYSFS,
            gpus=tuple(
                GpuFacts(pci_bus_id=g.address, numa_node=_known(g.numa_node), pcie_switch=g.pcie_switch) for g in gpus
            ),
            nics=tuple(
                NicFacts(
                    name=n.name,
                    pci_bus_id=n.address,
                    numa_node=_known(n.numa_node),
                    rate_gbps=n.rate_gbps,
                    link_layer=n.link_layer,
                    state=n.state,
                    pcie_switch=n.pcie_switch,
                )
                for n in nics
            ),
            links=tuple(links),
            problems=tuple(problems),
        )

    def _gpu_addresses(self) -> list[str]:
        pci = self.root / "bus" / "pci" / "devices"
        found = []
        for addr in _listdir(pci):
            if _read(pci / addr / "vendor") == NVIDIA_VENDOR and _read(pci / addr / "class").startswith(GPU_CLASSES):
                found.append(addr)
        return sorted(found)  # bus order: NVML's default enumeration order too

    def _nics(self) -> list["RdmaDevice"]:
        ib = self.root / "class" / "infiniband"
        out = []
        for name in sorted(_listdir(ib), key=natural_key):
            dev = RdmaDevice.read(self.root, name)
            if dev is not None:
                out.append(dev)
        return out


class PciFunction:
    """A PCI function's address, NUMA node and path from its host bridge."""

    __slots__ = ("address", "path", "numa_node", "pcie_switch")

    def __init__(self, address: str, path: tuple[str, ...], numa_node: int) -> None:
        self.address = address
        self.path = path
        self.numa_node = numa_node
        self.pcie_switch = switch_of(path)

    @classmethod
    def read(cls, root: Path, address: str) -> "PciFunction":
        link = root / "bus" / "pci" / "devices" / address
        return cls(address, pci_path(root, link), _read_int(link / "numa_node", -1))


class RdmaDevice(PciFunction):
    __slots__ = ("name", "rate_gbps", "link_layer", "state")

    def __init__(self, name: str, address: str, path: tuple[str, ...], numa_node: int) -> None:
        super().__init__(address, path, numa_node)
        self.name = name
        self.rate_gbps: int | None = None
        self.link_layer = ""
        self.state = ""

    @classmethod
    def read(cls, root: Path, name: str) -> "RdmaDevice | None":  # type: ignore[override]
        base = root / "class" / "infiniband" / name
        path = pci_path(root, base / "device")
        address = path[-1] if path else ""
        dev_dir = base / "device"
        if (dev_dir / "physfn").exists():
            return None  # an SR-IOV VF
        dev = cls(name, address, path, _read_int(dev_dir / "numa_node", -1))
        ports = sorted(_listdir(base / "ports"), key=natural_key)
        if ports:
            # mlx5 exposes one port per RDMA device (each port is its own PCI
            # function); for multi-port HCAs the first port stands for the device.
            pdir = base / "ports" / ports[0]
            dev.state = parse_port_state(_read(pdir / "state"))
            dev.rate_gbps = parse_rate_gbps(_read(pdir / "rate"))
            dev.link_layer = _read(pdir / "link_layer")
        return dev


def parse_port_state(text: str) -> str:
    """``4: ACTIVE`` -> ``ACTIVE``; "" when unknown."""
    return text.split(":", 1)[-1].strip().upper() if text else ""


def parse_rate_gbps(text: str) -> int | None:
    """``400 Gb/sec (4X NDR)`` -> 400; ``2.5 Gb/sec (1X SDR)`` -> 2 (the model
    counts whole Gb/s); None when unreadable."""
    try:
        return int(float(text.split()[0]))
    except (IndexError, ValueError):
        return None


def pci_path(root: Path, link: Path) -> tuple[str, ...]:
    """Components of a device's real path under ``<root>/devices``, host
    bridge first: ``('pci0000:15', '0000:15:01.0', …, '0000:18:00.0')``."""
    try:
        real = os.path.realpath(link)
        rel = os.path.relpath(real, os.path.join(os.path.realpath(root), "devices"))
    except (OSError, ValueError):
        return ()
    parts = tuple(Path(rel).parts)
    if not parts or not parts[0].startswith("pci"):
        return ()  # not on a PCI bus (soft-RoCE rxe, virtual devices)
    return parts


def switch_of(path: Sequence[str]) -> str:
    """The PCIe switch right above a device, named by its upstream port.

    ``host / root port / switch upstream / switch downstream / device``: the
    upstream port is third from the end. A device directly on a root port has
    no switch ("").
    """
    return path[-3] if len(path) >= 5 else ""


def pcie_distance(a: Sequence[str], b: Sequence[str], numa_a: int, numa_b: int) -> PcieDistance:
    """The ``nvidia-smi topo -m`` relation between two PCI functions.

    - different host bridges: NODE on one NUMA node, SYS across sockets
      (both NUMA nodes unknown, as on single-node machines whose firmware
      gives no proximity info, counts as one node; one unknown is SYS);
    - same host bridge, different root ports: PHB (through the CPU's root
      complex);
    - below one root port: PIX when each side crosses at most one bridge
      below their deepest common bridge (one switch), else PXB.
    """
    if not a or not b:
        return PcieDistance.SYS
    if a[0] != b[0]:
        return PcieDistance.NODE if numa_a == numa_b else PcieDistance.SYS
    common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        common += 1
    if common <= 1:
        return PcieDistance.PHB
    # Components after the common prefix, minus the endpoint, are bridges
    # crossed on that side.
    bridges_a = max(0, len(a) - common - 1)
    bridges_b = max(0, len(b) - common - 1)
    return PcieDistance.PIX if bridges_a <= 1 and bridges_b <= 1 else PcieDistance.PXB


def _known(numa: int) -> int | None:
    return numa if numa >= 0 else None


def _listdir(path: Path) -> Iterable[str]:
    try:
        return os.listdir(path)
    except OSError:
        return ()


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _read_int(path: Path, default: int) -> int:
    try:
        return int(_read(path))
    except ValueError:
        return default
