"""No head-of-line blocking by the impossible (docs/admission.md), on a real
etcd, real coordinator processes and simulated agents: a gang that can never
fit fails at once with the limit it breaks, and one that could fit some day
but not on the nodes up now holds nobody back."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from phalanx.timings import Timings
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node, tiny
from tests.integration.test_cross_az import AZS, cross, three_azs

pytestmark = pytest.mark.integration
AZ = "az-a"
# A short backfill window, so "past its window" is reached within a test;
# never-fits is judged 2 s after a leader starts (Timings.fast()).
TIMINGS = dataclasses.replace(Timings.fast(), backfill_window_s=1.0).validate()


@pytest.fixture
async def cluster(etcd_endpoint, cluster_name, tmp_path):
    c = LocalCluster(etcd_endpoint, cluster_name, tmp_path, timings=TIMINGS)
    await c.start()
    try:
        yield c
    finally:
        await c.close()


async def one_az(c: LocalCluster, nodes: int = 2) -> None:
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node(f"n{i}", AZ) for i in range(nodes)])
    await c.wait_nodes_ready(AZ, nodes)
    # Past the start-up grace, so the leader judges never-fits (setup, not
    # an assertion: the tests below wait for states, never for a duration).
    await asyncio.sleep(TIMINGS.node_register_grace_s)


async def test_issue_12_repro_the_impossible_gang_fails_at_once_and_the_small_one_runs(cluster: LocalCluster) -> None:
    c = cluster
    await one_az(c, nodes=2)  # 16 GPUs
    big = await c.submit(tiny("big", members=3, gpus=8, duration=1.0))
    small = await c.submit(tiny("small", members=1, gpus=1, duration=0.5))
    failed = await c.wait_state(big.id, TERMINAL, timeout=30)
    assert failed.state == pb.GANG_STATE_FAILED
    assert failed.reason == "never fits: needs 24 GPUs, the most it may span holds 16 (az az-a)", failed.reason
    done = await c.wait_state(small.id, TERMINAL, timeout=30)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    # The failure left nothing behind.
    assert await c.check_etcd_invariants() == []


async def test_a_gpu_model_no_node_has_fails_at_once(cluster: LocalCluster) -> None:
    c = cluster
    await one_az(c, nodes=1)
    odd = await c.submit(pb.GangSpec(name="odd", members=1, resources=pb.Resources(gpus=1, gpu_model="MI300X"),
                                     run=pb.RunSpec(duration_s=0.5)))
    failed = await c.wait_state(odd.id, TERMINAL, timeout=30)
    assert failed.state == pb.GANG_STATE_FAILED
    assert "never fits: no node in AZ az-a has a GPU of model 'MI300X'" in failed.reason, failed.reason


async def test_a_gang_that_needs_a_node_that_is_down_holds_nobody_back(cluster: LocalCluster) -> None:
    """It could fit some day (the node may come back), so it is not failed;
    but holding the queue would not make it fit, so gangs behind it run even
    after its backfill window has passed."""
    c = cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ), dgx_node("n1", AZ)])
    down = c.start_agents(AZ, [dgx_node("n2", AZ)])
    await c.wait_nodes_ready(AZ, 3)
    down.stop.set()
    await asyncio.wait_for(down.task, 30)
    await wait_ready_count(c, AZ, 2)
    big = await c.submit(tiny("big", members=3, gpus=8, duration=1.0))  # 24 GPUs: n0 + n1 + the down n2
    await asyncio.sleep(TIMINGS.backfill_window_s + TIMINGS.node_register_grace_s)  # past its window
    small = await c.submit(tiny("small", members=1, gpus=1, duration=0.5))
    done = await c.wait_state(small.id, TERMINAL, timeout=30)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    got = await c.stub().GetGang(gpb.GetGangRequest(id=big.id))
    assert got.state == pb.GANG_STATE_PENDING, got.reason
    ex = await c.stub().ExplainGang(gpb.ExplainGangRequest(id=big.id))
    assert not ex.never_fits
    assert "1 node not ready" in ex.summary, ex.summary
    assert "keeps no nodes and holds back no gang behind it" in ex.summary, ex.summary
    assert ex.leader_reason.startswith("queue position 1 of 1 in az-a"), ex.leader_reason
    await c.stub().CancelGang(gpb.CancelGangRequest(id=big.id, reason="test"))


async def wait_ready_count(c: LocalCluster, az: str, n: int, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        st = await c.stub().ClusterStatus(gpb.ClusterStatusRequest(), timeout=5)
        if any(a.az == az and a.nodes_ready == n for a in st.azs):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{az}: not exactly {n} nodes ready after {timeout}s")


async def test_a_cross_az_gang_larger_than_every_az_together_fails_at_once(cluster: LocalCluster) -> None:
    c = cluster
    await three_azs(c, nodes_per_az=1, coordinators=1)  # 24 GPUs in all
    await asyncio.sleep(TIMINGS.node_register_grace_s)  # setup: past the start-up grace (as one_az)
    huge = await c.submit(cross("huge", members=4), address=c.coordinators["a0"].address)
    small = await c.submit(cross("fits", members=3, duration=0.5), address=c.coordinators["a0"].address)
    failed = await c.wait_state(huge.id, TERMINAL, timeout=30)
    assert failed.state == pb.GANG_STATE_FAILED
    assert failed.reason.startswith("never fits: needs 32 GPUs, the most it may span holds 24"), failed.reason
    done = await c.wait_state(small.id, TERMINAL, timeout=60)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    assert sorted(m.az for m in done.placement) == list(AZS)
