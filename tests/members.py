"""What tests with real members need now that members never run as root.

When the suite runs as root, an agent runs each member as ``nobody`` (its
default run-as policy, docs/launcher.md), so a member can only use what that
user can reach:

- ``MEMBER_PYTHON``: an interpreter ``nobody`` can execute. The suite's own
  may sit in a virtualenv under a home directory closed to others (/root is
  0700), so a member command uses this one; member code needs only the
  standard library.
- ``member_tmp``: like ``tmp_path``, but reachable by other users (pytest's
  tmp dirs live under /tmp/pytest-of-<user>, mode 0700): a fresh directory
  under the system temp dir, mode 0711, removed afterwards. ``writable(d)``
  makes a directory in it that members can write results into.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest


def reachable_by_others(path: str | os.PathLike[str]) -> bool:
    """Whether a user other than the owner can execute ``path``: every
    directory on the way searchable by others, the file executable by them."""
    real = Path(os.path.realpath(path))
    try:
        if not all(d.stat().st_mode & stat.S_IXOTH for d in real.parents):
            return False
        return bool(real.stat().st_mode & stat.S_IXOTH)
    except OSError:
        return False


def _member_python() -> str:
    # The system's interpreters (os.defpath: /bin, /usr/bin) rather than a
    # PATH search: PATH may lead into the same closed virtualenv.
    system = [os.path.join(d, "python3") for d in os.defpath.split(os.pathsep) if d]
    for candidate in (sys.executable, *system):
        if os.path.exists(candidate) and reachable_by_others(candidate):
            return candidate
    return sys.executable  # then the agent is not root here: members run as the suite's user


MEMBER_PYTHON = _member_python()


@pytest.fixture
def member_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="phalanx-test-"))
    os.chmod(path, 0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def writable(path: Path) -> Path:
    """``path`` as a directory any member can write into (mode 0777)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o777)
    return path
