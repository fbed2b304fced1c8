"""GangService servicer: protobuf -> domain -> driver -> protobuf (docs/style.md §8).

Reads are served by any replica from etcd (linearizable reads). Writes go to
the AZ leader: a standby forwards them to the leader it finds in
``leader/<az>`` (one hop: a forwarded request is never forwarded again).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc

from coordinator import convert
from coordinator.broadcast import RESUME_HEADER, Change, serve
from coordinator.core.admission import spans_azs
from coordinator.core.placement import NodeView
from coordinator.core import authz, capacity, explanation, listing
from coordinator import tokens
from coordinator.policy_store import PolicyRecord
from coordinator.core.records import UNREADABLE, DeviceLedger, GangRecord, NameRecord, NodeRecord, read_records
from coordinator.core.retention import ExpiredGang
from coordinator.election import observe, observe_all
from coordinator.serving import ServingContext
from phalanx.leader_record import LeaderInfo
from phalanx.reservation import Reservation
from phalanx import limits, wire
from phalanx.errors import CLUSTER_METADATA, COORDINATOR_METADATA, DataLoss, InvalidArgument, NotFound, NotLeader, PermissionDenied, PhalanxError, StoreUnavailable as Unavailable, Unimplemented
from phalanx.model import GangState, Level
from phalanx.spec import InvalidSpec
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import gang_pb2_grpc as ggrpc
from phalanx.certs import Identity, IdentityError
from phalanx.tls import peer_identity, utc_now
from phalanx.v1 import types_pb2 as pb

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
# A gang id is its name, '-' and 8 hex digits (coordinator/leader.py).
_ID_SUFFIX = re.compile(r"[0-9a-f]{8}")


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Domain errors -> status codes, by table (phalanx.errors)."""
    if isinstance(exc, InvalidSpec):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, PhalanxError):
        await context.abort(exc.code, str(exc))
    log.exception("internal error")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")


