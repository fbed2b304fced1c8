"""etcd full (docs/etcd-keys.md "When etcd is full"), on a real etcd started
with a quota too small on purpose: once its NOSPACE alarm fires, the
client's SubmitGang error names it (RESOURCE_EXHAUSTED), `phalanx status`
prints the error line, the coordinator's metrics show it and its log says it
at ERROR with the recovery steps; the documented recovery (compact, defrag,
disarm with etcdctl as root) brings admission back."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import grpc
import pytest

from phalanx.errors import StoreSpaceExhausted
from phalanx.etcd_server import EtcdServer
from phalanx.metrics import scrape
from phalanx.store import Put, Store
from phalanx.v1 import types_pb2 as pb
from tests.conftest import etcdctl
from tests.integration.harness import LocalCluster, dgx_node, tiny, until
from tests.integration.test_metrics_coordinator import samples
from tests.pki import EtcdPki, provision, register, unregister

pytestmark = pytest.mark.integration
AZ = "az-a"
# Small enough to fill in a few seconds, large enough for a cluster's own
# keys (users, roles, a leader, nodes, a few gangs) with room to spare.
QUOTA = 6 * 1024 * 1024
JUNK = 256 * 1024  # one junk value: well under etcd's 1.5 MiB request limit


@pytest.fixture
def tiny_etcd(tmp_path, etcd_pki: EtcdPki):
    """An etcd of its own (the session's must not fill up), TLS and auth on
    as in every test, with --quota-backend-bytes QUOTA."""
    server = EtcdServer(data_dir=tmp_path / "etcd", name="tiny", log_path=tmp_path / "etcd.log",
                        tls_dir=etcd_pki.dir, quota_backend_bytes=QUOTA)
    server.start().wait_ready()
    register(server.endpoint, etcd_pki)
    try:
        yield server
    finally:
        unregister(server.endpoint)
        server.stop()


async def fill(endpoint: str, pki: EtcdPki) -> int:
    """Overwrite one key, as etcd's root user, until etcd refuses for want of
    space: the history of one key fills it as a gang record's updates do,
    and a compaction frees it. Returns how many writes passed."""
    async with Store(endpoint, "junk", tls=pki.root) as s:
        for n in range(4 * QUOTA // JUNK):
            try:
                await s.txn([], [Put("/junk/history", os.urandom(JUNK))])
            except StoreSpaceExhausted:
                return n
    raise AssertionError(f"etcd took {4 * QUOTA} bytes of writes under a {QUOTA}-byte quota")


def status_cli(c: LocalCluster, address: str) -> str:
    out = subprocess.run([sys.executable, "-m", "phalanx", "status", "--address", address], env=c.client_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def logged(coord, text: str):
    async def seen() -> bool:
        return text in coord.log()
    return seen


async def metrics(c: LocalCluster, cid: str) -> dict:
    text = await asyncio.to_thread(scrape, c.coordinators[cid].metrics, tls=c.pki.client_files(), cluster=c.cluster)
    return {name: v for (name, labels), v in samples(text).items() if name.startswith("phalanx_etcd_")}


def recover(endpoint: str) -> None:
    """docs/etcd-keys.md "When etcd is full", step by step."""
    status = json.loads(etcdctl(endpoint, "endpoint", "status", "-w", "json"))
    revision = status[0]["Status"]["header"]["revision"]
    etcdctl(endpoint, "compaction", str(revision))
    etcdctl(endpoint, "defrag")
    etcdctl(endpoint, "alarm", "disarm")
    assert etcdctl(endpoint, "alarm", "list").strip() == ""


async def test_space_alarm_seen_everywhere_and_recovery_restores_admission(tiny_etcd, etcd_pki, tmp_path) -> None:
    endpoint = tiny_etcd.endpoint
    cluster = "t" + uuid.uuid4().hex[:10]
    provision(endpoint, etcd_pki, cluster)
    c = LocalCluster(endpoint, cluster, tmp_path, etcd_pki=etcd_pki)
    await c.start()
    # The scenario: the coordinator says the alarm is on, at ERROR.
    c.expect_log(r"ERROR coordinator\.etcd_space: etcd's space alarm \(NOSPACE\) is active")
    # Filling etcd passes 80 % of its quota on the way: whether a space
    # reading falls in that moment, and says so at ERROR, depends on timing.
    c.expect_log(r"ERROR coordinator\.etcd_space: etcd is nearly full")
    try:
        coord = c.start_coordinator(AZ, "a0", extra_args=["--metrics-listen", "127.0.0.1:0",
                                                          "--etcd-quota-bytes", str(QUOTA)])
        await c.wait_leader(AZ)
        c.start_agents(AZ, [dgx_node("n0", AZ)])
        await c.wait_nodes_ready(AZ, 1)
        before = await c.submit(tiny("before", members=1, gpus=1, duration=0.2))
        await c.wait_state(before.id, {pb.GANG_STATE_SUCCEEDED})
        assert "error:" not in status_cli(c, coord.address)
        got = await metrics(c, "a0")
        assert got["phalanx_etcd_db_quota_bytes"] == QUOTA and got["phalanx_etcd_space_alarm"] == 0
        assert 0 < got["phalanx_etcd_db_size_bytes"] < QUOTA

        assert await fill(endpoint, etcd_pki) > 0
        assert "NOSPACE" in etcdctl(endpoint, "alarm", "list")

        # The client's error names etcd's space alarm, not a generic etcd error.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.submit(tiny("during", members=1, gpus=1, duration=0.2))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "space alarm (NOSPACE)" in (err.value.details() or "")
        out = status_cli(c, coord.address)
        assert "error: etcd's space alarm (NOSPACE) is active" in out, out
        got = await metrics(c, "a0")
        assert got["phalanx_etcd_space_alarm"] == 1
        # The status above read etcd afresh; the log says it once, at ERROR, with the steps.
        await until("the alarm logged", logged(coord, "etcd's space alarm (NOSPACE) is active"))
        alarm_lines = [line for line in coord.log().splitlines() if "etcd's space alarm (NOSPACE) is active" in line]
        assert len(alarm_lines) == 1 and "ERROR" in alarm_lines[0] and "etcdctl alarm disarm" in alarm_lines[0]

        recover(endpoint)

        after = await c.submit(tiny("after", members=1, gpus=1, duration=0.2))
        await c.wait_state(after.id, {pb.GANG_STATE_SUCCEEDED})
        assert "error:" not in status_cli(c, coord.address)
        assert (await metrics(c, "a0"))["phalanx_etcd_space_alarm"] == 0
        await until("the recovery logged", logged(coord, "etcd has room again"))
    finally:
        await c.close()
