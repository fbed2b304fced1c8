"""A cluster that runs with mutual TLS (the default, docs/security.md): real
coordinator and agent processes with certificates made by phalanx.certs,
the SDK and the CLI connecting with a client certificate (flags, variables
or a config file). Refused clients (plaintext, another CA's certificate, no
credentials) write nothing to etcd, checked in etcd directly; plaintext only
behind --insecure, warned about; an agent refuses a "leader" that is not a
coordinator."""

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
from typing import Any

import grpc
import pytest

from coordinator.server import ETCD_PLAINTEXT_WARNING, PLAINTEXT_WARNING
from phalanx import certs, procs
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
    c = local_cluster
    submitter = c.client_dir("submitter", "bob", ("default",))
    # Another CA of the same cluster name: its certificate must not get in.
    # The client trusts both CAs (a bundle), so it passes its own checks and
    # the coordinator is the one that refuses it.
    other = tmp_path / "other-pki"
    certs.init_ca(other, c.cluster, now=_now())
    ocrt, okey, _ = certs.issue(other, "admin", "mallory", now=_now())
    outsider = client_dir(tmp_path / "mallory", (submitter / "ca.crt").read_bytes() + (other / "ca.crt").read_bytes(), ocrt, okey)
    return {"submitter": submitter, "outsider": outsider}


def start_agent(c: LocalCluster, node: str = NODE, where: list[str] | None = None) -> subprocess.Popen:
    """``where``: where it reads and its credentials (default: the
    harness's, through the coordinators of AZ)."""
    log = c.workdir / f"agent-{node}.log"
    cmd = [
        sys.executable, "-m", "agent", "--cluster", c.cluster, "--az", AZ, "--node", node,
        "--simulate-members", "--timings", c._timings_json(), *(c.agent_args(node) if where is None else where),
        "--nvml-recording", str(FIX / "nvml.json"), "--sysfs-recording", str(FIX / "sysfs.json"),
        "--state-dir", str(c.workdir / f"agent-state-{node}"), "--log-level", "INFO",
    ]
    p = procs.spawn(cmd, die_with_parent=procs.TERM, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=REPO)
    ready, _, _ = select.select([p.stdout], [], [], 30)
    line = p.stdout.readline() if ready else ""
    assert "PHALANX_AGENT_READY" in line, log.read_text()
    return p


def stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)
    if p.stdout:
        p.stdout.close()


async def wait_ready_over_tls(client: AsyncClient, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = await client.status()
        if any(a.az == AZ and a.nodes_ready >= n for a in st.azs):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{AZ}: fewer than {n} nodes ready over TLS after {timeout}s")


def bare_env(home: Path, **extra: str) -> dict[str, str]:
    """A CLI environment with no credentials of its own: none of the
    variables, and a HOME without a config file."""
    env = {k: v for k, v in os.environ.items() if k not in ("PHALANX_TLS_DIR", "PHALANX_CONFIG", "PHALANX_INSECURE", "PHALANX_ADDRESS")}
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), **extra)
    return env


def cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx.cli", *argv], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=60)


