"""The cluster's event stream (`WatchEvents`, docs/events.md "Reading them")
on a real TLS cluster: real etcd, real coordinator processes, simulated
agents, the SDK and the `phalanx events` CLI as a subprocess."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import pytest

from phalanx import procs
from phalanx.client import AsyncClient, Client
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import REPO, TERMINAL, LocalCluster, dgx_node, tiny

pytestmark = pytest.mark.integration
AZ = "az-a"
LIFE = ["submitted", "placed", "reserved", "started", "finished"]
# Bounds for waits on other processes; never a pass/fail timing.
WAIT_S = 90.0


class Collector:
    """Reads a cluster stream in a task until ``done`` holds of what it has."""

    def __init__(self, client: AsyncClient, queue: str, done: Callable[[list[gpb.ClusterEvent]], bool]):
        self.events: list[gpb.ClusterEvent] = []
        self.opened = asyncio.Event()
        self._done = done
        self.task = asyncio.create_task(self._run(client, queue))

    async def _run(self, client: AsyncClient, queue: str) -> None:
        async for ce in client.watch_cluster_events(queue, on_open=self.opened.set):
            self.events.append(ce)
            if self._done(self.events):
                return

    def kinds(self, gang_id: str) -> list[str]:
        return [ce.event.kind for ce in self.events if ce.gang_id == gang_id]


def finished(*ids: str) -> Callable[[list[gpb.ClusterEvent]], bool]:
    return lambda evs: set(ids) <= {ce.gang_id for ce in evs if ce.event.kind == "finished"}


async def readline(proc: subprocess.Popen, stream: str) -> str:
    line = await asyncio.wait_for(asyncio.to_thread(getattr(proc, stream).readline), WAIT_S)
    assert line, f"`phalanx events` ended early: {proc.stderr.read() if stream == 'stdout' else ''}"
    return line


async def test_a_standby_streams_new_events_of_the_cluster_or_of_one_queue(local_cluster: LocalCluster) -> None:
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    leader = await c.wait_leader(AZ)
    standby = c.start_coordinator(AZ, "a1")
    assert standby.id != leader.coordinator_id
    c.start_agents(AZ, [dgx_node(f"n{i}", AZ) for i in range(2)])
    await c.wait_nodes_ready(AZ, 2)
    # Running before the streams open: only what happens to it afterwards is sent.
    old = await c.submit(tiny("old", members=1, gpus=8, duration=600.0, queue="q2"))
    await c.wait_state(old.id, {pb.GANG_STATE_RUNNING})
    cli = procs.spawn([sys.executable, "-m", "phalanx", "events", "--queue", "q1", "--address", standby.address],
                      die_with_parent=procs.KILL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                      env=c.client_env())
    try:
        async with AsyncClient(standby.address, timeout=10, tls_dir=c.client_dir()) as client:
            ids: dict[str, str] = {}
            every = Collector(client, "", lambda evs: bool(ids) and finished(*ids.values(), old.id)(evs))
            q1 = Collector(client, "q1", lambda evs: bool(ids) and finished(ids["a"])(evs))
            await asyncio.wait_for(asyncio.gather(every.opened.wait(), q1.opened.wait()), WAIT_S)
            assert "following new gang events of queue q1" in await readline(cli, "stderr")
            a = await c.submit(tiny("a", members=1, gpus=8, queue="q1"))
            b = await c.submit(tiny("b", members=1, gpus=8, queue="q2"))
            ids.update(a=a.id, b=b.id)
            await c.stub().CancelGang(gpb.CancelGangRequest(id=old.id, reason="make room"), timeout=10)
            for g in (a, b, old):
                await c.wait_state(g.id, TERMINAL, timeout=WAIT_S)
            await asyncio.wait_for(asyncio.gather(every.task, q1.task), WAIT_S)
        # Every gang's events in order, each once; the old gang's history before the call is not sent.
        assert every.kinds(a.id) == LIFE and every.kinds(b.id) == LIFE, [(e.gang_name, e.event.kind) for e in every.events]
        assert every.kinds(old.id) == ["cancelled", "finished"]
        for gid in (a.id, b.id):
            seqs = [ce.event.seq for ce in every.events if ce.gang_id == gid]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        ce = next(ce for ce in every.events if ce.gang_id == a.id)
        assert (ce.gang_name, ce.queue) == ("a", "q1") and ce.event.by == "admin/tester"
        # queue=q1: only gang a.
        assert {ce.gang_id for ce in q1.events} == {a.id} and q1.kinds(a.id) == LIFE
        # The CLI prints a's events, one line each: the gang (name and id), then the event.
        lines: list[str] = []
        while not lines or "finished" not in lines[-1]:
            lines.append(await readline(cli, "stdout"))
        assert all(line.startswith(f"a ({a.id})  ") for line in lines), lines
        assert [line.split()[6] for line in lines] == LIFE, lines
    finally:
        cli.terminate()
        cli.communicate(timeout=30)


async def test_under_visibility_own_a_submitter_streams_only_its_own_gangs(local_cluster: LocalCluster, tmp_path: Path) -> None:
    c = local_cluster
    policy = tmp_path / "policy.yaml"
    policy.write_text("visibility: own\n")
    c0 = c.start_coordinator(AZ, "c0", extra_args=["--policy", str(policy)])
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    alice, bob = c.client_dir("submitter", "alice", ["a"]), c.client_dir("submitter", "bob", ["a"])
    async with AsyncClient(c0.address, timeout=10, tls_dir=alice) as as_alice, \
            AsyncClient(c0.address, timeout=10, tls_dir=c.client_dir()) as as_admin, \
            AsyncClient(c0.address, timeout=10, tls_dir=bob) as as_bob:
        ids: dict[str, str] = {}
        mine = Collector(as_alice, "", lambda evs: "alice" in ids and finished(ids["alice"])(evs))
        admin = Collector(as_admin, "a", lambda evs: len(ids) == 2 and finished(*ids.values())(evs))
        # A viewer with the blocking client, in a thread of its own.
        viewer_open = threading.Event()

        def as_viewer() -> list[gpb.ClusterEvent]:
            got: list[gpb.ClusterEvent] = []
            with Client(c0.address, timeout=10, tls_dir=c.client_dir("viewer", "eve")) as client:
                for ce in client.watch_cluster_events(on_open=viewer_open.set):
                    got.append(ce)
                    if "alice" in ids and finished(ids["alice"])(got):
                        return got
            return got

        viewer = asyncio.ensure_future(asyncio.to_thread(as_viewer))
        await asyncio.wait_for(asyncio.gather(mine.opened.wait(), admin.opened.wait(),
                                              asyncio.to_thread(viewer_open.wait, WAIT_S)), WAIT_S)
        assert viewer_open.is_set()
        # bob's gang first, to its end: its events all precede alice's in etcd order.
        bobs = (await as_bob.submit(tiny("bob-job", members=1, queue="a"))).gang
        ids["bob"] = bobs.id
        await c.wait_state(bobs.id, TERMINAL, timeout=WAIT_S)
        alices = (await as_alice.submit(tiny("alice-job", members=1, queue="a"))).gang
        ids["alice"] = alices.id
        await asyncio.wait_for(asyncio.gather(mine.task, admin.task), WAIT_S)
        seen_by_viewer = await asyncio.wait_for(viewer, WAIT_S)
    assert {ce.gang_id for ce in mine.events} == {alices.id} and mine.kinds(alices.id) == LIFE
    assert [ce.event.kind for ce in seen_by_viewer if ce.gang_id == bobs.id] == LIFE
    assert admin.kinds(bobs.id) == LIFE and admin.kinds(alices.id) == LIFE
    # A queue that is not a name is refused before the stream opens, naming the field.
    bad = subprocess.run([sys.executable, "-m", "phalanx", "events", "--queue", "Not_A_Queue", "--address", c0.address],
                         capture_output=True, text=True, cwd=REPO, env=c.client_env(), timeout=60)
    assert bad.returncode != 0 and "queue:" in bad.stderr and not bad.stdout, bad
