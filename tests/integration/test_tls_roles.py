"""Roles on GangService when the coordinator serves TLS (docs/security.md
"Roles on GangService"): real coordinator processes with ``--tls-dir``, real
certificates from phalanx.certs, the SDK with each caller's certificate.
Every refusal is PERMISSION_DENIED naming the reason, and etcd (read
directly) shows that nothing changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from coordinator.service_base import FORWARDED, OWNER
from phalanx import certs
from phalanx.client import AsyncClient
from phalanx.errors import PermissionDenied
from phalanx.tls import TlsFiles, secure_channel
from phalanx.v1 import gang_pb2, gang_pb2_grpc
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import REPO, LocalCluster, tiny
from tests.integration.test_tls_cluster import AZ, _now, client_dir

pytestmark = pytest.mark.integration


@pytest.fixture
def pki(local_cluster: LocalCluster, tmp_path: Path) -> dict[str, Path]:
    ca = tmp_path / "pki"
    certs.init_ca(ca, local_cluster.cluster, now=_now())
    for cid in ("c0", "c1"):
        certs.issue(ca, "coordinator", cid, now=_now())
    ca_pem = (ca / "ca.crt").read_bytes()
    out = {"ca": ca}
    for who, role, kw in (
        ("alice", "submitter", {"queues": ["a"]}),
        ("bob", "submitter", {"queues": ["a"]}),
        ("root", "admin", {}),
        ("eve", "viewer", {}),
        ("n1", "agent", {"node": "n1"}),
    ):
        crt, key, _ = certs.issue(ca, role, who, now=_now(), **kw)
        out[who] = client_dir(tmp_path / who, ca_pem, crt, key)
    # A coordinator's own certificate used as a client, not forwarding.
    out["c1"] = client_dir(tmp_path / "as-c1", ca_pem, ca / "coordinator-c1.crt", ca / "coordinator-c1.key")
    return out


async def _denied(address: str, tls_dir: Path, call: str, *args: object) -> str:
    async with AsyncClient(address, timeout=10, tls_dir=tls_dir) as client:
        with pytest.raises(PermissionDenied) as e:
            await getattr(client, call)(*args)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    return str(e.value)


async def test_roles_queues_owners_and_priority(local_cluster: LocalCluster, pki: dict[str, Path], tmp_path: Path) -> None:
    c = local_cluster
    policy = tmp_path / "policy.yaml"
    policy.write_text("max_priority:\n  submitter: 10\n")
    args = ["--tls-dir", str(pki["ca"]), "--policy", str(policy)]
    leader = c.start_coordinator(AZ, "c0", extra_args=args)
    await c.wait_leader(AZ)
    # Calls go to the standby: it decides, then forwards to the leader over
    # its coordinator certificate, with the caller's owner in metadata.
    standby = c.start_coordinator(AZ, "c1", extra_args=args)
    addr = standby.address

    async with AsyncClient(addr, timeout=10, tls_dir=pki["alice"]) as alice:
        gang = (await alice.submit(tiny("alice-job", members=1, queue="a"))).gang
        assert gang.owner == "submitter/alice"
        # Another owner's gangs are visible to a submitter (the "see" decision).
        assert (await alice.get(gang.id)).owner == "submitter/alice"
    stored = await c.etcd_gangs()
    assert set(stored) == {gang.id} and stored[gang.id].owner == "submitter/alice"

    msg = await _denied(addr, pki["alice"], "submit", tiny("alice-b", members=1, queue="b"))
    assert "'b'" in msg and "submitter/alice" in msg, msg
    msg = await _denied(addr, pki["alice"], "submit", tiny("alice-hi", members=1, queue="a", priority=11))
    assert "priority 11" in msg and "max_priority.submitter" in msg, msg
    msg = await _denied(addr, pki["eve"], "submit", tiny("eve-job", members=1, queue="a"))
    assert "viewer/eve" in msg, msg
    msg = await _denied(addr, pki["n1"], "submit", tiny("agent-job", members=1, queue="a"))
    assert "agent/n1" in msg, msg
    msg = await _denied(leader.address, pki["c1"], "submit", tiny("coord-job", members=1, queue="a"))
    assert "coordinator/c1" in msg, msg
    assert set(await c.etcd_gangs()) == {gang.id}, "a refused submission wrote a gang record"

    # Bob may not cancel alice's gang: refused, and the record is untouched.
    msg = await _denied(addr, pki["bob"], "cancel", gang.id, "not mine")
    assert gang.id in msg and "submitter/alice" in msg, msg
    after = (await c.etcd_gangs())[gang.id]
    assert after.state == stored[gang.id].state and after.mod_revision == stored[gang.id].mod_revision

    # A submitter cannot claim another owner by sending the forwarded
    # metadata itself: only a coordinator's is trusted.
    bob_files = TlsFiles(pki["bob"] / "ca.crt", pki["bob"] / "client.crt", pki["bob"] / "client.key")
    async with secure_channel(leader.address, bob_files, cluster=c.cluster) as ch:
        resp = await gang_pb2_grpc.GangServiceStub(ch).SubmitGang(
            gang_pb2.SubmitGangRequest(spec=tiny("bob-job", members=1, queue="a")), timeout=10,
            metadata=((FORWARDED, "1"), (OWNER, "admin/root")))
    assert resp.gang.owner == "submitter/bob"
    assert (await c.etcd_gangs())[resp.gang.id].owner == "submitter/bob"

    # The viewer reads everything; an agent reads nothing.
    async with AsyncClient(addr, timeout=10, tls_dir=pki["eve"]) as eve:
        assert {g.id for g in await eve.list()} == {gang.id, resp.gang.id}
    await _denied(addr, pki["n1"], "get", gang.id)

    # The human `get` says who submitted it.
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_TLS_DIR"}
    res = subprocess.run([sys.executable, "-m", "phalanx.cli", "--address", addr, "--tls-dir", str(pki["eve"]), "get", gang.id],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert any(ln.startswith("submitted by:") and "submitter/alice" in ln for ln in res.stdout.splitlines()), res.stdout

    # An admin cancels anyone's gang (through the standby: forwarded).
    async with AsyncClient(addr, timeout=10, tls_dir=pki["root"]) as admin:
        cancelled = await admin.cancel(gang.id, "admin says so")
    assert cancelled.state == pb.GANG_STATE_CANCELLED
    assert (await c.etcd_gangs())[gang.id].state.name == "CANCELLED"


def test_bad_policy_stops_the_coordinator(tmp_path: Path, etcd_endpoint: str) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("max_priority:\n  viewer: 5\n")
    # --insecure: so that the missing TLS flags are not the first error.
    base = [sys.executable, "-m", "coordinator", "--az", AZ, "--id", "c9", "--etcd", etcd_endpoint, "--policy", str(policy),
            "--insecure"]
    for extra, words in (([], ("--policy", "needs --tls-dir")), (["--tls-dir", str(tmp_path)], ("max_priority.viewer",))):
        res = subprocess.run(base + extra, capture_output=True, text=True, cwd=REPO, timeout=60)
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert res.returncode == 2 and len(errors) == 1, res.stderr
        assert all(w in errors[0] for w in words), errors[0]
