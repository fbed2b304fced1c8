"""The admission bench, at its smallest, runs from a clone as docs/benchmarks.md
shows it: a real etcd, a coordinator and simulated agents, once in plaintext
and once with TLS on every gRPC hop and etcd client-certificate auth with the
cluster's roles, its tables with the machine line on top and the
TLS/plaintext ratios, and nothing left behind. Its numbers are not asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--azs", "1", "--nodes-per-az", "1", "--rates", "5", "--seconds", "1", "--raw-seconds", "0.2",
        "--cross-az-gangs", "0", "--duration", "0.1"]


def run_bench(tmp_path: Path, *args: str) -> list[str]:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = subprocess.run([sys.executable, "bench/admission.py", *TINY, *args],
                         cwd=ROOT, env=dict(os.environ, TMPDIR=str(tmp)), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert list(tmp.iterdir()) == [], "the bench left its etcd / certificates / state dir behind"
    return [ln for ln in res.stdout.splitlines() if ln.strip()]


def test_admission_bench_prints_both_modes_and_their_ratio_below_the_machine(tmp_path: Path) -> None:
    lines = run_bench(tmp_path)  # --tls both is the default
    assert re.match(r"^machine: \d+( of \d+)? cores \(.+\), .+, Python \d+\.\d+\.\d+$", lines[0]), lines[:2]
    assert lines[1].startswith("Phalanx admission benchmark — 1 AZs x 1 simulated 8-GPU nodes")
    assert lines[2].startswith("modes: plaintext (--insecure), tls (gRPC TLS + etcd client-cert auth and roles)")
    text = "\n".join(lines)
    # The raw etcd txn rows: one column per mode and the ratio.
    assert re.search(r"^\s+writers\s+plaintext txn/s\s+tls txn/s\s+tls/plaintext$", text, re.M), text
    assert re.search(r"^\s+32\s+\d+\s+\d+\s+\d+\.\d\d$", text, re.M), text
    # The offered-5/s row of each mode: all 5 submitted, none refused (a TLS
    # or etcd-permission mistake shows here as errors or nothing admitted).
    for mode in ("plaintext", "tls"):
        row = re.search(rf"^\s+{mode}\s+5\s+(\d+)\s+(\d+)\s+(\d+)\s", text, re.M)
        assert row, text
        assert (row.group(1), row.group(3)) == ("5", "0"), row.group(0)
        assert int(row.group(2)) > 0, row.group(0)
    ratio = lines.index(next(ln for ln in lines if ln.startswith("TLS + etcd auth / plaintext")))
    assert re.match(r"^\s+5\s+(\d+\.\d\d|-)\s+(\d+\.\d\d|-)\s+(\d+\.\d\d|-)$", lines[ratio + 2]), lines[ratio:]



def test_admission_bench_with_metrics_on_and_off_prints_their_ratio(tmp_path: Path) -> None:
    """--metrics both: each mode once without and once with /metrics on
    every process (its coordinators scraped while the load runs)."""
    lines = run_bench(tmp_path, "--tls", "off", "--metrics", "both")
    assert lines[2].startswith("modes: plaintext (--insecure), plaintext (--insecure) with /metrics on"), lines[:3]
    text = "\n".join(lines)
    for mode in ("plaintext", r"plaintext\+metrics"):
        row = re.search(rf"^\s+{mode}\s+5\s+(\d+)\s+(\d+)\s+(\d+)\s", text, re.M)
        assert row, text
        assert (row.group(1), row.group(3)) == ("5", "0"), row.group(0)
    ratio = lines.index(next(ln for ln in lines if ln.startswith("plaintext: metrics on / off")))
    scrapes = re.search(r": (\d+) scrapes, (\d+) failed\):$", lines[ratio])
    assert scrapes and int(scrapes.group(1)) > 0 and scrapes.group(2) == "0", lines[ratio]
    assert re.match(r"^\s+5\s+(\d+\.\d\d|-)\s+(\d+\.\d\d|-)\s+(\d+\.\d\d|-)$", lines[ratio + 2]), lines[ratio:]
