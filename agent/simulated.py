"""Simulated members: asyncio timers that 'run' for the spec's duration_s.

For `phalanx up`, scale tests and benchmarks: hundreds of agents in one
process, no real processes. Same interface as the real launcher.
"""

from __future__ import annotations

import asyncio
import inspect
import time

from agent.launcher import ExitCallback, MemberHandle, MemberKey, MemberLaunch


class SimulatedLauncher:
    def __init__(self, on_exit: ExitCallback):
        self.on_exit = on_exit
        self._members: dict[MemberKey, tuple[MemberHandle, asyncio.Task]] = {}

    async def start(self, launch: MemberLaunch) -> MemberHandle:
        handle = MemberHandle(launch.key, 0, time.time(), launch.gpus, launch.nics, launch.epoch)
        task = asyncio.create_task(self._run(launch.key, launch.duration_s), name=f"sim-{launch.key}")
        self._members[launch.key] = (handle, task)
        return handle

    async def _run(self, key: MemberKey, duration_s: float) -> None:
        code = 0
        try:
            await asyncio.sleep(duration_s)
        except asyncio.CancelledError:
            code = -15  # as if SIGTERM
        self._members.pop(key, None)
        r = self.on_exit(key, code)
        if inspect.isawaitable(r):
            await r

    async def stop(self, key: MemberKey, grace_s: float) -> None:
        entry = self._members.get(key)
        if entry is None:
            return
        _, task = entry
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if self._members.pop(key, None) is not None:
            # Stopped before its task took its first step (right after
            # start): _run never ran, so its exit is reported here.
            r = self.on_exit(key, -15)
            if inspect.isawaitable(r):
                await r

    async def stop_all(self, grace_s: float) -> None:
        await asyncio.gather(*(self.stop(k, grace_s) for k in list(self._members)))

    def running(self) -> list[MemberHandle]:
        return [h for h, _ in self._members.values()]

    async def adopt(self) -> list[MemberHandle]:
        return []

    async def close(self) -> None:
        # Simulated members cannot outlive the process: stop them.
        await self.stop_all(0)
