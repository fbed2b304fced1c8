"""The peer calls' checks and the participant's own NO votes
(coordinator/core/peer_calls.py), and the owner lifecycle of the leader's tick
(coordinator/core/owner_lifecycle.py): one table row per refusal, shortcut and
step. The texts are the ones peers see and tests/integration/test_leader_perform.py
greps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from coordinator.core import peer_calls as pc
from coordinator.core.owner_lifecycle import StartOwner, owner_steps
from coordinator.core.peer_auth import Code
from coordinator.core.records import GangRecord, MemberAssignment
from coordinator.core.twophase_events import GangFinished, GangSubmitted, Routed
from coordinator.core.twophase_model import Outcome
from coordinator.core.twophase_owner import OwnerPhase
from phalanx.model import GangState
from phalanx.reservation import NodeDevices
from phalanx.spec import GangSpec, Resources, Topology

AZ, OWNER = "az-a", "az-b"
CALLER = pc.PeerCaller(az=OWNER, epoch=7, coordinator_id="c-b")
SLICE = {"n1": ((0, 1), ("mlx5_0",))}


def attempt(gang: str = "g", *, owner_az: str = OWNER, inc: int = 1, state: GangState = GangState.RESERVING,
            cross: bool = True) -> GangRecord:
    spec = GangSpec(name=gang, members=2, resources=Resources(gpus=2), topology=Topology(allow_cross_az=cross))
    placement = (MemberAssignment(0, AZ, "n1", (1, 0), ("mlx5_0",)), MemberAssignment(1, OWNER, "b1", (0, 1), ()))
    return GangRecord(id=gang, spec=spec, state=state, owner_az=owner_az, submitted_at=1.0, updated_at=1.0,
                      incarnation=inc, placement=placement)


# ------------------------------------------------------------------ caller

@pytest.mark.parametrize("caller, leader_revision, refused", [
    pytest.param(CALLER, 7, False, id="current leader"),
    pytest.param(CALLER, 8, True, id="deposed: another epoch leads"),
    pytest.param(CALLER, None, True, id="its AZ has no leader key"),
    pytest.param(pc.PeerCaller(az="", epoch=7), 7, True, id="no AZ named"),
])
def test_caller_refusal(caller: pc.PeerCaller, leader_revision: int | None, refused: bool) -> None:
    r = pc.caller_refusal(caller, leader_revision)
    if not refused:
        assert r is None
        return
    assert r is not None and r.code is Code.PERMISSION_DENIED
    assert r.message == (f"caller {caller.coordinator_id or '?'} (AZ {caller.az or '?'}, epoch {caller.epoch}) "
                         "is not the current leader of its AZ")


# ------------------------------------------------------------------ Prepare

@pytest.mark.parametrize("record, nodes, code, text", [
    pytest.param(attempt(), SLICE, None, "", id="the recorded attempt"),
    pytest.param(attempt(), {"n1": ((1, 0, 0), ("mlx5_0",))}, None, "", id="same slice in another order"),
    pytest.param(None, SLICE, Code.FAILED_PRECONDITION, "unknown gang 'g'", id="unknown gang"),
    pytest.param(attempt(owner_az="az-c"), SLICE, Code.PERMISSION_DENIED, "gang g is owned by az-c, not az-b",
                 id="owned by another AZ"),
    pytest.param(attempt(inc=2), SLICE, Code.FAILED_PRECONDITION,
                 "stale or unknown incarnation 1 of g: its record is at incarnation 2 (RESERVING)", id="other incarnation"),
    pytest.param(attempt(state=GangState.RESERVED), SLICE, Code.FAILED_PRECONDITION,
                 "stale or unknown incarnation 1 of g: its record is at incarnation 1 (RESERVED)", id="not RESERVING"),
    pytest.param(attempt(), {"n1": ((0,), ("mlx5_0",))}, Code.FAILED_PRECONDITION,
                 "the slice for az-a does not match the recorded plan of g#1", id="another slice"),
    pytest.param(attempt(), {"n2": ((0, 1), ("mlx5_0",))}, Code.FAILED_PRECONDITION,
                 "the slice for az-a does not match the recorded plan of g#1", id="another node"),
])
def test_attempt_refusal(record: GangRecord | None, nodes: dict, code: Code | None, text: str) -> None:
    r = pc.attempt_refusal(AZ, CALLER, "g", 1, nodes, record)
    assert (r.code, r.message) == (code, text) if code else r is None


@pytest.mark.parametrize("caller, watched_epoch, record, nodes, skip", [
    pytest.param(CALLER, 7, attempt(), SLICE, True, id="watch shows the attempt and the epoch: no read"),
    pytest.param(CALLER, 6, attempt(), SLICE, False, id="caller's epoch not the watched one"),
    pytest.param(CALLER, None, attempt(), SLICE, False, id="no epoch watched"),
    pytest.param(CALLER, 7, None, SLICE, False, id="no watched record"),
    pytest.param(pc.PeerCaller(az="", epoch=7), 7, attempt(), SLICE, False, id="no AZ named"),
    pytest.param(CALLER, 7, attempt(owner_az="az-c"), SLICE, False, id="watched record: another owner"),
    pytest.param(CALLER, 7, attempt(inc=2), SLICE, False, id="watched record: another incarnation"),
    pytest.param(CALLER, 7, attempt(state=GangState.RESERVED), SLICE, False, id="watched record: not RESERVING"),
    pytest.param(CALLER, 7, attempt(), {"n1": ((0,), ())}, False, id="watched record: another slice"),
])
def test_watched_attempt(caller: pc.PeerCaller, watched_epoch: int | None, record: GangRecord | None, nodes: dict,
                         skip: bool) -> None:
    assert pc.watched_attempt(AZ, caller, 1, nodes, watched_epoch, record) is skip


# ------------------------------------------------------------------ Commit / Abort

@pytest.mark.parametrize("caller, watched_epoch, known, want, skip", [
    pytest.param(CALLER, 7, Outcome.COMMIT, Outcome.COMMIT, True, id="known COMMIT, watched epoch: no read"),
    pytest.param(CALLER, 7, Outcome.ABORT, Outcome.COMMIT, False, id="known otherwise"),
    pytest.param(CALLER, 7, None, Outcome.ABORT, False, id="not known"),
    pytest.param(CALLER, 6, Outcome.COMMIT, Outcome.COMMIT, False, id="caller's epoch not the watched one"),
    pytest.param(pc.PeerCaller(az="", epoch=7), 7, Outcome.COMMIT, Outcome.COMMIT, False, id="no AZ named"),
])
def test_decision_known(caller: pc.PeerCaller, watched_epoch: int | None, known: Outcome | None, want: Outcome,
                        skip: bool) -> None:
    assert pc.decision_known(caller, watched_epoch, known, want) is skip


@pytest.mark.parametrize("want, have, text", [
    pytest.param(Outcome.COMMIT, Outcome.COMMIT, "", id="matches"),
    pytest.param(Outcome.ABORT, Outcome.ABORT, "", id="matches (abort)"),
    pytest.param(Outcome.COMMIT, None, "no decision recorded for g#1; refusing COMMIT", id="no decision key"),
    pytest.param(Outcome.COMMIT, Outcome.ABORT, "decision of g#1 is ABORT, not COMMIT", id="says otherwise"),
    pytest.param(Outcome.ABORT, Outcome.COMMIT, "decision of g#1 is COMMIT, not ABORT", id="says otherwise (abort)"),
])
def test_decision_refusal(want: Outcome, have: Outcome | None, text: str) -> None:
    r = pc.decision_refusal("g", 1, want, have)
    assert (r.code, r.message) == (Code.FAILED_PRECONDITION, text) if text else r is None


@pytest.mark.parametrize("held, refused", [(1, False), (None, True), (2, True)])
def test_not_prepared_refusal(held: int | None, refused: bool) -> None:
    r = pc.not_prepared_refusal(AZ, "g", 1, held)
    if refused:
        assert r is not None and (r.code, r.message) == (Code.FAILED_PRECONDITION,
                                                          "g#1 was never prepared in az-a (NOT_PREPARED)")
    else:
        assert r is None


# ------------------------------------------------------------------ the participant's own NO

HELD = {"n1": {"single": NodeDevices((2, 3), ("mlx5_1",))}, "n2": {"other": NodeDevices((0,), ())}}


@pytest.mark.parametrize("nodes, prepared, serving, reason", [
    pytest.param(SLICE, False, {"n1"}, None, id="free devices, node serving: to the core"),
    pytest.param({"n1": ((2,), ())}, False, {"n1"}, "devices committed to single-AZ gang single in az-a",
                 id="a GPU held by a single-AZ gang"),
    pytest.param({"n1": ((0,), ("mlx5_1",))}, True, {"n1"}, "devices committed to single-AZ gang single in az-a",
                 id="a NIC held by a single-AZ gang, even when already prepared"),
    pytest.param({"n2": ((1,), ())}, False, {"n2"}, None, id="same node, other devices"),
    pytest.param({"n1": ((0,), ()), "n3": ((0,), ())}, False, {"n1"}, "node(s) n3 not ready in az-a",
                 id="a node not serving"),
    pytest.param({"n4": ((0,), ()), "n3": ((0,), ())}, False, set(), "node(s) n3, n4 not ready in az-a",
                 id="nodes not serving, sorted"),
    pytest.param({"n3": ((0,), ())}, True, set(), None, id="already prepared here: the core answers again"),
])
def test_prepare_no_vote(nodes: dict, prepared: bool, serving: set[str], reason: str | None) -> None:
    assert pc.prepare_no_vote(AZ, nodes, HELD, prepared, serving) == reason


# ------------------------------------------------------------------ owner lifecycle

def owner(phase: OwnerPhase, inc: int = 1) -> SimpleNamespace:
    return SimpleNamespace(phase=phase, incarnation=inc)


def finished(inc: int = 1) -> Routed:
    return Routed.owner(GangFinished(stimulus_id=f"owner-over:g:{inc}", gang="g", incarnation=inc))


def submitted(inc: int) -> Routed:
    return Routed.owner(GangSubmitted(stimulus_id=f"submit:g:{inc}", gang="g", incarnation=inc))


@pytest.mark.parametrize("record, own, steps", [
    pytest.param(attempt(cross=False), None, [], id="single-AZ gang: no owner"),
    pytest.param(attempt(state=GangState.PENDING), None, "start", id="no owner: start one"),
    pytest.param(attempt(state=GangState.SUCCEEDED), None, [], id="no owner, ended: none"),
    pytest.param(attempt(state=GangState.RUNNING), owner(OwnerPhase.RESERVED), [], id="RESERVED, running: nothing"),
    pytest.param(attempt(state=GangState.FAILED), owner(OwnerPhase.RESERVED), [finished()], id="RESERVED, ended"),
    pytest.param(attempt(state=GangState.RESTARTING), owner(OwnerPhase.RESERVED), [finished()],
                 id="RESERVED, restarting"),
    pytest.param(attempt(state=GangState.RUNNING, inc=2), owner(OwnerPhase.RESERVED), [finished()],
                 id="RESERVED, newer incarnation"),
    pytest.param(attempt(state=GangState.PENDING, inc=2), owner(OwnerPhase.RESERVED), [finished(), submitted(2)],
                 id="RESERVED, next incarnation pending: finished, then submitted"),
    pytest.param(attempt(state=GangState.PENDING, inc=2), owner(OwnerPhase.FINISHED), [submitted(2)],
                 id="FINISHED, next incarnation pending"),
    pytest.param(attempt(state=GangState.PENDING, inc=2), owner(OwnerPhase.FAILED), [submitted(2)],
                 id="FAILED, next incarnation pending"),
    pytest.param(attempt(state=GangState.PENDING, inc=1), owner(OwnerPhase.FINISHED), [], id="FINISHED, same incarnation"),
    pytest.param(attempt(state=GangState.PENDING, inc=2), owner(OwnerPhase.BACKOFF), [], id="BACKOFF: its timer goes on"),
    pytest.param(attempt(state=GangState.RESERVING, inc=2), owner(OwnerPhase.FINISHED), [], id="FINISHED, not pending"),
])
def test_owner_steps(record: GangRecord, own: SimpleNamespace | None, steps: list | str) -> None:
    got = owner_steps([record], {} if own is None else {"g": own})
    assert got == ([StartOwner(record)] if steps == "start" else steps)


def test_owner_steps_keep_the_gangs_order() -> None:
    a, b = attempt("a", state=GangState.PENDING), attempt("b", state=GangState.PENDING)
    assert owner_steps([b, a], {}) == [StartOwner(b), StartOwner(a)]
