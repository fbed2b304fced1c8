"""A single-AZ gang's run-time decisions (coordinator/core/lifecycle.py):
tables a reader can check by hand."""

from __future__ import annotations

import pytest

from coordinator.core import lifecycle as lc
from coordinator.core.progress import MemberReport
from coordinator.core.records import GangRecord, MemberAssignment
from phalanx.model import GangState, MemberPhase
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.spec import GangSpec, Policy, Resources
from phalanx.timings import Timings

AZ = "az-a"
EPOCH = 7
NOW = 1000.0
S = GangState
P = MemberPhase


def gang(state: GangState, *, members: int = 2, nodes: tuple[str, ...] = ("n0", "n1"), restarts: int = 0,
         max_restarts: int = 1, updated_at: float = NOW, start_timeout: float = 60.0, inc: int = 1,
         owner_az: str = AZ) -> GangRecord:
    spec = GangSpec(name="g", members=members, resources=Resources(gpus=1),
                    policy=Policy(max_restarts=max_restarts, start_timeout_s=start_timeout))
    placement = tuple(MemberAssignment(r, AZ, nodes[r % len(nodes)], (0,), ()) for r in range(members))
    return GangRecord(id="g", spec=spec, state=state, owner_az=owner_az, submitted_at=10.0, updated_at=updated_at,
                      incarnation=inc, placement=placement if state != S.PENDING else (), restarts=restarts,
                      reason="rank 1 on n1 exited with code 3")


def rep(*phases: MemberPhase, code: int = 0) -> dict[int, MemberReport]:
    """Reports for ranks 0, 1, ... in order (rank r on n<r>)."""
    return {r: MemberReport(ph, code if ph == P.FAILED else 0, "", f"n{r}") for r, ph in enumerate(phases)}


def reservation(state: HoldState = HoldState.COMMITTED, inc: int = 1) -> Reservation:
    return Reservation(AZ, "g", inc, state, {"n0": NodeDevices((0,), ()), "n1": NodeDevices((0,), ())}, EPOCH - 1)


def kinds(events) -> list[str]:
    return [e.kind for e in events]


# ---------------------------------------------------------------- (a)
# state, restarts/max, reports -> (new state or None, event kinds)
PROGRESS = [
    ("reserved-nothing-reported", S.RESERVED, 0, 1, {}, None, []),
    ("starting-one-running", S.STARTING, 0, 1, rep(P.RUNNING), None, []),
    ("starting-all-running", S.STARTING, 0, 1, rep(P.RUNNING, P.RUNNING), S.RUNNING, ["started"]),
    ("running-all-succeeded", S.RUNNING, 0, 1, rep(P.SUCCEEDED, P.SUCCEEDED), S.SUCCEEDED, []),
    ("starting-all-succeeded-records-start", S.STARTING, 0, 1, rep(P.SUCCEEDED, P.SUCCEEDED), S.SUCCEEDED, ["started"]),
    ("failure-with-restarts-left-restarts", S.RUNNING, 0, 1, rep(P.RUNNING, P.FAILED, code=3), S.RESTARTING,
     ["member_exited", "restarting"]),
    ("failure-with-no-restarts-left-fails", S.RUNNING, 1, 1, rep(P.RUNNING, P.FAILED, code=3), S.FAILED,
     ["member_exited"]),
    ("max-restarts-zero-fails", S.RUNNING, 0, 0, rep(P.STOPPED, P.RUNNING), S.FAILED, ["member_exited"]),
    ("rejected-member-restarts", S.STARTING, 0, 2, rep(P.REJECTED, P.RUNNING), S.RESTARTING,
     ["member_exited", "restarting"]),
    ("terminal-gang-no-step", S.SUCCEEDED, 0, 1, rep(P.FAILED, P.FAILED), None, []),
]


@pytest.mark.parametrize("state, restarts, max_restarts, reports, to, events",
                         [r[1:] for r in PROGRESS], ids=[r[0] for r in PROGRESS])
def test_member_progress(state, restarts, max_restarts, reports, to, events) -> None:
    g = gang(state, restarts=restarts, max_restarts=max_restarts)
    step = lc.member_progress(g, reports, NOW, EPOCH)
    if to is None:
        assert step is None
        return
    assert step.to == to
    assert kinds(step.events) == events
    assert all(e.at == NOW and e.epoch == EPOCH and e.incarnation == 1 for e in step.events)
    assert step.teardown == (to.terminal or to == S.RESTARTING)


