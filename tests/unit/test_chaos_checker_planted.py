"""The chaos checker on the histories the planted bugs of chaos/scenarios.py
leave behind (``stale-epoch-accepted``, ``fence-compare-skipped``,
``decision-overwrite``), built by hand: each must be reported under exactly
one invariant, naming the offending member or key, while the same history
with the safety check working (the bug's write or start refused) passes.
Pure: no cluster, no clock."""

from __future__ import annotations

import dataclasses
from typing import Any

from chaos import checker
from chaos.history import AgentEvent, ClientCall, ClientOutcome, EtcdEvent, FinalState, History, RunParams, recovery_bound

T0 = 1000.0
TIMINGS = {"lease_ttl_s": 2, "fence_after_s": 4.0, "replace_margin_s": 1.0}


def put(key: str, rev: int, t: float, value: dict[str, Any], create_rev: int = 0) -> EtcdEvent:
    return EtcdEvent("put", key, rev, T0 + t, create_rev=create_rev or rev, value=value)


def delete(key: str, rev: int, t: float) -> EtcdEvent:
    return EtcdEvent("delete", key, rev, T0 + t)


def leader(az: str, epoch: int, t: float, who: str) -> EtcdEvent:
    return put(f"leader/{az}", epoch, t, {"id": who, "address": "x"})


def gang_value(gid: str, state: str, members: int = 1, cross: bool = False,
               placement: tuple[tuple[str, str, int], ...] = ()) -> dict[str, Any]:
    return {"id": gid, "state": state, "owner_az": "a", "incarnation": 1, "idempotency_key": f"{gid}-k",
            "spec": {"name": gid, "members": members, "topology": {"allow_cross_az": cross}}, "reason": "",
            "placement": [{"rank": r, "az": az, "node": n, "gpus": [g], "nics": []}
                          for r, (az, n, g) in enumerate(placement)]}


def reservation(gid: str, epoch: int, node: str = "a-n000", gpus: tuple[int, ...] = (0,), az: str = "a",
                status: str = "COMMITTED", **extra: Any) -> dict[str, Any]:
    return {"az": az, "gang": gid, "incarnation": 1, "status": status, "epoch": epoch,
            "nodes": {node: {"gpus": list(gpus), "nics": []}}, **extra}


def started(key: str, t: float, epoch: int, gpus: tuple[int, ...] = (0,), node: str = "a-n000",
            az: str = "a") -> AgentEvent:
    return AgentEvent("member_started", node, az, T0 + t, epoch=epoch, key=key, gpus=gpus)


def exited(key: str, t: float, epoch: int, node: str = "a-n000", az: str = "a") -> AgentEvent:
    return AgentEvent("member_exited", node, az, T0 + t, epoch=epoch, key=key, code=0, phase="SUCCEEDED")


def history(etcd: list[EtcdEvent], agents: list[AgentEvent], gangs: dict[str, str],
            cross: tuple[str, ...] = ()) -> History:
    """A one-run history: ``gangs`` (id -> final state) were all acknowledged;
    a probe of every AZ runs after the heal at +30 s."""
    azs = ("a", "b")
    etcd = list(etcd)
    for i, az in enumerate(azs):
        gid = f"p-{az}"
        etcd += [put(f"gangs/{gid}", 900 + 10 * i, 31.0, gang_value(gid, "PENDING")),
                 put(f"gangs/{gid}", 901 + 10 * i, 31.2, gang_value(gid, "RUNNING")),
                 put(f"reservations/{az}/{gid}", 901 + 10 * i, 31.2, reservation(gid, 0, f"{az}-n001", (7,), az)),
                 put(f"gangs/{gid}", 902 + 10 * i, 33.0, gang_value(gid, "SUCCEEDED")),
                 delete(f"reservations/{az}/{gid}", 903 + 10 * i, 33.0)]
        agents += [started(f"{gid}#1/r0", 31.1, 0, (7,), f"{az}-n001", az), exited(f"{gid}#1/r0", 32.9, 0, f"{az}-n001", az)]
        gangs = {**gangs, gid: "SUCCEEDED"}
    calls, outcomes = [], []
    for gid in gangs:
        op = "submit_cross_az" if gid in cross else "submit"
        probe = gid.startswith("p-")
        calls.append(ClientCall(op, f"{gid}-k", gid, "a", "10.0.0.1:7070", 1, T0, T0 + 0.1, "OK", gang_id=gid, probe=probe))
        outcomes.append(ClientOutcome(op, f"{gid}-k", gid, gid[-1] if probe else "a", True, gid, T0, T0 + 0.1, "OK", 1,
                                      probe=probe))
    final_kvs: dict[str, Any] = {f"gangs/{g}": gang_value(g, s, cross=g in cross) for g, s in gangs.items()}
    final_kvs.update({f"leader/{az}": {"id": f"coord-{az}2"} for az in azs})
    final_kvs.update({e.key: e.value for e in etcd if e.key.startswith("decisions/") and e.kind == "put"})
    # An epoch-0 probe reservation would be flagged too: give each the epoch current then.
    terms = {e.key[len("leader/"):]: e.rev for e in sorted(etcd, key=lambda e: e.rev)
             if e.key.startswith("leader/") and e.kind == "put"}
    etcd = [dataclasses.replace(e, value={**e.value, "epoch": terms[e.value["az"]]})
            if e.kind == "put" and e.key.startswith("reservations/") and e.key.endswith("/p-" + e.value["az"]) else e
            for e in etcd]
    agents = [dataclasses.replace(a, epoch=terms[a.az]) if a.key.startswith("p-") else a for a in agents]
    return History(
        params=RunParams(azs=azs, started_at=T0, settle_at=T0 + 60, healed_at=T0 + 30, timings=TIMINGS,
                         recovery_bound_s=recovery_bound(TIMINGS), token_window_s=2.0),
        agents=tuple(sorted(agents, key=lambda a: a.mono)), etcd=tuple(sorted(etcd, key=lambda e: e.rev)),
        calls=tuple(calls), outcomes=tuple(outcomes), final=FinalState(revision=999, mono=T0 + 60, kvs=final_kvs))


