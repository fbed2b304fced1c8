"""A multi-host cluster on one machine, out of Linux network namespaces.

Layout (see docs/chaos.md for the picture)::

    netns phx<run>-br      bridge br0, one veth end per host (v<i>-<host>)
    netns phx<run>-<host>  lo up, eth0 = the other veth end, 10.213.<n>.<i>/24

Nothing is added to the root namespace: veth pairs are created directly
inside the bridge namespace with their peer placed straight into the host
namespace, so the root namespace's links, routes and iptables never change.
Processes started with :meth:`Host.popen` run under ``ip netns exec`` in their
own process group and are tracked, so teardown can SIGKILL whole groups.

Every run holds an ``flock`` on ``/run/phalanx-chaos/phx<run>.lock`` for its
lifetime. The kernel drops that lock when the owner dies, even by SIGKILL, so
:func:`cleanup_stale` can tell a leftover of a dead run from a live run of a
neighbour (another pytest on the same machine) and removes only the former.
"""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from phalanx.procs import spawn
from phalanx.programs import MissingProgram, install_hint, require

NS_PREFIX = "phx"
# phx<run>-<host>: <run> is lower-case alphanumerics (a random hex id in
# practice); the host part may itself contain dashes.
_NS_RE = re.compile(r"^(phx[0-9a-z]+)-(.+)$")
_HOST_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
BRIDGE_HOST = "br"  # reserved: phx<run>-br is the namespace holding the bridge
BRIDGE_DEV = "br0"
HOST_DEV = "eth0"
IFNAMSIZ = 15  # Linux interface names are at most 15 bytes
LOCK_DIR = Path("/run/phalanx-chaos")
# 10.213.0.0/16 is an arbitrary corner of 10/8 that no cloud or container
# runtime defaults to (docker: 172.17/16, k8s pods often 10.244/16 or 10.0/8
# slices); each run takes one /24 of it.
SUBNET_POOL = ipaddress.IPv4Network("10.213.0.0/16")


class ChaosEnvironmentError(RuntimeError):
    """The machine cannot run the chaos suite; the message says what is missing."""


class NetnsError(RuntimeError):
    """An ``ip``/``iptables`` command failed while building or changing the cluster."""


class SubnetInUse(NetnsError):
    """The requested test subnet overlaps a route or address of the root namespace."""


# ---------------------------------------------------------------------------
# Preflight


def missing_requirements(
    euid: int,
    which: Callable[[str], str | None],
    need_iptables: bool = True,
    netns_supported: bool = True,
) -> list[str]:
    """What this machine lacks for the chaos suite, one readable line each.

    Pure so that the exact messages are unit-testable without a non-root box.
    """
    missing: list[str] = []
    if euid != 0:
        missing.append(f"not running as root (euid={euid}); network namespaces need CAP_SYS_ADMIN/CAP_NET_ADMIN")
    if which("ip") is None:
        missing.append(f"no `ip` command on PATH ({install_hint('ip')})")
    if need_iptables and which("iptables") is None:
        missing.append(f"no `iptables` command on PATH ({install_hint('iptables')})")
    if not netns_supported:
        missing.append("kernel has no network namespaces (/proc/self/ns/net is missing)")
    return missing


def preflight(need_iptables: bool = True) -> None:
    """Raise :class:`ChaosEnvironmentError` naming everything that is missing.

    Tests call this (through :class:`NetnsCluster`) and must *fail* with the
    message, never skip: a chaos suite that silently does not run proves nothing.
    """
    missing = missing_requirements(
        os.geteuid(), shutil.which, need_iptables, os.path.exists("/proc/self/ns/net")
    )
    if missing:
        raise ChaosEnvironmentError("chaos suite cannot run here: " + "; ".join(missing))


# ---------------------------------------------------------------------------
# Small command helpers


