"""Rate limits per identity on a real coordinator (TLS, real etcd):
submissions past the bucket and registrations past theirs are
RESOURCE_EXHAUSTED naming the limit with a retry hint, nothing is written,
other identities are untouched, and the refusals are counted on /metrics."""

from __future__ import annotations

import grpc
import pytest

from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import gang_pb2_grpc as ggrpc
from tests.integration.harness import LocalCluster, tiny
from tests.integration.test_metrics_coordinator import METRICS, Scraper, value
from tests.integration.test_tls_cluster import AZ
from tests.integration.test_tls_peers import NODE_X, _files, _register, _snapshot, pki  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration
LIMITS = ["--submit-rate", "0.001", "--submit-burst", "2", "--register-rate", "0.001", "--register-burst", "2"]


async def test_submissions_past_the_limit_are_refused_per_identity(local_cluster: LocalCluster) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "c0", extra_args=LIMITS + METRICS)
    await c.wait_leader(AZ)
    async with c.channel(coord.address, role="submitter", name="alice", queues=("default",)) as ch:
        stub = ggrpc.GangServiceStub(ch)
        for i in range(2):
            await stub.SubmitGang(gpb.SubmitGangRequest(spec=tiny(f"alice-{i}", members=1)), timeout=10)
        before = await _snapshot(c)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SubmitGang(gpb.SubmitGangRequest(spec=tiny("alice-2", members=1)), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    details = err.value.details()
    assert "submissions from submitter/alice are limited to 0.001/s with a burst of 2" in details, details
    assert "--submit-rate" in details and "retry in " in details, details
    assert await _snapshot(c) == before, "a throttled submission wrote something"
    # Another identity has its own bucket.
    async with c.channel(coord.address, role="submitter", name="bob", queues=("default",)) as ch:
        await ggrpc.GangServiceStub(ch).SubmitGang(gpb.SubmitGangRequest(spec=tiny("bob-0", members=1)), timeout=10)
    s = await Scraper(c).until("c0", lambda s: value(s, "phalanx_requests_throttled_total", kind="submit") == 1)
    assert value(s, "phalanx_requests_throttled_total", kind="register") == 0


async def test_registrations_past_the_limit_are_refused(local_cluster: LocalCluster, pki) -> None:  # noqa: F811
    c = local_cluster
    coord = c.start_coordinator(AZ, "c0", extra_args=["--tls-dir", str(pki["ca"])] + LIMITS)
    await c.wait_leader(AZ)
    for _ in range(2):
        ch, call = await _register(coord.address, c, pki["agent"], NODE_X)
        call.cancel()
        await ch.close()
    before = await _snapshot(c)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _register(coord.address, c, pki["agent"], NODE_X)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    assert "registrations of ax are limited to 0.001/s with a burst of 2" in err.value.details(), err.value.details()
    assert await _snapshot(c) == before, "a throttled registration wrote something"
