"""Which events a cluster stream sends of a changed gang record
(coordinator/service.py unseen_events, last_seq), by table."""

from __future__ import annotations

import pytest

from coordinator.core.events import GangEvent
from coordinator.core.fanout import last_seq, unseen_events


def evs(*seqs: int) -> tuple[GangEvent, ...]:
    return tuple(GangEvent(kind="placed", at=1.0, epoch=1, message="m", seq=s) for s in seqs)


@pytest.mark.parametrize("seen, stored, sent, last", [
    (0, (), [], 0),                    # a record without events (written before they existed)
    (0, (1, 2), [1, 2], 2),            # a gang new to the stream: all of it
    (2, (1, 2), [], 2),                # rewritten without a new event
    (2, (1, 2, 3, 4), [3, 4], 4),      # two new events in one write
    (5, (4, 5, 6), [6], 6),            # the oldest dropped from the list (the bound)
    (1, (3, 4), [3, 4], 4),            # seq 2 dropped before the stream saw it: the rest
])
def test_only_events_above_the_last_seq_seen_are_sent(seen: int, stored: tuple[int, ...], sent: list[int], last: int) -> None:
    assert [e.seq for e in unseen_events(seen, evs(*stored))] == sent
    assert last_seq(evs(*stored)) == last
