"""Which finished gangs a collection sweep picks (coordinator/core/retention.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pytest

from coordinator.core.records import GangRecord, MemberAssignment
from coordinator.core.retention import FinishedGang, due_for_collection
from phalanx.model import GangState
from phalanx.spec import parse_spec

AZ = "az-a"
NOW = 1_000_000.0
RETENTION = 100.0


def gang(id: str, ended: float = 500.0, state: GangState = GangState.SUCCEEDED, owner: str = AZ) -> FinishedGang:
    """A gang that ended ``ended`` seconds before NOW."""
    return FinishedGang(id=id, state=state, owner_az=owner, ended_at=NOW - ended, mod_revision=7)


@dataclass(frozen=True)
class Row:
    id: str
    gangs: Sequence[FinishedGang]
    expect: list[str]
    limit: int = 10
    held: frozenset[str] = field(default_factory=frozenset)


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
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_due_for_collection(row: Row) -> None:
    due = due_for_collection(row.gangs, az=AZ, now=NOW, retention_s=RETENTION, limit=row.limit, held=row.held)
    assert [g.id for g in due] == row.expect


def test_finished_gang_keeps_what_collection_needs() -> None:
    spec = parse_spec({"name": "x", "members": 2, "resources": {"gpus": 1}})
    rec = GangRecord(id="x-1", spec=spec, state=GangState.CANCELLED, owner_az=AZ, submitted_at=1.0, updated_at=5.0,
                     idempotency_key="k", mod_revision=42,
                     placement=(MemberAssignment(0, "az-a", "n0", (0,), ()), MemberAssignment(1, "az-b", "n1", (0,), ())))
    assert FinishedGang.of(rec) == FinishedGang(id="x-1", state=GangState.CANCELLED, owner_az=AZ, ended_at=5.0,
                                                mod_revision=42, idempotency_key="k", azs=frozenset({"az-a", "az-b"}))
