"""Agents with no etcd credentials at all: their two reads (the leader, the
token check) go through ``AgentService.ReadToken`` on any coordinator replica
of their AZ (agent/coordinator_reads.py, coordinator/core/token_read.py;
docs/design.md §9.3 "Where the token check reads").

Real coordinators, real etcd, real TLS. Every refusal names its check and
writes nothing: etcd's revision, read back afterwards, has not moved.
"""

from __future__ import annotations

import asyncio
import os
import signal
import select
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from agent.coordinator_reads import CoordinatorReads
from agent.sim import run_agents
from phalanx import certs, procs
from phalanx.errors import StoreDenied, StoreUnavailable
from phalanx.etcd_server import free_port
from phalanx.v1 import types_pb2 as pb
from phalanx.store import Get, Put
from phalanx.tls import coordinator_channel
from phalanx.v1 import agent_pb2 as apb
from phalanx.v1 import agent_pb2_grpc as agrpc
from tests.integration.harness import dgx_node, tiny, until
from tests.pki import now

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration
AZ = "az-a"


async def test_agents_without_etcd_credentials_run_a_gang_through_the_standby(local_cluster):
    c0 = local_cluster.start_coordinator(AZ, "c0")
    await local_cluster.wait_leader(AZ)
    c1 = local_cluster.start_coordinator(AZ, "c1")
    tls = local_cluster.agents_tls(["n1", "n2"])
    stop = asyncio.Event()
    history: list = []
    # The standby first: it answers the reads as well as the leader does.
    task = asyncio.create_task(run_agents(
        cluster=local_cluster.cluster, az=AZ, etcd="", topologies=[dgx_node("n1", AZ), dgx_node("n2", AZ)],
        timings=local_cluster.timings, ready_line=False, stop_event=stop, history=history,
        tls_dir=tls["tls_dir"], etcd_tls=None, coordinators=[c1.address, c0.address]))
    try:
        await local_cluster.wait_nodes_ready(AZ, 2)
        gang = await local_cluster.submit(tiny("via-coordinators", members=2, gpus=8, duration=0.2))
        done = await local_cluster.wait_state(gang.id, {pb.GANG_STATE_SUCCEEDED, pb.GANG_STATE_FAILED}, timeout=60)
        assert done.state == pb.GANG_STATE_SUCCEEDED, done
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    started = [d for ev, d in history if ev == "member_started"]
    assert len(started) == 2, history[-10:]


def _reads(local_cluster, node: str, addresses: list[str]) -> CoordinatorReads:
    return CoordinatorReads(addresses, local_cluster.cluster, AZ, tls=local_cluster.pki.agent(node), timeout=10)


async def test_each_refusal_names_its_check_and_writes_nothing(local_cluster):
    c0 = local_cluster.start_coordinator(AZ, "c0")
    await local_cluster.wait_leader(AZ)
    store, keys = local_cluster.store, local_cluster.store.keys
    # A reservation placing a member on n2 only (as a leader writes it).
    held = {"gang": "g1", "incarnation": 1, "state": "COMMITTED", "az": AZ,
            "nodes": {"n2": {"gpus": [0, 1], "nics": []}}}
    await store.txn([], [Put(keys.reservation(AZ, "g1"), held)])
    n1, n2 = _reads(local_cluster, "n1", [c0.address]), _reads(local_cluster, "n2", [c0.address])
    try:
        before = await store.revision()
        # n2 reads what etcd holds, as etcd holds it.
        res = await n2.txn([], [Get(keys.leader(AZ)), Get(keys.reservation(AZ, "g1"))])
        etcd = await store.txn([], [Get(keys.leader(AZ)), Get(keys.reservation(AZ, "g1"))])
        assert [r[0].value for r in res.results] == [r[0].value for r in etcd.results]
        assert [r[0].create_revision for r in res.results] == [r[0].create_revision for r in etcd.results]
        assert (await n1.get(keys.leader(AZ))).create_revision == etcd.results[0][0].create_revision
        # n1 has no member in g1: refused, naming the check.
        with pytest.raises(StoreDenied, match="reservation of 'g1' places no member on node 'n1'"):
            await n1.txn([], [Get(keys.leader(AZ)), Get(keys.reservation(AZ, "g1"))])
        # An absent reservation is answered as absent (the agent starts nothing on it).
        res = await n1.txn([], [Get(keys.leader(AZ)), Get(keys.reservation(AZ, "g2"))])
        assert res.results[1] == ()

        agent_ch = coordinator_channel(c0.address, local_cluster.pki.agent("n1"), cluster=local_cluster.cluster)
        submitter_ch = local_cluster.channel(c0.address, role="submitter", name="bob", queues=("default",))
        try:
            cases = [
                (agent_ch, apb.TokenReadRequest(az="az-b"), grpc.StatusCode.PERMISSION_DENIED,
                 "this coordinator serves 'az-a'"),
                (agent_ch, apb.TokenReadRequest(az=AZ, gang="../g1"), grpc.StatusCode.INVALID_ARGUMENT,
                 "not a gang id"),
                (submitter_ch, apb.TokenReadRequest(az=AZ), grpc.StatusCode.PERMISSION_DENIED,
                 "needs an agent certificate"),
            ]
            for ch, req, code, words in cases:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await agrpc.AgentServiceStub(ch).ReadToken(req, timeout=10)
                assert err.value.code() == code and words in err.value.details(), err.value.details()
        finally:
            await agent_ch.close()
            await submitter_ch.close()
        assert await store.revision() == before, "a read wrote to etcd"
        assert (await store.get(keys.reservation(AZ, "g1"))).json() == held
    finally:
        await n1.close()
        await n2.close()


