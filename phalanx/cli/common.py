"""What every ``phalanx`` command shares: the exit codes (docs/cli.md),
``UsageError`` (bad local input, exit 2) and the one way output is printed."""

from __future__ import annotations

import sys
from typing import TextIO

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INVALID = 2
EXIT_INTERRUPTED = 130

STATE_DIR_ENV = "PHALANX_STATE_DIR"


class UsageError(Exception):
    """Bad local input (a flag value, an unreadable file): exit code 2."""


def print_line(text: str = "", file: TextIO | None = None) -> None:
    print(text, file=file or sys.stdout, flush=True)
