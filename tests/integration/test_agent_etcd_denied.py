"""An agent whose etcd credentials do not grant its cluster's keys.

A node given the wrong ``--etcd-tls-dir`` (another cluster's user) cannot read
``leader/<az>``: it must say so, loudly and once, and never register or run
anything, rather than retry silently forever."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from agent.sim import run_agents
from phalanx import etcd_auth
from tests.integration.harness import dgx_node, until

pytestmark = pytest.mark.integration
AZ = "az-a"


async def test_agent_with_another_clusters_etcd_user_says_denied_and_registers_nothing(
        local_cluster, etcd_pki, etcd_root_tls, caplog):
    other = "t" + uuid.uuid4().hex[:10]
    await etcd_auth.provision(local_cluster.etcd, etcd_root_tls, other, agent_user=True)
    try:
        local_cluster.start_coordinator(AZ, "c0")
        await local_cluster.wait_leader(AZ)
        tls = local_cluster.agents_tls(["n1"])
        # The legacy path explicitly (agents on etcd, not through the
        # coordinators), with a valid etcd user of the wrong cluster.
        tls.update(etcd_tls=etcd_pki.role(other, "agent"), coordinators=())
        stop = asyncio.Event()
        local_cluster.expect_log(r"etcd denied this agent's read", who="agent")  # what this test provokes
        caplog.set_level(logging.ERROR, logger="agent.session")
        task = asyncio.create_task(run_agents(
            cluster=local_cluster.cluster, az=AZ, etcd=local_cluster.etcd, topologies=[dgx_node("n1", AZ)],
            timings=local_cluster.timings, ready_line=False, stop_event=stop, **tls))
        try:
            def denials() -> list:
                return [r for r in caplog.records if "etcd denied this agent's read" in r.getMessage()]

            async def denied_or_ended() -> bool:
                return bool(denials()) or task.done()

            await until("the agent says etcd denied its read", denied_or_ended)
            assert not task.done(), task.exception() if task.done() else ""
            denied = denials()
            assert "--etcd-tls-dir" in denied[0].getMessage()
            # A negative check: three heartbeats of retries say nothing more.
            await asyncio.sleep(local_cluster.timings.heartbeat_interval_s * 3)
            again = [r for r in caplog.records if "etcd denied this agent's read" in r.getMessage()]
            assert len(again) == 1, "the same denial is logged once, not every retry"
            nodes = await local_cluster.store.get_prefix(local_cluster.store.keys.nodes(AZ))
            assert nodes[0] == [], "a denied agent registered anyway"
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
    finally:
        await etcd_auth.unprovision(local_cluster.etcd, etcd_root_tls, other)
