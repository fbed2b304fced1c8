"""An agent's registration as effects (coordinator/core/gang_effects.py:
register_node, reported_member_effects, unreported_effects): tables a reader
can check by hand."""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import pytest

from coordinator.core import gang_effects as fx
from coordinator.core.progress import MemberReport
from coordinator.core.records import GangRecord, MemberAssignment, NodeRecord
from phalanx.agent_messages import MemberStatus
from phalanx.model import GangState, MemberPhase
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.spec import GangSpec, Policy, Resources, Topology
from phalanx.topology import NodeTopology

AZ = "az-a"
NODE = "n0"
WALL = 1234.5
S = GangState
P = MemberPhase


@dataclass(frozen=True)
class Session:
    """What the leader's AgentConn says of its node."""

    node: str = NODE
    agent_id: str = "agent-2"
    topology: NodeTopology = NodeTopology(node=NODE, az=AZ)
    address: str = "10.0.0.7"
    ports: tuple[int, int] = (41000, 41100)


SESSION = Session()
READY = NodeRecord(topology=SESSION.topology, ready=True, agent_id="agent-1")
NOT_READY = NodeRecord(topology=SESSION.topology, ready=False, agent_id="agent-1", reason="no heartbeat for 9.0s")
WRITTEN = NodeRecord(topology=SESSION.topology, ready=True, agent_id="agent-2", last_heartbeat=WALL,
                     address="10.0.0.7", ports=(41000, 41100))


# ------------------------------------------------------------ register_node
@pytest.mark.parametrize("previous, replaces, announce", [
    pytest.param(None, False, True, id="first-registration-announces-ready"),
    pytest.param(READY, False, False, id="re-registration-of-a-ready-node-no-ready-line"),
    pytest.param(NOT_READY, False, True, id="node-that-was-not-ready-announces-ready"),
    pytest.param(READY, True, False, id="replacing-an-open-session-closes-it"),
])
def test_register_node(previous, replaces, announce):
    e = fx.register_node(SESSION, previous, replaces_session=replaces, wall=WALL, stimulus_id="az-a-3")
    assert e == fx.RegisterNode(NODE, WRITTEN, replaces, announce, SESSION, "az-a-3")


def test_a_re_registration_that_changes_nothing_writes_nothing():
    # A new leader, or a reconnect: etcd already says all of it but the time.
    same = dataclasses.replace(WRITTEN, last_heartbeat=WALL - 600, mod_revision=17)
    e = fx.register_node(SESSION, same, replaces_session=False, wall=WALL)
    assert (e.write, e.record, e.announce_ready) == (False, same, False)
    # Any other field (here the address the agent advertises) is a change.
    moved = dataclasses.replace(same, address="10.0.0.8")
    e = fx.register_node(SESSION, moved, replaces_session=False, wall=WALL)
    assert (e.write, e.record) == (True, WRITTEN)


def test_register_node_writes_the_new_sessions_facts_not_the_previous_records():
    # The previous record's reason, agent and address are not carried over.
    e = fx.register_node(SESSION, NOT_READY, replaces_session=False, wall=WALL)
    assert (e.record.ready, e.record.reason, e.record.agent_id, e.record.address) == (True, "", "agent-2", "10.0.0.7")


# -------------------------------------------------- reported_member_effects
def gang(state: GangState, *, gid: str = "g", inc: int = 2, wide: bool = False,
         placement: tuple[MemberAssignment, ...] = ()) -> GangRecord:
    spec = GangSpec(name=gid, members=max(1, len(placement)), resources=Resources(gpus=1), policy=Policy(max_restarts=2),
                    topology=Topology(allow_cross_az=wide))
    return GangRecord(id=gid, spec=spec, state=state, owner_az=AZ, submitted_at=10.0, updated_at=20.0,
                      incarnation=inc, placement=placement)


def hold(state: HoldState = HoldState.COMMITTED, *, inc: int = 2) -> Reservation:
    return Reservation(AZ, "g", inc, state, {NODE: NodeDevices((0,), ())}, 7)


M = MemberStatus("g", 2, 1, P.RUNNING, reason="up")
REPORT = MemberReport(P.RUNNING, 0, "up", NODE)
TRACK = fx.TrackMembers("g", 2, {1: REPORT}, "s")
REVOKE = fx.SendRevoke(NODE, "g", 2, "no committed reservation for this member", "s")
NOT_PLACED = "member g rank 1 is not placed on n0"


