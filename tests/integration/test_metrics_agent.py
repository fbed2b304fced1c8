"""An agent's /metrics (docs/metrics.md, "Agent"): a real ``python -m agent``
with real members and ``--metrics-listen``, under TLS, against a real
coordinator and etcd. The scrapes (HTTPS with an admin client certificate of
the cluster's CA, parsed with prometheus_client's parser) move exactly as the
test's members do: N started, one exited with code 3, a rank 0 refused for
its port counted under that reason, one self-fence when the leader goes
silent, and the session gauge and reconnects as the agent saw them. Also:
agent.sim's agents add up in one registry, and the refusals of a deposed
leader (test_agent_enforcement's scripted peer) land under their reasons."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from phalanx import procs
from phalanx.metrics import ScrapeError, scrape
from phalanx.v1 import types_pb2 as pb
from agent.metrics import AgentMetrics
from agent.sim import run_agents
from phalanx.timings import Timings
from coordinator.election import Election, LeaseSession
from phalanx.store import Delete
from phalanx.metrics import serve
from phalanx.tls import TlsFiles
from phalanx.v1 import agent_pb2 as apb
from phalanx.v1 import gang_pb2 as gpb
from tests.integration.harness import REPO, TERMINAL, LocalCluster, dgx_node, tiny
from tests.integration.test_agent_enforcement import T, Rig, assignment, commit, rig, wait_for  # noqa: F401 (rig: a fixture)
from tests.members import MEMBER_PYTHON, member_tmp, writable  # noqa: F401 (member_tmp: a fixture)

pytestmark = pytest.mark.integration
AZ = "az-a"
NODE = "metrics-n1"
FIX = REPO / "tests" / "fixtures" / "topology" / "hgx-h100"


@pytest.fixture
def tmp_path(member_tmp: Path) -> Path:
    """A directory members can reach (they run as nobody when the suite runs
    as root): the agent's state dir, with their work dirs, lives in it."""
    return writable(member_tmp / "t")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agent(c: LocalCluster, port: int, history: Path) -> tuple[subprocess.Popen, str]:
    """The agent with real members; its one rendezvous port is ``port``.
    Returns the process and the metrics address from its ready line."""
    log = c.workdir / f"agent-{NODE}.log"
    cmd = [
        sys.executable, "-m", "agent", "--cluster", c.cluster, "--az", AZ, "--node", NODE,
        "--timings", c._timings_json(), *c.agent_args(NODE), "--metrics-listen", "127.0.0.1:0",
        "--nvml-recording", str(FIX / "nvml.json"), "--sysfs-recording", str(FIX / "sysfs.json"),
        "--advertise-address", "127.0.0.1", "--rendezvous-ports", f"{port}-{port}",
        "--state-dir", str(c.workdir / "agent-state"), "--history", str(history), "--log-level", "INFO",
    ]
    p = procs.spawn(cmd, die_with_parent=procs.TERM, stdout=subprocess.PIPE, stderr=open(log, "a"), text=True, cwd=REPO)
    ready, _, _ = select.select([p.stdout], [], [], 30)
    line = p.stdout.readline() if ready else ""
    assert line.startswith("PHALANX_AGENT_READY") and " metrics=" in line, (line, log.read_text())
    fields = dict(part.split("=", 1) for part in line.split()[1:])
    return p, fields["metrics"]


def stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)
    if p.stdout:
        p.stdout.close()


class Scraper:
    """Scrapes one endpoint as the cluster's admin (a client certificate of its CA)."""

    def __init__(self, address: str, tls: TlsFiles, cluster: str):
        self.address, self.tls, self.cluster = address, tls, cluster

    @classmethod
    def of(cls, c: LocalCluster, address: str) -> "Scraper":
        return cls(address, c.pki.client_files("admin", "tester", ()), c.cluster)

    async def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """(sample name, sorted labels) -> value."""
        text = await asyncio.to_thread(scrape, self.address, tls=self.tls, cluster=self.cluster)
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    async def value(self, name: str, **labels: str) -> float:
        return (await self.samples())[(name, tuple(sorted(labels.items())))]

    async def wait(self, name: str, want: float, timeout: float = 30.0, **labels: str) -> None:
        deadline = time.monotonic() + timeout
        got = None
        while time.monotonic() < deadline:
            got = await self.value(name, **labels)
            if got == want:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{name}{labels} is {got}, not {want}, after {timeout}s")


