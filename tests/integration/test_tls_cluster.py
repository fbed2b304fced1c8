"""A cluster that runs with mutual TLS (opt-in ``--tls-dir``, docs/security.md):
real coordinator and agent processes with certificates made by
phalanx.certs, the SDK and the CLI connecting with a client certificate.
Refused clients (plaintext, another CA's certificate) write nothing to etcd,
checked in etcd directly."""

from __future__ import annotations

import asyncio
import datetime
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.server import PLAINTEXT_WARNING
from phalanx import certs
from phalanx.client import AsyncClient
from phalanx.errors import PhalanxError
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import REPO, LocalCluster, tiny

pytestmark = pytest.mark.integration
AZ = "az-a"
NODE = "tls-n1"
FIX = REPO / "tests" / "fixtures" / "topology" / "hgx-h100"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def client_dir(dest: Path, ca_pem: bytes, crt: Path, key: Path) -> Path:
    """A client TLS directory as the SDK and the CLI read it."""
    dest.mkdir(mode=0o700)
    (dest / "ca.crt").write_bytes(ca_pem)
    shutil.copy(crt, dest / "client.crt")
    shutil.copy(key, dest / "client.key")
    return dest


@pytest.fixture
def pki(local_cluster: LocalCluster, tmp_path: Path) -> dict[str, Path]:
    ca = tmp_path / "pki"
    certs.init_ca(ca, local_cluster.cluster, now=_now())
    for cid in ("c0", "c1"):
        certs.issue(ca, "coordinator", cid, now=_now())
    certs.issue(ca, "agent", NODE, node=NODE, now=_now())
    crt, key, _ = certs.issue(ca, "submitter", "bob", queues=["default"], now=_now())
    submitter = client_dir(tmp_path / "bob", (ca / "ca.crt").read_bytes(), crt, key)
    # Another CA of the same cluster name: its certificate must not get in.
    # The client trusts both CAs (a bundle), so it passes its own checks and
    # the coordinator is the one that refuses it.
    other = tmp_path / "other-pki"
    certs.init_ca(other, local_cluster.cluster, now=_now())
    ocrt, okey, _ = certs.issue(other, "admin", "mallory", now=_now())
    outsider = client_dir(tmp_path / "mallory", (ca / "ca.crt").read_bytes() + (other / "ca.crt").read_bytes(), ocrt, okey)
    return {"ca": ca, "submitter": submitter, "outsider": outsider}


def start_agent(c: LocalCluster, tls_dir: Path) -> subprocess.Popen:
    log = c.workdir / f"agent-{NODE}.log"
    cmd = [
        sys.executable, "-m", "agent", "--cluster", c.cluster, "--az", AZ, "--etcd", c.etcd, "--node", NODE,
        "--simulate-members", "--timings", c._timings_json(), "--tls-dir", str(tls_dir),
        "--nvml-recording", str(FIX / "nvml.json"), "--sysfs-recording", str(FIX / "sysfs.json"),
        "--state-dir", str(c.workdir / "agent-state"), "--log-level", "INFO",
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=REPO)
    ready, _, _ = select.select([p.stdout], [], [], 30)
    line = p.stdout.readline() if ready else ""
    assert "PHALANX_AGENT_READY" in line, log.read_text()
    return p


async def wait_ready_over_tls(client: AsyncClient, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = await client.status()
        if any(a.az == AZ and a.nodes_ready >= n for a in st.azs):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{AZ}: fewer than {n} nodes ready over TLS after {timeout}s")


async def test_tls_cluster_runs_a_gang_and_refuses_plaintext_and_other_ca(local_cluster: LocalCluster, pki: dict[str, Path]) -> None:
    c = local_cluster
    tls = ["--tls-dir", str(pki["ca"])]
    leader = c.start_coordinator(AZ, "c0", extra_args=tls)
    await c.wait_leader(AZ)
    standby = c.start_coordinator(AZ, "c1", extra_args=tls)
    agent = start_agent(c, pki["ca"])
    try:
        async with AsyncClient(leader.address, timeout=10, tls_dir=pki["submitter"]) as client:
            await wait_ready_over_tls(client, 1)
        # Submitted to the standby: it forwards to the leader over its own
        # peer channel, which presents its coordinator certificate.
        async with AsyncClient(standby.address, timeout=10, tls_dir=pki["submitter"]) as client:
            done = await client.wait((await client.submit(tiny("tls-job", members=1, duration=0.3))).gang.id,
                                     ["SUCCEEDED", "FAILED", "CANCELLED"], timeout=30)
        assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
        assert [m.node for m in done.placement] == [NODE]
        before = await c.etcd_gangs()
        assert set(before) == {done.id}

        # A plaintext client to the TLS port: refused, with the address and a
        # word about TLS; nothing written.
        async with AsyncClient(leader.address, timeout=2, tls_dir="") as plain:
            with pytest.raises(PhalanxError) as refused:
                await plain.submit(tiny("plain-job", members=1))
        assert leader.address in str(refused.value) and "TLS" in str(refused.value), str(refused.value)

        # A certificate from another CA: the coordinator refuses the handshake.
        async with AsyncClient(leader.address, timeout=2, tls_dir=pki["outsider"]) as outsider:
            with pytest.raises(PhalanxError) as foreign:
                await outsider.submit(tiny("outsider-job", members=1))
        assert leader.address in str(foreign.value) and "certificate" in str(foreign.value), str(foreign.value)

        # The CLI in plaintext: one error line naming the address and TLS.
        env = {k: v for k, v in os.environ.items() if k != "PHALANX_TLS_DIR"}
        res = subprocess.run([sys.executable, "-m", "phalanx.cli", "--address", leader.address, "--rpc-timeout", "2", "status"],
                             capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert res.returncode == 1 and len(lines) == 1, res.stderr
        assert leader.address in lines[0] and "TLS" in lines[0], lines[0]

        after = await c.etcd_gangs()
        assert set(after) == set(before), "a refused client wrote a gang record"
        assert PLAINTEXT_WARNING not in leader.log()
    finally:
        agent.terminate()
        agent.wait(15)
        if agent.stdout:
            agent.stdout.close()


async def test_plaintext_coordinator_warns_at_start_up(local_cluster: LocalCluster) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "p0")
    await c.wait_leader(AZ)
    warnings = [ln for ln in coord.log().splitlines() if PLAINTEXT_WARNING in ln]
    assert len(warnings) == 1 and " WARNING " in warnings[0], coord.log()[-2000:]


def test_coordinator_with_unusable_tls_dir_does_not_start(tmp_path: Path, etcd_endpoint: str) -> None:
    empty = tmp_path / "no-certs"
    empty.mkdir()
    res = subprocess.run([sys.executable, "-m", "coordinator", "--az", AZ, "--id", "c9", "--etcd", etcd_endpoint,
                          "--tls-dir", str(empty)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "error: --tls-dir:" in res.stderr and str(empty / "ca.crt") in res.stderr, res.stderr
