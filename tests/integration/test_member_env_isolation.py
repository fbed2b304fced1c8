"""Nothing of a gang's spec reaches a privileged process (docs/security.md
"What a member can and cannot do to its node", docs/launcher.md "Member-side
fencing (the shim)").

A gang's ``run.env`` sets every variable glibc's loader (and libc) reads to
a shared library the test compiled, in a directory the member's user can
write. The library's constructor appends ``pid euid exe`` to a marker file
whenever any process loads it. A member is launched through the real
``ProcessLauncher``, under the fencing shim (a fence lease) and without it;
the marker then holds lines of the member's user only: never of root or of
the agent's user. The member still sees its environment unchanged, and runs
with ``NoNewPrivs: 1``.

Switching users needs root (CI runs as root); elsewhere these tests are
skipped: the member would then run as the agent's own user.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from agent.launcher import MemberKey, MemberLaunch
from agent.core.member_env import ADOPTION_ENV, SHIM_PATH_VAR, member_environment
from agent.core.member_exit import EXIT_SPAWN_FAILED
from agent.process import ProcessLauncher
from agent.procfs import read_proc_environ
from agent.run_as import default_run_as
from agent.shim import LEASE_FILE, write_lease
from tests.integration.test_run_as import Exits
from tests.members import MEMBER_PYTHON, member_tmp, writable  # noqa: F401 (member_tmp: a fixture)

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.geteuid() != 0, reason="members run as another user only under root")]

WAIT_S = 20.0  # an upper bound for something to happen, never a pass/fail timing

# The variables glibc drops for a set-uid program because they change what a
# process loads or where it writes: glibc's sysdeps/generic/unsecvars.h
# (UNSECURE_ENVVARS). A spec may set every one of them.
GLIBC_UNSECURE_ENVVARS = (
    "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LD_AUDIT", "LD_DEBUG",
    "LD_DEBUG_OUTPUT", "LD_DYNAMIC_WEAK", "LD_HWCAP_MASK", "LD_LIBRARY_PATH", "LD_ORIGIN_PATH",
    "LD_PRELOAD", "LD_PROFILE", "LD_SHOW_AUXV", "LD_USE_LOAD_BIAS", "LOCALDOMAIN", "LOCPATH",
    "MALLOC_TRACE", "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TMPDIR", "TZDIR",
)
# Those that name a directory rather than a file.
DIRECTORY_VARS = frozenset({"GCONV_PATH", "GETCONF_DIR", "LD_LIBRARY_PATH", "LD_ORIGIN_PATH", "LOCPATH",
                            "TMPDIR", "TZDIR"})

# A constructor that appends "pid euid exe" to MARKER; la_version makes it a
# valid LD_AUDIT module too.
MARKER_LIB = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

__attribute__((constructor)) static void phalanx_marker(void) {
    char exe[512];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[n > 0 ? n : 0] = 0;
    char line[640];
    int len = snprintf(line, sizeof line, "%d %d %s\n", (int)getpid(), (int)geteuid(), exe);
    int fd = open(MARKER, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
    if (fd >= 0) { (void)!write(fd, line, len); close(fd); }
}

unsigned int la_version(unsigned int version) { return version; }
"""

DUMP = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"
NO_NEW_PRIVS = ("import sys; open(sys.argv[1], 'w').write("
                "[l for l in open('/proc/self/status') if l.startswith('NoNewPrivs:')][0])")


def compile_marker_lib(lib_dir: Path, marker: Path) -> Path:
    """The marker library, built with ``cc`` in ``lib_dir`` (the member's
    user can write there); ``marker`` exists, writable by anyone."""
    src, lib = lib_dir / "marker.c", lib_dir / "libphalanxmark.so"
    src.write_text(MARKER_LIB)
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(lib), str(src)],
                   check=True, capture_output=True, timeout=60)
    os.chmod(lib, 0o755)
    marker.touch()
    os.chmod(marker, 0o666)
    return lib


def hostile_env(lib: Path) -> dict[str, str]:
    """Every unsafe variable, pointing at the library (or its directory)."""
    env = {name: str(lib.parent) if name in DIRECTORY_VARS else str(lib) for name in GLIBC_UNSECURE_ENVVARS}
    env["LD_PROFILE_OUTPUT"] = str(lib.parent)  # LD_PROFILE's output, not /var/tmp
    return env


def marker_lines(marker: Path) -> list[tuple[int, int, str]]:
    out = []
    for line in marker.read_text().splitlines():
        pid, euid, exe = line.split(" ", 2)
        out.append((int(pid), int(euid), exe))
    return out


@pytest.fixture
async def setup(member_tmp: Path):
    lib_dir = writable(member_tmp / "tenant")  # a place the member's user can write
    out = writable(member_tmp / "out")
    marker = out / "marker"
    lib = compile_marker_lib(lib_dir, marker)
    launchers: list[ProcessLauncher] = []

    def make(shim: bool) -> tuple[ProcessLauncher, Exits, str]:
        state = member_tmp / "state"
        lease = None
        if shim:
            state.mkdir(exist_ok=True)
            lease = state / LEASE_FILE
            write_lease(lease, 1e12)  # far ahead: the shim never fences during the test
        exits, agent_id = Exits(), "isolation-" + uuid.uuid4().hex[:8]
        launcher = ProcessLauncher(state, agent_id, exits, fence_lease=lease, fence_after_s=60.0,
                                   kill_timeout_s=WAIT_S)
        launchers.append(launcher)
        return launcher, exits, agent_id

    yield make, lib, marker, out
    for launcher in launchers:
        await launcher.stop_all(0)
        await launcher.close()
    for launcher in launchers:  # one closed for a restart leaves its members to the next
        for handle in launcher.running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(handle.pid, signal.SIGKILL)


