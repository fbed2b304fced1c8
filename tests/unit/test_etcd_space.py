"""How full etcd is and what a coordinator says about it (coordinator/core/etcd_space.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from coordinator.core.etcd_space import EtcdSpace, SpaceLevel, notice

Q = 1000


@dataclass(frozen=True)
class LevelRow:
    id: str
    space: EtcdSpace
    expect: SpaceLevel


LEVELS = [
    LevelRow("empty is ok", EtcdSpace(0, Q), SpaceLevel.OK),
    LevelRow("just under 80 % is ok", EtcdSpace(799, Q), SpaceLevel.OK),
    LevelRow("80 % warns", EtcdSpace(800, Q), SpaceLevel.WARNING),
    LevelRow("past the quota without an alarm still only warns", EtcdSpace(1200, Q), SpaceLevel.WARNING),
    LevelRow("NOSPACE is the alarm whatever the size (after a defrag, before the disarm)",
             EtcdSpace(10, Q, ("NOSPACE",)), SpaceLevel.ALARM),
    LevelRow("another alarm (CORRUPT) is not the space alarm", EtcdSpace(10, Q, ("CORRUPT",)), SpaceLevel.OK),
    LevelRow("no quota known: never a warning", EtcdSpace(10**12, 0), SpaceLevel.OK),
]


@pytest.mark.parametrize("row", LEVELS, ids=[r.id for r in LEVELS])
def test_level(row: LevelRow) -> None:
    assert row.space.level == row.expect


@dataclass(frozen=True)
class NoticeRow:
    id: str
    before: SpaceLevel | None
    now: EtcdSpace
    expect: tuple[bool, str] | None  # (at ERROR, a phrase of the line), or nothing logged


NOTICES = [
    NoticeRow("first reading ok: silent", None, EtcdSpace(1, Q), None),
    NoticeRow("first reading already warning: said", None, EtcdSpace(900, Q), (True, "etcd is nearly full")),
    NoticeRow("first reading already alarm: said", None, EtcdSpace(900, Q, ("NOSPACE",)),
              (True, "space alarm (NOSPACE) is active")),
    NoticeRow("ok to warning: ERROR with the steps", SpaceLevel.OK, EtcdSpace(850, Q), (True, "etcdctl compaction")),
    NoticeRow("warning to alarm: ERROR with the steps", SpaceLevel.WARNING, EtcdSpace(990, Q, ("NOSPACE",)),
              (True, "etcdctl alarm disarm")),
    NoticeRow("alarm stays alarm: said once only", SpaceLevel.ALARM, EtcdSpace(990, Q, ("NOSPACE",)), None),
    NoticeRow("warning stays warning: said once only", SpaceLevel.WARNING, EtcdSpace(810, Q), None),
    NoticeRow("alarm to ok (recovered): INFO", SpaceLevel.ALARM, EtcdSpace(100, Q), (False, "etcd has room again")),
    NoticeRow("alarm to warning (disarmed, still big): ERROR", SpaceLevel.ALARM, EtcdSpace(900, Q),
              (True, "etcd is nearly full")),
]


@pytest.mark.parametrize("row", NOTICES, ids=[r.id for r in NOTICES])
def test_notice(row: NoticeRow) -> None:
    got = notice(row.before, row.now)
    if row.expect is None:
        assert got is None
    else:
        assert got is not None and got.error == row.expect[0] and row.expect[1] in got.text, got


def test_describe_names_size_quota_and_alarms() -> None:
    text = EtcdSpace(int(1.6 * 1024**3), 2 * 1024**3, ("NOSPACE",)).describe()
    assert text == "etcd database 1.6 GiB of 2.0 GiB quota (80%), alarms: NOSPACE"
