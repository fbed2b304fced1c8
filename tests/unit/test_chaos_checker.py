"""The chaos checker on small hand-made histories: for each invariant, one
history that holds it and at least one that breaks it (the checker must say
so, with evidence). Pure: no cluster, no clock."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from chaos import checker
from chaos.history import (
    INF,
    AgentEvent,
    ClientCall,
    ClientOutcome,
    EtcdEvent,
    FinalState,
    History,
    RunParams,
    client_record,
    leader_terms,
    load,
    member_intervals,
    recovery_bound,
)

T0 = 1000.0
TIMINGS = {"lease_ttl_s": 2, "fence_after_s": 4.0, "replace_margin_s": 1.0, "stop_grace_s": 1.0}


# ---------------------------------------------------------------------------
# Builders


def started(key: str, t: float, gpus: tuple[int, ...] = (0, 1), node: str = "a-n000", epoch: int = 5,
            az: str = "a") -> AgentEvent:
    return AgentEvent("member_started", node, az, T0 + t, epoch=epoch, key=key, gpus=gpus)


def exited(key: str, t: float, node: str = "a-n000", code: int = 0, phase: str = "SUCCEEDED",
           epoch: int = 5, az: str = "a") -> AgentEvent:
    return AgentEvent("member_exited", node, az, T0 + t, epoch=epoch, key=key, code=code, phase=phase)


def leader(az: str, epoch: int, t: float, who: str = "coord-a1") -> EtcdEvent:
    return EtcdEvent("put", f"leader/{az}", epoch, T0 + t, create_rev=epoch, value={"id": who, "address": "x"})


def leader_gone(az: str, rev: int, t: float) -> EtcdEvent:
    return EtcdEvent("delete", f"leader/{az}", rev, T0 + t)


def gang(gid: str, rev: int, t: float, state: str, members: int = 1, inc: int = 1, az: str = "a",
         key: str = "") -> EtcdEvent:
    return EtcdEvent("put", f"gangs/{gid}", rev, T0 + t, value=gang_value(gid, state, members, inc, az, key))


def gang_value(gid: str, state: str, members: int = 1, inc: int = 1, az: str = "a", key: str = "") -> dict[str, Any]:
    return {"id": gid, "state": state, "owner_az": az, "incarnation": inc, "idempotency_key": key or f"{gid}-k",
            "spec": {"name": gid, "members": members, "topology": {"allow_cross_az": False}}, "reason": ""}


def reservation(gid: str, rev: int, t: float, epoch: int = 5, inc: int = 1, status: str = "COMMITTED",
                az: str = "a", nodes: dict[str, list[int]] | None = None) -> EtcdEvent:
    return EtcdEvent("put", f"reservations/{az}/{gid}", rev, T0 + t,
                     value={"az": az, "gang": gid, "incarnation": inc, "status": status, "epoch": epoch,
                            "nodes": {n: {"gpus": g, "nics": []} for n, g in (nodes or {}).items()}})


def released(gid: str, rev: int, t: float, az: str = "a") -> EtcdEvent:
    return EtcdEvent("delete", f"reservations/{az}/{gid}", rev, T0 + t)


def ack(gid: str, t: float, az: str = "a", probe: bool = False, key: str = "") -> tuple[ClientCall, ClientOutcome]:
    key = key or f"{gid}-k"
    return (ClientCall("submit", key, gid, az, "10.0.0.1:7070", 1, T0 + t - 0.1, T0 + t, "OK", gang_id=gid,
                       probe=probe),
            ClientOutcome("submit", key, gid, az, True, gid, T0 + t - 0.1, T0 + t, "OK", 1, probe=probe))


def final(gangs: dict[str, dict[str, Any]], reservations: dict[str, dict[str, Any]] | None = None,
          leaders: tuple[str, ...] = ("a",)) -> FinalState:
    kvs: dict[str, Any] = {f"gangs/{g}": v for g, v in gangs.items()}
    kvs.update({f"reservations/{k}": v for k, v in (reservations or {}).items()})
    kvs.update({f"leader/{az}": {"id": "coord-a1"} for az in leaders})
    return FinalState(revision=999, mono=T0 + 60, kvs=kvs)


def healthy(**changes: Any) -> History:
    """One AZ, one leader (epoch 5), one 1-member gang that runs and succeeds,
    a probe gang after the heal at +20s. Every invariant holds."""
    etcd = [
        leader("a", 5, 0.0),
        gang("g1", 10, 1.0, "PENDING"),
        gang("g1", 11, 1.2, "RESERVED"), reservation("g1", 11, 1.2),
        gang("g1", 12, 1.3, "STARTING"),
        gang("g1", 13, 2.1, "RUNNING"),
        gang("g1", 14, 4.2, "SUCCEEDED"), released("g1", 15, 4.2),
        gang("p-a", 20, 21.0, "PENDING"), gang("p-a", 21, 21.2, "RESERVED"), reservation("p-a", 21, 21.2),
        gang("p-a", 22, 21.5, "RUNNING"), gang("p-a", 23, 23.0, "SUCCEEDED"), released("p-a", 24, 23.0),
    ]
    agents = [started("g1#1/r0", 2.0), exited("g1#1/r0", 4.0),
              started("p-a#1/r0", 21.4, gpus=(7,)), exited("p-a#1/r0", 22.9)]
    c1, o1 = ack("g1", 1.0)
    c2, o2 = ack("p-a", 21.0, probe=True)
    h = History(
        params=RunParams(azs=("a",), started_at=T0, settle_at=T0 + 60, healed_at=T0 + 20, timings=TIMINGS,
                         recovery_bound_s=recovery_bound(TIMINGS)),
        agents=tuple(agents), etcd=tuple(etcd), calls=(c1, c2), outcomes=(o1, o2),
        final=final({"g1": gang_value("g1", "SUCCEEDED"), "p-a": gang_value("p-a", "SUCCEEDED")}),
    )
    return dataclasses.replace(h, **changes)


def violations(h: History, invariant: int) -> list[checker.Violation]:
    v = checker.check(h)
    others = [x for x in v.violations if x.invariant != invariant]
    assert others == [], f"unexpected violations of other invariants: {[x.render() for x in others]}"
    return list(v.result(invariant).violations)


def add(h: History, *, etcd: tuple[EtcdEvent, ...] = (), agents: tuple[AgentEvent, ...] = (), **kw: Any) -> History:
    return dataclasses.replace(h, etcd=tuple(sorted(h.etcd + etcd, key=lambda e: e.rev)),
                               agents=tuple(sorted(h.agents + agents, key=lambda e: e.mono)), **kw)


# ---------------------------------------------------------------------------
# A cross-AZ (two-phase) gang: owner a, rank 0 in a, rank 1 in b


def xgang_value(gid: str, state: str, inc: int = 1, placement: tuple[tuple[str, str, int], ...] = (),
                members: int = 2) -> dict[str, Any]:
    v = gang_value(gid, state, members, inc, "a")
    v["spec"]["topology"] = {"allow_cross_az": True}
    v["placement"] = [{"rank": r, "az": az, "node": node, "gpus": [gpu], "nics": []}
                      for r, (az, node, gpu) in enumerate(placement)]
    return v


XPLAN = (("a", "a-n001", 4), ("b", "b-n000", 0))


def xgang(gid: str, rev: int, t: float, state: str, inc: int = 1,
          placement: tuple[tuple[str, str, int], ...] = XPLAN) -> EtcdEvent:
    return EtcdEvent("put", f"gangs/{gid}", rev, T0 + t, value=xgang_value(gid, state, inc, placement))


def hold(gid: str, rev: int, t: float, az: str, status: str, inc: int = 1) -> EtcdEvent:
    node, gpu = {"a": ("a-n001", 4), "b": ("b-n000", 0)}[az]
    e = reservation(gid, rev, t, epoch={"a": 5, "b": 6}[az], inc=inc, status=status, az=az, nodes={node: [gpu]})
    e.value.update(two_phase=True, owner_az="a", priority=0, submitted_at=1.0)
    return e


def decision(gid: str, inc: int, rev: int, t: float, outcome: str, by: str = "a") -> EtcdEvent:
    return EtcdEvent("put", f"decisions/{gid}/{inc}", rev, T0 + t, value={"outcome": outcome, "by": by, "reason": ""})


def xaz_events(**replace: EtcdEvent | None) -> tuple[EtcdEvent, ...]:
    """The two-phase happy path of x1 by name; ``replace`` swaps (or drops, with None) one step."""
    steps = {
        "leader_b": leader("b", 6, 0.1, "coord-b1"),
        "pending": xgang("x1", 40, 5.0, "PENDING", placement=()),
        "attempt": xgang("x1", 41, 5.1, "RESERVING"),
        "prep_a": hold("x1", 42, 5.2, "a", "PREPARED"),
        "prep_b": hold("x1", 43, 5.2, "b", "PREPARED"),
        "decide": decision("x1", 1, 44, 5.3, "COMMIT"),
        "commit_a": hold("x1", 45, 5.4, "a", "COMMITTED"),
        "commit_b": hold("x1", 46, 5.4, "b", "COMMITTED"),
        "reserved": xgang("x1", 47, 5.5, "RESERVED"),
        "starting": xgang("x1", 48, 5.6, "STARTING"),
        "running": xgang("x1", 49, 6.2, "RUNNING"),
        "done": xgang("x1", 51, 8.1, "SUCCEEDED"),
        "rel_a": released("x1", 52, 8.2, "a"),
        "rel_b": released("x1", 53, 8.2, "b"),
    }
    steps.update(replace)
    return tuple(e for e in steps.values() if e is not None)


def cross_az(etcd: tuple[EtcdEvent, ...] | None = None, agents: tuple[AgentEvent, ...] | None = None,
             final_gang: dict[str, Any] | None = None,
             final_res: dict[str, dict[str, Any]] | None = None) -> History:
    """healthy() plus the cross-AZ gang x1 (2 members: rank 0 on a-n001 in AZ a,
    rank 1 on b-n000 in AZ b), reserved two-phase and run to success."""
    if agents is None:
        agents = (started("x1#1/r0", 6.0, gpus=(4,), node="a-n001"),
                  started("x1#1/r1", 6.0, gpus=(0,), node="b-n000", epoch=6, az="b"),
                  exited("x1#1/r0", 8.0, node="a-n001"), exited("x1#1/r1", 8.0, node="b-n000", epoch=6, az="b"))
    h = add(healthy(), etcd=etcd if etcd is not None else xaz_events(), agents=agents)
    call = ClientCall("submit_cross_az", "x1-k", "x1", "a", "10.0.0.1:7070", 1, T0 + 4.9, T0 + 5.0, "OK",
                      gang_id="x1")
    out = ClientOutcome("submit_cross_az", "x1-k", "x1", "a", True, "x1", T0 + 4.9, T0 + 5.0, "OK", 1)
    fin = final({**h.final.gangs, "x1": final_gang or xgang_value("x1", "SUCCEEDED", placement=XPLAN)},  # type: ignore[union-attr]
                final_res, leaders=("a", "b"))
    kvs = dict(fin.kvs)
    kvs.update({e.key: e.value for e in h.etcd if e.key.startswith("decisions/") and e.kind == "put"})
    return dataclasses.replace(h, calls=h.calls + (call,), outcomes=h.outcomes + (out,),
                               final=dataclasses.replace(fin, kvs=kvs))


# ---------------------------------------------------------------------------
# The baseline


def test_a_healthy_history_passes_every_invariant() -> None:
    v = checker.check(healthy())
    assert v.ok, [x.render() for x in v.violations]
    assert all(r.checked > 0 for r in v.results if r.number not in (5, 8))  # 8: no cross-AZ gang here
    assert v.measurements["admission_after_heal_s"] == {"a": 1.5}


# ---------------------------------------------------------------------------
# 1. all-or-nothing


def _two_member_gang(second_start: float | None, settle_live_both: bool = False) -> History:
    etcd = (gang("g2", 30, 5.0, "RESERVED", members=2), reservation("g2", 30, 5.0),
            gang("g2", 31, 6.0, "RUNNING", members=2))
    agents = [started("g2#1/r0", 5.5, gpus=(2,))]
    if second_start is not None:
        agents.append(started("g2#1/r1", second_start, gpus=(3,), node="a-n001"))
    h = add(healthy(), etcd=etcd, agents=tuple(agents))
    fin = dict(h.final.gangs)  # type: ignore[union-attr]
    fin["g2"] = gang_value("g2", "RUNNING", members=2)
    res = {"a/g2": {"status": "COMMITTED", "incarnation": 1, "epoch": 5}}
    return dataclasses.replace(h, final=final(fin, res))


def test_all_or_nothing_holds_when_every_rank_started_before_running() -> None:
    assert violations(_two_member_gang(5.8), 1) == []


def test_all_or_nothing_flags_running_written_before_a_rank_started() -> None:
    found = violations(_two_member_gang(7.0), 1)
    assert any("written RUNNING" in v.what and "[1]" in v.what for v in found)


def test_all_or_nothing_flags_a_half_running_gang_at_settle_time() -> None:
    h = _two_member_gang(5.8)
    h = add(h, agents=(exited("g2#1/r1", 9.0, node="a-n001", code=-9, phase="STOPPED"),))
    found = violations(h, 1)
    assert any("1 of 2 members running at settle time" in v.what for v in found)
    assert any("RUNNING in the final state but ranks [1]" in v.what for v in found)


# ---------------------------------------------------------------------------
# 2. no GPU held twice


def test_no_double_booking_allows_back_to_back_members_on_one_gpu() -> None:
    h = add(healthy(), etcd=(reservation("g3", 40, 4.3), gang("g3", 41, 4.6, "RUNNING"),
                             gang("g3", 42, 8.0, "SUCCEEDED"), released("g3", 43, 8.0)),
            agents=(started("g3#1/r0", 4.5, gpus=(0,)), exited("g3#1/r0", 7.9)))
    h = dataclasses.replace(h, final=final({**h.final.gangs, "g3": gang_value("g3", "SUCCEEDED")}))  # type: ignore[union-attr]
    assert violations(h, 2) == []


def test_no_double_booking_flags_two_members_on_one_gpu_at_once() -> None:
    h = add(healthy(), etcd=(reservation("g3", 40, 2.5), gang("g3", 41, 3.1, "RUNNING"),
                             gang("g3", 42, 8.0, "SUCCEEDED"), released("g3", 43, 8.0)),
            agents=(started("g3#1/r0", 3.0, gpus=(1, 2)), exited("g3#1/r0", 7.9)))
    h = dataclasses.replace(h, final=final({**h.final.gangs, "g3": gang_value("g3", "SUCCEEDED")}))  # type: ignore[union-attr]
    found = violations(h, 2)
    assert len(found) == 1 and "GPU 1 of a-n000 held by g1#1/r0 and g3#1/r0" in found[0].what
    assert len(found[0].evidence) == 2


def test_no_double_booking_flags_a_member_that_outlives_its_released_reservation() -> None:
    # What a missing self-fence looks like: the coordinator gave up on the node
    # and released the devices, the member kept running for seconds.
    h = healthy()
    agents = tuple(e for e in h.agents if e.key != "g1#1/r0" or e.event != "member_exited")
    h = dataclasses.replace(h, agents=agents + (exited("g1#1/r0", 9.0, code=-15, phase="STOPPED"),))
    found = violations(h, 2)
    assert len(found) == 1 and "after its reservation was released" in found[0].what
    assert "4.80s" in found[0].what


def test_no_double_booking_flags_a_member_started_after_its_release() -> None:
    h = add(healthy(), agents=(started("g1#1/r0", 8.0, gpus=(4,), node="a-n001"),
                               exited("g1#1/r0", 8.5, node="a-n001")))
    found = violations(h, 2)
    assert any("started on a-n001 after its reservation was released" in v.what for v in found)


def test_no_double_booking_flags_two_reservations_of_one_gpu_in_etcd() -> None:
    # e.g. a reservation txn that timed out but committed, forgotten by the
    # leader's ledger, whose GPUs were then reserved again.
    h = add(healthy(), etcd=(reservation("g7", 40, 5.0, nodes={"a-n000": [2, 3]}),
                             reservation("g8", 41, 6.0, nodes={"a-n000": [3, 4]}),
                             released("g7", 42, 7.0), released("g8", 43, 7.0)))
    found = violations(h, 2)
    assert len(found) == 1 and "reservations of g8 and g7 on the same GPUs" in found[0].what
    assert "a: a-n000 gpu 3 held by g7 and g8" in found[0].evidence


def test_no_double_booking_allows_reusing_gpus_after_a_release_in_etcd() -> None:
    h = add(healthy(), etcd=(reservation("g7", 40, 5.0, nodes={"a-n000": [2, 3]}), released("g7", 41, 6.0),
                             reservation("g8", 42, 6.5, nodes={"a-n000": [3, 4]}), released("g8", 43, 7.0)))
    assert violations(h, 2) == []


# ---------------------------------------------------------------------------
# 3. one incarnation at a time


def test_one_incarnation_flags_two_incarnations_running_at_once() -> None:
    h = add(healthy(), etcd=(reservation("g1", 16, 3.0, inc=2), released("g1", 17, 6.0)),
            agents=(started("g1#2/r0", 3.5, gpus=(5,), node="a-n001"), exited("g1#2/r0", 5.5, node="a-n001")))
    found = violations(h, 3)
    assert len(found) == 1 and "incarnations 1 and 2 running at once" in found[0].what


def test_one_incarnation_flags_one_member_running_twice() -> None:
    h = add(healthy(), agents=(started("g1#1/r0", 3.0, gpus=(5,), node="a-n001"),
                               exited("g1#1/r0", 3.9, node="a-n001")))
    assert any("g1#1/r0 running twice" in v.what for v in violations(h, 3))


def test_one_incarnation_allows_a_restart_after_the_old_one_is_gone() -> None:
    h = add(healthy(), etcd=(reservation("g1", 16, 4.5, inc=2), released("g1", 17, 6.0)),
            agents=(started("g1#2/r0", 4.6, gpus=(5,)), exited("g1#2/r0", 5.5)))
    assert violations(h, 3) == []


# ---------------------------------------------------------------------------
# 4. no acknowledged submission lost


def test_acked_not_lost_flags_an_acknowledged_gang_missing_from_etcd() -> None:
    c, o = ack("g9", 3.0)
    h = dataclasses.replace(healthy(), calls=healthy().calls + (c,), outcomes=healthy().outcomes + (o,))
    found = violations(h, 4)
    assert len(found) == 1 and "acknowledged gang g9" in found[0].what


def test_acked_not_lost_flags_one_key_acknowledged_as_two_gangs() -> None:
    c, o = ack("g1-dup", 3.0, key="g1-k")
    h = healthy()
    fin = final({**h.final.gangs, "g1-dup": gang_value("g1-dup", "FAILED", key="g1-k")})  # type: ignore[union-attr]
    h = dataclasses.replace(h, calls=h.calls + (c,), outcomes=h.outcomes + (o,), final=fin)
    found = violations(h, 4)
    assert any("acknowledged as 2 different gangs" in v.what for v in found)
    assert any("has 2 gangs in etcd" in v.what for v in found)


def test_acked_not_lost_accepts_an_acknowledged_cross_az_gang_that_exists() -> None:
    assert violations(cross_az(), 4) == []


def test_acked_not_lost_flags_an_acknowledged_cross_az_gang_missing_from_etcd() -> None:
    h = cross_az()
    fin = final({g: v for g, v in h.final.gangs.items() if g != "x1"}, leaders=("a", "b"))  # type: ignore[union-attr]
    found = checker.check(dataclasses.replace(h, final=fin)).result(4).violations
    assert any("acknowledged cross-AZ gang x1" in v.what and "not in etcd" in v.what for v in found)


def test_acked_not_lost_flags_a_cross_az_submission_refused_unimplemented() -> None:
    # Before two-phase reservations this was the expected answer; now it is a regression.
    o = ClientOutcome("submit_cross_az", "x-k", "x", "a", False, "", T0, T0 + 1, "UNIMPLEMENTED", 1)
    found = violations(dataclasses.replace(healthy(), outcomes=healthy().outcomes + (o,)), 4)
    assert len(found) == 1 and "cross-AZ submission x refused UNIMPLEMENTED" in found[0].what


def test_acked_not_lost_ignores_a_cross_az_submission_that_ran_out_of_retries() -> None:
    o = ClientOutcome("submit_cross_az", "x-k", "x", "a", False, "", T0, T0 + 31, "UNAVAILABLE", 9)
    assert violations(dataclasses.replace(healthy(), outcomes=healthy().outcomes + (o,)), 4) == []


# ---------------------------------------------------------------------------
# 5. nothing stranded


def test_nothing_stranded_flags_a_reservation_left_for_a_failed_gang() -> None:
    h = healthy()
    fin = final(dict(h.final.gangs), {"a/g1": {"status": "COMMITTED", "incarnation": 1}})  # type: ignore[union-attr]
    found = violations(dataclasses.replace(h, final=fin), 5)
    assert len(found) == 1 and "reservation a/g1 (COMMITTED) left for a SUCCEEDED gang" in found[0].what


def test_nothing_stranded_counts_a_releasing_reservation_after_settle() -> None:
    h = _two_member_gang(5.8)
    fin = final(dict(h.final.gangs), {"a/g2": {"status": "RELEASING", "incarnation": 1}})  # type: ignore[union-attr]
    assert any("(RELEASING) left for a RUNNING gang" in v.what for v in violations(dataclasses.replace(h, final=fin), 5))


def test_nothing_stranded_flags_a_member_running_for_a_finished_gang() -> None:
    h = healthy()
    agents = tuple(e for e in h.agents if not (e.key == "p-a#1/r0" and e.event == "member_exited"))
    h = dataclasses.replace(h, agents=agents)
    found = checker.check(h).result(5).violations
    assert any("p-a#1/r0 still running at settle time for a SUCCEEDED gang" in v.what for v in found)


# ---------------------------------------------------------------------------
# 6. no effect from a superseded epoch


def test_epochs_flag_a_reservation_written_under_a_superseded_epoch() -> None:
    h = add(healthy(), etcd=(leader_gone("a", 25, 24.0), leader("a", 26, 24.5, "coord-a2"),
                             reservation("g5", 27, 25.0, epoch=5), released("g5", 28, 25.5)))
    found = violations(h, 6)
    assert len(found) == 1
    assert "written at rev 27 by epoch 5 while a had epoch 26 (coord-a2)" in found[0].what


def test_epochs_flag_a_member_started_long_after_its_epoch_ended() -> None:
    h = add(healthy(), etcd=(leader_gone("a", 25, 24.0), leader("a", 26, 24.5, "coord-a2"),
                             reservation("g6", 27, 24.6, epoch=26), gang("g6", 28, 29.1, "RUNNING"),
                             gang("g6", 29, 31.0, "FAILED"), released("g6", 30, 31.0)),
            agents=(started("g6#1/r0", 29.0, gpus=(6,), epoch=5), exited("g6#1/r0", 30.0)))
    h = dataclasses.replace(h, final=final({**h.final.gangs, "g6": gang_value("g6", "FAILED")}))  # type: ignore[union-attr]
    found = violations(h, 6)
    assert len(found) == 1 and "under epoch 5 5.00s after that leadership ended" in found[0].what


def test_epochs_allow_a_start_inside_the_token_window() -> None:
    # The agent read the leader key (epoch 5) just before the leadership ended;
    # its start is recorded after: inside the documented window, no violation.
    h = add(healthy(), etcd=(leader_gone("a", 25, 24.0), leader("a", 26, 24.5, "coord-a2"),
                             reservation("g6", 19, 19.0, epoch=5), gang("g6", 27, 24.6, "RUNNING"),
                             gang("g6", 29, 31.0, "SUCCEEDED"), released("g6", 30, 31.0)),
            agents=(started("g6#1/r0", 24.5, gpus=(6,), epoch=5), exited("g6#1/r0", 30.0)))
    h = dataclasses.replace(h, final=final({**h.final.gangs, "g6": gang_value("g6", "SUCCEEDED")}))  # type: ignore[union-attr]
    assert violations(h, 6) == []


def test_epochs_flag_a_member_started_under_an_epoch_that_never_led() -> None:
    h = add(healthy(), agents=(started("g1#1/r0", 2.0, gpus=(6,), epoch=77, node="a-n001"),
                               exited("g1#1/r0", 3.0, node="a-n001")))
    found = checker.check(h).result(6).violations
    assert any("under epoch 77, which never led a" in v.what for v in found)


# ---------------------------------------------------------------------------
# 7. leader and admission resume after healing


def test_recovery_flags_admission_that_resumes_too_late() -> None:
    h = healthy()
    etcd = tuple(e for e in h.etcd if not (e.key == "gangs/p-a" and e.value["state"] in ("RUNNING", "SUCCEEDED")))
    etcd += (gang("p-a", 22, 20.0 + h.params.recovery_bound_s + 5, "RUNNING"),)
    found = violations(dataclasses.replace(h, etcd=tuple(sorted(etcd, key=lambda e: e.rev))), 7)
    assert len(found) == 1 and "admission in a did not resume" in found[0].what


def test_recovery_flags_an_az_without_a_leader_after_healing() -> None:
    h = add(healthy(), etcd=(leader_gone("a", 19, 10.0),))
    h = dataclasses.replace(h, final=final(dict(h.final.gangs), leaders=()))  # type: ignore[union-attr]
    found = checker.check(h).result(7).violations
    assert any("a had no leader within" in v.what for v in found)
    assert any("no leader in the final state" in v.what for v in found)


def test_recovery_flags_a_probe_that_was_never_acknowledged() -> None:
    o = ClientOutcome("submit", "p-a-k", "p-a", "a", False, "", T0 + 21, T0 + 50, "UNAVAILABLE", 40, probe=True)
    h = dataclasses.replace(healthy(), outcomes=(healthy().outcomes[0], o))
    assert any("never acknowledged" in v.what for v in checker.check(h).result(7).violations)


def test_recovery_flags_a_gang_pending_long_past_its_admission_timeout() -> None:
    stuck = gang_value("g9", "PENDING")
    stuck.update(submitted_at=5000.0, spec={**stuck["spec"], "policy": {"admission_timeout_s": 30}})
    h = healthy()
    fin = dataclasses.replace(final({**h.final.gangs, "g9": stuck}), wall=5000.0 + 30 + 25)  # type: ignore[union-attr]
    found = violations(dataclasses.replace(h, final=fin), 7)
    assert len(found) == 1 and "g9 still PENDING 25s past its admission timeout" in found[0].what
    ok = dataclasses.replace(final({**h.final.gangs, "g9": stuck}), wall=5000.0 + 30 + 5)  # type: ignore[union-attr]
    assert violations(dataclasses.replace(h, final=ok), 7) == []


def test_recovery_bound_is_stated_from_the_timings() -> None:
    assert recovery_bound(TIMINGS) == 3 * 2 + 4.0 + 10.0
    assert recovery_bound(TIMINGS, slack_s=0) == 10.0


# ---------------------------------------------------------------------------
# Cross-AZ gangs under invariants 1-7


def test_a_cross_az_gang_passes_every_invariant() -> None:
    v = checker.check(cross_az())
    assert v.ok, [x.render() for x in v.violations]
    assert v.result(8).checked == 3  # one decision, two COMMITTED two-phase records
    assert v.measurements["incarnations"] == 3


def test_all_or_nothing_counts_ranks_across_az_agents() -> None:
    # rank 1 runs in AZ b and starts after the owner wrote RUNNING: a violation,
    # although every member of AZ a had started.
    late = (started("x1#1/r0", 6.0, gpus=(4,), node="a-n001"),
            started("x1#1/r1", 6.5, gpus=(0,), node="b-n000", epoch=6, az="b"),
            exited("x1#1/r0", 8.0, node="a-n001"), exited("x1#1/r1", 8.0, node="b-n000", epoch=6, az="b"))
    found = violations(cross_az(agents=late), 1)
    assert len(found) == 1 and "gang x1 written RUNNING (rev 49) before ranks [1]" in found[0].what
    assert any("b-n000" in e for e in found[0].evidence)


def test_all_or_nothing_flags_a_cross_az_gang_half_running_at_settle_time() -> None:
    # x1 RUNNING at the end; the member in AZ b exited, the one in AZ a runs on.
    agents = (started("x1#1/r0", 6.0, gpus=(4,), node="a-n001"),
              started("x1#1/r1", 6.0, gpus=(0,), node="b-n000", epoch=6, az="b"),
              exited("x1#1/r1", 8.0, node="b-n000", epoch=6, az="b", code=-9, phase="STOPPED"))
    res = {"a/x1": hold("x1", 45, 0, "a", "COMMITTED").value, "b/x1": hold("x1", 46, 0, "b", "COMMITTED").value}
    h = cross_az(etcd=xaz_events(done=None, rel_a=None, rel_b=None), agents=agents,
                 final_gang=xgang_value("x1", "RUNNING", placement=XPLAN), final_res=res)
    found = violations(h, 1)
    assert any("x1#1 has 1 of 2 members running at settle time" in v.what for v in found)
    assert any("x1 is RUNNING in the final state but ranks [1]" in v.what for v in found)


def test_one_incarnation_spans_the_agents_of_every_az() -> None:
    # incarnation 2's member in AZ b starts while incarnation 1's runs in AZ a.
    agents = (started("x1#1/r0", 6.0, gpus=(4,), node="a-n001"),
              started("x1#1/r1", 6.0, gpus=(0,), node="b-n000", epoch=6, az="b"),
              exited("x1#1/r1", 6.5, node="b-n000", epoch=6, az="b", code=1, phase="FAILED"),
              started("x1#2/r1", 7.0, gpus=(1,), node="b-n001", epoch=6, az="b"),
              exited("x1#1/r0", 7.5, node="a-n001"), exited("x1#2/r1", 8.0, node="b-n001", epoch=6, az="b"))
    found = checker.check(cross_az(agents=agents)).result(3).violations
    assert any("gang x1: incarnations 1 and 2 running at once" in v.what for v in found)


def _preempted(abort_first: bool) -> History:
    """y1 (younger, cross-AZ) holds b-n000 GPU 0 PREPARED; x1 (older) preempts it.
    With ``abort_first`` y1's ABORT decision is written before x1's hold, as the
    protocol requires; without, x1's hold lands on a live undecided hold."""
    y_prep = hold("y1", 38, 4.9, "b", "PREPARED")
    y_prep.value["gang"] = "y1"
    y_abort = decision("y1", 1, 39 if abort_first else 50, 4.95 if abort_first else 6.9, "ABORT", by="b")
    etcd = tuple(sorted(xaz_events() + (xgang("y1", 37, 4.8, "RESERVING"), y_prep, y_abort,
                                        xgang("y1", 54, 9.0, "FAILED"), released("y1", 55, 9.0, "b")),
                        key=lambda e: e.rev))
    h = cross_az(etcd=etcd)
    fin = dict(h.final.kvs)  # type: ignore[union-attr]
    fin["gangs/y1"] = xgang_value("y1", "FAILED", placement=XPLAN)
    fin["decisions/y1/1"] = y_abort.value
    return dataclasses.replace(h, final=dataclasses.replace(h.final, kvs=fin))  # type: ignore[arg-type]


