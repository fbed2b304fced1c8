"""Every process says once, at start-up, which etcd advisories apply to the
etcd it reaches (phalanx/etcd_version.py; docs/security.md "etcd versions and
advisories"): the real etcd here is Debian's 3.4.23, which lacks all three
fixes."""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.sim import run_agents
from phalanx import etcd_version, procs
from phalanx.store import Store
from tests.integration.harness import dgx_node

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration
AZ = "az-a"
CVES = ("CVE-2026-33413", "CVE-2026-33343", "CVE-2026-44283")


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "advisories" in ln and "etcd" in ln]


async def test_report_asks_the_real_etcd_as_the_agent_user(etcd_endpoint, cluster_name, etcd_agent_tls, caplog):
    caplog.set_level(logging.INFO, logger="phalanx.etcd_version")
    async with Store(etcd_endpoint, cluster_name, tls=etcd_agent_tls, timeout=10.0) as store:
        version = await etcd_version.report(store, who="agent n1", retry_s=0.1)
    said = [r for r in caplog.records if r.name == "phalanx.etcd_version"]
    assert len(said) == 1, [r.getMessage() for r in said]
    expected = etcd_version.advisories_for(version)
    assert said[0].levelno == (logging.WARNING if expected else logging.INFO)
    assert said[0].getMessage().startswith(f"agent n1: etcd {version}")
    for a in expected:
        assert a.id in said[0].getMessage()


async def test_a_coordinator_and_simulated_agents_say_it_once(local_cluster, caplog):
    c = local_cluster.start_coordinator(AZ, "c0")
    await local_cluster.wait_leader(AZ)
    deadline = time.monotonic() + 60
    while not _lines(c.log()) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    lines = _lines(c.log())
    assert len(lines) == 1, c.log()[-2000:]
    assert "WARNING" in lines[0] and "coordinator c0: etcd 3.4." in lines[0], lines[0]
    assert all(cve in lines[0] for cve in CVES) and "Production needs 3.4.44 / 3.5.30 / 3.6.11" in lines[0]

    caplog.set_level(logging.INFO, logger="phalanx.etcd_version")
    stop = asyncio.Event()
    task = asyncio.create_task(run_agents(
        cluster=local_cluster.cluster, az=AZ, etcd=local_cluster.etcd, topologies=[dgx_node("n1", AZ), dgx_node("n2", AZ)],
        timings=local_cluster.timings, ready_line=False, stop_event=stop,
        # The legacy path (agents on etcd, its agent user): agents reading
        # through the coordinators reach no etcd and say nothing of it.
        tls_dir=local_cluster.agents_tls(["n1", "n2"])["tls_dir"], etcd_tls=local_cluster.etcd_pki.role(
            local_cluster.cluster, "agent")))
    try:
        said: list[logging.LogRecord] = []
        while not said and not task.done() and time.monotonic() < deadline + 60:
            said = [r for r in caplog.records if r.name == "phalanx.etcd_version"]
            await asyncio.sleep(0.05)
        assert said, "the simulated agents never said which advisories apply"
        assert said[0].levelno == logging.WARNING and said[0].getMessage().startswith(f"agent.sim {AZ}: etcd 3.4.")
        assert all(cve in said[0].getMessage() for cve in CVES)
        assert len(said) == 1, "one line per process, not one per node"
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert len([r for r in caplog.records if r.name == "phalanx.etcd_version"]) == 1


async def test_a_real_agent_process_says_it_once(local_cluster, tmp_path):
    c = local_cluster
    log = tmp_path / "agent-n0.log"
    p = procs.spawn(
        [sys.executable, "-m", "agent", "--cluster", c.cluster, "--az", AZ, "--etcd", c.etcd, "--node", "n0",
         "--spine", "s0", "--leaf", "l0", "--state-dir", str(tmp_path / "state"), "--timings", c._timings_json(),
         "--simulate-members", "--log-level", "INFO",
         "--nvml-recording", str(REPO / "tests/fixtures/topology/hgx-h100/nvml.json"),
         "--sysfs-recording", str(REPO / "tests/fixtures/topology/hgx-h100/sysfs.json"),
         # The legacy path explicitly: an agent on --etcd with the agent user.
         "--tls-dir", str(c.pki.agent("n0").ca.parent), "--etcd-tls-dir", str(c.etcd_tls_dir("agent"))],
        die_with_parent=procs.TERM, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=REPO,
        env=dict(os.environ),
    )
    try:
        ready, _, _ = select.select([p.stdout], [], [], 60)
        assert ready and "PHALANX_AGENT_READY" in p.stdout.readline(), log.read_text()
        deadline = time.monotonic() + 60
        while not _lines(log.read_text()) and p.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        lines = _lines(log.read_text())
        assert len(lines) == 1, log.read_text()[-2000:]
        assert "WARNING" in lines[0] and "agent n0: etcd 3.4." in lines[0] and all(cve in lines[0] for cve in CVES)
    finally:
        p.terminate()
        p.wait(30)


def test_phalanx_up_says_it_once(tmp_path: Path) -> None:
    from phalanx.up import UpProcess

    up = UpProcess(["--no-workload", "--azs", "1", "--coordinators-per-az", "1", "--nodes-per-az", "1",
                    "--base-port", "0"], env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        up.start()
        said = [ln for ln in up.lines if "advisories" in ln]
        assert len(said) == 1, "\n".join(up.lines)
        assert said[0].startswith("phalanx up: warning: etcd: etcd 3.4.") and all(cve in said[0] for cve in CVES)
    finally:
        assert up.stop(signal.SIGINT) == 0
