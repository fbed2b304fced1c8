"""Unreadable leader records planted in a real etcd (phalanx/leader_record.py):
a real coordinator's cluster status counts them as no leader (and says why in
its log) instead of failing, and a real agent session in that AZ does not
dial what it cannot read, naming the field in its log."""

from __future__ import annotations

import asyncio
import logging

import pytest

from phalanx.store import Put
from phalanx.v1 import gang_pb2 as gpb
from tests.integration.harness import LocalCluster, dgx_node, until

pytestmark = pytest.mark.integration
AZ = "az-a"


async def plant(c: LocalCluster, key: str, value: bytes) -> None:
    """As an operator's `etcdctl put` would: no validation on the way."""
    res = await c.store.txn([], [Put(key, value)])
    assert res.succeeded


async def test_planted_leader_records_count_as_no_leader(local_cluster: LocalCluster,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    c = local_cluster
    k = c.store.keys
    await plant(c, k.leader("az-y"), b'["not", "an", "object"]')
    await plant(c, k.leader("az-z"), b'{"id": 7, "address": "127.0.0.1:1"}')
    coord = c.start_coordinator(AZ, "a0")
    info = await c.wait_leader(AZ)

    st = await c.stub().ClusterStatus(gpb.ClusterStatusRequest(), timeout=10)
    azs = {a.az: a for a in st.azs}
    assert azs[AZ].has_leader and azs[AZ].epoch == info.epoch and azs[AZ].leader_id == "a0"
    assert "az-y" not in azs or not azs["az-y"].has_leader, st
    assert "az-z" not in azs or not azs["az-z"].has_leader, st
    log = coord.log()
    assert "leader/az-y: not a JSON object but list" in log, log[-3000:]
    assert "leader/az-z: id must be a string, got int" in log, log[-3000:]

    # An agent of az-z reads the record, refuses it and dials nobody: no
    # node of az-z is ever registered. No coordinator serves az-z, so the
    # agent reads etcd itself (the legacy path), as a coordinator would.
    caplog.set_level(logging.ERROR, logger="agent.session")
    c.expect_log(r"cannot read the leader record", who="agent")  # what this test plants
    c.start_agents("az-z", [dgx_node("z0", "az-z")], via_etcd=True)

    async def said_once() -> bool:
        return any("cannot read the leader record" in r.getMessage() for r in caplog.records)

    await until("the agent says it cannot read the leader record", said_once)
    await asyncio.sleep(5 * c.timings.heartbeat_interval_s)  # negative: a few more lookups say nothing more
    said = [r.getMessage() for r in caplog.records if "cannot read the leader record" in r.getMessage()]
    assert said and "leader/az-z: id must be a string, got int" in said[0], said
    assert len(said) == 1, "said once, not at every retry"
    kvs, _ = await c.store.get_prefix(k.nodes("az-z"))
    assert kvs == [], [kv.key for kv in kvs]
