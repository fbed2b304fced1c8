"""Agent-side enforcement against a hostile peer.

The "leader" here is a scripted AgentService on loopback that behaves like a
deposed leader that kept running: it stamps messages with an epoch that etcd no
longer backs, or an epoch older than one the agent has seen. Leadership itself
is real (the test campaigns in a real etcd); the agent is the real code.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from agent.session import Agent
from agent.simulated import SimulatedLauncher
from phalanx import failpoints
from phalanx.timings import Timings
from phalanx.reservation import HoldState, NodeDevices, Reservation
from coordinator.election import Election, LeaseSession
from phalanx.store import Delete, Put, Store
from phalanx.tls import ServerCredentialsSource
from phalanx.v1 import agent_pb2 as apb
from phalanx.v1 import agent_pb2_grpc as agrpc
from tests.integration.harness import dgx_node

pytestmark = pytest.mark.integration
AZ = "az-a"
T = Timings.fast()


class ScriptedLeader(agrpc.AgentServiceServicer):
    def __init__(self) -> None:
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.inbox: list[apb.AgentMessage] = []
        self.registered = asyncio.Event()

    async def Session(self, request_iterator: Any, context: Any):
        async def read() -> None:
            async for m in request_iterator:
                self.inbox.append(m)
                if m.WhichOneof("kind") == "register":
                    self.registered.set()

        reader = asyncio.create_task(read())
        try:
            while True:
                msg = await self.outbox.get()
                yield msg
        finally:
            reader.cancel()

    def send(self, epoch: int, **kind: Any) -> None:
        m = apb.CoordinatorMessage(epoch=epoch, az=AZ)
        for k, v in kind.items():
            getattr(m, k).CopyFrom(v)
        self.outbox.put_nowait(m)

    def statuses(self) -> list[apb.MemberStatus]:
        return [m.member for m in self.inbox if m.WhichOneof("kind") == "member"]


@dataclass
class Rig:
    store: Store
    peer: ScriptedLeader
    lead: Any
    agent: Agent
    history: list[tuple[str, dict]]


@pytest.fixture
async def rig(etcd_endpoint, cluster_name, cluster_pki, etcd_coordinator_tls, etcd_agent_tls):
    """A real agent whose AZ 'leader' (a real etcd leadership) is the scripted
    peer. As in a real cluster, the peer serves TLS with a coordinator
    certificate and writes etcd as the coordinator user; the agent presents
    its node's certificate and reads etcd as the (read-only) agent user."""
    store = await Store(etcd_endpoint, cluster_name, tls=etcd_coordinator_tls).connect()
    agent_store = await Store(etcd_endpoint, cluster_name, tls=etcd_agent_tls).connect()
    peer = ScriptedLeader()
    server = grpc.aio.server()
    agrpc.add_AgentServiceServicer_to_server(peer, server)
    creds = ServerCredentialsSource(cluster_pki.coordinator("scripted"), cluster=cluster_name).credentials()
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    history: list[tuple[str, dict]] = []
    session = await LeaseSession(store, T).start()
    lead = await Election(store, AZ, "scripted", f"127.0.0.1:{port}", T).campaign(session)
    agent = Agent(cluster=cluster_name, az=AZ, topology=dgx_node("n0", AZ), store=agent_store,
                  launcher_factory=SimulatedLauncher, timings=T, history=lambda e, d: history.append((e, d)),
                  tls=cluster_pki.agent("n0"))
    run = asyncio.create_task(agent.run())
    try:
        yield Rig(store, peer, lead, agent, history)
    finally:
        await agent.stop()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        await server.stop(0)
        await session.close()
        await agent_store.close()
        await store.close()


async def commit(store: Store, gang: str, inc: int, gpus: list[int], epoch: int) -> None:
    r = Reservation(AZ, gang, inc, HoldState.COMMITTED, {"n0": NodeDevices(tuple(gpus))}, epoch)
    await store.txn([], [Put(store.keys.reservation(AZ, gang), r.to_dict())])


def assignment(gang: str, gpus: list[int], inc: int = 1) -> apb.Assignment:
    return apb.Assignment(gang=gang, incarnation=inc, rank=0, world_size=1, gpus=gpus, duration_s=30)


