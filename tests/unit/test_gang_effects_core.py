"""A single-AZ gang's effects and what follows from performing them
(coordinator/core/gang_effects.py): tables a reader can check by hand."""

from __future__ import annotations

import pytest

from coordinator.core import gang_effects as fx
from coordinator.core import lifecycle as lc
from coordinator.core.admission import FailAdmission, KeepPending, Reserve
from coordinator.core.placement import MemberSlot, Placement
from coordinator.core.progress import MemberReport
from coordinator.core.records import GangRecord, MemberAssignment, NodeRecord
from phalanx.errors import AlreadyExists, Conflict
from phalanx.agent_messages import MemberStatus
from phalanx.model import GangState, Level, MemberPhase
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.spec import GangSpec, Policy, Resources, Topology
from phalanx.timings import Timings
from phalanx.topology import NodeTopology

AZ = "az-a"
EPOCH = 7
NOW = 1000.0
S = GangState


def gang(state: GangState = S.PENDING, *, gid: str = "g", wide: bool = False, owner_az: str = AZ, inc: int = 1,
         placed: bool = False, restarts: int = 0) -> GangRecord:
    spec = GangSpec(name=gid, members=2, resources=Resources(gpus=1), policy=Policy(max_restarts=2),
                    topology=Topology(allow_cross_az=wide))
    placement = (MemberAssignment(0, AZ, "n0", (0,), ()), MemberAssignment(1, AZ, "n1", (1,), ())) if placed else ()
    return GangRecord(id=gid, spec=spec, state=state, owner_az=owner_az, submitted_at=10.0, updated_at=20.0,
                      incarnation=inc, placement=placement, restarts=restarts, reason="rank 1 exited")


def placement(*slots: tuple[str, tuple[int, ...], tuple[str, ...]]) -> Placement:
    """Ranks 0, 1, ... on (node, gpus, nics) in order, in this AZ."""
    members = tuple(MemberSlot(r, AZ, node, gpus, nics) for r, (node, gpus, nics) in enumerate(slots))
    return Placement(members, Level.NODE, "d", "packed on one leaf")


TWO_NODES = placement(("n0", (0,), ()), ("n1", (1,), ()))
ONE_NODE = placement(("n0", (3,), ("mlx1",)), ("n0", (1,), ("mlx0",)))


def keep(d_gang: GangRecord, **kw) -> KeepPending:
    return KeepPending(d_gang, "no room", position=2, queue=5, **kw)


# ------------------------------------------------------- reservation_for
@pytest.mark.parametrize("p, nodes", [
    pytest.param(TWO_NODES, {"n0": NodeDevices((0,), ()), "n1": NodeDevices((1,), ())}, id="one-member-per-node"),
    pytest.param(ONE_NODE, {"n0": NodeDevices((1, 3), ("mlx0", "mlx1"))}, id="members-on-one-node-merge-sorted"),
])
def test_reservation_for_holds_each_nodes_devices_committed(p, nodes):
    r = fx.reservation_for(gang(inc=3), p, AZ, EPOCH)
    assert r == Reservation(AZ, "g", 3, HoldState.COMMITTED, nodes, EPOCH)


# ------------------------------------------------------- queue / failure
@pytest.mark.parametrize("rule, want", [
    pytest.param("", "queue position 2 of 5 in az-a: waiting for devices to free up", id="no-rule"),
    pytest.param("restart backoff: 3s", "queue position 2 of 5 in az-a: restart backoff: 3s", id="rule-named"),
])
def test_queue_reason(rule, want):
    assert fx.queue_reason(keep(gang(), rule=rule), AZ) == want


@pytest.mark.parametrize("wide, never, last, want", [
    pytest.param(False, False, "NO from az-b", "timed out", id="single-az-ignores-last-attempt"),
    pytest.param(True, False, "NO from az-b", "timed out; last: NO from az-b", id="cross-az-names-last-attempt"),
    pytest.param(True, False, "", "timed out", id="cross-az-without-attempt"),
    pytest.param(True, True, "NO from az-b", "timed out", id="never-fits-says-only-why"),
])
def test_failure_reason(wide, never, last, want):
    assert fx.failure_reason(FailAdmission(gang(wide=wide), "timed out", never_fits=never), last) == want