@pytest.mark.parametrize("m, refused, cross_az, g, committed, effects, runs", [
    pytest.param(M, NOT_PLACED, False, gang(S.RUNNING), hold(), [fx.IgnoreMemberReport(NOT_PLACED, "s")], False,
                 id="refused-only-logged-not-revoked"),
    pytest.param(M, NOT_PLACED, True, None, None, [fx.IgnoreMemberReport(NOT_PLACED, "s")], False,
                 id="refused-before-cross-az"),
    pytest.param(M, None, True, None, None, [fx.PublishMemberReport(NODE, M, "s")], True,
                 id="cross-az-goes-to-the-participant"),
    pytest.param(M, None, False, gang(S.RUNNING), hold(), [TRACK], True, id="committed-running-adopted"),
    pytest.param(M, None, False, gang(S.FAILED), hold(), [REVOKE, TRACK], True,
                 id="torn-down-meanwhile-revoked-and-tracked"),
    pytest.param(M, None, False, gang(S.RUNNING), hold(HoldState.RELEASING), [REVOKE, TRACK], True,
                 id="releasing-reservation-revoked-and-tracked"),
    pytest.param(M, None, False, None, None, [REVOKE], False, id="unknown-gang-revoked"),
    pytest.param(M, None, False, gang(S.RUNNING, inc=3), hold(inc=3), [REVOKE], False,
                 id="older-incarnation-revoked-not-tracked"),
    pytest.param(MemberStatus("g", 2, 1, P.FAILED, exit_code=3, reason="oom"), None, False, gang(S.RUNNING), hold(),
                 [fx.TrackMembers("g", 2, {1: MemberReport(P.FAILED, 3, "oom", NODE)}, "s")], True,
                 id="adopted-report-keeps-phase-exit-and-reason"),
])
def test_reported_member_effects(m, refused, cross_az, g, committed, effects, runs):
    d = fx.reported_member_effects(NODE, m, refused=refused, cross_az=cross_az, gang=g, committed=committed,
                                   stimulus_id="s")
    assert (list(d.effects), d.runs) == (effects, runs)


# ------------------------------------------------------- unreported_effects
ON_NODE = (MemberAssignment(0, AZ, NODE, (0,), ()), MemberAssignment(1, AZ, NODE, (1,), ()),
           MemberAssignment(2, AZ, "n1", (0,), ()))
ELSEWHERE = (MemberAssignment(0, AZ, "n1", (0,), ()), MemberAssignment(1, "az-b", NODE, (0,), ()))


def placed(state: GangState, gid: str = "g", placement=ON_NODE, **kw) -> GangRecord:
    return gang(state, gid=gid, placement=placement, **kw)


VANISHED = "member vanished (agent restarted without it)"


@pytest.mark.parametrize("g, running, effects", [
    pytest.param(placed(S.STARTING), {("g", 2): {1}},
                 [fx.SendAssignments(placed(S.STARTING), NODE, frozenset({1}), "s")],
                 id="not-started-dispatched-again-skipping-what-runs"),
    pytest.param(placed(S.RESERVED), {}, [fx.SendAssignments(placed(S.RESERVED), NODE, frozenset(), "s")],
                 id="reserved-nothing-reported-dispatched-whole-node"),
    pytest.param(placed(S.STARTING, wide=True), {}, [], id="cross-az-not-started-left-to-its-driver"),
    pytest.param(placed(S.RUNNING), {("g", 2): {0}},
                 [fx.TrackMembers("g", 2, {1: MemberReport(P.FAILED, -1, VANISHED, NODE)}, "s")],
                 id="running-missing-member-vanished"),
    pytest.param(placed(S.RESTARTING), {},
                 [fx.TrackMembers("g", 2, {0: MemberReport(P.STOPPED, 0, "gone", NODE),
                                           1: MemberReport(P.STOPPED, 0, "gone", NODE)}, "s")],
                 id="torn-down-missing-members-gone"),
    pytest.param(placed(S.RUNNING), {("g", 2): {0, 1}}, [], id="every-member-reported-nothing"),
    pytest.param(placed(S.RUNNING), {("g", 1): {0, 1}},
                 [fx.TrackMembers("g", 2, {0: MemberReport(P.FAILED, -1, VANISHED, NODE),
                                           1: MemberReport(P.FAILED, -1, VANISHED, NODE)}, "s")],
                 id="another-incarnations-members-do-not-count"),
    pytest.param(placed(S.RUNNING, placement=ELSEWHERE), {}, [], id="nothing-of-this-az-placed-here"),
    pytest.param(placed(S.PENDING), {}, [], id="pending-nothing"),
])
def test_unreported_effects(g, running, effects):
    out = fx.unreported_effects(NODE, AZ, [g], running, two_phase=lambda g: g.spec.topology.may_span_azs,
                                stimulus_id="s")
    assert out == effects


def test_unreported_effects_follow_the_gangs_order():
    first, second = placed(S.STARTING, gid="b"), placed(S.RUNNING, gid="a")
    out = fx.unreported_effects(NODE, AZ, [first, second], {("a", 2): {0}}, two_phase=lambda g: False)
    assert out == [fx.SendAssignments(first, NODE, frozenset()),
                   fx.TrackMembers("a", 2, {1: MemberReport(P.FAILED, -1, VANISHED, NODE)})]
