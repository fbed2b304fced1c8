"""The etcd gateway's public names (docs/style.md §5): every caller imports
from here. The code lives in ``phalanx/etcd/`` (keys, ops, endpoints,
channels, errors, lease, client; its package docstring says which holds
what); this module only re-exports it."""

from __future__ import annotations

from phalanx.errors import Conflict, NotLeader, StoreDenied, StoreSpaceExhausted, StoreUnavailable
from phalanx.etcd.channels import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, RENEWAL_CHECK_S
from phalanx.etcd.client import RANGE_MIN_BYTES_PER_S, Store, jitter, range_deadline
from phalanx.etcd.endpoints import Endpoint, EndpointRotation, InvalidEndpoint, parse_endpoint, parse_endpoints
from phalanx.etcd.errors import AUTH_OLD_RESENDS, NO_SPACE_RECOVERY, Compacted, classify
from phalanx.etcd.keys import Keys, prefix_end
from phalanx.etcd.lease import LeaseKeepAlive
from phalanx.etcd.ops import (
    KV, MAX_TXN_OPS, Compare, Delete, EtcdSpaceReport, Fence, Get, Op, Put, TxnResult, WatchEvent, absent, encode,
    none_under, unchanged, unchanged_since,
)

# What ``from phalanx.store import *`` gives, as before the split; the
# other names imported above are re-exported too, for the importers that
# name them (AUTH_OLD_RESENDS, KEEPALIVE_TIMEOUT_MS, RENEWAL_CHECK_S,
# classify, encode, jitter, prefix_end, range_deadline, ...).
__all__ = [
    "Compacted", "Compare", "Conflict", "Delete", "Endpoint", "EndpointRotation", "Fence", "Get",
    "InvalidEndpoint", "KV", "Keys", "NotLeader", "Op", "Put", "Store", "StoreDenied", "StoreUnavailable", "TxnResult",
    "WatchEvent", "absent", "none_under", "parse_endpoint", "parse_endpoints", "unchanged",
]
