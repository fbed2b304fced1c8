"""`phalanx coordinator|agent ...` hand the rest of the line to the process's
own parser; start-up validation errors come back as exit code 2."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from phalanx.cli import main


def test_coordinator_subcommand_validates_timings_together(capsys) -> None:
    rc = main(["coordinator", "--az", "a", "--id", "c1", "--etcd", "127.0.0.1:1",
               "--timings", '{"lease_ttl_s": 5, "fence_after_s": 6}'])
    assert rc == 2
    assert "fence_after_s must exceed lease_ttl_s + reconnect_budget_s" in capsys.readouterr().err


def test_agent_subcommand_discovers_and_prints_topology(capsys, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a replayed sysfs tree would go
    rc = main(["agent", "--az", "a", "--etcd", "127.0.0.1:1", "--node", "h1", "--print-topology",
               "--nvml-recording", "tests/fixtures/topology/l40s-pcie/nvml.json",
               "--sysfs-recording", "tests/fixtures/topology/l40s-pcie/sysfs.json", "--log-level", "ERROR"])
    assert rc == 0
    out = capsys.readouterr().out
    assert '"node": "h1"' in out and "L40S" in out
    assert list(tmp_path.iterdir()) == [], "the replayed sysfs tree is removed after discovery"
