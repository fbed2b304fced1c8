"""Retention of finished gangs (docs/etcd-keys.md "Retention") on a real etcd
and real coordinator processes: the owner's leader deletes a finished gang,
its idempotency key and its decisions gang_retention_s after it ended, and
nothing else."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import signal
import time

import grpc
import pytest

from phalanx.timings import Timings
from phalanx.store import Delete, Get, Put, Store, none_under
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node, tiny

pytestmark = pytest.mark.integration
AZ = "az-a"
# The shortest retention the fast timings allow (Timings.validate, rule 9):
# a sweep every 1.2 s.
RETENTION = 12.0


def short_retention() -> Timings:
    return dataclasses.replace(Timings.fast(), gang_retention_s=RETENTION).validate()


@pytest.fixture
async def cluster(etcd_endpoint, cluster_name, tmp_path):
    c = LocalCluster(etcd_endpoint, cluster_name, tmp_path, timings=short_retention())
    await c.start()
    try:
        yield c
    finally:
        await c.close()


def leader_lines(log: str) -> list[tuple[int, int]]:
    """(gangs, finished) of every 'leader of ...' line in a coordinator log."""
    return [(int(m[1]), int(m[2])) for m in re.finditer(r"leader of \S+ \(epoch \d+\): (\d+) gangs, (\d+) finished", log)]


async def test_prefix_compare_and_keys_only_read_on_real_etcd(etcd_endpoint, cluster_name, etcd_coordinator_tls) -> None:
    """What the collector relies on: ``none_under`` holds on an empty prefix
    and fails once any key lies under it (etcd's range compare); a keys-only
    read returns the keys without their values."""
    async with Store(etcd_endpoint, cluster_name, tls=etcd_coordinator_tls) as s:
        prefix = s.keys.member_summaries("g-1")
        assert (await s.txn([none_under(prefix)], [])).succeeded
        await s.txn([], [Put(s.keys.member_summary("g-10", "az-a"), {"x": 1})])  # g-10 is not under g-1/
        assert (await s.txn([none_under(prefix)], [])).succeeded
        await s.txn([], [Put(s.keys.member_summary("g-1", "az-b"), {"x": 1})])
        assert not (await s.txn([none_under(prefix)], [])).succeeded
        keys = (await s.txn([], [Get(s.keys.member_summaries(), prefix=True, keys_only=True)])).results[0]
        assert [(kv.key, kv.value) for kv in keys] == [(s.keys.member_summary("g-1", "az-b"), b""),
                                                      (s.keys.member_summary("g-10", "az-a"), b"")]
        await s.txn([], [Delete(s.keys.member_summaries(), prefix=True)])


async def test_finished_gangs_are_collected_and_nothing_else(cluster: LocalCluster) -> None:
    c = cluster
    k = c.store.keys
    c.start_coordinator(AZ, "a0")
    first = await c.wait_leader(AZ)
    c.start_coordinator(AZ, "a1")
    c.start_agents(AZ, [dgx_node(f"n{i}", AZ) for i in range(2)])
    await c.wait_nodes_ready(AZ, 2)

    done = await c.submit(tiny("done", members=1, gpus=1, duration=0.2), key="k-done")
    held = await c.submit(tiny("held", members=1, gpus=1, duration=0.2), key="k-held")
    summarised = await c.submit(tiny("summarised", members=1, gpus=1, duration=0.2))
    running = await c.submit(tiny("running", members=1, gpus=1, duration=120.0))
    # 16 GPUs exist; "running" holds one of them, so this one fits only some day.
    waiting = await c.submit(tiny("waiting", members=2, gpus=8, duration=1.0))
    for g in (done, held, summarised):
        assert (await c.wait_state(g.id, TERMINAL, timeout=30)).state == pb.GANG_STATE_SUCCEEDED
    await c.wait_state(running.id, {pb.GANG_STATE_RUNNING}, timeout=30)
    # Holds the collector must respect, in an AZ whose leader is away (so
    # nobody releases them): a reservation still RELEASING, and a member
    # summary not deleted yet. (This AZ's own RELEASING reservations are in
    # its leader's memory too: tests/unit/test_retention.py.)
    hold_key = k.reservation("az-z", held.id)
    summary_key = k.member_summary(summarised.id, "az-z")
    await c.store.txn([], [Put(hold_key, {"az": "az-z", "gang": held.id, "incarnation": 1, "status": "RELEASING",
                                          "nodes": {}, "epoch": 1}),
                           Put(summary_key, {"incarnation": 1, "az": "az-z", "members": {}})])

    # The leader that saw "done" finish dies; its successor collects it.
    c.coordinators["a0"].signal(signal.SIGKILL)
    second = await c.wait_leader(AZ, not_epoch=first.epoch)
    assert await c.wait_deleted(k.gang(done.id), timeout=RETENTION + 30), "finished gang not collected"
    assert await c.store.get(k.idempotency("k-done")) is None
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub().GetGang(gpb.GetGangRequest(id=done.id), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert done.id in err.value.details() and "gang_retention_s=12s" in err.value.details()

    # A sweep later, the held, live and pending gangs are all still there.
    await asyncio.sleep(3 * short_retention().gc_interval_s)  # a negative check: sweeps meanwhile keep these
    have = await c.etcd_gangs()
    assert have[held.id].state.name == "SUCCEEDED" and have[summarised.id].state.name == "SUCCEEDED"
    assert have[running.id].state.name == "RUNNING" and have[waiting.id].state.name == "PENDING"
    assert (await c.store.get(k.idempotency("k-held"))).json() == {"id": held.id}
    listed = await c.stub().ListGangs(gpb.ListGangsRequest(), timeout=5)
    assert done.id not in {g.id for g in listed.gangs}

    # Holds gone: collected at the next sweeps.
    await c.store.txn([], [Delete(hold_key), Delete(summary_key)])
    assert await c.wait_deleted(k.gang(held.id), timeout=15)
    assert await c.wait_deleted(k.gang(summarised.id), timeout=15)
    assert await c.store.get(k.idempotency("k-held")) is None
    assert await c.check_etcd_invariants() == []

    # A new leader loads what etcd still holds (the two live gangs), never a
    # collected one.
    have = await c.etcd_gangs()
    assert set(have) == {running.id, waiting.id}
    c.start_coordinator(AZ, "a2")
    c.coordinators["a1"].signal(signal.SIGKILL)
    await c.wait_leader(AZ, not_epoch=second.epoch)
    deadline = time.monotonic() + 10
    while not leader_lines(c.coordinators["a2"].log()) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert leader_lines(c.coordinators["a2"].log()) == [(2, 0)]

    # The key is free again: the same submission is a new gang.
    resp = await c.stub().SubmitGang(gpb.SubmitGangRequest(spec=tiny("done", members=1, gpus=1, duration=0.2),
                                                           idempotency_key="k-done"), timeout=10)
    assert resp.created and resp.gang.id != done.id
    again = await c.wait_state(resp.gang.id, TERMINAL, timeout=30)
    assert again.state == pb.GANG_STATE_SUCCEEDED
    await c.stub().CancelGang(gpb.CancelGangRequest(id=running.id, reason="test over"), timeout=10)
