"""Which finished gangs a collection sweep picks (coordinator/core/retention.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pytest

from coordinator.core.records import UNREADABLE, GangRecord, MemberAssignment
from coordinator.core.retention import ExpiredGang, FinishedGang, due_for_collection, expired_to_trim
from phalanx.limits import json_bytes
from phalanx.model import GangState
from phalanx.spec import parse_spec

AZ = "az-a"
NOW = 1_000_000.0
RETENTION = 100.0


def gang(id: str, ended: float = 500.0, state: GangState = GangState.SUCCEEDED, owner: str = AZ,
         size: int = 100) -> FinishedGang:
    """A gang that ended ``ended`` seconds before NOW, its record ``size`` bytes."""
    return FinishedGang(id=id, state=state, owner_az=owner, ended_at=NOW - ended, mod_revision=7, size=size)


def young(n: int, size: int = 100, first: int = 0) -> list[FinishedGang]:
    """``n`` gangs y<first>.. within retention, y<first> the oldest."""
    return [gang(f"y{i}", ended=50 - i * 0.1, size=size) for i in range(first, first + n)]


@dataclass(frozen=True)
class Row:
    id: str
    gangs: Sequence[FinishedGang]
    expect: list[str]
    limit: int = 10
    held: frozenset[str] = field(default_factory=frozenset)
    max_kept: int | None = None
    max_kept_bytes: int | None = None


ROWS = [
    Row("nothing finished: nothing due", [], []),
    Row("each terminal state is collected past retention",
        [gang("s", state=GangState.SUCCEEDED), gang("f", state=GangState.FAILED), gang("c", state=GangState.CANCELLED)],
        ["c", "f", "s"]),
    Row("a gang that ended within retention is kept", [gang("young", ended=RETENTION - 1)], []),
    Row("exactly at retention is not yet due", [gang("edge", ended=RETENTION)], []),
    Row("just past retention is due", [gang("past", ended=RETENTION + 0.001)], ["past"]),
    Row("live and restarting gangs are never due, however old",
        [gang("p", state=GangState.PENDING), gang("run", state=GangState.RUNNING),
         gang("rs", state=GangState.RESTARTING), gang("rv", state=GangState.RESERVING)], []),
    Row("another AZ's gangs are its leader's to collect", [gang("theirs", owner="az-b")], []),
    Row("a gang still held (RELEASING, or a hold here) is skipped", [gang("h"), gang("free")], ["free"],
        held=frozenset({"h"})),
    Row("oldest end first, then id", [gang("b", ended=300), gang("a", ended=300), gang("old", ended=900)],
        ["old", "a", "b"]),
    Row("at most limit per sweep, the oldest", [gang(f"g{i}", ended=200 + i) for i in range(5)], ["g4", "g3"],
        limit=2),
    Row("limit zero collects nothing", [gang("g")], [], limit=0),
    Row("an end in the future (a clock ahead) is not due", [gang("future", ended=-50)], []),
    # Bounded by count and bytes, not only by age (docs/etcd-keys.md "Retention by count and bytes").
    Row("within the count bound nothing young is due", young(3), [], max_kept=3),
    Row("past the count bound the oldest go first, young as they are", young(5), ["y0", "y1"], max_kept=3),
    Row("a count bound of zero keeps none", young(2), ["y0", "y1"], max_kept=0),
    Row("aged gangs count toward the excess: no young one goes for them",
        [gang("old", ended=900)] + young(3), ["old"], max_kept=3),
    Row("held gangs take room but are not collected: the oldest unheld go instead",
        young(5), ["y1", "y2"], held=frozenset({"y0"}), max_kept=3),
    Row("another AZ's gangs count for its own bound, not this one's",
        young(3) + [gang("theirs", ended=10, owner="az-b")], [], max_kept=3),
    Row("live gangs do not count toward the bound",
        young(3) + [gang("run", ended=10, state=GangState.RUNNING)], [], max_kept=3),
    Row("within the bytes bound nothing young is due", young(4, size=250), [], max_kept_bytes=1000),
    Row("past the bytes bound the oldest go until the rest fits", young(4, size=300), ["y0", "y1"],
        max_kept_bytes=600),
    Row("one large record goes for many small ones' room",
        [gang("big", ended=60, size=5000)] + young(3), ["big"], max_kept_bytes=1000),
    Row("both bounds: the stricter one decides", young(6, size=100), ["y0", "y1", "y2", "y3"], max_kept=4,
        max_kept_bytes=200),
    Row("the bound's overflow is capped by limit like the rest, oldest first", young(6), ["y0", "y1"], limit=2,
        max_kept=1),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_due_for_collection(row: Row) -> None:
    due = due_for_collection(row.gangs, az=AZ, now=NOW, retention_s=RETENTION, limit=row.limit, held=row.held,
                             max_kept=row.max_kept, max_kept_bytes=row.max_kept_bytes)
    assert [g.id for g in due] == row.expect


def test_finished_gang_keeps_what_collection_needs() -> None:
    spec = parse_spec({"name": "x", "members": 2, "resources": {"gpus": 1}})
    rec = GangRecord(id="x-1", spec=spec, state=GangState.CANCELLED, owner_az=AZ, submitted_at=1.0, updated_at=5.0,
                     idempotency_key="k", mod_revision=42,
                     placement=(MemberAssignment(0, "az-a", "n0", (0,), ()), MemberAssignment(1, "az-b", "n1", (0,), ())))
    assert FinishedGang.of(rec) == FinishedGang(id="x-1", state=GangState.CANCELLED, owner_az=AZ, ended_at=5.0,
                                                mod_revision=42, idempotency_key="k", azs=frozenset({"az-a", "az-b"}),
                                                size=json_bytes(rec.to_dict()))
    assert FinishedGang.of(rec).size > 100  # a record's JSON, not a placeholder


TRIM = [
    ("none kept yet", 0, 10, 5, 0),
    ("at the bound: nothing to trim", 10, 10, 5, 0),
    ("beyond the bound: the excess", 13, 10, 5, 3),
    ("a large excess: at most limit per sweep", 100, 10, 5, 5),
    ("a bound of zero keeps none", 4, 0, 5, 4),
]


@pytest.mark.parametrize("count,bound,limit,expect", [r[1:] for r in TRIM], ids=[r[0] for r in TRIM])
def test_expired_to_trim(count: int, bound: int, limit: int, expect: int) -> None:
    assert expired_to_trim(count, bound, limit) == expect


def test_expired_gang_round_trips_and_refuses_what_cannot_have_expired() -> None:
    e = ExpiredGang(id="x-1", state=GangState.FAILED, owner_az=AZ, owner="submitter/alice", ended_at=5.0,
                    collected_at=9.0)
    assert ExpiredGang.from_dict(e.to_dict()) == e
    assert gang("g", state=GangState.CANCELLED).expired(collected_at=3.0).state == GangState.CANCELLED
    with pytest.raises(UNREADABLE):
        ExpiredGang.from_dict({**e.to_dict(), "state": "RUNNING"})
    with pytest.raises(UNREADABLE):
        ExpiredGang.from_dict({"id": "x-1"})
