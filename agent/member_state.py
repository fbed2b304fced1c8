"""The launcher's durable record of its live members,
``<state_dir>/members.json`` (docs/launcher.md "State file"): rewritten
atomically on every start and exit, so that a restarted agent can re-attach to
its members and kill processes it started but cannot account for."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from agent.launcher import MemberHandle, MemberKey

log = logging.getLogger(__name__)

STATE_FILE = "members.json"
STATE_VERSION = 1


@dataclass(frozen=True)
class MemberRecord:
    """One live member as written to ``members.json``."""

    key: MemberKey
    pid: int
    pgid: int
    start_ticks: int
    started_at: float
    gpus: tuple[int, ...] = ()
    nics: tuple[str, ...] = ()
    epoch: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "gang": self.key.gang,
            "incarnation": self.key.incarnation,
            "rank": self.key.rank,
            "pid": self.pid,
            "pgid": self.pgid,
            "start_ticks": self.start_ticks,
            "started_at": self.started_at,
            "gpus": list(self.gpus),
            "nics": list(self.nics),
            "epoch": self.epoch,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> MemberRecord:
        return cls(
            key=MemberKey(str(doc["gang"]), int(doc["incarnation"]), int(doc["rank"])),
            pid=int(doc["pid"]),
            pgid=int(doc["pgid"]),
            start_ticks=int(doc["start_ticks"]),
            started_at=float(doc["started_at"]),
            gpus=tuple(int(g) for g in doc.get("gpus", ())),
            nics=tuple(str(n) for n in doc.get("nics", ())),
            epoch=int(doc.get("epoch", 0)),
        )

    def handle(self) -> MemberHandle:
        return MemberHandle(key=self.key, pid=self.pid, started_at=self.started_at,
                            gpus=self.gpus, nics=self.nics, epoch=self.epoch)


def write_state(path: Path, agent_id: str, records: Iterable[MemberRecord]) -> None:
    """``members.json`` listing ``records`` (sorted by key), atomically;
    OSError when it cannot be written."""
    doc = {
        "version": STATE_VERSION,
        "agent_id": agent_id,
        "members": [rec.to_json() for rec in
                    sorted(records, key=lambda rec: (rec.key.gang, rec.key.incarnation, rec.key.rank))],
    }
    write_atomically(path, json.dumps(doc, indent=1).encode())


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` as ``path``'s whole content: after a crash the file is either
    the old or the new version, never a torn one, and the rename itself is
    durable (tmp + fsync + rename + fsync of the directory)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_state(state_dir: Path) -> tuple[str | None, list[MemberRecord]]:
    """(agent id, records) from ``<state_dir>/members.json``; (None, []) when absent.

    A file that cannot be parsed is moved aside (``members.json.corrupt-<ts>``)
    for a post-mortem; its members will then be treated as orphans."""
    path = Path(state_dir) / STATE_FILE
    try:
        doc = json.loads(path.read_bytes())
        if not isinstance(doc, dict) or not isinstance(doc.get("members"), list):
            raise ValueError("not a members document")
    except FileNotFoundError:
        return None, []
    except (OSError, ValueError) as exc:
        aside = path.with_name(f"{STATE_FILE}.corrupt-{int(time.time())}")
        log.error("unreadable state file %s (%s); moved to %s", path, exc, aside)
        with contextlib.suppress(OSError):
            os.replace(path, aside)
        return None, []
    records: list[MemberRecord] = []
    for item in doc["members"]:
        try:
            records.append(MemberRecord.from_json(item))
        except (KeyError, TypeError, ValueError):
            log.warning("skipping malformed member record in %s: %r", path, item)
    agent_id = doc.get("agent_id")
    return (str(agent_id) if agent_id is not None else None), records
