"""How a member's end is reported, pure: the launcher's own exit codes and
the status a shim's exit record gives (docs/launcher.md "Exit codes")."""

from __future__ import annotations

from typing import Any, Mapping

# Exit code reported when a member could not be started at all (command not
# found, not executable, bad environment). 127 is the shell's "command not
# found", so operators and wrappers already read it that way.
EXIT_SPAWN_FAILED = 127
# Exit code reported when a member ended but its status cannot be known: it was
# adopted after an agent restart (only the parent may wait for a process), or it
# vanished while the agent was down. Negative like a signal so it never reads as
# success, but below any real signal number (1..64), so it is unambiguous.
EXIT_UNKNOWN = -255


def recorded_status(record: Mapping[str, Any] | None) -> tuple[int, float | None]:
    """(status, CLOCK_MONOTONIC end) from a shim exit record;
    (``EXIT_UNKNOWN``, None) without one."""
    if record is None:
        return EXIT_UNKNOWN, None
    return int(record["code"]), float(record["ended_mono"])
