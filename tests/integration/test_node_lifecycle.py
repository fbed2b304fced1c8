"""Node lifecycle on a real etcd, real coordinator processes and simulated
agents over real gRPC (docs/nodes.md): a node whose agent is gone expires and
no longer counts for never-fits; an admin cordons, drains and deletes a node."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from phalanx.timings import Timings
from phalanx.v1 import gang_pb2 as gpb
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
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    gone = c.start_agents(AZ, [dgx_node("n1", AZ)])
    await c.wait_nodes_ready(AZ, 2)
    gone.stop.set()
    await asyncio.wait_for(gone.task, 30)

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

    # 16 GPUs: only with n1, which is gone. Today it waited "for devices".
    big = await c.submit(tiny("big", members=2, gpus=8, duration=0.5))
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
