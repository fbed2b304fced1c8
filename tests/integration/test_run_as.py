"""Members never run as root (agent.core.run_as, agent/run_as.py, agent/process.py), with real
processes: a member of an unmapped owner runs as nobody, a mapped owner's as
the mapped ids, an owner mapped to root only with allow_root (else it is
refused and nothing runs); each member leads its own process group, has its
account's groups only (not the agent's), and a work dir of its own as cwd,
HOME and PHALANX_WORK_DIR; its log stays the agent's. Through a cluster: the
gang's owner reaches the agent and its --run-as file decides.

An agent that is not root (a launcher in a process running as nobody)
runs its members as itself, even where the policy says root, and says so.

Switching users needs root: where the suite does not run as root those
tests are skipped (the decision table in tests/unit/test_run_as_policy.py
covers every case)."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import stat
import subprocess
import sys
import sysconfig
import uuid
from pathlib import Path

import pytest

from agent.core.run_as import Account, RunAsPolicy
from agent.launcher import MemberKey, MemberLaunch
from agent.process import ProcessLauncher
from agent.procfs import read_proc_environ
from agent.run_as import RunAsRefused, default_run_as
from agent.shim import LEASE_FILE, LeaseWriter
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster
from tests.integration.test_gang_runtime import AZ, agent_proc
from tests.members import MEMBER_PYTHON, member_tmp, reachable_by_others, writable  # noqa: F401 (member_tmp: a fixture)

pytestmark = pytest.mark.integration
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")

WAIT_S = 20.0  # an upper bound for something to happen, never a pass/fail timing
NOBODY = pwd.getpwnam("nobody")
# Ids no account of a test machine has: a mapping by ids needs no user.
MAPPED = Account("4242:4343", 4242, 4343)
# Groups the agent holds besides its own, which no member may inherit.
AGENT_EXTRA_GROUP = 4999

# The member reports who it is, where, and its process group.
REPORT = ("/bin/sh", "-c",
          'echo "uid=$(id -u) gid=$(id -g) groups=$(id -G | tr " " ,) cwd=$(pwd) home=$HOME work=$PHALANX_WORK_DIR"; '
          'echo "pid=$$ pgid=$(ps -o pgid= -p $$ | tr -d " ") sid=$(ps -o sid= -p $$ | tr -d " ")"; '
          'echo written > "$PHALANX_WORK_DIR/out" && echo wrote-work-dir')


def report(log: str) -> dict[str, str]:
    """The key=value words of the member's output lines in its log."""
    out: dict[str, str] = {}
    for line in log.splitlines():
        if line.startswith("[phalanx"):
            continue
        for word in line.split():
            k, sep, v = word.partition("=")
            if sep:
                out[k] = v
        if line == "wrote-work-dir":
            out["wrote"] = "yes"
    return out


class Exits:
    def __init__(self) -> None:
        self.codes: dict[MemberKey, int] = {}
        self.agent_id = ""

    def __call__(self, key: MemberKey, code: int, ended_mono: float | None = None) -> None:
        self.codes[key] = code

    async def wait(self, key: MemberKey) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while key not in self.codes:
            assert loop.time() < deadline, f"no exit reported for {key}"
            await asyncio.sleep(0.02)
        return self.codes[key]


def member(owner: str, gang: str = "g", command: tuple[str, ...] = REPORT) -> MemberLaunch:
    return MemberLaunch(key=MemberKey(gang, 1, 0), world_size=1, local_rank=0, local_world_size=1,
                        gpus=(), nics=(), command=command, owner=owner)


POLICY = RunAsPolicy(
    default=default_run_as().default,
    owners={"admin/mapped": MAPPED, "admin/ops": Account("root", 0, 0, (0,)), "admin/eve": Account("root", 0, 0, (0,))},
    allow_root=frozenset({"admin/ops"}),
)


@pytest.fixture(params=["direct", "shim"])
async def launcher(request, member_tmp: Path):
    """A launcher of an agent holding an extra supplementary group, with its
    members started directly or under the fencing shim (which keeps the
    agent's user and switches for the member)."""
    state = member_tmp / "state"
    groups = os.getgroups()
    os.setgroups([*groups, AGENT_EXTRA_GROUP])
    exits = Exits()
    lease = None
    writer = None
    if request.param == "shim":
        state.mkdir()
        lease = state / LEASE_FILE
        writer = LeaseWriter(lease)
        writer.update(asyncio.get_running_loop().time() + 3600, force=True)  # never stale here
    agent_id = f"runas-{uuid.uuid4().hex[:8]}"
    launcher = ProcessLauncher(state, agent_id, exits, run_as=POLICY, fence_lease=lease)
    exits.agent_id = agent_id
    try:
        yield launcher, exits
    finally:
        await launcher.stop_all(0)
        await launcher.close()
        os.setgroups(groups)


