"""Processes as the launcher sees them (docs/launcher.md "Adoption after an
agent restart"): ``/proc/<pid>/stat`` and ``environ``, whether a recorded
process is still the same one, and signalling a member's process group and
waiting for it to be gone. Linux only."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Iterator

from agent.core.adoption import ProcStat

log = logging.getLogger(__name__)


def read_proc_stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat``, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = data[data.rindex(b")") + 2:].split()
    # rest[0] is field 3, so field n is rest[n - 3].
    return ProcStat(
        pid=pid,
        state=rest[0].decode(),
        pgid=int(rest[2]),
        sid=int(rest[3]),
        start_ticks=int(rest[19]),
    )


def read_proc_environ(pid: int) -> dict[str, str] | None:
    """The environment a process was started with, or None if unreadable.

    /proc shows the block given to exec, not later setenv() calls, so a member
    cannot hide its Phalanx marker by editing its environment at run time."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    env: dict[str, str] = {}
    for entry in data.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep:
            env[name.decode(errors="replace")] = value.decode(errors="replace")
    return env


def all_pids() -> Iterator[int]:
    """Every process id in /proc."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def same_process_alive(pid: int, start_ticks: int) -> bool:
    """Whether ``pid`` is alive and is still the process that started at
    ``start_ticks`` (not a successor that took its pid)."""
    st = read_proc_stat(pid)
    return st is not None and st.alive and st.start_ticks == start_ticks


def group_has_live_process(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is alive (zombies are not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone's there; find out below whether it is only zombies
    # kill(0) succeeds on zombies too, and a zombie whose parent never reaps it
    # (some container inits) would otherwise look alive forever.
    for pid in all_pids():
        st = read_proc_stat(pid)
        if st is not None and st.pgid == pgid and st.alive:
            return True
    return False


def signal_group(pgid: int, sig: int) -> None:
    """``sig`` to a member's process group; never to the agent's own or init's."""
    # A member always leads its own session, so a pgid equal to ours means a
    # corrupt record.
    if pgid <= 1 or pgid == os.getpgrp():
        log.error("refusing to signal process group %d (not a member's group)", pgid)
        return
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        log.warning("no permission to signal process group %d", pgid)


async def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Until no process of ``pgid`` is alive (True) or ``timeout_s`` has
    passed (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = 0.01
    while group_has_live_process(pgid):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)
    return True


def open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``, or None (the caller then polls)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        # No pidfd (old kernel, seccomp) or the process is already gone: the
        # caller falls back to polling, which notices the latter at once.
        return None
