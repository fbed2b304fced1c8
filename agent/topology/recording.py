"""Record a machine's topology answers as data, and replay them.

Discovery is tested against *recordings*, not mocks: what NVML answered and
what sysfs contained on a machine, stored as JSON, replayed through exactly
the code paths a live node uses.

- ``record_nvml(nvml)`` asks a live NVML the questions ``NvmlSource`` asks and
  returns the answers as a JSON-able dict; ``ReplayNvml(recording)`` is an
  object with pynvml's function names that gives those answers back, raising
  pynvml's own exception classes for recorded errors.
- ``record_sysfs(root)`` captures the part of sysfs discovery reads (NVIDIA PCI
  functions, RDMA devices, their PCI paths and NUMA nodes) as a compact
  description; ``write_sysfs(description, root)`` materialises it as a
  sysfs-shaped tree (directories, files, relative symlinks) that
  ``SysfsSource`` reads unchanged.

``python -m agent.topology.recording OUT_DIR`` writes ``nvml.json``,
``sysfs.json`` and (when ``nvidia-smi`` is present) ``nvidia-smi-topo.txt`` for
the machine it runs on: the way to turn a real node into a test fixture.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping

import pynvml  # only for its error classes, constants and structures; no driver needed

from agent.topology.nvml import (
    AFFINITY_SCOPE_NODE,
    FEATURE_ENABLED,
    NODE_SET_WORDS,
    NVLINK_MAX_LINKS_FALLBACK,
)
from agent.topology.sysfs import GPU_CLASSES, NVIDIA_VENDOR, pci_path

NVML_FORMAT = "phalanx-nvml-recording/1"
SYSFS_FORMAT = "phalanx-sysfs-recording/1"

# The pynvml calls NvmlSource makes; a replay implements exactly these.
NVML_CALLS: tuple[str, ...] = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetMemoryAffinity",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkRemoteDeviceType",
    "nvmlDeviceGetNvLinkRemotePciInfo",
    "nvmlDeviceGetGpuFabricInfoV",
    "nvmlDeviceGetGpuFabricInfo",
)


def nvml_error(name: str) -> pynvml.NVMLError:
    """The pynvml exception for ``NOT_SUPPORTED`` / ``LIBRARY_NOT_FOUND`` / …
    (``NVMLError(code)`` picks the matching subclass itself)."""
    code = getattr(pynvml, f"NVML_ERROR_{name}", None)
    if code is None:
        raise ValueError(f"unknown NVML error name {name!r} in recording")
    return pynvml.NVMLError(code)


def _error_name(exc: pynvml.NVMLError) -> str:
    for attr in dir(pynvml):
        if attr.startswith("NVML_ERROR_") and getattr(pynvml, attr) == exc.value:
            return attr.removeprefix("NVML_ERROR_")
    return "UNKNOWN"


class _Handle:
    """Opaque device handle, as ``nvmlDeviceGetHandleByIndex`` returns."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<replayed nvmlDevice {self.index}>"


