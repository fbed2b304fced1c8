"""Named failpoints: crash, pause or delay a process at a protocol step, or
switch a safety check off, to prove the tests and the chaos checker can see
the resulting failure. Off by default and free when off (one dict lookup).

Armed by environment (``PHALANX_FAILPOINTS``) or by ``arm()`` in-process:

    PHALANX_FAILPOINTS="owner.after_prepare=crash,agent.ignore_epoch=on,leader.after_reserve=delay(0.5)"

Actions: ``crash`` (SIGKILL self: no cleanup, like a power cut), ``pause(S)``
(SIGSTOP-like: the event loop is blocked for S seconds), ``delay(S)``
(``await`` S seconds), ``on`` (a boolean switch, for planted bugs).
docs/failpoints.md lists every point.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

_SPEC = re.compile(r"^(?P<name>[a-z0-9_.]+)=(?P<action>crash|on|pause\((?P<p>[0-9.]+)\)|delay\((?P<d>[0-9.]+)\))$")


@dataclass(frozen=True)
class Action:
    kind: str  # crash | on | pause | delay
    seconds: float = 0.0


_ARMED: dict[str, Action] = {}
# Optional file re-read at run time (tests and the chaos suite arm and disarm
# points in a running process by rewriting it). Unset: no cost at all.
_FILE = os.environ.get("PHALANX_FAILPOINTS_FILE", "")
_file_state: dict[str, float] = {"checked": 0.0, "mtime": -1.0}
_FROM_FILE: set[str] = set()


def _reload() -> None:
    now = time.monotonic()
    if now - _file_state["checked"] < 0.1:
        return
    _file_state["checked"] = now
    try:
        mtime = os.stat(_FILE).st_mtime
        text = open(_FILE).read() if mtime != _file_state["mtime"] else None
    except FileNotFoundError:
        mtime, text = 0.0, ""
    if text is None:
        return
    _file_state["mtime"] = mtime
    for name in _FROM_FILE:
        _ARMED.pop(name, None)
    _FROM_FILE.clear()
    try:
        parsed = parse(text.replace("\n", ","))
    except ValueError as exc:
        log.error("ignoring %s: %s", _FILE, exc)
        return
    _ARMED.update(parsed)
    _FROM_FILE.update(parsed)


def parse(text: str) -> dict[str, Action]:
    out: dict[str, Action] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = _SPEC.match(part)
        if not m:
            raise ValueError(f"PHALANX_FAILPOINTS: cannot parse {part!r}; expected name=crash|on|pause(S)|delay(S)")
        kind = m.group("action").split("(")[0]
        secs = float(m.group("p") or m.group("d") or 0.0)
        out[m.group("name")] = Action(kind, secs)
    return out


def arm(name: str, action: str) -> None:
    _ARMED.update(parse(f"{name}={action}"))


def disarm_all() -> None:
    _ARMED.clear()


def load_from_env() -> None:
    text = os.environ.get("PHALANX_FAILPOINTS", "")
    if text:
        _ARMED.update(parse(text))
        log.warning("failpoints armed: %s", ", ".join(f"{k}={v.kind}" for k, v in _ARMED.items()))


def on(name: str) -> bool:
    """A planted-bug switch: True only when armed with ``on``."""
    if _FILE:
        _reload()
    a = _ARMED.get(name)
    return a is not None and a.kind == "on"


async def hit(name: str) -> None:
    """A protocol step: crash, pause or delay here if armed."""
    if _FILE:
        _reload()
    a = _ARMED.get(name)
    if a is None:
        return
    log.warning("failpoint %s: %s", name, a.kind)
    if a.kind == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif a.kind == "pause":
        time.sleep(a.seconds)  # blocks the whole loop, like SIGSTOP
    elif a.kind == "delay":
        await asyncio.sleep(a.seconds)


load_from_env()
