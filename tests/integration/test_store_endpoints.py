"""Endpoint failover of the etcd gateway against a real 3-member etcd cluster.

One member is paused with SIGSTOP: its connections stay open and nothing
answers, as in a partition that drops packets (docs/chaos.md finding 6). The
paused member is always an etcd follower, so the cluster keeps its leader and
quorum: what is tested is the client, not an etcd election. Assertions are
about behaviour (how many calls fail, who stays leader), never about time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from phalanx.timings import Timings
from coordinator.election import Election, LeaseSession, observe
from phalanx.store import Delete, Fence, Put, Store
from phalanx.errors import StoreUnavailable
from phalanx.etcd_server import EtcdServer, loopback_cluster, start_members, stop_members
from phalanx.programs import require
from phalanx.tls import TlsFiles
from tests.pki import EtcdPki, etcd_pki_for, etcdctl_args, provision, register, unprovision, unregister

pytestmark = pytest.mark.integration


def etcdctl(members: list[EtcdServer], *args: str) -> str:
    """etcdctl as etcd root, over TLS, to ``members``."""
    env = dict(os.environ, ETCDCTL_API="3")
    eps = [m.endpoint for m in members]
    return subprocess.run(
        [require("etcdctl"), *etcdctl_args(eps, etcd_pki_for(eps).root), "--dial-timeout", "2s",
         "--command-timeout", "5s", *args],
        env=env, check=True, capture_output=True, text=True, timeout=30,
    ).stdout


@pytest.fixture(scope="module")
def etcd_pki(tmp_path_factory: pytest.TempPathFactory) -> EtcdPki:
    """This module's etcd CA (it replaces the session one here, so the
    conftest's etcd_coordinator_tls gives this cluster's users)."""
    return EtcdPki(tmp_path_factory.mktemp("etcd3-pki") / "pki")


@pytest.fixture(scope="module")
def members(tmp_path_factory: pytest.TempPathFactory, etcd_pki: EtcdPki) -> Iterator[list[EtcdServer]]:
    """Three members serving clients and peers over TLS with client
    certificates required; etcd auth is on once the first test provisions."""
    ms = start_members(loopback_cluster(tmp_path_factory.mktemp("etcd3"), tls_dir=etcd_pki.dir))
    register([m.endpoint for m in ms], etcd_pki)
    yield ms
    unregister([m.endpoint for m in ms])
    stop_members(ms)


@pytest.fixture
def cluster_name(members: list[EtcdServer], etcd_pki: EtcdPki) -> Iterator[str]:
    """A fresh key prefix and its etcd users, wiped (and checked empty) after the test."""
    for m in members:
        m.wait_ready()  # the previous test resumed its paused member
    name = "t" + uuid.uuid4().hex[:10]
    provision([m.endpoint for m in members], etcd_pki, name)
    yield name
    prefix = f"/phalanx/{name}/"
    # A member resumed a moment ago may still be catching up (or calling an
    # etcd election): the clean-up is not what is tested, so it may retry.
    deadline = time.monotonic() + 30
    while True:
        try:
            etcdctl(members, "del", "--prefix", prefix)
            break
        except subprocess.CalledProcessError as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"cannot clean up {prefix}: {exc.stderr}") from None
            time.sleep(0.5)
    assert etcdctl(members, "get", "--prefix", "--keys-only", prefix).strip() == ""
    unprovision([m.endpoint for m in members], etcd_pki, name)


def follower_first(members: list[EtcdServer]) -> list[EtcdServer]:
    """The members with an etcd follower first (the one the test pauses)."""
    status = json.loads(etcdctl(members, "endpoint", "status", "--write-out", "json"))
    by_url = {s["Endpoint"]: s["Status"] for s in status}
    leader = {s["leader"] for s in by_url.values()}
    assert len(leader) == 1, f"members disagree on the etcd leader: {status}"
    victim = next(m for m in members if by_url[m.client_url]["header"]["member_id"] not in leader)
    return [victim] + [m for m in members if m is not victim]


def one_failed_keepalive_timings() -> Timings:
    """Timings that allow exactly one failed keepalive (rule 1 of
    docs/timing.md): 2*0.5 + 0.5 <= 3 - 0.5."""
    return dataclasses.replace(
        Timings.fast(), lease_ttl_s=3, keepalive_interval_s=0.5, etcd_timeout_s=0.5, step_down_margin_s=0.5,
        fence_after_s=5.0,
    ).validate()


@contextlib.contextmanager
def paused(member: EtcdServer) -> Iterator[None]:
    member.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        member.signal(signal.SIGCONT)


def localhost(m: EtcdServer) -> str:
    return f"localhost:{m.client_port}"


def test_loopback_cluster_is_one_cluster_of_three(members: list[EtcdServer]) -> None:
    listed = etcdctl(members[:1], "member", "list").strip().splitlines()
    assert sorted(line.split(", ")[2] for line in listed) == ["m1", "m2", "m3"]
    assert all(", started, " in line for line in listed)
    assert len({m.client_port for m in members} | {m.peer_port for m in members}) == 6


async def test_calls_move_to_another_member_when_the_current_one_stops_answering(
    members: list[EtcdServer], cluster_name: str, etcd_coordinator_tls: TlsFiles
) -> None:
    ordered = follower_first(members)
    victim = ordered[0]
    # DNS names for every member (gRPC's default resolver), the victim first.
    async with Store([localhost(m) for m in ordered], cluster_name, timeout=1.0, tls=etcd_coordinator_tls) as store:
        k = store.keys
        assert store.current_endpoint == f"localhost:{victim.client_port}"
        await store.txn([], [Put(k.gang("before"), 1)])
        with paused(victim):
            # The first call goes to the paused member and fails; the write is
            # not retried behind the caller's back (its outcome is unknown).
            with pytest.raises(StoreUnavailable):
                await store.txn([], [Put(k.gang("during"), 1)])
            failures = 1
            for _ in range(3):
                try:
                    assert (await store.get(k.gang("before"))).json() == 1
                    break
                except StoreUnavailable:
                    failures += 1
            else:
                pytest.fail(f"no call succeeded after {failures} failures with one of three members paused")
            assert failures <= 2
            assert store.current_endpoint != f"localhost:{victim.client_port}"
            # The failed write was not replayed on another member.
            assert await store.get(k.gang("during")) is None
            # From now on every call is answered.
            for i in range(10):
                await store.txn([], [Put(k.gang(f"after{i}"), i)])
                assert (await store.get(k.gang(f"after{i}"))).json() == i
        await store.txn([], [Delete(k.root, prefix=True)])


async def test_lease_kept_alive_by_ping_survives_a_paused_member(members: list[EtcdServer], cluster_name: str, etcd_coordinator_tls: TlsFiles) -> None:
    ordered = follower_first(members)
    victim = ordered[0]
    async with Store([m.endpoint for m in ordered], cluster_name, timeout=1.0, tls=etcd_coordinator_tls) as store:
        ttl = 3
        lease = await store.grant_lease(ttl)
        key = store.keys.leader("az-x")
        await store.txn([], [Put(key, "mine", lease=lease)])
        ka = store.keepalive(lease)
        assert await ka.ping(1.0) > 0
        results: list[int | None] = []
        with paused(victim):
            # Pings every TTL/6 for about three TTLs (plus the failed ones' timeouts).
            for _ in range(6 * ttl):
                await asyncio.sleep(ttl / 6)
                try:
                    results.append(await ka.ping(1.0))
                except StoreUnavailable:
                    results.append(None)
            # The lease never expired: its key is still there.
            kv = await store.get(key)
            assert kv is not None and kv.lease == lease
        failed = results.count(None)
        assert 1 <= failed <= 2, results
        assert all(ttl_left and ttl_left > 0 for ttl_left in results[failed:]), results
        assert store.current_endpoint != victim.endpoint
        ka.close()
        await store.revoke_lease(lease)


async def test_leader_keeps_its_leadership_across_a_paused_member(members: list[EtcdServer], cluster_name: str, etcd_coordinator_tls: TlsFiles) -> None:
    t = one_failed_keepalive_timings()
    ordered = follower_first(members)
    victim = ordered[0]
    async with Store([m.endpoint for m in ordered], cluster_name, timeout=t.etcd_timeout_s, tls=etcd_coordinator_tls) as store:
        session = await LeaseSession(store, t).start()
        election = Election(store, "az-a", "c1", "addr1", t)
        lead = await election.campaign(session)
        with paused(victim):
            # Three TTLs: the lease would have expired twice over without keepalives.
            for _ in range(12):
                await asyncio.sleep(t.lease_ttl_s / 4)
                assert not session.lost.is_set()
            assert store.current_endpoint != victim.endpoint
            # Still the leader in etcd: same epoch, and a fenced write goes through.
            now = await observe(store, "az-a")
            assert now is not None and now.epoch == lead.epoch and now.lease == session.lease_id
            res = await store.fenced_txn(Fence("az-a", lead.epoch), [], [Put(store.keys.gang("g"), {"v": 1})])
            assert res.succeeded
        assert not session.lost.is_set()
        await election.resign(lead)
        await session.close()
        await store.txn([], [Delete(store.keys.root, prefix=True)])


async def test_watch_follows_the_store_to_another_member(members: list[EtcdServer], cluster_name: str, etcd_coordinator_tls: TlsFiles) -> None:
    ordered = follower_first(members)
    victim = ordered[0]
    async with Store([m.endpoint for m in ordered], cluster_name, timeout=1.0, tls=etcd_coordinator_tls) as store:
        k = store.keys
        start = await store.revision() + 1
        seen: list[str] = []
        breaks: list[str] = []
        got = {name: asyncio.Event() for name in ("a", "b")}

        async def watcher() -> None:
            # What every caller of watch_prefix does: resume from the last
            # revision seen after a StoreUnavailable.
            nonlocal start
            while True:
                try:
                    async for batch in store.watch_prefix(k.gangs(), start):
                        for ev in batch:
                            start = ev.revision + 1
                            name = ev.kv.key.rsplit("/", 1)[-1]
                            seen.append(name)
                            got[name].set()
                except StoreUnavailable as exc:
                    breaks.append(str(exc))
                    await asyncio.sleep(0.05)

        task = asyncio.create_task(watcher())
        try:
            await store.txn([], [Put(k.gang("a"), 1)])
            await asyncio.wait_for(got["a"].wait(), 30)  # liveness bound, not a timing
            with paused(victim):
                # Any call that finds the member unresponsive moves the store,
                # and the watch open on that member with it.
                with pytest.raises(StoreUnavailable):
                    await store.get(k.gang("a"))
                await store.txn([], [Put(k.gang("b"), 2)])
                await asyncio.wait_for(got["b"].wait(), 30)
            assert seen == ["a", "b"]
            assert breaks and "left unresponsive etcd member" in breaks[0], breaks
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await store.txn([], [Delete(k.root, prefix=True)])


async def test_unreachable_member_first_in_the_list_costs_one_call(members: list[EtcdServer], cluster_name: str, etcd_coordinator_tls: TlsFiles) -> None:
    # A member that refuses connections (not running) fails fast; the store
    # moves on the same way.
    dead = "127.0.0.1:1"
    async with Store([dead] + [m.endpoint for m in members], cluster_name, timeout=1.0, tls=etcd_coordinator_tls) as store:
        with pytest.raises(StoreUnavailable):
            await store.get(store.keys.gang("x"))
        assert store.current_endpoint == members[0].endpoint
        assert await store.get(store.keys.gang("x")) is None


async def test_watch_gang_stream_survives_its_coordinator_moving_to_another_member(
        members: list[EtcdServer], cluster_name: str, tmp_path, etcd_coordinator_tls: TlsFiles) -> None:
    """A client's WatchGang stream is served by a watch on the coordinator's
    current etcd member; when that member stops answering, the coordinator's
    store moves and breaks the watch, and WatchGang resumes it from the last
    revision: the client sees the gang's next state on the same stream."""
    import grpc

    from phalanx.v1 import gang_pb2 as gpb
    from phalanx.v1 import types_pb2 as pb
    from tests.integration.harness import LocalCluster, tiny

    t = one_failed_keepalive_timings()
    ordered = follower_first(members)
    victim = ordered[0]
    c = LocalCluster(",".join(m.endpoint for m in ordered), cluster_name, tmp_path, timings=t)
    c.store = Store([m.endpoint for m in ordered[1:]], cluster_name, timeout=2.0, tls=etcd_coordinator_tls)  # the test's own reads
    await c.start()
    try:
        coord = c.start_coordinator("az-a", "a0")
        await c.wait_leader("az-a")
        g = await c.submit(tiny("watched", members=1, gpus=1))  # no agents: it stays PENDING
        stream = c.stub().WatchGang(gpb.WatchGangRequest(id=g.id))
        first = await stream.read()
        assert first.gang.state == pb.GANG_STATE_PENDING
        with paused(victim):
            deadline = time.monotonic() + 30
            while "did not answer" not in coord.log_path.read_text():
                assert time.monotonic() < deadline, "the coordinator's store never left the paused member"
                await asyncio.sleep(0.1)
            while True:  # the cancel needs a leader: retry while one is (re-)elected
                try:
                    await c.stub().CancelGang(gpb.CancelGangRequest(id=g.id, reason="watched"), timeout=5)
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
                    await asyncio.sleep(0.2)
            last = first
            while last.gang.state != pb.GANG_STATE_CANCELLED:
                last = await asyncio.wait_for(stream.read(), 30)
                assert last is not grpc.aio.EOF, "the stream ended before the gang's end"
        assert last.gang.id == g.id and last.revision > first.revision
    finally:
        await c.close()
