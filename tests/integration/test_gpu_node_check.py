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

from phalanx import procs

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


def _run_processes(tmp: Path | None = None) -> dict[int, str]:
    """Live processes started by a gpu_node_check run (they all carry
    GPUCHECK_RUN in their environment), and with ``tmp`` (the run's TMPDIR)
    the members' fencing shims, whose environment is the agent's markers
    only: their command line names the run's work dir: pid -> command line."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        shim = tmp is not None and f"--lease {tmp}/gpucheck." in cmdline
        if (b"GPUCHECK_RUN=" in environ or shim) and state != "Z":
            found[int(entry)] = cmdline[:160]
    return found


def test_a_sigkilled_gpu_node_check_leaves_nothing_behind(tmp_path: Path) -> None:
    """SIGKILL of the script (no EXIT trap runs): its etcd, coordinator,
    agent and members die with it; the next run removes its work dir."""
    import signal
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, OUT=str(tmp_path / "out"), GPU_CHECK_DRY_RUN="1", GPU_CHECK_PYTHON=sys.executable,
               TMPDIR=str(tmp))
    assert _run_processes() == {}, "another gpu_node_check is running"
    proc = procs.spawn(["bash", str(REPO / "scripts" / "gpu_node_check.sh")], die_with_parent=procs.KILL, cwd=REPO,
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        # Wait until the agent runs (etcd, coordinator and agent are up).
        while not any(" -m agent " in c for c in _run_processes().values()):
            assert proc.poll() is None and time.monotonic() < deadline, "the agent never started"
            time.sleep(0.2)
        work = [d for d in tmp.iterdir() if d.name.startswith("gpucheck.")]
        assert len(work) == 1, work
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30  # members: their shim fences within fence_after_s
        while (left := _run_processes(tmp)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == {}, f"left behind by a SIGKILLed gpu_node_check: {left}"
        assert work[0].exists()  # no EXIT trap ran; the next run cleans it
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _run_processes(tmp):
            os.kill(pid, signal.SIGKILL)
    again = subprocess.run(["bash", str(REPO / "scripts" / "gpu_node_check.sh")], cwd=REPO,
                           env=dict(env, OUT=str(tmp_path / "out2")), capture_output=True, text=True, timeout=420)
    assert "work dir of a dead earlier run" in again.stdout + again.stderr
    assert not work[0].exists()
    assert [d for d in tmp.iterdir() if d.name.startswith("gpucheck.")] == []
