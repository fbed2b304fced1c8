"""Unreadable decision, member-summary, name and idempotency records planted
in etcd (docs/design.md §19.3): each is refused by its one parser and handled
as its own kind needs, and the coordinator keeps leading.

Real etcd, a real coordinator process, real gRPC.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from phalanx.store import Put
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import LocalCluster, tiny

pytestmark = pytest.mark.integration
AZ = "az-a"


async def plant(c: LocalCluster, key: str, value: bytes) -> None:
    """Write straight to etcd, as `etcdctl put` would: no validation."""
    assert (await c.store.txn([], [Put(key, value)])).succeeded


async def log_says(proc, text: str, timeout: float = 30.0) -> str:
    """The coordinator's log once it contains ``text`` (a wait, not a timing
    assertion: the caller fails on what the log says, not on how fast)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = proc.log()
        if text in log:
            return log
        await asyncio.sleep(0.1)
    return proc.log()


async def test_unreadable_small_records_are_refused_by_their_parser_and_the_leader_carries_on(local_cluster: LocalCluster) -> None:
    c = local_cluster
    k = c.store.keys
    # Before the takeover: read by the driver's recovery.
    await plant(c, k.decision("ghost-00000001", 1), b"{not json")
    await plant(c, k.member_summary("ghost-00000001", AZ), b'{"incarnation": 1, "az": 5}')
    # Read by submission.
    await plant(c, k.idempotency("k-bad"), b'{"id": 7}')
    await plant(c, k.name("taken"), b"[1, 2]")

    coord = c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    log = await log_says(coord, "skipped unreadable member summary")
    assert "skipped unreadable decision" in log and "ghost-00000001/1" in log, log[-3000:]
    assert "skipped unreadable member summary" in log, log[-3000:]

    # After the takeover: read by the driver's watch.
    await plant(c, k.decision("ghost-00000002", 3), b'{"outcome": "MAYBE"}')
    log = await log_says(coord, "ghost-00000002/3")
    assert "two-phase watch: skipped unreadable decision" in log and "ghost-00000002/3" in log, log[-3000:]

    stub = c.stub()
    # A retried idempotency key whose record cannot be read: the cluster's
    # fault, named, and not a new gang under a key that is taken.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SubmitGang(gpb.SubmitGangRequest(spec=tiny("idem", members=1), idempotency_key="k-bad"), timeout=10)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS, (err.value.code(), err.value.details())
    assert "idempotency_key" in err.value.details() and "cannot be read" in err.value.details()
    assert [g.spec.name for g in (await stub.ListGangs(gpb.ListGangsRequest(), timeout=10)).gangs] == []

    # A name whose record cannot be read is still taken.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.submit(tiny("taken", members=1))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS, (err.value.code(), err.value.details())
    assert "name record cannot be read" in err.value.details()
    # Looking the name up finds no kept gang of that name (not INTERNAL).
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetGang(gpb.GetGangRequest(id="taken"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND, (err.value.code(), err.value.details())

    # Still leading: a normal submission is taken, and its name resolves.
    g = await c.submit(tiny("fine", members=1), key="k-fine")
    assert g.state == pb.GANG_STATE_PENDING
    assert (await stub.GetGang(gpb.GetGangRequest(id="fine"), timeout=10)).id == g.id
    again = await c.submit(tiny("fine", members=1), key="k-fine")
    assert again.id == g.id  # the readable idempotency record finds it
    assert coord.proc.poll() is None