def exited(s: dict, cls: str) -> float:
    return s[("phalanx_agent_members_exited_total", (("class", cls),))]


def refused(s: dict, reason: str) -> float:
    return s[("phalanx_agent_assignments_refused_total", (("reason", reason),))]


def fences(s: dict, kind: str) -> float:
    return s[("phalanx_agent_fence_events_total", (("kind", kind),))]


def history(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gang(name: str, members: int, command: list[str], **kw) -> pb.GangSpec:
    return pb.GangSpec(name=name, members=members, resources=pb.Resources(gpus=1),
                       run=pb.RunSpec(command=command), **kw)


async def test_agent_metrics_follow_its_members(local_cluster: LocalCluster, tmp_path: Path) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "c0")
    await c.wait_leader(AZ)
    port = free_port()
    hist = tmp_path / "history.jsonl"
    agent, address = start_agent(c, port, hist)
    try:
        m = Scraper.of(c, address)
        # TLS rules: no client certificate, no metrics.
        with pytest.raises(ScrapeError):
            await asyncio.to_thread(scrape, address, tls=None, cluster=c.cluster)
        await m.wait("phalanx_agent_sessions_connected", 1)
        s = await m.samples()
        assert s[("phalanx_agent_members_started_total", ())] == 0
        assert s[("phalanx_agent_members_running", ())] == 0

        # Two members that succeed, then one that exits 3 (no restart).
        ok = await c.submit(gang("ok", 2, [MEMBER_PYTHON, "-c", "pass"]))
        assert (await c.wait_state(ok.id, TERMINAL, 60)).state == pb.GANG_STATE_SUCCEEDED
        bad = await c.submit(gang("bad", 1, [MEMBER_PYTHON, "-c", "import sys; sys.exit(3)"], policy=pb.Policy(max_restarts=0)))
        assert (await c.wait_state(bad.id, TERMINAL, 60)).state == pb.GANG_STATE_FAILED
        await m.wait("phalanx_agent_members_exited_total", 1, **{"class": "error"})
        s = await m.samples()
        assert s[("phalanx_agent_members_started_total", ())] == 3
        assert s[("phalanx_agent_member_start_seconds_count", ())] == 3
        assert exited(s, "success") == 2 and exited(s, "error") == 1
        assert sum(exited(s, k) for k in ("fenced", "signal", "spawn_failed", "unknown")) == 0
        assert s[("phalanx_agent_members_running", ())] == 0
        assert s[("phalanx_agent_assignments_total", ())] >= 3
        assert sum(v for (name, _), v in s.items() if name == "phalanx_agent_assignments_refused_total") == 0
        # At least one check per gang (the members of a gang arriving together share one).
        assert s[("phalanx_agent_token_check_seconds_count", ())] >= 2

        # Rank 0's MASTER_PORT (the node's only rendezvous port) is taken: refused, with that reason.
        with socket.socket() as held:
            held.bind(("127.0.0.1", port))
            held.listen()
            blocked = await c.submit(gang("blocked", 1, [MEMBER_PYTHON, "-c", "pass"], policy=pb.Policy(max_restarts=0)))
            assert (await c.wait_state(blocked.id, TERMINAL, 60)).state == pb.GANG_STATE_FAILED
        s = await m.samples()
        refusals = [e for e in history(hist) if e["event"] == "assign_rejected_port"]
        assert refusals and refused(s, "port") == len(refusals)
        assert sum(refused(s, r) for r in ("token", "overlap", "run_as", "launch_failed")) == 0
        assert s[("phalanx_agent_members_started_total", ())] == 3  # nothing started

        # A running member, then a silent leader: one self-fence (by the agent
        # or by the member's shim, whichever got there first), the member ends.
        long = await c.submit(gang("long", 1, [MEMBER_PYTHON, "-c", "import time; time.sleep(120)"], policy=pb.Policy(max_restarts=0)))
        await c.wait_state(long.id, {pb.GANG_STATE_RUNNING}, 60)
        await m.wait("phalanx_agent_members_running", 1)
        coord.signal(signal.SIGSTOP)
        try:
            await m.wait("phalanx_agent_members_running", 0)
            await m.wait("phalanx_agent_sessions_connected", 0)
        finally:
            coord.signal(signal.SIGCONT)
        s = await m.samples()
        assert fences(s, "silence") + fences(s, "shim") == 1
        assert [e["by"] for e in history(hist) if e["event"] == "fenced"] == \
            ["agent" if fences(s, "silence") else "shim"]
        assert s[("phalanx_agent_members_started_total", ())] == 4
        assert exited(s, "signal") + exited(s, "fenced") == 1
        # Back with a leader: one more session, counted as a reconnect.
        await m.wait("phalanx_agent_sessions_connected", 1)
        connects = [e for e in history(hist) if e["event"] == "connected"]
        assert len(connects) >= 2
        assert await m.value("phalanx_agent_reconnects_total") == len(connects) - 1
        assert (await m.value("phalanx_agent_session_errors_total", kind="refused")) == 0
        assert (await m.value("phalanx_agent_session_errors_total", kind="tls")) == 0
    finally:
        stop(agent)


