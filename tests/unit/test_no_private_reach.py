"""No class reaches into another's private members (issue #14, "Friend
classes"): outside ``self``/``cls``, no module of the coordinator, the agent
or the shared package reads or writes ``x._name``. What one class needs of
another is a public, documented member (e.g. ``AzLeader.busy``/``acting_on``,
docs/design.md §19.6)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("coordinator", "agent", "phalanx")
GENERATED = ROOT / "phalanx" / "v1"  # protoc's output, not ours

# (receiver as written, attribute): third-party or standard-library names
# that are public API despite their underscore. Keep this tiny.
ALLOWED = {
    # os._exit is the documented way to leave a forked child without running
    # the parent's cleanup (Python docs, os._exit).
    ("os", "_exit"),
    # grpc.RpcMethodHandler is a namedtuple; _replace is namedtuple's public
    # copy-with-changes method.
    ("handler", "_replace"),
}


def _modules() -> list[pathlib.Path]:
    out = []
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            if GENERATED not in p.parents:
                out.append(p)
    return out


def private_reaches(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every ``x._name`` whose receiver is not
    ``self``/``cls`` and whose name is not a dunder."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        receiver = ast.unparse(node.value)
        if (receiver, name) in ALLOWED:
            continue
        found.append((node.lineno, f"{receiver}.{name}"))
    return found


@pytest.mark.parametrize("source, expected", [
    ("self._x", []),
    ("cls._x", []),
    ("self.__class__", []),
    ("other.__dict__", []),
    ("self.l._inflight.add(g)", [(1, "self.l._inflight")]),
    ("leader._until_rebuilt()", [(1, "leader._until_rebuilt")]),
    ("os._exit(1)", []),
    ("handler._replace(a=1)", []),
    ("x = 1\nfoo()._bar", [(2, "foo()._bar")]),
], ids=["self", "cls", "dunder-on-self", "dunder-elsewhere", "friend-set", "friend-method",
        "allowed-os-exit", "allowed-namedtuple-replace", "call-result"])
def test_private_reaches_finds_exactly_the_reaches(source: str, expected: list) -> None:
    assert private_reaches(source) == expected


def test_the_walk_sees_the_packages() -> None:
    paths = _modules()
    names = {p.relative_to(ROOT).as_posix() for p in paths}
    assert {"coordinator/leader.py", "coordinator/twophase/driver.py", "agent/session.py", "phalanx/store.py"} <= names
    assert not any(n.startswith("phalanx/v1/") for n in names)


def test_no_module_reaches_into_another_objects_private_members() -> None:
    offenders = [f"{p.relative_to(ROOT)}:{line}: {expr}" for p in _modules()
                 for line, expr in private_reaches(p.read_text())]
    assert offenders == [], "private members used from outside their class:\n" + "\n".join(offenders)