def test_a_restart_event_names_the_restart_and_the_cause() -> None:
    g = gang(S.RUNNING, restarts=1, max_restarts=3)
    step = lc.run_time_step(g, S.FAILED, "start barrier: 1 of 2", {}, NOW, EPOCH)
    assert step.to == S.RESTARTING
    assert "restart 2 of 3" in step.events[-1].message and "start barrier: 1 of 2" in step.events[-1].message


# state, reports, has reservation, two-phase -> what follows the teardown
AFTER = [
    ("restarting-members-gone-requeues", S.RESTARTING, rep(P.STOPPED, P.FAILED), True, False, lc.AfterTeardown.REQUEUE),
    ("restarting-member-still-running-waits", S.RESTARTING, rep(P.STOPPED, P.RUNNING), True, False, None),
    ("unheard-member-counts-as-running", S.FAILED, rep(P.STOPPED), True, False, None),
    ("failed-with-reservation-releases", S.FAILED, rep(P.STOPPED, P.STOPPED), True, False, lc.AfterTeardown.RELEASE),
    ("cross-az-terminal-is-forgotten", S.CANCELLED, rep(P.STOPPED, P.STOPPED), False, True, lc.AfterTeardown.FORGET),
    ("terminal-nothing-held-nothing-to-do", S.SUCCEEDED, rep(P.SUCCEEDED, P.SUCCEEDED), False, False, None),
    ("running-is-not-torn-down", S.RUNNING, rep(P.STOPPED, P.STOPPED), True, False, None),
]


@pytest.mark.parametrize("state, reports, has_res, two_phase, expected", [r[1:] for r in AFTER], ids=[r[0] for r in AFTER])
def test_after_teardown(state, reports, has_res, two_phase, expected) -> None:
    assert lc.after_teardown(gang(state), reports, has_reservation=has_res, two_phase=two_phase) == expected


# state, reports -> nodes where a member may still run
LIVE = [
    ("running-unheard-counts", S.RUNNING, rep(P.SUCCEEDED), {"n1"}),
    ("running-all-live", S.RUNNING, rep(P.RUNNING, P.STARTING), {"n0", "n1"}),
    ("all-exited", S.RESTARTING, rep(P.FAILED, P.STOPPED), set()),
    ("pending-never-sent", S.CANCELLED, {}, set()),
    ("cancelled-reported-live", S.CANCELLED, rep(P.RUNNING), {"n0"}),
]


@pytest.mark.parametrize("state, reports, nodes", [r[1:] for r in LIVE], ids=[r[0] for r in LIVE])
def test_live_member_nodes(state, reports, nodes) -> None:
    assert lc.live_member_nodes(gang(state), reports) == nodes


def test_teardown_keeps_devices_held_while_members_may_run() -> None:
    g = gang(S.RUNNING)
    t = lc.teardown(g, S.FAILED, "rank 1 failed", [], reservation(), {"n1"}, NOW, EPOCH)
    assert t.record.state == S.FAILED and t.record.reason == "rank 1 failed" and t.record.updated_at == NOW
    assert t.releasing is not None and t.releasing.state is HoldState.RELEASING and t.releasing.epoch == EPOCH
    assert not t.delete_reservation and t.free_name
    assert kinds(t.events) == ["finished"] and t.revoke_nodes == ("n0", "n1")


def test_teardown_deletes_the_reservation_when_nothing_runs_and_a_restart_keeps_the_name() -> None:
    t = lc.teardown(gang(S.RUNNING), S.RESTARTING, "why", [], reservation(), set(), NOW, EPOCH)
    assert t.releasing is None and t.delete_reservation and not t.free_name and kinds(t.events) == []
    t = lc.teardown(gang(S.PENDING), S.FAILED, "timeout", [], None, set(), NOW, EPOCH)
    assert t.releasing is None and not t.delete_reservation and t.revoke_nodes == ()


# ---------------------------------------------------------------- (b)
@pytest.mark.parametrize("restarts, backoff", [(0, 1.0), (1, 2.0), (3, 8.0), (10, 60.0)],
                         ids=["first-1s", "second-2s", "fourth-8s", "capped-60s"])
def test_requeue(restarts: int, backoff: float) -> None:
    g = gang(S.RESTARTING, restarts=restarts, max_restarts=20, inc=restarts + 1)
    q = lc.requeue(g, NOW, Timings(restart_backoff_s=1.0, restart_backoff_max_s=60.0), has_reservation=True)
    n = q.record
    assert q.backoff_s == backoff and n.not_before == NOW + backoff and q.delete_reservation
    assert (n.state, n.incarnation, n.restarts, n.placement, n.span) == (S.PENDING, g.incarnation + 1, restarts + 1, (), None)
    assert n.submitted_at == g.submitted_at, "keeps its place at the head of the queue"
    assert n.reason == f"restart {restarts + 1}/20 after: rank 1 on n1 exited with code 3"


