"""The CLI starts without loading what only a running command needs
(phalanx/cli/__init__.py's docstring, docs/cli.md "Start-up time"): ``--help``,
``--version``, a usage error and a local command like ``logs`` import neither
gRPC, protobuf, cryptography, asyncio nor YAML. Checked by what a fresh
interpreter has imported, not by a clock."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("grpc", "google.protobuf", "cryptography", "asyncio", "yaml", "phalanx.client", "phalanx.up", "importlib.metadata")

PROBE = """
import json, sys
from phalanx.cli import main
code = main(json.loads(sys.argv[1]))
print(json.dumps({"code": code, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in {"grpc", "google",
      "cryptography", "asyncio", "yaml"} or m in {"phalanx.client", "phalanx.up", "importlib.metadata"})}), file=sys.stderr)
"""


@pytest.mark.parametrize("argv, code", [
    (["--version"], 0),
    (["--help"], 0),
    (["up", "--help"], 0),
    (["list", "--bogus"], 2),
    (["get"], 2),
    (["wait", "g", "--for", "nosuchstate"], 2),
    (["logs", "g"], 2),  # no state dir: a local usage error
])
def test_no_heavy_import_before_a_command_runs(argv: list[str], code: int, tmp_path: object) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv)], capture_output=True, text=True, timeout=60,
                          env=env)
    result = json.loads(done.stderr.strip().splitlines()[-1])
    assert result["code"] == code, done.stderr
    # Only --version looks up the installed version (importlib.metadata: ~15 ms).
    allowed = ("importlib.metadata",) if argv == ["--version"] else ()
    assert not [m for m in result["loaded"] if m.startswith(HEAVY) and m not in allowed], result["loaded"]


def test_dialing_a_coordinator_needs_no_x509_library() -> None:
    """``phalanx get`` and the SDK import phalanx.client and phalanx.tls;
    neither loads cryptography (or phalanx.certs, which does) until a
    certificate must be parsed: files that passed before are not parsed
    again (phalanx/tls_check_cache.py, tests/unit/test_tls_check_cache.py)."""
    probe = ("import sys, phalanx.client, phalanx.tls\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cryptography' or m == 'phalanx.certs'))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
