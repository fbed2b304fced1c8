"""scripts/setup.sh in a fresh copy of the tree, as the README's first
command runs it (issue 24, item 13: the first run was silent for ~20 s while
it built the virtual environment).

It must say what it is doing before the long step, not after: when the
"installing" line arrives, ``.venv/bin/phalanx`` does not exist yet (pip
writes it at the end of the install, which takes many seconds). Then the
venv works, and a second run installs nothing. Real pip, real registry (the
same one setup.sh uses in CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from phalanx import procs

REPO = Path(__file__).resolve().parents[2]


def tree_copy(dest: Path) -> None:
    """The tracked files as they are in the working tree (no .venv)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / name.decode()
        if src.is_file():
            target = dest / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def clean_env() -> dict[str, str]:
    """A new shell's environment: no venv on PATH, no VIRTUAL_ENV, the base
    interpreter as setup.sh's python3."""
    venv_bin = str(Path(sys.executable).parent)
    path = ":".join(p for p in os.environ.get("PATH", "").split(":") if p and p != venv_bin)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=path, PYTHON=getattr(sys, "_base_executable", sys.executable))
    return env


def test_first_setup_says_what_it_does_before_the_long_step(tmp_path: Path) -> None:
    root = tmp_path / "phalanx"
    tree_copy(root)
    phalanx_bin = root / ".venv" / "bin" / "phalanx"
    proc = procs.spawn(["bash", "scripts/setup.sh"], die_with_parent=procs.KILL, cwd=root, env=clean_env(),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    installed_when_announced: bool | None = None
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line.rstrip("\n"))
        if line.startswith("setup: installing Phalanx"):
            installed_when_announced = phalanx_bin.exists()
    proc.wait(timeout=600)
    assert proc.returncode == 0, "\n".join(lines)
    said = [ln for ln in lines if ln.startswith("setup: ")]
    order = [next((i for i, ln in enumerate(said) if ln.startswith(p)), None)
             for p in ("setup: creating .venv", "setup: installing Phalanx", "setup: .venv ready")]
    assert None not in order and order == sorted(order), said
    assert installed_when_announced is False, "the install was announced after it had happened"
    version = subprocess.run([str(phalanx_bin), "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("phalanx"), version

    again = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, env=clean_env(), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr
    assert "installing" not in again.stderr and "creating" not in again.stderr, again.stderr
