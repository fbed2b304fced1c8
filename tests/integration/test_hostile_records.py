"""Hostile and careless input cannot hurt the cluster (docs/limits.md).

Real etcd, real coordinator processes, real gRPC: records planted in etcd
directly never stop a takeover; a refused registration writes nothing; every
identifier is matched exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
from typing import Any

import grpc
import pytest

from agent.topology.simulated import simulated_node
from phalanx import limits, wire
from phalanx.v1 import agent_pb2 as apb
from phalanx.v1 import agent_pb2_grpc as agrpc
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node, tiny

pytestmark = pytest.mark.integration
AZ = "az-a"

# The repro: 450,000 empty arguments, once 0 bytes against the run
# limit, stored as a 1.35 MB gang record.
EMPTY_ARGS = [""] * 450_000


def oversized_gang(gang_id: str) -> bytes:
    spec = {"name": gang_id.rsplit("-", 1)[0], "members": 1, "resources": {"gpus": 1}, "run": {"command": EMPTY_ARGS}}
    return json.dumps({"id": gang_id, "spec": spec, "state": "PENDING", "owner_az": AZ, "submitted_at": 1.0},
                      separators=(",", ":")).encode()


async def plant(c: LocalCluster, key: str, value: bytes) -> None:
    """Write straight to etcd, as an operator's `etcdctl put` (or a buggy
    older version) would: no validation on the way."""
    from phalanx.store import Put

    res = await c.store.txn([], [Put(key, value)])
    assert res.succeeded


async def test_a_new_leader_takes_over_past_oversized_and_corrupt_records_and_admits(local_cluster: LocalCluster) -> None:
    c = local_cluster
    k = c.store.keys
    first = c.start_coordinator(AZ, "a0")
    info = await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)

    # Seven 1.35 MB gang records: 9.5 MB under gangs/, past the 8 MiB a
    # single range reply may carry; and records that do not parse at all.
    for i in range(7):
        await plant(c, k.gang(f"huge{i}-0000000{i}"), oversized_gang(f"huge{i}-0000000{i}"))
    await plant(c, k.gang("notjson-00000001"), b"{not json")
    await plant(c, k.gang("partial-00000001"), json.dumps({"id": "partial-00000001"}).encode())
    await plant(c, k.gang("badstate-00000001"), json.dumps({"id": "badstate-00000001", "spec": {"name": "badstate", "members": 1, "resources": {"gpus": 1}},
                                                         "state": "EXPLODED", "owner_az": AZ, "submitted_at": 1.0}).encode())
    await plant(c, k.reservation(AZ, "garbage-00000001"), b"\x00\xff garbage")
    await plant(c, k.node(AZ, "ghost"), b"[1, 2, 3]")

    second = c.start_coordinator(AZ, "a1")
    first.signal(signal.SIGKILL)
    new = await c.wait_leader(AZ, not_epoch=info.epoch, timeout=30)
    assert new.coordinator_id == "a1"

    # It leads (not a rebuild retried for ever) and admits a normal gang.
    g = await c.submit(tiny("after", members=1), address=second.address)
    done = await c.wait_state(g.id, {pb.GANG_STATE_RUNNING} | TERMINAL, timeout=40)
    assert done.state in {pb.GANG_STATE_RUNNING, pb.GANG_STATE_SUCCEEDED}, done
    log = second.log()
    for key in ("huge0-00000000", "notjson-00000001", "partial-00000001", "badstate-00000001", "garbage-00000001", "nodes/az-a/ghost"):
        assert "skipped unreadable record" in log and key in log, f"{key} not reported as skipped:\n{log[-3000:]}"
    # Reading one back is the cluster's fault, said as such (not the caller's
    # INVALID_ARGUMENT); status counts them as unreadable, not as new states.
    stub = c.stub(second.address)
    for gid in ("notjson-00000001", "badstate-00000001", "huge0-00000000"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetGang(gpb.GetGangRequest(id=gid), timeout=10)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS, (gid, err.value.code(), err.value.details())
        assert "cannot be read" in err.value.details()
    st = await stub.ClusterStatus(gpb.ClusterStatusRequest(), timeout=10)
    assert "EXPLODED" not in st.gangs_by_state and st.gangs_by_state["UNREADABLE"] >= 3, dict(st.gangs_by_state)
    nodes = await stub.ListNodes(gpb.ListNodesRequest(), timeout=10)
    assert [n.topology.node for n in nodes.nodes] == ["n0"], nodes  # the corrupt "ghost" is skipped
    listed = await stub.ListGangs(gpb.ListGangsRequest(), timeout=10)
    assert g.id in [x.id for x in listed.gangs]
    assert second.proc.poll() is None


async def test_list_pages_past_the_grpc_reply_limit(local_cluster: LocalCluster) -> None:
    """Eighty legal gangs of ~60 KB each (4.8 MB, past gRPC's 4 MiB default
    receive limit): ListGangs answers in pages of at most LIST_REPLY_BYTES and
    the SDK follows them; ClusterStatus counts every one."""
    c = local_cluster
    coord = c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    n = 80
    for i in range(n):
        gid = f"big{i:02d}-{i:08x}"
        spec = {"name": gid.rsplit("-", 1)[0], "members": 1, "resources": {"gpus": 1},
                "run": {"command": ["true"], "env": {"PAD": "x" * 60_000}}}
        # Owned by an AZ with no leader, and finished: nobody acts on them.
        record = {"id": gid, "spec": spec, "state": "SUCCEEDED", "owner_az": "az-q",
                  "submitted_at": 1000.0 + i, "updated_at": 1000.0 + i}
        await plant(c, c.store.keys.gang(gid), json.dumps(record).encode())
    stub = c.stub(coord.address)
    first = await stub.ListGangs(gpb.ListGangsRequest(), timeout=30)
    assert first.next_page_token, "one reply carried every gang"
    assert first.ByteSize() <= limits.LIST_REPLY_BYTES + 64 * 1024
    from phalanx.client import AsyncClient

    async with AsyncClient(coord.address, tls_dir=c.client_dir()) as client:
        gangs = await client.list()
        assert [g.id for g in gangs] == [f"big{i:02d}-{i:08x}" for i in range(n)]
        assert len(await client.list(limit=5)) == 5
        st = await client.status()
        assert st.gangs_by_state["SUCCEEDED"] == n
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ListGangs(gpb.ListGangsRequest(page_token="not-a-token"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in err.value.details()


async def test_list_filters_are_identifiers(local_cluster: LocalCluster) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    stub = c.stub(coord.address)
    for field_, bad in [("queue", "q\n"), ("queue", "Q"), ("queue", "a/b"), ("owner_az", "az\x00"),
                        ("owner_az", "x" * 200), ("name_prefix", "nl\n"), ("name_prefix", "gаng")]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListGangs(gpb.ListGangsRequest(**{field_: bad}), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field_, bad)
        assert err.value.details().startswith(f"{field_}:"), err.value.details()
    ok = await stub.ListGangs(gpb.ListGangsRequest(queue="default", owner_az=AZ, name_prefix="a-"), timeout=10)
    assert list(ok.gangs) == []


async def test_an_unreadable_reservation_keeps_its_devices_held(local_cluster: LocalCluster) -> None:
    """Safety before liveness: a running gang's reservation made unreadable,
    then a takeover: the new leader does not offer that gang's GPUs."""
    c = local_cluster
    k = c.store.keys
    first = c.start_coordinator(AZ, "a0")
    info = await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    holder = await c.submit(tiny("holder", members=1, gpus=8, duration=300))
    await c.wait_state(holder.id, {pb.GANG_STATE_RUNNING}, timeout=30)
    await plant(c, k.reservation(AZ, holder.id), b"{corrupt")
    second = c.start_coordinator(AZ, "a1")
    first.signal(signal.SIGKILL)
    await c.wait_leader(AZ, not_epoch=info.epoch, timeout=30)
    late = await c.submit(tiny("late", members=1, gpus=1, duration=1), address=second.address)
    stub = c.stub(second.address)
    for _ in range(25):  # 5 s: a free-looking GPU is placed within a cycle
        g = await stub.GetGang(gpb.GetGangRequest(id=late.id), timeout=10)
        assert g.state == pb.GANG_STATE_PENDING, f"placed on a GPU the unreadable reservation holds: {g}"
        await asyncio.sleep(0.2)
    assert f"reservations/{AZ}/{holder.id}" in second.log()


