"""A gang's event history (docs/events.md) on a real cluster: real etcd, real
coordinator processes, real agents running real member processes (or
simulated agents where no member has to fail)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from phalanx import procs
from phalanx.timings import Timings
from coordinator.core import events as ev
from phalanx import limits
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import REPO, TERMINAL, LocalCluster, dgx_node, tiny
from tests.integration.test_gang_runtime import agent_proc
from tests.members import MEMBER_PYTHON, member_tmp, writable  # noqa: F401 (member_tmp: a fixture)

pytestmark = pytest.mark.integration
AZ = "az-a"

# Rank 1 exits with code 3 after argv[1] seconds (long enough for every member
# to have started, so the incarnation reaches RUNNING) while its incarnation is at
# most argv[2]; every other member (and later incarnations) sleeps argv[3] s.
FLAKY = ("import os, sys, time; time.sleep(float(sys.argv[1])); "
         "bad = os.environ['RANK'] == '1' and int(os.environ['PHALANX_INCARNATION']) <= int(sys.argv[2]); "
         "sys.exit(3) if bad else time.sleep(float(sys.argv[3]))")


def flaky(after_s: float, failing_incarnations: int, then_s: float) -> list[str]:
    return [MEMBER_PYTHON, "-c", FLAKY, str(after_s), str(failing_incarnations), str(then_s)]


@pytest.fixture
def tmp_path(member_tmp: Path) -> Path:
    return writable(member_tmp / "t")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
        if p.stdout:
            p.stdout.close()


def address(c: LocalCluster) -> str:
    return [p.address for p in c.coordinators.values() if p.usable][0]


def cli(c: LocalCluster, *args: str) -> subprocess.Popen:
    return procs.spawn([sys.executable, "-m", "phalanx", *args, "--address", address(c)], die_with_parent=procs.KILL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=c.client_env())


def kinds(gang: pb.Gang) -> list[str]:
    return [e.kind for e in gang.events]


async def wait_until(c: LocalCluster, gang_id: str, ok, timeout: float = 90.0) -> pb.Gang:
    deadline = asyncio.get_running_loop().time() + timeout
    cur = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            cur = await c.stub().GetGang(gpb.GetGangRequest(id=gang_id), timeout=5)
            if ok(cur):
                return cur
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{gang_id}: condition not met after {timeout}s; last: {cur}")


async def test_a_restart_after_a_member_failure_is_explained_in_order(local_cluster: LocalCluster, tmp_path: Path) -> None:
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    leader = await c.wait_leader(AZ)
    agents = [agent_proc(c, n, tmp_path / f"state-{n}", tmp_path / f"hist-{n}.jsonl") for n in ("n0", "n1")]
    try:
        await c.wait_nodes_ready(AZ, 2)
        spec = pb.GangSpec(name="flaky", members=2, resources=pb.Resources(gpus=8),
                           run=pb.RunSpec(command=flaky(5.0, 1, 300)), policy=pb.Policy(max_restarts=2))
        g = await c.submit(spec)
        stream = cli(c, "events", g.id)  # `phalanx events` follows the new gang from here on
        try:
            cur = await wait_until(c, g.id, lambda x: x.incarnation == 2 and x.state == pb.GANG_STATE_RUNNING)
            await c.stub().CancelGang(gpb.CancelGangRequest(id=g.id, reason="seen enough"), timeout=10)
            out, err = stream.communicate(timeout=60)
        finally:
            if stream.poll() is None:
                stream.kill()
                stream.communicate()
        assert stream.returncode == 0, err
        done = await c.wait_state(g.id, TERMINAL)
        assert kinds(done) == ["submitted", "placed", "reserved", "started", "member_exited", "restarting",
                               "placed", "reserved", "started", "cancelled", "finished"], [e.message for e in done.events]
        e = {(x.kind, x.incarnation): x for x in done.events}
        assert e["submitted", 1].by == "admin/tester" and "admin/tester" in e["submitted", 1].message
        assert "n0" in e["placed", 1].message and "n1" in e["placed", 1].message and "az-a" in e["placed", 1].message
        assert e["member_exited", 1].rank == 1 and e["member_exited", 1].exit_code == 3
        assert "incarnation 1 -> 2" in e["restarting", 1].message and "code 3" in e["restarting", 1].message
        assert e["cancelled", 2].by == "admin/tester" and "seen enough" in e["cancelled", 2].message
        assert "CANCELLED" in e["finished", 2].message
        assert all(x.epoch == leader.epoch for x in done.events)
        assert [x.seq for x in done.events] == list(range(1, 12))
        assert [x.at for x in done.events] == sorted(x.at for x in done.events)
        # The stream printed every event, once, in order, and ended with the gang.
        lines = out.splitlines()
        assert [line.split()[4] for line in lines] == kinds(done), out
        # `phalanx describe`: spec, state, placement, events, in reading order.
        d = subprocess.run([sys.executable, "-m", "phalanx", "describe", g.id, "--address", address(c)],
                           capture_output=True, text=True, cwd=REPO, env=c.client_env(), timeout=60)
        assert d.returncode == 0, d.stderr
        text = d.stdout
        heads = [text.index(h) for h in ("\nspec:\n", "\nstate:\n", "\nplacement:\n", "\nevents:\n")]
        assert heads == sorted(heads), text
        shown = [line.split()[4] for line in text[heads[-1]:].splitlines()[2:]]
        assert shown == kinds(done), text
        assert "members: 2" in text and "CANCELLED" in text
    finally:
        stop(agents)


async def test_events_survive_a_leader_failover(local_cluster: LocalCluster) -> None:
    c = local_cluster
    for i in range(2):
        c.start_coordinator(AZ, f"a{i}")
    old = await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node(f"n{i}", AZ) for i in range(2)])
    await c.wait_nodes_ready(AZ, 2)
    g = await c.submit(tiny("steady", members=2, gpus=8, duration=8.0))
    await c.wait_state(g.id, {pb.GANG_STATE_RUNNING})
    c.coordinators[old.coordinator_id].signal(signal.SIGKILL)
    new = await c.wait_leader(AZ, not_epoch=old.epoch, timeout=60)
    done = await c.wait_state(g.id, TERMINAL, timeout=90)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    assert kinds(done) == ["submitted", "placed", "reserved", "started", "fenced", "finished"], [e.message for e in done.events]
    assert [e.epoch for e in done.events] == [old.epoch] * 4 + [new.epoch] * 2
    fenced = done.events[4]
    assert f"epoch {new.epoch}" in fenced.message and f"from epoch {old.epoch}" in fenced.message


def quick_restarts() -> Timings:
    return dataclasses.replace(Timings.fast(), restart_backoff_s=0.05, restart_backoff_max_s=0.1).validate()


@pytest.fixture
async def quick_cluster(etcd_endpoint, cluster_name, member_tmp):
    c = LocalCluster(etcd_endpoint, cluster_name, writable(member_tmp / "c"), timings=quick_restarts())
    await c.start()
    try:
        yield c
    finally:
        await c.close()


async def test_many_restarts_keep_a_bounded_list_behind_a_dropped_marker(quick_cluster: LocalCluster, tmp_path: Path) -> None:
    c = quick_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    agents = [agent_proc(c, "n0", tmp_path / "state-n0", tmp_path / "hist-n0.jsonl")]
    try:
        await c.wait_nodes_ready(AZ, 1)
        restarts = 20
        spec = pb.GangSpec(name="crashloop", members=2, resources=pb.Resources(gpus=1),
                           run=pb.RunSpec(command=flaky(0.1, restarts + 1, 300)), policy=pb.Policy(max_restarts=restarts))
        g = await c.submit(spec)
        done = await c.wait_state(g.id, TERMINAL, timeout=240)
        assert done.state == pb.GANG_STATE_FAILED and done.restarts == restarts, done.reason
        head, kept = done.events[0], done.events[1:]
        assert head.kind == "dropped" and head.dropped > 0 and head.message == f"{head.dropped} earlier events dropped"
        assert len(done.events) <= limits.MAX_GANG_EVENTS
        assert [e.seq for e in kept] == list(range(head.dropped + 1, head.dropped + 1 + len(kept))), "the newest kept, in order"
        assert kept[-1].kind == "finished" and "FAILED" in kept[-1].message
        assert sum(e.kind == "restarting" for e in kept) < restarts, "the oldest restarts were dropped"
        stored = (await c.etcd_gangs())[g.id]
        assert ev.list_bytes(stored.events) <= limits.MAX_GANG_EVENTS_BYTES
        assert [e.seq for e in stored.events] == [e.seq for e in done.events]
    finally:
        stop(agents)


RETENTION = 12.0  # the shortest the fast timings allow (Timings.validate)


@pytest.fixture
async def short_retention(etcd_endpoint, cluster_name, tmp_path):
    timings = dataclasses.replace(Timings.fast(), gang_retention_s=RETENTION).validate()
    c = LocalCluster(etcd_endpoint, cluster_name, tmp_path, timings=timings)
    await c.start()
    try:
        yield c
    finally:
        await c.close()


async def test_events_go_with_the_gang_at_retention(short_retention: LocalCluster) -> None:
    c = short_retention
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    g = await c.submit(tiny("brief", members=1, gpus=1, duration=0.2))
    done = await c.wait_state(g.id, TERMINAL)
    assert kinds(done)[0] == "submitted" and kinds(done)[-1] == "finished"
    assert await c.wait_deleted(c.store.keys.gang(g.id), timeout=RETENTION * 5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub().GetGang(gpb.GetGangRequest(id=g.id), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert g.id not in await c.etcd_gangs(), "nothing of the gang, its events included, is left in etcd"


async def test_a_cross_az_gang_records_placed_and_reserved_apart(local_cluster: LocalCluster) -> None:
    """Two-phase: placed with the RESERVING write, reserved once every AZ of
    the plan has committed; all by the owner AZ's leader."""
    c = local_cluster
    azs = ("az-a", "az-b")
    for az in azs:
        c.start_coordinator(az, f"{az[-1]}0")
    leaders = {az: await c.wait_leader(az) for az in azs}
    for az in azs:
        c.start_agents(az, [dgx_node(f"{az[-1]}n0", az)])
    for az in azs:
        await c.wait_nodes_ready(az, 1)
    g = await c.submit(tiny("wide", members=2, gpus=8, duration=1.0, topology=pb.TopologyConstraint(allow_cross_az=True)),
                       address=c.coordinators["a0"].address)
    done = await c.wait_state(g.id, TERMINAL, timeout=60)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    assert kinds(done) == ["submitted", "placed", "reserved", "started", "finished"], [e.message for e in done.events]
    placed, reserved = done.events[1], done.events[2]
    assert "two-phase across az-a, az-b" in placed.message and "an0" in placed.message and "bn0" in placed.message
    assert "committed in every AZ" in reserved.message
    assert {e.epoch for e in done.events} == {leaders[done.owner_az].epoch}
