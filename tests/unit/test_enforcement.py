from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from agent.core.enforcement import Arrivals, DeviceLedger, EpochGuard, FenceTimer


@pytest.mark.parametrize(
    "seen,epoch,accepted",
    [([], 5, True), ([5], 5, True), ([5], 7, True), ([7], 5, False), ([3, 9], 8, False)],
    ids=["first", "same epoch", "newer", "older refused", "older than highest refused"],
)
def test_epoch_rule(seen: list[int], epoch: int, accepted: bool) -> None:
    g = EpochGuard()
    for e in seen:
        g.accept(e)
    assert g.accept(epoch) is accepted


@given(st.lists(st.integers(min_value=1, max_value=50), max_size=30))
def test_epoch_guard_never_goes_backwards(epochs: list[int]) -> None:
    g = EpochGuard()
    highest = 0
    for e in epochs:
        assert g.accept(e) == (e >= highest)
        highest = max(highest, e)
        assert g.highest == highest


def test_ledger_refuses_overlap_whatever_the_sender_says() -> None:
    led: DeviceLedger[str] = DeviceLedger()
    led.hold("a", (0, 1), ("mlx5_0",))
    assert led.conflicts("b", (1, 2), ()) == ["GPUs [1] held by a"]
    assert led.conflicts("b", (2,), ("mlx5_0",)) == ["NICs ['mlx5_0'] held by a"]
    assert led.conflicts("b", (2, 2), ()) == ["duplicate GPUs in assignment [2, 2]"]
    assert led.conflicts("a", (0, 1), ("mlx5_0",)) == []  # its own re-assignment
    led.release("a")
    assert led.conflicts("b", (1, 2), ("mlx5_0",)) == []
    assert led.check() == []


def test_fence_timer() -> None:
    f = FenceTimer(fence_after_s=4.0, last_valid=10.0)
    assert not f.overdue(14.0)
    assert f.overdue(14.01)
    f.heard(13.0)
    assert not f.overdue(16.0) and f.deadline() == 17.0
    f.heard(5.0)  # an old timestamp never moves the deadline back
    assert f.deadline() == 17.0


def test_arrivals_a_revocation_refuses_what_waits_to_start() -> None:
    a = Arrivals()
    a.arrive("g", 1, 0)
    a.arrive("g", 1, 1)
    a.arrive("g", 2, 0)  # the next incarnation: not revoked by the old one's revocation
    a.arrive("h", 1, 0)
    assert a.revoke("g", 1) == 2
    assert a.revoked("g", 1, 0) and a.revoked("g", 1, 1)
    assert not a.revoked("g", 2, 0) and not a.revoked("h", 1, 0)
    a.done("g", 1, 0)
    assert not a.revoked("g", 1, 0), "started or refused: forgotten"
    assert a.revoke("x", 1) == 0 and not a.revoked("x", 1, 0), "a revocation of nothing waiting marks nothing"
    a.arrive("g", 1, 1)  # a duplicate while the first waits keeps its mark
    assert a.revoked("g", 1, 1)
    for k in [("g", 1, 1), ("g", 2, 0), ("h", 1, 0)]:
        a.done(*k)
    assert a.pending == {}
