"""How an agent starts and stops gang members: the interface.

Two implementations share it:
- ``agent.simulated.SimulatedLauncher``: members are asyncio timers that run for
  the spec's ``run.duration_s`` (scale tests, benchmarks, `phalanx up`).
- ``agent.process.ProcessLauncher``: members are real processes in their own
  process groups (docs/launcher.md).

The agent's session driver owns the decisions (epoch rule, device ledger,
fencing); a launcher only performs them and reports exits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Protocol

# A member's key names its log too (phalanx/member_logs.py), which the CLI
# reads without the agent: it is defined there.
from phalanx.member_logs import MemberKey


@dataclass(frozen=True)
class MemberLaunch:
    """Everything needed to start one member; built from an Assignment."""

    key: MemberKey
    world_size: int
    local_rank: int
    local_world_size: int
    gpus: tuple[int, ...]
    nics: tuple[str, ...]
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    duration_s: float = 0.0
    master_addr: str = ""
    master_port: int = 0
    epoch: int = 0  # epoch of the leader whose assignment caused the start
    node: str = ""
    placement: str = ""  # human-readable placement summary, exported as PHALANX_PLACEMENT
    # The gang's owner ("<role>/<name>", "" for a plaintext submission): whom
    # a real member runs as comes from it (agent.core.run_as).
    owner: str = ""


@dataclass(frozen=True)
class MemberHandle:
    key: MemberKey
    pid: int  # 0 for simulated members
    started_at: float  # unix seconds
    gpus: tuple[int, ...] = ()
    nics: tuple[str, ...] = ()
    epoch: int = 0


# Called once per member when it ends, whatever the cause (exit, stop, fence):
# on_exit(key, exit_code[, ended_mono]). exit_code: the process's code; negative
# = killed by that signal. ended_mono (optional, may be None): the
# CLOCK_MONOTONIC time by which the member was known gone, when that is earlier
# than the call (it ended while the agent was down and its shim recorded when);
# None means "now". Launchers that never learn of an end late pass only two.
ExitCallback = Callable[..., Awaitable[None] | None]


class Launcher(Protocol):
    async def start(self, launch: MemberLaunch) -> MemberHandle:
        """Start a member; return once it is started (the process exists).
        Raises when the member must not run at all (``agent.run_as.RunAsRefused``:
        its owner's run-as policy); nothing was started, and the agent fails
        the member with the exception's text as its reason."""

    async def stop(self, key: MemberKey, grace_s: float) -> None:
        """Stop a member: SIGTERM to its group, SIGKILL after ``grace_s``.
        Idempotent; returns when it is gone. Its exit is still reported."""

    async def stop_all(self, grace_s: float) -> None:
        """Stop every member (self-fencing, shutdown)."""

    def running(self) -> list[MemberHandle]:
        """Members started (or adopted) and not yet exited."""

    async def adopt(self) -> list[MemberHandle]:
        """After an agent restart: re-attach to this agent's own live members
        (from its state file, checked by pid and start time); kill processes it
        started but cannot account for. Simulated launchers adopt nothing."""

    async def close(self) -> None:
        """Release resources without stopping members (restart keeps them)."""


def agent_identity(node: str, state_dir: "object | None") -> str:
    """An agent's id: stable across restarts of the same agent (adoption
    matches members by it) and distinct between agents on one host that
    happen to share a node name (e.g. two test clusters), because a starting
    agent kills unaccounted processes that carry its id."""
    if state_dir is None:
        return f"{node}-agent"
    import hashlib
    import os

    digest = hashlib.sha1(os.path.abspath(str(state_dir)).encode()).hexdigest()[:8]
    return f"{node}-{digest}"
