"""The book (coordinator/book.py): the one owner of a leadership's gang,
hold and node state, and the questions the drivers ask of it. Also the
rule that makes it the one owner: the drivers keep no gang state of their
own (their constructors are read here, so a new map in a driver fails)."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from coordinator.book import Book, two_phase_config
from coordinator.core.twophase import GangSubmitted, OwnerPhase, OwnerState, ParticipantState, PrepareReceived
from coordinator.admission_cycle import AdmissionCycle
from coordinator.gang_api import GangApi
from coordinator.gang_performer import GangPerformer
from coordinator.gang_writer import GangWriter
from coordinator.leader import AzLeader
from coordinator.leadership import Leadership
from coordinator.node_sessions import NodeSessions
from coordinator.retention import GangCollector
from coordinator.twophase import TwoPhaseDriver
from coordinator.twophase.counts import RequestCounts
from coordinator.twophase.members import Members
from coordinator.twophase.peer_calls import PeerCalls
from coordinator.twophase.peer_sender import PeerSender
from coordinator.twophase.store_effects import StoreEffects
from coordinator.twophase.watch import Watcher
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.store import Keys
from phalanx.timings import Timings

AZ = "az-a"
T = Timings()


def book() -> Book:
    return Book.of(AZ, Keys("/phalanx/test"), T)


def reservation(gang: str, node: str, gpus: tuple[int, ...]) -> Reservation:
    return Reservation(AZ, gang, 1, HoldState.COMMITTED, {node: NodeDevices(gpus)})


def prepared(b: Book, gang: str, node: str, gpus: tuple[int, ...]) -> None:
    """A cross-AZ hold of ``gang`` in the participant, as a Prepare makes it."""
    b.participant.handle(PrepareReceived(stimulus_id="t", gang=gang, incarnation=1, owner_az="az-b", priority=0,
                                         submitted_at=1.0, nodes={node: (gpus, ())}), 0.0)
    assert gang in b.participant.holds


def release_decided(b: Book, gang: str, inc: int, node: str, gpus: tuple[int, ...]) -> None:
    """A cross-AZ hold of ``gang``#``inc`` written and then aborted: its
    release is decided, its delete not yet committed."""
    from coordinator.core.twophase import AbortReceived, HoldWritten

    b.participant_decides(PrepareReceived(stimulus_id="t", gang=gang, incarnation=inc, owner_az="az-b", priority=0,
                                          submitted_at=1.0, nodes={node: (gpus, ())}), 0.0)
    b.participant_decides(HoldWritten(stimulus_id="t", gang=gang, incarnation=inc), 0.0)
    b.participant_decides(AbortReceived(stimulus_id="t", gang=gang, incarnation=inc, from_az="az-b"), 0.0)
    assert (gang, inc) in b.releasing


def owner(b: Book, gang: str, *, placed: bool) -> OwnerState:
    o = OwnerState(gang, AZ, 0, 1.0, two_phase_config(T))
    b.owners[gang] = o
    if placed:
        o.handle(GangSubmitted(stimulus_id="t", gang=gang, incarnation=1), 0.0)
    return o


# ---------------------------------------------------------------- held_slices
def test_held_slices_are_reservations_holds_and_releases_not_yet_done():
    b = book()
    b.ledger.hold(reservation("single", "n0", (0, 1)))
    prepared(b, "wide", "n1", (2,))
    release_decided(b, "gone", 3, "n2", (5,))
    got = sorted((node, tuple(dev[0])) for s in b.held_slices() for node, dev in s.items())
    assert got == [("n0", (0, 1)), ("n1", (2,)), ("n2", (5,))]


def test_an_empty_book_holds_nothing():
    assert list(book().held_slices()) == []
    assert book().held_here() == set()


# ----------------------------------------------------------------- held_here
@pytest.mark.parametrize("setup, held", [
    pytest.param(lambda b: b.reservations.update(g=reservation("g", "n0", (0,))), {"g"}, id="a-reservation"),
    pytest.param(lambda b: prepared(b, "g", "n0", (0,)), {"g"}, id="a-cross-az-hold"),
    pytest.param(lambda b: owner(b, "g", placed=False), set(), id="an-owner-not-started-is-settled"),
    pytest.param(lambda b: b.gangs.update(g=None), set(), id="an-owned-gang-alone-is-not-held"),
    pytest.param(lambda b: b.finished.update(g=None), set(), id="a-finished-gang-is-not-held"),
])
def test_held_here(setup, held):
    b = book()
    setup(b)
    assert b.held_here() == held


def test_an_owner_waiting_for_placement_is_settled_and_one_in_flight_is_held():
    b = book()
    o = owner(b, "g", placed=True)
    assert o.phase is OwnerPhase.UNPLACED and b.held_here() == set()
    o.phase = OwnerPhase.PREPARING  # (what a placed attempt's owner is in)
    assert b.held_here() == {"g"}


# ------------------------------------------------------------ forget_cross_az
def test_forget_cross_az_drops_only_that_gangs_entries():
    b = book()
    for gang in ("g", "other"):
        owner(b, gang, placed=False)
        b.gang_cache[gang] = None
        b.placements[(gang, 1)] = None
        b.hold_revision[(gang, 1)] = 7
        b.published[(gang, 1)] = None
        b.local_reports[(gang, 1)] = {}
        b.revoked_at[(gang, 1)] = 1.0
        b.dec_by_key[(gang, 1)] = None
        b.finished_fed.add((gang, 1))
    b.forget_cross_az("g")
    maps = (b.owners, b.gang_cache, b.placements, b.hold_revision, b.published, b.local_reports, b.revoked_at,
            b.dec_by_key)
    assert [sorted(m) for m in maps] == [["other"], ["other"]] + [[("other", 1)]] * 6
    assert b.finished_fed == {("other", 1)}


def test_hold_released_drops_only_that_incarnations_hold_entries():
    """Fails if a released hold leaves its revision, published summary, local
    reports or revoke mark behind, or takes another incarnation's (or another
    gang's) with it, or touches what is not the hold's (the gang's cache,
    its owner, its attempts)."""
    b = book()
    keys = [("g", 1), ("g", 2), ("other", 1)]
    for key in keys:
        b.hold_revision[key] = 7
        b.published[key] = None
        b.local_reports[key] = {}
        b.revoked_at[key] = 1.0
        b.placements[key] = None
    b.gang_cache["g"] = None
    b.hold_released("g", 1)
    for m in (b.hold_revision, b.published, b.local_reports, b.revoked_at):
        assert sorted(m) == [("g", 2), ("other", 1)]
    assert sorted(b.placements) == keys and "g" in b.gang_cache


def test_known_gang_is_the_owned_record_else_the_held_one():
    b = book()
    b.gang_cache["g"] = "held"
    assert b.known_gang("g") == "held"
    b.gangs["g"] = "owned"
    assert b.known_gang("g") == "owned"
    assert b.known_gang("nope") is None


def test_newest_never_goes_back_to_an_older_revision():
    """A reply that comes back after a later write of the gang (issue 26:
    a cancel retried on the record it lost to) is not the newest."""
    from types import SimpleNamespace as R

    b = book()
    assert b.newest(R(id="g", mod_revision=10))
    assert b.newest(R(id="g", mod_revision=12)), "a later write"
    assert not b.newest(R(id="g", mod_revision=11)), "the late reply of the write the cancel lost to"
    assert b.newest(R(id="g", mod_revision=12)), "the same record read back"
    assert b.newest(R(id="h", mod_revision=1)) and b.revisions == {"g": 12, "h": 1}


# ------------------------------------------------- the drivers keep no state
# What each driver may keep besides the book: I/O, never a gang's state.
IO_ONLY = {
    AzLeader: {},
    GangPerformer: {},
    AdmissionCycle: {
        "pending_classes": "the metrics gauge's last classes",
        "_verdicts": "never-fits memo",
        "_picking": "rendezvous ports being picked for writes in flight",
    },
    GangApi: {},
    Leadership: {"_tasks": "asyncio tasks"},
    NodeSessions: {"conns": "agent sessions (gRPC streams)"},
    GangWriter: {
        "_counted": "what the metrics counters last counted",
        "_inflight": "writes in flight",
        "_unwritten_events": "events riding on the next write",
        "_on_forget": "who else forgets a collected gang",
    },
    TwoPhaseDriver: {},
    RequestCounts: {
        "etcd_requests": "per-gang request counter (bench/admission.py)",
        "check_reads": "how many of etcd_requests were a lagging watch's check reads (bench/admission.py)",
    },
    StoreEffects: {"_folding": "a MarkGangReserved parked behind the COMMIT write in flight"},
    PeerSender: {"_leaders": "peer address cache"},
    Members: {"_publishing": "member summary writes in flight"},
    Watcher: {},
    GangCollector: {},
    PeerCalls: {
        "_vote_waiters": "futures of Prepare calls waiting for the vote",
        "_ack_waiters": "futures of Commit/Abort calls waiting for the ack",
        "auth_reads": "per-gang count of the servicer's leader-key reads under TLS (bench/admission.py)",
    },
}


def containers_made_in_init(cls: type) -> set[str]:
    """Attributes ``__init__`` sets to a new dict, set or list."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    made = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            new = isinstance(value, (ast.Dict, ast.Set, ast.List, ast.DictComp, ast.SetComp)) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("dict", "set", "list"))
            for t in targets:
                if new and isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    made.add(t.attr)
    return made


