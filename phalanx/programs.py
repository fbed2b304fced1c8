"""The external programs Phalanx, its chaos suite and its tests run, and where
each comes from.

``scripts/setup.sh`` holds the same table (program, Debian package, and for a
program nothing installs, why it is optional) and installs every required
one; ``tests/unit/test_setup_programs.py`` derives the programs from the code
itself and fails when one is in neither table, or when the two tables differ.

:func:`require` is for the moment before a program is started: a missing one
fails with its name and package at once, instead of a FileNotFoundError deep
in a stack, or (for a program started under ``ip netns exec``) an exit code
255 that a health check reads as "not healthy" until it times out.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass


@dataclass(frozen=True)
class Program:
    name: str
    package: str
    optional: str = ""  # why nothing installs it; "" for a required program


# Keep in the order of scripts/setup.sh's table (the test compares them).
PROGRAMS: dict[str, Program] = {p.name: p for p in (
    Program("etcd", "etcd-server"),
    Program("etcdctl", "etcd-client"),
    Program("ip", "iproute2"),
    Program("iptables", "iptables"),
    Program("iptables-save", "iptables"),
    Program("sleep", "coreutils"),
    Program("true", "coreutils"),
    Program("bash", "bash"),
    Program("sh", "dash"),
    Program("cc", "gcc"),
    Program("git", "git"),  # scripts/mutation_sample.py: is a file it edits committed?
    Program("nvidia-smi", "nvidia-smi",
            "ships with the NVIDIA driver on a GPU node; without it the agent reads the topology from NVML and sysfs"),
)}


class MissingProgram(RuntimeError):
    """A program the code is about to start is not installed; the message names it and its package."""

    def __init__(self, program: str, message: str):
        super().__init__(message)
        self.program = program


def install_hint(program: str) -> str:
    """Where ``program`` comes from, as a phrase for an error message."""
    p = PROGRAMS.get(os.path.basename(program))
    if p is None:
        return "not a program scripts/setup.sh knows; add it to the table there and in phalanx/programs.py"
    if p.optional:
        return f"Debian package {p.package}; optional: {p.optional}"
    return f"Debian package {p.package}; scripts/setup.sh installs it"


def require(program: str) -> str:
    """The path of ``program`` (a name looked up on PATH, or a path), or
    :class:`MissingProgram` naming it and the Debian package it comes in."""
    if os.sep in program:
        if os.path.isfile(program) and os.access(program, os.X_OK):
            return program
        raise MissingProgram(program, f"program {program!r} is not an executable file ({install_hint(program)})")
    path = shutil.which(program)
    if path is None:
        raise MissingProgram(program, f"program {program!r} not found on PATH ({install_hint(program)})")
    return path
