"""Child processes that end when their parent ends, however it ends.

Every long-running process that ``phalanx up``, the chaos suite and the
benchmark harnesses start goes through :func:`spawn`. It asks the kernel for a
*parent-death signal* (``prctl(PR_SET_PDEATHSIG)``, Linux): when the parent
dies - SIGKILL, OOM kill, a crash, a plain exit without clean-up - the kernel
sends the child that signal. No clean-up code of the parent has to run, which
is the point: a parent killed with SIGKILL runs none.

Two kernel details shape the code:

- The signal fires when the *thread* that forked the child exits, not only the
  whole process. A child started from a short-lived worker thread (say, one
  of ``asyncio.to_thread``'s) would be killed as soon as that thread ends. So
  :func:`spawn` forks on the main thread when called there, and otherwise
  hands the fork to one daemon thread that lives as long as the process (a
  daemon thread is never joined: it ends only with the process itself).
- The parent may die between ``fork`` and the ``prctl`` call; the child then
  already belongs to another parent and would never get the signal. The hook
  compares ``getppid()`` with the pid that forked it right after ``prctl``
  and exits at once when they differ.

The hook runs in the child between ``fork`` and ``exec`` (``preexec_fn``).
Python warns that arbitrary code there may deadlock when other threads hold
locks at fork time; this hook only calls a ``prctl`` function resolved before
the fork, ``getppid`` and ``_exit``: no import, no allocation-heavy work, no
lock that another thread could hold.

The signal survives ``exec`` (also through ``ip netns exec``, which execs its
command), except into a set-user-ID or file-capability binary, which none of
ours is. It is not inherited by the child's own children: a process that
starts others (an agent with its members) is responsible for them, and does so
on the signal it gets here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

PR_SET_PDEATHSIG = 1

# What a child gets when its parent dies. SIGKILL for servers whose state is
# crash-safe anyway (etcd fsyncs; a coordinator's leader key expires with its
# lease): nothing can keep them alive. SIGTERM for a process that must stop
# children of its own first (an agent stops its members, bounded by its stop
# grace; their fencing shims stop them anyway when the agent's lease goes stale).
KILL = signal.SIGKILL
TERM = signal.SIGTERM

_prctl: Callable[..., int] | None = None
_prctl_lock = threading.Lock()


def _resolve_prctl() -> Callable[..., int]:
    """libc's prctl, looked up once (before any fork)."""
    global _prctl
    with _prctl_lock:
        if _prctl is None:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            fn = getattr(libc, "prctl", None)
            if fn is None:
                raise OSError("this C library has no prctl: parent-death signals need Linux")
            fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
            fn.restype = ctypes.c_int
            _prctl = fn
        return _prctl


def parent_death_hook(sig: int, parent_pid: int | None = None) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` when ``parent_pid`` (default:
    this process) dies, and exits at once if it already has."""
    prctl = _resolve_prctl()
    parent = os.getpid() if parent_pid is None else parent_pid
    sig = int(sig)

    def hook() -> None:
        if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            os._exit(126)  # cannot promise to die with the parent: do not run at all
        if os.getppid() != parent:
            os._exit(126)  # the parent died before prctl took effect

    return hook


class _Spawner:
    """One long-lived daemon thread that forks on behalf of other threads."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="phalanx-spawner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, fut = self._q.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller, never lost here
                fut.set_exception(exc)

    def call(self, fn: Callable[[], Any]) -> Any:
        fut: Future[Any] = Future()
        self._q.put((fn, fut))
        return fut.result()


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def _get_spawner() -> _Spawner:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()
        return _spawner


def spawn(
    argv: Sequence[str],
    *,
    die_with_parent: int = KILL,
    popen: Callable[..., subprocess.Popen[Any]] = subprocess.Popen,
    **kw: Any,
) -> subprocess.Popen[Any]:
    """``popen(argv, **kw)`` whose child gets ``die_with_parent`` when this
    process dies. ``popen`` may be any ``Popen``-like callable that passes
    ``preexec_fn`` through (e.g. ``chaos.netns.Host.popen``). By default the
    child leads a session of its own (``start_new_session``), so a terminal's
    Ctrl-C reaches only the parent, which then stops its children in order."""
    if "preexec_fn" in kw:
        raise TypeError("spawn() sets preexec_fn itself (the parent-death hook)")
    kw["preexec_fn"] = parent_death_hook(die_with_parent)
    kw.setdefault("start_new_session", True)
    if threading.current_thread() is threading.main_thread():
        return popen(list(argv), **kw)
    return _get_spawner().call(lambda: popen(list(argv), **kw))


def pids() -> list[int]:
    """Every process id in /proc now."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (state first,
    then ppid, pgrp, session, ...; the name may hold spaces and parentheses,
    so the split is after its last ")"), or None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2:].split()


def _live(fields: list[bytes] | None) -> bool:
    return fields is not None and fields[0] not in (b"Z", b"X")  # a zombie holds nothing


def pid_start_time(pid: int) -> int | None:
    """The kernel start time of ``pid`` (clock ticks since boot, field 22 of
    /proc/PID/stat), or None if no such live process: with the pid, it names
    one process for good (a pid alone may be reused)."""
    fields = stat_fields(pid)
    return int(fields[19]) if _live(fields) else None


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether ``pid`` runs (and, given ``start_time``, is that same process)."""
    st = pid_start_time(pid)
    return st is not None and (start_time is None or st == start_time)


def descendants(pid: int) -> dict[int, int]:
    """pid -> start time of every live process below ``pid`` (Linux /proc):
    children, their children, and so on, whatever session or group they lead."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for p in pids():
        fields = stat_fields(p)
        if not _live(fields):
            continue
        children.setdefault(int(fields[1]), []).append(p)
        starts[p] = int(fields[19])
    out: dict[int, int] = {}
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out[p] = starts[p]
        todo.extend(children.get(p, []))
    return out


def still_alive(recorded: dict[int, int]) -> list[int]:
    """The processes of ``recorded`` (pid -> start time) that still run."""
    return sorted(p for p, st in recorded.items() if process_alive(p, st))
