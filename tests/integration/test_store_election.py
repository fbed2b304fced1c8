"""The etcd gateway and the election, against a real etcd."""

from __future__ import annotations

import asyncio

import pytest

from phalanx.timings import Timings
from coordinator.election import Election, LeaseLost, LeaseSession, observe
from phalanx.store import Compacted, Delete, Fence, Get, Put, Store, absent
from phalanx.errors import NotLeader, StoreUnavailable

pytestmark = pytest.mark.integration
T = Timings.fast()


@pytest.fixture
async def store(etcd_endpoint, cluster_name, etcd_coordinator_tls):
    """The store as a coordinator opens it: TLS, the cluster's coordinator user."""
    async with Store(etcd_endpoint, cluster_name, timeout=2.0, tls=etcd_coordinator_tls) as s:
        yield s


class FakeClock:
    """A monotonic clock the test moves by hand (pure time, not a mock of ours)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_campaign_gives_monotonic_epochs_and_fenced_writes(store: Store) -> None:
    s1 = await LeaseSession(store, T).start()
    s2 = await LeaseSession(store, T).start()
    e1 = Election(store, "az-a", "c1", "addr1", T)
    e2 = Election(store, "az-a", "c2", "addr2", T)
    lead1 = await e1.campaign(s1)
    assert (await observe(store, "az-a")).coordinator_id == "c1"
    # c2 waits while c1 leads.
    waiting = asyncio.create_task(e2.campaign(s2))
    await asyncio.sleep(0.3)  # a negative check: c2 does not win while c1 leads
    assert not waiting.done()
    # c1's fenced write works while it leads.
    f1 = Fence("az-a", lead1.epoch)
    assert (await store.fenced_txn(f1, [], [Put(store.keys.gang("g"), {"v": 1})])).succeeded
    # c1 is deposed (its lease revoked, as if it expired while paused).
    await s1.close(revoke=True)
    lead2 = await asyncio.wait_for(waiting, 10)
    assert lead2.coordinator_id == "c2" and lead2.epoch > lead1.epoch
    # The deposed leader's write is refused: NotLeader, and nothing changes.
    with pytest.raises(NotLeader):
        await store.fenced_txn(f1, [], [Put(store.keys.gang("g"), {"v": 2})])
    assert (await store.get(store.keys.gang("g"))).json() == {"v": 1}
    # A lost ordinary compare is not NotLeader: it returns succeeded=False.
    f2 = Fence("az-a", lead2.epoch)
    res = await store.fenced_txn(f2, [absent(store.keys.gang("g"))], [Put(store.keys.gang("g"), {"v": 3})])
    assert not res.succeeded
    await e2.resign(lead2)
    assert await observe(store, "az-a") is None
    await s2.close()
    await store.txn([], [Delete(store.keys.root, prefix=True)])


async def test_session_steps_down_locally_when_keepalives_stop_being_acknowledged(store: Store) -> None:
    clock = FakeClock()
    s = await LeaseSession(store, T, clock=clock).start()
    assert s.is_valid()
    # The process "sleeps" past TTL - margin without a successful keepalive:
    # it must find itself invalid before acting, whatever etcd says.
    clock.now += T.lease_ttl_s
    assert not s.is_valid()
    with pytest.raises(LeaseLost):
        s.check()
    assert s.lost.is_set()
    await s.close()


async def test_create_if_absent_first_writer_wins(store: Store) -> None:
    key = store.keys.decision("g", 1)
    results = await asyncio.gather(*(store.create_if_absent(key, v) for v in ["COMMIT", "ABORT", "ABORT"]))
    winners = [r for r in results if r[0]]
    assert len(winners) == 1
    assert {r[1].value for r in results} == {winners[0][1].value}
    await store.txn([], [Delete(store.keys.root, prefix=True)])


async def test_watch_resumes_and_reports_compaction(store: Store) -> None:
    k = store.keys
    rev0 = await store.revision()
    for i in range(3):
        await store.txn([], [Put(k.gang(f"w{i}"), {"i": i})])
    seen = []
    async for batch in store.watch_prefix(k.gangs(), rev0 + 1):
        seen.extend(e.kv.key for e in batch)
        if len(seen) >= 3:
            break
    assert seen == [k.gang(f"w{i}") for i in range(3)]
    # Compact past the start revision: the watch says so, so callers re-list.
    from aetcd.rpc import rpc_pb2 as epb

    last = await store.revision()
    await store._kv.Compact(epb.CompactionRequest(revision=last, physical=True))
    with pytest.raises(Compacted):
        async for _ in store.watch_prefix(k.gangs(), rev0 + 1):
            pass
    await store.txn([], [Delete(k.root, prefix=True)])


async def test_unreachable_etcd_fails_fast_and_typed(etcd_coordinator_tls) -> None:
    async with Store("127.0.0.1:1", "nowhere", timeout=0.5, tls=etcd_coordinator_tls) as s:
        with pytest.raises(StoreUnavailable, match="etcd unavailable"):
            await s.get(s.keys.gang("x"))
        with pytest.raises(StoreUnavailable):
            await s.txn([], [Get(s.keys.gang("x"))])
