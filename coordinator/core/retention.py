"""Retention of finished gangs: which of them are due for collection.

Finished gangs (SUCCEEDED, FAILED, CANCELLED) stay in etcd for
``Timings.gang_retention_s`` after they ended, then their owner AZ's leader
deletes them with their idempotency and decision keys (docs/etcd-keys.md
"Retention"; the driver is ``coordinator/retention.py``). This module only
chooses *which* gangs a sweep collects. Pure: no I/O, ``now`` is a value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable

from coordinator.core.records import GangRecord
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

    @classmethod
    def of(cls, g: GangRecord) -> "FinishedGang":
        return cls(id=g.id, state=g.state, owner_az=g.owner_az, ended_at=g.updated_at, mod_revision=g.mod_revision,
                   idempotency_key=g.idempotency_key, azs=frozenset(m.az for m in g.placement))


def due_for_collection(
    gangs: Iterable[FinishedGang],
    *,
    az: str,
    now: float,
    retention_s: float,
    limit: int,
    held: Collection[str] = (),
) -> list[FinishedGang]:
    """The gangs one sweep of ``az``'s leader collects: owned by ``az``, in a
    terminal state, ended more than ``retention_s`` before ``now``, and not in
    ``held`` (gangs with a reservation or member summary still present);
    oldest end first (then id, so the choice is deterministic), at most
    ``limit``. A gang whose end lies in the future (another replica's clock
    ran ahead) is simply not due yet."""
    if limit <= 0:
        return []
    due = [g for g in gangs
           if g.owner_az == az and g.state.terminal and g.id not in held and now - g.ended_at > retention_s]
    due.sort(key=lambda g: (g.ended_at, g.id))
    return due[:limit]
