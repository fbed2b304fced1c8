"""The committed stubs under phalanx/v1/ must be exactly what scripts/gen_proto.sh
makes from proto/ (a stale or hand-edited stub fails here)."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    fresh = sorted(p.name for p in (tmp_path / "phalanx" / "v1").iterdir())
    committed = sorted(p.name for p in (REPO / "phalanx" / "v1").iterdir() if p.suffix in (".py", ".pyi") and p.name != "__init__.py")
    assert fresh == committed, "proto files and committed stubs differ in set"
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "phalanx" / "v1", REPO / "phalanx" / "v1", fresh, shallow=False)
    assert mismatch == [] and errors == [], f"stale stubs (run scripts/gen_proto.sh): {mismatch + errors}"
    protos = sorted(p.stem for p in (REPO / "proto" / "phalanx" / "v1").glob("*.proto"))
    assert {f.split("_pb2")[0] for f in fresh} == set(protos)
