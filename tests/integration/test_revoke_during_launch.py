"""A revoke that meets a member whose launch is still in flight (found by
the cross-AZ cancel model, tests/unit/test_cross_az_cancel_model.py).

The revocation finds no process to signal and the leader sends no other
for that incarnation, so the agent must stop the member itself once the
launch returns, never reporting it RUNNING. Before the fix it reported
RUNNING and the member ran until the leader noticed a stray member of a
cancelled gang and revoked it again.

Real coordinator, real etcd, in-process agents with simulated members; the
slow launch is the ``agent.during_launch`` failpoint (docs/failpoints.md),
armed in this process, where the agents run. Waits are on observed facts:
the failpoint's own log line (the launch is in flight), the gang's
CANCELLED record, the agent's history."""

from __future__ import annotations

import logging

import pytest

from phalanx import failpoints
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import LocalCluster, dgx_node, tiny, until

pytestmark = pytest.mark.integration
AZ = "az-a"
# Long enough that the cancel's revoke reaches the agent while the launch
# waits (a cancel, the leader's write and one message: well under a second).
LAUNCH_S = 8.0


async def test_a_member_revoked_while_it_launches_is_stopped_when_the_launch_returns(
        local_cluster: LocalCluster, caplog: pytest.LogCaptureFixture) -> None:
    c = local_cluster
    c.start_coordinator(AZ, "c0")
    await c.wait_leader(AZ)
    group = c.start_agents(AZ, [dgx_node("n1", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    caplog.set_level(logging.INFO)
    failpoints.arm("agent.during_launch", f"delay({LAUNCH_S})")
    try:
        gang = await c.submit(tiny("slow-launch", members=1, gpus=1, duration=600))

        async def launching() -> bool:
            return any("failpoint agent.during_launch" in r.getMessage() for r in caplog.records)

        await until("the member's launch is in flight", launching)
        await c.stub().CancelGang(gpb.CancelGangRequest(id=gang.id, reason="cancelled while launching"), timeout=15)
        await c.wait_state(gang.id, {pb.GANG_STATE_CANCELLED})

        def events(name: str) -> list[dict]:
            return [d for ev, d in group.history if ev == name and gang.id in d.get("key", "")]

        async def exited() -> bool:
            return bool(events("member_exited"))

        await until("the member exits", exited, timeout=LAUNCH_S + 30)
    finally:
        failpoints.disarm_all()
    # It was stopped by the agent as its launch returned (the revoke had come
    # while it launched), not by a later, second revocation of a stray member.
    assert events("member_stopped_after_launch"), group.history[-10:]
    assert not any(f"launched {gang.id}" in r.getMessage() for r in caplog.records), \
        "the member was reported launched (RUNNING) after its revocation"
    assert not await c.check_etcd_invariants()
