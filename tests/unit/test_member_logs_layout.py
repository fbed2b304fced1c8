"""phalanx/member_logs.py: the layout the launcher writes by and `phalanx
logs` reads by (paths, the listing of a gang's logs, which marks end a log)."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.member_logs import (END_WORDS, MemberKey, exit_path_for, has_end_mark, mark_line, member_exit_path,
                                 member_log_path, read_log)


def test_a_members_log_and_exit_record_sit_side_by_side(tmp_path: Path) -> None:
    key = MemberKey("g-00000001", 3, 2)
    assert member_log_path(tmp_path, key) == tmp_path / "logs" / "g-00000001" / "3" / "rank-2.log"
    assert member_exit_path(tmp_path, key) == tmp_path / "logs" / "g-00000001" / "3" / "rank-2.exit"
    assert exit_path_for(member_log_path(tmp_path, key)) == member_exit_path(tmp_path, key)


@pytest.mark.parametrize("gang", ["", ".", "..", "a/b", "nul\x00"])
def test_a_gang_name_that_could_leave_the_log_directory_is_refused(tmp_path: Path, gang: str) -> None:
    with pytest.raises(ValueError, match="unsafe gang name"):
        member_log_path(tmp_path, MemberKey(gang, 1, 0))
    with pytest.raises(ValueError, match="unsafe gang name"):
        read_log(tmp_path, gang)


def test_the_listing_is_sorted_and_filtered_and_skips_foreign_files(tmp_path: Path) -> None:
    keys = [MemberKey("g", 2, 1), MemberKey("g", 1, 1), MemberKey("g", 2, 0), MemberKey("g", 10, 0)]
    for k in keys:
        p = member_log_path(tmp_path, k)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("")
    (member_log_path(tmp_path, keys[0]).parent / "rank-x.log").write_text("")
    (tmp_path / "logs" / "g" / "notes").mkdir()
    assert [k for k, _ in read_log(tmp_path, "g")] == [MemberKey("g", 1, 1), MemberKey("g", 2, 0),
                                                       MemberKey("g", 2, 1), MemberKey("g", 10, 0)]
    assert [k for k, _ in read_log(tmp_path, "g", incarnation=2, rank=1)] == [MemberKey("g", 2, 1)]
    assert read_log(tmp_path, "never-ran") == []


@pytest.mark.parametrize("text,ends", [
    (mark_line("2024-06-01T08:32:54+0000", "start g#1/r0 epoch=2 gpus=[0]"), False),
    *[(mark_line("2024-06-01T08:32:59+0000", f"{word} g#1/r0 ..."), True) for word in END_WORDS],
    ("hello\n" + mark_line("t", "exit g#1/r0 code=0"), True),
    ("the member printed: [phalanx t] exit g#1/r0 code=0\n", False),  # not at a line start
    ("exit g#1/r0 code=0\n", False),  # the member's own words, not the launcher's mark
])
def test_only_the_launchers_end_marks_end_a_log(text: str, ends: bool) -> None:
    assert has_end_mark(text) is ends
