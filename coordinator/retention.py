"""Garbage collection of finished gangs (docs/etcd-keys.md "Retention").

Without it every finished gang, its ``idempotency/<key>`` and its cross-AZ
``decisions/<gang>/<inc>`` keys stay in etcd for ever, and every leader's
rebuild reads them all: etcd's space quota and the takeover time grow with
the number of gangs ever submitted.

The owner AZ's leader collects its own finished gangs, and only those
(``gang.owner_az``): a ``GangCollector`` lives and dies with one
leadership. It reads the book's index of the finished gangs it owns (kept
by ``GangWriter.note``: the rebuild and every gang write of this leader
pass there), and every
``Timings.gc_interval_s`` sweeps at most ``MAX_PER_SWEEP`` gangs that ended
more than ``gang_retention_s`` ago, or are the oldest beyond this AZ's
``max_finished_gangs`` / ``max_finished_bytes`` (docs/etcd-keys.md
"Retention by count and bytes"; ``core.retention.due_for_collection``),
one fenced txn at a time, each well under etcd's 128 operations. A gang is
deleted together with

- its ``idempotency/<key>``, only if that key still names this gang;
- every ``decisions/<gang>/*`` key (one range delete);
- and ``expired/<gang>`` written in its place (what GetGang says of it),
  of which at most ``max_expired_ids`` are kept, the oldest trimmed first;

and only if, in the same txn, its record is unchanged since we read it (a
concurrent write wins), no AZ holds a reservation for it and no member
summary of it is left (a participant that has not released it yet).
"""

from __future__ import annotations

import asyncio
import logging
from coordinator.book import Book
from coordinator.core.records import UNREADABLE, GangRecord, IdempotencyRecord, read_records
from coordinator.core.retention import FinishedGang, due_for_collection, expired_to_trim
from coordinator.election import LeaseLost
from phalanx.store import KV, Compare, Delete, Get, Put, StoreUnavailable, absent, none_under, unchanged, unchanged_since
from coordinator.gang_writer import GangWriter
from coordinator.leadership import Leadership
from phalanx.errors import NotLeader

log = logging.getLogger(__name__)

# Gangs one sweep collects at most: with the default one sweep a minute this
# is ~290k gangs a day, far above any submission rate, while a backlog (a
# fleet that just upgraded) drains without a burst of writes.
MAX_PER_SWEEP = 200
# Compares + operations per txn: half of etcd's --max-txn-ops (128), so a
# batch never meets the limit whatever the number of AZs.
TXN_BUDGET = 64


