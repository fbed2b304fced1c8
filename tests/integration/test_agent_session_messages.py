"""A member report an agent sends after its registration has the bounds of
one sent in it (phalanx/agent_messages.py, docs/limits.md): a report that
breaks one ends the session with INVALID_ARGUMENT naming the field, and the
leader takes nothing of it. Real etcd, a real coordinator process, real gRPC,
the typed messages on the agent's end."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from agent.topology.simulated import simulated_node
from phalanx.agent_messages import FromAgent, FromLeader, Heartbeat, Register, Welcome
from phalanx.v1 import agent_pb2 as apb
from phalanx.v1 import agent_pb2_grpc as agrpc
from tests.integration.harness import LocalCluster

pytestmark = pytest.mark.integration
AZ = "az-a"

BAD_LATER = [
    ("member phase 99", apb.AgentMessage(member=apb.MemberStatus(gang="g-00000001", incarnation=1, rank=0, phase=99)),
     "member.phase: unknown member phase 99"),
    ("heartbeat member with a path for a gang",
     apb.AgentMessage(heartbeat=apb.Heartbeat(seq=1, members=[apb.MemberStatus(gang="../x", incarnation=1, rank=0,
                                                                                 phase=2)])),
     "heartbeat.members[0].gang"),
    ("member reason of 100 KB",
     apb.AgentMessage(member=apb.MemberStatus(gang="g-00000001", incarnation=1, rank=0, phase=2, reason="x" * 100_000)),
     "member.reason"),
]


@pytest.mark.parametrize("what,bad,words", BAD_LATER, ids=[b[0] for b in BAD_LATER])
async def test_a_bad_report_after_registration_ends_the_session_naming_the_field(
        local_cluster: LocalCluster, what: str, bad: apb.AgentMessage, words: str) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    node = "later"
    async with c.channel(coord.address, role="agent", name=node) as ch:
        call = agrpc.AgentServiceStub(ch).Session()
        await call.write(FromAgent(Register(agent_id="agent-1", topology=simulated_node(node, AZ))).to_pb())
        first = FromLeader.from_pb(await asyncio.wait_for(call.read(), 30))
        assert isinstance(first.body, Welcome), first
        # A good heartbeat is taken (acked) before the bad message is sent.
        await call.write(FromAgent(Heartbeat(seq=1)).to_pb())
        await call.write(bad)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await asyncio.wait_for(call.read(), 30) is not grpc.aio.EOF:
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err.value.code(), err.value.details())
    assert words in err.value.details(), (what, err.value.details())
    assert coord.proc.poll() is None
