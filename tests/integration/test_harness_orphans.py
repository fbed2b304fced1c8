"""The test harness leaves nothing behind, however the test run dies.

A pytest that is SIGTERMed or SIGKILLed runs no fixture teardown, so a
coordinator that ``LocalCluster.start_coordinator`` started with a plain
``Popen`` lived on as an orphan (PPID 1), holding its port and its etcd
lease. The harness now starts it through ``phalanx.procs.spawn`` (the kernel's
parent-death signal). ``procs.spawn`` itself is tested in test_up_orphans.py;
this checks that the harness uses it: a separate Python process plays the
test run, starts a real coordinator through the harness, and is SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx import procs
from tests.pki import EtcdPki

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# Upper bound on how long the coordinator may take to go after the process
# that started it died (the kernel signals it at once); only a wait bound.
GONE_WITHIN_S = 60.0

# The "test run": a LocalCluster on the test's etcd and cluster, one real
# coordinator started by the harness, its pid printed, then a long sleep.
RUN = """
import sys, time
from pathlib import Path
from tests.integration.harness import LocalCluster
from tests.pki import EtcdPki

etcd, cluster, workdir, etcd_pki_dir = sys.argv[1:5]
c = LocalCluster(etcd, cluster, Path(workdir), etcd_pki=EtcdPki(Path(etcd_pki_dir)))
coord = c.start_coordinator("az-a", "orphan0")
print(coord.proc.pid, flush=True)
time.sleep(300)
"""


def wait_gone(pid: int, start_time: int) -> bool:
    deadline = time.monotonic() + GONE_WITHIN_S
    while procs.process_alive(pid, start_time) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not procs.process_alive(pid, start_time)


def test_a_coordinator_the_harness_started_dies_with_a_sigkilled_test_run(
    etcd_endpoint: str, cluster_name: str, etcd_pki: EtcdPki, etcd_coordinator_dir: Path, tmp_path: Path
) -> None:
    assert etcd_coordinator_dir.is_dir()  # the run's coordinator reads its etcd credentials from here
    with open(tmp_path / "run.log", "w") as log:
        # The stand-in run itself dies with this test run too (its coordinator
        # then dies with it): KILL, as a real SIGKILLed run gets.
        run = procs.spawn(
            [sys.executable, "-c", RUN, etcd_endpoint, cluster_name, str(tmp_path), str(etcd_pki.dir)],
            die_with_parent=procs.KILL, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True,
        )
    coord_pid, coord_start = 0, None
    try:
        assert run.stdout is not None
        line = run.stdout.readline().strip()  # after the coordinator's READY line (start_coordinator waits)
        assert line.isdigit(), f"the run did not start a coordinator: {line!r}\n{(tmp_path / 'run.log').read_text()}"
        coord_pid = int(line)
        coord_start = procs.pid_start_time(coord_pid)
        fields = procs.stat_fields(coord_pid)
        assert coord_start is not None and fields is not None, "the coordinator is not running"
        assert int(fields[1]) == run.pid, "the coordinator is not the run's own child"
        run.kill()  # SIGKILL: no clean-up code of the run can stop it
        run.wait()
        assert wait_gone(coord_pid, coord_start), (
            f"coordinator {coord_pid} outlived the SIGKILLed run that started it (an orphan)")
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if coord_start is not None and procs.process_alive(coord_pid, coord_start):
            os.kill(coord_pid, signal.SIGKILL)  # a failed test leaves no orphan either
        if run.stdout:
            run.stdout.close()