class ReplayNvml:
    """Answers ``NVML_CALLS`` from a recording (see ``record_nvml`` for its
    shape). Structures returned are pynvml's own ctypes types, so the caller
    cannot tell a replay from the driver."""

    NVMLError = pynvml.NVMLError
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    c_nvmlGpuFabricInfoV_t = pynvml.c_nvmlGpuFabricInfoV_t
    c_nvmlGpuFabricInfo_t = pynvml.c_nvmlGpuFabricInfo_t

    def __init__(self, recording: Mapping[str, Any]) -> None:
        fmt = recording.get("format", NVML_FORMAT)
        if fmt != NVML_FORMAT:
            raise ValueError(f"not an NVML recording: format {fmt!r}, expected {NVML_FORMAT!r}")
        self._rec = recording
        self._devices: list[Mapping[str, Any]] = list(recording.get("devices", ()))
        self.initialised = False

    @classmethod
    def from_file(cls, path: str | Path) -> "ReplayNvml":
        return cls(json.loads(Path(path).read_text()))

    # -- lifecycle ---------------------------------------------------------
    def nvmlInit(self) -> None:
        if self._rec.get("init_error"):
            raise nvml_error(self._rec["init_error"])
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._check_init()
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return str(self._rec.get("driver_version", ""))

    # -- devices -------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check_init()
        if not 0 <= index < len(self._devices):
            raise nvml_error("INVALID_ARGUMENT")
        return _Handle(index)

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return str(self._answer(handle, "name"))

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return str(self._answer(handle, "uuid"))

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: Any = None) -> Any:
        total = int(self._answer(handle, "memory_total"))
        memory = pynvml.c_nvmlMemory_t()
        memory.total, memory.free, memory.used = total, total, 0
        return memory

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> Any:
        info = pynvml.nvmlPciInfo_t()
        info.busId = str(self._answer(handle, "pci_bus_id"))
        return info

    def nvmlDeviceGetMemoryAffinity(self, handle: _Handle, node_set_size: int, scope: int) -> Any:
        if scope != AFFINITY_SCOPE_NODE:
            raise nvml_error("INVALID_ARGUMENT")
        nodes = self._answer(handle, "memory_affinity_nodes")
        mask = (ctypes.c_ulonglong * node_set_size)()
        for node in nodes:
            if node // 64 >= node_set_size:
                raise nvml_error("INSUFFICIENT_SIZE")
            mask[node // 64] |= 1 << (node % 64)
        return mask

    # -- NVLink ------------------------------------------------------------
    def _link(self, handle: _Handle, link: int) -> Mapping[str, Any]:
        device = self._device(handle)
        entry: Mapping[str, Any]
        for entry in device.get("nvlinks", ()):
            if entry["link"] == link:
                if entry.get("error"):
                    raise nvml_error(entry["error"])
                return entry
        # Links the recording does not list answer what the device answered
        # for its absent links (INVALID_ARGUMENT past the last link,
        # NOT_SUPPORTED on a GPU without NVLink).
        raise nvml_error(device.get("nvlink_error", "INVALID_ARGUMENT"))

    def nvmlDeviceGetNvLinkState(self, handle: _Handle, link: int) -> int:
        return int(self._link(handle, link)["state"])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: _Handle, link: int) -> int:
        entry = self._link(handle, link)
        if "remote_type" not in entry:
            raise nvml_error(entry.get("remote_type_error", "FUNCTION_NOT_FOUND"))
        return int(entry["remote_type"])

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: _Handle, link: int) -> Any:
        entry = self._link(handle, link)
        info = pynvml.nvmlPciInfo_t()
        info.busId = str(entry.get("remote_pci_bus_id", "00000000:00:00.0"))
        return info

    # -- fabric --------------------------------------------------------------
    def nvmlDeviceGetGpuFabricInfoV(self, handle: _Handle, info_ref: Any) -> int:
        return self._fill_fabric(handle, info_ref)

    def nvmlDeviceGetGpuFabricInfo(self, handle: _Handle, info_ref: Any) -> int:
        return self._fill_fabric(handle, info_ref)

    def _fill_fabric(self, handle: _Handle, info_ref: Any) -> int:
        fabric = self._answer(handle, "fabric")
        info = getattr(info_ref, "_obj", info_ref)  # ctypes.byref(x)._obj is x
        raw = bytes.fromhex(fabric.get("cluster_uuid", "00" * 16).replace("-", ""))
        ctypes.memmove(info.clusterUuid, raw, len(raw))
        info.cliqueId = int(fabric.get("clique_id", 0))
        info.state = int(fabric.get("state", 0))
        info.status = int(fabric.get("status", 0))
        return 0

    # -- helpers ---------------------------------------------------------------
    def _check_init(self) -> None:
        if not self.initialised:
            raise nvml_error("UNINITIALIZED")

    def _device(self, handle: _Handle) -> Mapping[str, Any]:
        self._check_init()
        if not isinstance(handle, _Handle) or not 0 <= handle.index < len(self._devices):
            raise nvml_error("INVALID_ARGUMENT")
        return self._devices[handle.index]

    def _answer(self, handle: _Handle, key: str) -> Any:
        """A recorded value, or the recorded error (``{"error": "NAME"}``)."""
        value = self._device(handle).get(key)
        if value is None:
            raise nvml_error("NOT_SUPPORTED")
        if isinstance(value, Mapping) and "error" in value:
            raise nvml_error(value["error"])
        return value


