"""Real certificates for the test suite: a gRPC CA per test cluster and an
etcd CA per etcd server, made with the same code (phalanx.certs,
phalanx.etcd_pki) that an operator runs.

* ``ClusterPki(workdir, cluster)``: the cluster's gRPC CA under
  ``workdir/pki-<cluster>/``; opening the same directory again gives the same
  CA, so a test's fixture and its LocalCluster share one. ``server_dir()``
  holds ``ca.crt`` and every coordinator/agent certificate issued so far (as
  ``--tls-dir`` reads them; no CA key in it); ``client(...)`` is a client dir
  (``ca.crt client.crt client.key``, as ``$PHALANX_TLS_DIR`` reads it).
* ``EtcdPki(directory)``: an etcd CA made by ``phalanx.etcd_pki.init``, the
  root user's client dir and, per cluster, the coordinator and agent users'
  dirs. The one an etcd server was started with is registered under its
  endpoints (``register``/``etcd_pki_for``), so helpers that are handed an
  endpoint string (LocalCluster, ``etcdctl``) find the credentials without
  every test passing them along.
"""

from __future__ import annotations

import asyncio
import datetime
import shutil
import threading
from pathlib import Path
from typing import Any, Coroutine, Iterable, Sequence

from phalanx import certs
from phalanx.tls import TlsFiles

CLIENT_FILES = ("ca.crt", "client.crt", "client.key")


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class ClusterPki:
    """The gRPC CA of one test cluster and the certificates it issued."""

    def __init__(self, workdir: Path, cluster: str) -> None:
        self.cluster = cluster
        self.root = Path(workdir) / f"pki-{cluster}"
        self.ca_dir = self.root / "ca"
        self._server = self.root / "server"
        self._issued: set[tuple[str, str]] = set()
        self._clients: dict[tuple[str, str, tuple[str, ...]], Path] = {}
        if not (self.ca_dir / certs.CA_CERT).exists():
            certs.init_ca(self.ca_dir, cluster, now=now())
        self._server.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.copy(self.ca_dir / certs.CA_CERT, self._server / certs.CA_CERT)

    def server_dir(self) -> Path:
        """``--tls-dir`` for this cluster's coordinators and agents."""
        return self._server

    def _issue(self, role: str, name: str, **kw: Any) -> TlsFiles:
        files = TlsFiles.issued(self._server, role, name)
        if (role, name) not in self._issued and not files.cert.exists():
            certs.issue(self.ca_dir, role, name, now=now(), out=(files.cert, files.key), **kw)
        self._issued.add((role, name))
        return files

    def coordinator(self, cid: str) -> TlsFiles:
        # Loopback hosts by default, and always the cluster's coordinator name
        # that every client verifies against (phalanx.certs.build_leaf adds it).
        return self._issue("coordinator", cid)

    def agent(self, node: str) -> TlsFiles:
        return self._issue("agent", node, node=node)

    def client(self, role: str = "admin", name: str = "tester", queues: Sequence[str] = ()) -> Path:
        """A client dir for ``role``/``name`` (issued once per test)."""
        key = (role, name, tuple(queues))
        d = self._clients.get(key)
        if d is not None:
            return d
        d = self.root / "clients" / (f"{role}-{name}" + (f"-{'-'.join(queues)}" if queues else ""))
        if not (d / "client.crt").exists():
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            shutil.copy(self.ca_dir / certs.CA_CERT, d / "ca.crt")
            # An agent's certificate names its node: here the node is the name.
            certs.issue(self.ca_dir, role, name, queues=tuple(queues), node=name if role == "agent" else None,
                        now=now(), out=(d / "client.crt", d / "client.key"))
        self._clients[key] = d
        return d

    def client_files(self, role: str = "admin", name: str = "tester", queues: Sequence[str] = ()) -> TlsFiles:
        d = self.client(role, name, queues)
        return TlsFiles(d / "ca.crt", d / "client.crt", d / "client.key")


class EtcdPki:
    """An etcd CA directory (phalanx.etcd_pki layout) and its client users."""

    def __init__(self, directory: Path) -> None:
        from phalanx import etcd_pki

        self.dir = Path(directory)
        if not (self.dir / "ca.crt").exists():
            etcd_pki.init(self.dir, now=now())
        self._lock = threading.Lock()

    def user_dir(self, user: str) -> Path:
        from phalanx import etcd_pki

        with self._lock:
            d = self.dir / user
            if not (d / "client.crt").exists():
                etcd_pki.issue_client(self.dir, user, now=now())
            return d

    def user(self, user: str) -> TlsFiles:
        from phalanx import etcd_pki

        return etcd_pki.files(self.user_dir(user))

    @property
    def root(self) -> TlsFiles:
        from phalanx import etcd_pki

        return self.user(etcd_pki.ROOT_USER)

    def role_dir(self, cluster: str, role: str) -> Path:
        """The client dir of ``cluster``'s ``role`` ("coordinator"/"agent") user."""
        from phalanx import etcd_pki

        return self.user_dir(etcd_pki.user_for(cluster, role))

    def role(self, cluster: str, role: str) -> TlsFiles:
        from phalanx import etcd_pki

        return etcd_pki.files(self.role_dir(cluster, role))


