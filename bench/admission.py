"""Admission benchmark: gangs/s and submit-to-RESERVED latency, with TLS and without.

    .venv/bin/python bench/admission.py [--azs 3] [--nodes-per-az 32] [--rates 20,50,100,150,200] [--seconds 5]
                                        [--tls on|off|both] [--metrics on|off|both] [--repeat 1]

Starts a private etcd, one coordinator process per AZ and simulated agents
(one process per AZ), then offers 8x1-GPU gangs open-loop at each rate, spread
over the AZs, with churn (members run --duration seconds and free their
GPUs). Latency is submit-sent -> the gang's record is first seen RESERVED (or
later) in an etcd watch. In the same run it measures the raw rate of the
very fenced etcd transaction a reservation uses (the physical limit here).

``--tls both`` (the default) does all of it twice, each on its own fresh etcd
and processes: once in plaintext (``--insecure``) and once as deployed, TLS
on every gRPC hop and etcd serving TLS with client-certificate auth and the
cluster's least-privilege users (a fresh gRPC CA and etcd CA per run); then
prints both modes' rows and the TLS/plaintext ratios. ``--repeat N`` runs the
modes N times, alternating, and reports medians (the machines here are noisy).
``--metrics on`` starts every coordinator and agent process with
``--metrics-listen`` and scrapes each coordinator's /metrics once a second
while the load runs (far more often than a Prometheus would); ``--metrics
both`` runs every mode with metrics off and on and prints the on/off ratios.
Prints tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import phalanx  # noqa: E402,F401 - first: it turns gRPC fork support off before grpc loads
import grpc  # noqa: E402

from phalanx.timings import Timings  # noqa: E402
from coordinator.core.records import GangRecord  # noqa: E402
from coordinator.election import Election, LeaseSession  # noqa: E402
from phalanx.store import Fence, Put, Store, absent, Compare  # noqa: E402
from phalanx import etcd_auth, etcd_pki  # noqa: E402
from phalanx.client import client_tls  # noqa: E402
from phalanx.etcd_server import EtcdServer  # noqa: E402
from phalanx.tls import TlsFiles, coordinator_channel, utc_now  # noqa: E402
from phalanx.metrics import ScrapeError, scrape  # noqa: E402
from agent.topology.simulated import simulated_fabric  # noqa: E402
from chaos.pki import RunPki  # noqa: E402
from phalanx.procs import TERM, spawn  # noqa: E402
from bench.machine import machine_line  # noqa: E402
from phalanx.v1 import gang_pb2 as gpb, gang_pb2_grpc as ggrpc, types_pb2 as pb  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def raw_txn_rate(endpoint: str, seconds: float, concurrency: int, tls: TlsFiles | None = None) -> float:
    """The reservation txn shape: fence compare + gang revision compare +
    reservation absent; puts reservation + gang record."""
    store = await Store(endpoint, RAW_CLUSTER, tls=tls).connect()
    t = Timings()
    session = await LeaseSession(store, t).start()
    lead = await Election(store, "az-x", "bench", "none", t).campaign(session)
    fence = Fence("az-x", lead.epoch)
    k = store.keys
    gang_doc = {"id": "g", "spec": {"name": "g", "members": 8}, "state": "RESERVED", "placement": [{"rank": i, "node": f"n{i}", "gpus": [0]} for i in range(8)]}
    res_doc = {"az": "az-x", "gang": "g", "nodes": {f"n{i}": {"gpus": [0]} for i in range(8)}, "status": "COMMITTED"}
    count = 0
    stop = time.monotonic() + seconds

    async def worker(w: int) -> None:
        nonlocal count
        i = 0
        while time.monotonic() < stop:
            gid = f"w{w}-{i}"
            i += 1
            await store.fenced_txn(fence, [absent(k.reservation("az-x", gid))],
                                   [Put(k.reservation("az-x", gid), res_doc), Put(k.gang(gid), gang_doc)])
            count += 1

    t0 = time.monotonic()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    rate = count / (time.monotonic() - t0)
    await session.close()
    await store.close()
    return rate


async def offered_load(channel_for, addresses: dict[str, str], store: Store, rate: float, seconds: float, duration: float,
                       tag: str) -> dict:
    channels = {az: channel_for(a) for az, a in addresses.items()}
    stubs = {az: ggrpc.GangServiceStub(ch) for az, ch in channels.items()}
    azs = sorted(stubs)
    sent: dict[str, float] = {}
    reserved: dict[str, float] = {}
    errors = 0
    codes: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}  # status -> the first failure's details
    rev = await store.revision()

    async def watch() -> None:
        async for batch in store.watch_prefix(store.keys.gangs(), rev + 1):
            now = time.monotonic()
            for ev in batch:
                if ev.kind != "put":
                    continue
                d = ev.kv.json()
                if d["state"] not in ("PENDING",) and d["id"] not in reserved:
                    reserved[d["id"]] = now

    watcher = asyncio.create_task(watch())

    async def submit(i: int) -> None:
        nonlocal errors
        spec = pb.GangSpec(name=f"{tag}-{i}", members=8, resources=pb.Resources(gpus=1), run=pb.RunSpec(duration_s=duration))
        t0 = time.monotonic()
        try:
            r = await stubs[azs[i % len(azs)]].SubmitGang(gpb.SubmitGangRequest(spec=spec, idempotency_key=f"{tag}-{i}"), timeout=10)
            sent[r.gang.id] = t0
        except grpc.aio.AioRpcError as exc:
            errors += 1
            codes[exc.code().name] += 1
            examples.setdefault(exc.code().name, (exc.details() or "")[:160])

    tasks = []
    n = int(rate * seconds)
    start = time.monotonic()
    for i in range(n):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(submit(i)))
    await asyncio.gather(*tasks)
    offered_s = time.monotonic() - start
    # Let the queue drain (bounded).
    drain_deadline = time.monotonic() + max(20.0, seconds * 4)
    while time.monotonic() < drain_deadline and len([g for g in sent if g in reserved]) < len(sent):
        await asyncio.sleep(0.1)
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    lat = [(reserved[g] - t) * 1000 for g, t in sent.items() if g in reserved]
    done_times = sorted(reserved[g] for g in sent if g in reserved)
    span = (done_times[-1] - start) if done_times else float("nan")
    for ch in channels.values():
        await ch.close()
    return {
        "offered": rate, "submitted": len(sent), "errors": errors, "admitted": len(lat),
        "throughput": len(lat) / span if lat else 0.0, "p50": pct(lat, 50), "p99": pct(lat, 99),
        "offered_s": offered_s, "codes": codes, "examples": examples,
    }


async def cross_az_admissions(endpoint: str, etcd_dir: Path, workdir: Path, gangs: int) -> dict:
    """Sequential 3-AZ gangs (3 x 8 GPUs, one 8-GPU node per AZ, so every
    gang must span all three AZs) on a quiet cluster: submit -> RESERVED
    latency, and the etcd requests the leaders made for each admission
    (counted per gang by the two-phase driver and logged; summed here over
    the owner and the three participants). The integration harness runs it,
    with TLS and etcd auth (its only mode): ``etcd_dir`` is the etcd CA, and
    CROSS_CLUSTER's etcd users are provisioned."""
    import re

    from tests.integration.harness import LocalCluster, dgx_node
    from tests.pki import EtcdPki

    azs = ["az-a", "az-b", "az-c"]
    c = await LocalCluster(endpoint, CROSS_CLUSTER, workdir, etcd_pki=EtcdPki(etcd_dir)).start()
    lat: list[float] = []
    ev_lat: list[float] = []  # submitted -> reserved from the gang's own events (no polling in it)
    queued: list[float] = []  # submitted -> placed: the wait for an admission cycle to place it
    ids: list[str] = []
    try:
        for az in azs:
            c.start_coordinator(az, f"x{az[-1]}")
        for az in azs:
            await c.wait_leader(az)
            c.start_agents(az, [dgx_node(f"{az[-1]}x0", az)])
        for az in azs:
            await c.wait_nodes_ready(az, 1)
        for i in range(gangs):
            spec = pb.GangSpec(name=f"x{i}", members=3, resources=pb.Resources(gpus=8), run=pb.RunSpec(duration_s=0.05),
                               topology=pb.TopologyConstraint(allow_cross_az=True))
            t0 = time.monotonic()
            g = await c.submit(spec)
            ids.append(g.id)
            await c.wait_state(g.id, {pb.GANG_STATE_RESERVED, pb.GANG_STATE_STARTING, pb.GANG_STATE_RUNNING, pb.GANG_STATE_SUCCEEDED}, timeout=60)
            lat.append((time.monotonic() - t0) * 1000)
            await c.wait_state(g.id, {pb.GANG_STATE_SUCCEEDED, pb.GANG_STATE_FAILED}, timeout=60)
            gangs = await c.etcd_gangs()
            ev_lat.extend(event_latency_ms(gangs, g.id))
            queued.extend(event_latency_ms(gangs, g.id, to="placed"))
    finally:
        await c.close()
    per_gang: dict[str, int] = {}
    pat = re.compile(r"etcd-requests gang=(\S+) inc=(\d+) az=(\S+) role=(\S+) n=(\d+)")
    for az in azs:
        for line in (workdir / f"x{az[-1]}.log").read_text().splitlines():
            m = pat.search(line)
            if m:
                per_gang[m.group(1)] = per_gang.get(m.group(1), 0) + int(m.group(5))
    reqs = [per_gang[g] for g in ids if g in per_gang]
    return {"gangs": len(lat), "p50": pct(lat, 50), "p99": pct(lat, 99),
            "ev_p50": pct(ev_lat, 50) if ev_lat else float("nan"), "ev_p99": pct(ev_lat, 99) if ev_lat else float("nan"),
            "placed_p50": pct(queued, 50) if queued else float("nan"),
            "requests": statistics.mean(reqs) if reqs else float("nan")}


