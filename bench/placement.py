"""Placement benchmark: Phalanx vs a count-only gang placer vs PACK.

    .venv/bin/python bench/placement.py [--fabric CSV] [--jobs N] [--seed S] [--load RHO]

Replays one synthetic job stream (a discrete-event simulation: Poisson
arrivals, log-normal durations, gang sizes shaped like the Philly and Helios
traces) three times over the same fabric, once per placer, with the same queue
policy, and prints one table. Then times Phalanx's decision for 64-GPU gangs
(8 members × 8 GPUs + 8 NICs) on the full inventory. Method and results:
docs/placement.md.

The fabric is by default the Alibaba Lingjun 2023 topology shipped in
``bench/data/lingjun2023-topo.csv`` (847 hosts × 8 GPUs; ASW → leaf, PSW →
spine, DSW → AZ), another CSV of those columns with ``--fabric PATH``, or
``--fabric generated``: a generated fabric of the same shape (also what a
missing file falls back to, with a one-line note). Every host is modelled as an HGX H100-like node: 8 GPUs on one
NVSwitch island, 8 RDMA NICs on rails 0–7, GPU i on the PCIe switch of NIC i.
"""

from __future__ import annotations

import argparse
import csv
import gc
import heapq
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from coordinator.core.placement import (  # noqa: E402
    FabricIndex,
    NodeView,
    Placement,
    PlacementRequest,
    place,
    span_of,
)
from phalanx.model import Level, PcieDistance  # noqa: E402
from phalanx.topology import Gpu, GpuNicLink, Nic, NodeTopology  # noqa: E402
from bench.machine import machine_line  # noqa: E402

GPUS_PER_NODE = 8
DEFAULT_FABRIC = ROOT / "bench" / "data" / "lingjun2023-topo.csv"
GENERATED = "generated"

# --- fabric -------------------------------------------------------------------------------


def _links() -> tuple[GpuNicLink, ...]:
    out = []
    for g in range(GPUS_PER_NODE):
        for n in range(GPUS_PER_NODE):
            d = (PcieDistance.PIX if g == n else PcieDistance.PXB if g // 2 == n // 2
                 else PcieDistance.NODE if g // 4 == n // 4 else PcieDistance.SYS)
            out.append(GpuNicLink(g, f"mlx5_{n}", d))
    return tuple(out)


_GPUS = tuple(Gpu(index=i, model="NVIDIA H100 80GB HBM3", nvlink_island=0) for i in range(GPUS_PER_NODE))
_NICS = tuple(Nic(name=f"mlx5_{i}", rate_gbps=400, link_layer="Ethernet", rail=i) for i in range(GPUS_PER_NODE))
_LINKS = _links()


def hgx(name: str, az: str, spine: str, leaf: str) -> NodeTopology:
    return NodeTopology(node=name, az=az, spine=spine, leaf=leaf, gpus=_GPUS, nics=_NICS, links=_LINKS)


FABRIC_COLUMNS = ("ip", "DSW", "PSW", "ASW")


def load_fabric(path: Path) -> list[NodeTopology]:
    """One node per CSV row, in file order (the count-only placer's order).
    A file that is not such a CSV is a ValueError naming the file and what is
    wrong (not a division by zero over an empty fabric later on)."""
    try:
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in FABRIC_COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise ValueError(f"{path}: not a fabric CSV: no column {', '.join(missing)} "
                                 f"(want a header {','.join(FABRIC_COLUMNS)})")
            nodes = []
            for i, row in enumerate(reader):
                empty = [c for c in FABRIC_COLUMNS if not row.get(c)]
                if empty:
                    raise ValueError(f"{path}: line {reader.line_num}: empty {', '.join(empty)}")
                nodes.append(hgx(f"h{i:04d}-{row['ip'][:8]}", row["DSW"], row["PSW"], row["ASW"]))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path}: cannot read it as a CSV: {exc}") from None
    if not nodes:
        raise ValueError(f"{path}: no nodes (a header and no rows)")
    return nodes


def synthetic_fabric(seed: int) -> list[NodeTopology]:
    """The Lingjun shape without the file: one AZ, spines of 362/306/179
    hosts, leaves of 8 hosts (about 60%) or 2–7, listed in random order
    (the CSV's hashed host ids are in no topological order either)."""
    rng = random.Random(seed)
    nodes: list[NodeTopology] = []
    for s, hosts in enumerate((362, 306, 179)):
        leaf = 0
        while hosts > 0:
            size = min(hosts, 8 if rng.random() < 0.6 else rng.randint(2, 7))
            nodes += [hgx(f"s{s}l{leaf}n{i}", "G0", f"P{s}", f"S{leaf}") for i in range(size)]
            hosts -= size
            leaf += 1
    rng.shuffle(nodes)
    return nodes