async def test_store_pages_a_prefix_larger_than_one_range_reply(local_cluster: LocalCluster) -> None:
    """get_prefix_paged reads what one range cannot: nine 1.35 MB values
    (12 MB) under a prefix, against a receive limit of 8 MiB."""
    c = local_cluster
    prefix = c.store.keys.root + "paged/"
    for i in range(9):
        await plant(c, f"{prefix}{i}", oversized_gang(f"huge{i}-0000000{i}"))
    for i in range(30):
        await plant(c, f"{prefix}small{i:02d}", b"{}")
    with pytest.raises(Exception) as err:
        await c.store.get_prefix(prefix)
    assert "RESOURCE_EXHAUSTED" in str(err.value) or "larger than max" in str(err.value)
    kvs, rev = await c.store.get_prefix_paged(prefix, page=4)
    assert [kv.key for kv in kvs] == sorted(f"{prefix}{i}" for i in range(9)) + [f"{prefix}small{i:02d}" for i in range(30)]
    assert rev > 0
    # Every page was read at one revision: a key written after the first
    # page is not in this snapshot.
    pages = []
    async for page, page_rev in c.store.get_prefix_pages(prefix, page=8, keys_only=True):
        pages.append((len(page), page_rev))
        if len(pages) == 1:
            await plant(c, f"{prefix}zz-late", b"{}")
    assert sum(n for n, _ in pages) == 39, pages
    assert len({r for _, r in pages}) == 1, pages


