"""Member-side fencing (agent/shim.py) with real processes: a member whose
agent stops refreshing the fence lease — or is dead — is fenced by its shim.

Timeouts here are upper bounds for something to happen, never pass/fail
timings: every assertion is on an effect (a process gone, an exit status, a
log line)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent.launcher import MemberKey, MemberLaunch
from agent.core.member_exit import EXIT_UNKNOWN
from agent.process import ProcessLauncher
from agent.procfs import read_proc_environ, read_proc_stat
from agent.shim import EXIT_FENCED, LEASE_FILE, SHIM_FILE_NAME, read_exit_record, read_lease, write_lease
from phalanx import procs
from phalanx.member_logs import member_exit_path
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import LocalCluster
from tests.integration.test_gang_runtime import AZ, agent_proc, events
from tests.members import MEMBER_PYTHON, member_tmp, writable  # noqa: F401 (member_tmp: a fixture)

pytestmark = pytest.mark.integration


@pytest.fixture
def tmp_path(member_tmp: Path) -> Path:
    """Here ``tmp_path`` is a directory members can reach and write (its
    pid and "go" files): they run as nobody when the suite runs as root."""
    return writable(member_tmp / "t")

SHIM = Path(__file__).resolve().parents[2] / "agent" / SHIM_FILE_NAME
WAIT_S = 20.0

# Writes its pid, then sleeps; with "ignore" it ignores SIGTERM first.
MEMBER = (
    "import os, signal, sys, time\n"
    "if sys.argv[2] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "p = sys.argv[1]; open(p + '.tmp', 'w').write(str(os.getpid())); os.replace(p + '.tmp', p)\n"
    "time.sleep(300)\n"
)


def wait_for(pred, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def alive(pid: int) -> bool:
    st = read_proc_stat(pid)
    return st is not None and st.alive


def group_alive(pgid: int) -> bool:
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = read_proc_stat(int(name))
            if st is not None and st.pgid == pgid and st.alive:
                return True
    return False


class Lease:
    """Keeps a lease file fresh from a thread, like an agent hearing its leader."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        write_lease(self.path, time.monotonic())

        def loop() -> None:
            while not self._stop.wait(0.05):
                write_lease(self.path, time.monotonic())

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class Shim:
    def __init__(self, tmp: Path, cmd: list[str], *, fence_after: float = 1.0, grace: float = 0.5,
                 lease: Path | None = None, exit_file: Path | None = None) -> None:
        self.log = tmp / "member.log"
        self.lease = lease or tmp / "lease"
        extra = ["--exit-file", str(exit_file)] if exit_file is not None else []
        with open(self.log, "ab") as log:
            self.proc = procs.spawn(  # TERM: the shim stops its member first
                [sys.executable, "-I", str(SHIM), "--lease", str(self.lease), "--fence-after", str(fence_after),
                 "--grace", str(grace), *extra, "--", *cmd], die_with_parent=procs.TERM,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self) -> int:
        return self.proc.wait(WAIT_S)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(WAIT_S)


@pytest.fixture
def shims():
    started: list[Shim] = []
    yield started
    for s in started:
        s.kill()


def member_cmd(pidfile: Path, mode: str = "") -> list[str]:
    return [MEMBER_PYTHON, "-c", MEMBER, str(pidfile), mode or "-"]


def child_pid(pidfile: Path) -> int:
    wait_for(pidfile.exists, "member pid file")
    return int(pidfile.read_text())


def test_fresh_lease_keeps_member_then_stale_lease_fences_it(tmp_path: Path, shims: list[Shim]) -> None:
    lease = Lease(tmp_path / "lease")
    lease.start()
    pidfile = tmp_path / "pid"
    s = Shim(tmp_path, member_cmd(pidfile), fence_after=1.0, lease=lease.path)
    shims.append(s)
    pid = child_pid(pidfile)
    # The shim must have read the fresh lease many times (every 0.2 s) and
    # found it fresh: wait for well over fence_after of wall time.
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        assert s.proc.poll() is None and alive(pid), "fenced although the lease is fresh"
        time.sleep(0.1)
    assert "FENCED" not in s.log.read_text()
    lease.stop()  # the agent stops hearing its leader (or dies)
    assert s.wait() == EXIT_FENCED
    assert not alive(pid) and not group_alive(s.proc.pid)
    lines = [ln for ln in s.log.read_text().splitlines() if "FENCED" in ln]
    assert len(lines) == 1 and lines[0].startswith("phalanx-shim: FENCED: no valid leader contact for ")
    # The lease last written stays the reference: the shim did not fence
    # before fence_after had passed since it.
    silent = float(lines[0].split("contact for ")[1].split(" s")[0])
    assert silent >= 1.0
    assert read_lease(lease.path) is not None


