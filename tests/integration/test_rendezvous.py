"""Members on different nodes meet at MASTER_ADDR:MASTER_PORT (issue 11 item 3).

Real etcd, a real coordinator, real agents launching real member processes:
rank 0 listens on MASTER_ADDR:MASTER_PORT with a plain TCP socket, every other
rank connects to it, and they exchange their ranks. MASTER_ADDR must be an
address (what the rank-0 node's agent advertised), not a node name, and
MASTER_PORT a port of the rank-0 node's own range that is free.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from agent.sim import run_agents
from coordinator.core.records import NodeRecord
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node
from tests.integration.test_gang_runtime import AZ, agent_proc
from tests.members import MEMBER_PYTHON, member_tmp, writable  # noqa: F401 (member_tmp: a fixture)

pytestmark = pytest.mark.integration


@pytest.fixture
def tmp_path(member_tmp: Path) -> Path:
    """Here ``tmp_path`` is a directory members can reach (they run as nobody
    when the suite runs as root); ``writable`` makes their output dirs."""
    return writable(member_tmp / "t")

# Below the ephemeral range, away from the agents' default range: other tests
# on this host never hold these ports.
RANGES = {"n0": (30100, 30199), "n1": (30200, 30299)}

# argv: OUT_DIR LEFTOVER_INCARNATION FAIL_INCARNATION. Rank 0 listens, the
# others connect (retrying until rank 0 is up); each sends its rank and reads
# rank 0's. On LEFTOVER_INCARNATION rank 0 leaves a process in a session of
# its own holding the listening socket (as a stray child of a real trainer
# can): the agent's group kill does not reach it, so that port stays busy.
# On FAIL_INCARNATION rank 1 exits 3 after the exchange.
MEMBER = r"""
import json, os, socket, sys, time
out, leftover_inc, fail_inc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
inc = int(os.environ["PHALANX_INCARNATION"])
seen = []
if rank == 0:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(world)
    s.settimeout(60)
    for _ in range(world - 1):
        c, _ = s.accept()
        c.settimeout(60)
        seen.append(int(c.recv(16).decode()))
        c.sendall(b"0")
        c.close()
    if inc == leftover_inc and os.fork() == 0:
        os.setsid()
        open(os.path.join(out, "leftover.pid"), "w").write(str(os.getpid()))
        time.sleep(120)
        os._exit(0)
else:
    deadline = time.monotonic() + 60
    while True:
        try:
            c = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    c.sendall(str(rank).encode())
    seen.append(int(c.recv(16).decode()))
    c.close()