# --- agent registration ---------------------------------------------------------


async def register(c: LocalCluster, address: str, reg: apb.Register, node: str = "fine") -> grpc.aio.AioRpcError | None:
    """One Session, with the agent certificate of ``node``, that sends
    ``reg`` and reads the first answer. A registration is checked whole
    before the certificate's node is compared with it, so a refused one is
    refused for what it says, whichever agent sends it."""
    async with c.channel(address, role="agent", name=node,
                         options=(("grpc.max_send_message_length", 64 * 1024 * 1024),)) as ch:
        call = agrpc.AgentServiceStub(ch).Session()
        await call.write(apb.AgentMessage(register=reg))
        try:
            await asyncio.wait_for(call.read(), 10)
        except grpc.aio.AioRpcError as exc:
            return exc
        call.cancel()
        return None


def reg_of(topology: Any, members: list[apb.MemberStatus] = (), agent_id: str = "agent-1") -> apb.Register:
    return apb.Register(agent_id=agent_id, topology=wire.topology_to_pb(topology), members=list(members))


REFUSED = [
    ("member phase 99", reg_of(simulated_node("p99", AZ), [apb.MemberStatus(gang="g-00000001", incarnation=1, rank=0, phase=99)]),
     "register.members[0].phase"),
    ("4,000 GPUs", reg_of(simulated_node("big", AZ, gpus=4000, nics=0, islands=4000)), "register.topology.gpus: 4000 entries, more than the limit of 128"),
    ("node name with newline", reg_of(simulated_node("nl\n", AZ)), "register.topology.node"),
    ("node name with NUL", reg_of(simulated_node("nul\x00x", AZ)), "register.topology.node"),
    ("node name with a path", reg_of(simulated_node("../etc", AZ)), "register.topology.node"),
    ("node name look-alike", reg_of(simulated_node("nоde", AZ)), "register.topology.node"),  # Cyrillic o
    ("label key with newline", reg_of(dataclasses.replace(simulated_node("lbl", AZ), labels={"a\n": "b"})),
     "register.topology.labels"),
    ("member reason of 100 KB", reg_of(simulated_node("why", AZ), [apb.MemberStatus(gang="g-00000001", incarnation=1, rank=0, phase=1, reason="x" * 100_000)]),
     "register.members[0].reason"),
]


async def test_a_refused_registration_writes_no_node_record(local_cluster: LocalCluster) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    for what, reg, words in REFUSED:
        err = await register(c, coord.address, reg)
        assert err is not None, f"{what}: accepted"
        # Permanent: INVALID_ARGUMENT, never a retryable UNAVAILABLE.
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err.code(), err.details())
        assert words in err.details(), (what, err.details())
    await asyncio.sleep(0.5)  # a negative check: no refused registration is written later either
    nodes, _ = await c.store.get_prefix(c.store.keys.nodes(), keys_only=True)
    assert nodes == [], [kv.key for kv in nodes]
    # A normal registration is still accepted and written.
    assert await register(c, coord.address, reg_of(simulated_node("fine", AZ))) is None
    nodes, _ = await c.store.get_prefix(c.store.keys.nodes(), keys_only=True)
    assert [kv.key for kv in nodes] == [c.store.keys.node(AZ, "fine")]
    assert coord.proc.poll() is None


