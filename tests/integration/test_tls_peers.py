"""Agents bound to their node and peers authenticated, on a real coordinator
serving TLS (--tls-dir) with certificates made by phalanx.certs. Each
refusal is checked for its status and words, and etcd is read directly to
check that a refused call wrote nothing (docs/security.md)."""

from __future__ import annotations

import asyncio
import datetime
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from phalanx import certs, wire
from phalanx.certs import Identity
from phalanx.tls import TlsFiles, channel_credentials, coordinator_server_name
from phalanx.v1 import agent_pb2 as apb
from phalanx.v1 import agent_pb2_grpc as agrpc
from phalanx.v1 import peer_pb2 as ppb
from phalanx.v1 import peer_pb2_grpc as pgrpc
from tests.integration.harness import REPO, LocalCluster, dgx_node
from tests.integration.test_tls_cluster import AZ, _now

pytestmark = pytest.mark.integration
NODE_X, NODE_Y = "node-x", "node-y"


def _files(ca: Path, role: str, name: str) -> TlsFiles:
    return TlsFiles.issued(ca, role, name)


@pytest.fixture
def pki(local_cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    ca = tmp_path / "pki"
    certs.init_ca(ca, local_cluster.cluster, now=_now())
    for cid in ("c0", "c9"):
        certs.issue(ca, "coordinator", cid, now=_now())
    certs.issue(ca, "agent", "ax", node=NODE_X, now=_now())
    certs.issue(ca, "agent", "ax2", node=NODE_X, now=_now())
    certs.issue(ca, "submitter", "bob", queues=["default"], now=_now())
    # A coordinator certificate of another cluster signed by this very CA
    # (a misissue: build_leaf refuses it, so its CA check is lifted for this
    # one call). The handshake lets it in; the identity check must not.
    ca_cert, ca_key = certs.load_ca(ca)
    key = certs.new_key()
    start = _now()
    with monkeypatch.context() as m:
        m.setattr(certs, "ca_cluster", lambda _ca: "other")
        other = certs.build_leaf(Identity("other", "coordinator", "c0"), key.public_key(), ca=ca_cert, ca_key=ca_key,
                                 not_before=start, not_after=start + datetime.timedelta(days=1), hosts=certs.DEFAULT_HOSTS)
    assert certs.ca_cluster(ca_cert) == local_cluster.cluster
    (ca / "foreign-c0.crt").write_bytes(certs.cert_pem(other))
    (ca / "foreign-c0.key").write_bytes(certs.key_pem(key))
    # Another CA (another cluster) whose coordinator certificate the client side trusts along with ours.
    oca = tmp_path / "other-pki"
    certs.init_ca(oca, "other", now=_now())
    ocrt, okey, _ = certs.issue(oca, "coordinator", "c0", now=_now())
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes((ca / "ca.crt").read_bytes() + (oca / "ca.crt").read_bytes())
    return {
        "ca": ca,
        "agent": _files(ca, "agent", "ax"),
        "agent2": _files(ca, "agent", "ax2"),
        "submitter": _files(ca, "submitter", "bob"),
        "c9": _files(ca, "coordinator", "c9"),
        "same_ca_other_cluster": TlsFiles(ca / "ca.crt", ca / "foreign-c0.crt", ca / "foreign-c0.key"),
        "other_ca": TlsFiles(bundle, ocrt, okey),
    }


def _channel(c: LocalCluster, address: str, files: TlsFiles, cluster: str | None = None) -> grpc.aio.Channel:
    """A channel presenting ``files`` (checked as a certificate of
    ``cluster``, default the test's) that verifies the server as the test
    cluster's coordinator, as every phalanx client does: so what refuses a
    foreign caller is the server, not the caller's own name check."""
    return grpc.aio.secure_channel(address, channel_credentials(files, cluster=cluster or c.cluster),
                                   options=[("grpc.ssl_target_name_override", coordinator_server_name(c.cluster))])


async def _register(address: str, c: LocalCluster, files: TlsFiles, node: str) -> tuple[Any, Any]:
    """Open a Session as ``node``; (channel, call) once welcomed, or raise
    AioRpcError. A coordinator whose leader key is in etcd may not have
    started leading yet (FAILED_PRECONDITION, "not the leader"): asked again;
    so is a status the client lost to its own write (below)."""
    for _ in range(100):
        try:
            return await _register_once(address, c, files, node)
        except grpc.aio.AioRpcError as exc:
            not_leading = exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "not the leader" in (exc.details() or "")
            # A refusal sent before the server reads anything can reach the
            # client while gRPC is still writing the registration: the client
            # then reports its failed write (INTERNAL, "execute_batch") instead
            # of the server's status. Asked again, as a reconnecting agent does.
            lost_status = exc.code() == grpc.StatusCode.INTERNAL and "execute_batch" in (exc.debug_error_string() or "")
            if not (not_leading or lost_status):
                raise
        await asyncio.sleep(0.1)
    return await _register_once(address, c, files, node)


async def _register_once(address: str, c: LocalCluster, files: TlsFiles, node: str) -> tuple[Any, Any]:
    ch = _channel(c, address, files)
    reg = apb.Register(agent_id=f"agent-{node}", topology=wire.topology_to_pb(dgx_node(node, AZ)))
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait(apb.AgentMessage(register=reg))

    async def requests():
        while True:
            item = await queue.get()
            if item is None:
                return
            yield item

    call = agrpc.AgentServiceStub(ch).Session(requests())
    try:
        first = await asyncio.wait_for(call.read(), 15)
    except BaseException:
        await ch.close()
        raise
    assert first.WhichOneof("kind") == "welcome", first
    return ch, call


async def _snapshot(c: LocalCluster) -> list[tuple[str, int]]:
    kvs, _ = await c.store.get_prefix(c.store.keys.root)
    return sorted((kv.key, kv.mod_revision) for kv in kvs)


async def test_agent_certificates_bind_sessions_to_their_node(local_cluster: LocalCluster, pki: dict[str, Any]) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "c0", extra_args=["--tls-dir", str(pki["ca"])])
    await c.wait_leader(AZ)
    node_key = c.store.keys.node

    # An agent certificate for node-x registering as node-y: refused, naming both, no record.
    with pytest.raises(grpc.aio.AioRpcError) as wrong:
        await _register(coord.address, c, pki["agent"], NODE_Y)
    assert wrong.value.code() == grpc.StatusCode.PERMISSION_DENIED, wrong.value
    assert NODE_X in wrong.value.details() and NODE_Y in wrong.value.details(), wrong.value.details()
    assert await c.store.get(node_key(AZ, NODE_Y)) is None

    # A submitter certificate opening a Session: refused before any registration is read.
    with pytest.raises(grpc.aio.AioRpcError) as sub:
        await _register(coord.address, c, pki["submitter"], NODE_X)
    assert sub.value.code() == grpc.StatusCode.PERMISSION_DENIED, sub.value
    assert "submitter" in sub.value.details() and "bob" in sub.value.details(), sub.value.details()
    assert await c.store.get(node_key(AZ, NODE_X)) is None

    # The right certificate for its own node gets in and is recorded.
    ch, call = await _register(coord.address, c, pki["agent"], NODE_X)
    try:
        rec = await c.store.get(node_key(AZ, NODE_X))
        assert rec is not None and rec.json()["agent_id"] == f"agent-{NODE_X}"
        # Another agent certificate for the same node may not take over the live session.
        with pytest.raises(grpc.aio.AioRpcError) as other:
            await _register(coord.address, c, pki["agent2"], NODE_X)
        assert other.value.code() == grpc.StatusCode.PERMISSION_DENIED, other.value
        assert "ax2" in other.value.details() and "'ax'" in other.value.details(), other.value.details()
        assert (await c.store.get(node_key(AZ, NODE_X))).mod_revision == rec.mod_revision
        # The same identity reconnecting replaces its own session.
        ch2, call2 = await _register(coord.address, c, pki["agent"], NODE_X)
        call2.cancel()
        await ch2.close()
    finally:
        call.cancel()
        await ch.close()


