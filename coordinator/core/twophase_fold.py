"""The owner's folded COMMIT (docs/two-phase.md "Driver"): when a COMMIT
decision may be written in one txn with its gang's RESERVED record, and
whether a decision whose reply was lost was written by this owner. Pure:
the driver (coordinator/twophase/store_effects.py) does the I/O."""

from __future__ import annotations

import enum

from coordinator.core.twophase_model import Outcome
from phalanx.model import GangState


class Fold(enum.Enum):
    """What the COMMIT+RESERVED txn did."""

    FOLDED = "folded"  # written
    NOT_FOLDED = "not folded"  # not written: a lost compare, or not tried
    UNKNOWN = "fold unknown"  # the reply was lost: it may have applied


def can_fold(owned: bool, state: GangState | None, record_incarnation: int | None, incarnation: int,
             writing: bool) -> bool:
    """Whether the COMMIT of ``incarnation`` may be folded with the RESERVED
    write: only while this leader owns the gang (``owned``), its record
    (``state``/``record_incarnation``; None: not held) is RESERVING at this
    incarnation and no other write of it is in flight (``writing``)."""
    return (owned and state is GangState.RESERVING and record_incarnation == incarnation
            and not writing)


def fold_failed(timed_out: bool) -> Fold:
    """The fold's write did not come back written: a timeout may have
    applied it (UNKNOWN); a lost compare did not (NOT_FOLDED)."""
    return Fold.UNKNOWN if timed_out else Fold.NOT_FOLDED


def decided_here(won: bool, fold: Fold, outcome: Outcome, decided_by: str | None, az: str) -> bool:
    """Whether this owner (of ``az``) made the decision the key holds:
    it won the create, or its folded COMMIT's reply was lost and the key
    holds a COMMIT by ``az`` (only an owner writes COMMIT, and the record
    names who did). ``decided_by``: the stored record's author, None when
    no record was read."""
    return won or (fold is Fold.UNKNOWN and outcome is Outcome.COMMIT and decided_by == az)
