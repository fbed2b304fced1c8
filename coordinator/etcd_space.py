"""Watching etcd's space (docs/etcd-keys.md "When etcd is full").

Every coordinator, leader or not, reads etcd's database size and alarms
every ``Timings.etcd_space_poll_s`` (``Store.space``), exports them with
the configured quota (``CoordinatorConfig.etcd_quota_bytes``: etcd does not
report its own) as metrics, and logs once per change of level
(``core.etcd_space.notice``): at ERROR, with the recovery steps, when etcd
passes 80 % of its quota or raises its NOSPACE alarm. ``phalanx status``
reads etcd afresh (``GangServicer.ClusterStatus``), not this loop's copy.

With ``--etcd-compact-retention`` the same reading samples etcd's revision,
and the AZ's leader compacts etcd's history to the sample that old
(``core.compaction.plan``; docs/etcd-keys.md "Compaction": off by default).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from coordinator.core import compaction
from coordinator.core.etcd_space import NOSPACE, EtcdSpace, SpaceLevel, notice
from coordinator.metrics import CoordinatorMetrics
from phalanx.errors import StoreDenied
from phalanx.store import Store, StoreUnavailable

log = logging.getLogger(__name__)


class EtcdSpaceWatch:
    """``leading``: whether this coordinator leads its AZ now; with
    ``compact_retention_s`` (> 0) a leader also compacts etcd's history
    to the revision it read that long ago (core/compaction.py)."""

    def __init__(self, store: Store, quota: int, interval_s: float, metrics: CoordinatorMetrics, *,
                 compact_retention_s: float = 0.0, leading: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.quota = quota
        self.interval_s = interval_s
        self.metrics = metrics
        self.level: SpaceLevel | None = None  # of the last reading; None before the first
        self.compact_retention_s = compact_retention_s
        self.leading = leading
        self.clock = clock
        self.samples: tuple[compaction.Sample, ...] = ()
        self.compacted = 0  # the newest revision this process compacted etcd to (or found it past)
        self.compact_refused = False  # logged once per change

    async def read(self) -> EtcdSpace:
        """One reading, exported and judged."""
        report = await self.store.space()
        space = EtcdSpace(db_size=report.db_size, quota=self.quota, alarms=report.alarms)
        self.metrics.etcd_space(report.db_size, report.db_size_in_use, self.quota, NOSPACE in report.alarms)
        said = notice(self.level, space)
        if said is not None:
            log.log(logging.ERROR if said.error else logging.INFO, "%s (etcd member %s)", said.text, report.member)
        self.level = space.level
        if self.compact_retention_s > 0 and report.revision:
            await self.compact(report.revision)
        return space

    async def compact(self, revision: int) -> None:
        """Sample ``revision``; as the AZ's leader, compact to the sample
        ``compact_retention_s`` old. A follower keeps sampling, so that a
        new leader has the history it needs at once."""
        now = self.clock()
        self.samples, target = compaction.plan(self.samples + (compaction.Sample(now, revision),), now,
                                               self.compact_retention_s, self.compacted)
        if target is None or not self.leading():
            return
        try:
            done = await self.store.compact(target)
        except StoreDenied as exc:
            self.metrics.etcd_compaction("refused")
            if not self.compact_refused:
                log.error("--etcd-compact-retention: etcd refused this coordinator's compaction (%s); etcd versions "
                          "with the fix of CVE-2026-33413 let only an administrator compact: set etcd's own "
                          "--auto-compaction-mode periodic --auto-compaction-retention instead, and turn this off "
                          "(docs/etcd-keys.md \"Compaction\")", exc)
            self.compact_refused = True
            return
        if self.compact_refused:
            log.info("--etcd-compact-retention: etcd compacts again (to revision %d)", target)
        self.compact_refused = False
        self.compacted = target
        self.metrics.etcd_compaction("compacted" if done else "already")
        log.debug("compacted etcd's history to revision %d (%s)", target, "done" if done else "already past it")

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                await self.read()
            except StoreUnavailable as exc:
                # Every other part of the coordinator says etcd is down; the
                # next reading tells the level again.
                log.info("cannot read etcd's space: %s", exc)
            try:
                await asyncio.wait_for(stopping.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
