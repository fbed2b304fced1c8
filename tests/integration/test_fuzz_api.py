"""Property test of the public API against a running coordinator (real etcd,
real gRPC): specs across every field's boundary (just under, at and just
over each limit of phalanx.limits), hostile strings in every identifier and
free-text field, and random bytes sent as the raw request of every unary
method. Every answer is a clean status, the coordinator never dies, etcd
never holds a record over its bound, and a normal gang is admitted after.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.core.records import GangRecord, NodeRecord
from phalanx import limits
from phalanx.spec import parse_spec
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import gang_pb2_grpc as ggrpc
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node, tiny

pytestmark = pytest.mark.integration
AZ = "az-a"

# Few enough to run in seconds on two cores; the boundaries are enumerated
# explicitly, so a small sample still covers every edge.
SPEC_EXAMPLES = 120
RAW_EXAMPLES = 80

# Answers that are a clean verdict on the request. UNKNOWN and INTERNAL (an
# unhandled exception) and UNAVAILABLE (a retryable code for a permanent
# fault) are failures.
CLEAN = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # gRPC's own message size limit
}
HOSTILE = ["", "a\n", "a\r\n", "\x00", "a\x00b", "a/b", "../x", "/", "gаng", "ＡＢＣ", "\u202eabc", "\t", " a", "a ",
           "UPPER", "-a", "a-", "é", "\U0001F600", "\\", "%2F", "\x7f"]


def around(limit: int, lo: int = 0) -> st.SearchStrategy[int]:
    """Just under, at and just over ``limit`` (and the low end)."""
    return st.sampled_from(sorted({lo - 1, lo, lo + 1, limit - 1, limit, limit + 1}))


def text_around(limit: int, alphabet: str = "a") -> st.SearchStrategy[str]:
    return st.sampled_from([limit - 1, limit, limit + 1]).map(lambda n: alphabet * max(0, n))


def ident(limit: int) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(HOSTILE), text_around(limit), st.text(max_size=20),
                     st.from_regex(limits.DNS_LABEL, fullmatch=True).filter(lambda s: len(s) <= limit))


int32 = st.sampled_from([-(2**31), -1, 0, 1, 2**31 - 1])
seconds = st.sampled_from([-1.0, 0.0, 1e-9, 1.0, 600.0, 86400.0, 86401.0, 604800.0, 604801.0, 2592000.0, 2592001.0,
                           math.inf, -math.inf, math.nan, 1e300])


@st.composite
def run_specs(draw: Any) -> pb.RunSpec:
    kind = draw(st.sampled_from(["empty", "args", "bytes", "env", "hostile"]))
    run = pb.RunSpec()
    if kind == "args":
        run.command.extend([""] * draw(around(limits.MAX_COMMAND_ARGS)) if draw(st.booleans()) else ["x"] * 3)
    elif kind == "bytes":
        # One argument: its stored size is len + 2 quotes + 2 list brackets,
        # plus "{}" for the empty env.
        n = draw(around(limits.MAX_RUN_BYTES - 6))
        run.command.append("x" * max(0, n))
    elif kind == "env":
        count = draw(st.sampled_from([1, limits.MAX_ENV_VARS, limits.MAX_ENV_VARS + 1]))
        key_len = draw(around(limits.MAX_ENV_KEY_LEN, 1))
        for i in range(count):
            run.env[(f"K{i}_" + "k" * key_len)[: max(1, key_len)] if count == 1 else f"K{i}"] = "v"
    elif kind == "hostile":
        run.command.extend(draw(st.lists(st.sampled_from(HOSTILE), max_size=4)))
        for k in draw(st.lists(st.sampled_from(HOSTILE), max_size=3)):
            run.env[k] = draw(st.sampled_from(HOSTILE))
    if draw(st.booleans()):
        run.duration_s = draw(seconds)
    return run


@st.composite
def wild_specs(draw: Any) -> pb.GangSpec:
    """Every field drawn at once: mostly refused, for many reasons together."""
    return pb.GangSpec(
        name=draw(st.one_of(ident(limits.MAX_GANG_NAME_LEN), st.just("fuzz"))),
        queue=draw(st.one_of(st.just(""), ident(limits.MAX_QUEUE_LEN))),
        priority=draw(st.one_of(around(1_000_000, -1_000_000), int32)),
        members=draw(st.one_of(around(limits.MAX_MEMBERS, 1), int32, st.just(2000))),
        resources=pb.Resources(
            gpus=draw(st.one_of(around(limits.MAX_GPUS_PER_MEMBER, 1), st.just(8))),
            gpu_model=draw(st.one_of(st.just(""), st.sampled_from(HOSTILE), text_around(limits.MAX_GPU_MODEL_LEN, "H"))),
            rdma_nics=draw(st.one_of(around(limits.MAX_NICS_PER_MEMBER), st.just(8))),
        ),
        topology=pb.TopologyConstraint(required=draw(st.integers(-1, 8)), preferred=draw(st.integers(-1, 8)),
                                       allow_cross_az=draw(st.booleans())),
        run=draw(run_specs()),
        policy=pb.Policy(admission_timeout_s=draw(seconds), max_restarts=draw(around(100)), start_timeout_s=draw(seconds)),
    )


# One field at a boundary, the rest valid: each limit is probed alone, so
# just-under and at are accepted and just-over is refused for its own reason.
ONE_FIELD: dict[str, st.SearchStrategy[Any]] = {
    "name": ident(limits.MAX_GANG_NAME_LEN),
    "queue": ident(limits.MAX_QUEUE_LEN),
    "priority": st.one_of(around(1_000_000, -1_000_000), int32),
    "members": st.one_of(around(limits.MAX_MEMBERS, 1), around(limits.max_members_of_shape(8, 8, 600), 1), int32),
    "resources.gpus": around(limits.MAX_GPUS_PER_MEMBER, 1),
    "resources.rdma_nics": around(limits.MAX_NICS_PER_MEMBER),
    "resources.gpu_model": st.one_of(st.sampled_from(HOSTILE), text_around(limits.MAX_GPU_MODEL_LEN, "H")),
    "topology.required": st.integers(-1, 8),
    "topology.preferred": st.integers(-1, 8),
    "run": run_specs(),
    "policy.admission_timeout_s": seconds,
    "policy.max_restarts": around(100),
    "policy.start_timeout_s": seconds,
}


@st.composite
def one_field_specs(draw: Any) -> pb.GangSpec:
    spec = pb.GangSpec(name=f"fuzz{draw(st.integers(0, 10**6))}", members=1, resources=pb.Resources(gpus=1, rdma_nics=0),
                       run=pb.RunSpec(duration_s=1.0))
    field_ = draw(st.sampled_from(sorted(ONE_FIELD)))
    value = draw(ONE_FIELD[field_])
    if field_ == "members" and value > 1:
        spec.resources.gpus, spec.resources.rdma_nics = 8, 8  # the shape the whole-gang bound is probed with
    if field_ == "run":
        spec.run.CopyFrom(value)
        return spec
    target: Any = spec
    *parents, last = field_.split(".")
    for p in parents:
        target = getattr(target, p)
    setattr(target, last, value)
    return spec


def specs() -> st.SearchStrategy[pb.GangSpec]:
    return st.one_of(one_field_specs(), one_field_specs(), wild_specs())


METHODS = ["SubmitGang", "GetGang", "ListGangs", "CancelGang", "ExplainGang", "ListNodes", "ClusterStatus"]


def code_of(fn: Any) -> tuple[grpc.StatusCode, str, Any]:
    try:
        return grpc.StatusCode.OK, "", fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None


def fuzz(c: LocalCluster, address: str) -> list[str]:
    """Runs in a thread with a blocking channel (an admin certificate).
    Returns the ids of the gangs it created (to cancel them before the final
    admission)."""
    created: list[str] = []
    seen: dict[grpc.StatusCode, int] = {}
    with c.channel(address, aio=False) as ch:
        stub = ggrpc.GangServiceStub(ch)

        @settings(max_examples=SPEC_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(spec=specs(), key=st.one_of(st.just(""), ident(limits.MAX_IDEMPOTENCY_KEY_LEN)),
               gid=ident(limits.MAX_GANG_ID_LEN), reason=st.one_of(st.sampled_from(HOSTILE), text_around(limits.MAX_CANCEL_REASON_BYTES)))
        def specs_and_ids(spec: pb.GangSpec, key: str, gid: str, reason: str) -> None:
            code, details, resp = code_of(lambda: stub.SubmitGang(gpb.SubmitGangRequest(spec=spec, idempotency_key=key), timeout=10))
            assert code in CLEAN, f"SubmitGang -> {code}: {details}\n{spec}"
            seen[code] = seen.get(code, 0) + 1
            if code == grpc.StatusCode.OK:
                created.append(resp.gang.id)
            elif code == grpc.StatusCode.INVALID_ARGUMENT:
                assert ":" in details, f"no field named: {details}"
            for name, call in [
                ("GetGang", lambda: stub.GetGang(gpb.GetGangRequest(id=gid), timeout=10)),
                ("ExplainGang", lambda: stub.ExplainGang(gpb.ExplainGangRequest(id=gid), timeout=10)),
                ("CancelGang", lambda: stub.CancelGang(gpb.CancelGangRequest(id=gid, reason=reason), timeout=10)),
            ]:
                code, details, _ = code_of(call)
                assert code in CLEAN, f"{name}({gid!r}, reason of {len(reason)}) -> {code}: {details}"

        @settings(max_examples=RAW_EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
        @given(method=st.sampled_from(METHODS), raw=st.one_of(st.binary(max_size=300), st.sampled_from([b"\xff", b"\x0a\x02\xc3\x28", b"\x08" + b"\xff" * 10])))
        def raw_bytes(method: str, raw: bytes) -> None:
            call = ch.unary_unary(f"/phalanx.v1.GangService/{method}")  # no serializers: bytes in, bytes out
            code, details, _ = code_of(lambda: call(raw, timeout=10))
            # Bytes that are not a message at all are INVALID_ARGUMENT too
            # (coordinator/undecodable.py), not grpc's UNKNOWN.
            assert code in CLEAN, f"{method}({raw!r}) -> {code}: {details}"

        try:
            specs_and_ids()
            # The sample reached both sides of the boundaries.
            assert seen.get(grpc.StatusCode.OK) and seen.get(grpc.StatusCode.INVALID_ARGUMENT), seen
            raw_bytes()
            code, details, _ = code_of(lambda: ch.unary_unary("/phalanx.v1.GangService/SubmitGang")(b"\x00", timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "request: not a valid SubmitGang message" in details, (code, details)
        finally:
            for gid in created:
                code_of(lambda: stub.CancelGang(gpb.CancelGangRequest(id=gid, reason="fuzz over"), timeout=10))
    return created


async def test_fuzzed_requests_get_clean_answers_and_leave_etcd_bounded(local_cluster: LocalCluster) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)

    await asyncio.to_thread(fuzz, c, coord.address)
    assert coord.proc.poll() is None, "the coordinator died"

    # etcd never holds a record over its bound, and every record reads back.
    kvs, _ = await c.store.get_prefix_paged(c.store.keys.root)
    for kv in kvs:
        if kv.key.startswith(c.store.keys.gangs()):
            assert len(kv.value) <= limits.MAX_GANG_RECORD_BYTES, (kv.key, len(kv.value))
            g = GangRecord.from_dict(kv.json(), kv.mod_revision)
            parse_spec(g.spec.to_dict())  # accepted whole, not only as stored
        elif kv.key.startswith(c.store.keys.nodes()):
            assert len(kv.value) <= limits.MAX_NODE_RECORD_BYTES, (kv.key, len(kv.value))
            NodeRecord.from_dict(kv.json())
        assert len(kv.value) <= limits.MAX_RESERVATION_TXN_BYTES, (kv.key, len(kv.value))

    # A normal gang is admitted afterwards.
    c.start_agents(AZ, [dgx_node("n0", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    g = await c.submit(tiny("after-fuzz", members=1))
    done = await c.wait_state(g.id, {pb.GANG_STATE_RUNNING} | TERMINAL, timeout=40)
    assert done.state in {pb.GANG_STATE_RUNNING, pb.GANG_STATE_SUCCEEDED}, done
    assert coord.proc.poll() is None
