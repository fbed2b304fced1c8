"""A chaos run's per-run metrics (chaos/metrics.py): leadership changes and
time to full gang derived from hand-made histories, fenced writes refused
from coordinators' expositions, and how the report says them."""

from __future__ import annotations

import dataclasses

from prometheus_client import generate_latest

from chaos import checker, report
from chaos.metrics import FENCED, RunMetrics, Scraped, derive, parse, render, scraped_from
from coordinator.metrics import CoordinatorMetrics
from tests.unit.test_chaos_checker import add, gang, healthy, leader, leader_gone


def exposition(fenced: int, leading: int) -> str:
    m = CoordinatorMetrics(az="a")
    for _ in range(fenced):
        m.fenced_write_refused()
    for i in range(leading):
        m.leading(epoch=10 + i)
    return generate_latest(m.registry).decode()


def test_counters_are_read_from_a_real_exposition() -> None:
    assert parse(exposition(fenced=3, leading=2)) == {FENCED: 3.0, "phalanx_leadership_changes_total": 2.0}
    assert parse(exposition(fenced=0, leading=0))[FENCED] == 0.0


def test_leadership_changes_count_terms_begun_after_the_cluster_was_ready() -> None:
    # The healthy history's leader of a (epoch 5) is there at +0; a failover
    # at +8 (epoch 30), and b's leader changes twice.
    h = add(healthy(), etcd=(leader_gone("a", 29, 8.0), leader("a", 30, 8.5, who="coord-a2"),
                             leader("b", 31, 0.0, who="coord-b1"), leader_gone("b", 32, 3.0),
                             leader("b", 33, 4.0, who="coord-b2"), leader_gone("b", 34, 5.0),
                             leader("b", 35, 6.0, who="coord-b1")))
    h = dataclasses.replace(h, params=dataclasses.replace(h.params, azs=("a", "b")))
    assert derive(h).leadership_changes == {"a": 1, "b": 2}
    assert derive(healthy()).leadership_changes == {"a": 0}


def test_time_to_full_gang_is_first_record_to_first_running() -> None:
    m = derive(healthy())
    # g1: PENDING at +1.0, RUNNING at +2.1; the probe p-a: +21.0 .. +21.5.
    assert {g: round(s, 3) for g, s in m.full_gang_s.items()} == {"g1": 1.1, "p-a": 0.5}
    assert m.full_gang_stats == {"count": 2, "p50": m.full_gang_s["p-a"], "p95": m.full_gang_s["g1"], "max": m.full_gang_s["g1"]}
    # A gang that never ran is not in it; one restarted counts its first RUNNING.
    h = add(healthy(), etcd=(gang("g9", 40, 30.0, "PENDING"), gang("g9", 41, 31.0, "FAILED"),
                             gang("g7", 42, 30.0, "PENDING"), gang("g7", 43, 33.0, "RUNNING"),
                             gang("g7", 44, 34.0, "RESTARTING", inc=2), gang("g7", 45, 36.0, "RUNNING", inc=2)))
    got = derive(h).full_gang_s
    assert "g9" not in got and round(got["g7"], 3) == 3.0


def test_fenced_refused_sums_the_coordinators_that_answered() -> None:
    answers = {"coord-a1": {"address": "10.0.0.2:9090", "text": exposition(fenced=2, leading=1)},
               "coord-a2": {"address": "10.0.0.3:9090", "text": exposition(fenced=1, leading=2)},
               "coord-b1": {"address": "10.0.0.4:9090", "text": None, "error": "10.0.0.4:9090: ConnectionRefusedError"},
               "coord-b2": {"address": "10.0.0.5:9090", "text": "not { an exposition"}}
    scraped = scraped_from(answers, {"coord-a2": 3})
    assert [(s.coordinator, s.fenced_refused, s.starts, bool(s.error)) for s in scraped] == [
        ("coord-a1", 2.0, 1, False), ("coord-a2", 1.0, 3, False), ("coord-b1", None, 1, True), ("coord-b2", None, 1, True)]
    m = derive(healthy(), scraped)
    assert m.fenced_refused == 3.0
    assert derive(healthy(), scraped[2:]).fenced_refused is None  # nobody answered: unknown, not 0
    assert derive(healthy(), [Scraped("c", "x", 1, 0.0, 1.0)]).fenced_refused == 0.0


def test_the_report_says_each_number_and_where_it_comes_from() -> None:
    answers = {"coord-a1": {"address": "10.0.0.2:9090", "text": exposition(fenced=2, leading=1)},
               "coord-a2": {"address": "10.0.0.3:9090", "text": None, "error": "timed out"}}
    h = healthy()
    m = derive(h, scraped_from(answers, {"coord-a1": 2}))
    text = "\n".join(render(m))
    assert "leadership changes (history: new leader terms after ready): a 0; total 0" in text
    assert "time to full gang (history: first record to RUNNING): 2 gangs, p50 0.50s, p95 1.10s, max 1.10s" in text
    assert "fenced writes refused (coordinators' /metrics at the end): 2" in text
    assert "coord-a1: fenced refused 2, became leader 1 time(s) (restarted: counts since start 2 only)" in text
    assert "coord-a2 10.0.0.3:9090: no answer: timed out" in text
    full = report.summary(h, checker.check(h), metrics=m)
    assert "Per-run metrics" in full and full.index("Per-run metrics") < full.index("Invariants")
    assert "Per-run metrics" not in report.summary(h, checker.check(h))
    page = report.timeline(h, checker.check(h), metrics=m)
    assert "fenced writes refused" in page and "time to full gang" in page


def test_no_scrape_and_no_gang_are_said_so() -> None:
    text = "\n".join(render(RunMetrics({"a": 0}, {}, None)))
    assert "fenced writes refused: not scraped" in text and "no gang ran" in text
    assert RunMetrics({"a": 0}, {}, None).to_dict()["full_gang_stats"] == {}