async def test_peer_calls_only_from_the_leader_coordinator_of_this_cluster(local_cluster: LocalCluster, pki: dict[str, Any]) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "c0", extra_args=["--tls-dir", str(pki["ca"])])
    lead = await c.wait_leader(AZ)
    # The caller claims the real leader's AZ and (public) epoch: only the certificate tells it apart.
    caller = ppb.PeerIdentity(az=AZ, epoch=lead.epoch, coordinator_id="c0")
    prepare = ppb.PrepareRequest(caller=caller, gang="g-forged", incarnation=1,
                                 nodes=[ppb.NodeDevices(node=NODE_X, gpus=[0])])
    abort = ppb.DecisionRequest(caller=caller, gang="g-forged", incarnation=1)
    before = await _snapshot(c)

    async def call(files: TlsFiles, method: str, req: Any, cluster: str | None = None) -> grpc.aio.AioRpcError:
        async with _channel(c, coord.address, files, cluster) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await getattr(pgrpc.CoordinatorPeerStub(ch), method)(req, timeout=10)
        return refused.value

    for who, role in (("submitter", "submitter"), ("agent", "agent")):
        for method, req in (("Prepare", prepare), ("Abort", abort)):
            e = await call(pki[who], method, req)
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED, (who, method, e)
            assert role in e.details() and "coordinator" in e.details(), e.details()

    # A coordinator of this cluster that does not lead the AZ it speaks for.
    e = await call(pki["c9"], "Prepare", prepare)
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "'c9'" in e.details() and "'c0'" in e.details(), e.details()

    # A coordinator certificate of another cluster from this CA: the identity check refuses it.
    e = await call(pki["same_ca_other_cluster"], "Prepare", prepare, cluster="other")
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "wrong cluster" in e.details(), e.details()
    # From another cluster's CA: the handshake refuses it.
    e = await call(pki["other_ca"], "Prepare", prepare, cluster="other")
    assert e.code() == grpc.StatusCode.UNAVAILABLE, e

    assert await _snapshot(c) == before, "a refused peer call changed etcd"
    assert "CoordinatorPeer refused" in coord.log()


