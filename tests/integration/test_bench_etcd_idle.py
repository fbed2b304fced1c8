"""bench/etcd_idle.py at its smallest (one AZ, two nodes, a 2 s window):
the machine line, the table of key classes, etcd's own counters. Its
numbers are never asserted (docs/benchmarks.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_benches import MACHINE

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_etcd_idle_bench_prints_its_tables_below_the_machine() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "etcd_idle.py"), "--azs", "1", "--nodes-per-az", "2",
                          "--seconds", "2", "--settle", "0"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert MACHINE.match(lines[0]), lines[0]
    assert re.match(r"^2 simulated nodes \(1 AZs x 2\), idle, window \d+\.\d s$", lines[1]), lines[1]
    assert lines[2:4] == ["| key class | puts | bytes (key+value) | bytes per hour |", "|---|---|---|---|"]
    assert re.match(r"^etcd: revisions \+\d+, bytes put [\d,]+/h, WAL bytes [\d,]+/h, db size [\d,]+ -> [\d,]+ B$",
                    lines[-1]), lines[-1]
