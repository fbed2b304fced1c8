"""``phalanx up``: a whole multi-AZ cluster on one machine, for trying Phalanx.

Starts (each in its own process group, output in ``<state-dir>/logs/``):

- etcd (``phalanx.etcd_server.EtcdServer`` under ``<state-dir>/etcd``) unless
  ``--etcd`` points at one;
- per AZ (``az-a``, ``az-b``, ...): M coordinator replicas
  (``python -m coordinator``) and one process of K simulated node agents
  (``python -m agent.sim``);

then prints ``PHALANX_ADDRESS=host:port,...`` (every coordinator) once every AZ
has a leader, and, unless ``--no-workload``, submits the specs in
``examples/`` in a loop and prints a progress line every ~2 s.

Ctrl-C / SIGTERM: stop the workload, SIGTERM every child group, wait, SIGKILL
stragglers, stop etcd, remove the state dir if ``up`` created it (a
``--state-dir`` given by the user is kept, etcd data included, so the next
``up`` with the same dir finds its gangs again). Exit code 0 after a clean
shutdown, 1 when start-up failed, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from phalanx.client import AsyncClient, is_terminal, state_name
from phalanx.errors import AlreadyExists, PhalanxError, Unimplemented
from phalanx.etcd_server import EtcdServer, free_port
from phalanx.model import GangState
from phalanx.spec import load_spec

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = REPO_ROOT / "examples"
MAX_AZS = len(string.ascii_lowercase)

# Gangs whose records still hold or wait for devices.
LIVE_STATES = frozenset(s for s in GangState if not s.terminal)
# Reaching any of these means the gang was admitted (all members placed).
ADMITTED_STATES = frozenset(
    {GangState.RESERVED, GangState.STARTING, GangState.RUNNING, GangState.RESTARTING, GangState.SUCCEEDED}
)

PROGRESS_EVERY_S = 2.0
POLL_EVERY_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--azs", type=int, default=3, help="number of AZs (az-a, az-b, ...), default 3")
    p.add_argument("--coordinators-per-az", type=int, default=2, help="coordinator replicas per AZ, default 2")
    p.add_argument("--nodes-per-az", type=int, default=8, help="simulated nodes per AZ, default 8")
    p.add_argument("--spines", type=int, default=None, help="spines per AZ (default: the simulator's)")
    p.add_argument("--leaves-per-spine", type=int, default=None, help="leaves per spine (default: the simulator's)")
    p.add_argument("--etcd", default="", help="use this etcd (host:port[,...]) instead of starting one")
    p.add_argument("--no-workload", action="store_true", help="start the cluster only")
    p.add_argument("--launch", action="store_true", help="agents launch members as real processes")
    p.add_argument("--state-dir", default="", help="keep etcd data and logs here (default: a temp dir, removed on exit)")
    p.add_argument("--cluster", default="local", help="cluster name (etcd key prefix), default local")
    p.add_argument(
        "--base-port", type=int, default=7070,
        help="first coordinator port (then +1, ...; a taken port falls back to a free one); 0: free ports only",
    )
    p.add_argument("--gangs-per-az", type=int, default=3, help="workload: live gangs kept per AZ, default 3")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds to wait for the cluster to come up")


@dataclass(frozen=True)
class UpConfig:
    azs: tuple[str, ...]
    coordinators_per_az: int
    nodes_per_az: int
    spines: int | None
    leaves_per_spine: int | None
    etcd: str
    workload: bool
    launch: bool
    state_dir: str
    cluster: str
    base_port: int
    gangs_per_az: int
    start_timeout: float

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "UpConfig":
        """Validate every flag together; ValueError names the first bad one."""
        if not 1 <= a.azs <= MAX_AZS:
            raise ValueError(f"--azs must be between 1 and {MAX_AZS}, got {a.azs}")
        for flag, value in (
            ("--coordinators-per-az", a.coordinators_per_az),
            ("--nodes-per-az", a.nodes_per_az),
            ("--gangs-per-az", a.gangs_per_az),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        for flag, value in (("--spines", a.spines), ("--leaves-per-spine", a.leaves_per_spine)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        count = a.azs * a.coordinators_per_az
        if a.base_port != 0 and not 1024 <= a.base_port <= 65535 - count:
            raise ValueError(f"--base-port must be 0 or between 1024 and {65535 - count}, got {a.base_port}")
        if not re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", a.cluster or ""):
            raise ValueError(f"--cluster must be a DNS label, got {a.cluster!r}")
        if not a.start_timeout > 0:
            raise ValueError(f"--start-timeout must be positive, got {a.start_timeout}")
        return cls(
            azs=tuple(f"az-{string.ascii_lowercase[i]}" for i in range(a.azs)),
            coordinators_per_az=a.coordinators_per_az,
            nodes_per_az=a.nodes_per_az,
            spines=a.spines,
            leaves_per_spine=a.leaves_per_spine,
            etcd=normalize_etcd(a.etcd),
            workload=not a.no_workload,
            launch=a.launch,
            state_dir=a.state_dir,
            cluster=a.cluster,
            base_port=a.base_port,
            gangs_per_az=a.gangs_per_az,
            start_timeout=a.start_timeout,
        )


def normalize_etcd(value: str) -> str:
    """``http://h:p, h2:p2`` -> ``h:p,h2:p2`` (the coordinators want host:port)."""
    out = []
    for item in value.split(","):
        item = item.strip().rstrip("/")
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        if item:
            out.append(item)
    return ",".join(out)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR like the gRPC server itself: a TIME_WAIT leftover does
        # not make a port unusable, a listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_ports(base: int, count: int) -> list[int]:
    """``base, base+1, ...`` so PHALANX_ADDRESS is the same from run to run;
    any taken port (or all, with base 0) replaced by a free one."""
    ports: list[int] = []
    for i in range(count):
        port = base + i if base else 0
        if not port or not port_is_free(port):
            port = free_port()
            while port in ports:
                port = free_port()
        ports.append(port)
    return ports


