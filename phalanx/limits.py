"""Every bound on what may reach etcd, and every identifier alphabet, in one table.

docs/limits.md prints this table with the arithmetic behind it. Pure: no I/O.
The spec validation (``phalanx.spec``), the coordinator's servicers
(``coordinator.service``, ``coordinator.agents``) and the record types
(``coordinator.core.records``) all check against these names, so a bound
changes in one place.

Sizes of free text are counted as the bytes the value takes in its stored
JSON record (``json.dumps`` with ASCII escapes, as ``phalanx.store.encode``
writes it): an empty string still costs its quotes and comma, and a control
character or a non-ASCII one costs its ``\\uXXXX`` escape. That is what etcd
has to store and send, so that is what is bounded.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Mapping

# --- etcd's own limits (defaults of etcd 3.5) --------------------------------

# --max-request-bytes: the largest put or txn etcd accepts.
ETCD_MAX_REQUEST_BYTES = 1536 * 1024
# Our client's receive limit (phalanx.store: grpc.max_receive_message_length):
# the largest range reply a coordinator can read in one call.
RANGE_REPLY_BYTES = 8 * 1024 * 1024
# --quota-backend-bytes: etcd raises its NOSPACE alarm and refuses every
# write once its database file reaches it (etcd's default, 2 GiB).
ETCD_DEFAULT_QUOTA_BYTES = 2 * 1024**3

# --- identifiers: one alphabet each, matched with re.fullmatch ----------------

# A DNS label (RFC 1123): gang names, queues, gang ids. Lowercase only, so a
# name cannot have a look-alike that differs in case.
DNS_LABEL = r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?"
MAX_GANG_NAME_LEN = 53  # + "-<8 hex>" keeps the id a DNS label (63)
MAX_GANG_ID_LEN = 63
MAX_QUEUE_LEN = 63
# Node names: a host name as `hostname` prints it (letters of either case,
# digits, '.', '_', '-'; no '/', it is a key path segment).
NODE_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
MAX_NODE_NAME_LEN = 63
# Environment variable names (POSIX portable).
ENV_KEY = r"[A-Za-z_][A-Za-z0-9_]*"
MAX_ENV_KEY_LEN = 256
# Kubernetes label keys: an optional DNS-subdomain prefix and '/', then a name.
LABEL_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
LABEL_KEY = r"(?:[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?/)?" + LABEL_NAME
MAX_LABEL_KEY_LEN = 253 + 1 + 63
# Label values and the network location names a node reports (region, AZ,
# spine, leaf, rack, NVLink domain): "" or a label name.
LABEL_VALUE = r"(?:" + LABEL_NAME + r")?"
MAX_LABEL_VALUE_LEN = 63
# Idempotency keys (a UUID, a job name with a counter, base64 without '/').
IDEMPOTENCY_KEY = r"[A-Za-z0-9._:+=@-]+"
MAX_IDEMPOTENCY_KEY_LEN = 128
# Agent ids, GPU UUIDs and models, PCI bus ids, NIC names and the like: short
# printable ASCII without '/' (no control characters, nothing that renders
# differently from what it is).
TOKEN = r"[!-.0-\[\]-~](?:[ -.0-\[\]-~]*[!-.0-\[\]-~])?"  # printable ASCII but '/' and '\\', no edge spaces
MAX_AGENT_ID_LEN = 128
MAX_TOKEN_LEN = 64
MAX_NIC_NAME_LEN = 32

_COMPILED: dict[str, re.Pattern[str]] = {}


def _rx(pattern: str) -> re.Pattern[str]:
    rx = _COMPILED.get(pattern)
    if rx is None:
        rx = _COMPILED[pattern] = re.compile(pattern)
    return rx


def name_error(value: Any, pattern: str, max_len: int, what: str, *, required: bool = True) -> str | None:
    """Why ``value`` is not a valid identifier (``None`` if it is). Full-match
    semantics: a trailing newline, a NUL or a look-alike letter is refused."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value:
        return "is required" if required else None
    if len(value) > max_len:
        return f"must be at most {max_len} characters, got {len(value)}"
    if _rx(pattern).fullmatch(value) is None:
        return f"must be {what}, got {value!r}"
    return None


