"""Start and stop a real etcd server process (for `phalanx up`, tests, chaos).

Uses the `etcd` binary on PATH (Debian package etcd-server; scripts/setup.sh
installs it). No client library here: readiness is polled on /health. The
server is started with ``phalanx.procs.spawn``: it dies with the process that
started it, however that one ends.

With ``tls_dir`` (a directory made by ``phalanx.etcd_pki.init``) the member
serves clients and peers over TLS only and requires a client certificate of
the etcd CA on both (``--client-cert-auth``, ``--peer-client-cert-auth``);
with auth enabled (``phalanx.etcd_auth.provision``) etcd takes the client
certificate's CN as the user. /health is then polled over TLS with the
``root`` client certificate, which ``start`` issues into ``tls_dir/root/``
if it is not there.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from phalanx import etcd_pki, procs
from phalanx.limits import ETCD_DEFAULT_QUOTA_BYTES
from phalanx.tls import TlsFiles


class EtcdNotFound(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def etcd_binary() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if not path:
        raise EtcdNotFound("no etcd binary on PATH; run scripts/setup.sh (installs Debian's etcd-server)")
    return path


@dataclass
class EtcdServer:
    """One etcd member. For a single-node server leave ``initial_cluster`` empty."""

    data_dir: Path
    name: str = "default"
    host: str = "127.0.0.1"
    client_port: int = 0
    peer_port: int = 0
    initial_cluster: str = ""  # "n1=http://h1:p1,n2=..." (https with tls_dir) for a multi-member cluster
    cluster_state: str = "new"
    cluster_token: str = "phalanx"
    log_path: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    # etcd refuses every write past it (NOSPACE alarm); coordinators are told
    # it (--etcd-quota-bytes), as etcd does not report it.
    quota_backend_bytes: int = ETCD_DEFAULT_QUOTA_BYTES
    # History etcd keeps (--auto-compaction-retention, periodic mode): every
    # this long it compacts away the revisions older than this. Phalanx's
    # watchers resume within seconds and re-read on a compacted watch, so
    # minutes are plenty; a busy cluster's history stays far below the quota
    # (docs/etcd-keys.md "Compaction"). etcd's duration syntax: "5m", "30s".
    compaction_retention: str = "5m"
    netns: str | None = None  # run inside `ip netns exec NETNS`
    # False only for a script whose starter exits while etcd keeps serving
    # (scripts/gpu_node_check.sh stops it by pid itself).
    die_with_parent: bool = True
    # An etcd_pki.init directory: TLS with client certificates for clients
    # and peers. None: plaintext (only behind --insecure).
    tls_dir: Path | None = None
    proc: subprocess.Popen | None = None
    last_health_error: Exception | None = None

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if self.tls_dir is not None:
            self.tls_dir = Path(self.tls_dir)
        if not self.client_port:
            self.client_port = free_port(self.host)
        if not self.peer_port:
            self.peer_port = free_port(self.host)

    @property
    def scheme(self) -> str:
        return "https" if self.tls_dir is not None else "http"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.peer_port}"

    @property
    def root_tls(self) -> TlsFiles | None:
        """The root user's client files (``tls_dir/root/``), None in plaintext."""
        return etcd_pki.files(self.tls_dir / etcd_pki.ROOT_USER) if self.tls_dir is not None else None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def command(self) -> list[str]:
        cluster = self.initial_cluster or f"{self.name}={self.peer_url}"
        cmd = [
            etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", cluster,
            "--initial-cluster-state", self.cluster_state,
            "--initial-cluster-token", self.cluster_token,
            # Small and fast for tests and laptops; still durable (fsync on).
            # A partitioned member that rejoins must not force an election
            # (which restarts every lease TTL and churns all AZ leaders).
            "--pre-vote",
            "--heartbeat-interval", "100",
            "--election-timeout", "1000",
            "--quota-backend-bytes", str(self.quota_backend_bytes),
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", self.compaction_retention,
            "--logger", "zap",
            "--log-level", "warn",
        ]
        if self.tls_dir is not None:
            server = etcd_pki.server_files(self.tls_dir)
            cmd += [
                "--cert-file", str(server.cert), "--key-file", str(server.key),
                "--trusted-ca-file", str(server.ca), "--client-cert-auth",
                "--peer-cert-file", str(server.cert), "--peer-key-file", str(server.key),
                "--peer-trusted-ca-file", str(server.ca), "--peer-client-cert-auth",
            ]
        cmd += self.extra_args
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns] + cmd
        return cmd

    def start(self) -> "EtcdServer":
        if self.tls_dir is not None:
            for p in etcd_pki.server_files(self.tls_dir).paths():
                if not p.is_file():
                    raise FileNotFoundError(f"etcd {self.name}: {p} is missing: tls_dir {self.tls_dir} must be "
                                            f"made by phalanx certs etcd-init --dir {self.tls_dir}")
            root = self.root_tls
            assert root is not None
            if not all(p.is_file() for p in root.paths()):
                etcd_pki.issue_client(self.tls_dir, etcd_pki.ROOT_USER, now=datetime.datetime.now(datetime.timezone.utc))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ, ETCD_UNSUPPORTED_ARCH=os.environ.get("ETCD_UNSUPPORTED_ARCH", ""))
        # Dies with whoever started it (SIGKILL: etcd's data is fsynced, so a
        # kill is as safe as a power cut), even if that one is SIGKILLed itself.
        try:
            if self.die_with_parent:
                self.proc = procs.spawn(self.command(), stdout=out, stderr=subprocess.STDOUT, env=env)
            else:
                self.proc = subprocess.Popen(
                    self.command(), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child holds its own copy
        return self

    def healthy(self, timeout: float = 1.0) -> bool:
        try:
            if self.tls_dir is None:
                with urllib.request.urlopen(f"{self.client_url}/health", timeout=timeout) as resp:
                    return json.loads(resp.read()).get("health") in ("true", True)
            return self._healthy_tls(timeout)
        except Exception as exc:
            # Kept for wait_ready's error: over TLS a refused certificate
            # (ssl.SSLError naming the check) is not the same as "not up yet".
            self.last_health_error = exc
            return False

    def _healthy_tls(self, timeout: float) -> bool:
        """GET /health over TLS with the root certificate, verifying the
        member against ETCD_SERVER_NAME as every client does (its address
        need not be in the certificate). HTTP/1.0 by hand: urllib cannot
        verify against a name other than the one it dials."""
        root = self.root_tls
        assert root is not None
        ctx = ssl.create_default_context(cafile=str(root.ca))
        ctx.load_cert_chain(str(root.cert), str(root.key))
        with socket.create_connection((self.host, self.client_port), timeout=timeout) as raw:
            with ctx.wrap_socket(raw, server_hostname=etcd_pki.ETCD_SERVER_NAME) as tls:
                tls.sendall(b"GET /health HTTP/1.0\r\nHost: " + etcd_pki.ETCD_SERVER_NAME.encode() + b"\r\n\r\n")
                data = b""
                while chunk := tls.recv(65536):
                    data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        return head.startswith(b"HTTP/1.") and json.loads(body).get("health") in ("true", True)

    def wait_ready(self, timeout: float = 30.0) -> "EtcdServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd {self.name} exited with {self.proc.returncode}; log: {self.log_path}"
                )
            if self.healthy(0.5):
                return self
            time.sleep(0.05)
        last = f" (last: {self.last_health_error!r})" if self.last_health_error is not None else ""
        raise TimeoutError(f"etcd {self.name} not healthy at {self.client_url} after {timeout}s{last}")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=timeout)
        self.proc = None


