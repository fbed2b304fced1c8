"""`python -m agent.shim` — member-side fencing that works while the agent is dead.

    python -m agent.shim --lease FILE --fence-after S --grace G [--exit-file F]
                         [--user UID:GID:G1,G2,...] [--env-fd N] -- CMD [ARG...]

``ProcessLauncher`` starts this shim (standard library only) as the leader of
the member's process group; the shim starts ``CMD`` as its child in the *same*
group and:

- with ``--env-fd N``, reads the member's whole environment from the
  inherited descriptor ``N`` (``encode_environment``: ``NAME=VALUE`` entries,
  each ended by a NUL), closes it, and gives it to ``CMD`` only, in the exec
  of the child (after it switched users). The shim itself runs with the
  environment the agent built from scratch (``agent.core.member_env.shim_environment``),
  so nothing of a gang's spec (``LD_PRELOAD`` and the other loader
  variables) acts in it. Without ``--env-fd`` (started by hand), ``CMD``
  inherits the shim's environment;
- sets ``no_new_privs`` on itself before it starts ``CMD`` (so on ``CMD``
  and everything it runs: no exec gains privileges, set-uid or file
  capabilities); a kernel that refuses it means the member is not started;
- waits for the child and ends with the child's status: the same exit code,
  or, when the child was killed by a signal, it dies of that same signal (so
  its parent sees exactly what it would have seen without the shim; if the
  signal cannot kill it, it exits ``128 + signal`` as shells report it);
- every ``POLL_S`` reads ``FILE``, which the agent rewrites atomically with
  the CLOCK_MONOTONIC time (``time.monotonic()``, system-wide on Linux) of its
  last valid leader contact. When ``monotonic() - last_contact > S`` — or no
  parseable value has been read and the shim has run longer than ``S`` — it
  *fences*: one line ``phalanx-shim: FENCED: no valid leader contact for X s``
  on stderr (the member log), SIGTERM to every other process of its group,
  SIGKILL to whatever is left after ``G`` seconds, and exit ``EXIT_FENCED``.
  A value once read stays in force when the file later vanishes or is garbled:
  the deadline never moves forward without a fresh agent write.
- SIGTERM / SIGINT / SIGHUP sent to the shim are forwarded to the child and
  the shim keeps waiting, so it still reports the child's status. The
  launcher's stop signals the whole group anyway (and SIGKILLs it after its
  grace), so a member never outlives a stop because of the shim.
- with ``--user``, the shim itself keeps the agent's user (it reads the
  agent's lease, writes the exit record next to the agent's logs and signals
  the group) and starts ``CMD`` as ``UID``/``GID`` with exactly the groups
  listed (none inherited from the agent), so the member cannot signal or
  trace the shim that fences it;
- if it is not a process group leader already (started by hand), it makes
  itself one first, so it never signals a group it does not own;
- when the child ends, any other process left in the group is SIGKILLed before
  the shim exits: a member is its whole process group (docs/launcher.md), and
  with the agent dead nobody else would clean up.
- with ``--exit-file F``, once the whole group is gone and just before it
  exits, the shim writes its *exit record* to ``F`` (atomically): the status
  it is about to end with, whether it fenced, and the CLOCK_MONOTONIC and wall
  time of that moment. A restarted agent cannot wait for a process that is not
  its child, and an agent that was dead when the member ended saw nothing; the
  record tells it both the status and *when* the member's devices became free
  (an upper bound: the group was already gone when it was written).

Also holds ``LeaseWriter``, the agent side of the lease file, so that both
sides share one format: the decimal float of the monotonic time, one line.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping

# Distinct from the child's own codes as far as possible: not 0/1/2, not the
# shell's 126/127, not 128+signal.
EXIT_FENCED = 120
EXIT_SPAWN_FAILED = 127
EXIT_USAGE = 2
POLL_S = 0.2
LEASE_FILE = "fence-lease"
EXIT_RECORD_FORMAT = "phalanx-member-exit/1"
SHIM_FILE_NAME = "shim.py"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# How long to wait for the group to vanish after the final SIGKILL.
KILL_WAIT_S = 5.0


# --------------------------------------------------------------------------- #
# The lease file
# --------------------------------------------------------------------------- #

def read_lease(path: Path | str) -> float | None:
    """The monotonic time in the lease file, or None if missing or unparseable."""
    try:
        with open(path, "rb") as f:
            text = f.read(64)
        value = float(text.decode("ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return value if math.isfinite(value) else None


def write_lease(path: Path | str, value: float) -> None:
    """Atomically replace the lease file (tmp + rename; no fsync: a monotonic
    time is meaningless after a reboot anyway)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="ascii") as f:
        f.write(f"{value:.6f}\n")
    os.replace(tmp, path)


