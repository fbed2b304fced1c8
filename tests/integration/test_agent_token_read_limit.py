"""``AgentService.ReadToken`` is rate limited per node identity on a real
coordinator (TLS, real etcd; coordinator/throttle.py, docs/limits.md "Rate
limits"): past the bucket a read is RESOURCE_EXHAUSTED naming the limit, the
flags and when to retry, another node is untouched, and the refusal is
counted in ``phalanx_requests_throttled_total{kind="token_read"}``."""

from __future__ import annotations

import grpc
import pytest

from agent.coordinator_reads import CoordinatorReads
from phalanx.errors import StoreUnavailable
from phalanx.v1 import agent_pb2 as apb
from phalanx.v1 import agent_pb2_grpc as agrpc
from tests.integration.harness import LocalCluster
from tests.integration.test_metrics_coordinator import METRICS, Scraper, value

pytestmark = pytest.mark.integration
AZ = "az-a"
LIMITS = ["--token-read-rate", "0.001", "--token-read-burst", "2"]


async def test_token_reads_past_the_limit_are_refused_per_node(local_cluster: LocalCluster) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "c0", extra_args=LIMITS + METRICS)
    await c.wait_leader(AZ)
    async with c.channel(coord.address, role="agent", name="n1") as ch:
        stub = agrpc.AgentServiceStub(ch)
        for _ in range(2):
            reply = await stub.ReadToken(apb.TokenReadRequest(az=AZ), timeout=10)
            assert reply.leader.present
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ReadToken(apb.TokenReadRequest(az=AZ), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    details = err.value.details()
    assert "token reads of n1 are limited to 0.001/s with a burst of 2" in details, details
    assert "--token-read-rate" in details and "retry in " in details, details
    # Another node has its own bucket.
    async with c.channel(coord.address, role="agent", name="n2") as ch:
        assert (await agrpc.AgentServiceStub(ch).ReadToken(apb.TokenReadRequest(az=AZ), timeout=10)).leader.present
    s = await Scraper(c).until("c0", lambda s: value(s, "phalanx_requests_throttled_total", kind="token_read") == 1)
    assert value(s, "phalanx_requests_throttled_total", kind="register") == 0


async def test_an_agent_takes_a_throttled_read_as_unavailable_not_denied(local_cluster: LocalCluster) -> None:
    """Throttled is transient for the agent (agent/coordinator_reads.py): the
    next replica is asked, and with none left the read is unavailable (its
    token unconfirmed, the start sent again), never a refusal."""
    c = local_cluster
    coord = c.start_coordinator(AZ, "c0", extra_args=LIMITS)
    await c.wait_leader(AZ)
    reads = CoordinatorReads([coord.address], c.cluster, AZ, tls=c.pki.agent("n1"), timeout=10)
    try:
        for _ in range(2):
            assert await reads.get(reads.keys.leader(AZ)) is not None
        with pytest.raises(StoreUnavailable, match="RESOURCE_EXHAUSTED: token read: rate limit"):
            await reads.get(reads.keys.leader(AZ))
    finally:
        await reads.close()
