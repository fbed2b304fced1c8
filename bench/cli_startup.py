"""How long the ``phalanx`` command takes to start (docs/benchmarks.md "CLI
start-up"), hyperfine-style: two warm-up runs, then ``--runs`` runs of each
command; the median wall time and the median CPU time (user + system of the
child, which a loaded machine inflates less than the wall time).

    .venv/bin/python bench/cli_startup.py [--runs 21] [--no-cluster]

Without ``--no-cluster`` it also starts ``phalanx up --no-workload`` (1 AZ,
1 coordinator, 2 simulated nodes, TLS), submits examples/tiny.yaml and
times ``phalanx get tiny`` against it, as the README's shell would."""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from bench.machine import machine_line  # noqa: E402


def measure(argv: Sequence[str], env: dict[str, str], runs: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``argv`` over ``runs`` runs (after 2 warm-ups)."""
    for _ in range(2):
        subprocess.run(argv, env=env, capture_output=True, cwd=ROOT)
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(argv, env=env, capture_output=True, cwd=ROOT)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21, help="timed runs per command (default 21)")
    parser.add_argument("--no-cluster", action="store_true", help="skip `phalanx get` (no local cluster)")
    args = parser.parse_args(argv)
    phalanx = [sys.executable, "-m", "phalanx"]
    commands = [
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ("phalanx --version", [*phalanx, "--version"]),
        ("phalanx --help", [*phalanx, "--help"]),
        ("phalanx list --bogus (usage error)", [*phalanx, "list", "--bogus"]),
    ]
    print(machine_line())
    with open("/proc/loadavg") as f:
        print(f"load average at start: {' '.join(f.read().split()[:3])}")
    print(f"{'command':<40} {'wall median':>12} {'CPU median':>11}")
    env = dict(os.environ)
    # As a user's shell runs it: the warm-up runs write the bytecode that
    # the timed runs then load (with PYTHONDONTWRITEBYTECODE set, a module
    # edited since its .pyc was written would be compiled on every run).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # The client's TLS verdicts (phalanx/tls_check_cache.py) in a cache of
    # this run's own: the warm-ups fill it, and no other process on the
    # machine evicts the entry between the timed runs.
    cache = tempfile.mkdtemp(prefix="phalanx-bench-cache-")
    env["XDG_CACHE_HOME"] = cache

    def row(label: str, cmd: Sequence[str]) -> None:
        wall, cpu = measure(cmd, env, args.runs)
        print(f"{label:<40} {wall * 1000:>9.0f} ms {cpu * 1000:>8.0f} ms", flush=True)

    for label, cmd in commands:
        row(label, cmd)
    if not args.no_cluster:
        from phalanx.up import UpProcess

        with UpProcess(["--no-workload", "--azs", "1", "--coordinators-per-az", "1", "--nodes-per-az", "2",
                        "--base-port", "0"]) as up:
            env = {k: v for k, v in up.client_env().items() if k != "PYTHONDONTWRITEBYTECODE"}
            env["XDG_CACHE_HOME"] = cache
            subprocess.run([*phalanx, "submit", "examples/tiny.yaml"], env=env, cwd=ROOT, check=True,
                           capture_output=True)
            row("phalanx get tiny (TLS, local cluster)", [*phalanx, "get", "tiny"])
    shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
