"""The pure decisions of the watch fan-out (coordinator/core/fanout.py):
caps per identity and in all, the per-stream buffer bound, what a resume
can be served from."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from coordinator.core.fanout import History, StreamBuffer, StreamCaps, StreamLimits, slow_reader


@pytest.mark.parametrize("per_identity,total,opened,who,cap,says", [
    (2, 10, ["a", "a"], "a", "per_identity", "a has 2 open, the per-identity cap is 2 (--watch-streams-per-identity)"),
    (2, 10, ["a", "a"], "b", "", ""),
    (5, 3, ["a", "b", "c"], "d", "total", "this coordinator has 3 open, the total cap is 3 (--watch-streams-total)"),
    (1, 1, ["a"], "a", "per_identity", "per-identity cap is 1"),  # both passed: the caller's own is named
    (3, 3, [], "a", "", ""),
])
def test_a_stream_past_a_cap_is_refused_naming_the_cap_and_the_count(
        per_identity: int, total: int, opened: list[str], who: str, cap: str, says: str) -> None:
    caps = StreamCaps(per_identity, total)
    for o in opened:
        assert caps.admit(o) == ("", "")
    got_cap, why = caps.admit(who)
    assert got_cap == cap
    assert says in why
    assert caps.open_total == len(opened) + (0 if cap else 1)  # a refusal counts nothing


def test_released_streams_make_room_again() -> None:
    caps = StreamCaps(2, 3)
    for o in ("a", "a", "b"):
        caps.admit(o)
    assert caps.top() == 2
    assert caps.admit("a")[0] == "per_identity"
    assert caps.admit("c")[0] == "total"
    caps.release("a")
    assert caps.open_of("a") == 1 and caps.top() == 1
    assert caps.admit("c") == ("", "")


def test_a_full_buffer_refuses_the_next_item_and_holds_nothing_more() -> None:
    b: StreamBuffer[int] = StreamBuffer(3)
    assert [b.offer(i) for i in range(3)] == [True, True, True]
    assert b.offer(3) is False
    assert b.overflowed and b.take() == []  # emptied at once: a dropped stream holds no memory
    assert b.offer(4) is False  # and takes nothing more


def test_a_buffer_drained_in_time_never_overflows() -> None:
    b: StreamBuffer[int] = StreamBuffer(2)
    for i in range(10):
        assert b.offer(i)
        assert b.take() == [i]


def test_the_slow_reader_message_names_the_bound_and_the_flag() -> None:
    assert "more than 7 changes behind" in slow_reader(7) and "--watch-buffer" in slow_reader(7)


@dataclass(frozen=True)
class C:
    revision: int


@pytest.mark.parametrize("bound,floor,revisions,after,held", [
    (4, 10, [11, 12, 13], 10, [11, 12, 13]),   # from the first read on: all held
    (4, 10, [11, 12, 13], 12, [13]),
    (4, 10, [11, 12, 13], 13, []),             # up to date
    (4, 10, [11, 12, 13], 20, []),             # ahead (another coordinator's newer view): nothing again
    (4, 10, [11, 12, 13], 9, None),            # before the first read: not held
    (2, 10, [11, 12, 13, 14], 12, [13, 14]),   # 11 and 12 let go: the floor is 12
    (2, 10, [11, 12, 13, 14], 11, None),       # 12 is gone: a resume after 11 would miss it
    (2, 10, [11, 11, 12], 10, None),           # one revision's two changes: the floor moves past both only together
])
def test_a_resume_is_served_from_the_history_only_when_it_holds_every_change_after(
        bound: int, floor: int, revisions: list[int], after: int, held: list[int] | None) -> None:
    h: History[C] = History(bound, floor)
    for r in revisions:
        h.add(C(r))
    got = h.since(after)
    assert (None if got is None else [c.revision for c in got]) == held


def test_limits_are_checked_naming_the_flag() -> None:
    assert StreamLimits().errors() == []
    errs = StreamLimits(per_identity=0, total=-1, buffer=True, history=2).errors()  # type: ignore[arg-type]
    assert [e.split()[0] for e in errs] == ["--watch-streams-per-identity", "--watch-streams-total", "--watch-buffer"]


BASE = ["--az", "az-a", "--id", "c0", "--etcd", "127.0.0.1:2379", "--insecure"]


def test_the_flags_reach_the_config() -> None:
    from coordinator.__main__ import parse_everything

    config = parse_everything([*BASE, "--watch-streams-per-identity", "3", "--watch-streams-total", "9",
                               "--watch-buffer", "5", "--watch-history", "7"])[0]
    assert config.watch == StreamLimits(per_identity=3, total=9, buffer=5, history=7)
    assert parse_everything(BASE)[0].watch == StreamLimits()


@pytest.mark.parametrize("flag", ["--watch-streams-per-identity", "--watch-streams-total", "--watch-buffer",
                                  "--watch-history"])
def test_a_bound_below_one_stops_the_start_naming_the_flag(flag: str) -> None:
    from coordinator.__main__ import parse_everything
    from phalanx.timings import ConfigError

    with pytest.raises(ConfigError, match=f"{flag} must be a whole number of at least 1, got 0"):
        parse_everything([*BASE, flag, "0"])


@pytest.mark.parametrize("kept,read,position,gone,changed", [
    (["a", "b"], [("a", 5), ("b", 7)], 10, [], []),              # nothing happened in the gap
    (["a", "b"], [("a", 5), ("b", 12)], 10, [], ["b"]),          # b changed in the gap
    (["a", "b"], [("b", 7)], 10, ["a"], []),                     # a deleted (retention) in the gap
    (["a"], [("a", 5), ("c", 11)], 10, [], ["c"]),               # c appeared in the gap
    (["a"], [("a", 10)], 10, [], []),                            # at the position: already sent
    ([], [], 10, [], []),
])
def test_after_a_compaction_only_what_changed_in_the_gap_is_sent(
        kept: list[str], read: list[tuple[str, int]], position: int, gone: list[str], changed: list[str]) -> None:
    from coordinator.core.fanout import after_compaction

    assert after_compaction(kept, read, position) == (gone, changed)
