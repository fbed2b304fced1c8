"""A hypothesis world over the Book (coordinator/book.py; issue 23 item 2):
its public transitions driven in random valid and racing orders, and
``Book.problems()`` (what must hold between its maps, docs/book.md
"Invariants") empty after every step.

The world stands in for the drivers: it submits gangs this AZ owns, places
them on devices the book sees free (``held_slices``) and holds them before
the reservation's write, whose reply comes back later (applied, or not: the
in-memory hold is undone), possibly after the gang was torn down, restarted,
found adopted by another AZ or collected meanwhile. A gang is torn down
keeping its reservation RELEASING, deleting it, or to restart (requeued as
its next incarnation); a RELEASING reservation is released. The takeover
restores reservations read from etcd and stand-ins for unreadable ones.
Cross-AZ: Prepares from another AZ's owner and every participant event in
any order (written, committed, aborted, finished, released or not),
through ``participant_decides``; this AZ's owners started, placed, ended
and forgotten. Retention: finished gangs seen, and collected (forgotten).
Records are the real ``GangRecord``, ``Reservation`` and ``FinishedGang``."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from coordinator.book import Book, two_phase_config
from coordinator.core.placement import MemberSlot, Placement
from coordinator.core.records import GangRecord
from coordinator.core.retention import FinishedGang
from coordinator.core.twophase import (
    AbortReceived, CommitReceived, CommitWriteFailed, CommitWritten, GangFinished, GangSubmitted, HoldReleased,
    HoldReleaseFailed, HoldWriteFailed, HoldWritten, OwnerState, PrepareReceived,
)
from phalanx.model import GangState, Level
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.spec import GangSpec, Resources
from phalanx.store import Keys
from phalanx.timings import Timings

AZ, OTHER = "az-a", "az-b"
T = Timings()
GANGS = ("g0", "g1", "g2", "g3")  # single-AZ gangs this AZ owns
WIDE = ("w0", "w1")  # cross-AZ gangs: held here for another AZ's owner, or owned here
NODES = ("n0", "n1", "n2")
GPUS = (0, 1)
SPEC = GangSpec(name="g", members=1, resources=Resources(gpus=1))

gangs = st.sampled_from(GANGS)
wide = st.sampled_from(WIDE)
devices = st.tuples(st.sampled_from(NODES), st.sampled_from(GPUS))
incarnations = st.integers(1, 2)
# Steps that end a gang's life here are taken one time in four, so lives get long.
RARE = st.integers(0, 3).map(lambda n: n == 0)

PARTICIPANT_EVENTS = {
    "written": lambda g, i: HoldWritten(stimulus_id="w", gang=g, incarnation=i),
    "write-failed": lambda g, i: HoldWriteFailed(stimulus_id="w", gang=g, incarnation=i, reason="newer"),
    "commit": lambda g, i: CommitReceived(stimulus_id="w", gang=g, incarnation=i, from_az=OTHER),
    "commit-written": lambda g, i: CommitWritten(stimulus_id="w", gang=g, incarnation=i),
    "commit-write-failed": lambda g, i: CommitWriteFailed(stimulus_id="w", gang=g, incarnation=i, reason="x"),
    "abort": lambda g, i: AbortReceived(stimulus_id="w", gang=g, incarnation=i, from_az=OTHER),
    "finished": lambda g, i: GangFinished(stimulus_id="w", gang=g, incarnation=i),
    "released": lambda g, i: HoldReleased(stimulus_id="w", gang=g, incarnation=i),
    "release-failed": lambda g, i: HoldReleaseFailed(stimulus_id="w", gang=g, incarnation=i, reason="x"),
}


def record(gang: str, state: GangState, incarnation: int, owner_az: str = AZ, revision: int = 0) -> GangRecord:
    return GangRecord(id=gang, spec=SPEC, state=state, owner_az=owner_az, submitted_at=1.0, updated_at=2.0,
                      incarnation=incarnation, mod_revision=revision)


class BookWorld(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.book = Book.of(AZ, Keys("/phalanx/test"), T)
        self.now = 0.0
        self.revision = 0
        self.inc: dict[str, int] = {}  # the newest incarnation of each gang (etcd's)
        self.in_flight: dict[str, Reservation] = {}  # reservation writes whose reply has not come back

    # ---------------------------------------------------------------- helpers
    def _tick(self) -> float:
        self.now += 1.0
        self.revision += 1
        return self.now

    def _free(self, node: str, gpu: int) -> bool:
        return not any(gpu in s[node].gpus for s in self.book.held_slices() if node in s)

    def _rec(self, gang: str, state: GangState, **kw) -> GangRecord:
        self._tick()
        return record(gang, state, self.inc.setdefault(gang, 1), revision=self.revision, **kw)

    # ------------------------------------------------------------- takeover
    @initialize(held=st.lists(st.tuples(gangs, devices), max_size=4), stand_in=st.none() | devices,
                live=st.sets(gangs))
    def rebuild(self, held, stand_in, live) -> None:
        """Reservations read from etcd (one per gang, on distinct GPUs), a
        stand-in for an unreadable one, and the owned gangs kept."""
        taken: set[tuple[str, int]] = set()
        reservations = []
        for gang, (node, gpu) in held:
            if (node, gpu) in taken or any(r.gang == gang for r in reservations):
                continue
            taken.add((node, gpu))
            reservations.append(Reservation(AZ, gang, 1, HoldState.COMMITTED, {node: NodeDevices((gpu,))}))
        stand_ins = []
        if stand_in is not None and stand_in not in taken:
            stand_ins.append(Reservation(AZ, "unreadable", 0, HoldState.COMMITTED,
                                         {stand_in[0]: NodeDevices((stand_in[1],))}))
        self.book.restored(reservations, stand_ins)
        for r in reservations:
            g = self._rec(r.gang, GangState.RUNNING)
            if self.book.live_here(g):
                self.book.owned(g)
        for gang in live - {r.gang for r in reservations}:
            g = self._rec(gang, GangState.PENDING)
            if self.book.live_here(g):
                self.book.owned(g)

    # ------------------------------------------------------- single-AZ gangs
    @rule(gang=gangs)
    def submit(self, gang) -> None:
        if gang in self.book.gangs or gang in self.book.reservations:
            return
        self.inc[gang] = self.inc.get(gang, 0) + 1
        self.book.owned(self._rec(gang, GangState.PENDING))

    @rule(gang=gangs, device=devices)
    def place(self, gang, device) -> None:
        """The cycle placed a PENDING gang: its devices are held before the write."""
        g = self.book.gangs.get(gang)
        if g is None or g.state is not GangState.PENDING or gang in self.in_flight or gang in self.book.reservations:
            return
        if not self._free(*device):
            return
        r = Reservation(AZ, gang, g.incarnation, HoldState.COMMITTED, {device[0]: NodeDevices((device[1],))})
        self.book.held_in_memory(r)
        self.in_flight[gang] = r

    @rule(gang=gangs, applied=st.booleans())
    def reserve_replied(self, gang, applied) -> None:
        """The write's reply: applied only if the gang is still that PENDING
        incarnation (the txn compares the record); else the hold is undone."""
        r = self.in_flight.pop(gang, None)
        if r is None:
            return
        g = self.book.gangs.get(gang)
        if applied and g is not None and g.state is GangState.PENDING and g.incarnation == r.incarnation:
            self.book.owned(self._rec(gang, GangState.RESERVED))
            self.book.placed(gang)
        else:
            self.book.unheld(gang, r)

    @rule(gang=gangs, choice=st.integers(0, 5))
    def advance(self, gang, choice) -> None:
        """The next step of ``gang``'s ordinary life (the rules above and
        below also take each step alone, racing the others)."""
        g, r = self.book.gangs.get(gang), self.book.reservations.get(gang)
        if gang in self.in_flight:
            self.reserve_replied(gang=gang, applied=choice > 0)
        elif g is None and r is None:
            self.submit(gang=gang)
        elif g is None or (g.state.terminal and r is not None and r.state is HoldState.RELEASING):
            self.release(gang=gang)
        elif g.state is GangState.PENDING:
            free = [(n, gpu) for n in NODES for gpu in GPUS if self._free(n, gpu)]
            if free:
                self.place(gang=gang, device=free[choice % len(free)])
        elif g.state is GangState.RESERVED:
            self.started(gang=gang)
        elif g.state is GangState.RESTARTING:
            self.requeue(gang=gang)
        elif g.state.terminal:
            self.finished_seen(gang=gang)
            self.collected(gang=gang, rare=True)
        else:
            self.tear_down(gang=gang, how=("releasing", "delete", "restart")[choice % 3])

    @rule(gang=gangs, reason=st.sampled_from(["never fits", "no devices"]))
    def keep_waiting(self, gang, reason) -> None:
        if gang in self.book.gangs:
            self.book.waiting(gang, reason)

    @rule(gang=gangs)
    def started(self, gang) -> None:
        g = self.book.gangs.get(gang)
        if g is not None and g.state is GangState.RESERVED:
            self.book.owned(self._rec(gang, GangState.RUNNING))
            self.book.members_reported(gang, g.incarnation, {})

    @rule(gang=gangs, how=st.sampled_from(["releasing", "delete", "restart"]))
    def tear_down(self, gang, how) -> None:
        g = self.book.gangs.get(gang)
        if g is None or g.state.terminal or g.state is GangState.RESTARTING:
            return
        r = self.book.reservations.get(gang)
        if how == "releasing" and r is not None and gang not in self.in_flight:
            self.book.torn_down(self._rec(gang, GangState.FAILED), replace(r, state=HoldState.RELEASING),
                                delete_reservation=False, restarting=False)
        elif how == "restart":
            self.book.torn_down(self._rec(gang, GangState.RESTARTING), None, delete_reservation=True, restarting=True)
        else:
            self.book.torn_down(self._rec(gang, GangState.CANCELLED), None, delete_reservation=True, restarting=False)

    @rule(gang=gangs)
    def requeue(self, gang) -> None:
        g = self.book.gangs.get(gang)
        if g is None or g.state is not GangState.RESTARTING:
            return
        self.book.requeued(g)
        self.inc[gang] += 1
        self.book.owned(self._rec(gang, GangState.PENDING))

    @rule(gang=gangs)
    def release(self, gang) -> None:
        """A RELEASING reservation's delete committed."""
        r = self.book.reservations.get(gang)
        if r is None or r.state is not HoldState.RELEASING:
            return
        self.book.released(self.book.gangs.get(gang) or self._rec(gang, GangState.FAILED))

    @rule(gang=gangs | wide, transition=st.sampled_from(["adopted_elsewhere", "not_owned", "not_finished"]),
          rare=RARE)
    def let_go(self, gang, transition, rare) -> None:
        """Another AZ adopted the gang, this leader stops driving it, or it
        is no longer finished here (one transition each)."""
        if rare:
            getattr(self.book, transition)(gang)

    @rule(gang=gangs, elsewhere=st.booleans(), state=st.sampled_from(list(GangState)), rare=RARE)
    def found(self, gang, elsewhere, state, rare) -> None:
        """A write lost its compare; the newest record is found in etcd."""
        if not rare:
            return
        self.book.found(self._rec(gang, state, owner_az=OTHER if elsewhere else AZ))

    # ------------------------------------------------------------- retention
    @rule(gang=gangs | wide)
    def finished_seen(self, gang) -> None:
        g = self.book.gangs.get(gang)
        state = g.state if g is not None and g.state.terminal else GangState.SUCCEEDED
        self.book.finished_seen(FinishedGang(gang, state, AZ, self.now, self.revision), self._tick())

    @rule(gang=gangs | wide, rare=RARE)
    def collected(self, gang, rare) -> None:
        """``gangs/<gang>`` collected: every driver forgets it."""
        if not rare:
            return
        self.book.forgotten(gang)
        self.book.not_finished(gang)
        self.book.forget_cross_az(gang)

    # --------------------------------------------------- cross-AZ: participant
    @rule(gang=wide, inc=incarnations, device=devices)
    def prepare(self, gang, inc, device) -> None:
        """Another AZ's owner asks for a hold (devices the book sees free)."""
        if not self._free(*device):
            return
        self.book.participant_decides(PrepareReceived(
            stimulus_id="w", gang=gang, incarnation=inc, owner_az=OTHER, priority=0, submitted_at=1.0,
            nodes={device[0]: ((device[1],), ())}), self._tick())

    @rule(gang=wide, inc=incarnations, kind=st.sampled_from(sorted(PARTICIPANT_EVENTS)))
    def participant_event(self, gang, inc, kind) -> None:
        effects = self.book.participant_decides(PARTICIPANT_EVENTS[kind](gang, inc), self._tick())
        if kind == "released":
            self.book.hold_released(gang, inc)
        assert isinstance(effects, list)

    # ------------------------------------------------- cross-AZ: this AZ owns
    @rule(gang=wide)
    def owner_started(self, gang) -> None:
        if gang in self.book.owners:
            return
        o = OwnerState(gang, AZ, 0, 1.0, two_phase_config(T))
        self.book.owner_started(o)
        o.handle(GangSubmitted(stimulus_id="w", gang=gang, incarnation=1), self._tick())

    @rule(gang=wide, inc=incarnations, device=devices)
    def attempt_placed(self, gang, inc, device) -> None:
        if gang in self.book.owners:
            slot = MemberSlot(rank=0, az=OTHER, node=device[0], gpus=(device[1],), nics=())
            self.book.attempt_placed(gang, inc, Placement((slot,), Level.AZ, OTHER, "world"))

    @rule(gang=wide, rare=RARE)
    def owner_ended(self, gang, rare) -> None:
        if not rare:
            return
        self.book.owner_ended(gang)

    @rule(gang=wide)
    def owner_forgotten(self, gang) -> None:
        if gang in self.book.owners:
            self.book.owner_forgotten(gang)

    # ------------------------------------------------------------- must hold
    @invariant()
    def consistent(self) -> None:
        assert self.book.problems() == []

    @invariant()
    def no_leaked_hold(self) -> None:
        """The ledger holds only reservations and the takeover's stand-ins
        (``problems()`` checks it too, by the stand-ins the book keeps)."""
        held = {gang for gangs in self.book.ledger.held.values() for gang in gangs}
        assert held <= set(self.book.reservations) | {"unreadable"}, held - set(self.book.reservations)


BookWorld.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_book_world = BookWorld.TestCase
