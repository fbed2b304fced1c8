"""End to end: real agent processes discover different recorded machines,
register, and the API shows (and placement uses) what they discovered."""

from __future__ import annotations

import os
import select
import subprocess
import sys

import pytest

from phalanx import procs as phalanx_procs  # (tests here name their process lists procs)
from phalanx import wire
from phalanx.topology_view import render_tree
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import REPO, TERMINAL, LocalCluster

pytestmark = pytest.mark.integration
AZ = "az-a"
FIX = REPO / "tests" / "fixtures" / "topology"


def start_agent(c: LocalCluster, node: str, fixture: str, *, leaf: str, spine: str = "s1") -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "agent", "--cluster", c.cluster, "--az", AZ, "--node", node,
        "--spine", spine, "--leaf", leaf, "--simulate-members", "--timings", c._timings_json(),
        "--nvml-recording", str(FIX / fixture / "nvml.json"), "--sysfs-recording", str(FIX / fixture / "sysfs.json"),
        "--log-level", "WARNING", *c.agent_args(node),
    ]
    # No --state-dir: the agent makes a throw-away one under TMPDIR.
    tmp = c.workdir / "agent-tmp"
    tmp.mkdir(exist_ok=True)
    p = phalanx_procs.spawn(cmd, die_with_parent=phalanx_procs.TERM, stdout=subprocess.PIPE,
                            stderr=open(c.workdir / f"agent-{node}.log", "w"), text=True, cwd=REPO,
                            env=dict(os.environ, TMPDIR=str(tmp)))
    ready, _, _ = select.select([p.stdout], [], [], 30)
    line = p.stdout.readline() if ready else ""
    assert "PHALANX_AGENT_READY" in line, (c.workdir / f"agent-{node}.log").read_text()
    return p


async def test_agents_with_different_fixtures_register_and_placement_uses_them(local_cluster: LocalCluster) -> None:
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    procs = [
        start_agent(c, "hgx-1", "hgx-h100", leaf="l1"),
        start_agent(c, "hgx-2", "hgx-h100", leaf="l1"),
        start_agent(c, "l40s-1", "l40s-pcie", leaf="l2"),
    ]
    try:
        await c.wait_nodes_ready(AZ, 3)
        nodes = (await c.stub().ListNodes(gpb.ListNodesRequest(az=AZ))).nodes
        by = {n.topology.node: n for n in nodes}
        assert set(by) == {"hgx-1", "hgx-2", "l40s-1"}
        hgx, l40s = by["hgx-1"].topology, by["l40s-1"].topology
        assert [g.model for g in hgx.gpus].count(hgx.gpus[0].model) == 8 and "H100" in hgx.gpus[0].model
        assert len({g.nvlink_island for g in hgx.gpus}) == 1, "NVSwitch: one NVLink island"
        assert len({g.nvlink_island for g in l40s.gpus}) >= 4, "PCIe-only: no shared NVLink island"
        rails = sorted(n.rail for n in hgx.nics if n.rail >= 0)
        assert rails == list(range(8))
        assert "nvml" in hgx.sources and "sysfs" in hgx.sources
        tree = render_tree([(wire.topology_from_pb(n.topology), frozenset(n.used_gpus), n.ready) for n in nodes])
        assert "hgx-1" in tree and "l40s-1" in tree and "l1" in tree

        # A 2x8 H100 gang must land on the two HGX nodes (model filter),
        # each member with its GPU-affine RoCE NICs.
        spec = pb.GangSpec(name="h100-job", members=2, resources=pb.Resources(gpus=8, gpu_model="H100", rdma_nics=8),
                           run=pb.RunSpec(duration_s=0.5))
        g = await c.submit(spec)
        done = await c.wait_state(g.id, TERMINAL)
        assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
        assert {m.node for m in done.placement} == {"hgx-1", "hgx-2"}
        assert done.span == pb.TOPOLOGY_LEVEL_LEAF
        for m in done.placement:
            assert len(m.nics) == 8 and len(set(m.nics)) == 8

        # A gang that needs more H100s than were discovered can never fit:
        # it fails at once, naming the discovered capacity (docs/admission.md).
        big = pb.GangSpec(name="too-big", members=3, resources=pb.Resources(gpus=8, gpu_model="H100"))
        g2 = await c.submit(big)
        failed = await c.wait_state(g2.id, TERMINAL)
        assert failed.state == pb.GANG_STATE_FAILED
        assert "never fits: needs 24 H100 GPUs, the most it may span holds 16" in failed.reason, failed.reason
        ex = await c.stub().ExplainGang(gpb.ExplainGangRequest(id=g2.id))
        assert failed.reason in ex.summary, ex.summary
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(15)
            p.stdout.close()
    # Each agent removed the state dir it made for itself.
    assert list((c.workdir / "agent-tmp").iterdir()) == []
