"""``phalanx up``: a whole multi-AZ cluster on one machine, for trying Phalanx.

docs/local-cluster.md describes it for users. Starts (each in its own
session, output in ``<state-dir>/logs/``, every one through
``phalanx.procs.spawn`` so that it dies with ``up`` however ``up`` dies):

- etcd (``phalanx.etcd_server.EtcdServer`` under ``<state-dir>/etcd``) unless
  ``--etcd`` points at one;
- per AZ (``az-a``, ``az-b``, ...): M coordinator replicas
  (``python -m coordinator``) and one process of K simulated node agents
  (``python -m agent.sim``);

all of it secure by default: before anything starts, ``up`` makes a gRPC CA
for the cluster under ``<state-dir>/pki/<cluster>/`` (a certificate for every
coordinator, every simulated node and one admin client) and an etcd PKI
under ``<state-dir>/etcd-pki/`` (``phalanx.etcd_pki``; with ``--etcd``, the
PKI given by ``--etcd-pki``) whose etcd serves TLS and requires client
certificates, and provisions the cluster's least-privilege etcd users
(``phalanx.etcd_auth``: the coordinator's; agents get none). Coordinators
get ``--tls-dir`` and ``--etcd-tls-dir``; agents, started once their AZ's
coordinators serve, get ``--tls-dir`` and ``--coordinators`` (their AZ's
coordinator addresses: they read their token check through them and hold no
etcd endpoint or credential, docs/design.md §9.3). ``--insecure`` runs
everything in plaintext instead (with a warning), agents still through the
coordinators. Every coordinator and agent process also serves /metrics
on a free loopback port (``--metrics-listen 127.0.0.1:0``); once all are
ready, ``up`` prints one ``metrics NAME URL`` line per process.

Then it prints ``PHALANX_CLUSTER=name``, ``PHALANX_CONFIG=<state-dir>/config.yaml``
(the kubeconfig-style client config: cluster, addresses, the admin
certificate's dir) and ``PHALANX_ADDRESS=host:port,...`` (every coordinator)
once every AZ has a leader elected in this run, and, unless
``--no-workload``, submits the specs in ``examples/`` in a loop (over TLS, as
the admin) and prints a progress line every ~2 s.

Ctrl-C / SIGTERM / SIGHUP, or a closed stdout: stop the workload, SIGTERM
every child group, wait, SIGKILL stragglers, stop etcd, remove the state dir
if ``up`` created it (a ``--state-dir`` given by the user is kept, etcd data
included, so the next ``up`` with the same dir finds its gangs again). A state
dir ``up`` created under the temp dir holds an owner file; the next ``up``
removes such a dir once its owner is dead (SIGKILL leaves it behind). Exit
code 0 after a clean shutdown, 1 when start-up failed, an unexpected error or
a closed stdout stopped it, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, TextIO

import yaml

from phalanx import failpoints, procs
from phalanx.client import AsyncClient, is_terminal, state_name
from phalanx.errors import AlreadyExists, PhalanxError, Unimplemented
from phalanx.etcd_server import EtcdServer, free_port
from phalanx.model import GangState
from phalanx.spec import load_spec
from phalanx.up_args import add_arguments  # noqa: F401 (phalanx.up.add_arguments, as before)

REPO_ROOT = Path(__file__).resolve().parents[2]
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

# State dirs `up` creates itself: <temp dir>/phalanx-up-XXXX, each with an
# owner file naming the `up` process (pid and kernel start time, so a reused
# pid never passes for the owner). The next `up` removes the dirs of dead
# owners that no live process still uses.
STATE_DIR_PREFIX = "phalanx-up-"
OWNER_FILE = "phalanx-up.owner"
# A kept --state-dir remembers its cluster name, so the next `up` on it finds
# its gangs again without --cluster.
CLUSTER_FILE = "cluster"
DEFAULT_CLUSTER_PREFIX = "local"

# --launch runs every member as two real processes (its fencing shim and the
# member). On a small machine hundreds of them make every CLI call slow, so
# the sample workload keeps at most this many members live (pending ones
# included) and no gang bigger than half of it.
LAUNCH_MEMBER_BUDGET = max(4, 2 * (os.cpu_count() or 1))
# The sample member under --launch: programs every POSIX machine has (no
# train.py, no torchrun); it prints what Phalanx gave it, then sleeps.
SAMPLE_MEMBER_COMMAND = [
    "/bin/sh", "-c",
    'echo "rank=$RANK world=$WORLD_SIZE gang=$PHALANX_GANG node=$PHALANX_NODE '
    'master=$MASTER_ADDR:$MASTER_PORT"; sleep "$SAMPLE_SECONDS"; echo "rank=$RANK done"',
]


# Every process up starts serves /metrics on a free loopback port (its ready
# line says which; up prints them all).
METRICS_LISTEN = "127.0.0.1:0"
METRICS_LINE = re.compile(r"^phalanx up: metrics (\S+) (https?://\S+/metrics)$")


# The simulator's fabric when --spines / --leaves-per-spine are not given
# (agent.sim's own defaults).
SIM_SPINES = 1
SIM_LEAVES_PER_SPINE = 2


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
    insecure: bool = False
    etcd_pki: str = ""
    log_format: str | None = None  # for the children (PHALANX_LOG_FORMAT); None: theirs

    @property
    def sim_spines(self) -> int:
        return self.spines if self.spines is not None else SIM_SPINES

    @property
    def sim_leaves_per_spine(self) -> int:
        return self.leaves_per_spine if self.leaves_per_spine is not None else SIM_LEAVES_PER_SPINE

    def node_names(self, az: str) -> list[str]:
        return sim_node_names(az, self.nodes_per_az, self.sim_spines, self.sim_leaves_per_spine)

    def coordinator_ids(self) -> list[str]:
        return list(self.coordinator_azs())

    def coordinator_azs(self) -> dict[str, str]:
        """Each coordinator id and the AZ it serves (its certificate's binding)."""
        return {f"{az}-c{j}": az for az in self.azs for j in range(self.coordinators_per_az)}

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
        if a.cluster and not valid_cluster_name(a.cluster):
            raise ValueError(f"--cluster must be a DNS label (a-z, 0-9, '-', at most 63), got {a.cluster!r}")
        if not a.start_timeout > 0:
            raise ValueError(f"--start-timeout must be positive, got {a.start_timeout}")
        if a.etcd:
            from phalanx.store import parse_endpoints  # the coordinators' own parser: what they would refuse

            try:
                parse_endpoints(normalize_etcd(a.etcd))
            except ValueError as exc:
                raise ValueError(f"--etcd: {exc}") from None
        if a.state_dir and os.path.exists(a.state_dir) and not os.path.isdir(a.state_dir):
            raise ValueError(f"--state-dir: {a.state_dir} exists and is not a directory")
        problem = security_flags_error(bool(a.etcd), a.etcd_pki, a.insecure)
        if problem:
            raise ValueError(problem)
        if a.etcd_pki:
            problem = etcd_pki_dir_error(Path(a.etcd_pki))
            if problem:
                raise ValueError(f"--etcd-pki: {problem}")
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
            insecure=a.insecure,
            etcd_pki=str(Path(a.etcd_pki).resolve()) if a.etcd_pki else "",
            log_format=getattr(a, "log_format", None),
        )


