"""``--check-book``: the leader checks its book after each admission cycle.

``Book.problems()`` (coordinator/book.py) says what must hold between the
book's maps. With ``CoordinatorConfig.check_book`` the leader asks it after
every cycle and logs each problem at ERROR once per leadership ("book
inconsistent: ..."), so the integration harness's strict teardown and a
reader of the chaos logs see a book gone wrong where it went wrong. What it
costs and when to turn it on: docs/book.md "Checking a running leader".
"""

from __future__ import annotations

import logging

from coordinator.book import Book
from phalanx import failpoints
from phalanx.reservation import HoldState, NodeDevices, Reservation

log = logging.getLogger(__name__)

# A node no agent can be: the planted inconsistency holds devices there.
PLANTED_NODE = "book-check.planted"


def new_problems(book: Book, reported: frozenset[str] | set[str]) -> list[str]:
    """The book's problems not in ``reported``, in ``problems()``'s order."""
    return [p for p in book.problems() if p not in reported]


class BookCheck:
    """The hook ``AzLeader.run`` calls after each cycle; does nothing unless
    ``enabled``."""

    def __init__(self, book: Book, enabled: bool):
        self.book = book
        self.enabled = enabled
        self.reported: set[str] = set()

    def after_cycle(self) -> None:
        if not self.enabled:
            return
        planted = failpoints.on("leader.corrupt_book") and self._plant()
        try:
            for line in new_problems(self.book, self.reported):
                self.reported.add(line)
                log.error("book inconsistent: %s", line)
        finally:
            if planted:
                self._unplant()

    # The failpoint ``leader.corrupt_book`` (tests only): two gangs holding
    # one GPU of a node no agent has, for the length of one check (nothing
    # awaits in between, so no other task sees it), once per leadership.
    def _plant(self) -> bool:
        if any(PLANTED_NODE in line for line in self.reported):
            return False
        for gang in ("book-check.a", "book-check.b"):
            self.book.held_in_memory(Reservation(self.book.az, gang, 1, HoldState.COMMITTED,
                                                 {PLANTED_NODE: NodeDevices((0,))}))
        return True

    def _unplant(self) -> None:
        for gang in ("book-check.a", "book-check.b"):
            self.book.unreserved(gang)
