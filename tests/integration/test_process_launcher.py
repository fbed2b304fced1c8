"""ProcessLauncher with real processes: environment contract, exit codes, stop
semantics (whole group, SIGKILL fallback), logs, state file, adoption, orphans.

No mocks. Every wait is bounded and polls; no assertion is about how long
something took. The ``harness`` fixture kills every process group a test created
(and anything carrying the test's agent marker), so nothing outlives a test.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Awaitable, Callable, Mapping

import pytest

from agent.launcher import MemberHandle, MemberKey, MemberLaunch
from agent.core.log_retention import stale_log_dirs
from agent.core.member_exit import EXIT_SPAWN_FAILED, EXIT_UNKNOWN
from agent.member_state import STATE_FILE
from agent.process import ProcessLauncher
from phalanx import procs
from phalanx.member_logs import read_log
from tests.members import MEMBER_PYTHON, member_tmp, writable  # noqa: F401 (member_tmp: a fixture)

# Launcher A's Popen objects are dropped by close() while their members run on
# purpose (that is what an agent restart looks like); Python warns about that.
pytestmark = pytest.mark.filterwarnings("ignore:subprocess \\d+ is still running:ResourceWarning")

WAIT_S = 10.0  # upper bound for anything to happen; never a pass/fail timing


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #

def alive(pid: int) -> bool:
    """Running (a zombie has finished: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return False
    return data[data.rindex(b")") + 2:].split()[0] not in (b"Z", b"X")


def start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rindex(b")") + 2:].split()[19])


async def wait_until(pred: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"gave up waiting for: {what}")
        await asyncio.sleep(0.02)


async def read_pid_file(path: Path) -> int:
    await wait_until(lambda: path.exists() and path.read_text().strip() != "", f"{path} written")
    return int(path.read_text().strip())


def state_members(launcher: ProcessLauncher) -> list[dict[str, object]]:
    """The member records of the state file (none if it was never written)."""
    if not launcher.state_path.exists():
        return []
    return json.loads(launcher.state_path.read_text())["members"]


def sh(script: str) -> tuple[str, ...]:
    return ("/bin/sh", "-c", script)


def launch(
    command: tuple[str, ...] = (),
    *,
    gang: str = "g",
    incarnation: int = 1,
    rank: int = 0,
    **kw: object,
) -> MemberLaunch:
    fields: dict[str, object] = dict(world_size=1, local_rank=rank, local_world_size=1,
                                     gpus=(), nics=())
    fields.update(kw)
    return MemberLaunch(key=MemberKey(gang, incarnation, rank), command=command, **fields)  # type: ignore[arg-type]


class Exits:
    """Records on_exit calls; the callback is async, as the agent's will be."""

    def __init__(self) -> None:
        self.calls: list[tuple[MemberKey, int]] = []

    async def __call__(self, key: MemberKey, code: int, ended_mono: float | None = None) -> None:
        self.calls.append((key, code))

    async def wait(self, key: MemberKey) -> int:
        await wait_until(lambda: any(k == key for k, _ in self.calls), f"exit of {key}")
        codes = [c for k, c in self.calls if k == key]
        assert len(codes) == 1, f"{key} reported {len(codes)} times: {codes}"
        return codes[0]


