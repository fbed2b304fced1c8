"""Per-AZ leader election on etcd leases (docs/design.md §5).

Shaped after etcd's ``client/v3/concurrency/{session,election}.go``:

- ``LeaseSession``: one lease, kept alive every ``keepalive_interval_s`` on a
  stream. It is *locally* valid until (send time of the last acknowledged
  keepalive) + TTL - margin, on this process's monotonic clock. When that
  passes, ``lost`` is set and the leader must stop acting at once — even if
  etcd has not yet expired the lease: a paused process (SIGSTOP, GC) that wakes
  up finds itself invalid before it can write anything.
- ``Election``: campaign = txn ``create_revision(leader/<az>) == 0`` → put with
  our lease. The epoch (fencing token) is the leader key's create_revision,
  monotonic across elections. Every later write is guarded by
  ``create_revision(leader/<az>) == epoch`` (``Store.fenced_txn``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from phalanx import failpoints
from phalanx.timings import Timings
from phalanx.errors import NotLeader
from phalanx.leader_record import BadLeaderRecord, LeaderInfo
from phalanx.store import Compacted, Compare, Delete, Get, Put, Store, StoreUnavailable, absent, jitter

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class LeaseLost(NotLeader):
    """The session's lease expired (or may have): stop acting as leader.
    A NotLeader, so a request that meets it is answered UNAVAILABLE (retry
    elsewhere), never INTERNAL."""


class LeaseSession:
    def __init__(self, store: Store, timings: Timings, clock: Clock = time.monotonic, metrics: Any = None):
        self.store = store
        # ``metrics``: a coordinator.metrics.CoordinatorMetrics (keepalive
        # round trips and failures); None: not measured.
        self.metrics = metrics
        self.timings = timings
        self.clock = clock
        self.lease_id = 0
        self.valid_until = 0.0
        self.lost = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._ka = None

    async def start(self) -> "LeaseSession":
        sent = self.clock()
        self.lease_id = await self.store.grant_lease(self.timings.lease_ttl_s)
        self.valid_until = sent + self.timings.leader_validity_s
        self._ka = self.store.keepalive(self.lease_id)
        self._task = asyncio.create_task(self._keepalive_loop(), name=f"keepalive-{self.lease_id:x}")
        return self

    def is_valid(self) -> bool:
        return not self.lost.is_set() and self.clock() < self.valid_until

    def remaining(self) -> float:
        return self.valid_until - self.clock()

    def check(self) -> None:
        """Raise ``LeaseLost`` unless the lease is still locally valid."""
        if not self.is_valid():
            self._mark_lost("local validity expired")
            raise LeaseLost(f"lease {self.lease_id:x} may have expired")

    def step_down(self, why: str) -> None:
        """End this session's leadership now (the leader record is no longer
        what the campaign wrote): ``lost`` is set, as for an expired lease."""
        self._mark_lost(why)

    def _mark_lost(self, why: str) -> None:
        if not self.lost.is_set():
            log.warning("lease %x lost: %s", self.lease_id, why)
            self.lost.set()

    async def _keepalive_loop(self) -> None:
        t = self.timings
        assert self._ka is not None
        while not self.lost.is_set():
            # Sleep until the next keepalive, but wake to declare loss exactly
            # when local validity ends (a paused process wakes up late and
            # sees it at once).
            wait = min(t.keepalive_interval_s, max(0.0, self.remaining()))
            await asyncio.sleep(wait)
            if self.clock() >= self.valid_until:
                self._mark_lost("no keepalive acknowledged within the TTL budget")
                return
            sent = self.clock()
            try:
                ttl = await self._ka.ping(min(t.etcd_timeout_s, max(0.05, self.remaining())))
            except StoreUnavailable as exc:
                log.info("keepalive of lease %x failed: %s", self.lease_id, exc)
                if self.metrics is not None:
                    self.metrics.keepalive(None)
                    self.metrics.etcd_request("lease", self.clock() - sent, False)
                continue
            if self.metrics is not None:
                self.metrics.keepalive(self.clock() - sent)
                self.metrics.etcd_request("lease", self.clock() - sent, True)
            if ttl <= 0:
                self._mark_lost("etcd says the lease is gone")
                return
            # Never extend past what etcd just granted, measured from send time.
            self.valid_until = max(self.valid_until, sent + min(ttl, t.lease_ttl_s) - t.step_down_margin_s)

    async def close(self, revoke: bool = True) -> None:
        self.lost.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._ka is not None:
            self._ka.close()
        if revoke and self.lease_id:
            try:
                await self.store.revoke_lease(self.lease_id)
            except StoreUnavailable as exc:
                log.info("could not revoke lease %x (it will expire): %s", self.lease_id, exc)


class Election:
    def __init__(self, store: Store, az: str, coordinator_id: str, address: str, timings: Timings):
        self.store = store
        self.az = az
        self.coordinator_id = coordinator_id
        self.address = address
        self.timings = timings
        self.key = store.keys.leader(az)
        # What the campaign stores, checked now by the readers' own rules
        # (phalanx/leader_record.py): a bad id or address fails at start.
        self.value = LeaderInfo.value(coordinator_id, address)

    async def campaign(self, session: LeaseSession) -> LeaderInfo:
        """Block until this session holds the leader key; return our epoch.
        Raises ``LeaseLost`` when the session dies first."""
        value = self.value
        while True:
            session.check()
            try:
                res = await self.store.txn(
                    [absent(self.key)],
                    [Put(self.key, value, lease=session.lease_id), Get(self.key)],
                    [Get(self.key)],
                )
            except StoreUnavailable as exc:
                # Outcome unknown: the next attempt finds our own key by lease.
                log.info("campaign in %s: %s", self.az, exc)
                await asyncio.sleep(jitter(self.timings.campaign_retry_s))
                continue
            kvs = res.results[-1]
            if kvs:
                kv = kvs[0]
                if res.succeeded or kv.lease == session.lease_id:
                    session.check()
                    return LeaderInfo.from_kv(self.az, kv)
                if kv.lease == 0:
                    await self._reclaim_unleased(session, kv, res.revision)
                    continue
                log.info("%s stands by in %s: %s is led (epoch %d); waiting for the record to go",
                         self.coordinator_id, self.az, self.key, kv.create_revision)
                await self._wait_for_vacancy(session, res.revision)
            # else: deleted between compare and read; try again at once

    async def _wait_for_vacancy(self, session: LeaseSession, revision: int) -> None:
        """Wait until the current leader key is deleted or unleased (or our lease dies)."""

        async def deleted() -> None:
            start = revision + 1
            while True:
                try:
                    async for batch in self.store.watch_prefix(self.key, start, exact=True):
                        for ev in batch:
                            start = ev.revision + 1
                            if ev.kind == "delete" or ev.kv.lease == 0:
                                # Gone, or rewritten bound to no lease (it
                                # would never expire): campaign again, and
                                # the campaign reclaims an unleased record.
                                return
                except (StoreUnavailable, Compacted):
                    await asyncio.sleep(jitter(self.timings.campaign_retry_s))
                    return  # re-campaign: the txn re-reads the key

        watch = asyncio.create_task(deleted())
        lost = asyncio.create_task(session.lost.wait())
        try:
            await asyncio.wait({watch, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (watch, lost):
                t.cancel()
            await asyncio.gather(watch, lost, return_exceptions=True)

    async def _reclaim_unleased(self, session: LeaseSession, kv: Any, revision: int) -> None:
        """A leader key bound to no lease was written by hand (a campaign
        always binds its lease), so it would never expire: left alone, the AZ
        stays leaderless once its leader is gone. Wait one lease TTL for the
        leader it names to notice and step down (``guard``), then delete that
        very version (compare on its mod revision). Safe while that leader
        lives: its fenced writes compare the key's create revision, which the
        next campaign changes."""
        try:
            await asyncio.wait_for(self._wait_for_vacancy(session, revision), self.timings.lease_ttl_s)
            return  # it changed or went: campaign again
        except asyncio.TimeoutError:
            pass
        session.check()
        try:
            res = await self.store.txn([Compare(self.key, "mod", "==", kv.mod_revision)], [Delete(self.key)])
        except StoreUnavailable as exc:
            log.info("reclaiming %s: %s", self.key, exc)
            return
        if res.succeeded:
            log.warning("deleted %s: it was bound to no lease (written by hand?) and unchanged for %.1f s",
                        self.key, self.timings.lease_ttl_s)

    async def guard(self, session: LeaseSession, leader: LeaderInfo) -> None:
        """While we lead: step down as soon as our record is not what the
        campaign wrote (another value, another lease or none, deleted).
        Fencing compares only the key's create revision, so without this a
        rewritten record would leave us admitting while standbys and agents
        follow another address. A record changed under our epoch is deleted
        (compare on its mod revision) so that the AZ elects again without a
        person. Returns when it stepped down, or runs until cancelled."""
        if failpoints.on("election.guard_off"):
            return  # only the fence of the next write notices (docs/failpoints.md)
        start = leader.epoch + 1  # the campaign's put is the record's creation
        while not session.lost.is_set():
            try:
                async for batch in self.store.watch_prefix(self.key, start, exact=True):
                    for ev in batch:
                        start = ev.revision + 1
                        kv = None if ev.kind == "delete" else ev.kv
                        why = record_problem(kv, self.value, session.lease_id, leader.epoch)
                        if why is not None:
                            await self._step_down(session, leader, kv, why)
                            return
            except (StoreUnavailable, Compacted):
                # Missed events: read the record itself, then watch on.
                try:
                    kv = await self.store.get(self.key)
                except StoreUnavailable:
                    await asyncio.sleep(jitter(self.timings.campaign_retry_s))
                    continue
                why = record_problem(kv, self.value, session.lease_id, leader.epoch)
                if why is not None:
                    await self._step_down(session, leader, kv, why)
                    return
                start = (kv.mod_revision + 1) if kv is not None else start

    async def _step_down(self, session: LeaseSession, leader: LeaderInfo, kv: Any, why: str) -> None:
        session.step_down(f"leader record {self.key} {why}")
        if kv is None or kv.create_revision != leader.epoch:
            return  # gone, or already someone else's: nothing of ours to remove
        try:
            await self.store.txn([Compare(self.key, "create", "==", leader.epoch),
                                  Compare(self.key, "mod", "==", kv.mod_revision)], [Delete(self.key)])
        except StoreUnavailable as exc:
            log.info("could not delete the changed %s (a standby reclaims it): %s", self.key, exc)

    async def resign(self, leader: LeaderInfo) -> None:
        """Give up leadership at once (clean shutdown), guarded by our epoch."""
        try:
            await self.store.txn([Compare(self.key, "create", "==", leader.epoch)], [Delete(self.key)])
        except StoreUnavailable as exc:
            log.info("resign in %s failed (the lease will expire): %s", self.az, exc)


def record_problem(kv: Any, value: dict[str, str], lease_id: int, epoch: int) -> str | None:
    """Why the leader record ``kv`` (None: deleted) is no longer the one our
    campaign wrote under ``epoch`` with ``lease_id``, or None while it is.
    Pure, table-tested (tests/unit/test_election_guard.py)."""
    if kv is None:
        return "was deleted"
    if kv.create_revision != epoch:
        return f"was recreated (epoch {kv.create_revision}, ours {epoch})"
    if kv.lease != lease_id:
        return f"is bound to lease {kv.lease:x}, not ours ({lease_id:x})" if kv.lease else "was detached from our lease"
    try:
        data = kv.json()
    except ValueError:
        return "was overwritten with unreadable bytes"
    if data != value:
        return "was overwritten with another value"
    return None


def _readable(az: str, kv) -> LeaderInfo | None:
    """``kv`` parsed, or None (logged) when it cannot be read: a record that
    names no dialable leader is treated as no leader (callers answer
    UNAVAILABLE and retry), never guessed at."""
    try:
        return LeaderInfo.from_kv(az, kv)
    except BadLeaderRecord as exc:
        log.warning("skipped unreadable record %s: %s", kv.key, exc)
        return None


async def observe(store: Store, az: str) -> LeaderInfo | None:
    """The current leader of ``az`` (linearizable read), or None (none, or an
    unreadable record)."""
    kv = await store.get(store.keys.leader(az))
    return _readable(az, kv) if kv else None


async def observe_all(store: Store) -> dict[str, LeaderInfo]:
    """The leader of every AZ that has a readable leader record."""
    kvs, _ = await store.get_prefix(store.keys.leaders())
    out = {}
    for kv in kvs:
        az = kv.key.rsplit("/", 1)[-1]
        info = _readable(az, kv)
        if info is not None:
            out[az] = info
    return out
