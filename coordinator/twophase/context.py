"""What every part of the two-phase driver is built with: one ``Context``
(the leadership, its book, the gang writer, what the driver asks of the
leader, the request counts and the driver's feed loop), held by each
``Part`` (docs/two-phase.md "Driver")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from coordinator.book import Book
from coordinator.gang_writer import GangWriter
from coordinator.leadership import Leadership, RunTime
from coordinator.twophase.counts import RequestCounts


@dataclass(frozen=True)
class Context:
    lead: Leadership
    book: Book  # every state of the protocol; the parts keep only their I/O
    writer: GangWriter  # every gang-record write goes through it
    run_time: RunTime  # what the driver asks of the leader (coordinator/leadership.py)
    counts: RequestCounts
    feed: Callable[..., None]  # the driver's feed loop


class Part:
    """A part of the driver (store effects, peer sender, members, watch):
    the context's members, and the leadership's AZ, store and keys."""

    def __init__(self, ctx: Context):
        self.lead, self.book, self.writer = ctx.lead, ctx.book, ctx.writer
        self.run_time, self.counts, self.feed = ctx.run_time, ctx.counts, ctx.feed
        self.az, self.store, self.keys = ctx.lead.az, ctx.lead.store, ctx.lead.keys