class Harness:
    def __init__(self, root: Path) -> None:
        self.state_dir = root / "state"
        # Members run as nobody when the suite runs as root: they write here.
        self.work = writable(root / "work")
        self.agent_id = "test-agent-" + uuid.uuid4().hex[:8]
        self.launchers: list[ProcessLauncher] = []
        self.pgids: set[int] = set()
        self.strays: list[subprocess.Popen[bytes]] = []

    def launcher(self, **kw: object) -> tuple[ProcessLauncher, Exits]:
        exits = Exits()
        launcher = ProcessLauncher(self.state_dir, self.agent_id, exits, **kw)  # type: ignore[arg-type]
        self.launchers.append(launcher)
        return launcher, exits

    async def start(self, launcher: ProcessLauncher, member: MemberLaunch) -> MemberHandle:
        handle = await launcher.start(member)
        if handle.pid:
            self.pgids.add(handle.pid)
        return handle

    def spawn(self, argv: tuple[str, ...], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        """A process this agent's launcher did not start (stray or orphan)."""
        p = procs.spawn(argv, die_with_parent=procs.KILL, env=dict(env), start_new_session=True,
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self.strays.append(p)
        self.pgids.add(p.pid)
        return p

    def marker_env(self, agent_id: str | None = None, rank: int = 0) -> dict[str, str]:
        return dict(os.environ, PHALANX_AGENT_ID=agent_id or self.agent_id,
                    PHALANX_GANG="lost", PHALANX_INCARNATION="4", RANK=str(rank))

    async def cleanup(self) -> None:
        for launcher in self.launchers:
            await launcher.close()
        marked = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if f"PHALANX_AGENT_ID={self.agent_id}".encode() in f.read().split(b"\0"):
                        marked.append(int(name))
            except OSError:
                pass
        for pgid in self.pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in marked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.strays:
            p.wait(timeout=WAIT_S)
        # Reap members of closed launchers that were our children (zombies).
        for pid in self.pgids:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


@pytest.fixture
async def harness(member_tmp: Path) -> Harness:
    h = Harness(member_tmp)
    yield h  # type: ignore[misc]
    await h.cleanup()


# --------------------------------------------------------------------------- #
# environment
# --------------------------------------------------------------------------- #

DUMP_ENV = (MEMBER_PYTHON, "-c",
            "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))")


async def test_environment_contract(harness: Harness) -> None:
    launcher, exits = harness.launcher(node_addr="10.9.8.7",
                                       extra_env={"SHARED": "operator", "OPERATOR_ONLY": "y"})
    full_out, bare_out = harness.work / "full.json", harness.work / "bare.json"
    full = launch(
        DUMP_ENV + (str(full_out),), gang="llama", incarnation=3, rank=5,
        world_size=16, local_rank=1, local_world_size=8,
        gpus=(2, 5), nics=("mlx5_1", "mlx5_3"),
        master_addr="10.0.0.1", master_port=29400, epoch=7,
        node="node-a", placement="az1/spine0/leaf2/node-a",
        # The spec tries to override Phalanx-owned variables; it must not win.
        env={"RANK": "999", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "PHALANX_AGENT_ID": "evil",
             "NCCL_IB_HCA": "mlx5", "SPEC_VAR": "x", "SHARED": "spec"},
    )
    bare = launch(DUMP_ENV + (str(bare_out),), gang="llama", incarnation=3, rank=6)
    await harness.start(launcher, full)
    await harness.start(launcher, bare)
    assert await exits.wait(full.key) == 0
    assert await exits.wait(bare.key) == 0

    env = json.loads(full_out.read_text())
    assert env["PHALANX_GANG"] == "llama"
    assert env["PHALANX_INCARNATION"] == "3"
    assert env["PHALANX_AGENT_ID"] == harness.agent_id
    assert env["PHALANX_NODE"] == "node-a"
    assert env["PHALANX_PLACEMENT"] == "az1/spine0/leaf2/node-a"
    assert env["PHALANX_EPOCH"] == "7"
    assert env["RANK"] == "5"
    assert env["WORLD_SIZE"] == "16"
    assert env["LOCAL_RANK"] == "1"
    assert env["LOCAL_WORLD_SIZE"] == "8"
    assert env["MASTER_ADDR"] == "10.0.0.1"
    assert env["MASTER_PORT"] == "29400"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["NCCL_IB_HCA"] == "=mlx5_1,mlx5_3"
    # Spec env and operator env pass through; the spec beats the operator.
    assert env["SPEC_VAR"] == "x"
    assert env["OPERATOR_ONLY"] == "y"
    assert env["SHARED"] == "spec"
    # The agent's own environment is the base.
    assert env["PATH"] == os.environ["PATH"]

    env = json.loads(bare_out.read_text())
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # no GPUs reserved: none visible
    assert env["NCCL_IB_HCA"] == ""
    assert env["MASTER_ADDR"] == "10.9.8.7"  # no rendezvous given: this node
    assert env["PHALANX_NODE"] == harness.agent_id
    assert env["RANK"] == "6"


# --------------------------------------------------------------------------- #
# exits and stops
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "poll"])
async def test_exit_codes_are_reported_once(harness: Harness, use_pidfd: bool) -> None:
    launcher, exits = harness.launcher(use_pidfd=use_pidfd)
    ok = launch(sh("exit 0"), rank=0)
    three = launch(sh("exit 3"), rank=1)
    killed = launch(sh("kill -TERM $$; sleep 5"), rank=2)
    simulated = launch((), rank=3, duration_s=0.05)  # no command: built-in sleeper
    for m in (ok, three, killed, simulated):
        await harness.start(launcher, m)
    assert await exits.wait(ok.key) == 0
    assert await exits.wait(three.key) == 3
    assert await exits.wait(killed.key) == -signal.SIGTERM
    assert await exits.wait(simulated.key) == 0
    assert launcher.running() == []
    assert len(exits.calls) == 4