def event_latency_ms(gangs: dict, gang_id: str, to: str = "reserved") -> list[float]:
    """Submitted -> ``to`` (an event kind) of one gang from its record's
    events, both stamped by the owner leader's clock: what admission took,
    without the 100 ms polling of ``wait_state`` (which the first column
    includes)."""
    g = gangs.get(gang_id)
    if g is None:
        return []
    at = {e.kind: e.at for e in reversed(g.events)}  # the first of each kind
    if "submitted" not in at or to not in at:
        return []
    return [(at[to] - at["submitted"]) * 1000]


async def wait_ready(channel_for, address: str, azs: list[str], nodes: int, timeout: float = 60) -> None:
    async with channel_for(address) as ch:
        stub = ggrpc.GangServiceStub(ch)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                st = await stub.ClusterStatus(gpb.ClusterStatusRequest(), timeout=5)
                ready = {a.az: a.nodes_ready for a in st.azs if a.has_leader}
                if all(ready.get(az, 0) >= nodes for az in azs):
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError("cluster not ready")


WITH_METRICS = "+metrics"  # a mode's name with /metrics on
# Far more often than a Prometheus scrapes (15 s and more): an upper bound.
SCRAPE_INTERVAL_S = 1.0
MODES = {"off": ("plaintext",), "on": ("tls",), "both": ("plaintext", "tls")}
METRICS = {"off": ("",), "on": (WITH_METRICS,), "both": ("", WITH_METRICS)}
CLUSTER = "bench"
RAW_CLUSTER = "rawbench"
CROSS_CLUSTER = "benchx"


