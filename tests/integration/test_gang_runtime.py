"""Run-time semantics with REAL member processes (issue: node agents that
enforce reservations and launch real gang members)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.launcher import MemberKey
from agent.shim import read_exit_record
from phalanx import procs as phalanx_procs  # (tests here name their process lists procs)
from phalanx.member_logs import member_exit_path
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import REPO, TERMINAL, LocalCluster, dgx_node
from tests.members import MEMBER_PYTHON, member_tmp, writable  # noqa: F401 (member_tmp: a fixture)

pytestmark = pytest.mark.integration
AZ = "az-a"


@pytest.fixture
def tmp_path(member_tmp: Path) -> Path:
    """Here ``tmp_path`` is a directory members can reach (they run as nobody
    when the suite runs as root); ``writable`` makes their output dirs."""
    return writable(member_tmp / "t")

# A member that records its environment, then runs until told to stop.
ENV_DUMP = (
    "import json, os, sys, time; "
    "d = {k: v for k, v in os.environ.items() if k.startswith(('PHALANX_', 'RANK', 'WORLD_SIZE', 'LOCAL_', 'MASTER_', 'CUDA_', 'NCCL_'))}; "
    "p = os.path.join(sys.argv[1], 'rank-%s-inc-%s.json' % (os.environ['RANK'], os.environ['PHALANX_INCARNATION'])); "
    "open(p + '.tmp', 'w').write(json.dumps(d)); os.replace(p + '.tmp', p); "
    "time.sleep(float(sys.argv[2]))"
)


def member(out: Path, seconds: float) -> list[str]:
    return [MEMBER_PYTHON, "-c", ENV_DUMP, str(out), str(seconds)]


def agent_proc(c: LocalCluster, node: str, state_dir: Path, history: Path, failpoints: Path | None = None, leaf: str = "l0",
               extra: tuple[str, ...] = ()) -> subprocess.Popen:
    env = dict(os.environ)
    if failpoints is not None:
        env["PHALANX_FAILPOINTS_FILE"] = str(failpoints)
    p = phalanx_procs.spawn(
        [sys.executable, "-m", "agent", "--cluster", c.cluster, "--az", AZ, "--node", node,
         "--spine", "s0", "--leaf", leaf, "--state-dir", str(state_dir), "--history", str(history),
         "--timings", c._timings_json(), "--log-level", "INFO",
         "--nvml-recording", str(REPO / "tests/fixtures/topology/hgx-h100/nvml.json"),
         "--sysfs-recording", str(REPO / "tests/fixtures/topology/hgx-h100/sysfs.json"), *c.agent_args(node), *extra],
        die_with_parent=phalanx_procs.TERM, stdout=subprocess.PIPE, stderr=open(c.workdir / f"agent-{node}.log", "a"), text=True,
        cwd=REPO, env=env,
    )
    ready, _, _ = select.select([p.stdout], [], [], 30)
    assert ready and "PHALANX_AGENT_READY" in p.stdout.readline(), (c.workdir / f"agent-{node}.log").read_text()
    return p


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gang_pids(gang_id: str) -> set[int]:
    """Live processes (shims and members) of a gang on this host, found by the
    environment the agent gave them: what runs, whatever any record says."""
    pids = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                environ = (p / "environ").read_bytes()
                zombie = (p / "stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"Z"
            except (OSError, IndexError):
                continue
            if f"PHALANX_GANG={gang_id}\0".encode() in environ and not zombie:
                pids.add(int(p.name))
    return pids


def live_intervals(evs: list[dict]) -> dict[str, tuple[float, float]]:
    """member key -> (start, end) on the agents' monotonic clock (one host)."""
    out: dict[str, list[float]] = {}
    for e in evs:
        if e["event"] == "member_started":
            out[e["key"]] = [e["mono"], float("inf")]
        elif e["event"] == "member_exited" and e["key"] in out:
            out[e["key"]][1] = e["mono"]
    return {k: (a, b) for k, (a, b) in out.items()}


