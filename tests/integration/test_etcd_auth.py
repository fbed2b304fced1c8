"""etcd over TLS with client certificates and least-privilege roles, on a
real etcd started here (docs/security.md "etcd: TLS and roles").

Every refusal is checked twice: the store raises StoreDenied naming the key
and the user, and etcd read back as root shows nothing changed.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.store import RENEWAL_CHECK_S, Delete, Get, Put, Store, absent
from phalanx import etcd_auth, etcd_pki
from phalanx.errors import StoreDenied, StoreUnavailable
from phalanx.etcd_server import EtcdServer, loopback_cluster, start_members, stop_members
from phalanx.programs import require
from phalanx.tls import TlsError, TlsFiles
from tests.integration.harness import until

pytestmark = pytest.mark.integration

C1, C2 = "c1", "c2"


def etcdctl(etcd: "Etcd", *args: str) -> str:
    """etcdctl as root over TLS (it dials 127.0.0.1, which the server
    certificate names)."""
    r = etcd.root
    return subprocess.run(
        [require("etcdctl"), "--endpoints", f"https://{etcd.endpoint}", "--cacert", str(r.ca), "--cert", str(r.cert),
         "--key", str(r.key), *args],
        env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}, check=True, capture_output=True, text=True, timeout=30,
    ).stdout


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class Etcd:
    """One TLS etcd with clusters c1 and c2 provisioned, and client dirs."""

    def __init__(self, root: Path) -> None:
        self.pki = root / "pki"
        etcd_pki.init(self.pki, now=_now())
        self.server = EtcdServer(data_dir=root / "data", log_path=root / "etcd.log", tls_dir=self.pki)
        self.server.start().wait_ready()
        self.endpoint = self.server.endpoint
        assert self.server.root_tls is not None
        self.root = self.server.root_tls
        # With the legacy agent user (phalanx etcd-auth --agent-user): its
        # refusals are tested here and in test_etcd_agent_rights.py.
        for c in (C1, C2):
            asyncio.run(etcd_auth.provision(self.endpoint, self.root, c, agent_user=True))

    def user(self, cluster: str, role: str):
        return etcd_pki.files(etcd_pki.issue_client(self.pki, etcd_pki.user_for(cluster, role), now=_now()))

    def store(self, tls, cluster: str = C1) -> Store:
        # A generous deadline: on a loaded machine a slow answer must not
        # pass for a refusal.
        return Store(self.endpoint, cluster, tls=tls, timeout=10.0)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("etcd-auth")
    e = Etcd(root)
    try:
        yield e
    finally:
        e.server.stop()
        shutil.rmtree(root, ignore_errors=True)


async def test_coordinator_reads_and_writes_its_own_prefix(etcd: Etcd) -> None:
    async with etcd.store(etcd.user(C1, "coordinator")) as s:
        assert s.user == "phalanx-c1-coordinator"
        created, kv = await s.create_if_absent("/phalanx/c1/gangs/g1", {"n": 1})
        assert created and kv.json() == {"n": 1}
        kvs, _ = await s.get_prefix("/phalanx/c1/")
        assert [k.key for k in kvs] == ["/phalanx/c1/gangs/g1"]
        await s.txn([], [Delete("/phalanx/c1/gangs/g1")])
        assert await s.get("/phalanx/c1/gangs/g1") is None


@pytest.mark.parametrize("key", ["/phalanx/c2/gangs/x", "/phalanx/c10/x", "/other/x", "/phalanx/c1"])
async def test_coordinator_cannot_write_outside_its_prefix(etcd: Etcd, key: str) -> None:
    async with etcd.store(etcd.user(C1, "coordinator")) as s, etcd.store(etcd.root) as root:
        with pytest.raises(StoreDenied) as err:
            # One allowed put and one denied: the transaction is refused whole.
            await s.txn([], [Put("/phalanx/c1/side", "v"), Put(key, "v")])
        assert err.value.user == "phalanx-c1-coordinator"
        assert key in str(err.value) and "phalanx-c1-coordinator" in str(err.value)
        with pytest.raises(StoreDenied):
            await s.get(key)
        assert await root.get(key) is None
        assert await root.get("/phalanx/c1/side") is None


async def test_agent_credentials_read_token_keys_and_write_nothing(etcd: Etcd) -> None:
    """The Must-hold: a coordinator using the agent's etcd credentials to
    write is refused, and etcd (read as root) is unchanged."""
    leader, resv = "/phalanx/c1/leader/az-a", "/phalanx/c1/reservations/az-a/g1"
    async with etcd.store(etcd.root) as root:
        await root.txn([], [Put(leader, {"id": "c0"}), Put(resv, {"status": "HELD"})])
        before = {k: await root.get(k) for k in (leader, resv)}
        async with etcd.store(etcd.user(C1, "agent")) as agent:
            assert agent.user == "phalanx-c1-agent"
            # What the agent's token check does: one txn of two reads.
            res = await agent.txn([], [Get(leader), Get(resv)])
            assert [r[0].key for r in res.results] == [leader, resv]
            for ops in ([Put(leader, {"id": "evil"})], [Delete(resv)], [Put("/phalanx/c1/gangs/g1", "x")]):
                with pytest.raises(StoreDenied) as err:
                    await agent.txn([], ops)
                assert err.value.user == "phalanx-c1-agent"
            with pytest.raises(StoreDenied):
                await agent.get_prefix("/phalanx/c1/gangs/")
            with pytest.raises(StoreDenied):
                await agent.get("/phalanx/c1/nodes/az-a/n1")
            with pytest.raises(StoreDenied):
                async for _ in agent.watch_prefix("/phalanx/c1/gangs/", 1):
                    break
            with pytest.raises(StoreDenied):
                await agent.get("/phalanx/c2/leader/az-a")  # another cluster's agent keys
        assert {k: await root.get(k) for k in (leader, resv)} == before
        assert await root.get("/phalanx/c1/gangs/g1") is None
        await root.txn([], [Delete("/phalanx/c1/", prefix=True)])


def test_a_coordinator_process_with_the_agents_credentials_writes_nothing(etcd: Etcd) -> None:
    """The Must-hold, end to end: a real coordinator started with the
    agent's etcd directory cannot campaign (its leader-key write is
    refused), ends saying which etcd user was denied what, and etcd, read
    directly with etcdctl as root, holds exactly what it held before."""
    leader = "/phalanx/c1/leader/az-a"
    etcdctl(etcd, "put", "/phalanx/c1/reservations/az-a/g1", '{"status":"HELD"}')
    before = etcdctl(etcd, "get", "--prefix", "/phalanx/", "-w", "json")
    agent_dir = etcd.user(C1, "agent").ca.parent
    # --insecure only for the gRPC side (no --tls-dir): etcd is reached over
    # TLS with the agent's certificate.
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator", "--cluster", C1, "--az", "az-a", "--id", "c0",
         "--etcd", etcd.endpoint, "--etcd-tls-dir", str(agent_dir), "--insecure", "--timings", "fast"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --etcd-tls-dir: etcd denied"), proc.stderr[-2000:]
    assert "etcd denied" in proc.stderr and "'phalanx-c1-agent'" in proc.stderr and leader in proc.stderr, proc.stderr[-2000:]
    after = etcdctl(etcd, "get", "--prefix", "/phalanx/", "-w", "json")
    # The key-values alone: the header's raft term may differ.
    assert json.loads(after).get("kvs") == json.loads(before).get("kvs")
    assert "leader" not in etcdctl(etcd, "get", "--prefix", "--keys-only", "/phalanx/c1/")
    etcdctl(etcd, "del", "--prefix", "/phalanx/c1/")


def test_a_coordinator_with_a_mismatched_etcd_key_names_the_file(etcd: Etcd, tmp_path: Path) -> None:
    good = etcd.user(C1, "coordinator")
    other = etcd.user(C1, "agent")
    d = tmp_path / "mixed"
    d.mkdir()
    for src, name in ((good.ca, "ca.crt"), (good.cert, "client.crt"), (other.key, "client.key")):
        shutil.copy(src, d / name)
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator", "--cluster", C1, "--az", "az-a", "--id", "c0",
         "--etcd", etcd.endpoint, "--etcd-tls-dir", str(d), "--insecure"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --etcd-tls-dir: {d / 'client.key'}: key mismatch: not the key of {d / 'client.crt'}"), proc.stderr


async def test_plaintext_foreign_ca_and_unknown_user_are_refused(etcd: Etcd, tmp_path: Path) -> None:
    async with etcd.store(etcd.root) as root:
        await root.txn([], [Put("/phalanx/c1/leader/az-a", "x")])
        try:
            async with Store(etcd.endpoint, C1, tls=None, timeout=5.0) as plain:
                with pytest.raises(StoreUnavailable):
                    await plain.get("/phalanx/c1/leader/az-a")
            # Another etcd CA's certificate, even one that says CN=root.
            etcd_pki.init(tmp_path / "other", now=_now())
            foreign = etcd_pki.files(etcd_pki.issue_client(tmp_path / "other", "root", now=_now()))
            async with Store(etcd.endpoint, C1, tls=foreign, timeout=5.0) as s:
                with pytest.raises(StoreUnavailable) as err:
                    await s.get("/phalanx/c1/leader/az-a")
                assert str(foreign.ca) in str(err.value)  # the hint names the files to check
            # Our CA, but a CN no one provisioned: authenticated, permitted nothing.
            nobody = etcd_pki.files(etcd_pki.issue_client(etcd.pki, "nobody", now=_now()))
            async with Store(etcd.endpoint, C1, tls=nobody) as s:
                with pytest.raises(StoreDenied) as denied:
                    await s.get("/phalanx/c1/leader/az-a")
                assert denied.value.user == "nobody"
        finally:
            await root.txn([], [Delete("/phalanx/c1/", prefix=True)])


async def test_bad_client_files_are_named_before_connecting(etcd: Etcd, tmp_path: Path) -> None:
    good = etcd.user(C1, "coordinator")
    other = etcd_pki.files(etcd_pki.issue_client(etcd.pki, "someone", now=_now()))
    mixed = TlsFiles(good.ca, good.cert, other.key)
    with pytest.raises(TlsError) as err:
        await Store(etcd.endpoint, C1, tls=mixed).connect()
    assert err.value.path == str(other.key) and err.value.check == etcd_pki.CHECK_KEY_MISMATCH
    missing = TlsFiles(tmp_path / "ca.crt", good.cert, good.key)
    with pytest.raises(TlsError) as err:
        await Store(etcd.endpoint, C1, tls=missing).connect()
    assert err.value.path == str(tmp_path / "ca.crt") and err.value.check == "cannot read"


async def test_provision_is_idempotent_converges_and_unprovision_removes(etcd: Etcd) -> None:
    want = {"users": {u: [u] for u in etcd_auth.roles_for("c3", agent_user=True)},
            "roles": {r: sorted(p, key=lambda p: p.key)
                      for r, p in etcd_auth.roles_for("c3", agent_user=True).items()}}
    await etcd_auth.provision(etcd.endpoint, etcd.root, "c3", agent_user=True)
    await etcd_auth.provision(etcd.endpoint, etcd.root, "c3", agent_user=True)
    assert await etcd_auth.describe(etcd.endpoint, etcd.root, "c3") == want
    # Widen the agent role by hand (as an operator might): provision narrows it back.
    etcdctl(etcd, "role", "grant-permission", etcd_pki.user_for("c3", "agent"), "readwrite",
            "/phalanx/c3/gangs/", "--prefix")
    etcdctl(etcd, "user", "grant-role", etcd_pki.user_for("c3", "agent"), etcd_pki.user_for("c3", "coordinator"))
    assert await etcd_auth.describe(etcd.endpoint, etcd.root, "c3") != want
    await etcd_auth.provision(etcd.endpoint, etcd.root, "c3", agent_user=True)
    assert await etcd_auth.describe(etcd.endpoint, etcd.root, "c3") == want
    # Provisioned again without the opt-in (the default): the agent user and
    # role are gone, the coordinator's kept.
    await etcd_auth.provision(etcd.endpoint, etcd.root, "c3")
    agent = etcd_pki.user_for("c3", "agent")
    assert await etcd_auth.describe(etcd.endpoint, etcd.root, "c3") == {
        "users": {u: r for u, r in want["users"].items() if u != agent},
        "roles": {r: p for r, p in want["roles"].items() if r != agent}}
    coordinator = etcd.user("c3", "coordinator")
    async with etcd.store(coordinator, "c3") as s:
        await s.txn([], [Put("/phalanx/c3/x", "v")])
        await s.txn([], [Delete("/phalanx/c3/x")])
    await etcd_auth.unprovision(etcd.endpoint, etcd.root, "c3")
    await etcd_auth.unprovision(etcd.endpoint, etcd.root, "c3")  # absent is fine
    assert await etcd_auth.describe(etcd.endpoint, etcd.root, "c3") == {"users": {}, "roles": {}}
    async with etcd.store(coordinator, "c3") as s:
        with pytest.raises(StoreDenied):
            await s.get("/phalanx/c3/x")


def test_cli_etcd_auth_provisions_and_removes(etcd: Etcd, capsys: pytest.CaptureFixture[str]) -> None:
    from phalanx import cli

    root_dir = str(etcd.root.ca.parent)
    assert cli.main(["etcd-auth", "--etcd", etcd.endpoint, "--etcd-tls-dir", root_dir, "--cluster", "c4"]) == 0
    out = capsys.readouterr().out
    assert "role phalanx-c4-coordinator: readwrite prefix /phalanx/c4/\n" in out
    assert "phalanx-c4-agent" not in out  # by default agents get no etcd user
    assert cli.main(["etcd-auth", "--etcd", etcd.endpoint, "--etcd-tls-dir", root_dir, "--cluster", "c4",
                     "--agent-user"]) == 0
    out = capsys.readouterr().out
    assert "role phalanx-c4-agent: read prefix /phalanx/c4/leader/; read prefix /phalanx/c4/reservations/\n" in out
    assert "user phalanx-c4-agent: roles phalanx-c4-agent" in out
    assert asyncio.run(etcd_auth.describe(etcd.endpoint, etcd.root, "c4"))["users"]
    assert cli.main(["etcd-auth", "--etcd", etcd.endpoint, "--etcd-tls-dir", root_dir, "--cluster", "c4", "--remove"]) == 0
    assert "removed the etcd users and roles of cluster c4" in capsys.readouterr().out
    assert asyncio.run(etcd_auth.describe(etcd.endpoint, etcd.root, "c4")) == {"users": {}, "roles": {}}


async def test_provision_refuses_a_non_root_certificate(etcd: Etcd) -> None:
    with pytest.raises(etcd_auth.EtcdAuthError, match="phalanx-c1-coordinator"):
        await etcd_auth.provision(etcd.endpoint, etcd.user(C1, "coordinator"), C1)


async def test_coordinator_leases_and_watches(etcd: Etcd) -> None:
    """What the election needs: grant, keepalive, put with the lease,
    revoke (which deletes the key), and a watch on its own prefix."""
    key = "/phalanx/c1/leader/az-a"
    async with etcd.store(etcd.user(C1, "coordinator")) as s, etcd.store(etcd.root) as root:
        rev = await s.revision()
        events: list = []

        async def watch() -> None:
            async for batch in s.watch_prefix("/phalanx/c1/leader/", rev + 1):
                events.extend(batch)
                if any(e.kind == "delete" for e in events):
                    return

        w = asyncio.create_task(watch())
        lease = await s.grant_lease(10)
        ka = s.keepalive(lease)
        try:
            assert await ka.ping(2.0) > 0
        finally:
            ka.close()
        await s.txn([absent(key)], [Put(key, {"id": "c0"}, lease=lease)])
        assert (await root.get(key)).lease == lease
        await s.revoke_lease(lease)
        assert await root.get(key) is None
        await asyncio.wait_for(w, 10)
        assert [(e.kind, e.kv.key) for e in events] == [("put", key), ("delete", key)]


async def test_role_changes_while_writing_are_transient_never_denied(etcd: Etcd) -> None:
    """etcd refuses a request whose auth revision went stale between arrival
    and apply ("revision of auth store is old"). Another cluster's roles
    are provisioned and removed in a loop while a coordinator writes: every
    write either lands or fails as StoreUnavailable (nothing applied), never
    StoreDenied; what succeeded is there."""
    done = asyncio.Event()

    async def churn() -> int:
        n = 0
        while not done.is_set():
            await etcd_auth.provision(etcd.endpoint, etcd.root, "churn")
            await etcd_auth.unprovision(etcd.endpoint, etcd.root, "churn")
            n += 1
        return n

    written: list[str] = []
    failed: list[str] = []

    async def write(s: Store, worker: int) -> None:
        for i in range(60):
            key = f"/phalanx/c1/gangs/w{worker}-{i}"
            try:
                await s.txn([absent(key)], [Put(key, i)])
                written.append(key)
            except StoreUnavailable:  # a StoreDenied is not one: it fails the test
                failed.append(key)

    async with etcd.store(etcd.user(C1, "coordinator")) as s, etcd.store(etcd.root) as root:
        task = asyncio.create_task(churn())
        try:
            await asyncio.gather(*(write(s, w) for w in range(4)))
        finally:
            done.set()
            rounds = await task
        assert rounds >= 1
        kvs, _ = await root.get_prefix("/phalanx/c1/gangs/")
        present = {k.key for k in kvs}
        # Every acknowledged write landed; a failed one may have (a timeout
        # leaves the outcome unknown), a refused one has not.
        assert set(written) <= present <= set(written) | set(failed)
        await root.txn([], [Delete("/phalanx/c1/", prefix=True)])


def test_three_member_cluster_over_tls_peers(tmp_path: Path) -> None:
    """Peers talk TLS with client certificates too (https peer URLs)."""
    pki = tmp_path / "pki"
    etcd_pki.init(pki, now=_now())
    members = loopback_cluster(tmp_path / "m", 3, tls_dir=pki)
    assert all(m.peer_url.startswith("https://") for m in members)
    assert all("https://" in m.initial_cluster and "http://" not in m.initial_cluster for m in members)
    start_members(members)
    try:
        eps = [m.endpoint for m in members]
        root = members[0].root_tls
        assert root is not None

        async def check() -> None:
            await etcd_auth.provision(eps, root, C1)
            tls = etcd_pki.files(etcd_pki.issue_client(pki, etcd_pki.user_for(C1, "coordinator"), now=_now()))
            # Written through one member, read through another.
            async with Store(eps, C1, tls=tls) as a, Store(list(reversed(eps)), C1, tls=tls) as b:
                await a.txn([], [Put("/phalanx/c1/x", "v")])
                assert (await b.get("/phalanx/c1/x")).value == b'"v"'
                assert a.current_endpoint != b.current_endpoint

        asyncio.run(check())
    finally:
        stop_members(members)


async def test_client_files_replaced_on_disk_are_used_without_reconnecting(etcd: Etcd, tmp_path: Path) -> None:
    """A store follows its client files: new files (here another user's, so
    the switch shows in what etcd allows) are used by the next calls with no
    restart; files that fail their checks are refused and the old kept."""
    live = tmp_path / "client"
    agent, coordinator = etcd.user(C1, "agent"), etcd.user(C1, "coordinator")

    def install(files: TlsFiles) -> None:
        live.mkdir(exist_ok=True)
        for src, name in ((files.ca, "ca.crt"), (files.cert, "client.crt"), (files.key, "client.key")):
            tmp = live / (name + ".new")
            shutil.copyfile(src, tmp)
            os.replace(tmp, live / name)

    install(agent)
    async with etcd.store(etcd_pki.files(live)) as s, etcd.store(etcd.root) as root:
        with pytest.raises(StoreDenied):
            await s.txn([], [Put("/phalanx/c1/renewed", "v")])
        # A half-done replacement (a certificate beside another key) is not used.
        shutil.copyfile(coordinator.cert, live / "client.crt")
        # A negative check: past the store's renewal check interval, still refused.
        await asyncio.sleep(RENEWAL_CHECK_S + 0.2)
        with pytest.raises(StoreDenied) as still:
            await s.txn([], [Put("/phalanx/c1/renewed", "v")])
        assert still.value.user == "phalanx-c1-agent"
        install(coordinator)
        # The store takes the complete files at one of its next checks: wait
        # for that (the write goes through), never for a guessed duration.
        async def written() -> bool:
            try:
                await s.txn([], [Put("/phalanx/c1/renewed", "v")])
            except StoreDenied:
                return False
            return True

        await until("the store writes with the renewed files", written, timeout=RENEWAL_CHECK_S + 30)
        assert s.user == "phalanx-c1-coordinator"
        assert (await root.get("/phalanx/c1/renewed")).json() == "v"
        await root.txn([], [Delete("/phalanx/c1/renewed")])
