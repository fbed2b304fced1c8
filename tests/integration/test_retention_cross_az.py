"""Retention of a finished cross-AZ gang (docs/etcd-keys.md "Retention"):
its owner deletes the gang record, its idempotency key and every
decisions/<gang>/<inc> key; participants forget it, refuse late peer calls
about it from etcd alone, and keep admitting cross-AZ gangs."""

from __future__ import annotations

import grpc
import pytest

from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import peer_pb2, peer_pb2_grpc
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node, tiny
from tests.integration.test_retention import RETENTION, cluster  # noqa: F401 - the fixture, shared

pytestmark = pytest.mark.integration
AZS = ("az-a", "az-b")
def cross(name: str) -> pb.GangSpec:
    # 2 x 8 GPUs over two AZs of one 8-GPU node each: one member per AZ.
    return tiny(name, members=2, gpus=8, duration=0.3, topology=pb.TopologyConstraint(allow_cross_az=True))


async def test_finished_cross_az_gang_is_collected_with_its_decisions(cluster: LocalCluster) -> None:
    c = cluster
    k = c.store.keys
    for az in AZS:
        c.start_coordinator(az, f"{az[-1]}0")
    for az in AZS:
        await c.wait_leader(az)
        c.start_agents(az, [dgx_node(f"{az[-1]}n0", az)])
    for az in AZS:
        await c.wait_nodes_ready(az, 1)

    owner = c.coordinators["a0"]
    gang = await c.submit(cross("span"), key="k-span", address=owner.address)
    done = await c.wait_state(gang.id, TERMINAL, timeout=60)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    assert sorted(m.az for m in done.placement) == list(AZS)
    decisions, _ = await c.store.get_prefix(k.decisions(gang.id))
    assert decisions and decisions[-1].json()["outcome"] == "COMMIT"

    assert await c.wait_deleted(k.gang(gang.id), timeout=RETENTION + 30), "finished cross-AZ gang not collected"
    for prefix in (k.decisions(gang.id), k.member_summaries(gang.id)):
        assert (await c.store.get_prefix(prefix))[0] == [], prefix
    assert await c.store.get(k.idempotency("k-span")) is None
    assert await c.etcd_reservations() == {}

    # Late peer calls about the collected gang, from its owner's current
    # leader, are refused by the participant from etcd alone (the record and
    # the decision keys are gone), whatever it still remembers.
    la, lb = await c.leader("az-a"), await c.leader("az-b")
    caller = peer_pb2.PeerIdentity(az="az-a", epoch=la.epoch, coordinator_id=la.coordinator_id)
    slice_b = [peer_pb2.NodeDevices(node=m.node, gpus=list(m.gpus)) for m in done.placement if m.az == "az-b"]
    async with c.channel(lb.address, role="coordinator", name=la.coordinator_id) as ch:
        peer = peer_pb2_grpc.CoordinatorPeerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.Prepare(peer_pb2.PrepareRequest(caller=caller, gang=gang.id, incarnation=done.incarnation,
                                                       nodes=slice_b), timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "unknown gang" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.Commit(peer_pb2.DecisionRequest(caller=caller, gang=gang.id, incarnation=done.incarnation),
                              timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no decision" in err.value.details()
    assert await c.etcd_reservations() == {}

    # Both leaders carry on: the next cross-AZ gang (same key, so a new gang)
    # is admitted in both AZs and runs to success.
    resp = await c.stub(owner.address).SubmitGang(gpb.SubmitGangRequest(spec=cross("span"), idempotency_key="k-span"),
                                                  timeout=10)
    assert resp.created and resp.gang.id != gang.id
    again = await c.wait_state(resp.gang.id, TERMINAL, timeout=60)
    assert again.state == pb.GANG_STATE_SUCCEEDED, again.reason
    assert sorted(m.az for m in again.placement) == list(AZS)
    assert await c.check_etcd_invariants() == []
    for p in c.coordinators.values():
        assert "Traceback" not in p.log() and " ERROR " not in p.log(), p.log()[-3000:]