def test_no_double_booking_ignores_a_prepared_hold_already_decided_abort() -> None:
    # The decision key is the commit point: an ABORTed PREPARED hold holds
    # nothing, even before its ReleaseHold delete lands.
    assert violations(_preempted(abort_first=True), 2) == []


def test_no_double_booking_flags_a_prepared_hold_on_a_live_undecided_hold() -> None:
    found = violations(_preempted(abort_first=False), 2)
    assert found and all("etcd holds reservations of x1 and y1 on the same GPUs" in v.what for v in found)
    assert "reservations/b/x1 written at rev 43" in found[0].evidence[0]


# ---------------------------------------------------------------------------
# 5. two-phase holds at settle time


def test_nothing_stranded_accepts_a_prepared_hold_of_a_gang_still_reserving() -> None:
    res = {"b/x1": hold("x1", 43, 0, "b", "PREPARED").value}
    h = cross_az(etcd=xaz_events(decide=None, commit_a=None, commit_b=None, reserved=None, starting=None,
                                 running=None, done=None, rel_a=None, rel_b=None, prep_a=None),
                 agents=(), final_gang=xgang_value("x1", "RESERVING", placement=XPLAN), final_res=res)
    assert violations(h, 5) == []


def test_nothing_stranded_flags_a_prepared_hold_left_for_a_finished_gang() -> None:
    res = {"b/x1": hold("x1", 43, 0, "b", "PREPARED").value}
    found = violations(cross_az(final_res=res), 5)
    assert len(found) == 1 and "PREPARED hold b/x1#1 left for a SUCCEEDED gang" in found[0].what


