"""A leader compacts an etcd whose operator forgot to (docs/etcd-keys.md
"Compaction", ``--etcd-compact-retention``), on a real etcd of its own
started WITHOUT etcd's periodic compaction (the session's etcd compacts
itself and must not be compacted by a test).

The driver with a clock of the test's: a coordinator that does not lead
never compacts, whatever its samples; one that leads compacts to exactly the
revision it read ``retention`` ago. Then end to end: a coordinator process
started with the flag compacts etcd's history (a read at an old revision is
refused as compacted) and counts it in its metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
import subprocess

import pytest

from coordinator.etcd_space import EtcdSpaceWatch
from coordinator.metrics import CoordinatorMetrics
from phalanx.metrics import scrape
from phalanx.store import Put, Store
from tests.conftest import etcdctl
from tests.integration.harness import LocalCluster, until
from tests.integration.test_metrics_coordinator import samples
from tests.pki import PrivateEtcd

pytestmark = pytest.mark.integration
AZ = "az-a"
CLUSTER = "nocompact"
RETENTION = 10.0


@pytest.fixture
def uncompacted_etcd(tmp_path) -> Iterator[PrivateEtcd]:
    """An etcd of the test's own, TLS and auth on, ``CLUSTER`` provisioned,
    that never compacts itself."""
    with PrivateEtcd(tmp_path, CLUSTER, "nocompact", compaction_retention="0") as etcd:
        yield etcd


def readable_at(endpoint: str, revision: int) -> bool:
    """Whether etcd still holds ``revision`` (a read at it is not refused as compacted)."""
    try:
        etcdctl(endpoint, "get", "--rev", str(revision), "/nothing")
    except subprocess.CalledProcessError as exc:
        assert "required revision has been compacted" in exc.stderr, exc.stderr
        return False
    return True


async def write(store: Store, n: int) -> int:
    """``n`` writes under the store's prefix; etcd's revision after them."""
    for i in range(n):
        res = await store.txn([], [Put(store.keys.root + f"junk/{i % 3}", b"x" * 100)])
    return res.revision


async def test_only_a_leader_compacts_and_to_the_revision_it_read_retention_ago(uncompacted_etcd) -> None:
    endpoint = uncompacted_etcd.endpoint
    now = [1000.0]
    leading = [False]
    async with Store(endpoint, CLUSTER, tls=uncompacted_etcd.pki.role(CLUSTER, "coordinator"), timeout=10.0) as store:
        watch = EtcdSpaceWatch(store, 1 << 30, 1.0, CoordinatorMetrics(), compact_retention_s=RETENTION,
                               leading=lambda: leading[0], clock=lambda: now[0])
        first = await write(store, 5)
        await watch.read()  # sampled: the revision as of `first`
        await write(store, 5)
        now[0] += RETENTION
        await watch.read()  # `first`'s sample is now RETENTION old, but this coordinator does not lead
        assert readable_at(endpoint, 2) and watch.compacted == 0

        leading[0] = True
        later = await write(store, 5)
        await watch.read()
        # Compacted to the newest sample RETENTION old: the one read right after `first`.
        assert watch.compacted >= first and watch.compacted < later
        assert not readable_at(endpoint, watch.compacted - 1) and readable_at(endpoint, watch.compacted)
        assert readable_at(endpoint, later)  # the history it still needs is there


async def test_a_coordinator_with_the_flag_compacts_an_etcd_left_uncompacted(uncompacted_etcd, tmp_path) -> None:
    endpoint = uncompacted_etcd.endpoint
    c = LocalCluster(endpoint, CLUSTER, tmp_path, etcd_pki=uncompacted_etcd.pki)
    await c.start()
    try:
        # Fast timings read etcd's space every 0.5 s: 10 readings of history are 5 s.
        c.start_coordinator(AZ, "a0", extra_args=["--metrics-listen", "127.0.0.1:0",
                                                  "--etcd-compact-retention", "5"])
        await c.wait_leader(AZ)
        start = await write(c.store, 3)
        assert readable_at(endpoint, start)

        async def compacted_past_start() -> bool:
            await write(c.store, 1)  # history keeps growing, as a busy cluster's does
            return not readable_at(endpoint, start)

        await until("the leader compacts etcd's history", compacted_past_start, timeout=60)
        text = await asyncio.to_thread(scrape, c.coordinators["a0"].metrics, tls=c.pki.client_files(),
                                       cluster=c.cluster)
        got = samples(text)
        assert got[("phalanx_etcd_compactions_total", (("result", "compacted"),))] >= 1
        assert got[("phalanx_etcd_compactions_total", (("result", "refused"),))] == 0
    finally:
        await c.close()


def test_etcd_refuses_a_read_below_its_compaction(uncompacted_etcd) -> None:
    """What the tests above read: the check itself, on an etcdctl compaction."""
    endpoint = uncompacted_etcd.endpoint

    async def put_some() -> int:
        async with Store(endpoint, "junk", tls=uncompacted_etcd.pki.root) as s:
            return await write(s, 4)

    rev = asyncio.run(put_some())
    assert readable_at(endpoint, rev - 2)
    etcdctl(endpoint, "compaction", str(rev - 1))
    assert not readable_at(endpoint, rev - 2) and readable_at(endpoint, rev - 1)
