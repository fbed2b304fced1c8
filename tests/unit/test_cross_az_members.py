"""A cross-AZ gang's members in one participant AZ
(coordinator/core/cross_az_members.py): tables a reader can check by hand."""

from __future__ import annotations

import pytest

from coordinator.core.cross_az_members import GIVEN_UP, HoldOver, hold_over, lost_members, to_send_again
from coordinator.core.progress import MemberReport
from coordinator.core.records import GangRecord, MemberAssignment, MemberSummary
from phalanx.model import GangState, MemberPhase
from phalanx.spec import GangSpec, Policy, Resources, Topology

AZ = "az-b"
S = GangState
P = MemberPhase
REPLACE = 10.0  # replace_after_s
# Ranks 0 and 1 on n0 and n1 of this AZ; rank 2 in the owner's AZ.
PLACEMENT = (MemberAssignment(0, AZ, "n0", (0,), ()), MemberAssignment(1, AZ, "n1", (0,), ()),
             MemberAssignment(2, "az-a", "a0", (0,), ()))


def gang(state: GangState, inc: int = 2) -> GangRecord:
    spec = GangSpec(name="g", members=3, resources=Resources(gpus=1), policy=Policy(max_restarts=2),
                    topology=Topology(allow_cross_az=True))
    return GangRecord(id="g", spec=spec, state=state, owner_az="az-a", submitted_at=10.0, updated_at=20.0,
                      incarnation=inc, placement=PLACEMENT)


def rep(phase: MemberPhase, node: str = "n0", code: int = 0) -> MemberReport:
    return MemberReport(phase, code, "", node)


DONE = {0: rep(P.SUCCEEDED), 1: rep(P.SUCCEEDED, "n1")}
HALF = {0: rep(P.SUCCEEDED)}  # rank 1 never reported
STOP1 = {1: MemberReport(P.STOPPED, -1, GIVEN_UP, "n1")}


def summary(reports) -> MemberSummary:
    return MemberSummary.of(2, AZ, reports)


@pytest.mark.parametrize("g, kw, want", [
    pytest.param(gang(S.RUNNING), {}, None, id="incarnation-goes-on-nothing"),
    pytest.param(gang(S.PENDING, inc=1), {}, None, id="record-behind-the-hold-nothing"),
    pytest.param(gang(S.FAILED), dict(told=True), None, id="core-already-told-nothing"),
    pytest.param(gang(S.FAILED), dict(prepared=True), HoldOver(finish=True),
                 id="prepared-hold-core-told-at-once-no-revoke"),
    pytest.param(gang(S.CANCELLED), {}, HoldOver(revoke=True), id="first-look-revokes-and-waits"),
    pytest.param(gang(S.CANCELLED), dict(revoked_at=95.0), HoldOver(), id="revoked-waits-for-members"),
    pytest.param(gang(S.CANCELLED), dict(revoked_at=95.0, reports=HALF), HoldOver(),
                 id="one-member-still-unreported-waits"),
    pytest.param(gang(S.CANCELLED), dict(revoked_at=90.0, reports=HALF, published=summary(HALF)),
                 HoldOver(stopped=STOP1, publish=True), id="at-the-fence-deadline-the-silent-member-is-stopped"),
    pytest.param(gang(S.CANCELLED), dict(revoked_at=95.0, reports=DONE, published=summary(DONE)),
                 HoldOver(finish=True), id="every-member-ended-and-published-finishes"),
    pytest.param(gang(S.CANCELLED), dict(revoked_at=95.0, reports=DONE), HoldOver(publish=True),
                 id="ended-not-published-publishes-first"),
    pytest.param(gang(S.CANCELLED), dict(reports=DONE, published=summary(DONE)), HoldOver(revoke=True, finish=True),
                 id="ended-before-any-revoke-still-revoked-once"),
    pytest.param(gang(S.RESTARTING), dict(revoked_at=95.0, reports=DONE, published=summary(DONE)),
                 HoldOver(finish=True), id="restarting-counts-as-over"),
    pytest.param(gang(S.PENDING, inc=3), dict(revoked_at=95.0, reports=HALF, published=summary(HALF)),
                 HoldOver(finish=True), id="later-incarnation-only-reported-ranks-count"),
    pytest.param(gang(S.PENDING, inc=3), dict(revoked_at=80.0, reports={0: rep(P.RUNNING)}, published=None),
                 HoldOver(publish=True), id="later-incarnation-past-deadline-nothing-stopped-from-its-placement"),
    pytest.param(gang(S.CANCELLED), dict(revoked_at=80.0), HoldOver(stopped={
        0: MemberReport(P.STOPPED, -1, GIVEN_UP, "n0"), **STOP1}, publish=True),
                 id="none-reported-by-the-deadline-all-stopped-on-their-nodes"),
])
def test_hold_over(g, kw, want):
    args = dict(az=AZ, incarnation=2, prepared=False, told=False, revoked_at=None, reports={}, published=None,
                now=100.0, replace_after_s=REPLACE)
    args.update(kw)
    assert hold_over(g, **args) == want


def test_the_wait_ends_exactly_at_replace_after_s_from_the_revoke():
    args = dict(az=AZ, incarnation=2, prepared=False, told=False, revoked_at=90.0, reports=HALF,
                published=summary(HALF), replace_after_s=REPLACE)
    assert hold_over(gang(S.FAILED), now=99.99, **args) == HoldOver()
    assert hold_over(gang(S.FAILED), now=100.0, **args).stopped == STOP1


@pytest.mark.parametrize("node, reports, want", [
    pytest.param("n0", {}, {0: MemberReport(P.STOPPED, -1, "lost", "n0")}, id="its-member-stopped"),
    pytest.param("n0", {0: rep(P.SUCCEEDED)}, {}, id="an-ended-member-stays-as-it-ended"),
    pytest.param("n1", {1: rep(P.RUNNING, "n1")}, {1: MemberReport(P.STOPPED, -1, "lost", "n1")},
                 id="a-running-member-stopped"),
    pytest.param("a0", {}, {}, id="another-azs-node-is-not-ours"),
    pytest.param("n9", {}, {}, id="a-node-without-members"),
])
def test_lost_members(node, reports, want):
    assert lost_members(gang(S.RUNNING), node, AZ, reports, "lost") == want


@pytest.mark.parametrize("node, reported, reports, want", [
    pytest.param("n0", (), {}, frozenset(), id="nothing-reported-sent-again-whole"),
    pytest.param("n0", (0,), {}, None, id="its-member-runs-nothing"),
    pytest.param("n0", (), {0: rep(P.SUCCEEDED)}, None, id="its-member-ended-not-sent-again"),
    pytest.param("n0", (), {0: rep(P.RUNNING)}, frozenset(), id="a-live-report-does-not-count-as-running-there"),
    pytest.param("n9", (), {}, None, id="no-member-placed-there"),
])
def test_to_send_again(node, reported, reports, want):
    assert to_send_again(gang(S.RUNNING), node, reported, reports) == want
