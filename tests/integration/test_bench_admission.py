"""The admission bench, at its smallest, runs from a clone as docs/benchmarks.md
shows it: a real etcd, a coordinator and simulated agents, its tables with the
machine line on top, and nothing left behind. Its numbers are not asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_admission_bench_prints_the_machine_above_its_tables(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = subprocess.run(
        [sys.executable, "bench/admission.py", "--azs", "1", "--nodes-per-az", "1", "--rates", "5", "--seconds", "1",
         "--raw-seconds", "0.2", "--cross-az-gangs", "0", "--duration", "0.1"],
        cwd=ROOT, env=dict(os.environ, TMPDIR=str(tmp)), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert re.match(r"^machine: \d+( of \d+)? cores \(.+\), .+, Python \d+\.\d+\.\d+$", lines[0]), lines[:2]
    assert lines[1].startswith("Phalanx admission benchmark — 1 AZs x 1 simulated 8-GPU nodes")
    assert any(re.match(r"^\s+5\s+\d+\s+\d+\s+\d+\s", ln) for ln in lines), res.stdout  # the offered-5/s row
    assert list(tmp.iterdir()) == [], "the bench left its etcd / state dir behind"
