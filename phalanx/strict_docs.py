"""Strict reading of the documents a person or a client hands us: gang specs,
policies, client configs (docs/limits.md, "Documents").

YAML and JSON readers that agree: nesting is capped at MAX_DOC_DEPTH (both
parsers recurse, so a deep ``[[[[...`` document would otherwise end in a
RecursionError), a key given twice in one mapping is an error naming the key
and both places (both parsers silently keep the last one), and YAML aliases
are refused (nested aliases expand exponentially; no document of ours has a
use for them). Errors say where: ``line L, column C``.

Pure: text in, data or ``DocumentError`` out.
"""

from __future__ import annotations

import json
from json.decoder import scanstring
from typing import Any

import yaml

# Mapping/sequence nesting cap (a real spec nests 3 levels, a policy 3).
MAX_DOC_DEPTH = 32


class DocumentError(ValueError):
    """A document that is not strictly valid YAML/JSON; the text names the
    place (``line L, column C: ...``) and the check."""


class StrictLoader(yaml.SafeLoader):
    """A SafeLoader that refuses aliases, nesting past MAX_DOC_DEPTH and
    duplicate keys (PyYAML silently keeps the last one)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"YAML aliases (*{event.anchor}) are not allowed here", event.start_mark
            )
        self._depth += 1
        try:
            if self._depth > MAX_DOC_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested more than {MAX_DOC_DEPTH} levels deep", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=False)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable: the base class reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first on line {first})", key_node.start_mark
                    )
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def yaml_error_line(exc: yaml.YAMLError) -> str:
    """One line: what is wrong and where (PyYAML's own text spans lines)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return " ".join(f"{where}{problem}".split())


def load_yaml(text: str) -> Any:
    """The YAML document in ``text``, strictly; DocumentError naming the place.
    ValueError from Python's own conversions (an integer of more than 4,300
    digits) is reported the same way."""
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise DocumentError(f"not valid YAML: {yaml_error_line(exc)}") from None
    except ValueError as exc:
        raise DocumentError(f"not a valid value: {' '.join(str(exc).split())[:200]}") from None


def _place(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    return f"line {line}, column {pos - (text.rfind(chr(10), 0, pos) + 1) + 1}"


def _check_json_shape(text: str) -> None:
    """Depth and duplicate keys, before ``json.loads`` recurses. A token
    scan, not a parser: what it does not understand is left to json.loads,
    which reports syntax errors itself."""
    # One frame per open container: the keys seen so far (None for a
    # list) and whether the next string in it is a key.
    frames: list[tuple[dict[str, int] | None, list[bool]]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "{[":
            if len(frames) >= MAX_DOC_DEPTH:
                raise DocumentError(f"{_place(text, i)}: nested more than {MAX_DOC_DEPTH} levels deep")
            frames.append(({}, [True]) if c == "{" else (None, [False]))
        elif c in "}]":
            if frames:
                frames.pop()
        elif c == "," and frames and frames[-1][0] is not None:
            frames[-1][1][0] = True
        elif c == '"':
            try:
                value, end = scanstring(text, i + 1)
            except ValueError:
                return  # json.loads names the broken string
            if frames and frames[-1][0] is not None and frames[-1][1][0]:
                seen = frames[-1][0]
                if value in seen:
                    first = seen[value]
                    raise DocumentError(f"{_place(text, i)}: duplicate key {value!r} "
                                        f"(first at {_place(text, first)})")
                seen[value] = i
                frames[-1][1][0] = False
            i = end
            continue
        i += 1


def load_json(text: str) -> Any:
    """The JSON document in ``text``, strictly: the same depth and
    duplicate-key rules as ``load_yaml``; DocumentError naming the place."""
    _check_json_shape(text)
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or Python's int-digit cap
        raise DocumentError(f"not JSON: {exc}") from None
