"""Node lifecycle on a real etcd, real coordinator processes and simulated
agents over real gRPC (docs/nodes.md): a node whose agent is gone expires and
no longer counts for never-fits; an admin cordons, drains and deletes a node."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import grpc
import pytest

from coordinator.core.records import NodeRecord
from phalanx.metrics import scrape
from phalanx.timings import Timings
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import gang_pb2_grpc as ggrpc
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node, tiny, until

pytestmark = pytest.mark.integration
AZ = "az-a"
# Expired 6 s after its agent was last heard (the least the rules allow is
# just past fence_after_s + replace_margin_s = 5 s of Timings.fast()).
TIMINGS = dataclasses.replace(Timings.fast(), node_expire_after_s=6.0).validate()


@pytest.fixture
async def cluster(etcd_endpoint, cluster_name, tmp_path):
    c = LocalCluster(etcd_endpoint, cluster_name, tmp_path, timings=TIMINGS)
    await c.start()
    try:
        yield c
    finally:
        await c.close()


async def az_status(c: LocalCluster) -> gpb.AzStatus:
    st = await c.stub().ClusterStatus(gpb.ClusterStatusRequest(), timeout=5)
    return next(a for a in st.azs if a.az == AZ)


async def test_a_node_whose_agent_is_gone_expires_and_a_gang_that_needs_it_never_fits(cluster: LocalCluster) -> None:
    c = cluster
    c.start_coordinator(AZ, "a0", extra_args=["--metrics-listen", "127.0.0.1:0"])
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    gone = c.start_agents(AZ, [dgx_node("n1", AZ)])
    await c.wait_nodes_ready(AZ, 2)
    gone.stop.set()
    await asyncio.wait_for(gone.task, 30)
    # 16 GPUs: only with n1, which is gone. Before expiry it waits (n1 may
    # come back); today it waited "for devices" for ever.
    big = await c.submit(tiny("big", members=2, gpus=8, duration=0.5))

    async def expired() -> bool:
        a = await az_status(c)
        return a.nodes_expired == 1
    await until("n1 expired in status", expired, timeout=60)
    a = await az_status(c)
    assert (a.nodes_ready, a.nodes_not_ready, a.nodes_cordoned, a.nodes_total) == (1, 0, 0, 2), a
    assert (a.gpus_usable, a.gpus_total) == (8, 16), a
    nodes = {n.topology.node: n for n in (await c.stub().ListNodes(gpb.ListNodesRequest(az=AZ))).nodes}
    assert nodes["n1"].expired and not nodes["n1"].ready and "node_expire_after_s=6" in nodes["n1"].reason
    assert not nodes["n0"].expired

    async def gauge_says_expired() -> bool:
        text = await asyncio.to_thread(scrape, c.coordinators["a0"].metrics, tls=c.pki.client_files(), cluster=c.cluster)
        want = {f'phalanx_nodes{{az="{AZ}",state="{s}"}} {n:.1f}' for s, n in
                (("ready", 1), ("not_ready", 0), ("cordoned", 0), ("expired", 1))}
        return want <= set(text.splitlines())
    await until("phalanx_nodes showing n1 expired", gauge_says_expired)

    failed = await c.wait_state(big.id, TERMINAL, timeout=30)
    assert failed.state == pb.GANG_STATE_FAILED, failed.reason
    assert failed.reason.startswith("never fits: needs 16 GPUs"), failed.reason

    # Its agent comes back: the node is no longer expired and fits again.
    c.start_agents(AZ, [dgx_node("n1", AZ)])
    await c.wait_nodes_ready(AZ, 2)

    async def back() -> bool:
        a = await az_status(c)
        return a.nodes_expired == 0 and a.nodes_ready == 2
    await until("n1 back in status", back, timeout=30)
    again = await c.submit(tiny("again", members=2, gpus=8, duration=0.5))
    done = await c.wait_state(again.id, TERMINAL, timeout=30)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason


async def one_az_two_nodes(c: LocalCluster) -> dict[str, object]:
    """Leader a0 and standby a1 of one AZ; n0 and n1 (8 GPUs each), each
    with its own agent group (so a test can stop one)."""
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    c.start_coordinator(AZ, "a1")
    groups = {n: c.start_agents(AZ, [dgx_node(n, AZ)]) for n in ("n0", "n1")}
    await c.wait_nodes_ready(AZ, 2)
    await asyncio.sleep(TIMINGS.node_register_grace_s)  # setup: past the grace, never-fits is judged
    return groups


async def node_status(c: LocalCluster, node: str) -> pb.NodeStatus | None:
    nodes = (await c.stub().ListNodes(gpb.ListNodesRequest(az=AZ), timeout=5)).nodes
    return next((n for n in nodes if n.topology.node == node), None)


async def running_on(c: LocalCluster, name: str, node: str) -> pb.Gang:
    """Submit a gang of one 8-GPU member that runs long, with the other
    node cordoned so that it lands on ``node``; the other is uncordoned
    again once it runs."""
    other = "n1" if node == "n0" else "n0"
    await c.stub().CordonNode(gpb.CordonNodeRequest(az=AZ, node=other, cordoned=True), timeout=10)
    g = await c.submit(tiny(name, members=1, gpus=8, duration=600.0))
    g = await c.wait_state(g.id, {pb.GANG_STATE_RUNNING}, timeout=30)
    assert [m.node for m in g.placement] == [node]
    await c.stub().CordonNode(gpb.CordonNodeRequest(az=AZ, node=other, cordoned=False), timeout=10)
    return g


async def cli(c: LocalCluster, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx", *args, "--address", c.coordinators["a1"].address,
        env=c.client_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_a_cordoned_node_takes_nothing_new_and_counts_for_no_never_fits(cluster: LocalCluster) -> None:
    c = cluster
    await one_az_two_nodes(c)
    g = await running_on(c, "long", "n0")
    # Cordoned through the standby (forwarded to the leader), by the CLI.
    rc, out, err = await cli(c, "node", "cordon", "n0", "--az", AZ)
    assert rc == 0, err
    assert "node n0 (az-a) cordoned" in out, out
    st = await node_status(c, "n0")
    assert st is not None and st.cordoned and st.ready
    a = await az_status(c)
    assert (a.nodes_ready, a.nodes_cordoned, a.gpus_usable) == (1, 1, 8), a
    # Nothing new lands on it; what ran there stays.
    small = await c.submit(tiny("small", members=1, gpus=8, duration=0.5))
    done = await c.wait_state(small.id, TERMINAL, timeout=30)
    assert done.state == pb.GANG_STATE_SUCCEEDED and [m.node for m in done.placement] == ["n1"], done
    big = await c.submit(tiny("big", members=2, gpus=8, duration=0.5))
    failed = await c.wait_state(big.id, TERMINAL, timeout=30)
    assert failed.state == pb.GANG_STATE_FAILED and failed.reason.startswith("never fits: needs 16 GPUs"), failed.reason
    assert (await c.stub().GetGang(gpb.GetGangRequest(id=g.id))).state == pb.GANG_STATE_RUNNING
    # A submitter may not cordon; nothing is written.
    ch = c.channel(c.coordinators["a0"].address, role="submitter", name="alice", queues=("default",))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await ggrpc.GangServiceStub(ch).CordonNode(gpb.CordonNodeRequest(az=AZ, node="n0", cordoned=False))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "only an admin may cordon" in (denied.value.details() or "")
    finally:
        await ch.close()
    assert (await node_status(c, "n0")).cordoned  # type: ignore[union-attr]
    rc, out, err = await cli(c, "node", "uncordon", "n0", "--az", AZ)
    assert rc == 0, err
    assert not (await node_status(c, "n0")).cordoned  # type: ignore[union-attr]
    # Bad names are refused naming the field, an unknown node is NOT_FOUND.
    for req, code, words in ((gpb.CordonNodeRequest(az="", node="n0"), grpc.StatusCode.INVALID_ARGUMENT, "az: "),
                             (gpb.CordonNodeRequest(az=AZ, node="../n0"), grpc.StatusCode.INVALID_ARGUMENT, "node: "),
                             (gpb.CordonNodeRequest(az=AZ, node="n9", cordoned=True), grpc.StatusCode.NOT_FOUND,
                              "no node 'n9' in az-a")):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.stub().CordonNode(req, timeout=10)
        assert refused.value.code() == code and words in (refused.value.details() or ""), refused.value
    await c.stub().CancelGang(gpb.CancelGangRequest(id=g.id, reason="test"))


async def test_drain_requeues_a_running_gang_and_returns_when_the_node_holds_nothing(cluster: LocalCluster) -> None:
    c = cluster
    await one_az_two_nodes(c)
    g = await running_on(c, "long", "n0")
    rc, out, err = await cli(c, "node", "drain", "n0", "--az", AZ, "--requeue", "--timeout", "60")
    assert rc == 0, (out, err)
    assert f"restarted on other nodes: {g.id}" in out and "node n0 (az-a) drained" in out, out
    st = await node_status(c, "n0")
    assert st is not None and st.cordoned and st.gpus_used == 0, st
    moved = await c.wait_state(g.id, {pb.GANG_STATE_RUNNING}, timeout=60)
    if moved.incarnation == g.incarnation:  # (read before the restart was written)
        moved = await c.wait_state(g.id, {pb.GANG_STATE_RESTARTING}, timeout=30)
        moved = await c.wait_state(g.id, {pb.GANG_STATE_RUNNING}, timeout=60)
    assert moved.incarnation > g.incarnation and [m.node for m in moved.placement] == ["n1"], moved
    await c.stub().CancelGang(gpb.CancelGangRequest(id=g.id, reason="test"))


async def test_drain_waits_for_a_gang_to_finish_and_delete_is_refused_while_devices_are_held(cluster: LocalCluster) -> None:
    c = cluster
    groups = await one_az_two_nodes(c)
    g = await running_on(c, "long", "n0")
    rc, out, err = await cli(c, "node", "delete", "n0", "--az", AZ)
    assert rc != 0 and f"n0 in az-a holds devices of gang {g.id}; drain it first" in err, (rc, out, err)
    assert await node_status(c, "n0") is not None
    # Without --requeue, drain waits for the gang to end: it times out here...
    rc, out, err = await cli(c, "node", "drain", "n0", "--az", AZ, "--timeout", "1")
    assert rc == 1 and g.id in err and "still holds devices" in err, (rc, out, err)
    assert (await c.stub().GetGang(gpb.GetGangRequest(id=g.id))).state == pb.GANG_STATE_RUNNING
    # ...and returns once it ended.
    drain = asyncio.ensure_future(cli(c, "node", "drain", "n0", "--az", AZ, "--timeout", "60"))
    await c.stub().CancelGang(gpb.CancelGangRequest(id=g.id, reason="test"))
    rc, out, err = await drain
    assert rc == 0 and "node n0 (az-a) drained" in out, (rc, out, err)
    # Its agent stopped, the node is deleted for good.
    stopped = groups["n0"]
    stopped.stop.set()  # type: ignore[attr-defined]
    await asyncio.wait_for(stopped.task, 30)  # type: ignore[attr-defined]
    rc, out, err = await cli(c, "node", "delete", "n0", "--az", AZ)
    assert rc == 0 and "node n0 (az-a) deleted" in out, (rc, out, err)
    assert await node_status(c, "n0") is None
    a = await az_status(c)
    assert (a.nodes_total, a.nodes_ready) == (1, 1), a


async def test_a_cordon_racing_a_registration_is_not_undone(etcd_endpoint, cluster_name, tmp_path) -> None:
    """An admin cordons a node while its agent's registration write is in
    flight (held up by the failpoint): the cordon is written after it, and
    stays."""
    # Heartbeats every 1 s: an agent waits 3 s for its leader, longer than
    # the 1.5 s the failpoint holds each node write (the rest follows the rules).
    slow = dataclasses.replace(TIMINGS, heartbeat_interval_s=1.0, node_not_ready_after_s=2.0, reconnect_budget_s=2.0,
                               fence_after_s=5.0, node_register_grace_s=3.0, node_expire_after_s=8.0).validate()
    c = LocalCluster(etcd_endpoint, cluster_name, tmp_path, timings=slow)
    await c.start()
    try:
        c.start_coordinator(AZ, "a0", extra_env={"PHALANX_FAILPOINTS": "leader.before_node_write=delay(1.5)"})
        await c.wait_leader(AZ)
        first = c.start_agents(AZ, [dgx_node("n0", AZ)])
        await c.wait_nodes_ready(AZ, 1)
        first.stop.set()
        await asyncio.wait_for(first.task, 30)

        async def not_ready() -> bool:
            st = await node_status(c, "n0")
            return st is not None and not st.ready
        await until("n0 not ready", not_ready)
        log = c.coordinators["a0"]
        hits = log.log().count("failpoint leader.before_node_write")
        c.start_agents(AZ, [dgx_node("n0", AZ)])  # its registration writes the record ready again

        async def registering() -> bool:
            return log.log().count("failpoint leader.before_node_write") > hits
        await until("the registration's write held up", registering)
        await c.stub().CordonNode(gpb.CordonNodeRequest(az=AZ, node="n0", cordoned=True), timeout=20)

        async def registered() -> bool:
            st = await node_status(c, "n0")
            return st is not None and st.ready
        await until("n0 registered again", registered)
        st = await node_status(c, "n0")
        assert st is not None and st.cordoned, st
        kv = await c.store.get(c.store.keys.node(AZ, "n0"))
        assert NodeRecord.from_dict(kv.json()).cordoned
    finally:
        await c.close()


async def test_a_forced_delete_restarts_the_gangs_that_held_the_node(cluster: LocalCluster) -> None:
    c = cluster
    await one_az_two_nodes(c)
    g = await running_on(c, "long", "n0")
    rc, out, err = await cli(c, "node", "delete", "n0", "--az", AZ, "--force")
    assert rc == 0 and f"node n0 (az-a) deleted (gangs {g.id} held its devices)" in out, (rc, out, err)

    async def restarted() -> bool:
        now = await c.stub().GetGang(gpb.GetGangRequest(id=g.id), timeout=5)
        return now.incarnation > g.incarnation and now.state == pb.GANG_STATE_RUNNING
    await until("the gang running again in a new incarnation", restarted, timeout=60)
    # Its agent still runs: it registered the node again, uncordoned.
    await c.wait_nodes_ready(AZ, 2)
    await c.stub().CancelGang(gpb.CancelGangRequest(id=g.id, reason="test"))
    assert await c.check_etcd_invariants() == []
