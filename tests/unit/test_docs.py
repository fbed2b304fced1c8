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


# Files whose text may cite documents: code, protos, scripts, docs, examples.
CITING = [p for pat in ("**/*.py", "**/*.proto", "**/*.sh", "**/*.md", "**/*.yaml")
          for p in REPO.glob(pat)
          if not {".venv", "build", ".git", ".hypothesis"} & set(p.relative_to(REPO).parts)]


def _headings(doc: Path) -> set[str]:
    """Section numbers ("4", "8.2") of a doc's numbered headings."""
    return set(re.findall(r"^#+ (\d+(?:\.\d+)*)\.? ", doc.read_text(), re.M))


def test_no_document_outside_the_clone_is_cited() -> None:
    outside = re.compile(r"\b(?:DESIGN|STYLE) §|\.\./shared/|\b(?:DESIGN|STYLE)\.md\b")
    bad = [f"{p.relative_to(REPO)}:{n}: {line.strip()}"
           for p in CITING for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
           if outside.search(line)]
    assert bad == [], "cites a document a clone does not hold:\n" + "\n".join(bad)


def test_every_cited_doc_and_section_exists() -> None:
    cite = re.compile(r"\bdocs/([\w.-]+\.md)(?: (?:§|section )(\d+(?:\.\d+)*))?")
    bad = []
    for p in CITING:
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            for doc, section in cite.findall(line):
                target = REPO / "docs" / doc
                if not target.is_file():
                    bad.append(f"{p.relative_to(REPO)}:{n}: docs/{doc} does not exist")
                elif section and section not in _headings(target):
                    bad.append(f"{p.relative_to(REPO)}:{n}: docs/{doc} has no section {section}")
    assert bad == [], "\n".join(bad)


def test_test_files_have_unique_basenames() -> None:
    # tests/unit and tests/integration are not packages: pytest refuses two
    # test modules with one basename ("import file mismatch") at collection.
    seen: dict[str, Path] = {}
    for p in sorted((REPO / "tests").rglob("test_*.py")):
        assert p.name not in seen, f"{p.relative_to(REPO)} and {seen[p.name].relative_to(REPO)} share a basename"
        seen[p.name] = p
