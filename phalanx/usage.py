"""The argument parser of every process ``phalanx`` can start.

``phalanx coordinator|agent|agents-sim|chaos ...`` hand the rest of the
command line to that process's own parser; with plain ``argparse`` a usage
error there is a usage dump of a dozen lines, not the one ``error:`` line
(exit code 2) that every other ``phalanx`` command answers bad input with
(docs/cli.md). This module has no dependencies, so a coordinator or agent
gets the convention without importing the CLI.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error:`` line on stderr and exit
    code 2 (subparsers inherit the class); ``--help`` is unchanged."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see {self.prog} --help)\n")