# --- child processes -------------------------------------------------------------


@dataclass
class Child:
    """One process group started by ``up``."""

    name: str
    kind: str  # "coordinator" | "agents"
    az: str
    argv: list[str]
    log_path: Path
    ready: re.Pattern[str]
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""
    is_ready: bool = False
    reported_exit: bool = False
    starts: int = 0
    _log_offset: int = 0
    _log_text: str = ""

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self._log_offset = out.tell()
            self._log_text = ""
            # start_new_session: our own process group, so the terminal's
            # Ctrl-C reaches only `up`, which then shuts children down in order.
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            )
        self.starts += 1
        self.is_ready = False
        self.reported_exit = False

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_ready(self) -> bool:
        """Scan new log output for the readiness line (and the real address)."""
        if self.is_ready:
            return True
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                self._log_text += f.read().decode("utf-8", "replace")
                self._log_offset = f.tell()
        except OSError:
            return False
        m = self.ready.search(self._log_text)
        if m:
            self.is_ready = True
            if self.kind == "coordinator":
                self.address = m.group(1)
            self._log_text = ""
        elif len(self._log_text) > 1 << 20:
            self._log_text = self._log_text[-4096:]  # bound memory on a chatty child
        return self.is_ready

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Readiness lines are read from log files: never sit in a stdio buffer.
    env["PYTHONUNBUFFERED"] = "1"
    # `python -m coordinator` / `agent.sim` from this checkout, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def build_children(cfg: UpConfig, etcd: str, ports: list[int], logs: Path, agents_dir: Path) -> list[Child]:
    children: list[Child] = []
    port_iter = iter(ports)
    for az in cfg.azs:
        for j in range(cfg.coordinators_per_az):
            cid = f"{az}-c{j}"
            children.append(
                Child(
                    name=cid, kind="coordinator", az=az,
                    argv=[
                        sys.executable, "-m", "coordinator", "--cluster", cfg.cluster, "--az", az, "--id", cid,
                        "--etcd", etcd, "--listen", f"127.0.0.1:{next(port_iter)}",
                    ],
                    log_path=logs / f"{cid}.log",
                    ready=re.compile(rf"^PHALANX_COORDINATOR_READY id={re.escape(cid)} az=\S+ address=(\S+)\s*$", re.M),
                )
            )
    for az in cfg.azs:
        argv = [
            sys.executable, "-m", "agent.sim", "--cluster", cfg.cluster, "--az", az, "--etcd", etcd,
            "--nodes", str(cfg.nodes_per_az),
        ]
        if cfg.spines is not None:
            argv += ["--spines", str(cfg.spines)]
        if cfg.leaves_per_spine is not None:
            argv += ["--leaves-per-spine", str(cfg.leaves_per_spine)]
        if cfg.launch:
            # One dir per AZ process: each keeps its own members.json.
            argv += ["--launch", "--state-dir", str(agents_dir / az)]
        children.append(
            Child(
                name=f"{az}-agents", kind="agents", az=az, argv=argv, log_path=logs / f"{az}-agents.log",
                ready=re.compile(rf"^PHALANX_AGENTS_READY az={re.escape(az)} nodes=\d+\s*$", re.M),
            )
        )
    return children


