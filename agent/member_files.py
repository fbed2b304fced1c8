"""A member's files on its node: the launcher's marks in its log, its work
directory, and their retention (docs/launcher.md "Logs"). The log layout is
phalanx/member_logs.py: this module writes by it, and readers (`phalanx
logs`, tests) import it from there; which directories are stale is the pure
``agent.core.log_retention``."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Collection

from agent.core.log_retention import stale_log_dirs
from agent.core.run_as import Account
from agent.launcher import MemberKey
from phalanx.member_logs import logs_root, mark_line, path_component

log = logging.getLogger(__name__)


def member_work_path(work_root: Path, key: MemberKey) -> Path:
    """``<work_root>/<gang>/<incarnation>/rank-<rank>``: the member's own directory."""
    return Path(work_root) / path_component(key.gang) / str(key.incarnation) / f"rank-{key.rank}"


def make_work_dir(work_root: Path, key: MemberKey, account: Account | None) -> Path:
    """The member's own directory, owned by ``account`` (None: the
    agent's user), mode 0700. The directories above it are the agent's,
    mode 0711: a member can pass through them to its own directory but
    neither list nor change them, so it cannot reach another member's."""
    path = member_work_path(work_root, key)
    for directory in (work_root, path.parent.parent, path.parent):
        directory.mkdir(exist_ok=True)
        os.chmod(directory, 0o711)
    path.mkdir(exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} is not a directory")
    if account is not None:
        os.chown(path, account.uid, account.gid, follow_symlinks=False)
    os.chmod(path, 0o700, follow_symlinks=False)
    return path


def append_log_line(path: Path, text: str) -> None:
    """A mark in the member's own log (start, exit, spawn failure), so that
    `phalanx logs` tells the whole story; a failure here never matters."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        # 0600 when this creates it: a member's log is the agent's, not its readers'.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with open(fd, "a", encoding="utf-8") as stream:
            stream.write(mark_line(stamp, text))
    except OSError:
        log.warning("cannot write to member log %s", path, exc_info=True)


def prune_member_files(state_dir: Path, work_root: Path, *, live: Collection[tuple[str, int]],
                       now: float, retention_s: float) -> list[Path]:
    """Delete ``logs/<gang>/<incarnation>/`` directories (member logs and exit
    records) that ``stale_log_dirs`` chooses, with the members' work dirs of
    that incarnation; returns the log directories removed."""
    root = logs_root(state_dir)
    listing: list[tuple[str, int, float]] = []
    for gang_dir in _subdirs(root):
        for inc_dir in _subdirs(gang_dir):
            if inc_dir.name.isdigit():
                listing.append((gang_dir.name, int(inc_dir.name), _newest_mtime(inc_dir)))
    removed = []
    for gang, inc in stale_log_dirs(listing, live=live, now=now, retention_s=retention_s):
        path = root / gang / str(inc)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
        # The members' work dirs go with their logs (same retention).
        shutil.rmtree(work_root / gang / str(inc), ignore_errors=True)
        for parent in (root / gang, work_root / gang):
            with contextlib.suppress(OSError):
                parent.rmdir()  # only when that was its last incarnation
    return removed


def _subdirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []


def _newest_mtime(path: Path) -> float:
    newest = path.stat().st_mtime
    for child in path.iterdir():
        with contextlib.suppress(OSError):
            newest = max(newest, child.stat().st_mtime)
    return newest