async def wait_for(pred, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met")


async def test_agent_enforces_epoch_token_and_ledger(rig: Rig) -> None:
    store, peer, lead, agent, history = rig.store, rig.peer, rig.lead, rig.agent, rig.history
    await asyncio.wait_for(peer.registered.wait(), 10)
    peer.send(lead.epoch, welcome=apb.Welcome(coordinator_id="scripted"))

    # 1. The current leader's word, backed by a COMMITTED reservation: starts.
    await commit(store, "ok", 1, [0, 1], lead.epoch)
    peer.send(lead.epoch, assign=assignment("ok", [0, 1]))
    await wait_for(lambda: any(s.gang == "ok" and s.phase == apb.MEMBER_PHASE_RUNNING for s in peer.statuses()))

    # 2. The ledger: an overlapping assignment is refused, whatever the sender says.
    await commit(store, "overlap", 1, [1, 2], lead.epoch)
    peer.send(lead.epoch, assign=assignment("overlap", [1, 2]))
    await wait_for(lambda: any(s.gang == "overlap" and s.phase == apb.MEMBER_PHASE_REJECTED for s in peer.statuses()))
    rejected = [s for s in peer.statuses() if s.gang == "overlap"][-1]
    assert "GPUs [1]" in rejected.reason

    # 3. No COMMITTED reservation for that incarnation: nothing starts.
    peer.send(lead.epoch, assign=assignment("ghost", [5]))
    await wait_for(lambda: any(e == "assign_refused_token" and "ghost" in d["key"] for e, d in history))

    # 3b. A reservation that is not COMMITTED for this incarnation: a
    #     two-phase hold still PREPARED, or a COMMITTED one of the incarnation
    #     before. Nothing starts (fails if the token check's "holds" is gone).
    prepared = Reservation(AZ, "held", 1, HoldState.PREPARED, {"n0": NodeDevices((3,))}, lead.epoch)
    await store.txn([], [Put(store.keys.reservation(AZ, "held"), prepared.to_dict())])
    peer.send(lead.epoch, assign=assignment("held", [3]))
    await commit(store, "older", 1, [4], lead.epoch)
    peer.send(lead.epoch, assign=assignment("older", [4], inc=2))
    # 3c. A COMMITTED reservation that does not give every GPU assigned on
    #     this node: nothing starts (fails if the token check's cover is gone).
    await commit(store, "narrow", 1, [7], lead.epoch)
    peer.send(lead.epoch, assign=assignment("narrow", [5, 7]))
    for gang, why in (("held#1", "not COMMITTED for"), ("older#2", "not COMMITTED for"),
                      ("narrow#1", "does not give GPUs [5, 7] on n0")):
        await wait_for(lambda: any(e == "assign_refused_token" and gang in d["key"] for e, d in history))
        refused = [d for e, d in history if e == "assign_refused_token" and gang in d["key"]][0]
        assert why in refused["reason"], refused

    # 4. The leader is deposed in etcd (a successor wins) but this stale
    #    "leader" has not noticed: its still-highest epoch starts nothing.
    await store.txn([], [Delete(store.keys.leader(AZ))])
    successor = await Election(store, AZ, "successor", "127.0.0.1:1", T).campaign(await LeaseSession(store, T).start())
    await commit(store, "late", 1, [6], lead.epoch)
    peer.send(lead.epoch, assign=assignment("late", [6]))
    await wait_for(lambda: any(e == "assign_refused_token" and "late" in d["key"] for e, d in history))
    refused = [d for e, d in history if e == "assign_refused_token" and "late" in d["key"]][0]
    assert "no longer the leader" in refused["reason"]
    # ...nor can it stop a member.
    peer.send(lead.epoch, revoke=apb.Revocation(gang="ok", incarnation=1, reason="stale"))
    await wait_for(lambda: any(e == "revoke_refused_token" for e, _ in history))
    assert any(h.key.gang == "ok" for h in agent.launcher.running())

    # 5. Once the agent has seen the successor's epoch, older epochs are ignored.
    peer.send(successor.epoch, heartbeat_ack=apb.HeartbeatAck(seq=1))
    peer.send(lead.epoch, revoke=apb.Revocation(gang="ok", incarnation=1, reason="stale"))
    await wait_for(lambda: any(e == "stale_message_ignored" for e, _ in history))
    assert agent.guard.highest == successor.epoch
    starts = [d for e, d in history if e == "member_started"]
    assert [d["key"] for d in starts] == ["ok#1/r0"]
    assert agent.ledger.check() == []


async def test_agent_fences_when_no_valid_leader_is_heard(rig: Rig) -> None:
    store, peer, lead, agent, history = rig.store, rig.peer, rig.lead, rig.agent, rig.history
    await asyncio.wait_for(peer.registered.wait(), 10)
    peer.send(lead.epoch, welcome=apb.Welcome(coordinator_id="scripted"))
    await commit(store, "job", 1, [0], lead.epoch)
    peer.send(lead.epoch, assign=assignment("job", [0]))
    await wait_for(lambda: any(e == "member_started" for e, _ in history))
    started = [d for e, d in history if e == "member_started"][0]["mono"]
    # The leader goes silent (no acks): the agent fences after fence_after_s.
    await wait_for(lambda: any(e == "fenced" for e, _ in history), timeout=T.fence_after_s * 4)
    fenced = [d for e, d in history if e == "fenced"][0]
    assert fenced["silent_s"] > T.fence_after_s
    print(f"\nfenced {fenced['mono'] - started:.2f}s after start (fence_after_s={T.fence_after_s})")
    await wait_for(lambda: not agent.launcher.running())
    exits = [d for e, d in history if e == "member_exited"]
    assert exits and exits[0]["phase"] == "STOPPED"


async def test_revoke_while_an_assignment_waits_refuses_it(rig: Rig) -> None:
    """A cancel that races the start (issue 26): the revocation comes while
    the assignment waits for its token check (here held back by a
    failpoint; in a cluster, the agent busy launching other members). The
    revocation finds nothing to stop, and its leader sends no other: the
    assignment is refused and reported, never started, although its
    reservation still reads COMMITTED to the late token check."""
    store, peer, lead, agent, history = rig.store, rig.peer, rig.lead, rig.agent, rig.history
    await asyncio.wait_for(peer.registered.wait(), 10)
    peer.send(lead.epoch, welcome=apb.Welcome(coordinator_id="scripted"))
    await commit(store, "raced", 1, [3], lead.epoch)
    failpoints.arm("agent.before_token_check", "delay(2)")
    try:
        peer.send(lead.epoch, assign=assignment("raced", [3]))
        peer.send(lead.epoch, revoke=apb.Revocation(gang="raced", incarnation=1, reason="cancelled"))
        await wait_for(lambda: any(s.gang == "raced" and s.phase != apb.MEMBER_PHASE_RUNNING for s in peer.statuses()))
    finally:
        failpoints.disarm_all()
    said = [s for s in peer.statuses() if s.gang == "raced"]
    assert [s.phase for s in said] == [apb.MEMBER_PHASE_REJECTED] and "revoked before it started" in said[0].reason, said
    assert not any(e == "member_started" for e, _ in history)
    assert agent.launcher.running() == [] and agent.arrivals.pending == {}
