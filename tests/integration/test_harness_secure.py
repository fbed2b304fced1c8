"""The test harness itself runs as a deployment does by default: the
session etcd takes TLS clients with certificates only, and a test cluster's
etcd users are held to their roles; a LocalCluster's coordinators serve TLS
only, to certificates of the cluster's own CA; its agents register with
their node's certificate. If the harness slipped back to plaintext, every
other integration test would still pass: this one would not."""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request

import grpc
import pytest

from phalanx.store import Put, Store
from phalanx.client import AsyncClient
from phalanx.errors import PhalanxError, StoreDenied
from phalanx.etcd_server import EtcdServer
from phalanx.programs import require
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import gang_pb2_grpc as ggrpc
from tests.conftest import etcdctl
from tests.integration.harness import LocalCluster, dgx_node
from tests.pki import ClusterPki

pytestmark = pytest.mark.integration
AZ = "az-a"


def test_session_etcd_refuses_plaintext_and_certificateless_clients(etcd_server: EtcdServer, etcd_pki, etcd_root_tls) -> None:
    # Plaintext HTTP to a TLS listener: no answer that reads as etcd's.
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://{etcd_server.endpoint}/health", timeout=5).read()
    # TLS that verifies the server but presents no client certificate: refused.
    res = subprocess.run([require("etcdctl"), "--endpoints", f"https://{etcd_server.endpoint}", "--cacert", str(etcd_root_tls.ca),
                          "--dial-timeout", "3s", "--command-timeout", "3s", "get", "/x"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0, res.stdout
    # Root gets in; a certificate of the etcd CA naming no etcd user does
    # not (it would, were etcd auth off: the CN is only a user name).
    assert etcdctl(etcd_server.endpoint, "get", "/x") == ""
    with pytest.raises(subprocess.CalledProcessError) as err:
        etcdctl(etcd_server.endpoint, "get", "/x", tls=etcd_pki.user("no-such-user"))
    assert "user name not found" in err.value.stderr or "permission denied" in err.value.stderr, err.value.stderr


async def test_cluster_users_are_held_to_their_roles(etcd_endpoint, cluster_name, etcd_coordinator_tls,
                                                     etcd_agent_tls) -> None:
    async with Store(etcd_endpoint, cluster_name, tls=etcd_coordinator_tls) as coord, \
            Store(etcd_endpoint, cluster_name, tls=etcd_agent_tls) as agent:
        await coord.txn([], [Put(coord.keys.gang("mine"), {"x": 1})])
        # The coordinator user stops at its cluster's prefix.
        with pytest.raises(StoreDenied):
            await coord.txn([], [Put("/phalanx/some-other-cluster/gangs/x", {"x": 1})])
        # The agent user writes nothing, not even under its cluster's prefix.
        with pytest.raises(StoreDenied):
            await agent.txn([], [Put(agent.keys.gang("theirs"), {"x": 1})])
        assert await coord.get(coord.keys.gang("theirs")) is None
        await coord.txn([], [Put(coord.keys.gang("mine"), {"x": 2})])


async def test_local_cluster_serves_tls_only_to_its_own_ca(local_cluster: LocalCluster, tmp_path) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)  # over TLS, with the admin certificate; the agent with n0's
    async with grpc.aio.insecure_channel(coord.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ggrpc.GangServiceStub(ch).ClusterStatus(gpb.ClusterStatusRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # A certificate of another CA for the same cluster name: the handshake refuses it.
    other = ClusterPki(tmp_path / "other", c.cluster)
    async with AsyncClient(coord.address, timeout=3, tls_dir=other.client()) as client:
        with pytest.raises(PhalanxError):
            await client.status()
    assert "--insecure" not in " ".join(coord.proc.args)
    assert "plaintext" not in coord.log().lower(), coord.log()[-2000:]
