"""Every identifier is matched exactly, against one documented alphabet
(docs/limits.md "Identifiers"): trailing newlines, NULs, Unicode look-alikes,
path separators and the like are refused in every identifier field."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest

from agent.topology.simulated import simulated_node
from coordinator.service import _valid_id
from phalanx import limits
from phalanx.errors import InvalidArgument
from phalanx.spec import InvalidSpec, parse_spec
from phalanx.v1 import agent_pb2 as apb

HOSTILE = {
    "trailing newline": "abc\n",
    "trailing CRLF": "abc\r\n",
    "leading newline": "\nabc",
    "NUL": "ab\x00c",
    "trailing NUL": "abc\x00",
    "tab": "ab\tc",
    "slash": "a/b",
    "dot-dot path": "../abc",
    "backslash": "a\\b",
    "Cyrillic a look-alike": "\u0430bc",
    "fullwidth letters": "\uff41\uff42\uff43",
    "right-to-left override": "abc\u202e",
    "zero-width space": "ab\u200bc",
    "non-breaking space": "ab\u00a0c",
    "space": "a b",
    "DEL": "abc\x7f",
}


def spec_with(field: str, value: str) -> dict[str, Any]:
    d: dict[str, Any] = {"name": "ok", "members": 1, "resources": {"gpus": 1}}
    if field == "name":
        d["name"] = value
    elif field == "queue":
        d["queue"] = value
    elif field == "run.env":
        d["run"] = {"env": {value: "x"}}
    elif field == "resources.gpu_model":
        d["resources"]["gpu_model"] = value
    return d


@pytest.mark.parametrize("what", sorted(HOSTILE))
@pytest.mark.parametrize("field", ["name", "queue", "run.env", "resources.gpu_model"])
def test_spec_identifiers_refuse_hostile_strings(field: str, what: str) -> None:
    value = HOSTILE[what]
    if field == "resources.gpu_model" and what in ("space", "slash") :
        pytest.skip("a GPU model is free text within printable ASCII: spaces are allowed, '/' is not")
    with pytest.raises(InvalidSpec) as info:
        parse_spec(spec_with(field, value))
    fields = [e.field for e in info.value.errors]
    assert any(f == field or f.startswith(field + ".") for f in fields), (field, what, fields)


def test_gpu_model_with_a_slash_is_refused_and_a_space_accepted() -> None:
    with pytest.raises(InvalidSpec):
        parse_spec(spec_with("resources.gpu_model", "a/b"))
    assert parse_spec(spec_with("resources.gpu_model", "NVIDIA H100 80GB HBM3")).resources.gpu_model == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_gang_ids_at_the_api_refuse_hostile_strings(what: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        _valid_id(HOSTILE[what])
    assert str(info.value).startswith("id: ")


def test_a_valid_id_and_name_pass_exactly() -> None:
    assert _valid_id("llama-pretrain-1a2b3c4d") == "llama-pretrain-1a2b3c4d"
    assert _valid_id("llama-pretrain") == "llama-pretrain"
    for bad in ("llama-pretrain\n", "Llama", "-x", "x-", "x" * 64):
        with pytest.raises(InvalidArgument):
            _valid_id(bad)


TOPOLOGY_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "node": lambda t, v: dataclasses.replace(t, node=v),
    "az": lambda t, v: dataclasses.replace(t, az=v),
    "spine": lambda t, v: dataclasses.replace(t, spine=v),
    "leaf": lambda t, v: dataclasses.replace(t, leaf=v),
    "rack": lambda t, v: dataclasses.replace(t, rack=v),
    "nvlink_domain": lambda t, v: dataclasses.replace(t, nvlink_domain=v),
    "labels": lambda t, v: dataclasses.replace(t, labels={v: "x"}),
    "labels[k]": lambda t, v: dataclasses.replace(t, labels={"k": v}),
    "nics[0].name": lambda t, v: dataclasses.replace(t, nics=(dataclasses.replace(t.nics[0], name=v),) + t.nics[1:]),
}


@pytest.mark.parametrize("what", sorted(HOSTILE))
@pytest.mark.parametrize("field", sorted(TOPOLOGY_FIELDS))
def test_node_identifiers_at_registration_refuse_hostile_strings(field: str, what: str) -> None:
    value = HOSTILE[what]
    if field == "labels" and what == "slash":
        pytest.skip("a label key has one '/' after its DNS prefix (nvidia.com/gpu.product)")
    if field == "nics[0].name" and what == "space":
        value = "a b\n"  # a NIC name is a printable token: inner spaces are not identifiers' business
    t = TOPOLOGY_FIELDS[field](simulated_node("n0", "az-a"), value)
    errors = limits.registration_errors(t, "agent-1", [])
    assert any(e.startswith(f"register.topology.{field}") for e in errors), (field, what, errors)


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_member_reports_and_agent_ids_refuse_hostile_strings(what: str) -> None:
    value = HOSTILE[what]
    m = apb.MemberStatus(gang=value, incarnation=1, rank=0, phase=1)
    assert any(e.startswith("register.members[0].gang") for e in limits.registration_errors(simulated_node("n0", "az-a"), "a", [m]))
    if what not in ("space",):
        assert any(e.startswith("register.agent_id") for e in limits.registration_errors(simulated_node("n0", "az-a"), value, []))


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_idempotency_keys_refuse_hostile_strings(what: str) -> None:
    assert limits.name_error(HOSTILE[what], limits.IDEMPOTENCY_KEY, limits.MAX_IDEMPOTENCY_KEY_LEN,
                             limits.IDEMPOTENCY_KEY_WHAT) is not None
    assert limits.name_error("0b6f0e0e-3f1c-4a57-9d5e-0c1b2a3d4e5f", limits.IDEMPOTENCY_KEY, limits.MAX_IDEMPOTENCY_KEY_LEN,
                             limits.IDEMPOTENCY_KEY_WHAT) is None


def test_full_match_is_not_search() -> None:
    """The bug of `$`: re.match(r"^x$", "x\\n") matches. name_error uses fullmatch."""
    import re

    assert re.match(r"^[a-z]+$", "abc\n") is not None  # what the old check accepted
    assert limits.name_error("abc\n", limits.DNS_LABEL, 63, "a DNS label") is not None
    assert limits.name_error("abc", limits.DNS_LABEL, 63, "a DNS label") is None