@pytest.mark.parametrize("shim", [True, False], ids=["shim", "direct"])
async def test_spec_loader_variables_never_reach_a_privileged_process(setup, shim: bool) -> None:
    make, lib, marker, out = setup
    launcher, exits, agent_id = make(shim)
    dump = out / "env.json"
    spec_env = hostile_env(lib)
    launch = MemberLaunch(key=MemberKey("tenant", 1, 0), world_size=1, local_rank=0, local_world_size=1,
                          gpus=(), nics=(), command=(MEMBER_PYTHON, "-c", DUMP, str(dump)), env=spec_env)
    await launcher.start(launch)
    assert await exits.wait(launch.key) == 0, launcher.log_path(launch.key).read_text()

    member_uid = default_run_as().default.uid
    lines = marker_lines(marker)
    # The library works: the member itself loaded it, as its own user...
    assert any(euid == member_uid for _, euid, _ in lines), lines
    # ...and nothing else did: not root, not the agent's user.
    assert {euid for _, euid, _ in lines} == {member_uid}, lines
    assert os.geteuid() != member_uid

    # The member's environment is exactly the contract's, the spec's unsafe
    # variables included.
    got = json.loads(dump.read_text())
    expected = member_environment(launch, agent_id=agent_id, base=os.environ,
                                  work_dir=str(launcher.work_path(launch.key)), account=default_run_as().default)
    for name, value in spec_env.items():
        assert got.get(name) == value, name
    if "LC_CTYPE" not in expected:
        got.pop("LC_CTYPE", None)  # Python's own locale coercion (PEP 538) under the C locale
    assert got == expected


@pytest.mark.parametrize("shim", [True, False], ids=["shim", "direct"])
async def test_member_runs_with_no_new_privs(setup, shim: bool) -> None:
    make, _lib, _marker, out = setup
    launcher, exits, _agent_id = make(shim)
    status = out / "status"
    launch = MemberLaunch(key=MemberKey("nnp", 1, 0), world_size=1, local_rank=0, local_world_size=1,
                          gpus=(), nics=(), command=(MEMBER_PYTHON, "-c", NO_NEW_PRIVS, str(status)))
    await launcher.start(launch)
    assert await exits.wait(launch.key) == 0, launcher.log_path(launch.key).read_text()
    assert status.read_text().split() == ["NoNewPrivs:", "1"]


async def wait_for_file(path: Path) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not path.exists():
        assert loop.time() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.02)


async def test_shim_runs_with_only_the_agents_markers_and_is_adopted(setup) -> None:
    """The shim's environment is built from scratch: a fixed PATH and the
    adoption markers, which the spec cannot override; a restarted agent
    still adopts the member by them."""
    make, lib, marker, out = setup
    first, _exits, agent_id = make(True)
    ready = out / "ready"
    spec_env = {**hostile_env(lib), "PHALANX_AGENT_ID": "evil", "PHALANX_GANG": "other", "RANK": "9",
                "PATH": str(lib.parent)}
    launch = MemberLaunch(key=MemberKey("adopted", 2, 1), world_size=2, local_rank=1, local_world_size=2,
                          gpus=(), nics=(), env=spec_env,
                          command=(MEMBER_PYTHON, "-c", "import sys, time; open(sys.argv[1], 'w'); time.sleep(300)",
                                   str(ready)))
    handle = await first.start(launch)
    await wait_for_file(ready)  # the shim has exec'd (and started the member) by now
    assert read_proc_environ(handle.pid) == {"PATH": SHIM_PATH_VAR, "PHALANX_AGENT_ID": agent_id,
                                             "PHALANX_GANG": "adopted", "PHALANX_INCARNATION": "2", "RANK": "1"}
    assert set(read_proc_environ(handle.pid) or {}) == {"PATH", *ADOPTION_ENV}
    await first.close()  # an agent restart: the member keeps running

    state = first.state_path.parent
    second = ProcessLauncher(state, agent_id, Exits(), fence_lease=state / LEASE_FILE, fence_after_s=60.0,
                             kill_timeout_s=WAIT_S)
    try:
        adopted = await second.adopt()
        assert [(h.key, h.pid) for h in adopted] == [(launch.key, handle.pid)]
        assert second.orphans_killed == []
    finally:
        await second.stop_all(0)
        await second.close()
    assert {euid for _, euid, _ in marker_lines(marker)} == {default_run_as().default.uid}


@pytest.mark.parametrize("shim", [True, False], ids=["shim", "direct"])
async def test_environment_exec_would_refuse_fails_by_name_and_makes_nothing(setup, shim: bool) -> None:
    make, _lib, _marker, out = setup
    launcher, exits, _agent_id = make(shim)
    launch = MemberLaunch(key=MemberKey("nul", 1, 0), world_size=1, local_rank=0, local_world_size=1,
                          gpus=(), nics=(), env={"GOOD": "x", "BAD_VALUE": "a\0b"},
                          command=(MEMBER_PYTHON, "-c", "open(__import__('sys').argv[1], 'w')", str(out / "ran")))
    handle = await launcher.start(launch)
    assert handle.pid == 0
    assert await exits.wait(launch.key) == EXIT_SPAWN_FAILED
    assert "environment variable 'BAD_VALUE'" in launcher.log_path(launch.key).read_text()
    assert not launcher.work_path(launch.key).exists()
    assert not (out / "ran").exists()
    assert launcher.running() == []