# --- jobs -----------------------------------------------------------------------------------

# GPUs per job. Philly (Jeon et al., "Analysis of Large-Scale Multi-Tenant GPU
# Clusters for DNN Training Workloads", USENIX ATC 2019) and Helios (Hu et al.,
# "Characterization and Prediction of Deep Learning Workloads in Large-Scale
# GPU Datacenters", SC 2021) both report that single-GPU jobs are the majority
# of jobs, that jobs of at most 8 GPUs (one server) are the large majority, and
# that a thin tail of multi-node jobs, up to hundreds of GPUs, holds a large
# share of GPU time. The weights below are our approximation of those shapes
# (not figures copied from either paper): 88% of jobs fit one 8-GPU server,
# 12% are multi-node, 0.5% are 256-GPU jobs; about 75% of GPU time is
# multi-node jobs.
SIZE_WEIGHTS: tuple[tuple[int, float], ...] = (
    (1, 0.55), (2, 0.10), (4, 0.10), (8, 0.13),
    (16, 0.05), (32, 0.035), (64, 0.02), (128, 0.01), (256, 0.005),
)
# Share of 2–8 GPU jobs submitted as one pod per GPU (members × 1 GPU), as
# data-parallel jobs on Kubernetes often are: the case where a count-only
# placer scatters a small job over several nodes.
POD_PER_GPU = 0.3
# Durations: log-normal, median 30 min, sigma 1.0 (mean ~ 50 min, p99 ~ 5 h),
# capped at one day: both traces show minutes-long medians with a long tail.
# A heavier tail would be closer to the traces but would need far more jobs
# (and minutes of run time) before the simulated cluster reaches steady state.
DURATION_MEDIAN_S = 1800.0
DURATION_SIGMA = 1.0
DURATION_CAP_S = 86400.0
# Queue policy, the same for every placer: FIFO with backfill, except that a
# head-of-line job waiting longer than this blocks everything behind it, so
# large gangs are not starved by a stream of small ones.
HEAD_OF_LINE_WAIT_S = 2 * 3600.0


@dataclass(frozen=True)
class Job:
    id: int
    arrival: float
    duration: float
    members: int
    gpus: int  # per member
    nics: int  # per member

    @property
    def total_gpus(self) -> int:
        return self.members * self.gpus