# --- the run ----------------------------------------------------------------------


class StartupFailed(Exception):
    pass


class Up:
    def __init__(self, cfg: UpConfig, out: TextIO = sys.stdout, err: TextIO = sys.stderr):
        self.cfg = cfg
        self.out = out
        self.err = err
        self.state_dir = Path()
        self.created_state_dir = False
        self.etcd: EtcdServer | None = None
        self.children: list[Child] = []
        self.addresses: list[str] = []
        self.hurry = False  # a second Ctrl-C: skip the grace period

    def say(self, text: str) -> None:
        print(f"phalanx up: {text}", file=self.out, flush=True)

    def warn(self, text: str) -> None:
        print(f"phalanx up: {text}", file=self.err, flush=True)

    async def main(self) -> int:
        """Start, serve until cancelled (signal), always clean up."""
        code = 0
        try:
            await self.start()
            await self.serve()
        except asyncio.CancelledError:
            pass  # the signal handler cancelled us: a normal shutdown
        except StartupFailed as exc:
            self.warn(f"error: {exc}")
            code = 1
        finally:
            await self.shutdown(keep_logs=code != 0)
        return code

    async def start(self) -> None:
        cfg = self.cfg
        if cfg.state_dir:
            self.state_dir = Path(cfg.state_dir).resolve()
            self.state_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.state_dir = Path(tempfile.mkdtemp(prefix="phalanx-up-"))
            self.created_state_dir = True
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        kept = "kept" if not self.created_state_dir else "removed on exit"
        self.say(f"state dir {self.state_dir} ({kept}); logs in {logs}")

        etcd = cfg.etcd
        if not etcd:
            self.etcd = EtcdServer(data_dir=self.state_dir / "etcd", name="phalanx-up", log_path=logs / "etcd.log")
            try:
                self.etcd.start()
            except Exception as exc:  # EtcdNotFound, OSError
                raise StartupFailed(f"cannot start etcd: {exc}") from None
            await self._wait_etcd(self.etcd)
            etcd = self.etcd.endpoint
            self.say(f"etcd at {etcd}")
        else:
            self.say(f"using etcd at {etcd}")

        ports = pick_ports(cfg.base_port, len(cfg.azs) * cfg.coordinators_per_az)
        self.children = build_children(cfg, etcd, ports, logs, self.state_dir / "agents")
        env = child_env()
        for child in self.children:
            child.start(env)
        self.say(
            f"started {', '.join(cfg.azs)} (cluster {cfg.cluster!r}), each with {cfg.coordinators_per_az} "
            f"coordinator(s) and {cfg.nodes_per_az} simulated node(s); waiting for leaders"
        )
        deadline = time.monotonic() + cfg.start_timeout
        await self._wait_children_ready(env, deadline)
        addresses = [c.address for c in self.children if c.kind == "coordinator"]
        await self._wait_leaders(addresses, deadline)
        # Exactly one such line, flushed: scripts and tests wait for it.
        print(f"PHALANX_ADDRESS={','.join(addresses)}", file=self.out, flush=True)
        self.addresses = addresses
        if cfg.launch:
            self.say(f"member logs: phalanx logs GANG --state-dir {self.state_dir / 'agents'}")

    async def _wait_etcd(self, etcd: EtcdServer) -> None:
        deadline = time.monotonic() + min(self.cfg.start_timeout, 60.0)
        while time.monotonic() < deadline:
            if etcd.proc is not None and etcd.proc.poll() is not None:
                raise StartupFailed(f"etcd exited with code {etcd.proc.returncode}; see {etcd.log_path}")
            # healthy() blocks for up to its timeout: keep it off the loop.
            if await asyncio.to_thread(etcd.healthy, 0.5):
                return
            await asyncio.sleep(0.1)
        raise StartupFailed(f"etcd not healthy after {min(self.cfg.start_timeout, 60.0):g}s; see {etcd.log_path}")

    async def _wait_children_ready(self, env: dict[str, str], deadline: float) -> None:
        while True:
            pending = [c for c in self.children if not c.check_ready()]
            if not pending:
                return
            for c in pending:
                if c.alive():
                    continue
                code = c.proc.returncode if c.proc is not None else None
                # A coordinator that died before serving most likely lost a
                # race for its port: try again on a fresh one, twice at most.
                if c.kind == "coordinator" and c.starts < 3:
                    c.argv[-1] = f"127.0.0.1:{free_port()}"
                    self.warn(f"{c.name} exited with code {code} before serving; retrying on {c.argv[-1]}")
                    c.start(env)
                    continue
                raise StartupFailed(
                    f"{c.name} exited with code {code} before it was ready; last lines of {c.log_path}:\n{c.log_tail()}"
                )
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise StartupFailed(f"not ready after {self.cfg.start_timeout:g}s: {names}; logs in {self.state_dir / 'logs'}")
            await asyncio.sleep(0.1)

    async def _wait_leaders(self, addresses: list[str], deadline: float) -> None:
        wanted = set(self.cfg.azs)
        missing = wanted
        async with AsyncClient(addresses, timeout=5.0) as client:
            while True:
                try:
                    st = await client.status()
                    missing = wanted - {az.az for az in st.azs if az.has_leader}
                    if not missing:
                        return
                except PhalanxError:
                    pass  # not serving yet, or etcd unreachable for a moment
                for c in self.children:
                    if not c.alive():
                        raise StartupFailed(f"{c.name} exited with code {c.proc.returncode if c.proc else None}; see {c.log_path}")
                if time.monotonic() > deadline:
                    raise StartupFailed(
                        f"no leader after {self.cfg.start_timeout:g}s in {', '.join(sorted(missing))} "
                        "(is etcd reachable? see the coordinator logs)"
                    )
                await asyncio.sleep(0.2)

    async def serve(self) -> None:
        workload: asyncio.Task[None] | None = None
        if self.cfg.workload:
            workload = asyncio.create_task(Workload(self).run())
        else:
            self.say("no workload; Ctrl-C to stop")
        try:
            while True:
                self._report_exits()
                if workload is not None and workload.done() and not workload.cancelled():
                    exc = workload.exception()
                    if exc is not None:
                        self.warn(f"workload stopped: {exc!r}")
                    workload = None
                await asyncio.sleep(0.5)
        finally:
            if workload is not None:
                workload.cancel()
                await asyncio.gather(workload, return_exceptions=True)

    def _report_exits(self) -> None:
        for c in self.children:
            if c.proc is not None and not c.reported_exit and c.proc.poll() is not None:
                c.reported_exit = True
                self.warn(f"warning: {c.name} exited with code {c.proc.returncode}; last lines of {c.log_path}:\n{c.log_tail(10)}")

    async def shutdown(self, keep_logs: bool = False) -> None:
        """Children first (they resign leadership and stop members), then etcd,
        then the state dir. Every step runs even if an earlier one failed.
        ``keep_logs``: after a failed start, a state dir we created keeps its
        logs (only) so the failure can be diagnosed."""
        live = [c for c in self.children if c.alive()]
        if live:
            self.say(f"stopping {len(live)} process(es)")
        for c in self.children:
            c.signal_group(signal.SIGTERM)
        grace = 15.0
        deadline = time.monotonic() + grace
        while any(c.alive() for c in self.children) and time.monotonic() < deadline and not self.hurry:
            await asyncio.sleep(0.05)
        stragglers = [c.name for c in self.children if c.alive()]
        if stragglers:
            self.warn(f"killing {', '.join(stragglers)} (no exit {'' if self.hurry else f'{grace:g}s '}after SIGTERM)")
        for c in self.children:
            # Also for leaders that exited: kill whatever they left in their group.
            c.signal_group(signal.SIGKILL)
        for c in self.children:
            if c.proc is not None:
                try:
                    c.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.warn(f"{c.name} (pid {c.pid}) did not die after SIGKILL")
        if self.etcd is not None:
            try:
                await asyncio.to_thread(self.etcd.stop)
            except Exception as exc:
                self.warn(f"stopping etcd: {exc!r}")
        if self.created_state_dir and keep_logs:
            for entry in self.state_dir.iterdir():
                if entry.name != "logs":
                    shutil.rmtree(entry, ignore_errors=True)
            self.warn(f"logs kept in {self.state_dir / 'logs'}")
        elif self.created_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        self.say("stopped")


