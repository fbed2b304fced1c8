"""The run of ``phalanx up`` (``Up``): make the state dir and the
credentials, start etcd, the coordinators and the agents in order, wait until
every AZ has a leader of this run, print how to reach the cluster, serve the
sample workload, and on any stop shut everything down in order
(docs/local-cluster.md); ``run`` is the command's entry point."""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

from phalanx import failpoints
from phalanx.client import AsyncClient
from phalanx.errors import PhalanxError
from phalanx.etcd_server import EtcdServer, free_port
from phalanx.up.children import Child, build_children, child_env, set_agent_coordinators
from phalanx.up.config import UpConfig, choose_cluster_name
from phalanx.up.credentials import (
    CLIENT_CONFIG, ETCD_PKI_DIR, PKI_DIR, Credentials, activation_line, cli_bin_dir, make_credentials,
    write_client_config,
)
from phalanx.up.output import LineOut
from phalanx.up.ports import pick_ports, replaced_ports
from phalanx.up.startup import LeaderSeen, StartupFailed, leaders_of_this_run
from phalanx.up.state_dir import (
    CLUSTER_FILE, OWNER_FILE, STATE_DIR_PREFIX, owner_alive, read_owner, reap_stale_state_dirs, write_owner,
)
from phalanx.up.workload import Workload


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
