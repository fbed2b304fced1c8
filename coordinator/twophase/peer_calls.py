"""The participant side of the peer calls: a peer's Prepare, Commit and
Abort (and the owner's own AZ's Prepare, in process) checked and fed to the
participant core, and the wait for its vote or ack (docs/two-phase.md
"Peer calls").

Thin: it reads (the watched state, else one etcd txn), counts its reads
through the driver (``count_request``: the per-gang etcd requests
bench/admission.py reads), and asks coordinator/core/peer_calls.py, which
decides every refusal and the participant's own NO votes. A refused call
changes nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc

from coordinator import refusals
from coordinator.book import Book
from coordinator.core import peer_calls as decide
from coordinator.core.peer_auth import Refusal
from coordinator.core.peer_calls import PeerCaller
from coordinator.core.records import UNREADABLE, GangRecord
from coordinator.core.twophase import (
    AbortReceived,
    CommitReceived,
    DecisionObserved,
    DecisionRecord,
    Outcome,
    PrepareReceived,
    Routed,
    SendDecisionAck,
    SendVote,
)
from phalanx.logfmt import bind
from phalanx.store import Get, Keys, Store


class PeerRefused(Exception):
    """A peer call refused for a reason the caller must see (-> gRPC status)."""

    def __init__(self, code: grpc.StatusCode, text: str):
        super().__init__(text)
        self.code = code

    @classmethod
    def of(cls, refusal: Refusal) -> "PeerRefused":
        return cls(refusals.status(refusal.code), refusal.message)


def _refuse(refusal: Refusal | None) -> None:
    if refusal is not None:
        raise PeerRefused.of(refusal)


class PeerCallsHost(Protocol):
    """What the peer calls use of the two-phase driver."""

    az: str
    book: Book
    store: Store
    keys: Keys

    @property
    def epoch(self) -> int: ...

    @property
    def vote_timeout_s(self) -> float: ...

    def node_connected(self, node: str) -> bool: ...

    def feed(self, *routed: Routed) -> None: ...

    def count_request(self, gang: str, check: bool = False) -> None: ...


def _caller(req: Any) -> PeerCaller:
    return PeerCaller(az=req.caller.az, epoch=req.caller.epoch, coordinator_id=req.caller.coordinator_id)


def _slice(req: Any) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    return {n.node: (tuple(n.gpus), tuple(n.nics)) for n in req.nodes}


class PeerCalls:
    """One per ``TwoPhaseDriver``: the calls waiting for a vote or an ack
    (answered when the participant core emits ``SendVote`` /
    ``SendDecisionAck``), and the per-gang count of the servicer's reads of
    ``leader/<caller az>`` under TLS (``auth_reads``: counted apart from the
    driver's ``n``, see docs/two-phase.md "Peer calls")."""

    def __init__(self, driver: PeerCallsHost):
        self.driver = driver
        self._vote_waiters: dict[tuple[str, int], list[asyncio.Future]] = {}
        self._ack_waiters: dict[tuple[str, int], list[asyncio.Future]] = {}
        self.auth_reads: dict[str, int] = {}

    # ------------------------------------------------------------ answers
    def voted(self, e: SendVote) -> None:
        for fut in self._vote_waiters.pop((e.gang, e.incarnation), []):
            if not fut.done():
                fut.set_result((e.yes, e.reason))

    def acked(self, e: SendDecisionAck) -> None:
        for fut in self._ack_waiters.pop((e.gang, e.incarnation), []):
            if not fut.done():
                fut.set_result((e.applied, e.state))

    def auth_read(self, gang: str) -> None:
        """The servicer read ``leader/<caller az>`` for a call about ``gang``
        (coordinator/peer_service.py, under TLS)."""
        self.auth_reads[gang] = self.auth_reads.get(gang, 0) + 1

    # ------------------------------------------------------------ entry points
    async def local_prepare(self, ev: PrepareReceived) -> tuple[bool, str]:
        """Feed a Prepare (from an RPC or our own owner) and wait for the vote."""
        d = self.driver
        book = d.book
        prepared = ev.key in {(h.gang, h.incarnation) for h in book.participant.holds.values()}
        serving = {n for n in ev.nodes if book.liveness.get(n) and book.liveness[n].ready and d.node_connected(n)}
        no = decide.prepare_no_vote(d.az, ev.nodes, book.ledger.held, prepared, serving)
        if no is not None:
            return False, no
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._vote_waiters.setdefault(ev.key, []).append(fut)
        d.feed(Routed.participant(ev))
        return await fut

    async def local_decision(self, ev: CommitReceived | AbortReceived) -> tuple[bool, str]:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._ack_waiters.setdefault(ev.key, []).append(fut)
        self.driver.feed(Routed.participant(ev))
        # As long as the caller waits: vote_timeout_s is the deadline of peer
        # RPCs (docs/timing.md).
        return await asyncio.wait_for(fut, self.driver.vote_timeout_s)

    async def handle_prepare_rpc(self, req: Any) -> tuple[bool, str]:
        """Check a peer's Prepare (from the watch when it shows the attempt,
        else in one etcd read), then vote. ``PeerRefused``: no state change."""
        d = self.driver
        bind(epoch=d.epoch, gang=req.gang or None, incarnation=req.incarnation)  # the RPC's task
        caller, nodes = _caller(req), _slice(req)
        g = self._watched_attempt(req.gang, req.incarnation, caller, nodes)
        if g is None:
            res = await d.store.txn([], [Get(d.keys.leader(caller.az)), Get(d.keys.gang(req.gang))])
            d.count_request(req.gang, check=True)
            _refuse(decide.caller_refusal(caller, _revision(res.results[0])))
            g = GangRecord.from_dict(res.results[1][0].json()) if res.results[1] else None
            _refuse(decide.attempt_refusal(d.az, caller, req.gang, req.incarnation, nodes, g))
        d.book.gang_cached(g)
        ev = PrepareReceived(stimulus_id=f"rpc-prepare:{caller.az}:{req.gang}:{req.incarnation}", gang=req.gang,
                             incarnation=req.incarnation, owner_az=caller.az, priority=g.spec.priority,
                             submitted_at=g.submitted_at, nodes=nodes)
        return await self.local_prepare(ev)

    def _watched_attempt(self, gang: str, incarnation: int, caller: PeerCaller, nodes: Any) -> GangRecord | None:
        """The gang record as the watch delivered it, when it passes every
        check the etcd read makes (decide.watched_attempt); None: the read
        decides."""
        book = self.driver.book
        kv = book.watched_gangs.get(gang)
        if kv is None or not caller.az:
            return None
        try:
            g = GangRecord.from_dict(kv.json(), kv.mod_revision)
        except UNREADABLE:
            return None
        return g if decide.watched_attempt(self.driver.az, caller, incarnation, nodes, book.remote.epoch(caller.az), g) else None

    async def handle_decision_rpc(self, req: Any, commit: bool) -> tuple[bool, str]:
        d = self.driver
        bind(epoch=d.epoch, gang=req.gang or None, incarnation=req.incarnation)  # the RPC's task
        caller = _caller(req)
        want = Outcome.COMMIT if commit else Outcome.ABORT
        known = d.book.participant.known_decisions.get((req.gang, req.incarnation))
        if caller.az and decide.decision_known(caller, d.book.remote.epoch(caller.az), known, want):
            have: Outcome | None = want
        else:
            res = await d.store.txn([], [Get(d.keys.leader(caller.az)), Get(d.keys.decision(req.gang, req.incarnation))])
            d.count_request(req.gang, check=True)
            _refuse(decide.caller_refusal(caller, _revision(res.results[0])))
            have = (DecisionRecord.from_dict(res.results[1][0].json(), gang=req.gang, incarnation=req.incarnation).outcome
                    if res.results[1] else None)
        _refuse(decide.decision_refusal(req.gang, req.incarnation, want, have))
        hold = d.book.participant.holds.get(req.gang)
        refusal = decide.not_prepared_refusal(d.az, req.gang, req.incarnation, hold.incarnation if hold else None)
        if refusal is not None:
            # Not held here: learn the decision (it is durable), refuse the call.
            d.feed(Routed.participant(DecisionObserved(stimulus_id=f"rpc-decision:{req.gang}:{req.incarnation}",
                                                       gang=req.gang, incarnation=req.incarnation, outcome=want)))
            raise PeerRefused.of(refusal)
        cls = CommitReceived if commit else AbortReceived
        return await self.local_decision(cls(stimulus_id=f"rpc-decision:{req.gang}:{req.incarnation}", gang=req.gang,
                                             incarnation=req.incarnation, from_az=caller.az))


def _revision(leader_kvs: Any) -> int | None:
    """The create revision of ``leader/<az>`` as read (None: no key)."""
    return leader_kvs[0].create_revision if leader_kvs else None
