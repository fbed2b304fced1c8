"""The one writer of gang records (docs/design.md §19.8).

Every write of ``gangs/<id>`` a leadership makes goes through
``GangWriter.write``: fenced, guarded by the record's last revision (or its
absence), carrying the events that wait for the gang's next write, and
followed by the book's update, the collector's index and the metrics' count,
whether the write applied or lost its compare. It also keeps which gangs have
a write in flight (``busy``/``acting_on``): while one does, nothing else
decides about that gang.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from coordinator.book import Book
from coordinator.core import events as gang_events
from coordinator.core.records import GangRecord
from coordinator.core.retention import FinishedGang
from coordinator.leadership import Leadership
from coordinator.metrics import Step, step_of
from phalanx import failpoints
from phalanx.errors import Conflict
from phalanx.logfmt import current
from phalanx.store import Get, Put, absent, unchanged_since


class GangWriter:
    def __init__(self, lead: Leadership, book: Book):
        self.lead = lead
        self.book = book
        self._inflight: set[str] = set()  # gangs with a write in flight
        # Events seen outside a write (a takeover's "fenced"): they ride on
        # the gang's next write instead of costing one of their own.
        self._unwritten_events: dict[str, list[gang_events.GangEvent]] = {}
        # Per gang, the record state its counters last counted (_count).
        self._counted: dict[str, Step] = {}
        self._on_forget: list[Callable[[str], None]] = []  # see when_forgotten

    async def write(self, new: GangRecord, old: GangRecord | None, ops: list = (), compares: list = (),
                    events: list = ()) -> GangRecord:
        """Fenced write of a gang record guarded by its last revision;
        ``events`` (and any waiting for this gang) are appended to its
        history in the same write. Conflict when the guard fails: the record
        found instead is kept in the book if it is the newest seen."""
        lead, keys = self.lead, self.lead.keys
        lead.check_valid()
        waiting = self._unwritten_events.get(new.id, [])
        # Each event names the decision that wrote it: the stimulus bound in
        # the log context here (docs/logging.md "Stimulus ids"), so that
        # `phalanx describe` and a chaos history lead back to its log lines.
        stimulus = str(current().get("stimulus", ""))
        new = new.with_events([e.stamped(stimulus) for e in waiting + list(events)])
        guard = [unchanged_since(keys.gang(new.id), old.mod_revision)] if old else [absent(keys.gang(new.id))]
        res = await lead.fenced_txn(
            guard + list(compares), [Put(keys.gang(new.id), new.to_dict())] + list(ops), [Get(keys.gang(new.id))]
        )
        if not res.succeeded:
            kvs = res.results[0]
            if kvs:
                cur = GangRecord.from_dict(kvs[0].json(), kvs[0].mod_revision)
                if self.book.lost_compare(cur):  # kept, or dropped if another AZ adopted it meanwhile
                    self.note(cur)
                    if cur.owner_az == lead.az:
                        self._count(old, cur)  # e.g. our own earlier write whose reply was lost
            raise Conflict(f"gang {new.id} changed concurrently")
        written = new.evolve(mod_revision=res.revision)
        await failpoints.hit("leader.gang_write_replied")
        self._unwritten_events.pop(new.id, None)
        if self.book.newest(written):
            self._count(old, written)
            self.book.owned(written)
            self.note(written)
        return written

    def read_back(self, old: GangRecord, cur: GangRecord, *, applied: bool) -> None:
        """``cur`` was read back after a write based on ``old`` whose reply
        was lost: counted and kept; ``applied``: the write did apply, so the
        events waiting for it went with it."""
        self._count(old, cur)
        self.book.owned(cur)
        if applied:
            self._unwritten_events.pop(cur.id, None)

    def ride_on_next_write(self, gang_id: str, events: list[gang_events.GangEvent]) -> None:
        """``events`` go into the gang's history with its next write."""
        self._unwritten_events[gang_id] = events

    def _count(self, old: GangRecord | None, after: GangRecord) -> None:
        """Count in the metrics what ``after`` (written, or found in etcd)
        changed since the state last counted for the gang (else since
        ``old``, the record the write was based on): exactly once per change
        even when two writes race or one's reply was lost."""
        before = self._counted.get(after.id)
        if before is None and old is not None:
            before = step_of(old)
        self._counted[after.id] = step_of(after)
        self.lead.metrics.gang_changed(before, after, self.lead.wall())

    def note(self, g: GangRecord) -> None:
        """The collector's index (coordinator/retention.py): every gang
        record this leadership reads or writes passes here."""
        if g.owner_az == self.lead.az and g.state.terminal:
            # When *this* process first knew it finished (monotonic): the
            # record's wall time comes from another replica's clock, so a
            # skewed or stepped clock must not shorten a client's retry window.
            self.book.finished_seen(FinishedGang.of(g), self.lead.mono())
        else:
            self.book.not_finished(g.id)

    def when_forgotten(self, forget: Callable[[str], None]) -> None:
        """Call ``forget(gang_id)`` too when a gang is forgotten."""
        self._on_forget.append(forget)

    def forget_gang(self, gang_id: str) -> None:
        """The gang was collected (deleted from etcd after its retention):
        drop whatever this leadership still remembers of it."""
        self.book.not_finished(gang_id)
        self._counted.pop(gang_id, None)
        self.book.forgotten(gang_id)
        self._unwritten_events.pop(gang_id, None)
        for forget in self._on_forget:
            forget(gang_id)

    # ------------------------------------------------------ writes in flight
    def busy(self, gang_id: str) -> bool:
        """Whether a write for the gang is in flight here: then nothing else
        decides about it (admission skips it, evaluation waits for the next
        report or tick), so two decisions never race on one record."""
        return gang_id in self._inflight

    def start_acting(self, gang_id: str) -> None:
        """The gang is busy from now until ``done_acting`` (a write whose
        task is spawned later: the admission cycle's reserve)."""
        self._inflight.add(gang_id)

    def done_acting(self, gang_id: str) -> None:
        self._inflight.discard(gang_id)

    @contextlib.contextmanager
    def acting_on(self, gang_id: str) -> Iterator[None]:
        """The gang is busy for the duration of a write."""
        self._inflight.add(gang_id)
        try:
            yield
        finally:
            self._inflight.discard(gang_id)
