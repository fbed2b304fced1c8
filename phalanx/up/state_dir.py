"""The state dir's owner file, and the removal of the state dirs that dead
runs left behind (docs/local-cluster.md, Stopping, and what is left behind)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from phalanx import procs

# State dirs `up` creates itself: <temp dir>/phalanx-up-XXXX, each with an
# owner file naming the `up` process (pid and kernel start time, so a reused
# pid never passes for the owner). The next `up` removes the dirs of dead
# owners that no live process still uses.
STATE_DIR_PREFIX = "phalanx-up-"
OWNER_FILE = "phalanx-up.owner"

# A kept --state-dir remembers its cluster name, so the next `up` on it finds
# its gangs again without --cluster.
CLUSTER_FILE = "cluster"


def write_owner(state_dir: Path, *, cluster: str, pid: int | None = None) -> None:
    """Atomically record which ``up`` process owns ``state_dir``."""
    pid = os.getpid() if pid is None else pid
    doc = {"pid": pid, "start": procs.pid_start_time(pid), "cluster": cluster}
    tmp = state_dir / f".{OWNER_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(doc) + "\n")
    os.replace(tmp, state_dir / OWNER_FILE)


def read_owner(state_dir: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((state_dir / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("pid"), int) else None


def owner_alive(owner: dict[str, Any]) -> bool:
    start = owner.get("start")
    return procs.process_alive(int(owner["pid"]), start if isinstance(start, int) else None)


def processes_using(path: Path) -> list[int]:
    """Live processes whose command line names ``path`` or a path below it
    (etcd's --data-dir, an agent's --state-dir, a member shim's lease file)."""
    needle = str(path).encode()
    found = []
    for pid in procs.pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if needle in cmdline and procs.process_alive(pid):
            found.append(pid)
    return found


def stale_verdict(owner: dict[str, Any] | None, owner_is_alive: bool, users: list[int]) -> str | None:
    """Why a ``phalanx-up-*`` dir may go (None: keep it). Only a dir with an
    owner file (one ``up`` wrote it: never a stranger's dir), whose owner is
    dead and which no live process still uses (a child still shutting down)."""
    if owner is None or owner_is_alive or users:
        return None
    return f"state dir of a dead earlier run, pid {owner.get('pid')}"


def reap_stale_state_dirs(root: Path) -> list[tuple[Path, str]]:
    """Remove the state dirs that dead ``up`` runs left under ``root``;
    (path, why) for each removed."""
    removed = []
    try:
        candidates = sorted(root.glob(f"{STATE_DIR_PREFIX}*"))
    except OSError:
        return []
    for path in candidates:
        if not path.is_dir() or path.is_symlink():
            continue
        owner = read_owner(path)
        alive = owner is not None and owner_alive(owner)
        why = stale_verdict(owner, alive, processes_using(path) if owner is not None and not alive else [])
        if why is None:
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append((path, why))
    return removed
