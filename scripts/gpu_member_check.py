#!/usr/bin/env python3
"""A gang member that proves, on real hardware, that Phalanx gave it the right
GPUs (docs/launcher.md "Environment contract"). Standard library only.

1. Prints the Phalanx environment and checks its shape (RANK < WORLD_SIZE,
   CUDA_DEVICE_ORDER=PCI_BUS_ID, ...).
2. Resolves CUDA_VISIBLE_DEVICES to GPU UUIDs: entries may be UUIDs
   (``GPU-xxxxxxxx-...``) or indices; indices are NVML's (PCI bus order, which
   is what Phalanx assigns and why it sets CUDA_DEVICE_ORDER=PCI_BUS_ID) and
   are resolved through libnvidia-ml.so.1, which ignores CUDA_VISIBLE_DEVICES.
   With GPU_CHECK_TOPOLOGY=<discovered topology JSON> (``python -m agent
   --print-topology``) the index -> UUID map is cross-checked against what the
   agent discovered too.
3. Asks CUDA (libcuda.so.1 through ctypes) which devices it sees: they must be
   exactly the assigned ones, in that order.
4. On each one: context, 64 MiB cuMemAlloc, cuMemsetD8, cuMemcpyDtoH of a few
   bytes at both ends (the value must come back), free.

Exit 0 only if everything passed; 1 if a check failed; 2 if the machine has no
usable CUDA driver (libcuda missing or cuInit failing). The last line is
``GPU_MEMBER_CHECK PASS|FAIL {json}``.

``--hold SECONDS [--hold-mib MIB]`` (stage e of scripts/gpu_node_check.sh,
fencing on the GPU): instead of the checks, make a context on every visible
device, cuMemAlloc + cuMemsetD8 MIB (default 1024) on each, print
``GPU_HOLD READY pid=<pid> devices=<uuid,...> mib=<MIB>`` and sleep holding the
memory for SECONDS, then free it and exit 0 (``GPU_HOLD FAIL ...`` and exit 1,
or 2 without a usable CUDA driver). SIGTERM kills it (default action): the
driver releases the memory when the process is gone. With ``--no-cuda`` it
touches no GPU: it prints the READY line with ``devices=<CUDA_VISIBLE_DEVICES>
mib=0`` and just sleeps (dry runs on machines without a GPU).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

ALLOC_BYTES = 64 << 20
PATTERN = 0xA5
ENV_KEYS = (
    "PHALANX_GANG", "PHALANX_INCARNATION", "PHALANX_AGENT_ID", "PHALANX_NODE", "PHALANX_PLACEMENT",
    "PHALANX_EPOCH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_IB_HCA",
)
REQUIRED = ("PHALANX_GANG", "PHALANX_INCARNATION", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


class Check:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.facts: dict[str, object] = {}

    def ok(self, msg: str) -> None:
        print(f"  ok    {msg}", flush=True)

    def fail(self, msg: str) -> None:
        print(f"  FAIL  {msg}", flush=True)
        self.failures.append(msg)

    def expect(self, cond: bool, msg: str) -> bool:
        (self.ok if cond else self.fail)(msg)
        return cond


def finish(check: Check, code_if_failed: int = 1) -> int:
    passed = not check.failures
    check.facts["failures"] = check.failures
    print(f"GPU_MEMBER_CHECK {'PASS' if passed else 'FAIL'} {json.dumps(check.facts, sort_keys=True)}", flush=True)
    return 0 if passed else code_if_failed


def uuid_text(raw: bytes, prefix: str = "GPU-") -> str:
    h = raw.hex()
    return f"{prefix}{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


# --- environment -------------------------------------------------------------------

def check_env(check: Check) -> list[str] | None:
    print("== Phalanx environment", flush=True)
    for key in ENV_KEYS:
        print(f"  {key}={os.environ.get(key, '<unset>')!s}", flush=True)
    check.facts["env"] = {k: os.environ.get(k) for k in ENV_KEYS}
    for key in REQUIRED:
        check.expect(key in os.environ, f"{key} is set")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        check.expect(0 <= rank < world, f"0 <= RANK ({rank}) < WORLD_SIZE ({world})")
        check.expect(0 <= local < local_world <= world,
                     f"0 <= LOCAL_RANK ({local}) < LOCAL_WORLD_SIZE ({local_world}) <= WORLD_SIZE ({world})")
    except (KeyError, ValueError) as exc:
        check.fail(f"rank variables are not integers: {exc!r}")
    check.expect(os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID",
                 "CUDA_DEVICE_ORDER=PCI_BUS_ID (indices are NVML's PCI order)")
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return None
    return [t.strip() for t in cvd.split(",") if t.strip()]


# --- NVML (index -> UUID) ---------------------------------------------------------

class Nvml:
    """The three NVML calls needed, through ctypes (no pynvml)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        init = getattr(self.lib, "nvmlInit_v2", None) or self.lib.nvmlInit
        self._call("nvmlInit", init())

    def _call(self, name: str, rc: int) -> None:
        if rc != 0:
            self.lib.nvmlErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{name} failed: {rc} {self.lib.nvmlErrorString(rc).decode()}")

    def count(self) -> int:
        n = ctypes.c_uint()
        fn = getattr(self.lib, "nvmlDeviceGetCount_v2", None) or self.lib.nvmlDeviceGetCount
        self._call("nvmlDeviceGetCount", fn(ctypes.byref(n)))
        return n.value

    def uuid(self, index: int) -> tuple[str, str]:
        handle = ctypes.c_void_p()
        fn = getattr(self.lib, "nvmlDeviceGetHandleByIndex_v2", None) or self.lib.nvmlDeviceGetHandleByIndex
        self._call(f"nvmlDeviceGetHandleByIndex({index})", fn(ctypes.c_uint(index), ctypes.byref(handle)))
        buf = ctypes.create_string_buffer(96)
        self._call("nvmlDeviceGetUUID", self.lib.nvmlDeviceGetUUID(handle, buf, ctypes.c_uint(96)))
        name = ctypes.create_string_buffer(96)
        self._call("nvmlDeviceGetName", self.lib.nvmlDeviceGetName(handle, name, ctypes.c_uint(96)))
        return buf.value.decode(), name.value.decode()

    def close(self) -> None:
        self.lib.nvmlShutdown()


