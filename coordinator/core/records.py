"""Durable records as frozen dataclasses, parsed once per read (docs/style.md §3).

The JSON shapes stored in etcd (docs/etcd-keys.md). Pure: no I/O. The
reservation record, which the agent reads too, is phalanx/reservation.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Mapping

from coordinator.core import events as gang_events
from coordinator.core.events import GangEvent
from coordinator.core.progress import MemberReport
from coordinator.core.ordering import GangOrderKey, gang_order_key
from phalanx.ports import DEFAULT_PORTS
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx import limits
from phalanx.model import GangState, Level, MemberPhase
from phalanx.spec import GangSpec, parse_spec
from phalanx.topology import NodeTopology


@dataclass(frozen=True)
class MemberAssignment:
    rank: int
    az: str
    node: str
    gpus: tuple[int, ...]
    nics: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "az": self.az, "node": self.node, "gpus": list(self.gpus), "nics": list(self.nics)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MemberAssignment":
        return cls(int(d["rank"]), d["az"], d["node"], tuple(d.get("gpus", ())), tuple(d.get("nics", ())))


@dataclass(frozen=True)
class GangRecord:
    """``gangs/<id>``, written by the owner AZ's leader."""

    id: str
    spec: GangSpec
    state: GangState
    owner_az: str
    submitted_at: float  # wall clock of first submission; ordering key, kept across retries
    updated_at: float
    incarnation: int = 1
    reason: str = ""
    placement: tuple[MemberAssignment, ...] = ()
    span: Level | None = None
    restarts: int = 0
    idempotency_key: str = ""
    not_before: float = 0.0  # restart backoff: not placed before this wall time
    # The rendezvous of this incarnation (coordinator/core/rendezvous.py):
    # the rank-0 node's advertised address and the port picked from its
    # range, fixed when the placement is written so that every dispatch
    # (re-sent, by a successor, by another AZ) gives every member the same.
    master_addr: str = ""
    master_port: int = 0
    # Who submitted it, "<role>/<name>" from the client certificate
    # (coordinator/core/authz.py); "" when submitted without TLS.
    owner: str = ""
    # What happened to it, oldest first, bounded (coordinator/core/events.py).
    # Records written before events existed have none.
    events: tuple[GangEvent, ...] = ()
    mod_revision: int = 0  # from the read; not stored

    @property
    def order_key(self) -> GangOrderKey:
        """Admission order, the same as the cross-AZ conflict order
        (coordinator/core/ordering.py): higher priority first, then older first."""
        return gang_order_key(self.spec.priority, self.submitted_at, self.id)

    def evolve(self, **changes: Any) -> "GangRecord":
        return dataclasses.replace(self, **changes)

    def with_events(self, new: Iterable[GangEvent]) -> "GangRecord":
        """This record with ``new`` appended to its bounded event list."""
        new = list(new)
        return dataclasses.replace(self, events=gang_events.append(self.events, new)) if new else self

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "spec": self.spec.to_dict(),
            "state": self.state.name,
            "owner_az": self.owner_az,
            "submitted_at": self.submitted_at,
            "updated_at": self.updated_at,
            "incarnation": self.incarnation,
            # Clipped: a reason quotes a cancel reason or an agent's exit
            # report, and the record has a bound (docs/limits.md).
            "reason": limits.clip(self.reason),
            "placement": [m.to_dict() for m in self.placement],
            "span": self.span.label if self.span else "",
            "restarts": self.restarts,
            "idempotency_key": self.idempotency_key,
            "not_before": self.not_before,
            **({"master_addr": self.master_addr, "master_port": self.master_port} if self.master_port else {}),
            # Absent without TLS, so a plaintext cluster's records are as before.
            **({"owner": self.owner} if self.owner else {}),
            **({"events": gang_events.to_json(self.events)} if self.events else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], mod_revision: int = 0) -> "GangRecord":
        return cls(
            id=d["id"],
            spec=parse_spec(d["spec"], stored=True),
            state=GangState[d["state"]],
            owner_az=d["owner_az"],
            submitted_at=float(d["submitted_at"]),
            updated_at=float(d.get("updated_at", d["submitted_at"])),
            incarnation=int(d.get("incarnation", 1)),
            reason=d.get("reason", ""),
            placement=tuple(MemberAssignment.from_dict(m) for m in d.get("placement", ())),
            span=Level.parse(d["span"]) if d.get("span") else None,
            restarts=int(d.get("restarts", 0)),
            idempotency_key=d.get("idempotency_key", ""),
            not_before=float(d.get("not_before", 0.0)),
            master_addr=str(d.get("master_addr", "")),
            master_port=int(d.get("master_port", 0)),
            owner=str(d.get("owner", "")),
            events=gang_events.from_json(d.get("events")),
            mod_revision=mod_revision,
        )


