"""`phalanx coordinator|agent ...` hand the rest of the line to the process's
own parser; start-up validation errors come back as exit code 2."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from phalanx.cli import main


def test_coordinator_subcommand_validates_timings_together(capsys) -> None:
    rc = main(["coordinator", "--az", "a", "--id", "c1", "--etcd", "127.0.0.1:1",
               "--timings", '{"lease_ttl_s": 5, "fence_after_s": 6}'])
    assert rc == 2
    assert "fence_after_s must exceed lease_ttl_s + reconnect_budget_s" in capsys.readouterr().err


def test_agent_subcommand_discovers_and_prints_topology(capsys, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a replayed sysfs tree would go
    rc = main(["agent", "--az", "a", "--etcd", "127.0.0.1:1", "--node", "h1", "--print-topology",
               "--nvml-recording", "tests/fixtures/topology/l40s-pcie/nvml.json",
               "--sysfs-recording", "tests/fixtures/topology/l40s-pcie/sysfs.json", "--log-level", "ERROR"])
    assert rc == 0
    out = capsys.readouterr().out
    assert '"node": "h1"' in out and "L40S" in out
    assert list(tmp_path.iterdir()) == [], "the replayed sysfs tree is removed after discovery"


@pytest.mark.parametrize("argv", [
    ["coordinator"],
    ["coordinator", "--az", "a", "--id", "c1", "--etcd", "127.0.0.1:1", "--bogus"],
    ["agent", "--az", "a"],
    ["agents-sim", "--az", "a", "--etcd", "127.0.0.1:1", "--nodes", "x"],
    ["chaos", "run", "--seeds", "x"],
    ["chaos", "bogus"],
])
def test_usage_errors_of_the_server_processes_are_one_error_line(argv: list[str], capsys) -> None:
    """Like every other phalanx command: one ``error:`` line and exit code 2, not a usage dump."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse exits; phalanx's own main turns that into the exit code
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: python -m ") and err.count("\n") == 1, err
    assert "usage:" not in err


def test_coordinator_that_cannot_listen_says_so_in_one_line(capsys) -> None:
    rc = main(["coordinator", "--az", "a", "--id", "c1", "--etcd", "127.0.0.1:1", "--listen", "no-such-host.invalid:1",
               "--log-level", "ERROR", "--insecure"])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot listen on no-such-host.invalid:1") and err.count("\n") == 1, err


SERVE = ["--tls-dir", "T"]
ETCD = ["--etcd-tls-dir", "E"]
TLS_REQUIRED = "error: --tls-dir: required (pass --insecure to {})\n"
ETCD_REQUIRED = "error: --etcd-tls-dir: required (pass --insecure to reach etcd in plaintext)\n"


@pytest.mark.parametrize("process, base, plaintext", [
    ("coordinator", ["--az", "a", "--id", "c1", "--etcd", "127.0.0.1:1"], "serve plaintext"),
    ("agent", ["--az", "a", "--etcd", "127.0.0.1:1", "--node", "h1"], "connect in plaintext"),
    ("agents-sim", ["--az", "a", "--etcd", "127.0.0.1:1"], "connect in plaintext"),
])
@pytest.mark.parametrize("given, wanted", [
    ([], TLS_REQUIRED),
    (ETCD, TLS_REQUIRED),
    (SERVE, ETCD_REQUIRED),
])
def test_server_processes_need_credentials_or_insecure(process: str, base: list[str], plaintext: str, given: list[str],
                                                       wanted: str, capsys) -> None:
    """Plaintext is never a default: without --tls-dir or --etcd-tls-dir a
    process refuses to start (one line, exit 2) before it reads any file or
    reaches etcd."""
    assert main([process, *base, *given]) == 2
    assert capsys.readouterr().err == wanted.format(plaintext)
