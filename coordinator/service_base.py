"""What every GangService RPC shares (docs/style.md §8): errors translated
at the boundary (``handled``), who the caller is and what it may do
(``_authorize``), forwarding to an AZ's leader within the caller's deadline,
and the etcd reads of an AZ's nodes and reservations. The RPCs are in
``coordinator/service.py`` (gangs), ``node_service.py`` and
``policy_service.py``; ``GangServicer`` combines them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc

from coordinator import tokens
from coordinator.core import authz
from coordinator.core.records import DeviceLedger, NodeRecord, read_records
from coordinator.election import observe, observe_all
from coordinator.serving import ServingContext
from phalanx.certs import Identity, IdentityError
from phalanx.errors import CLUSTER_METADATA, COORDINATOR_METADATA, NotFound, NotLeader, PermissionDenied, PhalanxError, StoreUnavailable as Unavailable
from phalanx.leader_record import LeaderInfo
from phalanx.reservation import Reservation
from phalanx.spec import InvalidSpec
from phalanx.tls import peer_identity, utc_now
from phalanx.v1 import gang_pb2_grpc as ggrpc

log = logging.getLogger(__name__)

FORWARDED = "x-phalanx-forwarded"
# The owner of a forwarded SubmitGang, as the first coordinator identified
# its caller; trusted only on a call from a coordinator certificate of this
# cluster (docs/security.md "Forwarded calls").
OWNER = "x-phalanx-owner"
# A read that ranges over prefixes answers UNAVAILABLE "etcd did not answer"
# once this fraction of the caller's remaining deadline is spent, so the
# caller learns that etcd is the cause instead of seeing its own deadline
# expire without a word (the rest of the deadline carries the answer back).
ETCD_SHARE_OF_DEADLINE = 0.8
# An explain forwarded to the leader gets this share of the caller's
# remaining deadline: the rest is for the answer from etcd alone when the
# leader does not answer.
EXPLAIN_SHARE_OF_DEADLINE = 0.5


async def abort_error(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Domain errors -> status codes, by table (phalanx.errors)."""
    if isinstance(exc, InvalidSpec):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, PhalanxError):
        await context.abort(exc.code, str(exc))
    log.exception("internal error")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")


