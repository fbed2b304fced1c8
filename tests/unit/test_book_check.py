"""coordinator/book_check.py: what ``--check-book`` reports after a cycle."""

from __future__ import annotations

import logging

from coordinator.__main__ import parse_args
from coordinator.book import Book
from coordinator.book_check import BookCheck, new_problems
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.store import Keys
from phalanx.timings import Timings

AZ = "az-a"
ARGS = ["--az", AZ, "--id", "c0", "--etcd", "127.0.0.1:2379", "--insecure"]


def broken_book() -> Book:
    """Two gangs holding GPU 0 of n0."""
    b = Book.of(AZ, Keys("/phalanx/test"), Timings())
    for gang in ("x", "y"):
        b.held_in_memory(Reservation(AZ, gang, 1, HoldState.COMMITTED, {"n0": NodeDevices((0,))}))
    return b


def test_new_problems_are_those_not_reported_yet():
    b = broken_book()
    assert new_problems(b, set()) == ["n0 gpu 0 held by x and y"]
    assert new_problems(b, {"n0 gpu 0 held by x and y"}) == []


def test_each_problem_is_logged_at_error_once(caplog):
    check = BookCheck(broken_book(), enabled=True)
    with caplog.at_level(logging.ERROR, logger="coordinator.book_check"):
        check.after_cycle()
        check.after_cycle()
    assert [r.getMessage() for r in caplog.records] == ["book inconsistent: n0 gpu 0 held by x and y"]


def test_off_it_checks_nothing(caplog):
    with caplog.at_level(logging.ERROR, logger="coordinator.book_check"):
        BookCheck(broken_book(), enabled=False).after_cycle()
    assert caplog.records == []


def test_the_option():
    assert parse_args(ARGS).check_book is False
    assert parse_args([*ARGS, "--check-book"]).check_book is True


def test_the_bench_runs_at_its_smallest(capsys):
    from bench import book_check as bench

    bench.main(["--nodes", "5", "--gangs", "2", "--cross-az", "1", "--runs", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("machine: ") and lines[1].startswith("book: 5 nodes, 2 gangs holding 4 nodes")
    assert lines[2].startswith("problems(): median ")
