"""No orphans, ever: however ``phalanx up`` ends (SIGKILL, SIGHUP, a closed
stdout, an unexpected exception), no process of its tree survives it and no
state dir stays behind (after SIGKILL nothing of ``up`` can run: the next
``up`` removes the dir).

"Its tree" is every process below ``up`` (``phalanx.procs.descendants``:
children, the agents' member shims and members, whatever session they lead)
recorded just before the kill, each by pid *and* kernel start time, so a
reused pid never counts as a survivor. Every ``up`` runs with its own TMPDIR,
so its state dir and the next run's clean-up stay inside the test's tmp dir.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx import procs
from phalanx.up import UpProcess
from phalanx.up.config import REPO_ROOT
from phalanx.up.output import LineOut
from phalanx.up.state_dir import processes_using

pytestmark = pytest.mark.integration

SMALL = ["--azs", "2", "--coordinators-per-az", "1", "--nodes-per-az", "2", "--base-port", "0"]
TINY = ["--azs", "1", "--coordinators-per-az", "1", "--nodes-per-az", "1", "--base-port", "0"]
# Upper bound on how long a tree may take to go after its parent died (an
# agent stops its members within its stop grace first); only a wait bound.
GONE_WITHIN_S = 60.0


def up_env(tmp: Path, **extra: str) -> dict[str, str]:
    return dict(os.environ, TMPDIR=str(tmp), **extra)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def wait_gone(recorded: dict[int, int], timeout: float = GONE_WITHIN_S) -> list[str]:
    """The recorded processes still alive after waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while procs.still_alive(recorded) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [f"{p}: {cmdline(p)}" for p in procs.still_alive(recorded)]


def tree_of(up: UpProcess) -> dict[int, int]:
    assert up.proc is not None
    tree = procs.descendants(up.proc.pid)
    # etcd + 2 coordinators + 2 agent processes at least (SMALL).
    assert len(tree) >= 3, tree
    return tree


def state_dir_of(up: UpProcess, tmp: Path) -> Path:
    assert up.state_dir is not None
    assert up.state_dir.parent == tmp, "up made its state dir under TMPDIR"
    assert up.state_dir.name.startswith("phalanx-up-") and up.state_dir.is_dir()
    return up.state_dir


# --- the helper itself ---------------------------------------------------------------


PARENT = """
import threading, time
from phalanx import procs
kids = []
t = threading.Thread(target=lambda: kids.append(procs.spawn(["sleep", "300"])))
t.start(); t.join()   # that thread has exited now
kids.append(procs.spawn(["sleep", "300"], die_with_parent=procs.TERM))
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(300)
"""


