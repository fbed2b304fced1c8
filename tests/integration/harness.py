"""A real local Phalanx cluster for integration tests.

Coordinators are real processes (so tests can SIGKILL / SIGSTOP them);
simulated agents run in the test's event loop (so tests can read their
history). Everything talks over real gRPC on loopback to a real etcd, with
TLS on both (the default a deployment runs with): coordinators and agents
present certificates of the test cluster's CA (tests/pki.py), the test's
stubs an admin client certificate. Coordinators reach etcd as the cluster's
coordinator etcd user (read-write on the cluster's prefix); agents hold no
etcd credentials and read their token check through the coordinators of
their AZ (``--coordinators``; docs/design.md §9.3), as by default. Each
coordinator id keeps one port across restarts, so agents given its address
find it again.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from agent.sim import run_agents
from phalanx import procs
from phalanx.timings import Timings
from coordinator.core.records import GangRecord
from phalanx.reservation import HoldState, Reservation
from coordinator.election import observe
from phalanx.leader_record import LeaderInfo
from phalanx.store import Get, Store
from phalanx.model import GangState
from phalanx.topology import Gpu, Nic, NodeTopology
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import gang_pb2_grpc as ggrpc
from phalanx.v1 import types_pb2 as pb
from tests.pki import ClusterPki, EtcdPki, etcd_pki_for

REPO = Path(__file__).resolve().parents[2]


def dgx_node(name: str, az: str, *, spine: str = "s0", leaf: str = "l0", gpus: int = 8) -> NodeTopology:
    return NodeTopology(
        node=name, az=az, region="local", spine=spine, leaf=leaf,
        gpus=tuple(Gpu(index=i, model="H100", numa_node=i * 2 // gpus, nvlink_island=0) for i in range(gpus)),
        nics=tuple(Nic(name=f"mlx5_{i}", numa_node=i * 2 // gpus, rate_gbps=400, link_layer="Ethernet", rail=i) for i in range(gpus)),
    )


@dataclass
class CoordProc:
    id: str
    az: str
    proc: subprocess.Popen
    address: str
    log_path: Path
    paused: bool = False
    metrics: str = ""  # HOST:PORT of /metrics (started with --metrics-listen)
    # Where this life of the coordinator begins in ``log_path``: a restarted
    # coordinator appends to the file of its earlier lives (the teardown
    # check reads them all), while ``log()`` is this life's.
    log_start: int = 0

    @property
    def usable(self) -> bool:
        return self.proc.poll() is None and not self.paused

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            if sig == signal.SIGSTOP:
                self.paused = True
            elif sig == signal.SIGCONT:
                self.paused = False

    def log(self) -> str:
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_start)
            return f.read().decode(errors="replace")


@dataclass
class AgentGroup:
    az: str
    task: asyncio.Task
    stop: asyncio.Event
    history: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


# --- strict teardown: what a cluster's processes must not say unless the test expects it ---

WHO = ("coordinator", "agent")
# A log entry starts with a text line (logfmt.TextFormatter: "DATE TIME NAME
# LEVEL logger: ...") or a JSON object (--log-format json); anything else (a
# traceback's lines) continues the entry above it.
_ENTRY_START = re.compile(r"^(\{|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \S+ [A-Z]+ )")
_BAD_ENTRY = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \S+ (ERROR|CRITICAL) "
                        r'|^\{.*"level": "(ERROR|CRITICAL)"|Traceback \(most recent call last\)', re.M)
AGENT_CODE = str(REPO / "agent") + os.sep


@dataclass(frozen=True)
class Said:
    """One thing a cluster's process said that a test must expect: an
    ERROR/CRITICAL entry or a traceback in a coordinator's log, an ERROR
    record of an in-process agent, an agent task that ended with an
    exception. ``where`` is the log file and line (coordinator), the source
    line that logged (agent record) or the task; ``text`` the whole entry."""

    who: str
    where: str
    text: str

    def __str__(self) -> str:
        lines = self.text.rstrip().splitlines() or [""]
        shown = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
        return f"{self.who} {self.where}: {shown[:400]}"


def log_entries(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each entry of a log: a line and the
    continuation lines below it (a traceback)."""
    out: list[tuple[int, list[str]]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not out or _ENTRY_START.match(line):
            out.append((n, [line]))
        else:
            out[-1][1].append(line)
    return [(n, "\n".join(lines)) for n, lines in out]


def bad_log_entries(path: Path, who: str = "coordinator") -> list[Said]:
    """The ERROR/CRITICAL entries and tracebacks of the log at ``path``."""
    text = path.read_text(errors="replace") if path.exists() else ""
    return [Said(who, f"{path}:{n}", entry) for n, entry in log_entries(text) if _BAD_ENTRY.search(entry)]


class _AgentRecords(logging.Handler):
    """Collects ERROR+ records of the ``agent`` loggers into a list."""

    def __init__(self, sink: list[Said]):
        super().__init__(logging.ERROR)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info))
        self.sink.append(Said("agent", f"{record.pathname}:{record.lineno}", text))


