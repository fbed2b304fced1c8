"""The pure cores do no I/O and read no clock (docs/design.md §3, §19).

Every module under ``coordinator/core/`` and ``agent/core/`` is parsed with
``ast`` (nothing is imported, so a module cannot hide an effect from the
check by running it at import time): it may not import a network, process,
file-system, clock or concurrency module (at any level, inside a function
too), nor call ``open``/``print``/``input`` or a path's read/write methods.
``now`` is passed in; files are read by the drivers, which hand the core
their text.

``KNOWN_IMPURE`` lists the modules that still break the rule, with why; it
may only shrink: a listed module that has become pure fails the test until
it is removed from the list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE_DIRS = (REPO / "coordinator" / "core", REPO / "agent" / "core")
CORE_FILES = sorted(p for d in CORE_DIRS for p in d.glob("*.py"))

# Top-level module names a core may not import (network, etcd, processes,
# files, clocks, concurrency, nondeterminism).
FORBIDDEN_MODULES = frozenset({
    "grpc", "aetcd", "etcd3", "kubernetes", "socket", "ssl", "http", "urllib", "requests", "select", "selectors",
    "asyncio", "threading", "multiprocessing", "concurrent", "subprocess", "signal",
    "os", "pathlib", "shutil", "tempfile", "glob", "io", "fcntl",
    "time", "datetime", "random", "secrets", "uuid",
})
FORBIDDEN_CALLS = frozenset({"open", "print", "input"})
FORBIDDEN_METHODS = frozenset({"read_text", "write_text", "read_bytes", "write_bytes"})

# module -> why it is still impure (may only shrink).
KNOWN_IMPURE: dict[str, str] = {}


def violations(source: str) -> list[str]:
    """What in ``source`` breaks the purity rule, one line each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found += [f"line {node.lineno}: imports {n}" for n in names if n.split(".")[0] in FORBIDDEN_MODULES]
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in FORBIDDEN_CALLS:
                found.append(f"line {node.lineno}: calls {f.id}()")
            elif isinstance(f, ast.Attribute) and f.attr in FORBIDDEN_METHODS:
                found.append(f"line {node.lineno}: calls .{f.attr}()")
    return found


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def test_every_core_module_is_checked() -> None:
    # The glob must find the cores (a moved directory would make the
    # parametrized test below vacuous).
    assert {"coordinator/core/admission.py", "coordinator/core/placement.py",
            "agent/core/enforcement.py"} <= {_rel(p) for p in CORE_FILES}
    assert set(KNOWN_IMPURE) <= {_rel(p) for p in CORE_FILES}, "a KNOWN_IMPURE module no longer exists: remove it"


@pytest.mark.parametrize("path", CORE_FILES, ids=[_rel(p) for p in CORE_FILES])
def test_core_module_does_no_io(path: Path) -> None:
    found = violations(path.read_text())
    if _rel(path) in KNOWN_IMPURE:
        assert found, f"{_rel(path)} is pure now: remove it from KNOWN_IMPURE"
    else:
        assert not found, f"{_rel(path)}: " + "; ".join(found)


@pytest.mark.parametrize("source", [
    "import grpc", "import os.path", "from time import monotonic", "import asyncio as aio",
    "def f():\n    import subprocess", "from pathlib import Path", "from datetime import datetime",
    "def f(p):\n    return open(p).read()", "def f(p):\n    return p.read_text()", "print('x')",
], ids=lambda s: s.replace("\n", " "))
def test_the_rule_catches(source: str) -> None:
    assert violations(source)


@pytest.mark.parametrize("source", [
    "from coordinator.core import ordering", "from . import ordering", "import hashlib",
    "from dataclasses import dataclass", "x.open_slots()",
], ids=lambda s: s)
def test_the_rule_allows(source: str) -> None:
    assert not violations(source)
