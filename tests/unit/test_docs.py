"""The docs run as written: what the README shows is what the repository holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from phalanx.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def readme_block(first_line: str) -> str:
    """The fenced block of the README whose first line is ``first_line``."""
    m = re.search(r"```[a-z]*\n" + re.escape(first_line) + r"\n(.*?)```", README, re.S)
    assert m, f"README has no code block starting with {first_line!r}"
    return m.group(1)


@pytest.mark.parametrize("example", ["examples/llama-pretrain.yaml"])
def test_readme_example_spec_is_the_file(example: str) -> None:
    shown = readme_block(f"# {example}")
    assert shown == (REPO / example).read_text(), f"README's copy of {example} differs from the file"
    load_spec(shown)  # and it is a valid spec


def test_every_example_is_a_valid_spec() -> None:
    for path in sorted((REPO / "examples").glob("*.yaml")):
        load_spec(path.read_text())
