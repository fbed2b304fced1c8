from __future__ import annotations

import pytest

from coordinator.core.progress import MemberReport, evaluate
from phalanx.model import GangState as S, MemberPhase as P

R = lambda p, code=0: MemberReport(p, code, "", "n0")  # noqa: E731


@pytest.mark.parametrize(
    "state,members,expect",
    [
        (S.STARTING, {0: R(P.RUNNING)}, None),
        (S.STARTING, {0: R(P.RUNNING), 1: R(P.RUNNING)}, S.RUNNING),
        (S.STARTING, {0: R(P.RUNNING), 1: R(P.SUCCEEDED)}, S.RUNNING),
        (S.RUNNING, {0: R(P.RUNNING), 1: R(P.RUNNING)}, None),
        (S.RUNNING, {0: R(P.SUCCEEDED), 1: R(P.SUCCEEDED)}, S.SUCCEEDED),
        (S.RUNNING, {0: R(P.SUCCEEDED), 1: R(P.FAILED, 3)}, S.FAILED),
        (S.STARTING, {0: R(P.REJECTED)}, S.FAILED),
        (S.RUNNING, {0: R(P.STOPPED), 1: R(P.RUNNING)}, S.FAILED),
        (S.PENDING, {0: R(P.RUNNING), 1: R(P.RUNNING)}, None),
        (S.SUCCEEDED, {0: R(P.FAILED)}, None),
    ],
    ids=[
        "not all started yet", "all started -> running", "a fast member already done counts as started",
        "running stays running", "all exit 0 -> succeeded", "one non-zero exit fails the gang",
        "a rejected assignment fails the gang", "a stopped member fails the gang",
        "pending gangs ignore reports", "terminal gangs never move",
    ],
)
def test_gang_progress(state: S, members: dict, expect: S | None) -> None:
    tr = evaluate(state, 2, members)
    assert (tr.to if tr else None) == expect


@pytest.mark.parametrize("state,members,to,all_started", [
    (S.STARTING, {0: R(P.RUNNING), 1: R(P.RUNNING)}, S.RUNNING, True),
    (S.STARTING, {0: R(P.SUCCEEDED), 1: R(P.SUCCEEDED)}, S.SUCCEEDED, True),
    (S.RESERVED, {0: R(P.SUCCEEDED), 1: R(P.SUCCEEDED)}, S.SUCCEEDED, True),
    (S.RUNNING, {0: R(P.SUCCEEDED), 1: R(P.SUCCEEDED)}, S.SUCCEEDED, False),
    (S.STARTING, {0: R(P.SUCCEEDED), 1: R(P.FAILED, 1)}, S.FAILED, False),
], ids=["running step", "done before seen running", "done before even starting was written",
        "already counted when it ran", "a failure is not a start"])
def test_the_step_on_which_every_member_has_started(state: S, members: dict, to: S, all_started: bool) -> None:
    tr = evaluate(state, 2, members)
    assert tr is not None and tr.to == to and tr.all_started == all_started