def make_jobs(n: int, seed: int, total_gpus: int, load: float) -> list[Job]:
    rng = random.Random(seed)
    sizes, weights = zip(*SIZE_WEIGHTS)
    shapes = []
    for _ in range(n):
        size = rng.choices(sizes, weights)[0]
        if size > GPUS_PER_NODE:
            shape = (size // GPUS_PER_NODE, GPUS_PER_NODE, GPUS_PER_NODE)  # multi-node: RDMA NIC per GPU
        elif size > 1 and rng.random() < POD_PER_GPU:
            shape = (size, 1, 0)
        else:
            shape = (1, size, 0)
        duration = min(DURATION_CAP_S, rng.lognormvariate(math.log(DURATION_MEDIAN_S), DURATION_SIGMA))
        shapes.append((shape, duration))
    # Arrival rate for the offered load: load = rate × E[GPU-seconds] / GPUs.
    mean_work = statistics.fmean(m * g * d for (m, g, _), d in shapes)
    rate = load * total_gpus / mean_work
    jobs, t = [], 0.0
    for i, ((m, g, r), d) in enumerate(shapes):
        t += rng.expovariate(rate)
        jobs.append(Job(i, t, d, m, g, r))
    return jobs


# --- cluster state --------------------------------------------------------------------------

Allocation = list[tuple[int, tuple[int, ...], tuple[str, ...]]]  # (node index, gpus, nics) per member


class Cluster:
    def __init__(self, topologies: Sequence[NodeTopology]) -> None:
        self.topologies = list(topologies)
        self.index_of = {(t.az, t.node): i for i, t in enumerate(self.topologies)}
        self.views = [NodeView(t, frozenset(range(GPUS_PER_NODE)), frozenset(n.name for n in t.nics))
                      for t in self.topologies]
        # Nodes by free-GPU count: gang capacity in O(9), and fragmentation.
        self.hist = [0] * GPUS_PER_NODE + [len(self.topologies)]
        self.busy = 0

    @property
    def total(self) -> int:
        return GPUS_PER_NODE * len(self.topologies)

    def capacity(self, gpus: int) -> int:
        """Members of ``gpus`` GPUs the cluster can host. NICs never bind in
        this workload (only 8-GPU members take NICs, one per GPU), so this is
        exact, and every placer below is complete: it places a gang iff this
        count allows."""
        return sum(self.hist[k] * (k // gpus) for k in range(gpus, GPUS_PER_NODE + 1))

    def _update(self, i: int, gpus: frozenset[int], nics: frozenset[str]) -> None:
        old = self.views[i]
        self.hist[len(old.free_gpus)] -= 1
        self.hist[len(gpus)] += 1
        self.views[i] = NodeView(old.topology, gpus, nics)

    def take(self, alloc: Allocation) -> None:
        for i, gpus, nics in alloc:
            v = self.views[i]
            assert set(gpus) <= v.free_gpus and set(nics) <= v.free_nics, "double booking"
            self._update(i, v.free_gpus - set(gpus), v.free_nics - set(nics))
            self.busy += len(gpus)

    def give_back(self, alloc: Allocation) -> None:
        for i, gpus, nics in alloc:
            v = self.views[i]
            self._update(i, v.free_gpus | set(gpus), v.free_nics | set(nics))
            self.busy -= len(gpus)

    def fragmentation(self) -> float | None:
        """Share of free GPUs stranded on partly used nodes, where no 8-GPU
        member can go; None when nothing is free."""
        partial = sum(k * self.hist[k] for k in range(1, GPUS_PER_NODE))
        free = partial + GPUS_PER_NODE * self.hist[GPUS_PER_NODE]
        return partial / free if free else None


# --- placers --------------------------------------------------------------------------------

Placer = Callable[[Job, Cluster], Allocation | None]


def phalanx_placer() -> Placer:
    index: FabricIndex | None = None

    def run(job: Job, cl: Cluster) -> Allocation | None:
        nonlocal index
        if index is None:  # the leader keeps one index across cycles
            index = FabricIndex.build(cl.topologies)
        req = PlacementRequest(gang=f"j{job.id}", members=job.members, gpus_per_member=job.gpus,
                               rdma_nics_per_member=job.nics)
        result = place(req, cl.views, index)
        if not isinstance(result, Placement):
            return None
        return [(cl.index_of[(s.az, s.node)], s.gpus, s.nics) for s in result.members]

    return run


def count_only(job: Job, cl: Cluster) -> Allocation | None:
    """Kubernetes Coscheduling-like: the gang is admitted when enough members
    fit, each on the first node (in inventory order) with enough free GPUs."""
    out: Allocation = []
    for i, v in enumerate(cl.views):
        if len(v.free_gpus) < job.gpus or len(v.free_nics) < job.nics:
            continue
        gpus, nics = sorted(v.free_gpus), sorted(v.free_nics)
        while len(out) < job.members and len(gpus) >= job.gpus and len(nics) >= job.nics:
            out.append((i, tuple(gpus[: job.gpus]), tuple(nics[: job.nics])))
            gpus, nics = gpus[job.gpus :], nics[job.nics :]
        if len(out) == job.members:
            return out
    return None


def pack(job: Job, cl: Cluster) -> Allocation | None:
    """PACK: each member on the fullest node that still fits it, switches
    unseen (ties by inventory order)."""
    free = {i: sorted(v.free_gpus) for i, v in enumerate(cl.views)
            if len(v.free_gpus) >= job.gpus and len(v.free_nics) >= job.nics}
    nics = {i: sorted(cl.views[i].free_nics) for i in free}
    heap = [(len(g), i) for i, g in free.items()]
    heapq.heapify(heap)
    out: Allocation = []
    while len(out) < job.members and heap:
        _, i = heapq.heappop(heap)
        out.append((i, tuple(free[i][: job.gpus]), tuple(nics[i][: job.nics])))
        free[i], nics[i] = free[i][job.gpus :], nics[i][job.nics :]
        if len(free[i]) >= job.gpus and len(nics[i]) >= job.nics:
            heapq.heappush(heap, (len(free[i]), i))
    return out if len(out) == job.members else None


# --- simulation -----------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    spans: list[int] = field(default_factory=list)  # Level per multi-member gang
    multinode: int = 0
    multinode_in_leaf: int = 0
    waits: list[float] = field(default_factory=list)
    big_waits: list[float] = field(default_factory=list)  # gangs of 64+ GPUs
    busy_area: float = 0.0
    frag_area: float = 0.0
    frag_time: float = 0.0
    window: float = 0.0
    total_gpus: int = 0
    snapshot: list[NodeView] | None = None


def simulate(name: str, placer: Placer, topologies: Sequence[NodeTopology], jobs: Sequence[Job],
             snapshot_at: int | None = None) -> Result:
    cl = Cluster(topologies)
    res = Result(name, total_gpus=cl.total)
    # Measure in steady state: from the arrival of the 25th-percentile job to
    # the last arrival (before that the cluster fills, after it, it drains).
    t_start = jobs[len(jobs) // 4].arrival
    t_end = jobs[-1].arrival
    queue: list[Job] = []
    running: list[tuple[float, int, Allocation]] = []
    nxt = 0
    t = 0.0
    while nxt < len(jobs) or running:
        t_next = min(jobs[nxt].arrival if nxt < len(jobs) else math.inf, running[0][0] if running else math.inf)
        lo, hi = max(t, t_start), min(t_next, t_end)
        if hi > lo:
            res.busy_area += cl.busy * (hi - lo)
            frag = cl.fragmentation()
            if frag is not None:
                res.frag_area += frag * (hi - lo)
                res.frag_time += hi - lo
        t = t_next
        while running and running[0][0] <= t:
            cl.give_back(heapq.heappop(running)[2])
        while nxt < len(jobs) and jobs[nxt].arrival <= t:
            queue.append(jobs[nxt])
            nxt += 1
            if snapshot_at is not None and nxt == snapshot_at:
                res.snapshot = list(cl.views)
        # One scheduling pass: FIFO with backfill and a starvation guard.
        waiting: list[Job] = []
        for pos, job in enumerate(queue):
            if cl.capacity(job.gpus) >= job.members:
                alloc = placer(job, cl)
                assert alloc is not None, f"{name} failed a gang that fits: {job}"
                cl.take(alloc)
                heapq.heappush(running, (t + job.duration, job.id, alloc))
                if job.arrival >= t_start:
                    wait = t - job.arrival
                    res.waits.append(wait)
                    if job.total_gpus >= 64:
                        res.big_waits.append(wait)
                if job.members > 1:
                    span, _ = span_of([(cl.topologies[i], gpus) for i, gpus, _ in alloc])
                    res.spans.append(int(span))
                    if len({i for i, _, _ in alloc}) > 1:
                        res.multinode += 1
                        res.multinode_in_leaf += span <= Level.LEAF
                continue
            waiting.append(job)
            if pos == 0 and t - job.arrival > HEAD_OF_LINE_WAIT_S:
                waiting.extend(queue[pos + 1 :])
                break
        queue = waiting
    res.window = t_end - t_start
    return res


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def report(results: Sequence[Result]) -> None:
    head = (f"{'placer':<11} {'span mean':>9} {'span p95':>9} {'multi-node in 1 leaf':>20} {'GPU util':>8} "
            f"{'wait mean':>9} {'wait p95':>9} {'p95 wait 64+':>12} {'frag':>6}")
    print(head)
    print("-" * len(head))
    for r in results:
        p95 = Level(int(pct(r.spans, 0.95))).label if r.spans else "-"
        leaf_share = r.multinode_in_leaf / r.multinode if r.multinode else float("nan")
        util = r.busy_area / (r.total_gpus * r.window)
        frag = r.frag_area / r.frag_time if r.frag_time else float("nan")
        print(f"{r.name:<11} {statistics.fmean(r.spans):>9.2f} {p95:>9} {leaf_share:>20.1%} {util:>8.1%} "
              f"{statistics.fmean(r.waits) / 60:>7.1f} m {pct(r.waits, 0.95) / 60:>7.1f} m "
              f"{pct(r.big_waits, 0.95) / 60:>10.1f} m {frag:>6.1%}")


def time_decisions(topologies: Sequence[NodeTopology], snapshots: Sequence[tuple[str, Sequence[NodeView]]],
                   runs: int) -> None:
    """Wall and CPU time per decision. On a shared machine the wall-clock p99
    also measures the neighbours; the CPU time (process_time) does not."""
    index = FabricIndex.build(topologies)
    req = PlacementRequest(gang="bench", members=8, gpus_per_member=8, rdma_nics_per_member=8)
    cases: list[tuple[str, Sequence[NodeView], FabricIndex | None]] = [("empty", Cluster(topologies).views, index)]
    for label, views in snapshots:
        cases.append((label, views, index))
    if snapshots:
        cases.append((snapshots[0][0] + ", no index", snapshots[0][1], None))
    print(f"\nPhalanx decision time, 8 × 8 GPU + 8 NIC gang, {len(topologies)} nodes / "
          f"{GPUS_PER_NODE * len(topologies)} GPUs, {runs} decisions per case:")
    width = max(len(c[0]) for c in cases)
    print(f"  {'inventory':<{width}} {'wall p50':>9} {'wall p99':>9} {'CPU p50':>8} {'CPU p99':>8}  answer")
    gc.collect()
    for label, views, ix in cases:
        wall, cpu = [], []
        result = None
        for _ in range(runs):
            w0, c0 = time.perf_counter(), time.process_time()
            result = place(req, views, ix)
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
        answer = f"span {result.span.label}" if isinstance(result, Placement) else "unplaceable"
        print(f"  {label:<{width}} {pct(wall, 0.5) * 1e3:6.2f} ms {pct(wall, 0.99) * 1e3:6.2f} ms "
              f"{pct(cpu, 0.5) * 1e3:5.2f} ms {pct(cpu, 0.99) * 1e3:5.2f} ms  {answer}")


def choose_fabric(fabric: str, seed: int) -> tuple[list[NodeTopology], str]:
    """The fabric ``--fabric`` names and how to call it; a file that is not
    there falls back to the generated fabric with a one-line note."""
    if fabric != GENERATED:
        path = Path(fabric)
        if path.is_file():
            return load_fabric(path), path.name
        print(f"note: no fabric file {fabric}; using the generated fabric of the same shape instead")
    return synthetic_fabric(seed), f"generated (seed {seed})"


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: ``kind`` (int or float), more than zero (a stream of
    no jobs, or no load, has nothing to measure)."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
        return value
    return parse


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--fabric", default=str(DEFAULT_FABRIC),
                    help=f"topology CSV (ip,DSW,PSW,ASW), or '{GENERATED}' (default: {DEFAULT_FABRIC.relative_to(ROOT)})")
    ap.add_argument("--jobs", type=_positive(int), default=10000, help="jobs in the stream (default 10000)")
    ap.add_argument("--seed", type=int, default=1, help="seed for jobs (and the generated fabric)")
    ap.add_argument("--load", type=_positive(float), nargs="+", default=[0.9, 1.2],
                    help="offered loads to replay, GPU-time demanded / GPU-time available (default 0.9 1.2)")
    ap.add_argument("--timing-runs", type=_positive(int), default=300, help="decisions timed per case")
    args = ap.parse_args(argv)

    started = time.perf_counter()
    print(machine_line())
    try:
        topologies, source = choose_fabric(args.fabric, args.seed)
    except ValueError as exc:
        ap.error(f"--fabric: {exc}")
    leaves = {t.domain(Level.LEAF) for t in topologies}
    spines = {t.domain(Level.SPINE) for t in topologies}
    total = GPUS_PER_NODE * len(topologies)
    print(f"fabric: {source}: {len(topologies)} nodes, {total} GPUs, {len(leaves)} leaves, {len(spines)} spines, "
          f"{len({t.az for t in topologies})} AZ")
    snapshots: list[tuple[str, Sequence[NodeView]]] = []
    for load in args.load:
        jobs = make_jobs(args.jobs, args.seed, total, load)
        multi = sum(j.total_gpus > GPUS_PER_NODE for j in jobs)
        print(f"\njobs: {len(jobs)} over {jobs[-1].arrival / 3600:.1f} h, offered load {load:.0%}, "
              f"{multi / len(jobs):.1%} multi-node, largest {max(j.total_gpus for j in jobs)} GPUs, seed {args.seed}")
        results = [
            simulate("phalanx", phalanx_placer(), topologies, jobs, snapshot_at=len(jobs) // 2),
            simulate("count-only", count_only, topologies, jobs),
            simulate("pack", pack, topologies, jobs),
        ]
        report(results)
        if results[0].snapshot is not None:  # Phalanx's mid-run state, for timing
            snapshots.append((f"mid-run, load {load:.0%}", results[0].snapshot))
    print("span: Level of the tightest domain holding a multi-member gang "
          "(1 nvlink_domain, 2 node, 3 leaf, 4 spine, 5 az); waits in minutes, after the warm-up;")
    print("frag: time-averaged share of free GPUs on partly used nodes (no room for an 8-GPU member).")
    time_decisions(topologies, snapshots, args.timing_runs)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
