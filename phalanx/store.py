"""The only module that talks to etcd (docs/style.md §5).

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

Key layout (see docs/etcd-keys.md): everything under ``/phalanx/<cluster>/``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

import grpc
from aetcd.rpc import rpc_pb2 as epb
from aetcd.rpc import rpc_pb2_grpc as egrpc

from phalanx import etcd_pki, failpoints
from phalanx.errors import Conflict, NotLeader, StoreDenied, StoreSpaceExhausted, StoreUnavailable
from phalanx.limits import PAGE_KEYS, RANGE_REPLY_BYTES
from phalanx.tls import TlsFiles

log = logging.getLogger(__name__)

# etcd rejects txns with more than 128 operations (--max-txn-ops default).
MAX_TXN_OPS = 128
_METADATA = (("hasleader", "true"),)
# Codes that say "this member did not answer" (including etcd's "no leader",
# which the hasleader metadata turns into UNAVAILABLE): the store moves to the
# next member for later calls. Other codes are answers and move nothing.
_FAILOVER = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}
# etcd's answers when auth is on. "permission denied": the user's role does
# not cover the key. "user name is empty"/"not found": the certificate's CN
# is no etcd user (roles not provisioned). Both are refusals, never retried.
_DENIED_DETAILS = ("permission denied", "user name is empty", "user name not found")
# "auth: revision in header is old" (etcd's ErrAuthOldRevision, sent as
# "etcdserver: revision of auth store is old"): etcd stamped the request
# with the auth revision when it arrived and, before applying it, the users
# or roles changed (``phalanx etcd-auth`` provisioning or removing another
# cluster on the same etcd). It does hit coordinators: with another
# cluster's roles provisioned in a loop, about a third of a coordinator's
# txns got it (docs/security.md "etcd: TLS and roles"). etcd
# refused the request before applying anything, so sending it again is
# safe even for a write (the "never retry a write" rule is about writes
# whose outcome is unknown; clientv3 resends these too): the store resends
# it at once, at most AUTH_OLD_RESENDS times, and then treats it as a
# transient failure of that one call (StoreUnavailable, which every caller
# already treats as "try again later"). The member is fine, so it does not
# move the store to another one.
_AUTH_OLD_REVISION = ("revision of auth store is old", "revision in header is old")
AUTH_OLD_RESENDS = 3
# etcd's ErrGRPCNoSpace ("etcdserver: mvcc: database space exceeded",
# RESOURCE_EXHAUSTED): the NOSPACE alarm is active and every write is refused
# until an operator recovers (docs/etcd-keys.md "When etcd is full").
_NO_SPACE = "database space exceeded"
NO_SPACE_RECOVERY = ("etcd's space alarm (NOSPACE) is active: its database reached --quota-backend-bytes and etcd "
                     "refuses every write until an operator compacts, defragments and disarms it "
                     "(docs/etcd-keys.md \"When etcd is full\")")


def classify(code: grpc.StatusCode, details: str) -> str:
    """What an etcd error answer means to the store (pure): "denied"
    (StoreDenied), "auth-old" (resend, see above), "no-space" (etcd's space
    alarm: StoreSpaceExhausted), "transient" or "refused" (both
    StoreUnavailable; only "transient" may move to another member)."""
    if code == grpc.StatusCode.PERMISSION_DENIED or any(d in details for d in _DENIED_DETAILS):
        return "denied"
    if _NO_SPACE in details:
        return "no-space"
    if any(d in details for d in _AUTH_OLD_REVISION):
        return "auth-old"
    return "transient" if code in _TRANSIENT else "refused"


def _auth_old(exc: grpc.aio.AioRpcError) -> bool:
    return classify(exc.code(), exc.details() or "") == "auth-old"


# --- keys --------------------------------------------------------------------


@dataclass(frozen=True)
class Keys:
    """The key layout of docs/etcd-keys.md, in one place."""

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

    def expired(self, gang_id: str = "") -> str:
        """What is left of a collected gang: its id, terminal state and owner,
        so GetGang can say "finished and expired" (docs/etcd-keys.md
        "Retention by count and bytes"); bounded in number."""
        return f"{self.root}expired/{gang_id}"

    def name(self, name: str) -> str:
        """Index of live gang names: a name is unique among live gangs."""
        return f"{self.root}names/{name}"

    def policy(self) -> str:
        """The GangService policy every coordinator applies (coordinator/policy_store.py)."""
        return f"{self.root}policy"


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
    # Compare every key under ``key`` (etcd >= 3.3 range compare): true when
    # every key in the range satisfies it; an empty range compares as one
    # absent key (version 0), so ``version == 0`` means "no key under it".
    prefix: bool = False

    def to_pb(self) -> epb.Compare:
        result = {"==": epb.Compare.EQUAL, "!=": epb.Compare.NOT_EQUAL, ">": epb.Compare.GREATER, "<": epb.Compare.LESS}[self.result]
        c = epb.Compare(key=self.key.encode(), result=result)
        if self.prefix:
            c.range_end = prefix_end(self.key)
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


def none_under(prefix: str) -> Compare:
    """No key starts with ``prefix``."""
    return Compare(prefix, "version", "==", 0, prefix=True)


def unchanged_since(key: str, mod_revision: int) -> Compare:
    """The key was not written since ``mod_revision`` (the one mod-revision
    compare: every read-then-write guard uses it)."""
    return Compare(key, "mod", "==", mod_revision)


def unchanged(kv: KV) -> Compare:
    """``kv`` is still what was read."""
    return unchanged_since(kv.key, kv.mod_revision)


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
    keys_only: bool = False

    def to_pb(self) -> epb.RequestOp:
        req = epb.RangeRequest(key=self.key.encode(), keys_only=self.keys_only)
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


@dataclass(frozen=True)
class EtcdSpaceReport:
    """What etcd says about its space (``Store.space``): the size of the
    answering member's database file and the part of it in use (Maintenance
    Status), and the alarms active anywhere in the cluster (Alarm GET), by
    name (``NOSPACE``, ``CORRUPT``). etcd does not report its quota
    (--quota-backend-bytes): that comes from configuration."""

    member: str
    db_size: int
    db_size_in_use: int
    alarms: tuple[str, ...]
    revision: int = 0  # etcd's current revision (the Status reply's header)


class Compacted(Exception):
    """The watch start revision was compacted; re-list, then watch again."""

    def __init__(self, compact_revision: int):
        super().__init__(f"revision compacted (oldest available {compact_revision})")
        self.compact_revision = compact_revision


# --- endpoints -------------------------------------------------------------------


class InvalidEndpoint(ValueError):
    """An etcd endpoint that is not ``host:port``, ``http://host:port`` or
    ``[ipv6]:port``."""


@dataclass(frozen=True)
class Endpoint:
    """One etcd member's client address."""

    host: str  # a DNS name, an IPv4 address, or an IPv6 address without brackets
    port: int

    @property
    def target(self) -> str:
        """The gRPC target: plain ``host:port`` goes through gRPC's default
        (DNS) resolver, which also takes IP literals."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.target


_HOSTNAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_ENDPOINT_FORMS = "expected host:port, http://host:port or [ipv6]:port"


def parse_endpoint(text: str) -> Endpoint:
    """Parse one endpoint; ``InvalidEndpoint`` names it and says what is wrong."""

    def bad(why: str) -> InvalidEndpoint:
        return InvalidEndpoint(f"etcd endpoint {text!r}: {why} ({_ENDPOINT_FORMS})")

    rest = text.strip()
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if scheme.lower() != "http":
            raise bad(f"scheme {scheme!r} is not supported (TLS comes from the etcd client files, "
                      f"--etcd-tls-dir; give host:port)")
    if rest.endswith("/"):
        rest = rest[:-1]
    if not rest:
        raise bad("empty")
    if "/" in rest or "@" in rest or "?" in rest or "#" in rest:
        raise bad("only host and port are allowed")
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise bad("unclosed '['")
        host, after = rest[1:close], rest[close + 1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad(f"{host!r} in brackets is not an IPv6 address") from None
        if not after.startswith(":"):
            raise bad("missing port")
        port_text = after[1:]
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep:
            raise bad("missing port")
        if ":" in host:
            raise bad("an IPv6 address needs brackets")
        if not _HOSTNAME.match(host):
            raise bad(f"{host!r} is not a host name or address" if host else "missing host")
    if not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise bad(f"port {port_text!r} is not a number in 1..65535" if port_text else "missing port")
    return Endpoint(host, int(port_text))


def parse_endpoints(endpoints: str | Sequence[str]) -> tuple[Endpoint, ...]:
    """A comma-separated string or a list of endpoints, in the order given
    (the first is used first: list the nearest member first)."""
    if isinstance(endpoints, str):
        endpoints = endpoints.split(",")
    items = [e for e in endpoints if e.strip()]
    if not items:
        raise InvalidEndpoint("etcd endpoints: at least one host:port is required")
    out = tuple(parse_endpoint(e) for e in items)
    seen: set[Endpoint] = set()
    for text, ep in zip(items, out):
        if ep in seen:
            raise InvalidEndpoint(f"etcd endpoint {text!r}: listed twice ({ep})")
        seen.add(ep)
    return out


@dataclass
class EndpointRotation:
    """Which member the store talks to now, and when to move on. Pure: the
    caller passes ``now``.

    Every call pins ``(current, generation)`` when it starts. A transient
    failure moves ``current`` only if nothing moved it since that call began
    (its generation is still current): ten calls that time out together on a
    dead member move the store once, not ten times around the ring. The move
    goes to the next member in list order that has not failed within
    ``suspect_s``; when every other member has, to the plain next one, so the
    store keeps cycling rather than sticking to a dead member. There is no
    move back: a member that works stays current (as clientv3's pinned
    endpoint does)."""

    count: int
    suspect_s: float = 10.0
    current: int = 0
    generation: int = 0
    failed_at: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.failed_at:
            self.failed_at = [float("-inf")] * self.count

    def pin(self) -> tuple[int, int]:
        return self.current, self.generation

    def failed(self, index: int, generation: int, now: float) -> bool:
        """Record that a call pinned to ``(index, generation)`` failed
        transiently; return whether the store moved to another member."""
        self.failed_at[index] = max(self.failed_at[index], now)
        if generation != self.generation or self.count < 2:
            return False
        nxt = (self.current + 1) % self.count
        for step in range(1, self.count):
            j = (self.current + step) % self.count
            if now - self.failed_at[j] >= self.suspect_s:
                nxt = j
                break
        self.current = nxt
        self.generation += 1
        return True


# --- the client ----------------------------------------------------------------


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


# Channel keepalive (docs/timing.md "etcd connections"). etcd's server
# refuses pings closer than --grpc-keepalive-min-time (default 5 s) with
# GOAWAY too_many_pings after three strikes, so the cadence stays above it
# with a margin for jitter. It only backs up the failover above: it finds a
# dead connection under a long-lived watch that no other call would notice.
KEEPALIVE_TIME_MS = 6_000
KEEPALIVE_TIMEOUT_MS = 3_000


@dataclass
class _Member:
    endpoint: Endpoint
    channel: grpc.aio.Channel
    kv: egrpc.KVStub
    lease: egrpc.LeaseStub
    watch: egrpc.WatchStub
    maintenance: egrpc.MaintenanceStub


@dataclass(eq=False)
class _OpenWatch:
    call: Any
    abandoned: bool = False


# How often a call looks at the client files' stat for a renewal (a stat of
# three files; once a second is nothing next to an etcd round trip).
RENEWAL_CHECK_S = 1.0


def _files_stat(files: Any) -> tuple[Any, ...]:
    out = []
    for path in (files.ca, files.cert, files.key):
        try:
            st = os.stat(path)
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


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
        self._members: list[_Member] = []
        self._retired: list[_Member] = []  # channels of replaced client certificates
        self._options: list[tuple[str, Any]] = []
        self._tls_seen: tuple[Any, ...] = ()
        self._tls_checked_at = float("-inf")
        self._watches: list[set[_OpenWatch]] = [set() for _ in self._endpoints]

    async def connect(self) -> "Store":
        if not self._members:
            options = [
                ("grpc.max_receive_message_length", 8 * 1024 * 1024),
                ("grpc.enable_retries", 0),
                ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                # No pings on an idle connection (etcd counts them as strikes
                # too), but keep pinging under a quiet watch stream.
                ("grpc.keepalive_permit_without_calls", 0),
                ("grpc.http2.max_pings_without_data", 0),
                # A member that comes back is usable within seconds, not
                # after gRPC's default backoff of up to two minutes.
                ("grpc.max_reconnect_backoff_ms", 2_000),
            ]
            self._options = options
            creds = None
            if self.tls is not None:
                # Checked here, before any handshake, so a wrong file is
                # named with the check it fails (TlsError) instead of a
                # bare handshake failure from etcd.
                self._tls_seen = _files_stat(self.tls)
                creds, self.user = etcd_pki.channel_credentials(self.tls)
                self._options = options + list(etcd_pki.CHANNEL_OPTIONS)
            self._members = self._open_members(creds)
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

    def _open_members(self, creds: grpc.ChannelCredentials | None) -> list[_Member]:
        members = []
        for ep in self._endpoints:
            if creds is not None:
                ch = grpc.aio.secure_channel(ep.target, creds, options=self._options)
            else:
                ch = grpc.aio.insecure_channel(ep.target, options=self._options)
            # Connect every member now, so a failover does not also pay
            # for a connection handshake.
            ch.get_state(try_to_connect=True)
            members.append(_Member(ep, ch, egrpc.KVStub(ch), egrpc.LeaseStub(ch), egrpc.WatchStub(ch),
                                   egrpc.MaintenanceStub(ch)))
        return members

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
        seen = _files_stat(self.tls)
        if seen == self._tls_seen:
            return
        self._tls_seen = seen
        try:
            creds, user = etcd_pki.channel_credentials(self.tls)
        except Exception as exc:  # noqa: BLE001 - TlsError and unreadable files alike
            log.error("etcd client files changed but cannot be used (keeping the old ones): %s", exc)
            return
        self._retired.extend(self._members)
        self._members = self._open_members(creds)
        log.info("etcd client certificate renewed (user %s): new calls use it", user)
        self.user = user

    def pin(self) -> tuple[_Member, int, int]:
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
        details = exc.details() or ""
        kind = classify(exc.code(), details)
        if kind == "denied":
            return self._denied(what, key() if callable(key) else key, details)
        if kind == "auth-old":
            return StoreUnavailable(f"etcd refused {what} for now: the etcd users or roles changed while it was "
                                    f"checked, {AUTH_OLD_RESENDS + 1} times in a row ({details}); nothing was "
                                    f"applied, sending it again may pass")
        if kind == "no-space":
            return StoreSpaceExhausted(f"etcd refused {what}: {NO_SPACE_RECOVERY} ({exc.code().name}: {details})")
        if kind == "transient":
            hint = ""
            if self.tls is not None and ("ssl" in details.lower() or "handshake" in details.lower()):
                hint = (f" (TLS handshake failed: is {self.tls.ca} the CA of etcd's server certificate, and "
                        f"{self.tls.cert} issued by etcd's CA?)")
            elif self.tls is None and "socket closed" in details.lower():
                hint = " (plaintext: an etcd that serves TLS only closes such connections; give its client files)"
            return StoreUnavailable(f"etcd unavailable during {what}: {exc.code().name}: {details}{hint}")
        return StoreUnavailable(f"etcd refused {what}: {exc.code().name}: {details}")

    def _denied(self, what: str, key: str, details: str) -> StoreDenied:
        user = repr(self.user) if self.user else "(none: plaintext)"
        on = f" touching {key}" if key and key not in what else ""
        return StoreDenied(f"etcd denied {what}{on} to etcd user {user}: {details}; that user's role does not "
                           f"allow it (roles: phalanx etcd-auth)", key=key, user=self.user)

    def _measured(self, kind: str, started: float, ok: bool) -> None:
        if self.metrics is not None:
            self.metrics.etcd_request(kind, time.perf_counter() - started, ok)

    async def _call(self, method: Callable[[_Member], Any], req: Any, what: str, timeout: float | None = None,
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

    async def _call_once(self, method: Callable[[_Member], Any], req: Any, what: str, timeout: float | None = None,
                         *, blame_timeout: bool = True, key: str | Callable[[], str] = "") -> Any:
        """One call on the current member. ``blame_timeout=False``: a
        DEADLINE_EXCEEDED is not held against the member (a large range read
        may simply be slow; moving would also break every open watch). A
        member that really stopped answering is found by the next short call
        or lease keepalive."""
        member, index, generation = self.pin()
        for resend in range(AUTH_OLD_RESENDS + 1):
            try:
                return await method(member)(req, timeout=timeout or self.timeout, metadata=_METADATA)
            except grpc.aio.AioRpcError as exc:
                if _auth_old(exc) and resend < AUTH_OLD_RESENDS:
                    continue  # refused before anything was applied: safe to send again (_AUTH_OLD_REVISION)
                blame = exc.code() in _FAILOVER and (blame_timeout or exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED)
                if blame:
                    self.member_failed(index, generation, f"{what}: {exc.code().name}")
                raise self._translate(exc, f"{what} (at {member.endpoint})", key) from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    # -- reads (linearizable)
    async def get(self, key: str) -> KV | None:
        resp = await self._call(lambda m: m.kv.Range, epb.RangeRequest(key=key.encode()), f"get {key}", key=key)
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def get_prefix(self, prefix: str, *, keys_only: bool = False, limit: int = 0) -> tuple[list[KV], int]:
        req = epb.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix), keys_only=keys_only, limit=limit)
        resp = await self._call(lambda m: m.kv.Range, req, f"range {prefix}", timeout=self.range_timeout,
                                blame_timeout=False, key=prefix)
        return [_kv(m) for m in resp.kvs], resp.header.revision

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
                resp = await member.kv.Range(req, timeout=self.range_timeout, metadata=_METADATA)
                self._measured("get", started, True)
            except grpc.aio.AioRpcError as exc:
                self._measured("get", started, False)
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and size > 1:
                    size = max(1, size // 2)  # the reply was over our receive limit
                    continue
                if _auth_old(exc) and resends < AUTH_OLD_RESENDS:
                    resends += 1  # see _AUTH_OLD_REVISION
                    continue
                # As _call with blame_timeout=False: a slow range read is not
                # held against the member.
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.member_failed(index, generation, f"range {prefix}: {exc.code().name}")
                raise self._translate(exc, what, prefix) from None
            if not revision:
                revision = resp.header.revision
            kvs = [_kv(m) for m in resp.kvs]
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
        return [_kv(m) for m in resp.kvs]

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
        resp = await self._call(lambda m: m.kv.Txn, req, "txn", key=lambda: _txn_keys(compares, success, failure), kind="txn")
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
        call = member.watch.Watch(metadata=_METADATA)
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
                    if any(d in resp.cancel_reason for d in _DENIED_DETAILS):
                        raise self._denied("watch", prefix, resp.cancel_reason)
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
            if self.metrics is not None:
                self.metrics.etcd_request("watch", 0.0, False)
            if opened.abandoned:
                raise StoreUnavailable(f"watch on {prefix} left unresponsive etcd member {member.endpoint}") from None
            if exc.code() in _FAILOVER:
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


class LeaseKeepAlive:
    """One bidi LeaseKeepAlive stream; ``ping()`` sends one request and waits for
    its answer. The stream is reopened after any failure, and whenever the
    store has moved to another member since it was opened, so a keepalive
    always goes where the other calls go."""

    def __init__(self, store: Store, lease_id: int):
        self.store = store
        self.lease_id = lease_id
        self._call: Any = None
        self._index = -1

    async def ping(self, timeout: float) -> int:
        """Returns the remaining TTL (0 = the lease is gone)."""
        member, index, generation = self.store.pin()
        if self._call is not None and self._index != index:
            self.close()
        try:
            if self._call is None:
                self._call = member.lease.LeaseKeepAlive(metadata=_METADATA)
                self._index = index
            await asyncio.wait_for(self._call.write(epb.LeaseKeepAliveRequest(ID=self.lease_id)), timeout)
            resp = await asyncio.wait_for(self._call.read(), timeout)
            if resp is grpc.aio.EOF:
                raise StoreUnavailable(f"lease keepalive stream ended (at {member.endpoint})")
            return resp.TTL
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, StoreUnavailable) as exc:
            self.close()
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
            # No answer in time, a refused stream, or an ended one: this
            # member is not keeping our lease alive, try the next one. A
            # timeout shorter than a normal request's (the lease's last
            # moments) says nothing about the member.
            short = isinstance(exc, asyncio.TimeoutError) and timeout < self.store.timeout
            if (code is None or code in _FAILOVER) and not short:
                why = code.name if code is not None else type(exc).__name__
                self.store.member_failed(index, generation, f"lease keepalive: {why}")
            if isinstance(exc, StoreUnavailable):
                raise
            raise StoreUnavailable(f"lease keepalive failed (at {member.endpoint}): {exc!r}") from None

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
            self._index = -1


def _txn_keys(compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op]) -> str:
    """The keys a transaction touches, for a refusal's message (etcd does
    not say which one its role check stopped at)."""
    keys: list[str] = []
    for k in [c.key for c in compares] + [o.key for o in success] + [o.key for o in failure]:
        if k not in keys:
            keys.append(k)
    shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
    return shown


def jitter(base: float) -> float:
    """Retry pause with jitter, so replicas do not campaign in lockstep."""
    return base * (0.5 + random.random())


__all__ = [
    "Compacted", "Compare", "Conflict", "Delete", "Endpoint", "EndpointRotation", "Fence", "Get",
    "InvalidEndpoint", "KV", "Keys", "NotLeader", "Op", "Put", "Store", "StoreDenied", "StoreUnavailable", "TxnResult",
    "WatchEvent", "absent", "none_under", "parse_endpoint", "parse_endpoints", "unchanged",
]
