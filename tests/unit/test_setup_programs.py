"""scripts/setup.sh installs every program the code and the tests start.

The programs are derived from the code, not from a list kept by hand: every
literal program name that reaches a subprocess call (``subprocess.run`` /
``Popen`` / ``check_output`` / ``check_call`` / ``call``,
``asyncio.create_subprocess_exec``, ``os.exec*``, ``shutil.which``,
``phalanx.procs.spawn``) directly,
through a local or module-level argv constant, a parameter default, or a
function of ours that passes its argument on to one of those (found by a
fixed point over the whole tree, so ``run_cmd([...])`` and
``host.run([...])`` count). ``ip netns exec NS PROG`` also counts ``PROG``.
Each must be in setup.sh's table, and the table must equal
``phalanx.programs.PROGRAMS`` (what ``require`` names in its errors).

The script itself runs here too, as root and as ``nobody``, with stand-in
programs on a PATH of its own and a stand-in ``apt-get`` that records what
it was asked to install.
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from phalanx import programs

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"
SCANNED = ("phalanx", "coordinator", "agent", "chaos", "bench", "deploy", "scripts", "tests")

SUBPROCESS_FUNCS = {"run", "Popen", "check_output", "check_call", "call"}


# --- the table in setup.sh ------------------------------------------------------------------------

def setup_table(text: str) -> dict[str, programs.Program]:
    """setup.sh's ``programs="..."`` table: program -> Program(name, package, optional reason)."""
    start = text.index('\nprograms="\n') + len('\nprograms="\n')
    body = text[start:text.index('\n"\n', start)]
    table: dict[str, programs.Program] = {}
    for line in body.splitlines():
        if not line.strip():
            continue
        prog, pkg, *rest = line.split(None, 2)
        reason = rest[0] if rest else ""
        assert reason == "" or reason.startswith("optional: "), f"setup.sh table, {prog}: third column must be 'optional: why'"
        assert prog not in table, f"setup.sh table lists {prog} twice"
        table[prog] = programs.Program(prog, pkg, reason.removeprefix("optional: "))
    return table


# --- programs in the code ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Found:
    program: str
    where: str  # path:line


def _callee(func: ast.expr) -> tuple[str, str]:
    """(qualifier, name) of a call's function: ``subprocess.run`` -> ("subprocess", "run"),
    ``self.client.run`` -> ("client", "run"), ``run_cmd`` -> ("", "run_cmd")."""
    if isinstance(func, ast.Name):
        return "", func.id
    if isinstance(func, ast.Attribute):
        base = func.value
        qual = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
        return qual, func.attr
    return "", ""


