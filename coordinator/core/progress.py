"""Run-time progress of a reserved gang from its members' reports (pure).

All-or-nothing at run time too: the gang is RUNNING only when every member
has started; one failed member fails the gang (the restart policy of issue 4
builds on this); SUCCEEDED only when every member exited 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from phalanx.model import GangState, MemberPhase


@dataclass(frozen=True)
class MemberReport:
    phase: MemberPhase
    exit_code: int = 0
    reason: str = ""
    node: str = ""


@dataclass(frozen=True)
class Transition:
    to: GangState
    reason: str
    # Every member has started by this step: the RUNNING step, or a gang
    # whose members all exited 0 before the leader saw them all running
    # (its `started` event is written with the SUCCEEDED step then).
    all_started: bool = False


def evaluate(state: GangState, world_size: int, members: Mapping[int, MemberReport]) -> Transition | None:
    """The next gang state implied by the member reports, or None."""
    if state not in (GangState.RESERVED, GangState.STARTING, GangState.RUNNING):
        return None
    for rank in sorted(members):
        m = members[rank]
        if m.phase == MemberPhase.REJECTED:
            return Transition(GangState.FAILED, f"rank {rank} rejected by agent on {m.node}: {m.reason}")
        if m.phase == MemberPhase.FAILED:
            return Transition(GangState.FAILED, f"rank {rank} on {m.node} exited with code {m.exit_code}{': ' + m.reason if m.reason else ''}")
        if m.phase == MemberPhase.STOPPED:
            return Transition(GangState.FAILED, f"rank {rank} on {m.node} was stopped: {m.reason or 'by its agent'}")
    reported = [members[r] for r in range(world_size) if r in members]
    if len(reported) == world_size and all(m.phase == MemberPhase.SUCCEEDED for m in reported):
        return Transition(GangState.SUCCEEDED, f"all {world_size} members exited 0",
                          all_started=state != GangState.RUNNING)
    if state != GangState.RUNNING and len(reported) == world_size and all(
        m.phase in (MemberPhase.RUNNING, MemberPhase.SUCCEEDED) for m in reported
    ):
        return Transition(GangState.RUNNING, f"all {world_size} members started", all_started=True)
    return None
