"""Leader failover and fencing with real coordinator processes.

Failover times are printed (``-s`` shows them), never asserted: the bound
asserted is a liveness deadline, generous on a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time

import grpc
import pytest

from phalanx.reservation import HoldState
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import gang_pb2_grpc as gpb_grpc
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node, tiny

pytestmark = pytest.mark.integration
AZ = "az-a"


async def submit_with_retry(c: LocalCluster, spec: pb.GangSpec, key: str, deadline_s: float = 30.0) -> pb.Gang:
    """What the SDK does: same idempotency key, any coordinator, until acked."""
    deadline = time.monotonic() + deadline_s
    addresses = [p.address for p in c.coordinators.values()]
    i = 0
    while True:
        addr = addresses[i % len(addresses)]
        i += 1
        try:
            resp = await c.stub(addr).SubmitGang(gpb.SubmitGangRequest(spec=spec, idempotency_key=key), timeout=3)
            return resp.gang
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED):
                raise
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_sigkill_leader_during_admission(local_cluster: LocalCluster) -> None:
    c = local_cluster
    for i in range(3):
        c.start_coordinator(AZ, f"a{i}")
    first = await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node(f"n{i}", AZ, leaf=f"l{i % 2}") for i in range(4)])
    await c.wait_nodes_ready(AZ, 4)

    acked: dict[str, str] = {}
    stop = asyncio.Event()

    async def workload() -> None:
        n = 0
        while not stop.is_set():
            key = f"w-{n}"
            g = await submit_with_retry(c, tiny(f"w{n}", members=[8, 2][n % 2], gpus=[1, 8][n % 2], duration=0.5), key)
            acked[key] = g.id
            n += 1
            await asyncio.sleep(0.05)

    load = asyncio.create_task(workload())
    await asyncio.sleep(1.5)  # pacing: let the workload be in flight when the leader dies (nothing asserted on it)
    killed_at = time.monotonic()
    c.coordinators[first.coordinator_id].signal(signal.SIGKILL)
    new = await c.wait_leader(AZ, not_epoch=first.epoch, timeout=60)
    failover_s = time.monotonic() - killed_at
    print(f"\nfailover after SIGKILL: {failover_s:.2f}s (lease TTL {c.timings.lease_ttl_s}s)")
    assert new.coordinator_id != first.coordinator_id and new.epoch > first.epoch
    await asyncio.sleep(2.0)  # pacing: the workload goes on under the successor for a while
    stop.set()
    await load
    assert len(acked) >= 5
    # Every acknowledged submission exists; the in-flight ones all finish.
    for gid in acked.values():
        g = await c.wait_state(gid, TERMINAL, timeout=90)
        assert g.state == pb.GANG_STATE_SUCCEEDED, (gid, g.reason)
    gangs = await c.etcd_gangs()
    assert set(acked.values()) <= set(gangs)
    # One gang per idempotency key, even across the failover.
    keys = [g.idempotency_key for g in gangs.values()]
    assert len(keys) == len(set(keys))
    assert await c.check_etcd_invariants() == []
    assert await c.etcd_reservations() == {}


async def test_paused_leader_is_fenced_and_its_agents_follow_the_successor(local_cluster: LocalCluster) -> None:
    c = local_cluster
    for i in range(2):
        c.start_coordinator(AZ, f"a{i}")
    old = await c.wait_leader(AZ)
    group = c.start_agents(AZ, [dgx_node(f"n{i}", AZ) for i in range(2)])
    await c.wait_nodes_ready(AZ, 2)
    running = await c.submit(tiny("steady", members=2, gpus=8, duration=8.0))
    await c.wait_state(running.id, {pb.GANG_STATE_RUNNING})

    paused = c.coordinators[old.coordinator_id]
    paused.signal(signal.SIGSTOP)
    try:
        new = await c.wait_leader(AZ, not_epoch=old.epoch, timeout=60)
        # The successor holds the leader key from here on (the old leader is
        # stopped): every member start from now on must carry its epoch.
        takeover_wall = time.time()
        assert new.epoch > old.epoch
        # Work continues under the successor while the old leader sleeps.
        survivor = [p for p in c.coordinators.values() if p.id != old.coordinator_id][0]
        g = await submit_with_retry(c, tiny("after", members=1, gpus=1, duration=0.3), "after-1")
        assert (await c.wait_state(g.id, TERMINAL)).state == pb.GANG_STATE_SUCCEEDED
        await asyncio.sleep(c.timings.lease_ttl_s * 1.5)  # well past the old TTL
    finally:
        paused.signal(signal.SIGCONT)
    # The old leader wakes, finds its lease locally expired, and steps down.
    for _ in range(100):
        if re.search(r"(lost leadership|steps down)", paused.log()):
            break
        await asyncio.sleep(0.1)
    assert re.search(r"(lost leadership|steps down)", paused.log()), paused.log()[-2000:]
    assert (await c.leader(AZ)).epoch == new.epoch
    # A gang submitted once the old leader is awake again: were it still
    # acting on its epoch, this is where its word would reach the agents.
    woke = await submit_with_retry(c, tiny("after-wake", members=2, gpus=1, duration=0.3), "after-wake-1")
    assert (await c.wait_state(woke.id, TERMINAL)).state == pb.GANG_STATE_SUCCEEDED
    await asyncio.sleep(1.0)  # a negative check: the awake old leader writes nothing meanwhile
    # No etcd effect from the old epoch after the takeover...
    for r in (await c.etcd_reservations()).values():
        assert r.epoch != old.epoch or r.state is HoldState.RELEASING
    # ...and agents acted only on epochs that were current. The steady gang's
    # members started under the old epoch (so a start's epoch is the
    # assigning leader's, not a constant) ...
    started = [d for ev, d in group.history if ev == "member_started"]
    assert sorted(d["epoch"] for d in started if d["key"].startswith(f"{running.id}#")) == [old.epoch] * 2, started
    # ... and the members of both later gangs started after the takeover,
    # each under the new epoch (not vacuous: there must be those starts).
    starts = [d for d in started if d["wall"] > takeover_wall]
    assert {d["key"] for d in starts} >= {f"{g.id}#1/r0", f"{woke.id}#1/r0", f"{woke.id}#1/r1"}, started
    assert [d for d in starts if d["epoch"] != new.epoch] == [], starts
    connects = [d["epoch"] for ev, d in group.history if ev == "connected"]
    assert connects[-1] == new.epoch and old.epoch in connects
    # The steady gang survived the failover without being fenced.
    assert (await c.wait_state(running.id, TERMINAL, timeout=60)).state == pb.GANG_STATE_SUCCEEDED
    assert not [d for ev, d in group.history if ev == "fenced"]
    assert survivor.proc.poll() is None


async def test_submission_whose_reply_is_lost_is_admitted_without_a_retry(local_cluster: LocalCluster) -> None:
    """docs/chaos.md finding 2: the submission txn commits but its reply is
    lost (failpoint ``leader.submit_reply_lost``), the client is told
    UNAVAILABLE and never retries. The gang exists in etcd, so the leader must
    still admit it: without a leader change and without a second submission."""
    c = local_cluster
    c.start_coordinator(AZ, "a0", extra_env={"PHALANX_FAILPOINTS": "leader.submit_reply_lost=on"})
    leader = await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.submit(tiny("lost-reply", members=2, gpus=1, duration=0.3), key="once")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    (gang,) = [g for g in (await c.etcd_gangs()).values() if g.spec.name == "lost-reply"]
    done = await c.wait_state(gang.id, TERMINAL, timeout=60)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    assert (await c.wait_leader(AZ)).epoch == leader.epoch  # admitted by the same leader
    assert "applied although its reply was lost" in c.coordinators["a0"].log_path.read_text()


async def test_new_leader_whose_rebuild_fails_keeps_its_leadership_and_retries(
        local_cluster: LocalCluster, tmp_path) -> None:
    """A fresh leader whose first reads fail (an etcd member timing out)
    retries them while its lease holds instead of stepping down and making
    the AZ elect again (docs/chaos.md finding 6)."""
    c = local_cluster
    fp = tmp_path / "failpoints"
    fp.write_text("leader.rebuild_unavailable=on")
    proc = c.start_coordinator(AZ, "a0", extra_env={"PHALANX_FAILPOINTS_FILE": str(fp)})
    leader = await c.wait_leader(AZ)
    deadline = time.monotonic() + 30
    while proc.log_path.read_text().count("retrying") < 3:
        assert time.monotonic() < deadline, proc.log_path.read_text()
        await asyncio.sleep(0.1)
    fp.write_text("")  # etcd answers again
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    g = await c.submit(tiny("after-retry", members=1, gpus=1, duration=0.2))
    done = await c.wait_state(g.id, TERMINAL, timeout=60)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    assert (await c.wait_leader(AZ)).epoch == leader.epoch  # never stepped down


async def test_a_standby_forwards_within_the_callers_deadline(local_cluster: LocalCluster) -> None:
    """issue 12: submissions forwarded by a standby were given a fixed
    5 x etcd_timeout_s, so a leader slower than that (a burst) cost the
    caller a bare "Deadline Exceeded" or "CANCELLED" while it was still
    willing to wait. The forward now gets the caller's own deadline; with
    none, forward_timeout_s, and the error names the leader that did not
    answer."""
    c = local_cluster
    slow = c.timings.forward_timeout_s + 1.5  # slower than any fixed forward deadline
    c.start_coordinator(AZ, "a0", extra_env={"PHALANX_FAILPOINTS": f"leader.before_submit=delay({slow})"})
    leader = await c.wait_leader(AZ)
    standby = c.start_coordinator(AZ, "a1")
    assert leader.coordinator_id == "a0"
    async with c.channel(standby.address) as ch:
        stub = gpb_grpc.GangServiceStub(ch)
        resp = await stub.SubmitGang(gpb.SubmitGangRequest(spec=tiny("patient", members=1)), timeout=slow + 20)
        assert resp.created and resp.gang.owner_az == AZ
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SubmitGang(gpb.SubmitGangRequest(spec=tiny("no-deadline", members=1)))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
        assert "the leader of az-a (a0 at " in err.value.details() and "forwarded by a1" in err.value.details(), err.value.details()
    assert [g.spec.name for g in (await c.etcd_gangs()).values() if g.spec.name == "patient"] == ["patient"]