def run_cmd(
    cmd: Sequence[str], *, timeout: float = 30.0, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a short command, raising :class:`NetnsError` with its stderr on failure."""
    require_program(cmd[0])
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, input=input)
    if check and res.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} failed with {res.returncode}: {res.stderr.strip()}")
    return res


def require_program(program: str) -> str:
    """:func:`phalanx.programs.require` as a :class:`ChaosEnvironmentError`
    (named program, its Debian package)."""
    try:
        return require(program)
    except MissingProgram as e:
        raise ChaosEnvironmentError(f"chaos suite cannot run here: {e}") from None


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = run_cmd(["ip", "netns", "list"]).stdout
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(netns: str) -> list[int]:
    """Pids of live processes inside ``netns`` (empty if the namespace is gone).

    Zombies are not listed: their namespace references are dropped at exit.
    """
    res = run_cmd(["ip", "netns", "pids", netns], check=False)
    if res.returncode != 0:
        return []
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def _kill_namespace_processes(netns: str, deadline: float) -> list[int]:
    """SIGKILL everything in ``netns`` until it is empty or the deadline passes.

    Loops because a dying parent may still fork, and because a process that
    was SIGSTOPped still has to be scheduled to die. Returns survivors.
    """
    # A name under /run/netns can be bound to any namespace (`ip netns attach`);
    # one pointing at our own (usually the root) namespace would make this
    # kill every process on the machine, the caller included. Refuse.
    try:
        target, own = os.stat(f"/run/netns/{netns}"), os.stat("/proc/self/ns/net")
        if (target.st_dev, target.st_ino) == (own.st_dev, own.st_ino):
            raise NetnsError(f"namespace {netns} is the caller's own network namespace; not killing its processes")
    except FileNotFoundError:
        return []
    while True:
        pids = namespace_pids(netns)
        if not pids:
            return []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            return namespace_pids(netns)
        time.sleep(0.05)


def _delete_namespace(netns: str) -> None:
    res = run_cmd(["ip", "netns", "delete", netns], check=False)
    if res.returncode != 0 and netns in list_namespaces():
        raise NetnsError(f"ip netns delete {netns} failed: {res.stderr.strip()}")


_ROUTE_TYPES = {"unicast", "local", "broadcast", "multicast", "anycast", "blackhole",
                "unreachable", "prohibit", "throw", "nat"}


def _root_prefixes() -> list[ipaddress.IPv4Network]:
    """Non-default IPv4 prefixes routed or assigned in the root namespace (read only)."""
    nets: list[ipaddress.IPv4Network] = []
    routes = run_cmd(["ip", "-4", "route", "show", "table", "all"]).stdout
    for line in routes.splitlines():
        words = line.split()
        if words and words[0] in _ROUTE_TYPES:
            words = words[1:]  # "local 127.0.0.0/8 dev lo ..." -> the prefix
        if not words or words[0] == "default":
            continue
        try:
            nets.append(ipaddress.IPv4Network(words[0], strict=False))
        except ValueError:
            continue
    addrs = run_cmd(["ip", "-4", "-o", "addr", "show"]).stdout
    for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", addrs):
        nets.append(ipaddress.IPv4Network(m.group(1), strict=False))
    # A /0 (the default route) overlaps everything and says nothing about use.
    return [n for n in nets if n.prefixlen > 0]


def choose_subnet(
    run_id: str, in_use: Iterable[ipaddress.IPv4Network], requested: str | None = None
) -> ipaddress.IPv4Network:
    """The /24 this run uses: ``requested`` if free, else one picked from the run id.

    Raises :class:`SubnetInUse` when the requested subnet (or every /24 of the
    pool) overlaps something the root namespace already routes: even though our
    hosts are isolated, an overlapping subnet makes addresses in logs ambiguous
    and would shadow a real network if anyone ever bridged to the root.
    """
    used = list(in_use)
    if requested is not None:
        net = ipaddress.IPv4Network(requested)
        clash = [str(u) for u in used if u.overlaps(net)]
        if clash:
            raise SubnetInUse(f"test subnet {net} overlaps {', '.join(clash)} in the root namespace")
        return net
    subnets = list(SUBNET_POOL.subnets(new_prefix=24))
    start = int(run_id, 36) % len(subnets)
    for k in range(len(subnets)):
        net = subnets[(start + k) % len(subnets)]
        if not any(u.overlaps(net) for u in used):
            return net
    raise SubnetInUse(f"every /24 of {SUBNET_POOL} overlaps a root-namespace route")


# ---------------------------------------------------------------------------
# Run lock: tells a live run from a dead run's leftovers


def _lock_path(prefix: str) -> Path:
    return LOCK_DIR / f"{prefix}.lock"


def _lock_if_free(path: Path, block: bool, create: bool) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None if it is held elsewhere.

    Verifies after locking that ``path`` still names the inode we locked: the
    lock file is only ever unlinked by someone holding its lock, so a
    mismatch means we raced with such an unlink and hold a lock on nothing.
    """
    while True:
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
        if not create:
            return None


class _RunLock:
    """An flock held for the run's lifetime; released by the kernel if we die."""

    def __init__(self, prefix: str) -> None:
        self.path = _lock_path(prefix)
        self.fd: int | None = None

    def acquire(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        # Blocking: a cleaner probing liveness holds the lock only for an instant.
        fd = _lock_if_free(self.path, block=True, create=True)
        assert fd is not None
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still holding the lock
        finally:
            os.close(self.fd)
            self.fd = None


def _run_is_live(prefix: str) -> bool:
    """True while some process holds ``prefix``'s run lock."""
    path = _lock_path(prefix)
    fd = _lock_if_free(path, block=False, create=False)
    if fd is not None:
        os.close(fd)
        return False
    # Either held by a live run, or gone (never created / unlinked by its owner).
    return path.exists()


@dataclass(frozen=True)
class StaleReport:
    """What :func:`cleanup_stale` removed."""

    namespaces: tuple[str, ...]
    killed_pids: tuple[int, ...]
    lock_files: tuple[str, ...]


def cleanup_stale(timeout: float = 10.0) -> StaleReport:
    """Remove leftovers of chaos runs that are no longer alive.

    A namespace named ``phx<run>-...`` is stale when no process holds the run
    lock of ``phx<run>`` (its owner was SIGKILLed, the machine lost power, or
    someone created it by hand). Its processes are SIGKILLed (found through
    ``ip netns pids``, so they need not be our children) and it is deleted.
    Namespaces of live runs are left alone.
    """
    deadline = time.monotonic() + timeout
    namespaces: list[str] = []
    killed: list[int] = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if not m or _run_is_live(m.group(1)):
            continue
        # Host namespaces before the bridge namespace only matters for tidiness:
        # each is independent once its processes are gone.
        pids = namespace_pids(ns)
        survivors = _kill_namespace_processes(ns, deadline)
        if survivors:
            raise NetnsError(f"stale namespace {ns}: processes {survivors} survive SIGKILL")
        killed.extend(pids)
        _delete_namespace(ns)
        namespaces.append(ns)
    locks: list[str] = []
    if LOCK_DIR.is_dir():
        for path in LOCK_DIR.glob(f"{NS_PREFIX}*.lock"):
            fd = _lock_if_free(path, block=False, create=False)
            if fd is None:
                continue  # a live run holds it
            try:
                path.unlink(missing_ok=True)  # only ever unlinked under the lock
                locks.append(str(path))
            finally:
                os.close(fd)
    return StaleReport(tuple(namespaces), tuple(killed), tuple(locks))


# ---------------------------------------------------------------------------
# Hosts and the cluster


@dataclass(eq=False)  # identity: one object per host, usable in sets and as dict keys
class Host:
    """One simulated machine: a network namespace with one address on the bridge."""

    name: str
    az: str | None
    netns: str
    ip: str
    _cluster: "NetnsCluster" = field(repr=False, compare=False)

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` prefixed so that it runs inside this host's namespace.

        Checks here that ``cmd``'s program is installed: ``ip netns exec``
        reports a missing one only as exit code 255, which a health check
        (``etcdctl endpoint health``) would read as "not healthy" until it
        timed out."""
        require_program(cmd[0])
        return ["ip", "netns", "exec", self.netns, *cmd]

    def popen(self, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` inside this host, in its own process group, tracked for teardown.

        ``ip netns exec`` execs the command, so the returned pid is the
        command itself (signals reach it, not a wrapper). Started with
        ``phalanx.procs.spawn``: it also dies when this process dies without
        a teardown (SIGKILL); ``die_with_parent=`` picks the signal.
        """
        if self._cluster.closed:
            raise NetnsError(f"host {self.name}: its cluster was torn down")
        kw.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = spawn(self.wrap(cmd), **kw)
        self._cluster.track(proc)
        return proc

    def run(
        self, cmd: Sequence[str], *, timeout: float = 30.0, check: bool = False, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run a short command inside this host and wait for it (not tracked: it is waited)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.wrap(cmd), timeout=timeout, check=check, **kw)

    def iptables(self, *args: str) -> None:
        """Run ``iptables ARGS`` inside this host's namespace (never the root's)."""
        run_cmd(self.wrap(["iptables", "-w", *args]))

    def iptables_save(self) -> str:
        """This host's filter rules (``iptables-save``), for checks and reports."""
        return run_cmd(self.wrap(["iptables-save"])).stdout

    def pids(self) -> list[int]:
        """Live processes inside this host's namespace."""
        return namespace_pids(self.netns)


class NetnsCluster:
    """Build, use and tear down a set of namespace hosts on one bridge.

    Use as a context manager; teardown also runs at interpreter exit and on
    SIGINT/SIGTERM, and is idempotent::

        with NetnsCluster() as net:
            a = net.add_host("etcd-a", az="a")
            b = net.add_host("etcd-b", az="b")
            a.popen(["python", "-m", "chaos.probe", "serve", "--port", "7000"])
    """

    def __init__(
        self,
        run_id: str | None = None,
        subnet: str | None = None,
        clean_stale: bool = True,
        need_iptables: bool = True,
    ) -> None:
        self.run_id = run_id or secrets.token_hex(3)
        if not re.fullmatch(r"[0-9a-z]{1,8}", self.run_id):
            raise ValueError(f"run id {self.run_id!r}: use 1-8 lower-case alphanumerics")
        self.prefix = f"{NS_PREFIX}{self.run_id}"
        self.bridge_ns = f"{self.prefix}-{BRIDGE_HOST}"
        self._requested_subnet = subnet
        self._clean_stale = clean_stale
        self._need_iptables = need_iptables
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: dict[str, Host] = {}
        self._procs: list[subprocess.Popen[Any]] = []
        self._created_ns: list[str] = []
        self._lock = _RunLock(self.prefix)
        self._mutex = threading.RLock()
        self._started = False
        self._closed = False
        self.stale_report: StaleReport | None = None

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> "NetnsCluster":
        """Check the machine, clean old leftovers, create the bridge namespace."""
        with self._mutex:
            if self._started:
                return self
            if self._closed:
                raise NetnsError("this NetnsCluster was torn down; build a new one")
            preflight(self._need_iptables)
            if self._clean_stale:
                self.stale_report = cleanup_stale()
            self.subnet = choose_subnet(self.run_id, _root_prefixes(), self._requested_subnet)
            self._lock.acquire()
            _register(self)
            self._started = True
            try:
                self._create_ns(self.bridge_ns)
                bridge = ["ip", "-n", self.bridge_ns]
                try:
                    run_cmd([*bridge, "link", "add", BRIDGE_DEV, "type", "bridge"])
                except NetnsError as e:
                    raise ChaosEnvironmentError(
                        f"chaos suite cannot run here: cannot create a Linux bridge ({e}); "
                        "the kernel needs the bridge module"
                    ) from e
                run_cmd([*bridge, "link", "set", BRIDGE_DEV, "up"])
                run_cmd([*bridge, "link", "set", "lo", "up"])
            except BaseException:
                self.teardown()
                raise
            return self

    def __enter__(self) -> "NetnsCluster":
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.teardown()

    def _create_ns(self, name: str) -> None:
        # Recorded before creation so that a half-made namespace is still removed.
        self._created_ns.append(name)
        try:
            run_cmd(["ip", "netns", "add", name])
        except NetnsError as e:
            if "exists" in str(e):
                self._created_ns.remove(name)  # someone else's: never delete it
                raise NetnsError(f"namespace {name} exists already (run id reused?)") from e
            raise ChaosEnvironmentError(
                f"chaos suite cannot run here: cannot create network namespace {name} ({e})"
            ) from e

    # -- hosts -------------------------------------------------------------

    def add_host(self, name: str, az: str | None = None) -> Host:
        """Create host ``name`` (namespace ``phx<run>-<name>``) on the bridge; returns it."""
        with self._mutex:
            if self._closed:
                raise NetnsError(f"cluster {self.prefix} was torn down")
            if not self._started:
                self.start()
            if not _HOST_RE.match(name) or name == BRIDGE_HOST:
                raise ValueError(
                    f"host name {name!r}: use 1-32 of [a-z0-9-], starting alphanumeric, not {BRIDGE_HOST!r}"
                )
            if name in self.hosts:
                raise ValueError(f"host {name!r} exists already")
            assert self.subnet is not None
            index = len(self.hosts) + 1
            if index >= self.subnet.num_addresses - 1:
                raise NetnsError(f"subnet {self.subnet} is full")
            ip = str(self.subnet.network_address + index)
            netns = f"{self.prefix}-{name}"
            # The bridge-side end lives only in the bridge namespace, so its
            # name need only be unique there; the index keeps it unique even
            # when two host names share their first characters.
            port = f"v{index}-{name}"[:IFNAMSIZ]
            self._create_ns(netns)
            # Created inside the bridge namespace with the peer moved straight
            # into the host namespace: neither end ever exists in the root.
            run_cmd(["ip", "-n", self.bridge_ns, "link", "add", port, "type", "veth",
                     "peer", "name", HOST_DEV, "netns", netns])
            run_cmd(["ip", "-n", self.bridge_ns, "link", "set", port, "master", BRIDGE_DEV])
            run_cmd(["ip", "-n", self.bridge_ns, "link", "set", port, "up"])
            run_cmd(["ip", "-n", netns, "addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", HOST_DEV])
            run_cmd(["ip", "-n", netns, "link", "set", HOST_DEV, "up"])
            run_cmd(["ip", "-n", netns, "link", "set", "lo", "up"])
            host = Host(name=name, az=az, netns=netns, ip=ip, _cluster=self)
            self.hosts[name] = host
            return host

    def host(self, name: str) -> Host:
        """The host called ``name``."""
        return self.hosts[name]

    def hosts_in(self, az: str) -> list[Host]:
        """Hosts of availability zone ``az``, in creation order."""
        return [h for h in self.hosts.values() if h.az == az]

    def namespaces(self) -> list[str]:
        """All namespaces this run created and has not yet deleted."""
        return list(self._created_ns)

    def describe(self) -> dict[str, Any]:
        """The layout as plain data, for logs and chaos reports."""
        return {
            "run_id": self.run_id,
            "bridge_ns": self.bridge_ns,
            "subnet": str(self.subnet),
            "hosts": [
                {"name": h.name, "az": h.az, "netns": h.netns, "ip": h.ip}
                for h in self.hosts.values()
            ],
        }

    # -- processes ---------------------------------------------------------

    def track(self, proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
        """Have teardown SIGKILL ``proc``'s process group (for processes started elsewhere,
        e.g. :class:`phalanx.etcd_server.EtcdServer`)."""
        with self._mutex:
            self._procs.append(proc)
        return proc

    def tracked(self) -> list[subprocess.Popen[Any]]:
        """Every process tracked so far (live or not)."""
        return list(self._procs)

    # -- teardown ----------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def teardown(self, timeout: float = 15.0) -> None:
        """Kill every process and delete every namespace of this run. Idempotent.

        Order matters: a namespace with a process still in it outlives
        ``ip netns delete`` (only its name goes away), so processes die first.
        """
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            deadline = time.monotonic() + timeout
            errors: list[str] = []
            for proc in self._procs:
                # Group first: a tracked process may have children of its own.
                # Only while unreaped: a reaped pid may already belong to a
                # stranger's new group (our orphans are caught below by pid).
                if proc.poll() is not None:
                    continue
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            for ns in reversed(self._created_ns):
                survivors = _kill_namespace_processes(ns, deadline)
                if survivors:
                    errors.append(f"{ns}: pids {survivors} survive SIGKILL")
            for proc in self._procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    errors.append(f"pid {proc.pid} did not exit after SIGKILL")
            # Host namespaces first; deleting each removes its eth0 and, with
            # it, the veth peer in the bridge namespace and its iptables rules.
            for ns in reversed(self._created_ns):
                try:
                    _delete_namespace(ns)
                except NetnsError as e:
                    errors.append(str(e))
            self._created_ns.clear()
            self._lock.release()
            _unregister(self)
            if errors:
                raise NetnsError("teardown incomplete: " + "; ".join(errors))


# ---------------------------------------------------------------------------
# Exit and signal safety net: tear down every live cluster of this process


_live: "weakref.WeakSet[NetnsCluster]" = weakref.WeakSet()
_prev_handlers: dict[int, Any] = {}
_registry_lock = threading.Lock()
_atexit_registered = False


def _teardown_all() -> None:
    for cluster in list(_live):
        try:
            cluster.teardown()
        except Exception as e:  # best effort at exit: report, keep going
            print(f"chaos: teardown of {cluster.prefix} failed: {e}", file=sys.stderr)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _teardown_all()
    prev = _prev_handlers.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt
    elif prev == signal.SIG_IGN:
        return
    else:
        # Default action (terminate) with the right exit status for the parent.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _register(cluster: NetnsCluster) -> None:
    global _atexit_registered
    with _registry_lock:
        _live.add(cluster)
        if not _atexit_registered:
            atexit.register(_teardown_all)
            _atexit_registered = True
        # Python only lets the main thread install handlers; from another thread
        # we rely on atexit and on cleanup_stale in the next run.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not _on_signal:
                    _prev_handlers[sig] = signal.getsignal(sig)
                    signal.signal(sig, _on_signal)


def _unregister(cluster: NetnsCluster) -> None:
    with _registry_lock:
        _live.discard(cluster)
        if _live or threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in list(_prev_handlers.items()):
            # Restore only if nobody replaced our handler in the meantime.
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
            del _prev_handlers[sig]
