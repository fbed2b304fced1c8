"""Retention of finished gangs: which of them are due for collection.

Finished gangs (SUCCEEDED, FAILED, CANCELLED) stay in etcd for
``Timings.gang_retention_s`` after they ended, and an owner AZ keeps at most
``max_kept`` of them and ``max_kept_bytes`` of their records, oldest out
first; then their owner AZ's leader deletes them with their idempotency and
decision keys (docs/etcd-keys.md "Retention", "Retention by count and
bytes"; the driver is ``coordinator/retention.py``). This module only
chooses *which* gangs a sweep collects. Pure: no I/O, ``now`` is a value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable

from coordinator.core.records import GangRecord
from phalanx.limits import json_bytes
from phalanx.model import GangState


@dataclass(frozen=True)
class FinishedGang:
    """What an owner leader keeps in memory about a finished gang it owns:
    enough to collect it, not its spec."""

    id: str
    state: GangState
    owner_az: str
    ended_at: float  # the record's updated_at: the wall time its terminal state was written
    mod_revision: int  # of the terminal record; the collecting txn compares it
    idempotency_key: str = ""
    azs: frozenset[str] = frozenset()  # AZs of its last placement (where holds could be)
    size: int = 0  # bytes of its record as stored (what the bytes bound counts)
    owner: str = ""  # who submitted it (<role>/<name>): who may learn it expired (visibility)

    @classmethod
    def of(cls, g: GangRecord) -> "FinishedGang":
        return cls(id=g.id, state=g.state, owner_az=g.owner_az, ended_at=g.updated_at, mod_revision=g.mod_revision,
                   idempotency_key=g.idempotency_key, azs=frozenset(m.az for m in g.placement),
                   size=json_bytes(g.to_dict()), owner=g.owner)

    def expired(self, collected_at: float) -> "ExpiredGang":
        return ExpiredGang(id=self.id, state=self.state, owner_az=self.owner_az, owner=self.owner,
                           ended_at=self.ended_at, collected_at=collected_at)


@dataclass(frozen=True)
class ExpiredGang:
    """``expired/<id>``: what is left in etcd of a collected gang, written in
    the txn that deletes it, so that GetGang answers "finished and expired"
    instead of a bare "not found". A few hundred bytes; at most
    ``max_expired_ids`` of them are kept, the oldest deleted first
    (``expired_to_trim``)."""

    id: str
    state: GangState
    owner_az: str
    owner: str
    ended_at: float
    collected_at: float

    def to_dict(self) -> dict:
        return {"id": self.id, "state": self.state.name, "owner_az": self.owner_az, "owner": self.owner,
                "ended_at": self.ended_at, "collected_at": self.collected_at}

    @classmethod
    def from_dict(cls, d: dict) -> "ExpiredGang":
        """Raises one of records.UNREADABLE on a record it cannot read."""
        state = GangState[d["state"]]
        if not state.terminal:
            raise ValueError(f"expired gang record in state {state.name}: only a finished gang expires")
        return cls(id=str(d["id"]), state=state, owner_az=str(d["owner_az"]), owner=str(d.get("owner", "")),
                   ended_at=float(d["ended_at"]), collected_at=float(d["collected_at"]))


def expired_to_trim(count: int, bound: int, limit: int) -> int:
    """How many of the oldest ``expired/`` keys a sweep deletes: those beyond
    ``bound`` of the ``count`` there are, at most ``limit`` per sweep."""
    return max(0, min(count - bound, limit))


def due_for_collection(
    gangs: Iterable[FinishedGang],
    *,
    az: str,
    now: float,
    retention_s: float,
    limit: int,
    held: Collection[str] = (),
    max_kept: int | None = None,
    max_kept_bytes: int | None = None,
) -> list[FinishedGang]:
    """The gangs one sweep of ``az``'s leader collects: owned by ``az``, in a
    terminal state, not in ``held`` (gangs with a reservation or member
    summary still present, or finished too recently for a client's
    retries), and either ended more than ``retention_s`` before ``now`` or
    beyond the bounds: of ``az``'s finished gangs (held ones included, as
    they take room in etcd too) at most ``max_kept`` and ``max_kept_bytes``
    of records stay, the oldest unheld ones going first (None: no bound).
    Oldest end first (then id, so the choice is deterministic), at most
    ``limit``. A gang whose end lies in the future (another replica's clock
    ran ahead) is not due by age."""
    if limit <= 0:
        return []
    mine = sorted((g for g in gangs if g.owner_az == az and g.state.terminal), key=lambda g: (g.ended_at, g.id))
    free = [g for g in mine if g.id not in held]
    due = {g.id for g in free if now - g.ended_at > retention_s}
    # Beyond a bound: the oldest unheld gangs until what stays fits.
    excess_count = len(mine) - max_kept if max_kept is not None else 0
    excess_bytes = sum(g.size for g in mine) - max_kept_bytes if max_kept_bytes is not None else 0
    for g in free:
        if excess_count <= 0 and excess_bytes <= 0:
            break
        due.add(g.id)
        excess_count -= 1
        excess_bytes -= g.size
    return [g for g in free if g.id in due][:limit]
