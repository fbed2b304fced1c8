"""The etcd that `phalanx up`, the chaos suite and the tests start compacts
its history periodically (phalanx.etcd_server.EtcdServer.compaction_retention,
docs/etcd-keys.md "Compaction"), and a live watcher never notices: it gets
every event, in order, across the compactions; only a watch that starts
behind the compacted revision is told (Compacted), and every watcher of
Phalanx then reads the state again."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid

import pytest

from phalanx.store import Compacted, Put, Store
from tests.conftest import etcdctl
from tests.pki import PrivateEtcd

pytestmark = pytest.mark.integration


def compacted_past(endpoint: str, revision: int, key: str) -> bool:
    """Whether etcd has compacted away ``revision`` (a read at it is refused)."""
    try:
        etcdctl(endpoint, "get", "--rev", str(revision), key)
    except subprocess.CalledProcessError as exc:
        if "compacted" in exc.stderr:
            return True
        raise
    return False


async def test_periodic_compaction_leaves_a_live_watcher_whole(tmp_path) -> None:
    cluster = "t" + uuid.uuid4().hex[:10]
    with PrivateEtcd(tmp_path, cluster, compaction_retention="1s") as etcd:
        async with Store(etcd.endpoint, cluster, tls=etcd.pki.role(cluster, "coordinator")) as store:
            k = store.keys
            first = await store.revision() + 1
            seen: list[str] = []

            async def follow() -> None:
                async for batch in store.watch_prefix(k.gangs(), first):
                    seen.extend(ev.kv.key for ev in batch)

            watcher = asyncio.ensure_future(follow())
            written: list[str] = []
            deadline = time.monotonic() + 60
            # Write until etcd has compacted past the first write on its own.
            while not (written and compacted_past(etcd.endpoint, first, k.gang("g0"))):
                assert time.monotonic() < deadline, f"etcd never compacted past revision {first}"
                written.append(k.gang(f"g{len(written)}"))
                await store.txn([], [Put(written[-1], {"n": len(written)})])
                await asyncio.sleep(0.2)
            # And the live watcher has every write, in order.
            while seen != written:
                assert time.monotonic() < deadline and not watcher.done(), (watcher, seen, written)
                await asyncio.sleep(0.05)
            watcher.cancel()
            with pytest.raises(Compacted):
                async for _ in store.watch_prefix(k.gangs(), first):
                    pass