doc = {"rank": rank, "inc": inc, "addr": addr, "port": port, "seen": seen, "node": os.environ["PHALANX_NODE"]}
path = os.path.join(out, "rank-%d-inc-%d.json" % (rank, inc))
open(path + ".tmp", "w").write(json.dumps(doc))
os.replace(path + ".tmp", path)
sys.exit(3 if rank == 1 and inc == fail_inc else 0)
"""


def member(out: Path, *, leftover_inc: int = 0, fail_inc: int = 0) -> list[str]:
    return [MEMBER_PYTHON, "-c", MEMBER, str(out), str(leftover_inc), str(fail_inc)]


def results(out: Path, inc: int) -> dict[int, dict]:
    return {int(p.name.split("-")[1]): json.loads(p.read_text()) for p in out.glob(f"rank-*-inc-{inc}.json")}


def assert_met(docs: dict[int, dict], world: int, rank0_node: str, ports: tuple[int, int]) -> None:
    assert sorted(docs) == list(range(world)), docs
    assert sorted(docs[0]["seen"]) == list(range(1, world)), "rank 0 heard every other rank"
    assert all(docs[r]["seen"] == [0] for r in range(1, world)), "every other rank heard rank 0"
    assert len({(d["addr"], d["port"]) for d in docs.values()}) == 1, "one rendezvous for the whole gang"
    assert docs[0]["addr"] == "127.0.0.1" and docs[0]["addr"] != rank0_node, "an address, not a node name"
    assert docs[0]["node"] == rank0_node
    assert ports[0] <= docs[0]["port"] <= ports[1], f"port {docs[0]['port']} outside {rank0_node}'s range {ports}"


@pytest.fixture
async def agents(local_cluster: LocalCluster, tmp_path: Path):
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    procs = {}
    for n, (first, last) in RANGES.items():
        os.environ["PHALANX_RENDEZVOUS_PORTS"] = f"{first}-{last}"  # read by agent_proc's `python -m agent`
        try:
            procs[n] = agent_proc(c, n, tmp_path / f"state-{n}", tmp_path / f"hist-{n}.jsonl")
        finally:
            del os.environ["PHALANX_RENDEZVOUS_PORTS"]
    await c.wait_nodes_ready(AZ, 2)
    yield c
    for p in procs.values():
        p.terminate()
    for p in procs.values():
        p.wait(20)
        p.stdout.close()


async def test_agents_advertise_their_address_and_ports(agents: LocalCluster) -> None:
    c = agents
    for n, ports in RANGES.items():
        kv = await c.store.get(c.store.keys.node(AZ, n))
        rec = NodeRecord.from_dict(kv.json())
        # The coordinator listens on loopback: that is the agent's address towards it.
        assert rec.address == "127.0.0.1" and rec.ports == ports, rec


async def test_members_on_two_nodes_meet_at_master_addr_and_port(agents: LocalCluster, tmp_path: Path) -> None:
    c = agents
    out = tmp_path / "out"
    writable(out)
    spec = pb.GangSpec(name="meet", members=2, resources=pb.Resources(gpus=8), run=pb.RunSpec(command=member(out)))
    g = await c.submit(spec)
    done = await c.wait_state(g.id, TERMINAL, timeout=90)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    nodes = {m.rank: m.node for m in done.placement}
    assert sorted(nodes.values()) == ["n0", "n1"], "members on different nodes"
    assert_met(results(out, 1), 2, nodes[0], RANGES[nodes[0]])


async def test_a_restarted_gang_gets_a_port_that_is_free_again(agents: LocalCluster, tmp_path: Path) -> None:
    c = agents
    out = tmp_path / "out"
    writable(out)
    # Incarnation 1: the exchange works, rank 0 leaves a process holding its
    # port, rank 1 exits 3. Incarnation 2 must meet on another, free port.
    spec = pb.GangSpec(name="again", members=2, resources=pb.Resources(gpus=8),
                       run=pb.RunSpec(command=member(out, leftover_inc=1, fail_inc=1)), policy=pb.Policy(max_restarts=1))
    g = await c.submit(spec)
    try:
        done = await c.wait_state(g.id, TERMINAL, timeout=120)
        assert done.state == pb.GANG_STATE_SUCCEEDED and done.incarnation == 2 and done.restarts == 1, done
        first, second = results(out, 1), results(out, 2)
        nodes = {m.rank: m.node for m in done.placement}
        assert_met(second, 2, nodes[0], RANGES[nodes[0]])
        assert sorted(first[0]["seen"]) == [1], "incarnation 1 met too before it failed"
        assert (out / "leftover.pid").exists(), "incarnation 1's port was still held when incarnation 2 started"
        assert second[0]["port"] != first[0]["port"]
    finally:
        leftover = out / "leftover.pid"
        if leftover.exists():
            try:
                os.kill(int(leftover.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


async def test_simulated_nodes_of_phalanx_up_meet_on_loopback(local_cluster: LocalCluster, tmp_path: Path) -> None:
    """`phalanx up --launch`: every simulated node is on this host (agent/sim.py)."""
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    stop = asyncio.Event()
    block = (30300, 30399)  # split into one disjoint slice per simulated node
    task = asyncio.create_task(run_agents(
        cluster=c.cluster, az=AZ, etcd=c.etcd, topologies=[dgx_node("s0", AZ), dgx_node("s1", AZ)],
        timings=c.timings, launch=True, state_dir=tmp_path / "agents", ready_line=False, stop_event=stop,
        rendezvous_ports=block, **c.agents_tls(["s0", "s1"])))
    try:
        await c.wait_nodes_ready(AZ, 2)
        slices = {}
        for n in ("s0", "s1"):
            rec = NodeRecord.from_dict((await c.store.get(c.store.keys.node(AZ, n))).json())
            assert rec.address == "127.0.0.1", rec
            slices[n] = rec.ports
        assert slices == {"s0": (30300, 30349), "s1": (30350, 30399)}, "disjoint slices of one host's block"
        out = tmp_path / "out"
        writable(out)
        g = await c.submit(pb.GangSpec(name="sim-meet", members=2, resources=pb.Resources(gpus=8),
                                       run=pb.RunSpec(command=member(out))))
        done = await c.wait_state(g.id, TERMINAL, timeout=90)
        assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
        nodes = {m.rank: m.node for m in done.placement}
        assert sorted(nodes.values()) == ["s0", "s1"]
        assert_met(results(out, 1), 2, nodes[0], slices[nodes[0]])
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
