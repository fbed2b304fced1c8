"""Bad input gets a clear error naming the field, and changes nothing in etcd."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import peer_pb2 as ppb
from phalanx.v1 import peer_pb2_grpc as pgrpc
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node, tiny
from tests.pki import PrivateEtcd

pytestmark = pytest.mark.integration
AZ = "az-a"


async def gang_keys(c: LocalCluster) -> list[str]:
    kvs, _ = await c.store.get_prefix(c.store.keys.root)
    return sorted(kv.key for kv in kvs if "/leader/" not in kv.key and "/nodes/" not in kv.key)


def spec(**overrides) -> pb.GangSpec:
    s = tiny("ok")
    for path, value in overrides.items():
        target = s
        parts = path.split("__")
        for p in parts[:-1]:
            target = getattr(target, p)
        setattr(target, parts[-1], value)
    return s


BAD_SPECS = [
    ("negative members", spec(members=-3), "members"),
    ("zero gpus", spec(resources__gpus=0), "resources.gpus"),
    ("negative rdma nics", spec(resources__rdma_nics=-1), "resources.rdma_nics"),
    ("unknown topology level", spec(topology__required=42), "topology.required"),
    ("too-long name", spec(name="x" * 80), "name"),
    ("name not a DNS label", spec(name="Big_Job"), "name"),
    ("missing name", spec(name=""), "name"),
    ("negative max_restarts", spec(policy__max_restarts=-1), "policy.max_restarts"),
    ("oversized run section", pb.GangSpec(name="ok", members=1, resources=pb.Resources(gpus=1), run=pb.RunSpec(env={"BIG": "x" * 70000})), "run"),
]


@pytest.mark.parametrize("bad,field", [(s, f) for _, s, f in BAD_SPECS], ids=[i for i, _, _ in BAD_SPECS])
async def test_invalid_spec_is_refused_naming_the_field(local_cluster: LocalCluster, bad: pb.GangSpec, field: str) -> None:
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    before = await gang_keys(c)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub().SubmitGang(gpb.SubmitGangRequest(spec=bad, idempotency_key="k"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field}:" in err.value.details(), err.value.details()
    assert await gang_keys(c) == before


async def test_unknown_ids_cancel_of_finished_oversized_and_cross_az(local_cluster: LocalCluster) -> None:
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    stub = c.stub()
    for call, req in [
        (stub.GetGang, gpb.GetGangRequest(id="no-such-gang")),
        (stub.CancelGang, gpb.CancelGangRequest(id="no-such-gang")),
        (stub.ExplainGang, gpb.ExplainGangRequest(id="no-such-gang")),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(req)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "id:" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetGang(gpb.GetGangRequest(id="a/b"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    g = await c.submit(tiny("short", members=1, duration=0.2))
    await c.wait_state(g.id, TERMINAL)
    before = await gang_keys(c)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CancelGang(gpb.CancelGangRequest(id=g.id))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "SUCCEEDED" in err.value.details()

    # A request over the server's limit (1 MiB) is refused by gRPC itself.
    huge = pb.GangSpec(name="huge", members=1, resources=pb.Resources(gpus=1), run=pb.RunSpec(env={"X": "y" * (2 << 20)}))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SubmitGang(gpb.SubmitGangRequest(spec=huge))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    # Peer calls with a coordinator certificate of this cluster (so the
    # certificate's role is not what refuses them; test_tls_peers covers
    # that). From nobody (no caller identity): refused, since under TLS the
    # caller must be the leader of the AZ it names. From the leader's own
    # identity without a slice: the request itself is refused. No change.
    info = await c.leader(AZ)
    me = ppb.PeerIdentity(az=AZ, epoch=info.epoch, coordinator_id=info.coordinator_id)
    async with c.channel(c.coordinators["a0"].address, role="coordinator", name=info.coordinator_id) as ch:
        peer = pgrpc.CoordinatorPeerStub(ch)
        for call in (peer.Prepare(ppb.PrepareRequest(gang=g.id, incarnation=1)),
                     peer.Commit(ppb.DecisionRequest(gang=g.id, incarnation=1))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
            assert "no leader" in err.value.details(), err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.Prepare(ppb.PrepareRequest(caller=me, gang=g.id, incarnation=1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert await gang_keys(c) == before

    # Cross-AZ gangs are accepted since issue 3 (two-phase reservations).
    cross = tiny("wide")
    cross.topology.allow_cross_az = True
    resp = await stub.SubmitGang(gpb.SubmitGangRequest(spec=cross))
    assert resp.created and resp.gang.state == pb.GANG_STATE_PENDING


async def test_live_name_is_unique(local_cluster: LocalCluster) -> None:
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    a = await c.submit(tiny("dup"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.submit(tiny("dup"))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "name:" in err.value.details() and a.id in err.value.details()


async def test_etcd_down_gives_unavailable_and_loses_nothing(tmp_path, cluster_name) -> None:
    """A private etcd we can stop: submissions fail UNAVAILABLE while it is
    down; everything acknowledged before is there when it returns."""
    etcd = PrivateEtcd(tmp_path, cluster_name).__enter__()
    c = LocalCluster(etcd.endpoint, cluster_name, tmp_path)
    await c.start()
    try:
        c.start_coordinator(AZ, "a0")
        await c.wait_leader(AZ)
        acked = [(await c.submit(tiny(f"before-{i}", members=64))).id for i in range(3)]
        etcd.signal(signal.SIGSTOP)  # etcd is unreachable (requests hang)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.stub().SubmitGang(gpb.SubmitGangRequest(spec=tiny("during"), idempotency_key="during-1"), timeout=15)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "etcd" in err.value.details() or "leader" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.stub().GetGang(gpb.GetGangRequest(id=acked[0]), timeout=15)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            etcd.signal(signal.SIGCONT)
        await c.wait_leader(AZ)
        # Retrying the failed submission with its key is safe (at most once).
        for _ in range(100):
            try:
                r = await c.stub().SubmitGang(gpb.SubmitGangRequest(spec=tiny("during"), idempotency_key="during-1"), timeout=5)
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                await asyncio.sleep(0.2)
        else:
            raise AssertionError("the coordinator did not recover after etcd returned")
        again = await c.stub().SubmitGang(gpb.SubmitGangRequest(spec=tiny("during"), idempotency_key="during-1"), timeout=5)
        assert again.gang.id == r.gang.id
        gangs = await c.etcd_gangs()
        assert set(acked) <= set(gangs)
        assert [g for g in gangs.values() if g.spec.name == "during"] == [gangs[r.gang.id]]
    finally:
        await c.close()
        etcd.__exit__()


async def test_errors_while_etcd_is_paused_say_etcd(tmp_path, cluster_name, capsys) -> None:
    """While etcd does not answer, what the SDK and the CLI report names
    etcd and the cluster, not only "no answer within 10s from <addresses>":
    a coordinator answers UNAVAILABLE naming etcd before the caller's
    deadline, and the SDK keeps those words even when a later attempt
    merely runs out of time."""
    from phalanx import cli
    from phalanx.client import AsyncClient
    from phalanx.errors import StoreUnavailable

    etcd = PrivateEtcd(tmp_path, cluster_name).__enter__()
    c = LocalCluster(etcd.endpoint, cluster_name, tmp_path)
    await c.start()
    try:
        a0 = c.start_coordinator(AZ, "a0")
        a1 = c.start_coordinator(AZ, "a1")
        await c.wait_leader(AZ)
        gang = await c.submit(tiny("kept", members=64))
        addresses = f"{a0.address},{a1.address}"
        etcd.signal(signal.SIGSTOP)
        try:
            async with AsyncClient(addresses, timeout=4, tls_dir=c.client_dir()) as client:
                for call in (lambda: client.get(gang.id), lambda: client.list(), lambda: client.status(),
                             lambda: client.nodes()):
                    with pytest.raises(StoreUnavailable) as info:
                        await call()
                    assert "etcd" in str(info.value), str(info.value)
            code = await asyncio.to_thread(cli.main, ["list", "--address", addresses, "--tls-dir", str(c.client_dir()), "--rpc-timeout", "4"])
            err = capsys.readouterr().err
            assert code == cli.EXIT_ERROR and err.count("\n") == 1
            assert "etcd" in err and f"cluster {cluster_name}" in err, err
        finally:
            etcd.signal(signal.SIGCONT)
    finally:
        await c.close()
        etcd.__exit__()
