"""Bounded watch fan-out (docs/events.md "Bounds and resume", issue 22 item
2): a real coordinator and etcd, streams that are never read, small caps.

- Past the per-identity and the total cap a stream is refused
  RESOURCE_EXHAUSTED naming the cap and the count; admission goes on; the
  leader keeps its lease; etcd's watcher count does not grow per stream.
- A reader that falls a buffer bound behind is dropped RESOURCE_EXHAUSTED
  naming the bound, and its slot is given back.
- A stream reopened with the revision it last received gets what was
  recorded while it was closed, from the coordinator's history.
"""

from __future__ import annotations

import asyncio
import signal
import ssl
import urllib.request
from typing import Any

import grpc
import pytest

from phalanx.client import AsyncClient
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import gang_pb2_grpc as ggrpc
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node, tiny
from tests.pki import etcd_pki_for
from tests.integration.test_metrics_coordinator import METRICS, Scraper, value

AZ = "az-a"
PER_IDENTITY, TOTAL, BUFFER = 4, 6, 4
# Changes kept for a resume: a gang's life is 4 or 5 changes that carry
# events (submitted, placed+reserved, started, finished; a restart more).
HISTORY = 8
CAPS = ["--watch-streams-per-identity", str(PER_IDENTITY), "--watch-streams-total", str(TOTAL),
        "--watch-buffer", str(BUFFER)]
# A reader's HTTP/2 window kept at a few hundred bytes: a stream it never
# reads stops taking writes after a few events (else grpc's window grows to MBs).
SMALL_WINDOW = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024))


def etcd_watchers(c: LocalCluster) -> float:
    """etcd's own count of open watchers (its /metrics, as the etcd root user)."""
    tls = etcd_pki_for(c.etcd).root
    ctx = ssl.create_default_context(cafile=str(tls.ca))
    ctx.load_cert_chain(str(tls.cert), str(tls.key))
    text = urllib.request.urlopen(f"https://{c.etcd}/metrics", context=ctx, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("etcd_debugging_mvcc_watcher_total "):
            return float(line.split()[1])
    raise AssertionError("etcd does not export etcd_debugging_mvcc_watcher_total")


async def opened(call: Any) -> tuple[bool, grpc.StatusCode | None, str]:
    """(True, None, "") once the stream's headers came; (False, code,
    details) when it was refused instead."""
    await call.initial_metadata()
    if call.done():
        return False, await call.code(), await call.details()
    return True, None, ""


async def setup(c: LocalCluster, *more: str) -> tuple[str, Scraper]:
    proc = c.start_coordinator(AZ, "w0", extra_args=[*METRICS, *CAPS, *more])
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node(f"n{i}", AZ) for i in range(2)])
    await c.wait_nodes_ready(AZ, 2)
    return proc.address, Scraper(c)


