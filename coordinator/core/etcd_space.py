"""How full etcd is, and what to say when that changes (docs/etcd-keys.md
"When etcd is full").

etcd refuses every write once its database reaches ``--quota-backend-bytes``
and raises the NOSPACE alarm; nothing recovers until an operator compacts,
defragments and disarms it. A coordinator reads the database size and the
alarms every ``Timings.etcd_space_poll_s`` (coordinator/etcd_space.py); this
module judges the reading (ok, warning from ``WARN_FRACTION`` of the quota,
alarm) and says, once per change of that judgement, what the operator must
do. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# The warning starts at this share of the quota: room left for the
# operator to lower retention or raise the quota before writes stop.
WARN_FRACTION = 0.8
NOSPACE = "NOSPACE"

# The documented procedure (docs/etcd-keys.md "When etcd is full"), in the
# log line so the one who reads the alert has it at hand.
RECOVERY = ("recover with etcdctl as etcd's root user: `etcdctl endpoint status -w json` (the revision), "
            "`etcdctl compaction <revision>`, `etcdctl defrag` (every member), `etcdctl alarm disarm`; then keep fewer "
            "finished gangs (--max-finished-gangs/--max-finished-bytes) or raise --quota-backend-bytes with "
            "--etcd-quota-bytes (docs/etcd-keys.md \"When etcd is full\")")


class SpaceLevel(str, Enum):
    OK = "ok"
    WARNING = "warning"  # at or past WARN_FRACTION of the quota
    ALARM = "alarm"  # etcd's NOSPACE alarm is active: every write is refused


@dataclass(frozen=True)
class EtcdSpace:
    db_size: int  # bytes of the answering member's database file
    quota: int  # --quota-backend-bytes as configured (etcd does not report it)
    alarms: tuple[str, ...] = ()  # active alarms, by name

    @property
    def fraction(self) -> float:
        return self.db_size / self.quota if self.quota > 0 else 0.0

    @property
    def level(self) -> SpaceLevel:
        if NOSPACE in self.alarms:
            return SpaceLevel.ALARM
        if self.quota > 0 and self.db_size >= WARN_FRACTION * self.quota:
            return SpaceLevel.WARNING
        return SpaceLevel.OK

    def describe(self) -> str:
        """``etcd database 1.6 GiB of 2.0 GiB quota (80 %)``, plus the alarms."""
        text = f"etcd database {_size(self.db_size)} of {_size(self.quota)} quota ({self.fraction:.0%})"
        return text + (f", alarms: {', '.join(self.alarms)}" if self.alarms else "")


@dataclass(frozen=True)
class SpaceNotice:
    """A line to log when the level changed; ``error``: log it at ERROR."""

    error: bool
    text: str


def notice(before: SpaceLevel | None, now: EtcdSpace) -> SpaceNotice | None:
    """What to log after a reading, given the level of the reading before
    (None: the first one). Nothing when the level did not change, or when a
    coordinator's first reading is simply ok."""
    level = now.level
    if level == before or (before is None and level == SpaceLevel.OK):
        return None
    if level == SpaceLevel.ALARM:
        return SpaceNotice(True, f"etcd's space alarm (NOSPACE) is active: {now.describe()}; etcd refuses every "
                                 f"write, so no gang is admitted, started or finished; {RECOVERY}")
    if level == SpaceLevel.WARNING:
        return SpaceNotice(True, f"etcd is nearly full: {now.describe()}, warning from {WARN_FRACTION:.0%}; at the "
                                 f"quota etcd raises its space alarm and refuses every write; {RECOVERY}")
    return SpaceNotice(False, f"etcd has room again: {now.describe()}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