def _task_failure(task: asyncio.Task) -> Said | None:
    if task.cancelled() or task.exception() is None:
        return None
    exc = task.exception()
    assert exc is not None
    return Said("agent", f"task {task.get_name()}",
                f"task {task.get_name()} ended with {exc!r}\n" + "".join(traceback.format_exception(exc)))


class _LoopWatch:
    """For a cluster's lifetime, in the test's event loop: every task whose
    coroutine is agent code (what ``run_agents`` and the agents spawn) that
    ends with an exception, and whatever the loop's exception handler gets
    (asyncio's "Task exception was never retrieved", an exception in a
    callback), land in ``sink``. Chains to the loop's previous task factory
    and handler, and restores them on ``close`` when still its own."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sink: list[Said]):
        self.loop, self.sink, self.active = loop, sink, True
        self.prev_factory = loop.get_task_factory()
        self.prev_handler = loop.get_exception_handler()
        loop.set_task_factory(self.factory)
        loop.set_exception_handler(self.handler)

    def factory(self, loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Future:
        if self.prev_factory is not None:
            task = self.prev_factory(loop, coro, **kw)
        else:
            task = asyncio.Task(coro, loop=loop, **kw)
        code = getattr(coro, "cr_code", None)
        if code is not None and code.co_filename.startswith(AGENT_CODE):
            task.add_done_callback(self.done)
        return task

    def done(self, task: asyncio.Task) -> None:
        failure = _task_failure(task)
        if failure is not None and self.active:
            self.sink.append(failure)

    def handler(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # Only reports of an exception: a pending task destroyed at the end
        # (gRPC's own stream helpers are) failed nothing.
        exc = context.get("exception")
        if self.active and exc is not None:
            text = f"{context.get('message', '')}\n" + "".join(traceback.format_exception(exc))
            where = context.get("task") or context.get("future") or context.get("handle") or "event loop"
            self.sink.append(Said("agent", f"loop: {where!r}"[:200], text))
        if self.prev_handler is not None:
            self.prev_handler(loop, context)
        else:
            loop.default_exception_handler(context)

    def close(self) -> None:
        self.active = False
        if self.loop.get_task_factory() == self.factory:
            self.loop.set_task_factory(self.prev_factory)
        if self.loop.get_exception_handler() == self.handler:
            self.loop.set_exception_handler(self.prev_handler)


class LocalCluster:
    """``pki``: the cluster's gRPC CA (default: ``ClusterPki(workdir, cluster)``,
    the one the ``cluster_pki`` fixture opens too). ``etcd_pki``: the etcd CA
    the etcd at ``etcd`` trusts (default: the one registered for it by
    tests/pki.py); the cluster's users must be provisioned (the
    ``cluster_name`` fixture does)."""

    def __init__(self, etcd: str, cluster: str, workdir: Path, timings: Timings | None = None, *,
                 pki: ClusterPki | None = None, etcd_pki: EtcdPki | None = None):
        self.etcd = etcd
        self.cluster = cluster
        self.workdir = workdir
        self.timings = timings or Timings.fast()
        self.coordinators: dict[str, CoordProc] = {}
        # Per coordinator id, the port it listens on, kept across restarts;
        # per AZ, the addresses its agents read through (a live list: the
        # in-process agents see coordinators started later too).
        self.listen_ports: dict[str, int] = {}
        self.az_addresses: dict[str, list[str]] = {}
        self.agent_groups: list[AgentGroup] = []
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.pki = pki or ClusterPki(workdir, cluster)
        self.etcd_pki = etcd_pki or etcd_pki_for(etcd)
        # The test's own reads and writes go through the coordinator's etcd
        # user: what the test checks in etcd is what a coordinator can see.
        self.store = Store(etcd, cluster, timeout=2.0, tls=self.etcd_pki.role(cluster, "coordinator"))
        # Strict teardown (docs/testing.md "Strict teardown"): what the
        # agents said, and what the test declared it expects.
        self.agent_said: list[Said] = []
        self._expected: list[tuple[str, re.Pattern[str]]] = []
        self._agent_records = _AgentRecords(self.agent_said)
        logging.getLogger("agent").addHandler(self._agent_records)
        try:
            self._loop_watch: _LoopWatch | None = _LoopWatch(asyncio.get_running_loop(), self.agent_said)
        except RuntimeError:  # built outside a loop: agents' tasks are not watched
            self._loop_watch = None

    # --- credentials --------------------------------------------------------------------

    def etcd_tls_dir(self, role: str = "coordinator") -> Path:
        """``--etcd-tls-dir`` for this cluster's ``role`` user: "coordinator";
        "agent" only in a test that provisioned the legacy agent user
        (tests.pki.provision(..., agent_user=True)): agents have none by
        default."""
        return self.etcd_pki.role_dir(self.cluster, role)

    def client_dir(self, role: str = "admin", name: str = "tester", queues: tuple[str, ...] | list[str] = ()) -> Path:
        """A client TLS dir (``ca.crt client.crt client.key``) of this cluster's CA."""
        return self.pki.client(role, name, tuple(queues))

    def client_env(self, role: str = "admin", name: str = "tester", queues: tuple[str, ...] | list[str] = (),
                   **extra: str) -> dict[str, str]:
        """The environment for a CLI/SDK subprocess: ``$PHALANX_TLS_DIR`` set
        to a client dir, no inherited ``PHALANX_INSECURE``."""
        env = {k: v for k, v in os.environ.items() if k not in ("PHALANX_INSECURE", "PHALANX_CONFIG")}
        env.update(PHALANX_TLS_DIR=str(self.client_dir(role, name, queues)), **extra)
        return env

    def coordinator_args(self, cid: str) -> list[str]:
        """The credential flags of ``python -m coordinator --id cid``."""
        self.pki.coordinator(cid)
        return ["--tls-dir", str(self.pki.server_dir()), "--etcd-tls-dir", str(self.etcd_tls_dir("coordinator"))]

    def agent_args(self, node: str, az: str = "") -> list[str]:
        """Where ``python -m agent --node node`` reads and its credentials:
        ``--coordinators`` (the coordinators of ``az`` started so far; ""
        when they all serve one AZ) and its agent certificate, no etcd."""
        self.pki.agent(node)
        return ["--coordinators", ",".join(self.addresses_of(az)), "--tls-dir", str(self.pki.server_dir())]

    def addresses_of(self, az: str = "") -> list[str]:
        """The live list of the coordinator addresses of ``az`` ("": the one
        AZ every coordinator started so far serves)."""
        if not az:
            azs = {c.az for c in self.coordinators.values()}
            if len(azs) != 1:
                raise ValueError(f"agent_args: name the AZ (coordinators serve {sorted(azs) or 'none yet'})")
            az = azs.pop()
        return self.az_addresses.setdefault(az, [])

    def agents_tls(self, nodes: list[str], az: str = "") -> dict[str, Any]:
        """``run_agents`` keyword arguments for simulated ``nodes`` of this
        cluster: each node's agent certificate, and the coordinators of
        ``az`` to read through (no etcd credentials)."""
        for node in nodes:
            self.pki.agent(node)
        return {"tls_dir": self.pki.server_dir(), "etcd_tls": None, "coordinators": self.addresses_of(az)}

    def _timings_json(self) -> str:
        import dataclasses
        import json

        return json.dumps(dataclasses.asdict(self.timings))

    def start_coordinator(self, az: str, cid: str, extra_env: dict[str, str] | None = None,
                          extra_args: list[str] | None = None) -> CoordProc:
        log_path = self.workdir / f"{cid}.log"
        log_start = log_path.stat().st_size if log_path.exists() else 0
        port = self.listen_ports.setdefault(cid, stable_port())
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
        # Through procs.spawn: the coordinator dies with this process however
        # it dies (a killed pytest leaves no orphan coordinator behind).
        proc = procs.spawn(
            [sys.executable, "-m", "coordinator", "--cluster", self.cluster, "--az", az, "--id", cid,
             "--etcd", self.etcd, "--timings", self._timings_json(), "--log-level", "INFO",
             "--listen", f"127.0.0.1:{port}",
             # The leader checks its book after every cycle: an inconsistency
             # is an ERROR line, which the strict teardown fails on.
             "--check-book",
             # extra_args last: a test that gives its own --tls-dir (its own CA) wins.
             *self.coordinator_args(cid), *(extra_args or [])],
            die_with_parent=procs.KILL, stdout=subprocess.PIPE, stderr=open(log_path, "a"), text=True, cwd=REPO,
            env=env,
        )
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else ""
        if "PHALANX_COORDINATOR_READY" not in line:
            proc.kill()
            raise RuntimeError(f"coordinator {cid} did not start: {line!r}\n{log_path.read_bytes()[log_start:].decode(errors='replace')}")
        address = line.split("address=")[1].split()[0]
        metrics = line.split("metrics=")[1].split()[0] if "metrics=" in line else ""
        c = CoordProc(cid, az, proc, address, log_path, metrics=metrics, log_start=log_start)
        self.coordinators[cid] = c
        known = self.az_addresses.setdefault(az, [])
        if address not in known:
            known.append(address)
        return c

    async def start(self) -> "LocalCluster":
        await self.store.connect()
        return self

    def start_agents(self, az: str, topologies: list[NodeTopology], *, via_etcd: bool = False) -> AgentGroup:
        """In-process agents of ``az``, reading through its coordinators;
        ``via_etcd``: the legacy path instead (the cluster's agent etcd
        user, which the test etcds still provision), for a test of what an
        agent makes of etcd's records when no coordinator serves its AZ."""
        stop = asyncio.Event()
        history: list[tuple[str, dict[str, Any]]] = []
        group = AgentGroup(az, None, stop, history)  # type: ignore[arg-type]
        tls = self.agents_tls([t.node for t in topologies], az)
        if via_etcd:
            tls.update(etcd_tls=self.etcd_pki.role(self.cluster, "agent"), coordinators=())

        async def go() -> None:
            await run_agents(cluster=self.cluster, az=az, etcd=self.etcd, topologies=topologies,
                             timings=self.timings, ready_line=False, stop_event=stop, history=history, **tls)

        group.task = asyncio.create_task(go())
        self.agent_groups.append(group)
        return group

    def stub(self, address: str | None = None) -> ggrpc.GangServiceStub:
        if address is None:
            live = [c for c in self.coordinators.values() if c.usable]
            address = (live or list(self.coordinators.values()))[0].address
        ch = self._channels.get(address)
        if ch is None:
            ch = self.channel(address)
            self._channels[address] = ch
        return ggrpc.GangServiceStub(ch)

    def channel(self, address: str, role: str = "admin", name: str = "tester", queues: tuple[str, ...] = (),
                options: tuple[tuple[str, Any], ...] = (), aio: bool = True) -> Any:
        """A new channel (grpc.aio, or blocking grpc with ``aio=False``) to a
        coordinator at ``address`` with a client certificate of this
        cluster's CA, verifying the server as this cluster's coordinator;
        the caller closes it."""
        from phalanx.tls import coordinator_channel

        return coordinator_channel(address, self.pki.client_files(role, name, queues), cluster=self.cluster,
                                   options=options, aio=aio)

    async def leader(self, az: str) -> LeaderInfo | None:
        return await observe(self.store, az)

    async def wait_leader(self, az: str, *, not_epoch: int = 0, timeout: float = 30.0) -> LeaderInfo:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = await self.leader(az)
            if info is not None and info.epoch != not_epoch:
                return info
            await asyncio.sleep(0.05)
        raise TimeoutError(f"no (new) leader in {az} after {timeout}s")

    async def wait_nodes_ready(self, az: str, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = await self.stub().ClusterStatus(gpb.ClusterStatusRequest(), timeout=5)
            for a in st.azs:
                if a.az == az and a.nodes_ready >= n:
                    return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{az}: fewer than {n} nodes ready after {timeout}s")

    async def submit(self, spec: pb.GangSpec, key: str = "", address: str | None = None) -> pb.Gang:
        resp = await self.stub(address).SubmitGang(gpb.SubmitGangRequest(spec=spec, idempotency_key=key), timeout=10)
        return resp.gang

    async def wait_state(self, gang_id: str, states: set[int], timeout: float = 30.0) -> pb.Gang:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                last = await self.stub().GetGang(gpb.GetGangRequest(id=gang_id), timeout=5)
                if last.state in states:
                    return last
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{gang_id} not in {states} after {timeout}s; last: {last}")

    async def wait_deleted(self, key: str, timeout: float) -> bool:
        """Poll until ``key`` is gone from etcd (e.g. collected by retention,
        which is a periodic sweep, not an event)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.store.get(key) is None:
                return True
            await asyncio.sleep(0.2)
        return False

    async def etcd_gangs(self) -> dict[str, GangRecord]:
        kvs, _ = await self.store.get_prefix(self.store.keys.gangs())
        return {g.id: g for g in (GangRecord.from_dict(kv.json(), kv.mod_revision) for kv in kvs)}

    async def etcd_reservations(self) -> dict[tuple[str, str], Reservation]:
        kvs, _ = await self.store.get_prefix(self.store.keys.reservations())
        return {(r.az, r.gang): r for r in (Reservation.from_dict(kv.json(), kv.mod_revision) for kv in kvs)}

    async def check_etcd_invariants(self) -> list[str]:
        """No GPU and no NIC reserved twice (NICs are exclusive as GPUs are:
        capacity.free_view subtracts held NICs, an agent's ledger refuses an
        overlap); every reserved gang's record and reservation agree in full,
        GPUs and NICs (never partial); no reservation for a gang that is
        neither holding devices nor releasing them.

        Two-phase (cross-AZ) records are judged with their decision key: a
        PREPARED record is a hold while its attempt is undecided (gang
        RESERVING at that incarnation) and counts as COMMITTED once the key
        says COMMIT (the record follows); records of ABORTed or finished
        attempts are garbage awaiting deletion, not holds (as in
        coordinator/core/twophase_invariants.py)."""
        # One txn = one consistent snapshot of the prefixes.
        k = self.store.keys
        snap = await self.store.txn([], [Get(k.gangs(), prefix=True), Get(k.reservations(), prefix=True), Get(k.decisions(), prefix=True)])
        gangs = {g.id: g for g in (GangRecord.from_dict(kv.json(), kv.mod_revision) for kv in snap.results[0])}
        res = {(r.az, r.gang): r for r in (Reservation.from_dict(kv.json(), kv.mod_revision) for kv in snap.results[1])}
        decided = {}
        for kv in snap.results[2]:
            gang, inc = kv.key.rsplit("/", 2)[-2:]
            decided[(gang, int(inc))] = kv.json()["outcome"]
        problems = []
        seen: dict[tuple[str, str, int], str] = {}
        seen_nics: dict[tuple[str, str, str], str] = {}

        def garbage(r: Reservation) -> bool:
            if not r.two_phase:
                return False
            g = gangs.get(r.gang)
            return (decided.get((r.gang, r.incarnation)) == "ABORT" or g is None or g.incarnation > r.incarnation
                    or (g.incarnation == r.incarnation and (g.state.terminal or g.state == GangState.RESTARTING)))

        for (az, gang), r in res.items():
            if garbage(r):
                continue
            for node, dev in r.nodes.items():
                for gpu in dev.gpus:
                    k_ = (az, node, gpu)
                    if k_ in seen:
                        problems.append(f"GPU {k_} reserved by {seen[k_]} and {gang}")
                    seen[k_] = gang
                for nic in dev.nics:
                    n_ = (az, node, nic)
                    if n_ in seen_nics:
                        problems.append(f"NIC {n_} reserved by {seen_nics[n_]} and {gang}")
                    seen_nics[n_] = gang
            g = gangs.get(gang)
            if g is None:
                problems.append(f"reservation {az}/{gang} for an unknown gang")
                continue
            if not g.state.holds_devices and r.state is not HoldState.RELEASING and not (
                    r.two_phase and g.state == GangState.RESERVING and r.incarnation == g.incarnation):
                problems.append(f"reservation {az}/{gang} ({r.state.value}) for a {g.state.name} gang")
        for g in gangs.values():
            if g.state.holds_devices:
                # Every AZ of the placement (one for single-AZ gangs) holds
                # exactly its part, COMMITTED.
                want_by_az: dict[str, dict[str, tuple[set[int], set[str]]]] = {}
                for m in g.placement:
                    gpus, nics = want_by_az.setdefault(m.az, {}).setdefault(m.node, (set(), set()))
                    gpus.update(m.gpus)
                    nics.update(m.nics)
                for az, want in sorted(want_by_az.items()):
                    r = res.get((az, g.id))
                    if r is None:
                        problems.append(f"{g.id} is {g.state.name} without a reservation in {az}")
                        continue
                    committed = r.state is HoldState.COMMITTED or (r.two_phase and decided.get((g.id, r.incarnation)) == "COMMIT")
                    if not committed or r.incarnation != g.incarnation:
                        problems.append(f"{g.id} is {g.state.name} but {az} holds {r.state.value}#{r.incarnation}")
                    have = {n: (set(d.gpus), set(d.nics)) for n, d in r.nodes.items()}
                    if want != have:
                        problems.append(f"{g.id}: placement {want} != reservation {have} in {az}")
                if len(g.placement) != g.spec.members:
                    problems.append(f"{g.id}: {len(g.placement)} of {g.spec.members} members placed")
        return problems

    # --- strict teardown ----------------------------------------------------------------

    def expect_log(self, pattern: str, who: str = "coordinator") -> None:
        """Declare that ``who``'s ERROR line, traceback or failed task
        matching ``pattern`` (re.search over the whole entry, traceback
        included) is part of this test's scenario; anything else fails the
        test at ``close``. Use the narrowest pattern that names the cause."""
        if who not in WHO:
            raise ValueError(f"expect_log: who must be one of {', '.join(WHO)}, got {who!r}")
        self._expected.append((who, re.compile(pattern)))

    def unexpected(self) -> list[Said]:
        """What the coordinators' logs (every ``<cid>.log`` this cluster
        wrote), the logs of real agent processes a test started itself (by
        convention ``<workdir>/agent-<node>.log``) and the in-process agents
        said that no ``expect_log`` covers: ERROR/CRITICAL lines, tracebacks,
        agent tasks ended by an exception."""
        logs = ([(c.log_path, "coordinator") for c in self.coordinators.values()]
                + [(p, "agent") for p in sorted(self.workdir.glob("agent-*.log"))])
        said = [s for path, who in logs for s in bad_log_entries(path, who)] + self.agent_said
        return [s for s in said if not any(w == s.who and p.search(s.text) for w, p in self._expected)]

    async def close(self) -> None:
        """Stops everything, then fails (AssertionError naming the test, the
        file and line of each) if anything was said that the test did not
        expect (``unexpected``)."""
        for g in self.agent_groups:
            g.stop.set()
        for g in self.agent_groups:
            try:
                await asyncio.wait_for(g.task, 15)
            except TimeoutError:
                g.task.cancel()
                self.agent_said.append(Said("agent", f"agents of {g.az}", f"agents of {g.az} did not stop within 15 s"))
            except Exception as exc:  # noqa: BLE001 - recorded: the test fails below
                self.agent_said.append(Said("agent", f"agents of {g.az}", f"agent group {g.az} ended with {exc!r}\n"
                                            + "".join(traceback.format_exception(exc))))
        for c in self.coordinators.values():
            if c.proc.poll() is None:
                c.signal(signal.SIGCONT)
                c.signal(signal.SIGTERM)
        for c in self.coordinators.values():
            try:
                c.proc.wait(10)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(5)
            if c.proc.stdout:
                c.proc.stdout.close()
        for ch in self._channels.values():
            await ch.close()
        await self.store.close()
        # Dropped tasks that failed report "never retrieved" when collected.
        gc.collect()
        if self._loop_watch is not None:
            self._loop_watch.close()
        logging.getLogger("agent").removeHandler(self._agent_records)
        left = self.unexpected()
        if left:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
            raise AssertionError(f"{test}: {len(left)} unexpected ERROR line(s), traceback(s) or failed agent "
                                 "task(s) (declare what the test means with LocalCluster.expect_log):\n"
                                 + "\n".join(f"  {s}" for s in left))


def stable_port() -> int:
    """A free loopback port below Linux's ephemeral range and above the
    rendezvous ports (phalanx.ports.DEFAULT_PORTS), so no outgoing
    connection takes it while its coordinator is down between restarts."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(30000, 32768)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 30000-32767 for a coordinator")


