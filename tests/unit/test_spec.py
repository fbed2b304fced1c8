"""Gang spec validation (phalanx.spec) and its wire form (phalanx.wire).

Tables with a builder: every case starts from one valid spec and changes one
thing, so a failure reads as "this change must be reported on that field".
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from phalanx.model import Level
from phalanx.spec import (
    DEFAULT_ADMISSION_TIMEOUT_S,
    DEFAULT_DURATION_S,
    DEFAULT_MAX_RESTARTS,
    MAX_NAME_LEN,
    MAX_RUN_BYTES,
    GangSpec,
    InvalidSpec,
    load_spec,
    parse_spec,
)
from phalanx.v1 import types_pb2 as pb
from phalanx.wire import spec_from_pb, spec_to_pb

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

_DELETE = object()


def base() -> dict[str, Any]:
    """A valid spec using every section."""
    return {
        "name": "llama-pretrain",
        "queue": "default",
        "priority": 5,
        "members": 4,
        "resources": {"gpus": 8, "gpu_model": "H100", "rdma_nics": 8},
        "topology": {"required": "spine", "preferred": "leaf", "allow_cross_az": False},
        "run": {"command": ["python", "train.py"], "env": {"KEY": "value"}, "duration_s": 30},
        "policy": {"admission_timeout_s": 600, "max_restarts": 3},
    }


def with_(path: str, value: Any, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base()`` with the dotted ``path`` set to ``value`` (or removed)."""
    data = copy.deepcopy(base() if data is None else data)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return data


def fields_of(exc: InvalidSpec) -> list[str]:
    return [e.field for e in exc.errors]


