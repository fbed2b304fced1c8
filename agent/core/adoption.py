"""Which processes a restarted agent's launcher kills as orphans, pure
(docs/launcher.md "Adoption after an agent restart"). ``agent.process`` reads
``/proc`` (agent/procfs.py) and hands in what it read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping

from agent.core.member_env import ENV_AGENT_ID, ENV_GANG, member_key_from_env
from agent.launcher import MemberKey


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` the launcher needs."""

    pid: int
    state: str  # R, S, D, Z, T, ...
    pgid: int
    sid: int
    start_ticks: int  # field 22: start time after boot, in clock ticks

    @property
    def alive(self) -> bool:
        # A zombie has finished; it only waits for its parent to reap it.
        return self.state not in ("Z", "X", "x")


@dataclass(frozen=True)
class OrphanProcess:
    """A process carrying this agent's marker that no state record accounts for."""

    pid: int
    pgid: int
    key: MemberKey | None  # from its PHALANX_* environment, when parseable


def orphan(env: Mapping[str, str] | None, stat: ProcStat | None, *, agent_id: str,
           member_sessions: Collection[int], member_groups: Collection[int]) -> OrphanProcess | None:
    """The process ``stat`` describes as an orphan of this agent, or None: an
    orphan is alive, carries this agent's marker and a gang, and is in no
    tracked member's session or process group. A member's descendants
    inherit its marker; they belong to the member as long as they stay in its
    session (or at least its group). A process without this agent's marker is
    never an orphan."""
    if not env or env.get(ENV_AGENT_ID) != agent_id or ENV_GANG not in env:
        return None
    if stat is None or not stat.alive or stat.sid in member_sessions or stat.pgid in member_groups:
        return None
    return OrphanProcess(pid=stat.pid, pgid=stat.pgid, key=member_key_from_env(env))