async def test_streams_past_the_caps_are_refused_and_admission_goes_on(local_cluster: LocalCluster) -> None:
    c = local_cluster
    address, m = await setup(c)
    before = await asyncio.to_thread(etcd_watchers, c)
    viewer = c.channel(address, role="viewer", name="v")
    admin = c.channel(address)
    try:
        calls = [ggrpc.GangServiceStub(viewer).WatchEvents(gpb.WatchEventsRequest()) for _ in range(PER_IDENTITY + 3)]
        # (They start at once, in any order: which ones are refused is not fixed.)
        results = [await opened(call) for call in calls]
        refused = [(code, details) for ok, code, details in results if not ok]
        assert len(refused) == 3, results
        for code, details in refused:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"viewer/v has {PER_IDENTITY} open, the per-identity cap is {PER_IDENTITY}" in details, details
        others = [ggrpc.GangServiceStub(admin).WatchEvents(gpb.WatchEventsRequest()) for _ in range(TOTAL - PER_IDENTITY + 1)]
        results = [await opened(call) for call in others]
        refused = [(code, details) for ok, code, details in results if not ok]
        assert len(refused) == 1, results
        assert refused[0][0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"this coordinator has {TOTAL} open, the total cap is {TOTAL}" in refused[0][1]
        # A WatchGang stream counts too.
        gang = await c.submit(tiny("w-first", members=2, duration=0.2))
        watch = ggrpc.GangServiceStub(viewer).WatchGang(gpb.WatchGangRequest(id=gang.id))
        ok, code, details = await opened(watch)
        if ok:  # (it may have finished first: then it is sent and closed, no stream)
            got = await watch.read()
            assert got is grpc.aio.EOF or got.gang.state in TERMINAL, "a WatchGang past the caps was served"
            if got is not grpc.aio.EOF:
                assert await watch.code() == grpc.StatusCode.OK
        else:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "per-identity cap" in details

        # Admission goes on while the streams are held (never read).
        for i in range(3):
            g = await c.submit(tiny(f"w{i}", members=2, duration=0.2))
            await c.wait_state(g.id, TERMINAL, timeout=60)
        s = await m.get("w0")
        assert value(s, "phalanx_leadership_changes_total", az=AZ) == 1
        assert value(s, "phalanx_watch_streams") == TOTAL
        assert value(s, "phalanx_watch_streams_top_identity") == PER_IDENTITY
        assert value(s, "phalanx_watch_streams_refused_total", cap="per_identity") >= 3
        assert value(s, "phalanx_watch_streams_refused_total", cap="total") == 1
        # One etcd watch feeds them all: not one per stream.
        after = await asyncio.to_thread(etcd_watchers, c)
        assert after - before <= 1, f"etcd watchers grew from {before} to {after} for {TOTAL} streams"

        # Closing streams gives their slots back.
        for call in calls:
            call.cancel()
        await m.until("w0", lambda s: value(s, "phalanx_watch_streams") == TOTAL - PER_IDENTITY)
        again = ggrpc.GangServiceStub(viewer).WatchEvents(gpb.WatchEventsRequest())
        assert (await opened(again))[0]
        again.cancel()
        for call in others:
            call.cancel()
    finally:
        await viewer.close()
        await admin.close()


async def test_a_reader_a_buffer_behind_is_dropped_naming_the_bound(local_cluster: LocalCluster) -> None:
    c = local_cluster
    address, m = await setup(c)
    slow = c.channel(address, role="viewer", name="slow", options=SMALL_WINDOW)
    try:
        call = ggrpc.GangServiceStub(slow).WatchEvents(gpb.WatchEventsRequest())
        assert (await opened(call))[0]
        # Each gang writes several events; the reader reads none.
        gangs = []
        for i in range(8):
            gangs.append(await c.submit(tiny(f"s{i}", members=2, duration=0.1)))
        await m.until("w0", lambda s: value(s, "phalanx_watch_streams_dropped_total", reason="slow") >= 1, timeout=90)
        s = await m.until("w0", lambda s: value(s, "phalanx_watch_streams") == 0)
        assert value(s, "phalanx_watch_streams_dropped_total", reason="slow") == 1
        assert value(s, "phalanx_watch_streams") == 0  # its slot is given back at once
        # What it had been sent before, then the status naming the bound.
        got = 0
        try:
            async for _ in call:
                got += 1
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"more than {BUFFER} changes behind" in (exc.details() or ""), exc.details()
            assert "--watch-buffer" in (exc.details() or "")
        else:
            raise AssertionError(f"the slow stream ended OK after {got} events")
        for g in gangs:
            await c.wait_state(g.id, TERMINAL, timeout=60)
    finally:
        await slow.close()


async def read_until(call: Any, ok: Any, timeout: float = 60.0) -> list[gpb.ClusterEvent]:
    out: list[gpb.ClusterEvent] = []

    async def go() -> None:
        async for ce in call:
            out.append(ce)
            if ok(out):
                return

    await asyncio.wait_for(go(), timeout)
    return out


def finished(gang_id: str) -> Any:
    return lambda evs: any(e.gang_id == gang_id and e.event.kind == "finished" for e in evs)


async def test_a_reopened_stream_resumes_after_the_last_revision_it_received(local_cluster: LocalCluster) -> None:
    c = local_cluster
    address, m = await setup(c, "--watch-history", str(HISTORY))
    ch = c.channel(address)
    try:
        stub = ggrpc.GangServiceStub(ch)
        first = stub.WatchEvents(gpb.WatchEventsRequest())
        assert (await opened(first))[0]
        a = await c.submit(tiny("r-a", members=2, duration=0.1))
        seen = await read_until(first, finished(a.id))
        last = seen[-1].revision
        assert last > 0 and all(x.revision <= y.revision for x, y in zip(seen, seen[1:]))
        first.cancel()
        # Recorded while no stream is open.
        b = await c.submit(tiny("r-b", members=2, duration=0.1))
        await c.wait_state(b.id, TERMINAL, timeout=60)
        resumed = stub.WatchEvents(gpb.WatchEventsRequest(after_revision=last))
        assert (await opened(resumed))[0]
        assert dict(await resumed.initial_metadata()).get("x-phalanx-resume") == "resumed"
        again = await read_until(resumed, finished(b.id))
        kinds = [e.event.kind for e in again if e.gang_id == b.id]
        assert kinds[0] == "submitted" and kinds[-1] == "finished", kinds
        assert not [e for e in again if e.gang_id == a.id and e.revision <= last], "sent again what it had"
        resumed.cancel()
        # More changes than the history keeps: a resume after `last` would
        # miss some, so the stream starts from now and says so.
        for name in ("r-c", "r-d", "r-e"):
            g = await c.submit(tiny(name, members=2, duration=0.1))
            await c.wait_state(g.id, TERMINAL, timeout=60)
        gap = stub.WatchEvents(gpb.WatchEventsRequest(after_revision=last))
        assert (await opened(gap))[0]
        assert dict(await gap.initial_metadata()).get("x-phalanx-resume") == "gap"
        gap.cancel()
        bad = stub.WatchEvents(gpb.WatchEventsRequest(after_revision=-1))
        ok, code, details = await opened(bad)
        assert not ok and code == grpc.StatusCode.INVALID_ARGUMENT and "after_revision" in details
        s = await m.until("w0", lambda s: value(s, "phalanx_watch_streams") == 0)
        assert value(s, "phalanx_watch_streams") == 0
    finally:
        await ch.close()


@pytest.mark.parametrize("history", [4096, 2])
async def test_the_sdk_resumes_on_another_coordinator_with_what_was_recorded_meanwhile(
        local_cluster: LocalCluster, history: int) -> None:
    """With the default history the coordinator it reopens on still holds
    what was recorded while the stream was closed, and sends it; with a
    history of 2 changes (outrun by a gang's life) it does not, and the SDK
    says so through on_gap."""
    c = local_cluster
    c.start_coordinator(AZ, "w0", extra_args=["--watch-history", str(history)])
    await c.wait_leader(AZ)
    standby = c.start_coordinator(AZ, "w1")
    c.start_agents(AZ, [dgx_node(f"n{i}", AZ) for i in range(2)])
    await c.wait_nodes_ready(AZ, 2)
    leader_address = c.coordinators["w0"].address
    gaps: list[int] = []
    async with AsyncClient([standby.address, leader_address], timeout=10, tls_dir=c.client_dir()) as client:
        opened_at: list[str] = []
        is_open = asyncio.Event()

        def on_open() -> None:
            opened_at.append(client.last_address)
            is_open.set()

        stream = client.watch_cluster_events(on_open=on_open, on_gap=gaps.append)
        got: list[gpb.ClusterEvent] = []
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.wait_for(is_open.wait(), 60)
        a = await c.submit(tiny("sdk-a", members=2, duration=0.1), address=leader_address)
        got.append(await asyncio.wait_for(first, 60))
        while not finished(a.id)(got):
            got.append(await asyncio.wait_for(stream.__anext__(), 60))
        # The stream's coordinator goes away while the reader is not reading;
        # a gang runs its whole life meanwhile.
        standby.signal(signal.SIGKILL)
        b = await c.submit(tiny("sdk-b", members=2, duration=0.1), address=leader_address)
        await c.wait_state(b.id, TERMINAL, timeout=60)
        if history == 2:
            # Nothing of b is sent; a gang after the reopen arrives.
            is_open.clear()
            following = asyncio.ensure_future(stream.__anext__())
            await asyncio.wait_for(is_open.wait(), 60)
            d = await c.submit(tiny("sdk-d", members=2, duration=0.1), address=leader_address)
            got.append(await asyncio.wait_for(following, 60))
            while not finished(d.id)(got):
                got.append(await asyncio.wait_for(stream.__anext__(), 60))
        else:
            while not finished(b.id)(got):
                got.append(await asyncio.wait_for(stream.__anext__(), 60))
        await stream.aclose()
    assert len(opened_at) == 2 and opened_at[1] == leader_address, opened_at
    kinds = [e.event.kind for e in got if e.gang_id == b.id]
    if history == 2:
        # on_gap names the revision asked for: just before a's last one.
        assert kinds == [] and gaps == [max(e.revision for e in got if e.gang_id == a.id) - 1], (kinds, gaps)
    else:
        assert kinds[0] == "submitted" and kinds[-1] == "finished", kinds
        assert gaps == []
    seqs = [(e.gang_id, e.event.seq) for e in got]
    assert len(seqs) == len(set(seqs)), "an event was sent twice"
