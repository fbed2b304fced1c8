"""Where a member's output and exit record live on its node, and how they read.

The launcher (agent/process.py) writes them; ``phalanx logs`` (phalanx/cli/local.py)
reads them, on the node or from a copy of agents' state directories. Both use
this module, so the CLI needs nothing of the launcher:

    <state_dir>/logs/<gang>/<incarnation>/rank-<rank>.log   the member's stdout+stderr
    <state_dir>/logs/<gang>/<incarnation>/rank-<rank>.exit  its shim's exit record

The launcher marks the log with lines of its own (``mark_line``); a log whose
member is over ends with an end mark (``has_end_mark``). The shim
(agent/shim.py) runs with no project imports and is told its exit record's
path on its command line, so it holds no copy of this layout.

Shared: imports nothing of ``coordinator`` or ``agent``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MemberKey:
    """One member: a rank of a gang's incarnation (it names its log too)."""

    gang: str
    incarnation: int
    rank: int

    def __str__(self) -> str:
        return f"{self.gang}#{self.incarnation}/r{self.rank}"


def path_component(name: str) -> str:
    """``name`` if it is safe as one directory name, else ValueError. Gang
    names are DNS labels by spec validation; anything that could escape the
    log directory is refused anyway, since the path is built from wire data."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"unsafe gang name for a log path: {name!r}")
    return name


LOGS_DIR = "logs"  # under an agent's state dir


def logs_root(state_dir: Path) -> Path:
    """``<state_dir>/logs``: every member log and exit record of one agent."""
    return Path(state_dir) / LOGS_DIR


def member_log_path(state_dir: Path, key: MemberKey) -> Path:
    """``<state_dir>/logs/<gang>/<incarnation>/rank-<rank>.log``."""
    return logs_root(state_dir) / path_component(key.gang) / str(key.incarnation) / f"rank-{key.rank}.log"


def exit_path_for(log_path: Path) -> Path:
    """The exit record next to a member's log: ``rank-<rank>.exit``."""
    return Path(log_path).with_suffix(".exit")


def member_exit_path(state_dir: Path, key: MemberKey) -> Path:
    """``<state_dir>/logs/<gang>/<incarnation>/rank-<rank>.exit``: the shim's
    exit record (agent/shim.py), next to the member's log."""
    return exit_path_for(member_log_path(state_dir, key))


def read_log(
    state_dir: Path,
    gang: str,
    incarnation: int | None = None,
    rank: int | None = None,
) -> list[tuple[MemberKey, Path]]:
    """The log files of a gang on this node, sorted by (incarnation, rank).

    ``incarnation=None`` means every incarnation found; ``rank=None`` every rank.
    Missing directories yield an empty list (the gang never ran here)."""
    root = logs_root(state_dir) / path_component(gang)
    found: list[tuple[MemberKey, Path]] = []
    if not root.is_dir():
        return found
    for inc_dir in root.iterdir():
        if not inc_dir.is_dir() or not inc_dir.name.isdigit():
            continue
        inc = int(inc_dir.name)
        if incarnation is not None and inc != incarnation:
            continue
        for path in inc_dir.glob("rank-*.log"):
            rank_text = path.name[len("rank-"):-len(".log")]
            if not rank_text.isdigit():
                continue
            r = int(rank_text)
            if rank is not None and r != rank:
                continue
            found.append((MemberKey(gang, inc, r), path))
    found.sort(key=lambda item: (item[0].incarnation, item[0].rank))
    return found


# The launcher's own lines in a member's log: ``[phalanx <stamp>] <text>``.
# The words that begin a line after which the member writes no more: its
# exit, a failed start, or its vanishing while the agent was down.
END_WORDS = ("exit", "failed to start", "vanished")
_END_MARK = re.compile(r"^\[phalanx [^\]]*\] (" + "|".join(map(re.escape, END_WORDS)) + ") ", re.M)


def mark_line(stamp: str, text: str) -> str:
    """One line the launcher adds to a member's log (``text`` starts with one
    of END_WORDS when the member is over)."""
    return f"[phalanx {stamp}] {text}\n"


def has_end_mark(text: str) -> bool:
    """Whether ``text`` (whole lines of a member's log) holds an end mark."""
    return _END_MARK.search(text) is not None