def security_flags_error(own_etcd_given: bool, etcd_pki: str, insecure: bool) -> str | None:
    """Why ``--etcd`` / ``--etcd-pki`` / ``--insecure`` do not go together
    (None: they do). An etcd of the user's own is reached with TLS and
    client certificates like the one ``up`` starts, so ``up`` needs that
    etcd's CA to issue this cluster's etcd users: ``--etcd-pki``."""
    if insecure and etcd_pki:
        return "--etcd-pki: not with --insecure (which reaches etcd in plaintext, without users)"
    if etcd_pki and not own_etcd_given:
        return "--etcd-pki: only with --etcd (without --etcd, up makes the etcd PKI of the etcd it starts)"
    if own_etcd_given and not etcd_pki and not insecure:
        return (
            "--etcd: needs --etcd-pki DIR (that etcd's PKI, from phalanx certs etcd-init, to issue this cluster's "
            "etcd users) or --insecure (an etcd without TLS and auth)"
        )
    return None


def etcd_pki_dir_error(directory: Path) -> str | None:
    """What ``--etcd-pki`` lacks: the CA, from which ``up`` issues this
    cluster's etcd users (and root's client files, to provision their
    roles, if the directory has none yet)."""
    missing = [str(p) for p in (directory / "ca.crt", directory / "ca.key") if not p.is_file()]
    if missing:
        return f"{directory}: missing {', '.join(missing)} (make the etcd PKI with phalanx certs etcd-init --dir {directory})"
    return None


def valid_cluster_name(name: str) -> bool:
    return len(name) <= 63 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name) is not None


def choose_cluster_name(given: str, remembered: str, token: str) -> str:
    """``--cluster`` if given, else the name a kept state dir remembers, else
    ``local-<token>``: two local clusters never share a name by accident (the
    CLI's default address could otherwise answer from the other one)."""
    if given:
        return given
    if remembered and valid_cluster_name(remembered):
        return remembered
    return f"{DEFAULT_CLUSTER_PREFIX}-{token}"


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


def replaced_ports(base: int, ports: list[int]) -> list[tuple[int, int]]:
    """(asked, taken instead) for every port of ``ports`` that is not
    ``base + i``; none with base 0 (nothing was asked for)."""
    if not base:
        return []
    return [(base + i, p) for i, p in enumerate(ports) if p != base + i]


def pick_ports(base: int, count: int) -> list[int]:
    """``base, base+1, ...`` so PHALANX_ADDRESS is the same from run to run;
    any taken port (or all, with base 0) replaced by a free one
    (``replaced_ports`` says which, for the warning)."""
    ports: list[int] = []
    for i in range(count):
        port = base + i if base else 0
        if not port or not port_is_free(port):
            port = free_port()
            while port in ports:
                port = free_port()
        ports.append(port)
    return ports


# --- credentials --------------------------------------------------------------------

# Under the state dir: the cluster's gRPC CA and what it issued
# (pki/<cluster>/...), the etcd PKI of the etcd `up` starts (etcd-pki/), and
# the client config the CLI and the SDK read ($PHALANX_CONFIG).
PKI_DIR = "pki"
ETCD_PKI_DIR = "etcd-pki"
CLIENT_CONFIG = "config.yaml"
ADMIN_NAME = "up"  # the admin certificate's name: phalanx://<cluster>/admin/up


@dataclass(frozen=True)
class Credentials:
    """Every file a process of this run is started with (docs/local-cluster.md)."""

    server_dir: Path  # --tls-dir of every coordinator and agent process: ca.crt + their certs
    admin_dir: Path  # ca.crt client.crt client.key: up's own clients, and the client config's tls_dir
    etcd_coordinator: Path  # ca.crt client.crt client.key of phalanx-<cluster>-coordinator (agents get no etcd user)
    etcd_root: Path  # ... of root: provisions the roles (and reads the revision before any coordinator runs)


def sim_node_names(az: str, nodes: int, spines: int, leaves_per_spine: int) -> list[str]:
    """The nodes ``python -m agent.sim`` simulates for these flags (its own
    topology function), so each gets an agent certificate for its node."""
    from phalanx.simulated_topology import simulated_fabric

    return [t.node for t in simulated_fabric(az, nodes, spines, leaves_per_spine)]