def test_nothing_stranded_flags_a_prepared_hold_of_an_aborted_incarnation() -> None:
    # The gang is RESERVING incarnation 1 again on paper, but 1 was decided ABORT:
    # the hold should have been released.
    res = {"b/x1": hold("x1", 43, 0, "b", "PREPARED").value}
    h = cross_az(etcd=xaz_events(decide=decision("x1", 1, 44, 5.3, "ABORT"), commit_a=None, commit_b=None,
                                 reserved=None, starting=None, running=None, done=None, rel_a=None, rel_b=None),
                 agents=(), final_gang=xgang_value("x1", "RESERVING", placement=XPLAN), final_res=res)
    found = violations(h, 5)
    assert len(found) == 1 and "PREPARED hold b/x1#1 left for a RESERVING gang" in found[0].what
    assert "decision ABORT" in found[0].what


def test_nothing_stranded_flags_a_prepared_hold_of_an_older_incarnation() -> None:
    res = {"b/x1": hold("x1", 43, 0, "b", "PREPARED", inc=1).value}
    h = cross_az(etcd=xaz_events(decide=None, commit_a=None, commit_b=None, reserved=None, starting=None,
                                 running=None, done=None, rel_a=None, rel_b=None),
                 agents=(), final_gang=xgang_value("x1", "RESERVING", inc=2, placement=XPLAN), final_res=res)
    assert any("PREPARED hold b/x1#1" in v.what for v in violations(h, 5))