class Module:
    """One parsed file: its functions, its module-level constants, and what it imports from subprocess."""

    def __init__(self, path: str, source: str):
        self.path = path
        self.tree = ast.parse(source, filename=path)
        self.constants: dict[str, list[ast.expr]] = {}
        self.from_subprocess: set[str] = set()
        self.stdlib: set[str] = set()  # stdlib modules imported under their own name
        for node in self.tree.body:
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        self.constants.setdefault(t.id, []).append(node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                self.constants.setdefault(node.target.id, []).append(node.value)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                self.stdlib |= {a.asname or a.name for a in node.names if a.name in sys.stdlib_module_names}
            if isinstance(node, ast.ImportFrom) and node.module == "subprocess":
                self.from_subprocess |= {a.asname or a.name for a in node.names}

        self._functions = [n for n in ast.walk(self.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def functions(self) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
        return self._functions


class Scanner:
    """Finds literal program names passed to subprocess calls across a set of modules."""

    def __init__(self, modules: Iterable[Module]):
        self.modules = list(modules)
        # Our own functions that pass a parameter on as argv: name -> positional index.
        self.wrappers: dict[str, int] = {}
        # Our own functions that return an argv built around a parameter (Host.wrap: ip netns exec NS *cmd).
        self.builders: set[str] = {"list", "tuple"}
        self._calls_cache: dict[int, list[ast.Call]] = {}
        self._assign_cache: dict[int, dict[str, list[ast.expr]]] = {}
        self._returns: dict[int, list[ast.expr]] = {}
        self._find_wrappers()

    # argv position of a call, or None when it starts no program
    def argv_of(self, mod: Module, call: ast.Call) -> ast.expr | None:
        qual, name = _callee(call.func)
        index: int | None = None
        if qual == "subprocess" and name in SUBPROCESS_FUNCS or qual == "" and name in mod.from_subprocess & SUBPROCESS_FUNCS:
            index = 0
        elif name == "create_subprocess_exec" or name == "which" or qual == "os" and name.startswith("exec"):
            index = 0
        elif name == "spawn" and qual.endswith("procs"):  # phalanx.procs.spawn (its Popen is a parameter)
            index = 0
        elif name in self.wrappers and qual not in mod.stdlib:  # asyncio.run is not Host.run
            index = self.wrappers[name]
        if index is None:
            return None
        if index < len(call.args) and not isinstance(call.args[index], ast.Starred):
            return call.args[index]
        for kw in call.keywords:
            if kw.arg in ("args", "cmd", "argv", "command", "file", "path") and index == 0:
                return kw.value
        return None

    def _calls(self, node: ast.AST) -> list[ast.Call]:
        key = id(node)
        if key not in self._calls_cache:
            self._calls_cache[key] = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
        return self._calls_cache[key]

    def _assignments(self, fn: ast.AST) -> dict[str, list[ast.expr]]:
        """Local name -> the values assigned to it anywhere in ``fn``."""
        key = id(fn)
        if key not in self._assign_cache:
            out: dict[str, list[ast.expr]] = {}
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign):
                    for t in n.targets:
                        if isinstance(t, ast.Name):
                            out.setdefault(t.id, []).append(n.value)
                elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None:
                    out.setdefault(n.target.id, []).append(n.value)
            self._assign_cache[key] = out
        return self._assign_cache[key]

    def _find_wrappers(self) -> None:
        changed = True
        while changed:
            changed = False
            for mod in self.modules:
                for fn in mod.functions():
                    params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
                    skip = 1 if params and params[0] in ("self", "cls") else 0
                    if fn.name not in self.builders:
                        if id(fn) not in self._returns:
                            self._returns[id(fn)] = [r.value for r in ast.walk(fn)
                                                     if isinstance(r, ast.Return) and r.value is not None]
                        for ret in self._returns[id(fn)]:
                            if set(params[skip:]) & self.heads(ret, mod, fn)[1]:
                                self.builders.add(fn.name)
                                changed = True
                                break
                    if fn.name in self.wrappers:
                        continue
                    for call in self._calls(fn):
                        argv = self.argv_of(mod, call)
                        if argv is None:
                            continue
                        _, names = self.heads(argv, mod, fn)
                        hit = [i for i, p in enumerate(params) if p in names and i >= skip]
                        if hit:
                            self.wrappers[fn.name] = hit[0] - skip
                            changed = True
                            break

    def heads(self, expr: ast.expr, mod: Module, fn: ast.AST | None,
              seen: frozenset[str] = frozenset()) -> tuple[set[str], set[str]]:
        """What ``expr`` (an argv, or a program) can start: (literal program names,
        names of unassigned variables, i.e. parameters, in that position)."""
        progs: set[str] = set()
        names: set[str] = set()

        def add(sub: ast.expr) -> None:
            p, n = self.heads(sub, mod, fn, seen)
            progs.update(p)
            names.update(n)

        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            word = expr.value.split()
            progs.update(word[:1])
        elif isinstance(expr, (ast.List, ast.Tuple)) and expr.elts:
            first = expr.elts[0]
            add(first.value if isinstance(first, ast.Starred) else first)
            words = [e.value if isinstance(e, ast.Constant) else None for e in expr.elts]
            if words[:3] == ["ip", "netns", "exec"] and len(words) > 4:  # ip netns exec NS PROG ...
                fifth = expr.elts[4]
                add(fifth.value if isinstance(fifth, ast.Starred) else fifth)
        elif isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            add(expr.left)
        elif isinstance(expr, ast.Call) and _callee(expr.func)[1] in self.builders:
            # list(cmd), self.wrap([...]): the argv that goes in (never a bare
            # string argument: _py("chaos.workload", ...) names a module, not a program)
            for a in expr.args:
                a = a.value if isinstance(a, ast.Starred) else a
                if isinstance(a, (ast.List, ast.Tuple, ast.Name, ast.BinOp)):
                    add(a)
        elif isinstance(expr, ast.Name) and expr.id not in seen:
            seen = seen | {expr.id}
            values: list[ast.expr] = []
            is_param = False
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                values += self._assignments(fn).get(expr.id, [])
                args = fn.args.posonlyargs + fn.args.args
                is_param = expr.id in {a.arg for a in args + fn.args.kwonlyargs}
                defaults = dict(zip([a.arg for a in args][len(args) - len(fn.args.defaults):], fn.args.defaults))
                defaults |= {a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None}
                if expr.id in defaults:
                    values.append(defaults[expr.id])
            if not values:
                values = list(mod.constants.get(expr.id, []))
            if is_param or not values:
                names.add(expr.id)
            for v in values:
                add(v)
        return progs, names

    def found(self) -> list[Found]:
        out: list[Found] = []
        for mod in self.modules:
            owners: dict[int, ast.AST] = {}
            for fn in mod.functions():  # outer first: an inner function's calls end up its own
                for n in self._calls(fn):
                    owners[id(n)] = fn
            for call in self._calls(mod.tree):
                argv = self.argv_of(mod, call)
                if argv is None:
                    continue
                for prog in self.heads(argv, mod, owners.get(id(call)))[0]:
                    out.append(Found(prog, f"{mod.path}:{call.lineno}"))
        return out


def scan_sources(sources: dict[str, str]) -> list[Found]:
    return Scanner(Module(path, src) for path, src in sources.items()).found()


@functools.cache
def tree_found() -> tuple[Found, ...]:
    return tuple(scan_sources(tree_sources()))


def tree_sources() -> dict[str, str]:
    sources: dict[str, str] = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "phalanx/v1" in rel.as_posix():  # generated stubs start nothing
                continue
            sources[rel.as_posix()] = path.read_text()
    return sources


# Names tests pass on purpose to show that a missing program is handled.
ABSENT_ON_PURPOSE = {
    "nvidia-smi-not-installed-here": "tests/unit/test_topology_nvidia_smi.py",
    "frobnicate": "tests/unit/test_setup_programs.py",
}


def uninstalled(found: Iterable[Found], table: dict[str, programs.Program]) -> dict[str, list[str]]:
    """Programs the code starts that the table does not have: program -> where."""
    missing: dict[str, list[str]] = {}
    for f in found:
        if ABSENT_ON_PURPOSE.get(f.program) == f.where.split(":")[0]:
            continue
        if f.program not in table and not os.path.isabs(f.program):
            missing.setdefault(f.program, []).append(f.where)
    return missing


# --- tests: the tree ------------------------------------------------------------------------------------

def test_setup_installs_every_program_the_code_starts() -> None:
    table = setup_table(SETUP.read_text())
    found = tree_found()
    missing = uninstalled(found, table)
    assert not missing, ("programs started by the code but not in scripts/setup.sh's table "
                         f"(add 'program  debian-package' there and in phalanx/programs.py): {missing}")
    # The scan sees the programs we know are there: a scanner that went blind would pass the check above.
    names = {f.program for f in found}
    assert {"etcd", "etcdctl", "ip", "iptables", "iptables-save", "nvidia-smi", "sleep"} <= names, names


def test_every_table_entry_is_started_somewhere() -> None:
    """A program nothing starts any more is a stale install step."""
    names = {f.program for f in tree_found()}
    assert set(setup_table(SETUP.read_text())) <= names


def test_setup_table_equals_the_one_require_uses() -> None:
    assert setup_table(SETUP.read_text()) == programs.PROGRAMS
    optional = {p.name for p in programs.PROGRAMS.values() if p.optional}
    assert optional == {"nvidia-smi"}, "a program becomes optional only with a reason, on purpose"


# --- tests: the checker catches what it should --------------------------------------------------------------

SYNTHETIC = {
    "pkg/runner.py": '''
import asyncio, os, shutil, subprocess
from subprocess import check_output

STRACE = ["strace", "-f"]
TOOL = "fictional-tool"

def run_cmd(cmd, *, timeout=30.0):
    return subprocess.run(list(cmd), capture_output=True, timeout=timeout)

class Host:
    def wrap(self, cmd):
        return ["ip", "netns", "exec", self.ns, *cmd]
    def run(self, cmd, **kw):
        return run_cmd(self.wrap(cmd), **kw)

def probe(executable="lspci"):
    return shutil.which(executable)

async def main(h: Host):
    subprocess.Popen(["tcpdump", "-i", "any"])
    check_output(("ethtool", "eth0"))
    await asyncio.create_subprocess_exec("ss", "-tn")
    subprocess.check_call(STRACE + ["true"])
    subprocess.run([TOOL, "."])
    os.execvp("numactl", ["numactl", "-H"])
    run_cmd(["conntrack", "-L"])
    h.run(["tc", "qdisc"])
    subprocess.run(["ip", "netns", "exec", "x", "ping", "-c1", "h"])
    argv = ["perf", "record"]
    subprocess.run(argv)
    subprocess.run([sys.executable, "-c", "pass"])  # not a program name: ignored
    asyncio.run(main(h))  # starts no program
''',
}


def test_checker_finds_programs_in_every_form() -> None:
    names = {f.program for f in scan_sources(SYNTHETIC)}
    assert names == {"strace", "fictional-tool", "lspci", "tcpdump", "ethtool", "ss", "numactl", "conntrack", "ip", "tc",
                     "ping", "perf"}


def test_checker_fails_for_a_program_setup_lacks() -> None:
    table = setup_table(SETUP.read_text())
    # A new fault that shapes traffic with tc, started through chaos.netns's Host.run.
    code = {"chaos/netns.py": (ROOT / "chaos" / "netns.py").read_text(),
            "chaos/new_fault.py": 'import subprocess\n\ndef slow(h):\n    h.run(["tc", "qdisc", "add"])\n'}
    found = scan_sources(code)
    assert uninstalled(found, table) == {"tc": ["chaos/new_fault.py:4"]}
    # ...and the same code passes once setup.sh's table has it.
    table["tc"] = programs.Program("tc", "iproute2")
    assert uninstalled(found, table) == {}


def test_setup_table_parser_rejects_an_optional_without_reason() -> None:
    with pytest.raises(AssertionError, match="optional: why"):
        setup_table('x\nprograms="\nnvidia-smi nvidia-smi maybe\n"\n')


# --- require --------------------------------------------------------------------------------------------------

def test_require_names_the_program_and_its_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    with pytest.raises(programs.MissingProgram, match=r"'etcdctl' not found on PATH \(Debian package etcd-client; "
                                                      r"scripts/setup.sh installs it\)") as exc:
        programs.require("etcdctl")
    assert exc.value.program == "etcdctl"
    with pytest.raises(programs.MissingProgram, match="optional: ships with the NVIDIA driver"):
        programs.require("nvidia-smi")
    with pytest.raises(programs.MissingProgram, match="not a program scripts/setup.sh knows"):
        programs.require("frobnicate")
    tool = tmp_path / "etcdctl"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert programs.require("etcdctl") == str(tool)
    assert programs.require(str(tool)) == str(tool)
    tool.chmod(0o644)
    with pytest.raises(programs.MissingProgram, match="is not an executable file"):
        programs.require(str(tool))


# --- the script itself ------------------------------------------------------------------------------------------

class Sandbox:
    """A copy of setup.sh under a world-readable temporary root, and a PATH holding only
    the shell tools it uses, stand-ins for the table's programs, and a stand-in apt-get
    that records its arguments and "installs" a package by adding its programs."""

    SHELL_TOOLS = ("bash", "dirname", "id", "chmod")

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="phalanx-setup-"))
        self.root.chmod(0o755)
        (self.root / "scripts").mkdir()
        shutil.copy2(SETUP, self.root / "scripts" / "setup.sh")
        self.bin = self.root / "bin"
        self.bin.mkdir()
        self.log = self.root / "apt.log"
        for tool in self.SHELL_TOOLS:
            real = shutil.which(tool)
            assert real, tool
            (self.bin / tool).symlink_to(real)
        table = setup_table(SETUP.read_text())
        by_package: dict[str, list[str]] = {}
        for p in table.values():
            by_package.setdefault(p.package, []).append(p.name)
        cases = "\n".join(
            f'    {pkg}) ' + " ".join(f'[ -e "$bin/{n}" ] || {{ printf "#!/bin/sh\\n" > "$bin/{n}"; chmod 755 "$bin/{n}"; }};' for n in names) + " ;;"
            for pkg, names in by_package.items())
        self._write(self.bin / "apt-get", f'''#!/bin/bash
bin="{self.bin}"
echo "$*" >> "{self.log}"
[ "$1" = install ] || exit 0
for pkg in "$@"; do
  case "$pkg" in
{cases}
  esac
done
''')
        self.log.touch()
        self.log.chmod(0o666)

    @staticmethod
    def _write(path: Path, text: str) -> None:
        path.unlink(missing_ok=True)  # never write through a symlink to a real program
        path.write_text(text)
        path.chmod(0o755)

    def add(self, *names: str) -> None:
        for n in names:
            if not (self.bin / n).exists():  # bash is there already, as a shell tool
                self._write(self.bin / n, "#!/bin/sh\n")

    def setup(self, *args: str, user: int | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(self.root / "scripts" / "setup.sh"), *args],
                              env={"PATH": str(self.bin)}, capture_output=True, text=True, timeout=60, user=user)

    def apt_calls(self) -> list[str]:
        return self.log.read_text().splitlines()

    def close(self) -> None:
        shutil.rmtree(self.root)


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    box = Sandbox()
    yield box
    box.close()
    assert not box.root.exists()