@dataclass
class Mode:
    """How every process of one mode's cluster talks: plaintext, or TLS on
    every gRPC hop and etcd with client certificates and the cluster's
    least-privilege etcd users (docs/security.md)."""

    name: str
    pki: RunPki | None = None
    client: tuple[TlsFiles, str] | None = None  # the bench's own admin certificate and its cluster

    def channel(self, address: str) -> grpc.aio.Channel:
        if self.client is None:
            return grpc.aio.insecure_channel(address)
        files, cluster = self.client
        return coordinator_channel(address, files, cluster=cluster)

    def etcd_tls(self, cluster: str, role: str = "coordinator") -> TlsFiles | None:
        if self.pki is None:
            return None
        return etcd_pki.files(self.pki.etcd_dir / etcd_pki.user_for(cluster, role))

    def coordinator_args(self, cid: str) -> list[str]:
        if self.pki is None:
            return ["--insecure"]
        return ["--tls-dir", str(self.pki.coordinator(cid)),
                "--etcd-tls-dir", str(self.pki.etcd_user_dir("coordinator"))]

    def agent_args(self, nodes: list[str]) -> list[str]:
        """No etcd credentials: agents read through their AZ's coordinators."""
        if self.pki is None:
            return ["--insecure"]
        return ["--tls-dir", str(self.pki.agents(nodes))]


