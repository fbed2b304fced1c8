"""The etcd client, ``Store``: reads, transactions, watches, leases,
space and compaction, each call on the current member. With the rest of
``phalanx/etcd/`` (the package docstring lists it) the only code that talks
to etcd (docs/style.md §5).

Built directly on the etcd v3 gRPC stubs that ``aetcd`` ships
(``aetcd.rpc``), over our own grpc.aio channel, because the high-level client
leaves out what safety needs (docs/design.md §4):

- every request carries ``hasleader=true`` metadata, so a member cut off from
  the etcd majority fails fast instead of answering stale;
- every read is linearizable (``serializable=False``);
- every call has a deadline and **no write is ever retried automatically**:
  a timed-out write raises ``StoreUnavailable`` and the caller decides (every
  write we make is idempotent by id or guarded by revisions);
- leases are kept alive on one bidi stream, one request per keepalive;
- watches resume from the last seen revision and report compaction, so the
  caller re-lists;
- one channel per etcd member and one *current* member for every call: a
  call that fails transiently moves later calls (and the keepalive stream,
  and open watches) to the next member, so a member that stops answering
  without closing its connections (a partition that drops packets, a paused
  process) costs one failed call, not the ~15 s gRPC keepalive needs to
  declare the connection dead (docs/chaos.md finding 6, docs/timing.md);
- with ``tls`` (an etcd client directory, ``phalanx.etcd_pki``) every
  member is reached over TLS, verified against ``ETCD_SERVER_NAME``, with a
  client certificate whose CN is the etcd user; a call that user's role does
  not allow raises ``StoreDenied`` naming the key and the user
  (docs/security.md "etcd: TLS and roles").

Key layout: phalanx/etcd/keys.py (docs/etcd-keys.md).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

import grpc
from aetcd.rpc import rpc_pb2 as epb
from aetcd.rpc import rpc_pb2_grpc as egrpc

from phalanx import etcd_pki, failpoints
from phalanx.errors import NotLeader, StoreDenied, StoreUnavailable
from phalanx.etcd.channels import CHANNEL_OPTIONS, METADATA, RENEWAL_CHECK_S, Member, files_stat, open_members
from phalanx.etcd.endpoints import EndpointRotation, parse_endpoints
from phalanx.etcd.errors import (
    AUTH_OLD_RESENDS, DENIED_DETAILS, FAILOVER_CODES, Compacted, denied, is_auth_old, translate,
)
from phalanx.etcd.keys import Keys, prefix_end
from phalanx.etcd.lease import LeaseKeepAlive
from phalanx.etcd.ops import (
    KV, MAX_TXN_OPS, Compare, EtcdSpaceReport, Fence, Get, Op, Put, TxnResult, WatchEvent, absent, kv_from_pb, txn_keys,
)
from phalanx.limits import PAGE_KEYS, RANGE_REPLY_BYTES
from phalanx.tls import TlsFiles

log = logging.getLogger(__name__)


# A range read's reply grows with what it reads, up to the client's receive
# limit (RANGE_REPLY_BYTES; a paged read's page too), where a point request's
# does not: its deadline is one request's (the store's ``timeout``, the
# Timings' etcd_timeout_s) plus the largest reply at the slowest rate a
# loaded host is assumed to sustain. A rate, not a timing: it is what scales
# the size bound into time (docs/timing.md "etcd connections").
RANGE_MIN_BYTES_PER_S = 2 * 1024 * 1024


def range_deadline(request_timeout: float) -> float:
    """Deadline of one range read (``Store.get_prefix``, one page of
    ``get_prefix_pages``): 4 s past ``request_timeout`` for 8 MiB."""
    return request_timeout + RANGE_REPLY_BYTES / RANGE_MIN_BYTES_PER_S


@dataclass(eq=False)
class _OpenWatch:
    call: Any
    abandoned: bool = False



class Store:
    """An etcd connection for one cluster prefix. Cheap calls, no hidden retry.

    ``endpoints``: one or more members (see ``parse_endpoint``), used in the
    order given; a transient failure of a call moves later calls to the next
    member (``EndpointRotation``). The failed call itself is never retried
    here: a write's outcome is unknown to the caller (``StoreUnavailable``),
    and a read may simply be issued again."""

    # An agent's words when its read is refused, and what to check
    # (agent/coordinator_reads.py has its own).
    refused_read = "etcd denied this agent's read (check --etcd-tls-dir and the cluster's etcd roles, `phalanx etcd-auth`)"

    def __init__(
        self,
        endpoints: str | Sequence[str],
        cluster: str,
        *,
        tls: TlsFiles | None = None,
        timeout: float = 2.0,
        suspect_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        metrics: Any = None,
    ):
        # ``metrics``: where request latencies and failures go (a
        # coordinator.metrics.CoordinatorMetrics: etcd_request(kind, seconds,
        # ok) and fenced_write_refused()); None: not measured.
        self.metrics = metrics
        self._endpoints = parse_endpoints(endpoints)
        # ``tls``: an etcd client directory's files (etcd_pki.files); None
        # reaches etcd in plaintext (only behind --insecure).
        self.tls = tls
        # The etcd user this store logs in as (the certificate's CN), known
        # once connected; "" in plaintext (no auth).
        self.user = ""
        self.endpoints = [e.target for e in self._endpoints]
        self.keys = Keys(cluster)
        self.timeout = timeout
        self.range_timeout = range_deadline(timeout)
        self._clock = clock
        self._rotation = EndpointRotation(len(self._endpoints), suspect_s=suspect_s)
        self._members: list[Member] = []
        self._retired: list[Member] = []  # channels of replaced client certificates
        self._options: list[tuple[str, Any]] = []
        self._tls_seen: tuple[Any, ...] = ()
        self._tls_checked_at = float("-inf")
        self._watches: list[set[_OpenWatch]] = [set() for _ in self._endpoints]

    async def connect(self) -> "Store":
        if not self._members:
            options = list(CHANNEL_OPTIONS)
            self._options = options
            creds = None
            if self.tls is not None:
                # Checked here, before any handshake, so a wrong file is
                # named with the check it fails (TlsError) instead of a
                # bare handshake failure from etcd.
                self._tls_seen = files_stat(self.tls)
                creds, self.user = etcd_pki.channel_credentials(self.tls)
                self._options = options + list(etcd_pki.CHANNEL_OPTIONS)
            self._members = open_members(self._endpoints, creds, self._options)
        return self

    async def close(self) -> None:
        """Close every member's channel, even if closing one fails."""
        members, self._members = self._members + self._retired, []
        self._retired = []
        results = await asyncio.gather(*(m.channel.close() for m in members), return_exceptions=True)
        for m, r in zip(members, results):
            if isinstance(r, Exception):
                log.warning("closing the channel to etcd member %s: %r", m.endpoint, r)

    async def __aenter__(self) -> "Store":
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- which member
    @property
    def current_endpoint(self) -> str:
        """The member that new calls go to."""
        return self._endpoints[self._rotation.current].target

    def _follow_renewal(self) -> None:
        """A renewed client certificate (the files changed on disk) is used
        by the calls made from now on: new channels to every member. The old
        ones are not closed before the store is (open watches and the lease
        keepalive stream go on over them until they end), so a renewal
        disturbs nothing; renewals are rare, so they are few. Files that fail
        their checks are logged once and the old credentials kept, as the
        gRPC servers do (phalanx.tls.ServerCredentialsSource)."""
        assert self.tls is not None
        now = self._clock()
        if now - self._tls_checked_at < RENEWAL_CHECK_S:
            return
        self._tls_checked_at = now
        seen = files_stat(self.tls)
        if seen == self._tls_seen:
            return
        self._tls_seen = seen
        try:
            creds, user = etcd_pki.channel_credentials(self.tls)
        except Exception as exc:  # noqa: BLE001 - TlsError and unreadable files alike
            log.error("etcd client files changed but cannot be used (keeping the old ones): %s", exc)
            return
        self._retired.extend(self._members)
        self._members = open_members(self._endpoints, creds, self._options)
        log.info("etcd client certificate renewed (user %s): new calls use it", user)
        self.user = user

    def pin(self) -> tuple[Member, int, int]:
        if not self._members:
            raise RuntimeError("Store is not connected (use `async with Store(...)` or `await store.connect()`)")
        if self.tls is not None:
            self._follow_renewal()
        index, generation = self._rotation.pin()
        return self._members[index], index, generation

    def member_failed(self, index: int, generation: int, why: str) -> None:
        """A call pinned to ``(index, generation)`` got no answer from that
        member. Later calls go elsewhere; watches open on it are broken off
        (their callers resume on the new member)."""
        if not self._rotation.failed(index, generation, self._clock()):
            return
        log.warning(
            "etcd member %s did not answer (%s); using %s from now on",
            self._endpoints[index], why, self.current_endpoint,
        )
        for w in list(self._watches[index]):
            w.abandoned = True
            w.call.cancel()

    # Stubs of the current member (tests and maintenance calls).
    @property
    def _kv(self) -> egrpc.KVStub:
        return self.pin()[0].kv

    @property
    def _lease(self) -> egrpc.LeaseStub:
        return self.pin()[0].lease

    # -- error translation (docs/style.md §6): one table, at the boundary
    def _translate(self, exc: grpc.aio.AioRpcError, what: str, key: str | Callable[[], str] = "") -> Exception:
        return translate(exc, what, key, tls=self.tls, user=self.user)

    def _measured(self, kind: str, started: float, ok: bool) -> None:
        if self.metrics is not None:
            self.metrics.etcd_request(kind, time.perf_counter() - started, ok)

    async def _call(self, method: Callable[[Member], Any], req: Any, what: str, timeout: float | None = None,
                    *, blame_timeout: bool = True, key: str | Callable[[], str] = "", kind: str = "get") -> Any:
        """``_call_once`` measured as one etcd request of ``kind``."""
        started = time.perf_counter()
        try:
            resp = await self._call_once(method, req, what, timeout, blame_timeout=blame_timeout, key=key)
        except (StoreUnavailable, StoreDenied):
            self._measured(kind, started, False)
            raise
        self._measured(kind, started, True)
        return resp

    async def _call_once(self, method: Callable[[Member], Any], req: Any, what: str, timeout: float | None = None,
                         *, blame_timeout: bool = True, key: str | Callable[[], str] = "") -> Any:
        """One call on the current member. ``blame_timeout=False``: a
        DEADLINE_EXCEEDED is not held against the member (a large range read
        may simply be slow; moving would also break every open watch). A
        member that really stopped answering is found by the next short call
        or lease keepalive."""
        member, index, generation = self.pin()
        for resend in range(AUTH_OLD_RESENDS + 1):
            try:
                return await method(member)(req, timeout=timeout or self.timeout, metadata=METADATA)
            except grpc.aio.AioRpcError as exc:
                if is_auth_old(exc) and resend < AUTH_OLD_RESENDS:
                    continue  # refused before anything was applied: safe to send again (errors.AUTH_OLD_REVISION)
                blame = exc.code() in FAILOVER_CODES and (blame_timeout or exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED)
                if blame:
                    self.member_failed(index, generation, f"{what}: {exc.code().name}")
                raise self._translate(exc, f"{what} (at {member.endpoint})", key) from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    # -- reads (linearizable)
    async def get(self, key: str) -> KV | None:
        resp = await self._call(lambda m: m.kv.Range, epb.RangeRequest(key=key.encode()), f"get {key}", key=key)
        return kv_from_pb(resp.kvs[0]) if resp.kvs else None

    async def get_prefix(self, prefix: str, *, keys_only: bool = False, limit: int = 0) -> tuple[list[KV], int]:
        req = epb.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix), keys_only=keys_only, limit=limit)
        resp = await self._call(lambda m: m.kv.Range, req, f"range {prefix}", timeout=self.range_timeout,
                                blame_timeout=False, key=prefix)
        return [kv_from_pb(m) for m in resp.kvs], resp.header.revision

    async def get_prefix_pages(self, prefix: str, *, keys_only: bool = False, page: int = PAGE_KEYS,
                               revision: int = 0) -> AsyncIterator[tuple[list[KV], int]]:
        """Every key under ``prefix`` as ``(kvs, revision)`` pages of at most
        ``page`` keys, so that no single range reply grows with the number of
        keys (docs/limits.md "Paged reads"). Every page is read at the
        revision of the first (or at ``revision``): together they are one
        consistent snapshot, as one range read would be. A page whose reply
        would exceed the client's receive limit is read again at half the
        size. A revision compacted between two pages raises
        ``StoreUnavailable``: the caller starts over, as after any failed read."""
        if page < 1:
            raise ValueError(f"page must be at least 1, got {page}")
        start, end = prefix.encode(), prefix_end(prefix)
        size = page
        resends = 0
        while True:
            req = epb.RangeRequest(key=start, range_end=end, keys_only=keys_only, limit=size, revision=revision)
            member, index, generation = self.pin()
            what = f"range {prefix} (page of {size} from {start[len(prefix.encode()):][:64]!r}, at {member.endpoint})"
            started = time.perf_counter()
            try:
                resp = await member.kv.Range(req, timeout=self.range_timeout, metadata=METADATA)
                self._measured("get", started, True)
            except grpc.aio.AioRpcError as exc:
                self._measured("get", started, False)
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and size > 1:
                    size = max(1, size // 2)  # the reply was over our receive limit
                    continue
                if is_auth_old(exc) and resends < AUTH_OLD_RESENDS:
                    resends += 1  # see errors.AUTH_OLD_REVISION
                    continue
                # As _call with blame_timeout=False: a slow range read is not
                # held against the member.
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.member_failed(index, generation, f"range {prefix}: {exc.code().name}")
                raise self._translate(exc, what, prefix) from None
            if not revision:
                revision = resp.header.revision
            kvs = [kv_from_pb(m) for m in resp.kvs]
            yield kvs, revision
            if not resp.more or not resp.kvs:
                return
            start = resp.kvs[-1].key + b"\0"  # the next key after the last one read
            size = min(page, size * 2)

    async def get_prefix_paged(self, prefix: str, *, keys_only: bool = False, page: int = PAGE_KEYS,
                               revision: int = 0) -> tuple[list[KV], int]:
        """``get_prefix`` in pages (``get_prefix_pages``): the same answer,
        without a range reply that grows with the number of keys."""
        out: list[KV] = []
        rev = revision
        async for kvs, rev in self.get_prefix_pages(prefix, keys_only=keys_only, page=page, revision=revision):
            out.extend(kvs)
        return out, rev

    async def space(self) -> EtcdSpaceReport:
        """Two small maintenance reads; etcd answers both with its space
        alarm active (it refuses writes, not these)."""
        member, _, _ = self.pin()
        status = await self._call(lambda m: m.maintenance.Status, epb.StatusRequest(), "status")
        alarms = await self._call(lambda m: m.maintenance.Alarm,
                                  epb.AlarmRequest(action=epb.AlarmRequest.GET), "alarm list")
        names = sorted({epb.AlarmType.Name(a.alarm) for a in alarms.alarms if a.alarm != epb.NONE})
        return EtcdSpaceReport(member=str(member.endpoint), db_size=status.dbSize,
                               db_size_in_use=status.dbSizeInUse, alarms=tuple(names), revision=status.header.revision)

    async def compact(self, revision: int) -> bool:
        """Compact etcd's history up to ``revision`` (cluster-wide, every
        prefix: coordinator/compaction.py says when Phalanx may). False if
        etcd had already compacted at or past it (someone else did: the
        goal is met); StoreDenied if this etcd user may not compact."""
        req = epb.CompactionRequest(revision=revision, physical=False)
        try:
            await self._call(lambda m: m.kv.Compact, req, f"compact to revision {revision}", kind="compact")
        except StoreUnavailable as exc:
            if "required revision has been compacted" in str(exc):
                return False
            raise
        return True

    async def server_version(self) -> str:
        """The answering member's etcd version (Maintenance Status), e.g.
        ``3.4.23`` (phalanx/etcd_version.py)."""
        status = await self._call(lambda m: m.maintenance.Status, epb.StatusRequest(), "status")
        return status.version

    async def count_under(self, prefix: str) -> int:
        """How many keys lie under ``prefix`` (etcd counts; no key is sent)."""
        req = epb.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix), count_only=True)
        resp = await self._call(lambda m: m.kv.Range, req, f"count {prefix}", key=prefix)
        return resp.count

    async def oldest_under(self, prefix: str, n: int) -> list[KV]:
        """The ``n`` keys under ``prefix`` created first (keys only)."""
        req = epb.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix), keys_only=True, limit=n,
                               sort_order=epb.RangeRequest.ASCEND, sort_target=epb.RangeRequest.CREATE)
        resp = await self._call(lambda m: m.kv.Range, req, f"range {prefix} (oldest {n})", timeout=self.range_timeout,
                                blame_timeout=False, key=prefix)
        return [kv_from_pb(m) for m in resp.kvs]

    async def revision(self) -> int:
        req = epb.RangeRequest(key=self.keys.root.encode(), count_only=True)
        resp = await self._call(lambda m: m.kv.Range, req, "revision")
        return resp.header.revision

    # -- transactions
    async def txn(self, compares: Iterable[Compare], success: Iterable[Op], failure: Iterable[Op] = ()) -> TxnResult:
        success = list(success)
        failure = list(failure)
        compares = list(compares)
        if max(len(success), len(failure)) + len(compares) > MAX_TXN_OPS:
            raise ValueError(f"transaction has more than {MAX_TXN_OPS} operations")
        req = epb.TxnRequest(
            compare=[c.to_pb() for c in compares],
            success=[o.to_pb() for o in success],
            failure=[o.to_pb() for o in failure],
        )
        resp = await self._call(lambda m: m.kv.Txn, req, "txn", key=lambda: txn_keys(compares, success, failure), kind="txn")
        results: list[tuple[KV, ...] | None] = []
        for r in resp.responses:
            if r.HasField("response_range"):
                results.append(tuple(kv_from_pb(m) for m in r.response_range.kvs))
            else:
                results.append(None)
        return TxnResult(resp.succeeded, resp.header.revision, tuple(results))

    def fence_compare(self, fence: Fence) -> Compare:
        return Compare(self.keys.leader(fence.az), "create", "==", fence.epoch)

    async def fenced_txn(self, fence: Fence, compares: Iterable[Compare], success: Iterable[Op], failure: Iterable[Op] = ()) -> TxnResult:
        """A leader's write: also requires that its leader key still has the
        create_revision ``fence.epoch``. A lost fence raises ``NotLeader`` (step
        down, never retry); any other lost compare returns ``succeeded=False``
        with the failure branch's reads, after the leader-key read we add."""
        failure = [Get(self.keys.leader(fence.az))] + list(failure)
        # failpoint leader.skip_fence_compare: a planted bug for the chaos checker
        fenced = [] if failpoints.on("leader.skip_fence_compare") else [self.fence_compare(fence)]
        res = await self.txn(fenced + list(compares), success, failure)
        if res.succeeded:
            return res
        leader = res.results[0]
        if not leader or leader[0].create_revision != fence.epoch:
            if self.metrics is not None:
                self.metrics.fenced_write_refused()
            raise NotLeader(f"leader key of {fence.az} no longer has epoch {fence.epoch}")
        return TxnResult(False, res.revision, res.results[1:])

    async def create_if_absent(self, key: str, value: Any) -> tuple[bool, KV]:
        """The commit-point primitive: returns (created, the key's record)."""
        res = await self.txn([absent(key)], [Put(key, value), Get(key)], [Get(key)])
        kvs = res.results[-1]
        assert kvs, f"{key} vanished inside its own transaction"
        return res.succeeded, kvs[0]

    # -- leases
    async def grant_lease(self, ttl: int) -> int:
        resp = await self._call(lambda m: m.lease.LeaseGrant, epb.LeaseGrantRequest(TTL=ttl), "lease grant", kind="lease")
        if resp.error:
            raise StoreUnavailable(f"lease grant refused: {resp.error}")
        return resp.ID

    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self._call(lambda m: m.lease.LeaseRevoke, epb.LeaseRevokeRequest(ID=lease_id), "lease revoke", kind="lease")
        except StoreUnavailable as exc:
            if "not found" not in str(exc):
                raise

    def keepalive(self, lease_id: int) -> "LeaseKeepAlive":
        return LeaseKeepAlive(self, lease_id)

    # -- watches
    async def watch_prefix(self, prefix: str, start_revision: int, *, exact: bool = False) -> AsyncIterator[list[WatchEvent]]:
        """Yield batches of events from ``start_revision`` on (``exact``: only
        the key itself). Raises ``Compacted`` when that revision is gone and
        ``StoreUnavailable`` when the stream breaks — also when another call
        found its member unresponsive and the store moved on; the caller
        resumes from the last revision it saw, on the new member."""
        create = epb.WatchCreateRequest(key=prefix.encode(), start_revision=start_revision, progress_notify=True)
        if not exact:
            create.range_end = prefix_end(prefix)
        req = epb.WatchRequest(create_request=create)
        member, index, generation = self.pin()
        call = member.watch.Watch(metadata=METADATA)
        opened = _OpenWatch(call)
        self._watches[index].add(opened)
        try:
            await call.write(req)
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise StoreUnavailable(f"watch on {prefix} ended (at {member.endpoint})")
                if resp.compact_revision:
                    raise Compacted(resp.compact_revision)
                if resp.canceled:
                    if any(d in resp.cancel_reason for d in DENIED_DETAILS):
                        raise denied("watch", prefix, resp.cancel_reason, self.user)
                    raise StoreUnavailable(f"watch on {prefix} cancelled: {resp.cancel_reason}")
                if resp.events:
                    yield [
                        WatchEvent("delete" if e.type == 1 else "put", kv_from_pb(e.kv), e.kv.mod_revision)
                        for e in resp.events
                    ]
                elif resp.header.revision and not resp.created:
                    # progress notification: lets the caller advance its resume point
                    yield []
        except grpc.aio.AioRpcError as exc:
            if self.metrics is not None:
                self.metrics.etcd_request("watch", 0.0, False)
            if opened.abandoned:
                raise StoreUnavailable(f"watch on {prefix} left unresponsive etcd member {member.endpoint}") from None
            if exc.code() in FAILOVER_CODES:
                self.member_failed(index, generation, f"watch {prefix}: {exc.code().name}")
            raise self._translate(exc, f"watch {prefix} (at {member.endpoint})", prefix) from None
        except asyncio.CancelledError:
            # member_failed cancelled the call (grpc.aio raises
            # CancelledError for a locally cancelled call): a broken stream
            # to the caller, unless its own task is being cancelled too.
            task = asyncio.current_task()
            if opened.abandoned and task is not None and not task.cancelling():
                raise StoreUnavailable(f"watch on {prefix} left unresponsive etcd member {member.endpoint}") from None
            raise
        finally:
            self._watches[index].discard(opened)
            call.cancel()


def jitter(base: float) -> float:
    """Retry pause with jitter, so replicas do not campaign in lockstep."""
    return base * (0.5 + random.random())