async def test_stop_all_falls_back_to_sigkill_after_grace(harness: Harness) -> None:
    launcher, exits = harness.launcher()
    ready = harness.work / "ready"
    stubborn = launch(sh(f'trap "" TERM; echo ok > {ready}; exec sleep 30'), rank=0)
    polite = launch(("sleep", "30"), rank=1)
    await harness.start(launcher, stubborn)
    await harness.start(launcher, polite)
    # SIGTERM must arrive after the trap is set, or the test proves nothing.
    await wait_until(ready.exists, "SIGTERM ignored")
    assert {h.key for h in launcher.running()} == {stubborn.key, polite.key}

    await launcher.stop_all(grace_s=0.3)

    # stop returns after the exit is reported: no waiting needed here.
    assert dict(exits.calls) == {stubborn.key: -signal.SIGKILL, polite.key: -signal.SIGTERM}
    assert launcher.running() == []
    await launcher.stop(stubborn.key, grace_s=0.3)  # idempotent
    assert len(exits.calls) == 2


async def test_stop_kills_the_whole_process_group(harness: Harness) -> None:
    launcher, exits = harness.launcher()
    child_file = harness.work / "child"
    # The child ignores SIGTERM and outlives its parent unless the group is killed.
    member = launch(sh(f'(trap "" TERM; exec sleep 30) & echo $! > {child_file}; wait'))
    handle = await harness.start(launcher, member)
    child = await read_pid_file(child_file)
    assert alive(child) and alive(handle.pid)

    await launcher.stop(member.key, grace_s=2.0)

    assert not alive(handle.pid)
    assert not alive(child)
    assert exits.calls == [(member.key, -signal.SIGTERM)]


async def test_leader_exit_kills_leftover_children(harness: Harness) -> None:
    launcher, exits = harness.launcher()
    child_file = harness.work / "child"
    member = launch(sh(f"sleep 30 & echo $! > {child_file}; exit 0"))
    await harness.start(launcher, member)
    assert await exits.wait(member.key) == 0
    # Reported only once the group is gone: the devices are really free.
    assert not alive(int(child_file.read_text()))


@pytest.mark.parametrize("command", [("/nonexistent/phalanx-no-such-binary",), ("/etc/hostname",)],
                         ids=["not-found", "not-executable"])
async def test_spawn_failure_reported_as_127(harness: Harness, command: tuple[str, ...]) -> None:
    launcher, exits = harness.launcher()
    member = launch(command)
    handle = await harness.start(launcher, member)
    assert handle.pid == 0
    assert await exits.wait(member.key) == EXIT_SPAWN_FAILED
    assert launcher.running() == []
    assert state_members(launcher) == []
    assert "failed to start" in launcher.log_path(member.key).read_text()


async def test_unwritable_log_is_a_spawn_failure_not_a_crash(harness: Harness) -> None:
    launcher, exits = harness.launcher()
    (harness.state_dir / "logs").mkdir(parents=True, exist_ok=True)  # the launcher made it
    (harness.state_dir / "logs" / "g").write_text("a file where the gang's log dir belongs")
    member = launch(("sleep", "30"))
    assert (await harness.start(launcher, member)).pid == 0
    assert await exits.wait(member.key) == EXIT_SPAWN_FAILED
    assert launcher.running() == []


# --------------------------------------------------------------------------- #
# logs
# --------------------------------------------------------------------------- #

