"""When a leader compacts an etcd it does not run (docs/etcd-keys.md
"Compaction"). PURE: revisions and times in, a revision out.

etcd's own periodic compaction (``--auto-compaction-mode periodic``) keeps
the history of the last ``retention``: every so often it compacts to the
revision it saw ``retention`` ago. A coordinator given
``--etcd-compact-retention`` does the same from outside, for an etcd whose
operator did not set those flags: it samples etcd's revision at each space
reading (``Store.space``), and while it leads an AZ compacts to the newest
sample at least ``retention`` old. Phalanx's own watchers resume within
seconds, so minutes of history are plenty; the history a slower reader of
the same etcd needs is why the default is off.
"""

from __future__ import annotations

from dataclasses import dataclass

# The least history the option may keep, in space readings: a watcher of
# Phalanx resumes a broken stream within seconds, and one that resumes
# behind the compacted revision re-reads (correct, but a full read per
# watcher). With the default reading every 15 s: at least 150 s.
MIN_RETENTION_POLLS = 10


@dataclass(frozen=True)
class Sample:
    at: float  # monotonic seconds
    revision: int


def plan(samples: tuple[Sample, ...], now: float, retention_s: float, compacted: int) -> tuple[tuple[Sample, ...], int | None]:
    """``(samples to keep, revision to compact to or None)``: the target is
    the newest sample taken at least ``retention_s`` before ``now``, if it
    is past what was compacted already; samples older than the target are
    no longer needed (a later target is never older)."""
    old = [s for s in samples if now - s.at >= retention_s]
    if not old:
        return samples, None
    newest_old = max(old, key=lambda s: (s.at, s.revision))
    keep = tuple(s for s in samples if s.at >= newest_old.at)
    return keep, (newest_old.revision if newest_old.revision > compacted else None)


def retention_error(retention_s: float, poll_s: float) -> str | None:
    """Why ``--etcd-compact-retention`` cannot be used with these timings
    (None: it can; 0 is off)."""
    if retention_s == 0:
        return None
    if not retention_s >= MIN_RETENTION_POLLS * poll_s:
        return (f"etcd_compact_retention_s must be 0 (off) or at least {MIN_RETENTION_POLLS} x "
                f"Timings.etcd_space_poll_s ({MIN_RETENTION_POLLS * poll_s:g} s): the revision is sampled at each "
                f"space reading, and Phalanx's watchers need a few seconds of history; got {retention_s!r}")
    return None
