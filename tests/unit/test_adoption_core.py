"""Which processes a restarted agent kills as orphans (agent/core/adoption.py):
only live ones carrying its own marker and a gang, outside every tracked
member's session and group. The real sweep: tests/integration/test_process_launcher.py."""

from __future__ import annotations

import pytest

from agent.core.adoption import OrphanProcess, ProcStat, orphan
from agent.launcher import MemberKey

AGENT = "node-a-1234"
MARKED = {"PHALANX_AGENT_ID": AGENT, "PHALANX_GANG": "llama", "PHALANX_INCARNATION": "3", "RANK": "5",
          "PATH": "/bin"}
MEMBER_SESSION, MEMBER_GROUP = 100, 200  # of the one tracked member


def stat(state: str = "S", sid: int = 300, pgid: int = 300) -> ProcStat:
    return ProcStat(pid=301, state=state, pgid=pgid, sid=sid, start_ticks=42)


def orphan_of(env: dict[str, str] | None, proc: ProcStat | None) -> OrphanProcess | None:
    return orphan(env, proc, agent_id=AGENT, member_sessions={MEMBER_SESSION}, member_groups={MEMBER_GROUP})


def test_a_live_marked_process_outside_every_member_is_an_orphan_named_by_its_markers() -> None:
    assert orphan_of(MARKED, stat()) == OrphanProcess(pid=301, pgid=300, key=MemberKey("llama", 3, 5))


@pytest.mark.parametrize("env, proc", [
    (None, stat()),
    ({}, stat()),
    ({**MARKED, "PHALANX_AGENT_ID": "node-b-5678"}, stat()),
    ({k: v for k, v in MARKED.items() if k != "PHALANX_AGENT_ID"}, stat()),
    ({k: v for k, v in MARKED.items() if k != "PHALANX_GANG"}, stat()),
    (MARKED, None),
    (MARKED, stat(state="Z")),
    (MARKED, stat(sid=MEMBER_SESSION)),
    (MARKED, stat(pgid=MEMBER_GROUP)),
], ids=["environ unreadable", "empty environ", "another agent's marker", "no agent marker", "no gang",
        "gone", "zombie", "in a member's session", "in a member's group"])
def test_not_an_orphan(env: dict[str, str] | None, proc: ProcStat | None) -> None:
    assert orphan_of(env, proc) is None


def test_an_orphan_whose_markers_do_not_parse_is_still_one_without_a_key() -> None:
    assert orphan_of({**MARKED, "PHALANX_INCARNATION": "x"}, stat()) == OrphanProcess(pid=301, pgid=300, key=None)
