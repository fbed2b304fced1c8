"""``phalanx up``'s own output: whole lines that never raise, and a reader
that went away noticed (docs/local-cluster.md, Stopping)."""

from __future__ import annotations

import os
import select
from typing import Any, TextIO


class StdoutClosed(Exception):
    """Nobody reads ``up``'s output any more (a closed pipe, a hung-up
    terminal): shut down cleanly, as SIGPIPE would have stopped it, but
    without leaving anything behind."""


class LineOut:
    """Writes whole lines to one stream and never raises: the first write
    that fails (EPIPE from a closed pipe, EIO from a hung-up terminal, a
    closed file) marks the stream dead, points its descriptor at /dev/null
    (so the interpreter's final flush cannot fail either) and calls
    ``on_broken`` once. Clean-up must run whatever happened to the reader."""

    def __init__(self, stream: TextIO, on_broken: Any = None):
        self.stream = stream
        self.broken = False
        self.on_broken = on_broken

    def line(self, text: str) -> None:
        if self.broken:
            return
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except Exception:  # EPIPE, EIO, a closed file, no stream at all (fd 1 closed)
            self.mark_broken()

    def check(self) -> None:
        """Notice a reader that went away while we had nothing to write: the
        write end of a pipe without readers polls POLLERR (a hung-up terminal
        POLLHUP); a regular file never does."""
        if self.broken:
            return
        try:
            fd = self.stream.fileno()
        except (OSError, ValueError, AttributeError):
            return  # not a real descriptor (tests' StringIO): nothing to poll
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        try:
            events = poller.poll(0)
        except OSError:
            return
        if any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in events):
            self.mark_broken()

    def mark_broken(self) -> None:
        if self.broken:
            return
        self.broken = True
        try:
            fd = self.stream.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, fd)
            finally:
                os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass
        if self.on_broken is not None:
            self.on_broken()