async def run_member(launcher: ProcessLauncher, exits: Exits, owner: str) -> tuple[MemberLaunch, dict[str, str], str]:
    m = member(owner)
    handle = await launcher.start(m)
    assert handle.pid > 0
    assert await exits.wait(m.key) == 0, launcher.log_path(m.key).read_text()
    log = launcher.log_path(m.key).read_text()
    return m, report(log), log


@needs_root
async def test_unmapped_owner_runs_as_nobody_with_its_own_groups_group_and_work_dir(launcher) -> None:
    launcher, exits = launcher
    m, seen, log = await run_member(launcher, exits, "queue/team-a")
    work = launcher.work_path(m.key)
    assert seen["uid"] == str(NOBODY.pw_uid) and seen["gid"] == str(NOBODY.pw_gid), log
    # nobody's own groups only: neither the agent's root group nor its extra one.
    assert set(seen["groups"].split(",")) == {str(g) for g in os.getgrouplist("nobody", NOBODY.pw_gid)}, log
    assert str(AGENT_EXTRA_GROUP) in {str(g) for g in os.getgroups()}, "the agent holds the extra group"
    # Its own session and group: it leads them (directly) or its shim does.
    assert seen["pgid"] == seen["sid"] and seen["pgid"] != str(os.getpgrp()), log
    assert seen["cwd"] == seen["home"] == seen["work"] == str(work), log
    assert seen.get("wrote") == "yes" and (work / "out").read_text() == "written\n"
    st = work.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY.pw_uid, NOBODY.pw_gid, 0o700)
    # The log is the agent's, not the member's.
    lst = launcher.log_path(m.key).stat()
    assert (lst.st_uid, stat.S_IMODE(lst.st_mode)) == (os.geteuid(), 0o600)
    assert stat.S_IMODE((launcher.state_path.parent / "logs").stat().st_mode) == 0o700
    assert "user=nobody" in log


@needs_root
async def test_mapped_owner_runs_as_the_mapped_ids_and_no_other_group(launcher) -> None:
    launcher, exits = launcher
    _, seen, log = await run_member(launcher, exits, "admin/mapped")
    assert (seen["uid"], seen["gid"], seen["groups"]) == ("4242", "4343", "4343"), log


@needs_root
async def test_owner_mapped_to_root_without_allow_root_is_refused_and_nothing_runs(launcher, member_tmp: Path) -> None:
    launcher, exits = launcher
    ran = writable(member_tmp / "out") / "ran"
    m = member("admin/eve", command=("/bin/sh", "-c", f"touch {ran}"))
    with pytest.raises(RunAsRefused) as err:
        await launcher.start(m)
    assert "owner 'admin/eve' is mapped to 'root' (uid 0)" in str(err.value)
    assert "allow_root" in str(err.value)
    assert launcher.running() == [] and m.key not in exits.codes
    assert not launcher.work_path(m.key).exists()
    log = launcher.log_path(m.key).read_text()
    assert "refused g#1/r0" in log and "allow_root" in log
    # No process anywhere carries this agent's marker, and the command never ran.
    marked = [name for name in os.listdir("/proc") if name.isdigit()
              and (read_proc_environ(int(name)) or {}).get("PHALANX_AGENT_ID") == exits.agent_id]
    assert marked == [] and not ran.exists()


@needs_root
async def test_owner_in_allow_root_runs_as_root_with_roots_groups_only(launcher) -> None:
    launcher, exits = launcher
    _, seen, log = await run_member(launcher, exits, "admin/ops")
    assert (seen["uid"], seen["gid"], seen["groups"]) == ("0", "0", "0"), log


# --------------------------------------------------------------------------- #
# Through a cluster: the owner travels with the assignment; --run-as decides
# --------------------------------------------------------------------------- #

