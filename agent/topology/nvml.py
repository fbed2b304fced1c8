"""GPUs, NVLink and the multi-node NVLink fabric, from NVML (``nvidia-ml-py``).

The NVML module is injected: production passes nothing and gets ``pynvml``;
tests pass ``recording.ReplayNvml``, which answers the same calls from a
recording of a real machine. Only the calls below are made, so a replay needs
only these names (``recording.NVML_CALLS`` lists them).

NVLink islands. Each active link reports its remote end. A remote end that is
one of this node's GPUs is a direct GPU↔GPU link (NVLink bridges, DGX-1
hybrid cube mesh). Anything else — remote type NVSWITCH, or a PCI address that
is not a local GPU — is an NVSwitch: on HGX/DGX H100 the switches may not be
PCI-visible at all (NCCL makes the same assumption, NVIDIA/nccl#1182). All
GPUs that reach an NVSwitch are peers of each other: one NVSwitch system is one
island. (A Fabric Manager *partition* of a shared NVSwitch system would split
it; NVML does not expose partitions per GPU, so that is not modelled.)

Multi-node NVLink (GB200 NVL72). ``nvmlDeviceGetGpuFabricInfoV`` reports the
fabric ``clusterUuid`` and ``cliqueId`` once the GPU has registered with the
fabric manager (state COMPLETED). GPUs with equal (clusterUuid, cliqueId) can
use NVLink with each other across trays; ``<clusterUuid>.<cliqueId>`` is the
value the GPU Operator publishes as ``nvidia.com/gpu.clique``, so the domain
names Phalanx reports agree with the cluster's labels.
"""

from __future__ import annotations

import ctypes
import uuid as uuidlib
from typing import Any, Callable, TypeVar

from agent.topology.base import NVML, GpuFacts, PartialTopology, normalise_bus_id

T = TypeVar("T")

# NVML constants, spelled out so a replay (or an old pynvml) without them works.
NVLINK_MAX_LINKS_FALLBACK = 18  # NVML_NVLINK_MAX_LINKS before Blackwell
NVLINK_DEVICE_TYPE_GPU = 0x00
NVLINK_DEVICE_TYPE_IBMNPU = 0x01
NVLINK_DEVICE_TYPE_SWITCH = 0x02
FEATURE_ENABLED = 1
AFFINITY_SCOPE_NODE = 0
FABRIC_STATE_COMPLETED = 3
NVML_SUCCESS = 0
# 4 × 64 bits: NUMA ids on Grace systems run into the 30s (GPU memory nodes).
NODE_SET_WORDS = 4


class NvmlSource:
    """``TopologySource`` over NVML. ``nvml=None`` imports ``pynvml`` lazily,
    so a node without the package still starts (with no GPUs)."""

    name = NVML

    def __init__(self, nvml: Any = None) -> None:
        self._nvml = nvml

    def discover(self) -> PartialTopology:
        nvml = self._nvml
        if nvml is None:
            try:
                import pynvml as nvml  # type: ignore[no-redef]
            except ImportError as exc:  # the package is a declared dependency; be safe anyway
                return PartialTopology(NVML, defines_gpus=True, problems=(f"nvml: pynvml not importable ({exc})",))
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            # The normal case on CPU-only nodes and in CI: no libnvidia-ml, or
            # no kernel driver. Not an error: the node has no usable GPUs.
            return PartialTopology(NVML, defines_gpus=True, problems=(f"nvml: {exc}",))
        try:
            return _read(nvml)
        except nvml.NVMLError as exc:
            # A failure after init (GPU fell off the bus mid-scan): report no
            # GPUs rather than a half-read inventory the placer would trust.
            return PartialTopology(NVML, defines_gpus=True, problems=(f"nvml: scan failed: {exc}",))
        finally:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                pass


