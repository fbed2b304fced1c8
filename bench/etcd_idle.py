"""What a cluster writes to etcd: bytes per hour, by key class.

    .venv/bin/python bench/etcd_idle.py [--nodes-per-az 32] [--azs 3] [--seconds 60] [--settle 10] [--busy]

Starts ``phalanx up --insecure --no-workload`` (its own etcd, 2 coordinators
per AZ, simulated agents; ``--busy``: with up's own workload instead, which
keeps ``--gangs-per-az`` gangs of short members running per AZ), waits for its PHALANX_ADDRESS line and
``--settle`` more seconds (registrations done), then for ``--seconds``
watches every key under the cluster's prefix and reads etcd's own counters
(/metrics: revision, bytes put, WAL bytes, database size) at both ends of
the window. Prints one row per key class (``nodes``, ``leader``, ...):
puts, bytes put and bytes per hour, then the totals from etcd's counters
(which also count writes outside the prefix: none, in an idle cluster).
Asserts nothing (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import phalanx  # noqa: E402,F401 - first: it turns gRPC fork support off before grpc loads

from bench.machine import machine_line  # noqa: E402
from phalanx.store import Store  # noqa: E402
from phalanx.up import UpProcess  # noqa: E402

COUNTERS = {
    "revision": "etcd_debugging_mvcc_current_revision",
    "put_bytes": "etcd_debugging_mvcc_total_put_size_in_bytes",
    "wal_bytes": "etcd_disk_wal_write_bytes_total",
    "db_bytes": "etcd_mvcc_db_total_size_in_bytes",
}


def etcd_counters(endpoint: str) -> dict[str, float]:
    """The COUNTERS of a plaintext etcd's /metrics."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = {}
    for name, metric in COUNTERS.items():
        m = re.search(rf"^{metric} (\S+)$", text, re.M)
        values[name] = float(m.group(1)) if m else 0.0
    return values


def key_class(key: str, root: str) -> str:
    """``/phalanx/<cluster>/nodes/az-a/n1`` -> ``nodes``."""
    return key[len(root):].split("/", 1)[0] if key.startswith(root) else "(other)"


async def watch_window(endpoint: str, cluster: str, seconds: float,
                       ) -> tuple[Counter, Counter, dict, dict, float, set[str]]:
    """Puts and bytes per key class over ``seconds``, etcd's counters at
    both ends, and the gang records created in the window."""
    puts: Counter = Counter()
    size: Counter = Counter()
    created: set[str] = set()
    async with Store(endpoint, cluster) as store:
        root = store.keys.root
        before = etcd_counters(endpoint)
        start_rev = await store.revision() + 1
        started = time.monotonic()

        async def follow() -> None:
            async for batch in store.watch_prefix(root, start_rev):
                for ev in batch:
                    c = key_class(ev.kv.key, root)
                    puts[c] += ev.kind == "put"
                    size[c] += len(ev.kv.key) + len(ev.kv.value)
                    if c == "gangs" and ev.kind == "put" and ev.kv.version == 1:
                        created.add(ev.kv.key)

        task = asyncio.ensure_future(follow())
        await asyncio.sleep(seconds)  # the measurement window itself, not a wait for a fact
        after = etcd_counters(endpoint)
        elapsed = time.monotonic() - started
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    return puts, size, before, after, elapsed, created


def per_hour(value: float, seconds: float) -> str:
    return f"{value * 3600 / seconds:,.0f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--azs", type=int, default=3)
    p.add_argument("--nodes-per-az", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60.0, help="measurement window")
    p.add_argument("--settle", type=float, default=10.0, help="seconds after the cluster is up before measuring")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--busy", action="store_true", help="with up's workload (default: idle, --no-workload)")
    p.add_argument("--gangs-per-az", type=int, default=3, help="--busy: live gangs up keeps per AZ")
    a = p.parse_args(argv)
    print(machine_line())
    load = ["--gangs-per-az", str(a.gangs_per_az)] if a.busy else ["--no-workload"]
    up = UpProcess(["--insecure", *load, "--azs", str(a.azs), "--nodes-per-az", str(a.nodes_per_az),
                    "--base-port", "0", "--start-timeout", str(a.start_timeout)])
    up.start(timeout=a.start_timeout + 60)
    try:
        endpoint = up.find_line(r"etcd at (\S+) ").group(1)
        cluster = up.find_line(r"^PHALANX_CLUSTER=(\S+)$").group(1)
        time.sleep(a.settle)  # registrations' writes are not idle traffic
        puts, size, before, after, elapsed, created = asyncio.run(watch_window(endpoint, cluster, a.seconds))
    finally:
        up.stop()
    nodes = a.azs * a.nodes_per_az
    how = f"busy (up's workload, {a.gangs_per_az} live gangs per AZ)" if a.busy else "idle"
    print(f"{nodes} simulated nodes ({a.azs} AZs x {a.nodes_per_az}), {how}, window {elapsed:.1f} s")
    print("| key class | puts | bytes (key+value) | bytes per hour |")
    print("|---|---|---|---|")
    for c in sorted(size):
        print(f"| {c} | {puts[c]} | {size[c]:,} | {per_hour(size[c], elapsed)} |")
    if not size:
        print("| (none) | 0 | 0 | 0 |")
    delta = {k: after[k] - before[k] for k in COUNTERS}
    print(f"etcd: revisions +{delta['revision']:.0f}, bytes put {per_hour(delta['put_bytes'], elapsed)}/h, "
          f"WAL bytes {per_hour(delta['wal_bytes'], elapsed)}/h, db size {before['db_bytes']:,.0f} -> "
          f"{after['db_bytes']:,.0f} B")
    if created:
        # Every byte the cluster put in the window, over the gangs it created
        # in it: a busy cluster's cost per admitted gang (its node, leader and
        # retention writes included).
        print(f"gang records created in the window: {len(created)}; bytes put per gang: "
              f"{sum(size.values()) / len(created):,.0f} (watched), {delta['put_bytes'] / len(created):,.0f} (etcd's count)")


if __name__ == "__main__":
    main()
