"""A whole Phalanx in network namespaces: 3 AZs x (etcd member, 2 coordinators, agents).

Built on :class:`chaos.netns.NetnsCluster` and :class:`chaos.etcd_cluster.EtcdCluster`::

    host            az   runs
    etcd-<az>       az   one member of the real 3-member etcd cluster
    coord-<az>1/2   az   python -m coordinator --listen <ip>:7070 --timings fast
    agents-<az>     az   python -m agent.sim --nodes 2 --launch (real member processes)
    ctl             -    etcdctl health checks, chaos.recorder (etcd history, final dump)
    client          -    chaos.workload (the submitters)

Every coordinator and agent gets all three etcd endpoints, its own AZ's
member first (the Store sticks to the first that answers). Every process is
started with :meth:`Host.popen`, so it is tracked and the NetnsCluster
teardown kills it (and every member process, found through ``ip netns
pids``), whatever happens; and ``Host.popen`` starts it through
``phalanx.procs.spawn``, so it also dies when the runner is killed before any
teardown can run (SIGKILL). ``ctl`` and ``client`` belong to no AZ: an AZ
partition cuts the AZ's hosts from the other AZs' hosts, not from the
observers.

With ``proxies=True`` each coordinator also gets a :mod:`chaos.proxy` on
``<ip>:7071`` in front of its port 7070 and advertises that address, so
agents, forwarding standbys and clients all reach it through a proxy that a
one-way fault can steer (request delivered, reply lost).

Security is on, as deployed (docs/security.md): the etcd members serve TLS
to clients and peers with client-certificate auth, and the cluster's etcd
roles are provisioned (``phalanx.etcd_auth``, as root) before any Phalanx
process starts; coordinators serve TLS (``--tls-dir``) and reach etcd as the
cluster's coordinator user (``--etcd-tls-dir``), agents present their node's
agent certificate and hold no etcd credentials (they read through their AZ's
coordinators, ``--coordinators``); the workload and the
probes call with an admin certificate and verify the coordinators' name
(``phalanx.tls.coordinator_channel``), so namespace addresses and the TCP
proxies (which pass TLS through as bytes) need nothing in the certificates.
The recorder and the final dump read etcd as root: observers, not parts of
the system under test. Every certificate is in the run's work dir
(:mod:`chaos.pki`) and goes with it.

The runner learns the cluster's state by tailing the recorder's history
(:class:`LiveView`): the root namespace has no route to the hosts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.topology.simulated import simulated_fabric
from chaos.etcd_cluster import EtcdCluster
from chaos.faults import FaultEvent
from chaos.netns import Host, NetnsCluster, namespace_pids
from chaos.pki import COORDINATOR, RunPki
from chaos.proxy import ProxyControl, RunningProxy, start_proxy
from phalanx.timings import Timings
from phalanx import procs

REPO = Path(__file__).resolve().parent.parent
COORD_PORT = 7070
PROXY_PORT = 7071
ETCD_PROXY_PORT = 2379  # on a coordinator host: its proxy to its AZ's etcd member
AZS = ("a", "b", "c")
# Failpoints and timings must come only from what a scenario asks for, never
# from the environment of whoever runs the suite.
_SCRUB = ("PHALANX_FAILPOINTS", "PHALANX_FAILPOINTS_FILE", "PHALANX_TIMINGS", "PHALANX_STATE_DIR")


class ClusterError(RuntimeError):
    """A cluster process did not start or the cluster did not become healthy."""


@dataclass
class ManagedProcess:
    """One long-running cluster process, restartable with the same command."""

    name: str
    role: str  # coordinator | agents | recorder
    az: str
    host: Host
    cmd: list[str]
    ready_marker: str
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[Any] | None = None
    ready_line: str = ""
    starts: int = 0
    armed: str = ""  # failpoints of the current incarnation, for the history

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LiveView:
    """The recorder's etcd history, replayed into the current key -> value map.

    Reads only new complete lines on each :meth:`refresh`, so polling is cheap.
    Lags reality by the recorder's watch latency: good enough for health
    gates and settling, never used by the checker as "now".
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pos = 0
        self._buf = ""
        self.kv: dict[str, tuple[Any, int]] = {}  # key -> (value, create_rev)
        self.revision = 0
        self._lock = threading.Lock()

    def refresh(self) -> "LiveView":
        with self._lock:
            try:
                with open(self.path, "r", errors="replace") as f:
                    f.seek(self._pos)
                    chunk = f.read()
                    self._pos = f.tell()
            except FileNotFoundError:
                return self
            self._buf += chunk
            *lines, self._buf = self._buf.split("\n")
            for line in lines:
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if d.get("kind") == "put":
                    self.kv[d["key"]] = (d.get("value"), int(d.get("create_rev", 0)))
                elif d.get("kind") == "delete":
                    self.kv.pop(d["key"], None)
                self.revision = max(self.revision, int(d.get("rev", 0)))
        return self

    def prefix(self, p: str) -> dict[str, Any]:
        return {k[len(p):]: v for k, (v, _) in self.kv.items() if k.startswith(p)}

    def leaders(self) -> dict[str, tuple[str, int]]:
        """AZ -> (coordinator id, epoch)."""
        return {k[len("leader/"):]: ((v or {}).get("id", ""), cr)
                for k, (v, cr) in self.kv.items() if k.startswith("leader/")}

    def gangs(self) -> dict[str, Mapping[str, Any]]:
        return self.prefix("gangs/")

    def reservations(self) -> dict[str, Mapping[str, Any]]:
        return self.prefix("reservations/")

    def ready_nodes(self, az: str) -> int:
        return sum(1 for v in self.prefix(f"nodes/{az}/").values() if isinstance(v, Mapping) and v.get("ready"))


