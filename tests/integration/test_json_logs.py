"""--log-format json on a real coordinator and a real agent (real members):
every line either writes to stderr is one JSON object with the fields of
docs/logging.md, the leader's admission of a gang names the gang and a
stimulus id, and the agent's launch of a member names gang, incarnation and
node, and the stimulus of the admission that sent it."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx import procs
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import REPO, TERMINAL, LocalCluster, dgx_node, stop_agent_then_coordinator, tiny
from tests.members import MEMBER_PYTHON, member_tmp, writable  # noqa: F401 (member_tmp: a fixture)

pytestmark = pytest.mark.integration
AZ = "az-a"
REQUIRED = ("time", "level", "component", "az", "epoch", "logger", "message")


@pytest.fixture
def tmp_path(member_tmp: Path) -> Path:
    """A directory members can reach (they run as nobody when the suite runs
    as root)."""
    return writable(member_tmp / "t")


def json_lines(path: Path) -> list[dict]:
    """Every line of a process's stderr, parsed; a line that is not one JSON
    object fails the test with the line."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            obj = json.loads(line)
        except ValueError:
            pytest.fail(f"{path.name} line {n} is not JSON: {line[:300]!r}")
        assert isinstance(obj, dict), f"{path.name} line {n}: {line[:300]!r}"
        missing = [k for k in REQUIRED if k not in obj]
        assert not missing, f"{path.name} line {n} lacks {missing}: {line[:300]!r}"
        out.append(obj)
    return out


def start_agent(c: LocalCluster, node: str, state_dir: Path) -> subprocess.Popen:
    log = c.workdir / f"agent-{node}.log"
    p = procs.spawn(
        [sys.executable, "-m", "agent", "--cluster", c.cluster, "--az", AZ, "--node", node,
         "--spine", "s0", "--leaf", "l0", "--state-dir", str(state_dir), "--timings", c._timings_json(),
         "--log-level", "INFO", "--log-format", "json",
         "--nvml-recording", str(REPO / "tests/fixtures/topology/hgx-h100/nvml.json"),
         "--sysfs-recording", str(REPO / "tests/fixtures/topology/hgx-h100/sysfs.json"), *c.agent_args(node)],
        die_with_parent=procs.TERM, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=REPO, env=dict(os.environ),
    )
    ready, _, _ = select.select([p.stdout], [], [], 30)
    assert ready and "PHALANX_AGENT_READY" in p.stdout.readline(), log.read_text()
    return p


async def test_json_logs_of_a_gang_from_submission_to_launch(local_cluster: LocalCluster, tmp_path: Path) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "a0", extra_args=["--log-format", "json"])
    leader = await c.wait_leader(AZ)
    agent = start_agent(c, "n0", tmp_path / "state-n0")
    try:
        await c.wait_nodes_ready(AZ, 1)
        spec = pb.GangSpec(name="logged", members=2, resources=pb.Resources(gpus=4),
                           run=pb.RunSpec(command=[MEMBER_PYTHON, "-c", "pass"]))
        g = await c.submit(spec)
        done = await c.wait_state(g.id, TERMINAL, timeout=60)
        assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    finally:
        # Stopped before reading: the shutdown lines are checked too.
        stop_agent_then_coordinator(agent, coord)

    cl = json_lines(coord.log_path)
    al = json_lines(c.workdir / "agent-n0.log")
    assert all(x["component"] == "coordinator" and x["az"] == AZ and x["id"] == "a0" for x in cl)
    assert all(x["component"] == "agent" and x["az"] == AZ and x["node"] == "n0" for x in al)

    mine = [x for x in cl if x.get("gang") == g.id]
    submitted = [x for x in mine if "submitted" in x["message"]]
    admitted = [x for x in mine if "admitted" in x["message"]]
    assert len(submitted) == 1 and len(admitted) == 1, [x["message"] for x in mine]
    adm = admitted[0]
    # The admission is a decision of one admission cycle of this leadership.
    assert adm["epoch"] == leader.epoch and adm["incarnation"] == 1
    assert isinstance(adm["stimulus"], str) and adm["stimulus"].startswith(f"{AZ}-")
    assert submitted[0]["stimulus"] != adm["stimulus"]  # the RPC and the cycle are different stimuli
    # The end is decided on a member report: a stimulus of its own, same gang.
    ended = [x for x in mine if "-> SUCCEEDED" in x["message"]]
    assert len(ended) == 1 and ended[0]["incarnation"] == 1
    assert ended[0]["stimulus"] not in (adm["stimulus"], submitted[0]["stimulus"])

    launched = [x for x in al if "launched" in x["message"]]
    assert len(launched) == 2, [x["message"] for x in al]
    for x in launched:
        assert (x["gang"], x["incarnation"], x["node"], x["epoch"]) == (g.id, 1, "n0", leader.epoch)
        # Followed from the decision into the other process: the assignment
        # carried the admission's stimulus id.
        assert x["stimulus"] == adm["stimulus"]
    # A member's exit is the agent's own stimulus: "<node>-N", one per exit.
    exits = [x for x in al if "exited" in x["message"] and x["logger"] == "agent.session"]
    assert len(exits) == 2 and all(x["gang"] == g.id and x["stimulus"].startswith("n0-") for x in exits)
    assert len({x["stimulus"] for x in exits}) == 2


async def test_json_logs_of_a_cross_az_gang_carry_the_two_phase_stimulus_ids(local_cluster: LocalCluster) -> None:
    c = local_cluster
    coords = [c.start_coordinator(az, f"{az[-1]}0", extra_args=["--log-format", "json"]) for az in ("az-a", "az-b")]
    epochs = {}
    for az in ("az-a", "az-b"):
        epochs[az] = (await c.wait_leader(az)).epoch
        c.start_agents(az, [dgx_node(f"{az[-1]}n0", az)])
    for az in ("az-a", "az-b"):
        await c.wait_nodes_ready(az, 1)
    try:
        g = await c.submit(tiny("spread", members=2, gpus=8, duration=0.5,
                                topology=pb.TopologyConstraint(allow_cross_az=True)), address=coords[0].address)
        done = await c.wait_state(g.id, TERMINAL, timeout=60)
        assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
        assert sorted(m.az for m in done.placement) == ["az-a", "az-b"]
    finally:
        for co in coords:
            co.signal(signal.SIGTERM)
            co.proc.wait(20)

    owner, participant = (json_lines(co.log_path) for co in coords)
    # The owner decides; the participant dispatches its slice: each line of
    # the protocol names the gang and the stimulus of the event behind it.
    decided = [x for x in owner if x.get("gang") == g.id and "decided" in x["message"]]
    dispatched = [x for x in participant if x.get("gang") == g.id and "dispatching" in x["message"]]
    assert len(decided) == 1 and len(dispatched) == 1, ([x["message"] for x in owner], [x["message"] for x in participant])
    for x in decided + dispatched:
        assert x["incarnation"] == 1 and isinstance(x["stimulus"], str) and x["stimulus"]
    # The owner learns the end from the members' summaries in etcd: the
    # decision names the watch event (its revision) it acted on, or the
    # admission cycle whose periodic re-evaluation saw it first.
    ended = [x for x in owner if x.get("gang") == g.id and "-> SUCCEEDED" in x["message"]]
    assert len(ended) == 1 and ended[0]["stimulus"].startswith(("watch:", "az-a-")), ended
    assert (decided[0]["az"], decided[0]["epoch"]) == ("az-a", epochs["az-a"])
    assert (dispatched[0]["az"], dispatched[0]["epoch"]) == ("az-b", epochs["az-b"])
