"""Three more planted bugs, end to end: each one is a failpoint that switches
one safety check off (docs/failpoints.md), run in its chaos scenario
(chaos/scenarios.py); the checker must report the one invariant it breaks,
naming the offending record. Like ``fencing-disabled``
(tests/chaos/test_chaos_scenarios.py), none of these is in ``--all``.

Needs root, ``ip``, ``iptables`` and etcd, as the rest of the chaos suite;
no assertion is about timing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from chaos.checker import INVARIANTS
from chaos.history import History, load
from chaos.run import RunResult, run_scenario
from chaos.scenarios import scenario
from tests.chaos.test_chaos_scenarios import assert_nothing_left, report

pytestmark = pytest.mark.chaos


def run_planted(name: str, invariant: int, tmp_path: Path) -> tuple[RunResult, History]:
    """Run the planted bug ``name``; exactly ``invariant`` must fail."""
    r = run_scenario(scenario(name), seed=1, out_dir=tmp_path)
    assert r.error == "", r.error
    assert r.verdict is not None
    assert not r.verdict.ok, f"the planted bug {name} went unnoticed:\n" + report(r)
    assert r.as_expected
    assert [x.name for x in r.verdict.results if not x.passed] == [INVARIANTS[invariant]], report(r)
    return r, load(r.run_dir)


def notes(h: History, fault: str) -> list[str]:
    """The details of the notes a fault wrote into the history."""
    return [f.detail for f in h.faults if f.action == "note" and f.name == fault]


def test_checker_reports_a_member_started_under_a_stale_epoch(tmp_path: Path) -> None:
    """agent.ignore_stale_epoch: an assignment of AZ a's leader waits in a slow
    token check while that leader is SIGSTOPped and replaced; the agent reads
    another epoch in leader/a and starts the member anyway. Invariant 6 must
    name the member and the dead epoch it started under."""
    r, h = run_planted("stale-epoch-accepted", 6, tmp_path)
    assert any("SIGSTOPped" in d for d in notes(h, "stale-epoch-start-a")), report(r)
    stale = [v for v in r.verdict.result(6).violations if "after that leadership ended" in v.what]  # type: ignore[union-attr]
    assert stale, report(r)
    starts = {(e.key, e.epoch) for e in h.agents if e.event == "member_started" and e.az == "a"}
    for v in stale:
        m = re.match(r"(\S+) started on (\S+) under epoch (\d+) ", v.what)
        assert m is not None, v.what
        assert (m.group(1), int(m.group(3))) in starts, v.what
        assert m.group(2).startswith("a-"), v.what
    assert_nothing_left(r)


def test_checker_reports_a_reservation_written_without_the_fence(tmp_path: Path) -> None:
    """leader.skip_fence_compare: AZ a's leader sends its reservation txn while
    still valid; its etcd requests are held until its lease has expired (the
    standby paused, so no successor yet) and the txn, fence compare dropped,
    commits. Invariant 6 must name reservations/a/<gang> and the dead epoch."""
    r, h = run_planted("fence-compare-skipped", 6, tmp_path)
    detail = next((d for d in notes(h, "stale-leader-write-a") if "reached leader.before_reserve" in d), "")
    assert detail, report(r)
    epoch = int(re.search(r"\(epoch (\d+)\)", detail).group(1))  # type: ignore[union-attr]
    stale = [v for v in r.verdict.result(6).violations  # type: ignore[union-attr]
             if re.match(rf"reservation reservations/a/\S+ written at rev \d+ by epoch {epoch} while a had ", v.what)]
    assert stale, report(r)
    assert_nothing_left(r)


def test_checker_reports_a_two_phase_decision_written_twice(tmp_path: Path) -> None:
    """twophase.decision_overwrite: a cross-AZ owner's COMMIT is held on its
    way to etcd past the participants' prepare timeout; an in-doubt
    participant (or the owner AZ's next leader) writes ABORT meanwhile, and
    the COMMIT, a plain Put, lands on top. Invariant 8 must name
    decisions/<gang>/<inc> of a cross-AZ gang the workload submitted, with
    both writes."""
    r, h = run_planted("decision-overwrite", 8, tmp_path)
    assert any("counts its votes" in d for d in notes(h, "decision-overwrite")), report(r)
    twice = [v for v in r.verdict.result(8).violations if "written twice" in v.what]  # type: ignore[union-attr]
    assert twice, report(r)
    cross = {o.gang_id for o in h.outcomes if o.op == "submit_cross_az" and o.acked}
    for v in twice:
        m = re.match(r"decision (\S+)#(\d+) written twice \(rev (\d+): (\w+), rev (\d+): (\w+)\)", v.what)
        assert m is not None, v.what
        assert m.group(1) in cross, v.what
        assert int(m.group(3)) < int(m.group(5))
        assert any(e.startswith(f"rev {m.group(3)} ") for e in v.evidence), v.evidence
        assert any(e.startswith(f"rev {m.group(5)} ") for e in v.evidence), v.evidence
    assert_nothing_left(r)
