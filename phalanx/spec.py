"""The gang spec a submitter writes (docs/design.md §6.1): parsing and validation.

Pure: the same validation runs in the CLI (before anything is sent) and in the
coordinator (the authority; a client can send anything). Every error names the
field by its dotted path and says why, and all errors of a spec are reported at
once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Mapping

from phalanx import limits, strict_docs
from phalanx.model import Level

# The bounds live in phalanx.limits (one table, docs/limits.md); these names
# stay for the callers that import them from here.
MAX_NAME_LEN = limits.MAX_GANG_NAME_LEN
MAX_MEMBERS = limits.MAX_MEMBERS
MAX_GPUS_PER_MEMBER = limits.MAX_GPUS_PER_MEMBER
MAX_NICS_PER_MEMBER = limits.MAX_NICS_PER_MEMBER
MAX_RESTARTS = 100
MAX_PRIORITY = 1_000_000
MAX_RUN_BYTES = limits.MAX_RUN_BYTES
# A spec document (file, stdin or SDK text) is refused past this size before
# it is parsed: the largest legal spec (MAX_RUN_BYTES of run plus a few
# hundred bytes of fields) is far below it, even as verbose YAML.
MAX_SPEC_BYTES = 256 * 1024
# Mapping/sequence nesting cap while parsing (phalanx.strict_docs).
MAX_SPEC_DEPTH = strict_docs.MAX_DOC_DEPTH
DEFAULT_DURATION_S = 10.0
DEFAULT_ADMISSION_TIMEOUT_S = 600.0
DEFAULT_MAX_RESTARTS = 3
DEFAULT_START_TIMEOUT_S = 300.0



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
        listed = False
        for key in data:
            if key not in allowed:
                where = f"{path}.{key}" if path else str(key)
                # The allowed fields once per section, not once per unknown field.
                self.fail(where, "unknown field" if listed else "unknown field; allowed: " + ", ".join(sorted(allowed)))
                listed = True
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
        else:
            why = limits.name_error(value, limits.DNS_LABEL, max_len, limits.DNS_LABEL_WHAT)
            if why:
                self.fail(path, why)

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


def parse_spec(data: Any, *, stored: bool = False) -> GangSpec:
    """Validate a spec given as plain data (parsed YAML/JSON). Raises InvalidSpec.

    ``stored``: the spec of a record read back from etcd. It was accepted
    once, so the bound on the whole gang's reservation write (which depends
    on its shape, and which a spec accepted before that bound existed may
    exceed) is not applied again; every per-field bound is."""
    c = _Checker()
    if isinstance(data, Mapping) and isinstance(data.get("spec"), Mapping) and "name" not in data:
        # A whole gang as `phalanx get -o yaml` prints it: one error, not one per field.
        raise InvalidSpec([FieldError("spec", "this is a whole gang (id, spec, state, ...) as `phalanx get -o yaml` "
                                      "prints it; submit only its `spec:` part, unindented")])
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
    why = limits.name_error(gpu_model, limits.TOKEN, limits.MAX_GPU_MODEL_LEN, limits.TOKEN_WHAT, required=False)
    if why:
        c.fail("resources.gpu_model", why)
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
    elif len(command_raw) > limits.MAX_COMMAND_ARGS:
        c.fail("run.command", f"{len(command_raw)} arguments, more than the limit of {limits.MAX_COMMAND_ARGS}")
    else:
        for i, arg in enumerate(command_raw):
            if not isinstance(arg, str):
                c.fail(f"run.command[{i}]", f"must be a string, got {arg!r:.64}")
            elif "\0" in arg:
                # execve() cannot pass it: the member would never start.
                c.fail(f"run.command[{i}]", "must not contain a NUL character")
        command = tuple(a for a in command_raw if isinstance(a, str))
    env_raw = run.get("env", {})
    env: dict[str, str] = {}
    if env_raw is None:
        env_raw = {}
    if not isinstance(env_raw, Mapping):
        c.fail("run.env", f"must be a mapping of names to strings, got {env_raw!r:.64}")
    elif len(env_raw) > limits.MAX_ENV_VARS:
        c.fail("run.env", f"{len(env_raw)} variables, more than the limit of {limits.MAX_ENV_VARS}")
    else:
        for k, v in env_raw.items():
            why = limits.name_error(k, limits.ENV_KEY, limits.MAX_ENV_KEY_LEN, limits.ENV_KEY_WHAT)
            if why:
                plain = isinstance(k, str) and k.isascii() and k.isprintable() and len(k) <= 80
                c.fail(f"run.env.{k}" if plain else f"run.env.{k!r:.80}", why)
            elif isinstance(v, bool) or not isinstance(v, (str, int, float)):
                c.fail(f"run.env.{k}", f"must be a string, got {v!r:.64}")
            elif "\0" in str(v):
                c.fail(f"run.env.{k}", "must not contain a NUL character")
            else:
                env[k] = str(v)
    # Counted as stored: every argument and variable costs its JSON-escaped
    # bytes plus quotes and separators, so 450,000 empty arguments are 1.3 MB,
    # not 0 bytes.
    size = limits.list_bytes(command) + limits.map_bytes(env)
    if size > MAX_RUN_BYTES:
        c.fail("run", f"command and env take {size} bytes as stored, more than the limit of {MAX_RUN_BYTES} bytes")
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
    spec = GangSpec(
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
    _check_whole(spec, stored)
    return spec


def _check_whole(spec: GangSpec, stored: bool) -> None:
    """Bounds on the spec as a whole (docs/limits.md): its stored size, and
    the reservation write its shape can need (gang record with the placement
    of every member, plus the reservation record) against etcd's request
    limit."""
    spec_bytes = limits.json_bytes(spec.to_dict())
    if spec_bytes > limits.MAX_STORED_SPEC_BYTES:
        raise InvalidSpec([FieldError("spec", f"takes {spec_bytes} bytes as stored, more than the limit of "
                                              f"{limits.MAX_STORED_SPEC_BYTES} bytes")])
    if stored:
        return
    bound = limits.reservation_txn_bound(spec.members, spec.resources.gpus, spec.resources.rdma_nics, spec_bytes)
    if bound > limits.MAX_RESERVATION_TXN_BYTES:
        most = limits.max_members_of_shape(spec.resources.gpus, spec.resources.rdma_nics, spec_bytes)
        raise InvalidSpec([FieldError(
            "members",
            f"{spec.members} members of {spec.resources.gpus} GPUs and {spec.resources.rdma_nics} RDMA NICs can need "
            f"{bound} bytes in the write that reserves them, more than the limit of "
            f"{limits.MAX_RESERVATION_TXN_BYTES} bytes; at most {most} members of this shape")])


def load_spec(text: str) -> GangSpec:
    """Parse a YAML (or JSON) gang spec document: at most MAX_SPEC_BYTES, no
    aliases, no duplicate keys (``phalanx.strict_docs``)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise InvalidSpec([FieldError("spec", f"is {size} bytes, more than the limit of {MAX_SPEC_BYTES}")])
    try:
        data = strict_docs.load_yaml(text)
    except strict_docs.DocumentError as exc:
        raise InvalidSpec([FieldError("spec", str(exc))]) from None
    return parse_spec(data)


def read_spec_bytes(stream: BinaryIO, what: str) -> str:
    """Read a spec document from ``stream`` (a file or stdin), at most
    MAX_SPEC_BYTES: a device such as /dev/zero or /dev/urandom ends with an
    error at the limit instead of filling memory. Raises InvalidSpec."""
    data = stream.read(MAX_SPEC_BYTES + 1)
    if data is None:
        data = b""
    if len(data) > MAX_SPEC_BYTES:
        raise InvalidSpec([FieldError("spec", f"{what} is larger than the limit of {MAX_SPEC_BYTES} bytes")])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidSpec([FieldError("spec", f"{what} is not UTF-8 text (byte {exc.start})")]) from None