def incarnations_overlap(intervals: dict[str, tuple[float, float]], gang: str) -> list[str]:
    by_inc: dict[int, list[tuple[float, float]]] = {}
    for key, iv in intervals.items():
        g, rest = key.split("#")
        if g == gang:
            by_inc.setdefault(int(rest.split("/")[0]), []).append(iv)
    bad = []
    incs = sorted(by_inc)
    for a in incs:
        for b in incs:
            if a < b:
                last_a = max(e for _, e in by_inc[a])
                first_b = min(s for s, _ in by_inc[b])
                if first_b < last_a:
                    bad.append(f"incarnation {b} started at {first_b:.2f} before {a} ended at {last_a:.2f}")
    return bad


@pytest.fixture
async def two_agents(local_cluster: LocalCluster, tmp_path: Path):
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    procs = {}
    for n in ("n0", "n1"):
        procs[n] = agent_proc(c, n, tmp_path / f"state-{n}", tmp_path / f"hist-{n}.jsonl", tmp_path / f"fp-{n}")
    await c.wait_nodes_ready(AZ, 2)
    yield c, procs
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
        p.stdout.close()


async def test_members_see_exactly_their_environment(two_agents, tmp_path: Path) -> None:
    c, _ = two_agents
    out = tmp_path / "env"
    writable(out)
    spec = pb.GangSpec(name="envs", members=4, resources=pb.Resources(gpus=4, rdma_nics=4), run=pb.RunSpec(command=member(out, 0.5)))
    g = await c.submit(spec)
    done = await c.wait_state(g.id, TERMINAL, timeout=60)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    envs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert sorted(int(e["RANK"]) for e in envs) == [0, 1, 2, 3]
    placed = {m.rank: m for m in done.placement}
    seen_devices = set()
    for e in envs:
        m = placed[int(e["RANK"])]
        assert e["WORLD_SIZE"] == "4" and e["PHALANX_GANG"] == g.id and e["PHALANX_INCARNATION"] == "1"
        assert e["CUDA_VISIBLE_DEVICES"] == ",".join(str(x) for x in m.gpus)
        assert sorted(e["NCCL_IB_HCA"].lstrip("=").split(",")) == sorted(m.nics)
        assert e["PHALANX_NODE"] == m.node
        for gpu in m.gpus:
            assert (m.node, gpu) not in seen_devices
            seen_devices.add((m.node, gpu))
        assert e["LOCAL_WORLD_SIZE"] == "2" and e["LOCAL_RANK"] in ("0", "1")
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1