async def test_certificates_bind_agents_and_coordinators_to_their_az(local_cluster: LocalCluster, pki: dict[str, Any],
                                                                      tmp_path: Path) -> None:
    """An agent certificate bound to another AZ is refused at this AZ's
    leader (PERMISSION_DENIED naming both AZs, nothing written), one bound to
    this AZ gets in; a coordinator certificate bound to another AZ speaks for
    nobody here, and a coordinator does not start on one that is not bound
    to its own --az."""
    c = local_cluster
    ca = pki["ca"]
    certs.issue(ca, "agent", "a-there", node=NODE_X, az="az-elsewhere", now=_now())
    certs.issue(ca, "agent", "a-here", node=NODE_X, az=AZ, now=_now())
    coord = c.start_coordinator(AZ, "c0", extra_args=["--tls-dir", str(ca)])
    lead = await c.wait_leader(AZ)
    before = await _snapshot(c)

    with pytest.raises(grpc.aio.AioRpcError) as there:
        await _register(coord.address, c, _files(ca, "agent", "a-there"), NODE_X)
    assert there.value.code() == grpc.StatusCode.PERMISSION_DENIED, there.value
    assert "bound to AZ 'az-elsewhere'" in there.value.details() and f"'{AZ}'" in there.value.details(), there.value.details()
    assert await _snapshot(c) == before, "a refused registration changed etcd"

    ch, call = await _register(coord.address, c, _files(ca, "agent", "a-here"), NODE_X)
    try:
        assert (await c.store.get(c.store.keys.node(AZ, NODE_X))) is not None
    finally:
        call.cancel()
        await ch.close()

    # The leader's own name, bound to another AZ: it speaks for no one here.
    other = tmp_path / "other-az"
    other.mkdir()
    crt, key, _ = certs.issue(ca, "coordinator", "c0", az="az-elsewhere", now=_now(),
                              out=(other / "coordinator-c0.crt", other / "coordinator-c0.key"))
    (other / "ca.crt").write_bytes((ca / "ca.crt").read_bytes())
    mid = await _snapshot(c)
    req = ppb.PrepareRequest(caller=ppb.PeerIdentity(az=AZ, epoch=lead.epoch, coordinator_id="c0"), gang="g-forged",
                             incarnation=1, nodes=[ppb.NodeDevices(node=NODE_X, gpus=[0])])
    async with _channel(c, coord.address, TlsFiles(other / "ca.crt", crt, key)) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pgrpc.CoordinatorPeerStub(ch).Prepare(req, timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
    assert "bound to AZ 'az-elsewhere'" in refused.value.details(), refused.value.details()
    assert await _snapshot(c) == mid

    # A coordinator started with that certificate for this AZ stops at once, naming the check.
    res = subprocess.run([sys.executable, "-m", "coordinator", "--cluster", c.cluster, "--az", AZ, "--id", "c0",
                          "--etcd", c.etcd, "--listen", "127.0.0.1:0", "--tls-dir", str(other),
                          "--etcd-tls-dir", str(c.etcd_tls_dir("coordinator"))],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode != 0, res
    assert "wrong AZ" in res.stderr and "az-elsewhere" in res.stderr, res.stderr[-2000:]