def loopback_cluster(
    data_root: Path, size: int = 3, *, host: str = "127.0.0.1", token: str = "phalanx-local",
    tls_dir: Path | None = None,
) -> list[EtcdServer]:
    """The members of one new ``size``-member cluster on ``host``, each on its
    own client and peer ports, data under ``data_root/<name>`` (not started;
    see ``start_members``). For tests that stop or pause single members; the
    chaos suite builds its cluster in namespaces instead (chaos/etcd_cluster.py)."""
    if size < 1:
        raise ValueError(f"an etcd cluster needs at least one member, got {size}")
    data_root = Path(data_root)
    members = [
        EtcdServer(
            data_dir=data_root / f"m{i}" / "data", name=f"m{i}", host=host,
            log_path=data_root / f"m{i}.log", cluster_token=token, tls_dir=tls_dir,
        )
        for i in range(1, size + 1)
    ]
    initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
    for m in members:
        m.initial_cluster = initial
    return members


def start_members(members: list[EtcdServer], timeout: float = 30.0) -> list[EtcdServer]:
    """Start every member, then wait until each is healthy (a new cluster has
    no leader, hence no healthy member, before a quorum runs). Stops them all
    if one does not come up."""
    try:
        for m in members:
            m.start()
        deadline = time.monotonic() + timeout
        for m in members:
            m.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        stop_members(members)
        raise
    return members


def stop_members(members: list[EtcdServer]) -> None:
    """Stop every member (SIGCONT first: a paused process ignores SIGTERM until resumed)."""
    for m in members:
        m.signal(signal.SIGCONT)
        m.stop()