async def test_a_session_that_never_registers_is_told_why(local_cluster: LocalCluster) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    async with c.channel(coord.address, role="agent", name="silent") as ch:
        # Silent: opens the stream and sends nothing.
        call = agrpc.AgentServiceStub(ch).Session()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read(), 60)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (err.value.code(), err.value.details())
        assert "must start with register" in err.value.details(), err.value.details()
        # Closes its side without a message.
        call = agrpc.AgentServiceStub(ch).Session()
        await call.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read(), 60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), err.value.details())
        assert "register" in err.value.details(), err.value.details()
    nodes, _ = await c.store.get_prefix(c.store.keys.nodes(), keys_only=True)
    assert nodes == [], [kv.key for kv in nodes]
    assert coord.proc.poll() is None


async def test_undecodable_agent_messages_are_invalid_argument(local_cluster: LocalCluster) -> None:
    """Bytes that are not an AgentMessage, first or after a good register:
    INVALID_ARGUMENT naming the message, not UNKNOWN; nothing written."""
    c = local_cluster
    coord = c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    good = apb.AgentMessage(register=reg_of(simulated_node("raw", AZ))).SerializeToString()
    async with c.channel(coord.address, role="agent", name="raw") as ch:
        session = ch.stream_stream("/phalanx.v1.AgentService/Session",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
        for first in ([b"\xff\xff\xff"], [good, b"\x0a\xff\x01"]):
            call = session()
            for raw in first:
                await call.write(raw)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while True:
                    if await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF:
                        break
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), err.value.details())
            assert "not a valid Session message" in err.value.details(), err.value.details()
    nodes, _ = await c.store.get_prefix(c.store.keys.nodes(), keys_only=True)
    # The second stream registered "raw" before its bad message; nothing else.
    assert [kv.key for kv in nodes] in ([], [c.store.keys.node(AZ, "raw")]), [kv.key for kv in nodes]
    assert coord.proc.poll() is None


# --- identifiers at the API ----------------------------------------------------------

HOSTILE_IDS = ["nl\n", "ok-1234abcd\n", "nul\x00", "a/b", "../x", "gаng", "ＡＢＣ", "x" * 64, " pad", "UPPER"]


