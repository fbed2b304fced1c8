"""Run chaos scenarios and check them: ``python -m chaos.run``.

::

    python -m chaos.run --all --seeds 3 --out chaos-out
    python -m chaos.run --scenario leader-pause --scenario agent-restart --seeds 1
    python -m chaos.run --list

One run = (scenario, seed): build the namespace cluster (:mod:`chaos.cluster`),
start the workload in the ``client`` host, execute the scenario's fault
schedule, submit the post-heal probe, wait for the cluster to settle, dump
etcd, tear everything down, then check the recorded history
(:mod:`chaos.checker`) and write the report (:mod:`chaos.report`) into
``<out>/<scenario>-s<seed>/``. ``<out>/summary.txt`` has the matrix.

Exit status: 0 when every run came out as expected (no violation; for a
planted-bug scenario: at least one), 1 otherwise, 2 when the machine cannot
run the suite (the message says what is missing).

``main(argv) -> int`` is the entry point for ``phalanx chaos run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos import checker, history, report
from chaos import metrics as run_metrics
from chaos.cluster import REPO, PhalanxCluster
from chaos.faults import HealthCheckFailed, heal_all, run_schedule
from chaos.netns import ChaosEnvironmentError, NetnsCluster
from chaos.scenarios import MATRIX, SCENARIOS, Scenario, scenario
from phalanx.usage import OneLineParser

# How long a member start may trail the agent's token read, and the slack
# for an exit recorded after its reservation was seen released (see
# chaos.history.RunParams). Generous for a loaded 2-core machine.
TOKEN_WINDOW_S = 2.0
RELEASE_TOLERANCE_S = 1.0
SETTLE_TIMEOUT_S = 60.0
DEFAULT_RATE = 0.8  # gangs per second over all AZs


@dataclass
class RunResult:
    scenario: str
    seed: int
    run_dir: Path
    verdict: checker.Verdict | None
    wall_s: float
    expect_violations: bool = False
    error: str = ""
    prefix: str = ""  # namespace prefix of the run (leftover checks)
    pids: dict[str, list[int]] = field(default_factory=dict)  # pids seen just before teardown
    metrics: run_metrics.RunMetrics | None = None
    # What the leaders' --check-book said (book_problems): a run that must
    # hold fails on any.
    book_problems: list[str] = field(default_factory=list)

    @property
    def as_expected(self) -> bool:
        if self.verdict is None:
            return False
        return (not self.verdict.ok) if self.expect_violations else (self.verdict.ok and not self.book_problems)

    def line(self) -> str:
        if self.verdict is None:
            status = f"ERROR {self.error.splitlines()[-1] if self.error else ''}"
        else:
            n = len(self.verdict.violations)
            status = ("ok" if self.as_expected else "UNEXPECTED") + f", {n} violation(s)"
            if self.book_problems:
                status += f", {len(self.book_problems)} book problem(s)"
        if self.metrics is not None:
            m = self.metrics
            fenced = "?" if m.fenced_refused is None else f"{m.fenced_refused:g}"
            p50 = m.full_gang_stats.get("p50")
            status += (f"; leader changes {sum(m.leadership_changes.values())}, fenced refused {fenced}, "
                       f"full gang p50 {'-' if p50 is None else f'{p50:.2f}s'}")
        return f"{self.scenario:22} seed {self.seed:<3} {self.wall_s:6.1f}s  {status}"


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def run_scenario(
    sc: Scenario,
    seed: int,
    out_dir: Path,
    *,
    duration: float | None = None,
    rate: float | None = None,
    agent_failpoints: str | None = None,
    keep_workdir: bool = False,
    log: Any = print,
) -> RunResult:
    """One (scenario, seed): build, break, heal, settle, check. Never leaves
    a namespace or process behind (the NetnsCluster is torn down on every path)."""
    t_begin = time.monotonic()
    duration = duration or sc.duration
    rate = rate or sc.rate or DEFAULT_RATE
    run_dir = Path(out_dir) / f"{sc.name}-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # Short path: unix socket paths (proxy control) are limited to 107 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="phxc-"))
    failpoints = sc.agent_failpoints if agent_failpoints is None else agent_failpoints
    result = RunResult(sc.name, seed, run_dir, None, 0.0, sc.expect_violations)
    scraped: tuple[run_metrics.Scraped, ...] = ()
    notes: list[str] = []
    meta: dict[str, Any] = {"scenario": sc.name, "seed": seed, "description": sc.description,
                            "agent_failpoints": failpoints, "duration": duration, "rate": rate}
    try:
        with NetnsCluster() as net:
            result.prefix = net.prefix
            pc = PhalanxCluster.build(net, workdir, run_dir, proxies=sc.proxies, etcd_proxies=sc.etcd_proxies,
                                      agent_env={"PHALANX_FAILPOINTS": failpoints} if failpoints else None)
            bound = history.recovery_bound(dataclasses.asdict(pc.timings))
            log(f"[{sc.name} s{seed}] starting cluster {net.prefix} ({net.subnet})")
            pc.start()
            started_at = time.monotonic()
            (run_dir / "cluster.json").write_text(json.dumps(pc.describe(), indent=2))
            steps = sc.steps(pc, seed, duration)
            meta["steps"] = [s.describe() for s in steps]
            log(f"[{sc.name} s{seed}] workload {duration:.0f}s, faults: "
                + ("; ".join(f"{s.fault.name} at {s.at:.1f}s for {s.hold:.1f}s" for s in steps) or "none"))
            targets = json.dumps(pc.targets())
            assert pc.client is not None
            wl_out = open(run_dir / "logs" / "workload.log", "ab")
            workload = pc.client.popen(
                _py("chaos.workload", "--targets", targets, "--seed", str(seed), "--duration", str(duration),
                    "--rate", str(rate), "--steady", str(duration), "--out", str(run_dir / "workload.jsonl"),
                    "--fault-events", str(run_dir / "events.jsonl"), *pc.client_args()),
                stdout=wl_out, stderr=subprocess.STDOUT, env=pc._env({}), cwd=str(REPO))
            wl_out.close()
            try:
                run_schedule(steps)
            except HealthCheckFailed as exc:
                notes.append(f"health check failed: {exc}")
                log(f"[{sc.name} s{seed}] {exc}")
            finally:
                heal_all([s.fault for s in steps])
            faults = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
                      if '"src":"fault"' in line]
            heals = [f["mono"] for f in faults if f["action"] == "heal"]
            healed_at = max(heals) if heals else None
            probe_out = open(run_dir / "logs" / "probe.log", "ab")
            probe = pc.client.popen(
                _py("chaos.workload", "--probe", "--targets", targets, "--seed", str(seed),
                    "--retry-budget", str(bound), "--out", str(run_dir / "probe.jsonl"), *pc.client_args()),
                stdout=probe_out, stderr=subprocess.STDOUT, env=pc._env({}),
                cwd=str(REPO))
            probe_out.close()
            # The workload ends by itself: its plan spans `duration`, then its
            # last retries run out (30 s budget); the probe within the bound.
            deadlines = (("workload", workload, started_at + duration + 45.0),
                         ("probe", probe, time.monotonic() + bound + 15.0))
            for name, proc, deadline in deadlines:
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    notes.append(f"{name} still running at its deadline; stopped")
                    proc.terminate()
                    proc.wait(timeout=10)
                if proc.returncode not in (0, -15):
                    # A broken harness is not a finding about Phalanx: fail the run loudly.
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see logs/{name}.log")
            try:
                pc.wait(pc.settled, SETTLE_TIMEOUT_S, "all gangs terminal and no reservation left")
                settled = True
            except Exception as exc:  # noqa: BLE001 - recorded; the checker judges the state
                settled = False
                notes.append(str(exc))
            final = pc.dump(run_dir / "final.json")
            # Before teardown, while the coordinators still run: only they
            # know how many of their writes etcd refused (chaos/metrics.py).
            scraped = _scrape_coordinators(pc, run_dir)
            result.pids = pc.pids()
            pc.stop_recorder()
            meta.update(
                azs=list(pc.azs), started_at=started_at, settle_at=final["mono"], healed_at=healed_at,
                timings=dataclasses.asdict(pc.timings), token_window_s=TOKEN_WINDOW_S,
                release_tolerance_s=RELEASE_TOLERANCE_S, recovery_bound_s=bound, settled=settled, notes=notes,
                prefix=net.prefix,
            )
            (run_dir / "run.json").write_text(json.dumps(meta, indent=2))
    except Exception:  # noqa: BLE001 - reported as an errored run
        result.error = traceback.format_exc()
        log(f"[{sc.name} s{seed}] ERROR\n{result.error}")
    finally:
        _keep_logs(workdir, run_dir)
        if not keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    result.wall_s = time.monotonic() - t_begin
    if not result.error:
        h = history.load(run_dir)
        result.verdict = checker.check(h)
        result.metrics = run_metrics.derive(h, scraped)
        report.write(run_dir, h, result.verdict, wall_s=result.wall_s, metrics=result.metrics)
    result.book_problems = book_problems(run_dir)
    (run_dir / "verdict.json").write_text(json.dumps(_verdict_json(result), indent=2))
    log(result.line())
    return result


def _scrape_coordinators(pc: PhalanxCluster, run_dir: Path) -> tuple[run_metrics.Scraped, ...]:
    """Every coordinator's /metrics, scraped from the client host (which
    reaches them) with the workload's admin certificate; the expositions go
    to ``metrics/<id>.prom``. A coordinator that does not answer is named in
    the report, never fatal."""
    assert pc.client is not None and pc.client_dir is not None
    targets = {cid: pc.metrics_address(cid) for cid in pc.coordinator_ids()}
    starts = {cid: pc.procs[cid].starts for cid in targets if cid in pc.procs}
    try:
        done = pc.client.run(_py("chaos.metrics", "--targets", json.dumps(targets), "--tls-dir", str(pc.client_dir)),
                             timeout=60.0, cwd=str(REPO), env=pc._env({}))
        answers = json.loads(done.stdout) if done.returncode == 0 else {}
        why = "" if done.returncode == 0 else f"the scraper exited with {done.returncode}: {done.stderr.strip()[-300:]}"
    except (subprocess.TimeoutExpired, ValueError) as exc:
        answers, why = {}, f"the scraper failed: {exc}"
    for cid, address in targets.items():
        answers.setdefault(cid, {"address": address, "text": None, "error": why or "no answer"})
    out = run_dir / "metrics"
    out.mkdir(exist_ok=True)
    for cid, a in answers.items():
        if a.get("text") is not None:
            (out / f"{cid}.prom").write_text(a["text"])
    return run_metrics.scraped_from(answers, starts)


def book_problems(run_dir: Path) -> list[str]:
    """The coordinators' \"book inconsistent\" lines (``--check-book``,
    docs/book.md), each as ``<coordinator>: <line>``."""
    return [f"{p.stem}: {line.strip()}" for p in sorted((run_dir / "logs").glob("coord-*.log"))
            for line in p.read_text(errors="replace").splitlines() if "book inconsistent: " in line]


def _keep_logs(workdir: Path, run_dir: Path) -> None:
    """etcd logs into the run directory (data dirs stay behind: 64 MiB WAL each)."""
    for p in (workdir / "etcd").glob("*/etcd.log"):
        dst = run_dir / "logs" / f"{p.parent.name}.log"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dst)


def _verdict_json(r: RunResult) -> dict[str, Any]:
    d: dict[str, Any] = {"scenario": r.scenario, "seed": r.seed, "wall_s": round(r.wall_s, 1),
                         "expect_violations": r.expect_violations, "as_expected": r.as_expected, "error": r.error,
                         "book_problems": r.book_problems}
    if r.verdict is not None:
        d["ok"] = r.verdict.ok
        d["invariants"] = {str(x.number): {"name": x.name, "checked": x.checked, "violations": len(x.violations)}
                           for x in r.verdict.results}
        d["violations"] = [v.render() for v in r.verdict.violations]
        d["measurements"] = r.verdict.measurements
    if r.metrics is not None:
        d["metrics"] = r.metrics.to_dict()
    return d


def main(argv: list[str] | None = None) -> int:
    """``phalanx chaos run`` / ``python -m chaos.run``; returns the exit status."""
    p = OneLineParser(prog="python -m chaos.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", action="append", default=[], metavar="NAME", help="run this scenario (repeatable)")
    p.add_argument("--all", action="store_true", help=f"every scenario that must hold: {', '.join(MATRIX)}")
    p.add_argument("--seeds", type=int, default=1, help="seeds per scenario: seed-base .. seed-base+N-1")
    p.add_argument("--seed-base", type=int, default=1)
    p.add_argument("--out", default="chaos-reports", help="report directory (chaos-reports/ is git-ignored)")
    p.add_argument("--duration", type=float, default=None, help="workload seconds (default: per scenario)")
    p.add_argument("--rate", type=float, default=None, help=f"gangs per second over all AZs (default: per scenario, else {DEFAULT_RATE})")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    try:
        a = p.parse_args(argv)
        names = list(MATRIX) if a.all else []
        names += [n for n in a.scenario if n not in names]
        if not names and not a.list:
            p.error("name at least one --scenario, or --all")
        chosen = [scenario(n) for n in names]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse: --help, usage errors; main() returns, never exits
        return exc.code if isinstance(exc.code, int) else 2
    if a.list:
        for name, sc in SCENARIOS.items():
            print(f"{name:22} {sc.description}{'  [planted bug: expects violations]' if sc.expect_violations else ''}")
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[RunResult] = []
    t0 = time.monotonic()
    try:
        for sc in chosen:
            for seed in range(a.seed_base, a.seed_base + a.seeds):
                r = run_scenario(sc, seed, out, duration=a.duration, rate=a.rate)
                results.append(r)
                if r.error and "cannot run here" in r.error:
                    print(r.error.strip().splitlines()[-1], file=sys.stderr)
                    return 2
    except ChaosEnvironmentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if results:
            text = report.matrix(results, time.monotonic() - t0)
            (out / "summary.txt").write_text(text)
            print(text)
    return 0 if all(r.as_expected for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