def run_as_file(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


async def start_agent(c: LocalCluster, root: Path, run_as: Path):
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    p = agent_proc(c, "n0", root / "state-n0", root / "hist-n0.jsonl", extra=("--run-as", str(run_as)))
    await c.wait_nodes_ready(AZ, 1)
    return p


def stop_agent(p) -> None:
    p.terminate()
    try:
        p.wait(20)
    except Exception:  # noqa: BLE001
        p.kill()
    p.stdout.close()


@needs_root
async def test_gang_owner_reaches_the_agent_and_runs_as_the_mapped_user(local_cluster: LocalCluster,
                                                                       member_tmp: Path) -> None:
    c = local_cluster
    # The harness submits with the admin/tester certificate: that is the owner.
    policy = run_as_file(member_tmp / "run-as.yaml", {"owners": {"admin/tester": "4242:4343"}})
    p = await start_agent(c, member_tmp, policy)
    try:
        g = await c.submit(pb.GangSpec(name="mapped", members=1, resources=pb.Resources(gpus=1),
                                       run=pb.RunSpec(command=list(REPORT)), policy=pb.Policy(max_restarts=0)))
        done = await c.wait_state(g.id, TERMINAL, timeout=60)
        logs = list((member_tmp / "state-n0" / "logs").rglob("rank-0.log"))
        assert done.state == pb.GANG_STATE_SUCCEEDED, (done.reason, [q.read_text() for q in logs])
        seen = report(logs[0].read_text())
        assert (seen["uid"], seen["gid"]) == ("4242", "4343"), logs[0].read_text()
    finally:
        stop_agent(p)


@needs_root
async def test_gang_of_an_owner_mapped_to_root_fails_with_the_reason_and_runs_nothing(
        local_cluster: LocalCluster, member_tmp: Path) -> None:
    c = local_cluster
    policy = run_as_file(member_tmp / "run-as.yaml", {"owners": {"admin/tester": "root"}})
    p = await start_agent(c, member_tmp, policy)
    try:
        marker = writable(member_tmp / "out") / "ran"
        g = await c.submit(pb.GangSpec(name="as-root", members=1, resources=pb.Resources(gpus=1),
                                       run=pb.RunSpec(command=["/bin/sh", "-c", f"touch {marker}"]),
                                       policy=pb.Policy(max_restarts=0)))
        done = await c.wait_state(g.id, TERMINAL, timeout=60)
        assert done.state == pb.GANG_STATE_FAILED, done
        assert "allow_root" in done.reason and "admin/tester" in done.reason, done.reason
        assert not marker.exists(), "a refused member must not run"
    finally:
        stop_agent(p)


# --------------------------------------------------------------------------- #
# An agent that is not root runs members as itself
# --------------------------------------------------------------------------- #

# A launcher in a process running as nobody, with a policy whose default is
# root: it cannot switch, so the member runs as nobody too (never refused,
# never root), and the launcher says so once.
NON_ROOT_AGENT = r"""
import asyncio, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
from agent.core.run_as import Account, RunAsPolicy
from agent.launcher import MemberKey, MemberLaunch
from agent.process import ProcessLauncher

async def main():
    codes, done = {}, asyncio.Event()
    def on_exit(key, code, ended=None):
        codes[key] = code
        done.set()
    launcher = ProcessLauncher(Path(sys.argv[1]), "non-root-agent", on_exit,
                               run_as=RunAsPolicy(default=Account("root", 0, 0, (0,))))
    m = MemberLaunch(key=MemberKey("g", 1, 0), world_size=1, local_rank=0, local_world_size=1, gpus=(), nics=(),
                     command=("/bin/sh", "-c", "echo member-uid=$(id -u)"), owner="admin/eve")
    await launcher.start(m)
    await asyncio.wait_for(done.wait(), 20)
    print("code=%d" % codes[m.key])
    print(launcher.log_path(m.key).read_text())
    await launcher.close()

asyncio.run(main())
"""


@needs_root
def test_an_agent_that_is_not_root_runs_members_as_itself_and_says_so(member_tmp: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    site = sysconfig.get_paths()["purelib"]
    same = subprocess.run([MEMBER_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
                          capture_output=True, text=True, timeout=30).stdout.strip()
    if same != str(tuple(sys.version_info[:2])) or not all(reachable_by_others(p) for p in (repo, site)):
        pytest.skip("no interpreter nobody can run with this checkout and its packages")
    state = writable(member_tmp / "agent")
    done = subprocess.run([MEMBER_PYTHON, "-c", NON_ROOT_AGENT, str(state / "state")], user=NOBODY.pw_uid,
                          group=NOBODY.pw_gid, extra_groups=[], cwd=state, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=f"{repo}{os.pathsep}{site}"))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "code=0" in out and f"member-uid={NOBODY.pw_uid}" in out, out
    assert out.count("not root: members run as this same user") == 1, out


# --------------------------------------------------------------------------- #
# A bad --run-as file: the agent does not start
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("text,field,reason", [
    ("owners:\n  admin/alice: no-such-user-here\n", "owners.admin/alice", "no user 'no-such-user-here' on this node"),
    ("users: {}\n", "users", "unknown field"),
    ("allow_root: admin/ops\n", "allow_root", "must be a list of owners"),
    ("default: '12:x'\n", "default", "neither a user name nor UID:GID"),
    ("owners: [\n", "(document)", "not YAML"),
])
def test_a_bad_run_as_file_stops_the_agent_with_one_line_naming_file_and_field(
        tmp_path: Path, text: str, field: str, reason: str) -> None:
    path = tmp_path / "run-as.yaml"
    path.write_text(text)
    done = subprocess.run([sys.executable, "-m", "agent", "--az", "a", "--etcd", "127.0.0.1:1", "--insecure",
                           "--run-as", str(path)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --run-as: {path}: {field}: "), done.stderr
    assert reason in lines[0], done.stderr