async def test_every_gang_id_field_is_matched_exactly(local_cluster: LocalCluster) -> None:
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    g = await c.submit(tiny("nlx", members=1, duration=30))
    # Running, so the cancel at the end does not race its admission.
    await c.wait_state(g.id, {pb.GANG_STATE_RUNNING}, timeout=30)
    stub = c.stub()
    for bad in HOSTILE_IDS + [g.id + "\n", "nlx\n"]:
        calls = {
            "get": stub.GetGang(gpb.GetGangRequest(id=bad), timeout=5),
            "cancel": stub.CancelGang(gpb.CancelGangRequest(id=bad), timeout=5),
            "explain": stub.ExplainGang(gpb.ExplainGangRequest(id=bad), timeout=5),
        }
        for what, call in calls.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, bad, err.value.code())
            assert "id:" in err.value.details(), (what, bad, err.value.details())
        watch = stub.WatchGang(gpb.WatchGangRequest(id=bad), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in watch:
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ("watch", bad)
    # Spec identifiers: the name "nlx\n" cannot be admitted next to "nlx".
    for field_, spec in [
        ("name", tiny("nlx\n", members=1)),
        ("name", tiny("nlx\x00", members=1)),
        ("name", tiny("nlх", members=1)),  # Cyrillic ha
        ("queue", tiny("q", members=1, queue="default\n")),
        ("queue", tiny("q", members=1, queue="a/b")),
        ("run.env", pb.GangSpec(name="e", members=1, resources=pb.Resources(gpus=1), run=pb.RunSpec(env={"PATH\n": "x"}))),
        ("resources.gpu_model", pb.GangSpec(name="m", members=1, resources=pb.Resources(gpus=1, gpu_model="H100\n"))),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.submit(spec)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field_, spec)
        assert f"{field_}" in err.value.details(), (field_, err.value.details())
    # The real gang is still reachable by its exact id and can be cancelled.
    cancelled = await stub.CancelGang(gpb.CancelGangRequest(id=g.id, reason="done"), timeout=5)
    assert cancelled.id == g.id


async def test_cancel_reason_is_bounded_and_printable(local_cluster: LocalCluster) -> None:
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    g = await c.submit(tiny("why", members=1))
    stub = c.stub()
    for reason, words in [("x" * (limits.MAX_CANCEL_REASON_BYTES + 1), f"more than the limit of {limits.MAX_CANCEL_REASON_BYTES} bytes"),
                          ("é" * 600, "1200 bytes"), ("two\nlines", "printable")]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.CancelGang(gpb.CancelGangRequest(id=g.id, reason=reason), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "reason:" in err.value.details() and words in err.value.details(), err.value.details()
    still = await stub.GetGang(gpb.GetGangRequest(id=g.id), timeout=5)
    assert still.state not in TERMINAL
    done = await stub.CancelGang(gpb.CancelGangRequest(id=g.id, reason="x" * limits.MAX_CANCEL_REASON_BYTES), timeout=5)
    assert done.id == g.id
    kv = await c.store.get(c.store.keys.gang(g.id))
    assert kv is not None and len(kv.value) <= limits.MAX_GANG_RECORD_BYTES


async def test_empty_arguments_count_against_the_run_limit(local_cluster: LocalCluster) -> None:
    """The issue's 900 KB request of empty arguments is refused, naming the
    field, its size and the limit; nothing is written."""
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    spec = pb.GangSpec(name="empty", members=1, resources=pb.Resources(gpus=1), run=pb.RunSpec(command=[""] * 300_000))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.submit(spec)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "run.command: 300000 arguments, more than the limit of 4096" in err.value.details(), err.value.details()
    spec = pb.GangSpec(name="empty", members=1, resources=pb.Resources(gpus=1), run=pb.RunSpec(command=[""] * 4000, env={"A": "x" * 60_000}))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.submit(spec)
    assert "run: command and env take" in err.value.details() and f"limit of {limits.MAX_RUN_BYTES} bytes" in err.value.details()
    spec = pb.GangSpec(name="model", members=1, resources=pb.Resources(gpus=1, gpu_model="H" * 100_000))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.submit(spec)
    assert "resources.gpu_model: must be at most 64 characters, got 100000" in err.value.details(), err.value.details()
    gangs, _ = await c.store.get_prefix(c.store.keys.gangs(), keys_only=True)
    assert gangs == []


async def test_a_cancel_between_reservation_and_start_frees_the_devices(local_cluster: LocalCluster, tmp_path) -> None:
    """A cancel that lands after a gang's reservation is written but before
    its assignment reaches the agent: the agent refuses the assignment (the
    reservation is RELEASING) and must say so, or the leader keeps the
    devices held for a member that never started until the agent registers
    again (seen with `phalanx cancel` racing admission: 8 of 16 GPUs held by
    a CANCELLED gang)."""
    c = local_cluster
    fp = tmp_path / "failpoints"
    fp.write_text("leader.after_reserve=delay(3)")
    c.start_coordinator(AZ, "a0", extra_env={"PHALANX_FAILPOINTS_FILE": str(fp)})
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    whole = await c.submit(tiny("whole-node", members=1, gpus=8, duration=600))
    cur = await c.wait_state(whole.id, {pb.GANG_STATE_RESERVED} | TERMINAL, timeout=30)
    assert cur.state == pb.GANG_STATE_RESERVED, cur  # reserved, its assignment not yet sent
    await c.stub().CancelGang(gpb.CancelGangRequest(id=whole.id), timeout=10)
    fp.write_text("")
    # The same 8 GPUs go to the next gang once the refused member is known.
    nxt = await c.submit(tiny("next", members=1, gpus=8, duration=600))
    done = await c.wait_state(nxt.id, {pb.GANG_STATE_RUNNING} | TERMINAL, timeout=30)
    assert done.state == pb.GANG_STATE_RUNNING, done
    assert await c.store.get(c.store.keys.reservation(AZ, whole.id)) is None
