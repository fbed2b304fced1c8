"""GangService servicer: protobuf -> domain -> driver -> protobuf (docs/style.md §8).

Reads are served by any replica from etcd (linearizable reads). Writes go to
the AZ leader: a standby forwards them to the leader it finds in
``leader/<az>`` (one hop: a forwarded request is never forwarded again).
The gang RPCs are here; the node and policy RPCs in ``node_service.py`` and
``policy_service.py``, what they all share in ``service_base.py``.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import grpc

from coordinator import convert
from coordinator.broadcast import RESUME_HEADER, Change, serve
from coordinator.core.admission import spans_azs
from coordinator.core.placement import NodeView
from coordinator.core import authz, explanation, listing
from coordinator.core.records import UNREADABLE, GangRecord, NameRecord, read_records
from coordinator.core.retention import ExpiredGang
from coordinator.node_service import NodeRpcs
from coordinator.policy_service import PolicyRpcs
from coordinator.service_base import EXPLAIN_SHARE_OF_DEADLINE, FORWARDED, Caller, abort_error, handled
from phalanx import limits, wire
from phalanx.errors import DataLoss, InvalidArgument, NotFound, NotLeader, StoreUnavailable as Unavailable
from phalanx.model import GangState
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import gang_pb2_grpc as ggrpc
from phalanx.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

# A gang id is its name, '-' and 8 hex digits (coordinator/leader.py).
_ID_SUFFIX = re.compile(r"[0-9a-f]{8}")


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


class GangServicer(NodeRpcs, PolicyRpcs, ggrpc.GangServiceServicer):
    """The GangService the gRPC server registers: the gang RPCs below, the
    node RPCs (NodeRpcs) and the policy RPCs (PolicyRpcs)."""

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
            await abort_error(context, exc)
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
            await abort_error(context, exc)
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
            await abort_error(context, exc)
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