# ------------------------------------------------------ admission_effects
def classify(d: KeepPending, now: float) -> str:
    return f"class@{now:g}:{d.rule or 'none'}"


def test_admission_effects_one_per_decision_in_plan_order():
    single, wide, waiting, late, hopeless = (gang(gid="s"), gang(gid="w", wide=True), gang(gid="k"),
                                             gang(gid="t", wide=True), gang(gid="h", wide=True))
    decisions = [Reserve(single, TWO_NODES, "fits"), Reserve(wide, TWO_NODES, "fits"), keep(waiting, rule="backfill"),
                 FailAdmission(late, "timed out"), FailAdmission(hopeless, "never fits", never_fits=True)]
    out = fx.admission_effects(decisions, az=AZ, epoch=EPOCH, now=NOW, pending_class=classify,
                               last_attempts={"t": "NO from az-b", "h": "ignored"}, stimulus_id="az-a-9")
    assert out == [
        fx.ReserveDevices(single, TWO_NODES, fx.reservation_for(single, TWO_NODES, AZ, EPOCH), "az-a-9"),
        fx.StartTwoPhaseAttempt(wide, TWO_NODES, "az-a-9"),
        fx.KeepWaiting(waiting, "queue position 2 of 5 in az-a: backfill", "class@1000:backfill", "az-a-9"),
        fx.FailAdmission(late, "timed out; last: NO from az-b", False, "az-a-9"),
        fx.FailAdmission(hopeless, "never fits", True, "az-a-9"),
    ]


def test_admission_effects_of_no_decisions_is_nothing():
    assert fx.admission_effects([], az=AZ, epoch=EPOCH, now=NOW, pending_class=classify) == []


# ------------------------------------------------------- reserved_record
def test_reserved_record_places_and_reserves_in_one_write():
    g = gang(inc=2)
    r = fx.reservation_for(g, TWO_NODES, AZ, EPOCH)
    new, events = fx.reserved_record(g, TWO_NODES, r, ("10.0.0.1", 29501), NOW, EPOCH)
    assert new.state == S.RESERVED and new.updated_at == NOW and new.reason == "packed on one leaf"
    assert new.placement == (MemberAssignment(0, AZ, "n0", (0,), ()), MemberAssignment(1, AZ, "n1", (1,), ()))
    assert (new.master_addr, new.master_port, new.span) == ("10.0.0.1", 29501, Level.NODE)
    assert new.incarnation == 2 and new.submitted_at == g.submitted_at
    assert [e.kind for e in events] == ["placed", "reserved"]
    assert events[1].message.endswith("2 GPUs on 2 nodes of az-a in one write")
    assert all(e.at == NOW and e.epoch == EPOCH and e.incarnation == 2 for e in events)


# -------------------------------------------------------- after_reserved
WRITTEN = gang(S.RESERVED, placed=True)


@pytest.mark.parametrize("event, want", [
    pytest.param(fx.GangWritten(WRITTEN), [fx.SendAssignments(WRITTEN, stimulus_id="s1"), fx.MarkStarting(WRITTEN, "s1")],
                 id="committed-dispatch-then-starting"),
    pytest.param(fx.NotApplied("g"), [], id="did-not-apply-stays-pending"),
    pytest.param(fx.WriteRefused("changed"), [], id="refused-nothing-follows"),
])
def test_after_reserved(event, want):
    assert fx.after_reserved(event, "s1") == want


# ------------------------------------------------------- run_time_effect
@pytest.mark.parametrize("to, want_type", [
    pytest.param(S.RUNNING, fx.WriteTransition, id="running-is-a-plain-write"),
    pytest.param(S.SUCCEEDED, fx.Finish, id="succeeded-tears-down"),
    pytest.param(S.RESTARTING, fx.Finish, id="restarting-tears-down"),
])
def test_run_time_effect(to, want_type):
    g = gang(S.STARTING, placed=True)
    step = lc.RunTimeStep(to, "why", ())
    e = fx.run_time_effect(g, step, NOW, "s2")
    assert type(e) is want_type and e.stimulus_id == "s2"
    if want_type is fx.WriteTransition:
        assert e.old is g and e.record == g.evolve(state=to, reason="why", updated_at=NOW)
    else:
        assert (e.gang, e.state, e.reason) == (g, to, "why")


