"""The gang spec a submitter writes (DESIGN §4): parsing and validation.

Pure: the same validation runs in the CLI (before anything is sent) and in the
coordinator (the authority; a client can send anything). Every error names the
field by its dotted path and says why, and all errors of a spec are reported at
once.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from phalanx.model import Level

# A gang id is "<name>-<8 hex>", and must itself stay a DNS label (63 chars).
MAX_NAME_LEN = 53
MAX_MEMBERS = 4096
MAX_GPUS_PER_MEMBER = 72  # one GB200 NVL72 domain
MAX_NICS_PER_MEMBER = 32
MAX_RESTARTS = 100
MAX_PRIORITY = 1_000_000
# The gang record must fit comfortably in one etcd value (1.5 MiB request cap).
MAX_RUN_BYTES = 64 * 1024
DEFAULT_DURATION_S = 10.0
DEFAULT_ADMISSION_TIMEOUT_S = 600.0
DEFAULT_MAX_RESTARTS = 3
DEFAULT_START_TIMEOUT_S = 300.0

_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class FieldError:
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


class InvalidSpec(ValueError):
    """A gang spec failed validation; ``errors`` names every bad field."""

    def __init__(self, errors: list[FieldError]):
        self.errors = list(errors)
        super().__init__("invalid gang spec: " + "; ".join(str(e) for e in self.errors))


@dataclass(frozen=True)
class Resources:
    gpus: int = 1
    gpu_model: str = ""
    rdma_nics: int = 0


@dataclass(frozen=True)
class Topology:
    required: Level | None = None
    preferred: Level | None = None
    allow_cross_az: bool = False

    @property
    def may_span_azs(self) -> bool:
        return self.allow_cross_az or self.required == Level.REGION


@dataclass(frozen=True)
class Run:
    command: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    duration_s: float = DEFAULT_DURATION_S


@dataclass(frozen=True)
class Policy:
    admission_timeout_s: float = DEFAULT_ADMISSION_TIMEOUT_S
    max_restarts: int = DEFAULT_MAX_RESTARTS
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S


@dataclass(frozen=True)
class GangSpec:
    name: str
    members: int
    resources: Resources = Resources()
    queue: str = "default"
    priority: int = 0
    topology: Topology = Topology()
    run: Run = Run()
    policy: Policy = Policy()

    @property
    def total_gpus(self) -> int:
        return self.members * self.resources.gpus

    def to_dict(self) -> dict[str, Any]:
        """The YAML/JSON form; ``parse_spec(spec.to_dict()) == spec``."""
        topo: dict[str, Any] = {"allow_cross_az": self.topology.allow_cross_az}
        if self.topology.required is not None:
            topo["required"] = self.topology.required.label
        if self.topology.preferred is not None:
            topo["preferred"] = self.topology.preferred.label
        return {
            "name": self.name,
            "queue": self.queue,
            "priority": self.priority,
            "members": self.members,
            "resources": dataclasses.asdict(self.resources),
            "topology": topo,
            "run": {
                "command": list(self.run.command),
                "env": dict(self.run.env),
                "duration_s": self.run.duration_s,
            },
            "policy": dataclasses.asdict(self.policy),
        }


# --- parsing --------------------------------------------------------------

_SECTIONS: dict[str, set[str]] = {
    "": {"name", "queue", "priority", "members", "resources", "topology", "run", "policy"},
    "resources": {"gpus", "gpu_model", "rdma_nics"},
    "topology": {"required", "preferred", "allow_cross_az"},
    "run": {"command", "env", "duration_s"},
    "policy": {"admission_timeout_s", "max_restarts", "start_timeout_s"},
}


class _Checker:
    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def fail(self, path: str, reason: str) -> None:
        self.errors.append(FieldError(path, reason))

    def section(self, data: Any, path: str) -> Mapping[str, Any]:
        if data is None:
            return {}
        if not isinstance(data, Mapping):
            self.fail(path or "spec", f"must be a mapping, got {type(data).__name__}")
            return {}
        allowed = _SECTIONS[path]
        for key in data:
            if key not in allowed:
                where = f"{path}.{key}" if path else str(key)
                self.fail(where, "unknown field; allowed: " + ", ".join(sorted(allowed)))
        return data

    def integer(self, data: Mapping[str, Any], key: str, path: str, default: int, lo: int, hi: int) -> int:
        value = data.get(key, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"must be an integer, got {value!r}")
            return default
        if not lo <= value <= hi:
            self.fail(path, f"must be between {lo} and {hi}, got {value}")
        return value

    def number(self, data: Mapping[str, Any], key: str, path: str, default: float, lo: float, hi: float, *, strict_lo: bool = False) -> float:
        value = data.get(key, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(path, f"must be a number, got {value!r}")
            return default
        if value != value or (value <= lo if strict_lo else value < lo) or value > hi:
            bound = f"greater than {lo}" if strict_lo else f"at least {lo}"
            self.fail(path, f"must be {bound} and at most {hi}, got {value}")
        return float(value)

    def string(self, data: Mapping[str, Any], key: str, path: str, default: str) -> str:
        value = data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, str):
            self.fail(path, f"must be a string, got {value!r}")
            return default
        return value

    def dns_label(self, value: str, path: str, max_len: int) -> None:
        if not value:
            self.fail(path, "is required")
        elif len(value) > max_len:
            self.fail(path, f"must be at most {max_len} characters, got {len(value)}")
        elif not _DNS_LABEL.match(value):
            self.fail(path, f"must be a DNS label (lowercase letters, digits, '-'), got {value!r}")

    def level(self, data: Mapping[str, Any], key: str, path: str) -> Level | None:
        value = data.get(key)
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            self.fail(path, f"must be a topology level name, got {value!r}")
            return None
        try:
            return Level.parse(value)
        except ValueError as exc:
            self.fail(path, str(exc))
            return None


def parse_spec(data: Any) -> GangSpec:
    """Validate a spec given as plain data (parsed YAML/JSON). Raises InvalidSpec."""
    c = _Checker()
    top = c.section(data, "")
    if not isinstance(data, Mapping):
        if not c.errors:  # None (an empty document) passes section() silently
            c.fail("spec", "is empty; expected a mapping with at least name, members and resources.gpus")
        raise InvalidSpec(c.errors)

    name = c.string(top, "name", "name", "")
    c.dns_label(name, "name", MAX_NAME_LEN)
    queue = c.string(top, "queue", "queue", "default") or "default"
    c.dns_label(queue, "queue", 63)
    priority = c.integer(top, "priority", "priority", 0, -MAX_PRIORITY, MAX_PRIORITY)
    if "members" not in top:
        c.fail("members", "is required")
    members = c.integer(top, "members", "members", 1, 1, MAX_MEMBERS)

    res = c.section(top.get("resources"), "resources")
    if "gpus" not in res:
        c.fail("resources.gpus", "is required")
    gpus = c.integer(res, "gpus", "resources.gpus", 1, 1, MAX_GPUS_PER_MEMBER)
    gpu_model = c.string(res, "gpu_model", "resources.gpu_model", "")
    rdma_nics = c.integer(res, "rdma_nics", "resources.rdma_nics", 0, 0, MAX_NICS_PER_MEMBER)

    topo = c.section(top.get("topology"), "topology")
    required = c.level(topo, "required", "topology.required")
    preferred = c.level(topo, "preferred", "topology.preferred")
    allow_cross_az = topo.get("allow_cross_az", False)
    if allow_cross_az is None:
        allow_cross_az = False
    if not isinstance(allow_cross_az, bool):
        c.fail("topology.allow_cross_az", f"must be true or false, got {allow_cross_az!r}")
        allow_cross_az = False
    if required is not None and preferred is not None and preferred > required:
        c.fail(
            "topology.preferred",
            f"must be at or below the required level ({required.label}), got {preferred.label}",
        )
    if required == Level.REGION and "allow_cross_az" in topo and allow_cross_az is False:
        c.fail("topology.allow_cross_az", "cannot be false when topology.required is region")

    run = c.section(top.get("run"), "run")
    command_raw = run.get("command", [])
    command: tuple[str, ...] = ()
    if command_raw is None:
        command_raw = []
    if isinstance(command_raw, str) or not isinstance(command_raw, (list, tuple)):
        c.fail("run.command", f"must be a list of strings, got {command_raw!r}")
    else:
        for i, arg in enumerate(command_raw):
            if not isinstance(arg, str):
                c.fail(f"run.command[{i}]", f"must be a string, got {arg!r}")
        command = tuple(a for a in command_raw if isinstance(a, str))
    env_raw = run.get("env", {})
    env: dict[str, str] = {}
    if env_raw is None:
        env_raw = {}
    if not isinstance(env_raw, Mapping):
        c.fail("run.env", f"must be a mapping of names to strings, got {env_raw!r}")
    else:
        for k, v in env_raw.items():
            if not isinstance(k, str) or not _ENV_NAME.match(k):
                c.fail(f"run.env.{k}", "is not a valid environment variable name")
            elif isinstance(v, bool) or not isinstance(v, (str, int, float)):
                c.fail(f"run.env.{k}", f"must be a string, got {v!r}")
            else:
                env[k] = str(v)
    size = sum(len(a.encode()) for a in command) + sum(len(k.encode()) + len(v.encode()) for k, v in env.items())
    if size > MAX_RUN_BYTES:
        c.fail("run", f"command and env total {size} bytes, more than the limit of {MAX_RUN_BYTES}")
    duration_s = c.number(run, "duration_s", "run.duration_s", DEFAULT_DURATION_S, 0.0, 7 * 24 * 3600.0)

    pol = c.section(top.get("policy"), "policy")
    admission_timeout_s = c.number(
        pol, "admission_timeout_s", "policy.admission_timeout_s", DEFAULT_ADMISSION_TIMEOUT_S, 0.0, 30 * 24 * 3600.0, strict_lo=True
    )
    max_restarts = c.integer(pol, "max_restarts", "policy.max_restarts", DEFAULT_MAX_RESTARTS, 0, MAX_RESTARTS)
    start_timeout_s = c.number(
        pol, "start_timeout_s", "policy.start_timeout_s", DEFAULT_START_TIMEOUT_S, 0.0, 24 * 3600.0, strict_lo=True
    )

    if c.errors:
        raise InvalidSpec(c.errors)
    return GangSpec(
        name=name,
        queue=queue,
        priority=priority,
        members=members,
        resources=Resources(gpus=gpus, gpu_model=gpu_model, rdma_nics=rdma_nics),
        topology=Topology(
            required=required,
            preferred=preferred,
            allow_cross_az=allow_cross_az or required == Level.REGION,
        ),
        run=Run(command=command, env=env, duration_s=duration_s),
        policy=Policy(admission_timeout_s=admission_timeout_s, max_restarts=max_restarts, start_timeout_s=start_timeout_s),
    )


def load_spec(text: str) -> GangSpec:
    """Parse a YAML (or JSON) gang spec document."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidSpec([FieldError("spec", f"not valid YAML: {exc}")]) from None
    return parse_spec(data)
