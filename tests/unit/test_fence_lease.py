"""The fence lease file shared by the agent (LeaseWriter) and the member shim
(read_lease): format, atomic replacement, cheap writes (agent/shim.py)."""

from __future__ import annotations

from pathlib import Path

from agent.shim import LeaseWriter, read_lease, write_lease


def test_round_trip_and_unreadable_values(tmp_path: Path) -> None:
    p = tmp_path / "fence-lease"
    assert read_lease(p) is None
    write_lease(p, 1234.5)
    assert read_lease(p) == 1234.5
    assert [f.name for f in tmp_path.iterdir()] == ["fence-lease"], "no temporary file left behind"
    for garbage in ("", "abc\n", "nan\n", "inf\n", "\xff"):
        p.write_text(garbage, encoding="latin-1")
        assert read_lease(p) is None


def test_writer_throttles_small_moves_and_flushes_them(tmp_path: Path) -> None:
    p = tmp_path / "fence-lease"
    w = LeaseWriter(p, min_interval_s=3600.0, jump_s=1.0)
    w.update(100.0)
    assert read_lease(p) == 100.0  # the first value is always written
    w.update(100.5)
    assert read_lease(p) == 100.0  # small move within the interval: pending
    w.flush()
    assert read_lease(p) == 100.5
    w.update(102.0)
    assert read_lease(p) == 102.0  # a jump is written at once
    w.update(102.1, force=True)
    assert read_lease(p) == 102.1


def test_writer_survives_an_unwritable_directory(tmp_path: Path) -> None:
    w = LeaseWriter(tmp_path / "missing-dir" / "fence-lease")
    w.update(1.0)  # logged, not raised: the shims then fence (safe direction)
    assert w.written is None
    (tmp_path / "missing-dir").mkdir()
    w.flush()
    assert w.written == 1.0 and read_lease(tmp_path / "missing-dir" / "fence-lease") == 1.0
