"""Each admission rule alone, and the order of the pipeline (pure;
coordinator/core/admission_rules.py, docs/admission.md "Rules")."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.core import admission_rules as rules
from coordinator.core.admission import plan_admissions, request_for, shape_of, spans_azs
from coordinator.core.admission_rules import (
    RULES, AdmissionView, Candidate, FailAdmission, KeepPending, Reserve, decide,
)
from coordinator.core.records import GangRecord
from tests.unit import test_admission_one_order as one_order
from tests.unit.test_admission import AZ, WINDOW, gang, node, topo

NOW = 200.0


def view(free: dict[str, int], *, registered: list[str] | None = None, kept: tuple[str, ...] = (),
         head: GangRecord | None = None) -> AdmissionView:
    """This AZ's nodes (name -> free GPUs of 8); ``kept`` for ``head``."""
    nodes = [node(n, f) for n, f in free.items()]
    return AdmissionView(az=AZ, free={(v.az, v.name): v for v in nodes}, backfill_window_s=WINDOW,
                         registered=None if registered is None else [topo(n) for n in registered], verdicts={},
                         head=head, kept=frozenset((AZ, n) for n in kept))


def cand(g: GangRecord, position: int = 1, queue: int = 1) -> Candidate:
    request = request_for(g, AZ)
    return Candidate(g, request, shape_of(request), spans_azs(g), position=position, queue=queue)


def kind(d: Any) -> str | None:
    return None if d is None else type(d).__name__


OLD = gang("old", 1, 8, at=0)


# Each rule alone: (rule, gang, view, expected kind or None, words in the reason).
@pytest.mark.parametrize("rule,g,v,expected,words", [
    pytest.param(rules.admission_timeout, gang("g", 1, 1, at=0, timeout=60), view({"n0": 8}), "FailAdmission",
                 "admission_timeout_s=60", id="timeout: waited past its admission timeout fails"),
    pytest.param(rules.admission_timeout, gang("g", 1, 1, at=NOW - 60, timeout=60), view({"n0": 8}), None, "",
                 id="timeout: exactly at its timeout it still waits"),
    pytest.param(rules.never_fitting, gang("g", 3, 8, at=NOW), view({"n0": 8}, registered=["n0", "n1"]),
                 "FailAdmission", "never fits: needs 24 GPUs", id="never fits: more than every registered node"),
    pytest.param(rules.never_fitting, gang("g", 2, 8, at=NOW), view({"n0": 0}, registered=["n0", "n1"]), None, "",
                 id="never fits: fits the registered nodes emptied, so not judged impossible"),
    pytest.param(rules.never_fitting, gang("g", 3, 8, at=NOW), view({"n0": 8}), None, "",
                 id="never fits: not judged without the registered nodes (start-up grace)"),
    pytest.param(rules.restart_backoff, gang("g", 1, 1, at=0, not_before=NOW + 5), view({"n0": 8}), "KeepPending",
                 "restart backoff: not re-placed for 5.0s", id="backoff: a restarted gang waits it out"),
    pytest.param(rules.restart_backoff, gang("g", 1, 1, at=0, not_before=NOW), view({"n0": 8}), None, "",
                 id="backoff: over at not_before"),
    pytest.param(rules.place_now, gang("g", 1, 8, at=0), view({"n0": 8}), "Reserve", "", id="place: it fits"),
    pytest.param(rules.place_now, gang("g", 1, 8, at=0), view({"n0": 4}), None, "", id="place: no room"),
    pytest.param(rules.place_now, gang("g", 1, 8, at=0), view({"n0": 8}, kept=("n0",), head=OLD), None, "",
                 id="place: kept nodes are not free for it"),
    pytest.param(rules.held_back_by_backfill, gang("g", 1, 8, at=0), view({"n0": 8}, kept=("n0",), head=OLD),
                 "KeepPending", "nodes kept for older gang old (n0)", id="held back: it fits only on kept nodes"),
    pytest.param(rules.held_back_by_backfill, gang("g", 1, 8, at=0), view({"n0": 4}, kept=("n0",), head=OLD),
                 None, "", id="held back: not even on the kept nodes, so not held back by them"),
    pytest.param(rules.held_back_by_backfill, gang("g", 1, 8, at=0), view({"n0": 4}), None, "",
                 id="held back: nothing is kept"),
    pytest.param(rules.backfill_head, gang("g", 2, 8, at=NOW - WINDOW - 1), view({"n0": 0, "n1": 8}), "KeepPending",
                 "nodes n0, n1 are kept for it", id="head: past its window, it keeps the nodes it would take emptied"),
    pytest.param(rules.backfill_head, gang("g", 3, 8, at=NOW - WINDOW - 1), view({"n0": 0, "n1": 8}), "KeepPending",
                 "keeps no nodes and holds back no gang", id="head: not even on the emptied nodes, it keeps none"),
    pytest.param(rules.backfill_head, gang("g", 2, 8, at=NOW - WINDOW), view({"n0": 0, "n1": 8}), None, "",
                 id="head: inside its window it holds nobody back"),
    pytest.param(rules.backfill_head, gang("g", 2, 8, at=0), view({"n0": 0, "n1": 8}, kept=("n1",), head=OLD), None,
                 "", id="head: one head at a time"),
    pytest.param(rules.no_room, gang("g", 1, 8, at=0), view({"n0": 4}), "KeepPending", "",
                 id="no room: it waits, with its shortfall"),
    pytest.param(rules.no_room, gang("g", 1, 8, at=0), view({"n0": 8}), None, "",
                 id="no room: not when it fits (place_now reserves it first)"),
    pytest.param(rules.backfill_head, gang("g", 1, 8, at=0), view({"n0": 8}), None, "",
                 id="head: not when it fits"),
])
def test_rule(rule, g: GangRecord, v: AdmissionView, expected: str | None, words: str) -> None:
    d = rule(cand(g), v, NOW)
    assert kind(d) == expected, d
    assert words in (d.reason if d is not None else "")
    if rule in (rules.backfill_head, rules.no_room):
        assert d is None or d.shortfalls, "a gang waiting for room says how close it comes"


