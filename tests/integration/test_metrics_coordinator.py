"""/metrics of real coordinator processes (docs/metrics.md): scraped over
HTTPS with the admin's client certificate and parsed with prometheus_client's
own parser; the counters and histograms move exactly as the test's gangs do."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import ssl
import time

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from phalanx.timings import Timings
from coordinator.metrics import PENDING_CLASSES
from phalanx.store import Delete
from phalanx.metrics import ScrapeError, scrape
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node, tiny
from tests.pki import ClusterPki

pytestmark = pytest.mark.integration
AZ = "az-a"
METRICS = ["--metrics-listen", "127.0.0.1:0"]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class Scraper:
    def __init__(self, c: LocalCluster) -> None:
        self.c = c

    async def get(self, cid: str) -> dict:
        p = self.c.coordinators[cid]
        assert p.metrics, "started without --metrics-listen?"
        text = await asyncio.to_thread(scrape, p.metrics, tls=self.c.pki.client_files(), cluster=self.c.cluster)
        return samples(text)

    async def until(self, cid: str, ok, timeout: float = 30.0) -> dict:
        """Scrape until ``ok(samples)`` (gauges follow the leader's view a
        moment later); the last scrape either way."""
        deadline = time.monotonic() + timeout
        while True:
            got = await self.get(cid)
            if ok(got) or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.2)


def value(s: dict, name: str, **labels: str) -> float:
    return s.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_counters_and_histograms_follow_the_gangs(local_cluster: LocalCluster) -> None:
    c = local_cluster
    leader_proc = c.start_coordinator(AZ, "m0", extra_args=METRICS)
    leader = await c.wait_leader(AZ)
    assert leader.coordinator_id == "m0"
    standby = c.start_coordinator(AZ, "m1", extra_args=METRICS)
    assert f"metrics at https://{leader_proc.metrics}/metrics" in leader_proc.log()
    c.start_agents(AZ, [dgx_node(f"n{i}", AZ) for i in range(2)])
    await c.wait_nodes_ready(AZ, 2)
    m = Scraper(c)

    n = 5
    # Through the standby: it forwards, the leader decides and counts.
    gangs = [await c.submit(tiny(f"g{i}", members=2, gpus=4, duration=0.3, queue="train"), address=standby.address)
             for i in range(n)]
    for g in gangs:
        assert (await c.wait_state(g.id, TERMINAL, timeout=60)).state == pb.GANG_STATE_SUCCEEDED

    s = await m.get("m0")
    assert value(s, "phalanx_gangs_submitted_total", queue="train") == n
    assert value(s, "phalanx_gangs_admitted_total", queue="train") == n
    assert value(s, "phalanx_gangs_finished_total", queue="train", outcome="SUCCEEDED") == n
    assert value(s, "phalanx_gangs_finished_total", queue="train", outcome="FAILED") == 0
    assert value(s, "phalanx_gang_restarts_total", queue="train") == 0
    assert value(s, "phalanx_gang_time_to_reserved_seconds_count", queue="train") == n
    assert value(s, "phalanx_gang_time_to_full_gang_seconds_count", queue="train") == n
    assert value(s, "phalanx_placement_decision_seconds_count") >= 1
    assert value(s, "phalanx_admission_cycle_seconds_count") >= 1
    assert value(s, "phalanx_leadership_changes_total", az=AZ) == 1
    assert value(s, "phalanx_leader_epoch", az=AZ) == leader.epoch
    assert value(s, "phalanx_is_leader", az=AZ) == 1
    assert value(s, "phalanx_etcd_request_seconds_count", kind="txn") >= 3 * n  # submit, reserve, ... per gang
    assert value(s, "phalanx_lease_keepalive_lag_seconds_count") >= 1
    assert value(s, "phalanx_fenced_writes_refused_total") == 0
    # No gang ids or node names in any label.
    for (name, labels) in s:
        for _, v in labels:
            assert not any(g.id in v for g in gangs) and v not in ("n0", "n1"), (name, labels)

    # The view's gauges: all devices free again, both agents and nodes up.
    s = await m.until("m0", lambda s: value(s, "phalanx_gpus", az=AZ, state="free") == 16)
    assert value(s, "phalanx_gpus", az=AZ, state="free") == 16
    assert value(s, "phalanx_gpus", az=AZ, state="used") == 0
    assert value(s, "phalanx_agents_connected", az=AZ) == 2
    assert value(s, "phalanx_nodes_ready", az=AZ) == 2
    assert value(s, "phalanx_reservations", state="COMMITTED") == 0

    # A running gang holds 8 GPUs; one that cannot fit waits as "no room".
    running = await c.submit(tiny("hold", members=2, gpus=4, duration=30.0))
    waiting = await c.submit(tiny("wait", members=2, gpus=8, duration=0.1))
    await c.wait_state(running.id, {pb.GANG_STATE_RUNNING}, timeout=60)
    s = await m.until("m0", lambda s: value(s, "phalanx_gangs_pending", reason="no_room") == 1
                      and value(s, "phalanx_gpus", az=AZ, state="used") == 8)
    assert value(s, "phalanx_gangs_pending", reason="no_room") == 1
    assert value(s, "phalanx_gpus", az=AZ, state="used") == 8
    assert value(s, "phalanx_reservations", state="COMMITTED") == 1
    for g in (running, waiting):
        await c.stub().CancelGang(gpb.CancelGangRequest(id=g.id, reason="test over"), timeout=10)
    s = await m.until("m0", lambda s: value(s, "phalanx_gangs_finished_total", queue="default", outcome="CANCELLED") == 2)
    assert value(s, "phalanx_gangs_finished_total", queue="default", outcome="CANCELLED") == 2
    assert value(s, "phalanx_gang_time_to_full_gang_seconds_count", queue="default") == 1  # only "hold" ran

    # The standby decided nothing: its gang counters did not move.
    s = await m.get("m1")
    assert value(s, "phalanx_gangs_submitted_total", queue="train") == 0
    assert value(s, "phalanx_is_leader", az=AZ) == 0
    assert value(s, "phalanx_leadership_changes_total", az=AZ) == 0


async def test_a_forced_restart_is_counted_once(local_cluster: LocalCluster) -> None:
    """One node of a running 2-node gang goes away: the leader tears the
    whole gang down and restarts it once (restarts=1)."""
    c = local_cluster
    c.start_coordinator(AZ, "r0", extra_args=METRICS)
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    b = c.start_agents(AZ, [dgx_node("n1", AZ)])
    await c.wait_nodes_ready(AZ, 2)
    m = Scraper(c)
    # 15 s: if the teardown's write is cut off with n1's session (it applies,
    # the leader learns of it from its next write), the restart waits for
    # n0's member to end; either way it is counted once.
    spec = tiny("restart-me", members=2, gpus=8, duration=15.0)
    spec.policy.max_restarts = 2
    g = await c.submit(spec)
    await c.wait_state(g.id, {pb.GANG_STATE_RUNNING}, timeout=60)
    b.stop.set()
    await asyncio.wait_for(b.task, 15)
    deadline = time.monotonic() + 60
    cur = None
    while time.monotonic() < deadline:
        cur = await c.stub().GetGang(gpb.GetGangRequest(id=g.id), timeout=5)
        if cur.incarnation >= 2 and cur.state == pb.GANG_STATE_PENDING:
            break
        await asyncio.sleep(0.2)
    assert cur is not None and cur.incarnation == 2 and cur.restarts == 1, cur

    def pending(s: dict) -> float:
        # no_room, or too_large once n1's record says not ready
        return sum(value(s, "phalanx_gangs_pending", reason=r) for r in PENDING_CLASSES)

    s = await m.until("r0", lambda s: pending(s) == 1)
    assert value(s, "phalanx_gang_restarts_total", queue="default") == 1, c.coordinators["r0"].log()
    assert value(s, "phalanx_gangs_admitted_total", queue="default") == 1  # incarnation 2 has no room (n1 is gone)
    assert value(s, "phalanx_gangs_finished_total", queue="default", outcome="FAILED") == 0
    assert pending(s) == 1
    await c.stub().CancelGang(gpb.CancelGangRequest(id=g.id, reason="test over"), timeout=10)
    s = await m.until("r0", lambda s: value(s, "phalanx_gangs_finished_total", queue="default", outcome="CANCELLED") == 1)
    assert value(s, "phalanx_gangs_finished_total", queue="default", outcome="CANCELLED") == 1
    assert value(s, "phalanx_gang_restarts_total", queue="default") == 1


async def test_a_stale_epoch_write_is_refused_and_counted(local_cluster: LocalCluster) -> None:
    """The leader key is deleted behind the leader's back (its lease still
    valid): its next write (a submission) is refused by etcd's epoch compare; the leader steps down and
    wins again with a new epoch. Its guard on its own record would notice the
    delete first (test_leader_record_guard.py): switched off here, so the
    fence alone is what refuses."""
    c = local_cluster
    c.start_coordinator(AZ, "f0", extra_args=METRICS, extra_env={"PHALANX_FAILPOINTS": "election.guard_off=on"})
    first = await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    m = Scraper(c)
    s = await m.get("f0")
    assert value(s, "phalanx_fenced_writes_refused_total") == 0
    assert value(s, "phalanx_leadership_changes_total", az=AZ) == 1
    await c.store.txn([], [Delete(c.store.keys.leader(AZ))])
    # A submission is a fenced write the leader makes at once (an idle
    # leader writes nothing periodically): refused, so it steps down.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub().SubmitGang(gpb.SubmitGangRequest(spec=tiny("after-delete", members=1)), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    second = await c.wait_leader(AZ, not_epoch=first.epoch, timeout=60)
    assert second.epoch > first.epoch and second.coordinator_id == "f0"
    s = await m.until("f0", lambda s: value(s, "phalanx_leader_epoch", az=AZ) == second.epoch)
    assert value(s, "phalanx_fenced_writes_refused_total") == 1
    assert value(s, "phalanx_leadership_changes_total", az=AZ) == 2
    assert value(s, "phalanx_leader_epoch", az=AZ) == second.epoch


async def test_scrapes_without_a_cluster_certificate_are_refused(local_cluster: LocalCluster, tmp_path) -> None:
    c = local_cluster
    p = c.start_coordinator(AZ, "s0", extra_args=METRICS)
    await c.wait_leader(AZ)
    # Plaintext HTTP to the HTTPS port: the connection is closed, no metrics.
    with pytest.raises(ScrapeError):
        await asyncio.to_thread(scrape, p.metrics, tls=None, cluster=c.cluster)
    # TLS with a certificate of another cluster's CA: refused in the handshake.
    other = ClusterPki(tmp_path / "other", "elsewhere").client_files()
    host, port = p.metrics.rsplit(":", 1)

    def foreign() -> bytes:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.load_cert_chain(str(other.cert), str(other.key))
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            with ctx.wrap_socket(raw) as conn:
                conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                return conn.recv(65536)

    try:
        # (With TLS 1.3 the client's handshake may finish before the server
        # refuses its certificate: then the refusal is an empty read.)
        got = await asyncio.to_thread(foreign)
    except (ssl.SSLError, OSError):
        got = b""
    assert got == b"", got
    # The admin's certificate is answered.
    assert "phalanx_leader_epoch" in await asyncio.to_thread(scrape, p.metrics, tls=c.pki.client_files(), cluster=c.cluster)


async def test_collected_gangs_are_counted(etcd_endpoint, cluster_name, tmp_path) -> None:
    """With the shortest retention the fast timings allow, two finished
    gangs are deleted from etcd and counted once each."""
    timings = dataclasses.replace(Timings.fast(), gang_retention_s=12.0).validate()
    c = await LocalCluster(etcd_endpoint, cluster_name, tmp_path, timings=timings).start()
    try:
        c.start_coordinator(AZ, "g0", extra_args=METRICS)
        await c.wait_leader(AZ)
        c.start_agents(AZ, [dgx_node("n0", AZ)])
        await c.wait_nodes_ready(AZ, 1)
        gangs = [await c.submit(tiny(f"old{i}", members=1, gpus=1, duration=0.1)) for i in range(2)]
        for g in gangs:
            await c.wait_state(g.id, TERMINAL, timeout=60)
        for g in gangs:
            assert await c.wait_deleted(c.store.keys.gang(g.id), timeout=60), g.id
        s = await Scraper(c).until("g0", lambda s: value(s, "phalanx_gangs_collected_total") == 2)
        assert value(s, "phalanx_gangs_collected_total") == 2
        assert value(s, "phalanx_gangs_finished_total", queue="default", outcome="SUCCEEDED") == 2
    finally:
        await c.close()


async def test_a_cross_az_gang_is_counted_by_its_owner(local_cluster: LocalCluster) -> None:
    """A 3-AZ gang: the owner AZ's leader counts the submission, the
    admission (committed in every AZ) and one two-phase commit; the other
    leaders count none of those, and every AZ's holds go back to 0."""
    c = local_cluster
    azs = ("az-a", "az-b", "az-c")
    for az in azs:
        c.start_coordinator(az, f"x{az[-1]}", extra_args=METRICS)
    for az in azs:
        await c.wait_leader(az)
        c.start_agents(az, [dgx_node(f"{az[-1]}n0", az)])
    for az in azs:
        await c.wait_nodes_ready(az, 1)
    m = Scraper(c)
    g = await c.submit(tiny("span", members=3, gpus=8, duration=0.5, topology=pb.TopologyConstraint(allow_cross_az=True)),
                       address=c.coordinators["xa"].address)
    done = await c.wait_state(g.id, TERMINAL, timeout=60)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    assert sorted(p.az for p in done.placement) == list(azs)
    owner = "x" + done.owner_az[-1]
    s = await m.until(owner, lambda s: value(s, "phalanx_gangs_finished_total", queue="default", outcome="SUCCEEDED") == 1)
    assert value(s, "phalanx_gangs_submitted_total", queue="default") == 1
    assert value(s, "phalanx_gangs_admitted_total", queue="default") == 1
    assert value(s, "phalanx_gangs_finished_total", queue="default", outcome="SUCCEEDED") == 1
    assert value(s, "phalanx_twophase_outcomes_total", outcome="commit") == 1
    assert value(s, "phalanx_twophase_outcomes_total", outcome="abort") == 0
    for cid in ("xa", "xb", "xc"):
        s = await m.until(cid, lambda s: value(s, "phalanx_twophase_holds", state="COMMITTED") == 0)
        assert value(s, "phalanx_twophase_holds", state="COMMITTED") == 0
        assert value(s, "phalanx_twophase_holds", state="PREPARED") == 0
        if cid != owner:
            assert value(s, "phalanx_gangs_admitted_total", queue="default") == 0
            assert value(s, "phalanx_twophase_outcomes_total", outcome="commit") == 0
