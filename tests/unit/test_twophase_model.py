"""Model test of two-phase reservations (hypothesis stateful, docs/style.md §14).

A small world: three AZ leaders (each one ``ParticipantState`` plus the
``OwnerState`` of every cross-AZ gang submitted to it, plus a stand-in for the
single-AZ admission path that reserves through the same ledger), 2-4 gangs
competing for overlapping devices, and, standing in for etcd, a dict store
with the write semantics the driver must give (create-if-absent decisions,
guarded hold writes, compare-deletes, fencing by leader life). Everything the
leaders send is an item in flight; the rules deliver items in any order, duplicate
and drop RPCs, fail store writes, fire timers (moving time forward), crash
and restart leaders (a restarted leader knows only what the store holds), and
finish or restart admitted gangs. After every step the invariant checker runs
on the whole world. At teardown every fault heals, everything in flight is
delivered and every timer fires; then the world must be quiescent (every hold
resolved, nothing stranded, every owner settled) within a bounded number of
deliveries, and every gang must be admitted unless a COMMITTED gang holds part
of its devices. That last check is the no-livelock property: the oldest gang
that can fit always gets in.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import random
from dataclasses import dataclass, field
from typing import Literal

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from coordinator.core.ordering import gang_order_key
from coordinator.core.twophase import (
    AbortReceived,
    AttemptWriteFailed,
    AttemptWritten,
    CommitReceived,
    CommitWriteFailed,
    CommitWritten,
    CreateDecision,
    DecisionCreated,
    DecisionCreateFailed,
    DecisionKey,
    DecisionObserved,
    DecisionRecord,
    DispatchGang,
    Effect,
    Event,
    GangFinished,
    GangSubmitted,
    HoldReleased,
    HoldReleaseFailed,
    HoldState,
    HoldWriteFailed,
    HoldWritten,
    MarkCommitted,
    MarkGangFailed,
    MarkGangPending,
    MarkGangReserved,
    NodeDevices,
    Outcome,
    OwnerPhase,
    OwnerRecovered,
    OwnerState,
    ParticipantRecovered,
    ParticipantState,
    PlacementMade,
    Plan,
    PrepareReceived,
    ReleaseHold,
    RetryDue,
    Reservation,
    ScheduleTimeout,
    SendAbort,
    SendCommit,
    SendDecisionAck,
    SendFinish,
    SendPrepare,
    SendVote,
    TwoPhaseConfig,
    VoteReceived,
    WorldSnapshot,
    WriteAttempt,
    WriteHold,
    assert_invariants,
    normalize_plan,
)
from coordinator.core.twophase_model import slice_devices

AZS = ("a", "b", "c")
NODES = ("n1", "n2")
GPUS = (0, 1, 2, 3)
NICS = ("mlx0", "mlx1")
INVENTORY: dict[str, NodeDevices] = {node: (GPUS, NICS) for node in NODES}
CONFIG = TwoPhaseConfig(vote_timeout_s=5.0, prepare_timeout_s=12.0, retry_backoff_s=1.0,
                        retry_backoff_max_s=4.0, store_retry_s=1.0, max_attempts=None)
DRAIN_LIMIT = 20_000
# What a step can do. "network" first: it is what hypothesis tries first and
# shrinks towards, and runs need deliveries to get anywhere.
ACTIONS = ("network", "network", "timer", "timer", "crash", "restart", "finish", "resubmit")
FAULTS = ("duplicate", "drop", "store-failure", "crash")

Role = Literal["participant", "owner", "local"]
Kind = Literal["msg", "store", "result", "placement"]


@dataclass(frozen=True)
class GangSpec:
    gang: str
    owner_az: str
    priority: int
    submitted_at: float
    plan: Plan
    local: bool = False
    """Single-AZ gang admitted by the local path (``PrepareReceived(local=
    True)`` to its own AZ's participant), not by an ``OwnerState``."""


class LocalPhase(enum.Enum):
    """The single-AZ admission the lead's leader runs, reduced to what the
    ledger sees of it."""

    REQUESTING = "REQUESTING"
    BACKOFF = "BACKOFF"
    WAITING = "WAITING"  # blocked by a COMMITTED gang: waits for a finish
    RESERVED = "RESERVED"
    FINISHED = "FINISHED"


@dataclass
class LocalGang:
    incarnation: int
    phase: LocalPhase


@dataclass(frozen=True)
class Item:
    """Something in flight. ``msg``: an RPC (droppable) or watch notification
    (not droppable: etcd watches resume, and a restarted leader re-reads);
    ``store``: a write a leader issued, applied only if that leader life is
    still current (fencing); ``result``/``placement``: the answer to one."""

    kind: Kind
    az: str
    role: Role
    gang: str | None
    payload: Event | Effect
    life: int | None = None
    droppable: bool = False


@dataclass
class Store:
    """The etcd stand-in: durable, outlives every leader."""

    decisions: dict[DecisionKey, Outcome] = field(default_factory=dict)
    decision_writes: list[tuple[DecisionKey, Outcome]] = field(default_factory=list)
    reservations: dict[tuple[str, str], Reservation] = field(default_factory=dict)
    attempts: dict[str, tuple[int, Plan]] = field(default_factory=dict)
    requested: dict[str, int] = field(default_factory=dict)  # incarnation the lifecycle asked for
    plans: dict[DecisionKey, Plan] = field(default_factory=dict)
    finished: set[DecisionKey] = field(default_factory=set)

    def live_committed(self) -> list[tuple[str, str, Reservation]]:
        """Holds that are committed (by a COMMIT key, or single-AZ records,
        which have none) and not finished: what the owners' view counts as
        taken."""
        out = []
        for (az, gang), rec in self.reservations.items():
            key = (gang, rec.incarnation)
            decision = self.decisions.get(key)
            committed = decision is Outcome.COMMIT or (decision is None and rec.state is HoldState.COMMITTED)
            if committed and key not in self.finished:
                out.append((az, gang, rec))
        return out


class Sim:
    def __init__(self, gangs: list[GangSpec]) -> None:
        self.gangs = {g.gang: g for g in gangs}
        self.now = 0.0
        self.store = Store()
        self.life = {az: 1 for az in AZS}
        self.up = {az: True for az in AZS}
        self.participants: dict[str, ParticipantState] = {}
        self.owners: dict[str, OwnerState] = {}
        self.locals: dict[str, LocalGang] = {}  # single-AZ gangs whose AZ leader is up
        self.inflight: list[Item] = []
        self.timers: list[tuple[float, str, int, Role, str | None, Event]] = []
        self.reserved_log: list[DecisionKey] = []
        self.dispatched: set[tuple[str, DecisionKey]] = set()
        self._ids = itertools.count()
        for az in AZS:
            self.participants[az] = ParticipantState(az, CONFIG, INVENTORY)
        for spec in gangs:
            self.store.requested[spec.gang] = 1
            if spec.local:
                self.request_local(spec.gang, 1)
                continue
            self.owners[spec.gang] = OwnerState(spec.gang, spec.owner_az, spec.priority,
                                                spec.submitted_at, CONFIG)
            self.feed_owner(spec.gang, GangSubmitted(stimulus_id=self.sid("submit"),
                                                     gang=spec.gang, incarnation=1))

    # ------------------------------------------------------------ plumbing

    def sid(self, what: str) -> str:
        return f"sim-{what}-{next(self._ids)}"

    def snapshot(self) -> WorldSnapshot:
        return WorldSnapshot(
            decisions=self.store.decisions, reservations=self.store.reservations,
            plans=self.store.plans, finished=self.store.finished,
            decision_writes=self.store.decision_writes,
            participants=self.participants, owners=self.owners,
        )

    def feed_participant(self, az: str, event: Event) -> None:
        participant = self.participants.get(az)
        if participant is not None:
            self.perform(az, "participant", None, participant.handle(event, self.now))

    def feed_owner(self, gang: str, event: Event) -> None:
        owner = self.owners.get(gang)
        if owner is not None:
            self.perform(self.gangs[gang].owner_az, "owner", gang, owner.handle(event, self.now))

    def perform(self, az: str, role: Role, gang: str | None, effects: list[Effect]) -> None:
        """The driver: turn effects into items in flight, timers and logs."""
        life = self.life[az]
        for e in effects:
            if isinstance(e, (WriteHold, MarkCommitted, ReleaseHold, CreateDecision, WriteAttempt)):
                self.inflight.append(Item("store", az, role, gang, e, life))
            elif isinstance(e, MarkGangPending):
                # The owner waits for placement: its leader's admission cycle
                # runs on the wake this effect causes (the cycle's answer is
                # in flight like any other; it may find no room).
                self.inflight.append(Item("placement", az, role, gang, e, life))
            elif isinstance(e, ScheduleTimeout):
                self.timers.append((e.at, az, life, role, gang, e.event))
            elif isinstance(e, SendPrepare):
                self.send(e.to_az, "participant", None, PrepareReceived(
                    stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                    owner_az=e.owner_az, priority=e.priority, submitted_at=e.submitted_at,
                    nodes=e.nodes))
            elif isinstance(e, SendVote) and self.gangs[e.gang].local:
                # The answer to the local path: an in-process call, so it
                # dies with the leader (life) but is never dropped.
                self.inflight.append(Item("result", az, "local", e.gang, VoteReceived(
                    stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                    from_az=e.from_az, yes=e.yes, reason=e.reason), life))
            elif isinstance(e, SendVote):
                self.send(e.to_az, "owner", e.gang, VoteReceived(
                    stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                    from_az=e.from_az, yes=e.yes, reason=e.reason))
            elif isinstance(e, SendCommit):
                self.send(e.to_az, "participant", None, CommitReceived(
                    stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation, from_az=az))
            elif isinstance(e, SendAbort):
                self.send(e.to_az, "participant", None, AbortReceived(
                    stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation, from_az=az))
            elif isinstance(e, SendFinish):
                self.send(e.to_az, "participant", None, GangFinished(
                    stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation))
            elif isinstance(e, MarkGangReserved):
                self.reserved_log.append((e.gang, e.incarnation))
            elif isinstance(e, DispatchGang):
                self.dispatched.add((e.az, (e.gang, e.incarnation)))
            elif isinstance(e, (SendDecisionAck, MarkGangFailed)):
                pass
            else:  # pragma: no cover - a new effect type the driver must learn
                raise AssertionError(f"unhandled effect {e!r}")

    def send(self, to_az: str, role: Role, gang: str | None, event: Event,
             droppable: bool = True) -> None:
        self.inflight.append(Item("msg", to_az, role, gang, event, None, droppable))

    def watch(self, event: Event, gang: str) -> None:
        """etcd watch notifications: to every participant and the owner."""
        for az in AZS:
            self.send(az, "participant", None, event, droppable=False)
        self.send(self.gangs[gang].owner_az, "owner", gang, event, droppable=False)

    # ------------------------------------------------------------ delivery

    def deliver(self, item: Item) -> None:
        if not self.up[item.az]:
            return  # to a dead leader: lost (a new one re-reads the store)
        if item.kind == "msg":
            self.route(item, item.payload)  # type: ignore[arg-type]
        elif item.life != self.life[item.az]:
            return  # fenced: the issuing leader life is gone
        elif item.kind == "store":
            result = self.execute(item.az, item.payload)  # type: ignore[arg-type]
            self.inflight.append(dataclasses.replace(item, kind="result", payload=result))
        elif item.kind == "placement":
            placed = self.place(item.payload)  # type: ignore[arg-type]
            if placed is not None:
                self.route(item, placed)
        else:
            self.route(item, item.payload)  # type: ignore[arg-type]

    def route(self, item: Item, event: Event) -> None:
        if item.role == "participant":
            self.feed_participant(item.az, event)
        elif item.role == "local":
            assert isinstance(event, VoteReceived)
            self.on_local_answer(event)
        else:
            assert item.gang is not None
            self.feed_owner(item.gang, event)

    def execute(self, az: str, e: Effect) -> Event:
        """One store write with the driver's semantics (twophase_events)."""
        s, sid = self.store, e.stimulus_id
        if isinstance(e, WriteHold):
            rec = s.reservations.get((e.az, e.gang))
            if rec is not None and rec.incarnation > e.incarnation:
                return HoldWriteFailed(stimulus_id=sid, gang=e.gang, incarnation=e.incarnation,
                                       reason="newer incarnation recorded")
            if rec is None or rec.incarnation < e.incarnation:
                s.reservations[(e.az, e.gang)] = e.record()
            return HoldWritten(stimulus_id=sid, gang=e.gang, incarnation=e.incarnation)
        if isinstance(e, MarkCommitted):
            rec = s.reservations.get((e.az, e.gang))
            if rec is None or rec.incarnation != e.incarnation:
                return CommitWriteFailed(stimulus_id=sid, gang=e.gang, incarnation=e.incarnation,
                                         reason="record missing")
            s.reservations[(e.az, e.gang)] = dataclasses.replace(rec, state=HoldState.COMMITTED)
            return CommitWritten(stimulus_id=sid, gang=e.gang, incarnation=e.incarnation)
        if isinstance(e, ReleaseHold):
            rec = s.reservations.get((e.az, e.gang))
            if rec is not None and rec.incarnation == e.incarnation:
                del s.reservations[(e.az, e.gang)]
            return HoldReleased(stimulus_id=sid, gang=e.gang, incarnation=e.incarnation)
        if isinstance(e, CreateDecision):
            key = (e.gang, e.incarnation)
            won = key not in s.decisions
            if won:
                s.decisions[key] = e.outcome
                s.decision_writes.append((key, e.outcome))
                self.watch(DecisionObserved(stimulus_id=self.sid("watch"), gang=e.gang,
                                            incarnation=e.incarnation, outcome=e.outcome), e.gang)
            return DecisionCreated(stimulus_id=sid, gang=e.gang, incarnation=e.incarnation,
                                   won=won, outcome=s.decisions[key])
        if isinstance(e, WriteAttempt):
            current = s.attempts.get(e.gang)
            if current is not None and current[0] > e.incarnation:
                return AttemptWriteFailed(stimulus_id=sid, gang=e.gang, incarnation=e.incarnation,
                                          reason="newer attempt recorded")
            s.attempts[e.gang] = (e.incarnation, e.plan)
            s.plans[(e.gang, e.incarnation)] = e.plan
            return AttemptWritten(stimulus_id=sid, gang=e.gang, incarnation=e.incarnation)
        raise AssertionError(f"not a store write: {e!r}")

    def fail(self, e: Effect) -> Event:
        """The same write, refused (definitely not applied)."""
        kw = dict(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,  # type: ignore[attr-defined]
                  reason="injected store failure")
        failures = {WriteHold: HoldWriteFailed, MarkCommitted: CommitWriteFailed,
                    ReleaseHold: HoldReleaseFailed, CreateDecision: DecisionCreateFailed,
                    WriteAttempt: AttemptWriteFailed}
        return failures[type(e)](**kw)  # type: ignore[arg-type]

    def place(self, e: MarkGangPending) -> Event | None:
        """The owner AZ's admission cycle over its view: the gang's fixed
        plan, or nothing (still pending: a later wake places it) when a
        COMMITTED gang holds part of it or the owner no longer waits for
        this incarnation."""
        owner = self.owners.get(e.gang)
        if owner is None or owner.phase is not OwnerPhase.UNPLACED or owner.incarnation != e.incarnation:
            return None
        if self.blockers(self.gangs[e.gang]):
            return None
        return PlacementMade(stimulus_id=e.stimulus_id, gang=e.gang, incarnation=e.incarnation,
                             plan=self.gangs[e.gang].plan)

    def fire(self, index: int) -> None:
        at, az, life, role, gang, event = self.timers.pop(index)
        if not self.up[az] or life != self.life[az]:
            return  # timers live in the leader's memory
        self.now = max(self.now, at)
        if role == "participant":
            self.feed_participant(az, event)
        elif role == "local":
            assert gang is not None
            lg = self.locals.get(gang)
            if lg is not None and lg.phase is LocalPhase.BACKOFF:
                self.request_local(gang, lg.incarnation)
        else:
            assert gang is not None
            self.feed_owner(gang, event)

    # ------------------------------------------------------------ faults

    def crash(self, az: str) -> None:
        self.up[az] = False
        self.life[az] += 1  # the next leader's epoch fences the old one's writes
        del self.participants[az]
        for gang, spec in self.gangs.items():
            if spec.owner_az == az:
                self.owners.pop(gang, None)
                self.locals.pop(gang, None)
        self.timers = [t for t in self.timers if t[1] != az]

    def restart(self, az: str) -> None:
        s = self.store
        self.up[az] = True
        participant = ParticipantState(az, CONFIG, INVENTORY)
        self.participants[az] = participant
        self.perform(az, "participant", None, participant.handle(ParticipantRecovered(
            stimulus_id=self.sid("recover"),
            reservations=[r for (raz, _), r in s.reservations.items() if raz == az],
            decisions=[DecisionRecord(gang=g, incarnation=n, outcome=o)
                       for (g, n), o in s.decisions.items()],
            finished=sorted(s.finished),
        ), self.now))
        for gang, spec in self.gangs.items():
            if spec.owner_az != az:
                continue
            if spec.local:
                # The local path re-reads its gang: reserved if its COMMITTED
                # record is there and not finished, else it asks again.
                inc = s.requested[gang]
                rec = s.reservations.get((az, gang))
                if (gang, inc) in s.finished:
                    self.locals[gang] = LocalGang(inc, LocalPhase.FINISHED)
                elif rec is not None and rec.incarnation == inc and rec.state is HoldState.COMMITTED:
                    self.locals[gang] = LocalGang(inc, LocalPhase.RESERVED)
                else:
                    self.request_local(gang, inc)
                continue
            owner = OwnerState(gang, az, spec.priority, spec.submitted_at, CONFIG)
            self.owners[gang] = owner
            inc, plan = s.attempts.get(gang, (0, None))  # type: ignore[assignment]
            finished = (gang, inc) in s.finished
            if s.requested[gang] > inc:
                # The lifecycle asked for a newer incarnation than the last
                # recorded attempt (a fresh gang, or a restart after finish).
                inc, plan, finished = s.requested[gang], None, False
            self.perform(az, "owner", gang, owner.handle(OwnerRecovered(
                stimulus_id=self.sid("recover"), gang=gang, incarnation=inc, plan=plan,
                decision=s.decisions.get((gang, inc)), finished=finished), self.now))

    def finish(self, gang: str) -> None:
        lg = self.locals.get(gang)
        inc = lg.incarnation if lg is not None else self.owners[gang].incarnation
        self.store.finished.add((gang, inc))  # the lifecycle makes it durable first
        event = GangFinished(stimulus_id=self.sid("finish"), gang=gang, incarnation=inc)
        if lg is not None:
            lg.phase = LocalPhase.FINISHED
        else:
            self.feed_owner(gang, event)
        for az in AZS:  # participants watch gangs/ too
            self.send(az, "participant", None, event, droppable=False)
        self.poke_unplaced()

    def resubmit(self, gang: str) -> None:
        lg = self.locals.get(gang)
        inc = (lg.incarnation if lg is not None else self.owners[gang].incarnation) + 1
        self.store.requested[gang] = inc
        if lg is not None:
            self.request_local(gang, inc)
        else:
            self.feed_owner(gang, GangSubmitted(stimulus_id=self.sid("resubmit"), gang=gang,
                                                incarnation=inc))

    def poke_unplaced(self) -> None:
        """Capacity changed: the owners' leaders run an admission cycle (a
        wake), which places the gangs waiting for placement that now fit."""
        for gang, owner in list(self.owners.items()):
            if owner.phase is OwnerPhase.UNPLACED and self.up[self.gangs[gang].owner_az]:
                az = self.gangs[gang].owner_az
                self.inflight.append(Item("placement", az, "owner", gang, MarkGangPending(
                    stimulus_id=self.sid("wake"), gang=gang, incarnation=owner.incarnation, reason="woken"),
                    self.life[az]))
        for gang, lg in list(self.locals.items()):
            if lg.phase is LocalPhase.WAITING:
                self.request_local(gang, lg.incarnation)

    # ------------------------------------------------------------ local path

    def request_local(self, gang: str, inc: int) -> None:
        """The single-AZ path asks its own participant (in process)."""
        spec = self.gangs[gang]
        self.locals[gang] = LocalGang(inc, LocalPhase.REQUESTING)
        self.feed_participant(spec.owner_az, PrepareReceived(
            stimulus_id=self.sid("local"), gang=gang, incarnation=inc, owner_az=spec.owner_az,
            priority=spec.priority, submitted_at=spec.submitted_at,
            nodes=spec.plan[spec.owner_az], local=True))

    def on_local_answer(self, vote: VoteReceived) -> None:
        lg = self.locals.get(vote.gang)
        if lg is None or lg.phase is not LocalPhase.REQUESTING or vote.incarnation != lg.incarnation:
            return
        if vote.yes:
            lg.phase = LocalPhase.RESERVED
        elif self.blockers(self.gangs[vote.gang]):
            lg.phase = LocalPhase.WAITING
        else:
            lg.phase = LocalPhase.BACKOFF
            az = self.gangs[vote.gang].owner_az
            self.timers.append((self.now + 1.0, az, self.life[az], "local", vote.gang,
                                RetryDue(stimulus_id=self.sid("local-retry"), gang=vote.gang,
                                         incarnation=lg.incarnation)))

    def check(self) -> None:
        """The core's invariants, plus the one about the local path that the
        core cannot see: a single-AZ gang told "reserved" has its COMMITTED
        record in etcd (agents start members only on that record)."""
        assert_invariants(self.snapshot())
        for gang, lg in self.locals.items():
            if lg.phase is LocalPhase.RESERVED:
                rec = self.store.reservations.get((self.gangs[gang].owner_az, gang))
                assert rec is not None and rec.incarnation == lg.incarnation \
                    and rec.state is HoldState.COMMITTED, f"local {gang} reserved without its record"

    def blockers(self, spec: GangSpec) -> list[str]:
        """COMMITTED gangs holding part of ``spec``'s devices."""
        return sorted({gang for az, gang, rec in self.store.live_committed()
                       if gang != spec.gang and az in spec.plan
                       and slice_devices(spec.plan[az]) & slice_devices(rec.nodes)})

    # ------------------------------------------------------------ teardown

    def drain(self) -> int:
        """Heal, then deliver everything and fire every timer, in order."""
        for az in AZS:
            if not self.up[az]:
                self.restart(az)
        for steps in range(DRAIN_LIMIT):
            if self.inflight:
                self.deliver(self.inflight.pop(0))
            elif self.timers:
                earliest = min(range(len(self.timers)), key=lambda i: self.timers[i][0])
                self.fire(earliest)
            else:
                return steps
        raise AssertionError(
            f"not quiescent after {DRAIN_LIMIT} deliveries (livelock?): owners "
            + ", ".join(f"{g}={o.phase.value}@{o.incarnation}" for g, o in self.owners.items()))

    def check_liveness(self) -> None:
        """Every gang is admitted, or a COMMITTED gang holds part of its
        devices. In particular the oldest gang is never starved by younger
        ones that are merely PREPARED."""
        order = sorted(self.gangs.values(),
                       key=lambda g: gang_order_key(g.priority, g.submitted_at, g.gang))
        for rank, spec in enumerate(order):
            if spec.local:
                lg = self.locals[spec.gang]
                state, inc, why = lg.phase.value, lg.incarnation, ""
                admitted = lg.phase in (LocalPhase.RESERVED, LocalPhase.FINISHED)
                waiting = lg.phase is LocalPhase.WAITING
            else:
                owner = self.owners[spec.gang]
                state, inc, why = owner.phase.value, owner.incarnation, owner.last_reason
                admitted = owner.phase in (OwnerPhase.RESERVED, OwnerPhase.FINISHED)
                waiting = owner.phase is OwnerPhase.UNPLACED
            assert admitted or (waiting and self.blockers(spec)), (
                f"{'oldest ' if rank == 0 else ''}gang {spec.gang} is {state} at incarnation "
                f"{inc} ({why!r}) though no COMMITTED gang blocks it")


# ---------------------------------------------------------------- strategies


@st.composite
def gang_specs(draw: st.DrawFn) -> list[GangSpec]:
    """2-4 gangs over few devices, so that most of them overlap somewhere.
    About a quarter are single-AZ gangs on the local path, competing for the
    same ledger as the cross-AZ ones."""
    count = draw(st.integers(2, 4))
    specs = []
    for i in range(count):
        owner_az = draw(st.sampled_from(AZS))
        local = draw(st.integers(0, 3)) == 0
        if local:
            azs = [owner_az]
        else:
            azs = draw(st.lists(st.sampled_from(AZS), min_size=1, max_size=3, unique=True))
        plan: dict[str, dict[str, NodeDevices]] = {}
        for az in azs:
            node = draw(st.sampled_from(NODES))
            gpus = draw(st.lists(st.sampled_from(GPUS), min_size=1, max_size=2, unique=True))
            nics = draw(st.lists(st.sampled_from(NICS), max_size=1, unique=True))
            plan[az] = {node: (tuple(gpus), tuple(nics))}
        specs.append(GangSpec(
            gang=f"g{i}", owner_az=owner_az,
            priority=draw(st.integers(0, 1)),
            submitted_at=float(draw(st.integers(0, 3))),  # ties: gang id decides
            plan=normalize_plan(plan), local=local,
        ))
    return specs


class TwoPhaseWorld(RuleBasedStateMachine):
    """One rule, ``step``, whose ``action`` picks what happens. A single rule
    on purpose: hypothesis' swarm testing switches whole rules off per run,
    and a run without deliveries never gets past the first prepare. Our own
    swarm (``faults``, drawn once per run) switches fault kinds instead, so
    some runs only drop messages, others only crash leaders, and so on."""

    sim: Sim
    faults: frozenset[str]

    @initialize(gangs=gang_specs(), faults=st.frozensets(st.sampled_from(FAULTS)))
    def start(self, gangs: list[GangSpec], faults: frozenset[str]) -> None:
        self.sim = Sim(gangs)
        self.faults = faults

    @rule(action=st.sampled_from(ACTIONS), count=st.sampled_from((15, 40, 5, 1)),
          seed=st.integers(0, 2**32 - 1))
    def step(self, action: str, count: int, seed: int) -> None:
        rnd = random.Random(seed)
        if action in FAULTS and action not in self.faults:
            action = "network"
        getattr(self, f"_{action}")(count, rnd)

    def _network(self, count: int, rnd: random.Random) -> None:
        """A burst of ``count`` deliveries of any item in flight (so in any
        order), with duplicated messages, dropped RPCs and failed store
        writes mixed in when those faults are on. Invariants are checked after
        every action, not only per step. The choices come from a seeded RNG
        rather than one hypothesis draw each: long bursts would otherwise use
        up hypothesis' buffer, and a failure still replays exactly."""
        ops = ["deliver"] * 8 + sorted(self.faults & {"duplicate", "drop", "store-failure"})
        for _ in range(count):
            inflight = self.sim.inflight
            if not inflight:
                break
            op = rnd.choice(ops)
            if op == "deliver":
                self.sim.deliver(inflight.pop(rnd.randrange(len(inflight))))
            elif op == "duplicate":
                msgs = [it for it in inflight if it.kind == "msg"]
                if msgs:
                    inflight.append(rnd.choice(msgs))
            elif op == "drop":
                victims = [k for k, it in enumerate(inflight) if it.droppable]
                if victims:
                    inflight.pop(rnd.choice(victims))
            else:  # a refused store write is reported to its issuer, not lost
                writes = [k for k, it in enumerate(inflight) if it.kind == "store"]
                if writes:
                    item = inflight.pop(rnd.choice(writes))
                    inflight.append(dataclasses.replace(
                        item, kind="result", payload=self.sim.fail(item.payload)))  # type: ignore[arg-type]
            self.sim.check()

    def _timer(self, count: int, rnd: random.Random) -> None:
        """Fire any pending timer (not necessarily the earliest); time moves
        to its deadline if that is later, so other timers fire late."""
        if self.sim.timers:
            self.sim.fire(rnd.randrange(len(self.sim.timers)))

    def _crash(self, count: int, rnd: random.Random) -> None:
        """An AZ leader dies: its participant and the owners it runs lose all
        memory; its writes still in flight are fenced."""
        up = [az for az in AZS if self.sim.up[az]]
        if up:
            self.sim.crash(rnd.choice(up))

    def _restart(self, count: int, rnd: random.Random) -> None:
        """A new leader takes over and rebuilds from the store alone."""
        down = [az for az in AZS if not self.sim.up[az]]
        if down:
            self.sim.restart(rnd.choice(down))

    def _finish(self, count: int, rnd: random.Random) -> None:
        """An admitted gang ends; its holds must now be released."""
        gangs = sorted([g for g, o in self.sim.owners.items() if o.phase is OwnerPhase.RESERVED]
                       + [g for g, lg in self.sim.locals.items() if lg.phase is LocalPhase.RESERVED])
        if gangs:
            self.sim.finish(rnd.choice(gangs))

    def _resubmit(self, count: int, rnd: random.Random) -> None:
        """A finished gang restarts (whole-gang teardown, new incarnation)."""
        gangs = sorted([g for g, o in self.sim.owners.items() if o.phase is OwnerPhase.FINISHED]
                       + [g for g, lg in self.sim.locals.items() if lg.phase is LocalPhase.FINISHED])
        if gangs:
            self.sim.resubmit(rnd.choice(gangs))

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "sim"):
            self.sim.check()

    def teardown(self) -> None:
        if not hasattr(self, "sim"):
            return
        self.sim.drain()
        self.sim.check()
        assert_invariants(self.sim.snapshot(), quiescent=True)
        self.sim.check_liveness()
        # Every COMMITTED record was handed to the agents exactly as committed.
        for (az, gang), rec in self.sim.store.reservations.items():
            assert (az, (gang, rec.incarnation)) in self.sim.dispatched


TwoPhaseWorld.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    # ~10 s on one idle core; the soak setting for a bug hunt is
    # max_examples=3000, stateful_step_count=60 (a minute or two).
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_two_phase_world = TwoPhaseWorld.TestCase
