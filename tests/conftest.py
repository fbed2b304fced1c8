"""Shared fixtures: a real etcd server for the whole session.

Each test gets its own cluster name (key prefix ``/phalanx/<cluster>/``), so
tests never see each other's keys; the prefix is wiped after the test.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from phalanx.etcd_server import EtcdServer
from phalanx.programs import require


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("etcd")
    server = EtcdServer(data_dir=root / "data", name="test", log_path=root / "etcd.log")
    server.start().wait_ready()
    yield server
    server.stop()


@pytest.fixture
def etcd_endpoint(etcd_server: EtcdServer) -> str:
    return etcd_server.endpoint


def etcdctl(endpoint: str, *args: str) -> str:
    env = dict(os.environ, ETCDCTL_API="3")
    return subprocess.run(
        [require("etcdctl"), "--endpoints", f"http://{endpoint}", *args],
        env=env, check=True, capture_output=True, text=True, timeout=30,
    ).stdout


@pytest.fixture
def cluster_name(etcd_server: EtcdServer) -> str:
    """A fresh key prefix for one test, removed (and checked empty) afterwards."""
    name = "t" + uuid.uuid4().hex[:10]
    yield name
    prefix = f"/phalanx/{name}/"
    etcdctl(etcd_server.endpoint, "del", "--prefix", prefix)
    left = etcdctl(etcd_server.endpoint, "get", "--prefix", "--keys-only", prefix).strip()
    assert left == "", f"keys left under {prefix}: {left[:200]}"