def record_nvml(nvml: Any = None, *, description: str = "") -> dict[str, Any]:
    """Ask a live NVML what ``NvmlSource`` asks; return the answers as data.

    Recorded errors are stored by name (``{"error": "NOT_SUPPORTED"}``), so a
    replay raises the same exception class the driver raised.
    """
    nvml = nvml if nvml is not None else pynvml
    out: dict[str, Any] = {"format": NVML_FORMAT, "description": description}
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        out["init_error"] = _error_name(exc)
        out["devices"] = []
        return out

    def answer(fn: Any, *args: Any) -> Any:
        try:
            return ("ok", fn(*args))
        except nvml.NVMLError as exc:
            return ("error", _error_name(exc))

    try:
        kind, version = answer(nvml.nvmlSystemGetDriverVersion)
        out["driver_version"] = _text(version) if kind == "ok" else ""
        devices: list[dict[str, Any]] = []
        max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", NVLINK_MAX_LINKS_FALLBACK))
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            dev: dict[str, Any] = {}
            for key, fn in (("name", nvml.nvmlDeviceGetName), ("uuid", nvml.nvmlDeviceGetUUID)):
                kind, value = answer(fn, handle)
                dev[key] = _text(value) if kind == "ok" else {"error": value}
            kind, value = answer(nvml.nvmlDeviceGetMemoryInfo, handle)
            dev["memory_total"] = int(value.total) if kind == "ok" else {"error": value}
            dev["pci_bus_id"] = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
            kind, value = answer(nvml.nvmlDeviceGetMemoryAffinity, handle, NODE_SET_WORDS, AFFINITY_SCOPE_NODE)
            dev["memory_affinity_nodes"] = _mask_nodes(value) if kind == "ok" else {"error": value}
            links: list[dict[str, Any]] = []
            absent: str | None = None
            for link in range(max_links):
                kind, state = answer(nvml.nvmlDeviceGetNvLinkState, handle, link)
                if kind == "error":
                    absent = absent or state
                    if state == absent:
                        continue  # the device's usual answer for a missing link
                    links.append({"link": link, "error": state})
                    continue
                entry: dict[str, Any] = {"link": link, "state": int(state)}
                if int(state) == FEATURE_ENABLED:
                    kind, rtype = answer(nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
                    if kind == "ok":
                        entry["remote_type"] = int(rtype)
                    else:
                        entry["remote_type_error"] = rtype
                    kind, remote = answer(nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
                    if kind == "ok":
                        entry["remote_pci_bus_id"] = _text(remote.busId)
                links.append(entry)
            dev["nvlinks"] = links
            dev["nvlink_error"] = absent or "INVALID_ARGUMENT"
            dev["fabric"] = _record_fabric(nvml, handle)
            devices.append(dev)
        out["devices"] = devices
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass
    return out


def _record_fabric(nvml: Any, handle: Any) -> dict[str, Any]:
    for fn_name, struct_name in (
        ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t"),
        ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t"),
    ):
        fn, struct_type = getattr(nvml, fn_name, None), getattr(nvml, struct_name, None)
        if fn is None or struct_type is None:
            continue
        info = struct_type()
        try:
            fn(handle, ctypes.byref(info))
        except nvml.NVMLError as exc:
            if _error_name(exc) == "FUNCTION_NOT_FOUND":
                continue
            return {"error": _error_name(exc)}
        return {
            "cluster_uuid": bytes(info.clusterUuid).hex(),
            "clique_id": int(info.cliqueId),
            "state": int(info.state),
            "status": int(info.status),
        }
    return {"error": "FUNCTION_NOT_FOUND"}


def _mask_nodes(mask: Any) -> list[int]:
    return [w * 64 + b for w, word in enumerate(mask) for b in range(64) if int(word) >> b & 1]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- sysfs ------------------------------------------------------------------------

def record_sysfs(root: str | Path = "/sys", *, description: str = "") -> dict[str, Any]:
    """The part of sysfs discovery reads, as a compact description:
    one entry per NVIDIA GPU function and per RDMA device, each with its PCI
    path under ``devices/`` (which encodes the whole PCIe hierarchy)."""
    root = Path(root)
    devices: list[dict[str, Any]] = []
    seen: set[str] = set()
    pci = root / "bus" / "pci" / "devices"
    for entry in sorted(_listdir(pci)):
        attrs = {k: _read(pci / entry / k) for k in ("vendor", "device", "class", "numa_node")}
        if attrs["vendor"] == NVIDIA_VENDOR and attrs["class"].startswith(GPU_CLASSES):
            path = _pci_path(root, pci / entry)
            if path:
                devices.append({"path": path, **{k: v for k, v in attrs.items() if v}})
                seen.add(entry)
    ib = root / "class" / "infiniband"
    for name in sorted(_listdir(ib)):
        dev_link = ib / name / "device"
        path = _pci_path(root, dev_link)
        if not path:
            continue
        bdf = path.rsplit("/", 1)[-1]
        dev_dir = root / "devices" / path
        ports: dict[str, dict[str, str]] = {}
        for port in sorted(_listdir(ib / name / "ports")):
            pdir = ib / name / "ports" / port
            ports[port] = {k: v for k in ("state", "phys_state", "rate", "link_layer") if (v := _read(pdir / k))}
        if bdf in seen:
            continue
        attrs = {k: _read(dev_dir / k) for k in ("vendor", "device", "class", "numa_node")}
        entry_out: dict[str, Any] = {"path": path, **{k: v for k, v in attrs.items() if v}}
        if (dev_dir / "physfn").exists():
            # An SR-IOV virtual function; its physical function's address.
            entry_out["physfn"] = os.path.basename(os.path.realpath(dev_dir / "physfn"))
        entry_out["rdma"] = {"name": name, "ports": ports}
        devices.append(entry_out)
    devices.sort(key=lambda d: d["path"])  # stable output: a diff shows real changes only
    return {"format": SYSFS_FORMAT, "description": description, "devices": devices}


def write_sysfs(description: Mapping[str, Any], root: str | Path) -> Path:
    """Materialise a ``record_sysfs`` description under ``root``; returns
    ``root``. Links are relative, as the kernel makes them, so the tree can be
    moved or copied."""
    fmt = description.get("format", SYSFS_FORMAT)
    if fmt != SYSFS_FORMAT:
        raise ValueError(f"not a sysfs recording: format {fmt!r}, expected {SYSFS_FORMAT!r}")
    root = Path(root)
    (root / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
    (root / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
    for dev in description.get("devices", ()):
        path = str(dev["path"]).strip("/")
        parts = path.split("/")
        numa = str(dev.get("numa_node", "-1"))
        # Every bridge on the way gets a directory, a numa_node and a bus link,
        # like the kernel's: discovery only follows paths, but a realistic
        # tree keeps the recorder and the reader honest.
        for depth in range(2, len(parts) + 1):
            node_dir = root / "devices" / "/".join(parts[:depth])
            node_dir.mkdir(parents=True, exist_ok=True)
            _write_once(node_dir / "numa_node", numa)
            _link(root / "bus" / "pci" / "devices" / parts[depth - 1], os.path.join("..", "..", "..", "devices", *parts[:depth]))
        dev_dir = root / "devices" / path
        for key in ("vendor", "device", "class"):
            if key in dev:
                (dev_dir / key).write_text(str(dev[key]) + "\n")
        (dev_dir / "numa_node").write_text(numa + "\n")
        if dev.get("physfn"):
            _link(dev_dir / "physfn", os.path.join("..", str(dev["physfn"])))
        rdma = dev.get("rdma")
        if rdma:
            ib_dir = dev_dir / "infiniband" / rdma["name"]
            for port, attrs in rdma.get("ports", {}).items():
                pdir = ib_dir / "ports" / str(port)
                pdir.mkdir(parents=True, exist_ok=True)
                for key, value in attrs.items():
                    (pdir / key).write_text(str(value) + "\n")
            ib_dir.mkdir(parents=True, exist_ok=True)
            _link(ib_dir / "device", os.path.join("..", "..", "..", parts[-1]))
            _link(root / "class" / "infiniband" / rdma["name"], os.path.join("..", "..", "devices", path, "infiniband", rdma["name"]))
    return root


def _write_once(path: Path, text: str) -> None:
    if not path.exists():
        path.write_text(text + "\n")


def _link(at: Path, target: str) -> None:
    if not at.is_symlink():
        at.symlink_to(target)


def _pci_path(root: Path, link: Path) -> str:
    return "/".join(pci_path(root, link))


def _listdir(path: Path) -> Iterator[str]:
    try:
        yield from os.listdir(path)
    except OSError:
        return


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def main(argv: list[str] | None = None) -> int:
    """Record this machine into OUT_DIR (nvml.json, sysfs.json, nvidia-smi-topo.txt)."""
    from agent.topology.nvidia_smi import capture_topo_matrix

    parser = argparse.ArgumentParser(prog="python -m agent.topology.recording", description=main.__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--sysfs-root", default="/sys")
    parser.add_argument("--description", default="")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "nvml.json").write_text(json.dumps(record_nvml(description=args.description), indent=1) + "\n")
    sysfs = record_sysfs(args.sysfs_root, description=args.description)
    (args.out_dir / "sysfs.json").write_text(json.dumps(sysfs, indent=1) + "\n")
    text = capture_topo_matrix()
    if text is not None:
        (args.out_dir / "nvidia-smi-topo.txt").write_text(text)
    print(f"recorded into {args.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