async def test_tls_cluster_runs_a_gang_and_refuses_plaintext_and_other_ca(local_cluster: LocalCluster, pki: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    c = local_cluster
    leader = c.start_coordinator(AZ, "c0")
    await c.wait_leader(AZ)
    standby = c.start_coordinator(AZ, "c1")
    agent = start_agent(c)
    try:
        async with AsyncClient(leader.address, timeout=10, tls_dir=pki["submitter"]) as client:
            await wait_ready_over_tls(client, 1)
        # Submitted to the standby: it forwards to the leader over its own
        # peer channel, which presents its coordinator certificate and
        # checks the leader's.
        async with AsyncClient(standby.address, timeout=10, tls_dir=pki["submitter"]) as client:
            done = await client.wait((await client.submit(tiny("tls-job", members=1, duration=0.3))).gang.id,
                                     ["SUCCEEDED", "FAILED", "CANCELLED"], timeout=30)
        assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
        assert [m.node for m in done.placement] == [NODE]
        before = await c.etcd_gangs()
        assert set(before) == {done.id}

        # A plaintext client (chosen explicitly) to the TLS port: refused,
        # with the address and a word about TLS; nothing written.
        async with AsyncClient(leader.address, timeout=2, insecure=True) as plain:
            with pytest.raises(PhalanxError) as refused:
                await plain.submit(tiny("plain-job", members=1))
        assert leader.address in str(refused.value) and "TLS" in str(refused.value), str(refused.value)

        # A certificate from another CA: the coordinator refuses the handshake.
        async with AsyncClient(leader.address, timeout=2, tls_dir=pki["outsider"]) as outsider:
            with pytest.raises(PhalanxError) as foreign:
                await outsider.submit(tiny("outsider-job", members=1))
        assert leader.address in str(foreign.value) and "certificate" in str(foreign.value), str(foreign.value)

        # The CLI in plaintext: one error line naming the address and TLS.
        res = cli("--address", leader.address, "--rpc-timeout", "2", "--insecure", "status", env=bare_env(tmp_path / "home"))
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert res.returncode == 1 and len(lines) == 1, res.stderr
        assert leader.address in lines[0] and "TLS" in lines[0], lines[0]

        # The CLI with a kubeconfig-style file (a path relative to it) and
        # nothing else reaches the TLS cluster; `phalanx config` says where
        # the credentials came from.
        config = tmp_path / "phalanx" / "config.yaml"
        config.parent.mkdir()
        shutil.copytree(pki["submitter"], config.parent / "bob")
        config.write_text(f"cluster: {c.cluster}\naddresses: [{standby.address}, {leader.address}]\ntls_dir: bob\n")
        env = bare_env(tmp_path / "home", PHALANX_CONFIG=str(config))
        res = cli("status", env=env)
        assert res.returncode == 0, res.stderr
        assert f"cluster {c.cluster}" in res.stdout, res.stdout
        res = cli("config", env=env)
        assert res.returncode == 0, res.stderr
        assert f"tls: {config.parent / 'bob'} (from {config} (tls_dir))" in res.stdout, res.stdout
        assert f"identity: phalanx://{c.cluster}/submitter/bob?queues=default" in res.stdout, res.stdout
        assert f"addresses: {standby.address},{leader.address} (from {config} (addresses))" in res.stdout, res.stdout
        # A config file whose cluster is not its CA's: refused, naming the file.
        config.write_text(f"cluster: not-{c.cluster}\naddresses: [{leader.address}]\ntls_dir: bob\n")
        res = cli("status", env=env)
        assert res.returncode == 2 and res.stderr.startswith(f"error: {config}: cluster: "), res.stderr

        # The CLI without any credentials: one line naming every way to give them.
        res = cli("--address", leader.address, "status", env=bare_env(tmp_path / "home"))
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        for words in ("no credentials", "--tls-dir", "$PHALANX_TLS_DIR", "$PHALANX_CONFIG", "--insecure", "PHALANX_INSECURE=1"):
            assert words in res.stderr, (words, res.stderr)

        after = await c.etcd_gangs()
        assert set(after) == set(before), "a refused client wrote a gang record"
        assert PLAINTEXT_WARNING not in leader.log() and ETCD_PLAINTEXT_WARNING not in leader.log()
    finally:
        stop(agent)


def coordinator_cmd(c: LocalCluster, cid: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "coordinator", "--cluster", c.cluster, "--az", AZ, "--id", cid, "--etcd", c.etcd,
            "--timings", c._timings_json(), "--log-level", "INFO", *flags]


async def test_insecure_coordinator_warns_once_per_plaintext_hop(local_cluster: LocalCluster, tmp_path: Path) -> None:
    """--insecure with the etcd credentials: gRPC in plaintext, one WARNING
    for it and none for etcd; a plaintext client (chosen explicitly) gets
    in. --insecure with the gRPC credentials only: one WARNING for etcd."""
    c = local_cluster
    log = tmp_path / "p0.log"
    p = procs.spawn(coordinator_cmd(c, "p0", "--insecure", "--etcd-tls-dir", str(c.etcd_tls_dir("coordinator"))),
                    die_with_parent=procs.KILL, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=REPO)
    try:
        ready, _, _ = select.select([p.stdout], [], [], 30)
        line = p.stdout.readline() if ready else ""
        assert "PHALANX_COORDINATOR_READY" in line, log.read_text()
        address = line.split("address=")[1].strip()
        await c.wait_leader(AZ)
        async with AsyncClient(address, timeout=10, insecure=True) as plain:
            assert (await plain.status()).cluster == c.cluster
    finally:
        stop(p)
    warnings = [ln for ln in log.read_text().splitlines() if " WARNING " in ln and "--insecure" in ln]
    assert len(warnings) == 1 and PLAINTEXT_WARNING in warnings[0], log.read_text()[-2000:]

    c.pki.coordinator("p1")
    log = tmp_path / "p1.log"
    p = procs.spawn(coordinator_cmd(c, "p1", "--insecure", "--tls-dir", str(c.pki.server_dir())),
                    die_with_parent=procs.KILL, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while ETCD_PLAINTEXT_WARNING not in log.read_text() and p.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    finally:
        stop(p)
    warnings = [ln for ln in log.read_text().splitlines() if " WARNING " in ln and "--insecure" in ln]
    assert len(warnings) == 1 and ETCD_PLAINTEXT_WARNING in warnings[0], log.read_text()[-2000:]


@pytest.mark.parametrize("flags, line", [
    ([], "error: --tls-dir: required (pass --insecure to serve plaintext)\n"),
    (["--tls-dir", "T"], "error: --etcd-tls-dir: required (pass --insecure to reach etcd in plaintext)\n"),
    (["--etcd-tls-dir", "E"], "error: --tls-dir: required (pass --insecure to serve plaintext)\n"),
])
def test_coordinator_without_credentials_or_insecure_does_not_start(local_cluster: LocalCluster, flags: list[str],
                                                                     line: str) -> None:
    res = subprocess.run(coordinator_cmd(local_cluster, "c9", *flags), capture_output=True, text=True, cwd=REPO, timeout=60)
    assert (res.returncode, res.stderr) == (2, line)


def test_coordinator_with_unusable_tls_dir_does_not_start(tmp_path: Path, etcd_endpoint: str) -> None:
    empty = tmp_path / "no-certs"
    empty.mkdir()
    res = subprocess.run([sys.executable, "-m", "coordinator", "--az", AZ, "--id", "c9", "--etcd", etcd_endpoint,
                          "--tls-dir", str(empty), "--insecure"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "error: --tls-dir:" in res.stderr and str(empty / "ca.crt") in res.stderr, res.stderr


class Impostor:
    """A TLS server of the cluster's CA that is not a coordinator (it
    presents an agent's or a submitter's certificate) and counts the calls
    that reach it."""

    def __init__(self, files: Any) -> None:
        self.calls = 0
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "phalanx.v1.AgentService", {"Session": grpc.stream_stream_rpc_method_handler(self.session)})])
        creds = grpc.ssl_server_credentials([(files.key.read_bytes(), files.cert.read_bytes())],
                                            root_certificates=files.ca.read_bytes(), require_client_auth=True)
        self.address = f"127.0.0.1:{self.server.add_secure_port('127.0.0.1:0', creds)}"

    async def session(self, requests: Any, context: Any) -> Any:
        self.calls += 1
        async for _ in requests:
            pass
        if False:  # pragma: no cover - a stream handler must be a generator
            yield b""


@pytest.mark.parametrize("role", ["agent", "submitter"])
async def test_an_agent_refuses_a_leader_that_is_not_a_coordinator(local_cluster: LocalCluster, role: str) -> None:
    """The leader key names a server whose certificate is from the cluster's
    CA but is not a coordinator's: the agent never opens its Session there
    and its log names the peer and the check."""
    c = local_cluster
    c.expect_log(r"ERROR agent\.session: agent tls-n1: refusing the leader: .*: wrong name: the server is not a "
                 r"coordinator", who="agent")
    files = c.pki.agent("impostor") if role == "agent" else c.pki.client_files("submitter", "eve", ("default",))
    impostor = Impostor(files)
    await impostor.server.start()
    try:
        created, _ = await c.store.create_if_absent(c.store.keys.leader(AZ), {"id": "c0", "address": impostor.address})
        assert created
        # No coordinator runs to read the planted record through: the agent
        # reads it from etcd (the legacy path, with the legacy agent user).
        agent = start_agent(c, where=["--etcd", c.etcd, "--tls-dir", str(c.pki.agent(NODE).ca.parent),
                                      "--etcd-tls-dir", str(c.etcd_tls_dir("agent"))])
        log = c.workdir / f"agent-{NODE}.log"
        try:
            deadline = time.monotonic() + 30
            while "refusing the leader" not in log.read_text() and agent.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            stop(agent)
    finally:
        await impostor.server.stop(None)
    refusals = [ln for ln in log.read_text().splitlines() if "refusing the leader" in ln]
    assert refusals, log.read_text()[-3000:]
    assert len(refusals) == 1, "each reason is logged once"
    assert f"{impostor.address}: wrong name:" in refusals[0], refusals[0]
    assert f"phalanx://{c.cluster}/{role}/" in refusals[0] and " ERROR " in refusals[0], refusals[0]
    assert impostor.calls == 0