async def test_logs_capture_output_and_read_log_finds_them(harness: Harness) -> None:
    launcher, exits = harness.launcher()
    members = [
        launch(sh("echo out-r$RANK; echo err-r$RANK >&2"), gang="talk", incarnation=1, rank=0),
        launch(sh("echo out-r$RANK; echo err-r$RANK >&2"), gang="talk", incarnation=1, rank=1),
        launch(sh("echo out-r$RANK-inc2"), gang="talk", incarnation=2, rank=0),
    ]
    for m in members:
        await harness.start(launcher, m)
    for m in members:
        assert await exits.wait(m.key) == 0

    found = read_log(harness.state_dir, "talk")
    assert [k for k, _ in found] == [m.key for m in members]
    for key, path in found:
        assert path == launcher.log_path(key)
        assert path == harness.state_dir / "logs" / "talk" / str(key.incarnation) / f"rank-{key.rank}.log"
    text = launcher.log_path(members[1].key).read_text()
    assert "out-r1" in text and "err-r1" in text
    assert "start talk#1/r1" in text and "exit talk#1/r1 code=0" in text

    assert [k for k, _ in read_log(harness.state_dir, "talk", rank=0)] == [members[0].key, members[2].key]
    assert [k for k, _ in read_log(harness.state_dir, "talk", incarnation=2)] == [members[2].key]
    assert read_log(harness.state_dir, "no-such-gang") == []


# --------------------------------------------------------------------------- #
# state file and adoption
# --------------------------------------------------------------------------- #

async def test_state_file_lists_live_members(harness: Harness) -> None:
    launcher, exits = harness.launcher()
    a = launch(("sleep", "30"), rank=0, gpus=(0, 1), nics=("mlx5_0",), epoch=12)
    b = launch(("sleep", "30"), rank=1, gpus=(2, 3), nics=("mlx5_1",), epoch=12)
    ha = await harness.start(launcher, a)
    hb = await harness.start(launcher, b)
    assert (await launcher.start(a)).pid == ha.pid  # idempotent per key

    doc = json.loads(launcher.state_path.read_text())
    assert doc["agent_id"] == harness.agent_id
    records = {(r["gang"], r["incarnation"], r["rank"]): r for r in doc["members"]}
    assert set(records) == {("g", 1, 0), ("g", 1, 1)}
    for handle in (ha, hb):
        rec = records[(handle.key.gang, handle.key.incarnation, handle.key.rank)]
        assert rec["pid"] == handle.pid
        assert rec["pgid"] == handle.pid  # own process group
        assert rec["start_ticks"] == start_ticks(handle.pid)
        assert rec["gpus"] == list(handle.gpus)
        assert rec["nics"] == list(handle.nics)
        assert rec["epoch"] == 12
        assert rec["started_at"] == handle.started_at
    assert [p.name for p in harness.state_dir.iterdir() if p.name.endswith(".tmp")] == []

    await launcher.stop(a.key, grace_s=2.0)
    doc = json.loads(launcher.state_path.read_text())
    assert [(r["rank"], r["pid"]) for r in doc["members"]] == [(1, hb.pid)]


@pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "poll"])
async def test_restarted_launcher_adopts_and_watches_members(harness: Harness, use_pidfd: bool) -> None:
    first, first_exits = harness.launcher()
    a = launch(("sleep", "30"), rank=0, gpus=(0,), nics=("mlx5_0",), epoch=3)
    b = launch(("sleep", "30"), rank=1, gpus=(1,), nics=("mlx5_1",), epoch=3)
    handles = {h.key: h for h in [await harness.start(first, a), await harness.start(first, b)]}
    await first.close()
    assert all(alive(h.pid) for h in handles.values())  # close() kills nothing

    second, exits = harness.launcher(use_pidfd=use_pidfd)
    adopted = await second.adopt()
    assert {h.key: h for h in adopted} == handles  # the state file round-trips
    assert second.vanished == [] and second.orphans_killed == []
    assert {h.key for h in second.running()} == set(handles)

    os.killpg(handles[a.key].pid, signal.SIGKILL)  # dies behind the agent's back
    assert await exits.wait(a.key) == EXIT_UNKNOWN  # not our child: status unknown
    assert [h.key for h in second.running()] == [b.key]

    await second.stop(b.key, grace_s=2.0)
    assert not alive(handles[b.key].pid)
    assert await exits.wait(b.key) == EXIT_UNKNOWN
    assert state_members(second) == []
    assert first_exits.calls == []  # the closed launcher reported nothing


