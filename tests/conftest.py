"""Shared fixtures: a real etcd server for the whole session, with TLS,
client-certificate authentication and etcd auth on (the default a real
deployment runs with; docs/security.md).

Each test gets its own cluster name (key prefix ``/phalanx/<cluster>/``) and
that cluster's etcd users and roles (``phalanx.etcd_auth.provision``), so
tests never see each other's keys and every test runs as the least-privilege
users a real cluster has; afterwards the prefix is wiped (as root), checked
empty, and the users and roles are removed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.etcd_server import EtcdServer
from phalanx.programs import require
from phalanx.tls import TlsFiles
from tests.pki import ClusterPki, EtcdPki, etcd_pki_for, etcdctl_args, provision, register, unprovision, unregister

# A suite started in the background by a non-interactive shell inherits
# SIGINT ignored (POSIX: `cmd &` without job control), and so would every CLI
# it starts, which then ignores the Ctrl-C the tests send it (`phalanx logs
# -f`, `phalanx top`): the children get the default disposition back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# A cluster name no test uses: provisioned once at session start so that
# etcd auth is on before the first test (provision turns it on).
SESSION_CLUSTER = "session"


@pytest.fixture(scope="session", autouse=True)
def client_tls_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The CLI's and the SDK's TLS verdict cache (phalanx/tls_check_cache.py,
    under $XDG_CACHE_HOME) is the session's own, for this process and the
    CLI processes tests start: tests write nothing into the user's home,
    and nothing there decides a test."""
    home = tmp_path_factory.mktemp("xdg-cache")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session")
def etcd_pki(tmp_path_factory: pytest.TempPathFactory) -> EtcdPki:
    return EtcdPki(tmp_path_factory.mktemp("etcd-pki") / "pki")


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory, etcd_pki: EtcdPki):
    root = tmp_path_factory.mktemp("etcd")
    server = EtcdServer(data_dir=root / "data", name="test", log_path=root / "etcd.log", tls_dir=etcd_pki.dir)
    server.start().wait_ready()
    register(server.endpoint, etcd_pki)
    try:
        provision(server.endpoint, etcd_pki, SESSION_CLUSTER)
        yield server
    finally:
        unregister(server.endpoint)
        server.stop()


@pytest.fixture
def etcd_endpoint(etcd_server: EtcdServer) -> str:
    return etcd_server.endpoint


def etcdctl(endpoint: str, *args: str, tls: TlsFiles | None = None) -> str:
    """Run etcdctl against ``endpoint`` over TLS as ``tls``'s user (default:
    root of the etcd PKI registered for that endpoint)."""
    tls = tls or etcd_pki_for(endpoint).root
    env = dict(os.environ, ETCDCTL_API="3")
    return subprocess.run(
        [require("etcdctl"), *etcdctl_args(endpoint, tls), *args],
        env=env, check=True, capture_output=True, text=True, timeout=30,
    ).stdout


@pytest.fixture
def cluster_name(etcd_server: EtcdServer, etcd_pki: EtcdPki) -> str:
    """A fresh key prefix and its etcd users/roles for one test; afterwards
    the prefix is removed (and checked empty) and the users/roles with it."""
    name = "t" + uuid.uuid4().hex[:10]
    provision(etcd_server.endpoint, etcd_pki, name)
    yield name
    prefix = f"/phalanx/{name}/"
    etcdctl(etcd_server.endpoint, "del", "--prefix", prefix)
    left = etcdctl(etcd_server.endpoint, "get", "--prefix", "--keys-only", prefix).strip()
    unprovision(etcd_server.endpoint, etcd_pki, name)
    assert left == "", f"keys left under {prefix}: {left[:200]}"


@pytest.fixture
def etcd_coordinator_dir(etcd_pki: EtcdPki, cluster_name: str) -> Path:
    """The client dir of this test cluster's etcd coordinator user (--etcd-tls-dir)."""
    return etcd_pki.role_dir(cluster_name, "coordinator")


@pytest.fixture
def etcd_agent_dir(etcd_pki: EtcdPki, cluster_name: str) -> Path:
    """The client dir of this test cluster's etcd agent user (read-only)."""
    return etcd_pki.role_dir(cluster_name, "agent")


@pytest.fixture
def etcd_root_dir(etcd_pki: EtcdPki, etcd_server: EtcdServer) -> Path:
    """etcd root's client dir: only for what no Phalanx role may do
    (cleanup, planting records a coordinator could not write)."""
    from phalanx import etcd_pki as ep

    return etcd_pki.user_dir(ep.ROOT_USER)


@pytest.fixture
def etcd_coordinator_tls(etcd_pki: EtcdPki, cluster_name: str) -> TlsFiles:
    return etcd_pki.role(cluster_name, "coordinator")


@pytest.fixture
def etcd_agent_tls(etcd_pki: EtcdPki, cluster_name: str) -> TlsFiles:
    return etcd_pki.role(cluster_name, "agent")


@pytest.fixture
def etcd_root_tls(etcd_pki: EtcdPki, etcd_server: EtcdServer) -> TlsFiles:
    return etcd_pki.root


@pytest.fixture
def cluster_pki(tmp_path: Path, cluster_name: str) -> ClusterPki:
    """The test cluster's gRPC CA (the same one its LocalCluster uses)."""
    return ClusterPki(tmp_path, cluster_name)
