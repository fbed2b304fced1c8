"""Fixtures for the chaos suite: a fresh namespace cluster per test, echo servers.

Nothing here skips: on a machine that cannot build namespaces the fixtures
raise :class:`chaos.netns.ChaosEnvironmentError` and the tests fail with its
message (what is missing), because a chaos suite that silently does not run
proves nothing.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.netns import Host, NetnsCluster


@pytest.fixture
def net() -> Iterator[NetnsCluster]:
    with NetnsCluster() as cluster:
        yield cluster


def start_echo(host: Host, port: int, log: Path) -> subprocess.Popen[Any]:
    """A ``chaos.probe serve`` line echo server in ``host``, started and listening."""
    proc = host.popen(
        [sys.executable, "-m", "chaos.probe", "serve", "--port", str(port), "--log", str(log)],
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), f"echo server on {host.name} did not start (exit {proc.poll()})"
    return proc