def expected_uuids(check: Check, tokens: list[str]) -> list[str] | None:
    """The UUIDs CUDA_VISIBLE_DEVICES names, in its order."""
    print("== Assigned devices", flush=True)
    topo_map: dict[int, str] = {}
    topo_path = os.environ.get("GPU_CHECK_TOPOLOGY", "")
    if topo_path:
        try:
            with open(topo_path) as f:
                topo_map = {int(g["index"]): str(g["uuid"]) for g in json.load(f)["gpus"]}
            print(f"  discovered topology {topo_path}: {len(topo_map)} GPUs", flush=True)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            check.fail(f"cannot read GPU_CHECK_TOPOLOGY={topo_path}: {exc!r}")
    nvml: Nvml | None = None
    out: list[str] = []
    for token in tokens:
        if token.startswith(("GPU-", "MIG-")):
            out.append(token)
            print(f"  {token}: given as UUID", flush=True)
            continue
        try:
            index = int(token)
        except ValueError:
            check.fail(f"CUDA_VISIBLE_DEVICES entry {token!r} is neither an index nor a UUID")
            return None
        if nvml is None:
            try:
                nvml = Nvml()
                check.facts["nvml_device_count"] = nvml.count()
            except (OSError, RuntimeError, AttributeError) as exc:
                if index not in topo_map:
                    check.fail(f"NVML unavailable, cannot map index {index} to a UUID: {exc}")
                    return None
                print(f"  NVML unavailable ({exc}); index {index} -> {topo_map[index]} [discovered topology]", flush=True)
                out.append(topo_map[index])
                continue
        try:
            uuid, name = nvml.uuid(index)
        except RuntimeError as exc:
            check.fail(f"NVML index {index}: {exc}")
            return None
        print(f"  index {index} -> {uuid} ({name}) [NVML]", flush=True)
        if topo_map:
            check.expect(topo_map.get(index) == uuid,
                         f"index {index}: NVML {uuid} == discovered {topo_map.get(index)}")
        out.append(uuid)
    if nvml is not None:
        nvml.close()
    check.expect(len(set(out)) == len(out), f"no device assigned twice ({out})")
    return out


# --- CUDA driver API --------------------------------------------------------------

class CudaError(RuntimeError):
    pass


class Cuda:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def fn(self, *names: str):
        for name in names:
            f = getattr(self.lib, name, None)
            if f is not None:
                return name, f
        raise CudaError(f"libcuda has none of {names}")

    def call(self, names: str | tuple[str, ...], *args) -> None:
        name, f = self.fn(*((names,) if isinstance(names, str) else names))
        rc = f(*args)
        if rc != 0:
            n, s = ctypes.c_char_p(), ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(n))
            self.lib.cuGetErrorString(rc, ctypes.byref(s))
            raise CudaError(f"{name} -> {rc} {(n.value or b'?').decode()}: {(s.value or b'?').decode()}")


