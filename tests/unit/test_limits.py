"""phalanx.limits: the table of bounds, and the arithmetic docs/limits.md states."""

from __future__ import annotations

import dataclasses
import json

import pytest

from agent.topology.simulated import simulated_fabric, simulated_node
from coordinator.core.records import GangRecord, MemberAssignment, NodeRecord, read_records
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.store import KV, encode
from phalanx import limits
from phalanx.model import GangState
from phalanx.spec import InvalidSpec, parse_spec
from phalanx.topology import Gpu, Nic


def spec_data(**over):
    d = {"name": "g", "members": 1, "resources": {"gpus": 1}}
    d.update(over)
    return d


def errors_of(data) -> dict[str, str]:
    with pytest.raises(InvalidSpec) as info:
        parse_spec(data)
    return {e.field: e.reason for e in info.value.errors}


# --- strings and lists counted as stored ------------------------------------------


def test_empty_arguments_cost_their_quotes_and_commas() -> None:
    assert limits.list_bytes([""] * 10) == 2 + 10 * 2 + 9  # [] + "" each + commas
    # The issue's repro is refused on the argument count and on the bytes.
    errs = errors_of(spec_data(run={"command": [""] * 450_000}))
    assert errs["run.command"] == "450000 arguments, more than the limit of 4096"
    errs = errors_of(spec_data(run={"command": [""] * 4096, "env": {"A": "x" * 60_000}}))
    assert "run" in errs and "limit of 65536 bytes" in errs["run"]


def test_escapes_count_as_the_bytes_they_are_stored_as() -> None:
    # A control character is stored as \\u0001 (6 bytes), an emoji as two
    # \\uXXXX escapes (12): a 11,000-emoji argument is 132 KB stored.
    assert limits.json_bytes("\x01") == 8
    assert limits.json_bytes("\U0001F600") == 14
    errs = errors_of(spec_data(run={"command": ["\U0001F600" * 11_000]}))
    assert "run" in errs and "132" in errs["run"]


@pytest.mark.parametrize("size,ok", [(limits.MAX_RUN_BYTES - 7, True), (limits.MAX_RUN_BYTES - 6, True), (limits.MAX_RUN_BYTES - 5, False)])
def test_run_limit_is_exact(size: int, ok: bool) -> None:
    # One argument of n bytes is stored as ["..."] (n + 4) plus {} for env (2).
    data = spec_data(run={"command": ["x" * size]})
    if ok:
        assert limits.list_bytes(parse_spec(data).run.command) + 2 == size + 6
    else:
        assert "run" in errors_of(data)


@pytest.mark.parametrize("field,value,words", [
    ("resources.gpu_model", "H" * 65, "at most 64 characters, got 65"),
    ("resources.gpu_model", "H100\n", "printable ASCII"),
    ("run.command[0]", "a\x00b", "NUL"),
    ("run.env.A", "a\x00b", "NUL"),
])
def test_free_text_bounds(field: str, value: str, words: str) -> None:
    if field == "resources.gpu_model":
        data = spec_data(resources={"gpus": 1, "gpu_model": value})
    elif field.startswith("run.command"):
        data = spec_data(run={"command": [value]})
    else:
        data = spec_data(run={"env": {"A": value}})
    assert words in errors_of(data)[field]


def test_gpu_model_at_its_limit_is_accepted() -> None:
    assert parse_spec(spec_data(resources={"gpus": 1, "gpu_model": "H" * 64})).resources.gpu_model == "H" * 64


def test_lists_have_counts() -> None:
    assert "more than the limit of 1024" in errors_of(spec_data(run={"env": {f"V{i}": "" for i in range(1025)}}))["run.env"]
    parse_spec(spec_data(run={"env": {f"V{i}": "" for i in range(1024)}}))


# --- the whole gang: its reservation write against etcd's request limit --------


def worst_txn_bytes(members: int, gpus: int, nics: int) -> int:
    """Build the real records of the largest placement of this shape (every
    name at its maximum) and measure what the reservation txn writes."""
    spec = parse_spec(spec_data(members=1, resources={"gpus": gpus, "rdma_nics": nics}))
    spec = dataclasses.replace(spec, members=members)
    node = lambda r: (f"{r:0{limits.MAX_NODE_NAME_LEN}d}")  # noqa: E731 - unique names of maximum length
    az = "a" * limits.MAX_AZ_NAME_LEN
    placement = tuple(MemberAssignment(r, az, node(r), tuple(range(limits.MAX_GPU_INDEX - gpus + 1, limits.MAX_GPU_INDEX + 1)),
                                       tuple(f"{i:0{limits.MAX_NIC_NAME_LEN}d}" for i in range(nics))) for r in range(members))
    g = GangRecord(id="g" * 54 + "-12345678", spec=spec, state=GangState.RESERVED, owner_az=az, submitted_at=1.7e9,
                   updated_at=1.7e9, reason="é" * limits.MAX_REASON_CHARS, placement=placement,
                   idempotency_key="k" * limits.MAX_IDEMPOTENCY_KEY_LEN, restarts=100, incarnation=101)
    r = Reservation(az=az, gang=g.id, incarnation=101, state=HoldState.COMMITTED,
                    nodes={m.node: NodeDevices(m.gpus, m.nics) for m in placement}, epoch=2**40)
    return len(encode(g.to_dict())) + len(encode(r.to_dict()))


