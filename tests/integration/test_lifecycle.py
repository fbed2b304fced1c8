"""Gang lifecycle on a real etcd + real coordinator processes + agents over gRPC."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node, tiny

pytestmark = pytest.mark.integration
AZ = "az-a"


async def one_az(c: LocalCluster, nodes: int = 4, coordinators: int = 2) -> None:
    for i in range(coordinators):
        c.start_coordinator(AZ, f"a{i}")
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node(f"n{i}", AZ, leaf=f"l{i // 2}") for i in range(nodes)])
    await c.wait_nodes_ready(AZ, nodes)


async def states_seen(c: LocalCluster, gang_id: str) -> list[int]:
    seen = []
    async for ev in c.stub().WatchGang(gpb.WatchGangRequest(id=gang_id), timeout=60):
        if not seen or seen[-1] != ev.gang.state:
            seen.append(ev.gang.state)
    return seen


@pytest.mark.parametrize(
    "members,gpus", [(8, 1), (4, 8)], ids=["8x1-gpu gang runs to success", "4x8-gpu gang runs to success"]
)
async def test_gang_runs_to_success(local_cluster: LocalCluster, members: int, gpus: int) -> None:
    c = local_cluster
    await one_az(c)
    # Submit through the standby, so forwarding is on the path too.
    standby = [p for p in c.coordinators.values() if p.id != (await c.leader(AZ)).coordinator_id][0]
    gang = await c.submit(tiny("train", members=members, gpus=gpus, duration=1.0), address=standby.address)
    assert gang.state == pb.GANG_STATE_PENDING
    watch = asyncio.create_task(states_seen(c, gang.id))
    done = await c.wait_state(gang.id, TERMINAL, timeout=60)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    seen = await asyncio.wait_for(watch, 10)
    # The watch may start after RESERVED, but order is the lifecycle's.
    order = [pb.GANG_STATE_PENDING, pb.GANG_STATE_RESERVED, pb.GANG_STATE_STARTING, pb.GANG_STATE_RUNNING, pb.GANG_STATE_SUCCEEDED]
    assert seen == [s for s in order if s in seen] and seen[-1] == pb.GANG_STATE_SUCCEEDED and pb.GANG_STATE_RUNNING in seen
    assert len(done.placement) == members
    assert sorted(m.rank for m in done.placement) == list(range(members))
    assert all(len(m.gpus) == gpus for m in done.placement)
    if gpus == 8:
        assert len({m.node for m in done.placement}) == 4
    else:
        assert len({m.node for m in done.placement}) == 1, "8 x 1 GPU fits on one node: fewest nodes"
    # Nothing left reserved once the gang finished.
    assert await c.etcd_reservations() == {}
    assert await c.check_etcd_invariants() == []


async def test_gang_larger_than_az_fails_at_once_and_explain_says_why(local_cluster: LocalCluster) -> None:
    """Larger than every node the AZ has registered: it can never fit, so it
    fails with that reason instead of waiting for its admission timeout
    (docs/admission.md "Never fits")."""
    c = local_cluster
    await one_az(c, nodes=4)
    gang = await c.submit(tiny("huge", members=5, gpus=8, duration=1.0))
    failed = await c.wait_state(gang.id, TERMINAL, timeout=30)
    assert failed.state == pb.GANG_STATE_FAILED
    assert failed.reason == "never fits: needs 40 GPUs, the most it may span holds 32 (az az-a)", failed.reason
    ex = await c.stub().ExplainGang(gpb.ExplainGangRequest(id=gang.id))
    assert ex.gang.id == gang.id and failed.reason in ex.summary, ex.summary
    assert await c.etcd_reservations() == {}


async def test_gang_larger_than_what_is_free_waits_and_explain_says_why(local_cluster: LocalCluster) -> None:
    c = local_cluster
    await one_az(c, nodes=4)
    busy = await c.submit(tiny("busy", members=1, gpus=8, duration=60.0))
    await c.wait_state(busy.id, {pb.GANG_STATE_RUNNING}, timeout=30)
    gang = await c.submit(tiny("wide", members=4, gpus=8, duration=1.0))
    await asyncio.sleep(1.0)  # a negative check: it does not fit, so it is not admitted meanwhile
    got = await c.stub().GetGang(gpb.GetGangRequest(id=gang.id))
    assert got.state == pb.GANG_STATE_PENDING
    ex = await c.stub().ExplainGang(gpb.ExplainGangRequest(id="wide"))  # by name works too
    assert ex.gang.id == gang.id
    assert "24 of 32 GPUs free" in ex.summary and "3 of 4" in ex.summary, ex.summary
    assert ex.shortfalls and ex.shortfalls[0].gpus_needed == 32 and ex.shortfalls[0].gpus_free == 24
    assert ex.leader_reason.startswith("queue position 1 of 1 in az-a"), ex.leader_reason
    assert not ex.never_fits
    cancelled = await c.stub().CancelGang(gpb.CancelGangRequest(id=gang.id, reason="test"))
    assert cancelled.state == pb.GANG_STATE_CANCELLED
    await c.stub().CancelGang(gpb.CancelGangRequest(id=busy.id, reason="test"))


async def test_many_gangs_never_partially_reserved_nor_double_booked(local_cluster: LocalCluster) -> None:
    c = local_cluster
    await one_az(c, nodes=4)
    ids = []
    for i in range(12):
        g = await c.submit(tiny(f"g{i}", members=[8, 2, 3][i % 3], gpus=[1, 8, 4][i % 3], duration=0.6))
        ids.append(g.id)
    checks = 0
    while True:
        problems = await c.check_etcd_invariants()
        assert problems == []
        checks += 1
        gangs = await c.etcd_gangs()
        if all(gangs[i].state.terminal for i in ids):
            break
        await asyncio.sleep(0.05)
    gangs = await c.etcd_gangs()
    assert {gangs[i].state.name for i in ids} == {"SUCCEEDED"}
    assert checks > 3


async def test_idempotent_submission_gives_one_gang(local_cluster: LocalCluster) -> None:
    c = local_cluster
    await one_az(c, nodes=1)
    a = await c.submit(tiny("idem", duration=0.2), key="key-1")
    b = await c.submit(tiny("idem", duration=0.2), key="key-1")
    assert a.id == b.id
    resp = await c.stub().ListGangs(gpb.ListGangsRequest(name_prefix="idem"))
    assert [g.id for g in resp.gangs] == [a.id]
    # Same key, different spec: refused, naming the key.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.submit(tiny("idem", members=2, duration=0.2), key="key-1")
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "idempotency_key" in err.value.details()


async def test_cancel_running_gang_stops_members_and_frees_devices(local_cluster: LocalCluster) -> None:
    c = local_cluster
    await one_az(c, nodes=2)
    g = await c.submit(tiny("long", members=2, gpus=8, duration=120))
    await c.wait_state(g.id, {pb.GANG_STATE_RUNNING})
    out = await c.stub().CancelGang(gpb.CancelGangRequest(id=g.id, reason="user"))
    assert out.state == pb.GANG_STATE_CANCELLED
    # Devices are freed once both members are confirmed stopped.
    for _ in range(100):
        if await c.etcd_reservations() == {}:
            break
        await asyncio.sleep(0.1)
    assert await c.etcd_reservations() == {}
    hist = [d for g_ in c.agent_groups for ev, d in g_.history if ev == "member_exited"]
    assert sorted(d["phase"] for d in hist) == ["STOPPED", "STOPPED"]
    # The freed capacity is usable again.
    g2 = await c.submit(tiny("next", members=2, gpus=8, duration=0.3))
    assert (await c.wait_state(g2.id, TERMINAL)).state == pb.GANG_STATE_SUCCEEDED
