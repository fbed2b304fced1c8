"""``phalanx top`` against a live cluster: real coordinator processes in two
AZs, simulated 8-GPU agents, real etcd, mutual TLS (the CLI's credentials
from ``$PHALANX_TLS_DIR``). The numbers it prints are the cluster's: the
leaders and epochs etcd holds, the GPUs the running gang holds, the gang
that waits with its owner leader's reason; an AZ whose leader died shows no
leader."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import select
import signal
import sys
from typing import Any

import pytest

from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import REPO, LocalCluster, dgx_node, tiny

pytestmark = pytest.mark.integration


async def top(c: LocalCluster, *args: str, address: str) -> str:
    """``phalanx top ARGS`` as a user runs it (stdout a pipe: the plain
    view); asynchronous, so the simulated agents keep heartbeating."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx", "top", "--address", address, *args, cwd=REPO, env=c.client_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def top_json(c: LocalCluster, address: str) -> dict[str, Any]:
    return json.loads(await top(c, "--once", "-o", "json", address=address))


def table_rows(text: str, header_start: str) -> list[list[str]]:
    """The rows of the plain table whose header line starts with
    ``header_start`` (cells split on runs of two or more blanks)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 1:]:
        if not line or line.startswith(("gangs:", "pending:", "cluster ")):
            break
        rows.append(re.split(r"\s{2,}", line))
    return rows


async def live_frames(c: LocalCluster, address: str) -> int:
    """Run ``phalanx top`` with a pseudo-terminal as stdout until it has
    redrawn its view in place at least twice; returns how many views it
    drew (each is headed by the cluster's name), after Ctrl-C (exit 130)."""
    leader, tty = pty.openpty()
    env = dict(c.client_env(), COLUMNS="200", LINES="50", TERM="xterm")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx", "top", "--interval", "0.2", "--address", address,
        cwd=REPO, env=env, stdout=tty, stderr=asyncio.subprocess.PIPE)
    os.close(tty)
    seen = b""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    try:
        # A redraw moves the cursor up over the previous view (ESC [ n A).
        while len(re.findall(rb"\x1b\[\d*A", seen)) < 2:
            assert loop.time() < deadline, seen[-2000:]
            ready, _, _ = await asyncio.to_thread(select.select, [leader], [], [], 1.0)
            if ready:
                try:
                    seen += os.read(leader, 65536)
                except OSError:  # the terminal closed: the process ended
                    break
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 30)
        os.close(leader)
    assert proc.returncode == 130, (await proc.stderr.read()).decode()
    return seen.count(f"cluster {c.cluster} (answered by ".encode())


