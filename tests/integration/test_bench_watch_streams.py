"""bench/watch_streams.py at a small size (70 streams, 3 submissions): the
machine line, the refusals past the per-identity cap, the table. Its
numbers (memory, latency) are never asserted (docs/benchmarks.md); the
stream counts are the cap's, not timings."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.core.fanout import StreamLimits
from tests.unit.test_benches import MACHINE

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_watch_streams_bench_prints_its_table_below_the_machine() -> None:
    cap = StreamLimits().per_identity
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "watch_streams.py"), "--streams", str(cap + 6),
                          "--submits", "3", "--nodes-per-az", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert MACHINE.match(lines[0]), lines[0]
    assert lines[1] == (f"refused 6: RESOURCE_EXHAUSTED: watch streams: an unauthenticated caller has N open, "
                        f"the per-identity cap is N (--watch-streams-per-identity); close one first"), lines[1]
    assert lines[2] == f"{cap + 6} WatchEvents streams from one identity to one coordinator, never read"
    assert lines[3:5] == ["| | before | while held |", "|---|---|---|"]
    assert lines[5] == f"| streams opened / refused | 0 / 0 | {cap} / 6 |"
    labels = [re.match(r"^\| ([^|]+) \|", ln).group(1) for ln in lines[6:]]
    assert labels == ["coordinator RSS, MB (all)", "etcd RSS, MB", "etcd db size, MB", "etcd watchers",
                      "SubmitGang p50, ms"]