@pytest.mark.parametrize("cls", list(IO_ONLY), ids=lambda c: c.__name__)
def test_drivers_keep_no_gang_state_of_their_own(cls):
    # A map added to a driver must either move into the book or be listed
    # above with the I/O it serves.
    assert containers_made_in_init(cls) == set(IO_ONLY[cls])


def test_the_check_sees_a_new_map_in_a_driver():
    class Driver:
        def __init__(self):
            self.book = None
            self.gangs: dict = {}
            self.seen = set()
            self.n = 0

    assert containers_made_in_init(Driver) == {"gangs", "seen"}


# ------------------------------------------------- invariants and transitions
def record(gid: str = "g", state=None, *, owner_az: str = AZ, inc: int = 1):
    from coordinator.core.records import GangRecord
    from phalanx.model import GangState
    from phalanx.spec import GangSpec, Resources

    spec = GangSpec(name=gid, members=1, resources=Resources(gpus=1))
    return GangRecord(id=gid, spec=spec, state=state or GangState.RUNNING, owner_az=owner_az, submitted_at=1.0,
                      updated_at=2.0, incarnation=inc)


def finished(gid: str):
    from coordinator.core.retention import FinishedGang
    from phalanx.model import GangState

    return FinishedGang(id=gid, state=GangState.SUCCEEDED, owner_az=AZ, ended_at=1.0, mod_revision=7)


