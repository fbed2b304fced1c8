"""coordinator/core/twophase_fold.py: when the owner folds its COMMIT with
the RESERVED write, and whether a decision whose reply was lost is its own."""
from __future__ import annotations

import pytest

from coordinator.core.twophase_fold import Fold, can_fold, decided_here, fold_failed
from coordinator.core.twophase_model import Outcome
from phalanx.model import GangState

R = GangState.RESERVING


@pytest.mark.parametrize("owned, state, rec_inc, inc, writing, expected", [
    (True, R, 3, 3, False, True),
    (False, R, 3, 3, False, False),
    (True, None, None, 3, False, False),
    (True, GangState.RESERVED, 3, 3, False, False),
    (True, GangState.PENDING, 3, 3, False, False),
    (True, R, 2, 3, False, False),
    (True, R, 4, 3, False, False),
    (True, R, 3, 3, True, False),
], ids=["eligible", "not-owned", "not-held", "already-reserved", "pending", "older-record", "newer-record",
        "write-in-flight"])
def test_can_fold(owned, state, rec_inc, inc, writing, expected) -> None:  # type: ignore[no-untyped-def]
    assert can_fold(owned, state, rec_inc, inc, writing) is expected


@pytest.mark.parametrize("timed_out, expected", [(True, Fold.UNKNOWN), (False, Fold.NOT_FOLDED)],
                         ids=["timeout-may-have-applied", "lost-compare-did-not"])
def test_fold_failed(timed_out, expected) -> None:  # type: ignore[no-untyped-def]
    assert fold_failed(timed_out) is expected


@pytest.mark.parametrize("won, fold, outcome, by, expected", [
    (True, Fold.NOT_FOLDED, Outcome.ABORT, "other", True),
    (True, Fold.FOLDED, Outcome.COMMIT, None, True),
    (False, Fold.UNKNOWN, Outcome.COMMIT, "az1", True),
    (False, Fold.UNKNOWN, Outcome.COMMIT, "az2", False),
    (False, Fold.UNKNOWN, Outcome.ABORT, "az1", False),
    (False, Fold.UNKNOWN, Outcome.COMMIT, None, False),
    (False, Fold.NOT_FOLDED, Outcome.COMMIT, "az1", False),
], ids=["won", "won-folded", "lost-reply-ours", "lost-reply-other-az", "lost-reply-abort", "lost-reply-nothing-read",
        "not-folded-not-won"])
def test_decided_here(won, fold, outcome, by, expected) -> None:  # type: ignore[no-untyped-def]
    assert decided_here(won, fold, outcome, by, "az1") is expected