async def test_no_replica_answering_is_unavailable_and_the_next_replica_is_asked(local_cluster):
    c0 = local_cluster.start_coordinator(AZ, "c0")
    await local_cluster.wait_leader(AZ)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    keys = local_cluster.store.keys
    nobody = _reads(local_cluster, "n1", [dead])
    first_dead = _reads(local_cluster, "n1", [dead, c0.address])
    try:
        with pytest.raises(StoreUnavailable, match="no coordinator of az-a answered the token read"):
            await nobody.get(keys.leader(AZ))
        assert (await first_dead.get(keys.leader(AZ))) is not None
    finally:
        await nobody.close()
        await first_dead.close()


async def test_the_leader_address_of_the_last_answer_is_asked_when_the_given_ones_are_gone(local_cluster):
    """Given only a standby, the reads learn the leader from its answer; with
    the standby gone they still answer, through that leader."""
    c0 = local_cluster.start_coordinator(AZ, "c0")
    await local_cluster.wait_leader(AZ)
    c1 = local_cluster.start_coordinator(AZ, "c1")
    keys = local_cluster.store.keys
    reads = _reads(local_cluster, "n1", [c1.address])
    try:
        assert (await reads.get(keys.leader(AZ))) is not None
        assert reads.learned == c0.address
        c1.signal(signal.SIGKILL)
        c1.proc.wait(10)
        kv = await reads.get(keys.leader(AZ))
        assert kv is not None and kv.json()["address"] == c0.address
    finally:
        await reads.close()


async def test_a_real_agent_process_with_no_etcd_flags_registers_and_runs(local_cluster, tmp_path):
    """``python -m agent --coordinators``: no --etcd, no --etcd-tls-dir."""
    c = local_cluster
    c0 = c.start_coordinator(AZ, "c0")
    await c.wait_leader(AZ)
    c1 = c.start_coordinator(AZ, "c1")
    log = tmp_path / "agent-n0.log"
    c.pki.agent("n0")
    p = procs.spawn(
        [sys.executable, "-m", "agent", "--cluster", c.cluster, "--az", AZ, "--coordinators",
         f"{c1.address},{c0.address}", "--node", "n0", "--spine", "s0", "--leaf", "l0",
         "--state-dir", str(tmp_path / "state"), "--timings", c._timings_json(), "--simulate-members",
         "--nvml-recording", str(REPO / "tests/fixtures/topology/hgx-h100/nvml.json"),
         "--sysfs-recording", str(REPO / "tests/fixtures/topology/hgx-h100/sysfs.json"),
         "--tls-dir", str(c.pki.server_dir())],
        die_with_parent=procs.TERM, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=REPO,
        env=dict(os.environ),
    )
    try:
        ready, _, _ = select.select([p.stdout], [], [], 60)
        assert ready and "PHALANX_AGENT_READY" in p.stdout.readline(), log.read_text()
        await c.wait_nodes_ready(AZ, 1, timeout=60)
        gang = await c.submit(tiny("real-agent", members=1, gpus=8, duration=0.2))
        done = await c.wait_state(gang.id, {pb.GANG_STATE_SUCCEEDED, pb.GANG_STATE_FAILED}, timeout=60)
        assert done.state == pb.GANG_STATE_SUCCEEDED, (done, log.read_text()[-2000:])
        assert "etcd" not in " ".join(p.args[p.args.index("--coordinators"):p.args.index("--node")])
    finally:
        p.terminate()
        p.wait(30)


async def test_an_agent_the_coordinators_refuse_says_what_to_check(local_cluster, caplog):
    """A node whose certificate is bound to another AZ, started in this one:
    the coordinator refuses its first read (the leader record), and the
    agent's ERROR names the coordinators' refusal and what to check (its
    certificate's node and AZ, --coordinators), not etcd's roles, which it
    does not use. Nothing of the node is written."""
    local_cluster.start_coordinator(AZ, "c0")
    await local_cluster.wait_leader(AZ)
    files = local_cluster.pki.agent("n9")  # the harness's name for n9's files ...
    certs.issue(local_cluster.pki.ca_dir, "agent", "n9", node="n9", az="az-b", now=now(),  # ... bound to az-b
                out=(files.cert, files.key))
    said = "a coordinator refused this agent's read"
    local_cluster.expect_log(said, who="agent")
    local_cluster.start_agents(AZ, [dgx_node("n9", AZ)])

    async def refused() -> bool:
        return any(said in r.getMessage() and "--coordinators" in r.getMessage() and "etcd" not in r.getMessage()
                   for r in caplog.records if r.levelname == "ERROR")

    await until("the agent's refusal logged", refused)
    assert await local_cluster.store.get(local_cluster.store.keys.node(AZ, "n9")) is None
