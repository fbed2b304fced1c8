"""The processes ``phalanx up`` starts, each its own process group: what
each coordinator and agents process is started with, how it is started (dying
with ``up``), and how its readiness line is read from its log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from phalanx import procs
from phalanx.up.config import REPO_ROOT, UpConfig
from phalanx.up.credentials import Credentials

# Every process up starts serves /metrics on a free loopback port (its ready
# line says which; up prints them all).
METRICS_LISTEN = "127.0.0.1:0"


def security_args(creds: Credentials | None, kind: str) -> list[str]:
    """What a coordinator (``kind`` "coordinator") or agents process is
    started with: its credential dirs (an agents process: no etcd user), or
    ``--insecure``."""
    if creds is None:
        return ["--insecure"]
    if kind == "coordinator":
        return ["--tls-dir", str(creds.server_dir), "--etcd-tls-dir", str(creds.etcd_coordinator)]
    return ["--tls-dir", str(creds.server_dir)]


COORDINATORS_PENDING = "-"  # an agents process's --coordinators until its AZ's coordinators serve


def set_agent_coordinators(children: list["Child"]) -> None:
    """Each agents process reads through the coordinators of its AZ: its
    ``--coordinators`` is set to their addresses as they serve them (a
    coordinator may have been retried on another port)."""
    for c in children:
        if c.kind == "agents":
            addresses = [o.address for o in children if o.kind == "coordinator" and o.az == c.az]
            c.argv[c.argv.index("--coordinators") + 1] = ",".join(addresses)


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
    metrics: str = ""  # HOST:PORT of its /metrics, from its ready line
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
            # A session of its own (procs.spawn's default): the terminal's
            # Ctrl-C reaches only `up`, which then shuts children down in
            # order. Should `up` die without doing so, the kernel signals the
            # child: agents get SIGTERM (they stop their members first, within
            # their stop grace), coordinators SIGKILL (their leader keys
            # expire with their leases).
            self.proc = procs.spawn(
                self.argv, die_with_parent=procs.TERM if self.kind == "agents" else procs.KILL,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
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
                self.address = m.group("address")
            self.metrics = m.group("metrics") or ""
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


def build_children(
    cfg: UpConfig, etcd: str, ports: list[int], logs: Path, agents_dir: Path, cluster: str = "",
    creds: Credentials | None = None, etcd_quota_bytes: int = 0,
) -> list[Child]:
    """``creds`` None: every process plaintext (``--insecure``).
    ``etcd_quota_bytes``: the --quota-backend-bytes of the etcd this run
    started, told to the coordinators (etcd does not report it); 0: an etcd
    of the user's, whose quota the coordinators take to be etcd's default."""
    cluster = cluster or cfg.cluster
    children: list[Child] = []
    port_iter = iter(ports)
    for az in cfg.azs:
        for j in range(cfg.coordinators_per_az):
            cid = f"{az}-c{j}"  # as coordinator_ids() says: their certificates' names
            children.append(
                Child(
                    name=cid, kind="coordinator", az=az,
                    argv=[
                        sys.executable, "-m", "coordinator", "--cluster", cluster, "--az", az, "--id", cid,
                        "--etcd", etcd, *security_args(creds, "coordinator"), "--metrics-listen", METRICS_LISTEN,
                        *(["--etcd-quota-bytes", str(etcd_quota_bytes)] if etcd_quota_bytes else []),
                        "--check-book",  # a cluster for trying Phalanx: cheap there (docs/book.md)
                        # Last: a retry on another port replaces it.
                        "--listen", f"127.0.0.1:{next(port_iter)}",
                    ],
                    log_path=logs / f"{cid}.log",
                    ready=re.compile(rf"^PHALANX_COORDINATOR_READY id={re.escape(cid)} az=\S+ address=(?P<address>\S+)"
                                     rf"(?: metrics=(?P<metrics>\S+))?\s*$", re.M),
                )
            )
    # Every AZ's agents share this host: each AZ process gets its own block of
    # rendezvous ports (split again per node), so MASTER_PORTs never collide.
    from phalanx.ports import DEFAULT_PORTS, split_port_range

    blocks = split_port_range(*DEFAULT_PORTS, len(cfg.azs))
    for az, block in zip(cfg.azs, blocks):
        argv = [
            # No etcd: the agents read through their AZ's coordinators, whose
            # addresses set_agent_coordinators fills in once they serve.
            sys.executable, "-m", "agent.sim", "--cluster", cluster, "--az", az,
            "--coordinators", COORDINATORS_PENDING,
            "--nodes", str(cfg.nodes_per_az), "--rendezvous-ports", "%d-%d" % block,
            # Always given: the agent certificates were issued for the nodes
            # these flags make (sim_node_names).
            "--spines", str(cfg.sim_spines), "--leaves-per-spine", str(cfg.sim_leaves_per_spine),
            *security_args(creds, "agents"), "--metrics-listen", METRICS_LISTEN,
        ]
        if cfg.launch:
            # One dir per AZ process: each keeps its own members.json.
            argv += ["--launch", "--state-dir", str(agents_dir / az)]
        children.append(
            Child(
                name=f"{az}-agents", kind="agents", az=az, argv=argv, log_path=logs / f"{az}-agents.log",
                ready=re.compile(rf"^PHALANX_AGENTS_READY az={re.escape(az)} nodes=\d+(?: metrics=(?P<metrics>\S+))?\s*$",
                                 re.M),
            )
        )
    return children
