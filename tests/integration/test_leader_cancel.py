"""Driver-level tests of a cancel that races a gang's start (issue 26): a
real ``AzLeader`` against a real etcd, built as tests/integration/
test_leader_perform.py builds it (its fixtures). Agents are the leader's
own ``AgentConn`` sessions, whose queues the test reads: what the leader
sends them is what an agent would receive.

- A member that starts after its gang was cancelled (its agent was busy
  when the revocation came) reports RUNNING: the leader revokes it again,
  and once it reports stopped the devices are released.
- A cancel whose compare loses to another write of the gang is decided
  again on the record etcd has, not answered ABORTED.
- The reply of a write that comes back after a later write of the gang
  (the retried cancel) does not take the leader's book back.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.core import lifecycle
from coordinator.core.gang_effects import STRAY_MEMBER
from coordinator.core.records import GangRecord, MemberAssignment
from coordinator.leader import AzLeader
from coordinator.node_sessions import AgentConn
from phalanx import failpoints
from phalanx.agent_messages import MemberStatus, Revoke
from phalanx.model import GangState, MemberPhase
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.spec import GangSpec, Resources
from phalanx.store import Put, Store
from tests.integration.harness import dgx_node
from tests.integration.test_leader_perform import AZ, leader, store, wait_for  # noqa: F401 (fixtures)

pytestmark = pytest.mark.integration


async def starting_gang(leader: AzLeader, store: Store, name: str) -> GangRecord:
    """A gang as the leader leaves it once its assignments went out: STARTING,
    rank 0 on n0 and rank 1 on n1, its reservation COMMITTED (in etcd and
    in the leader's book, as ``_reserve`` leaves them)."""
    rec, _ = await leader.submit(GangSpec(name=name, members=2, resources=Resources(gpus=1)), "")
    placement = (MemberAssignment(0, AZ, "n0", (0,), ()), MemberAssignment(1, AZ, "n1", (0,), ()))
    r = Reservation(AZ, rec.id, rec.incarnation, HoldState.COMMITTED,
                    {"n0": NodeDevices((0,), ()), "n1": NodeDevices((0,), ())}, leader.epoch)
    leader.book.reservations[rec.id] = r
    leader.book.ledger.hold(r)
    return await leader.writer.write(rec.evolve(state=GangState.STARTING, placement=placement, updated_at=time.time()),
                                   rec, [Put(store.keys.reservation(AZ, rec.id), r.to_dict())])


def sessions(leader: AzLeader, *nodes: str) -> dict[str, AgentConn]:
    conns = {n: AgentConn(n, f"agent-{n}", dgx_node(n, AZ)) for n in nodes}
    leader.conns.update(conns)
    return conns


def sent(conn: AgentConn) -> list:
    out = []
    while not conn.queue.empty():
        out.append(conn.queue.get_nowait())
    return out


def status(g: GangRecord, rank: int, node: str, phase: MemberPhase) -> MemberStatus:
    return MemberStatus(gang=g.id, incarnation=g.incarnation, rank=rank, phase=phase, node=node)


async def test_a_member_started_after_the_cancel_is_revoked_again_then_released(leader: AzLeader,
                                                                                store: Store) -> None:
    conns = sessions(leader, "n0", "n1")
    g = await starting_gang(leader, store, "late-start")
    cancelled = await leader.cancel(g.id, "race", by="test")
    assert cancelled.state == GangState.CANCELLED
    # The cancel's one revocation per node: rank 1's agent was busy launching
    # others, found nothing to stop, and started rank 1 afterwards.
    for conn in conns.values():
        assert [(m.gang, m.incarnation) for m in sent(conn) if isinstance(m, Revoke)] == [(g.id, 1)]
    await leader.on_member(conns["n1"], status(g, 1, "n1", MemberPhase.RUNNING))
    again = sent(conns["n1"])
    assert [(type(m), m.gang, m.incarnation) for m in again] == [(Revoke, g.id, 1)]
    assert again[0].reason.startswith(STRAY_MEMBER)
    assert sent(conns["n0"]) == []
    # Devices stay held while rank 1 runs; released once both are known gone.
    rkey = store.keys.reservation(AZ, g.id)
    assert Reservation.from_dict((await store.get(rkey)).json()).state is HoldState.RELEASING
    await leader.on_member(conns["n0"], status(g, 0, "n0", MemberPhase.REJECTED))
    assert await store.get(rkey) is not None
    await leader.on_member(conns["n1"], status(g, 1, "n1", MemberPhase.STOPPED))
    await wait_for("the reservation released", lambda: _absent(store, rkey))
    assert g.id not in leader.book.reservations


async def _absent(store: Store, key: str) -> bool:
    return await store.get(key) is None


async def test_a_cancel_that_loses_its_compare_is_decided_again(leader: AzLeader, store: Store) -> None:
    sessions(leader, "n0", "n1")
    g = await starting_gang(leader, store, "lost-compare")
    # Another write of the record lands first (here the same content again,
    # so the leader's copy is one revision behind, as when its own write's
    # reply has not come back yet).
    await store.txn([], [Put(store.keys.gang(g.id), (await store.get(store.keys.gang(g.id))).json())])
    assert lifecycle.CANCEL_ATTEMPTS > 1
    cancelled = await leader.cancel(g.id, "race", by="test")
    assert cancelled.state == GangState.CANCELLED
    kv = await store.get(store.keys.gang(g.id))
    assert GangRecord.from_dict(kv.json(), kv.mod_revision).state == GangState.CANCELLED


async def test_a_late_reply_does_not_take_the_book_back(leader: AzLeader, store: Store) -> None:
    sessions(leader, "n0", "n1")
    g = await starting_gang(leader, store, "late-reply")
    gkey = store.keys.gang(g.id)
    failpoints.arm("leader.gang_write_replied", "delay(3)")
    try:
        # STARTING -> RUNNING commits; its reply is taken in only later.
        running = asyncio.create_task(leader.writer.write(g.evolve(state=GangState.RUNNING, reason="all started"), g))
        await wait_for("RUNNING in etcd",
                       lambda: _state_is(store, gkey, GangState.RUNNING))
    finally:
        failpoints.disarm_all()
    # The cancel loses its compare to it, is decided again on RUNNING, and lands.
    cancelled = await leader.cancel(g.id, "race", by="test")
    assert cancelled.state == GangState.CANCELLED
    late = await running
    assert late.state == GangState.RUNNING and late.mod_revision < cancelled.mod_revision
    assert leader.book.gangs[g.id].state == GangState.CANCELLED
    assert g.id in leader.book.finished


async def _state_is(store: Store, key: str, state: GangState) -> bool:
    kv = await store.get(key)
    return kv is not None and GangRecord.from_dict(kv.json(), kv.mod_revision).state == state
