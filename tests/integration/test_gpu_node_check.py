"""scripts/gpu_node_check.sh, the check run on real GPU machines, in its dry
run: stages c-e (discovery vs. replay, a real agent running a gang, `phalanx
explain`, the shim fencing a member of a SIGKILLed agent) on a recorded
fixture, with real etcd, coordinator and agent processes. Keeps the script
working between the sessions that are lent a GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MUST_PASS = ("c-discovery", "c-replay", "d-cluster", "d-gang", "d-explain", "e-fence-gpu", "e-restart",
             "d-teardown", "OVERALL")


def test_gpu_node_check_dry_run_passes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_DRY_RUN="1", GPU_CHECK_PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_node_check.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=420)
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    assert proc.returncode == 0, summary + proc.stdout[-3000:] + proc.stderr[-3000:]
    status = {line.split()[0]: line.split()[1] for line in summary.splitlines() if len(line.split()) > 1}
    for stage in MUST_PASS:
        assert status.get(stage) == "PASS", (stage, summary)
    assert "FAIL" not in status.values(), summary
    assert "fenced=true" in summary  # the member of the killed agent was fenced by its shim
    assert (out / "log.txt").exists() and (out / "logs.tgz").exists()
