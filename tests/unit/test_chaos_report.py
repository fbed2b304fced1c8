"""Chaos reports from hand-made histories: the text summary says what was
checked and found; the HTML timeline is one self-contained page."""

from __future__ import annotations

import dataclasses
import re
from html.parser import HTMLParser
from pathlib import Path

from chaos import checker, report
from chaos.history import ClientOutcome, FaultRecord
from tests.unit.test_chaos_checker import T0, exited, healthy


def _with_fault():
    h = healthy()
    return dataclasses.replace(h, faults=(FaultRecord(T0 + 10, "partition-az-a", "inject"),
                                          FaultRecord(T0 + 10, "partition-az-a", "note", "target x"),
                                          FaultRecord(T0 + 20, "partition-az-a", "heal")))


def test_summary_lists_faults_leaders_outcomes_and_each_invariant() -> None:
    h = _with_fault()
    text = report.summary(h, checker.check(h), wall_s=12.0)
    assert "+10.00s ..   +20.00s  partition-az-a  (target x)" in text
    assert "a: coord-a1 e5" in text
    assert "Gangs by final state: SUCCEEDED 2" in text
    assert text.count("[PASS]") == len(checker.INVARIANTS) == 9 and "VERDICT: no violation" in text


def test_summary_shows_each_violation_with_its_evidence() -> None:
    h = healthy()
    h = dataclasses.replace(h, agents=tuple(e for e in h.agents if not (e.key == "g1#1/r0" and e.event == "member_exited"))
                            + (exited("g1#1/r0", 9.0, code=-15, phase="STOPPED"),))
    text = report.summary(h, checker.check(h))
    assert "[FAIL] 2. no GPU held by two live members" in text
    assert re.search(r"\[2\] g1#1/r0 still held GPUs \[0, 1\] of a-n000 4\.80s after its reservation", text)
    assert "reservation a/g1 released at rev 15" in text


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.refs: list[str] = []

    def handle_starttag(self, tag, attrs):  # noqa: ANN001
        self.tags.append(tag)
        self.refs += [v for k, v in attrs if k in ("src", "href") and v]


def test_timeline_is_self_contained_inline_svg(tmp_path: Path) -> None:
    h = _with_fault()
    v = checker.check(h)
    report.write(tmp_path, h, v)
    page = (tmp_path / "timeline.html").read_text()
    p = _Refs()
    p.feed(page)
    assert "svg" in p.tags and p.refs == [] and "<script" not in page
    assert "partition-az-a" in page and "g1" in page and "coord-a1 e5" in page
    assert (tmp_path / "report.txt").read_text().startswith("Phalanx chaos run")


def test_summary_counts_cancels_by_aim_and_where_they_landed() -> None:
    h = healthy()
    cancels = (ClientOutcome("cancel", "g1", "g1", "a", True, "g1", T0 + 1.25, T0 + 1.3, "OK", 1, aim="admission"),
               ClientOutcome("cancel", "g1", "g1", "a", False, "g1", T0 + 2.5, T0 + 30, "UNAVAILABLE", 9,
                             aim="restart", trigger="fault"),
               ClientOutcome("cancel", "p-a", "p-a", "a", True, "p-a", T0 + 20.5, T0 + 20.6, "OK", 1, aim="late"))
    h = dataclasses.replace(h, outcomes=h.outcomes + cancels)
    by_aim = report.cancels_by_aim(h)
    assert by_aim["admission"]["landed"] == {"RESERVED": 1} and by_aim["admission"]["outcome"] == {"ok": 1}
    assert by_aim["restart"]["trigger"] == {"fault": 1} and by_aim["restart"]["landed"] == {"RUNNING": 1}
    assert by_aim["late"]["landed"] == {"unseen": 1}  # p-a's first write is seen at +21.0s
    text = report.summary(h, checker.check(h))
    assert "    admission: 1 (ok 1); landed on RESERVED 1" in text
    assert "    restart: 1 (UNAVAILABLE 1); landed on RUNNING 1; trigger fault 1" in text
    assert "Terminal gangs (invariant 9): 2 examined, 0 with a member alive at their terminal write" in text
