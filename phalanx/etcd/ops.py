"""What the store reads and writes: records (``KV``, ``encode``), the
compares that guard a write (``Compare``, ``absent``, ``unchanged_since``,
...), the operations of a transaction (``Put``, ``Delete``, ``Get``) and
the results (``TxnResult``, ``WatchEvent``, ``EtcdSpaceReport``), each
with its etcd protobuf form. Plain values: no call to etcd here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from aetcd.rpc import rpc_pb2 as epb

from phalanx.etcd.keys import prefix_end

# etcd rejects txns with more than 128 operations (--max-txn-ops default).
MAX_TXN_OPS = 128


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


def kv_from_pb(m: Any) -> KV:
    """A ``KV`` from etcd's ``mvccpb.KeyValue``."""
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


def txn_keys(compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op]) -> str:
    """The keys a transaction touches, for a refusal's message (etcd does
    not say which one its role check stopped at)."""
    keys: list[str] = []
    for k in [c.key for c in compares] + [o.key for o in success] + [o.key for o in failure]:
        if k not in keys:
            keys.append(k)
    shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
    return shown
