"""The tests, the chaos suite and the benchmarks start long-running children through ``procs.spawn``.

A child started with a plain ``subprocess.Popen`` has no parent-death signal:
a pytest (or chaos run, or bench) killed with SIGKILL leaves it running as an
orphan, holding its ports, etcd leases and namespaces. ``phalanx.procs.spawn``
gives it one. This walks the Python sources under tests/, chaos/ and bench/
and fails on every call of ``subprocess.Popen`` (however it was imported) that
is not on the allow-list: one-shot children waited on where they start.
``subprocess.run`` and its kin wait for their child and are not flagged;
neither is code inside string literals (a child's own program), which is not
this process's child.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("tests", "chaos", "bench")

# (file, enclosing function) -> why a plain Popen is fine there.
ALLOWED = {
    ("tests/unit/test_bounded_retries.py", "test_wait_ready_fails_at_once_when_the_proxy_exited"):
        "the child raises SystemExit(3) at once and is waited on the next line",
}


@dataclass(frozen=True)
class Site:
    path: str
    function: str  # innermost enclosing def, "<module>" at top level
    line: int

    def key(self) -> tuple[str, str]:
        return (self.path, self.function)


class PopenCalls(ast.NodeVisitor):
    """Calls of subprocess.Popen in one module: ``subprocess.Popen(...)``,
    ``sp.Popen(...)`` after ``import subprocess as sp``, ``Popen(...)`` or an
    alias of it after ``from subprocess import Popen``."""

    def __init__(self, path: str, tree: ast.Module) -> None:
        self.path = path
        self.modules = {"subprocess"}
        self.names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.modules |= {a.asname or a.name for a in node.names if a.name == "subprocess"}
            elif isinstance(node, ast.ImportFrom) and node.module == "subprocess":
                self.names |= {a.asname or a.name for a in node.names if a.name == "Popen"}
        self.functions: list[str] = []
        self.sites: list[Site] = []
        self.visit(tree)

    def _in_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_FunctionDef = _in_function
    visit_AsyncFunctionDef = _in_function

    def is_popen(self, func: ast.expr) -> bool:
        if isinstance(func, ast.Attribute):
            return func.attr == "Popen" and isinstance(func.value, ast.Name) and func.value.id in self.modules
        return isinstance(func, ast.Name) and func.id in self.names

    def visit_Call(self, node: ast.Call) -> None:
        if self.is_popen(node.func):
            self.sites.append(Site(self.path, self.functions[-1] if self.functions else "<module>", node.lineno))
        self.generic_visit(node)


def plain_popens(path: str, source: str) -> list[Site]:
    return PopenCalls(path, ast.parse(source, filename=path)).sites


def scanned_files() -> list[Path]:
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def repo_sites() -> list[Site]:
    return [s for f in scanned_files() for s in plain_popens(str(f.relative_to(ROOT)), f.read_text())]


def test_no_plain_popen_starts_a_long_lived_child() -> None:
    files = {str(f.relative_to(ROOT)) for f in scanned_files()}
    assert "tests/chaos/test_netns_infra.py" in files and "chaos/netns.py" in files and "bench/admission.py" in files
    bad = [s for s in repo_sites() if s.key() not in ALLOWED]
    assert bad == [], (
        "plain subprocess.Popen: start it with phalanx.procs.spawn(..., die_with_parent=procs.KILL or TERM), "
        "or, for a one-shot child waited on at once, add it to ALLOWED with why:\n"
        + "\n".join(f"  {s.path}:{s.line} in {s.function}" for s in bad))


def test_every_allowed_popen_is_still_there() -> None:
    # A stale entry would silently allow a new Popen in a function of that name.
    found = {s.key() for s in repo_sites()}
    assert [k for k in ALLOWED if k not in found] == []


SAMPLE = '''
import subprocess
import subprocess as sp
from subprocess import Popen, Popen as P, run
from phalanx import procs

def long_lived():
    subprocess.Popen(["etcd"])

async def aliased():
    sp.Popen(["sleep", "1"])
    P(["agent"])

class Owner:
    def start(self):
        return Popen(["coordinator"])

top = subprocess.Popen(["x"])

def fine(h) -> "subprocess.Popen[str]":
    procs.spawn(["etcd"], die_with_parent=procs.KILL, popen=subprocess.Popen)
    subprocess.run(["ip", "netns", "exec", "n", "true"])
    run(["true"])
    h.popen(["sleep", "1000"])
    code = "import subprocess; subprocess.Popen(['sleep', '9'])"
    p: subprocess.Popen[str] | None = None
'''


def test_the_scan_finds_popen_in_every_spelling_and_nothing_else() -> None:
    sites = plain_popens("sample.py", SAMPLE)
    assert [(s.function, s.line) for s in sites] == [
        ("long_lived", 8), ("aliased", 11), ("aliased", 12), ("start", 16), ("<module>", 18)]
