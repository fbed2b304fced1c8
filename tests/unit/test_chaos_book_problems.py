"""A chaos run that must hold fails on what its leaders' ``--check-book``
said (chaos/run.py ``book_problems``; docs/book.md)."""

from __future__ import annotations

from pathlib import Path

from chaos.checker import Verdict
from chaos.run import RunResult, book_problems

LINE = "2026-01-01 ERROR coordinator.book_check book inconsistent: n0 gpu 0 held by x and y"


def test_the_lines_are_read_from_the_coordinators_logs(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "coord-a1.log").write_text(f"INFO all fine\n{LINE}\n")
    (tmp_path / "logs" / "agents-a.log").write_text(f"{LINE}\n")  # not a coordinator's
    assert book_problems(tmp_path) == [f"coord-a1: {LINE}"]


def test_a_run_that_must_hold_fails_on_a_book_problem(tmp_path: Path) -> None:
    clean = RunResult("leader-pause", 1, tmp_path, Verdict(()), 1.0)
    assert clean.as_expected and "book problem" not in clean.line()
    broken = RunResult("leader-pause", 1, tmp_path, Verdict(()), 1.0, book_problems=[f"coord-a1: {LINE}"])
    assert not broken.as_expected and "UNEXPECTED, 0 violation(s), 1 book problem(s)" in broken.line()