def _read(nvml: Any) -> PartialTopology:
    problems: list[str] = []

    def optional(fn: Callable[..., T], *args: Any) -> T | None:
        """Calls that some GPUs or drivers do not support answer None."""
        try:
            return fn(*args)
        except nvml.NVMLError:
            return None

    count = int(nvml.nvmlDeviceGetCount())
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    bus_ids = [normalise_bus_id(_text(nvml.nvmlDeviceGetPciInfo(h).busId)) for h in handles]
    index_of_bus = {bus: i for i, bus in enumerate(bus_ids)}
    max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", NVLINK_MAX_LINKS_FALLBACK))

    direct: dict[int, set[int]] = {i: set() for i in range(count)}
    on_switch: set[int] = set()
    domains: dict[int, str] = {}
    records: list[tuple[int, str, str, int, int | None]] = []
    for i, handle in enumerate(handles):
        name = _text(nvml.nvmlDeviceGetName(handle))
        gpu_uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        memory = optional(nvml.nvmlDeviceGetMemoryInfo, handle)
        memory_mib = int(memory.total) // (1024 * 1024) if memory is not None else 0
        numa = _first_node(optional(nvml.nvmlDeviceGetMemoryAffinity, handle, NODE_SET_WORDS, AFFINITY_SCOPE_NODE))
        records.append((i, name, gpu_uuid, memory_mib, numa))
        for link in range(max_links):
            state = optional(nvml.nvmlDeviceGetNvLinkState, handle, link)
            if state != FEATURE_ENABLED:
                continue  # not present (INVALID_ARGUMENT), not supported, or down
            remote_type = optional(nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
            if remote_type == NVLINK_DEVICE_TYPE_IBMNPU:
                continue  # a POWER9 CPU link, not GPU↔GPU bandwidth
            remote = optional(nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
            peer = index_of_bus.get(normalise_bus_id(_text(remote.busId))) if remote is not None else None
            if remote_type == NVLINK_DEVICE_TYPE_SWITCH or peer is None:
                on_switch.add(i)  # a switch, visible or not
            elif peer != i:  # (a loopback link adds no peer)
                direct[i].add(peer)
                direct[peer].add(i)
        domain = _fabric_domain(nvml, handle)
        if domain:
            domains[i] = domain

    gpus = []
    for i, name, gpu_uuid, memory_mib, numa in records:
        peers = set(direct[i])
        if i in on_switch:
            peers |= on_switch - {i}
        gpus.append(
            GpuFacts(
                index=i,
                pci_bus_id=bus_ids[i],
                uuid=gpu_uuid,
                model=name,
                memory_mib=memory_mib,
                numa_node=numa,
                nvlink_peers=tuple(sorted(peers)),
            )
        )

    location: dict[str, str] = {}
    if domains:
        distinct = sorted(set(domains.values()))
        # The node-level domain is GPU 0's (lowest index): deterministic. GPUs
        # of one tray in two cliques means a fabric manager misconfiguration;
        # say so rather than pick silently.
        location["nvlink_domain"] = domains[min(domains)]
        if len(distinct) > 1:
            problems.append(f"nvml: GPUs report different NVLink cliques {distinct}; using GPU {min(domains)}'s")
    return PartialTopology(NVML, gpus=tuple(gpus), location=location, defines_gpus=True, problems=tuple(problems))


def _fabric_domain(nvml: Any, handle: Any) -> str:
    """``<clusterUuid>.<cliqueId>`` once the GPU is registered with a
    multi-node NVLink fabric; "" on NVSwitch-only or PCIe systems."""
    attempts: list[tuple[str, str]] = [
        ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t"),
        ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t"),  # drivers before 550
    ]
    for fn_name, struct_name in attempts:
        fn = getattr(nvml, fn_name, None)
        struct_type = getattr(nvml, struct_name, None)
        if fn is None or struct_type is None:
            continue
        info = struct_type()
        try:
            fn(handle, ctypes.byref(info))
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13):
                continue  # older driver: try the legacy call
            return ""
        if int(info.state) != FABRIC_STATE_COMPLETED or int(info.status) != NVML_SUCCESS:
            return ""
        raw = bytes(info.clusterUuid)
        if not any(raw):
            return ""  # registered but no cluster: a single NVSwitch system
        return f"{uuidlib.UUID(bytes=raw)}.{int(info.cliqueId)}"
    return ""


def _first_node(mask: Any) -> int | None:
    """Lowest NUMA node set in an NVML node mask (array of 64-bit words)."""
    if mask is None:
        return None
    for word_index, word in enumerate(mask):
        word = int(word)
        if word:
            return word_index * 64 + ((word & -word).bit_length() - 1)
    return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