def cuda_devices(check: Check, cuda: Cuda) -> list[dict[str, object]]:
    count = ctypes.c_int()
    cuda.call("cuDeviceGetCount", ctypes.byref(count))
    version = ctypes.c_int()
    cuda.call("cuDriverGetVersion", ctypes.byref(version))
    check.facts["cuda_driver_version"] = version.value
    print(f"== CUDA: driver API {version.value // 1000}.{version.value % 1000 // 10}, {count.value} visible device(s)", flush=True)
    devices: list[dict[str, object]] = []
    for ordinal in range(count.value):
        dev = ctypes.c_int()
        cuda.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        raw = (ctypes.c_ubyte * 16)()
        cuda.call(("cuDeviceGetUuid_v2", "cuDeviceGetUuid"), ctypes.byref(raw), dev)
        name = ctypes.create_string_buffer(256)
        cuda.call("cuDeviceGetName", name, 256, dev)
        mem = ctypes.c_size_t()
        cuda.call(("cuDeviceTotalMem_v2", "cuDeviceTotalMem"), ctypes.byref(mem), dev)
        bus = ctypes.create_string_buffer(32)
        try:
            cuda.call("cuDeviceGetPCIBusId", bus, 32, dev)
        except CudaError:
            pass
        info = {"ordinal": ordinal, "uuid": uuid_text(bytes(raw)), "name": name.value.decode(),
                "total_mem_mib": mem.value >> 20, "pci_bus_id": bus.value.decode(), "handle": dev.value}
        print(f"  cuda:{ordinal} {info['uuid']} {info['name']} {info['total_mem_mib']} MiB pci={info['pci_bus_id']}", flush=True)
        devices.append(info)
    return devices


def exercise(check: Check, cuda: Cuda, info: dict[str, object]) -> None:
    """Context + 64 MiB alloc + memset + read back both ends + free."""
    ctx = ctypes.c_void_p()
    ptr = ctypes.c_uint64()
    dev = ctypes.c_int(int(info["handle"]))
    t0 = time.monotonic()
    created = primary = allocated = False
    try:
        try:
            cuda.call("cuCtxCreate_v2", ctypes.byref(ctx), 0, dev)
            created = True
        except CudaError as exc:
            # A driver without the v2 entry point (or refusing it): the
            # device's primary context does the same job.
            print(f"  cuCtxCreate_v2 unavailable ({exc}); using the primary context", flush=True)
            cuda.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
            primary = True
            cuda.call("cuCtxSetCurrent", ctx)
        cuda.call(("cuMemAlloc_v2", "cuMemAlloc"), ctypes.byref(ptr), ctypes.c_size_t(ALLOC_BYTES))
        allocated = True
        cuda.call(("cuMemsetD8_v2", "cuMemsetD8"), ctypes.c_uint64(ptr.value), ctypes.c_ubyte(PATTERN),
                  ctypes.c_size_t(ALLOC_BYTES))
        cuda.call("cuCtxSynchronize")
        host = (ctypes.c_ubyte * 16)()
        seen: list[int] = []
        for offset in (0, ALLOC_BYTES - 16):
            cuda.call(("cuMemcpyDtoH_v2", "cuMemcpyDtoH"), ctypes.byref(host), ctypes.c_uint64(ptr.value + offset),
                      ctypes.c_size_t(16))
            seen.extend(host)
        good = all(b == PATTERN for b in seen)
        check.expect(good, f"cuda:{info['ordinal']} {info['uuid']}: 64 MiB alloc+memset+DtoH read back "
                           f"{'0x%02x' % PATTERN if good else bytes(seen).hex()} in {time.monotonic() - t0:.2f}s")
    except CudaError as exc:
        check.fail(f"cuda:{info['ordinal']} {info['uuid']}: {exc}")
    finally:
        try:
            if allocated:
                cuda.call(("cuMemFree_v2", "cuMemFree"), ctypes.c_uint64(ptr.value))
            if created:
                cuda.call(("cuCtxDestroy_v2", "cuCtxDestroy"), ctx)
            if primary:
                cuda.call("cuCtxSetCurrent", None)
                cuda.call(("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"), dev)
        except CudaError as exc:
            check.fail(f"cuda:{info['ordinal']}: cleanup: {exc}")


