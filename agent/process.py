"""Real gang members: one process group per member (docs/launcher.md).

``ProcessLauncher`` implements ``agent.launcher.Launcher`` with real processes:

- each member is started in its own session (so its own process group), with the
  Phalanx environment contract (``member_environment``), its output appended to
  ``<state_dir>/logs/<gang>/<incarnation>/rank-<rank>.log`` (agent-owned);
- it runs as the account the agent's run-as policy maps its gang's owner to
  (``agent.core.run_as``; never root unless the policy allows it for that
  owner), with that account's groups only, in its own work directory
  ``<work_root>/<gang>/<incarnation>/rank-<rank>`` owned by that account
  (its current directory, ``$HOME`` and ``$PHALANX_WORK_DIR``);
- a member *is* its process group: stopping it signals the whole group, and when
  its leader exits, whatever is left of the group is killed before the exit is
  reported, so a reported exit means the member's devices are really free;
- every start and exit rewrites ``<state_dir>/members.json`` atomically, so a
  restarted agent can re-attach to its members (``adopt``) and kill processes it
  started but cannot account for.

Why ``subprocess.Popen`` + pidfd rather than ``asyncio.create_subprocess_exec``:
an asyncio subprocess transport SIGKILLs its child when it is closed or garbage
collected (``BaseSubprocessTransport.__del__``), so an agent that shuts down
gracefully for a restart would kill the very members it means to keep. ``Popen``
never kills on collection, and a pidfd (``os.pidfd_open``) watched with
``loop.add_reader`` lets one code path wait for both our own children and the
non-child members we adopt after a restart, without a thread per member.

Linux only: relies on ``/proc`` and (where available) pidfds.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import os
import pwd
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Coroutine, Iterable, Iterator, Mapping

import yaml

from agent.core.run_as import Account, Refused, RunAsError, RunAsPolicy, decide, parse_policy
from agent.launcher import ExitCallback, MemberHandle, MemberKey, MemberLaunch
from agent.shim import encode_environment, no_new_privs, read_exit_record
from phalanx.member_logs import logs_root, mark_line, member_exit_path, member_log_path, path_component

log = logging.getLogger(__name__)

# Exit code reported when a member could not be started at all (command not
# found, not executable, bad environment). 127 is the shell's "command not
# found", so operators and wrappers already read it that way.
EXIT_SPAWN_FAILED = 127
# Exit code reported when a member ended but its status cannot be known: it was
# adopted after an agent restart (only the parent may wait for a process), or it
# vanished while the agent was down. Negative like a signal so it never reads as
# success, but below any real signal number (1..64), so it is unambiguous.
EXIT_UNKNOWN = -255

STATE_FILE = "members.json"
STATE_VERSION = 1

# Built-in member used when a spec has no command (``phalanx up --launch`` with
# specs written for simulated agents): sleeps for run.duration_s. coreutils'
# sleep rather than this interpreter: the member's user (nobody by default)
# may not be able to reach the agent's Python (a virtualenv under /root).
SLEEP_ARGV = ("sleep",)

# Environment variables owned by Phalanx: set on every member, after the spec's
# env and the agent's extra env, so a spec cannot override them (a spec that set
# RANK or CUDA_VISIBLE_DEVICES could break the gang or use devices reserved for
# another member).
ENV_GANG = "PHALANX_GANG"
ENV_INCARNATION = "PHALANX_INCARNATION"
ENV_AGENT_ID = "PHALANX_AGENT_ID"
ENV_NODE = "PHALANX_NODE"
ENV_PLACEMENT = "PHALANX_PLACEMENT"
ENV_EPOCH = "PHALANX_EPOCH"
ENV_WORK_DIR = "PHALANX_WORK_DIR"
OWNED_ENV: frozenset[str] = frozenset({
    ENV_GANG, ENV_INCARNATION, ENV_AGENT_ID, ENV_NODE, ENV_PLACEMENT, ENV_EPOCH, ENV_WORK_DIR, "HOME",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_IB_HCA",
})

# What of a member's environment its shim carries too: the markers a
# restarted agent reads from /proc/<pid>/environ to adopt the member (its
# ``PHALANX_AGENT_ID``) and to name an orphan (``_key_from_env``). All of them
# are Phalanx-owned (``OWNED_ENV``): no spec can set them.
ADOPTION_ENV = (ENV_AGENT_ID, ENV_GANG, ENV_INCARNATION, "RANK")
# The shim's PATH: a fixed value, never the agent's or the spec's.
SHIM_PATH_VAR = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# How often the no-pidfd fallback checks whether a process is still there.
POLL_INTERVAL_S = 0.2
# How long to wait for a process group to vanish after SIGKILL before giving up
# and reporting anyway (a process in uninterruptible sleep, e.g. stuck in a GPU
# driver, can outlive SIGKILL; the agent must not hang on it).
DEFAULT_KILL_TIMEOUT_S = 10.0
# Member logs and exit records of an incarnation are deleted this long after
# the last write to them, once none of its members runs here (disk use of a
# long-lived node must not grow with every member it ever ran).
DEFAULT_LOG_RETENTION_S = 7 * 24 * 3600.0


# --------------------------------------------------------------------------- #
# Environment contract
# --------------------------------------------------------------------------- #

def member_environment(
    launch: MemberLaunch,
    *,
    agent_id: str,
    node_addr: str = "127.0.0.1",
    base: Mapping[str, str] | None = None,
    extra_env: Mapping[str, str] | None = None,
    work_dir: Path | None = None,
    account: Account | None = None,
) -> dict[str, str]:
    """The environment of one member, lowest precedence first: ``base`` (the
    agent's own environment), ``extra_env`` (node operator), ``launch.env``
    (the spec), then the Phalanx-owned variables, which always win.

    ``work_dir``: the member's own directory, exported as ``PHALANX_WORK_DIR``
    and ``HOME`` (the agent's home is no place for a member's files).
    ``account``: the user it runs as, for ``USER``/``LOGNAME`` (None: the
    agent's own user, whose variables it inherits)."""
    env: dict[str, str] = dict(os.environ if base is None else base)
    env.update(extra_env or {})
    env.update(launch.env)
    key = launch.key
    if work_dir is not None:
        env.update({ENV_WORK_DIR: str(work_dir), "HOME": str(work_dir)})
    if account is not None:
        env.update({"USER": account.name, "LOGNAME": account.name})
    env.update({
        ENV_GANG: key.gang,
        ENV_INCARNATION: str(key.incarnation),
        ENV_AGENT_ID: agent_id,
        ENV_NODE: launch.node or agent_id,
        ENV_PLACEMENT: launch.placement,
        ENV_EPOCH: str(launch.epoch),
        "RANK": str(key.rank),
        "WORLD_SIZE": str(launch.world_size),
        "LOCAL_RANK": str(launch.local_rank),
        "LOCAL_WORLD_SIZE": str(launch.local_world_size),
        # A gang on one node may come without a rendezvous address; this node is
        # then the right one.
        "MASTER_ADDR": launch.master_addr or node_addr,
        "MASTER_PORT": str(launch.master_port),
        # GPU indices come from NVML, which numbers GPUs in PCI bus order; CUDA's
        # default order is "fastest first", which can differ, so without this the
        # member could open GPUs reserved for someone else.
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in launch.gpus),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        # NCCL matches HCA names by prefix ("mlx5_1" also selects mlx5_10..19);
        # the leading "=" asks for exact names, so only the reserved NICs.
        "NCCL_IB_HCA": ("=" + ",".join(launch.nics)) if launch.nics else "",
    })
    return env


def member_command(launch: MemberLaunch) -> list[str]:
    """The argv of a member; the built-in sleeper when the spec has no command."""
    if launch.command:
        return list(launch.command)
    return [*SLEEP_ARGV, repr(float(launch.duration_s))]


SHIM_PATH = Path(__file__).resolve().with_name("shim.py")


def shim_command(argv: list[str], lease: Path, fence_after_s: float, grace_s: float,
                 exit_file: Path | None = None, account: Account | None = None,
                 env_fd: int | None = None) -> list[str]:
    """``argv`` wrapped by the fencing shim (agent/shim.py, docs/launcher.md).

    Run by file path with ``-I`` so it needs neither this package on the
    member's ``sys.path`` nor a particular working directory. With
    ``account`` the shim keeps the agent's user (it must read the agent's
    lease, write the exit record and signal the group) and starts ``argv``
    as that account. ``env_fd``: the descriptor the shim reads the member's
    environment from (``environment_fd``); the shim itself runs with
    ``shim_environment``, so nothing of the spec acts in it."""
    exit_args = ["--exit-file", str(exit_file)] if exit_file is not None else []
    user_args = ["--user", account_arg(account)] if account is not None else []
    env_args = ["--env-fd", str(env_fd)] if env_fd is not None else []
    return [sys.executable, "-I", str(SHIM_PATH), "--lease", str(lease),
            "--fence-after", repr(float(fence_after_s)), "--grace", repr(float(grace_s)),
            *exit_args, *user_args, *env_args, "--", *argv]


def shim_environment(member_env: Mapping[str, str]) -> dict[str, str]:
    """The shim's whole environment, built from scratch: a fixed ``PATH``
    and the member's adoption markers (``ADOPTION_ENV``, which the agent
    owns). Nothing else of the agent's, the operator's or the spec's
    environment: the shim may run as root, and the loader reads ``LD_*``,
    ``GCONV_PATH`` and the like before any code of ours runs."""
    return {"PATH": SHIM_PATH_VAR, **{name: member_env[name] for name in ADOPTION_ENV}}


def environment_fd(data: bytes) -> int:
    """An anonymous in-memory file (memfd, close-on-exec) holding ``data``
    (``encode_environment``) for the shim's ``--env-fd``, positioned at its
    start. Never on disk, readable through no path by the member's user, and
    no size limit (a pipe would block at 64 KiB before the shim reads it)."""
    fd = os.memfd_create("phalanx-member-env", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def account_arg(account: Account) -> str:
    """``UID:GID:G1,G2,...`` (the shim's ``--user``)."""
    return f"{account.uid}:{account.gid}:{','.join(str(g) for g in account.groups)}"


# --------------------------------------------------------------------------- #
# Run-as policy (the driver of agent.core.run_as)
# --------------------------------------------------------------------------- #

def system_account(name: str) -> Account:
    """The node's account ``name`` with its own groups (/etc/passwd,
    /etc/group); KeyError when there is none."""
    pw = pwd.getpwnam(name)
    return Account(name=name, uid=pw.pw_uid, gid=pw.pw_gid,
                   groups=tuple(sorted(set(os.getgrouplist(name, pw.pw_gid)))))


def default_run_as() -> RunAsPolicy:
    """The policy without ``--run-as``: every owner runs as ``nobody``, none
    as root. RunAsError when the node has no ``nobody``."""
    return parse_policy(None, system_account)


def load_run_as(path: str | Path) -> RunAsPolicy:
    """The ``--run-as`` file; ValueError ``FILE: <field>: <reason>``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path}: (document): not YAML: {first}") from None
    try:
        return parse_policy(doc, system_account)
    except RunAsError as exc:
        raise ValueError(f"{path}: {exc}") from None


def closed_to_others(path: Path) -> Path | None:
    """The first directory from ``/`` down to ``path`` that users other than
    its owner and group cannot search (no ``o+x``), or None."""
    p = Path(path).resolve()
    for d in (*reversed(p.parents), p):
        try:
            if not d.stat().st_mode & stat.S_IXOTH:
                return d
        except OSError:
            return d
    return None


class RunAsRefused(Exception):
    """A member its run-as policy does not let run (nothing was started)."""


def member_work_path(work_root: Path, key: MemberKey) -> Path:
    """``<work_root>/<gang>/<incarnation>/rank-<rank>``: the member's own directory."""
    return Path(work_root) / path_component(key.gang) / str(key.incarnation) / f"rank-{key.rank}"


# --------------------------------------------------------------------------- #
# Logs: their layout is phalanx/member_logs.py; this launcher writes by it and
# readers (`phalanx logs`, tests) import it from there, not from here.
# --------------------------------------------------------------------------- #

def stale_log_dirs(listing: Iterable[tuple[str, int, float]], *, live: Collection[tuple[str, int]],
                   now: float, retention_s: float) -> list[tuple[str, int]]:
    """Pure: of ``(gang, incarnation, newest mtime)`` log directories, those
    to delete: not a running member's, and untouched for ``retention_s``. A
    directory whose mtime lies in the future (clock step) is kept."""
    return sorted((gang, inc) for gang, inc, newest in listing
                  if (gang, inc) not in live and now - newest > retention_s)


def _subdirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []


def _newest_mtime(path: Path) -> float:
    newest = path.stat().st_mtime
    for child in path.iterdir():
        with contextlib.suppress(OSError):
            newest = max(newest, child.stat().st_mtime)
    return newest


def _append_log_line(path: Path, text: str) -> None:
    # Marks in the member's own log (start, exit, spawn failure) so that
    # `phalanx logs` tells the whole story; failures here must never matter.
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        # 0600 when this creates it: a member's log is the agent's, not its readers'.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with open(fd, "a", encoding="utf-8") as f:
            f.write(mark_line(stamp, text))
    except OSError:
        log.warning("cannot write to member log %s", path, exc_info=True)


# --------------------------------------------------------------------------- #
# /proc
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` the launcher needs."""

    pid: int
    state: str  # R, S, D, Z, T, ...
    pgid: int
    sid: int
    start_ticks: int  # field 22: start time after boot, in clock ticks

    @property
    def alive(self) -> bool:
        # A zombie has finished; it only waits for its parent to reap it.
        return self.state not in ("Z", "X", "x")


def read_proc_stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat``, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = data[data.rindex(b")") + 2:].split()
    # rest[0] is field 3, so field n is rest[n - 3].
    return ProcStat(
        pid=pid,
        state=rest[0].decode(),
        pgid=int(rest[2]),
        sid=int(rest[3]),
        start_ticks=int(rest[19]),
    )


def read_proc_environ(pid: int) -> dict[str, str] | None:
    """The environment a process was started with, or None if unreadable.

    /proc shows the block given to exec, not later setenv() calls, so a member
    cannot hide its Phalanx marker by editing its environment at run time."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    env: dict[str, str] = {}
    for entry in data.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep:
            env[name.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _all_pids() -> Iterator[int]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def _same_process_alive(pid: int, start_ticks: int) -> bool:
    st = read_proc_stat(pid)
    return st is not None and st.alive and st.start_ticks == start_ticks


def _group_has_live_process(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone's there; find out below whether it is only zombies
    # kill(0) succeeds on zombies too, and a zombie whose parent never reaps it
    # (some container inits) would otherwise look alive forever.
    for pid in _all_pids():
        st = read_proc_stat(pid)
        if st is not None and st.pgid == pgid and st.alive:
            return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    # Never signal the agent's own group (or init's): a member always leads its
    # own session, so a pgid equal to ours means a corrupt record.
    if pgid <= 1 or pgid == os.getpgrp():
        log.error("refusing to signal process group %d (not a member's group)", pgid)
        return
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        log.warning("no permission to signal process group %d", pgid)


async def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = 0.01
    while _group_has_live_process(pgid):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)
    return True


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        # No pidfd (old kernel, seccomp) or the process is already gone: the
        # caller falls back to polling, which notices the latter at once.
        return None


# --------------------------------------------------------------------------- #
# State file
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class MemberRecord:
    """One live member as written to ``members.json``."""

    key: MemberKey
    pid: int
    pgid: int
    start_ticks: int
    started_at: float
    gpus: tuple[int, ...] = ()
    nics: tuple[str, ...] = ()
    epoch: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "gang": self.key.gang,
            "incarnation": self.key.incarnation,
            "rank": self.key.rank,
            "pid": self.pid,
            "pgid": self.pgid,
            "start_ticks": self.start_ticks,
            "started_at": self.started_at,
            "gpus": list(self.gpus),
            "nics": list(self.nics),
            "epoch": self.epoch,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> MemberRecord:
        return cls(
            key=MemberKey(str(doc["gang"]), int(doc["incarnation"]), int(doc["rank"])),
            pid=int(doc["pid"]),
            pgid=int(doc["pgid"]),
            start_ticks=int(doc["start_ticks"]),
            started_at=float(doc["started_at"]),
            gpus=tuple(int(g) for g in doc.get("gpus", ())),
            nics=tuple(str(n) for n in doc.get("nics", ())),
            epoch=int(doc.get("epoch", 0)),
        )

    def handle(self) -> MemberHandle:
        return MemberHandle(key=self.key, pid=self.pid, started_at=self.started_at,
                            gpus=self.gpus, nics=self.nics, epoch=self.epoch)


def _write_atomically(path: Path, data: bytes) -> None:
    # tmp + fsync + rename + fsync(dir): after a crash the file is either the old
    # or the new version, never a torn one, and the rename itself is durable.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_state(state_dir: Path) -> tuple[str | None, list[MemberRecord]]:
    """(agent id, records) from ``<state_dir>/members.json``; (None, []) when absent.

    A file that cannot be parsed is moved aside (``members.json.corrupt-<ts>``)
    for a post-mortem; its members will then be treated as orphans."""
    path = Path(state_dir) / STATE_FILE
    try:
        doc = json.loads(path.read_bytes())
        if not isinstance(doc, dict) or not isinstance(doc.get("members"), list):
            raise ValueError("not a members document")
    except FileNotFoundError:
        return None, []
    except (OSError, ValueError) as exc:
        aside = path.with_name(f"{STATE_FILE}.corrupt-{int(time.time())}")
        log.error("unreadable state file %s (%s); moved to %s", path, exc, aside)
        with contextlib.suppress(OSError):
            os.replace(path, aside)
        return None, []
    records: list[MemberRecord] = []
    for item in doc["members"]:
        try:
            records.append(MemberRecord.from_json(item))
        except (KeyError, TypeError, ValueError):
            log.warning("skipping malformed member record in %s: %r", path, item)
    agent_id = doc.get("agent_id")
    return (str(agent_id) if agent_id is not None else None), records


# --------------------------------------------------------------------------- #
# The launcher
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class OrphanProcess:
    """A process carrying this agent's marker that no state record accounts for."""

    pid: int
    pgid: int
    key: MemberKey | None  # from its PHALANX_* environment, when parseable


@dataclass(eq=False)
class _Member:
    record: MemberRecord
    popen: subprocess.Popen[bytes] | None  # None for adopted (non-child) members
    pidfd: int | None
    exited: asyncio.Event = field(default_factory=asyncio.Event)  # leader gone
    done: asyncio.Event = field(default_factory=asyncio.Event)  # group gone + reported
    task: asyncio.Task[None] | None = None


class ProcessLauncher:
    """Members as real processes in their own process groups (see module doc).

    ``on_exit(key, code, ended_mono)`` is called exactly once per member that was started or
    adopted and then ended, after its whole process group is gone and the state
    file no longer lists it. ``code``: the exit status; negative = killed by that
    signal; ``EXIT_SPAWN_FAILED`` (127) when it could not be started;
    ``EXIT_UNKNOWN`` (-255) when it cannot be known (adopted or vanished)."""

    def __init__(
        self,
        state_dir: Path,
        agent_id: str,
        on_exit: ExitCallback,
        *,
        node_addr: str = "127.0.0.1",
        extra_env: Mapping[str, str] | None = None,
        kill_timeout_s: float = DEFAULT_KILL_TIMEOUT_S,
        use_pidfd: bool = True,
        fence_lease: Path | None = None,
        fence_after_s: float = 12.0,
        fence_grace_s: float = 5.0,
        log_retention_s: float = DEFAULT_LOG_RETENTION_S,
        run_as: RunAsPolicy | None = None,
        work_root: Path | None = None,
    ) -> None:
        if not agent_id:
            raise ValueError("agent_id must be non-empty: it marks this agent's members")
        self._state_dir = Path(state_dir)
        self._agent_id = agent_id
        self._on_exit = on_exit
        self._node_addr = node_addr
        self._extra_env = dict(extra_env or {})
        self._kill_timeout_s = kill_timeout_s
        self._use_pidfd = use_pidfd
        # Member-side fencing (agent/shim.py): with a lease file, every member
        # runs under the shim, which fences it when the lease goes stale even
        # if this agent is dead.
        self._fence_lease = Path(fence_lease) if fence_lease is not None else None
        self._fence_after_s = fence_after_s
        self._fence_grace_s = fence_grace_s
        if not (log_retention_s > 0 and math.isfinite(log_retention_s)):
            raise ValueError(f"log_retention_s must be a positive number of seconds, got {log_retention_s}")
        self._log_retention_s = log_retention_s
        self._members: dict[MemberKey, _Member] = {}
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._pruning = False
        self._closed = False
        # Filled in by adopt(): members in the state file that were gone, and
        # unaccounted processes that were killed.
        self.vanished: list[MemberKey] = []
        # The handles of those vanished members (epoch, devices), so that the
        # agent can report one whose end its shim recorded (docs/launcher.md).
        self.vanished_handles: dict[MemberKey, MemberHandle] = {}
        self.vanished_exits: dict[MemberKey, dict[str, Any]] = {}  # their shims' exit records
        self.orphans_killed: list[OrphanProcess] = []
        self._state_dir.mkdir(parents=True, exist_ok=True)
        # Whom members run as (agent.core.run_as): without a policy, nobody.
        # Only root can switch users; an agent that is not root runs its
        # members as itself, and says so once.
        self._uid = os.geteuid()
        self._run_as = run_as if run_as is not None or self._uid != 0 else default_run_as()
        # For members started without the shim (which sets it on itself).
        self._no_new_privs = no_new_privs()
        if self._uid != 0:
            log.warning("agent runs as uid %d, not root: members run as this same user (switching to the "
                        "users of the run-as policy needs root)", self._uid)
        self._work_root = Path(work_root) if work_root is not None else self._state_dir / "work"
        # Member logs and exit records are the agent's: a member (any user)
        # must neither list other gangs' logs nor read them.
        logs = logs_root(self._state_dir)
        logs.mkdir(exist_ok=True)
        os.chmod(logs, 0o700)
        if work_root is None and self._uid == 0:
            # Members of other users pass through the state dir to their work
            # dirs: search (not read) for others. What it holds stays closed:
            # logs/ is 0700 and members.json 0600.
            os.chmod(self._state_dir, stat.S_IMODE(self._state_dir.stat().st_mode) | 0o011)
        self._work_root.mkdir(parents=True, exist_ok=True)
        closed = closed_to_others(self._work_root) if self._uid == 0 else None
        if closed is not None:
            log.warning("member work dirs under %s: %s is closed to other users, so members that run as "
                        "another user start in their work dir but cannot open it by its path ($HOME, "
                        "$PHALANX_WORK_DIR)", self._work_root, closed)

    # -- paths ------------------------------------------------------------- #

    @property
    def state_path(self) -> Path:
        return self._state_dir / STATE_FILE

    def log_path(self, key: MemberKey) -> Path:
        return member_log_path(self._state_dir, key)

    def work_path(self, key: MemberKey) -> Path:
        return member_work_path(self._work_root, key)

    # -- Launcher ---------------------------------------------------------- #

    async def start(self, launch: MemberLaunch) -> MemberHandle:
        """Start one member; returns once the process exists.

        Idempotent per key: starting a key that is already running returns its
        handle (a re-sent assignment must not start a second copy). A member that
        cannot be started is reported through ``on_exit`` with
        ``EXIT_SPAWN_FAILED``, and the returned handle has ``pid=0``."""
        if self._closed:
            raise RuntimeError("launcher is closed")
        key = launch.key
        existing = self._members.get(key)
        if existing is not None:
            return existing.record.handle()

        argv = member_command(launch)
        log_path = self.log_path(key)
        started_at = time.time()
        decision = decide(launch.owner, self._run_as, self._uid)
        if isinstance(decision, Refused):
            # Nothing runs; the session reports the member failed with this
            # reason, and the member's log says it too.
            with contextlib.suppress(OSError):
                log_path.parent.mkdir(parents=True, exist_ok=True)
                _append_log_line(log_path, f"refused {key}: {decision.reason}")
            log.warning("member %s refused: %s", key, decision.reason)
            raise RunAsRefused(decision.reason)
        account = decision.account if decision.switch else None
        env = member_environment(launch, agent_id=self._agent_id, node_addr=self._node_addr,
                                 extra_env=self._extra_env, work_dir=self.work_path(key), account=account)
        try:
            # Before anything is made for the member (work dir, exit record):
            # an environment exec would refuse fails it here, by name.
            env_block = encode_environment(env)
        except ValueError as exc:
            with contextlib.suppress(OSError):
                log_path.parent.mkdir(parents=True, exist_ok=True)
                _append_log_line(log_path, f"failed to start {key}: {exc}")
            return self._spawn_failed(launch, started_at, str(exc))
        exit_path = member_exit_path(self._state_dir, key)
        if self._fence_lease is not None:
            with contextlib.suppress(OSError):
                exit_path.unlink()  # a leftover must never read as this member's end
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            # Agent-owned and private: the member writes it only through the
            # descriptor it inherits, and members of other owners read nothing.
            log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            # Full disk or bad permissions: fail this member, not the agent.
            return self._spawn_failed(launch, started_at, f"cannot open log {log_path}: {exc}")
        try:
            work_dir = self._make_work_dir(key, account)
        except OSError as exc:
            os.close(log_fd)
            _append_log_line(log_path, f"failed to start {key}: cannot make its work dir: {exc}")
            return self._spawn_failed(launch, started_at, f"cannot make work dir {self.work_path(key)}: {exc}")
        fence_note = (f" fence_lease={self._fence_lease} fence_after_s={self._fence_after_s:g}"
                      if self._fence_lease is not None else "")
        who = (f" user={account.name} uid={account.uid} gid={account.gid}" if account is not None
               else f" uid={self._uid} (the agent's own user)")
        _append_log_line(log_path, f"start {key} epoch={launch.epoch} gpus={list(launch.gpus)} "
                                   f"nics={list(launch.nics)}{who} command={shlex.join(argv)}{fence_note}")
        # Under the shim, the shim (agent code) keeps the agent's user and
        # switches for the member itself; without it, Popen switches in the
        # child, after chdir (so the work dir is entered even where its
        # parents are closed to the member's user) and before exec.
        direct = account if self._fence_lease is None else None
        env_fd: int | None = None
        try:
            if self._fence_lease is None:
                # The member's own exec, already as its user, with
                # no_new_privs set in between (preexec_fn runs after the
                # switch): no process of the agent's user ever execs with
                # the spec's environment.
                spawn_argv, spawn_env, pass_fds, preexec = argv, env, (), self._no_new_privs
            else:
                # The shim may be root: it gets an environment built from
                # scratch; the member's reaches it through a descriptor and
                # is applied only in the member's exec (docs/launcher.md).
                env_fd = environment_fd(env_block)
                spawn_argv = shim_command(argv, self._fence_lease, self._fence_after_s, self._fence_grace_s,
                                          exit_file=exit_path, account=account, env_fd=env_fd)
                spawn_env, pass_fds, preexec = shim_environment(env), (env_fd,), None
            popen = subprocess.Popen(
                spawn_argv,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=subprocess.STDOUT,
                env=spawn_env,
                cwd=work_dir,
                close_fds=True,
                pass_fds=pass_fds,
                preexec_fn=preexec,
                # Own session => own process group, so the member and everything
                # it forks can be signalled as one, and a signal aimed at the
                # agent's terminal group never reaches members.
                start_new_session=True,
                # The account's own groups only: never the agent's
                # supplementary groups (setgroups before setgid/setuid).
                user=direct.uid if direct is not None else None,
                group=direct.gid if direct is not None else None,
                extra_groups=list(direct.groups) if direct is not None else None,
            )
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            # ValueError: e.g. a NUL byte in the spec's env. Never crash the agent
            # on a bad command; the gang fails through the normal exit path.
            _append_log_line(log_path, f"failed to start {key}: {exc}")
            return self._spawn_failed(launch, started_at, str(exc))
        finally:
            os.close(log_fd)
            if env_fd is not None:
                os.close(env_fd)

        pid = popen.pid
        # Our child cannot be reaped by anyone else, so /proc/<pid> is there
        # (maybe as a zombie, which still has its start time).
        st = read_proc_stat(pid)
        record = MemberRecord(
            key=key, pid=pid,
            pgid=st.pgid if st is not None else pid,
            start_ticks=st.start_ticks if st is not None else 0,
            started_at=started_at, gpus=tuple(launch.gpus), nics=tuple(launch.nics),
            epoch=launch.epoch,
        )
        member = _Member(record=record, popen=popen,
                         pidfd=_open_pidfd(pid) if self._use_pidfd else None)
        self._members[key] = member
        self._write_state()
        member.task = asyncio.get_running_loop().create_task(
            self._watch(member), name=f"member-watch {key}")
        log.info("member %s started pid=%d epoch=%d", key, pid, launch.epoch)
        return record.handle()

    async def stop(self, key: MemberKey, grace_s: float) -> None:
        """SIGTERM to the member's group, SIGKILL after ``grace_s``.

        Idempotent. Returns once the whole group is gone and the exit has been
        reported, unless the process survives SIGKILL for ``kill_timeout_s``
        (logged; its exit is reported whenever it finally happens)."""
        member = self._members.get(key)
        if member is None:
            return
        pgid = member.record.pgid
        if grace_s > 0 and not member.exited.is_set():
            _signal_group(pgid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(member.exited.wait(), grace_s)
        if not member.exited.is_set():
            _signal_group(pgid, signal.SIGKILL)
            try:
                await asyncio.wait_for(member.exited.wait(), self._kill_timeout_s)
            except TimeoutError:
                log.error("member %s (pid %d) survived SIGKILL for %.1fs",
                          key, member.record.pid, self._kill_timeout_s)
                return
        await member.done.wait()

    async def stop_all(self, grace_s: float) -> None:
        """Stop every member in parallel (self-fencing, shutdown)."""
        await asyncio.gather(*(self.stop(k, grace_s) for k in list(self._members)))

    def running(self) -> list[MemberHandle]:
        """Members started or adopted whose leader has not exited yet."""
        return [m.record.handle() for m in self._members.values() if not m.exited.is_set()]

    async def adopt(self) -> list[MemberHandle]:
        """Re-attach to this agent's live members after a restart; call it before
        the first ``start``.

        A record is adopted when its pid exists, is not a zombie, has the recorded
        start time (so the pid was not reused) and carries
        ``PHALANX_AGENT_ID == agent_id``. Records failing that are *vanished*:
        listed in ``self.vanished`` and reported via ``on_exit`` with
        ``EXIT_UNKNOWN``. Then every live process carrying this agent's marker
        that is not in an adopted member's session or group is an orphan (a crash
        between spawn and state write, or a member's leftover child): its group is
        SIGKILLed and it is listed in ``self.orphans_killed``. Processes without
        this agent's marker are never touched."""
        if self._closed:
            raise RuntimeError("launcher is closed")
        file_agent, records = load_state(self._state_dir)
        adopted: list[MemberHandle] = []
        vanished: list[MemberRecord] = []
        if file_agent is not None and file_agent != self._agent_id:
            # The agent id changed under live members: they are not ours to adopt
            # or to declare dead (that would free devices they still use).
            aside = self.state_path.with_name(f"{STATE_FILE}.foreign-{int(time.time())}")
            log.error("state file %s belongs to agent %r, not %r: ignoring its %d records "
                      "(moved to %s)", self.state_path, file_agent, self._agent_id,
                      len(records), aside)
            with contextlib.suppress(OSError):
                os.replace(self.state_path, aside)
            records = []
        for rec in records:
            if rec.key in self._members:
                continue
            member = self._attach(rec)
            if member is None:
                vanished.append(rec)
                continue
            self._members[rec.key] = member
            adopted.append(rec.handle())
            log.info("adopted member %s pid=%d", rec.key, rec.pid)
        self.orphans_killed = await self._kill_orphans()
        self._write_state()
        self.vanished = [rec.key for rec in vanished]
        self.vanished_handles = {rec.key: rec.handle() for rec in vanished}
        self.vanished_exits = {rec.key: record for rec in vanished
                               if (record := self._exit_record(rec.key, rec.pid)) is not None}
        for rec in vanished:
            key = rec.key
            code, ended = _recorded_status(self.vanished_exits.get(key))
            how = f"code={code}" if ended is not None else "status unknown (no exit record)"
            log.warning("member %s ended while the agent was down: %s", key, how)
            _append_log_line(self.log_path(key), f"vanished {key} while the agent was down: {how}")
            await self._report(key, code, ended)
        # Watch the adopted members only now, when adopt() returns without
        # another await: the caller records them before any of their exits
        # can be reported (an exit reported earlier would find no record).
        loop = asyncio.get_running_loop()
        for h in adopted:
            member = self._members.get(h.key)
            if member is not None and member.task is None:
                member.task = loop.create_task(self._watch(member), name=f"member-watch {h.key}")
        if not self._pruning:
            self._pruning = True
            self._spawn(self._prune_loop())
        return adopted

    # -- log retention ------------------------------------------------------ #

    def prune_logs(self, now: float | None = None) -> list[Path]:
        """Delete ``logs/<gang>/<incarnation>/`` directories (member logs and
        exit records) whose newest file is older than the log retention and
        none of whose members runs here; returns the directories removed."""
        now = time.time() if now is None else now
        live = {(k.gang, k.incarnation) for k in self._members}
        root = logs_root(self._state_dir)
        listing: list[tuple[str, int, float]] = []
        for gang_dir in _subdirs(root):
            for inc_dir in _subdirs(gang_dir):
                if inc_dir.name.isdigit():
                    listing.append((gang_dir.name, int(inc_dir.name), _newest_mtime(inc_dir)))
        removed = []
        for gang, inc in stale_log_dirs(listing, live=live, now=now, retention_s=self._log_retention_s):
            path = root / gang / str(inc)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            # The members' work dirs go with their logs (same retention).
            shutil.rmtree(self._work_root / gang / str(inc), ignore_errors=True)
            for parent in (root / gang, self._work_root / gang):
                with contextlib.suppress(OSError):
                    parent.rmdir()  # only when that was its last incarnation
        if removed:
            log.info("removed %d member log director%s older than %gs", len(removed),
                     "y" if len(removed) == 1 else "ies", self._log_retention_s)
        return removed

    async def _prune_loop(self) -> None:
        while True:
            try:
                self.prune_logs()
            except OSError as exc:  # a full or read-only disk must not stop the agent
                log.warning("member log retention: %s", exc)
            await asyncio.sleep(min(3600.0, self._log_retention_s / 10))

    async def close(self) -> None:
        """Stop watching; members keep running (an agent restart adopts them)."""
        if self._closed:
            return
        self._closed = True
        tasks = [m.task for m in self._members.values() if m.task is not None]
        tasks += list(self._side_tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for m in self._members.values():
            self._close_pidfd(m)
            # Release anyone blocked in stop(): the launcher no longer knows.
            m.exited.set()
            m.done.set()
        self._members.clear()

    # -- internals --------------------------------------------------------- #

    def _make_work_dir(self, key: MemberKey, account: Account | None) -> Path:
        """The member's own directory, owned by ``account`` (None: the
        agent's user), mode 0700. The directories above it are the agent's,
        mode 0711: a member can pass through them to its own directory but
        neither list nor change them, so it cannot reach another member's."""
        path = self.work_path(key)
        for d in (self._work_root, path.parent.parent, path.parent):
            d.mkdir(exist_ok=True)
            os.chmod(d, 0o711)
        path.mkdir(exist_ok=True)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(f"{path} is not a directory")
        if account is not None:
            os.chown(path, account.uid, account.gid, follow_symlinks=False)
        os.chmod(path, 0o700, follow_symlinks=False)
        return path

    def _spawn_failed(self, launch: MemberLaunch, started_at: float, reason: str) -> MemberHandle:
        log.warning("member %s failed to start: %s", launch.key, reason)
        # Reported from a task, after start() has returned the handle, so the
        # agent always learns of a member before it learns of its end.
        self._spawn(self._report(launch.key, EXIT_SPAWN_FAILED))
        return MemberHandle(key=launch.key, pid=0, started_at=started_at,
                            gpus=tuple(launch.gpus), nics=tuple(launch.nics), epoch=launch.epoch)

    def _attach(self, rec: MemberRecord) -> _Member | None:
        st = read_proc_stat(rec.pid)
        if st is None or not st.alive or st.start_ticks != rec.start_ticks:
            return None
        env = read_proc_environ(rec.pid)
        if env is None or env.get(ENV_AGENT_ID) != self._agent_id:
            return None  # same pid and tick but not our member: treat as gone
        pidfd = _open_pidfd(rec.pid) if self._use_pidfd else None
        # Re-check after opening: the pidfd must refer to the process we vetted,
        # not to a successor that took the pid in between.
        if not _same_process_alive(rec.pid, rec.start_ticks):
            if pidfd is not None:
                os.close(pidfd)
            return None
        return _Member(record=rec, popen=None, pidfd=pidfd)

    async def _kill_orphans(self) -> list[OrphanProcess]:
        own_pid = os.getpid()
        # A member's descendants inherit its marker; they belong to the member as
        # long as they stay in its session (or at least its group).
        sids = {m.record.pid for m in self._members.values()}
        pgids = {m.record.pgid for m in self._members.values()}
        orphans: list[OrphanProcess] = []
        for pid in _all_pids():
            if pid == own_pid:
                continue
            env = read_proc_environ(pid)
            if not env or env.get(ENV_AGENT_ID) != self._agent_id or ENV_GANG not in env:
                continue
            st = read_proc_stat(pid)
            if st is None or not st.alive or st.sid in sids or st.pgid in pgids:
                continue
            orphans.append(OrphanProcess(pid=pid, pgid=st.pgid, key=_key_from_env(env)))
        for o in orphans:
            log.warning("killing orphan pid=%d pgid=%d (%s): carries this agent's marker "
                        "but no state record", o.pid, o.pgid, o.key)
            if o.pgid == os.getpgrp() or o.pgid <= 1:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(o.pid, signal.SIGKILL)
            else:
                _signal_group(o.pgid, signal.SIGKILL)
        for pgid in {o.pgid for o in orphans}:
            if pgid != os.getpgrp() and not await _wait_group_gone(pgid, self._kill_timeout_s):
                log.error("orphan group %d survived SIGKILL for %.1fs", pgid, self._kill_timeout_s)
        return orphans

    async def _watch(self, m: _Member) -> None:
        key, pgid = m.record.key, m.record.pgid
        try:
            await self._wait_leader_exit(m)
            # The leader's pid (== pgid) cannot be reused while it is an unreaped
            # zombie or while any process of its group lives, so killing the group
            # now reaches only the member's leftovers. A member is its whole
            # group: leftovers would hold devices the coordinator will re-assign.
            _signal_group(pgid, signal.SIGKILL)
            ended: float | None = None
            if m.popen is not None:
                code = m.popen.wait()
            else:
                # Not our child: only its shim's exit record can tell the status.
                code, ended = _recorded_status(self._exit_record(m.record.key, m.record.pid))
            m.exited.set()
            if not await _wait_group_gone(pgid, self._kill_timeout_s):
                log.error("member %s: process group %d survived SIGKILL for %.1fs; "
                          "reporting the exit anyway", key, pgid, self._kill_timeout_s)
        finally:
            self._close_pidfd(m)
        self._members.pop(key, None)
        self._write_state()
        _append_log_line(self.log_path(key), f"exit {key} code={code}")
        log.info("member %s exited code=%d", key, code)
        try:
            await self._report(key, code, ended)
        finally:
            m.done.set()

    async def _wait_leader_exit(self, m: _Member) -> None:
        if m.pidfd is not None:
            loop = asyncio.get_running_loop()
            ready: asyncio.Future[None] = loop.create_future()

            def on_readable() -> None:
                if not ready.done():
                    ready.set_result(None)

            # A pidfd becomes readable when the process terminates, child or not.
            loop.add_reader(m.pidfd, on_readable)
            try:
                await ready
            finally:
                loop.remove_reader(m.pidfd)
            return
        while True:
            if m.popen is not None:
                # WNOWAIT: learn that it ended without reaping, so the pid stays
                # reserved until we have killed the rest of its group.
                info = os.waitid(os.P_PID, m.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if info is not None:
                    return
            elif not _same_process_alive(m.record.pid, m.record.start_ticks):
                return
            await asyncio.sleep(POLL_INTERVAL_S)

    def _close_pidfd(self, m: _Member) -> None:
        if m.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(m.pidfd)
            m.pidfd = None

    def _exit_record(self, key: MemberKey, pid: int) -> dict[str, Any] | None:
        """The member's shim exit record, if there is one written by ``pid``."""
        rec = read_exit_record(member_exit_path(self._state_dir, key))
        return rec if rec is not None and rec["pid"] == pid else None

    async def _report(self, key: MemberKey, code: int, ended_mono: float | None = None) -> None:
        try:
            result = self._on_exit(key, code, ended_mono)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:
            # The callback belongs to the agent; its bug must not stop the
            # launcher from tracking the other members.
            log.exception("on_exit callback failed for %s (code %d)", key, code)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    def _write_state(self) -> None:
        doc = {
            "version": STATE_VERSION,
            "agent_id": self._agent_id,
            "members": [m.record.to_json() for _, m in
                        sorted(self._members.items(),
                               key=lambda kv: (kv[0].gang, kv[0].incarnation, kv[0].rank))],
        }
        try:
            _write_atomically(self.state_path, json.dumps(doc, indent=1).encode())
        except OSError:
            # Not fatal: a member missing from the file is killed as an orphan
            # after a restart, which is the safe direction.
            log.exception("cannot write state file %s", self.state_path)


def _recorded_status(record: Mapping[str, Any] | None) -> tuple[int, float | None]:
    """(status, CLOCK_MONOTONIC end) from a shim exit record;
    (``EXIT_UNKNOWN``, None) without one."""
    if record is None:
        return EXIT_UNKNOWN, None
    return int(record["code"]), float(record["ended_mono"])


def _key_from_env(env: Mapping[str, str]) -> MemberKey | None:
    try:
        return MemberKey(env[ENV_GANG], int(env[ENV_INCARNATION]), int(env["RANK"]))
    except (KeyError, ValueError):
        return None