async def test_killed_member_restarts_the_whole_gang_one_incarnation_at_a_time(two_agents, tmp_path: Path) -> None:
    c, _ = two_agents
    out = tmp_path / "env"
    writable(out)
    spec = pb.GangSpec(name="restart-me", members=2, resources=pb.Resources(gpus=8),
                       run=pb.RunSpec(command=member(out, 300)), policy=pb.Policy(max_restarts=2))
    g = await c.submit(spec)
    await c.wait_state(g.id, {pb.GANG_STATE_RUNNING}, timeout=60)
    for _ in range(200):  # RUNNING means started; the file comes a moment later
        if (out / "rank-1-inc-1.json").exists():
            break
        await asyncio.sleep(0.05)
    victim = json.loads((out / "rank-1-inc-1.json").read_text())
    matches = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                environ = (p / "environ").read_bytes()
                ppid = int((p / "stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if f"PHALANX_GANG={g.id}".encode() in environ and b"RANK=1\0" in environ and b"PHALANX_INCARNATION=1\0" in environ:
                matches.append((int(p.name), ppid))
    # Members run under their fencing shim (agent/shim.py), which carries the
    # same environment: kill the member itself, the one whose parent is a match.
    pids = {pid for pid, _ in matches}
    children = [pid for pid, ppid in matches if ppid in pids]
    pid = children[0] if children else (matches[0][0] if matches else None)
    assert pid is not None and victim["RANK"] == "1"
    os.kill(pid, signal.SIGKILL)
    for _ in range(300):
        cur = await c.stub().GetGang(gpb.GetGangRequest(id=g.id))
        if cur.incarnation == 2 and cur.state == pb.GANG_STATE_RUNNING:
            break
        await asyncio.sleep(0.1)
    assert cur.incarnation == 2 and cur.restarts == 1 and cur.state == pb.GANG_STATE_RUNNING, cur
    # Why it restarted, in the gang's own history (its reason now says why it
    # is RUNNING): the killed rank, on its node, with the signal's status.
    killed = f"rank 1 on {victim['PHALANX_NODE']} exited with code -9"
    restarting = [e.message for e in cur.events if e.kind == "restarting"]
    assert len(restarting) == 1 and "incarnation 1 -> 2 (restart 1 of 2)" in restarting[0] \
        and restarting[0].endswith(f"after: {killed}"), restarting
    exits = [(e.incarnation, e.rank, e.exit_code, e.message) for e in cur.events if e.kind == "member_exited"]
    assert exits == [(1, 1, -9, killed)], exits
    # Agents' own records: no process of incarnation 2 started before every
    # process of incarnation 1 had exited (one host: one monotonic clock).
    evs = events(tmp_path / "hist-n0.jsonl") + events(tmp_path / "hist-n1.jsonl")
    iv = live_intervals(evs)
    assert {k for k in iv if k.startswith(g.id)} >= {f"{g.id}#1/r0", f"{g.id}#1/r1", f"{g.id}#2/r0", f"{g.id}#2/r1"}
    assert incarnations_overlap(iv, g.id) == []
    await c.stub().CancelGang(gpb.CancelGangRequest(id=g.id))


async def test_cut_off_agent_fences_and_gang_is_replaced_only_after_its_deadline(local_cluster: LocalCluster, tmp_path: Path) -> None:
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    fp = tmp_path / "fp-n0"
    procs = [agent_proc(c, "n0", tmp_path / "s0", tmp_path / "h0.jsonl", fp),
             agent_proc(c, "n1", tmp_path / "s1", tmp_path / "h1.jsonl")]
    try:
        await c.wait_nodes_ready(AZ, 2)
        out = tmp_path / "env"
        writable(out)
        spec = pb.GangSpec(name="one-node", members=1, resources=pb.Resources(gpus=8), run=pb.RunSpec(command=member(out, 300)))
        g = await c.submit(spec)
        running = await c.wait_state(g.id, {pb.GANG_STATE_RUNNING})
        node = running.placement[0].node
        hist = tmp_path / ("h0.jsonl" if node == "n0" else "h1.jsonl")
        if node != "n0":
            pytest.fail("best fit + name tie-break places on n0")
        cut = time.time()  # n0 was in contact with the leader until now
        fp.write_text("agent.cut_off=on")  # n0 loses its coordinator; keeps running
        for _ in range(400):
            cur = await c.stub().GetGang(gpb.GetGangRequest(id=g.id))
            if cur.incarnation == 2 and cur.state == pb.GANG_STATE_RUNNING:
                break
            await asyncio.sleep(0.1)
        assert cur.incarnation == 2 and cur.placement[0].node == "n1", cur
        fenced = [e for e in events(hist) if e["event"] == "fenced"]
        assert fenced, "the cut-off agent must fence its members"
        exits = [e for e in events(hist) if e["event"] == "member_exited" and e["key"] == f"{g.id}#1/r0"]
        starts2 = [e for e in events(tmp_path / "h1.jsonl") if e["event"] == "member_started" and e["key"] == f"{g.id}#2/r0"]
        assert exits and starts2
        # Same host, so wall clocks agree: the new incarnation started after
        # the old member was gone, i.e. after the fence deadline.
        assert starts2[0]["wall"] > exits[0]["wall"]
        # The deadline itself (a lower bound: a safety property, not a speed).
        # The leader re-places a silent node's work replace_after_s =
        # fence_after_s + replace_margin_s after its last contact with it,
        # and that contact was at most a heartbeat or two before the cut; the
        # margin covers that, so nothing may start before cut + fence_after_s,
        # when n0's members could still be running on their own lease.
        t = c.timings
        assert t.replace_after_s == t.fence_after_s + t.replace_margin_s and t.replace_margin_s >= 2 * t.heartbeat_interval_s
        assert starts2[0]["wall"] >= cut + t.fence_after_s, (
            f"re-placed {starts2[0]['wall'] - cut:.2f}s after the cut, before fence_after_s={t.fence_after_s}")
        print(f"\nfenced {fenced[0]['silent_s']:.2f}s after last valid contact (fence_after_s={t.fence_after_s}); "
              f"re-placed {starts2[0]['wall'] - cut:.2f}s after the cut (replace_after_s={t.replace_after_s}), "
              f"{starts2[0]['wall'] - exits[0]['wall']:.2f}s after the old member stopped")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)
            p.stdout.close()


@pytest.fixture
def restart_fits_fence(local_cluster: LocalCluster) -> LocalCluster:
    """The cluster's Timings with a fence deadline an agent restart fits in
    comfortably: with the fast 4 s, a restart slowed by a loaded host (a
    new interpreter, its imports, registration) let the shims fence and the
    leader re-place the kept gang, which is not what the test is about.
    Requested before ``two_agents``, so its coordinator and agents get it."""
    local_cluster.timings = dataclasses.replace(local_cluster.timings, fence_after_s=20.0).validate()
    return local_cluster


async def test_restarted_agent_adopts_members_and_stops_unreserved_ones(restart_fits_fence, two_agents,
                                                                        tmp_path: Path) -> None:
    c, procs = two_agents
    out = tmp_path / "env"
    writable(out)
    keep = await c.submit(pb.GangSpec(name="keep", members=1, resources=pb.Resources(gpus=4), run=pb.RunSpec(command=member(out, 300))))
    drop = await c.submit(pb.GangSpec(name="drop", members=1, resources=pb.Resources(gpus=4), run=pb.RunSpec(command=member(out, 300))))
    k = await c.wait_state(keep.id, {pb.GANG_STATE_RUNNING})
    d = await c.wait_state(drop.id, {pb.GANG_STATE_RUNNING})
    assert k.placement[0].node == d.placement[0].node == "n0"
    # (RUNNING: the shims run; a member's own process may follow a moment later.)
    kept, dropped = gang_pids(keep.id), gang_pids(drop.id)
    assert kept and dropped and not kept & dropped, (kept, dropped)
    stray = phalanx_procs.spawn([sys.executable, "-c", "import time; time.sleep(300)"], die_with_parent=phalanx_procs.KILL)
    try:
        procs["n0"].send_signal(signal.SIGKILL)  # members live on in their own groups
        procs["n0"].wait(10)
        await c.stub().CancelGang(gpb.CancelGangRequest(id=drop.id))  # its reservation goes while the agent is down
        # No agent runs on n0 now, so nothing can have stopped the member yet
        # (the leader's release of its devices is a record in etcd, not a
        # signal): it still runs, and whatever stops it from here on is the
        # restarted agent (or its shim fencing, which is ruled out below).
        assert gang_pids(drop.id) >= dropped
        restarted = time.time()
        procs["n0"] = agent_proc(c, "n0", tmp_path / "state-n0", tmp_path / "hist-n0.jsonl")
        for _ in range(200):
            if not (await c.etcd_reservations()).get((AZ, drop.id)):
                break
            await asyncio.sleep(0.1)
        assert (await c.etcd_reservations()).get((AZ, drop.id)) is None
        cur = await c.stub().GetGang(gpb.GetGangRequest(id=keep.id))
        assert cur.state == pb.GANG_STATE_RUNNING and cur.incarnation == 1, "adopted, not restarted"
        # The unreserved member is stopped by the restarted agent: its
        # processes are gone, the agent's own history says it exited STOPPED
        # (a stop the agent asked for), and its shim's exit record says it was
        # signalled, not fenced.
        drop_key = f"{drop.id}#1/r0"
        for _ in range(200):
            exited = [e for e in events(tmp_path / "hist-n0.jsonl")
                      if e["event"] == "member_exited" and e["key"] == drop_key and e["wall"] > restarted]
            if exited and not gang_pids(drop.id):
                break
            await asyncio.sleep(0.1)
        assert gang_pids(drop.id) == set(), "the unreserved member still runs"
        assert [e["phase"] for e in exited] == ["STOPPED"], exited
        record = read_exit_record(member_exit_path(tmp_path / "state-n0", MemberKey(drop.id, 1, 0)))
        assert record is not None and record["signalled"] and not record["fenced"], record
        evs = events(tmp_path / "hist-n0.jsonl")
        assert [e for e in evs if e["event"] == "fenced"] == [], "stopped by the agent, not by a fence"
        assert len([e for e in evs if e["event"] == "member_started" and e["key"].startswith(keep.id)]) == 1, "not duplicated"
        assert gang_pids(keep.id) >= kept, ("the reserved member runs on, untouched", kept, gang_pids(keep.id))
        assert stray.poll() is None, "a process the agent did not start is left alone"
    finally:
        stray.kill()
        stray.wait()
    await c.stub().CancelGang(gpb.CancelGangRequest(id=keep.id))