def make_credentials(
    state_dir: Path, cluster: str, coordinators: Mapping[str, str], nodes: Mapping[str, str], etcd_pki_dir: Path,
    *, now: datetime.datetime,
) -> Credentials:
    """The cluster's gRPC CA (kept with a kept state dir, else new), a
    certificate for every coordinator and simulated node (id -> its AZ: each
    certificate is bound to it) and an admin client certificate (issued
    afresh every run), and this cluster's etcd users from the etcd PKI in
    ``etcd_pki_dir`` (whose ``root/`` must exist)."""
    from phalanx import certs, etcd_pki

    base = state_dir / PKI_DIR / cluster
    ca_dir, server_dir, admin_dir = base / "ca", base / "servers", base / "admin"
    if not (ca_dir / certs.CA_CERT).is_file():
        certs.init_ca(ca_dir, cluster, now=now)
    for d in (server_dir, admin_dir):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.copyfile(ca_dir / certs.CA_CERT, d / certs.CA_CERT)
    # A coordinator certificate names the cluster's server name, which every
    # client verifies whatever address it dials (and the loopback names).
    for cid, az in coordinators.items():
        certs.issue(ca_dir, "coordinator", cid, az=az, now=now, out=certs.leaf_paths(server_dir, "coordinator", cid))
    for node, az in nodes.items():
        certs.issue(ca_dir, "agent", node, node=node, az=az, now=now, out=certs.leaf_paths(server_dir, "agent", node))
    certs.issue(ca_dir, "admin", ADMIN_NAME, now=now, out=(admin_dir / "client.crt", admin_dir / "client.key"))
    return Credentials(
        server_dir=server_dir,
        admin_dir=admin_dir,
        etcd_coordinator=etcd_pki.issue_client(etcd_pki_dir, etcd_pki.user_for(cluster, "coordinator"), now=now),
        etcd_root=etcd_pki_dir / etcd_pki.ROOT_USER,
    )


ACTIVATION_LINE = re.compile(r"^export PATH=\S+ PHALANX_CONFIG=\S+ PHALANX_STATE_DIR=\S+$")


def cli_bin_dir() -> Path | None:
    """The directory of the ``phalanx`` command that belongs to this Python
    (``.venv/bin`` after scripts/setup.sh), None when it has none."""
    bin_dir = Path(sys.executable).parent
    return bin_dir if (bin_dir / "phalanx").is_file() else None


def activation_line(bin_dir: Path | None, config: Path, state_dir: Path) -> str:
    """The one line a new shell needs for everything the README runs: this
    install's ``phalanx``, ``python3`` and ``python`` first on PATH (a fresh
    clone's are only in ``.venv/bin``), the client config and the state dir
    ``phalanx logs`` reads. Paths are shell-quoted."""
    path = f"{shlex.quote(str(bin_dir))}:\"$PATH\"" if bin_dir is not None else '"$PATH"'
    return (f"export PATH={path} PHALANX_CONFIG={shlex.quote(str(config))} "
            f"PHALANX_STATE_DIR={shlex.quote(str(state_dir))}")


def client_config(cluster: str, addresses: list[str], tls_dir: str | None) -> dict[str, Any]:
    """The kubeconfig-style file the CLI and the SDK read ($PHALANX_CONFIG):
    which cluster, where, and with which credentials (``tls_dir`` relative to
    the file, so the state dir can move; None: ``insecure: true``)."""
    doc: dict[str, Any] = {"cluster": cluster, "addresses": list(addresses)}
    if tls_dir is None:
        doc["insecure"] = True
    else:
        doc["tls_dir"] = tls_dir
    return doc


def write_client_config(path: Path, cluster: str, addresses: list[str], tls_dir: Path | None) -> None:
    rel = os.path.relpath(tls_dir, path.parent) if tls_dir is not None else None
    doc = client_config(cluster, addresses, rel)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(
        "# Written by phalanx up for its cluster; the CLI and the SDK read it through $PHALANX_CONFIG.\n"
        + yaml.safe_dump(doc, sort_keys=False)
    )
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


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


# --- the run ----------------------------------------------------------------------


class StartupFailed(Exception):
    pass


class StdoutClosed(Exception):
    """Nobody reads ``up``'s output any more (a closed pipe, a hung-up
    terminal): shut down cleanly, as SIGPIPE would have stopped it, but
    without leaving anything behind."""


class LineOut:
    """Writes whole lines to one stream and never raises: the first write
    that fails (EPIPE from a closed pipe, EIO from a hung-up terminal, a
    closed file) marks the stream dead, points its descriptor at /dev/null
    (so the interpreter's final flush cannot fail either) and calls
    ``on_broken`` once. Clean-up must run whatever happened to the reader."""

    def __init__(self, stream: TextIO, on_broken: Any = None):
        self.stream = stream
        self.broken = False
        self.on_broken = on_broken

    def line(self, text: str) -> None:
        if self.broken:
            return
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except Exception:  # EPIPE, EIO, a closed file, no stream at all (fd 1 closed)
            self.mark_broken()

    def check(self) -> None:
        """Notice a reader that went away while we had nothing to write: the
        write end of a pipe without readers polls POLLERR (a hung-up terminal
        POLLHUP); a regular file never does."""
        if self.broken:
            return
        try:
            fd = self.stream.fileno()
        except (OSError, ValueError, AttributeError):
            return  # not a real descriptor (tests' StringIO): nothing to poll
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        try:
            events = poller.poll(0)
        except OSError:
            return
        if any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in events):
            self.mark_broken()

    def mark_broken(self) -> None:
        if self.broken:
            return
        self.broken = True
        try:
            fd = self.stream.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, fd)
            finally:
                os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass
        if self.on_broken is not None:
            self.on_broken()


@dataclass(frozen=True)
class LeaderSeen:
    """One AZ's leader as ClusterStatus reports it."""

    az: str
    leader_id: str
    address: str
    epoch: int


