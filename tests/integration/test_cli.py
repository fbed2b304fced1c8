"""The SDK and the ``phalanx`` command against a live cluster.

One cluster per module (2 AZs x 1 coordinator x 2 simulated 8-GPU nodes),
started with ``phalanx up --no-workload`` on the session etcd under its own
key prefix, which is wiped and checked empty afterwards. Every test uses
its own gang names, so tests do not see each other's gangs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from phalanx import cli
from phalanx.client import AsyncClient, Client, TerminalStateReached, state_name
from phalanx.errors import FailedPrecondition, InvalidArgument, NotFound
from phalanx.etcd_server import EtcdServer
from phalanx.model import GangState
from phalanx.up import UpProcess
from phalanx.v1 import gang_pb2, gang_pb2_grpc
from phalanx.v1 import types_pb2 as pb
from phalanx.tls import TlsFiles, coordinator_channel
from tests.conftest import etcdctl
from tests.pki import ClusterPki, EtcdPki, unprovision

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
AZS = ("az-a", "az-b")
NODES_PER_AZ = 2


@dataclasses.dataclass(frozen=True)
class UpCluster:
    address: str
    cluster: str
    etcd: str
    admin_dir: Path  # the admin client dir up made (ca.crt client.crt client.key)


@pytest.fixture(scope="module")
def address(up_cluster: UpCluster) -> str:
    return up_cluster.address


@pytest.fixture(scope="module")
def up_cluster(etcd_server: EtcdServer, etcd_pki: EtcdPki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    """``phalanx up`` on the session etcd (TLS, etcd auth: ``--etcd-pki``
    lets it issue and provision its cluster's etcd users). For the module,
    the SDK and the CLI find their credentials as ``up`` tells a user to:
    ``$PHALANX_CONFIG`` (the addresses are still given to each call)."""
    cluster = "t" + uuid.uuid4().hex[:10]
    state = tmp_path_factory.mktemp("up")
    up = UpProcess([
        "--no-workload", "--etcd", etcd_server.endpoint, "--etcd-pki", str(etcd_pki.dir), "--cluster", cluster,
        "--azs", str(len(AZS)), "--coordinators-per-az", "1", "--nodes-per-az", str(NODES_PER_AZ),
        "--base-port", "0", "--state-dir", str(state),
    ])
    try:
        with pytest.MonkeyPatch.context() as env:
            up.start()
            assert up.config is not None and up.admin_dir is not None, "phalanx up wrote no client config"
            for name in ("PHALANX_TLS_DIR", "PHALANX_INSECURE", "PHALANX_ADDRESS"):
                env.delenv(name, raising=False)
            env.setenv("PHALANX_CONFIG", str(up.config))
            asyncio.run(_wait_nodes_ready(up.address))
            asyncio.run(_start_hog(up.address))
            yield UpCluster(up.address, cluster, etcd_server.endpoint, up.admin_dir)
    finally:
        code = up.stop()
        prefix = f"/phalanx/{cluster}/"
        etcdctl(etcd_server.endpoint, "del", "--prefix", prefix)
        assert etcdctl(etcd_server.endpoint, "get", "--prefix", "--keys-only", prefix).strip() == ""
        unprovision(etcd_server.endpoint, etcd_pki, cluster)
    assert code == 0, "\n".join(up.lines[-40:])


async def _wait_nodes_ready(address: str) -> None:
    async with AsyncClient(address) as client:
        while True:
            st = await client.status()
            if sum(az.nodes_ready for az in st.azs) >= len(AZS) * NODES_PER_AZ:
                return
            await asyncio.sleep(0.2)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def small(name: str, members: int = 2, gpus: int = 1, duration_s: float = 1.0, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name, "members": members, "resources": {"gpus": gpus}, "run": {"duration_s": duration_s},
    }
    spec.update(extra)
    return spec


async def _start_hog(address: str) -> None:
    """One GPU busy for the module's lifetime, so that `unplaceable` gangs
    (the whole cluster) wait instead of running."""
    async with AsyncClient(address) as client:
        hog = (await client.submit(small(unique("hog"), members=1, duration_s=24 * 3600.0))).gang
        await client.wait(hog.id, {GangState.RUNNING}, timeout=60)


def unplaceable(name: str) -> dict[str, Any]:
    """Every GPU of the cluster, across AZs: it could fit an empty cluster
    (so it is not failed as never fitting, docs/admission.md), but one GPU is
    held by the hog, so it stays PENDING until cancelled."""
    return small(name, members=len(AZS) * NODES_PER_AZ, gpus=8, duration_s=1.0, topology={"allow_cross_az": True})


def one_address(address: str, az: str = "az-a") -> str:
    return address.split(",")[AZS.index(az)]


# --- SDK -------------------------------------------------------------------------------------


async def test_submit_get_list_watch(address: str) -> None:
    name = unique("sdk")
    async with AsyncClient(address) as client:
        result = await client.submit(small(name))
        gang = result.gang
        assert result.created
        assert gang.id.startswith(name + "-") and gang.spec.name == name
        assert (await client.get(gang.id)).id == gang.id
        listed = await client.list(name_prefix=name)
        assert [g.id for g in listed] == [gang.id]
        assert [g.id for g in await client.list(name_prefix=name, owner_az=gang.owner_az)] == [gang.id]

        seen = [g async for g in client.watch(gang.id)]
    states = [state_name(g) for g in seen]
    assert states[-1] == "SUCCEEDED", states
    revisions = [g.mod_revision for g in seen]
    assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions)
    assert len(seen[-1].placement) == 2


async def test_get_by_name_while_live(address: str) -> None:
    name = unique("byname")
    async with AsyncClient(address) as client:
        gang = (await client.submit(unplaceable(name))).gang
        try:
            assert (await client.get(name)).id == gang.id
        finally:
            await client.cancel(gang.id)


async def test_resubmit_with_same_idempotency_key_returns_the_same_gang(address: str) -> None:
    name = unique("idem")
    key = uuid.uuid4().hex
    async with AsyncClient(address) as client:
        first = await client.submit(small(name), idempotency_key=key)
        again = await client.submit(small(name), idempotency_key=key)
        assert first.created and not again.created
        assert again.gang.id == first.gang.id
        assert len(await client.list(name_prefix=name)) == 1
        await client.wait(first.gang.id, {GangState.SUCCEEDED}, timeout=120)


async def test_wait_outcomes(address: str) -> None:
    async with AsyncClient(address) as client:
        done = (await client.submit(small(unique("wait")))).gang
        assert (await client.wait(done.id, {"succeeded"}, timeout=120)).state == GangState.SUCCEEDED
        # A terminal gang answers at once, wanted or not.
        with pytest.raises(TerminalStateReached) as info:
            await client.wait(done.id, {GangState.RUNNING}, timeout=120)
        assert info.value.state == GangState.SUCCEEDED

        stuck = (await client.submit(unplaceable(unique("stuck")))).gang
        with pytest.raises(TimeoutError) as tinfo:
            await client.wait(stuck.id, {GangState.RUNNING}, timeout=1.0)
        assert "PENDING" in str(tinfo.value)
        cancelled = await client.cancel(stuck.id, reason="test")
        assert cancelled.state == GangState.CANCELLED
        with pytest.raises(TerminalStateReached) as info:
            await client.wait(stuck.id, {GangState.RUNNING}, timeout=120)
        assert info.value.state == GangState.CANCELLED


async def test_cancel_twice_is_a_failed_precondition(address: str) -> None:
    async with AsyncClient(address) as client:
        gang = (await client.submit(unplaceable(unique("cancel")))).gang
        await client.cancel(gang.id)
        with pytest.raises(FailedPrecondition):
            await client.cancel(gang.id)


async def test_explain_names_the_shortfall(address: str) -> None:
    async with AsyncClient(address) as client:
        gang = (await client.submit(unplaceable(unique("explain")))).gang
        try:
            response = await client.explain(gang.id)
            assert response.gang.id == gang.id
            assert response.summary
            assert response.shortfalls
            assert all(s.members_fit < s.members_needed for s in response.shortfalls)
        finally:
            await client.cancel(gang.id)


async def test_nodes_and_status(address: str) -> None:
    async with AsyncClient(address) as client:
        nodes = await client.nodes()
        assert len(nodes) == len(AZS) * NODES_PER_AZ
        assert {n.topology.az for n in nodes} == set(AZS)
        only_b = await client.nodes(az="az-b")
        assert len(only_b) == NODES_PER_AZ and {n.topology.az for n in only_b} == {"az-b"}
        st = await client.status()
        assert {az.az for az in st.azs if az.has_leader} >= set(AZS)
        assert all(az.epoch > 0 and az.leader_address for az in st.azs if az.az in AZS)


async def test_unknown_gang_is_not_found(address: str) -> None:
    async with AsyncClient(address) as client:
        with pytest.raises(NotFound):
            await client.get(unique("nobody"))


async def test_fails_over_past_dead_addresses(address: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    async with AsyncClient(f"{dead},{address}", timeout=10) as client:
        st = await client.status()
        assert st.azs
        # Sticks to the address that answered.
        assert client.addresses[client._current] != dead


async def test_server_rejects_a_bad_wire_spec_naming_the_field(up_cluster: UpCluster) -> None:
    """What a client that skips local validation gets: INVALID_ARGUMENT that
    names the field (the generated stub, not the SDK, which refuses to send)."""
    spec = pb.GangSpec(name=unique("wire"), members=-3, resources=pb.Resources(gpus=1))
    admin = up_cluster.admin_dir
    files = TlsFiles(admin / "ca.crt", admin / "client.crt", admin / "client.key")
    async with coordinator_channel(one_address(up_cluster.address), files, cluster=up_cluster.cluster) as channel:
        stub = gang_pb2_grpc.GangServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SubmitGang(gang_pb2.SubmitGangRequest(spec=spec, idempotency_key=uuid.uuid4().hex), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "members" in (info.value.details() or "")


async def test_invalid_argument_is_translated(address: str) -> None:
    async with AsyncClient(address) as client:
        with pytest.raises(InvalidArgument):
            await client.get("not/a/gang")


def test_blocking_client(address: str) -> None:
    with Client(address) as client:
        result = client.submit(small(unique("sync")))
        states = [state_name(g) for g in client.watch(result.gang.id)]
        assert states[-1] == "SUCCEEDED"
        assert client.wait(result.gang.id, ["succeeded"], timeout=60).id == result.gang.id
        assert client.status().azs


# --- the phalanx command -------------------------------------------------------------------


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def write_spec(tmp_path: Path, data: dict[str, Any]) -> str:
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_cli_submit_get_list_wait_watch(address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.ADDRESS_ENV, address)  # the environment, not a flag
    name = unique("cli")
    code, out, _ = run_cli(capsys, "submit", write_spec(tmp_path, small(name, duration_s=2.0)))
    assert code == 0
    gang_id = out.strip()
    assert gang_id.startswith(name + "-")

    code, out, _ = run_cli(capsys, "get", gang_id, "-o", "json")
    assert code == 0 and json.loads(out)["id"] == gang_id
    code, out, _ = run_cli(capsys, "get", gang_id)
    assert code == 0 and "id:" in out and gang_id in out

    code, out, _ = run_cli(capsys, "list", "--name-prefix", name)
    assert code == 0 and gang_id in out and out.splitlines()[0].split()[:3] == ["ID", "NAME", "STATE"]

    code, out, _ = run_cli(capsys, "watch", gang_id)
    assert code == 0
    lines = out.strip().splitlines()
    assert lines and "SUCCEEDED" in lines[-1] and all(gang_id in line for line in lines)

    code, out, _ = run_cli(capsys, "wait", gang_id, "--for", "succeeded", "--timeout", "60")
    assert code == 0 and "SUCCEEDED" in out

    code, _, err = run_cli(capsys, "wait", gang_id, "--for", "running", "--timeout", "60")
    assert code == 1 and "SUCCEEDED" in err and "instead of RUNNING" in err

    code, out, _ = run_cli(capsys, "list", "--state", "succeeded", "--name-prefix", name, "-o", "yaml")
    assert code == 0 and yaml.safe_load(out)[0]["id"] == gang_id


def test_cli_submit_idempotency_key_and_outputs(address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_spec(tmp_path, small(unique("clikey")))
    key = "k-" + uuid.uuid4().hex
    code, out, err = run_cli(capsys, "submit", path, "--idempotency-key", key, "-o", "yaml", "--address", address)
    assert code == 0 and "already submitted" not in err
    first = yaml.safe_load(out)
    code, out, err = run_cli(capsys, "submit", path, "--idempotency-key", key, "-o", "wide", "--address", address)
    assert code == 0
    assert first["id"] in out and "already submitted" in err


def test_cli_cancel_explain_and_wait_timeout(address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = unique("clicancel")
    code, out, _ = run_cli(capsys, "submit", write_spec(tmp_path, unplaceable(name)), "--address", address)
    gang_id = out.strip()

    code, out, _ = run_cli(capsys, "explain", gang_id, "--address", address)
    assert code == 0 and "PENDING" in out and "shortfall" in out

    code, _, err = run_cli(capsys, "wait", gang_id, "--for", "running", "--timeout", "1", "--address", address)
    assert code == 1 and "timed out" in err and "PENDING" in err

    code, out, _ = run_cli(capsys, "cancel", gang_id, "--reason", "not needed", "--address", address)
    assert code == 0 and "CANCELLED" in out

    code, _, err = run_cli(capsys, "cancel", gang_id, "--address", address)
    assert code == 1 and err.startswith("error: ")

    code, _, err = run_cli(capsys, "wait", gang_id, "--for", "running", "--timeout", "60", "--address", address)
    assert code == 1 and "CANCELLED" in err


def test_cli_nodes_status_topology(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "nodes", "--address", address)
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["NODE", "AZ", "SPINE/LEAF"]
    assert len(lines) == 1 + len(AZS) * NODES_PER_AZ

    code, out, _ = run_cli(capsys, "nodes", "--az", "az-a", "--address", address)
    assert code == 0 and len(out.strip().splitlines()) == 1 + NODES_PER_AZ

    code, out, _ = run_cli(capsys, "status", "--address", address)
    assert code == 0
    for az in AZS:
        assert any(line.startswith(az + " ") and "(none)" not in line for line in out.splitlines())
    assert "gangs:" in out

    code, out, _ = run_cli(capsys, "topology", "--address", address)
    assert code == 0 and "az-a" in out and "az-b" in out


def test_cli_errors_exit_codes(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "get", unique("nobody"), "--address", address)
    assert code == 1 and err.startswith("error: ")
    # The server's INVALID_ARGUMENT is invalid input too: exit 2, field named.
    code, _, err = run_cli(capsys, "get", "not/a/gang", "--address", address)
    assert code == 2 and "id" in err


def test_cli_failover_in_address_list(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    code, out, _ = run_cli(capsys, "status", "--address", f"{dead},{address}")
    assert code == 0 and "az-a" in out


def _pid_listening_on(address: str) -> int:
    """The coordinator process started with ``--listen ADDRESS``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"coordinator" in argv and address.encode() in argv:
            return int(entry)
    raise LookupError(address)


async def test_watch_and_calls_survive_losing_the_serving_coordinator(
    etcd_server: EtcdServer, etcd_pki: EtcdPki, cluster_name: str, tmp_path: Path
) -> None:
    """One AZ, two coordinators. Stop the one serving a watch: the watch
    resumes on the other and still sees the gang to its end, with no event
    twice; unary calls fail over too."""
    up = UpProcess([
        "--no-workload", "--etcd", etcd_server.endpoint, "--etcd-pki", str(etcd_pki.dir), "--cluster", cluster_name,
        "--azs", "1",
        "--coordinators-per-az", "2", "--nodes-per-az", "1", "--base-port", "0", "--state-dir", str(tmp_path / "s"),
    ])
    try:
        await asyncio.to_thread(up.start)
        # Its own CA: explicit credentials (they win over the module's $PHALANX_CONFIG).
        await _wait_nodes_ready_n(up.address, 1, **up.client_kwargs())
        async with AsyncClient(up.address, timeout=15, **up.client_kwargs()) as client:
            gang = (await client.submit(small(unique("failover"), duration_s=6.0))).gang
            seen: list[pb.Gang] = []
            async for g in client.watch(gang.id):
                seen.append(g)
                if len(seen) == 1:
                    serving = client.addresses[client._current]
                    os.kill(_pid_listening_on(serving), signal.SIGTERM)
            assert state_name(seen[-1]) == "SUCCEEDED", [state_name(g) for g in seen]
            revisions = [g.mod_revision for g in seen]
            assert len(set(revisions)) == len(revisions)
            st = await client.status()
            stopped_id = f"az-a-c{up.addresses.index(serving)}"
            assert st.served_by and st.served_by != stopped_id
    finally:
        code = await asyncio.to_thread(up.stop)
    assert code == 0, "\n".join(up.lines[-40:])


async def _wait_nodes_ready_n(address: str, n: int, **credentials: Any) -> None:
    async with AsyncClient(address, **credentials) as client:
        while sum(az.nodes_ready for az in (await client.status()).azs) < n:
            await asyncio.sleep(0.2)


# --- output a person can reuse; names; who answered; races ------------------------------------


def _rfc3339(text: str) -> float:
    assert isinstance(text, str) and text.endswith("Z"), text
    return datetime.datetime.fromisoformat(text[:-1] + "+00:00").timestamp()


def test_cli_get_yaml_spec_round_trips_through_submit(address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`get -o yaml` spells states and levels as the spec does and times as
    RFC 3339; its `spec:` saved to a file is accepted by `phalanx submit`
    and makes a gang with the same spec."""
    name = unique("again")
    data = small(name, topology={"required": "az", "preferred": "node"}, policy={"max_restarts": 0})
    code, out, _ = run_cli(capsys, "submit", write_spec(tmp_path, data), "--address", address)
    assert code == 0
    first = out.strip()
    assert run_cli(capsys, "wait", first, "--for", "succeeded", "--timeout", "120", "--address", address)[0] == 0

    code, out, _ = run_cli(capsys, "get", first, "-o", "yaml", "--address", address)
    assert code == 0
    got = yaml.safe_load(out)
    assert got["state"] == "SUCCEEDED"
    assert got["span"] in {"nvlink_domain", "node"}
    assert got["spec"]["topology"]["required"] == "az" and got["spec"]["topology"]["preferred"] == "node"
    assert _rfc3339(got["submitted_at"]) <= _rfc3339(got["updated_at"])
    assert got["spec"]["policy"]["max_restarts"] == 0

    saved = tmp_path / "saved.yaml"
    saved.write_text(yaml.safe_dump(got["spec"]))
    code, out, err = run_cli(capsys, "submit", str(saved), "--address", address)
    assert code == 0, err
    second = out.strip()
    assert second != first and second.startswith(name + "-")
    code, out, _ = run_cli(capsys, "get", second, "-o", "json", "--address", address)
    assert code == 0 and json.loads(out)["spec"] == got["spec"]
    assert run_cli(capsys, "wait", second, "--for", "succeeded", "--timeout", "120", "--address", address)[0] == 0


async def test_a_name_resolves_to_its_latest_gang_while_list_shows_it(address: str) -> None:
    """After a gang ends its name is free for reuse, but get/wait/explain/
    cancel/watch NAME still find it (the newest gang of that name), as long
    as ListGangs shows it; a longer name that starts the same is not taken."""
    name = unique("kept")
    async with AsyncClient(address) as client:
        first = (await client.submit(small(name, members=1))).gang
        await client.wait(first.id, {GangState.SUCCEEDED}, timeout=120)
        assert [g.id for g in await client.list(name_prefix=name)] == [first.id]
        assert (await client.get(name)).id == first.id
        assert (await client.wait(name, {"succeeded"}, timeout=60)).id == first.id
        assert (await client.explain(name)).gang.id == first.id
        with pytest.raises(FailedPrecondition, match="already SUCCEEDED"):
            await client.cancel(name)
        other = (await client.submit(small(name + "-x", members=1))).gang  # id "<name>-x-<hex>"
        await client.wait(other.id, {GangState.SUCCEEDED}, timeout=120)
        assert (await client.get(name)).id == first.id

        second = (await client.submit(small(name, members=1, duration_s=2.0))).gang
        assert (await client.get(name)).id == second.id  # the live one
        await client.wait(second.id, {GangState.SUCCEEDED}, timeout=120)
        assert (await client.get(name)).id == second.id  # the newest finished one
        assert [g.id async for g in client.watch(name)] == [second.id]


def test_cli_by_name_after_the_gang_finished(address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's order: submit, watch to the end, then wait/explain/get
    by name; the cancel says what the gang is, not that there is none."""
    name = unique("readme")
    assert run_cli(capsys, "submit", write_spec(tmp_path, small(name, members=1)), "--address", address)[0] == 0
    assert run_cli(capsys, "watch", name, "--address", address)[0] == 0
    code, out, _ = run_cli(capsys, "wait", name, "--for", "succeeded", "--timeout", "30", "--address", address)
    assert code == 0 and "SUCCEEDED" in out
    assert run_cli(capsys, "explain", name, "--address", address)[0] == 0
    code, out, _ = run_cli(capsys, "get", name, "--address", address)
    assert code == 0 and re.search(rf"^name:\s+{re.escape(name)}$", out, re.M), out
    # Submitted over TLS with up's admin certificate: the gang has that owner.
    assert re.search(r"^submitted by:\s+admin/up$", out, re.M), out
    code, _, err = run_cli(capsys, "cancel", name, "--address", address)
    assert code == 1 and "already SUCCEEDED" in err and "no gang" not in err


def test_status_and_errors_say_which_cluster_answered(up_cluster: UpCluster, capsys: pytest.CaptureFixture[str]) -> None:
    first = one_address(up_cluster.address)
    code, out, _ = run_cli(capsys, "status", "--address", first)
    assert code == 0
    assert out.splitlines()[0] == f"cluster {up_cluster.cluster} (answered by az-a-c0 at {first})"
    missing = unique("nobody")
    code, _, err = run_cli(capsys, "get", missing, "--address", first)
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"error: id: no gang {missing!r} in cluster {up_cluster.cluster!r}")
    assert err.rstrip().endswith(f"[cluster {up_cluster.cluster}, coordinator az-a-c0 at {first}]")
    # The server's INVALID_ARGUMENT names its origin too.
    code, _, err = run_cli(capsys, "get", "not/a/gang", "--address", first)
    assert code == 2 and f"[cluster {up_cluster.cluster}, coordinator az-a-c0 at {first}]" in err


def test_sdk_without_an_address_reads_phalanx_address(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_ADDRESS", address)
    with Client() as client:
        assert client.status().azs
        with pytest.raises(NotFound) as info:
            client.get(unique("nobody"))
    assert info.value.cluster and info.value.coordinator and info.value.address in address.split(",")


async def test_cancel_that_loses_a_race_is_retried_until_it_takes_effect(up_cluster: UpCluster) -> None:
    """A cancel whose compare loses to another write of the gang (admission
    placing it at that moment) is answered ABORTED; the SDK retries it. The
    other write is made deterministic here: the record is rewritten in etcd
    with the same content, so the leader's copy is one revision behind."""
    az_a = one_address(up_cluster.address)
    async with AsyncClient(az_a) as client:
        # All of az-a's GPUs, in az-a only: waits behind the hog's one GPU.
        gang = (await client.submit(small(unique("race"), members=NODES_PER_AZ, gpus=8))).gang
        assert gang.owner_az == "az-a"
        key = f"/phalanx/{up_cluster.cluster}/gangs/{gang.id}"
        value = etcdctl(up_cluster.etcd, "get", key, "--print-value-only").strip()
        assert json.loads(value)["id"] == gang.id
        etcdctl(up_cluster.etcd, "put", key, value)
        cancelled = await client.cancel(gang.id, reason="race")
        assert cancelled.state == GangState.CANCELLED
        assert (await client.get(gang.id)).state == GangState.CANCELLED


def _cli_process(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # A deadline of an hour: a command that waited it out would outlive the
    # subprocess timeout and fail; one that knows the cause stops at once.
    return subprocess.run([sys.executable, "-m", "phalanx", *argv, "--rpc-timeout", "3600"], env=env,
                          capture_output=True, text=True, timeout=120)


def test_connect_failures_name_their_cause_at_once_in_one_line(up_cluster: UpCluster, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}  # what a user's shell has
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    # Nothing listening, over TLS: not a certificate problem.
    done = _cli_process("status", "--address", dead, env=env)
    assert done.returncode == cli.EXIT_ERROR and done.stderr.count("\n") == 1, done.stderr
    assert f"nothing is listening at {dead} (connection refused; is the cluster up?" in done.stderr, done.stderr
    assert "certificate" not in done.stderr, done.stderr
    # A client whose CA is another one (same cluster name): the check that failed, and only our line
    # (gRPC's C-core logs each failed handshake unless told not to).
    other = ClusterPki(tmp_path, up_cluster.cluster).client()
    done = _cli_process("status", "--address", up_cluster.address.split(",")[0], "--tls-dir", str(other), env=env)
    assert done.returncode == cli.EXIT_ERROR and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: ClusterStatus: TLS handshake failed") and "unknown CA" in done.stderr, \
        done.stderr
