"""Watching etcd's space (docs/etcd-keys.md "When etcd is full").

Every coordinator, leader or not, reads etcd's database size and alarms
every ``Timings.etcd_space_poll_s`` (``Store.space``), exports them with
the configured quota (``CoordinatorConfig.etcd_quota_bytes``: etcd does not
report its own) as metrics, and logs once per change of level
(``core.etcd_space.notice``): at ERROR, with the recovery steps, when etcd
passes 80 % of its quota or raises its NOSPACE alarm. ``phalanx status``
reads etcd afresh (``GangServicer.ClusterStatus``), not this loop's copy.
"""

from __future__ import annotations

import asyncio
import logging

from coordinator.core.etcd_space import NOSPACE, EtcdSpace, SpaceLevel, notice
from coordinator.metrics import CoordinatorMetrics
from phalanx.store import Store, StoreUnavailable

log = logging.getLogger(__name__)


class EtcdSpaceWatch:
    def __init__(self, store: Store, quota: int, interval_s: float, metrics: CoordinatorMetrics):
        self.store = store
        self.quota = quota
        self.interval_s = interval_s
        self.metrics = metrics
        self.level: SpaceLevel | None = None  # of the last reading; None before the first

    async def read(self) -> EtcdSpace:
        """One reading, exported and judged."""
        report = await self.store.space()
        space = EtcdSpace(db_size=report.db_size, quota=self.quota, alarms=report.alarms)
        self.metrics.etcd_space(report.db_size, report.db_size_in_use, self.quota, NOSPACE in report.alarms)
        said = notice(self.level, space)
        if said is not None:
            log.log(logging.ERROR if said.error else logging.INFO, "%s (etcd member %s)", said.text, report.member)
        self.level = space.level
        return space

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
