"""Bearer tokens and the policy as data (docs/security.md "Bearer tokens",
"Policy as data"): real TLS coordinator processes, a real token file, the
SDK and the CLI; etcd read directly shows what was (not) written."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from coordinator.tokens import hash_token, new_token
from phalanx.certs import coordinator_server_name
from phalanx.client import AsyncClient, ClientConfigError
from phalanx.store import Put
from phalanx.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, PhalanxError
from phalanx.v1 import gang_pb2, gang_pb2_grpc, peer_pb2, peer_pb2_grpc
from tests.integration.harness import REPO, LocalCluster, tiny

pytestmark = pytest.mark.integration
AZ = "az-a"
# Polls for something another process does in its own time; never a pass/fail timing.
SETTLE_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ca_only_dir(c: LocalCluster, where: Path) -> Path:
    """What a token client needs: the cluster's ca.crt, no certificate."""
    where.mkdir(mode=0o700, parents=True)
    shutil.copy(c.pki.ca_dir / "ca.crt", where / "ca.crt")
    return where


async def _unauthenticated(address: str, tls_dir: Path, token: str) -> str:
    async with AsyncClient(address, timeout=10, tls_dir=tls_dir, token=token) as client:
        with pytest.raises(PhalanxError) as e:
            await client.submit(tiny("never", members=1, queue="a"))
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED, e.value
    assert token not in str(e.value)
    return str(e.value)


