"""What clients ask of a leadership about gangs: submit, cancel, and the
teardown both a cancel and the cycle's failures use (docs/design.md §19).

``GangApi`` writes a submission (name and idempotency key taken in one txn,
its outcome learnt from etcd when the reply is lost), cancels a gang (decided
by coordinator/core/lifecycle.py, retried on a lost compare) and finishes an
incarnation through the leader's gang-effect interpreter, given as a
callable. ``AzLeader`` builds it and keeps ``submit`` and ``cancel`` for the
gang service, delegating here.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Awaitable, Callable

from coordinator.book import Book
from coordinator.core import events as gang_events
from coordinator.core import gang_effects
from coordinator.core import lifecycle
from coordinator.core.records import UNREADABLE, GangRecord, IdempotencyRecord, NameRecord
from coordinator.leadership import Leadership, current_stimulus
from phalanx import failpoints
from phalanx.errors import AlreadyExists, Conflict, DataLoss, FailedPrecondition, NotFound, StoreUnavailable
from phalanx.logfmt import bind, new_stimulus
from phalanx.model import GangState
from phalanx.spec import GangSpec
from phalanx.store import Get, Put, absent

log = logging.getLogger(__name__)


class GangApi:
    def __init__(self, lead: Leadership, book: Book, *, perform: Callable[[gang_effects.Effect], Awaitable[gang_effects.Event]],
                 until_rebuilt: Callable[[], Awaitable[None]]):
        self.lead = lead
        self.book = book
        self.perform = perform  # the leader's gang-effect interpreter
        self.until_rebuilt = until_rebuilt

    async def submit(self, spec: GangSpec, idempotency_key: str, owner: str = "") -> tuple[GangRecord, bool]:
        self.lead.check_valid()
        await self.until_rebuilt()
        await failpoints.hit("leader.before_submit")
        self.lead.check_valid()
        k = self.lead.keys
        # No pre-read of the idempotency key: the txn below creates it only if
        # absent, and only a lost compare costs the extra read.
        now = self.lead.wall()
        gang_id = f"{spec.name}-{secrets.token_hex(4)}"
        stimulus = new_stimulus(self.lead.az)  # the submission: its event and its lines name it
        rec = GangRecord(
            id=gang_id, spec=spec, state=GangState.PENDING, owner_az=self.lead.az, submitted_at=now,
            updated_at=now, idempotency_key=idempotency_key, reason="waiting for placement", owner=owner,
            events=gang_events.append((), [gang_events.submitted(now, self.lead.epoch, owner, spec.queue, spec.priority).stamped(stimulus)]),
        )
        compares = [absent(k.name(spec.name))]
        ops = [Put(k.name(spec.name), NameRecord(gang_id).to_dict())]
        if idempotency_key:
            compares.append(absent(k.idempotency(idempotency_key)))
            ops.append(Put(k.idempotency(idempotency_key), IdempotencyRecord(gang_id).to_dict()))
        self.lead.check_valid()
        try:
            res = await self.lead.fenced_txn(
                [absent(k.gang(gang_id))] + compares, [Put(k.gang(gang_id), rec.to_dict())] + ops,
                [Get(k.name(spec.name))] + ([Get(k.idempotency(idempotency_key))] if idempotency_key else []),
            )
            if failpoints.on("leader.submit_reply_lost") and res.succeeded:
                raise StoreUnavailable("failpoint leader.submit_reply_lost: the submission's reply is lost")
        except StoreUnavailable:
            # The outcome is unknown: the txn may have committed although its
            # reply was lost. The client is told UNAVAILABLE and may retry with
            # its idempotency key (which finds the gang, below); if it never
            # does, the gang must still be admitted, so learn the outcome.
            self.lead.spawn(self._learn_submit_outcome(gang_id), f"learn-submit-{gang_id}")
            raise
        if not res.succeeded:
            if idempotency_key and res.results[1]:
                existing = await self._by_idempotency(idempotency_key, spec)
                if existing:
                    if gang_effects.adopt_retried(existing, self.lead.az, self.book.gangs):
                        self.book.owned(existing)
                        self.lead.metrics.submitted(existing.spec.queue)  # its first attempt's reply was lost
                        self.lead.wake.set()
                    return existing, False
            name_kvs, holder = res.results[0], None
            if name_kvs:
                try:
                    holder = NameRecord.from_dict(name_kvs[0].json()).id
                except UNREADABLE:
                    holder = "its name record cannot be read"  # still taken: the key exists
            raise gang_effects.submission_refused(spec.name, holder)
        rec = rec.evolve(mod_revision=res.revision)
        self.book.owned(rec)
        # The RPC's task: its later lines (and the service's) carry the gang.
        bind(az=self.lead.az, epoch=self.lead.epoch, gang=gang_id, incarnation=rec.incarnation, stimulus=stimulus)
        log.info("gang %s submitted to queue %s (%d members)", gang_id, spec.queue, spec.members)
        self.lead.metrics.submitted(spec.queue)
        self.lead.wake.set()
        return rec, True

    async def _learn_submit_outcome(self, gang_id: str) -> None:
        """After a submission txn with an unknown outcome (docs/chaos.md
        finding 2): read ``gangs/<id>`` until etcd answers and, if the txn
        applied, take the gang on as if its reply had arrived. The first read
        waits one etcd timeout, so that a proposal still in flight when the
        call gave up has been applied or dropped by then. If the leadership
        ends first, the successor's rebuild finds the gang in etcd anyway."""
        await asyncio.sleep(self.lead.timings.etcd_timeout_s)
        while True:
            self.lead.check_valid()
            try:
                kv = await self.lead.store.get(self.lead.keys.gang(gang_id))
                break
            except StoreUnavailable:
                await asyncio.sleep(self.lead.timings.store_retry_pause_s)
        if kv is None:
            log.info("submission %s did not apply (reply lost)", gang_id)
            return
        rec = GangRecord.from_dict(kv.json(), kv.mod_revision)
        if gang_effects.adopt_retried(rec, self.lead.az, self.book.gangs):
            log.info("submission %s applied although its reply was lost; admitting it", gang_id)
            self.book.owned(rec)
            self.lead.metrics.submitted(rec.spec.queue)
            self.lead.wake.set()

    async def _by_idempotency(self, key: str, spec: GangSpec) -> GangRecord | None:
        kv = await self.lead.store.get(self.lead.keys.idempotency(key))
        if kv is None:
            return None
        try:
            created = IdempotencyRecord.from_dict(kv.json()).id
        except UNREADABLE as exc:
            # The cluster's fault, not the caller's; the key stays taken.
            raise DataLoss(f"idempotency_key: the stored record of {key!r} cannot be read "
                           f"({type(exc).__name__}: {str(exc)[:200]}); an operator must delete or repair it") from None
        gkv = await self.lead.store.get(self.lead.keys.gang(created))
        if gkv is None:
            return None
        rec = GangRecord.from_dict(gkv.json(), gkv.mod_revision)
        if rec.spec != spec:
            raise AlreadyExists(f"idempotency_key: {key!r} was used for a different spec (gang {rec.id})")
        return rec

    # -------------------------------------------------------------- cancel
    async def cancel(self, gang_id: str, reason: str, by: str = "") -> GangRecord:
        bind(az=self.lead.az, epoch=self.lead.epoch, gang=gang_id, stimulus=new_stimulus(self.lead.az))  # the RPC's task
        self.lead.check_valid()
        # Before rebuild() the reservations are unknown: cancelling then would
        # strand the gang's reservation.
        await self.until_rebuilt()
        g, attempt = self.book.gangs.get(gang_id), 1
        while True:
            if g is None:
                kv = await self.lead.store.get(self.lead.keys.gang(gang_id))
                if kv is None:
                    raise NotFound(f"id: no gang {gang_id!r} (finished gangs are deleted "
                                   f"gang_retention_s={self.lead.timings.gang_retention_s:g}s after they end)")
                g = GangRecord.from_dict(kv.json(), kv.mod_revision)
            verdict = lifecycle.cancel(g, self.lead.az, reason, by, self.lead.wall(), self.lead.epoch)
            if isinstance(verdict, lifecycle.CancelRefused):
                raise FailedPrecondition(verdict.message)
            try:
                return await self.finish(g, GangState.CANCELLED, verdict.reason, list(verdict.events))
            except Conflict:
                # Lost its compare to another write of the gang (its start,
                # most often): decide again on the record etcd has now,
                # rather than make the client retry a cancel of a live gang.
                if attempt == lifecycle.CANCEL_ATTEMPTS:
                    raise
                log.info("cancel of %s lost a race with another write (attempt %d of %d); reading it again",
                         gang_id, attempt, lifecycle.CANCEL_ATTEMPTS)
                g, attempt = None, attempt + 1

    async def finish(self, g: GangRecord, state: GangState, reason: str, events: list = ()) -> GangRecord:
        """Tear an incarnation down: to a terminal state, or to RESTARTING.
        Its devices stay held (reservation RELEASING) until every member is
        known to be gone, so they are never handed to another gang (or to the
        gang's next incarnation) while an old member may still run: at most
        one incarnation of a gang is ever alive."""
        inc = g.incarnation
        effect = gang_effects.finish_effect(g, state, reason, events, self.book.reservations.get(g.id),
                                  self.book.members.get((g.id, inc), {}), self.lead.wall(), self.lead.epoch,
                                  current_stimulus())
        done = await self.perform(effect)
        if isinstance(done, gang_effects.WriteRefused):
            raise Conflict(done.why)
        # Stop (or tell agents to forget) the members of this incarnation.
        for follow in gang_effects.after_torn_down(effect, done):
            await self.perform(follow)
        log.info("gang %s#%d -> %s: %s%s", g.id, inc, state.name, reason, gang_effects.teardown_note(effect.teardown),
                 extra={"gang": g.id, "incarnation": inc})
        return done.record