def test_missing_lease_fences_after_fence_after(tmp_path: Path, shims: list[Shim]) -> None:
    pidfile = tmp_path / "pid"
    s = Shim(tmp_path, member_cmd(pidfile), fence_after=0.5, lease=tmp_path / "never-written")
    shims.append(s)
    pid = child_pid(pidfile)
    assert s.wait() == EXIT_FENCED
    assert not alive(pid) and not group_alive(s.proc.pid)
    assert "phalanx-shim: FENCED: no valid leader contact for" in s.log.read_text()


def test_garbled_lease_counts_as_missing(tmp_path: Path, shims: list[Shim]) -> None:
    (tmp_path / "lease").write_text("not a number\n")
    pidfile = tmp_path / "pid"
    s = Shim(tmp_path, member_cmd(pidfile), fence_after=0.5)
    shims.append(s)
    pid = child_pid(pidfile)
    assert s.wait() == EXIT_FENCED
    assert not alive(pid)


def test_member_ignoring_sigterm_is_sigkilled_after_grace(tmp_path: Path, shims: list[Shim]) -> None:
    pidfile = tmp_path / "pid"
    s = Shim(tmp_path, member_cmd(pidfile, "ignore"), fence_after=0.5, grace=0.5, lease=tmp_path / "none")
    shims.append(s)
    pid = child_pid(pidfile)
    assert s.wait() == EXIT_FENCED
    assert not alive(pid) and not group_alive(s.proc.pid)
    text = s.log.read_text()
    assert "FENCED" in text and "SIGKILL" in text


def test_fencing_kills_the_members_whole_group(tmp_path: Path, shims: list[Shim]) -> None:
    # The member forks a grandchild that ignores SIGTERM; both must go.
    pidfile = tmp_path / "pid"
    code = ("import os, signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            "p = sys.argv[1]; open(p + '.tmp', 'w').write(str(c.pid)); os.replace(p + '.tmp', p)\n"
            "time.sleep(300)\n")
    s = Shim(tmp_path, [sys.executable, "-c", code, str(pidfile)], fence_after=0.5, grace=0.3,
             lease=tmp_path / "none")
    shims.append(s)
    grandchild = child_pid(pidfile)
    assert s.wait() == EXIT_FENCED
    assert not alive(grandchild) and not group_alive(s.proc.pid)


@pytest.mark.parametrize("script,expected", [
    ("raise SystemExit(0)", 0),
    ("raise SystemExit(3)", 3),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),
])
def test_child_status_passes_through(tmp_path: Path, shims: list[Shim], script: str, expected: int) -> None:
    lease = Lease(tmp_path / "lease")
    lease.start()
    try:
        s = Shim(tmp_path, [sys.executable, "-c", script], fence_after=5.0, lease=lease.path)
        shims.append(s)
        assert s.wait() == expected
    finally:
        lease.stop()
    assert "FENCED" not in s.log.read_text()


def test_sigterm_to_the_shim_is_forwarded_and_status_reported(tmp_path: Path, shims: list[Shim]) -> None:
    lease = Lease(tmp_path / "lease")
    lease.start()
    try:
        pidfile = tmp_path / "pid"
        s = Shim(tmp_path, member_cmd(pidfile), fence_after=5.0, lease=lease.path)
        shims.append(s)
        pid = child_pid(pidfile)
        os.kill(s.proc.pid, signal.SIGTERM)  # the shim only, not the group
        assert s.wait() == -signal.SIGTERM
        assert not alive(pid)
    finally:
        lease.stop()