# --- sample workload ------------------------------------------------------------------


@dataclass(frozen=True)
class Template:
    """A spec from examples/, as plain data, and where it may be used."""

    label: str
    data: dict[str, Any]
    cross_az: bool = False
    real_command: bool = False


def load_templates(examples: Path = EXAMPLES_DIR) -> list[Template]:
    """Every valid examples/*.yaml; a spec that fails validation is skipped
    (the unit tests keep them valid)."""
    out = []
    for path in sorted(examples.glob("*.yaml")):
        try:
            spec = load_spec(path.read_text())
        except (OSError, ValueError):
            continue
        data = spec.to_dict()
        out.append(
            Template(
                label=spec.name,
                data=data,
                cross_az=spec.topology.may_span_azs,
                real_command=path.stem == "real-command",
            )
        )
    if not out:
        # Installed without the examples directory: one small built-in gang.
        out.append(Template("tiny", {"name": "tiny", "members": 8, "resources": {"gpus": 1}}))
    return out


def runnable(t: Template) -> bool:
    """With --launch members really run: leave out templates whose program is
    not installed here (e.g. torchrun), they could only fail."""
    command = t.data.get("run", {}).get("command") or []
    return not command or shutil.which(command[0]) is not None


def fit_template(t: Template, nodes: int, gpus_per_node: int, azs: int, seq: int) -> dict[str, Any]:
    """Shrink a template so it fits in about half an AZ (the whole cluster for
    a cross-AZ gang), give it a unique name and a short simulated run."""
    data = yaml.safe_load(yaml.safe_dump(t.data))  # deep copy
    gpus = max(1, min(int(data["resources"]["gpus"]), gpus_per_node))
    per_node = max(1, gpus_per_node // gpus)
    capacity = nodes * per_node * (azs if t.cross_az else 1)
    data["resources"]["gpus"] = gpus
    data["members"] = max(1, min(int(data["members"]), capacity // 2 if capacity > 1 else 1))
    data["resources"]["rdma_nics"] = min(int(data["resources"].get("rdma_nics", 0)), gpus)
    data["name"] = f"{t.label}-{seq}"[:53].rstrip("-")
    data.setdefault("run", {})["duration_s"] = float(5 + (seq % 4) * 5)
    # Fail fast rather than block the queue when the simulated topology cannot
    # satisfy a template's constraints.
    data.setdefault("policy", {})["admission_timeout_s"] = 120.0
    return data


class Workload:
    """Keeps ``gangs_per_az`` live gangs per AZ, submitted to that AZ's
    coordinators (the receiving AZ owns a gang), and prints progress."""

    def __init__(self, up: Up):
        self.up = up
        cfg = up.cfg
        self.templates = [
            t for t in load_templates()
            if (len(cfg.azs) > 1 or not t.cross_az)
            and (runnable(t) if cfg.launch else not t.real_command)
        ]
        by_az: dict[str, list[str]] = {az: [] for az in cfg.azs}
        for c in up.children:
            if c.kind == "coordinator":
                by_az[c.az].append(c.address)
        # Each AZ's own coordinators first, the others as fallback.
        self.clients = {
            az: AsyncClient(addrs + [a for other, xs in by_az.items() if other != az for a in xs], timeout=5.0)
            for az, addrs in by_az.items()
        }
        self.live: dict[str, tuple[str, GangState]] = {}  # gang id -> (az, state)
        self.finished: Counter[str] = Counter()
        self.admitted: set[str] = set()
        self.seq = itertools.count(1)
        self.rotation = {az: itertools.cycle(range(len(self.templates))) for az in cfg.azs}
        for i, az in enumerate(cfg.azs):  # AZs start at different templates
            for _ in range(i % max(1, len(self.templates))):
                next(self.rotation[az])
        self.capacity: dict[str, tuple[int, int]] = {}  # az -> (nodes, gpus per node)
        self.errors_shown = 0
        self.disabled: set[str] = set()

    def _next_template(self, az: str) -> Template | None:
        for _ in range(len(self.templates)):
            template = self.templates[next(self.rotation[az])]
            if template.label not in self.disabled:
                return template
        return None

    async def run(self) -> None:
        try:
            await self._learn_capacity()
            self.up.say(f"workload: {', '.join(t.label for t in self.templates)}; {self.up.cfg.gangs_per_az} live gang(s) per AZ")
            started = last_print = last_poll = time.monotonic()
            last_admitted = 0
            while True:
                await self._top_up()
                now = time.monotonic()
                if now - last_poll >= POLL_EVERY_S:
                    await self._poll()
                    last_poll = now
                if now - last_print >= PROGRESS_EVERY_S:
                    rate = (len(self.admitted) - last_admitted) / (now - last_print)
                    last_admitted, last_print = len(self.admitted), now
                    print(self.progress_line(now - started, rate), file=self.up.out, flush=True)
                await asyncio.sleep(0.25)
        finally:
            for client in self.clients.values():
                await client.close()

    async def _learn_capacity(self) -> None:
        """Nodes and GPUs per node of every AZ, once its agents registered
        (bounded wait: the workload adapts to whatever has registered)."""
        cfg = self.up.cfg
        client = next(iter(self.clients.values()))
        deadline = time.monotonic() + 30.0
        while True:
            try:
                st = await client.status()
                self.capacity = {
                    az.az: (az.nodes_total, az.gpus_total // az.nodes_total if az.nodes_total else 8)
                    for az in st.azs
                }
            except PhalanxError:
                pass
            if all(self.capacity.get(az, (0, 0))[0] >= cfg.nodes_per_az for az in cfg.azs):
                return
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.5)

    async def _top_up(self) -> None:
        cfg = self.up.cfg
        per_az = Counter(az for az, _ in self.live.values())
        for az in cfg.azs:
            if per_az[az] >= cfg.gangs_per_az:
                continue
            template = self._next_template(az)
            if template is None:
                return  # every template was refused by this server version
            nodes, gpus_per_node = self.capacity.get(az, (cfg.nodes_per_az, 8))
            data = fit_template(template, max(nodes, 1), max(gpus_per_node, 1), len(cfg.azs), next(self.seq))
            try:
                result = await self.clients[az].submit(data)
            except AlreadyExists:
                continue  # a live gang of that name from an earlier run: next seq
            except Unimplemented as exc:
                # e.g. cross-AZ gangs on a coordinator that cannot place them
                # yet: say so once and leave the template out from now on.
                self.disabled.add(template.label)
                self.up.warn(f"workload: leaving out {template.label}: {exc}")
                continue
            except (PhalanxError, ValueError) as exc:
                self._show_error(f"submit {data['name']} to {az}: {exc}")
                continue
            self.live[result.gang.id] = (az, GangState(result.gang.state or GangState.PENDING))
            per_az[az] += 1

    async def _poll(self) -> None:
        client = next(iter(self.clients.values()))
        try:
            gangs = await client.list(states=LIVE_STATES)
        except PhalanxError as exc:
            self._show_error(f"list: {exc}")
            return
        seen = {g.id: g for g in gangs}
        for gid, (az, _) in list(self.live.items()):
            gang = seen.get(gid)
            if gang is None:
                try:
                    gang = await client.get(gid)
                except PhalanxError:
                    del self.live[gid]  # gone (deleted): nothing to count
                    continue
            state = GangState(gang.state) if gang.state else GangState.PENDING
            if state in ADMITTED_STATES:
                self.admitted.add(gid)
            if is_terminal(gang):
                del self.live[gid]
                self.finished[state_name(gang)] += 1
            else:
                self.live[gid] = (az, state)

    def progress_line(self, elapsed: float, rate: float) -> str:
        counts: Counter[str] = Counter(state.name for _, state in self.live.values())
        counts.update(self.finished)
        order = [s.name for s in GangState]
        shown = ", ".join(f"{name.lower()} {counts[name]}" for name in order if counts[name])
        return f"[{int(elapsed):>4}s] gangs: {shown or 'none yet'} | admitted {len(self.admitted)} ({rate:.1f}/s)"

    def _show_error(self, text: str) -> None:
        # The first few in full, then one line now and then: a flapping
        # cluster must not flood the terminal.
        self.errors_shown += 1
        if self.errors_shown <= 5 or self.errors_shown % 20 == 0:
            self.up.warn(f"workload: {text}")


# --- entry point ----------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """``phalanx up``; returns the exit code."""
    try:
        cfg = UpConfig.from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return asyncio.run(_amain(cfg))


async def _amain(cfg: UpConfig) -> int:
    up = Up(cfg)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    stopping = False

    def on_signal(signame: str) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            up.say(f"{signame}: shutting down")
            task.cancel()
        else:
            up.hurry = True  # second signal: no more grace

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        return await up.main()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


# --- running `phalanx up` from Python (tests, benchmarks, demos) ---------------------------


class UpProcess:
    """``phalanx up ARGS`` in a child process: start it, wait for its
    ``PHALANX_ADDRESS`` line, stop it with a signal.

        with UpProcess(["--no-workload", "--azs", "2", "--base-port", "0"]) as up:
            client = Client(up.address)
    """

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.args = list(args)
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self.address = ""
        self.state_dir: Path | None = None
        self._cond = threading.Condition()

    @property
    def addresses(self) -> list[str]:
        return self.address.split(",") if self.address else []

    def start(self, timeout: float = 240.0) -> "UpProcess":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "up", *self.args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=self.env, cwd=str(REPO_ROOT), start_new_session=True,
        )
        threading.Thread(target=self._read, name="phalanx-up-output", daemon=True).start()
        m = self.wait_for_line(r"^PHALANX_ADDRESS=(\S+)$", timeout)
        self.address = m.group(1)
        sd = self.find_line(r"^phalanx up: state dir (\S+) ")
        self.state_dir = Path(sd.group(1)) if sd else None
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:  # drains the pipe so `up` never blocks on it
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def find_line(self, pattern: str) -> re.Match[str] | None:
        rx = re.compile(pattern)
        with self._cond:
            for line in self.lines:
                m = rx.search(line)
                if m:
                    return m
        return None

    def wait_for_line(self, pattern: str, timeout: float, after: int = 0) -> re.Match[str]:
        """The first output line (from index ``after``) matching ``pattern``."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = after
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = max(seen, len(self.lines))
                exited = self.proc is not None and self.proc.poll() is not None
                left = deadline - time.monotonic()
                if exited or left <= 0:
                    why = f"exited with code {self.proc.returncode}" if exited and self.proc else f"no match after {timeout:g}s"
                    raise RuntimeError(f"phalanx up {why} waiting for {pattern!r}; output:\n" + "\n".join(self.lines[-60:]))
                self._cond.wait(min(left, 0.5))

    def stop(self, sig: int = signal.SIGINT, timeout: float = 120.0) -> int:
        """Signal ``up`` and wait for it; SIGKILL (its group) after ``timeout``."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # `up` is stuck: kill what it started (each child leads its
                # own group), then `up` itself.
                for pgid in child_groups(self.proc.pid):
                    try:
                        os.killpg(pgid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "UpProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def proc_stat(pid: int) -> tuple[int, int, int, str] | None:
    """(ppid, pgid, sid, state) of a live process from /proc; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ")".
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[2]), int(fields[3]), fields[0]


def child_groups(pid: int) -> set[int]:
    """Process groups of the direct children of ``pid`` (Linux /proc)."""
    groups = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None and st[0] == pid:
                groups.add(st[1])
    return groups
