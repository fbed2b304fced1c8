"""Log output of every Phalanx process: ``--log-format text|json``.

Who a line is about (AZ, leader epoch, gang, incarnation, node, stimulus id)
lives in a `contextvars.ContextVar`, bound with `log_context(...)` where a
decision is made; both formatters read it, so a call site logs a plain
message and the fields follow. A context variable (not a logger adapter or a
thread-local) because the processes are asyncio programs: a task created
inside a `log_context` starts with a copy of it, and what a task binds never
leaks into its parent or its siblings.

``json``: one JSON object per line on stderr, always with ``time`` (UTC,
RFC 3339, milliseconds), ``level``, ``component``, ``logger``, ``message``,
``az`` and ``epoch`` (null where not known), and ``gang``, ``incarnation``,
``node``, ``stimulus`` where bound, ``exc`` with a traceback. ``text``: the
classic line, with the bound fields appended as ``[k=v ...]``. Fields are in
docs/logging.md. The standard library's `json` and `logging` suffice: no
dependency for a formatter of thirty lines.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import sys
import threading
import time
from contextvars import ContextVar
from typing import Any, Iterator, Mapping

# The context fields a line may carry, in the order text lines show them.
FIELDS = ("az", "epoch", "gang", "incarnation", "node", "stimulus")
# Present on every JSON line (null when unknown), so a query on them never
# has to ask whether the key exists.
ALWAYS = ("az", "epoch")
# What configure's STATIC may also hold: the process's own id (a
# coordinator's --id, an agent's node name).
STATIC_FIELDS = ("id",) + FIELDS
FORMATS = ("text", "json")

_EMPTY: Mapping[str, Any] = {}
_context: ContextVar[Mapping[str, Any]] = ContextVar("phalanx_log_context", default=_EMPTY)
_counter = itertools.count(1)


def _checked(fields: Mapping[str, Any], known: tuple[str, ...] = FIELDS) -> dict[str, Any]:
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise TypeError(f"log_context: unknown field(s) {', '.join(unknown)} (known: {', '.join(known)})")
    return {k: v for k, v in fields.items() if v is not None}


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[Mapping[str, Any]]:
    """Bind FIELDS for the lines logged inside the block (and by tasks
    created inside it). Nested blocks add to and override the outer one; a
    None value leaves the outer value as it is."""
    merged = {**_context.get(), **_checked(fields)}
    token = _context.set(merged)
    try:
        yield merged
    finally:
        _context.reset(token)


def bind(**fields: Any) -> None:
    """Bind FIELDS for the rest of the current task (or thread): for a
    long-lived loop whose whole life is about one thing, e.g. a leader term's
    epoch. Never leaks into the task that created this one."""
    _context.set({**_context.get(), **_checked(fields)})


def bind_event(ev: Any) -> None:
    """Bind the gang, incarnation and stimulus_id of a two-phase event or
    effect (coordinator/core/twophase_events.py) for the rest of the task
    that performs it."""
    bind(gang=getattr(ev, "gang", None) or None, incarnation=getattr(ev, "incarnation", None),
         stimulus=getattr(ev, "stimulus_id", None) or None)


def current() -> dict[str, Any]:
    """The fields bound here, now."""
    return dict(_context.get())


def new_stimulus(prefix: str) -> str:
    """A stimulus id for a decision that has no event of its own (an
    admission cycle, an agent's report, a timer): PREFIX-N, N counting up
    from 1 in this process, so it is unique per process and short enough to
    grep for."""
    return f"{prefix}-{next(_counter)}"


def _fields(record: logging.LogRecord, static: Mapping[str, Any]) -> dict[str, Any]:
    """The context of RECORD: the process's static fields, then what was
    bound when it was logged, then `extra={...}` fields given on the call."""
    out = {**static, **_context.get()}
    for k in FIELDS:
        v = getattr(record, k, None)
        if v is not None:
            out[k] = v
    return out


def _utc(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def __init__(self, component: str, static: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.component = component
        self.static = _checked(static or {}, STATIC_FIELDS)

    def format(self, record: logging.LogRecord) -> str:
        fields = _fields(record, self.static)
        line: dict[str, Any] = {"time": _utc(record.created), "level": record.levelname,
                                "component": self.component}
        if "id" in fields:
            line["id"] = fields.pop("id")
        for k in ALWAYS:
            line[k] = fields.pop(k, None)
        line.update(fields)
        line["logger"] = record.name
        line["message"] = record.getMessage()
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            line["exc"] = self.formatStack(record.stack_info)
        # default=str: a field bound to a non-JSON value (a Path, an enum)
        # is still one parsable line, never a logging error.
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The classic line, with the bound context appended."""

    def __init__(self, name: str) -> None:
        super().__init__(fmt=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        # The process's static fields are in its NAME already: only what was
        # bound is appended.
        fields = _fields(record, {})
        if not fields:
            return text
        context = " ".join(f"{k}={fields[k]}" for k in FIELDS if k in fields)
        head, sep, tail = text.partition("\n")  # a traceback stays below the line
        return f"{head} [{context}]{sep}{tail}"


def formatter(fmt: str, component: str, static: Mapping[str, Any] | None = None,
              name: str = "") -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter(component, static)
    if fmt == "text":
        return TextFormatter(name or component)
    raise ValueError(f"--log-format: {fmt!r} is not one of {', '.join(FORMATS)}")


_installed: logging.Handler | None = None  # the root handler configure() added


def configure(level: str, fmt: str, component: str, *, static: Mapping[str, Any] | None = None,
              name: str = "", stream: Any = None) -> logging.Handler | None:
    """Send every log record of this process to STREAM (stderr) in FMT.
    COMPONENT is the kind of process ("coordinator", "agent", "agent-sim");
    STATIC holds fields true of the whole process (its id, AZ, an agent's
    node); NAME is what text lines show instead of COMPONENT (e.g. the
    coordinator's id). Python warnings are logged too, so that in json every
    line of stderr is JSON. ValueError names the flag for a bad format or
    level.

    Without STREAM, logging that someone else set up (a test runner, a
    program that runs ours in-process) is left alone, as
    `logging.basicConfig` does: returns None then."""
    global _installed
    chosen = formatter(fmt, component, static, name)
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise ValueError(f"--log-level: {level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
    root = logging.getLogger()
    if stream is None and any(h is not _installed for h in root.handlers):
        return None
    if _installed is not None:
        root.removeHandler(_installed)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(chosen)
    root.addHandler(handler)
    root.setLevel(level.upper())
    _installed = handler
    logging.captureWarnings(True)
    if fmt == "json":
        # Python writes these tracebacks to stderr itself, bypassing logging:
        # a crash, an exception in a thread (e.g. a metrics server's), one in
        # a __del__ ("Exception ignored in"). Each becomes one JSON line with
        # the traceback in "exc".
        log = logging.getLogger(component)

        def log_uncaught(kind: Any, value: Any, tb: Any) -> None:
            log.critical("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, tb))

        def log_thread(args: Any) -> None:
            if args.exc_type is not SystemExit:
                log.error("exception in thread %s: %s", getattr(args.thread, "name", "?"), args.exc_value,
                          exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

        def log_unraisable(u: Any) -> None:
            log.warning("exception ignored in %r: %s", u.object, u.exc_value,
                        exc_info=(u.exc_type, u.exc_value, u.exc_traceback) if u.exc_type else None)

        sys.excepthook = log_uncaught
        threading.excepthook = log_thread
        sys.unraisablehook = log_unraisable
    return handler
