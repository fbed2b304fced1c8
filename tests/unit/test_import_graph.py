"""The modules under ``coordinator/`` and ``phalanx/`` import one way
(docs/design.md §19): no import cycle, and ``phalanx/`` (shipped to nodes and
to users) imports neither ``agent/`` nor ``coordinator/``.

The graph is read from the source with ``ast``: every import is an edge,
wherever it is written — at module level, inside a function (a "lazy"
import) or under ``if TYPE_CHECKING:``. A lazy import only postpones the
cycle to the first call; it does not remove the dependency, and it is how the
leader and the two-phase driver hid theirs (issue 23: "no lazy-import
workarounds"). Importing ``a.b.c`` runs ``a`` and ``a.b`` too, so an edge to a
module is an edge to its packages as well. Generated stubs (``phalanx/v1``)
are left out.

``KNOWN_CYCLE_EDGES`` are the edges that still close a cycle, each with why;
the test removes them and requires the rest to be acyclic, so any new cycle
fails. The list may only shrink: an edge that no longer exists, or no longer
closes a cycle, fails until it is removed from the list.
``KNOWN_LAYER_BREAKS`` is the same for ``phalanx/`` importing the other two.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("coordinator", "phalanx", "agent")
CHECKED = ("coordinator", "phalanx")

# (importer, imported) -> why the edge is still there.
KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {
}
KNOWN_LAYER_BREAKS: dict[tuple[str, str], str] = {}


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(module: str, is_package: bool, source: str) -> set[str]:
    """Every module name ``source`` imports (absolute; for ``from m import x``
    both ``m`` and ``m.x``, since ``x`` may be a submodule)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


def build_graph(sources: dict[str, tuple[bool, str]]) -> dict[str, set[str]]:
    """module -> the known modules it imports (with their parent packages)."""
    graph: dict[str, set[str]] = {}
    for module, (is_package, source) in sources.items():
        edges: set[str] = set()
        for name in imported_names(module, is_package, source):
            while name and name not in sources:  # `from m import function` names m
                name = name.rpartition(".")[0]
            while name:
                if name != module and not module.startswith(name + "."):
                    edges.add(name)
                name = name.rpartition(".")[0]
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (its modules in order, first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)) is not None:
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)) is not None:
            return found
    return None


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        if v not in seen:
            seen.add(v)
            todo += graph.get(v, ())
    return False


def repo_graph() -> dict[str, set[str]]:
    sources = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            if "v1" in path.relative_to(REPO).parts:
                continue
            sources[module_name(path)] = (path.name == "__init__.py", path.read_text())
    return build_graph(sources)


def _checked(m: str) -> bool:
    return m.split(".")[0] in CHECKED


def test_no_new_import_cycle() -> None:
    graph = repo_graph()
    assert "coordinator.leader" in graph and "phalanx.cli" in graph
    checked = {m: {w for w in e if _checked(w) and (m, w) not in KNOWN_CYCLE_EDGES}
               for m, e in graph.items() if _checked(m)}
    cycle = find_cycle(checked)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_known_cycle_edges_only_shrink() -> None:
    graph = repo_graph()
    for (a, b), why in KNOWN_CYCLE_EDGES.items():
        assert b in graph.get(a, set()), f"{a} no longer imports {b}: remove it from KNOWN_CYCLE_EDGES"
        assert reaches(graph, b, a), f"{a} -> {b} closes no cycle now: remove it from KNOWN_CYCLE_EDGES ({why})"


def test_phalanx_imports_neither_agent_nor_coordinator() -> None:
    graph = repo_graph()
    breaks = set()
    for m, edges in graph.items():
        if m.split(".")[0] == "phalanx":
            targets = {w for w in edges if w.split(".")[0] in ("agent", "coordinator")}
            # the module imported, not the packages it runs on the way
            breaks |= {(m, w) for w in targets if not any(x.startswith(w + ".") for x in targets)}
    assert breaks <= set(KNOWN_LAYER_BREAKS), f"phalanx/ imports {sorted(breaks - set(KNOWN_LAYER_BREAKS))}"
    assert set(KNOWN_LAYER_BREAKS) <= breaks, \
        f"no longer imported: {sorted(set(KNOWN_LAYER_BREAKS) - breaks)} (remove from KNOWN_LAYER_BREAKS)"


def _graph(**modules: str) -> dict[str, set[str]]:
    return build_graph({name.replace("__", "."): (False, src) for name, src in modules.items()})


def test_a_lazy_import_is_an_edge() -> None:
    g = _graph(p__a="from p.b import f\n", p__b="def f():\n    from p.a import g\n")
    assert find_cycle(g) == ["p.a", "p.b", "p.a"]


def test_a_type_checking_import_is_an_edge() -> None:
    g = _graph(p__a="import p.b\n", p__b="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import a\n")
    assert find_cycle(g) is not None


def test_relative_imports_and_acyclic_graphs() -> None:
    g = _graph(p__a="from . import b\nfrom .c import x\n", p__b="from p.c import y\n", p__c="import json\n")
    assert g["p.a"] == {"p.b", "p.c"} and find_cycle(g) is None
