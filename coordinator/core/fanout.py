"""Bounded fan-out of one etcd watch to many client streams: the decisions,
without I/O (the driver is coordinator/broadcast.py; docs/events.md
"Bounds and resume").

- ``StreamCaps``: open watch streams per identity and in all; a stream past
  either cap is refused with a message naming the cap and the count.
- ``StreamBuffer``: what one stream has not yet written, at most ``bound``
  changes; one more and the stream is to be dropped (never queued without
  bound), its buffer emptied at once.
- ``History``: the last ``bound`` changes, so that a stream reopened with the
  revision it last received resumes from there without re-reading etcd;
  ``History.since`` says None when that revision is older than what is kept.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Generic, Iterable, TypeVar

T = TypeVar("T")

PER_IDENTITY_FLAG = "--watch-streams-per-identity"
TOTAL_FLAG = "--watch-streams-total"
BUFFER_FLAG = "--watch-buffer"
HISTORY_FLAG = "--watch-history"


@dataclass(frozen=True)
class StreamLimits:
    """The caps and bounds (coordinator flags; defaults in docs/limits.md)."""

    per_identity: int = 64
    total: int = 1024
    buffer: int = 1024
    history: int = 4096

    def errors(self) -> list[str]:
        out = []
        for name, flag in (("per_identity", PER_IDENTITY_FLAG), ("total", TOTAL_FLAG),
                           ("buffer", BUFFER_FLAG), ("history", HISTORY_FLAG)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                out.append(f"{flag} must be a whole number of at least 1, got {v!r}")
        return out


class StreamCaps:
    """Open streams per identity and in all."""

    def __init__(self, per_identity: int, total: int) -> None:
        self.per_identity = per_identity
        self.total = total
        self._open: Counter[str] = Counter()

    @property
    def open_total(self) -> int:
        return sum(self._open.values())

    def open_of(self, identity: str) -> int:
        return self._open[identity]

    def top(self) -> int:
        """The most streams one identity holds open."""
        return max(self._open.values(), default=0)

    def refusal(self, identity: str) -> tuple[str, str]:
        """("", "") when one more stream of ``identity`` fits; else the cap
        it would pass ("per_identity" or "total") and the message saying so."""
        mine, total = self._open[identity], self.open_total
        if mine >= self.per_identity:
            return "per_identity", (f"watch streams: {identity} has {mine} open, the per-identity cap is "
                                    f"{self.per_identity} ({PER_IDENTITY_FLAG}); close one first")
        if total >= self.total:
            return "total", (f"watch streams: this coordinator has {total} open, the total cap is {self.total} "
                             f"({TOTAL_FLAG}); try another coordinator or later")
        return "", ""

    def admit(self, identity: str) -> tuple[str, str]:
        cap, why = self.refusal(identity)
        if not cap:
            self._open[identity] += 1
        return cap, why

    def release(self, identity: str) -> None:
        self._open[identity] -= 1
        if self._open[identity] <= 0:
            del self._open[identity]


def slow_reader(bound: int) -> str:
    return (f"watch stream dropped: its reader fell more than {bound} changes behind (the per-stream buffer bound, "
            f"{BUFFER_FLAG}); reopen with after_revision set to the last revision received to resume")


class StreamBuffer(Generic[T]):
    """At most ``bound`` items; ``offer`` past that empties it and says so."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.items: deque[T] = deque()
        self.overflowed = False

    def offer(self, item: T) -> bool:
        """False when the item does not fit: the stream is to be dropped
        (the buffer is emptied and takes nothing more)."""
        if self.overflowed:
            return False
        if len(self.items) >= self.bound:
            self.overflowed = True
            self.items.clear()
            return False
        self.items.append(item)
        return True

    def take(self) -> list[T]:
        out = list(self.items)
        self.items.clear()
        return out


class History(Generic[T]):
    """The last ``bound`` changes in revision order. ``floor``: every change
    with a revision above it is held (the revision the history starts
    after: the watch's first read, then the newest change let go)."""

    def __init__(self, bound: int, floor: int) -> None:
        self.bound = bound
        self.floor = floor
        self._items: deque[Any] = deque()

    def add(self, change: Any) -> None:
        self._items.append(change)
        while len(self._items) > self.bound:
            gone = self._items.popleft()
            self.floor = max(self.floor, gone.revision)

    def since(self, after: int) -> list[Any] | None:
        """The changes after revision ``after``, or None when some of them
        are no longer held (``after`` is below the floor)."""
        if after < self.floor:
            return None
        return [c for c in self._items if c.revision > after]

    def __len__(self) -> int:
        return len(self._items)


def after_compaction(kept: Iterable[str], read: Iterable[tuple[str, int]], position: int) -> tuple[list[str], list[str]]:
    """What a watch that missed history (compacted) tells its streams from a
    fresh read of every gang: the gangs it kept that are gone (deleted
    meanwhile), and the gangs read that changed after ``position`` (the
    last revision it had sent; ``read``: id and mod_revision). The others
    have nothing new."""
    now = dict(read)
    gone = [gid for gid in kept if gid not in now]
    changed = [gid for gid, mod in now.items() if mod > position]
    return gone, changed


def unseen_events(seen_seq: int, events: Any) -> list[Any]:
    """The events of one gang a cluster stream has not sent yet: those with
    a ``seq`` above the highest it saw for that gang (``seq`` is 1, 2, ...
    per gang and never reused, and every write carries the whole list)."""
    return [e for e in events if e.seq > seen_seq]


def last_seq(events: Iterable[Any]) -> int:
    return max((e.seq for e in events), default=0)