@pytest.mark.parametrize("to, current, want", [
    pytest.param(S.FAILED, S.FAILED, True, id="torn-down-look-again"),
    pytest.param(S.RESTARTING, S.RESTARTING, True, id="restarting-look-again"),
    pytest.param(S.FAILED, None, False, id="gone-nothing-to-do"),
    pytest.param(S.FAILED, S.RUNNING, False, id="write-refused-record-still-running"),
    pytest.param(S.RUNNING, S.RUNNING, False, id="not-a-teardown"),
])
def test_reevaluate_after(to, current, want):
    cur = None if current is None else gang(current, placed=True)
    assert fx.reevaluate_after(lc.RunTimeStep(to, "why"), cur) is want


# ---------------------------------------------------- after_teardown_effect
def test_after_teardown_effect_requeue_carries_the_next_incarnation():
    g = gang(S.RESTARTING, placed=True, restarts=1)
    e = fx.after_teardown_effect(lc.AfterTeardown.REQUEUE, g, NOW, Timings(), has_reservation=True, stimulus_id="s3")
    assert e == fx.Requeue(g, lc.requeue(g, NOW, Timings(), has_reservation=True), "s3")
    assert e.requeue.record.incarnation == 2 and e.requeue.delete_reservation


@pytest.mark.parametrize("then, want", [
    pytest.param(lc.AfterTeardown.RELEASE, fx.ReleaseDevices, id="release"),
    pytest.param(lc.AfterTeardown.FORGET, fx.ForgetGang, id="forget"),
])
def test_after_teardown_effect_release_or_forget(then, want):
    g = gang(S.FAILED, placed=True)
    assert fx.after_teardown_effect(then, g, NOW, Timings(), has_reservation=False) == want(g)


# -------------------------------------------------------- after_torn_down
def test_after_torn_down_revokes_every_placed_node_once_written():
    g = gang(S.RUNNING, placed=True)
    t = lc.teardown(g, S.CANCELLED, "by user", (), None, set(), NOW, EPOCH)
    effect = fx.TearDown(g, t, "s4")
    assert fx.after_torn_down(effect, fx.GangWritten(t.record)) == [
        fx.SendRevoke("n0", "g", 1, "by user", "s4"), fx.SendRevoke("n1", "g", 1, "by user", "s4")]
    assert fx.after_torn_down(effect, fx.WriteRefused("changed")) == []


# -------------------------------------------------------- liveness_effects
REC = NodeRecord(topology=NodeTopology(node="n0", az=AZ), ready=True, agent_id="a0")


@pytest.mark.parametrize("close, not_ready, lost, record, want", [
    pytest.param(False, "", "", REC, [], id="healthy-nothing"),
    pytest.param(True, "", "", REC, [fx.CloseSession("n0")], id="silent-close-only"),
    pytest.param(True, "no heartbeat for 9.0s", "", REC,
                 [fx.CloseSession("n0"), fx.MarkNodeNotReady("n0", NodeRecord(topology=REC.topology, ready=False,
                                                                              agent_id="a0", reason="no heartbeat for 9.0s"))],
                 id="silent-close-then-record-not-ready"),
    pytest.param(False, "no heartbeat for 9.0s", "", None, [], id="no-record-nothing-to-write"),
    pytest.param(False, "", "node n0 lost", REC, [fx.NodeLost("n0", "node n0 lost")], id="past-fence-deadline-lost"),
])
def test_liveness_effects(close, not_ready, lost, record, want):
    v = lc.NodeVerdict("n0", 9.0, close, not_ready, lost)
    assert fx.liveness_effects(v, record) == want