def only(h: History, invariant: int) -> list[checker.Violation]:
    v = checker.check(h)
    others = [x.render() for x in v.violations if x.invariant != invariant]
    assert others == [], f"violations of other invariants: {others}"
    return list(v.result(invariant).violations)


# ---------------------------------------------------------------------------
# stale-epoch-accepted (agent.ignore_stale_epoch)


def _stale_start(start_at: float, epoch: int) -> History:
    """Leader coord-a1 (epoch 5) reserves g1 and assigns it; it is SIGSTOPped,
    its key expires at +12, coord-a2 leads from +12.3 (epoch 20). The agent's
    delayed token check ends at ``start_at`` and starts g1 under ``epoch``."""
    etcd = [leader("a", 5, 0.0, "coord-a1"), leader("b", 6, 0.0, "coord-b1"),
            put("gangs/g1", 10, 9.8, gang_value("g1", "PENDING")),
            put("gangs/g1", 11, 10.0, gang_value("g1", "RESERVED")),
            put("reservations/a/g1", 11, 10.0, reservation("g1", 5)),
            delete("leader/a", 19, 12.0), leader("a", 20, 12.3, "coord-a2"),
            put("gangs/g1", 21, start_at + 0.2, gang_value("g1", "RUNNING")),
            put("gangs/g1", 22, start_at + 3.0, gang_value("g1", "SUCCEEDED")),
            delete("reservations/a/g1", 23, start_at + 3.0)]
    agents = [started("g1#1/r0", start_at, epoch), exited("g1#1/r0", start_at + 2.9, epoch)]
    return history(etcd, agents, {"g1": "SUCCEEDED"})


def test_a_member_started_under_a_dead_epoch_is_an_epoch_violation_naming_it() -> None:
    found = only(_stale_start(18.1, epoch=5), 6)
    assert len(found) == 1
    assert found[0].what.startswith("g1#1/r0 started on a-n000 under epoch 5 6.10s after that leadership ended")
    assert any("epoch 5 (coord-a1)" in e for e in found[0].evidence)
    assert any("next: epoch 20 (coord-a2)" in e for e in found[0].evidence)


def test_the_same_start_under_the_new_epoch_passes() -> None:
    # With the token check working the agent waits for the new leader's
    # assignment (epoch 20) and starts under that: no violation at all.
    assert checker.check(_stale_start(18.1, epoch=20)).ok


# ---------------------------------------------------------------------------
# fence-compare-skipped (leader.skip_fence_compare)