def test_nothing_stranded_accepts_committed_holds_of_a_reserving_gang_after_commit() -> None:
    res = {"a/x1": hold("x1", 45, 0, "a", "COMMITTED").value, "b/x1": hold("x1", 46, 0, "b", "COMMITTED").value}
    h = cross_az(etcd=xaz_events(reserved=None, starting=None, running=None, done=None, rel_a=None, rel_b=None),
                 agents=(), final_gang=xgang_value("x1", "RESERVING", placement=XPLAN), final_res=res)
    assert violations(h, 5) == []


def test_nothing_stranded_flags_a_releasing_two_phase_hold_after_settle() -> None:
    res = {"b/x1": hold("x1", 46, 0, "b", "RELEASING").value}
    found = violations(cross_az(final_res=res), 5)
    assert len(found) == 1 and "reservation b/x1 (RELEASING) left for a SUCCEEDED gang" in found[0].what


# ---------------------------------------------------------------------------
# 8. two-phase decisions


def test_two_phase_accepts_an_abort_then_a_commit_of_the_next_incarnation() -> None:
    etcd = xaz_events(decide=decision("x1", 1, 44, 5.3, "ABORT", by="b"),
                      commit_a=released("x1", 45, 5.4, "a"), commit_b=released("x1", 46, 5.4, "b"),
                      reserved=None, starting=None, running=None, done=None, rel_a=None, rel_b=None)
    etcd += (xgang("x1", 60, 9.0, "RESERVING", inc=2), hold("x1", 61, 9.1, "a", "PREPARED", inc=2),
             hold("x1", 62, 9.1, "b", "PREPARED", inc=2), decision("x1", 2, 63, 9.2, "COMMIT"),
             hold("x1", 64, 9.3, "a", "COMMITTED", inc=2), hold("x1", 65, 9.3, "b", "COMMITTED", inc=2),
             xgang("x1", 66, 9.4, "RESERVED", inc=2), xgang("x1", 67, 10.1, "RUNNING", inc=2),
             xgang("x1", 68, 12.1, "SUCCEEDED", inc=2), released("x1", 69, 12.2, "a"), released("x1", 70, 12.2, "b"))
    agents = (started("x1#2/r0", 10.0, gpus=(4,), node="a-n001"),
              started("x1#2/r1", 10.0, gpus=(0,), node="b-n000", epoch=6, az="b"),
              exited("x1#2/r0", 12.0, node="a-n001"), exited("x1#2/r1", 12.0, node="b-n000", epoch=6, az="b"))
    h = cross_az(etcd=etcd, agents=agents, final_gang=xgang_value("x1", "SUCCEEDED", inc=2, placement=XPLAN))
    v = checker.check(h)
    assert v.ok, [x.render() for x in v.violations]
    assert v.result(8).checked == 4


