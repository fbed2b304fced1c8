"""One gRPC channel per etcd member (``Member``: the channel and the etcd
stubs over it), with the options, keepalive and request metadata every call
uses, and the stat of the client files by which a renewed certificate is
noticed (docs/timing.md "etcd connections")."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import grpc
from aetcd.rpc import rpc_pb2_grpc as egrpc

from phalanx.etcd.endpoints import Endpoint

# Every request carries it: a member cut off from the etcd majority fails
# fast instead of answering stale (docs/design.md §4).
METADATA = (("hasleader", "true"),)

# Channel keepalive (docs/timing.md "etcd connections"). etcd's server
# refuses pings closer than --grpc-keepalive-min-time (default 5 s) with
# GOAWAY too_many_pings after three strikes, so the cadence stays above it
# with a margin for jitter. It only backs up the store's failover: it finds a
# dead connection under a long-lived watch that no other call would notice.
KEEPALIVE_TIME_MS = 6_000
KEEPALIVE_TIMEOUT_MS = 3_000
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
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
)


@dataclass
class Member:
    endpoint: Endpoint
    channel: grpc.aio.Channel
    kv: egrpc.KVStub
    lease: egrpc.LeaseStub
    watch: egrpc.WatchStub
    maintenance: egrpc.MaintenanceStub


def open_members(endpoints: Sequence[Endpoint], creds: grpc.ChannelCredentials | None,
                 options: Sequence[tuple[str, Any]]) -> list[Member]:
    """A channel to each of ``endpoints`` (TLS with ``creds``, else plaintext)."""
    members = []
    for ep in endpoints:
        if creds is not None:
            ch = grpc.aio.secure_channel(ep.target, creds, options=options)
        else:
            ch = grpc.aio.insecure_channel(ep.target, options=options)
        # Connect every member now, so a failover does not also pay
        # for a connection handshake.
        ch.get_state(try_to_connect=True)
        members.append(Member(ep, ch, egrpc.KVStub(ch), egrpc.LeaseStub(ch), egrpc.WatchStub(ch),
                              egrpc.MaintenanceStub(ch)))
    return members


# How often a call looks at the client files' stat for a renewal (a stat of
# three files; once a second is nothing next to an etcd round trip).
RENEWAL_CHECK_S = 1.0


def files_stat(files: Any) -> tuple[Any, ...]:
    out = []
    for path in (files.ca, files.cert, files.key):
        try:
            st = os.stat(path)
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)