def _releasing_a_held_key(b: Book) -> None:
    # Only a core bug makes it (the core keeps devices releasing only once
    # their key is decided or finished, and then never holds that key again:
    # test_twophase_participant.py), so a participant with that bug stands in.
    class ReleasingWhatItHolds(ParticipantState):
        @property
        def releasing(self):
            return {("wide", 1): {"n1": ((2,), ())}}

    b.participant = ReleasingWhatItHolds(AZ, two_phase_config(T))
    prepared(b, "wide", "n1", (2,))


@pytest.mark.parametrize("break_it, problem", [
    pytest.param(lambda b: b.gangs.update(h=record("g")), "gangs['h'] holds the entry of 'g'", id="gang-under-another-key"),
    pytest.param(lambda b: b.gangs.update(g=record("g", owner_az="az-b")), "gangs['g'] is owned by az-b",
                 id="gang-owned-elsewhere"),
    pytest.param(lambda b: b.reservations.update(g=reservation("g", "n0", (0,))),
                 "reservation of g not held in the ledger on n0", id="reservation-not-in-the-ledger"),
    pytest.param(lambda b: (b.ledger.hold(reservation("g", "n0", (0,))), b.ledger.hold(reservation("h", "n0", (0,)))),
                 "n0 gpu 0 held by g and h", id="one-gpu-two-gangs"),
    pytest.param(lambda b: b.finished.update(g=finished("g")), "finished and seen_mono differ: ['g']",
                 id="finished-not-seen"),
    pytest.param(lambda b: b.owners.update(h=OwnerState("g", AZ, 0, 1.0, two_phase_config(T))),
                 "owners['h'] holds the entry of 'g'", id="owner-under-another-key"),
    pytest.param(_releasing_a_held_key, "('wide', 1) is both held and being released", id="held-and-releasing"),
    pytest.param(lambda b: b.ledger.hold(reservation("g", "n0", (0,))),
                 "ledger holds devices of g on n0 with no reservation behind them", id="leaked-ledger-hold"),
])
def test_problems_names_each_broken_invariant(break_it, problem):
    b = book()
    assert b.problems() == []
    break_it(b)
    assert any(p.startswith(problem) for p in b.problems()), b.problems()


