"""A cross-AZ owner whose cluster-root watch was compacted reads other AZs'
inventory again (``Watcher._reread_other_azs`` in coordinator/twophase/watch.py
-> ``RemoteInventory.reset``, docs/design.md §19.10) and places with it: real etcd, real coordinator
processes, simulated agents.

How the watch gets compacted, with no failpoint: the owner's coordinator is
SIGSTOPped, so it reads nothing; enough large writes under the cluster root
fill etcd's send window and buffer for its watch, and etcd sets that watcher
aside (a "victim": it gets no further events). Then another AZ changes (a node
registers, a hold goes) and etcd is compacted past those changes. On SIGCONT
etcd answers the watch with its compact revision: those events are lost to
the owner, and only the reread can show them."""

from __future__ import annotations

import dataclasses
import signal

import pytest

from phalanx.store import Delete, Put
from phalanx.timings import Timings
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.conftest import etcdctl
from tests.integration.harness import LocalCluster, dgx_node, tiny, until
from tests.pki import PrivateEtcd

pytestmark = pytest.mark.integration

COMPACTED = "two-phase watch compacted"
# Filler: more than any flow-control window plus etcd's per-stream buffer of
# 128 responses (one event per revision each), so the stopped owner's
# watcher is set aside for certain.
FILLER_WRITES = 400
FILLER_BYTES = 100_000


def long_lease_timings() -> Timings:
    """Timings.fast() with a lease that outlives the owner's pause: the test
    is about its watch, not about a failover."""
    return dataclasses.replace(Timings.fast(), lease_ttl_s=20, fence_after_s=25.0,
                               owner_adopt_after_s=25.0).validate()


async def test_owner_rereads_other_azs_after_a_compacted_watch_and_places_with_what_changed_in_the_gap(
        cluster_name, tmp_path) -> None:
    # An etcd of its own: compacting the session's etcd would take the
    # history later tests watch from revision 1 (test_stimulus_trace.py).
    etcd = PrivateEtcd(tmp_path, cluster_name).__enter__()
    etcd_endpoint = etcd.endpoint
    c = LocalCluster(etcd_endpoint, cluster_name, tmp_path, long_lease_timings())
    try:
        await c.start()
    except BaseException:
        etcd.__exit__()
        raise
    try:
        owner = c.start_coordinator("az-a", "a0")
        b = c.start_coordinator("az-b", "b0")
        await c.wait_leader("az-a")
        await c.wait_leader("az-b")
        c.start_agents("az-a", [dgx_node("an0", "az-a")])
        c.start_agents("az-b", [dgx_node("bn0", "az-b")])
        await c.wait_nodes_ready("az-a", 1)
        await c.wait_nodes_ready("az-b", 1)
        # bn0 is taken by a single-AZ gang of az-b; the owner's view has it.
        blocker = await c.submit(tiny("blocker", members=1, gpus=8, duration=300.0), address=b.address)
        await c.wait_state(blocker.id, {pb.GANG_STATE_RUNNING}, timeout=30)
        assert COMPACTED not in owner.log()

        owner.signal(signal.SIGSTOP)
        k = c.store.keys
        filler = f"{k.root}test-filler/"
        for i in range(FILLER_WRITES):
            await c.store.txn([], [Put(f"{filler}{i % 8}", "x" * FILLER_BYTES)])
        # The gap: az-b gains a node (bn1) and frees bn0.
        c.start_agents("az-b", [dgx_node("bn1", "az-b")])
        await c.wait_nodes_ready("az-b", 2)
        await c.stub(b.address).CancelGang(gpb.CancelGangRequest(id=blocker.id, reason="free bn0"), timeout=10)

        async def bn0_free() -> bool:
            return await c.store.get(k.reservation("az-b", blocker.id)) is None
        await until("bn0 released", bn0_free)
        await c.store.txn([], [Delete(filler, prefix=True)])
        etcdctl(etcd_endpoint, "compact", str(await c.store.revision()))
        owner.signal(signal.SIGCONT)

        async def reread() -> bool:
            return COMPACTED in owner.log()
        await until("the owner's watch compacted", reread)

        # Submitted after the reread: 3 whole nodes, which exist only with
        # what the gap changed (bn1 registered, bn0 free again). A view that
        # missed those events would see one free node in az-b and wait.
        span = await c.submit(tiny("span", members=3, gpus=8, duration=300.0,
                                   topology=pb.TopologyConstraint(allow_cross_az=True)), address=owner.address)
        running = await c.wait_state(span.id, {pb.GANG_STATE_RUNNING}, timeout=30)
        assert running.owner_az == "az-a"
        assert sorted((m.az, m.node) for m in running.placement) == [("az-a", "an0"), ("az-b", "bn0"), ("az-b", "bn1")]
        # Placed right the first time: no attempt was aborted on a stale view.
        decisions, _ = await c.store.get_prefix(k.decisions(span.id))
        assert [kv.json()["outcome"] for kv in decisions] == ["COMMIT"], decisions
        assert await c.check_etcd_invariants() == []
    finally:
        try:
            await c.close()
        finally:
            etcd.__exit__()