@dataclass(frozen=True)
class NodeRecord:
    """``nodes/<az>/<node>``, written by the AZ leader from agent registrations."""

    topology: NodeTopology
    ready: bool
    agent_id: str = ""
    last_heartbeat: float = 0.0  # wall clock of its registration (the live one is the leader's, docs/design.md D17)
    reason: str = ""
    mod_revision: int = 0
    # What the agent advertised (absent in records of older agents): the
    # address members on other nodes reach this node at ("" = unknown: the
    # node name is used), and the ports it owns for rendezvous.
    address: str = ""
    ports: tuple[int, int] = DEFAULT_PORTS
    # Node lifecycle (docs/nodes.md): an admin cordoned it (nothing new is
    # placed on it; what runs there stays), or its agent was not heard for
    # node_expire_after_s (left out of placement and never-fits until it
    # registers again). Written by the leader, fenced.
    cordoned: bool = False
    expired: bool = False

    @property
    def name(self) -> str:
        return self.topology.node

    def to_dict(self) -> dict[str, Any]:
        return {
            "topology": self.topology.to_dict(),
            "ready": self.ready,
            "agent_id": self.agent_id,
            "last_heartbeat": self.last_heartbeat,
            "reason": limits.clip(self.reason),
            "address": self.address,
            "ports": list(self.ports),
            "cordoned": self.cordoned,
            "expired": self.expired,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], mod_revision: int = 0) -> "NodeRecord":
        return cls(
            topology=NodeTopology.from_dict(d["topology"]),
            ready=bool(d.get("ready", False)),
            agent_id=d.get("agent_id", ""),
            last_heartbeat=float(d.get("last_heartbeat", 0.0)),
            reason=d.get("reason", ""),
            mod_revision=mod_revision,
            address=str(d.get("address", "")),
            ports=tuple(int(p) for p in d["ports"]) if len(d.get("ports") or ()) == 2 else DEFAULT_PORTS,  # type: ignore[arg-type]
            cordoned=d.get("cordoned", False) is True,
            expired=d.get("expired", False) is True,
        )


@dataclass
class DeviceLedger:
    """Devices held per node in one AZ, rebuilt from reservations. The AZ
    leader's authoritative in-memory view (docs/design.md §7.2)."""

    held: dict[str, dict[str, NodeDevices]] = field(default_factory=dict)  # node -> gang -> devices

    @classmethod
    def from_reservations(cls, reservations: Mapping[str, Reservation]) -> "DeviceLedger":
        ledger = cls()
        for r in reservations.values():
            ledger.hold(r)
        return ledger

    def hold(self, r: Reservation) -> None:
        for node, dev in r.nodes.items():
            self.held.setdefault(node, {})[r.gang] = dev

    def slices(self) -> list[dict[str, NodeDevices]]:
        """Each (node, gang) hold as a one-node slice (capacity.held)."""
        return [{node: dev} for node, gangs in self.held.items() for dev in gangs.values()]

    def release(self, gang: str) -> None:
        for node in list(self.held):
            self.held[node].pop(gang, None)
            if not self.held[node]:
                del self.held[node]

    def used_gpus(self, node: str) -> frozenset[int]:
        return frozenset(g for dev in self.held.get(node, {}).values() for g in dev.gpus)

    def used_nics(self, node: str) -> frozenset[str]:
        return frozenset(n for dev in self.held.get(node, {}).values() for n in dev.nics)

    def conflicts(self) -> list[str]:
        """Invariant: no GPU held by two gangs. Returns violations (empty = ok)."""
        out = []
        for node, gangs in self.held.items():
            seen: dict[int, str] = {}
            for gang, dev in sorted(gangs.items()):
                for g in dev.gpus:
                    if g in seen:
                        out.append(f"{node} gpu {g} held by {seen[g]} and {gang}")
                    seen[g] = gang
        return out


