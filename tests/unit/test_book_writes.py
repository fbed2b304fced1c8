"""Only the book changes the book (issue 23 item 2): outside
coordinator/book.py no module assigns into, deletes from, rebinds or calls a
mutating method of one of the Book's maps (``book.gangs[k] = ...``,
``self.book.owners.pop(k)``, ``del self.l.book.members[k]``,
``book.ledger.hold(r)``, ``self.book.watched_gangs = {}``). The drivers read
the maps and change them through the Book's transitions (``admitted``-like
events named for what happened: ``owned``, ``torn_down``, ``released``,
``adopted_elsewhere``, ...), each one place that keeps the maps consistent
(``Book.problems``)."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from coordinator.book import Book

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("coordinator", "agent", "phalanx", "chaos", "bench")
GENERATED = ROOT / "phalanx" / "v1"
BOOK = ROOT / "coordinator" / "book.py"

# The Book's fields that hold state (every field but ``az``). The
# participant and remote inventory are objects with their own API (cores
# fed events), not maps: calling them is not a write of the book's.
MAPS = {f.name for f in dataclasses.fields(Book)} - {"az", "participant", "remote"}
MUTATORS = {"pop", "popitem", "setdefault", "clear", "update", "add", "discard", "remove", "append", "extend",
            "insert", "hold", "release", "__setitem__", "__delitem__"}

# (module, line text) of writes not moved onto a transition yet. May only
# shrink.
KNOWN: set[tuple[str, str]] = set()


def _is_book(node: ast.AST) -> bool:
    """``book``, ``self.book``, ``self.l.book``, ``leader.book`` ..."""
    return (isinstance(node, ast.Name) and node.id == "book") or (isinstance(node, ast.Attribute) and node.attr == "book")


def _book_map(node: ast.AST) -> str | None:
    """The map's name if ``node`` is ``<...book>.<map>``."""
    if isinstance(node, ast.Attribute) and node.attr in MAPS and _is_book(node.value):
        return node.attr
    return None


def book_writes(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every write of a Book map in ``source``."""
    found = []

    def target(t: ast.AST) -> None:
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                target(e)
        elif isinstance(t, ast.Subscript) and _book_map(t.value):
            found.append((t.lineno, ast.unparse(t)))
        elif _book_map(t):
            found.append((t.lineno, ast.unparse(t)))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                target(t)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            target(node.target)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                target(t)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            if _book_map(node.func.value):
                found.append((node.lineno, ast.unparse(node.func)))
    return sorted(found)


def _modules() -> list[pathlib.Path]:
    out = []
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            if GENERATED not in p.parents and p != BOOK:
                out.append(p)
    return out


@pytest.mark.parametrize("source, expected", [
    ("self.book.gangs[g.id] = g", [(1, "self.book.gangs[g.id]")]),
    ("self.book.owners.pop(gang, None)", [(1, "self.book.owners.pop")]),
    ("del self.book.owners[gang]", [(1, "self.book.owners[gang]")]),
    ("self.l.book.members.setdefault(k, {}).update(r)", [(1, "self.l.book.members.setdefault")]),
    ("book.finished_fed.add(k)", [(1, "book.finished_fed.add")]),
    ("self.book.watched_gangs = {}", [(1, "self.book.watched_gangs")]),
    ("self.book.ledger.hold(r)", [(1, "self.book.ledger.hold")]),
    ("self.book.revoked_at[k] += 1", [(1, "self.book.revoked_at[k]")]),
    ("rec = self.book.nodes[n] = r", [(1, "self.book.nodes[n]")]),
    ("self.book.gangs.get(g)", []),
    ("x = self.book.gangs[g]", []),
    ("self.book.participant.handle(ev, now)", []),
    ("self.gangs[g] = 1; self.cache.pop(g)", []),
    ("self.book.owned(g)", []),
])
def test_the_check_sees_each_kind_of_write(source, expected):
    assert book_writes(source) == expected


def test_no_module_but_the_book_writes_its_maps():
    found = set()
    for path in _modules():
        rel = str(path.relative_to(ROOT))
        lines = path.read_text().splitlines()
        for line, _ in book_writes(path.read_text()):
            found.add((rel, lines[line - 1].strip()))
    new = sorted(found - KNOWN)
    assert not new, "write the book through a Book transition (coordinator/book.py):\n" + "\n".join(
        f"{m}: {text}" for m, text in new)
    assert not KNOWN - found, f"moved onto a transition: take these off KNOWN: {sorted(KNOWN - found)}"