async def until(what: str, ok: Any, timeout: float = 30.0) -> None:
    """Poll the coroutine function ``ok`` every 0.1 s until it is true;
    TimeoutError naming ``what`` after ``timeout`` s (a "never happened"
    bound, not a speed assertion)."""
    deadline = time.monotonic() + timeout
    while not await ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {what} after {timeout}s")
        await asyncio.sleep(0.1)


def stop_agent_then_coordinator(agent: subprocess.Popen, coord: CoordProc, timeout: float = 20) -> None:
    """Stops a real agent process, then its coordinator, each with SIGTERM,
    and waits for both: a test that reads their logs afterwards sees both
    shutdowns, and the leader outlives the agent's goodbye. One that does not
    stop within ``timeout`` is killed and the wait's TimeoutExpired raised
    (a shutdown that hangs is a bug, not something to read logs after)."""
    agent.send_signal(signal.SIGTERM)
    try:
        _wait_or_kill(agent, timeout)
    finally:
        if agent.stdout:
            agent.stdout.close()
        coord.signal(signal.SIGTERM)
        _wait_or_kill(coord.proc, timeout)


def _wait_or_kill(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
        raise


def tiny(name: str, members: int = 8, gpus: int = 1, duration: float = 1.0, **kw: Any) -> pb.GangSpec:
    return pb.GangSpec(name=name, members=members, resources=pb.Resources(gpus=gpus), run=pb.RunSpec(duration_s=duration), **kw)


TERMINAL = {pb.GANG_STATE_SUCCEEDED, pb.GANG_STATE_FAILED, pb.GANG_STATE_CANCELLED}
STATE = GangState