@pytest.mark.parametrize("script,expected", [
    ("raise SystemExit(0)", 0),
    ("raise SystemExit(120)", 120),  # the member's own 120 is not a fence
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),
])
def test_exit_record_holds_the_status_the_shim_ends_with(tmp_path: Path, shims: list[Shim], script: str,
                                                         expected: int) -> None:
    lease = Lease(tmp_path / "lease")
    lease.start()
    record = tmp_path / "rank-0.exit"
    try:
        before = time.monotonic()
        s = Shim(tmp_path, [sys.executable, "-c", script], fence_after=5.0, lease=lease.path, exit_file=record)
        shims.append(s)
        assert s.wait() == expected
        after = time.monotonic()
    finally:
        lease.stop()
    got = read_exit_record(record)
    assert got is not None, record.read_text() if record.exists() else "no exit record written"
    assert got["code"] == expected and got["fenced"] is False and got["pid"] == s.proc.pid
    assert got["signalled"] is False
    # CLOCK_MONOTONIC is system-wide: the shim's end lies inside our window.
    assert before <= got["ended_mono"] <= after


def test_exit_record_says_a_stop_signal_reached_the_member(tmp_path: Path, shims: list[Shim]) -> None:
    """A member that exits 0 on SIGTERM was interrupted, not finished: the
    record says ``signalled`` so that a restarted agent reports it STOPPED."""
    lease = Lease(tmp_path / "lease")
    lease.start()
    record = tmp_path / "rank-0.exit"
    pidfile = tmp_path / "pid"
    graceful = ("import os, signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                "p = sys.argv[1]; open(p + '.tmp', 'w').write(str(os.getpid())); os.replace(p + '.tmp', p)\n"
                "time.sleep(300)\n")
    try:
        s = Shim(tmp_path, [sys.executable, "-c", graceful, str(pidfile)], fence_after=5.0, lease=lease.path,
                 exit_file=record)
        shims.append(s)
        child_pid(pidfile)
        os.kill(s.proc.pid, signal.SIGTERM)
        assert s.wait() == 0
    finally:
        lease.stop()
    got = read_exit_record(record)
    assert got is not None and got["code"] == 0 and got["signalled"] is True and got["fenced"] is False


def test_exit_record_of_a_fenced_member(tmp_path: Path, shims: list[Shim]) -> None:
    pidfile = tmp_path / "pid"
    record = tmp_path / "rank-0.exit"
    s = Shim(tmp_path, member_cmd(pidfile), fence_after=0.5, lease=tmp_path / "none", exit_file=record)
    shims.append(s)
    pid = child_pid(pidfile)
    assert s.wait() == EXIT_FENCED
    got = read_exit_record(record)
    assert got is not None and got["code"] == EXIT_FENCED and got["fenced"] is True
    # Written after the whole group was gone: the member cannot outlive it.
    assert not alive(pid)


@pytest.mark.parametrize("content", ["", "{", "[]", '{"format": "other/1", "code": 0}',
                                     '{"format": "phalanx-member-exit/1", "code": "0", "pid": 1, '
                                     '"ended_mono": 1, "ended_wall": 1}'])
def test_unreadable_exit_record_reads_as_none(tmp_path: Path, content: str) -> None:
    path = tmp_path / "rank-0.exit"
    path.write_text(content)
    assert read_exit_record(path) is None
    assert read_exit_record(tmp_path / "missing.exit") is None


