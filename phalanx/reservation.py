"""The reservation record ``reservations/<az>/<gang>``: the one model.

The coordinator writes it (single-AZ leader, two-phase participant) and reads
it back after a takeover; the agent reads it to confirm a start token
(agent/session.py). Both parse it here, with the same checks, so a record one
side accepts the other cannot read differently. Shared: imports nothing of
``coordinator`` or ``agent``. Pure: no I/O.

The stored JSON is unchanged from earlier versions (docs/etcd-keys.md): the
state is stored under ``"status"``, and the two-phase fields are absent in
single-AZ records.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple


class HoldState(str, enum.Enum):
    """Where a reservation stands. Str-valued: the value is what is stored."""

    PREPARED = "PREPARED"  # two-phase: voted YES, waiting for the decision
    COMMITTED = "COMMITTED"  # devices given to this incarnation; members may start
    RELEASING = "RELEASING"  # gang is terminal; devices held until its members are gone


class NodeDevices(NamedTuple):
    """The devices of one node that one gang holds. A tuple, so the two-phase
    cores can unpack it as ``gpus, nics``."""

    gpus: tuple[int, ...]
    nics: tuple[str, ...] = ()


class BadReservation(ValueError):
    """A reservation record that cannot be read; the message names the field.
    A ValueError, so ``read_records`` counts it as unreadable."""


@dataclass(frozen=True)
class Reservation:
    """``reservations/<az>/<gang>``: one record per (AZ, gang) holding its
    node → devices map (etcd caps a txn at 128 ops, so never a key per GPU)."""

    az: str
    gang: str
    incarnation: int
    state: HoldState
    nodes: Mapping[str, NodeDevices]
    epoch: int = 0  # epoch of the leader that wrote it
    mod_revision: int = 0  # from the read; not stored
    # Two-phase (cross-AZ) holds also carry the gang's owner AZ and its place
    # in the conflict order, so a new leader can rebuild its participant
    # ledger from etcd alone. Absent in single-AZ records (and in records
    # written before issue 3): ``two_phase`` False.
    two_phase: bool = False
    owner_az: str = ""
    priority: int = 0
    submitted_at: float = 0.0

    def __post_init__(self) -> None:
        # Canonical devices (sorted, no repeats) so that two holds of the same
        # devices compare equal however they were listed. Nodes with no
        # device are kept: a member that asks for none still needs its node
        # named for the agent's token check.
        object.__setattr__(self, "state", _state(self.state))
        object.__setattr__(self, "nodes", {
            n: NodeDevices(tuple(sorted(set(d[0]))), tuple(sorted(set(d[1]))))
            for n, d in sorted(self.nodes.items())})

    def holds(self, gang: str, incarnation: int) -> bool:
        """Members of ``gang``'s ``incarnation`` may run on these devices."""
        return self.gang == gang and self.incarnation == incarnation and self.state is HoldState.COMMITTED

    def releasing(self, incarnation: int) -> bool:
        """``incarnation`` is being torn down: its members must not (re)start."""
        return self.incarnation == incarnation and self.state is HoldState.RELEASING

    def to_dict(self) -> dict[str, Any]:
        return {
            "az": self.az,
            "gang": self.gang,
            "incarnation": self.incarnation,
            "status": self.state.value,
            "nodes": {n: {"gpus": list(d.gpus), "nics": list(d.nics)} for n, d in sorted(self.nodes.items())},
            "epoch": self.epoch,
            **({"two_phase": True, "owner_az": self.owner_az, "priority": self.priority,
                "submitted_at": self.submitted_at} if self.two_phase else {}),
        }

    @classmethod
    def from_dict(cls, d: Any, mod_revision: int = 0) -> "Reservation":
        """The one parser. Raises BadReservation naming the field."""
        if not isinstance(d, Mapping):
            raise BadReservation(f"reservation record: not a JSON object ({type(d).__name__})")
        nodes = _field(d, "nodes")
        if not isinstance(nodes, Mapping):
            raise BadReservation(f"reservation record: field 'nodes': expected a JSON object, got {type(nodes).__name__}")
        parsed: dict[str, NodeDevices] = {}
        for node, dev in nodes.items():
            where = f"nodes.{str(node)[:64]}"
            if not isinstance(dev, Mapping):
                raise BadReservation(f"reservation record: field {where!r}: not a JSON object")
            parsed[str(node)] = NodeDevices(
                tuple(_int(g, f"{where}.gpus") for g in _list(dev, "gpus", where)),
                tuple(_str(c, f"{where}.nics") for c in _list(dev, "nics", where)))
        return cls(
            az=_str(_field(d, "az"), "az"),
            gang=_str(_field(d, "gang"), "gang"),
            incarnation=_int(_field(d, "incarnation"), "incarnation"),
            state=_state(_field(d, "status")),
            nodes=parsed,
            epoch=_int(d.get("epoch", 0), "epoch"),
            mod_revision=mod_revision,
            two_phase=bool(d.get("two_phase", False)),
            owner_az=_str(d.get("owner_az", ""), "owner_az"),
            priority=_int(d.get("priority", 0), "priority"),
            submitted_at=_float(d.get("submitted_at", 0.0), "submitted_at"),
        )


def _state(v: Any) -> HoldState:
    try:
        return HoldState(v)
    except ValueError:
        raise BadReservation(f"reservation record: field 'status': {str(v)[:64]!r} is not one of "
                             + ", ".join(s.value for s in HoldState)) from None


def _field(d: Mapping[str, Any], name: str) -> Any:
    if name not in d:
        raise BadReservation(f"reservation record: field {name!r} is missing")
    return d[name]


def _list(dev: Mapping[str, Any], name: str, where: str) -> list[Any]:
    v = dev.get(name, [])
    if not isinstance(v, list):
        raise BadReservation(f"reservation record: field '{where}.{name}': expected a list, got {type(v).__name__}")
    return v


def _int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadReservation(f"reservation record: field {name!r}: expected an integer, got {type(v).__name__}")
    return v


def _float(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadReservation(f"reservation record: field {name!r}: expected a number, got {type(v).__name__}")
    return float(v)


def _str(v: Any, name: str) -> str:
    if not isinstance(v, str):
        raise BadReservation(f"reservation record: field {name!r}: expected a string, got {type(v).__name__}")
    return v
