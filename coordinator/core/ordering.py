"""The total order on gangs that makes cross-AZ reservations deadlock-free.

docs/two-phase.md: conflicting prepares are ordered by gang. A gang that comes first
in this order ("older") may abort a later gang's undecided PREPARED hold; a
later gang is refused and retries with a new incarnation but the *same* key
(priority and first submission time are kept across retries), so the gang at
the head of the order can only ever be refused by COMMITTED holds, never by a
competitor that is itself waiting. That is what rules out both deadlock and
livelock.

The same key is the admission order of a leader's pending gangs
(``GangRecord.order_key``, coordinator/core/admission.py): one order, one
definition.

Pure: no I/O.
"""

from __future__ import annotations

from typing import NamedTuple


class GangOrderKey(NamedTuple):
    """Sorts ascending in admission order: the smallest key is the oldest gang.

    A NamedTuple so that keys compare with ``<`` and print readably in reasons
    and logs.
    """

    neg_priority: int
    submitted_at: float
    gang_id: str


def gang_order_key(priority: int, submitted_at: float, gang_id: str) -> GangOrderKey:
    """Key of a gang in the conflict order: priority descending, then first
    submission time ascending, then gang id ascending.

    The gang id is the final tie-break so that the order is *total*: two gangs
    submitted in the same clock tick (or on AZs whose clocks disagree) must
    still compare the same way on every participant, or two participants could
    each let a different gang win and both gangs would be refused forever.
    """
    return GangOrderKey(-priority, submitted_at, gang_id)


def is_older(a: GangOrderKey, b: GangOrderKey) -> bool:
    """True when gang ``a`` takes precedence over gang ``b`` in a conflict."""
    return a < b
