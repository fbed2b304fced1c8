"""One etcd watch on ``gangs/`` per coordinator, fanned out to every
WatchEvents and WatchGang stream it serves (docs/events.md "Bounds and
resume"). The decisions (caps, the per-stream buffer bound, what a resume
can be served from) are coordinator/core/fanout.py; this is the driver: one
task reading etcd, one bounded buffer per stream, and the gRPC writes.

A stream whose reader does not keep up is ended with RESOURCE_EXHAUSTED
naming the buffer bound as soon as its buffer is full, whatever its pending
write is doing (an abandoned reader's write never completes), so it holds
neither memory nor a slot of the caps.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable

import grpc

from coordinator import convert
from coordinator.core.fanout import (History, StreamBuffer, StreamCaps, StreamLimits, after_compaction, last_seq,
                                     slow_reader, unseen_events)
from coordinator.core.records import UNREADABLE, GangRecord, read_records
from phalanx.errors import ResourceExhausted
from phalanx.store import Compacted, StoreUnavailable
from phalanx.v1 import gang_pb2 as gpb

if TYPE_CHECKING:
    from coordinator.metrics import CoordinatorMetrics
    from phalanx.store import Store

log = logging.getLogger(__name__)

# The etcd watch resumes this many times in a row (a move to another etcd
# member breaks it once) before every stream is ended UNAVAILABLE.
WATCH_RESUMES = 5
WATCH_RESUME_PAUSE_S = 0.2
# Sent in the response headers of WatchEvents: "resumed" (every event after
# after_revision follows), "gap" (some are no longer held: the stream starts
# from now) or "new" (no after_revision was asked).
RESUME_HEADER = "x-phalanx-resume"


@dataclass(frozen=True)
class Change:
    """One gang write (or delete) as every stream sees it: the new events
    it carries, already converted (shared by every stream), and the record
    (for WatchGang; not kept in the history)."""

    revision: int
    gang_id: str
    owner: str = ""
    queue: str = ""
    events: tuple[gpb.ClusterEvent, ...] = ()
    record: GangRecord | None = None
    deleted: bool = False


class StreamEnded(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Stream:
    """One client stream's subscription: a bounded buffer of the changes it
    wants, woken when one arrives or when it is ended."""

    def __init__(self, hub: "Broadcaster", identity: str, wants: Callable[[Change], bool], bound: int) -> None:
        self.hub = hub
        self.identity = identity
        self.wants = wants
        self.after = 0  # changes at or below this revision are not sent (a resume's)
        self.buffer: StreamBuffer[Change] = StreamBuffer(bound)
        self.replay: list[Change] = []  # a resume's held changes (shared with the history), sent first
        self.ended: StreamEnded | None = None
        self.resume = "new"
        self.opened_at = 0  # the revision it was subscribed at: every later change is offered to it
        self._wake = asyncio.Event()
        self._ended = asyncio.Event()
        self._closed = False

    def offer(self, change: Change) -> None:
        if self.ended is not None or change.revision <= self.after or not self.wants(change):
            return
        if not self.buffer.offer(change):
            self.hub.dropped("slow")
            self.end(StreamEnded(grpc.StatusCode.RESOURCE_EXHAUSTED, slow_reader(self.buffer.bound)))
            return
        self._wake.set()

    def end(self, why: StreamEnded) -> None:
        if self.ended is None:
            self.ended = why
            self.hub.unsubscribe(self)
            self._wake.set()
            self._ended.set()

    async def next(self) -> list[Change]:
        """The changes buffered (waiting for one); StreamEnded once ended
        and empty."""
        while True:
            items, self.replay = self.replay + self.buffer.take(), []
            if items:
                return items
            if self.ended is not None:
                raise self.ended
            self._wake.clear()
            await self._wake.wait()

    async def wait_ended(self) -> None:
        await self._ended.wait()

    def close(self) -> None:
        """The call is over: unsubscribe and give its slot back (once)."""
        if not self._closed:
            self._closed = True
            self.hub.unsubscribe(self)
            self.hub.release(self)


class Broadcaster:
    """The coordinator's one watch on ``gangs/``, started with the
    coordinator (or by the next stream) and kept; ended (every stream UNAVAILABLE) only when etcd keeps
    failing, and then started again by the next stream."""

    def __init__(self, store: "Store", limits: StreamLimits, metrics: "CoordinatorMetrics | None" = None) -> None:
        self.store = store
        self.limits = limits
        self.metrics = metrics
        self.caps = StreamCaps(limits.per_identity, limits.total)
        self.position = 0  # the newest revision every stream has been offered
        self.history: History[Change] = History(limits.history, 0)
        self._prefix = store.keys.gangs()
        self._subs: set[Stream] = set()
        self._seen: dict[str, int] = {}  # the highest event seq of every kept gang
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None

    async def open(self, identity: str, wants: Callable[[Change], bool], *, after: int = 0) -> Stream:
        """A new stream of ``identity`` (ResourceExhausted naming the cap
        past either cap; nothing is opened then). ``after`` > 0: the changes
        after that revision still held are buffered first (``resume``
        "resumed"), else the stream starts from now (``resume`` "gap")."""
        cap, why = self.caps.admit(identity)
        if cap:
            if self.metrics is not None:
                self.metrics.watch_refused(cap)
            raise ResourceExhausted(why)
        stream = Stream(self, identity, wants, self.limits.buffer)
        try:
            await self._started()
        except BaseException:
            stream.close()
            raise
        if after > 0:
            held = self.history.since(after)
            if held is None:
                stream.resume = "gap"
            else:
                stream.resume, stream.after = "resumed", after
                stream.replay = [c for c in held if stream.wants(c)]
        stream.opened_at = self.position
        self._subs.add(stream)
        self._count()
        return stream

    def unsubscribe(self, stream: Stream) -> None:
        self._subs.discard(stream)

    def release(self, stream: Stream) -> None:
        self.caps.release(stream.identity)
        self._count()

    def dropped(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.watch_dropped(reason)

    def _count(self) -> None:
        if self.metrics is not None:
            self.metrics.watch_streams(self.caps.open_total, self.caps.top())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def start(self) -> None:
        """Start the watch now (the coordinator's start), so that its
        history covers a stream that resumes here after another coordinator
        went away; a failure here is retried by the next stream."""
        if self._task is None or self._task.done():
            self._ready = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._run(self._ready), name="watch-broadcast")

    async def _started(self) -> None:
        self.start()
        assert self._ready is not None
        await asyncio.shield(self._ready)

    async def _run(self, ready: asyncio.Future[None]) -> None:
        try:
            start = await self._baseline() + 1
        except Exception as exc:  # noqa: BLE001 - the waiting opens get it; the next open tries again
            ready.set_exception(exc)
            ready.exception()  # (retrieved: no "never retrieved" warning when nobody waits)
            return
        ready.set_result(None)
        breaks = 0  # consecutive broken watches without an event in between
        try:
            while True:
                try:
                    async for batch in self.store.watch_prefix(self._prefix, start):
                        breaks = 0
                        for ev in batch:
                            start = ev.revision + 1
                            self._apply(ev)
                except Compacted:
                    # Missed history: re-read every gang, offer what changed.
                    start = await self._resync() + 1
                except StoreUnavailable:
                    # A watch breaks when the store moves to another etcd
                    # member (docs/etcd-keys.md "Endpoints and failover").
                    breaks += 1
                    if breaks > WATCH_RESUMES:
                        raise
                    await asyncio.sleep(WATCH_RESUME_PAUSE_S)
        except asyncio.CancelledError:
            self._end_all(StreamEnded(grpc.StatusCode.UNAVAILABLE, "the coordinator is stopping"))
            raise
        except Exception as exc:  # noqa: BLE001 - every stream learns why; the next open starts afresh
            log.warning("gang watch ended: %s", exc)
            self.dropped("unavailable")
            self._end_all(StreamEnded(grpc.StatusCode.UNAVAILABLE, f"the coordinator's gang watch ended: {exc}"))

    def _end_all(self, why: StreamEnded) -> None:
        for s in list(self._subs):
            s.end(why)

    async def _read(self) -> tuple[list[GangRecord], int]:
        kvs, rev = await self.store.get_prefix_paged(self._prefix)
        gangs, bad = read_records(kvs, GangRecord.from_dict)
        if bad:
            log.warning("gang watch skipped %d unreadable gang record(s), e.g. %s: %s", len(bad), *bad[0])
        return gangs, rev

    async def _baseline(self) -> int:
        """Where every gang stands (the highest seq of each), read once for
        all streams: a stream that opens later sends only what follows."""
        gangs, rev = await self._read()
        self._seen = {g.id: last_seq(g.events) for g in gangs}
        self.position = rev
        self.history = History(self.limits.history, rev)
        return rev

    async def _resync(self) -> int:
        gangs, rev = await self._read()
        gone, changed = after_compaction(list(self._seen), [(g.id, g.mod_revision) for g in gangs], self.position)
        for gid in gone:
            self._seen.pop(gid, None)
            self._publish(Change(rev, gid, deleted=True))
        by_id = {g.id: g for g in gangs}
        for gid in changed:
            self._publish(self._change(by_id[gid], rev))
        self.position = max(self.position, rev)
        return rev

    def _apply(self, ev: Any) -> None:
        gid = ev.kv.key[len(self._prefix):]
        if ev.kind == "delete":
            self._seen.pop(gid, None)
            self._publish(Change(ev.revision, gid, deleted=True))
            return
        try:
            g = GangRecord.from_dict(ev.kv.json(), ev.kv.mod_revision)
        except UNREADABLE as exc:
            log.warning("gang watch skipped unreadable gang record %s: %s", ev.kv.key, exc)
            return
        self._publish(self._change(g, ev.revision))

    def _change(self, g: GangRecord, revision: int) -> Change:
        before = self._seen.get(g.id, 0)
        self._seen[g.id] = max(before, last_seq(g.events))
        events = tuple(cluster_event(g, e, revision) for e in unseen_events(before, g.events))
        return Change(revision, g.id, g.owner, g.spec.queue, events, g)

    def _publish(self, change: Change) -> None:
        self.position = max(self.position, change.revision)
        if change.events:
            self.history.add(replace(change, record=None))
        for s in list(self._subs):
            s.offer(change)


def cluster_event(g: GangRecord, e: Any, revision: int) -> gpb.ClusterEvent:
    return gpb.ClusterEvent(gang_id=g.id, gang_name=g.spec.name, queue=g.spec.queue, event=convert.event_to_pb(e),
                            revision=revision)


async def serve(context: grpc.aio.ServicerContext, stream: Stream,
                messages: Callable[[Change], tuple[Iterable[Any], bool]]) -> None:
    """Write the stream's changes as ``messages`` turns them into replies
    (and says, second, whether that was the last); end the call with the
    stream's status once it is ended, even while a write waits on a reader
    that never reads (the write is let go; the call returns)."""
    ended = asyncio.ensure_future(stream.wait_ended())
    try:
        while True:
            try:
                changes = await stream.next()
            except StreamEnded as why:
                context.set_code(why.code)
                context.set_details(why.message)
                return
            for change in changes:
                replies, last = messages(change)
                for reply in replies:
                    write = asyncio.ensure_future(context.write(reply))
                    await asyncio.wait({write, ended}, return_when=asyncio.FIRST_COMPLETED)
                    if not write.done():
                        write.cancel()
                        assert stream.ended is not None
                        context.set_code(stream.ended.code)
                        context.set_details(stream.ended.message)
                        return
                    write.result()
                if last:
                    return
    finally:
        ended.cancel()
