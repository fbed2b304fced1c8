"""A real multi-member etcd cluster, one member per AZ host, in namespaces.

Health is judged from inside the cluster: the root namespace has no route to
the hosts (by design, nothing is added to it), so every check runs
``etcdctl`` inside a client host. ``EtcdServer.wait_ready`` is not used for
the same reason: it polls /health from the calling process's namespace.

Members serve clients and peers over TLS with client-certificate auth (as
deployed; docs/security.md): :meth:`EtcdCluster.build` makes one etcd CA per
cluster in ``<data_root>/pki`` (``phalanx.etcd_pki``), its server
certificate naming every member's address (members verify each other's peer
certificates against the address they dial), and ``etcdctl`` uses the
``root`` client certificate there. Roles and ``auth enable`` are the
caller's (:mod:`chaos.cluster` provisions its Phalanx cluster's users).

Members are ``EtcdServer``s (``netns`` set), started through
``phalanx.procs.spawn`` like every process of the suite: a member dies with
the runner that started it (or restarted it, from any thread), even when the
runner is SIGKILLed before the namespace teardown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from chaos.netns import Host, NetnsCluster
from phalanx import etcd_pki
from phalanx.etcd_server import EtcdServer
from phalanx.tls import utc_now

CLIENT_PORT = 2379
PEER_PORT = 2380
PROBE_KEY = "/phalanx-chaos/probe"


@dataclass
class EtcdMember:
    """One etcd member and the host it runs on."""

    az: str
    host: Host
    server: EtcdServer

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    @property
    def proc(self) -> subprocess.Popen[Any] | None:
        return self.server.proc

    def alive(self) -> bool:
        return self.server.proc is not None and self.server.proc.poll() is None


@dataclass
class EtcdCluster:
    """etcd members on the given hosts (one per AZ), checked from ``client``.

    Build it with :meth:`build` (adds hosts ``etcd-<az>`` and ``ctl``) or pass
    your own hosts. Members use fixed ports: each host has its own namespace,
    so ports cannot clash, and the addresses stay readable in logs.
    """

    net: NetnsCluster
    hosts: Sequence[Host]
    client: Host
    data_root: Path
    token: str = "phalanx-chaos"
    # The etcd PKI (phalanx.etcd_pki layout); None: plaintext, no client auth.
    tls_dir: Path | None = None
    members: dict[str, EtcdMember] = field(default_factory=dict)

    @classmethod
    def build(
        cls, net: NetnsCluster, data_root: Path, azs: Sequence[str] = ("a", "b", "c"), client: Host | None = None,
        *, tls: bool = True,
    ) -> "EtcdCluster":
        hosts = [net.add_host(f"etcd-{az}", az=az) for az in azs]
        tls_dir = None
        if tls:
            tls_dir = Path(data_root) / "pki"
            etcd_pki.init(tls_dir, hosts=tuple(h.ip for h in hosts), now=utc_now())
            etcd_pki.issue_client(tls_dir, etcd_pki.ROOT_USER, now=utc_now())
        return cls(net=net, hosts=hosts, client=client or net.add_host("ctl"), data_root=Path(data_root),
                   tls_dir=tls_dir)

    def __post_init__(self) -> None:
        servers = {}
        for h in self.hosts:
            az = h.az or h.name
            name = f"etcd-{az}"
            d = self.data_root / name
            servers[az] = EtcdServer(
                data_dir=d / "data",
                name=name,
                host=h.ip,
                client_port=CLIENT_PORT,
                peer_port=PEER_PORT,
                cluster_token=self.token,
                log_path=d / "etcd.log",
                netns=h.netns,
                tls_dir=self.tls_dir,
            )
        initial = ",".join(f"{s.name}={s.peer_url}" for s in servers.values())
        for h in self.hosts:
            az = h.az or h.name
            servers[az].initial_cluster = initial
            self.members[az] = EtcdMember(az, h, servers[az])

    # -- lifecycle -------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> "EtcdCluster":
        """Start every member, then wait until all are healthy and a write commits."""
        self.data_root.mkdir(parents=True, exist_ok=True)
        for m in self.members.values():
            self._start_member(m)
        self.wait_healthy(list(self.members), timeout)
        return self

    def _start_member(self, m: EtcdMember) -> None:
        m.server.data_dir.parent.mkdir(parents=True, exist_ok=True)
        m.server.start()
        assert m.server.proc is not None
        self.net.track(m.server.proc)

    def stop(self) -> None:
        """Stop every member gracefully (teardown of the NetnsCluster kills anything left)."""
        for m in self.members.values():
            m.server.stop(timeout=5.0)

    def kill(self, az: str) -> None:
        """SIGKILL member ``az``'s process group and reap it."""
        m = self.members[az]
        if m.server.proc is not None:
            m.server.signal(signal.SIGKILL)
            m.server.proc.wait(timeout=10)
            m.server.proc = None

    def restart(self, az: str, timeout: float = 30.0) -> None:
        """(Re)start member ``az`` from its data dir and wait until it is healthy.

        The data dir holds the member's identity and WAL, so the initial-cluster
        flags are ignored on restart and it rejoins as itself.
        """
        m = self.members[az]
        if m.alive():
            self.kill(az)
        self._start_member(m)
        self.wait_healthy([az], timeout)

    def process_ref(self, az: str) -> Callable[[], subprocess.Popen[Any] | None]:
        """A callable giving member ``az``'s current process (for Pause/Kill faults)."""
        return lambda: self.members[az].server.proc

    def restarter(self, az: str) -> Callable[[], None]:
        """A callable that restarts member ``az`` without waiting (for Kill/Restart faults)."""
        return lambda: self._start_member(self.members[az])

    # -- checks ------------------------------------------------------------------

    def endpoints(self, azs: Sequence[str] | None = None) -> list[str]:
        return [self.members[a].endpoint for a in (azs or list(self.members))]

    @property
    def root_dir(self) -> Path | None:
        """The etcd ``root`` user's client dir (ca.crt client.crt client.key), or None without TLS."""
        return self.tls_dir / etcd_pki.ROOT_USER if self.tls_dir else None

    def etcdctl(
        self, *args: str, azs: Sequence[str] | None = None, command_timeout: float = 2.0, dial_timeout: float = 1.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``etcdctl ARGS`` (API v3) inside the client host against the members ``azs``."""
        eps = ",".join(self.members[a].server.client_url for a in (azs or list(self.members)))
        env = dict(os.environ, ETCDCTL_API="3")
        creds: list[str] = []
        if self.root_dir is not None:
            root = etcd_pki.files(self.root_dir)
            creds = [f"--cacert={root.ca}", f"--cert={root.cert}", f"--key={root.key}"]
        return self.client.run(
            ["etcdctl", f"--endpoints={eps}", *creds, f"--command-timeout={command_timeout}s",
             f"--dial-timeout={dial_timeout}s", *args],
            env=env, timeout=command_timeout + dial_timeout + 20,
        )

    def member_health(self, azs: Sequence[str] | None = None) -> dict[str, bool]:
        """Per member: does it answer a linearizable read (needs a leader and quorum)?"""
        res = self.etcdctl("endpoint", "health", "-w", "json", azs=azs)
        by_ep: dict[str, bool] = {}
        try:
            for item in json.loads(res.stdout or "[]"):
                by_ep[item["endpoint"].split("://", 1)[-1]] = bool(item.get("health"))
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
        return {a: by_ep.get(self.members[a].endpoint, False) for a in (azs or list(self.members))}

    def healthy(self, azs: Sequence[str] | None = None) -> bool:
        """All of ``azs`` (default: all members) are healthy."""
        return all(self.member_health(azs).values())

    def can_write(self, azs: Sequence[str] | None = None, timeout: float = 1.0) -> bool:
        """A put through ``azs`` commits within ``timeout``: the cluster has quorum."""
        res = self.etcdctl("put", PROBE_KEY, str(time.time()), azs=azs, command_timeout=timeout)
        return res.returncode == 0 and "OK" in res.stdout

    def wait_healthy(self, azs: Sequence[str] | None = None, timeout: float = 30.0) -> None:
        """Wait until ``azs`` are healthy and a write through them commits."""
        deadline = time.monotonic() + timeout
        while True:
            for a in azs or list(self.members):
                p = self.members[a].server.proc
                if p is not None and p.poll() is not None:
                    raise RuntimeError(
                        f"etcd-{a} exited with {p.returncode}; log: {self.members[a].server.log_path}"
                    )
            if self.healthy(azs) and self.can_write(azs):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd members {list(azs or self.members)} not healthy after {timeout}s: "
                                   f"{self.member_health(azs)}")
            time.sleep(0.2)