def leaders_of_this_run(
    seen: list[LeaderSeen], azs: tuple[str, ...], baseline_revision: int, addresses: set[str]
) -> tuple[set[str], dict[str, LeaderSeen]]:
    """(AZs whose leader was elected in this run, AZs whose leader key is an
    older one). A leader of this run is one of this run's coordinators
    (its address) whose key was created after ``baseline_revision``, the
    etcd revision read before any of them started: a leader key of an
    earlier run on the same etcd (a kept --state-dir, an --etcd shared
    across runs) carries the same ids and, with fixed ports, the same
    addresses, but never a newer epoch (an epoch is the key's create
    revision)."""
    ours: set[str] = set()
    stale: dict[str, LeaderSeen] = {}
    for s in seen:
        if s.az not in azs:
            continue
        if s.epoch > baseline_revision and s.address in addresses:
            ours.add(s.az)
        else:
            stale[s.az] = s
    return ours, stale


class Up:
    def __init__(self, cfg: UpConfig, out: TextIO = sys.stdout, err: TextIO = sys.stderr):
        self.cfg = cfg
        self.out = LineOut(out, on_broken=self._stdout_broken)
        self.err = LineOut(err)
        self.state_dir = Path()
        self.created_state_dir = False
        self.owner_written = False
        self.cluster = cfg.cluster
        self.etcd: EtcdServer | None = None
        self.etcd_reported = False
        self.creds: Credentials | None = None  # None: --insecure
        self.config_path: Path | None = None
        self.children: list[Child] = []
        self.addresses: list[str] = []
        self.baseline_revision = 0
        self.hurry = False  # a second Ctrl-C: skip the grace period
        self.stdout_closed = False
        self.stop_requested = False
        self.shutting_down = False
        self.main_task: asyncio.Task[Any] | None = None

    def say(self, text: str) -> None:
        self.out.line(f"phalanx up: {text}")

    def warn(self, text: str) -> None:
        self.err.line(f"phalanx up: {text}")

    def emit(self, text: str) -> None:
        """A bare line on stdout (PHALANX_ADDRESS=..., progress)."""
        self.out.line(text)

    def request_stop(self, why: str, *, escalate: bool = True) -> None:
        """A signal or a closed stdout: the first cancels the main task, which
        then shuts everything down in order; a later signal (``escalate``)
        drops the grace period, as does a second one after a failed start's
        shutdown began. Never cancels the shutdown itself."""
        if self.stop_requested or self.shutting_down:
            if escalate and self.stop_requested:
                self.hurry = True
            self.stop_requested = self.stop_requested or escalate
            return
        self.stop_requested = True
        self.say(f"{why}: shutting down")
        if self.main_task is not None and not self.main_task.done():
            self.main_task.cancel()

    def _stdout_broken(self) -> None:
        # Called from inside a write (maybe in the signal handler's say, maybe
        # deep in the workload): flag it and let request_stop do the rest.
        if not self.stdout_closed:
            self.stdout_closed = True
            self.warn("stdout closed (nobody reads it any more)")
            # Not a second Ctrl-C: the stop that made `tee` go away may be
            # the very signal being handled now (its say() hit the EPIPE).
            self.request_stop("stdout closed", escalate=False)

    async def main(self) -> int:
        """Start, serve until cancelled (signal, closed stdout), always clean up."""
        self.main_task = asyncio.current_task()
        code = 0
        keep_logs = False
        try:
            await self.start()
            await self.serve()
        except asyncio.CancelledError:
            pass  # a signal or a closed stdout cancelled us: a normal shutdown
        except StartupFailed as exc:
            self.warn(f"error: {exc}")
            code = 1
            keep_logs = True
        except Exception as exc:
            # A bug: one error line, the traceback for the report, and still
            # the whole clean-up below.
            self.warn(f"error: unexpected {type(exc).__name__}: {exc}; shutting down")
            for line in traceback.format_exc().rstrip().splitlines():
                self.err.line(line)
            code = 1
        finally:
            self.shutting_down = True
            await self.shutdown(keep_logs=keep_logs)
        if self.stdout_closed and code == 0:
            code = 1
        return code

    # -- state dir ------------------------------------------------------------------

    def _make_state_dir(self) -> None:
        cfg = self.cfg
        root = Path(tempfile.gettempdir())
        for path, why in reap_stale_state_dirs(root):
            self.say(f"removed {path} ({why})")
        if cfg.state_dir:
            self.state_dir = Path(cfg.state_dir).resolve()
            self.state_dir.mkdir(parents=True, exist_ok=True)
            owner = read_owner(self.state_dir)
            if owner is not None and owner_alive(owner) and owner.get("pid") != os.getpid():
                raise StartupFailed(
                    f"--state-dir {self.state_dir} is in use by another phalanx up (pid {owner.get('pid')})"
                )
        else:
            self.state_dir = Path(tempfile.mkdtemp(prefix=STATE_DIR_PREFIX, dir=root))
            self.created_state_dir = True
        write_owner(self.state_dir, cluster=self.cluster)
        self.owner_written = True

    async def start(self) -> None:
        cfg = self.cfg
        self._make_state_dir()
        remembered = ""
        if not self.created_state_dir:
            try:
                remembered = (self.state_dir / CLUSTER_FILE).read_text().strip()
            except OSError:
                pass
        self.cluster = choose_cluster_name(cfg.cluster, remembered, secrets.token_hex(3))
        if not self.created_state_dir:
            (self.state_dir / CLUSTER_FILE).write_text(self.cluster + "\n")
        write_owner(self.state_dir, cluster=self.cluster)
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        kept = "kept" if not self.created_state_dir else "removed on exit"
        self.say(f"state dir {self.state_dir} ({kept}); logs in {logs}")

        etcd_tls_dir: Path | None = None
        if cfg.insecure:
            self.warn(
                "warning: --insecure: every coordinator and agent serves and dials plaintext gRPC, and etcd runs "
                "without TLS or users: anyone who reaches these ports can read and change everything"
            )
        else:
            etcd_tls_dir = Path(cfg.etcd_pki) if cfg.etcd_pki else self.state_dir / ETCD_PKI_DIR
            self.creds = self._make_credentials(etcd_tls_dir)

        etcd = cfg.etcd
        if not etcd:
            self.etcd = EtcdServer(
                data_dir=self.state_dir / "etcd", name="phalanx-up", log_path=logs / "etcd.log",
                tls_dir=etcd_tls_dir,
            )
            try:
                self.etcd.start()
            except Exception as exc:  # EtcdNotFound, OSError
                raise StartupFailed(f"cannot start etcd: {exc}") from None
            await self._wait_etcd(self.etcd)
            etcd = self.etcd.endpoint
            tls = "TLS, client certificates" if self.creds is not None else "plaintext, no auth"
            self.say(f"etcd at {etcd} ({tls}; pid {self.etcd.proc.pid if self.etcd.proc else '?'})")
        else:
            self.say(f"using etcd at {etcd}")
        deadline = time.monotonic() + cfg.start_timeout
        if self.creds is not None:
            await self._provision(etcd, self.creds, deadline)
        # Before any coordinator of ours can campaign: a leader key created
        # after this revision is one of this run's.
        self.baseline_revision = await self._read_revision(etcd, deadline)

        count = len(cfg.azs) * cfg.coordinators_per_az
        ports = pick_ports(cfg.base_port, count)
        replaced = replaced_ports(cfg.base_port, ports)
        if replaced:
            self.warn(
                f"warning: asked for ports {cfg.base_port}-{cfg.base_port + count - 1}; "
                f"{', '.join(str(a) for a, _ in replaced)} taken, using "
                f"{', '.join(f'{a}->{t}' for a, t in replaced)} instead"
            )
        self.children = build_children(cfg, etcd, ports, logs, self.state_dir / "agents", self.cluster, self.creds,
                                       self.etcd.quota_backend_bytes if self.etcd is not None else 0)
        env = child_env()
        if cfg.log_format:
            env["PHALANX_LOG_FORMAT"] = cfg.log_format
        coordinators = [c for c in self.children if c.kind == "coordinator"]
        for child in coordinators:
            child.start(env)
        self.say(
            f"started {', '.join(cfg.azs)} (cluster {self.cluster!r}), each with {cfg.coordinators_per_az} "
            f"coordinator(s) and {cfg.nodes_per_az} simulated node(s); waiting for leaders"
        )
        # The agents, once their coordinators serve: they read through them.
        await self._wait_children_ready(env, deadline, coordinators)
        set_agent_coordinators(self.children)
        for child in self.children:
            if child.kind == "agents":
                child.start(env)
        await self._wait_children_ready(env, deadline, self.children)
        self._say_metrics()
        self.addresses = [c.address for c in self.children if c.kind == "coordinator"]
        await self._wait_leaders(self.addresses, deadline)
        # For `phalanx logs`: the agents' state dirs (member logs) are under it.
        self.emit(f"PHALANX_STATE_DIR={self.state_dir}")
        self.emit(f"PHALANX_CLUSTER={self.cluster}")
        self.config_path = self.state_dir / CLIENT_CONFIG
        write_client_config(
            self.config_path, self.cluster, self.addresses, self.creds.admin_dir if self.creds is not None else None
        )
        self.emit(f"PHALANX_CONFIG={self.config_path}")
        # Last: UpProcess (and scripts) take it as "ready".
        self.emit(f"PHALANX_ADDRESS={','.join(self.addresses)}")
        how = "an admin certificate, mutual TLS" if self.creds is not None else "insecure: plaintext"
        self.say(f"for the CLI, the SDK and `phalanx logs` in any shell, run the next line (cluster, addresses, {how}):")
        self.emit(activation_line(cli_bin_dir(), self.config_path, self.state_dir))

    def _say_metrics(self) -> None:
        """One line per process: where its /metrics is."""
        scheme = "http" if self.creds is None else "https"
        for c in self.children:
            if c.metrics:
                self.say(f"metrics {c.name} {scheme}://{c.metrics}/metrics")
        if self.creds is not None:
            admin = self.creds.admin_dir
            self.say(f"metrics need a client certificate of the cluster's CA, e.g. curl -sk --cert {admin}/client.crt "
                     f"--key {admin}/client.key URL (-k: an agent's certificate names no host)")

    def client_options(self) -> dict[str, Any]:
        """How ``up``'s own clients (readiness, workload) reach the cluster."""
        if self.creds is None:
            return {"insecure": True}
        return {"tls_dir": self.creds.admin_dir}

    def _make_credentials(self, etcd_pki_dir: Path) -> Credentials:
        from phalanx import etcd_pki
        from phalanx.certs import CertError
        from phalanx.tls import utc_now

        cfg = self.cfg
        nodes = {n: az for az in cfg.azs for n in cfg.node_names(az)}
        coordinators = cfg.coordinator_azs()
        now = utc_now()
        try:
            if not cfg.etcd_pki and not (etcd_pki_dir / "ca.crt").is_file():
                # A kept state dir keeps its etcd, and the etcd its CA and users.
                etcd_pki.init(etcd_pki_dir, now=now)
            if cfg.etcd_pki and not all(p.is_file() for p in etcd_pki.files(etcd_pki_dir / etcd_pki.ROOT_USER).paths()):
                etcd_pki.issue_client(etcd_pki_dir, etcd_pki.ROOT_USER, now=now)
            creds = make_credentials(self.state_dir, self.cluster, coordinators, nodes, etcd_pki_dir, now=now)
        except (CertError, OSError, ValueError) as exc:
            raise StartupFailed(f"cannot make the cluster's certificates: {exc}") from None
        self.say(
            f"certificates: gRPC CA and {len(cfg.coordinator_ids())} coordinator, {len(nodes)} agent and 1 admin "
            f"certificate under {self.state_dir / PKI_DIR / self.cluster}; etcd users under {etcd_pki_dir}"
        )
        return creds

    async def _provision(self, etcd: str, creds: Credentials, deadline: float) -> None:
        """This cluster's etcd users and roles (idempotent), as etcd's root."""
        from phalanx import etcd_auth, etcd_pki

        root = etcd_pki.files(creds.etcd_root)
        last: Exception | None = None
        while time.monotonic() < deadline:
            self._check_etcd_alive()
            try:
                await etcd_auth.provision(etcd, root, self.cluster)
                return
            except Exception as exc:  # etcd not answering yet; a refusal repeats until the deadline
                last = exc
            await asyncio.sleep(0.5)
        raise StartupFailed(f"cannot provision the etcd users of cluster {self.cluster!r} at {etcd}: {last}")

    async def _read_revision(self, etcd: str, deadline: float) -> int:
        from phalanx.store import Store  # the coordinators' own etcd client

        last: Exception | None = None
        from phalanx import etcd_pki

        tls = etcd_pki.files(self.creds.etcd_coordinator) if self.creds is not None else None
        async with Store(etcd, self.cluster, timeout=2.0, tls=tls) as store:
            while time.monotonic() < deadline:
                self._check_etcd_alive()
                try:
                    revision = await store.revision()
                    self._say_etcd_version(await store.server_version())
                    return revision
                except Exception as exc:  # StoreUnavailable & co: etcd not answering yet
                    last = exc
                await asyncio.sleep(0.5)
        raise StartupFailed(f"etcd at {etcd} did not answer within {self.cfg.start_timeout:g}s: {last}")

    def _say_etcd_version(self, version: str) -> None:
        """Once, at start: which etcd advisories apply (phalanx/etcd_version.py)."""
        from logging import WARNING

        from phalanx.etcd_version import advisory_line

        level, line = advisory_line(version, "etcd")
        if level >= WARNING:
            self.warn(f"warning: {line}")
        else:
            self.say(line)

    def _check_etcd_alive(self) -> None:
        etcd = self.etcd
        if etcd is not None and etcd.proc is not None and etcd.proc.poll() is not None:
            self.etcd_reported = True
            raise StartupFailed(f"etcd (pid {etcd.proc.pid}) exited with code {etcd.proc.returncode}; see {etcd.log_path}")

    async def _wait_etcd(self, etcd: EtcdServer) -> None:
        deadline = time.monotonic() + min(self.cfg.start_timeout, 60.0)
        while time.monotonic() < deadline:
            self._check_etcd_alive()
            # healthy() blocks for up to its timeout: keep it off the loop.
            if await asyncio.to_thread(etcd.healthy, 0.5):
                return
            await asyncio.sleep(0.1)
        raise StartupFailed(f"etcd not healthy after {min(self.cfg.start_timeout, 60.0):g}s; see {etcd.log_path}")

    async def _wait_children_ready(self, env: dict[str, str], deadline: float, children: list[Child]) -> None:
        while True:
            self._check_etcd_alive()
            pending = [c for c in children if not c.check_ready()]
            if not pending:
                return
            for c in pending:
                if c.alive():
                    continue
                code = c.proc.returncode if c.proc is not None else None
                # A coordinator that died before serving most likely lost a
                # race for its port: try again on a fresh one, twice at most.
                if c.kind == "coordinator" and c.starts < 3:
                    asked = c.argv[-1]
                    c.argv[-1] = f"127.0.0.1:{free_port()}"
                    self.warn(
                        f"warning: {c.name} exited with code {code} before serving on {asked} "
                        f"(port taken?); retrying on {c.argv[-1]}"
                    )
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
        stale: dict[str, LeaderSeen] = {}
        told_stale: set[str] = set()
        async with AsyncClient(addresses, timeout=5.0, **self.client_options()) as client:
            while True:
                try:
                    st = await client.status()
                    seen = [LeaderSeen(az.az, az.leader_id, az.leader_address, az.epoch) for az in st.azs if az.has_leader]
                    ours, stale = leaders_of_this_run(seen, self.cfg.azs, self.baseline_revision, set(addresses))
                    missing = wanted - ours
                    if not missing:
                        return
                    for az in sorted(set(stale) & missing - told_stale):
                        s = stale[az]
                        told_stale.add(az)
                        self.say(
                            f"{az}: leader key of an earlier run ({s.leader_id} at {s.address}, epoch {s.epoch}) "
                            "still held; waiting for its lease to expire"
                        )
                except PhalanxError:
                    pass  # not serving yet, or etcd unreachable for a moment
                self._check_etcd_alive()
                for c in self.children:
                    if not c.alive():
                        raise StartupFailed(f"{c.name} exited with code {c.proc.returncode if c.proc else None}; see {c.log_path}")
                if time.monotonic() > deadline:
                    why = "; ".join(
                        f"{az}: only the leader key of an earlier run ({stale[az].leader_id}, epoch {stale[az].epoch})"
                        for az in sorted(missing) if az in stale
                    )
                    raise StartupFailed(
                        f"no leader of this run after {self.cfg.start_timeout:g}s in {', '.join(sorted(missing))} "
                        f"({why or 'is etcd reachable? see the coordinator logs'})"
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
                self.out.check()
                if failpoints.on("up.serve_error"):
                    raise RuntimeError("failpoint up.serve_error")
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
        """One line per process of ours that died while serving (etcd
        included); its log holds the why."""
        for c in self.children:
            if c.proc is not None and not c.reported_exit and c.proc.poll() is not None:
                c.reported_exit = True
                self.warn(f"warning: {c.name} (pid {c.pid}) exited with code {c.proc.returncode}; see {c.log_path}")
        etcd = self.etcd
        if etcd is not None and etcd.proc is not None and not self.etcd_reported and etcd.proc.poll() is not None:
            self.etcd_reported = True
            self.warn(
                f"warning: etcd (pid {etcd.proc.pid}) exited with code {etcd.proc.returncode}; "
                f"the cluster cannot work without it; see {etcd.log_path}"
            )

    async def shutdown(self, keep_logs: bool = False) -> None:
        """Children first (they resign leadership and stop members), then etcd,
        then the state dir. Every step runs even if an earlier one failed.
        ``keep_logs``: after a failed start, a state dir we created keeps its
        logs (only) so the failure can be diagnosed (the next ``up`` removes
        it: its owner is dead by then)."""
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
                if entry.name not in ("logs", OWNER_FILE):
                    shutil.rmtree(entry, ignore_errors=True)
            self.warn(f"logs kept in {self.state_dir / 'logs'}")
        elif self.created_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        elif self.owner_written:
            try:
                (self.state_dir / OWNER_FILE).unlink()
            except OSError:
                pass
        self.say("stopped")


# --- state dirs of earlier runs ----------------------------------------------------------


def write_owner(state_dir: Path, *, cluster: str, pid: int | None = None) -> None:
    """Atomically record which ``up`` process owns ``state_dir``."""
    pid = os.getpid() if pid is None else pid
    doc = {"pid": pid, "start": procs.pid_start_time(pid), "cluster": cluster}
    tmp = state_dir / f".{OWNER_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(doc) + "\n")
    os.replace(tmp, state_dir / OWNER_FILE)


def read_owner(state_dir: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((state_dir / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("pid"), int) else None


def owner_alive(owner: dict[str, Any]) -> bool:
    start = owner.get("start")
    return procs.process_alive(int(owner["pid"]), start if isinstance(start, int) else None)


def processes_using(path: Path) -> list[int]:
    """Live processes whose command line names ``path`` or a path below it
    (etcd's --data-dir, an agent's --state-dir, a member shim's lease file)."""
    needle = str(path).encode()
    found = []
    for pid in procs.pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if needle in cmdline and procs.process_alive(pid):
            found.append(pid)
    return found


def stale_verdict(owner: dict[str, Any] | None, owner_is_alive: bool, users: list[int]) -> str | None:
    """Why a ``phalanx-up-*`` dir may go (None: keep it). Only a dir with an
    owner file (one ``up`` wrote it: never a stranger's dir), whose owner is
    dead and which no live process still uses (a child still shutting down)."""
    if owner is None or owner_is_alive or users:
        return None
    return f"state dir of a dead earlier run, pid {owner.get('pid')}"


def reap_stale_state_dirs(root: Path) -> list[tuple[Path, str]]:
    """Remove the state dirs that dead ``up`` runs left under ``root``;
    (path, why) for each removed."""
    removed = []
    try:
        candidates = sorted(root.glob(f"{STATE_DIR_PREFIX}*"))
    except OSError:
        return []
    for path in candidates:
        if not path.is_dir() or path.is_symlink():
            continue
        owner = read_owner(path)
        alive = owner is not None and owner_alive(owner)
        why = stale_verdict(owner, alive, processes_using(path) if owner is not None and not alive else [])
        if why is None:
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append((path, why))
    return removed


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


def fit_template(
    t: Template, nodes: int, gpus_per_node: int, azs: int, seq: int, *, launch: bool = False
) -> dict[str, Any]:
    """Shrink a template so it fits in about half an AZ (the whole cluster for
    a cross-AZ gang), give it a unique name and a short run. With ``launch``
    (members are real processes) every template but ``real-command`` (written
    for it) runs ``SAMPLE_MEMBER_COMMAND``: the examples' own commands name
    programs and files (torchrun, train.py) a fresh machine lacks. No gang
    then has more than half of ``LAUNCH_MEMBER_BUDGET`` members."""
    data = yaml.safe_load(yaml.safe_dump(t.data))  # deep copy
    gpus = max(1, min(int(data["resources"]["gpus"]), gpus_per_node))
    per_node = max(1, gpus_per_node // gpus)
    capacity = nodes * per_node * (azs if t.cross_az else 1)
    data["resources"]["gpus"] = gpus
    members = max(1, min(int(data["members"]), capacity // 2 if capacity > 1 else 1))
    if launch:
        members = min(members, max(1, LAUNCH_MEMBER_BUDGET // 2))
    data["members"] = members
    data["resources"]["rdma_nics"] = min(int(data["resources"].get("rdma_nics", 0)), gpus)
    data["name"] = f"{t.label}-{seq}"[:53].rstrip("-")
    seconds = 5 + (seq % 4) * 5
    run = data.setdefault("run", {})
    run["duration_s"] = float(seconds)
    if launch and not t.real_command:
        run["command"] = list(SAMPLE_MEMBER_COMMAND)
        run.setdefault("env", {})["SAMPLE_SECONDS"] = str(seconds)
    # Fail fast rather than block the queue when the simulated topology cannot
    # satisfy a template's constraints.
    data.setdefault("policy", {})["admission_timeout_s"] = 120.0
    return data


def workload_line(labels: list[str], gangs_per_az: int, launch: bool, budget: int = LAUNCH_MEMBER_BUDGET) -> str:
    """What the sample workload keeps running. Under --launch the member
    budget, over the whole cluster, usually binds first: it is named, so
    that two running gangs do not read as a fault."""
    line = f"workload: {', '.join(labels)}; up to {gangs_per_az} live gang(s) per AZ"
    if launch:
        line += (f", and with --launch at most {budget} members live in the whole cluster (2 per core of this "
                 f"machine, at least 4; docs/local-cluster.md), so usually fewer gangs")
    return line


class Workload:
    """Keeps ``gangs_per_az`` live gangs per AZ, submitted to that AZ's
    coordinators (the receiving AZ owns a gang), and prints progress."""

    def __init__(self, up: Up):
        self.up = up
        cfg = up.cfg
        self.templates = [
            t for t in load_templates()
            if (len(cfg.azs) > 1 or not t.cross_az)
            and (cfg.launch or not t.real_command)
        ]
        by_az: dict[str, list[str]] = {az: [] for az in cfg.azs}
        for c in up.children:
            if c.kind == "coordinator":
                by_az[c.az].append(c.address)
        # Each AZ's own coordinators first, the others as fallback.
        self.clients = {
            az: AsyncClient(
                addrs + [a for other, xs in by_az.items() if other != az for a in xs], timeout=5.0,
                **up.client_options(),
            )
            for az, addrs in by_az.items()
        }
        self.live: dict[str, tuple[str, GangState]] = {}  # gang id -> (az, state)
        self.live_members: dict[str, int] = {}  # gang id -> members (the --launch budget)
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
            self.up.say(workload_line([t.label for t in self.templates], self.up.cfg.gangs_per_az, self.up.cfg.launch))
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
                    self.up.emit(self.progress_line(now - started, rate))
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
            data = fit_template(
                template, max(nodes, 1), max(gpus_per_node, 1), len(cfg.azs), next(self.seq), launch=cfg.launch
            )
            if cfg.launch and sum(self.live_members.values()) + int(data["members"]) > LAUNCH_MEMBER_BUDGET:
                return  # the machine stays responsive: wait until live members finish
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
            self.live_members[result.gang.id] = int(data["members"])
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
                    self.live_members.pop(gid, None)
                    continue
            state = GangState(gang.state) if gang.state else GangState.PENDING
            if state in ADMITTED_STATES:
                self.admitted.add(gid)
            if is_terminal(gang):
                del self.live[gid]
                self.live_members.pop(gid, None)
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

    up.main_task = asyncio.current_task()  # a signal right away still stops us cleanly

    def on_signal(signame: str) -> None:
        up.request_stop(signame)

    # SIGHUP (terminal closed, ssh dropped) stops the cluster like SIGTERM,
    # with the same clean-up; its default action would kill `up` and skip it.
    # SIGPIPE stays ignored (Python's default; made sure of here): a closed
    # stdout shows up as EPIPE, which LineOut turns into a clean shutdown.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for sig in handled:
        loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        return await up.main()
    finally:
        for sig in handled:
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
        self.config: Path | None = None  # the client config it wrote
        self.activation = ""  # the `export PATH=... PHALANX_CONFIG=...` line it printed
        self._cond = threading.Condition()
        self._eof = False  # the reader has seen the end of the output
        self._reader: threading.Thread | None = None

    @property
    def addresses(self) -> list[str]:
        return self.address.split(",") if self.address else []

    def metrics_urls(self) -> dict[str, str]:
        """Process name (``az-a-c0``, ``az-a-agents``, ...) -> its /metrics
        URL, from the lines ``up`` printed."""
        found = (METRICS_LINE.match(line) for line in self.lines)
        return {m.group(1): m.group(2) for m in found if m}

    def start(self, timeout: float = 240.0) -> "UpProcess":
        # SIGTERM when the caller dies (a killed test run): `up` then cleans up.
        self.proc = procs.spawn(
            [sys.executable, "-m", "phalanx", "up", *self.args], die_with_parent=procs.TERM,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=self.env, cwd=str(REPO_ROOT),
        )
        self._reader = threading.Thread(target=self._read, name="phalanx-up-output", daemon=True)
        self._reader.start()
        m = self.wait_for_line(r"^PHALANX_ADDRESS=(\S+)$", timeout)
        self.address = m.group(1)
        sd = self.find_line(r"^phalanx up: state dir (\S+) ")
        self.state_dir = Path(sd.group(1)) if sd else None
        cf = self.find_line(r"^PHALANX_CONFIG=(\S+)$")
        self.config = Path(cf.group(1)) if cf else None
        # Printed right after PHALANX_ADDRESS: what a user pastes into a new shell.
        self.activation = self.wait_for_line(ACTIVATION_LINE.pattern, timeout).group(0)
        return self

    @property
    def admin_dir(self) -> Path | None:
        """The admin client dir the config names (what ``Client(tls_dir=...)``
        takes); None with --insecure."""
        if self.config is None:
            return None
        doc = yaml.safe_load(self.config.read_text())
        return (self.config.parent / doc["tls_dir"]).resolve() if doc.get("tls_dir") else None

    def client_kwargs(self) -> dict[str, Any]:
        """``Client``/``AsyncClient`` keyword arguments for this cluster."""
        admin = self.admin_dir
        return {"tls_dir": admin} if admin is not None else {"insecure": True}

    def client_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment in which the CLI reaches this cluster as ``up``
        told the user to (``PHALANX_CONFIG``, or the addresses in plaintext)."""
        env = dict(os.environ if base is None else base)
        for name in ("PHALANX_ADDRESS", "PHALANX_TLS_DIR", "PHALANX_INSECURE", "PHALANX_CONFIG"):
            env.pop(name, None)
        if self.config is not None:
            env["PHALANX_CONFIG"] = str(self.config)
        return env

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:  # drains the pipe so `up` never blocks on it
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
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
                # Exited *and* every line it wrote read (a last line may still
                # be in the pipe when the process is already gone).
                exited = self.proc is not None and self.proc.poll() is not None and self._eof
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
        if self._reader is not None:
            self._reader.join(timeout=10)  # every line in self.lines
        return self.proc.returncode

    def __enter__(self) -> "UpProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def proc_stat(pid: int) -> tuple[int, int, int, str] | None:
    """(ppid, pgid, sid, state) of a live process from /proc; None if gone."""
    fields = procs.stat_fields(pid)
    if fields is None:
        return None
    return int(fields[1]), int(fields[2]), int(fields[3]), fields[0].decode()


def child_groups(pid: int) -> set[int]:
    """Process groups of the direct children of ``pid`` (Linux /proc)."""
    groups = set()
    for p in procs.pids():
        st = proc_stat(p)
        if st is not None and st[0] == pid:
            groups.add(st[1])
    return groups
