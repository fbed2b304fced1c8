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

Spawned with ``subprocess.Popen`` and watched through a pidfd, not with
``asyncio.create_subprocess_exec`` (whose transport kills its child when
collected): docs/launcher.md "Implementation notes". What a member is given
is ``agent.core.member_env``, whom it runs as ``agent.core.run_as`` and
``agent.run_as``, its files ``agent.member_files``, the state file
``agent.member_state``, /proc and its group ``agent.procfs``, the shim's
command line ``agent.shim_call``.

Linux only: relies on ``/proc`` and (where available) pidfds.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import os
import shlex
import signal
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Coroutine, Mapping

from agent.core import adoption
from agent.core.adoption import OrphanProcess
from agent.core.member_env import ENV_AGENT_ID, member_command, member_environment, shim_environment
from agent.core.member_exit import EXIT_SPAWN_FAILED, recorded_status
from agent.core.run_as import Refused, RunAsPolicy, decide
from agent.launcher import ExitCallback, MemberHandle, MemberKey, MemberLaunch
from agent.member_files import append_log_line, make_work_dir, member_work_path, prune_member_files
from agent.member_state import STATE_FILE, MemberRecord, load_state, write_state
from agent.procfs import (
    all_pids,
    open_pidfd,
    read_proc_environ,
    read_proc_stat,
    same_process_alive,
    signal_group,
    wait_group_gone,
)
from agent.run_as import RunAsRefused, closed_to_others, default_run_as
from agent.shim import encode_environment, no_new_privs, read_exit_record
from agent.shim_call import environment_fd, shim_command
from phalanx.member_logs import logs_root, member_exit_path, member_log_path

