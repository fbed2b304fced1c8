"""The cluster's GangService policy as one record in etcd (docs/security.md
"Policy as data").

``/phalanx/<cluster>/policy`` holds JSON::

    {"format": 1, "policy": {...}, "set_by": "admin/root", "set_at": 1764612345.6}

``policy`` is what ``coordinator.core.authz.parse_policy`` accepts (the same
validator as ``--policy FILE``). The record's etcd mod revision is its
version: ``SetPolicy`` writes only if the record is still at the revision
the admin read (0: only if there is none), so two admins never overwrite
each other unseen. No record: the defaults apply.

Every coordinator applies the record through ``PolicyCache``: a copy read
from etcd, read again once it is ``Timings.policy_max_staleness_s`` old
(one read shared by every call that asks meanwhile). ``--policy FILE``
(``initial``) is written as the first record when none exists (``seed``)
and otherwise ignored with a warning naming the record; while there is no
record it is what applies (so a seed that etcd did not take at start-up
leaves no window with the defaults).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from coordinator.core.authz import Policy, PolicyError, parse_policy
from phalanx.store import KV, Get, Put, Store, StoreUnavailable, absent, unchanged_since
from phalanx.errors import DataLoss, FailedPrecondition

log = logging.getLogger(__name__)

RECORD_FORMAT = 1


@dataclass(frozen=True)
class PolicyRecord:
    policy: Policy
    revision: int  # etcd mod revision; 0: no record (the defaults)
    set_by: str = ""
    set_at: float = 0.0


DEFAULT_RECORD = PolicyRecord(Policy(), 0)


def record_data(policy: Policy, *, set_by: str, set_at: float) -> dict[str, Any]:
    return {"format": RECORD_FORMAT, "policy": policy.to_data(), "set_by": set_by, "set_at": set_at}


def record_from_kv(kv: KV) -> PolicyRecord:
    """The record in ``kv``; PolicyError naming the key, its revision and
    the field when it cannot be used (written by hand, or by a newer
    format)."""
    where = f"{kv.key} (revision {kv.mod_revision})"
    try:
        data = json.loads(kv.value)
    except ValueError as exc:
        raise PolicyError(f"{where}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{where}: must be a JSON object, got {type(data).__name__}")
    if data.get("format") != RECORD_FORMAT:
        raise PolicyError(f"{where}: format: must be {RECORD_FORMAT}, got {data.get('format')!r}")
    try:
        policy = parse_policy(data.get("policy"))
    except PolicyError as exc:
        raise PolicyError(f"{where}: policy: {exc}") from None
    set_by, set_at = data.get("set_by", ""), data.get("set_at", 0.0)
    return PolicyRecord(policy, kv.mod_revision, set_by if isinstance(set_by, str) else "",
                        float(set_at) if isinstance(set_at, (int, float)) and not isinstance(set_at, bool) else 0.0)


class PolicyCache:
    """The policy record as this coordinator applies it (module docstring)."""

    def __init__(self, store: Store, max_staleness_s: float, *, initial: Policy | None = None, initial_source: str = "",
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.store = store
        self.max_staleness_s = max_staleness_s
        self.initial = initial
        self.initial_source = initial_source
        self.clock = clock
        self.wall = wall
        self._none = PolicyRecord(initial, 0, initial_source) if initial is not None else DEFAULT_RECORD
        self._record: PolicyRecord | None = None
        self._read_at = 0.0  # clock() when the read that gave _record started
        self._reading: asyncio.Future[PolicyRecord] | None = None

    @property
    def key(self) -> str:
        return self.store.keys.policy()

    def _unreadable(self, exc: PolicyError) -> DataLoss:
        return DataLoss(f"the policy record cannot be used: {exc}; an admin must replace it "
                        f"(phalanx policy set, with the revision named here)")

    async def read(self) -> PolicyRecord:
        """The record as etcd has it now (linearizable read); DataLoss when
        it cannot be used (nothing is applied from it)."""
        started = self.clock()
        kv = await self.store.get(self.key)
        try:
            record = self._none if kv is None else record_from_kv(kv)
        except PolicyError as exc:
            raise self._unreadable(exc) from None
        self._remember(record, started)
        return record

    def _remember(self, record: PolicyRecord, started: float) -> None:
        if started >= self._read_at or self._record is None:
            self._record, self._read_at = record, started

    async def current(self) -> PolicyRecord:
        """The record, at most max_staleness_s old: the copy, or a fresh
        read shared by every caller that asks while it is in flight."""
        if self._record is not None and self.clock() - self._read_at < self.max_staleness_s:
            return self._record
        fut = self._reading
        if fut is None:
            fut = asyncio.ensure_future(self.read())
            self._reading = fut

            def done(f: asyncio.Future[PolicyRecord]) -> None:
                self._reading = None
                if not f.cancelled():
                    f.exception()  # retrieved: every waiter may have gone

            fut.add_done_callback(done)
        return await asyncio.shield(fut)

    async def set(self, policy: Policy, *, expected_revision: int, set_by: str, now: float) -> PolicyRecord:
        """Write ``policy`` if the record is still at ``expected_revision``
        (0: absent); FailedPrecondition naming the current revision if not."""
        if expected_revision < 0:
            raise FailedPrecondition(f"expected_revision: must be 0 (no record yet) or a revision from GetPolicy, got {expected_revision}")
        guard = absent(self.key) if expected_revision == 0 else unchanged_since(self.key, expected_revision)
        started = self.clock()
        res = await self.store.txn([guard], [Put(self.key, record_data(policy, set_by=set_by, set_at=now)), Get(self.key)],
                                   [Get(self.key)])
        kvs = res.results[-1]
        if not res.succeeded:
            current = kvs[0].mod_revision if kvs else 0
            raise FailedPrecondition(
                f"expected_revision: the policy record {self.key} is at revision {current}, not {expected_revision} "
                f"(changed since it was read); read it again (phalanx policy get) and retry")
        assert kvs, f"{self.key} vanished inside its own transaction"
        record = PolicyRecord(policy, kvs[0].mod_revision, set_by, now)
        self._remember(record, started)
        return record

    async def seed(self) -> bool:
        """Write ``initial`` (``--policy FILE``) as the first record; True if
        written. An existing record wins, with a warning naming it; an etcd
        that does not answer is logged (``initial`` applies meanwhile, and
        an admin's SetPolicy with revision 0 writes the first record)."""
        if self.initial is None:
            return False
        try:
            record = await self.set(self.initial, expected_revision=0, set_by=self.initial_source, now=self.wall())
        except FailedPrecondition:
            try:
                existing = await self.store.get(self.key)
            except StoreUnavailable:
                existing = None
            log.warning("%s is ignored: the policy record %s exists (revision %d, set by %s); change it with "
                        "`phalanx policy set`", self.initial_source, self.key, existing.mod_revision if existing else 0,
                        _set_by(existing))
            return False
        except StoreUnavailable as exc:
            log.warning("%s not written as the policy record %s (etcd: %s); it applies while there is no record",
                        self.initial_source, self.key, exc)
            return False
        log.info("%s written as the policy record %s (revision %d)", self.initial_source, self.key, record.revision)
        return True


def _set_by(kv: KV | None) -> str:
    try:
        return str(json.loads(kv.value).get("set_by", "?")) if kv is not None else "?"
    except (ValueError, AttributeError):
        return "?"