REQUIRED = [p.name for p in programs.PROGRAMS.values() if not p.optional]

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="runs setup.sh as root and as nobody")


@root_only
def test_setup_installs_what_is_missing_once(sandbox: Sandbox) -> None:
    sandbox.add(*(n for n in REQUIRED if n not in ("etcdctl", "iptables", "iptables-save")))
    first = sandbox.setup("--programs-only")
    assert first.returncode == 0, first.stderr
    assert sandbox.apt_calls() == ["update -qq", "install -y -qq etcd-client iptables"]  # each package once
    assert "etcdctl (etcd-client)" in first.stderr
    # Again: everything is there now, so nothing is installed.
    second = sandbox.setup("--programs-only")
    assert second.returncode == 0, second.stderr
    assert len(sandbox.apt_calls()) == 2 and second.stderr == ""


@root_only
def test_setup_does_not_need_root_when_nothing_is_missing(sandbox: Sandbox) -> None:
    sandbox.add(*REQUIRED)
    res = sandbox.setup("--programs-only", user=65534)
    assert res.returncode == 0, res.stderr
    assert sandbox.apt_calls() == []


@root_only
def test_setup_without_root_says_what_is_missing(sandbox: Sandbox) -> None:
    sandbox.add(*(n for n in REQUIRED if n != "etcdctl"))
    res = sandbox.setup("--programs-only", user=65534)
    assert res.returncode == 1
    assert res.stderr.strip() == ("setup: error: missing programs: etcdctl (etcd-client); run scripts/setup.sh as root, "
                                  "or install the Debian packages etcd-client")
    assert sandbox.apt_calls() == []


@root_only
def test_setup_fails_when_a_package_does_not_bring_its_program(sandbox: Sandbox) -> None:
    sandbox.add(*(n for n in REQUIRED if n != "etcdctl"))
    sandbox._write(sandbox.bin / "apt-get", f'#!/bin/sh\necho "$*" >> "{sandbox.log}"\n')  # installs nothing
    res = sandbox.setup("--programs-only")
    assert res.returncode == 1
    assert "installed etcd-client but etcdctl (etcd-client) is still not on PATH" in res.stderr


def test_setup_rejects_an_unknown_argument(sandbox: Sandbox) -> None:
    res = sandbox.setup("--fast")
    assert res.returncode == 2
    assert res.stderr.strip() == "setup: error: unknown argument --fast; usage: scripts/setup.sh [--programs-only]"