async def test_simulated_agents_of_one_process_add_up_in_one_registry(local_cluster: LocalCluster) -> None:
    """agent.sim's agents share one endpoint: no node label, sums."""
    c = local_cluster
    c.start_coordinator(AZ, "c0")
    await c.wait_leader(AZ)
    nodes = [dgx_node(f"msim-{i}", AZ) for i in range(3)]
    stop_agents = asyncio.Event()
    metrics = AgentMetrics()
    listen = f"127.0.0.1:{free_port()}"
    task = asyncio.create_task(run_agents(cluster=c.cluster, az=AZ, etcd=c.etcd, topologies=nodes, timings=c.timings,
                                          ready_line=False, stop_event=stop_agents, metrics=metrics,
                                          metrics_listen=listen, **c.agents_tls([n.node for n in nodes])))
    try:
        m = Scraper.of(c, listen)
        deadline = time.monotonic() + 30
        while True:  # the endpoint is up once run_agents has started it
            try:
                await m.samples()
                break
            except ScrapeError:
                assert time.monotonic() < deadline and not task.done(), "agent.sim's metrics never served"
                await asyncio.sleep(0.1)
        await m.wait("phalanx_agent_sessions_connected", 3)
        # One member per node (8 GPUs each): three agents, one set of counters.
        g = await c.submit(tiny("spread", members=3, gpus=8, duration=0.5))
        assert (await c.wait_state(g.id, TERMINAL, 60)).state == pb.GANG_STATE_SUCCEEDED
        await m.wait("phalanx_agent_members_exited_total", 3, **{"class": "success"})
        s = await m.samples()
        assert s[("phalanx_agent_members_started_total", ())] == 3
        assert s[("phalanx_agent_members_running", ())] == 0
        assert not any(k == "node" for (_, labels) in s for k, _ in labels)
    finally:
        stop_agents.set()
        await asyncio.gather(task, return_exceptions=True)


