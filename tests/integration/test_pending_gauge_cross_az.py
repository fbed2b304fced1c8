"""The pending gauge (``phalanx_gangs_pending{reason}``, docs/metrics.md) of a
cross-AZ gang's owner, scraped from the real /metrics endpoint of real
coordinator processes: while the owner awaits a placement (PENDING, or
RESERVING between two attempts after an ABORT) the gang waits in the one
queue like any other and counts under its admission plan's class
(``coordinator/core/gang_effects.py`` ``pending_gauge_class``), not under
``two_phase``, which is for an attempt in progress."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.metrics import PENDING_CLASSES
from phalanx.metrics import scrape
from phalanx.model import GangState
from phalanx.reservation import HoldState
from phalanx.timings import Timings
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import CoordProc, LocalCluster, dgx_node, tiny, until

pytestmark = pytest.mark.integration
METRICS = ["--metrics-listen", "127.0.0.1:0"]
GAUGE = "phalanx_gangs_pending"
# One whole node in each of az-a (the owner) and az-b: a 2 x 8-GPU cross-AZ
# gang needs both, so a single-AZ gang on bn0 leaves it no room.
SPAN = dict(members=2, gpus=8, topology=pb.TopologyConstraint(allow_cross_az=True))


def quiet_backfill() -> Timings:
    """No backfill window within the test: a waiting gang's class stays
    ``no_room`` (past the window the head would keep nodes, another class)."""
    return dataclasses.replace(Timings.fast(), backfill_window_s=600.0).validate()


async def pending_gauge(c: LocalCluster, p: CoordProc) -> dict[str, float]:
    text = await asyncio.to_thread(scrape, p.metrics, tls=c.pki.client_files(), cluster=c.cluster)
    out = dict.fromkeys(PENDING_CLASSES, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == GAUGE:
                out[s.labels["reason"]] = s.value
    return out


async def gauge_until(c: LocalCluster, p: CoordProc, want: dict[str, float], timeout: float = 30.0) -> dict[str, float]:
    """Scrape until the gauge is ``want`` (0 for every class not named): the
    leader publishes its view every metrics_view_interval_s. The last scrape
    either way."""
    full = dict.fromkeys(PENDING_CLASSES, 0.0) | want
    deadline = time.monotonic() + timeout
    while True:
        got = await pending_gauge(c, p)
        if got == full or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.2)


async def two_azs(c: LocalCluster, b_env: dict[str, str] | None = None) -> tuple[CoordProc, CoordProc]:
    a = c.start_coordinator("az-a", "a0", extra_args=METRICS)
    b = c.start_coordinator("az-b", "b0", extra_args=METRICS, extra_env=b_env)
    for az, node in (("az-a", "an0"), ("az-b", "bn0")):
        await c.wait_leader(az)
        c.start_agents(az, [dgx_node(node, az)])
    for az in ("az-a", "az-b"):
        await c.wait_nodes_ready(az, 1)
    return a, b


async def cancel(c: LocalCluster, p: CoordProc, gang: str) -> None:
    await c.stub(p.address).CancelGang(gpb.CancelGangRequest(id=gang, reason="test"), timeout=10)


async def test_a_pending_cross_az_gang_with_no_room_counts_under_no_room(etcd_endpoint, cluster_name, tmp_path) -> None:
    c = LocalCluster(etcd_endpoint, cluster_name, tmp_path, quiet_backfill())
    await c.start()
    try:
        a, b = await two_azs(c)
        blocker = await c.submit(tiny("blocker", members=1, gpus=8, duration=300.0), address=b.address)
        await c.wait_state(blocker.id, {pb.GANG_STATE_RUNNING}, timeout=30)
        span = await c.submit(tiny("span", duration=300.0, **SPAN), address=a.address)
        got = await gauge_until(c, a, {"no_room": 1})
        assert got == dict.fromkeys(PENDING_CLASSES, 0.0) | {"no_room": 1}, got
        assert (await c.etcd_gangs())[span.id].state is GangState.PENDING
        # The other AZ owns no pending gang: it counts none.
        assert set((await pending_gauge(c, b)).values()) == {0.0}
        # Room again: admitted, and no longer pending anywhere.
        await cancel(c, b, blocker.id)
        await c.wait_state(span.id, {pb.GANG_STATE_RUNNING}, timeout=30)
        got = await gauge_until(c, a, {})
        assert set(got.values()) == {0.0}, got
        await cancel(c, a, span.id)
    finally:
        await c.close()


async def test_a_cross_az_gang_between_two_attempts_counts_under_its_plan_class(etcd_endpoint, cluster_name,
                                                                                tmp_path: Path) -> None:
    """Attempt 1 aborts (az-b's vote comes after vote_timeout_s), a single-AZ
    gang of az-b takes bn0 meanwhile, and the owner then awaits a placement
    with the gang RESERVING at the aborted incarnation: no_room, not
    two_phase (and counted, unlike a RESERVING gang whose attempt runs)."""
    t = quiet_backfill()
    fp = tmp_path / "failpoints-b"
    fp.write_text(f"participant.after_prepared=delay({t.vote_timeout_s + 1.5:g})\n")
    c = LocalCluster(etcd_endpoint, cluster_name, tmp_path, t)
    await c.start()
    try:
        a, b = await two_azs(c, {"PHALANX_FAILPOINTS_FILE": str(fp)})
        k = c.store.keys
        span = await c.submit(tiny("span", duration=300.0, **SPAN), address=a.address)

        async def prepared_in_b() -> bool:
            r = (await c.etcd_reservations()).get(("az-b", span.id))
            return r is not None and r.state is HoldState.PREPARED
        await until("span PREPARED in az-b", prepared_in_b)
        # Waits behind the PREPARED hold; takes bn0 once the attempt aborts
        # (a retry of span meets the same late vote, or a NO, until it has).
        blocker = await c.submit(tiny("blocker", members=1, gpus=8, duration=300.0), address=b.address)
        await c.wait_state(blocker.id, {pb.GANG_STATE_RUNNING}, timeout=60)
        fp.write_text("")  # az-b votes in time from now on

        got = await gauge_until(c, a, {"no_room": 1})
        assert got == dict.fromkeys(PENDING_CLASSES, 0.0) | {"no_room": 1}, got
        g = (await c.etcd_gangs())[span.id]
        assert g.state is GangState.RESERVING
        decided = await c.store.get(k.decision(span.id, g.incarnation))
        assert decided is not None and decided.json()["outcome"] == "ABORT"
        # Room again: the next attempt commits, and the gauge empties.
        await cancel(c, b, blocker.id)
        running = await c.wait_state(span.id, {pb.GANG_STATE_RUNNING}, timeout=30)
        assert running.incarnation > g.incarnation
        got = await gauge_until(c, a, {})
        assert set(got.values()) == {0.0}, got
        await cancel(c, a, span.id)
    finally:
        await c.close()