def test_two_phase_flags_a_decision_written_twice() -> None:
    h = cross_az(etcd=xaz_events() + (decision("x1", 1, 50, 7.0, "ABORT", by="b"),))
    found = violations(h, 8)
    assert len(found) == 1 and "decision x1#1 written twice (rev 44: COMMIT, rev 50: ABORT)" in found[0].what


def test_two_phase_flags_a_decision_rewritten_with_the_same_outcome() -> None:
    h = cross_az(etcd=xaz_events() + (decision("x1", 1, 50, 7.0, "COMMIT", by="b"),))
    assert any("written twice" in v.what for v in violations(h, 8))


def test_two_phase_flags_a_deleted_decision() -> None:
    h = cross_az(etcd=xaz_events() + (EtcdEvent("delete", "decisions/x1/1", 54, T0 + 9.0),))
    found = violations(h, 8)
    assert len(found) == 1 and "decision x1#1 deleted at rev 54" in found[0].what


def test_two_phase_flags_a_commit_before_every_participant_prepared() -> None:
    # b's PREPARED lands after the COMMIT decision (rev 44): b never voted on a durable hold.
    h = cross_az(etcd=tuple(sorted(xaz_events(prep_b=None, decide=decision("x1", 1, 43, 5.25, "COMMIT")) +
                                   (hold("x1", 44, 5.3, "b", "PREPARED"),), key=lambda e: e.rev)))
    found = violations(h, 8)
    assert len(found) == 1
    assert "COMMIT of x1#1 at rev 43 although b held no PREPARED record of incarnation 1 (plan: a, b)" in found[0].what
    assert any("reservations/b/x1: absent" in e for e in found[0].evidence)