def main() -> int:
    check = Check()
    print(f"gpu_member_check: pid {os.getpid()} python {sys.version.split()[0]} cwd {os.getcwd()}", flush=True)
    tokens = check_env(check)
    if tokens is None:
        return finish(check)
    expected = expected_uuids(check, tokens)
    check.facts["expected_uuids"] = expected
    try:
        cuda = Cuda()
    except OSError as exc:
        check.fail(f"no CUDA driver: cannot load libcuda.so.1 ({exc})")
        return finish(check, 2)
    try:
        cuda.call("cuInit", 0)
    except CudaError as exc:
        if not tokens and "NO_DEVICE" in str(exc):
            check.ok(f"no GPU assigned and CUDA sees none ({exc})")
            return finish(check)
        check.fail(f"cuInit failed: {exc}")
        return finish(check, 2)
    try:
        devices = cuda_devices(check, cuda)
    except CudaError as exc:
        check.fail(f"enumerating CUDA devices: {exc}")
        return finish(check)
    seen = [str(d["uuid"]) for d in devices]
    check.facts["cuda_uuids"] = seen
    check.facts["cuda_devices"] = [{k: v for k, v in d.items() if k != "handle"} for d in devices]
    if expected is not None:
        check.expect(seen == expected, f"CUDA sees exactly the assigned devices, in order: {seen} == {expected}")
        if seen != expected and sorted(seen) == sorted(expected):
            print("  (same set, different order: CUDA_DEVICE_ORDER not honoured?)", flush=True)
    print("== Device work", flush=True)
    for info in devices:
        exercise(check, cuda, info)
    return finish(check)


# --- hold mode (fencing on the GPU) ---------------------------------------------

def hold_devices(cuda: Cuda, devices: list[dict[str, object]], mib: int) -> None:
    """A context per device, ``mib`` MiB allocated and written on each; the
    contexts and allocations stay until the process ends (or is killed)."""
    size = mib << 20
    for info in devices:
        dev = ctypes.c_int(int(info["handle"]))
        ctx = ctypes.c_void_p()
        try:
            cuda.call("cuCtxCreate_v2", ctypes.byref(ctx), 0, dev)
        except CudaError as exc:
            print(f"  cuCtxCreate_v2 unavailable ({exc}); using the primary context", flush=True)
            cuda.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
            cuda.call("cuCtxSetCurrent", ctx)
        ptr = ctypes.c_uint64()
        t0 = time.monotonic()
        cuda.call(("cuMemAlloc_v2", "cuMemAlloc"), ctypes.byref(ptr), ctypes.c_size_t(size))
        cuda.call(("cuMemsetD8_v2", "cuMemsetD8"), ctypes.c_uint64(ptr.value), ctypes.c_ubyte(PATTERN),
                  ctypes.c_size_t(size))
        cuda.call("cuCtxSynchronize")
        info["held"] = (ctx, ptr)
        print(f"  cuda:{info['ordinal']} {info['uuid']}: holding {mib} MiB at 0x{ptr.value:x} "
              f"(alloc+memset {time.monotonic() - t0:.2f}s)", flush=True)


def hold(seconds: float, mib: int, use_cuda: bool) -> int:
    pid = os.getpid()
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    print(f"gpu_member_check --hold {seconds:g}: pid {pid} pgid {os.getpgid(0)} python {sys.version.split()[0]} "
          f"CUDA_VISIBLE_DEVICES={cvd} PHALANX_GANG={os.environ.get('PHALANX_GANG')} "
          f"RANK={os.environ.get('RANK')}", flush=True)
    if not use_cuda:
        devices_text, mib = cvd, 0
    else:
        try:
            cuda = Cuda()
            cuda.call("cuInit", 0)
        except (OSError, CudaError) as exc:
            print(f"GPU_HOLD FAIL no usable CUDA driver: {exc}", flush=True)
            return 2
        try:
            devices = cuda_devices(Check(), cuda)
            if not devices:
                print("GPU_HOLD FAIL CUDA sees no device", flush=True)
                return 1
            hold_devices(cuda, devices, mib)
        except CudaError as exc:
            print(f"GPU_HOLD FAIL {exc}", flush=True)
            return 1
        devices_text = ",".join(str(d["uuid"]) for d in devices)
    print(f"GPU_HOLD READY pid={pid} devices={devices_text} mib={mib}", flush=True)
    deadline = time.monotonic() + seconds
    while (rest := deadline - time.monotonic()) > 0:
        time.sleep(min(rest, 1.0))
    print(f"GPU_HOLD DONE held {seconds:g}s, exiting (the driver frees the memory)", flush=True)
    return 0


def parse_args(argv: list[str]):
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hold", type=float, metavar="SECONDS",
                   help="allocate on every visible device, print GPU_HOLD READY, sleep SECONDS holding it")
    p.add_argument("--hold-mib", type=int, default=1024, metavar="MIB", help="MiB per device (default 1024)")
    p.add_argument("--no-cuda", action="store_true", help="with --hold: no CUDA at all, just sleep")
    return p.parse_args(argv)


if __name__ == "__main__":
    _args = parse_args(sys.argv[1:])
    if _args.hold is not None:
        sys.exit(hold(_args.hold, _args.hold_mib, not _args.no_cuda))
    sys.exit(main())