# --- small records: names, idempotency keys, member summaries -----------------


class BadRecord(ValueError):
    """A record that cannot be read; the message names the record and the
    field. A ValueError, so ``read_records`` counts it as unreadable."""


def expect_object(d: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise BadRecord(f"{what}: not a JSON object ({type(d).__name__})")
    return d


def expect_field(d: Mapping[str, Any], name: str, what: str) -> Any:
    if name not in d:
        raise BadRecord(f"{what}: field {name!r} is missing")
    return d[name]


def expect_str(v: Any, name: str, what: str) -> str:
    if not isinstance(v, str):
        raise BadRecord(f"{what}: field {name!r}: expected a string, got {type(v).__name__}")
    return v


def expect_int(v: Any, name: str, what: str) -> int:
    # bool is an int in Python, never in a record we write.
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRecord(f"{what}: field {name!r}: expected an integer, got {type(v).__name__}")
    return v


@dataclass(frozen=True)
class GangPointer:
    """A record whose whole content is the id of the gang that wrote it
    (``{"id": ...}``). The two keys of that shape are the subclasses."""

    id: str
    what: ClassVar[str] = "gang pointer"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id}

    @classmethod
    def from_dict(cls, d: Any) -> "GangPointer":
        """The one parser. Raises BadRecord naming the field."""
        d = expect_object(d, cls.what)
        gang = expect_str(expect_field(d, "id", cls.what), "id", cls.what)
        if not gang:
            raise BadRecord(f"{cls.what}: field 'id' is empty")
        return cls(gang)


@dataclass(frozen=True)
class NameRecord(GangPointer):
    """``names/<name>``: the live gang of that name (created with the gang,
    deleted when it ends), so a name is unique among live gangs."""

    what: ClassVar[str] = "name record"


@dataclass(frozen=True)
class IdempotencyRecord(GangPointer):
    """``idempotency/<key>``: the gang a submission with this key created
    (deleted with the gang record by retention, only while it names it)."""

    what: ClassVar[str] = "idempotency record"