def _unfenced_write(successor_first: bool) -> History:
    """coord-a1 (epoch 5) reads g1 PENDING and sends its reservation txn; its
    lease expires (leader/a deleted at rev 12) before the txn lands at rev 13.
    Either no leader holds leader/a then (the standby was paused) or the
    successor already does (epoch 12)."""
    etcd = [leader("a", 5, 0.0, "coord-a1"), leader("b", 6, 0.0, "coord-b1"),
            put("gangs/g1", 10, 9.8, gang_value("g1", "PENDING")),
            delete("leader/a", 11, 11.0)]
    if successor_first:
        etcd.append(leader("a", 12, 11.5, "coord-a2"))
    etcd += [put("gangs/g1", 13, 12.0, gang_value("g1", "RESERVED")),
             put("reservations/a/g1", 13, 12.0, reservation("g1", 5)),
             put("gangs/g1", 15, 13.0, gang_value("g1", "RUNNING")),
             put("gangs/g1", 16, 16.0, gang_value("g1", "SUCCEEDED")), delete("reservations/a/g1", 17, 16.0)]
    if not successor_first:
        etcd.append(leader("a", 14, 12.5, "coord-a2"))
    agents = [started("g1#1/r0", 12.9, 14 if not successor_first else 12), exited("g1#1/r0", 15.9, 14)]
    return history(etcd, agents, {"g1": "SUCCEEDED"})


def test_a_reservation_committed_after_its_leader_key_expired_names_key_and_epoch() -> None:
    found = only(_unfenced_write(successor_first=False), 6)
    assert [v.what for v in found] == ["reservation reservations/a/g1 written at rev 13 by epoch 5 while a had no leader"]


def test_a_reservation_committed_under_the_successor_names_both_epochs() -> None:
    found = only(_unfenced_write(successor_first=True), 6)
    assert [v.what for v in found] == [
        "reservation reservations/a/g1 written at rev 13 by epoch 5 while a had epoch 12 (coord-a2)"]


# ---------------------------------------------------------------------------
# decision-overwrite (twophase.decision_overwrite)

XPLAN = (("a", "a-n000", 4), ("b", "b-n000", 0))


def _hold(az: str, rev: int, t: float, status: str) -> EtcdEvent:
    node, gpu = {"a": ("a-n000", 4), "b": ("b-n000", 0)}[az]
    return put(f"reservations/{az}/x1", rev, t,
               reservation("x1", {"a": 5, "b": 6}[az], node, (gpu,), az, status,
                           two_phase=True, owner_az="a", priority=0, submitted_at=1.0))


def _overwritten(second: str | None) -> History:
    """Owner a prepares x1#1 in a and b and freezes; its successor (epoch 20)
    ABORTs the undecided incarnation and both holds are released; the frozen
    owner wakes and writes ``second`` (None: its create-if-absent lost)."""
    etcd = [leader("a", 5, 0.0, "coord-a1"), leader("b", 6, 0.0, "coord-b1"),
            put("gangs/x1", 10, 5.0, gang_value("x1", "PENDING", 2, True)),
            put("gangs/x1", 11, 5.1, gang_value("x1", "RESERVING", 2, True, XPLAN)),
            _hold("a", 12, 5.2, "PREPARED"), _hold("b", 13, 5.2, "PREPARED"),
            delete("leader/a", 14, 7.5), leader("a", 20, 7.8, "coord-a2"),
            put("decisions/x1/1", 21, 8.0, {"outcome": "ABORT", "by": "a", "reason": "owner leader changed"}),
            delete("reservations/a/x1", 22, 8.1), delete("reservations/b/x1", 23, 8.1),
            put("gangs/x1", 25, 12.0, gang_value("x1", "FAILED", 2, True, XPLAN))]
    if second is not None:
        etcd.append(put("decisions/x1/1", 24, 11.2, {"outcome": second, "by": "a", "reason": "every participant voted YES"},
                        create_rev=21))
    return history(etcd, [], {"x1": "FAILED"}, cross=("x1",))


def test_a_decision_put_over_another_is_a_two_phase_violation_naming_the_key() -> None:
    found = only(_overwritten("COMMIT"), 8)
    assert [v.what for v in found] == [
        "decision x1#1 written twice (rev 21: ABORT, rev 24: COMMIT): a decision key is created once"]
    assert any(e.startswith("rev 21 ") for e in found[0].evidence) and any(e.startswith("rev 24 ") for e in found[0].evidence)


def test_even_the_same_outcome_written_again_is_reported() -> None:
    found = only(_overwritten("ABORT"), 8)
    assert [v.what for v in found] == [
        "decision x1#1 written twice (rev 21: ABORT, rev 24: ABORT): a decision key is created once"]


def test_a_decision_created_once_passes() -> None:
    assert checker.check(_overwritten(None)).ok
