"""`explain` tells the whole truth (docs/admission.md "What explain shows"),
on a real etcd, real coordinator processes and simulated agents: the owner
leader's own reason next to the shortfall, for a cross-AZ gang every AZ it
may span, and never "it fits now" for a gang that a rule holds back."""

from __future__ import annotations

import asyncio

import pytest

from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node, tiny
from tests.integration.test_cross_az import cross, three_azs
# The same short-backfill cluster as the never-fits tests (a fixture).
from tests.integration.test_never_fits import TIMINGS, cluster  # noqa: F401

pytestmark = pytest.mark.integration
AZ = "az-a"


async def explain_everywhere(c: LocalCluster, gang_id: str) -> list[gpb.ExplainGangResponse]:
    """The same question to every coordinator: standbys and other AZs'
    leaders forward it to the owner AZ's leader."""
    return [await c.stub(p.address).ExplainGang(gpb.ExplainGangRequest(id=gang_id), timeout=10)
            for p in c.coordinators.values()]


async def test_explain_says_which_rule_holds_whom_and_never_that_a_held_gang_is_admitted(cluster: LocalCluster) -> None:
    c = cluster
    for i in range(2):
        c.start_coordinator(AZ, f"a{i}")
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ), dgx_node("n1", AZ)])
    await c.wait_nodes_ready(AZ, 2)
    # One node busy for a long time; a 2-node gang behind it waits past its
    # backfill window, so both nodes are kept for it; a 1-GPU gang would fit
    # on the free node now, but the backfill rule holds it back.
    busy = await c.submit(tiny("busy", members=1, gpus=8, duration=120.0))
    await c.wait_state(busy.id, {pb.GANG_STATE_RUNNING}, timeout=30)
    wide = await c.submit(tiny("wide", members=2, gpus=8, duration=0.5))
    await asyncio.sleep(TIMINGS.backfill_window_s + 0.5)  # past its window (setup, not an assertion)
    small = await c.submit(tiny("small", members=1, gpus=1, duration=0.5))

    async def held() -> list[gpb.ExplainGangResponse]:
        while True:
            answers = await explain_everywhere(c, small.id)
            if all("held back by the backfill rule" in a.summary for a in answers):
                return answers
            await asyncio.sleep(0.2)

    for ex in await asyncio.wait_for(held(), 30):
        assert f"nodes kept for older gang {wide.id} (n0, n1)" in ex.summary, ex.summary
        assert "fits now" not in ex.summary and "next cycle" not in ex.summary, ex.summary
        assert ex.leader_reason.startswith("queue position 2 of 2 in az-a: held back by the backfill rule"), ex.leader_reason
        assert ex.leader_reason in ex.summary  # what `phalanx explain` prints
    for ex in await explain_everywhere(c, wide.id):
        assert "nodes n0, n1 are kept for it until it fits" in ex.summary, ex.summary
        assert ex.leader_reason.startswith("queue position 1 of 2 in az-a: waited"), ex.leader_reason
        assert ex.shortfalls and ex.shortfalls[0].members_fit == 1 and ex.shortfalls[0].members_needed == 2
    # Ending the busy gang lets the head in, then the one it held back.
    await c.stub().CancelGang(gpb.CancelGangRequest(id=busy.id, reason="test"))
    assert (await c.wait_state(wide.id, TERMINAL, timeout=30)).state == pb.GANG_STATE_SUCCEEDED
    assert (await c.wait_state(small.id, TERMINAL, timeout=30)).state == pb.GANG_STATE_SUCCEEDED
    assert await c.check_etcd_invariants() == []


async def test_explain_of_a_cross_az_gang_looks_at_every_az_it_may_span(cluster: LocalCluster) -> None:
    c = cluster
    await three_azs(c, nodes_per_az=1, coordinators=2)
    # az-b's only node is busy: a 3-AZ gang cannot be placed now.
    busy = await c.submit(tiny("busy-b", members=1, gpus=8, duration=120.0), address=c.coordinators["b0"].address)
    await c.wait_state(busy.id, {pb.GANG_STATE_RUNNING}, timeout=30)
    span = await c.submit(cross("span3"), address=c.coordinators["a0"].address)

    async def unplaced() -> list[gpb.ExplainGangResponse]:
        while True:
            answers = await explain_everywhere(c, span.id)
            if all("UNPLACED" in a.leader_reason for a in answers):
                return answers
            await asyncio.sleep(0.2)

    for ex in await asyncio.wait_for(unplaced(), 30):
        assert ex.gang.owner_az == "az-a"
        assert ex.leader_reason.startswith("two-phase owner in az-a: UNPLACED"), ex.leader_reason
        by_az = {s.domain: s for s in ex.shortfalls if s.level == pb.TOPOLOGY_LEVEL_AZ}
        assert set(by_az) == {"az-a", "az-b", "az-c"}, ex.shortfalls
        assert by_az["az-b"].gpus_free == 0 and by_az["az-a"].gpus_free == 8 and by_az["az-c"].gpus_free == 8
        region = [s for s in ex.shortfalls if s.level == pb.TOPOLOGY_LEVEL_REGION]
        assert region and region[0].gpus_free == 16 and region[0].members_fit == 2, ex.shortfalls
        assert not ex.never_fits and "fits now" not in ex.summary
    await c.stub().CancelGang(gpb.CancelGangRequest(id=busy.id, reason="test"))
    done = await c.wait_state(span.id, TERMINAL, timeout=60)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason


async def test_explain_of_a_gang_failed_as_never_fitting_names_the_limit(cluster: LocalCluster) -> None:
    c = cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    big = await c.submit(tiny("big", members=2, gpus=8, duration=0.5))
    failed = await c.wait_state(big.id, TERMINAL, timeout=30)
    assert failed.state == pb.GANG_STATE_FAILED
    ex = await c.stub().ExplainGang(gpb.ExplainGangRequest(id=big.id))
    assert ex.summary.startswith("FAILED: never fits: needs 16 GPUs, the most it may span holds 8"), ex.summary