class LeaseWriter:
    """The agent's side: publish ``FenceTimer.last_valid`` cheaply.

    ``update`` writes when the value moved and the last write is at least
    ``min_interval_s`` old, or at once when it moved by more than
    ``jump_s``; otherwise the value is kept pending and ``flush`` (called from
    the agent's fence loop, every <= 0.2 s) writes it. A lagging file only
    makes the shim fence *earlier*, never later."""

    def __init__(self, path: Path | str, *, min_interval_s: float = POLL_S, jump_s: float = 1.0) -> None:
        self.path = Path(path)
        self.min_interval_s = min_interval_s
        self.jump_s = jump_s
        self.written: float | None = None
        self._pending: float | None = None
        self._last_write = -math.inf
        self._failing = False

    def update(self, value: float, *, force: bool = False) -> None:
        if self.written is not None and value == self.written:
            self._pending = None
            return
        now = time.monotonic()
        if (force or self.written is None or abs(value - self.written) > self.jump_s
                or now - self._last_write >= self.min_interval_s):
            self._write(value, now)
        else:
            self._pending = value

    def flush(self) -> None:
        if self._pending is not None:
            self._write(self._pending, time.monotonic())

    def _write(self, value: float, now: float) -> None:
        try:
            write_lease(self.path, value)
        except OSError as exc:
            # Not fatal here, but the members' shims will fence when the lease
            # stops moving: the safe direction.
            if not self._failing:
                print(f"phalanx agent: cannot write fence lease {self.path}: {exc}", file=sys.stderr)
            self._failing = True
            self._pending = value
            return
        self._failing = False
        self.written = value
        self._pending = None
        self._last_write = now


# --------------------------------------------------------------------------- #
# The exit record
# --------------------------------------------------------------------------- #

def write_exit_record(path: Path | str, *, code: int, fenced: bool, pid: int,
                      ended_mono: float, ended_wall: float, signalled: bool = False) -> None:
    """Atomically write the exit record (tmp + rename; one small JSON object).
    ``code`` follows the Popen convention (negative: killed by that signal)."""
    import json  # only here: the shim's hot loop never needs it

    path = Path(path)
    doc = {"format": EXIT_RECORD_FORMAT, "code": int(code), "fenced": bool(fenced), "pid": int(pid),
           "ended_mono": float(ended_mono), "ended_wall": float(ended_wall), "signalled": bool(signalled)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="ascii") as f:
        f.write(json.dumps(doc) + "\n")
    os.replace(tmp, path)


def read_exit_record(path: Path | str) -> dict[str, object] | None:
    """The exit record at ``path``, or None when missing, unparseable or of
    another format (a torn or foreign file must never read as a status)."""
    import json

    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(4096))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != EXIT_RECORD_FORMAT:
        return None
    try:
        code, pid = doc["code"], doc["pid"]
        ended_mono, ended_wall = float(doc["ended_mono"]), float(doc["ended_wall"])
    except (KeyError, TypeError, ValueError):
        return None
    if not (isinstance(code, int) and isinstance(pid, int) and math.isfinite(ended_mono)):
        return None
    return {"code": code, "fenced": bool(doc.get("fenced")), "pid": pid,
            "ended_mono": ended_mono, "ended_wall": ended_wall, "signalled": bool(doc.get("signalled"))}


# --------------------------------------------------------------------------- #
# The member's environment and its privileges
# --------------------------------------------------------------------------- #

def encode_environment(env: Mapping[str, str]) -> bytes:
    """``env`` as the shim's ``--env-fd`` reads it: ``NAME=VALUE`` entries,
    each ended by a NUL (as in ``/proc/<pid>/environ``). ValueError naming
    the variable when one cannot be an environment entry (what exec would
    refuse): an empty name, a name with ``=``, a NUL anywhere."""
    out = bytearray()
    for name, value in env.items():
        if not name or "=" in name or "\0" in name:
            raise ValueError(f"environment variable {name!r}: not a valid name (empty, or holds '=' or NUL)")
        if "\0" in value:
            raise ValueError(f"environment variable {name!r}: its value holds a NUL character")
        out += os.fsencode(name) + b"=" + os.fsencode(value) + b"\0"
    return bytes(out)