def test_two_phase_flags_a_commit_next_to_a_hold_of_another_incarnation() -> None:
    h = cross_az(etcd=xaz_events(prep_b=hold("x1", 43, 5.2, "b", "PREPARED", inc=0)))
    found = violations(h, 8)
    assert any("b held no PREPARED record of incarnation 1" in v.what for v in found)
    assert any("PREPARED incarnation 0 (rev 43)" in e for v in found for e in v.evidence)


def test_two_phase_flags_a_committed_record_next_to_an_abort() -> None:
    h = cross_az(etcd=xaz_events(decide=decision("x1", 1, 44, 5.3, "ABORT", by="b"), commit_a=None,
                                 reserved=None, starting=None, running=None, done=None,
                                 rel_a=released("x1", 52, 8.2, "a")),
                 agents=(), final_gang=xgang_value("x1", "FAILED", placement=XPLAN))
    found = violations(h, 8)
    assert len(found) == 1
    assert "reservation b/x1#1 written COMMITTED at rev 46 while the decision of incarnation 1 is ABORT" in found[0].what


def test_two_phase_flags_a_committed_record_before_any_decision() -> None:
    etcd = tuple(sorted(xaz_events(decide=decision("x1", 1, 50, 7.0, "COMMIT"),
                                   commit_b=hold("x1", 51, 7.1, "b", "COMMITTED"),
                                   done=xgang("x1", 54, 8.1, "SUCCEEDED"),
                                   rel_a=released("x1", 55, 8.2, "a"), rel_b=released("x1", 56, 8.2, "b")),
                        key=lambda e: e.rev))
    found = violations(cross_az(etcd=etcd), 8)
    assert len(found) == 1 and "reservation a/x1#1 written COMMITTED at rev 45 while the decision of " \
                               "incarnation 1 is not yet made" in found[0].what