class GangCollector:
    def __init__(self, lead: Leadership, book: Book, writer: GangWriter):
        self.lead = lead
        self.az = lead.az
        self.keys = lead.keys
        self.book = book  # finished gangs and when this leader first saw them (coordinator/book.py)
        # Keeps the index of finished gangs (GangWriter.note) and forgets a collected one.
        self.writer = writer
        self.collected = 0  # this leadership's total (logged)

    # ------------------------------------------------------------- sweeps
    async def run(self) -> None:
        """A leader task: sweep every gc_interval_s until the leadership ends."""
        interval = self.lead.timings.gc_interval_s
        pause = interval
        while not self.lead.stopped.is_set():
            await asyncio.sleep(pause)
            pause = interval
            try:
                if await self.sweep() >= MAX_PER_SWEEP:
                    # A backlog: keep draining at a bounded pace instead of
                    # MAX_PER_SWEEP a minute, which a busy fleet outruns.
                    pause = self.lead.timings.gc_backlog_pause_s
            except StoreUnavailable as exc:
                # Every write is fenced and guarded: the next sweep retries.
                log.info("gang collection in %s: %s", self.az, exc)
            except (NotLeader, LeaseLost, asyncio.CancelledError):
                raise  # the leadership ends (AzLeader._spawn)
            except Exception:  # noqa: BLE001 - one bad record must not stop collection for good
                log.exception("gang collection in %s failed; next sweep in %gs", self.az, interval)

    def _recently_seen(self) -> set[str]:
        """Gangs this leader has known finished for less than a client's
        submit retry window, on its own monotonic clock."""
        now, window = self.lead.mono(), self.lead.timings.submit_retry_window_s
        return {g for g, t in self.book.seen_mono.items() if now - t < window}

    def _due(self, held: set[str], limit: int) -> list[FinishedGang]:
        return due_for_collection(self.book.finished.values(), az=self.az, now=self.lead.wall(),
                                  retention_s=self.lead.timings.gang_retention_s, limit=limit,
                                  held=held | self._recently_seen(), max_kept=self.lead.config.max_finished_gangs,
                                  max_kept_bytes=self.lead.config.finished_bytes_bound)

    async def sweep(self) -> int:
        """One sweep; returns how many gangs were collected."""
        if not self._due(self.book.held_here(), limit=1):
            return 0
        k = self.keys
        # Which gangs still have a reservation (any AZ) or a member summary:
        # skipped now, and compared again in the txn.
        self.lead.check_valid()
        # Keys only, in pages at one revision (docs/limits.md "Paged reads"):
        # the reply does not grow with the number of gangs held.
        rev = await self.lead.store.revision()
        res_keys, _ = await self.lead.store.get_prefix_paged(k.reservations(), keys_only=True, revision=rev)
        sum_keys, _ = await self.lead.store.get_prefix_paged(k.member_summaries(), keys_only=True, revision=rev)
        reserved: set[str] = set()
        azs: set[str] = {self.az}
        for kv in res_keys:
            az, _, gang = kv.key[len(k.reservations()):].partition("/")
            azs.add(az)
            reserved.add(gang)
        summarised = {kv.key[len(k.member_summaries()):].split("/", 1)[0] for kv in sum_keys}
        # The cap applies after this filter: gangs held elsewhere (another
        # AZ's leaderless participant, say) must not fill every sweep and
        # starve the collectable ones behind them.
        due = self._due(self.book.held_here() | reserved | summarised, limit=MAX_PER_SWEEP)
        if not due:
            return await self._trim_expired()
        collected = 0
        batch: list[FinishedGang] = []
        for g in due:
            if batch and self._cost(batch + [g], azs) > TXN_BUDGET:
                collected += await self._collect(batch, azs)
                batch = []
            batch.append(g)
        if batch:
            collected += await self._collect(batch, azs)
        if collected:
            self.collected += collected
            self.lead.metrics.gangs_collected.inc(collected)
            log.info("collected %d finished gang(s) in %s (older than gang_retention_s=%gs, or beyond "
                     "max_finished_gangs=%d / max_finished_bytes=%d; %d this leadership)", collected, self.az,
                     self.lead.timings.gang_retention_s, self.lead.config.max_finished_gangs, self.lead.config.finished_bytes_bound,
                     self.collected)
        await self._trim_expired()
        return collected

    async def _trim_expired(self) -> int:
        """Keep at most ``max_expired_ids`` of the ``expired/`` keys, the
        oldest deleted first: a count (no key sent) per sweep, and a
        keys-only read of the excess only when there is one. Every AZ's
        leader trims the same cluster-wide set; two that trim at once delete
        the same oldest keys, which is harmless."""
        k = self.keys
        self.lead.check_valid()
        n = expired_to_trim(await self.lead.store.count_under(k.expired()), self.lead.config.max_expired_ids,
                            MAX_PER_SWEEP)
        if not n:
            return 0
        oldest = await self.lead.store.oldest_under(k.expired(), n)
        for i in range(0, len(oldest), TXN_BUDGET - 1):
            self.lead.check_valid()
            await self.lead.store.fenced_txn(self.lead.fence, [], [Delete(kv.key) for kv in oldest[i:i + TXN_BUDGET - 1]])
        log.info("deleted the %d oldest expired gang id(s) beyond max_expired_ids=%d", len(oldest),
                 self.lead.config.max_expired_ids)
        return 0

    @staticmethod
    def _cost(batch: list[FinishedGang], azs: set[str]) -> int:
        # Per gang: compares (record, summaries, one per AZ, idempotency key)
        # and ops (record, decisions, idempotency key, expired id); plus the fence.
        return 1 + sum(2 + len(azs | g.azs) + 1 + 4 for g in batch)

    async def _collect(self, batch: list[FinishedGang], azs: set[str]) -> int:
        """Delete ``batch`` in one fenced txn; on a lost compare, gang by gang
        (so one gang changed concurrently does not hold the others back)."""
        k = self.keys
        # The idempotency keys, to delete each only while it names its gang.
        reads = [Get(k.idempotency(g.idempotency_key)) for g in batch if g.idempotency_key]
        self.lead.check_valid()
        idem = iter((await self.lead.store.txn([], reads)).results if reads else ())
        plans = []
        for g in batch:
            kvs = next(idem) if g.idempotency_key else ()
            compares: list[Compare] = [
                unchanged_since(k.gang(g.id), g.mod_revision),
                none_under(k.member_summaries(g.id)),
                *(absent(k.reservation(az, g.id)) for az in sorted(azs | g.azs)),
            ]
            ops: list = [Delete(k.gang(g.id)), Delete(k.decisions(g.id), prefix=True)]
            if self.lead.config.max_expired_ids:
                # What GetGang answers once the record is gone: "finished and expired".
                ops.append(Put(k.expired(g.id), g.expired(collected_at=self.lead.wall()).to_dict()))
            if kvs and _names(kvs[0], g.id):
                compares.append(unchanged(kvs[0]))
                ops.append(Delete(kvs[0].key))
            plans.append((g, compares, ops))
        if len(plans) > 1:
            self.lead.check_valid()
            res = await self.lead.store.fenced_txn(self.lead.fence, [c for _, cs, _ in plans for c in cs],
                                                [o for _, _, os_ in plans for o in os_])
            if res.succeeded:
                for g, _, _ in plans:
                    self.writer.forget_gang(g.id)
                return len(plans)
        collected = 0
        for g, compares, ops in plans:
            self.lead.check_valid()
            res = await self.lead.store.fenced_txn(self.lead.fence, compares, ops, [Get(k.gang(g.id))])
            if res.succeeded:
                self.writer.forget_gang(g.id)
                collected += 1
                continue
            kvs = res.results[0]
            if not kvs:
                self.writer.forget_gang(g.id)  # gone already
            else:
                read, bad = read_records(kvs[:1], GangRecord.from_dict)
                for cur in read:
                    self.writer.note(cur)  # changed (or still held somewhere): judged again next sweep
                if bad:
                    self.writer.forget_gang(g.id)  # no longer a record this leader can judge: not collected by it
                    log.warning("gang %s not collected: its record is unreadable now: %s", g.id, bad[0][1])
                else:
                    log.info("gang %s not collected: changed concurrently or still held", g.id)
        return collected


def _names(kv: KV, gang: str) -> bool:
    """The idempotency record ``kv`` names ``gang``. One that cannot be read
    names nobody: it is left for an operator, never deleted on a guess."""
    try:
        return IdempotencyRecord.from_dict(kv.json()).id == gang
    except UNREADABLE:
        log.warning("retention: idempotency record %s cannot be read; left in place", kv.key[:200])
        return False
