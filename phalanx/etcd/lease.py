"""Keeping an etcd lease alive (``LeaseKeepAlive``): one bidi stream, one
request per keepalive, on the member the store's other calls use. Granting
and revoking leases are plain calls of the store (phalanx/etcd/client.py);
the lease session built on them lives with the election
(coordinator/election.py)."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc
from aetcd.rpc import rpc_pb2 as epb

from phalanx.errors import StoreUnavailable
from phalanx.etcd.channels import METADATA, Member
from phalanx.etcd.errors import FAILOVER_CODES


class MemberPinning(Protocol):
    """What a keepalive needs of the store (``phalanx.etcd.client.Store``)."""

    timeout: float

    def pin(self) -> tuple[Member, int, int]: ...

    def member_failed(self, index: int, generation: int, why: str) -> None: ...


class LeaseKeepAlive:
    """One bidi LeaseKeepAlive stream; ``ping()`` sends one request and waits for
    its answer. The stream is reopened after any failure, and whenever the
    store has moved to another member since it was opened, so a keepalive
    always goes where the other calls go."""

    def __init__(self, store: MemberPinning, lease_id: int):
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
                self._call = member.lease.LeaseKeepAlive(metadata=METADATA)
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
            if (code is None or code in FAILOVER_CODES) and not short:
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