DNS_LABEL_WHAT = "a DNS label (lowercase letters a-z, digits, '-' inside)"
NODE_NAME_WHAT = "a node name (letters, digits, '.', '_', '-' inside; no '/')"
ENV_KEY_WHAT = "an environment variable name (letters, digits, '_'; not starting with a digit)"
LABEL_KEY_WHAT = "a label key ([dns-prefix/]name of letters, digits, '.', '_', '-')"
LABEL_VALUE_WHAT = "a label value (letters, digits, '.', '_', '-' inside)"
IDEMPOTENCY_KEY_WHAT = "letters, digits and . _ : + = @ -"
TOKEN_WHAT = "printable ASCII without '/', '\\' or control characters"

# --- gang spec -------------------------------------------------------------

MAX_MEMBERS = 4096
MAX_GPUS_PER_MEMBER = 72  # one GB200 NVL72 domain
MAX_NICS_PER_MEMBER = 32
MAX_GPU_MODEL_LEN = MAX_TOKEN_LEN
MAX_COMMAND_ARGS = 4096
MAX_ENV_VARS = 1024
# run.command and run.env together, as stored (JSON bytes).
MAX_RUN_BYTES = 64 * 1024
# The whole spec as stored in the gang record (JSON bytes): run plus the rest.
MAX_STORED_SPEC_BYTES = MAX_RUN_BYTES + 8 * 1024

# --- free text ---------------------------------------------------------------

MAX_CANCEL_REASON_BYTES = 1024  # UTF-8 bytes of CancelGangRequest.reason
# A record's `reason` (written by a leader from its own words, a cancel
# reason or an agent's exit report) is clipped to this many characters when
# the record is written: at most 6 JSON bytes each.
MAX_REASON_CHARS = 2048
MAX_MEMBER_REASON_BYTES = 1024  # an agent's member report, at registration
# A gang's event history (coordinator/core/events.py), stored in its record:
# at most this many events and this many JSON bytes together (the oldest are
# dropped first, behind one "N earlier events dropped" marker), each message
# clipped to MAX_EVENT_MESSAGE_CHARS (at most 6 JSON bytes each, so even the
# worst event is a fraction of the list bound).
MAX_GANG_EVENTS = 64
MAX_GANG_EVENTS_BYTES = 16 * 1024
MAX_EVENT_MESSAGE_CHARS = 512

# --- node topology (nodes/<az>/<node>) ----------------------------------------

MAX_GPUS_PER_NODE = 128
MAX_NICS_PER_NODE = 64
MAX_LINKS_PER_NODE = 4096  # GPU<->NIC pairs reported (72 GPUs x 32 NICs = 2304)
MAX_LABELS_PER_NODE = 64
MAX_SOURCES_PER_NODE = 16
MAX_GPU_INDEX = 1023
MAX_MEMBERS_PER_REGISTRATION = 1024
# The whole node record as stored. A real 8-GPU, 8-NIC node is ~6 KiB.
MAX_NODE_RECORD_BYTES = 256 * 1024

# --- whole records and writes -------------------------------------------------

# The txn that reserves a gang writes its gang record (spec + placement) and
# its reservation record (node -> devices) together: both must fit one etcd
# request with room for compares, keys and framing.
MAX_RESERVATION_TXN_BYTES = 1280 * 1024
# No gang record can be larger than that txn.
MAX_GANG_RECORD_BYTES = MAX_RESERVATION_TXN_BYTES
# Fixed part of a gang record besides spec, placement and reason (id,
# state, owner AZ, timestamps, counters, idempotency key, JSON keys).
GANG_RECORD_FIXED_BYTES = 1024
MAX_AZ_NAME_LEN = 63
# leader/<az> ({"id", "address"}, phalanx.leader_record): a coordinator id
# and a host:port are far shorter; a larger record is refused on read.
MAX_LEADER_RECORD_BYTES = 1024

# --- paged reads ---------------------------------------------------------------

# Keys per range call of a paged read (phalanx.store.Store.get_prefix_paged).
# A page that would exceed RANGE_REPLY_BYTES is read again at half the size,
# down to one key (every record is far below RANGE_REPLY_BYTES).
PAGE_KEYS = 512