def handled(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(self: "ServicerBase", request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._tag(context)
        try:
            return await fn(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - translated, never leaked
            await abort_error(context, exc)

    wrapper.__name__ = fn.__name__
    return wrapper


def forward_failure(info: LeaderInfo, method: str, forwarder: str, code: str, details: str, *,
                    waited_s: float, budget_s: float) -> str:
    """What a forwarded call that ended in DEADLINE_EXCEEDED or CANCELLED
    tells the caller: how long it really waited and, when the budget had not
    run out, that the leader itself ended the call, with its own status (a
    budget quoted as the wait read as "95.7 s" after 8.7 s of a burst)."""
    who = f"the leader of {info.az} ({info.coordinator_id} at {info.address})"
    via = f"forwarded by {forwarder}"
    # grpc's own timer ends a call within a few ms of the budget.
    if waited_s >= budget_s * 0.95:
        return (f"{who} did not answer {method} within the {budget_s:.1f} s left of the caller's deadline "
                f"(waited {waited_s:.1f} s, {via}); it may be overloaded")
    said = f": {details}" if details else ""
    return (f"{who} ended {method} with {code} after {waited_s:.1f} s, before the {budget_s:.1f} s "
            f"budget ran out ({via}){said}")


@dataclass(frozen=True)
class Caller:
    """Who a GangService call is from, as ``_authorize`` found it.
    ``identity`` None: a plaintext coordinator (nothing is checked)."""

    identity: Identity | None
    owner: str = ""  # what a submission records (and a cancel names in its event)
    forwarded: bool = False
    policy: authz.Policy = authz.Policy()

    def sees(self, gang_owner: str) -> bool:
        if self.identity is None:
            return True
        return authz.visible(self.identity, self.policy, gang_owner, forwarded=self.forwarded)


PLAINTEXT = Caller(None)
# Actions whose decision reads the policy (caps, visibility); the others
# are decided by role alone, so they do not wait on the policy record.
_POLICY_ACTIONS = (authz.SUBMIT, authz.CANCEL, "get", "list", "watch", "explain")


class ServicerBase:
    """The parts of GangServicer every group of its RPCs uses."""

    def __init__(self, coordinator: ServingContext):
        self.c = coordinator
        self.store = coordinator.store
        self.keys = coordinator.store.keys
        self._leader_reads: dict[str, asyncio.Future[LeaderInfo | None]] = {}

    async def _leader_of(self, az: str) -> LeaderInfo | None:
        """The leader of ``az`` from etcd, one read shared by every request
        that asks while it is in flight. A burst of 2,000 submissions sent to
        a standby made 2,000 concurrent reads of the same key; on a busy
        machine many outlived etcd_timeout_s and the burst was told "etcd
        unavailable ... Deadline Exceeded" while etcd was up. A stale answer
        is harmless: the leader it names refuses a forwarded call it no
        longer leads for, and the caller retries."""
        fut = self._leader_reads.get(az)
        if fut is None:
            fut = asyncio.ensure_future(observe(self.store, az))
            self._leader_reads[az] = fut

            def done(f: asyncio.Future[LeaderInfo | None], az: str = az) -> None:
                self._leader_reads.pop(az, None)
                if not f.cancelled():
                    f.exception()  # retrieved: every waiter may have gone

            fut.add_done_callback(done)
        return await asyncio.shield(fut)

    def _forward_timeout(self, context: grpc.aio.ServicerContext, share: float = ETCD_SHARE_OF_DEADLINE) -> float:
        """Deadline of a call forwarded to a leader: ``share`` of the
        caller's remaining deadline (the rest carries the answer back), or
        forward_timeout_s when the caller set none. A fixed deadline shorter
        than the caller's gave up on a leader busy with a burst while the
        caller was still willing to wait."""
        left = context.time_remaining()
        if left is None:
            return self.c.config.timings.forward_timeout_s
        return max(left * share, 0.0)

    async def _forward(self, context: grpc.aio.ServicerContext, info: LeaderInfo, method: str, request: Any,
                       owner: str = "") -> Any:
        """``method`` on ``info``'s leader, within the caller's deadline;
        its error becomes ours, and a forwarded call that ran out of time
        says which leader did not answer (not grpc's bare "Deadline
        Exceeded" or "CANCELLED", which read as the caller's own)."""
        timeout = self._forward_timeout(context)
        stub = ggrpc.GangServiceStub(self.c.peer_channel(info.address))
        started = time.monotonic()
        try:
            metadata = ((FORWARDED, "1"),) + (((OWNER, owner),) if owner else ())
            return await getattr(stub, method)(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, forward_failure(
                    info, method, self.c.config.coordinator_id, exc.code().name, exc.details() or "",
                    waited_s=time.monotonic() - started, budget_s=timeout))
            await context.abort(exc.code(), exc.details() or "")

    async def _leader_or_forward(self, context: grpc.aio.ServicerContext, method: str, request: Any,
                                 owner: str = "") -> tuple[Any, Any]:
        """(leader, None) when we lead; else (None, the leader's response)."""
        leader = self.c.leader
        if leader is not None:
            return leader, None
        if self._forwarded(context):
            raise NotLeader(f"coordinator {self.c.config.coordinator_id} is not the leader of {self.c.config.az}; retry")
        info = await self._leader_of(self.c.config.az)
        if info is None or not info.address:
            raise Unavailable(f"{self.c.config.az} has no leader right now; retry shortly")
        if info.coordinator_id == self.c.config.coordinator_id:
            raise Unavailable(f"{self.c.config.az}: leadership is changing; retry shortly")
        return None, await self._forward(context, info, method, request, owner)

    def _forwarded(self, context: grpc.aio.ServicerContext) -> bool:
        return any(k == FORWARDED for k, _ in (context.invocation_metadata() or ()))

    async def _identify(self, context: grpc.aio.ServicerContext) -> Identity:
        """The caller's identity: its bearer token when the call carries one
        (only a coordinator with --token-file takes them), else its client
        certificate. Any failure is UNAUTHENTICATED naming the check, never
        the token."""
        try:
            token = tokens.bearer_token(context.invocation_metadata() or ())
        except tokens.TokenRefused as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        if token is not None:
            if self.c.tokens is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    f"bearer token: coordinator {self.c.config.coordinator_id} takes no bearer tokens "
                                    "(started without --token-file); use a client certificate")
            try:
                return self.c.tokens.identify(token)
            except tokens.TokenRefused as exc:
                log.warning("GangService refused a call from %s: %s", context.peer(), exc)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        source = self.c.tls_source
        assert source is not None
        try:
            return peer_identity(context, cas=source.current.cas, cluster=self.keys.cluster, now=utc_now())
        except IdentityError as exc:
            hint = " (or send a bearer token)" if self.c.tokens is not None else ""
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"client certificate: {exc}{hint}")
        raise AssertionError("unreachable: abort raises")

    def _missing(self, ident: str) -> NotFound:
        return NotFound(f"id: no gang {ident!r} in cluster {self.keys.cluster!r}: neither an id nor the name of "
                        f"a kept gang (finished gangs are deleted gang_retention_s="
                        f"{self.c.config.timings.gang_retention_s:g}s after they end)")

    async def _authorize(self, context: grpc.aio.ServicerContext, action: str, *, ident: str = "", **what: Any) -> Caller:
        """Refuse the call unless its caller may do ``action``
        (coordinator/core/authz.py); the Caller says the owner a submission
        records and which gangs the caller sees. Without TLS nothing is
        checked and the owner is "". Decided here, at the first coordinator
        the call reaches: a coordinator that forwards has already decided,
        so a forwarded call from a coordinator certificate is let through
        and carries its caller's owner. A cancel of a gang the caller may
        not see (``ident``: the id it named) is NOT_FOUND, as for a gang
        that does not exist."""
        if self.c.tls_source is None:
            return PLAINTEXT
        identity = await self._identify(context)
        forwarded = self._forwarded(context)
        policy = authz.Policy()
        if action in _POLICY_ACTIONS and not (forwarded and identity.role == "coordinator"):
            policy = (await self.c.policies.current()).policy
        if action == authz.CANCEL and not authz.visible(identity, policy, what.get("gang_owner", ""), forwarded=forwarded) \
                and identity.role == "submitter":
            raise self._missing(ident or what.get("gang_id", ""))
        decision = authz.decide(identity, action, policy=policy, forwarded=forwarded, **what)
        if not decision.allowed:
            raise PermissionDenied(decision.reason)
        if identity.role == "coordinator":  # forwarded (decide refuses it otherwise)
            if action == authz.CANCEL:
                # Only names the canceller in the gang's events (the first
                # coordinator decided): one that sent none, or a bad one, is "".
                by = dict(context.invocation_metadata() or ()).get(OWNER, "")
                return Caller(identity, by if authz.valid_owner(by) else "", forwarded, policy)
            if action != authz.SUBMIT:
                return Caller(identity, "", forwarded, policy)
            owner = dict(context.invocation_metadata() or ()).get(OWNER, "")
            if not authz.valid_owner(owner):
                raise PermissionDenied(f"{authz.owner_of(identity)}: a forwarded SubmitGang must carry the caller's "
                                       f"identity in {OWNER} as <role>/<name>, got {owner[:80]!r}")
            return Caller(identity, owner, forwarded, policy)
        return Caller(identity, authz.owner_of(identity), forwarded, policy)

    def _tag(self, context: grpc.aio.ServicerContext) -> None:
        """Every answer, errors included, names the cluster and the
        coordinator that gave it (trailing metadata; the SDK puts them in
        its errors): two clusters on one machine can look alike."""
        context.set_trailing_metadata((
            (CLUSTER_METADATA, self.keys.cluster),
            (COORDINATOR_METADATA, self.c.config.coordinator_id),
        ))

    async def _within_deadline(self, context: grpc.aio.ServicerContext, work: Awaitable[Any], what: str) -> Any:
        """``work`` (etcd reads), answered UNAVAILABLE naming etcd once
        ETCD_SHARE_OF_DEADLINE of the caller's remaining deadline is spent."""
        left = context.time_remaining()
        if left is None:
            return await work
        budget = max(left * ETCD_SHARE_OF_DEADLINE, 0.0)
        try:
            return await asyncio.wait_for(work, timeout=budget)
        except asyncio.TimeoutError:
            raise Unavailable(f"etcd did not answer {what} within {budget:.1f}s (the caller's deadline); "
                              f"etcd at {self.store.current_endpoint} may be down or overloaded") from None

    async def _az_state(self, az: str) -> tuple[dict[str, NodeRecord], DeviceLedger]:
        node_kvs, _ = await self.store.get_prefix_paged(self.keys.nodes(az))
        res_kvs, _ = await self.store.get_prefix_paged(self.keys.reservations(az))
        # An unreadable record is skipped (and logged), as rebuild() does: one
        # corrupt key must not stop status, nodes or explain for everyone.
        node_recs, bad_nodes = read_records(node_kvs, NodeRecord.from_dict)
        res_recs, bad_res = read_records(res_kvs, Reservation.from_dict)
        for key, why in bad_nodes + bad_res:
            log.warning("skipped unreadable record %s: %s", key, why)
        nodes = {n.name: n for n in node_recs}
        reservations = {r.gang: r for r in res_recs}
        return nodes, DeviceLedger.from_reservations(reservations)

    async def _azs(self) -> set[str]:
        kvs, _ = await self.store.get_prefix_paged(self.keys.nodes(), keys_only=True)
        azs = {kv.key[len(self.keys.nodes()):].split("/", 1)[0] for kv in kvs}
        azs |= set((await observe_all(self.store)).keys())
        return azs
