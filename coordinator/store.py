"""The only module that talks to etcd (STYLE §5).

Built directly on the etcd v3 gRPC stubs that ``aetcd`` ships
(``aetcd.rpc``), over our own grpc.aio channel, because the high-level client
leaves out what safety needs (DESIGN §3):

- every request carries ``hasleader=true`` metadata, so a member cut off from
  the etcd majority fails fast instead of answering stale;
- every read is linearizable (``serializable=False``);
- every call has a deadline and **no write is ever retried automatically**:
  a timed-out write raises ``StoreUnavailable`` and the caller decides (every
  write we make is idempotent by id or guarded by revisions);
- leases are kept alive on one bidi stream, one request per keepalive;
- watches resume from the last seen revision and report compaction, so the
  caller re-lists.

Key layout (see docs/etcd-keys.md): everything under ``/phalanx/<cluster>/``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Sequence

import grpc
from aetcd.rpc import rpc_pb2 as epb
from aetcd.rpc import rpc_pb2_grpc as egrpc

from phalanx.errors import Conflict, NotLeader, StoreUnavailable

log = logging.getLogger(__name__)

# etcd rejects txns with more than 128 operations (--max-txn-ops default).
MAX_TXN_OPS = 128
_METADATA = (("hasleader", "true"),)
_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}


# --- keys --------------------------------------------------------------------


@dataclass(frozen=True)
class Keys:
    """The key layout of DESIGN §3, in one place."""

    cluster: str

    @property
    def root(self) -> str:
        return f"/phalanx/{self.cluster}/"

    def leader(self, az: str) -> str:
        return f"{self.root}leader/{az}"

    def leaders(self) -> str:
        return f"{self.root}leader/"

    def node(self, az: str, node: str) -> str:
        return f"{self.root}nodes/{az}/{node}"

    def nodes(self, az: str = "") -> str:
        return f"{self.root}nodes/{az}/" if az else f"{self.root}nodes/"

    def gang(self, gang_id: str) -> str:
        return f"{self.root}gangs/{gang_id}"

    def gangs(self) -> str:
        return f"{self.root}gangs/"

    def reservation(self, az: str, gang_id: str) -> str:
        return f"{self.root}reservations/{az}/{gang_id}"

    def reservations(self, az: str = "") -> str:
        return f"{self.root}reservations/{az}/" if az else f"{self.root}reservations/"

    def decision(self, gang_id: str, incarnation: int) -> str:
        return f"{self.root}decisions/{gang_id}/{incarnation}"

    def decisions(self, gang_id: str = "") -> str:
        return f"{self.root}decisions/{gang_id}/" if gang_id else f"{self.root}decisions/"

    def member_summary(self, gang_id: str, az: str) -> str:
        """Per-AZ member status of a cross-AZ gang, written by that AZ's
        leader (the participant), watched by the owner."""
        return f"{self.root}members/{gang_id}/{az}"

    def member_summaries(self, gang_id: str = "") -> str:
        return f"{self.root}members/{gang_id}/" if gang_id else f"{self.root}members/"

    def idempotency(self, key: str) -> str:
        return f"{self.root}idempotency/{key}"

    def name(self, name: str) -> str:
        """Index of live gang names: a name is unique among live gangs."""
        return f"{self.root}names/{name}"


def prefix_end(prefix: str) -> bytes:
    """The range_end that selects every key starting with ``prefix``."""
    b = bytearray(prefix.encode())
    for i in reversed(range(len(b))):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


# --- values ----------------------------------------------------------------


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    def json(self) -> Any:
        return json.loads(self.value)


def _kv(m: Any) -> KV:
    return KV(
        key=m.key.decode(),
        value=bytes(m.value),
        create_revision=m.create_revision,
        mod_revision=m.mod_revision,
        version=m.version,
        lease=m.lease,
    )


def encode(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


# --- compares and operations -----------------------------------------------------


@dataclass(frozen=True)
class Compare:
    key: str
    target: str  # "create" | "mod" | "version" | "value"
    result: str  # "==" | "!=" | ">" | "<"
    value: Any

    def to_pb(self) -> epb.Compare:
        result = {"==": epb.Compare.EQUAL, "!=": epb.Compare.NOT_EQUAL, ">": epb.Compare.GREATER, "<": epb.Compare.LESS}[self.result]
        c = epb.Compare(key=self.key.encode(), result=result)
        if self.target == "create":
            c.target = epb.Compare.CREATE
            c.create_revision = self.value
        elif self.target == "mod":
            c.target = epb.Compare.MOD
            c.mod_revision = self.value
        elif self.target == "version":
            c.target = epb.Compare.VERSION
            c.version = self.value
        elif self.target == "value":
            c.target = epb.Compare.VALUE
            c.value = encode(self.value)
        else:  # pragma: no cover - programming error
            raise ValueError(self.target)
        return c


def absent(key: str) -> Compare:
    """Create-if-absent guard."""
    return Compare(key, "version", "==", 0)


def unchanged(kv: KV) -> Compare:
    return Compare(kv.key, "mod", "==", kv.mod_revision)


@dataclass(frozen=True)
class Put:
    key: str
    value: Any
    lease: int = 0

    def to_pb(self) -> epb.RequestOp:
        return epb.RequestOp(request_put=epb.PutRequest(key=self.key.encode(), value=encode(self.value), lease=self.lease))


@dataclass(frozen=True)
class Delete:
    key: str
    prefix: bool = False

    def to_pb(self) -> epb.RequestOp:
        req = epb.DeleteRangeRequest(key=self.key.encode())
        if self.prefix:
            req.range_end = prefix_end(self.key)
        return epb.RequestOp(request_delete_range=req)


@dataclass(frozen=True)
class Get:
    key: str
    prefix: bool = False

    def to_pb(self) -> epb.RequestOp:
        req = epb.RangeRequest(key=self.key.encode())
        if self.prefix:
            req.range_end = prefix_end(self.key)
        return epb.RequestOp(request_range=req)


Op = Put | Delete | Get


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    # For each Get op of the branch taken, the KVs it returned (None for others).
    results: tuple[tuple[KV, ...] | None, ...]


@dataclass(frozen=True)
class Fence:
    """A leader's fencing token: the create_revision of its leader key."""

    az: str
    epoch: int


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" | "delete"
    kv: KV
    revision: int