def json_bytes(value: Any) -> int:
    """Bytes ``value`` takes in a stored record (phalanx.store.encode)."""
    return len(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


def list_bytes(items: Iterable[Any]) -> int:
    """JSON bytes of a list: every element's bytes plus its comma, so an
    empty string still costs 3 bytes."""
    return json_bytes(list(items))


def map_bytes(items: Mapping[str, Any]) -> int:
    return json_bytes(dict(items))


def _max_member_json(gpus: int, nics: int) -> tuple[int, int]:
    """JSON bytes of the largest placement entry and reservation node entry of
    a member with ``gpus`` GPUs and ``nics`` NICs (names at their maximum,
    indices at their widest)."""
    node = "n" * MAX_NODE_NAME_LEN
    member = {
        "rank": MAX_MEMBERS - 1,
        "az": "a" * MAX_AZ_NAME_LEN,
        "node": node,
        "gpus": [MAX_GPU_INDEX] * gpus,
        "nics": ["x" * MAX_NIC_NAME_LEN] * nics,
    }
    entry = {node: {"gpus": [MAX_GPU_INDEX] * gpus, "nics": ["x" * MAX_NIC_NAME_LEN] * nics}}
    return json_bytes([member]) - 1, json_bytes(entry) - 1  # "[...]"/"{...}" -> one element and its comma


def reservation_txn_bound(members: int, gpus: int, nics: int, spec_bytes: int) -> int:
    """An upper bound on the bytes of the reservation txn of a gang of this
    shape: its gang record (fixed part, spec, clipped reason, a full event
    list, placement of every member) plus its reservation record (one node
    entry per member at worst), with every name at its maximum length."""
    per_member, per_node = _max_member_json(gpus, nics)
    reason = 6 * MAX_REASON_CHARS + 2
    events = MAX_GANG_EVENTS_BYTES + len('"events":,')
    return (GANG_RECORD_FIXED_BYTES + spec_bytes + reason + events + members * (per_member + per_node)
            + GANG_RECORD_FIXED_BYTES)


def max_members_of_shape(gpus: int, nics: int, spec_bytes: int) -> int:
    """The most members a gang of this shape may have (see reservation_txn_bound)."""
    per_member, per_node = _max_member_json(gpus, nics)
    fixed = reservation_txn_bound(0, gpus, nics, spec_bytes)
    return max(0, min(MAX_MEMBERS, (MAX_RESERVATION_TXN_BYTES - fixed) // (per_member + per_node)))


def clip(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying that it was cut."""
    if len(text) <= limit:
        return text
    keep = limit - 40  # room for the marker (at most 40 characters)
    return text[:keep] + f"... ({len(text) - keep} more characters)"


def size_error(field_: str, size: int, limit: int, unit: str = "bytes") -> str:
    """The one wording of an oversized field: the field, the limit, the size."""
    return f"{field_}: {size} {unit}, more than the limit of {limit} {unit}"


# --- node topology -------------------------------------------------------------


def topology_errors(t: Any, *, prefix: str = "register.topology") -> list[str]:
    """Every bound a node's topology (``phalanx.topology.NodeTopology``)
    breaks, each as "field: why"; empty when it may be stored. Checked when
    an agent registers, before anything is written: a topology past a bound
    is a permanent error (the same agent sends the same topology again)."""
    out: list[str] = []

    def name(path: str, value: Any, pattern: str, max_len: int, what: str, required: bool = False) -> None:
        why = name_error(value, pattern, max_len, what, required=required)
        if why:
            out.append(f"{prefix}.{path}: {why}")

    def count(path: str, items: Any, limit: int) -> bool:
        if len(items) > limit:
            out.append(f"{prefix}.{path}: {len(items)} entries, more than the limit of {limit}")
            return False
        return True

    name("node", t.node, NODE_NAME, MAX_NODE_NAME_LEN, NODE_NAME_WHAT, required=True)
    name("az", t.az, LABEL_VALUE, MAX_AZ_NAME_LEN, LABEL_VALUE_WHAT)
    for f in ("region", "spine", "leaf", "rack", "nvlink_domain"):
        name(f, getattr(t, f), LABEL_VALUE, MAX_LABEL_VALUE_LEN, LABEL_VALUE_WHAT)
    if count("gpus", t.gpus, MAX_GPUS_PER_NODE):
        seen: set[int] = set()
        for i, g in enumerate(t.gpus):
            if not 0 <= g.index <= MAX_GPU_INDEX:
                out.append(f"{prefix}.gpus[{i}].index: must be between 0 and {MAX_GPU_INDEX}, got {g.index}")
            elif g.index in seen:
                out.append(f"{prefix}.gpus[{i}].index: GPU {g.index} is listed twice")
            seen.add(g.index)
            for f in ("uuid", "model", "pci_bus_id", "pcie_switch"):
                name(f"gpus[{i}].{f}", getattr(g, f), TOKEN, MAX_TOKEN_LEN, TOKEN_WHAT)
            count(f"gpus[{i}].nvlink_peers", g.nvlink_peers, MAX_GPUS_PER_NODE)
            if len(out) > 20:
                break  # enough to say what is wrong
    if count("nics", t.nics, MAX_NICS_PER_NODE):
        names: set[str] = set()
        for i, n in enumerate(t.nics):
            name(f"nics[{i}].name", n.name, TOKEN, MAX_NIC_NAME_LEN, TOKEN_WHAT, required=True)
            if n.name in names:
                out.append(f"{prefix}.nics[{i}].name: NIC {n.name!r} is listed twice")
            names.add(n.name)
            for f in ("pci_bus_id", "pcie_switch", "link_layer", "state"):
                name(f"nics[{i}].{f}", getattr(n, f), TOKEN, MAX_TOKEN_LEN, TOKEN_WHAT)
            if len(out) > 20:
                break
    count("links", t.links, MAX_LINKS_PER_NODE)
    if count("labels", t.labels, MAX_LABELS_PER_NODE):
        for k, v in t.labels.items():
            why = name_error(k, LABEL_KEY, MAX_LABEL_KEY_LEN, LABEL_KEY_WHAT)
            if why:
                out.append(f"{prefix}.labels: key {why}")
                continue
            why = name_error(v, LABEL_VALUE, MAX_LABEL_VALUE_LEN, LABEL_VALUE_WHAT, required=False)
            if why:
                out.append(f"{prefix}.labels[{k}]: {why}")
    if count("sources", t.sources, MAX_SOURCES_PER_NODE):
        for i, s in enumerate(t.sources):
            name(f"sources[{i}]", s, TOKEN, MAX_TOKEN_LEN, TOKEN_WHAT)
    if not out:
        size = json_bytes(t.to_dict())
        if size > MAX_NODE_RECORD_BYTES - 4096:  # room for the record's other fields
            out.append(size_error(prefix, size, MAX_NODE_RECORD_BYTES - 4096))
    return out


def member_errors(m: Any, path: str) -> list[str]:
    """Bounds of one member report an agent sends (``MemberStatus``)."""
    from phalanx.model import MemberPhase

    out = []
    why = name_error(m.gang, DNS_LABEL, MAX_GANG_ID_LEN, DNS_LABEL_WHAT)
    if why:
        out.append(f"{path}.gang: {why}")
    if m.incarnation < 0:
        out.append(f"{path}.incarnation: must not be negative, got {m.incarnation}")
    if not 0 <= m.rank < MAX_MEMBERS:
        out.append(f"{path}.rank: must be between 0 and {MAX_MEMBERS - 1}, got {m.rank}")
    try:
        MemberPhase(m.phase)
    except ValueError:
        out.append(f"{path}.phase: unknown member phase {m.phase}")
    size = len(m.reason.encode("utf-8", "surrogatepass"))
    if size > MAX_MEMBER_REASON_BYTES:
        out.append(size_error(f"{path}.reason", size, MAX_MEMBER_REASON_BYTES))
    if len(m.gpus) > MAX_GPUS_PER_NODE:
        out.append(f"{path}.gpus: {len(m.gpus)} entries, more than the limit of {MAX_GPUS_PER_NODE}")
    return out


def registration_errors(topology: Any, agent_id: str, members: Any) -> list[str]:
    """Everything wrong with an agent's Register message, before anything
    of it is written (an empty list: it may be accepted)."""
    out = topology_errors(topology)
    why = name_error(agent_id, TOKEN, MAX_AGENT_ID_LEN, TOKEN_WHAT, required=False)
    if why:
        out.append(f"register.agent_id: {why}")
    if len(members) > MAX_MEMBERS_PER_REGISTRATION:
        out.append(f"register.members: {len(members)} entries, more than the limit of {MAX_MEMBERS_PER_REGISTRATION}")
    else:
        for i, m in enumerate(members):
            out.extend(member_errors(m, f"register.members[{i}]"))
            if len(out) > 20:
                break
    return out

# One ListGangs reply holds at most this many bytes of gangs (then a
# next_page_token), well under gRPC's default 4 MiB receive limit, so a list
# is never refused for size however many or large the gangs are. A single
# gang always fits: its record is bounded far below this (docs/limits.md).
LIST_REPLY_BYTES = 2 * 1024 * 1024