# ------------------------------------------------------------- submission
@pytest.mark.parametrize("holder, kind, message", [
    pytest.param("train-1a2b", AlreadyExists, "name: a live gang named 'train' exists (train-1a2b)", id="name-taken"),
    pytest.param("its name record cannot be read", AlreadyExists,
                 "name: a live gang named 'train' exists (its name record cannot be read)", id="name-record-unreadable"),
    pytest.param(None, Conflict, "submission of 'train' raced with another write; retry with the same idempotency key",
                 id="raced"),
])
def test_submission_refused(holder, kind, message):
    err = fx.submission_refused("train", holder)
    assert type(err) is kind and str(err) == message


@pytest.mark.parametrize("state, owner_az, known, want", [
    pytest.param(S.PENDING, AZ, set(), True, id="reply-lost-take-it-on"),
    pytest.param(S.PENDING, AZ, {"g"}, False, id="already-known"),
    pytest.param(S.SUCCEEDED, AZ, set(), False, id="already-ended"),
    pytest.param(S.PENDING, "az-b", set(), False, id="owned-elsewhere"),
])
def test_adopt_retried(state, owner_az, known, want):
    assert fx.adopt_retried(gang(state, owner_az=owner_az), AZ, known) is want


# ------------------------------------------------------------ assignments
def placed_gang(**kw) -> GangRecord:
    """Ranks 0, 2 on n0, rank 1 on n1 (this AZ), rank 3 on m0 in az-b."""
    g = gang(S.RESERVED, wide=True)
    return g.evolve(placement=(MemberAssignment(0, AZ, "n0", (0,), ("mlx0",)), MemberAssignment(1, AZ, "n1", (0,), ()),
                               MemberAssignment(2, AZ, "n0", (1,), ()), MemberAssignment(3, "az-b", "m0", (0,), ())), **kw)


RANK0 = NodeRecord(topology=NodeTopology(node="n0", az=AZ), ready=True, address="10.1.1.1", ports=(40000, 40100))


@pytest.mark.parametrize("only, skip, want", [
    pytest.param(None, frozenset(), [("n0", 0, 0), ("n0", 2, 1), ("n1", 1, 0)], id="this-azs-members-local-ranks"),
    pytest.param("n0", frozenset(), [("n0", 0, 0), ("n0", 2, 1)], id="only-the-registering-node"),
    pytest.param("n0", frozenset({0}), [("n0", 2, 1)], id="skip-ranks-it-runs-local-rank-kept"),
    pytest.param("m0", frozenset(), [], id="other-azs-node-not-ours"),
])
def test_assignments_per_node(only, skip, want):
    out = fx.assignments(placed_gang(master_addr="10.9.9.9", master_port=29500), AZ, RANK0, only, skip)
    assert [(n, a.rank, a.local_rank) for n, a in out] == want
    assert all(a.world_size == 4 and a.master_addr == "10.9.9.9" and a.master_port == 29500 for _, a in out)
    assert all(a.local_world_size == (2 if n == "n0" else 1) for n, a in out)


def test_assignments_of_a_record_without_rendezvous_pick_from_rank0s_range():
    (_, a), *_ = fx.assignments(placed_gang(), AZ, RANK0)
    assert a.master_addr == "10.1.1.1" and 40000 <= a.master_port <= 40100
    (_, b), *_ = fx.assignments(placed_gang(), AZ, None)
    assert b.master_addr == "n0"  # no record: the node's name


def test_assignments_of_an_unplaced_gang_is_nothing():
    assert fx.assignments(gang(), AZ, None) == []


# ----------------------------------------------------- pending_gauge_class
@pytest.mark.parametrize("state, two_phase, awaits, want", [
    pytest.param(S.PENDING, False, False, "held_back", id="single-az-pending-plan-class"),
    pytest.param(S.RUNNING, False, False, None, id="single-az-running-not-pending"),
    pytest.param(S.PENDING, True, True, "held_back", id="cross-az-awaiting-first-placement-plan-class"),
    pytest.param(S.RESERVING, True, True, "held_back", id="cross-az-between-attempts-plan-class"),
    pytest.param(S.PENDING, True, False, "two_phase", id="cross-az-attempt-running-apart"),
    pytest.param(S.RESERVING, True, False, None, id="cross-az-prepared-not-pending"),
])
def test_pending_gauge_class(state, two_phase, awaits, want):
    assert fx.pending_gauge_class(state, two_phase, awaits, "held_back") == want