def _every_transition(b: Book) -> None:
    """A leadership's life through the transitions, on one book."""
    from phalanx.model import GangState

    g, r = record("g"), reservation("g", "n0", (0, 1))
    b.owned(g)
    b.held_in_memory(r)
    b.waiting("g", "no room")
    b.placed("g")
    b.members_reported("g", 1, {})
    b.torn_down(g, dataclasses_replace(r, state=HoldState.RELEASING), False, restarting=False)
    b.released(g)
    b.owned(record("h"))
    b.held_in_memory(reservation("h", "n1", (0,)))
    b.unheld("h", reservation("h", "n1", (0,)))  # (another reservation: kept)
    b.requeued(record("h"))
    b.found(record("h", owner_az="az-b"))
    b.owned(record("k", GangState.RESTARTING))
    b.torn_down(record("k"), None, True, restarting=True)
    b.not_owned("k")
    b.finished_seen(finished("done"), 5.0)
    b.not_finished("done")
    b.finished_seen(finished("done2"), 5.0)
    b.forgotten("g")
    prepared(b, "wide", "n2", (3,))
    b.hold_written("wide", 1, 9)
    b.gang_cached(record("wide", owner_az="az-b"))
    b.local_members_reported("wide", 1, {})
    b.summary_published("wide", 1, None)
    b.hold_revoked("wide", 1, 1.0)
    b.finish_fed("wide", 1)
    b.owner_started(OwnerState("o", AZ, 0, 1.0, two_phase_config(T)))
    b.attempt_placed("o", 1, None)
    b.owner_ended("o")
    b.adopted_elsewhere("wide")


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_transitions_keep_the_book_consistent():
    """Fails when a transition leaves the maps inconsistent (Book.problems),
    e.g. a reservation dropped without its ledger entry or the reverse."""
    b = book()
    _every_transition(b)
    assert b.problems() == []
    assert sorted(b.gangs) == [] and b.reservations == {} and b.ledger.held == {}
    assert sorted(b.finished) == ["done2"] and sorted(b.owners) == [] and b.placements == {}


@pytest.mark.parametrize("transition, after", [
    pytest.param(lambda b: b.held_in_memory(reservation("g", "n0", (0,))), ({"g"}, {"n0": {"g"}}), id="held_in_memory"),
    pytest.param(lambda b: (b.held_in_memory(reservation("g", "n0", (0,))), b.unreserved("g")), (set(), {}),
                 id="unreserved"),
    pytest.param(lambda b: (b.held_in_memory(r := reservation("g", "n0", (0,))), b.unheld("g", r)), (set(), {}),
                 id="unheld-the-same-reservation"),
    pytest.param(lambda b: (b.held_in_memory(reservation("g", "n0", (0,))), b.unheld("g", reservation("g", "n0", (0,)))),
                 ({"g"}, {"n0": {"g"}}), id="unheld-keeps-a-later-reservation"),
    pytest.param(lambda b: b.restored([reservation("g", "n0", (0,))], [reservation("x", "n1", (1,))]),
                 ({"g"}, {"n0": {"g"}, "n1": {"x"}}), id="restored-with-a-stand-in"),
])
def test_reservations_and_ledger_move_together(transition, after):
    b = book()
    transition(b)
    assert (set(b.reservations), {n: set(g) for n, g in b.ledger.held.items()}) == after
    assert b.problems() == []


