"""The driver of the run-as policy (``agent.core.run_as``, docs/launcher.md
"Who members run as"): the node's accounts, the ``--run-as`` file, and
whether members of another user can reach their work directories."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import yaml

from agent.core.run_as import Account, RunAsError, RunAsPolicy, parse_policy


class RunAsRefused(Exception):
    """A member its run-as policy does not let run (nothing was started)."""


def system_account(name: str) -> Account:
    """The node's account ``name`` with its own groups (/etc/passwd,
    /etc/group); KeyError when there is none."""
    entry = pwd.getpwnam(name)
    return Account(name=name, uid=entry.pw_uid, gid=entry.pw_gid,
                   groups=tuple(sorted(set(os.getgrouplist(name, entry.pw_gid)))))


def default_run_as() -> RunAsPolicy:
    """The policy without ``--run-as``: every owner runs as ``nobody``, none
    as root. RunAsError when the node has no ``nobody``."""
    return parse_policy(None, system_account)


def load_run_as(path: str | Path) -> RunAsPolicy:
    """The ``--run-as`` file; ValueError ``FILE: <field>: <reason>``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path}: (document): not YAML: {first}") from None
    try:
        return parse_policy(doc, system_account)
    except RunAsError as exc:
        raise ValueError(f"{path}: {exc}") from None


def closed_to_others(path: Path) -> Path | None:
    """The first directory from ``/`` down to ``path`` that users other than
    its owner and group cannot search (no ``o+x``), or None."""
    resolved = Path(path).resolve()
    for directory in (*reversed(resolved.parents), resolved):
        try:
            if not directory.stat().st_mode & stat.S_IXOTH:
                return directory
        except OSError:
            return directory
    return None