def test_two_phase_flags_a_commit_without_a_recorded_plan() -> None:
    h = cross_az(etcd=xaz_events(attempt=None))
    found = violations(h, 8)
    assert len(found) == 1 and "COMMIT of x1#1 at rev 44 with no recorded plan" in found[0].what


# ---------------------------------------------------------------------------
# Derived views and loading


def test_member_intervals_pair_starts_and_exits_per_node() -> None:
    ivs = member_intervals([started("g#1/r0", 1.0), started("g#1/r1", 1.0, node="n2"),
                            exited("g#1/r0", 3.0), exited("unknown", 4.0)])
    assert [(i.key, i.node, i.end) for i in ivs] == [("g#1/r0", "a-n000", T0 + 3.0), ("g#1/r1", "n2", INF)]


def test_leader_terms_follow_the_key_by_revision() -> None:
    terms = leader_terms([leader("a", 5, 0.0), leader_gone("a", 9, 3.0), leader("a", 12, 4.0, "coord-a2")])
    assert [(t.epoch, t.coordinator, t.end_rev) for t in terms["a"]] == [(5, "coord-a1", 9), (12, "coord-a2", None)]


def test_load_reads_a_run_directory(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"azs": ["a"], "started_at": T0, "settle_at": T0 + 9,
                                                   "healed_at": None, "timings": TIMINGS}))
    (tmp_path / "events.jsonl").write_text(
        json.dumps({"src": "fault", "mono": T0 + 1, "name": "f", "action": "inject"}) + "\n"
        + json.dumps({"src": "note", "mono": T0 + 1, "name": "f", "detail": "target x"}) + "\n")
    (tmp_path / "agents-a.jsonl").write_text(
        json.dumps({"event": "member_started", "node": "a-n000", "az": "a", "mono": T0 + 2, "wall": 1,
                    "key": "g#1/r0", "epoch": 5, "gpus": [0]}) + "\n{torn line")
    (tmp_path / "etcd.jsonl").write_text(json.dumps({"src": "etcd", "kind": "put", "key": "leader/a", "rev": 5,
                                                     "create_rev": 5, "value": {"id": "c"}, "mono": T0}) + "\n")
    (tmp_path / "workload.jsonl").write_text(json.dumps(
        {"kind": "outcome", "op": "submit", "key": "k", "name": "g", "az": "a", "acked": True, "gang_id": "g",
         "first_start": T0, "end": T0 + 1, "code": "OK", "attempts": 1, "probe": False}) + "\n")
    (tmp_path / "final.json").write_text(json.dumps({"revision": 9, "mono": T0 + 9, "kvs": [
        {"key": "gangs/g", "value": {"state": "SUCCEEDED"}, "create_rev": 6, "mod_rev": 8, "lease": 0}]}))
    h = load(tmp_path)
    assert [f.action for f in h.faults] == ["inject", "note"]
    assert len(h.agents) == 1 and h.agents[0].gpus == (0,)
    assert h.outcomes[0].acked and h.final is not None and "g" in h.final.gangs
    assert leader_terms(h.etcd)["a"][0].coordinator == "c"


# ---------------------------------------------------------------------------
# 9. no member outlives its gang's end (stop_grace_s + fence_after_s + replace_margin_s = 6 s here)


def _cancelled_at_3(member_end: float | None, started_at: float = 2.0) -> History:
    """g1 cancelled (seen at +3.0s) while its member runs; the member ends at
    ``member_end`` (None: no exit recorded) and the reservation goes after it."""
    h = healthy()
    gone = 3.0 + 10 if member_end is None else member_end + 0.1
    # a member started after the cancel never made its gang RUNNING
    dropped = (13, 14, 15) if started_at > 3.0 else (14, 15)
    etcd = tuple(e for e in h.etcd if not (e.key in ("gangs/g1", "reservations/a/g1") and e.rev in dropped))
    etcd += (gang("g1", 14, 3.0, "CANCELLED"), released("g1", 15, gone))
    agents = tuple(e for e in h.agents if not e.key.startswith("g1#"))
    agents += (started("g1#1/r0", started_at),)
    if member_end is not None:
        agents += (exited("g1#1/r0", member_end, code=-15, phase="STOPPED"),)
    fin = final({"g1": gang_value("g1", "CANCELLED"), "p-a": gang_value("p-a", "SUCCEEDED")})
    return dataclasses.replace(h, etcd=tuple(sorted(etcd, key=lambda e: e.rev)),
                               agents=tuple(sorted(agents, key=lambda e: e.mono)), final=fin)


