"""Following a decision back to its stimulus on a real cluster (real etcd, a
real coordinator and agent, real members; docs/design.md §19.5): every event
of a gang's history names the stimulus of the decision that wrote it, the
coordinator logged that decision under the same id, each decision of the
gang's life (reserve, dispatch, start, finish, release) has a line of its
own, `phalanx describe` shows the ids, and the chaos recorder's history of
the same etcd leads a violation's gang back to them."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from chaos import recorder
from chaos.history import Tracer, etcd_event, gang_observations
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import REPO, TERMINAL, LocalCluster, stop_agent_then_coordinator
from tests.integration.test_json_logs import json_lines, start_agent
from tests.members import MEMBER_PYTHON, member_tmp, writable  # noqa: F401 (member_tmp: a fixture)

pytestmark = pytest.mark.integration
AZ = "az-a"


@pytest.fixture
def tmp_path(member_tmp: Path) -> Path:
    return writable(member_tmp / "t")


async def test_each_event_leads_back_to_the_log_lines_of_its_decision(local_cluster: LocalCluster, tmp_path: Path) -> None:
    c = local_cluster
    # The session's etcd compacts history older than a few minutes: the
    # recorder below replays this test's, from here.
    first = await c.store.revision()
    coord = c.start_coordinator(AZ, "a0", extra_args=["--log-format", "json"])
    await c.wait_leader(AZ)
    agent = start_agent(c, "n0", tmp_path / "state-n0")
    try:
        await c.wait_nodes_ready(AZ, 1)
        g = await c.submit(pb.GangSpec(name="traced", members=2, resources=pb.Resources(gpus=4),
                                       run=pb.RunSpec(command=[MEMBER_PYTHON, "-c", "import time; time.sleep(2)"])))
        done = await c.wait_state(g.id, TERMINAL, timeout=60)
        assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
        d = subprocess.run([sys.executable, "-m", "phalanx", "describe", g.id, "--address", coord.address],
                           capture_output=True, text=True, cwd=REPO, env=c.client_env(), timeout=60)
        assert d.returncode == 0, d.stderr
    finally:
        stop_agent_then_coordinator(agent, coord)

    events = {e.kind: e for e in done.events}
    assert list(events) == ["submitted", "placed", "reserved", "started", "finished"], [e.message for e in done.events]
    assert all(e.stimulus.startswith(f"{AZ}-") for e in done.events), [(e.kind, e.stimulus) for e in done.events]
    # Placed and reserved are one decision (one admission cycle, one write).
    assert events["placed"].stimulus == events["reserved"].stimulus
    assert len({events[k].stimulus for k in ("submitted", "reserved", "started")}) == 3

    mine = [x for x in json_lines(coord.log_path) if x.get("gang") == g.id]
    by_stimulus: dict[str, list[str]] = {}
    for x in mine:
        by_stimulus.setdefault(x.get("stimulus", ""), []).append(x["message"])
    # Each event's stimulus is on the coordinator's lines of that decision.
    assert any("submitted to queue" in m for m in by_stimulus.get(events["submitted"].stimulus, [])), by_stimulus
    admission = by_stimulus.get(events["reserved"].stimulus, [])
    assert any(" admitted: " in m for m in admission), by_stimulus
    assert any(" dispatched to n0" in m for m in admission), by_stimulus  # the dispatch follows the admission
    # (A gang whose members all exit before the leader sees them running
    # records "started" with its end: the same decision then.)
    assert any(("-> RUNNING" in m or "-> SUCCEEDED" in m) for m in by_stimulus.get(events["started"].stimulus, [])), by_stimulus
    assert any("-> SUCCEEDED" in m for m in by_stimulus.get(events["finished"].stimulus, [])), by_stimulus
    # Every decision of the gang's life has a line of its own, with a
    # stimulus; the release goes with the end when no member is left.
    for what in (" admitted: ", " dispatched to ", "-> STARTING", "-> SUCCEEDED", "released"):
        lines = [x for x in mine if what in x["message"]]
        assert len(lines) == 1 and lines[0].get("stimulus"), (what, [x["message"] for x in mine])

    shown = d.stdout[d.stdout.index("\nevents:\n"):].splitlines()[2:]
    assert [line.rsplit("[stimulus=", 1)[-1].rstrip("]") for line in shown] == [e.stimulus for e in done.events], d.stdout

    # The chaos recorder, watching this etcd from the test's start, keeps them: the
    # history names the stimulus of every gang write that added events, and
    # the tracer a violation uses leads from the gang to its admission.
    out, stop = io.StringIO(), asyncio.Event()
    task = asyncio.create_task(recorder.watch(c.store, out, stop, start=first))
    try:
        for _ in range(300):
            if f'"rev":{done.mod_revision},' in out.getvalue():
                break
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    history = [etcd_event(json.loads(line)) for line in out.getvalue().splitlines()]
    writes = [o for o in gang_observations(history)[g.id] if o.kinds]
    assert all(o.stimuli for o in writes), writes
    assert [s for o in writes for s in o.stimuli] == list(dict.fromkeys(e.stimulus for e in done.events)), writes
    assert Tracer(history).lines([f"gang {g.id} left RUNNING"]) == (
        f"traced: {g.id}#1: submitted by stimulus {events['submitted'].stimulus} (rev {writes[0].rev}); "
        f"placed by stimulus {events['placed'].stimulus} (rev {writes[1].rev}); "
        f"reserved by stimulus {events['reserved'].stimulus} (rev {writes[1].rev})",)