# ------------------------------------------------- stray_member_effects (issue 26)
def status(inc: int = 1, phase: MemberPhase = MemberPhase.RUNNING) -> MemberStatus:
    return MemberStatus(gang="g", incarnation=inc, rank=1, phase=phase, exit_code=0, epoch=EPOCH, reason="",
                        gpus=(1,), pid=42, at=NOW, node="n1")


@pytest.mark.parametrize("g, m, want", [
    pytest.param(gang(S.CANCELLED, placed=True), status(),
                 [fx.SendRevoke("n1", "g", 1, f"{fx.STRAY_MEMBER} (CANCELLED#1)", "s1")],
                 id="cancelled-then-started-revoked-on-its-node"),
    pytest.param(gang(S.PENDING, inc=2), status(inc=1),
                 [fx.SendRevoke("n1", "g", 1, f"{fx.STRAY_MEMBER} (PENDING#2)", "s1")],
                 id="requeued-old-incarnation-revoked"),
    pytest.param(gang(S.CANCELLED, placed=True), status(phase=MemberPhase.STOPPED), [], id="stopped-nothing"),
    pytest.param(gang(S.STARTING, placed=True), status(), [], id="its-own-start-nothing"),
    pytest.param(None, status(), [], id="unknown-gang-nothing"),
])
def test_stray_member_effects(g, m, want):
    assert fx.stray_member_effects("n1", m, g, "s1") == want


# ------------------------------------------------- finish (gang_api.finish)
RES = Reservation(AZ, "g", 1, HoldState.COMMITTED, {"n0": NodeDevices((0,)), "n1": NodeDevices((1,))}, EPOCH)


@pytest.mark.parametrize("reservation, reports, state, want_releasing, want_delete, note", [
    # A member not heard from may run: the devices stay held, RELEASING.
    pytest.param(RES, {}, S.CANCELLED, True, False, "; devices held until its members are gone", id="unheard-held"),
    pytest.param(RES, {0: MemberReport(MemberPhase.RUNNING), 1: MemberReport(MemberPhase.FAILED)}, S.FAILED,
                 True, False, "; devices held until its members are gone", id="one-live-held"),
    # Every member gone: the reservation goes in the same write.
    pytest.param(RES, {0: MemberReport(MemberPhase.SUCCEEDED), 1: MemberReport(MemberPhase.FAILED)}, S.FAILED,
                 False, True, "; devices released", id="all-gone-released"),
    # No reservation (still PENDING): nothing to hold or delete.
    pytest.param(None, {}, S.CANCELLED, False, False, "", id="no-reservation"),
])
def test_finish_effect(reservation, reports, state, want_releasing, want_delete, note):
    g = gang(S.RUNNING, placed=True)
    e = fx.finish_effect(g, state, "stop", (), reservation, reports, NOW, EPOCH, "st")
    assert isinstance(e, fx.TearDown) and e.gang == g and e.stimulus_id == "st"
    t = e.teardown
    assert (t.releasing is not None, t.delete_reservation) == (want_releasing, want_delete)
    if want_releasing:
        assert t.releasing.state == HoldState.RELEASING and t.releasing.nodes == RES.nodes
    assert t.record.state == state and t.record.reason == "stop" and t.revoke_nodes == ("n0", "n1")
    assert fx.teardown_note(t) == note


# --------------------------------------------- a reservation's lost reply
@pytest.mark.parametrize("read_gang, read_res, want", [
    pytest.param(gang(S.RESERVED, placed=True), RES, True, id="applied"),
    pytest.param(None, RES, False, id="gang-gone"),
    pytest.param(gang(S.PENDING), RES, False, id="gang-still-pending"),
    pytest.param(gang(S.RESERVED, placed=True), None, False, id="no-reservation"),
    pytest.param(gang(S.RESERVED, placed=True), Reservation(AZ, "g", 2, HoldState.COMMITTED, RES.nodes, EPOCH),
                 False, id="another-incarnation"),
])
def test_reservation_applied(read_gang, read_res, want):
    assert fx.reservation_applied(read_gang, read_res, RES) is want