_BY_ENDPOINT: dict[str, EtcdPki] = {}


def register(endpoints: str | Iterable[str], pki: EtcdPki) -> None:
    """Record that the etcd at ``endpoints`` trusts ``pki`` (so its users get in)."""
    for ep in _split(endpoints):
        _BY_ENDPOINT[ep] = pki


def unregister(endpoints: str | Iterable[str]) -> None:
    for ep in _split(endpoints):
        _BY_ENDPOINT.pop(ep, None)


def etcd_pki_for(endpoints: str | Iterable[str]) -> EtcdPki:
    eps = _split(endpoints)
    for ep in eps:
        pki = _BY_ENDPOINT.get(ep)
        if pki is not None:
            return pki
    raise LookupError(f"no etcd PKI registered for {','.join(eps)!r}: start the etcd with tests.pki "
                      "(secure_etcd / the etcd_server fixture) or pass its credentials")


def _split(endpoints: str | Iterable[str]) -> list[str]:
    if isinstance(endpoints, str):
        endpoints = endpoints.split(",")
    return [e.strip().removeprefix("https://").removeprefix("http://") for e in endpoints if e.strip()]


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` to completion from synchronous code, in a thread of its
    own so it works whether or not this thread already runs an event loop
    (sync fixtures run beside pytest-asyncio's loop)."""
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    t = threading.Thread(target=go, name="tests.pki.run_sync")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def provision(endpoints: str | Sequence[str], pki: EtcdPki, cluster: str, *, agent_user: bool = True) -> None:
    """The cluster's etcd users and roles (and auth on), as root. Unlike
    ``phalanx etcd-auth``, the test etcds get the legacy agent user too
    (``agent_user``), for the tests that exercise an agent on ``--etcd``
    explicitly; the agents the harness starts are given no etcd credentials
    at all, and tests/integration/test_agent_no_etcd_credentials.py
    provisions without it, as a deployment does."""
    from phalanx import etcd_auth

    run_sync(etcd_auth.provision(_split(endpoints), pki.root, cluster, agent_user=agent_user))


def unprovision(endpoints: str | Sequence[str], pki: EtcdPki, cluster: str) -> None:
    from phalanx import etcd_auth

    run_sync(etcd_auth.unprovision(_split(endpoints), pki.root, cluster))


def etcdctl_args(endpoints: str | Iterable[str], tls: TlsFiles) -> list[str]:
    """etcdctl's flags to reach ``endpoints`` over TLS as ``tls``'s user."""
    eps = ",".join(f"https://{e}" for e in _split(endpoints))
    # etcdctl checks the server certificate against the host it dials
    # (127.0.0.1 and localhost are in it); verification is never skipped.
    return ["--endpoints", eps, "--cacert", str(tls.ca), "--cert", str(tls.cert), "--key", str(tls.key)]


class PrivateEtcd:
    """A one-member etcd of a test's own (to stop or pause), with its own CA,
    TLS, client-certificate auth and etcd auth on, ``cluster`` provisioned:
    ``with PrivateEtcd(tmp_path, cluster) as etcd: ... etcd.endpoint``."""

    def __init__(self, workdir: Path, cluster: str, name: str = "private", *, agent_user: bool = True,
                 **options: Any) -> None:
        """``options``: more EtcdServer fields (a quota, a compaction retention);
        ``agent_user``: provision the legacy agent user too (as ``provision``)."""
        from phalanx.etcd_server import EtcdServer

        self.pki = EtcdPki(Path(workdir) / f"etcd-pki-{name}")
        self.cluster = cluster
        self.agent_user = agent_user
        self.server = EtcdServer(data_dir=Path(workdir) / f"etcd-{name}", name=name,
                                 log_path=Path(workdir) / f"etcd-{name}.log", tls_dir=self.pki.dir, **options)

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def signal(self, sig: int) -> None:
        self.server.signal(sig)

    def __enter__(self) -> "PrivateEtcd":
        self.server.start().wait_ready()
        try:
            register(self.server.endpoint, self.pki)
            provision(self.server.endpoint, self.pki, self.cluster, agent_user=self.agent_user)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        unregister(self.server.endpoint)
        self.server.stop()