@dataclass(frozen=True)
class MemberSummary:
    """``members/<gang>/<az>``: what one participant AZ's members of a
    cross-AZ gang's incarnation report, written by that AZ's leader and read
    by the owner's driver (its run-time view of the gang) and by the writer
    itself after a takeover. The gang is the key's, not stored."""

    incarnation: int
    az: str
    # (rank, report), ranks ascending: a tuple so that two summaries of the
    # same reports compare equal (the writer skips a write of what it wrote).
    members: tuple[tuple[int, MemberReport], ...] = ()

    what: ClassVar[str] = "member summary"

    @classmethod
    def of(cls, incarnation: int, az: str, reports: Mapping[int, MemberReport]) -> "MemberSummary":
        return cls(incarnation, az, tuple(sorted(reports.items())))

    def reports(self) -> dict[int, MemberReport]:
        return dict(self.members)

    def to_dict(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "az": self.az, "members": {
            str(r): {"phase": int(p.phase), "exit_code": p.exit_code, "reason": p.reason, "node": p.node}
            for r, p in self.members}}

    @classmethod
    def from_dict(cls, d: Any) -> "MemberSummary":
        """The one parser. Raises BadRecord naming the field (a member's as
        ``members.<rank>.<field>``)."""
        w = cls.what
        d = expect_object(d, w)
        members = d.get("members", {})
        if not isinstance(members, Mapping):
            raise BadRecord(f"{w}: field 'members': expected a JSON object, got {type(members).__name__}")
        reports: dict[int, MemberReport] = {}
        for rank, m in members.items():
            where = f"members.{str(rank)[:16]}"
            if not (isinstance(rank, str) and rank.isdecimal()):
                raise BadRecord(f"{w}: field {where!r}: a rank is a decimal number")
            m = expect_object(m, f"{w} {where}")
            phase = expect_int(expect_field(m, "phase", f"{w} {where}"), f"{where}.phase", w)
            try:
                member_phase = MemberPhase(phase)
            except ValueError:
                raise BadRecord(f"{w}: field '{where}.phase': {phase} is not one of "
                                + ", ".join(str(int(p)) for p in MemberPhase)) from None
            reports[int(rank)] = MemberReport(
                member_phase,
                expect_int(m.get("exit_code", 0), f"{where}.exit_code", w),
                expect_str(m.get("reason", ""), f"{where}.reason", w),
                expect_str(m.get("node", ""), f"{where}.node", w))
        return cls.of(expect_int(expect_field(d, "incarnation", w), "incarnation", w),
                      expect_str(expect_field(d, "az", w), "az", w), reports)


# --- reading records back -------------------------------------------------------

# What a record that cannot be read raises in ``from_dict``: bad JSON
# (ValueError), a missing field (KeyError), a wrong type (TypeError,
# AttributeError), a spec past a bound (InvalidSpec, a ValueError).
UNREADABLE = (ValueError, KeyError, TypeError, AttributeError, IndexError)


def read_records(kvs: Any, parse: Any) -> tuple[list[Any], list[tuple[str, str]]]:
    """Parse every ``kv`` with ``parse(json, mod_revision)``. Returns the
    records and ``(key, why)`` for each one that cannot be read, so that one
    corrupt or hostile record costs the caller a log line, not a takeover
    (docs/limits.md "Reading records back")."""
    out: list[Any] = []
    bad: list[tuple[str, str]] = []
    for kv in kvs:
        try:
            out.append(parse(kv.json(), kv.mod_revision))
        except UNREADABLE as exc:
            bad.append((kv.key, f"{type(exc).__name__}: {str(exc)[:200]}"))
    return out, bad


UNREADABLE_HOLD = "unreadable:"  # ledger key prefix of a hold kept for an unreadable reservation


def holds_for_unreadable(bad_keys: Iterable[str], prefix: str, gangs: Iterable["GangRecord"], az: str) -> list[Reservation]:
    """Safety before liveness: a reservation record that cannot be read may
    still be holding devices that members use. For each unreadable key
    ``<prefix><gang>`` whose gang record is readable, hold the devices that
    gang's placement names in ``az`` under ``unreadable:<gang>``, so the
    leader does not offer them to another gang; they are offered again once
    the record is readable or gone (at the next rebuild). A gang whose record
    is unreadable too names no devices: the agents' own ledgers still refuse
    an overlapping assignment."""
    by_id = {g.id: g for g in gangs}
    out = []
    for key in bad_keys:
        if not key.startswith(prefix):
            continue
        g = by_id.get(key[len(prefix):])
        if g is None:
            continue
        nodes: dict[str, NodeDevices] = {}
        for m in g.placement:
            if m.az != az:
                continue
            cur = nodes.get(m.node, NodeDevices((), ()))
            nodes[m.node] = NodeDevices(cur.gpus + tuple(m.gpus), cur.nics + tuple(m.nics))
        if nodes:
            # Held like a committed reservation; kept in the ledger only,
            # never written nor counted (the key names it as a stand-in).
            out.append(Reservation(az, UNREADABLE_HOLD + g.id, g.incarnation, HoldState.COMMITTED, nodes, 0))
    return out