async def test_members_gone_during_restart_are_reported_vanished(harness: Harness) -> None:
    first, _ = harness.launcher()
    member = launch(("sleep", "30"))
    handle = await harness.start(first, member)
    await first.close()
    os.killpg(handle.pid, signal.SIGKILL)
    await wait_until(lambda: not alive(handle.pid), "member dead")

    second, exits = harness.launcher()
    assert await second.adopt() == []
    assert second.vanished == [member.key]
    assert await exits.wait(member.key) == EXIT_UNKNOWN
    assert state_members(second) == []


def point_record_at(launcher: ProcessLauncher, key: MemberKey, pid: int, ticks: int | None = None) -> None:
    """Rewrite ``key``'s record in the state file to name ``pid`` (and, when
    given, its start time): what a reused pid, or a record naming the wrong
    process, looks like to the next adopter."""
    doc = json.loads(launcher.state_path.read_text())
    for rec in doc["members"]:
        if (rec["gang"], rec["incarnation"], rec["rank"]) == (key.gang, key.incarnation, key.rank):
            rec["pid"] = pid
            rec["start_ticks"] = rec["start_ticks"] if ticks is None else ticks
    launcher.state_path.write_text(json.dumps(doc))


@pytest.mark.parametrize("stranger", ["marked-other-start", "unmarked-same-start"])
async def test_a_live_stranger_at_a_recorded_pid_is_not_adopted(harness: Harness, stranger: str) -> None:
    """The PID-reuse guards of adoption, each with a live process sitting at
    the dead member's recorded pid. ``marked-other-start``: the pid now
    belongs to a child of another member of ours (it carries this agent's
    marker, so only the recorded start time tells it apart; fails if both
    start-time compares of ``_attach`` are removed). ``unmarked-same-start``:
    the record names a process that is not ours at its very start time (only
    the marker tells it apart; fails if ``_attach``'s marker check is
    removed). Either way the dead member is reported vanished, the other
    member alone is adopted, and the stranger is neither adopted nor
    signalled."""
    first, _ = harness.launcher()
    gone = launch(("sleep", "30"), rank=0)
    child_file = harness.work / "other-child"
    other = launch(sh(f"sleep 30 & echo $! > {child_file}; wait"), rank=1)
    dead = await harness.start(first, gone)
    await harness.start(first, other)
    child = await read_pid_file(child_file)
    await first.close()
    os.killpg(dead.pid, signal.SIGKILL)
    await wait_until(lambda: not alive(dead.pid), "the first member dead")
    if stranger == "marked-other-start":
        victim = child
        point_record_at(first, gone.key, victim)
    else:
        victim = harness.spawn(("sleep", "30"), dict(os.environ)).pid
        point_record_at(first, gone.key, victim, start_ticks(victim))

    second, exits = harness.launcher()
    adopted = await second.adopt()
    assert [h.key for h in adopted] == [other.key]
    assert second.vanished == [gone.key]
    assert await exits.wait(gone.key) == EXIT_UNKNOWN
    assert [o.pid for o in second.orphans_killed] == []
    assert alive(victim) and alive(child)
    assert [(r["rank"], r["pid"]) for r in state_members(second)] == [(1, adopted[0].pid)]


