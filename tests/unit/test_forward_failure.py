"""What a standby says when a call it forwarded to its leader ended in
DEADLINE_EXCEEDED or CANCELLED (coordinator/service.py ``forward_failure``):
the time it really waited, and the leader's own status when the budget had
not run out (a burst once read "did not answer within 95.7 s" after 8.7 s)."""

from __future__ import annotations

import pytest

from coordinator.service_base import forward_failure
from phalanx.leader_record import LeaderInfo

LEADER = LeaderInfo(az="az-a", coordinator_id="a0", address="127.0.0.1:7001", epoch=5)


@pytest.mark.parametrize("code,details,waited,budget,present,absent", [
    # The budget ran out: the leader did not answer in time.
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", 9.98, 10.0,
     ["did not answer SubmitGang within the 10.0 s left", "waited 10.0 s", "forwarded by b0"], ["ended"]),
    # The leader ended it itself, long before the budget: its own status and
    # words, the real wait, never the budget as the wait.
    ("DEADLINE_EXCEEDED", "etcd did not answer within 2 s", 8.7, 95.7,
     ["ended SubmitGang with DEADLINE_EXCEEDED after 8.7 s", "before the 95.7 s budget", "etcd did not answer within 2 s"],
     ["did not answer SubmitGang within 95.7"]),
    ("CANCELLED", "", 0.4, 30.0, ["ended SubmitGang with CANCELLED after 0.4 s", "(forwarded by b0)"], ["did not answer"]),
])
def test_forward_failure(code: str, details: str, waited: float, budget: float, present: list[str], absent: list[str]) -> None:
    text = forward_failure(LEADER, "SubmitGang", "b0", code, details, waited_s=waited, budget_s=budget)
    assert "the leader of az-a (a0 at 127.0.0.1:7001)" in text, text
    for words in present:
        assert words in text, (words, text)
    for words in absent:
        assert words not in text, (words, text)
