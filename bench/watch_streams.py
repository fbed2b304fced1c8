"""Abandoned WatchEvents streams against a real cluster (issue 22 item 2).

    .venv/bin/python bench/watch_streams.py [--streams 2000] [--submits 40] [--nodes-per-az 4]

Starts ``phalanx up --insecure --no-workload --azs 1`` (its own etcd, 2
coordinators, simulated agents), measures SubmitGang latency (send to
reply; --submits gangs one after the other), then opens ``--streams``
WatchEvents streams from one identity to one coordinator and never reads
them, measures again while they are held, and prints a table: coordinator
RSS (every coordinator process of the cluster), etcd RSS and database size,
etcd's watcher count, streams open and refused. Insecure: every caller is the
one plaintext identity, so the per-identity cap (default 64) applies.
Asserts nothing (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import phalanx  # noqa: E402,F401 - first: it turns gRPC fork support off before grpc loads

import grpc  # noqa: E402

from bench.machine import machine_line  # noqa: E402
from phalanx.up import UpProcess  # noqa: E402
from phalanx.v1 import gang_pb2 as gpb  # noqa: E402
from phalanx.v1 import gang_pb2_grpc as ggrpc  # noqa: E402
from phalanx.v1 import types_pb2 as pb  # noqa: E402


def etcd_metric(endpoint: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as resp:
        m = re.search(rf"^{name} (\S+)$", resp.read().decode(), re.M)
    return float(m.group(1)) if m else 0.0


def rss_mb(program: str, word: str) -> float:
    """The summed RSS of the processes running ``program`` (its argv[0]'s
    name, or argv[1..2] "-m program") with ``word`` in their command line."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            runs = Path(argv[0]).name == program or argv[1:3] == ["-m", program]
            if runs and any(word in a for a in argv):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


async def submit_p50(address: str, n: int, tag: str) -> float:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = ggrpc.GangServiceStub(ch)
        took = []
        for i in range(n):
            spec = pb.GangSpec(name=f"{tag}-{i}", members=1, resources=pb.Resources(gpus=1),
                               run=pb.RunSpec(duration_s=0.2))
            t0 = time.monotonic()
            await stub.SubmitGang(gpb.SubmitGangRequest(spec=spec), timeout=30)
            took.append(time.monotonic() - t0)
    return statistics.median(took) * 1000


async def run(address: str, endpoint: str, cluster: str, streams: int, submits: int) -> list[tuple[str, str, str]]:
    def sample() -> dict[str, float]:
        return {"coord": rss_mb("coordinator", cluster), "etcd": rss_mb("etcd", endpoint),
                "db": etcd_metric(endpoint, "etcd_mvcc_db_total_size_in_bytes") / 2**20,
                "watchers": etcd_metric(endpoint, "etcd_debugging_mvcc_watcher_total")}

    before = sample()
    p50_before = await submit_p50(address, submits, "before")
    ch = grpc.aio.insecure_channel(address)
    calls = [ggrpc.GangServiceStub(ch).WatchEvents(gpb.WatchEventsRequest()) for _ in range(streams)]
    opened = refused = 0
    reasons: Counter[str] = Counter()
    for call in calls:
        await call.initial_metadata()
        if call.done():
            refused += 1
            reasons[f"{(await call.code()).name}: {re.sub(r'[0-9]+', 'N', await call.details())}"] += 1
        else:
            opened += 1
    p50_while = await submit_p50(address, submits, "while")
    held = sample()
    for call in calls:
        call.cancel()
    await ch.close()
    rows = [("streams opened / refused", "0 / 0", f"{opened} / {refused}")]
    for key, label, fmt in (("coord", "coordinator RSS, MB (all)", "{:.0f}"), ("etcd", "etcd RSS, MB", "{:.0f}"),
                            ("db", "etcd db size, MB", "{:.1f}"), ("watchers", "etcd watchers", "{:.0f}")):
        rows.append((label, fmt.format(before[key]), fmt.format(held[key])))
    rows.append(("SubmitGang p50, ms", f"{p50_before:.1f}", f"{p50_while:.1f}"))
    for r, n in sorted(reasons.items()):
        print(f"refused {n}: {r}")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--submits", type=int, default=40)
    p.add_argument("--nodes-per-az", type=int, default=4)
    p.add_argument("--start-timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    print(machine_line())
    up = UpProcess(["--insecure", "--no-workload", "--azs", "1", "--nodes-per-az", str(a.nodes_per_az),
                    "--base-port", "0", "--start-timeout", str(a.start_timeout)])
    up.start(timeout=a.start_timeout + 60)
    try:
        endpoint = up.find_line(r"etcd at (\S+) ").group(1)
        cluster = up.find_line(r"^PHALANX_CLUSTER=(\S+)$").group(1)
        rows = asyncio.run(run(up.addresses[0], endpoint, cluster, a.streams, a.submits))
    finally:
        up.stop()
    print(f"{a.streams} WatchEvents streams from one identity to one coordinator, never read")
    print("| | before | while held |")
    print("|---|---|---|")
    for label, x, y in rows:
        print(f"| {label} | {x} | {y} |")


if __name__ == "__main__":
    main()