async def test_adopt_kills_orphans_and_leaves_strays_alone(harness: Harness) -> None:
    # An adopted member with a child of its own: the child carries the marker
    # too, but belongs to the member and must survive adoption.
    first, _ = harness.launcher()
    member_child_file = harness.work / "member-child"
    member = launch(sh(f"sleep 30 & echo $! > {member_child_file}; wait"))
    await harness.start(first, member)
    member_child = await read_pid_file(member_child_file)
    await first.close()

    # Orphan: this agent's marker, no state record (crash between spawn and
    # state write), with a child of its own.
    orphan_child_file = harness.work / "orphan-child"
    orphan = harness.spawn(sh(f"sleep 30 & echo $! > {orphan_child_file}; wait"),
                           harness.marker_env(rank=9))
    orphan_child = await read_pid_file(orphan_child_file)
    # Strays: no marker at all, and another agent's marker.
    stray = harness.spawn(("sleep", "30"), dict(os.environ))
    other_agents = harness.spawn(("sleep", "30"), harness.marker_env(agent_id="someone-else"))

    second, exits = harness.launcher()
    adopted = await second.adopt()

    assert [h.key for h in adopted] == [member.key]
    assert alive(member_child)
    assert orphan.wait(timeout=WAIT_S) == -signal.SIGKILL
    assert not alive(orphan_child)
    assert [(o.pid, o.key) for o in second.orphans_killed if o.pid == orphan.pid] == [
        (orphan.pid, MemberKey("lost", 4, 9))]
    assert {o.pgid for o in second.orphans_killed} == {orphan.pid}
    assert alive(stray.pid) and alive(other_agents.pid)
    assert exits.calls == []


async def test_state_file_of_another_agent_is_neither_adopted_nor_reported(harness: Harness) -> None:
    # The agent id changed under live members: they are not this agent's, so it
    # must neither adopt them nor declare them dead (that would free devices
    # they still use). The file is kept aside for the operator.
    other, _ = harness.launcher()
    member = launch(("sleep", "30"))
    handle = await harness.start(other, member)
    await other.close()

    exits = Exits()
    renamed = ProcessLauncher(harness.state_dir, "renamed-" + harness.agent_id, exits)
    harness.launchers.append(renamed)
    assert await renamed.adopt() == []
    assert renamed.vanished == [] and renamed.orphans_killed == [] and exits.calls == []
    assert alive(handle.pid)
    assert [p.name.startswith(f"{STATE_FILE}.foreign-") for p in harness.state_dir.iterdir()
            if p.name != STATE_FILE and p.is_file()] == [True]


# log retention


@pytest.mark.parametrize("listing,live,expected", [
    ([("a", 1, 0.0)], set(), [("a", 1)]),                       # old, nobody runs it: removed
    ([("a", 1, 0.0)], {("a", 1)}, []),                          # old but a member still runs
    ([("a", 1, 950.0)], set(), []),                             # written 50 s ago: kept
    ([("a", 1, 2000.0)], set(), []),                            # mtime in the future (clock step): kept
    ([("b", 2, 0.0), ("a", 1, 0.0), ("a", 2, 990.0)], {("b", 1)}, [("a", 1), ("b", 2)]),
])
def test_stale_log_dirs(listing, live, expected) -> None:
    assert stale_log_dirs(listing, live=live, now=1000.0, retention_s=100.0) == expected


async def test_prune_removes_old_logs_of_ended_members_only(harness: Harness) -> None:
    launcher, exits = harness.launcher(log_retention_s=3600.0)
    await launcher.adopt()
    done = await harness.start(launcher, launch((MEMBER_PYTHON, "-c", "print('done')"), gang="old"))
    assert await exits.wait(done.key) == 0
    running = await harness.start(launcher, launch((MEMBER_PYTHON, "-c", "import time; time.sleep(60)"),
                                                   gang="live"))
    recent = await harness.start(launcher, launch((MEMBER_PYTHON, "-c", "pass"), gang="recent"))
    assert await exits.wait(recent.key) == 0
    long_ago = time.time() - 2 * 3600
    for key in (done.key, running.key):  # both last written two hours ago
        d = launcher.log_path(key).parent
        for f in [d, *d.iterdir()]:
            os.utime(f, (long_ago, long_ago))
    removed = launcher.prune_logs()
    assert removed == [launcher.log_path(done.key).parent]
    assert not (harness.state_dir / "logs" / "old").exists()  # its last incarnation: the gang dir goes too
    assert launcher.log_path(running.key).exists() and launcher.log_path(recent.key).exists()
    assert read_log(harness.state_dir, "old") == []


def test_log_retention_must_be_positive(harness: Harness) -> None:
    with pytest.raises(ValueError, match="log_retention_s"):
        harness.launcher(log_retention_s=0.0)
