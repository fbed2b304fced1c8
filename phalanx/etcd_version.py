"""Which published etcd advisories apply to the etcd a process talks to
(docs/security.md "etcd versions and advisories").

``advisories_for(version)`` is pure: etcd's version string (what
``Maintenance.Status`` answers, e.g. ``3.4.23``) to the advisories of
``ADVISORIES`` whose fix it lacks. ``report(store, ...)`` is the thin
driver every process (coordinator, agent, ``agent.sim``, ``phalanx up``)
starts once: it asks etcd for its version until one member answers, then
logs one line (WARNING when an advisory applies) and ends.

Phalanx's safety does not rest on these being fixed (docs/security.md says
what it does and does not rely on etcd RBAC for); the line says which of
etcd's own refusals cannot be trusted on this server.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Advisory:
    id: str
    what: str
    # The first fixed release of each maintained branch, (major, minor, patch).
    fixed: tuple[tuple[int, int, int], ...]

    def fixed_in(self) -> str:
        return " / ".join(".".join(map(str, v)) for v in self.fixed)


ADVISORIES: tuple[Advisory, ...] = (
    Advisory("CVE-2026-33413", "lease and compaction calls are not checked against the caller's role",
             ((3, 4, 42), (3, 5, 28), (3, 6, 9))),
    Advisory("CVE-2026-33343", "RBAC bypass through nested transactions",
             ((3, 4, 42), (3, 5, 28), (3, 6, 9))),
    Advisory("CVE-2026-44283", "RBAC bypass through PrevKv and lease attachment in transaction puts",
             ((3, 4, 44), (3, 5, 30), (3, 6, 11))),
)

# MAJOR.MINOR.PATCH, an optional pre-release (-rc.0) and build metadata (+git).
_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?")


def parse_version(text: str) -> tuple[int, int, int, bool]:
    """``(major, minor, patch, prerelease)``; ValueError naming the field
    for anything else."""
    m = _VERSION.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"etcd version: {text[:64]!r} is not MAJOR.MINOR.PATCH")
    return int(m[1]), int(m[2]), int(m[3]), m[4] is not None


def _affected(v: tuple[int, int, int, bool], a: Advisory) -> bool:
    major, minor, patch, pre = v
    for fm, fn, fp in a.fixed:
        if (major, minor) == (fm, fn):
            # 3.6.9-rc.0 comes before 3.6.9, so it lacks 3.6.9's fix.
            return (patch, not pre) < (fp, True)
    # A branch older than every maintained one gets no fix; a newer one
    # was released after the fixes.
    return (major, minor) < min((fm, fn) for fm, fn, _ in a.fixed)


def advisories_for(version: str) -> tuple[Advisory, ...]:
    """The advisories whose fix ``version`` lacks, in ``ADVISORIES``'s order
    (ValueError naming the field for a version that cannot be read)."""
    v = parse_version(version)
    return tuple(a for a in ADVISORIES if _affected(v, a))


def minimum_versions() -> str:
    """The first release of each branch with every fix (for the docs and
    the line): ``3.4.44 / 3.5.30 / 3.6.11``."""
    branches = sorted({(m, n) for a in ADVISORIES for m, n, _ in a.fixed})
    need = [max(p for a in ADVISORIES for m, n, p in a.fixed if (m, n) == b) for b in branches]
    return " / ".join(f"{m}.{n}.{p}" for (m, n), p in zip(branches, need))


def advisory_line(version: str, who: str) -> tuple[int, str]:
    """The one line a process logs about its etcd, and its level (pure)."""
    try:
        found = advisories_for(version)
    except ValueError as exc:
        return logging.WARNING, (f"{who}: {exc}: cannot tell which etcd advisories apply, so assume all of "
                                 f"{', '.join(a.id for a in ADVISORIES)} (production needs {minimum_versions()})")
    if not found:
        return logging.INFO, f"{who}: etcd {version}: none of the known etcd advisories apply"
    listed = "; ".join(f"{a.id} ({a.what}; fixed in {a.fixed_in()})" for a in found)
    return logging.WARNING, (f"{who}: etcd {version} lacks fixes for {len(found)} advisories: {listed}. "
                             f"Production needs {minimum_versions()} or later; until then etcd's roles cannot be "
                             f"trusted to confine the agent's etcd user (docs/security.md "
                             f"\"etcd versions and advisories\")")


class _VersionSource(Protocol):
    async def server_version(self) -> str: ...


async def report(store: _VersionSource, *, who: str, retry_s: float) -> str:
    """Ask etcd for its version until a member answers, log ``advisory_line``
    once, and return the version. Meant to run as its own task from
    start-up: etcd not answering yet delays only this line. Any store error
    is retried after ``retry_s`` (a denied Status is logged and ends it)."""
    from phalanx.errors import StoreDenied, StoreUnavailable

    while True:
        try:
            version = await store.server_version()
            break
        except StoreDenied as exc:
            log.warning("%s: cannot ask etcd for its version: %s", who, exc)
            return ""
        except StoreUnavailable:
            await asyncio.sleep(retry_s)
    level, line = advisory_line(version, who)
    log.log(level, "%s", line)
    return version
