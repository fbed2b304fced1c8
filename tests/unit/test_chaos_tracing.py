"""Following a chaos violation back to the decisions that caused it: the gang
events in the etcd history name the stimulus of the write that added them
(chaos.history.Tracer, docs/chaos.md "Following a violation back"). Pure: a
hand-built history, no cluster."""

from __future__ import annotations

from typing import Any

from chaos import checker
from chaos.history import AgentEvent, EtcdEvent, FinalState, History, RunParams, Tracer, gang_observations

T0 = 1000.0


def gang_put(rev: int, t: float, state: str, events: list[dict[str, Any]], gid: str = "g3", members: int = 2) -> EtcdEvent:
    return EtcdEvent("put", f"gangs/{gid}", rev, T0 + t, value={
        "id": gid, "state": state, "owner_az": "a", "incarnation": 1, "idempotency_key": f"{gid}-k", "reason": "",
        "spec": {"name": gid, "members": members, "topology": {"allow_cross_az": False}}, "events": events})


def event(seq: int, kind: str, stimulus: str = "") -> dict[str, Any]:
    d: dict[str, Any] = {"kind": kind, "at": T0, "epoch": 5, "message": kind, "seq": seq, "incarnation": 1}
    if stimulus:
        d["stimulus"] = stimulus
    return d


SUBMITTED = event(1, "submitted", "a-3")
PLACED, RESERVED = event(2, "placed", "a-17"), event(3, "reserved", "a-17")
STARTED = event(4, "started", "a-21")


def history() -> History:
    """g3 (2 members) is written RUNNING (rev 43, by stimulus a-21) when only
    rank 0 has started: an all-or-nothing violation. Its reservation went
    with the placement write (rev 41, stimulus a-17, one txn). g4's write at
    rev 44 comes from a coordinator older than stimulus ids."""
    etcd = (
        EtcdEvent("put", "leader/a", 5, T0, create_rev=5, value={"id": "coord-a1"}),
        gang_put(40, 1.0, "PENDING", [SUBMITTED]),
        gang_put(41, 1.2, "RESERVED", [SUBMITTED, PLACED, RESERVED]),
        EtcdEvent("put", "reservations/a/g3", 41, T0 + 1.2, value={
            "az": "a", "gang": "g3", "incarnation": 1, "status": "COMMITTED", "epoch": 5,
            "nodes": {"a-n000": {"gpus": [0, 1], "nics": []}}}),
        gang_put(42, 1.3, "STARTING", [SUBMITTED, PLACED, RESERVED]),
        gang_put(43, 2.0, "RUNNING", [SUBMITTED, PLACED, RESERVED, STARTED]),
        gang_put(44, 2.5, "PENDING", [event(1, "submitted")], gid="g4", members=1),
    )
    agents = (AgentEvent("member_started", "a-n000", "a", T0 + 1.5, epoch=5, key="g3#1/r0", gpus=(0,)),)
    return History(params=RunParams(azs=("a",), started_at=T0, settle_at=T0 + 60, healed_at=None),
                   agents=agents, etcd=etcd,
                   final=FinalState(revision=99, mono=T0 + 60, kvs={"leader/a": {"id": "coord-a1"}}))


def test_each_gang_observation_names_the_stimuli_of_the_events_it_added() -> None:
    obs = gang_observations(history().etcd)
    assert [(o.rev, o.stimuli, o.kinds) for o in obs["g3"]] == [
        (40, ("a-3",), ("submitted",)),
        (41, ("a-17",), ("placed", "reserved")),
        (42, (), ()),  # a write with no event of its own
        (43, ("a-21",), ("started",)),
    ]
    # An event written before stimulus ids existed still parses: no stimulus.
    assert [(o.stimuli, o.kinds) for o in obs["g4"]] == [((), ("submitted",))]


def test_a_violation_names_the_stimulus_of_the_write_it_is_about() -> None:
    verdict = checker.check(history())
    found = [v for v in verdict.violations if v.invariant == 1 and "written RUNNING (rev 43)" in v.what]
    assert len(found) == 1, [v.render() for v in verdict.violations]
    traced = [e for e in found[0].evidence if e.startswith("traced: ")]
    assert traced == ["traced: rev 43 (gangs/g3) written by stimulus a-21 (with gang g3's started event)"]
    assert "written by stimulus a-21" in found[0].render()


def test_the_tracer_names_the_txn_of_a_reservation_and_the_admission_of_a_gang() -> None:
    t = Tracer(history().etcd)
    # The reservation shares its revision with the gang write of the same txn.
    assert t.lines(["reservation reservations/a/g3 written at rev 41"]) == (
        "traced: rev 41 (gangs/g3, reservations/a/g3) written by stimulus a-17 (with gang g3's placed, reserved events)",)
    assert t.lines(["rev 42"]) == ("traced: rev 42 (gangs/g3): no stimulus recorded (no gang event was written with it)",)
    # No revision named: the decisions that admitted the incarnation named.
    assert t.lines(["GPU 1 of a-n000 held by g3#1/r0 and g9#1/r0 at once"]) == (
        "traced: g3#1: submitted by stimulus a-3 (rev 40); placed by stimulus a-17 (rev 41); "
        "reserved by stimulus a-17 (rev 41)",)
    assert t.lines(["gang g4 left PENDING"]) == ()  # its only event names no stimulus


def test_the_report_says_how_many_gang_writes_name_their_stimulus() -> None:
    from chaos import report

    h = history()
    line = report.traceability(h)
    # g3's three writes with events name theirs; g4's (an old coordinator's) does not.
    assert line == "Traceability: 3 of 4 gang writes with events name their stimulus (3 distinct stimulus ids)"
    assert line in report.summary(h, checker.check(h))