class PhalanxCluster:
    """Build with :meth:`build`, then :meth:`start`; torn down with its NetnsCluster."""

    def __init__(
        self,
        net: NetnsCluster,
        workdir: Path,
        run_dir: Path,
        *,
        name: str = "chaos",
        azs: tuple[str, ...] = AZS,
        coordinators_per_az: int = 2,
        nodes_per_az: int = 2,
        timings: Timings | None = None,
        agent_env: Mapping[str, str] | None = None,
        coordinator_env: Mapping[str, str] | None = None,
        proxies: bool = False,
        etcd_proxies: tuple[str, ...] = (),
    ) -> None:
        self.net = net
        self.workdir = Path(workdir)
        self.run_dir = Path(run_dir)
        self.logs = self.run_dir / "logs"
        self.name = name
        self.azs = azs
        self.coordinators_per_az = coordinators_per_az
        self.nodes_per_az = nodes_per_az
        self.timings = timings or Timings.fast()
        self.agent_env = dict(agent_env or {})
        self.coordinator_env = dict(coordinator_env or {})
        self.use_proxies = proxies
        # AZs whose coordinators reach etcd only through a proxy in their own
        # host (to their AZ's member), so a fault can slow etcd's replies.
        self.etcd_proxy_azs = tuple(etcd_proxies)
        self.etcd_proxies: dict[str, RunningProxy] = {}
        self.etcd: EtcdCluster | None = None
        self.pki: RunPki | None = None
        self.client_dir: Path | None = None  # the workload's admin certificate
        self.ctl: Host | None = None
        self.client: Host | None = None
        self.procs: dict[str, ManagedProcess] = {}
        self.proxies: dict[str, RunningProxy] = {}
        self.view = LiveView(self.run_dir / "etcd.jsonl")
        self._events_lock = threading.Lock()
        self._events_path = self.run_dir / "events.jsonl"

    # -- layout --------------------------------------------------------------

    @classmethod
    def build(cls, net: NetnsCluster, workdir: Path, run_dir: Path, **kw: Any) -> "PhalanxCluster":
        """Create every host (no process yet)."""
        c = cls(net, workdir, run_dir, **kw)
        c.run_dir.mkdir(parents=True, exist_ok=True)
        c.logs.mkdir(parents=True, exist_ok=True)
        c.etcd = EtcdCluster.build(net, c.workdir / "etcd", azs=c.azs)
        assert c.etcd.tls_dir is not None
        c.pki = RunPki.create(c.workdir / "pki", c.name, etcd_dir=c.etcd.tls_dir)
        c.client_dir = c.pki.client("chaos-workload")
        c.ctl = c.etcd.client
        for az in c.azs:
            for i in range(1, c.coordinators_per_az + 1):
                net.add_host(f"coord-{az}{i}", az=az)
            net.add_host(f"agents-{az}", az=az)
        c.client = net.add_host("client")
        return c

    def etcd_endpoints(self, az: str | None = None) -> str:
        """All etcd endpoints; with ``az``, that AZ's member first. The Store
        uses the first endpoint until it stops answering (docs/etcd-keys.md
        "Endpoints and failover"), so each process talks to its own AZ's
        member, as a deployment would configure it."""
        assert self.etcd is not None
        azs = list(self.etcd.members)
        if az in azs:
            azs.remove(az)
            azs.insert(0, az)
        return ",".join(self.etcd.endpoints(azs))

    def coordinator_ids(self, az: str | None = None) -> list[str]:
        return [f"coord-{a}{i}" for a in ([az] if az else self.azs) for i in range(1, self.coordinators_per_az + 1)]

    def coord_host(self, cid: str) -> Host:
        return self.net.host(cid)

    def agent_host(self, az: str) -> Host:
        return self.net.host(f"agents-{az}")

    def etcd_host(self, az: str) -> Host:
        return self.net.host(f"etcd-{az}")

    def az_hosts(self, az: str) -> list[Host]:
        return self.net.hosts_in(az)

    def coordinator_etcd(self, cid: str, az: str) -> str:
        """The etcd endpoints coordinator ``cid`` is given."""
        if az in self.etcd_proxy_azs:
            return f"{self.coord_host(cid).ip}:{ETCD_PROXY_PORT}"
        return self.etcd_endpoints(az)

    def advertised(self, cid: str) -> str:
        h = self.coord_host(cid)
        return f"{h.ip}:{PROXY_PORT if self.use_proxies else COORD_PORT}"

    def metrics_address(self, cid: str) -> str:
        """Where coordinator ``cid`` serves /metrics (its host's address, not
        through a proxy: faults are healed when it is scraped)."""
        from chaos.metrics import METRICS_PORT

        return f"{self.coord_host(cid).ip}:{METRICS_PORT}"

    def targets(self) -> dict[str, list[str]]:
        """AZ -> coordinator addresses a client should use (through the proxies if any)."""
        return {az: [self.advertised(c) for c in self.coordinator_ids(az)] for az in self.azs}

    def client_args(self) -> list[str]:
        """What ``chaos.workload`` needs to call the coordinators (an admin certificate)."""
        assert self.client_dir is not None
        return ["--tls-dir", str(self.client_dir)]

    def _etcd_root_args(self) -> list[str]:
        assert self.etcd is not None and self.etcd.root_dir is not None
        return ["--etcd-tls-dir", str(self.etcd.root_dir)]

    def describe(self) -> dict[str, Any]:
        return {
            "net": self.net.describe(),
            "cluster": self.name,
            "azs": list(self.azs),
            "etcd": self.etcd_endpoints(),
            "coordinators": {cid: self.advertised(cid) for cid in self.coordinator_ids()},
            "agents": {az: self.agent_host(az).ip for az in self.azs},
            "proxies": self.use_proxies,
            "etcd_proxies": list(self.etcd_proxy_azs),
            "timings": dataclasses.asdict(self.timings),
            "agent_env": self.agent_env,
            "security": "TLS on every gRPC hop; etcd TLS with client-certificate auth and the cluster's roles",
        }

    # -- history of the runner ----------------------------------------------

    def record(self, line: dict[str, Any]) -> None:
        """Append one line to ``events.jsonl`` (faults and process events)."""
        with self._events_lock, open(self._events_path, "a") as f:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")

    def record_fault(self, ev: FaultEvent) -> None:
        self.record({"src": "fault", "mono": ev.ts, "name": ev.name, "action": ev.action, "detail": ev.detail})

    def _process_event(self, action: str, mp: ManagedProcess, detail: str = "") -> None:
        self.record({"src": "process", "mono": time.monotonic(), "action": action, "name": mp.name,
                     "role": mp.role, "az": mp.az, "detail": detail})

    # -- processes -------------------------------------------------------------

    def _env(self, extra: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env

    def failpoints_file(self, name: str) -> Path:
        """The file ``name`` re-reads for failpoints at run time (docs/failpoints.md)."""
        return self.workdir / f"failpoints-{name}.txt"

    def arm(self, name: str, failpoints: str) -> None:
        """Arm (or, with "", disarm) failpoints in the *running* process ``name``;
        it picks the change up within 100 ms, at its next failpoint check."""
        path = self.failpoints_file(name)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(failpoints)
        tmp.replace(path)
        mp = self.procs[name]
        mp.armed = failpoints or mp.env.get("PHALANX_FAILPOINTS", "")
        self.record({"src": "process", "mono": time.monotonic(), "action": "armed", "name": name, "role": mp.role,
                     "az": mp.az, "detail": failpoints or "(disarmed)"})

    def _spawn(self, mp: ManagedProcess, extra_env: Mapping[str, str] | None = None) -> None:
        mp.starts += 1
        env = {"PHALANX_FAILPOINTS_FILE": str(self.failpoints_file(mp.name)), **mp.env}
        if extra_env is not None:
            env.update(extra_env)
        fp_file = self.failpoints_file(mp.name)
        mp.armed = env.get("PHALANX_FAILPOINTS", "") or (fp_file.read_text() if fp_file.exists() else "")
        out_path = self.logs / f"{mp.name}.{mp.starts}.out"
        err = open(self.logs / f"{mp.name}.log", "ab")
        out = open(out_path, "wb")
        try:
            # Host.popen starts it through phalanx.procs.spawn: should this
            # runner die without its teardown (SIGKILL), the kernel signals
            # it. Agents get SIGTERM, so they stop their members first (their
            # shims fence them anyway once the agent's lease goes stale);
            # everything else SIGKILL.
            die = procs.TERM if mp.role == "agents" else procs.KILL
            mp.proc = mp.host.popen(mp.cmd, stdout=out, stderr=err, env=self._env(env), cwd=str(REPO),
                                    die_with_parent=die)
        finally:
            out.close()
            err.close()
        mp.ready_line = ""
        self._process_event("started", mp, f"pid={mp.proc.pid} start={mp.starts}" +
                            (f" failpoints={mp.armed}" if mp.armed else ""))

    def _wait_ready(self, mps: list[ManagedProcess], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(mps)
        while pending:
            for mp in list(pending):
                out_path = self.logs / f"{mp.name}.{mp.starts}.out"
                text = out_path.read_text(errors="replace") if out_path.exists() else ""
                for line in text.splitlines():
                    if mp.ready_marker in line:
                        mp.ready_line = line.strip()
                        pending.remove(mp)
                        break
                else:
                    if mp.proc is not None and mp.proc.poll() is not None:
                        tail = (self.logs / f"{mp.name}.log").read_text(errors="replace")[-2000:]
                        raise ClusterError(f"{mp.name} exited with {mp.proc.returncode} before it was ready:\n{tail}")
            if pending and time.monotonic() > deadline:
                raise ClusterError(f"not ready after {timeout}s: {[m.name for m in pending]}")
            if pending:
                time.sleep(0.1)

    def _coordinator(self, cid: str, az: str) -> ManagedProcess:
        h = self.coord_host(cid)
        assert self.pki is not None
        cmd = [sys.executable, "-m", "coordinator", "--cluster", self.name, "--az", az, "--id", cid,
               "--etcd", self.coordinator_etcd(cid, az), "--listen", f"{h.ip}:{COORD_PORT}",
               "--tls-dir", str(self.pki.coordinator(cid, az)),
               "--etcd-tls-dir", str(self.pki.etcd_user_dir(COORDINATOR)),
               "--timings", json.dumps(dataclasses.asdict(self.timings)), "--log-level", "INFO",
               # Scraped at the end of a run for its fenced writes refused (chaos/metrics.py).
               "--metrics-listen", self.metrics_address(cid),
               # The leader checks its book after every cycle (ERROR "book inconsistent").
               "--check-book"]
        if self.use_proxies:
            cmd += ["--advertise", self.advertised(cid)]
        return ManagedProcess(cid, "coordinator", az, h, cmd, "PHALANX_COORDINATOR_READY", dict(self.coordinator_env))

    def _agents(self, az: str) -> ManagedProcess:
        h = self.agent_host(az)
        state = self.workdir / "state" / f"agents-{az}"
        state.mkdir(parents=True, exist_ok=True)
        assert self.pki is not None
        # agent.sim's default fabric (1 spine, 2 leaves): one agent certificate per node it simulates.
        nodes = [t.node for t in simulated_fabric(az, self.nodes_per_az, 1, 2)]
        # No etcd: the agents read the leader and their token checks through
        # this AZ's coordinators, at the addresses they advertise (their
        # proxies when the scenario has them, as the agents' Sessions).
        cmd = [sys.executable, "-m", "agent.sim", "--cluster", self.name, "--az", az,
               "--coordinators", ",".join(self.advertised(c) for c in self.coordinator_ids(az)),
               "--nodes", str(self.nodes_per_az), "--launch", "--tls-dir", str(self.pki.agents(nodes, az)),
               "--state-dir", str(state), "--history", str(self.run_dir / f"agents-{az}.jsonl"),
               "--timings", json.dumps(dataclasses.asdict(self.timings)), "--log-level", "INFO"]
        return ManagedProcess(f"agents-{az}", "agents", az, h, cmd, "PHALANX_AGENTS_READY", dict(self.agent_env))

    def start(self, timeout: float = 90.0) -> "PhalanxCluster":
        """etcd, recorder, proxies, coordinators, agents; returns once every AZ
        has a leader and every node is ready."""
        assert self.etcd is not None and self.ctl is not None
        self.etcd.start(timeout=60)
        self.provision_etcd()
        rec = ManagedProcess("recorder", "recorder", "", self.ctl,
                             [sys.executable, "-m", "chaos.recorder", "watch", "--etcd", self.etcd_endpoints(),
                              "--cluster", self.name, "--out", str(self.run_dir / "etcd.jsonl"),
                              *self._etcd_root_args()],
                             "PHALANX_RECORDER_READY")
        self.procs[rec.name] = rec
        self._spawn(rec)
        if self.use_proxies:
            for az in self.azs:
                for cid in self.coordinator_ids(az):
                    h = self.coord_host(cid)
                    self.proxies[cid] = start_proxy(h, PROXY_PORT, (h.ip, COORD_PORT),
                                                    self.workdir / f"px-{cid}.sock",
                                                    log_path=self.logs / f"proxy-{cid}.log")
        for az in self.etcd_proxy_azs:
            member = self.etcd_host(az)
            for cid in self.coordinator_ids(az):
                self.etcd_proxies[cid] = start_proxy(self.coord_host(cid), ETCD_PROXY_PORT, (member.ip, 2379),
                                                     self.workdir / f"epx-{cid}.sock",
                                                     log_path=self.logs / f"etcd-proxy-{cid}.log")
        for az in self.azs:
            for cid in self.coordinator_ids(az):
                self.procs[cid] = self._coordinator(cid, az)
        for az in self.azs:
            self.procs[f"agents-{az}"] = self._agents(az)
        coords = [p for p in self.procs.values() if p.role == "coordinator"]
        for mp in coords:
            self._spawn(mp)
        self._wait_ready([rec] + coords, timeout)
        agents = [p for p in self.procs.values() if p.role == "agents"]
        for mp in agents:
            self._spawn(mp)
        self._wait_ready(agents, timeout)
        self.wait(self.healthy, timeout, "every AZ has a leader and all nodes ready")
        return self

    def provision_etcd(self, timeout: float = 60.0) -> None:
        """The cluster's etcd users and roles, and auth on
        (``phalanx.etcd_auth.provision`` as root), run inside ``ctl``: the
        root namespace has no route to etcd."""
        assert self.ctl is not None and self.etcd is not None and self.etcd.root_dir is not None
        code = ("import asyncio, sys; from phalanx import etcd_auth, etcd_pki; "
                "asyncio.run(etcd_auth.provision(sys.argv[1].split(','), etcd_pki.files(sys.argv[2]), sys.argv[3]))")
        res = self.ctl.run([sys.executable, "-c", code, self.etcd_endpoints(), str(self.etcd.root_dir), self.name],
                           timeout=timeout, env=self._env({}), cwd=str(REPO))
        if res.returncode != 0:
            raise ClusterError(f"provisioning etcd users failed ({res.returncode}): {(res.stderr or res.stdout)[-2000:]}")
        self.record({"src": "process", "mono": time.monotonic(), "action": "etcd-auth", "name": "etcd", "role": "etcd",
                     "az": "", "detail": f"users and roles of cluster {self.name} provisioned, auth enabled"})

    # -- control -----------------------------------------------------------------

    def proc_ref(self, name: str) -> Callable[[], subprocess.Popen[Any] | None]:
        """The current process of ``name`` (for Pause/Kill/Restart faults)."""
        return lambda: self.procs[name].proc

    def restart(self, name: str, *, failpoints: str | None = None, wait: bool = True, timeout: float = 60.0) -> None:
        """(Re)start ``name`` with its usual command; SIGKILL first if alive.

        ``failpoints`` overrides ``PHALANX_FAILPOINTS`` for this incarnation
        only; None keeps the process's scenario-wide setting.
        """
        mp = self.procs[name]
        if mp.alive():
            self.kill(name)
        self._spawn(mp, None if failpoints is None else {"PHALANX_FAILPOINTS": failpoints})
        if wait:
            self._wait_ready([mp], timeout)

    def restarter(self, name: str) -> Callable[[], None]:
        return lambda: self.restart(name)

    def kill(self, name: str) -> None:
        """SIGKILL ``name``'s process group and reap it."""
        mp = self.procs[name]
        p = mp.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)
        self._process_event("killed", mp, f"pid={p.pid}")

    def note_exit(self, name: str) -> None:
        """Record that ``name`` died by itself (e.g. a crash failpoint)."""
        mp = self.procs[name]
        if mp.proc is not None and mp.proc.poll() is not None:
            self._process_event("exited", mp, f"pid={mp.proc.pid} code={mp.proc.returncode}")

    def leader_of(self, az: str) -> str | None:
        """Coordinator id holding ``leader/<az>`` per the recorder (may lag)."""
        info = self.view.refresh().leaders().get(az)
        return info[0] if info else None

    def standby_of(self, az: str) -> str | None:
        leader = self.leader_of(az)
        others = [c for c in self.coordinator_ids(az) if c != leader and self.procs[c].alive()]
        return others[0] if others else None

    # -- health (callables for Fault before/after checks) ------------------------

    def leaders_ok(self) -> bool:
        """Every AZ has a leader key whose holder is a live process."""
        leaders = self.view.refresh().leaders()
        return all(az in leaders and self.procs.get(leaders[az][0]) is not None
                   and self.procs[leaders[az][0]].alive() for az in self.azs)

    def nodes_ok(self) -> bool:
        self.view.refresh()
        return all(self.view.ready_nodes(az) >= self.nodes_per_az for az in self.azs)

    def etcd_ok(self) -> bool:
        assert self.etcd is not None
        return self.etcd.healthy()

    def healthy(self) -> bool:
        return self.leaders_ok() and self.nodes_ok()

    def settled(self) -> bool:
        """No gang in flight and nothing reserved: the cluster is at rest."""
        self.view.refresh()
        gangs = self.view.gangs()
        busy = [g for g, v in gangs.items() if isinstance(v, Mapping) and v.get("state") not in ("SUCCEEDED", "FAILED", "CANCELLED")]
        return not busy and not self.view.reservations()

    @staticmethod
    def wait(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.25) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout}s waiting for: {what}")
            time.sleep(interval)

    # -- observers -------------------------------------------------------------

    def dump(self, out: Path, timeout: float = 60.0) -> dict[str, Any]:
        """The final etcd state, read by ``chaos.recorder dump`` inside ``ctl``."""
        assert self.ctl is not None
        res = self.ctl.run([sys.executable, "-m", "chaos.recorder", "dump", "--etcd", self.etcd_endpoints(),
                            "--cluster", self.name, "--out", str(out), "--timeout", str(timeout),
                            *self._etcd_root_args()],
                           timeout=timeout + 30, env=self._env({}), cwd=str(REPO))
        if res.returncode != 0:
            raise ClusterError(f"final dump failed ({res.returncode}): {res.stderr[-2000:]}")
        return json.loads(Path(out).read_text())

    def trigger(self, az: str, tag: str) -> subprocess.Popen[Any]:
        """Submit one high-priority 1-GPU gang to ``az`` from the client host
        (appended to workload.jsonl; not waited for): makes a leader admit
        something now, e.g. to reach an armed failpoint."""
        assert self.client is not None
        log = open(self.logs / "workload.log", "ab")
        try:
            return self.client.popen(
                [sys.executable, "-m", "chaos.workload", "--targets", json.dumps(self.targets()), "--trigger", az,
                 "--tag", tag, "--out", str(self.run_dir / "workload.jsonl"), *self.client_args()],
                stdout=log, stderr=subprocess.STDOUT, env=self._env({}), cwd=str(REPO))
        finally:
            log.close()

    def stop_recorder(self) -> None:
        """SIGTERM the recorder so its last lines are written (teardown would SIGKILL)."""
        mp = self.procs.get("recorder")
        if mp is None or not mp.alive():
            return
        assert mp.proc is not None
        mp.proc.send_signal(signal.SIGTERM)
        try:
            mp.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def pids(self) -> dict[str, list[int]]:
        """Every live pid in each of the run's namespaces (for leftover checks)."""
        return {ns: namespace_pids(ns) for ns in self.net.namespaces()}

    def proxy_control(self, cid: str) -> ProxyControl:
        return self.proxies[cid].control

    def etcd_proxy_control(self, cid: str) -> ProxyControl:
        return self.etcd_proxies[cid].control