# ---------------------------------------------------------------- (c)
# state, seconds since its last update (timeout 60), reports -> failure reason (or None)
BARRIER = [
    ("reserved-within-timeout", S.RESERVED, 60.0, {}, None),
    ("reserved-past-timeout", S.RESERVED, 60.5, {}, "start barrier: 0 of 2 members started within start_timeout_s=60s"),
    ("starting-one-of-two", S.STARTING, 61.0, rep(P.RUNNING, P.STARTING),
     "start barrier: 1 of 2 members started within start_timeout_s=60s"),
    ("succeeded-counts-as-started", S.STARTING, 61.0, rep(P.SUCCEEDED),
     "start barrier: 1 of 2 members started within start_timeout_s=60s"),
    ("running-has-no-barrier", S.RUNNING, 999.0, {}, None),
]


@pytest.mark.parametrize("state, age, reports, why", [r[1:] for r in BARRIER], ids=[r[0] for r in BARRIER])
def test_start_barrier(state, age, reports, why) -> None:
    assert lc.start_barrier(gang(state, updated_at=NOW - age), reports, NOW) == why


# ---------------------------------------------------------------- (d)
# not ready after 5 s, replaced after 20 s
# silent, placeable, record ready -> (close session, record written not ready, lost)
LIVENESS = [
    ("heard-recently", 1.0, True, True, (False, False, False)),
    ("silent-closes-and-marks", 6.0, True, True, (True, True, False)),
    ("already-closed-record-ready", 6.0, False, True, (False, True, False)),
    ("already-marked", 6.0, False, False, (False, False, False)),
    ("no-record-closes-only", 6.0, True, None, (True, False, False)),
    ("past-fence-deadline-lost", 21.0, False, False, (False, False, True)),
    ("past-deadline-still-ready-all-three", 21.0, True, True, (True, True, True)),
]


@pytest.mark.parametrize("silent, ready, record_ready, expected", [r[1:] for r in LIVENESS], ids=[r[0] for r in LIVENESS])
def test_node_verdict(silent, ready, record_ready, expected) -> None:
    v = lc.node_verdict("n1", last_contact=NOW - silent, ready=ready, record_ready=record_ready, now=NOW,
                        not_ready_after_s=5.0, replace_after_s=20.0)
    assert (v.close_session, bool(v.not_ready_reason), bool(v.lost_reason)) == expected
    if v.not_ready_reason:
        assert v.not_ready_reason == f"no heartbeat for {silent:.1f}s"
    if v.lost_reason:
        assert v.lost_reason == f"node n1 lost (silent {silent:.0f}s, past its fence deadline)"


SHOWN = [
    # (case, recorded, last_contact, shown): now NOW (monotonic), wall 5000.0
    ("not-heard-the-record", 4000.0, None, 4000.0),
    ("heard-2s-ago", 4000.0, NOW - 2.0, 4998.0),
    ("heard-just-now", 4000.0, NOW, 5000.0),
    ("never-ahead-of-now", 4000.0, NOW + 1.0, 5000.0),
]


@pytest.mark.parametrize("recorded, last_contact, shown", [r[1:] for r in SHOWN], ids=[r[0] for r in SHOWN])
def test_shown_heartbeat(recorded, last_contact, shown) -> None:
    assert lc.shown_heartbeat(recorded, last_contact, NOW, 5000.0) == shown


def test_a_lost_node_stops_exactly_the_members_placed_there() -> None:
    g1 = gang(S.RUNNING, members=4, nodes=("n0", "n1"))  # ranks 1 and 3 on n1
    g2 = gang(S.RUNNING, nodes=("n0",)).evolve(id="h")
    out = lc.lost_member_reports([g1, g2], "n1", AZ, "node n1 lost")
    assert [(g.id, sorted(r)) for g, r in out] == [("g", [1, 3])]
    assert all(r.phase == P.STOPPED and r.exit_code == -1 and r.node == "n1" for r in out[0][1].values())
    assert lc.lost_member_reports([g1], "n1", "az-b", "x") == [], "only this AZ's members"


# ---------------------------------------------------------------- (e)
# gang state (None: unknown), reservation, reported incarnation -> what to do
REPORTED = [
    ("committed-running-adopted", S.RUNNING, reservation(), 1, lc.Reported.ADOPT),
    ("unknown-gang-revoked", None, reservation(), 1, lc.Reported.REVOKE),
    ("no-reservation-tracked", S.RUNNING, None, 1, lc.Reported.REVOKE_AND_TRACK),
    ("releasing-reservation-tracked", S.FAILED, reservation(HoldState.RELEASING), 1, lc.Reported.REVOKE_AND_TRACK),
    ("restarting-tracked", S.RESTARTING, reservation(), 1, lc.Reported.REVOKE_AND_TRACK),
    ("older-incarnation-revoked", S.RUNNING, reservation(inc=2), 1, lc.Reported.REVOKE),
]


