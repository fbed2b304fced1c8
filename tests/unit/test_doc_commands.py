"""Every command line the docs show is one the code takes.

Each shell block of README.md, deploy/README.md and docs/*.md (fenced as
``sh``, ``bash``, ``console`` or with no language) is split into simple
commands; each ``phalanx ...`` (also ``.venv/bin/phalanx``, and
``scripts/up.sh ...`` as ``phalanx up ...``) is parsed with the CLI's real
parser, each ``python -m MODULE`` must name a module of this repository or
the standard library, and each repository path a command names
(``examples/...``, ``scripts/...``, ``deploy/...``, ``bench/...``) must
exist. A line that is a synopsis (``...``, ``…``, ``<placeholder>``,
``[optional]``) or output (``phalanx up: ...``) is not a command, nor is a
diagram. In a transcript (a block with ``$ `` prompts) only the prompted
lines are commands, and one the transcript shows refused (its next line is
``error: phalanx ...``) must be refused by the parser with that very line.
Running the README's blocks against a cluster is
tests/integration/test_readme.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

from phalanx import cli

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "deploy" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGS = {"", "sh", "bash", "console", "shell"}
REPO_PATH = re.compile(r"^(?:\./)?(examples|scripts|deploy|bench|docs|tests)/[\w./-]*[\w]$")
SYNOPSIS = re.compile(r"\.\.\.|…|<[^<>]*>|\[[^\]]*\]")
DIAGRAM = re.compile(r"[─│┌┐└┘├┤▲▼►◄]")


def shell_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, body) of each shell block."""
    out = []
    for m in re.finditer(r"^```([\w-]*)[^\n]*\n(.*?)^```", text, re.S | re.M):
        if m.group(1) in SHELL_LANGS and not DIAGRAM.search(m.group(2)):
            out.append((text.count("\n", 0, m.start(2)) + 1, m.group(2)))
    return out


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line, as words (comments, redirections,
    leading VAR=value assignments and a ``$ `` prompt removed); [] for a line
    that does not parse as shell (output, prose)."""
    line = line.strip()
    if line.startswith("$ "):
        line = line[2:]
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:
        return []
    commands: list[list[str]] = [[]]
    skip_next = False
    for tok in tokens:
        if skip_next:
            skip_next = False
            continue
        if tok and set(tok) <= set(";&|"):
            commands.append([])
        elif tok and set(tok) <= set("<>"):
            skip_next = True  # the redirection's target
        else:
            commands[-1].append(tok)
    out = []
    for words in commands:
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words = words[1:]
        if words and words[0] in ("exec", "time", "timeout"):
            words = words[1:] if words[0] != "timeout" else words[2:]
        if words:
            out.append(words)
    return out


def problems_in(text: str, where: str) -> list[str]:
    """What is wrong with the commands in ``text`` (a document)."""
    bad = []
    for start, body in shell_blocks(text):
        lines = body.splitlines()
        transcript = any(line.startswith("$ ") for line in lines)
        for offset, line in enumerate(lines):
            if (transcript and not line.startswith("$ ")) or SYNOPSIS.search(line.split("#")[0]):
                continue
            after = lines[offset + 1] if offset + 1 < len(lines) else ""
            if transcript and after.startswith("error: phalanx"):
                (words,) = simple_commands(line)
                said = parse_problems(words[1:])
                if not (said and said[0].endswith(": " + after)):
                    bad.append(f"{where}:{start + offset}: shown refused with {after!r}; the parser says {said}")
                continue
            for words in simple_commands(line):
                bad.extend(f"{where}:{start + offset}: {p}" for p in command_problems(words))
    return bad


def command_problems(words: list[str]) -> list[str]:
    prog = words[0]
    problems = []
    if prog == "sudo":
        # A root shell (CI, a fresh Debian machine) has no sudo: say "as root" instead.
        return [f"{' '.join(words)}: sudo (a root shell has none; say the command needs root)"]
    if prog in ("phalanx", ".venv/bin/phalanx") and len(words) > 1 and not words[1].endswith(":"):
        problems += parse_problems(words[1:])
    elif prog in ("scripts/up.sh", "./scripts/up.sh"):
        problems += parse_problems(["up", *words[1:]])
    elif re.fullmatch(r"(?:\.venv/bin/)?python3?", prog) and words[1:2] == ["-m"] and len(words) > 2:
        module = words[2]
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            problems.append(f"python -m {module}: no such module")
    for word in words:
        value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        if REPO_PATH.match(value) and not (REPO / value).exists() and not value.startswith("tests/fixtures/x"):
            problems.append(f"{' '.join(words)}: {value} does not exist in the repository")
    return problems


def parse_problems(argv: list[str]) -> list[str]:
    """What the real parser says about ``phalanx ARGV`` (nothing is run)."""
    if argv[0] in cli.PASSTHROUGH:
        return []  # the server processes' own parsers: their tests (test_cli_passthrough.py)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args, extra = cli.build_parser().parse_known_args(argv)
        except SystemExit as exc:
            return [] if exc.code == 0 else [f"phalanx {' '.join(argv)}: {err.getvalue().strip()}"]
    if extra:
        return [f"phalanx {' '.join(argv)}: unrecognized arguments: {' '.join(extra)}"]
    if args.command is None and not {"--help", "-h", "--version"} & set(argv):
        return [f"phalanx {' '.join(argv)}: no command"]
    return []


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_documented_command_parses(doc: Path) -> None:
    bad = problems_in(doc.read_text(), str(doc.relative_to(REPO)))
    assert bad == [], "\n".join(bad)


def test_the_docs_show_commands_at_all() -> None:
    # The extraction finds what it should: a checker that sees nothing passes everything.
    found = [words for d in DOCS for _, body in shell_blocks(d.read_text()) for line in body.splitlines()
             for words in simple_commands(line) if words[0] == "phalanx"]
    assert len(found) > 40 and ["phalanx", "wait", "llama-pretrain", "--for", "RUNNING", "--timeout", "120"] in found


@pytest.mark.parametrize("doc, complaint", [
    ("```sh\nphalanx get llama --no-such-flag\n```\n", "unrecognized arguments: --no-such-flag"),
    ("```\nphalanx wait x --for NEVER\n```\n", "--for"),
    ("```sh\nscripts/up.sh --azs three\n```\n", "--azs"),
    ("```sh\nphalanx submit examples/none.yaml  # a file\n```\n", "examples/none.yaml does not exist"),
    ("```bash\nPHALANX_LOG_FORMAT=json python -m chaos.nosuch --all\n```\n", "no such module"),
    ("```sh\nphalanx list; phalanx nodez\n```\n", "nodez"),
])
def test_a_doc_naming_what_does_not_exist_fails(doc: str, complaint: str) -> None:
    bad = problems_in(doc, "doc.md")
    assert len(bad) == 1 and complaint in bad[0], bad


def test_a_transcript_shows_the_parser_s_own_refusal() -> None:
    shown = "```\n$ phalanx list --limit -1\nerror: phalanx list: argument --limit: must be between 0 and 2147483647, got -1 (see phalanx list --help)\n```\n"
    assert problems_in(shown, "doc.md") == []
    wrong = shown.replace("got -1", "got minus one")
    assert len(problems_in(wrong, "doc.md")) == 1
    accepted = shown.replace("--limit -1", "--limit 1")
    assert len(problems_in(accepted, "doc.md")) == 1


def test_sudo_is_not_a_documented_command() -> None:
    assert "sudo" in problems_in("```sh\nsudo .venv/bin/python -m chaos.run --list\n```\n", "doc.md")[0]


def test_the_full_chaos_matrix_takes_one_documented_time() -> None:
    # README, the how-to and the latest run say the same wall time (docs/chaos.md "Latest full-matrix run").
    chaos = (REPO / "docs" / "chaos.md").read_text()
    latest = chaos.split("## Latest full-matrix run", 1)[1]
    (seconds,) = re.findall(r"\*\*39/39 runs as expected, 0 violations, ([\d,]+) s wall\*\*", latest)[:1]
    how_to = chaos.split("## How to run", 1)[1].split("\n## ", 1)[0]
    assert f"the full matrix ({seconds} s" in how_to, how_to
    readme = (REPO / "README.md").read_text().split("## The chaos suite", 1)[1].split("\n## ", 1)[0]
    assert f"39/39 runs with zero violations in {seconds} s" in readme, readme


def test_synopses_and_output_are_not_commands() -> None:
    doc = ("```\nphalanx logs GANG --rank 0 [-f]\nphalanx up: metrics az-a-c0 https://x/metrics\n"
           "phalanx submit <file>\n```\n```yaml\nphalanx: --bogus\n```\n")
    assert problems_in(doc, "doc.md") == []


def test_deploy_readme_names_the_kind_and_cluster_role_the_overlays_render() -> None:
    import yaml

    base = [d for f in sorted((REPO / "deploy" / "k8s" / "base").glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text()) if d and "metadata" in d]
    suffixes = sorted(yaml.safe_load((k / "kustomization.yaml").read_text()).get("nameSuffix", "")
                      for k in (REPO / "deploy" / "k8s" / "overlays").iterdir() if k.is_dir())
    text = (REPO / "deploy" / "README.md").read_text()
    # The coordinators' kind, as the manifest has it, and no other workload kind said of them.
    (kind,) = [d["kind"] for d in base if d["metadata"]["name"] == "phalanx-coordinator"
               and d["kind"] in ("Deployment", "StatefulSet")]
    section = text.split("## Coordinator pods", 1)[1].split("\n## ", 1)[0]
    assert f"A {kind} " in section and not [k for k in ("Deployment", "StatefulSet") if f"A {k} of" in section and k != kind]
    # A ClusterRole is named as an overlay renders it (cluster-scoped: every AZ's gets its suffix).
    roles = {d["metadata"]["name"] + s for d in base if d["kind"] == "ClusterRole" for s in suffixes}
    named = re.findall(r"ClusterRole `([\w-]+)`", text)
    assert named and set(named) <= roles, (named, sorted(roles))
