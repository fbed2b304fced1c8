"""Finished gangs bounded by count, not only by age, and what is left of a
collected gang (docs/etcd-keys.md "Retention by count and bytes"), on a real
etcd.

The collector is driven directly: a real ``AzLeader`` built in the test
process as coordinator/server.py builds it (the cluster's coordinator etcd
user, a lease session, an election won), its sweep called by the test, and
its monotonic clock moved past a client's retry window instead of waited
for. Then, end to end, a real coordinator's GetGang of a collected gang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import grpc
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core.records import GangRecord
from coordinator.core.retention import ExpiredGang
from coordinator.election import Election, LeaseSession
from coordinator.leader import AzLeader
from phalanx.model import GangState
from phalanx.spec import parse_spec
from phalanx.store import Put, Store
from phalanx.timings import Timings
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import gang_pb2_grpc as ggrpc
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import LocalCluster, dgx_node, tiny
from tests.integration.test_retention import cluster  # noqa: F401 - the fixture: 12 s of retention, a sweep every 1.2 s

pytestmark = pytest.mark.integration
AZ = "az-a"
T = Timings()  # 7 days of retention: nothing here is old enough to go by age
KEEP = 2
KEEP_EXPIRED = 3


class Clock:
    """The leader's monotonic clock, moved on by the test."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead


def finished(i: int, now: float) -> GangRecord:
    spec = parse_spec({"name": f"done{i}", "members": 1, "resources": {"gpus": 1}})
    return GangRecord(id=f"done{i}-0000000{i}", spec=spec, state=GangState.SUCCEEDED, owner_az=AZ,
                      submitted_at=now - 100 + i, updated_at=now - 50 + i, owner="admin/tester")


async def put_finished(store: Store, recs: list[GangRecord]) -> list[GangRecord]:
    out = []
    for g in recs:
        res = await store.txn([], [Put(store.keys.gang(g.id), g.to_dict())])
        out.append(dataclasses.replace(g, mod_revision=res.revision))
    return out


async def keys_under(store: Store, prefix: str) -> set[str]:
    kvs, _ = await store.get_prefix(prefix, keys_only=True)
    return {kv.key[len(prefix):] for kv in kvs}


@pytest.fixture
async def store(etcd_endpoint: str, cluster_name: str, etcd_coordinator_tls: Any):
    async with Store([etcd_endpoint], cluster_name, timeout=T.etcd_timeout_s, tls=etcd_coordinator_tls) as s:
        yield s


async def test_count_bound_collects_the_oldest_and_expired_ids_are_bounded(store: Store, etcd_endpoint: str,
                                                                           cluster_name: str) -> None:
    now = time.time()
    first = await put_finished(store, [finished(i, now) for i in range(5)])
    config = CoordinatorConfig(cluster=cluster_name, az=AZ, coordinator_id="c-test", etcd=(etcd_endpoint,),
                               timings=T, max_finished_gangs=KEEP, max_expired_ids=KEEP_EXPIRED).validate()
    clock = Clock()
    session = await LeaseSession(store, T).start()
    election = Election(store, AZ, config.coordinator_id, "127.0.0.1:1", T)
    info = await asyncio.wait_for(election.campaign(session), 10)
    ldr = AzLeader(store, config, info, session, peer_channel=None, mono=clock)
    lead = asyncio.create_task(ldr.run())
    try:
        await asyncio.wait_for(ldr.until_rebuilt(), 15)
        # Within a client's retry window nothing goes, bound or not.
        assert await ldr.collector.sweep() == 0
        assert await keys_under(store, store.keys.gangs()) == {g.id for g in first}

        clock.ahead += T.submit_retry_window_s + 1
        assert await ldr.collector.sweep() == 3
        # The newest KEEP stay, young as all of them are; the oldest left etcd.
        assert await keys_under(store, store.keys.gangs()) == {g.id for g in first[3:]}
        assert await keys_under(store, store.keys.expired()) == {g.id for g in first[:3]}
        kv = await store.get(store.keys.expired(first[0].id))
        gone = ExpiredGang.from_dict(kv.json())
        assert (gone.state, gone.owner_az, gone.owner, gone.ended_at) == (GangState.SUCCEEDED, AZ, "admin/tester",
                                                                          first[0].updated_at)

        # Two more finish: two more go, and the expired ids keep the newest KEEP_EXPIRED.
        more = await put_finished(store, [finished(i, now + 10) for i in range(5, 7)])
        for g in more:
            ldr.writer.note(g)
        clock.ahead += T.submit_retry_window_s + 1
        assert await ldr.collector.sweep() == 2
        assert await keys_under(store, store.keys.gangs()) == {g.id for g in more}
        assert await keys_under(store, store.keys.expired()) == {first[2].id, first[3].id, first[4].id}
    finally:
        lead.cancel()
        await asyncio.gather(lead, return_exceptions=True)
        await election.resign(info)
        await session.close(revoke=True)


async def test_get_of_a_collected_gang_says_finished_and_expired(cluster: LocalCluster, tmp_path) -> None:
    """To its submitter; under visibility own, another submitter is told
    only "no gang", as for a gang that never was."""
    c = cluster
    policy = tmp_path / "policy.yaml"
    policy.write_text("visibility: own\n")
    coord = c.start_coordinator(AZ, "a0", extra_args=["--policy", str(policy)])
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    alice = c.channel(coord.address, role="submitter", name="alice", queues=("a",))
    bob = c.channel(coord.address, role="submitter", name="bob", queues=("a",))
    try:
        as_alice, as_bob = ggrpc.GangServiceStub(alice), ggrpc.GangServiceStub(bob)
        g = (await as_alice.SubmitGang(gpb.SubmitGangRequest(spec=tiny("brief", members=1, gpus=1, duration=0.2,
                                                                        queue="a")), timeout=10)).gang
        await c.wait_state(g.id, {pb.GANG_STATE_SUCCEEDED})
        assert await c.wait_deleted(c.store.keys.gang(g.id), timeout=120), "not collected"

        async def get_error(stub: ggrpc.GangServiceStub, ident: str) -> str:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetGang(gpb.GetGangRequest(id=ident), timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            return err.value.details() or ""

        details = await get_error(as_alice, g.id)
        assert f"gang {g.id!r} finished SUCCEEDED at" in details and "and expired" in details, details
        for details in (await get_error(as_bob, g.id), await get_error(as_alice, "never-0badc0de")):
            assert "expired" not in details and "no gang" in details, details
    finally:
        await alice.close()
        await bob.close()