# (id, spec, field that must be named, words the reason must contain)
INVALID: list[tuple[str, Any, str, str]] = [
    # members
    ("members-negative", with_("members", -3), "members", "between 1"),
    ("members-zero", with_("members", 0), "members", "between 1"),
    ("members-too-many", with_("members", 4097), "members", "between 1 and 4096"),
    ("members-missing", with_("members", _DELETE), "members", "required"),
    ("members-bool-is-not-int", with_("members", True), "members", "integer"),
    ("members-string", with_("members", "4"), "members", "integer"),
    ("members-float", with_("members", 4.0), "members", "integer"),
    # resources
    ("gpus-zero", with_("resources.gpus", 0), "resources.gpus", "between 1"),
    ("gpus-negative", with_("resources.gpus", -1), "resources.gpus", "between 1"),
    ("gpus-above-nvl72", with_("resources.gpus", 73), "resources.gpus", "between 1 and 72"),
    ("gpus-missing", with_("resources.gpus", _DELETE), "resources.gpus", "required"),
    ("gpus-bool", with_("resources.gpus", False), "resources.gpus", "integer"),
    ("resources-missing", with_("resources", _DELETE), "resources.gpus", "required"),
    ("resources-not-mapping", with_("resources", [8]), "resources", "mapping"),
    ("rdma-nics-negative", with_("resources.rdma_nics", -1), "resources.rdma_nics", "between 0"),
    ("rdma-nics-too-many", with_("resources.rdma_nics", 33), "resources.rdma_nics", "between 0 and 32"),
    ("gpu-model-not-string", with_("resources.gpu_model", 100), "resources.gpu_model", "string"),
    # unknown fields, at every level
    ("unknown-top-level", with_("replicas", 3), "replicas", "unknown field"),
    ("unknown-in-resources", with_("resources.cpus", 4), "resources.cpus", "unknown field"),
    ("unknown-in-topology", with_("topology.zone", "a"), "topology.zone", "unknown field"),
    ("unknown-in-run", with_("run.args", ["x"]), "run.args", "unknown field"),
    ("unknown-in-policy", with_("policy.retries", 1), "policy.retries", "unknown field"),
    # name and queue
    ("name-missing", with_("name", _DELETE), "name", "required"),
    ("name-empty", with_("name", ""), "name", "required"),
    ("name-too-long", with_("name", "a" * (MAX_NAME_LEN + 1)), "name", f"at most {MAX_NAME_LEN}"),
    ("name-uppercase", with_("name", "Llama"), "name", "DNS label"),
    ("name-underscore", with_("name", "llama_7b"), "name", "DNS label"),
    ("name-leading-dash", with_("name", "-llama"), "name", "DNS label"),
    ("name-trailing-dash", with_("name", "llama-"), "name", "DNS label"),
    ("name-dot", with_("name", "llama.7b"), "name", "DNS label"),
    ("name-not-string", with_("name", 7), "name", "string"),
    ("queue-bad-label", with_("queue", "Batch Jobs"), "queue", "DNS label"),
    ("queue-too-long", with_("queue", "q" * 64), "queue", "at most 63"),
    # priority
    ("priority-too-high", with_("priority", 1_000_001), "priority", "between"),
    ("priority-too-low", with_("priority", -1_000_001), "priority", "between"),
    ("priority-bool", with_("priority", True), "priority", "integer"),
    # topology
    ("required-unknown-level", with_("topology.required", "rack"), "topology.required", "unknown topology level"),
    ("preferred-unknown-level", with_("topology.preferred", "rail"), "topology.preferred", "unknown topology level"),
    ("required-not-a-name", with_("topology.required", 3), "topology.required", "topology level name"),
    ("preferred-above-required", with_("topology.preferred", "az"), "topology.preferred", "at or below"),
    (
        "region-with-cross-az-false",
        with_("topology", {"required": "region", "allow_cross_az": False}),
        "topology.allow_cross_az",
        "cannot be false",
    ),
    ("cross-az-string", with_("topology.allow_cross_az", "yes"), "topology.allow_cross_az", "true or false"),
    ("cross-az-int", with_("topology.allow_cross_az", 1), "topology.allow_cross_az", "true or false"),
    ("topology-not-mapping", with_("topology", "spine"), "topology", "mapping"),
    # run
    ("command-string", with_("run.command", "python train.py"), "run.command", "list of strings"),
    ("command-item-not-string", with_("run.command", ["python", 3]), "run.command[1]", "string"),
    ("env-name-leading-digit", with_("run.env", {"1BAD": "x"}), "run.env.1BAD", "environment variable name"),
    ("env-name-dash", with_("run.env", {"A-B": "x"}), "run.env.A-B", "environment variable name"),
    ("env-value-bool", with_("run.env", {"DEBUG": True}), "run.env.DEBUG", "string"),
    ("env-value-list", with_("run.env", {"HOSTS": ["a"]}), "run.env.HOSTS", "string"),
    ("env-not-mapping", with_("run.env", ["A=B"]), "run.env", "mapping"),
    ("run-oversized-command", with_("run.command", ["x" * (MAX_RUN_BYTES + 1)]), "run", "limit"),
    (
        "run-oversized-env",
        with_("run.env", {f"V{i}": "y" * 1024 for i in range(MAX_RUN_BYTES // 1024 + 1)}),
        "run",
        "limit",
    ),
    ("duration-negative", with_("run.duration_s", -1), "run.duration_s", "at least 0"),
    ("duration-nan", with_("run.duration_s", math.nan), "run.duration_s", "at least"),
    ("duration-infinite", with_("run.duration_s", math.inf), "run.duration_s", "at most"),
    ("duration-string", with_("run.duration_s", "30s"), "run.duration_s", "number"),
    ("duration-bool", with_("run.duration_s", True), "run.duration_s", "number"),
    ("run-not-mapping", with_("run", ["python"]), "run", "mapping"),
    # policy
    ("admission-timeout-zero", with_("policy.admission_timeout_s", 0), "policy.admission_timeout_s", "greater than 0"),
    ("admission-timeout-negative", with_("policy.admission_timeout_s", -5), "policy.admission_timeout_s", "greater than 0"),
    ("max-restarts-negative", with_("policy.max_restarts", -1), "policy.max_restarts", "between 0"),
    ("max-restarts-too-many", with_("policy.max_restarts", 101), "policy.max_restarts", "between 0 and 100"),
    ("max-restarts-bool", with_("policy.max_restarts", True), "policy.max_restarts", "integer"),
    ("policy-not-mapping", with_("policy", 3), "policy", "mapping"),
    # the document itself
    ("spec-is-list", [base()], "spec", "mapping"),
    ("spec-is-string", "name: x", "spec", "mapping"),
    ("spec-is-none", None, "spec", "empty"),
]


@pytest.mark.parametrize("data, field, words", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_spec_names_the_field(data: Any, field: str, words: str) -> None:
    with pytest.raises(InvalidSpec) as info:
        parse_spec(data)
    exc = info.value
    assert field in fields_of(exc), f"{field} not in {fields_of(exc)}"
    reason = next(e.reason for e in exc.errors if e.field == field)
    assert words.lower() in reason.lower(), reason
    # The message a user sees carries the field too.
    assert field in str(exc)
    assert isinstance(exc, ValueError)


def test_every_error_is_reported_at_once() -> None:
    data = with_("members", -1, with_("resources.gpus", 0, with_("policy.retries", 2, with_("name", "BAD"))))
    with pytest.raises(InvalidSpec) as info:
        parse_spec(data)
    assert set(fields_of(info.value)) >= {"members", "resources.gpus", "policy.retries", "name"}


# (id, spec, check on the parsed GangSpec)
VALID: list[tuple[str, dict[str, Any], Any]] = [
    ("base", base(), lambda s: s.total_gpus == 32),
    ("name-at-max-length", with_("name", "a" * MAX_NAME_LEN), lambda s: len(s.name) == MAX_NAME_LEN),
    ("name-single-char", with_("name", "a"), lambda s: s.name == "a"),
    ("name-with-digits-and-dashes", with_("name", "llama-7b-v2"), lambda s: s.name == "llama-7b-v2"),
    ("preferred-equal-required", with_("topology.preferred", "spine"), lambda s: s.topology.preferred == Level.SPINE),
    ("preferred-nvlink-domain", with_("topology.preferred", "nvlink_domain"), lambda s: s.topology.preferred == Level.NVLINK_DOMAIN),
    ("level-case-insensitive", with_("topology.required", "Spine"), lambda s: s.topology.required == Level.SPINE),
    ("empty-level-is-none", with_("topology.required", ""), lambda s: s.topology.required is None),
    (
        "region-implies-cross-az",
        with_("topology", {"required": "region"}),
        lambda s: s.topology.allow_cross_az and s.topology.may_span_azs,
    ),
    (
        "region-with-cross-az-true",
        with_("topology", {"required": "region", "allow_cross_az": True}),
        lambda s: s.topology.allow_cross_az,
    ),
    ("cross-az-allowed", with_("topology", {"allow_cross_az": True}), lambda s: s.topology.may_span_azs),
    ("az-not-cross-az", with_("topology", {"required": "az"}), lambda s: not s.topology.may_span_azs),
    ("env-number-becomes-string", with_("run.env", {"PORT": 8080, "RATIO": 0.5}), lambda s: dict(s.run.env) == {"PORT": "8080", "RATIO": "0.5"}),
    ("env-underscore-name", with_("run.env", {"_PRIVATE_1": "x"}), lambda s: "_PRIVATE_1" in s.run.env),
    ("duration-int-becomes-float", with_("run.duration_s", 7), lambda s: s.run.duration_s == 7.0 and isinstance(s.run.duration_s, float)),
    ("duration-zero", with_("run.duration_s", 0), lambda s: s.run.duration_s == 0.0),
    ("max-restarts-zero", with_("policy.max_restarts", 0), lambda s: s.policy.max_restarts == 0),
    ("priority-negative", with_("priority", -10), lambda s: s.priority == -10),
    # (4096 one-GPU members: the largest shape whose reservation write fits, docs/limits.md)
    ("members-max", with_("members", 4096, with_("resources", {"gpus": 1})), lambda s: s.members == 4096),
    ("gpus-nvl72", with_("resources.gpus", 72), lambda s: s.resources.gpus == 72),
    ("null-sections-are-defaults", with_("run", None, with_("policy", None, with_("topology", None))), lambda s: s.topology.required is None and s.policy.max_restarts == DEFAULT_MAX_RESTARTS),
    ("null-values-are-defaults", with_("queue", None, with_("priority", None)), lambda s: s.queue == "default" and s.priority == 0),
    ("run-just-under-limit", with_("run.command", ["x" * (MAX_RUN_BYTES - 16)], with_("run.env", {})), lambda s: len(s.run.command[0]) == MAX_RUN_BYTES - 16),
]


@pytest.mark.parametrize("data, check", [c[1:] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_spec(data: dict[str, Any], check: Any) -> None:
    spec = parse_spec(data)
    assert check(spec)


def test_defaults_of_a_minimal_spec() -> None:
    spec = parse_spec({"name": "tiny", "members": 8, "resources": {"gpus": 1}})
    assert spec == GangSpec(name="tiny", members=8)
    assert spec.queue == "default"
    assert spec.priority == 0
    assert (spec.resources.gpus, spec.resources.gpu_model, spec.resources.rdma_nics) == (1, "", 0)
    assert spec.topology.required is None and spec.topology.preferred is None
    assert spec.topology.allow_cross_az is False and not spec.topology.may_span_azs
    assert spec.run.command == () and dict(spec.run.env) == {}
    assert spec.run.duration_s == DEFAULT_DURATION_S
    assert spec.policy.admission_timeout_s == DEFAULT_ADMISSION_TIMEOUT_S
    assert spec.policy.max_restarts == DEFAULT_MAX_RESTARTS


ROUND_TRIP = [c for c in VALID if c[0] != "run-just-under-limit"] + [
    ("minimal", {"name": "tiny", "members": 1, "resources": {"gpus": 1}}, None),
]


@pytest.mark.parametrize("data", [c[1] for c in ROUND_TRIP], ids=[c[0] for c in ROUND_TRIP])
def test_to_dict_round_trip(data: dict[str, Any]) -> None:
    spec = parse_spec(data)
    assert parse_spec(spec.to_dict()) == spec
    # ... and through YAML text, as `phalanx submit --dry-run` prints it.
    assert load_spec(yaml.safe_dump(spec.to_dict())) == spec


def test_load_spec_reports_bad_yaml_on_spec() -> None:
    with pytest.raises(InvalidSpec) as info:
        load_spec("name: [unclosed")
    assert fields_of(info.value) == ["spec"]
    assert "YAML" in str(info.value)


def test_load_spec_empty_document_names_spec() -> None:
    # Regression: an empty file raised InvalidSpec with no error at all.
    with pytest.raises(InvalidSpec) as info:
        load_spec("")
    assert fields_of(info.value) == ["spec"]


def test_load_spec_accepts_json() -> None:
    assert load_spec('{"name": "j", "members": 2, "resources": {"gpus": 4}}').total_gpus == 8


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    spec = load_spec(path.read_text())
    assert spec.name == path.stem


def test_examples_cover_the_documented_shapes() -> None:
    specs = {p.stem: load_spec(p.read_text()) for p in EXAMPLES.glob("*.yaml")}
    assert (specs["tiny"].members, specs["tiny"].resources.gpus) == (8, 1)
    llama = specs["llama-pretrain"]
    assert (llama.members, llama.resources.gpus) == (4, 8)
    assert (llama.topology.required, llama.topology.preferred) == (Level.SPINE, Level.LEAF)
    assert specs["cross-az"].topology.allow_cross_az
    assert specs["real-command"].run.command


# --- wire form -----------------------------------------------------------------------

WIRE_ROUND_TRIP = [c for c in ROUND_TRIP if c[0] != "duration-zero"]


@pytest.mark.parametrize("data", [c[1] for c in WIRE_ROUND_TRIP], ids=[c[0] for c in WIRE_ROUND_TRIP])
def test_wire_round_trip(data: dict[str, Any]) -> None:
    spec = parse_spec(data)
    msg = spec_to_pb(spec)
    assert spec_from_pb(msg) == spec
    # The bytes on the wire too, not only the message object.
    again = pb.GangSpec()
    again.ParseFromString(msg.SerializeToString())
    assert spec_from_pb(again) == spec


def test_wire_round_trip_zero_duration() -> None:
    spec = parse_spec(with_("run.duration_s", 0))
    assert spec_from_pb(spec_to_pb(spec)) == spec


def valid_pb() -> pb.GangSpec:
    return spec_to_pb(parse_spec(base()))


def _set(msg: pb.GangSpec, path: str, value: Any) -> pb.GangSpec:
    *parents, last = path.split(".")
    node: Any = msg
    for key in parents:
        node = getattr(node, key)
    setattr(node, last, value)
    return msg


WIRE_INVALID: list[tuple[str, str, Any, str]] = [
    ("members-negative", "members", -3, "members"),
    ("members-zero", "members", 0, "members"),
    ("gpus-zero", "resources.gpus", 0, "resources.gpus"),
    ("gpus-negative", "resources.gpus", -8, "resources.gpus"),
    ("rdma-negative", "resources.rdma_nics", -1, "resources.rdma_nics"),
    ("name-empty", "name", "", "name"),
    ("name-uppercase", "name", "Llama", "name"),
    ("queue-bad", "queue", "a b", "queue"),
    ("priority-too-high", "priority", 2_000_000, "priority"),
    ("required-unknown-enum", "topology.required", 42, "topology.required"),
    ("preferred-unknown-enum", "topology.preferred", 99, "topology.preferred"),
    ("preferred-above-required", "topology.preferred", int(Level.REGION), "topology.preferred"),
    ("admission-negative", "policy.admission_timeout_s", -1.0, "policy.admission_timeout_s"),
    ("max-restarts-negative", "policy.max_restarts", -1, "policy.max_restarts"),
    ("duration-negative", "run.duration_s", -2.0, "run.duration_s"),
]


@pytest.mark.parametrize("path, value, field", [c[1:] for c in WIRE_INVALID], ids=[c[0] for c in WIRE_INVALID])
def test_wire_errors_name_the_field(path: str, value: Any, field: str) -> None:
    msg = _set(valid_pb(), path, value)
    with pytest.raises(InvalidSpec) as info:
        spec_from_pb(msg)
    assert field in fields_of(info.value), fields_of(info.value)


def test_wire_bad_env_name_is_named() -> None:
    msg = valid_pb()
    msg.run.env["BAD-NAME"] = "x"
    with pytest.raises(InvalidSpec) as info:
        spec_from_pb(msg)
    assert "run.env.BAD-NAME" in fields_of(info.value)


def test_wire_reports_every_error() -> None:
    msg = valid_pb()
    msg.members = -3
    msg.topology.required = 42
    with pytest.raises(InvalidSpec) as info:
        spec_from_pb(msg)
    assert {"members", "topology.required"} <= set(fields_of(info.value))


def test_wire_unset_numbers_take_defaults() -> None:
    msg = pb.GangSpec(name="bare", members=2, resources=pb.Resources(gpus=1))
    spec = spec_from_pb(msg)
    assert spec.queue == "default"
    assert spec.run.duration_s == DEFAULT_DURATION_S
    assert spec.policy.admission_timeout_s == DEFAULT_ADMISSION_TIMEOUT_S
    assert spec.policy.max_restarts == DEFAULT_MAX_RESTARTS


def test_wire_explicit_policy_keeps_zero_restarts() -> None:
    msg = pb.GangSpec(name="bare", members=2, resources=pb.Resources(gpus=1), policy=pb.Policy(max_restarts=0))
    assert spec_from_pb(msg).policy.max_restarts == 0


def test_wire_region_carries_cross_az() -> None:
    spec = parse_spec(with_("topology", {"required": "region"}))
    msg = spec_to_pb(spec)
    assert msg.topology.allow_cross_az is True
    assert spec_from_pb(msg).topology.may_span_azs