async def test_bearer_tokens(local_cluster: LocalCluster, tmp_path: Path) -> None:
    c = local_cluster
    t1, t2, wrong = new_token(), new_token(), new_token()
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# alice's token\n{hash_token(t1)} submitter alice queues=a\n")
    port = free_port()
    c.start_coordinator(AZ, "c0", extra_args=["--token-file", str(tokens), "--token-listen", f"127.0.0.1:{free_port()}"])
    await c.wait_leader(AZ)
    # Calls through the standby's token port: it decides, then forwards to
    # the leader over its coordinator certificate.
    c.start_coordinator(AZ, "c1", extra_args=["--token-file", str(tokens), "--token-listen", f"127.0.0.1:{port}"])
    taddr = f"127.0.0.1:{port}"
    ca = ca_only_dir(c, tmp_path / "ca-only")

    async with AsyncClient(taddr, timeout=10, tls_dir=ca, token=t1) as alice:
        gang = (await alice.submit(tiny("tok-job", members=1, queue="a"))).gang
        assert gang.owner == "submitter/alice"
        # The token's identity is a submitter's: its queues hold.
        with pytest.raises(PermissionDenied, match="queue 'b'"):
            await alice.submit(tiny("tok-b", members=1, queue="b"))
    assert {g: r.owner for g, r in (await c.etcd_gangs()).items()} == {gang.id: "submitter/alice"}

    msg = await _unauthenticated(taddr, ca, wrong)
    assert "bearer token: unknown" in msg, msg
    assert set(await c.etcd_gangs()) == {gang.id}, "a refused token wrote a gang"

    # Neither a token nor a certificate on the token port; and the token
    # port serves no AgentService/CoordinatorPeer caller, token or not.
    import grpc.aio

    creds = grpc.ssl_channel_credentials(root_certificates=(ca / "ca.crt").read_bytes())
    opts = [("grpc.ssl_target_name_override", coordinator_server_name(c.cluster))]
    async with grpc.aio.secure_channel(taddr, creds, options=opts) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await gang_pb2_grpc.GangServiceStub(ch).GetGang(gang_pb2.GetGangRequest(id=gang.id), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "no certificate" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await peer_pb2_grpc.CoordinatorPeerStub(ch).Prepare(
                peer_pb2.PrepareRequest(gang=gang.id), timeout=10, metadata=(("authorization", f"Bearer {t1}"),))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value

    # Rotation without a restart: add the new token, move, remove the old.
    tokens.write_text(f"{hash_token(t1)} submitter alice queues=a\n{hash_token(t2)} submitter alice queues=a\n")
    async with AsyncClient(taddr, timeout=10, tls_dir=ca, token=t2) as alice:
        assert (await alice.get(gang.id)).owner == "submitter/alice"
    tokens.write_text(f"{hash_token(t2)} submitter alice queues=a\n")
    await _unauthenticated(taddr, ca, t1)
    # A broken edit is refused whole: the last good file still holds (and
    # the coordinator says so, at ERROR).
    c.expect_log(r"ERROR coordinator\.tokens: bearer tokens: keeping the 1 current tokens: the file on disk is "
                 r"refused: .*tokens:2: role: must be one of")
    tokens.write_text(f"{hash_token(t2)} submitter alice queues=a\n{hash_token(t1)} wizard x\n")
    async with AsyncClient(taddr, timeout=10, tls_dir=ca, token=t2) as alice:
        assert (await alice.get(gang.id)).id == gang.id
    assert set(await c.etcd_gangs()) == {gang.id}

    # The certificate port asks every client for a certificate: a token
    # client there is told to dial the token port.
    async with AsyncClient(c.coordinators["c1"].address, timeout=3, tls_dir=ca, token=t2) as client:
        with pytest.raises(PhalanxError, match="--token-listen"):
            await client.get(gang.id)

    # A token is never sent in plaintext (the SDK refuses before dialling).
    with pytest.raises(ClientConfigError, match="only over TLS"):
        AsyncClient(taddr, timeout=10, insecure=True, token=t2)

    # A bad token file stops a coordinator at start-up, naming line and field.
    bad = tmp_path / "bad-tokens"
    bad.write_text(f"{hash_token(t1)} agent n1\n")
    res = subprocess.run([sys.executable, "-m", "coordinator", "--cluster", c.cluster, "--az", AZ, "--id", "c9",
                          "--etcd", c.etcd, *c.coordinator_args("c9"), "--token-file", str(bad),
                          "--token-listen", "127.0.0.1:0"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode == 2 and f"{bad}:1: role" in res.stderr, res.stderr


def _cli(c: LocalCluster, addr: str, tls_dir: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    return subprocess.run([sys.executable, "-m", "phalanx.cli", "policy", *args, "--address", addr, "--tls-dir", str(tls_dir)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=60, input=stdin)


async def _record(c: LocalCluster) -> tuple[int, dict]:
    kv = await c.store.get(c.store.keys.policy())
    assert kv is not None
    return kv.mod_revision, json.loads(kv.value)


async def test_policy_as_data(local_cluster: LocalCluster, tmp_path: Path) -> None:
    c = local_cluster
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("max_priority:\n  submitter: 10\n")
    second.write_text("max_priority:\n  submitter: 99\n")
    c0 = c.start_coordinator(AZ, "c0", extra_args=["--policy", str(first)])
    await c.wait_leader(AZ)
    c1 = c.start_coordinator(AZ, "c1", extra_args=["--policy", str(second)])
    rev, data = await _record(c)
    # The first --policy became the record; the second was ignored, said so.
    assert data["policy"]["max_priority"]["submitter"] == 10 and data["set_by"] == f"--policy {first}"
    deadline = time.monotonic() + SETTLE_S
    while "is ignored: the policy record" not in c1.log() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert f"--policy {second} is ignored: the policy record {c.store.keys.policy()} exists" in c1.log()

    admin, eve = c.client_dir("admin", "root"), c.client_dir("viewer", "eve")
    alice, bob = c.client_dir("submitter", "alice", ["a"]), c.client_dir("submitter", "bob", ["a"])
    async with AsyncClient(c1.address, timeout=10, tls_dir=eve) as client:
        policy, record = await client.get_policy()
    assert record.revision == rev and policy["max_priority"]["submitter"] == 10 and policy["visibility"] == "all"

    # Not an admin: refused before the policy is read, and etcd is unchanged.
    async with AsyncClient(c1.address, timeout=10, tls_dir=alice) as client:
        with pytest.raises(PermissionDenied, match="only an admin"):
            await client.set_policy({"max_priority": {"submitter": 1000}}, rev)
    assert (await _record(c))[0] == rev
    async with AsyncClient(c1.address, timeout=10, tls_dir=admin) as client:
        # Stale revision, bad field: refused, naming why; nothing written.
        with pytest.raises(FailedPrecondition, match=f"at revision {rev}, not {rev - 1}"):
            await client.set_policy({"max_priority": {"submitter": 1}}, rev - 1)
        with pytest.raises(InvalidArgument, match="visibility"):
            await client.set_policy({"visibility": "mine"}, rev)
    # JSON the SDK would never send, straight on the wire: a document nested
    # past the cap (once an INTERNAL RecursionError) and a key given twice
    # (once the last one silently won). INVALID_ARGUMENT naming the place;
    # nothing written.
    async with c.channel(c1.address, role="admin", name="root") as ch:
        stub = gang_pb2_grpc.GangServiceStub(ch)
        for text, words in (('{"visibility": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested more than 32 levels deep"),
                            ('{"visibility": "own", "visibility": "all"}', "line 1, column 23: duplicate key 'visibility' (first at line 1, column 2)")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SetPolicy(gang_pb2.SetPolicyRequest(policy_json=text, expected_revision=rev))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert "policy_json" in err.value.details() and words in err.value.details(), err.value.details()
    assert (await _record(c))[0] == rev

    # Before the change: alice and bob submit within the first policy.
    async with AsyncClient(c1.address, timeout=10, tls_dir=bob) as client:
        bobs = (await client.submit(tiny("bob-job", members=1, queue="a", priority=10))).gang
    async with AsyncClient(c1.address, timeout=10, tls_dir=alice) as client:
        alices = (await client.submit(tiny("alice-job", members=1, queue="a", priority=7))).gang

    # The admin changes it with the CLI on the leader: `get`, edit, `set`.
    got = _cli(c, c0.address, admin, "get")
    assert got.returncode == 0 and got.stdout.startswith(f"# revision: {rev}, set by --policy {first}"), got
    new = tmp_path / "new.yaml"
    new.write_text("max_priority:\n  submitter: 5\nsubmitters:\n  bob:\n    max_priority: 50\nvisibility: own\n")
    res = _cli(c, c0.address, admin, "set", str(new), "--revision", str(rev))
    assert res.returncode == 0 and "policy set: revision" in res.stdout and "admin/root" in res.stdout, res
    rev2, data2 = await _record(c)
    assert rev2 > rev and data2["set_by"] == "admin/root" and data2["policy"]["visibility"] == "own"
    again = _cli(c, c0.address, admin, "set", str(new), "--revision", str(rev))
    assert again.returncode == 1 and "expected_revision" in again.stderr, again
    assert (await _record(c))[0] == rev2

    # It binds the other coordinator (within its staleness bound): a
    # priority allowed before is now refused there, and nothing is written.
    async with AsyncClient(c1.address, timeout=10, tls_dir=alice) as client:
        deadline = time.monotonic() + SETTLE_S
        for n in range(10_000):
            try:
                # (a try before c1 re-read the record is taken: a new name each time)
                await client.submit(tiny(f"alice-hi-{n}", members=1, queue="a", priority=7))
            except PermissionDenied as exc:
                assert "maximum 5" in str(exc) and "max_priority.submitter" in str(exc), exc
                break
            assert time.monotonic() < deadline, "c1 never applied the new policy"
            await asyncio.sleep(0.2)
        stored = await c.etcd_gangs()
        assert f"alice-hi-{n}" not in {g.spec.name for g in stored.values()}, "a refused submission wrote a gang"
        # visibility own: alice sees only her gangs; bob's is "not found".
        seen = {g.id for g in await client.list()}
        assert alices.id in seen and bobs.id not in seen
        for call, args in (("get", (bobs.id,)), ("explain", (bobs.id,)), ("cancel", (bobs.id, "not mine"))):
            with pytest.raises(NotFound, match="no gang"):
                await getattr(client, call)(*args)
        assert (await client.get(alices.id)).id == alices.id
    assert (await c.etcd_gangs())[bobs.id].mod_revision == stored[bobs.id].mod_revision
    async with AsyncClient(c1.address, timeout=10, tls_dir=bob) as client:
        # bob's own override (50) is above the submitter maximum.
        assert (await client.submit(tiny("bob-hi", members=1, queue="a", priority=40))).gang.owner == "submitter/bob"
    async with AsyncClient(c1.address, timeout=10, tls_dir=eve) as client:
        assert {alices.id, bobs.id} <= {g.id for g in await client.list()}

    # A record written by hand that does not validate is applied by nobody:
    # calls that need it are DATA_LOSS naming the key and its revision,
    # and an admin replaces it with that revision.
    await c.store.txn([], [Put(c.store.keys.policy(), {"format": 1, "policy": {"visibility": "everyone"}})])
    bad_rev, _ = await _record(c)
    async with AsyncClient(c1.address, timeout=10, tls_dir=admin) as client:
        with pytest.raises(DataLoss, match=f"revision {bad_rev}.*visibility"):
            await client.get_policy()
        deadline = time.monotonic() + SETTLE_S
        while True:  # c1 may still hold the good copy for its staleness bound
            try:
                await client.list()
            except DataLoss:
                break
            assert time.monotonic() < deadline, "c1 kept applying a policy etcd no longer holds"
            await asyncio.sleep(0.2)
        fixed = await client.set_policy({}, bad_rev)
        assert fixed.revision > bad_rev and (await client.get_policy())[0]["visibility"] == "all"
        assert {alices.id, bobs.id} <= {g.id for g in await client.list()}