class Compacted(Exception):
    """The watch start revision was compacted; re-list, then watch again."""

    def __init__(self, compact_revision: int):
        super().__init__(f"revision compacted (oldest available {compact_revision})")
        self.compact_revision = compact_revision


# --- the client ----------------------------------------------------------------


class Store:
    """An etcd connection for one cluster prefix. Cheap calls, no hidden retry."""

    def __init__(self, endpoints: str | Sequence[str], cluster: str, *, timeout: float = 2.0):
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e]
        if not endpoints:
            raise ValueError("etcd endpoints: at least one host:port is required")
        self.endpoints = [e.removeprefix("http://") for e in endpoints]
        self.keys = Keys(cluster)
        self.timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._kv: egrpc.KVStub
        self._lease: egrpc.LeaseStub
        self._watch: egrpc.WatchStub

    async def connect(self) -> "Store":
        if self._channel is None:
            # The ipv4 resolver with several addresses + round_robin gives
            # failover across etcd members without client-side retry loops.
            target = "ipv4:" + ",".join(self.endpoints) if len(self.endpoints) > 1 else self.endpoints[0]
            options = [
                ("grpc.max_receive_message_length", 8 * 1024 * 1024),
                ("grpc.lb_policy_name", "round_robin"),
                ("grpc.enable_retries", 0),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
            ]
            self._channel = grpc.aio.insecure_channel(target, options=options)
            self._kv = egrpc.KVStub(self._channel)
            self._lease = egrpc.LeaseStub(self._channel)
            self._watch = egrpc.WatchStub(self._channel)
        return self

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> "Store":
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- error translation (STYLE §6): one table, at the boundary
    def _translate(self, exc: grpc.aio.AioRpcError, what: str) -> Exception:
        if exc.code() in _TRANSIENT:
            return StoreUnavailable(f"etcd unavailable during {what}: {exc.code().name}: {exc.details()}")
        return StoreUnavailable(f"etcd refused {what}: {exc.code().name}: {exc.details()}")

    async def _call(self, fn: Any, req: Any, what: str, timeout: float | None = None) -> Any:
        try:
            return await fn(req, timeout=timeout or self.timeout, metadata=_METADATA)
        except grpc.aio.AioRpcError as exc:
            raise self._translate(exc, what) from None

    # -- reads (linearizable)
    async def get(self, key: str) -> KV | None:
        resp = await self._call(self._kv.Range, epb.RangeRequest(key=key.encode()), f"get {key}")
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def get_prefix(self, prefix: str, *, keys_only: bool = False, limit: int = 0) -> tuple[list[KV], int]:
        req = epb.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix), keys_only=keys_only, limit=limit)
        resp = await self._call(self._kv.Range, req, f"range {prefix}", timeout=max(self.timeout, 5.0))
        return [_kv(m) for m in resp.kvs], resp.header.revision

    async def revision(self) -> int:
        resp = await self._call(self._kv.Range, epb.RangeRequest(key=self.keys.root.encode(), count_only=True), "revision")
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
        resp = await self._call(self._kv.Txn, req, "txn")
        results: list[tuple[KV, ...] | None] = []
        for r in resp.responses:
            if r.HasField("response_range"):
                results.append(tuple(_kv(m) for m in r.response_range.kvs))
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
        res = await self.txn([self.fence_compare(fence)] + list(compares), success, failure)
        if res.succeeded:
            return res
        leader = res.results[0]
        if not leader or leader[0].create_revision != fence.epoch:
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
        resp = await self._call(self._lease.LeaseGrant, epb.LeaseGrantRequest(TTL=ttl), "lease grant")
        if resp.error:
            raise StoreUnavailable(f"lease grant refused: {resp.error}")
        return resp.ID

    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self._call(self._lease.LeaseRevoke, epb.LeaseRevokeRequest(ID=lease_id), "lease revoke")
        except StoreUnavailable as exc:
            if "not found" not in str(exc):
                raise

    def keepalive(self, lease_id: int) -> "LeaseKeepAlive":
        return LeaseKeepAlive(self, lease_id)

    # -- watches
    async def watch_prefix(self, prefix: str, start_revision: int, *, exact: bool = False) -> AsyncIterator[list[WatchEvent]]:
        """Yield batches of events from ``start_revision`` on (``exact``: only
        the key itself). Raises ``Compacted`` when that revision is gone and
        ``StoreUnavailable`` when the stream breaks; the caller resumes from the
        last revision it saw."""
        create = epb.WatchCreateRequest(key=prefix.encode(), start_revision=start_revision, progress_notify=True)
        if not exact:
            create.range_end = prefix_end(prefix)
        req = epb.WatchRequest(create_request=create)
        call = self._watch.Watch(metadata=_METADATA)
        try:
            await call.write(req)
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise StoreUnavailable(f"watch on {prefix} ended")
                if resp.compact_revision:
                    raise Compacted(resp.compact_revision)
                if resp.canceled:
                    raise StoreUnavailable(f"watch on {prefix} cancelled: {resp.cancel_reason}")
                if resp.events:
                    yield [
                        WatchEvent("delete" if e.type == 1 else "put", _kv(e.kv), e.kv.mod_revision)
                        for e in resp.events
                    ]
                elif resp.header.revision and not resp.created:
                    # progress notification: lets the caller advance its resume point
                    yield []
        except grpc.aio.AioRpcError as exc:
            raise self._translate(exc, f"watch {prefix}") from None
        finally:
            call.cancel()


