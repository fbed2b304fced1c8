"""An idle cluster does not fill etcd (issue 25): a leader and a standby,
NODES simulated nodes with full topologies, short timings, and an etcd of
its own with a quota of a few MB. While every agent keeps heartbeating for
SOAK_S, no node record is written, no space alarm is raised, and `phalanx
nodes` (ListNodes) still shows each node's last heartbeat moving, on the
leader and on the standby (which asks the leader, docs/design.md D17).

Before issue 25 the leader rewrote every node record every 5 s to refresh
its heartbeat; this cluster then raised etcd's NOSPACE alarm within the soak.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from agent.topology.simulated import simulated_fabric
from phalanx.v1 import gang_pb2 as gpb
from tests.conftest import etcdctl
from tests.integration.harness import LocalCluster
from tests.pki import PrivateEtcd

pytestmark = pytest.mark.integration
AZ = "az-a"
NODES = 48  # ~4.9 KB records: the rewrites of before filled QUOTA in well under SOAK_S
QUOTA = 2 * 1024 * 1024
SOAK_S = 40.0


def db_size(endpoint: str) -> int:
    return json.loads(etcdctl(endpoint, "endpoint", "status", "-w", "json"))[0]["Status"]["dbSize"]


async def heartbeats(c: LocalCluster, address: str) -> dict[str, float]:
    resp = await c.stub(address).ListNodes(gpb.ListNodesRequest(az=AZ), timeout=10)
    return {n.topology.node: n.last_heartbeat for n in resp.nodes}


async def test_idle_cluster_writes_no_node_records_and_raises_no_alarm(tmp_path) -> None:
    cluster = "t" + uuid.uuid4().hex[:10]
    # An etcd of its own (the session's is shared), --quota-backend-bytes QUOTA.
    with PrivateEtcd(tmp_path, cluster, extra_args=["--quota-backend-bytes", str(QUOTA)]) as etcd:
        await soak(LocalCluster(etcd.endpoint, cluster, tmp_path, etcd_pki=etcd.pki), etcd.endpoint)


async def soak(c: LocalCluster, endpoint: str) -> None:
    await c.start()
    try:
        leader = c.start_coordinator(AZ, "a0")
        await c.wait_leader(AZ)
        standby = c.start_coordinator(AZ, "a1")
        c.start_agents(AZ, simulated_fabric(AZ, NODES, 2, 4))
        await c.wait_nodes_ready(AZ, NODES, timeout=60)
        registered = await heartbeats(c, leader.address)
        assert len(registered) == NODES
        start_rev = await c.store.revision()
        node_puts: list[str] = []

        async def watch_nodes() -> None:
            async for batch in c.store.watch_prefix(c.store.keys.nodes(AZ), start_rev + 1):
                node_puts.extend(ev.kv.key for ev in batch)

        watcher = asyncio.ensure_future(watch_nodes())
        started, size0 = time.time(), db_size(endpoint)
        deadline = time.monotonic() + 4 * SOAK_S
        seen: dict[str, float] = {}
        # Wait on the fact: every agent heard for SOAK_S after the start,
        # as the standby shows it; the alarm is checked on every look.
        while time.monotonic() < deadline:
            alarms = etcdctl(endpoint, "alarm", "list")
            assert "NOSPACE" not in alarms, (f"etcd raised its space alarm after {time.time() - started:.0f}s idle: "
                                             f"db {db_size(endpoint):,} B of {QUOTA:,} ({len(node_puts)} node puts)")
            seen = await heartbeats(c, standby.address)
            if len(seen) == NODES and min(seen.values()) >= started + SOAK_S:
                break
            await asyncio.sleep(0.5)
        else:
            pytest.fail(f"the standby's ListNodes never showed every node heard {SOAK_S}s after the start: "
                        f"{len(seen)} nodes, the oldest heartbeat {started - min(seen.values(), default=0.0):.1f}s "
                        "before the start")
        watcher.cancel()
        assert not node_puts, f"{len(node_puts)} node record writes while idle, e.g. {node_puts[:3]}"
        # The leader answers from its memory too, and nothing moved backwards.
        mine = await heartbeats(c, leader.address)
        assert all(mine[n] >= started + SOAK_S and mine[n] > registered[n] for n in registered)
        assert db_size(endpoint) < QUOTA // 2, f"db grew from {size0:,} B while idle"
    finally:
        await c.close()