@pytest.mark.parametrize("gpus,nics", [(1, 0), (8, 0), (8, 8), (72, 32)])
def test_the_bound_is_an_upper_bound_and_the_largest_legal_gang_fits_etcd(gpus: int, nics: int) -> None:
    most = limits.max_members_of_shape(gpus, nics, 200)
    real = worst_txn_bytes(most, gpus, nics)
    assert real <= limits.reservation_txn_bound(most, gpus, nics, 200) <= limits.MAX_RESERVATION_TXN_BYTES
    # ... with room under etcd's request limit for keys, compares and framing.
    assert limits.MAX_RESERVATION_TXN_BYTES + 200 * 1024 <= limits.ETCD_MAX_REQUEST_BYTES


def test_a_gang_too_large_to_reserve_in_one_write_is_refused_with_its_shape_limit() -> None:
    most = limits.max_members_of_shape(8, 8, 150)
    assert 1000 < most < 4096
    errs = errors_of(spec_data(members=4096, resources={"gpus": 8, "rdma_nics": 8}))
    assert "at most" in errs["members"] and "more than the limit of 1310720 bytes" in errs["members"]
    parse_spec(spec_data(members=4096, resources={"gpus": 1}))  # the largest count, with a small shape


def test_a_stored_spec_is_not_refused_for_its_shape() -> None:
    """A record accepted before the whole-gang bound existed still reads."""
    data = spec_data(members=4096, resources={"gpus": 8, "rdma_nics": 8})
    assert parse_spec(data, stored=True).members == 4096


def test_reasons_are_clipped_when_stored() -> None:
    long = "x" * 100_000
    clipped = limits.clip(long)
    assert len(clipped) <= limits.MAX_REASON_CHARS and clipped.endswith("more characters)")
    assert limits.clip("short") == "short"
    rec = NodeRecord(topology=simulated_node("n0", "az-a"), ready=False, reason=long)
    assert len(rec.to_dict()["reason"]) <= limits.MAX_REASON_CHARS


# --- node topology ----------------------------------------------------------------


def test_real_shapes_pass_the_topology_bounds() -> None:
    shapes = [simulated_node("n0", "az-a"), simulated_node("nvl", "az-a", gpus=72, nics=32, nvlink_domain="d1"),
              *simulated_fabric("az-a", 4, 2, 2, nodes_per_nvlink_domain=2)]
    for t in shapes:
        assert limits.topology_errors(t) == [], t.node
        assert limits.json_bytes(NodeRecord(topology=t, ready=True).to_dict()) <= limits.MAX_NODE_RECORD_BYTES


@pytest.mark.parametrize("change,words", [
    (lambda t: dataclasses.replace(t, gpus=tuple(Gpu(i) for i in range(4000))), "gpus: 4000 entries, more than the limit of 128"),
    (lambda t: dataclasses.replace(t, nics=tuple(Nic(f"n{i}") for i in range(65))), "nics: 65 entries"),
    (lambda t: dataclasses.replace(t, nics=(Nic("x" * 33),)), "nics[0].name: must be at most 32"),
    (lambda t: dataclasses.replace(t, nics=(Nic("a"), Nic("a"))), "listed twice"),
    (lambda t: dataclasses.replace(t, gpus=(Gpu(0), Gpu(0))), "GPU 0 is listed twice"),
    (lambda t: dataclasses.replace(t, gpus=(Gpu(-1),)), "gpus[0].index: must be between 0 and 1023"),
    (lambda t: dataclasses.replace(t, gpus=(Gpu(0, model="H" * 100),)), "gpus[0].model"),
    (lambda t: dataclasses.replace(t, labels={f"k{i}": "v" for i in range(65)}), "labels: 65 entries"),
    (lambda t: dataclasses.replace(t, labels={"k": "v" * 64}), "labels[k]"),
    (lambda t: dataclasses.replace(t, leaf="a/b"), "leaf"),
    (lambda t: dataclasses.replace(t, sources=("x",) * 17), "sources: 17 entries"),
])
def test_topology_past_a_bound_is_named(change, words: str) -> None:
    errors = limits.topology_errors(change(simulated_node("n0", "az-a")))
    assert any(words in e for e in errors), errors


def test_topology_within_counts_but_over_the_record_size_is_refused() -> None:
    t = simulated_node("n0", "az-a", gpus=128, nics=64, islands=1)  # every GPU peers with 127: a large record
    t = dataclasses.replace(t, links=t.links[: limits.MAX_LINKS_PER_NODE])
    size = limits.json_bytes(t.to_dict())
    errors = limits.topology_errors(t)
    if size > limits.MAX_NODE_RECORD_BYTES - 4096:
        assert errors and f"{size} bytes" in errors[-1]
    else:
        assert errors == []


# --- reading records back -------------------------------------------------------------


def test_unreadable_records_are_skipped_and_named() -> None:
    good = GangRecord(id="a-00000001", spec=parse_spec(spec_data()), state=GangState.PENDING, owner_az="az-a",
                      submitted_at=1.0, updated_at=1.0)
    kvs = [KV(k, v, 1, 1, 1, 0) for k, v in [
        ("g/a", encode(good.to_dict())), ("g/b", b"{nope"), ("g/c", b"[]"), ("g/d", json.dumps({"id": "x"}).encode()),
        ("g/e", encode({**good.to_dict(), "state": "EXPLODED"})),
        ("g/f", encode({**good.to_dict(), "spec": {**good.spec.to_dict(), "run": {"command": [""] * 450_000}}})),
    ]]
    read, bad = read_records(kvs, GangRecord.from_dict)
    assert [g.id for g in read] == ["a-00000001"]
    assert [k for k, _ in bad] == ["g/b", "g/c", "g/d", "g/e", "g/f"]
    assert all(why for _, why in bad)