@pytest.mark.parametrize("revision, owner_az, want, kept", [
    (5, AZ, False, "old"),  # a late reply: older than what the book has
    (12, AZ, True, "new"),  # newer, still ours: kept
    (12, "az-b", True, None),  # newer, adopted by another AZ: dropped
], ids=["older-changes-nothing", "newer-kept", "newer-adopted-elsewhere-dropped"])
def test_lost_compare_keeps_only_the_newest_record_found(revision, owner_az, want, kept):
    b = book()
    old = record("g").evolve(mod_revision=10, reason="old")
    assert b.newest(old)
    b.owned(old)
    assert b.lost_compare(record("g", owner_az=owner_az).evolve(mod_revision=revision, reason="new")) is want
    assert (b.gangs["g"].reason if "g" in b.gangs else None) == kept
    assert b.revisions["g"] == max(10, revision)


def test_found_drops_a_gang_adopted_elsewhere_and_keeps_only_live_ones():
    from phalanx.model import GangState

    b = book()
    b.owned(record("g"))
    b.found(record("g", owner_az="az-b"))
    assert "g" not in b.gangs
    b.found(record("g", GangState.FAILED))
    assert "g" not in b.gangs, "terminal, no reservation"
    b.held_in_memory(reservation("g", "n0", (0,)))
    b.found(record("g", GangState.FAILED))
    assert "g" in b.gangs, "terminal but RELEASING its reservation"


def test_a_stand_in_is_backed_until_its_gang_is_unreserved_and_a_leak_is_not():
    b = book()
    b.restored([reservation("g", "n0", (0,))], [reservation("unreadable", "n1", (1,))])
    assert b.problems() == [] and b.stand_ins == {"unreadable"}
    b.unreserved("unreadable")
    assert b.stand_ins == set() and b.problems() == []
    # The gap it closes: a hold left in the ledger with neither a
    # reservation nor a stand-in behind it (devices never freed).
    b.restored([], [reservation("unreadable", "n1", (1,))])
    b.stand_ins.discard("unreadable")
    assert b.problems() == ["ledger holds devices of unreadable on n1 with no reservation behind them"]


def test_participant_decides_keeps_a_decided_release_taken_until_its_delete_commits():
    from coordinator.core.twophase import AbortReceived, HoldReleased, HoldWritten, ReleaseHold

    b = book()
    prepared(b, "wide", "n1", (2,))
    b.participant_decides(HoldWritten(stimulus_id="t", gang="wide", incarnation=1), 0.0)  # (voted yes)
    effects = b.participant_decides(AbortReceived(stimulus_id="t", gang="wide", incarnation=1, from_az="az-b"), 0.0)
    assert any(isinstance(e, ReleaseHold) for e in effects) and "wide" not in b.participant.holds
    assert list(b.releasing) == [("wide", 1)] and b.gangs_holding("n1") == ["wide"] and b.problems() == []
    b.participant_decides(HoldReleased(stimulus_id="t", gang="wide", incarnation=1), 0.0)
    assert b.releasing == {} and b.gangs_holding("n1") == []


def test_owner_forgotten_takes_its_pending_reason_and_attempts():
    b = book()
    owner(b, "g", placed=False)
    b.waiting("g", "no room")
    b.attempt_placed("g", 1, None)
    b.attempt_placed("h", 1, None)
    b.owner_forgotten("g")
    assert "g" not in b.owners and "g" not in b.pending_reason and sorted(b.placements) == [("h", 1)]


def test_waiting_says_whether_the_reason_changed():
    b = book()
    assert b.waiting("g", "a") and not b.waiting("g", "a") and b.waiting("g", "b")
    b.placed("g")
    assert b.pending_reason == {}