def test_shim_passes_the_environment_through(tmp_path: Path, shims: list[Shim]) -> None:
    lease = Lease(tmp_path / "lease")
    lease.start()
    try:
        out = tmp_path / "env"
        code = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"
        env = dict(os.environ, PHALANX_PROBE="x y", PYTHONPATH="/nowhere")
        with open(tmp_path / "log", "ab") as log:
            p = procs.spawn([sys.executable, "-I", str(SHIM), "--lease", str(lease.path), "--fence-after", "5",
                             "--", sys.executable, "-c", code, str(out)],
                            die_with_parent=procs.TERM,  # TERM: the shim stops its member first
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            assert p.wait(WAIT_S) == 0
    finally:
        lease.stop()
    got = json.loads(out.read_text())
    assert got["PHALANX_PROBE"] == "x y" and got["PYTHONPATH"] == "/nowhere"


# --------------------------------------------------------------------------- #
# Through ProcessLauncher
# --------------------------------------------------------------------------- #

class Exits:
    def __init__(self) -> None:
        self.calls: list[tuple[MemberKey, int]] = []
        self.ended: dict[MemberKey, float | None] = {}

    async def __call__(self, key: MemberKey, code: int, ended_mono: float | None = None) -> None:
        self.calls.append((key, code))
        self.ended[key] = ended_mono

    async def wait(self, key: MemberKey) -> int:
        deadline = time.monotonic() + WAIT_S
        while not any(k == key for k, _ in self.calls):
            assert time.monotonic() < deadline, f"no exit reported for {key}"
            await asyncio.sleep(0.02)
        return [c for k, c in self.calls if k == key][0]


def shim_children(shim_pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if int(data[data.rindex(b")") + 2:].split()[1]) == shim_pid:
                out.append(int(name))
    return out


@pytest.fixture
async def launched(tmp_path: Path):
    made: list[tuple[ProcessLauncher, Exits]] = []
    agent_id = f"fence-test-{os.getpid()}-{time.monotonic_ns()}"

    def make(**kw) -> tuple[ProcessLauncher, Exits]:
        exits = Exits()
        launcher = ProcessLauncher(tmp_path / "state", agent_id, exits, kill_timeout_s=WAIT_S, **kw)
        made.append((launcher, exits))
        return launcher, exits

    yield make
    pgids = set()
    for launcher, _ in made:
        pgids.update(h.pid for h in launcher.running())
        await launcher.stop_all(0)
        await launcher.close()
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch(gang: str, rank: int = 0) -> MemberLaunch:
    return MemberLaunch(key=MemberKey(gang, 1, rank), world_size=2, local_rank=rank, local_world_size=2,
                        gpus=(rank,), nics=(), command=(MEMBER_PYTHON, "-c", "import time; time.sleep(300)"))


async def test_launcher_member_is_fenced_when_lease_goes_stale(tmp_path: Path, launched) -> None:
    lease = tmp_path / "state" / LEASE_FILE
    launcher, exits = launched(fence_lease=lease, fence_after_s=0.5, fence_grace_s=0.5)
    handle = await launcher.start(launch("stale"))
    assert await exits.wait(handle.key) == EXIT_FENCED
    assert not group_alive(handle.pid)
    assert "phalanx-shim: FENCED" in launcher.log_path(handle.key).read_text()


@pytest.mark.parametrize("victim", ["child", "shim"])
async def test_launcher_killing_shim_or_child_fails_the_member(tmp_path: Path, launched, victim: str) -> None:
    lease = Lease(tmp_path / "state" / LEASE_FILE)
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    lease.start()
    try:
        launcher, exits = launched(fence_lease=lease.path, fence_after_s=5.0, fence_grace_s=0.5)
        handle = await launcher.start(launch("victim", rank=1))
        deadline = time.monotonic() + WAIT_S
        while not shim_children(handle.pid):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        (child,) = shim_children(handle.pid)
        # Both processes carry the member's marker; the shim is the tracked pid.
        for pid in (handle.pid, child):
            env = read_proc_environ(pid)
            assert env is not None and env["RANK"] == "1" and env["PHALANX_GANG"] == "victim"
        os.kill(child if victim == "child" else handle.pid, signal.SIGKILL)
        assert await exits.wait(handle.key) == -signal.SIGKILL
        assert not group_alive(handle.pid) and not alive(child)
    finally:
        lease.stop()


async def test_restarted_launcher_adopts_shim_wrapped_member(tmp_path: Path, launched) -> None:
    lease = Lease(tmp_path / "state" / LEASE_FILE)
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    lease.start()
    try:
        first, _ = launched(fence_lease=lease.path, fence_after_s=5.0, fence_grace_s=0.5)
        handle = await first.start(launch("adopt"))
        await first.close()  # agent restart: the member keeps running
        second, exits = launched(fence_lease=lease.path, fence_after_s=5.0, fence_grace_s=0.5)
        adopted = await second.adopt()
        assert [h.key for h in adopted] == [handle.key] and adopted[0].pid == handle.pid
        assert second.orphans_killed == [] and alive(handle.pid)
        await second.stop(handle.key, 1.0)
        assert await exits.wait(handle.key) is not None
        assert not group_alive(handle.pid)
    finally:
        lease.stop()


# A member that waits for a "go" file, then exits with the code given.
GATED = ("import os, sys, time\n"
         "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n"
         "raise SystemExit(int(sys.argv[2]))\n")


def gated_launch(gang: str, go: Path, code: int) -> MemberLaunch:
    return MemberLaunch(key=MemberKey(gang, 1, 0), world_size=1, local_rank=0, local_world_size=1,
                        gpus=(0,), nics=(), command=(MEMBER_PYTHON, "-c", GATED, str(go), str(code)))


async def test_adopted_member_reports_its_real_exit_status(tmp_path: Path, launched) -> None:
    """Finding 5 (docs/chaos.md): an adopted member is not the agent's child;
    its status comes from the shim's exit record, so a success stays one."""
    lease = Lease(tmp_path / "state" / LEASE_FILE)
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    lease.start()
    try:
        for code in (0, 7):
            go = tmp_path / f"go-{code}"
            first, _ = launched(fence_lease=lease.path, fence_after_s=5.0, fence_grace_s=0.5)
            handle = await first.start(gated_launch(f"adopt-{code}", go, code))
            await first.close()  # agent restart: the member keeps running
            second, exits = launched(fence_lease=lease.path, fence_after_s=5.0, fence_grace_s=0.5)
            assert [h.key for h in await second.adopt()] == [handle.key]
            go.touch()
            assert await exits.wait(handle.key) == code
            await second.close()
    finally:
        lease.stop()


@pytest.mark.parametrize("how", ["exits", "fenced"])
async def test_member_that_ended_while_the_agent_was_down_reports_status_and_time(
        tmp_path: Path, launched, how: str) -> None:
    """Finding 4 (docs/chaos.md): a restarted agent reports a vanished member
    with the status and the CLOCK_MONOTONIC time its shim recorded, not the
    time the agent came back."""
    lease = Lease(tmp_path / "state" / LEASE_FILE)
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    lease.start()
    go = tmp_path / "go"
    first, _ = launched(fence_lease=lease.path, fence_after_s=1.0, fence_grace_s=0.3)
    handle = await first.start(gated_launch(f"vanish-{how}", go, 3))
    await first.close()  # the agent dies; the member runs on under its shim
    if how == "exits":
        go.touch()
    else:
        lease.stop()  # nobody refreshes the lease: the shim fences
    while group_alive(handle.pid):
        await asyncio.sleep(0.05)
    gone_by = time.monotonic()
    lease.stop()
    await asyncio.sleep(0.5)  # the agent comes back later than the end
    second, exits = launched(fence_lease=lease.path, fence_after_s=1.0, fence_grace_s=0.3)
    assert await second.adopt() == [] and second.vanished == [handle.key]
    assert await exits.wait(handle.key) == (3 if how == "exits" else EXIT_FENCED)
    ended = exits.ended[handle.key]
    assert ended is not None and ended <= gone_by
    record = read_exit_record(member_exit_path(tmp_path / "state", handle.key))
    assert record is not None and record["pid"] == handle.pid


async def test_vanished_member_without_exit_record_is_unknown(tmp_path: Path, launched) -> None:
    lease = Lease(tmp_path / "state" / LEASE_FILE)
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    lease.start()
    try:
        first, _ = launched(fence_lease=lease.path, fence_after_s=5.0, fence_grace_s=0.3)
        handle = await first.start(launch("no-record"))
        await first.close()
        os.killpg(handle.pid, signal.SIGKILL)  # shim and member die together: no record
        while group_alive(handle.pid):
            await asyncio.sleep(0.05)
        second, exits = launched(fence_lease=lease.path, fence_after_s=5.0, fence_grace_s=0.3)
        await second.adopt()
        assert await exits.wait(handle.key) == EXIT_UNKNOWN and exits.ended[handle.key] is None
    finally:
        lease.stop()


# --------------------------------------------------------------------------- #
# agent-down in miniature: the agent is SIGKILLed, its member is fenced anyway
# --------------------------------------------------------------------------- #

class NodeAgent:
    """The one real agent process of a test node: SIGKILLed and started again
    on the same state dir and history, like a crashing DaemonSet pod."""

    def __init__(self, c: LocalCluster, tmp_path: Path) -> None:
        self.c, self.state, self.history = c, tmp_path / "state-n0", tmp_path / "hist-n0.jsonl"
        self.proc = agent_proc(c, "n0", self.state, self.history)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.proc.stdout.close()

    def restart(self) -> None:
        self.proc = agent_proc(self.c, "n0", self.state, self.history)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if not self.proc.stdout.closed:
            self.proc.stdout.close()


@pytest.fixture
async def node_agent(local_cluster: LocalCluster, tmp_path: Path):
    """A leader for AZ and one ready node whose agent the test may kill."""
    local_cluster.start_coordinator(AZ, "a0")
    await local_cluster.wait_leader(AZ)
    agent = NodeAgent(local_cluster, tmp_path)
    try:
        await local_cluster.wait_nodes_ready(AZ, 1)
        yield agent
    finally:
        agent.close()


async def test_member_of_a_killed_agent_is_fenced_by_its_shim(local_cluster: LocalCluster, node_agent: NodeAgent,
                                                              tmp_path: Path) -> None:
    c, agent = local_cluster, node_agent
    pidfile = tmp_path / "member-pid"
    g = await c.submit(pb.GangSpec(name="orphaned", members=1, resources=pb.Resources(gpus=8),
                                   run=pb.RunSpec(command=member_cmd(pidfile))))
    await c.wait_state(g.id, {pb.GANG_STATE_RUNNING}, timeout=60)
    for _ in range(400):
        if pidfile.exists():
            break
        await asyncio.sleep(0.05)
    member = int(pidfile.read_text())
    st = read_proc_stat(member)
    assert st is not None and st.alive
    shim_pid = st.pgid  # the shim leads the member's group
    assert member in shim_children(shim_pid)
    assert read_lease(agent.state / LEASE_FILE) is not None, "the agent publishes its lease"
    agent.kill()
    # No agent any more: only the shim can end the member.
    deadline = time.monotonic() + c.timings.fence_after_s + c.timings.stop_grace_s + WAIT_S
    while alive(member) or group_alive(shim_pid):
        assert time.monotonic() < deadline, "the member of a dead agent was never fenced"
        await asyncio.sleep(0.1)
    gone_by = time.monotonic()
    logs = list((agent.state / "logs").rglob("rank-0.log"))
    assert logs and "phalanx-shim: FENCED: no valid leader contact for" in logs[0].read_text()
    # The agent comes back: it reports the member with the status and the
    # time its shim recorded (the history's ``mono``), not its own return.
    agent.restart()
    key = f"{g.id}#1/r0"
    deadline = time.monotonic() + WAIT_S
    while not (exited := [e for e in events(agent.history) if e["event"] == "member_exited" and key in e["key"]]):
        assert time.monotonic() < deadline, "the restarted agent never reported the fenced member"
        await asyncio.sleep(0.1)
    (ev,) = exited
    assert ev["code"] == EXIT_FENCED and ev["phase"] == "VANISHED"
    assert ev["mono"] <= gone_by < ev["reported_mono"]


async def test_member_that_succeeds_while_its_agent_is_dead_counts_as_success(
        local_cluster: LocalCluster, node_agent: NodeAgent, tmp_path: Path) -> None:
    """The agent is SIGKILLed; its member exits 0 before any fence deadline;
    the agent comes back. It reports the status the shim recorded, so the gang
    SUCCEEDS instead of failing with "member vanished (agent restarted
    without it)" (the chaos run agent-restart seed 1 showed that failure)."""
    c, agent = local_cluster, node_agent
    go = tmp_path / "go"
    g = await c.submit(pb.GangSpec(name="quiet-success", members=1, resources=pb.Resources(gpus=8),
                                   run=pb.RunSpec(command=[MEMBER_PYTHON, "-c", GATED, str(go), "0"]),
                                   policy=pb.Policy(max_restarts=0)))
    await c.wait_state(g.id, {pb.GANG_STATE_RUNNING}, timeout=60)
    agent.kill()
    go.touch()  # the member finishes while nobody watches it
    record = None
    deadline = time.monotonic() + WAIT_S
    while record is None:
        assert time.monotonic() < deadline, "the shim wrote no exit record"
        record = next((read_exit_record(p) for p in (agent.state / "logs").rglob("rank-0.exit")), None)
        await asyncio.sleep(0.05)
    assert record["code"] == 0 and not record["fenced"]
    agent.restart()
    done = await c.wait_state(g.id, {pb.GANG_STATE_SUCCEEDED, pb.GANG_STATE_FAILED}, timeout=60)
    assert done.state == pb.GANG_STATE_SUCCEEDED, done.reason
    assert done.incarnation == 1  # the first run counted: no restart