def test_spawned_children_outlive_the_thread_that_asked_but_not_their_parent() -> None:
    """The kernel signal fires on the death of the forking *thread*: a child
    asked for by a thread that ended must still run, and every child must
    end once the parent is SIGKILLed (no clean-up of the parent ran)."""
    # The parent under test dies with this test run too (and its children with it).
    parent = procs.spawn(
        [sys.executable, "-c", PARENT], die_with_parent=procs.KILL, stdout=subprocess.PIPE, text=True,
        cwd=str(REPO_ROOT), start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        pids = [int(x) for x in parent.stdout.readline().split()]
        assert len(pids) == 2
        recorded = {p: procs.pid_start_time(p) for p in pids}
        assert all(v is not None for v in recorded.values())
        assert procs.still_alive(recorded) == sorted(pids), "a child died with the thread that asked for it"
        parent.kill()
        parent.wait()
        assert wait_gone(recorded) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_spawn_refuses_a_preexec_fn_of_its_own() -> None:
    with pytest.raises(TypeError, match="preexec_fn"):
        procs.spawn(["true"], preexec_fn=lambda: None)


@pytest.mark.parametrize("how", ["write", "poll"])
def test_a_closed_pipe_is_noticed_and_never_raises(how: str) -> None:
    r, w = os.pipe()
    stream = os.fdopen(w, "w")
    calls: list[int] = []
    out = LineOut(stream, on_broken=lambda: calls.append(1))
    out.line("first")
    assert os.read(r, 100) == b"first\n"
    out.check()
    assert not out.broken, "a pipe with a reader is fine"
    os.close(r)
    if how == "write":
        out.line("second")  # EPIPE: SIGPIPE is ignored in Python
    else:
        out.check()  # nothing written: the pipe polls POLLERR without a reader
    assert out.broken and calls == [1]
    out.line("third")
    out.check()
    assert calls == [1], "reported once"
    stream.close()  # the descriptor now points at /dev/null: the final flush cannot fail


# --- phalanx up, killed every way ----------------------------------------------------------


def test_sigkill_leaves_no_process_and_the_next_up_removes_the_state_dir(tmp_path: Path) -> None:
    """With --launch, so the tree holds member shims and members too: the
    agents get SIGTERM from the kernel and stop their members."""
    up = UpProcess([*SMALL, "--launch", "--gangs-per-az", "1"], env=up_env(tmp_path))
    second: UpProcess | None = None
    try:
        up.start()
        state = state_dir_of(up, tmp_path)
        up.wait_for_line(r"running [1-9]", timeout=180)
        tree = tree_of(up)
        assert any("shim.py" in cmdline(p) for p in tree), "no member was running: nothing to prove for members"
        assert up.proc is not None
        os.kill(up.proc.pid, signal.SIGKILL)
        up.proc.wait(timeout=30)
        assert wait_gone(tree) == []
        assert processes_using(state) == []
        assert state.is_dir(), "SIGKILL: up itself cannot remove its state dir"

        second = UpProcess(["--no-workload", *TINY], env=up_env(tmp_path))
        second.start()
        assert second.find_line(rf"^phalanx up: removed {re.escape(str(state))} \(state dir of a dead earlier run")
        assert not state.exists()
        assert second.state_dir is not None and second.state_dir.is_dir()  # its own, not removed
    finally:
        up.stop()
        if second is not None:
            assert second.stop(signal.SIGINT) == 0, "\n".join(second.lines[-30:])
    assert second.state_dir is not None and not second.state_dir.exists()


def test_sighup_shuts_down_cleanly(tmp_path: Path) -> None:
    up = UpProcess(["--no-workload", *SMALL], env=up_env(tmp_path))
    try:
        up.start()
        state = state_dir_of(up, tmp_path)
        tree = tree_of(up)
    finally:
        code = up.stop(signal.SIGHUP)
    assert code == 0, "\n".join(up.lines[-30:])
    assert up.find_line(r"SIGHUP: shutting down")
    assert wait_gone(tree) == []
    assert not state.exists()


def read_until(fd: int, pattern: str, timeout: float) -> list[str]:
    """Lines read from ``fd`` up to and including one matching ``pattern``."""
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    buf = b""
    lines: list[str] = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            lines.append(line.decode(errors="replace"))
            if rx.search(lines[-1]):
                return lines
    raise AssertionError(f"no line matching {pattern!r} within {timeout:g}s: {lines[-20:]}")


@pytest.mark.parametrize("how", ["reader-gone", "ctrl-c-with-tee"])
def test_a_closed_stdout_shuts_down_cleanly(tmp_path: Path, how: str) -> None:
    """``phalanx up | head``, whose reader goes away while up has nothing to
    write ("reader-gone": up notices, stops and cleans up instead of running
    unseen), and ``scripts/up.sh 2>&1 | tee up.log`` stopped with Ctrl-C
    ("ctrl-c-with-tee": tee dies first, and up's own SIGINT handler then
    writes to the closed pipe, stdout and stderr alike): either way a clean
    stop, exit code 1, nothing left."""
    r, w = os.pipe()
    err_path = tmp_path / "up.err"
    with open(err_path, "wb") as err:
        proc = procs.spawn(
            [sys.executable, "-m", "phalanx", "up", "--no-workload", *SMALL], die_with_parent=procs.TERM,
            stdin=subprocess.DEVNULL, stdout=w, stderr=w if how == "ctrl-c-with-tee" else err,
            env=up_env(tmp_path), cwd=str(REPO_ROOT),
        )
    os.close(w)
    try:
        lines = read_until(r, r"^PHALANX_ADDRESS=", timeout=240)
        state = Path(next(m.group(1) for m in map(re.compile(r"^phalanx up: state dir (\S+) ").match, lines) if m))
        tree = procs.descendants(proc.pid)
        assert len(tree) >= 3, tree
        os.close(r)
        r = -1
        if how == "ctrl-c-with-tee":
            proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        if r >= 0:
            os.close(r)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    err_text = err_path.read_text()
    assert code == 1, err_text
    if how == "reader-gone":
        assert "stdout closed" in err_text and "Traceback" not in err_text, err_text
    assert wait_gone(tree) == []
    assert not state.exists()


def test_an_unexpected_exception_still_cleans_up(tmp_path: Path) -> None:
    fp = tmp_path / "failpoints"
    up = UpProcess(["--no-workload", *SMALL], env=up_env(tmp_path, PHALANX_FAILPOINTS_FILE=str(fp)))
    try:
        up.start()
        state = state_dir_of(up, tmp_path)
        tree = tree_of(up)
        fp.write_text("up.serve_error=on\n")  # the serve loop raises RuntimeError
        assert up.proc is not None
        code = up.proc.wait(timeout=120)
    finally:
        up.stop()
    assert code == 1, "\n".join(up.lines[-30:])
    assert up.wait_for_line(r"error: unexpected RuntimeError: failpoint up.serve_error", timeout=10)
    assert up.find_line(r"^phalanx up: stopped$"), "the clean-up ran to its end"
    assert wait_gone(tree) == []
    assert not state.exists()