log = logging.getLogger(__name__)

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
                append_log_line(log_path, f"refused {key}: {decision.reason}")
            log.warning("member %s refused: %s", key, decision.reason)
            raise RunAsRefused(decision.reason)
        account = decision.account if decision.switch else None
        env = member_environment(launch, agent_id=self._agent_id, base=os.environ, node_addr=self._node_addr,
                                 extra_env=self._extra_env, work_dir=str(self.work_path(key)), account=account)
        try:
            # Before anything is made for the member (work dir, exit record):
            # an environment exec would refuse fails it here, by name.
            env_block = encode_environment(env)
        except ValueError as exc:
            with contextlib.suppress(OSError):
                log_path.parent.mkdir(parents=True, exist_ok=True)
                append_log_line(log_path, f"failed to start {key}: {exc}")
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
            work_dir = make_work_dir(self._work_root, key, account)
        except OSError as exc:
            os.close(log_fd)
            append_log_line(log_path, f"failed to start {key}: cannot make its work dir: {exc}")
            return self._spawn_failed(launch, started_at, f"cannot make work dir {self.work_path(key)}: {exc}")
        fence_note = (f" fence_lease={self._fence_lease} fence_after_s={self._fence_after_s:g}"
                      if self._fence_lease is not None else "")
        who = (f" user={account.name} uid={account.uid} gid={account.gid}" if account is not None
               else f" uid={self._uid} (the agent's own user)")
        append_log_line(log_path, f"start {key} epoch={launch.epoch} gpus={list(launch.gpus)} "
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
            append_log_line(log_path, f"failed to start {key}: {exc}")
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
                         pidfd=open_pidfd(pid) if self._use_pidfd else None)
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
            signal_group(pgid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(member.exited.wait(), grace_s)
        if not member.exited.is_set():
            signal_group(pgid, signal.SIGKILL)
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
        return [member.record.handle() for member in self._members.values() if not member.exited.is_set()]

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
            code, ended = recorded_status(self.vanished_exits.get(key))
            how = f"code={code}" if ended is not None else "status unknown (no exit record)"
            log.warning("member %s ended while the agent was down: %s", key, how)
            append_log_line(self.log_path(key), f"vanished {key} while the agent was down: {how}")
            await self._report(key, code, ended)
        # Watch the adopted members only now, when adopt() returns without
        # another await: the caller records them before any of their exits
        # can be reported (an exit reported earlier would find no record).
        loop = asyncio.get_running_loop()
        for handle in adopted:
            member = self._members.get(handle.key)
            if member is not None and member.task is None:
                member.task = loop.create_task(self._watch(member), name=f"member-watch {handle.key}")
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
        removed = prune_member_files(self._state_dir, self._work_root, live=live, now=now,
                                     retention_s=self._log_retention_s)
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
        tasks = [member.task for member in self._members.values() if member.task is not None]
        tasks += list(self._side_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for member in self._members.values():
            self._close_pidfd(member)
            # Release anyone blocked in stop(): the launcher no longer knows.
            member.exited.set()
            member.done.set()
        self._members.clear()

    # -- internals --------------------------------------------------------- #

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
        pidfd = open_pidfd(rec.pid) if self._use_pidfd else None
        # Re-check after opening: the pidfd must refer to the process we vetted,
        # not to a successor that took the pid in between.
        if not same_process_alive(rec.pid, rec.start_ticks):
            if pidfd is not None:
                os.close(pidfd)
            return None
        return _Member(record=rec, popen=None, pidfd=pidfd)

    async def _kill_orphans(self) -> list[OrphanProcess]:
        own_pid = os.getpid()
        # A member leads its own session: its pid is the session id.
        sessions = {member.record.pid for member in self._members.values()}
        groups = {member.record.pgid for member in self._members.values()}
        orphans: list[OrphanProcess] = []
        for pid in all_pids():
            if pid == own_pid:
                continue
            found = adoption.orphan(read_proc_environ(pid), read_proc_stat(pid), agent_id=self._agent_id,
                                    member_sessions=sessions, member_groups=groups)
            if found is not None:
                orphans.append(found)
        for orphan in orphans:
            log.warning("killing orphan pid=%d pgid=%d (%s): carries this agent's marker "
                        "but no state record", orphan.pid, orphan.pgid, orphan.key)
            if orphan.pgid == os.getpgrp() or orphan.pgid <= 1:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(orphan.pid, signal.SIGKILL)
            else:
                signal_group(orphan.pgid, signal.SIGKILL)
        for pgid in {orphan.pgid for orphan in orphans}:
            if pgid != os.getpgrp() and not await wait_group_gone(pgid, self._kill_timeout_s):
                log.error("orphan group %d survived SIGKILL for %.1fs", pgid, self._kill_timeout_s)
        return orphans

    async def _watch(self, member: _Member) -> None:
        key, pgid = member.record.key, member.record.pgid
        try:
            await self._wait_leader_exit(member)
            # The leader's pid (== pgid) cannot be reused while it is an unreaped
            # zombie or while any process of its group lives, so killing the group
            # now reaches only the member's leftovers. A member is its whole
            # group: leftovers would hold devices the coordinator will re-assign.
            signal_group(pgid, signal.SIGKILL)
            ended: float | None = None
            if member.popen is not None:
                code = member.popen.wait()
            else:
                # Not our child: only its shim's exit record can tell the status.
                code, ended = recorded_status(self._exit_record(member.record.key, member.record.pid))
            member.exited.set()
            if not await wait_group_gone(pgid, self._kill_timeout_s):
                log.error("member %s: process group %d survived SIGKILL for %.1fs; "
                          "reporting the exit anyway", key, pgid, self._kill_timeout_s)
        finally:
            self._close_pidfd(member)
        self._members.pop(key, None)
        self._write_state()
        append_log_line(self.log_path(key), f"exit {key} code={code}")
        log.info("member %s exited code=%d", key, code)
        try:
            await self._report(key, code, ended)
        finally:
            member.done.set()

    async def _wait_leader_exit(self, member: _Member) -> None:
        if member.pidfd is not None:
            loop = asyncio.get_running_loop()
            ready: asyncio.Future[None] = loop.create_future()

            def on_readable() -> None:
                if not ready.done():
                    ready.set_result(None)

            # A pidfd becomes readable when the process terminates, child or not.
            loop.add_reader(member.pidfd, on_readable)
            try:
                await ready
            finally:
                loop.remove_reader(member.pidfd)
            return
        while True:
            if member.popen is not None:
                # WNOWAIT: learn that it ended without reaping, so the pid stays
                # reserved until we have killed the rest of its group.
                info = os.waitid(os.P_PID, member.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if info is not None:
                    return
            elif not same_process_alive(member.record.pid, member.record.start_ticks):
                return
            await asyncio.sleep(POLL_INTERVAL_S)

    def _close_pidfd(self, member: _Member) -> None:
        if member.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(member.pidfd)
            member.pidfd = None

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
        try:
            write_state(self.state_path, self._agent_id, (member.record for member in self._members.values()))
        except OSError:
            # Not fatal: a member missing from the file is killed as an orphan
            # after a restart, which is the safe direction.
            log.exception("cannot write state file %s", self.state_path)