def test_a_head_keeps_the_nodes_it_names_and_record_applies_them() -> None:
    v = view({"n0": 0, "n1": 8, "n2": 0})
    g = gang("big", 2, 8, at=0)
    d = rules.backfill_head(cand(g), v, NOW)
    assert isinstance(d, KeepPending) and d.kept_nodes == {(AZ, n) for n in d.keeps} and len(d.keeps) == 2
    v.record(d)
    assert v.head is g and v.kept == d.kept_nodes


def test_record_takes_a_reservations_devices_from_the_view() -> None:
    v = view({"n0": 8})
    d = rules.place_now(cand(gang("g", 1, 3, at=0)), v, NOW)
    assert isinstance(d, Reserve)
    v.record(d)
    assert len(v.free[(AZ, "n0")].free_gpus) == 5


def test_the_pipeline_order() -> None:
    assert [r.__name__ for r in RULES] == ["admission_timeout", "never_fitting", "restart_backoff", "place_now",
                                           "held_back_by_backfill", "backfill_head", "no_room"]


# A gang several rules would decide: the earliest rule in RULES wins.
@pytest.mark.parametrize("g,v,expected", [
    pytest.param(gang("g", 3, 8, at=0, timeout=60, not_before=NOW + 5), view({"n0": 8}, registered=["n0"]),
                 "admission_timeout", id="timed out and never fits and backing off: the timeout"),
    pytest.param(gang("g", 3, 8, at=NOW, not_before=NOW + 5), view({"n0": 8}, registered=["n0"]),
                 "never_fitting", id="never fits and backing off: never fits"),
    pytest.param(gang("g", 1, 8, at=NOW, not_before=NOW + 5), view({"n0": 8}), "restart_backoff",
                 id="fits but backing off: the backoff"),
    pytest.param(gang("g", 2, 8, at=0), view({"n0": 0, "n1": 8}), "backfill_head",
                 id="past its window without room: it becomes the head, not merely waiting"),
    pytest.param(gang("g", 1, 8, at=0), view({"n0": 8}, kept=("n0",), head=OLD), "held_back_by_backfill",
                 id="past its window but fits only on kept nodes: held back, not a second head"),
])
def test_the_first_rule_that_decides_wins(g: GangRecord, v: AdmissionView, expected: str) -> None:
    c = cand(g)
    d = decide(c, v, NOW)
    deciding = [r.__name__ for r in RULES if r(c, v, NOW) is not None]
    assert deciding[0] == expected and len(deciding) > 1, deciding
    assert d == getattr(rules, expected)(c, v, NOW)


def test_a_new_rule_is_a_new_step() -> None:
    """A policy (a quota, say) goes in as a rule at its place in the list."""
    def quota(c: Candidate, v: AdmissionView, now: float) -> KeepPending | None:
        return KeepPending(c.gang, "quota: over") if c.gang.spec.priority < 1 else None

    pending = [gang("low", 1, 1, at=0), gang("high", 1, 1, at=1, priority=1)]
    order = list(RULES)
    order.insert(order.index(rules.place_now), quota)
    ds = plan_admissions(pending, [node("n0")], NOW, az=AZ, backfill_window_s=WINDOW, rules=order)
    assert {d.gang.id: kind(d) for d in ds} == {"high": "Reserve", "low": "KeepPending"}
    assert ds[1].reason == "quota: over"


def test_with_no_deciding_rule_the_pipeline_says_so() -> None:
    with pytest.raises(ValueError, match="no admission rule decided gang g"):
        decide(cand(gang("g", 1, 1, at=0)), view({"n0": 8}), NOW, rules=(rules.admission_timeout,))


def test_a_cross_az_candidate_is_placed_over_every_az() -> None:
    v = view({"n0": 8})
    v.free[("az-b", "m0")] = one_order.node("m0", "az-b")
    d = rules.place_now(cand(one_order.gang("wide", 2, 8, at=0, cross=True)), v, NOW)
    assert isinstance(d, Reserve) and {m.az for m in d.placement.members} == {AZ, "az-b"}
    assert rules.place_now(cand(one_order.gang("narrow", 2, 8, at=0)), v, NOW) is None


def test_fail_decisions_carry_never_fits_only_from_that_rule() -> None:
    c = cand(gang("g", 3, 8, at=0, timeout=60))
    v = view({"n0": 8}, registered=["n0"])
    assert rules.admission_timeout(c, v, NOW) == FailAdmission(c.gang, "not admitted within admission_timeout_s=60s")
    d = rules.never_fitting(c, v, NOW)
    assert isinstance(d, FailAdmission) and d.never_fits