def decode_environment(data: bytes) -> dict[str, str]:
    """The environment ``encode_environment`` wrote; ValueError when
    ``data`` is not that (an entry without ``=``, or unterminated)."""
    if data and not data.endswith(b"\0"):
        raise ValueError("the last environment entry is not NUL-terminated")
    env: dict[str, str] = {}
    for entry in data.split(b"\0")[:-1]:
        name, sep, value = entry.partition(b"=")
        if not sep or not name:
            raise ValueError(f"environment entry {entry[:40]!r} is not NAME=VALUE")
        env[os.fsdecode(name)] = os.fsdecode(value)
    return env


def read_environment_fd(fd: int) -> dict[str, str]:
    """Read the member's environment from ``fd`` to its end, then close it."""
    with open(fd, "rb", closefd=True) as f:
        return decode_environment(f.read())


PR_SET_NO_NEW_PRIVS = 38  # linux/prctl.h


def no_new_privs() -> Callable[[], None]:
    """A function that sets ``no_new_privs`` on the calling thread (kept
    across fork and exec, never cleared): raises OSError when the kernel
    refuses. libc's ``prctl`` is looked up here, in advance: the function
    itself only calls it, so it is fit for Popen's ``preexec_fn`` (between
    fork and exec nothing may take the dynamic loader's locks)."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
    prctl.restype = ctypes.c_int

    def set_no_new_privs() -> None:
        if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_NO_NEW_PRIVS) refused: {os.strerror(errno)}")

    return set_no_new_privs


# --------------------------------------------------------------------------- #
# The shim
# --------------------------------------------------------------------------- #

def _log(text: str) -> None:
    try:
        sys.stderr.write(f"phalanx-shim: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _group_others(pgid: int) -> list[int]:
    """Live processes of group ``pgid`` other than this one."""
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        rest = data[data.rindex(b")") + 2:].split()
        if rest[0] in (b"Z", b"X", b"x"):
            continue
        if int(rest[2]) == pgid:
            found.append(int(name))
    return found


def _signal_others(pgid: int, sig: int) -> None:
    for pid in _group_others(pgid):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_rest_of_group(child: subprocess.Popen) -> None:
    """SIGKILL every other process of our group, reap the child, wait until
    the group holds nobody else (bounded)."""
    pgid = os.getpgrp()
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        others = _group_others(pgid)
        if not others:
            break
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if child.returncode is None:
            try:
                child.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
        else:
            time.sleep(0.02)
        if time.monotonic() >= deadline:
            _log(f"processes {others} survived SIGKILL for {KILL_WAIT_S:.0f}s")
            break
    if child.returncode is None:
        child.poll()


def _exit_like(code: int) -> None:
    """End this process with the child's status (Popen convention: negative =
    killed by that signal)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code >= 0:
        os._exit(code)
    sig = -code
    try:
        import resource  # no core file of the shim for SIGSEGV/SIGABRT & co.
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, OSError, ValueError):
        pass
    try:
        signal.signal(sig, signal.SIG_DFL)  # refused for SIGKILL/SIGSTOP: no need
    except (OSError, ValueError):
        pass
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        time.sleep(0.1)  # delivery is immediate for an unblocked signal
    except (OSError, ValueError):
        pass
    os._exit(128 + sig)


def parse_user(text: str) -> tuple[int, int, list[int]]:
    """``UID:GID:G1,G2,...`` (the groups may be empty) -> (uid, gid, groups);
    ValueError when it is not that."""
    uid, gid, groups = text.split(":")
    return int(uid), int(gid), [int(g) for g in groups.split(",") if g]


def run(cmd: list[str], lease: str, fence_after: float, grace: float,
        exit_file: str | None = None, user: tuple[int, int, list[int]] | None = None,
        env: dict[str, str] | None = None) -> int:
    state: dict[str, object] = {"child": None, "pending": [], "fencing": False, "signalled": False}
    code, fenced = _supervise(cmd, lease, fence_after, grace, state, user, env)
    if exit_file:
        try:
            # signalled: a stop (SIGTERM/SIGINT/SIGHUP) reached the member, so
            # even a 0 status is an interrupted run, not a finished one.
            write_exit_record(exit_file, code=code, fenced=fenced, pid=os.getpid(),
                              ended_mono=time.monotonic(), ended_wall=time.time(),
                              signalled=bool(state["signalled"]))
        except OSError as exc:
            # Not fatal: the agent then reports the status as unknown.
            _log(f"cannot write exit record {exit_file}: {exc}")
    return code


