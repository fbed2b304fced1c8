"""The Grafana dashboard and the alert rules (deploy/monitoring/) name only
metrics the processes really export: a real coordinator and a real agent
(``python -m coordinator`` / ``python -m agent`` with ``--metrics-listen``,
TLS, real etcd) are scraped over HTTPS with a client certificate of the
cluster's CA, and every metric name in the dashboard's queries and the
rules is among what they serve."""

from __future__ import annotations

import asyncio
import select
import subprocess
import sys

import pytest

from phalanx import procs
from phalanx.metrics import scrape
from tests.integration.harness import REPO, LocalCluster
from tests.unit.test_dashboards import all_references, exposed_names, missing

pytestmark = pytest.mark.integration
AZ = "az-a"
NODE = "dash-n1"
FIX = REPO / "tests" / "fixtures" / "topology" / "hgx-h100"


def start_agent(c: LocalCluster) -> tuple[subprocess.Popen, str]:
    """A real agent (recorded H100 topology) serving /metrics; returns the
    process and the metrics address from its ready line."""
    log = c.workdir / f"agent-{NODE}.log"
    p = procs.spawn(
        [sys.executable, "-m", "agent", "--cluster", c.cluster, "--az", AZ, "--node", NODE,
         "--timings", c._timings_json(), *c.agent_args(NODE), "--metrics-listen", "127.0.0.1:0",
         "--nvml-recording", str(FIX / "nvml.json"), "--sysfs-recording", str(FIX / "sysfs.json"),
         "--advertise-address", "127.0.0.1", "--state-dir", str(c.workdir / "agent-state"), "--log-level", "INFO"],
        die_with_parent=procs.TERM, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=REPO)
    ready, _, _ = select.select([p.stdout], [], [], 30)
    line = p.stdout.readline() if ready else ""
    if not line.startswith("PHALANX_AGENT_READY") or " metrics=" not in line:
        p.kill()
        p.wait(5)
        raise AssertionError(f"agent did not start with metrics: {line!r}\n{log.read_text()}")
    fields = dict(part.split("=", 1) for part in line.split()[1:])
    return p, fields["metrics"]


async def test_dashboard_and_alerts_name_only_exported_metrics(local_cluster: LocalCluster) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "c0", extra_args=["--metrics-listen", "127.0.0.1:0"])
    assert coord.metrics, "the coordinator's READY line has no metrics="
    await c.wait_leader(AZ)
    agent, agent_metrics = start_agent(c)
    try:
        await c.wait_nodes_ready(AZ, 1)
        tls = c.pki.client_files("viewer", "prometheus", ())  # what deploy/monitoring gives Prometheus
        texts = [await asyncio.to_thread(scrape, address, tls=tls, cluster=c.cluster)
                 for address in (coord.metrics, agent_metrics)]
    finally:
        agent.terminate()
        try:
            agent.wait(20)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(5)
        if agent.stdout:
            agent.stdout.close()
    coordinator_names, agent_names = exposed_names(texts[0]), exposed_names(texts[1])
    # Each scrape is the process's own: a coordinator's and an agent's metrics.
    assert "phalanx_is_leader" in coordinator_names and "phalanx_agent_fence_events_total" not in coordinator_names
    assert "phalanx_agent_fence_events_total" in agent_names and "phalanx_is_leader" not in agent_names
    refs = all_references()
    assert missing(refs, "\n".join(texts)) == []
    # Both kinds of process are on the dashboard.
    assert any(n in coordinator_names for n in refs) and any(n in agent_names for n in refs)
