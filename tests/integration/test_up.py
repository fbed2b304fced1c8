"""``phalanx up``: starts a whole cluster, serves the API, and leaves nothing
behind when stopped (no process, no temp state dir).

Every child of ``up`` leads its own session, so "nothing left behind" is
checked as: no live process remains in any session that ``up``'s children
led, and ``up``'s direct children are all gone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import uuid
from pathlib import Path

import pytest

from phalanx.client import AsyncClient
from phalanx.etcd_server import EtcdServer
from phalanx.up import UpProcess, proc_stat

pytestmark = pytest.mark.integration


def child_sessions(pid: int) -> dict[int, int]:
    """pid -> session id of every direct child of ``pid``."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None and st[0] == pid:
                out[int(entry)] = st[2]
    return out


def live_in_sessions(sessions: set[int]) -> list[int]:
    """Processes (zombies excluded: they hold nothing) in any of ``sessions``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None and st[2] in sessions and st[3] != "Z":
                found.append(int(entry))
    return found


def processes_mentioning(token: str) -> list[int]:
    """Live processes whose command line contains ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            st = proc_stat(int(entry))
            if token.encode() in cmdline and st is not None and st[3] != "Z":
                found.append(int(entry))
    return found


async def leaders(address: str) -> set[str]:
    async with AsyncClient(address) as client:
        st = await client.status()
        return {az.az for az in st.azs if az.has_leader}


def test_up_no_workload_starts_everything_and_leaves_nothing_behind() -> None:
    cluster = "t" + uuid.uuid4().hex[:10]
    up = UpProcess([
        "--no-workload", "--cluster", cluster, "--azs", "2", "--coordinators-per-az", "2", "--nodes-per-az", "2",
        "--base-port", "0",
    ])
    try:
        up.start()
        assert up.proc is not None
        # Exactly one address line, naming every coordinator (2 AZs x 2).
        assert len([line for line in up.lines if line.startswith("PHALANX_ADDRESS=")]) == 1
        assert len(up.addresses) == 4 and len(set(up.addresses)) == 4
        assert asyncio.run(leaders(up.address)) >= {"az-a", "az-b"}
        # etcd + 4 coordinators + 2 agent processes, each leading its own session.
        children = child_sessions(up.proc.pid)
        assert len(children) == 7, children
        assert all(pid == sid for pid, sid in children.items())
        assert up.state_dir is not None and (up.state_dir / "logs").is_dir()
        assert any(p.name == "etcd.log" for p in (up.state_dir / "logs").iterdir())
    finally:
        code = up.stop(signal.SIGINT)
    assert code == 0, "\n".join(up.lines[-40:])
    assert live_in_sessions(set(children.values())) == []
    assert processes_mentioning(cluster) == [] and processes_mentioning(str(up.state_dir)) == []
    assert not up.state_dir.exists(), "a state dir that up created must be removed"
    assert any("stopped" in line for line in up.lines)


def test_up_with_workload_on_given_etcd_keeps_given_state_dir(
    etcd_server: EtcdServer, cluster_name: str, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    up = UpProcess([
        "--etcd", f"http://{etcd_server.endpoint}", "--cluster", cluster_name, "--azs", "1",
        "--coordinators-per-az", "1", "--nodes-per-az", "2", "--base-port", "0", "--state-dir", str(state),
    ])
    try:
        up.start()
        assert up.proc is not None
        children = child_sessions(up.proc.pid)
        assert len(children) == 2, children  # no etcd of its own this time
        # The workload runs: gangs get admitted and finish (waited for, not timed).
        up.wait_for_line(r"admitted [1-9]", timeout=240)
        up.wait_for_line(r"succeeded [1-9]", timeout=240)
    finally:
        code = up.stop(signal.SIGTERM)
    assert code == 0, "\n".join(up.lines[-40:])
    assert live_in_sessions(set(children.values())) == []
    assert processes_mentioning(cluster_name) == []
    assert state.is_dir() and (state / "logs" / "az-a-c0.log").is_file(), "a given state dir is kept"


def test_up_reports_a_failed_start_and_cleans_up(tmp_path: Path) -> None:
    """An etcd nobody serves: no leader can be elected; with a short start
    timeout ``up`` gives up, exits 1, and still stops what it started."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    cluster = "t" + uuid.uuid4().hex[:10]
    up = UpProcess([
        "--no-workload", "--etcd", dead, "--cluster", cluster, "--azs", "1", "--coordinators-per-az", "1",
        "--nodes-per-az", "1", "--base-port", "0", "--start-timeout", "20", "--state-dir", str(tmp_path / "state"),
    ])
    with pytest.raises(RuntimeError) as info:
        up.start(timeout=240)  # waits for PHALANX_ADDRESS, which never comes
    assert "exited with code 1" in str(info.value)
    assert up.stop() == 1
    assert any("error:" in line for line in up.lines)
    assert processes_mentioning(cluster) == []