def _supervise(cmd: list[str], lease: str, fence_after: float, grace: float,
               state: dict[str, object], user: tuple[int, int, list[int]] | None = None,
               env: dict[str, str] | None = None) -> tuple[int, bool]:
    """Run the member; (status to end with, whether we fenced it)."""
    started = time.monotonic()

    def forward(sig: int, _frame: object) -> None:
        if state["fencing"]:
            return  # our own group-wide SIGTERM, or too late to matter
        state["signalled"] = True
        child = state["child"]
        if child is None:
            state["pending"].append(sig)  # type: ignore[union-attr]
        elif child.returncode is None:  # type: ignore[union-attr]
            try:
                os.kill(child.pid, sig)  # type: ignore[union-attr]
            except ProcessLookupError:
                pass

    if os.getpgrp() != os.getpid():
        # Started outside ProcessLauncher (by hand, from a shell): lead a group
        # of our own first, since fencing and clean-up signal "our group".
        os.setpgid(0, 0)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    if state["pending"]:
        _log(f"signal {state['pending'][0]} before the member started; not starting it")  # type: ignore[index]
        return 128 + int(state["pending"][0]), False  # type: ignore[index]
    try:
        # Inherited by the child and kept across its exec: nothing the member
        # runs gains privileges.
        no_new_privs()()
        # Same process group (no new session), stdio and current directory
        # inherited; the member's environment (None: ours) only in the
        # child's exec; with a user, setgroups/setgid/setuid in the child
        # just before that exec.
        if user is None:
            child = subprocess.Popen(cmd, env=env)
        else:
            child = subprocess.Popen(cmd, env=env, user=user[0], group=user[1], extra_groups=user[2])
    except (OSError, ValueError) as exc:
        _log(f"cannot start member {cmd!r}: {exc}")
        return EXIT_SPAWN_FAILED, False
    state["child"] = child
    for sig in state["pending"]:  # type: ignore[union-attr]
        forward(sig, None)

    last_contact: float | None = None
    while True:
        try:
            code = child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        else:
            _kill_rest_of_group(child)
            return code, False
        value = read_lease(lease)
        if value is not None:
            last_contact = value if last_contact is None else max(last_contact, value)
        now = time.monotonic()
        silent = now - (last_contact if last_contact is not None else started)
        if silent > fence_after:
            state["fencing"] = True
            if last_contact is None:
                _log(f"FENCED: no valid leader contact for {silent:.1f} s "
                     f"(no readable lease in {lease}; fence_after={fence_after:g} s)")
            else:
                _log(f"FENCED: no valid leader contact for {silent:.1f} s (fence_after={fence_after:g} s)")
            _signal_others(os.getpgrp(), signal.SIGTERM)
            try:
                child.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _log(f"member still running {grace:g} s after SIGTERM; SIGKILL")
            _kill_rest_of_group(child)
            return EXIT_FENCED, True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.shim", description="member-side fencing shim")
    p.add_argument("--lease", required=True, help="lease file the agent keeps fresh")
    p.add_argument("--fence-after", type=float, required=True, help="seconds without leader contact before fencing")
    p.add_argument("--grace", type=float, default=5.0, help="SIGTERM -> SIGKILL grace when fencing")
    p.add_argument("--exit-file", default=None, help="write the exit record here when the member ends")
    p.add_argument("--user", default=None, help="UID:GID:G1,G2,... to start the member as")
    p.add_argument("--env-fd", type=int, default=None, help="read the member's environment from this descriptor")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    try:
        user = parse_user(a.user) if a.user is not None else None
    except ValueError:
        user = None
        cmd = []
    if not cmd or not math.isfinite(a.fence_after) or a.fence_after <= 0 or a.grace < 0:
        _log("usage: --lease FILE --fence-after S (> 0) [--grace G] [--user UID:GID:G1,...] [--env-fd N] "
             "-- CMD...")
        return EXIT_USAGE
    env = None
    if a.env_fd is not None:
        try:
            env = read_environment_fd(a.env_fd)
        except (OSError, ValueError) as exc:
            _log(f"cannot start member {cmd!r}: cannot read its environment from fd {a.env_fd}: {exc}")
            return EXIT_SPAWN_FAILED
    return run(cmd, a.lease, a.fence_after, a.grace, a.exit_file, user, env)


if __name__ == "__main__":
    _exit_like(main())