@pytest.mark.parametrize("state, committed, inc, expected", [r[1:] for r in REPORTED], ids=[r[0] for r in REPORTED])
def test_reported_member(state, committed, inc, expected) -> None:
    g = None if state is None else gang(state, inc=committed.incarnation if committed else 1)
    assert lc.reported_member(g, committed, "g", inc) == expected


# gang state, two-phase, ranks the agent reports on n1 (ranks 1, 3 placed there) -> redispatch, recorded phases
UNREPORTED = [
    ("all-reported", S.RUNNING, False, {1, 3}, None),
    ("starting-redispatched", S.STARTING, False, {1}, (True, {})),
    ("cross-az-starting-left-to-its-driver", S.RESERVED, True, set(), None),
    ("running-vanished-fails", S.RUNNING, False, {3}, (False, {1: P.FAILED})),
    ("restarting-gone", S.RESTARTING, False, set(), (False, {1: P.STOPPED, 3: P.STOPPED})),
    ("pending-nothing", S.PENDING, False, set(), None),
]


@pytest.mark.parametrize("state, two_phase, have, expected", [r[1:] for r in UNREPORTED], ids=[r[0] for r in UNREPORTED])
def test_unreported_members(state, two_phase, have, expected) -> None:
    g = gang(state, members=4, nodes=("n0", "n1"))
    u = lc.unreported_members(g, "n1", AZ, have, two_phase=two_phase)
    if expected is None:
        assert u is None
        return
    assert (u.redispatch, {r: m.phase for r, m in u.reports.items()}) == expected
    assert all(m.node == "n1" for m in u.reports.values())


# ---------------------------------------------------------------- (f)
CANCEL = [
    ("running-cancelled-default-reason", S.RUNNING, AZ, "", "cancelled by user"),
    ("pending-cancelled-with-reason", S.PENDING, AZ, "wrong data", "wrong data"),
    ("other-owner-refused", S.RUNNING, "az-b", "", "gang g is owned by az-b, not az-a"),
    ("finished-refused", S.SUCCEEDED, AZ, "", "id: gang g is already SUCCEEDED; nothing to cancel"),
]


@pytest.mark.parametrize("state, owner, reason, expected", [r[1:] for r in CANCEL], ids=[r[0] for r in CANCEL])
def test_cancel(state, owner, reason, expected) -> None:
    out = lc.cancel(gang(state, owner_az=owner), AZ, reason, "user/alice", NOW, EPOCH)
    if isinstance(out, lc.CancelRefused):
        assert out.message == expected
        return
    assert out.reason == expected
    (e,) = out.events
    assert e.kind == "cancelled" and e.by == "user/alice" and expected in e.message and e.at == NOW


# ------------------------------------------------- (g) stray members (issue 26)
# A member's report arrives: gang state (None: unknown) and incarnation, the
# reported incarnation and phase -> revoke it (again)? A cancel (or any
# teardown) that races the start sends its revocation before the member
# starts; the member's first report is the leader's only chance to stop it.
STRAY = [
    ("cancelled-running-revoked", S.CANCELLED, 1, 1, P.RUNNING, True),
    ("cancelled-starting-revoked", S.CANCELLED, 1, 1, P.STARTING, True),
    ("failed-running-revoked", S.FAILED, 1, 1, P.RUNNING, True),
    ("restarting-running-revoked", S.RESTARTING, 1, 1, P.RUNNING, True),
    ("older-incarnation-running-revoked", S.STARTING, 2, 1, P.RUNNING, True),
    ("cancelled-stopped-nothing", S.CANCELLED, 1, 1, P.STOPPED, False),
    ("cancelled-rejected-nothing", S.CANCELLED, 1, 1, P.REJECTED, False),
    ("running-running-its-own", S.RUNNING, 1, 1, P.RUNNING, False),
    ("starting-running-its-own", S.STARTING, 1, 1, P.RUNNING, False),
    ("unknown-gang-left-to-registration", None, 1, 1, P.RUNNING, False),
]


@pytest.mark.parametrize("state, gang_inc, inc, phase, expected", [r[1:] for r in STRAY], ids=[r[0] for r in STRAY])
def test_stray_member(state, gang_inc, inc, phase, expected) -> None:
    g = None if state is None else gang(state, inc=gang_inc)
    assert lc.stray_member(g, inc, phase) is expected