def test_terminal_stops_accepts_a_member_gone_just_inside_the_bound() -> None:
    assert checker.stop_bound(TIMINGS) == 6.0
    h = _cancelled_at_3(3.0 + 5.95)
    assert violations(h, 9) == []
    v = checker.check(h)
    assert v.result(9).checked == 2  # g1 and the probe gang
    assert v.measurements["terminal_stops"]["longest_after_terminal_write_s"] == pytest.approx(5.95)


def test_terminal_stops_flags_a_member_that_outlives_the_bound() -> None:
    found = violations(_cancelled_at_3(3.0 + 6.05), 9)
    assert len(found) == 1
    assert found[0].what == ("g1#1/r0 of CANCELLED gang g1 exited 6.05s after its terminal write (rev 14), past "
                             "stop_grace_s + fence_after_s + replace_margin_s = 6s")
    assert found[0].at == pytest.approx(T0 + 9.0)


def test_terminal_stops_holds_a_member_started_after_the_cancel_to_the_same_bound() -> None:
    # the cancel raced the start: the member starts after the terminal write
    found = violations(_cancelled_at_3(3.0 + 7.0, started_at=3.5), 9)
    assert len(found) == 1 and "exited 7.00s after its terminal write" in found[0].what


def test_terminal_stops_flags_a_member_never_seen_to_exit() -> None:
    found = checker.check(_cancelled_at_3(None)).result(9).violations
    assert len(found) == 1 and "g1#1/r0 of CANCELLED gang g1 still running at settle time" in found[0].what


def test_terminal_stops_reads_the_bound_from_the_run_timings() -> None:
    h = _cancelled_at_3(3.0 + 6.05)
    longer = dataclasses.replace(h.params, timings={**TIMINGS, "stop_grace_s": 1.2})
    assert violations(dataclasses.replace(h, params=longer), 9) == []


def test_a_cancel_line_keeps_its_aim_and_trigger() -> None:
    line = {"kind": "outcome", "op": "cancel", "key": "g1", "name": "g1", "az": "a", "acked": True, "gang_id": "g1",
            "first_start": T0, "end": T0 + 0.1, "code": "OK", "attempts": 1, "aim": "restart", "trigger": "fault"}
    o = client_record(line)
    assert isinstance(o, ClientOutcome) and (o.aim, o.trigger) == ("restart", "fault")
    o = client_record({**line, "kind": "call", "target": "x", "attempt": 1, "start": T0, "aim": "admission"})
    assert isinstance(o, ClientCall) and o.aim == "admission"


@pytest.mark.parametrize("n", list(checker.INVARIANTS))
def test_every_invariant_is_reported_once(n: int) -> None:
    assert [r.number for r in checker.check(healthy()).results].count(n) == 1


# ---------------------------------------------------------------------------
# Retention: finished gangs collected by their owner (docs/etcd-keys.md)


def short_retention(h, retention_s: float = 0.5):
    """The run's timings with a retention short enough for these histories."""
    params = dataclasses.replace(h.params, timings={**h.params.timings, "gang_retention_s": retention_s})
    return dataclasses.replace(h, params=params)


def test_two_phase_accepts_decisions_deleted_with_their_finished_gang() -> None:
    collect = (EtcdEvent("delete", "gangs/x1", 60, T0 + 9.0), EtcdEvent("delete", "decisions/x1/1", 60, T0 + 9.0))
    h = short_retention(cross_az(etcd=xaz_events() + collect))
    fin = final({g: v for g, v in h.final.gangs.items() if g != "x1"}, leaders=("a", "b"))  # type: ignore[union-attr]
    v = checker.check(dataclasses.replace(h, final=fin))
    assert v.ok, [x.render() for x in v.violations]


def test_two_phase_flags_a_decision_deleted_apart_from_its_gang() -> None:
    collect = (EtcdEvent("delete", "gangs/x1", 60, T0 + 9.0), EtcdEvent("delete", "decisions/x1/1", 61, T0 + 9.0))
    h = short_retention(cross_az(etcd=xaz_events() + collect))
    fin = final({g: v for g, v in h.final.gangs.items() if g != "x1"}, leaders=("a", "b"))  # type: ignore[union-attr]
    found = checker.check(dataclasses.replace(h, final=fin)).result(8).violations
    assert len(found) == 1 and "decision x1#1 deleted at rev 61" in found[0].what


def test_acked_not_lost_accepts_a_finished_gang_collected_by_retention() -> None:
    h = short_retention(add(healthy(), etcd=(EtcdEvent("delete", "gangs/g1", 30, T0 + 30.0),)), 10.0)
    fin = final({"p-a": gang_value("p-a", "SUCCEEDED")})
    assert violations(dataclasses.replace(h, final=fin), 4) == []


@pytest.mark.parametrize("retention_s", [None, 60.0])  # the default (7 days), or longer than the gap
def test_acked_not_lost_flags_a_finished_gang_deleted_before_its_retention(retention_s) -> None:
    h = add(healthy(), etcd=(EtcdEvent("delete", "gangs/g1", 30, T0 + 30.0),))
    if retention_s is not None:
        h = short_retention(h, retention_s)
    fin = final({"p-a": gang_value("p-a", "SUCCEEDED")})
    found = violations(dataclasses.replace(h, final=fin), 4)
    assert len(found) == 1 and "acknowledged gang g1" in found[0].what


def test_acked_not_lost_flags_a_live_gang_deleted() -> None:
    # The record was RUNNING when it vanished: not retention.
    h = add(healthy(), etcd=(gang("g2", 25, 25.0, "RUNNING"), EtcdEvent("delete", "gangs/g2", 30, T0 + 30.0)))
    c, o = ack("g2", 24.0)
    h = dataclasses.replace(h, calls=h.calls + (c,), outcomes=h.outcomes + (o,))
    found = checker.check(h).result(4).violations
    assert len(found) == 1 and "acknowledged gang g2" in found[0].what
