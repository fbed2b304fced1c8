"""How the launcher calls the fencing shim (agent/shim.py, docs/launcher.md
"Member-side fencing"): its command line and the descriptor that carries the
member's environment to it. What the shim's own environment holds is pure:
``agent.core.member_env.shim_environment``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from agent.core.run_as import Account

SHIM_PATH = Path(__file__).resolve().with_name("shim.py")


def shim_command(argv: list[str], lease: Path, fence_after_s: float, grace_s: float,
                 exit_file: Path | None = None, account: Account | None = None,
                 env_fd: int | None = None) -> list[str]:
    """``argv`` wrapped by the fencing shim (agent/shim.py, docs/launcher.md).

    Run by file path with ``-I`` so it needs neither this package on the
    member's ``sys.path`` nor a particular working directory. With
    ``account`` the shim keeps the agent's user (it must read the agent's
    lease, write the exit record and signal the group) and starts ``argv``
    as that account. ``env_fd``: the descriptor the shim reads the member's
    environment from (``environment_fd``); the shim itself runs with
    ``shim_environment``, so nothing of the spec acts in it."""
    exit_args = ["--exit-file", str(exit_file)] if exit_file is not None else []
    user_args = ["--user", account_arg(account)] if account is not None else []
    env_args = ["--env-fd", str(env_fd)] if env_fd is not None else []
    return [sys.executable, "-I", str(SHIM_PATH), "--lease", str(lease),
            "--fence-after", repr(float(fence_after_s)), "--grace", repr(float(grace_s)),
            *exit_args, *user_args, *env_args, "--", *argv]


def environment_fd(data: bytes) -> int:
    """An anonymous in-memory file (memfd, close-on-exec) holding ``data``
    (``encode_environment``) for the shim's ``--env-fd``, positioned at its
    start. Never on disk, readable through no path by the member's user, and
    no size limit (a pipe would block at 64 KiB before the shim reads it)."""
    fd = os.memfd_create("phalanx-member-env", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def account_arg(account: Account) -> str:
    """``UID:GID:G1,G2,...`` (the shim's ``--user``)."""
    return f"{account.uid}:{account.gid}:{','.join(str(g) for g in account.groups)}"
