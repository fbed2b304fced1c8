"""The packages' layering (docs/design.md §19): a node ships the agent and
the shared `phalanx` package, never the control plane, so neither imports
the coordinator package (whole modules, in a fresh interpreter, so an import
hidden inside a function that runs at import time is caught too)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.harness import REPO

PROBE = """
import importlib, pkgutil, sys
import {pkg}
for m in pkgutil.walk_packages({pkg}.__path__, "{pkg}."):
    importlib.import_module(m.name)
print(",".join(sorted(n for n in sys.modules if n == "coordinator" or n.startswith("coordinator."))))
"""


@pytest.mark.parametrize("pkg", ["agent", "phalanx"])
def test_a_package_that_runs_on_nodes_does_not_import_the_coordinator(pkg: str) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE.format(pkg=pkg)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{pkg} imports {out.stdout.strip()}"
