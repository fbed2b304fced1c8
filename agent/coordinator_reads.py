"""An agent's two etcd reads, made by the coordinators instead
(docs/design.md §9.3 "Where the token check reads").

``CoordinatorReads`` stands in for the agent's ``phalanx.store.Store``
(``keys``, ``get``, ``txn``, ``close``) for exactly the reads the agent
makes: ``leader/<az>`` (finding the leader, checking an epoch) and
``leader/<az>`` with ``reservations/<az>/<gang>`` (the token check before a
start). Each is one ``AgentService.ReadToken`` call to a coordinator replica
of the AZ, leader or standby, which makes the linearizable etcd read with
its own credentials; so the agent needs none. The agent judges the records
itself, as before.

Replicas are asked in turn, starting with the last one that answered: a
refusal (PERMISSION_DENIED, INVALID_ARGUMENT: not transient) is
``StoreDenied``; no replica answering is ``StoreUnavailable``, which the
agent treats as an unreachable etcd (nothing starts: it fails closed).
Besides the given replicas, the leader's address of the last answer is
asked last (a leader that came up on an address the agent was not given,
e.g. a replaced pod); the given list is read at every call, so a caller may
add to it (the test harness adds the coordinators it starts later).
RESOURCE_EXHAUSTED (a replica's rate limit on token reads, with its retry
hint) is transient: the next replica is asked, and with none left the read
is unavailable (the token unconfirmed; the leader sends the start again).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Iterable, Sequence

import grpc

from phalanx.errors import StoreDenied, StoreUnavailable
from phalanx.process_flags import missing_credentials
from phalanx.store import KV, Get, Keys, TxnResult
from phalanx.tls import TlsFiles, coordinator_channel
from phalanx.v1 import agent_pb2 as apb
from phalanx.v1 import agent_pb2_grpc as agrpc

COORDINATORS_HELP = ("read the leader and the token check through these coordinator replicas of the AZ "
                     "(AgentService.ReadToken) instead of etcd: no etcd and no etcd credentials, the default "
                     "(docs/design.md 9.3); not with --etcd-tls-dir")


def add_where_flags(p: argparse.ArgumentParser) -> None:
    """--etcd or --coordinators, exactly one (python -m agent, agent.sim)."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--etcd", default="", help="the legacy path: read etcd HOST:PORT[,...] directly, with an agent "
                       "etcd user (phalanx etcd-auth --agent-user; only on an etcd with the fixes docs/security.md "
                       "lists); the default deployment uses --coordinators")
    where.add_argument("--coordinators", default="", metavar="ADDR[,ADDR...]", help=COORDINATORS_HELP)


def credentials_error(a: argparse.Namespace) -> str | None:
    """The one-line error for missing or contradictory credential flags:
    with --coordinators only --tls-dir is needed (and --etcd-tls-dir is
    refused), else what every process needs."""
    if not a.coordinators:
        return missing_credentials(a, plaintext="connect in plaintext")
    if a.etcd_tls_dir:
        return "--coordinators: not with --etcd-tls-dir (the agent then reads through the coordinators)"
    return None if a.insecure or a.tls_dir else "--tls-dir: required (pass --insecure to connect in plaintext)"


_REFUSED = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED}


def leader_address(r: apb.StoredRecord) -> str:
    """The address a leader record names ("" when absent or unreadable: the
    agent judges the record itself; this is only where to ask next)."""
    if not r.present:
        return ""
    try:
        data = json.loads(bytes(r.value))
    except ValueError:
        return ""
    address = data.get("address") if isinstance(data, dict) else None
    return address if isinstance(address, str) and 0 < len(address) <= 256 else ""


class CoordinatorReads:
    # An agent's words when its read is refused, and what to check (as Store's).
    refused_read = ("a coordinator refused this agent's read (check this agent's certificate: its node and AZ, "
                    "phalanx certs issue --role agent --node --az; and that --coordinators are this AZ's)")

    def __init__(self, addresses: Sequence[str], cluster: str, az: str, *, tls: TlsFiles | None,
                 timeout: float) -> None:
        # Not copied: read at every call (see the module docstring).
        self.addresses = addresses
        self.learned = ""  # the leader's address of the last answer
        self.keys = Keys(cluster)
        self.cluster = cluster
        self.az = az
        self.tls = tls
        self.timeout = timeout
        self.user = ""  # as Store.user: no etcd user at all
        self._first = 0
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> agrpc.AgentServiceStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = (coordinator_channel(address, self.tls, cluster=self.cluster) if self.tls is not None
                  else grpc.aio.insecure_channel(address))
            self._channels[address] = ch
        return agrpc.AgentServiceStub(ch)

    async def _read(self, gang: str) -> apb.TokenReadReply:
        tried: list[str] = []
        given = list(self.addresses)
        candidates = given + ([self.learned] if self.learned and self.learned not in given else [])
        n = len(candidates)
        for i in range(n):
            index = (self._first + i) % n
            address = candidates[index]
            try:
                reply = await self._stub(address).ReadToken(apb.TokenReadRequest(az=self.az, gang=gang),
                                                             timeout=self.timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _REFUSED:
                    raise StoreDenied(f"coordinator {address} refused the token read: {exc.code().name}: "
                                      f"{exc.details()}", key=gang or self.keys.leader(self.az)) from None
                tried.append(f"{address}: {exc.code().name}: {exc.details()}")
                continue
            self._first = index if index < len(given) else 0
            self.learned = leader_address(reply.leader) or self.learned
            return reply
        raise StoreUnavailable(f"no coordinator of {self.az} answered the token read "
                               f"({'; '.join(tried) or 'no coordinator address known'})")

    def _kv(self, key: str, r: apb.StoredRecord) -> tuple[KV, ...]:
        if not r.present:
            return ()
        return (KV(key=key, value=bytes(r.value), create_revision=r.create_revision, mod_revision=r.mod_revision,
                   version=r.version, lease=0),)

    def _gang_of(self, op: Any) -> str:
        prefix = self.keys.reservation(self.az, "")
        if not isinstance(op, Get) or op.prefix or not op.key.startswith(prefix):
            raise ValueError(f"CoordinatorReads: only reads of {prefix}<gang>, not {op!r}")
        return op.key[len(prefix):]

    async def get(self, key: str) -> KV | None:
        if key != self.keys.leader(self.az):
            raise ValueError(f"CoordinatorReads: only {self.keys.leader(self.az)} is read alone, not {key}")
        reply = await self._read("")
        found = self._kv(key, reply.leader)
        return found[0] if found else None

    async def txn(self, compares: Iterable[Any], success: Iterable[Any], failure: Iterable[Any] = ()) -> TxnResult:
        ops = list(success)
        leader = self.keys.leader(self.az)
        if list(compares) or list(failure) or not ops or len(ops) > 2 or ops[0] != Get(leader):
            raise ValueError(f"CoordinatorReads: only the token check's read ({leader} [+ its reservation])")
        gang = self._gang_of(ops[1]) if len(ops) == 2 else ""
        reply = await self._read(gang)
        results: tuple[tuple[KV, ...], ...] = (self._kv(leader, reply.leader),)
        if gang:
            results += (self._kv(ops[1].key, reply.reservation),)
        return TxnResult(succeeded=True, revision=reply.revision, results=results)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