class LeaseKeepAlive:
    """One bidi LeaseKeepAlive stream; ``ping()`` sends one request and waits for
    its answer. The stream is reopened after any failure."""

    def __init__(self, store: Store, lease_id: int):
        self.store = store
        self.lease_id = lease_id
        self._call: Any = None

    async def ping(self, timeout: float) -> int:
        """Returns the remaining TTL (0 = the lease is gone)."""
        try:
            if self._call is None:
                self._call = self.store._lease.LeaseKeepAlive(metadata=_METADATA)
            await asyncio.wait_for(self._call.write(epb.LeaseKeepAliveRequest(ID=self.lease_id)), timeout)
            resp = await asyncio.wait_for(self._call.read(), timeout)
            if resp is grpc.aio.EOF:
                raise StoreUnavailable("lease keepalive stream ended")
            return resp.TTL
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, StoreUnavailable) as exc:
            self.close()
            if isinstance(exc, StoreUnavailable):
                raise
            raise StoreUnavailable(f"lease keepalive failed: {exc!r}") from None

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


def jitter(base: float) -> float:
    """Retry pause with jitter, so replicas do not campaign in lockstep."""
    return base * (0.5 + random.random())


__all__ = [
    "Compacted", "Compare", "Conflict", "Delete", "Fence", "Get", "KV", "Keys", "NotLeader",
    "Op", "Put", "Store", "StoreUnavailable", "TxnResult", "WatchEvent", "absent", "unchanged",
]