async def test_top_shows_leaders_capacity_states_and_why_a_gang_waits(local_cluster: LocalCluster) -> None:
    c = local_cluster
    a0 = c.start_coordinator("az-a", "a0")
    b0 = c.start_coordinator("az-b", "b0")
    lead_a, lead_b = await c.wait_leader("az-a"), await c.wait_leader("az-b")
    c.start_agents("az-a", [dgx_node("n0", "az-a"), dgx_node("n1", "az-a")])
    c.start_agents("az-b", [dgx_node("m0", "az-b")])
    await c.wait_nodes_ready("az-a", 2)
    await c.wait_nodes_ready("az-b", 1)
    # One node's GPUs busy for the test's length; a gang of both nodes waits.
    busy = await c.submit(tiny("busy", members=1, gpus=8, duration=600.0), address=a0.address)
    await c.wait_state(busy.id, {pb.GANG_STATE_RUNNING})
    wide = await c.submit(tiny("wide", members=2, gpus=8, duration=1.0), address=a0.address)

    async def leader_reason() -> str:
        while True:
            ex = await c.stub(a0.address).ExplainGang(gpb.ExplainGangRequest(id=wide.id), timeout=10)
            if ex.leader_reason:
                return ex.leader_reason
            await asyncio.sleep(0.2)

    reason = await asyncio.wait_for(leader_reason(), 30)

    # Asked of az-b's coordinator: any coordinator answers for the cluster.
    view = await top_json(c, b0.address)
    assert view["cluster"] == c.cluster and view["served_by"] == "b0" and view["address"] == b0.address
    azs = {a["az"]: a for a in view["azs"]}
    assert azs["az-a"] == {"az": "az-a", "leader": "a0", "address": a0.address, "epoch": lead_a.epoch, "nodes_ready": 2,
                           "nodes_total": 2, "gpus_used": 8, "gpus_free_ready": 8, "gpus_total": 16}
    assert azs["az-b"] == {"az": "az-b", "leader": "b0", "address": b0.address, "epoch": lead_b.epoch, "nodes_ready": 1,
                           "nodes_total": 1, "gpus_used": 0, "gpus_free_ready": 8, "gpus_total": 8}
    assert dict(map(tuple, view["gangs_by_state"])) == {"PENDING": 1, "RUNNING": 1}
    assert view["pending_total"] == 1
    (row,) = view["pending"]
    assert (row["id"], row["name"], row["queue"], row["owner_az"], row["gpus"]) == (wide.id, "wide", "default", "az-a", 16)
    assert row["reason"].startswith("queue position 1 of 1 in az-a"), row
    assert row["reason"] == " ".join(reason.split())
    assert 0 <= row["waited_s"] < row["timeout_s"]

    # The plain view says the same.
    text = await top(c, "--once", address=a0.address)
    assert text.startswith(f"cluster {c.cluster} (answered by a0 at {a0.address}) ")
    assert table_rows(text, "AZ  ") == [["az-a", "a0", str(lead_a.epoch), "2/2", "8", "8", "16"],
                                        ["az-b", "b0", str(lead_b.epoch), "1/1", "0", "8", "8"]]
    assert "gangs: PENDING 1, RUNNING 1" in text and "pending: 1" in text
    (prow,) = table_rows(text, "ID  ")
    assert prow[:5] == [wide.id, "wide", "default", "az-a", "16"] and prow[-1] == " ".join(reason.split())

    # --watch without a terminal: a fresh copy every interval.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx", "top", "--watch", "--interval", "0.2", "--address", a0.address,
        cwd=REPO, env=c.client_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        headers = []
        while len(headers) < 2:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            assert line, (await proc.stderr.read()).decode()
            if line.startswith("cluster "):
                headers.append(line)
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.returncode == 130  # Ctrl-C, as for every command

    # On a terminal: rich's live display, redrawn in place (cursor moves)
    # every interval, until Ctrl-C.
    assert await live_frames(c, a0.address) >= 2

    # az-b's only coordinator dies: a --watch asking only it keeps its last
    # view, headed by why the refresh failed; once b0's lease is gone, az-b
    # has no leader.
    watch = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx", "top", "--watch", "--interval", "0.3", "--rpc-timeout", "1",
        "--address", b0.address, cwd=REPO, env=c.client_env(), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        first = (await asyncio.wait_for(watch.stdout.readline(), 30)).decode()
        assert first.startswith(f"cluster {c.cluster} (answered by b0"), first
        b0.signal(signal.SIGKILL)
        b0.proc.wait(10)
        # A copy is its header line, then "refresh failed: ..." when the
        # newest refresh failed: that copy is the last good one again.
        last_good, header = first, first
        while True:
            line = (await asyncio.wait_for(watch.stdout.readline(), 30)).decode()
            assert line, (await watch.stderr.read()).decode()
            if line.startswith("refresh failed: "):
                break
            if header is not None:  # the line after a header: that copy was good
                last_good, header = header, None
            if line.startswith("cluster "):
                header = line
        assert header == last_good, "a failed refresh shows the last good view, with its time"
        # Refused outright once b0 is gone ("nothing is listening at"); a
        # refresh that was in flight when it died ends "could answer".
        assert ("nothing is listening at " + b0.address in line
                or ("could answer" in line and b0.address in line)), line
    finally:
        watch.send_signal(signal.SIGINT)
        await asyncio.wait_for(watch.wait(), 30)
    deadline = asyncio.get_running_loop().time() + 30
    while await c.leader("az-b") is not None:
        assert asyncio.get_running_loop().time() < deadline, "az-b's lease outlived its coordinator"
        await asyncio.sleep(0.2)
    azs = {a["az"]: a for a in (await top_json(c, a0.address))["azs"]}
    assert (azs["az-b"]["leader"], azs["az-b"]["epoch"], azs["az-b"]["gpus_total"]) == ("", 0, 8)
    assert azs["az-a"]["leader"] == "a0"
    text = await top(c, "--once", address=a0.address)
    assert table_rows(text, "AZ  ")[1][:3] == ["az-b", "(none)", "-"]
