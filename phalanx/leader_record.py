"""The leader record ``leader/<az>``: the one model and its one parser.

The campaign txn (coordinator/election.py) writes it, bound to the winner's
session lease; coordinators read it to forward calls and to reach a peer AZ's
leader, and the agent (agent/session.py) reads it to find the leader to dial.
Both parse it here, so a record one side can read the other cannot read
differently. Shared: imports nothing of ``coordinator`` or ``agent``. Pure:
no I/O.

The stored JSON is unchanged (docs/etcd-keys.md): ``{"id", "address"}``. The
epoch (fencing token) is not stored: it is the key's create revision, and
the lease the key's own; both come from the read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from phalanx.limits import MAX_LEADER_RECORD_BYTES, json_bytes


class BadLeaderRecord(ValueError):
    """A leader record that cannot be read; the message names the key and the
    field. A ValueError, like every other unreadable record."""


@dataclass(frozen=True)
class LeaderInfo:
    """Who leads ``az`` and under which epoch, as read from ``leader/<az>``."""

    az: str
    coordinator_id: str
    address: str  # host:port of its gRPC server, as it advertises it
    epoch: int  # the key's create revision
    lease: int = 0  # the session lease the key is bound to

    @staticmethod
    def value(coordinator_id: str, address: str) -> dict[str, str]:
        """The JSON the campaign stores; refused (``BadLeaderRecord``) when
        a reader would refuse it, so a coordinator with a bad id or address
        fails before it campaigns rather than lead unseen."""
        data = {"id": coordinator_id, "address": address}
        _check(data, "leader record")
        if json_bytes(data) > MAX_LEADER_RECORD_BYTES:
            raise BadLeaderRecord(f"leader record: id and address take more than {MAX_LEADER_RECORD_BYTES} bytes")
        return data

    @classmethod
    def from_dict(cls, az: str, data: Any, *, epoch: int, lease: int = 0) -> "LeaderInfo":
        where = f"leader/{az}"
        if not isinstance(data, Mapping):
            raise BadLeaderRecord(f"{where}: not a JSON object but {type(data).__name__}")
        _check(data, where)
        return cls(az=az, coordinator_id=data["id"], address=data["address"], epoch=epoch, lease=lease)

    @classmethod
    def from_kv(cls, az: str, kv: Any) -> "LeaderInfo":
        """Parse a read of ``leader/<az>`` (a ``phalanx.store.KV``)."""
        if len(kv.value) > MAX_LEADER_RECORD_BYTES:
            raise BadLeaderRecord(f"leader/{az}: the record is {len(kv.value)} bytes, more than the "
                                  f"{MAX_LEADER_RECORD_BYTES} a leader record may take")
        try:
            data = kv.json()
        except ValueError as exc:  # bad JSON or bad UTF-8 (both ValueErrors)
            raise BadLeaderRecord(f"leader/{az}: not JSON: {exc}") from None
        return cls.from_dict(az, data, epoch=kv.create_revision, lease=kv.lease)


def _check(data: Mapping[str, Any], where: str) -> None:
    # Both fields are required: a record without an id vouches for no peer
    # (coordinator/server.py), one without an address cannot be dialed.
    for name in ("id", "address"):
        if name not in data:
            raise BadLeaderRecord(f"{where}: {name} is missing")
        v = data[name]
        if not isinstance(v, str):
            raise BadLeaderRecord(f"{where}: {name} must be a string, got {type(v).__name__}")
        if not v.strip():
            raise BadLeaderRecord(f"{where}: {name} must not be empty")
    if "/" in data["id"]:  # the rule of CoordinatorConfig.validate
        raise BadLeaderRecord(f"{where}: id must contain no '/', got {data['id']!r}")