async def scrape_every(addresses: list[str], client: tuple[TlsFiles, str] | None, interval: float,
                       counts: collections.Counter) -> None:
    """Scrape every address's /metrics each ``interval`` until cancelled
    (the cost of being scraped is part of what --metrics on measures);
    ``counts``: "ok" and "failed" scrapes."""
    files, cluster = client if client is not None else (None, CLUSTER)
    while True:
        for address in addresses:
            try:
                await asyncio.to_thread(scrape, address, tls=files, cluster=cluster)
                counts["ok"] += 1
            except ScrapeError as exc:
                counts["failed"] += 1
                print(f"scrape failed: {exc}", file=sys.stderr)
        await asyncio.sleep(interval)


async def run_mode(a: argparse.Namespace, name: str, tmp: Path, cross_az: bool) -> dict:
    """One mode's etcd, coordinators and agents, its raw-txn and offered-load
    rows; everything it started is stopped before it returns. ``name``: a
    MODES entry, with WITH_METRICS appended for a run with /metrics on."""
    d = tmp / name
    d.mkdir(parents=True)
    base = name.removesuffix(WITH_METRICS)
    metrics_args = ["--metrics-listen", "127.0.0.1:0"] if name.endswith(WITH_METRICS) else []
    metrics_at: list[str] = []
    mode = Mode(base)
    if base == "tls":
        mode.pki = RunPki.create(d / "pki", CLUSTER, now=utc_now())
        mode.client = client_tls(mode.pki.client("bench"))
        etcd_pki.issue_client(mode.pki.etcd_dir, etcd_pki.user_for(RAW_CLUSTER, "coordinator"), now=utc_now())
    etcd = EtcdServer(data_dir=d / "etcd", log_path=d / "etcd.log",
                      tls_dir=mode.pki.etcd_dir if mode.pki else None).start().wait_ready()
    procs: list[subprocess.Popen] = []
    try:
        if mode.pki is not None:
            for cluster in (CLUSTER, RAW_CLUSTER, CROSS_CLUSTER):
                await etcd_auth.provision([etcd.endpoint], mode.pki.etcd_root, cluster)
        raw_tls = mode.etcd_tls(RAW_CLUSTER)
        raw1 = await raw_txn_rate(etcd.endpoint, a.raw_seconds, 1, raw_tls)
        raw32 = await raw_txn_rate(etcd.endpoint, a.raw_seconds, 32, raw_tls)
        cross = None
        if cross_az:
            assert mode.pki is not None
            cross = await cross_az_admissions(etcd.endpoint, mode.pki.etcd_dir, d, a.cross_az_gangs)
        azs = [f"az-{chr(ord('a') + i)}" for i in range(a.azs)]
        addresses = {}
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for az in azs:
            cid = f"{az}-1"
            # spawn(): every process of the bench dies with it, even when the
            # bench itself is killed before its finally can run.
            p = spawn([sys.executable, "-m", "coordinator", "--cluster", CLUSTER, "--az", az, "--id", cid,
                       "--etcd", etcd.endpoint, "--log-level", "WARNING", *mode.coordinator_args(cid), *metrics_args],
                      stdout=subprocess.PIPE, stderr=open(d / f"{az}.log", "w"), text=True, cwd=REPO, env=env)
            procs.append(p)
            line = p.stdout.readline()
            if "address=" not in line:
                p.wait(10)
                raise RuntimeError(f"coordinator {cid} ({name}) did not start: {(d / f'{az}.log').read_text()[-2000:]}")
            addresses[az] = line.split("address=")[1].split()[0]
            if "metrics=" in line:
                metrics_at.append(line.split("metrics=")[1].split()[0])
        for az in azs:
            nodes = [t.node for t in simulated_fabric(az, a.nodes_per_az, SPINES, LEAVES_PER_SPINE)]
            procs.append(spawn([sys.executable, "-m", "agent.sim", "--cluster", CLUSTER, "--az", az,
                                "--coordinators", addresses[az],
                                "--nodes", str(a.nodes_per_az), "--spines", str(SPINES),
                                "--leaves-per-spine", str(LEAVES_PER_SPINE), *mode.agent_args(nodes), *metrics_args],
                               die_with_parent=TERM,
                               stdout=subprocess.DEVNULL, stderr=open(d / f"agents-{az}.log", "w"), cwd=REPO, env=env))
        await wait_ready(mode.channel, addresses[azs[0]], azs, a.nodes_per_az)
        store = await Store(etcd.endpoint, CLUSTER, tls=mode.etcd_tls(CLUSTER)).connect()
        rows = []
        scrapes: collections.Counter = collections.Counter()
        scraper = (asyncio.create_task(scrape_every(metrics_at, mode.client, SCRAPE_INTERVAL_S, scrapes))
                   if metrics_at else None)
        try:
            for i, rate in enumerate(float(r) for r in a.rates.split(",")):
                rows.append(await offered_load(mode.channel, addresses, store, rate, a.seconds, a.duration, f"r{i}"))
                await asyncio.sleep(a.duration + 1.0)  # let running gangs finish between steps
        finally:
            if scraper is not None:
                scraper.cancel()
                await asyncio.gather(scraper, return_exceptions=True)
        await store.close()
        return {"raw": {1: raw1, 32: raw32}, "rows": rows, "cross": cross, "scrapes": scrapes}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        etcd.stop()


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Per offered rate, the median of each number over the repeats."""
    out = []
    for same_rate in zip(*runs):
        row = {k: statistics.median(r[k] for r in same_rate) for k in same_rate[0]
               if k not in ("offered", "codes", "examples")}
        row["offered"] = same_rate[0]["offered"]
        if any("codes" in r for r in same_rate):  # failed submissions by status, summed over the repeats
            row["codes"] = sum((r.get("codes", collections.Counter()) for r in same_rate), collections.Counter())
            row["examples"] = {c: d for r in same_rate for c, d in r.get("examples", {}).items()}
        out.append(row)
    return out


def ratio(tls: float, plain: float) -> str:
    return f"{tls / plain:.2f}" if plain and plain == plain and tls == tls else "-"


def print_tables(a: argparse.Namespace, modes: tuple[str, ...], results: dict[str, list[dict]]) -> None:
    print(f"\n{machine_line()}")
    print(f"Phalanx admission benchmark — {a.azs} AZs x {a.nodes_per_az} simulated 8-GPU nodes, 8x1-GPU gangs, "
          f"members run {a.duration}s (churn), {a.seconds}s per step, etcd fsync on")
    print(f"modes: {', '.join(MODE_WORDS[m] for m in modes)}; {a.repeat} run(s) each, alternating; medians")
    raw = {m: {w: statistics.median(r["raw"][w] for r in results[m]) for w in (1, 32)} for m in modes}
    rows = {m: median_rows([r["rows"] for r in results[m]]) for m in modes}
    print("\nraw fenced reservation txn (same shape as a reservation), same etcd:")
    head = "".join(f" {m + ' txn/s':>14}" for m in modes)
    both = "tls" in modes and "plaintext" in modes
    print(f"  {'writers':>8}{head}" + (f" {'tls/plaintext':>14}" if both else ""))
    for w in (1, 32):
        cells = "".join(f" {raw[m][w]:>14.0f}" for m in modes)
        print(f"  {w:>8}{cells}" + (f" {ratio(raw['tls'][w], raw['plaintext'][w]):>14}" if both else ""))
    print(f"\n  {'mode':<9} {'offered/s':>9} {'submitted':>9} {'admitted':>8} {'errors':>6} {'gangs/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for m in modes:
        for r in rows[m]:
            print(f"  {m:<9} {r['offered']:>9.0f} {r['submitted']:>9.0f} {r['admitted']:>8.0f} {r['errors']:>6.0f} "
                  f"{r['throughput']:>8.1f} {r['p50']:>8.1f} {r['p99']:>8.1f}")
    failed = [(m, r) for m in modes for r in rows[m] if r.get("codes")]
    if failed:
        print("  failed submissions by status (all runs): " + "; ".join(
            f"{m} {r['offered']:.0f}/s: " + ", ".join(f"{c} {n}" for c, n in r["codes"].most_common()) for m, r in failed))
        for m, r in failed:
            for c, d in sorted(r.get("examples", {}).items()):
                print(f"    e.g. {m} {r['offered']:.0f}/s {c}: {d}")
    for m in modes:
        if m.endswith(WITH_METRICS) and m.removesuffix(WITH_METRICS) in modes:
            off = m.removesuffix(WITH_METRICS)
            done = sum((r["scrapes"] for r in results[m]), collections.Counter())
            print(f"\n{off}: metrics on / off (ratio of the medians; 1.00 = no cost; on: every process serves "
                  f"/metrics, each coordinator scraped every {SCRAPE_INTERVAL_S:g}s: {done['ok']} scrapes, "
                  f"{done['failed']} failed):")
            print(f"  {'offered/s':>9} {'gangs/s':>8} {'p50':>8} {'p99':>8}")
            for t, p in zip(rows[m], rows[off]):
                print(f"  {t['offered']:>9.0f} {ratio(t['throughput'], p['throughput']):>8} {ratio(t['p50'], p['p50']):>8} "
                      f"{ratio(t['p99'], p['p99']):>8}")
    if both:
        print("\nTLS + etcd auth / plaintext (ratio of the medians; 1.00 = no cost):")
        print(f"  {'offered/s':>9} {'gangs/s':>8} {'p50':>8} {'p99':>8}")
        for t, p in zip(rows["tls"], rows["plaintext"]):
            print(f"  {t['offered']:>9.0f} {ratio(t['throughput'], p['throughput']):>8} {ratio(t['p50'], p['p50']):>8} "
                  f"{ratio(t['p99'], p['p99']):>8}")
    cross = next((r["cross"] for m in modes for r in results[m] if r["cross"] is not None), None)
    if cross is not None:
        k = 3
        print(f"\ncross-AZ admission (two-phase, {MODE_WORDS[CROSS_AZ_MODE]}), {cross['gangs']} sequential gangs of 3 x 8 GPUs "
              "over 3 AZs (one node each), quiet cluster:")
        print(f"  {'p50 ms':>8} {'p99 ms':>8} {'events p50':>10} {'events p99':>10} {'placed p50':>10} "
              f"{'etcd requests/admission':>24} {'protocol minimum':>17}")
        print(f"  {cross['p50']:>8.1f} {cross['p99']:>8.1f} {cross.get('ev_p50', float('nan')):>10.1f} "
              f"{cross.get('ev_p99', float('nan')):>10.1f} {cross.get('placed_p50', float('nan')):>10.1f} "
              f"{cross['requests']:>24.1f} {2 * k + 2:>17}")
        print("  (p50/p99: submit -> RESERVED seen by polling GetGang every 100 ms; events: submitted -> reserved"
              " in the gang's record, the owner's clock; placed: submitted -> placed, the wait for placement)")
        print("  (minimum: attempt record + k PREPARED + decision + k COMMITTED = 2k+2 writes, 4 sequential round trips;"
              " single-AZ admission: 1 txn)")


MODE_WORDS = {"plaintext": "plaintext (--insecure)", "tls": "tls (gRPC TLS + etcd client-cert auth and roles)"}
for _m in list(MODE_WORDS):
    MODE_WORDS[_m + WITH_METRICS] = MODE_WORDS[_m] + " with /metrics on"
# The cross-AZ row counts etcd requests, not the cost of TLS: it runs once,
# in the TLS mode (the integration harness it uses runs nothing else).
CROSS_AZ_MODE = "tls"
SPINES, LEAVES_PER_SPINE = 2, 2


def positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        v = kind(text)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
        return v
    return parse


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--azs", type=int, default=3)
    ap.add_argument("--nodes-per-az", type=int, default=32)
    ap.add_argument("--rates", default="20,50,100,150,200")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--duration", type=float, default=0.5, help="simulated member run time (churn)")
    ap.add_argument("--raw-seconds", type=float, default=3.0)
    ap.add_argument("--cross-az-gangs", type=int, default=20,
                    help="sequential 3-AZ gangs for the cross-AZ row, run in the tls mode (0: skip)")
    ap.add_argument("--tls", choices=sorted(MODES), default="both",
                    help="on: TLS on every gRPC hop and etcd client-cert auth with roles; off: plaintext "
                         "(--insecure); both (default): both, same run, with the ratio")
    ap.add_argument("--metrics", choices=sorted(METRICS), default="off",
                    help="on: every process serves /metrics (coordinators scraped every second); off (default); "
                         "both: every mode with and without, with the on/off ratio")
    ap.add_argument("--repeat", type=positive(int), default=1, help="runs of each mode, alternating (medians)")
    a = ap.parse_args(argv)
    modes = tuple(m + x for m in MODES[a.tls] for x in METRICS[a.metrics])
    tmp = Path(tempfile.mkdtemp(prefix="phalanx-bench-"))
    results: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        for i in range(a.repeat):
            for m in modes:
                # Once: in the first mode that is CROSS_AZ_MODE (with or without metrics).
                first = next((x for x in modes if x.removesuffix(WITH_METRICS) == CROSS_AZ_MODE), None)
                cross = bool(a.cross_az_gangs) and i == 0 and m == first
                results[m].append(await run_mode(a, m, tmp / f"run{i}", cross))
        print_tables(a, modes, results)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