def handled(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(self: "GangServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._tag(context)
        try:
            return await fn(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - translated, never leaked
            await _abort(context, exc)

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

class Expired(NotFound):
    """A gang retention collected: NOT_FOUND, saying so (``owner``: who may
    be told, under the visibility policy)."""

    def __init__(self, message: str, *, owner: str) -> None:
        super().__init__(message)
        self.owner = owner


def _valid_id(value: str, field: str = "id") -> str:
    """A gang id or name, exactly (docs/limits.md "Identifiers"): a DNS
    label, full match, so "x\n" is refused rather than read as "x"."""
    if not value:
        raise InvalidArgument(f"{field}: is required")
    why = limits.name_error(value, limits.DNS_LABEL, limits.MAX_GANG_ID_LEN, limits.DNS_LABEL_WHAT)
    if why:
        raise InvalidArgument(f"{field}: not a valid gang id or name: {why[:160]}")
    return value


def _valid_node(request: Any) -> tuple[str, str]:
    """(az, node) of a node lifecycle request (docs/nodes.md), both
    required and valid names, before anything is read or forwarded."""
    for field, pattern, most, what in (("az", limits.LABEL_VALUE, limits.MAX_AZ_NAME_LEN, limits.LABEL_VALUE_WHAT),
                                       ("node", limits.NODE_NAME, limits.MAX_NODE_NAME_LEN, limits.NODE_NAME_WHAT)):
        why = limits.name_error(getattr(request, field), pattern, most, what)
        if why:
            raise InvalidArgument(f"{field}: {why[:160]}")
    return request.az, request.node


def _valid_reason(reason: str) -> str:
    """A cancel reason: bounded, and printable (it is shown in `phalanx
    list` and `get`, and quoted in the gang record)."""
    size = len(reason.encode("utf-8", "surrogatepass"))
    if size > limits.MAX_CANCEL_REASON_BYTES:
        raise InvalidArgument(limits.size_error("reason", size, limits.MAX_CANCEL_REASON_BYTES))
    if not reason.isprintable():
        raise InvalidArgument(f"reason: must be printable text (no newlines or control characters), got {reason[:64]!r}")
    return reason


def _explain_placed(g: GangRecord) -> gpb.ExplainGangResponse:
    """ExplainGang of a gang that is not waiting: where it is and why."""
    return gpb.ExplainGangResponse(gang=convert.gang_to_pb(g), summary=explanation.placed_summary(g))


def _explanation_pb(g: GangRecord, ex: explanation.Explanation) -> gpb.ExplainGangResponse:
    # The leader's reason also goes into the summary: the summary is what a
    # person reads (`phalanx explain` prints it), the field is for programs.
    text = ex.summary + (f"\nleader: {ex.leader_reason}" if ex.leader_reason else "")
    resp = gpb.ExplainGangResponse(gang=convert.gang_to_pb(g), summary=text, leader_reason=ex.leader_reason,
                                   never_fits=ex.never_fits)
    resp.shortfalls.extend(convert.shortfall_to_pb(s) for s in ex.shortfalls)
    return resp


def _stream_identity(caller: "Caller") -> str:
    """Whose share of the watch stream caps a stream is."""
    return authz.owner_of(caller.identity) if caller.identity is not None else "an unauthenticated caller"

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


def _policy_pb(record: PolicyRecord) -> gpb.PolicyRecord:
    return gpb.PolicyRecord(policy_json=json.dumps(record.policy.to_data(), sort_keys=True), revision=record.revision,
                            set_by=record.set_by, set_at=record.set_at)


class GangServicer(ggrpc.GangServiceServicer):
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

    # ------------------------------------------------------------- writes
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

    @handled
    async def SubmitGang(self, request: gpb.SubmitGangRequest, context: grpc.aio.ServicerContext) -> gpb.SubmitGangResponse:
        spec = wire.spec_from_pb(request.spec)
        key = request.idempotency_key
        why = limits.name_error(key, limits.IDEMPOTENCY_KEY, limits.MAX_IDEMPOTENCY_KEY_LEN,
                                limits.IDEMPOTENCY_KEY_WHAT, required=False)
        if why:
            raise InvalidArgument(f"idempotency_key: {why[:200]}")
        owner = (await self._authorize(context, authz.SUBMIT, queue=spec.queue, priority=spec.priority)).owner
        if not self._forwarded(context):
            # Limited where it arrives; a forward was counted at its first hop.
            self.c.throttle.submission(owner)
        leader, forwarded = await self._leader_or_forward(context, "SubmitGang", request, owner)
        if forwarded is not None:
            return forwarded
        rec, created = await leader.submit(spec, key, owner=owner)
        return gpb.SubmitGangResponse(gang=convert.gang_to_pb(rec), created=created)

    @handled
    async def CancelGang(self, request: gpb.CancelGangRequest, context: grpc.aio.ServicerContext) -> pb.Gang:
        _valid_reason(request.reason)  # before anything is read or forwarded
        try:
            rec = await self._load(request.id)
        except Expired:
            raise self._missing(request.id) from None  # (who may learn it expired is not known yet)
        # Who cancels goes into the gang's "cancelled" event (and along with a forward).
        by = (await self._authorize(context, authz.CANCEL, gang_owner=rec.owner, gang_id=rec.id, ident=request.id)).owner
        if rec.state.terminal:
            from phalanx.errors import FailedPrecondition

            raise FailedPrecondition(f"id: gang {rec.id} is already {rec.state.name}; nothing to cancel")
        if rec.owner_az != self.c.config.az:
            # Owned by another AZ: forward to that AZ's leader.
            info = await self._leader_of(rec.owner_az)
            if info is None:
                raise Unavailable(f"{rec.owner_az}, which owns gang {rec.id}, has no leader right now; retry shortly")
            return await self._forward(context, info, "CancelGang", request, by)
        leader, forwarded = await self._leader_or_forward(context, "CancelGang", request, by)
        if forwarded is not None:
            return forwarded
        return convert.gang_to_pb(await leader.cancel(rec.id, request.reason, by=by))

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

    async def _load_seen(self, caller: Caller, ident: str) -> GangRecord:
        """``_load``, and NOT_FOUND (the same answer as for no such gang) for
        a gang the caller may not see (visibility: own)."""
        try:
            rec = await self._load(ident)
        except Expired as exc:
            if not caller.sees(exc.owner):
                raise self._missing(ident) from None
            raise
        if not caller.sees(rec.owner):
            raise self._missing(ident)
        return rec

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

    # -------------------------------------------------------------- reads
    async def _load(self, ident: str) -> GangRecord:
        """The gang with id ``ident``; else the live gang named ``ident``;
        else the most recently submitted gang of that name that is still
        kept (finished, not yet collected). So a name keeps resolving for
        as long as ``ListGangs`` shows a gang of that name."""
        ident = _valid_id(ident)
        kv = await self.store.get(self.keys.gang(ident))
        if kv is None:
            name_kv = await self.store.get(self.keys.name(ident))
            if name_kv is not None:
                try:
                    named = NameRecord.from_dict(name_kv.json()).id
                except UNREADABLE as exc:
                    # The newest kept gang of that name is found below all the same.
                    log.warning("unreadable name record %s: %r", name_kv.key[:200], exc)
                else:
                    kv = await self.store.get(self.keys.gang(named))
        if kv is None:
            kv = await self._latest_of_name(ident)
        if kv is None:
            raise await self._expired_or_missing(ident)
        records, bad = read_records([kv], GangRecord.from_dict)
        if bad:
            # The stored record is unreadable (written past the bounds or by
            # hand): not the caller's fault, so not INVALID_ARGUMENT.
            log.warning("unreadable gang record %s: %s", *bad[0])
            raise DataLoss(f"id: the stored record of gang {ident!r} cannot be read ({bad[0][1][:200]}); "
                           "an operator must delete or repair it")
        return records[0]

    async def _expired_or_missing(self, ident: str) -> NotFound:
        """The answer for an id with no record: "finished and expired" when
        retention collected it and its ``expired/<id>`` is still kept
        (docs/etcd-keys.md "Retention by count and bytes"), else not found."""
        kv = await self.store.get(self.keys.expired(ident)) if _ID_SUFFIX.fullmatch(ident[-8:]) else None
        if kv is None:
            return self._missing(ident)
        try:
            gone = ExpiredGang.from_dict(kv.json())
        except UNREADABLE as exc:
            log.warning("unreadable expired gang record %s: %r", kv.key[:200], exc)
            return self._missing(ident)
        ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(gone.ended_at))
        collected = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(gone.collected_at))
        t = self.c.config
        return Expired(f"id: gang {ident!r} finished {gone.state.name} at {ended} and expired: its record left etcd at "
                       f"{collected} (finished gangs are kept gang_retention_s={t.timings.gang_retention_s:g}s, and "
                       f"at most max_finished_gangs={t.max_finished_gangs} per AZ); its history is no longer "
                       f"kept by the cluster", owner=gone.owner)

    async def _latest_of_name(self, name: str) -> Any:
        """The record of the newest kept gang named ``name``, or None. The
        ``names/`` index holds live gangs only (it is released when a gang
        ends, so the name can be reused); finished gangs are found by their
        ids, ``<name>-<8 hex>``: a keys-only range over ``gangs/<name>-``,
        the newest by create revision (a record is created once, at
        submission)."""
        prefix = self.keys.gang(name + "-")
        kvs, _ = await self.store.get_prefix_paged(prefix, keys_only=True)
        mine = [kv for kv in kvs if _ID_SUFFIX.fullmatch(kv.key[len(prefix):])]
        if not mine:
            return None
        return await self.store.get(max(mine, key=lambda kv: kv.create_revision).key)

    @handled
    async def GetGang(self, request: gpb.GetGangRequest, context: grpc.aio.ServicerContext) -> pb.Gang:
        caller = await self._authorize(context, "get")
        return convert.gang_to_pb(await self._load_seen(caller, request.id))

    @handled
    async def ListGangs(self, request: gpb.ListGangsRequest, context: grpc.aio.ServicerContext) -> gpb.ListGangsResponse:
        caller = await self._authorize(context, "list")
        states = set()
        for s in request.states:
            try:
                states.add(GangState(s))
            except ValueError:
                raise InvalidArgument(f"states: unknown gang state {s}") from None
        if request.limit < 0:
            raise InvalidArgument("limit: must not be negative")
        # Filters are identifiers too: one alphabet, matched whole.
        for field, value, pattern, max_len, what in (
            ("queue", request.queue, limits.DNS_LABEL, limits.MAX_QUEUE_LEN, limits.DNS_LABEL_WHAT),
            ("owner_az", request.owner_az, limits.LABEL_VALUE, limits.MAX_AZ_NAME_LEN, limits.LABEL_VALUE_WHAT),
            ("name_prefix", request.name_prefix, r"[a-z0-9-]+", limits.MAX_GANG_ID_LEN,
             "a prefix of a DNS label (lowercase letters a-z, digits, '-')"),
        ):
            why = limits.name_error(value, pattern, max_len, what, required=False)
            if why:
                raise InvalidArgument(f"{field}: {why[:200]}")
        after = None
        if request.page_token:
            try:
                after = listing.parse_token(request.page_token)
            except listing.BadPageToken as exc:
                raise InvalidArgument(f"page_token: {exc}") from None
        # Paged range reads: no single etcd reply grows with the gang count.
        kvs, _ = await self._within_deadline(context, self.store.get_prefix_paged(self.keys.gangs()), "a range read of the gangs")
        gangs, bad = read_records(kvs, GangRecord.from_dict)
        if bad:
            log.warning("ListGangs skipped %d unreadable gang record(s), e.g. %s: %s", len(bad), *bad[0])
        out = []
        for g in gangs:
            if not caller.sees(g.owner):
                continue
            if states and g.state not in states:
                continue
            if request.queue and g.spec.queue != request.queue:
                continue
            if request.owner_az and g.owner_az != request.owner_az:
                continue
            if request.name_prefix and not g.spec.name.startswith(request.name_prefix):
                continue
            out.append(g)
        out.sort(key=lambda g: (g.submitted_at, g.id))
        if request.limit:
            out = out[-request.limit:]
        # Converted only as the page reaches them (a page is a slice of what
        # matched; the gangs before page_token and past the budget are not).
        converted: dict[str, pb.Gang] = {}

        def as_pb(g: GangRecord) -> pb.Gang:
            if g.id not in converted:
                converted[g.id] = convert.gang_to_pb(g)
            return converted[g.id]

        chosen, next_token = listing.page(
            out, key=lambda g: (g.submitted_at, g.id), size=lambda g: as_pb(g).ByteSize() + 8,
            budget=limits.LIST_REPLY_BYTES, after=after,
        )
        return gpb.ListGangsResponse(gangs=[as_pb(g) for g in chosen], next_page_token=next_token)

    async def WatchGang(self, request: gpb.WatchGangRequest, context: grpc.aio.ServicerContext) -> None:
        """The gang's record now, then each change until it is terminal or
        deleted, from the coordinator's one gang watch (coordinator/broadcast.py)."""
        self._tag(context)
        try:
            caller = await self._authorize(context, "watch")
            rec = await self._load_seen(caller, request.id)
            if rec.state.terminal:
                await context.write(gpb.GangEvent(gang=convert.gang_to_pb(rec), revision=rec.mod_revision))
                return
            gang_id = rec.id
            stream = await self.c.fanout.open(_stream_identity(caller), lambda ch: ch.gang_id == gang_id)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)
            return
        try:
            if stream.opened_at > rec.mod_revision:
                # It may have changed between the read and the subscription.
                rec = await self._load(gang_id)
            sent = rec.mod_revision
            await context.write(gpb.GangEvent(gang=convert.gang_to_pb(rec), revision=rec.mod_revision))
            if rec.state.terminal:
                return

            def replies(ch: Change) -> tuple[list[gpb.GangEvent], bool]:
                nonlocal sent
                if ch.deleted:
                    return [], True
                if ch.record is None or ch.record.mod_revision <= sent:
                    return [], False
                sent = ch.record.mod_revision
                return [gpb.GangEvent(gang=convert.gang_to_pb(ch.record), revision=ch.revision)], ch.record.state.terminal

            await serve(context, stream, replies)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)
        finally:
            stream.close()

    async def WatchEvents(self, request: gpb.WatchEventsRequest, context: grpc.aio.ServicerContext) -> None:
        """Every event recorded after the call starts (after
        ``after_revision``, when the coordinator still holds it), of the
        gangs the caller may see (of ``queue`` only, when named), from the
        coordinator's one gang watch (coordinator/broadcast.py): no etcd
        read or watch of its own."""
        self._tag(context)
        try:
            caller = await self._authorize(context, "watch")
            why = limits.name_error(request.queue, limits.DNS_LABEL, limits.MAX_QUEUE_LEN, limits.DNS_LABEL_WHAT, required=False)
            if why:
                raise InvalidArgument(f"queue: {why[:200]}")
            if request.after_revision < 0:
                raise InvalidArgument(f"after_revision: must be 0 (from now) or a revision received, got {request.after_revision}")
            queue = request.queue
            stream = await self.c.fanout.open(
                _stream_identity(caller), lambda ch: bool(ch.events) and self._streams_events_of(caller, queue, ch),
                after=request.after_revision)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)
            return
        try:
            # Headers now tell the caller the stream is open: every event
            # recorded from here on reaches it (it may wait long for a first one).
            await context.send_initial_metadata(((RESUME_HEADER, stream.resume),))
            await serve(context, stream, lambda ch: (ch.events, False))
        finally:
            stream.close()

    @staticmethod
    def _streams_events_of(caller: Caller, queue: str, ch: Change) -> bool:
        return caller.sees(ch.owner) and (not queue or ch.queue == queue)

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

    @handled
    async def ExplainGang(self, request: gpb.ExplainGangRequest, context: grpc.aio.ServicerContext) -> gpb.ExplainGangResponse:
        caller = await self._authorize(context, "explain")
        g = await self._load_seen(caller, request.id)
        if g.state not in (GangState.PENDING, GangState.RESERVING):
            return _explain_placed(g)
        # Only the owner AZ's leader knows why it holds a gang back (queue
        # order, backfill, restart backoff, two-phase state) and sees what it
        # places on (live agent sessions, in-flight holds): ask it, and answer
        # from etcd only when it cannot be asked.
        why = ""
        leader = self.c.leader
        if leader is not None and self.c.config.az == g.owner_az:
            try:
                ex = await leader.explain(g.id)
            except NotLeader as exc:
                ex, why = None, f"the leader of {g.owner_az} is stepping down ({exc})"
            if ex is not None:
                return _explanation_pb(g, ex)
            g = await self._load(g.id)
            if g.state not in (GangState.PENDING, GangState.RESERVING):
                return _explain_placed(g)
            why = why or f"the leader of {g.owner_az} holds no waiting gang {g.id} (it may have changed just now)"
        elif self._forwarded(context):
            why = f"the leadership of {g.owner_az} is changing"
        else:
            info = await self._leader_of(g.owner_az)
            if info is None or not info.address:
                why = f"{g.owner_az}, which owns this gang, has no leader right now: nothing is admitted for it until one is elected"
            elif info.coordinator_id == self.c.config.coordinator_id:
                why = f"the leadership of {g.owner_az} is changing"
            else:
                stub = ggrpc.GangServiceStub(self.c.peer_channel(info.address))
                try:
                    return await stub.ExplainGang(request, timeout=self._forward_timeout(context, EXPLAIN_SHARE_OF_DEADLINE),
                                                  metadata=((FORWARDED, "1"),))
                except grpc.aio.AioRpcError as exc:
                    why = f"the leader of {g.owner_az} ({info.coordinator_id}) did not answer: {exc.code().name}"
        return await self._explain_from_etcd(g, why)

    async def _explain_from_etcd(self, g: GangRecord, why: str) -> gpb.ExplainGangResponse:
        """The answer from the records in etcd of every AZ the gang may span
        (coordinator/core/explanation.py ``of_records``; ``why``: why the
        leader could not be asked)."""
        views: list[NodeView] = []
        for az in (sorted(await self._azs()) if spans_azs(g) else [g.owner_az]):
            nodes, ledger = await self._az_state(az)
            views.extend(explanation.recorded_view(az, nodes.values(), ledger))
        return _explanation_pb(g, explanation.of_records(g, views, why, self.c.wall()))

    @handled
    async def ListNodes(self, request: gpb.ListNodesRequest, context: grpc.aio.ServicerContext) -> gpb.ListNodesResponse:
        await self._authorize(context, "nodes")
        return await self._within_deadline(context, self._list_nodes(request, context), "the reads of the node list")

    async def _list_nodes(self, request: gpb.ListNodesRequest, context: grpc.aio.ServicerContext) -> gpb.ListNodesResponse:
        azs = [request.az] if request.az else sorted(await self._azs())
        out = []
        for az in azs:
            out.extend(await self._az_nodes(az, context))
        return gpb.ListNodesResponse(nodes=out)

    async def _az_nodes(self, az: str, context: grpc.aio.ServicerContext) -> list[pb.NodeStatus]:
        """One AZ's nodes with their last heartbeats, which only its leader
        knows (its memory: no etcd write refreshes them, docs/design.md
        D17). Another AZ's, or a standby's, are asked of that AZ's leader
        (one hop); one that cannot be asked is answered from etcd, each
        node's last heartbeat then being its registration's."""
        leader = self.c.leader
        heartbeats: dict[str, float] = {}
        if leader is not None and self.c.config.az == az:
            heartbeats = leader.heartbeats()  # (none before its rebuild: the records')
        elif not self._forwarded(context):
            info = await self._leader_of(az)
            if info is not None and info.address and info.coordinator_id != self.c.config.coordinator_id:
                stub = ggrpc.GangServiceStub(self.c.peer_channel(info.address))
                try:
                    answer = await stub.ListNodes(gpb.ListNodesRequest(az=az), metadata=((FORWARDED, "1"),),
                                                  timeout=self._forward_timeout(context, EXPLAIN_SHARE_OF_DEADLINE))
                    return list(answer.nodes)
                except grpc.aio.AioRpcError as exc:
                    log.info("nodes of %s from etcd: its leader %s did not answer: %s", az, info.coordinator_id,
                             exc.code().name)
        nodes, ledger = await self._az_state(az)
        return [convert.node_to_pb(nodes[name], ledger.used_gpus(name), heartbeats.get(name))
                for name in sorted(nodes)]

    async def _azs(self) -> set[str]:
        kvs, _ = await self.store.get_prefix_paged(self.keys.nodes(), keys_only=True)
        azs = {kv.key[len(self.keys.nodes()):].split("/", 1)[0] for kv in kvs}
        azs |= set((await observe_all(self.store)).keys())
        return azs

    @handled
    async def ClusterStatus(self, request: gpb.ClusterStatusRequest, context: grpc.aio.ServicerContext) -> gpb.ClusterStatusResponse:
        await self._authorize(context, "status")
        return await self._within_deadline(context, self._cluster_status(), "the reads of a cluster status")

    async def _cluster_status(self) -> gpb.ClusterStatusResponse:
        leaders = await observe_all(self.store)
        azs = sorted(set(leaders) | await self._azs())
        resp = gpb.ClusterStatusResponse(cluster=self.keys.cluster, served_by=self.c.config.coordinator_id)
        for az in azs:
            nodes, ledger = await self._az_state(az)
            info = leaders.get(az)
            total = sum(len(n.topology.gpus) for n in nodes.values())
            used = sum(len(ledger.used_gpus(n)) for n in nodes)
            states = [capacity.node_state(n, n.ready) for n in nodes.values()]
            usable = [n for n in nodes.values() if capacity.node_state(n, n.ready) == "ready"]
            usable_gpus = sum(len(n.topology.gpus) for n in usable)
            resp.azs.append(gpb.AzStatus(
                az=az,
                has_leader=info is not None,
                leader_id=info.coordinator_id if info else "",
                leader_address=info.address if info else "",
                epoch=info.epoch if info else 0,
                nodes_ready=states.count("ready"),
                nodes_total=len(nodes),
                gpus_total=total,
                gpus_free=total - used,
                nodes_not_ready=states.count("not_ready"),
                nodes_cordoned=states.count("cordoned"),
                nodes_expired=states.count("expired"),
                gpus_usable=usable_gpus,
                gpus_usable_free=usable_gpus - sum(len(ledger.used_gpus(n.name)) for n in usable),
            ))
        kvs, _ = await self.store.get_prefix_paged(self.keys.gangs())
        # Parsed as every reader parses a gang record: one that GetGang would
        # answer DATA_LOSS for is counted as UNREADABLE, not fatal.
        gangs, bad = read_records(kvs, GangRecord.from_dict)
        for g in gangs:
            resp.gangs_by_state[g.state.name] = resp.gangs_by_state[g.state.name] + 1
        if bad:
            resp.gangs_by_state["UNREADABLE"] = resp.gangs_by_state["UNREADABLE"] + len(bad)
        try:
            space = await self.c.space_watch.read()  # afresh: an alarm shows at once
        except Unavailable as exc:
            resp.etcd.error = str(exc)
        else:
            resp.etcd.CopyFrom(gpb.EtcdSpace(db_size_bytes=space.db_size, quota_bytes=space.quota,
                                             alarms=list(space.alarms), level=space.level.value,
                                             summary=space.describe()))
        return resp

    # ------------------------------------------------------ node lifecycle
    async def _node_leader(self, context: grpc.aio.ServicerContext, method: str, request: Any) -> tuple[Any, Any]:
        """Admin only; done by the node's AZ leader: (leader, None) here,
        else (None, that leader's answer), forwarded like a write."""
        az, _ = _valid_node(request)
        await self._authorize(context, authz.NODE_ADMIN)
        if az == self.c.config.az:
            return await self._leader_or_forward(context, method, request)
        if self._forwarded(context):
            raise NotLeader(f"coordinator {self.c.config.coordinator_id} is not the leader of {az}; retry")
        info = await self._leader_of(az)
        if info is None or not info.address:
            raise Unavailable(f"{az} has no leader right now; retry shortly")
        return None, await self._forward(context, info, method, request)

    async def _node_status(self, leader: Any, rec: NodeRecord) -> pb.NodeStatus:
        return convert.node_to_pb(rec, leader.book.ledger.used_gpus(rec.name), leader.heartbeats().get(rec.name))

    @handled
    async def CordonNode(self, request: gpb.CordonNodeRequest, context: grpc.aio.ServicerContext) -> pb.NodeStatus:
        leader, forwarded = await self._node_leader(context, "CordonNode", request)
        if forwarded is not None:
            return forwarded
        return await self._node_status(leader, await leader.cordon(request.node, request.cordoned))

    @handled
    async def DrainNode(self, request: gpb.DrainNodeRequest, context: grpc.aio.ServicerContext) -> gpb.DrainNodeResponse:
        leader, forwarded = await self._node_leader(context, "DrainNode", request)
        if forwarded is not None:
            return forwarded
        rec, gangs, requeued = await leader.drain(request.node, request.requeue)
        return gpb.DrainNodeResponse(node=await self._node_status(leader, rec), gangs=gangs, requeued=requeued)

    @handled
    async def DeleteNode(self, request: gpb.DeleteNodeRequest, context: grpc.aio.ServicerContext) -> gpb.DeleteNodeResponse:
        leader, forwarded = await self._node_leader(context, "DeleteNode", request)
        if forwarded is not None:
            return forwarded
        return gpb.DeleteNodeResponse(gangs=await leader.delete_node(request.node, request.force))

    # ------------------------------------------------------------- policy
    @handled
    async def GetPolicy(self, request: gpb.GetPolicyRequest, context: grpc.aio.ServicerContext) -> gpb.PolicyRecord:
        await self._authorize(context, authz.GET_POLICY)
        # A fresh read, not the cached copy: an admin bases SetPolicy's
        # expected_revision on it.
        return _policy_pb(await self.c.policies.read())

    @handled
    async def SetPolicy(self, request: gpb.SetPolicyRequest, context: grpc.aio.ServicerContext) -> gpb.PolicyRecord:
        caller = await self._authorize(context, authz.SET_POLICY)  # before the policy is even parsed
        try:
            policy = authz.parse_policy_json(request.policy_json)
        except authz.PolicyError as exc:
            raise InvalidArgument(str(exc)) from None
        record = await self.c.policies.set(policy, expected_revision=request.expected_revision,
                                           set_by=caller.owner or "(plaintext)", now=self.c.wall())
        log.info("policy record %s set to revision %d by %s", self.keys.policy(), record.revision, record.set_by)
        return _policy_pb(record)
