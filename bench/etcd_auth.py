"""What TLS with client certificates and etcd auth cost the store.

    .venv/bin/python bench/etcd_auth.py [--ops N] [--concurrency C] [--rounds R]

Starts two private etcd servers on loopback (fsync on, as ``phalanx up``
runs them): one plaintext without auth, one with TLS, client-certificate
auth and the cluster's roles provisioned (docs/security.md "etcd: TLS and
roles"). Against each, through ``phalanx.store.Store`` as a coordinator
uses it, it times: linearizable gets of one key, guarded single-key txn
writes (the shape of a coordinator's writes, without any admission logic
around them), both one at a time and C at a time. Prints the machine line,
then one table: median latency (one at a time) and ops/s (C at a time),
each the median of R rounds that alternate the two servers (so load from
other processes on a shared machine falls on both alike).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from bench.machine import machine_line  # noqa: E402
from phalanx.store import Compare, Put, Store  # noqa: E402
from phalanx import etcd_auth, etcd_pki  # noqa: E402
from phalanx.etcd_server import EtcdServer  # noqa: E402

CLUSTER = "bench"


async def _time(op: Callable[[int], Awaitable[object]], ops: int, concurrency: int) -> tuple[float, float]:
    """(median seconds per op one at a time, ops/s with ``concurrency`` in flight)."""
    lat = []
    for i in range(ops):
        t = time.perf_counter()
        await op(i)
        lat.append(time.perf_counter() - t)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await op(ops + i)

    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(ops)))
    return statistics.median(lat), ops / (time.perf_counter() - t)


async def _measure(store: Store, ops: int, concurrency: int) -> dict[str, tuple[float, float]]:
    root = store.keys.root
    await store.txn([], [Put(f"{root}k", "v")])
    run = time.time_ns()  # fresh keys every round: each guarded write really writes

    async def get(i: int) -> object:
        return await store.get(f"{root}k")

    async def write(i: int) -> object:
        key = f"{root}gangs/{run}-{i}"
        return await store.txn([Compare(key, "version", "==", 0)], [Put(key, {"i": i})])

    return {"get": await _time(get, ops, concurrency), "txn write": await _time(write, ops, concurrency)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    print(machine_line())
    work = Path(tempfile.mkdtemp(prefix="phalanx-bench-etcd-"))
    servers: list[EtcdServer] = []
    try:
        plain = EtcdServer(data_dir=work / "plain", log_path=work / "plain.log").start()
        servers.append(plain)
        pki = work / "pki"
        etcd_pki.init(pki, now=datetime.datetime.now(datetime.timezone.utc))
        tls = EtcdServer(data_dir=work / "tls", log_path=work / "tls.log", tls_dir=pki).start()
        servers.append(tls)
        plain.wait_ready()
        tls.wait_ready()
        assert tls.root_tls is not None
        asyncio.run(etcd_auth.provision(tls.endpoint, tls.root_tls, CLUSTER))
        user = etcd_pki.issue_client(pki, etcd_pki.user_for(CLUSTER, "coordinator"),
                                     now=datetime.datetime.now(datetime.timezone.utc))

        async def run(endpoint: str, files) -> dict[str, tuple[float, float]]:
            async with Store(endpoint, CLUSTER, tls=files, timeout=10.0) as s:
                return await _measure(s, a.ops, a.concurrency)

        modes = {"plaintext, no auth": (plain.endpoint, None),
                 "TLS + client cert + roles": (tls.endpoint, etcd_pki.files(user))}
        rounds: dict[str, list[dict[str, tuple[float, float]]]] = {m: [] for m in modes}
        for _ in range(a.rounds):
            for name, (endpoint, files) in modes.items():
                rounds[name].append(asyncio.run(run(endpoint, files)))
        rows = {name: {op: (statistics.median(r[op][0] for r in rs), statistics.median(r[op][1] for r in rs))
                       for op in rs[0]} for name, rs in rounds.items()}
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{a.ops} ops each, median of {a.rounds} rounds; throughput with {a.concurrency} in flight")
    print("| etcd | get p50 | get ops/s | txn write p50 | txn write ops/s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        (g50, gops), (w50, wops) = r["get"], r["txn write"]
        print(f"| {name} | {g50 * 1e3:.2f} ms | {gops:,.0f} | {w50 * 1e3:.2f} ms | {wops:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