async def test_refusals_by_a_deposed_leader_are_counted_by_reason(rig: Rig, cluster_pki, cluster_name: str) -> None:
    """The scripted deposed leader of test_agent_enforcement against the real
    agent code: each refusal lands under its reason, served over TLS."""
    store, peer, lead, agent, history = rig.store, rig.peer, rig.lead, rig.agent, rig.history
    server, address = serve("127.0.0.1:0", agent.metrics.registry, tls=cluster_pki.agent("n0"), cluster=cluster_name)
    try:
        m = Scraper(address, cluster_pki.client_files("admin", "tester", ()), cluster_name)
        await asyncio.wait_for(peer.registered.wait(), 10)
        peer.send(lead.epoch, welcome=apb.Welcome(coordinator_id="scripted"))
        await m.wait("phalanx_agent_sessions_connected", 1)
        await commit(store, "ok", 1, [0, 1], lead.epoch)
        peer.send(lead.epoch, assign=assignment("ok", [0, 1]))
        await wait_for(lambda: any(e == "member_started" for e, _ in history))
        await commit(store, "overlap", 1, [1, 2], lead.epoch)
        peer.send(lead.epoch, assign=assignment("overlap", [1, 2]))
        await wait_for(lambda: any(e == "assign_rejected_overlap" for e, _ in history))
        peer.send(lead.epoch, assign=assignment("ghost", [5]))  # no reservation
        await wait_for(lambda: any(e == "assign_refused_token" and "ghost" in d["key"] for e, d in history))
        # Deposed: a successor holds the leader key.
        await store.txn([], [Delete(store.keys.leader(AZ))])
        session = await LeaseSession(store, T).start()
        try:
            successor = await Election(store, AZ, "successor", "127.0.0.1:1", T).campaign(session)
            await commit(store, "late", 1, [6], lead.epoch)
            peer.send(lead.epoch, assign=assignment("late", [6]))
            await wait_for(lambda: any(e == "assign_refused_token" and "late" in d["key"] for e, d in history))
            peer.send(lead.epoch, revoke=apb.Revocation(gang="ok", incarnation=1, reason="stale"))
            await wait_for(lambda: any(e == "revoke_refused_token" for e, _ in history))
            peer.send(successor.epoch, heartbeat_ack=apb.HeartbeatAck(seq=1))
            peer.send(lead.epoch, revoke=apb.Revocation(gang="ok", incarnation=1, reason="stale"))
            await wait_for(lambda: any(e == "stale_message_ignored" for e, _ in history))
        finally:
            await session.close()
        s = await m.samples()
        assert s[("phalanx_agent_assignments_total", ())] == 4
        assert s[("phalanx_agent_members_started_total", ())] == 1
        assert s[("phalanx_agent_members_running", ())] == 1
        assert {r: refused(s, r) for r in ("token", "overlap", "port", "run_as", "launch_failed")} == \
            {"token": 2, "overlap": 1, "port": 0, "run_as": 0, "launch_failed": 0}
        failures = {dict(labels)["reason"]: v for (name, labels), v in s.items()
                    if name == "phalanx_agent_token_check_failures_total"}
        # ghost: no reservation; late and the revoke: a deposed epoch.
        assert failures == {"not_leader": 2, "no_reservation": 1, "not_committed": 0, "torn_down": 0, "devices": 0,
                            "unconfirmed": 0, "denied": 0}
        assert fences(s, "token_refused") == 3 and fences(s, "stale_epoch") == 1
        assert fences(s, "silence") == 0 and fences(s, "shim") == 0
    finally:
        server.close()


async def test_a_restarted_agent_counts_the_members_it_adopts(etcd_endpoint: str, cluster_name: str,
                                                              tmp_path: Path) -> None:
    """started + adopted - exited = running across an agent restart: the new
    process started nothing and adopted both live members, whose ends it
    counts."""
    # A fence deadline the members outlive the agent's restart by, however
    # loaded the machine (their shims would fence them otherwise).
    # (A node expires only after it could be lost: later than that fence.)
    timings = dataclasses.replace(Timings.fast(), fence_after_s=30.0, node_expire_after_s=120.0).validate()
    c = await LocalCluster(etcd_endpoint, cluster_name, tmp_path, timings).start()
    try:
        c.start_coordinator(AZ, "c0")
        await c.wait_leader(AZ)
        port, hist = free_port(), tmp_path / "history.jsonl"
        agent, address = start_agent(c, port, hist)
        try:
            g = await c.submit(gang("survivor", 2, [MEMBER_PYTHON, "-c", "import time; time.sleep(300)"]))
            await c.wait_state(g.id, {pb.GANG_STATE_RUNNING}, 60)
            await Scraper.of(c, address).wait("phalanx_agent_members_running", 2)
            agent.kill()  # members keep running; the next agent adopts them
            agent.wait(10)
            agent.stdout.close()
            agent, address = start_agent(c, port, hist)
            m = Scraper.of(c, address)
            await m.wait("phalanx_agent_members_adopted_total", 2)
            s = await m.samples()
            assert s[("phalanx_agent_members_started_total", ())] == 0
            assert s[("phalanx_agent_orphans_killed_total", ())] == 0
            assert s[("phalanx_agent_members_running", ())] == 2
            assert sum(exited(s, k) for k in ("success", "fenced", "signal", "spawn_failed", "unknown", "error")) == 0
            # Cancelled: the leader revokes, the agent stops both (a signal each).
            await c.stub().CancelGang(gpb.CancelGangRequest(id=g.id, reason="test"), timeout=10)
            await m.wait("phalanx_agent_members_running", 0)
            await m.wait("phalanx_agent_members_exited_total", 2, **{"class": "signal"})
            s = await m.samples()
            assert s[("phalanx_agent_members_started_total", ())] == 0
        finally:
            stop(agent)
    finally:
        await c.close()
