"""Chaos scenarios: a fault family + the workload + settle + check.

Each scenario turns a built :class:`chaos.cluster.PhalanxCluster` into a list
of fault *variants* (usually one per AZ); :func:`chaos.faults.schedule`
then picks, from the seed, which variant strikes when and for how long, so a
(scenario, seed) pair always gives the same steps. Faults aimed at "the
leader of AZ x" resolve their target when injected (:class:`AtLeader`),
because leadership moves during a run.

| scenario | fault |
|---|---|
| partition-az | every host of one AZ (etcd member, coordinators, agents) cut from the other AZs' hosts |
| leader-etcd-cut | the AZ leader's host cut from all etcd members, not from its agents (their token reads fall to the standby, which still reads etcd) |
| agents-cut | an AZ's agent host cut from its coordinators, 2-9 s: both sides of fence_after; the agents hold no etcd access, so their token reads are cut too (nothing starts until it heals) |
| one-way | the leader's proxy drops one direction: requests delivered, replies lost (s2c), or the reverse |
| leader-pause | SIGSTOP of the AZ leader for 1.5-4 x its lease TTL, then SIGCONT |
| coordinator-crash | ``leader.after_reserve=crash`` armed in the running AZ leader, then a trigger gang submitted: it dies right after that reservation txn, before sending assignments |
| etcd-member-restart | SIGKILL of one etcd member, restarted from its data dir after the hold |
| etcd-quorum-loss | SIGKILL of two of the three etcd members, both restarted after the hold |
| agent-restart | SIGKILL of an AZ's agent process and an immediate restart: its members must be adopted |
| agent-down | SIGKILL of an AZ's agent process, restarted 6-9 s later: past the node's re-placement deadline |
| etcd-slow-replies | etcd's replies to AZ a's leader held past its request timeout, in 0.6-0.9 s bursts: writes commit while the leader sees timeouts |
| reserve-reply-lost | the reply to one reservation txn of AZ a's leader is lost while the txn commits (failpoint + etcd proxy) |
| mixed | several of the above, one at a time, from the seed |
| fencing-disabled | agents-cut past the re-placement deadline with ``agent.no_fencing=on``: the checker MUST report violations |
| stale-epoch-accepted | ``agent.ignore_stale_epoch=on`` + a token check delayed (``agent.before_token_check``) while the AZ leader is SIGSTOPped and replaced: a member starts under the dead epoch (invariant 6 MUST report it) |
| fence-compare-skipped | ``leader.skip_fence_compare=on``; the standby SIGSTOPped and the leader's etcd requests held until its lease expired: its reservation txn commits with no leader (invariant 6 MUST report it) |
| decision-overwrite | ``twophase.decision_overwrite=on`` + ``owner.after_prepare=delay(2)``; the owner's etcd requests held (``channel_hold_ms()``, 2.8 s): its COMMIT lands over the ABORT an in-doubt participant wrote meanwhile (invariant 8 MUST report it) |
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos.cluster import PhalanxCluster
from chaos.faults import Fault, Kill, Partition, Pause, ProxyDelay, ProxyOneWay, Restart, Step, schedule
from phalanx.store import KEEPALIVE_TIMEOUT_MS
from phalanx.timings import Timings


class AtLeader(Fault):
    """A fault aimed at whoever leads ``az`` at the moment it is injected.

    ``make(coordinator_id)`` builds the concrete fault; its own inject/heal
    do the work, while this wrapper owns the health checks and the record
    (so the history shows one fault with one name).
    """

    def __init__(self, pc: PhalanxCluster, az: str, make: Callable[[str], Fault], name: str, **kw: Any) -> None:
        self.pc, self.az, self.make = pc, az, make
        self.inner: Fault | None = None
        self.target = ""
        super().__init__(name, **kw)

    def _inject(self) -> None:
        cid = self.pc.leader_of(self.az)
        if cid is None or not self.pc.procs[cid].alive():
            raise RuntimeError(f"{self.name}: {self.az} has no live leader to aim at")
        self.target = cid
        self.inner = self.make(cid)
        self.pc.record({"src": "note", "mono": _now(), "name": self.name, "detail": f"target {cid}"})
        self.inner._inject()
        self.inner.active = True

    def _heal(self) -> None:
        if self.inner is not None:
            self.inner._heal()
            self.inner.active = False
            self.inner = None


class CrashAtFailpoint(Fault):
    """Arm ``failpoint`` (a crash) in the running leader of ``az``.

    Armed at run time through the leader's failpoints file, so the crash hits
    the current leader in the middle of its work: with
    ``leader.after_reserve=crash`` it SIGKILLs itself right after its next
    reservation txn commits, before any assignment is sent; the standby must
    take over and finish (or undo) that gang. A trigger gang is submitted to
    the AZ right after arming, so the leader has something to admit. Heal
    disarms every coordinator of the AZ and restarts the ones that crashed.
    """

    def __init__(self, pc: PhalanxCluster, az: str, failpoint: str = "leader.after_reserve=crash", **kw: Any) -> None:
        self.pc, self.az, self.failpoint = pc, az, failpoint
        self.armed: str = ""
        super().__init__(f"crash-{failpoint.split('=')[0]}-{az}", **kw)

    def _inject(self) -> None:
        leader = self.pc.leader_of(self.az)
        if leader is None or not self.pc.procs[leader].alive():
            raise RuntimeError(f"{self.name}: {self.az} has no live leader to arm")
        self.armed = leader
        self.pc.arm(leader, self.failpoint)
        self.pc.record({"src": "note", "mono": _now(), "name": self.name, "detail": f"armed leader {leader}"})
        # Make sure the armed leader admits something while armed.
        self.pc.trigger(self.az, f"{self.az}{int(_now() * 1000) % 100000}")

    def _heal(self) -> None:
        for cid in self.pc.coordinator_ids(self.az):
            self.pc.arm(cid, "")
        crashed = bool(self.armed) and not self.pc.procs[self.armed].alive()
        if self.armed:
            self.pc.record({"src": "note", "mono": _now(), "name": self.name,
                            "detail": f"{self.armed} {'crashed at the failpoint' if crashed else 'did not reach the failpoint'}"})
        for cid in self.pc.coordinator_ids(self.az):
            if not self.pc.procs[cid].alive():
                self.pc.note_exit(cid)
                self.pc.restart(cid)
        self.armed = ""


class QuorumLoss(Fault):
    """SIGKILL etcd members ``azs`` (two of three: no quorum); restart them on heal."""

    def __init__(self, pc: PhalanxCluster, azs: Sequence[str], **kw: Any) -> None:
        self.pc, self.azs = pc, list(azs)
        super().__init__(f"etcd-quorum-loss({','.join(self.azs)})", **kw)

    def _inject(self) -> None:
        assert self.pc.etcd is not None
        for az in self.azs:
            self.pc.etcd.kill(az)

    def _heal(self) -> None:
        assert self.pc.etcd is not None
        for az in self.azs:
            if not self.pc.etcd.members[az].alive():
                self.pc.etcd.restarter(az)()


def _now() -> float:
    return time.monotonic()


# ---------------------------------------------------------------------------


FaultFactory = Callable[[PhalanxCluster, dict[str, Any]], list[Fault]]


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    faults: FaultFactory
    hold: tuple[float, float] = (3.0, 8.0)
    gap: tuple[float, float] = (4.0, 7.0)
    max_steps: int = 1
    proxies: bool = False
    etcd_proxies: tuple[str, ...] = ()
    agent_failpoints: str = ""
    rate: float | None = None  # gangs/s; None: the runner's default
    expect_violations: bool = False
    duration: float = 20.0

    def steps(self, pc: PhalanxCluster, seed: int, duration: float | None = None) -> list[Step]:
        """The fault schedule for ``seed`` (same seed, same steps)."""
        kw = checks(pc)
        variants = self.faults(pc, kw)
        steps = schedule(schedule_seed(self.name, seed), variants, (duration or self.duration) - 1.0,
                         hold=self.hold, gap=self.gap)
        return steps[: self.max_steps]


def checks(pc: PhalanxCluster) -> dict[str, Any]:
    """Health gates for every fault: never inject into a cluster still broken
    by the last fault (etcd healthy, a live leader per AZ, every node ready).
    Recovery after a heal is not a gate: it is measured (invariant 7)."""
    return {"before": [pc.etcd_ok, pc.healthy], "record": pc.record_fault, "settle_timeout": 45.0}


def _others(pc: PhalanxCluster, az: str) -> list[Any]:
    return [h for other in pc.azs if other != az for h in pc.az_hosts(other)]


def partition_az(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    return [Partition(pc.az_hosts(az), _others(pc, az), name=f"partition-az-{az}", **kw) for az in pc.azs]


def leader_etcd_cut(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    etcd_hosts = [pc.etcd_host(a) for a in pc.azs]
    return [AtLeader(pc, az, lambda cid: Partition([pc.coord_host(cid)], etcd_hosts), f"leader-etcd-cut-{az}", **kw)
            for az in pc.azs]


def agents_cut(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    return [Partition([pc.agent_host(az)], [pc.coord_host(c) for c in pc.coordinator_ids(az)],
                      name=f"agents-cut-{az}", **kw) for az in pc.azs]


def one_way(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    out: list[Fault] = []
    for az in pc.azs:
        for direction in ("s2c", "c2s"):
            out.append(AtLeader(pc, az, lambda cid, d=direction: ProxyOneWay(pc.proxy_control(cid), d),
                                f"one-way-{direction}-leader-{az}", **kw))
    return out


def leader_pause(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    return [AtLeader(pc, az, lambda cid: Pause(pc.proc_ref(cid)), f"pause-leader-{az}", **kw) for az in pc.azs]


def coordinator_crash(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    return [CrashAtFailpoint(pc, az, **kw) for az in pc.azs]


def etcd_member_restart(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    assert pc.etcd is not None
    kw = dict(kw, after=[pc.etcd_ok])
    return [Kill(pc.etcd.process_ref(az), restart=pc.etcd.restarter(az), name=f"etcd-kill-restart-{az}", **kw)
            for az in pc.azs]


def etcd_quorum_loss(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    kw = dict(kw, after=[pc.etcd_ok])
    azs = list(pc.azs)
    return [QuorumLoss(pc, [a for a in azs if a != keep], **kw) for keep in azs]


def agent_restart(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    return [Restart(pc.proc_ref(f"agents-{az}"), (lambda name=f"agents-{az}": pc.restart(name)),
                    name=f"agent-restart-{az}", **kw) for az in pc.azs]


def agent_down(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    return [Kill(pc.proc_ref(f"agents-{az}"), restart=(lambda name=f"agents-{az}": pc.restart(name)),
                 name=f"agent-down-{az}", **kw) for az in pc.azs]


def etcd_slow_replies(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    """etcd's replies to the leader of AZ a held 650 ms: past the leader's
    request timeout (500 ms with fast timings), so a write issued early in a
    burst commits while the leader sees DEADLINE_EXCEEDED; bursts are short
    (< the lease validity) so the leader usually stays leader and carries on
    with what it believes. (Healing releases held replies at once.)"""
    az = pc.etcd_proxy_azs[0]
    return [AtLeader(pc, az, lambda cid: ProxyDelay(pc.etcd_proxy_control(cid), 0, 650),
                     f"etcd-slow-replies-leader-{az}", **kw)]


class ReserveReplyLost(Fault):
    """The reply to one reservation txn of ``az``'s leader is lost; the txn commits.

    Arms ``leader.before_reserve=delay(D)`` in the leader; when the leader logs
    that it reached the failpoint (its next admission), etcd's replies to it
    are held ``hold_ms`` from just before the txn is sent until just after its
    deadline, then released. The leader sees DEADLINE_EXCEEDED for a write
    that is durable, and keeps its lease (the window is shorter than its
    validity). What it does next is the test.
    """

    def __init__(self, pc: PhalanxCluster, az: str, delay_s: float = 1.5, hold_ms: int = 650, **kw: Any) -> None:
        self.pc, self.az, self.delay_s, self.hold_ms = pc, az, delay_s, hold_ms
        self.leader = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        super().__init__(f"reserve-reply-lost-{az}", **kw)

    def _inject(self) -> None:
        leader = self.pc.leader_of(self.az)
        if leader is None or leader not in self.pc.etcd_proxies:
            raise RuntimeError(f"{self.name}: {self.az}'s leader has no etcd proxy")
        self.leader = leader
        log = self.pc.logs / f"{leader}.log"
        start = log.stat().st_size if log.exists() else 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, args=(log, start), daemon=True)
        self._thread.start()
        self.pc.arm(leader, f"leader.before_reserve=delay({self.delay_s})")
        self.pc.trigger(self.az, f"{self.az}{int(_now() * 1000) % 100000}")  # something to admit now

    def _watch(self, log: Any, start: int) -> None:
        ctl = self.pc.etcd_proxy_control(self.leader)
        while not self._stop.is_set():
            with open(log, "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
            if "failpoint leader.before_reserve" in text:
                break
            self._stop.wait(0.02)
        else:
            return
        seen = time.monotonic()
        self.pc.arm(self.leader, "")  # one reservation only
        # The txn goes out delay_s after the failpoint line; hold the replies
        # from just before that until just past its deadline (etcd_timeout_s).
        self._stop.wait(max(0.0, seen + self.delay_s - 0.1 - time.monotonic()))
        ctl.set_delay(0, self.hold_ms)
        self.pc.record({"src": "note", "mono": time.monotonic(), "name": self.name,
                        "detail": f"{self.leader} reached leader.before_reserve; etcd replies held {self.hold_ms} ms"})
        self._stop.wait(self.pc.timings.etcd_timeout_s + 0.25)
        ctl.set_delay(0, 0)

    def _heal(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.leader:
            self.pc.arm(self.leader, "")
            self.pc.etcd_proxy_control(self.leader).set_delay(0, 0)


def reserve_reply_lost(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    return [ReserveReplyLost(pc, pc.etcd_proxy_azs[0], **kw)]


def _log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _wait_for_line(paths: dict[str, tuple[Path, int]], marker: str, stop: threading.Event) -> str | None:
    """Poll the logs (name -> (path, offset to read from)) until one has a line
    with ``marker``; the name of that log, or None once ``stop`` is set."""
    while not stop.is_set():
        for name, (path, start) in paths.items():
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(start)
                if marker in f.read().decode(errors="replace"):
                    return name
        stop.wait(0.02)
    return None


# The planted-bug faults below hold one coordinator's etcd *requests* (its
# etcd proxy delays them) so that a write arrives after a deadline has passed
# in etcd or at a peer. The hold is as long as the etcd channel survives: its
# keepalive ping (phalanx.store.KEEPALIVE_TIMEOUT_MS) is held too, and a
# ping unanswered that long drops the connection, and with it the order of
# what it carries (the held write would then fail instead of landing late).
# PING_ROUND_TRIP_MS keeps the ping's answer inside that timeout. What the
# hold has to outlast is a deadline of the scenario's Timings, checked by
# each fault (``hold_outlasts``): with longer timings the bug cannot be
# staged this way, and the fault says so instead of catching nothing.
PING_ROUND_TRIP_MS = 200
# etcd revokes an expired lease at its next expiry check (every 500 ms) and
# a participant writes its ABORT one etcd round trip after its timeout.
DEADLINE_SLACK_S = 0.5


def channel_hold_ms() -> int:
    """How long a planted-bug fault holds a process's etcd requests."""
    return KEEPALIVE_TIMEOUT_MS - PING_ROUND_TRIP_MS


def hold_outlasts(name: str, hold_ms: int, lead_s: float, deadline_s: float, what: str) -> None:
    """Refuse a fault whose held write would not reach etcd past
    ``deadline_s`` (plus DEADLINE_SLACK_S), both counted from the moment
    the deadline starts running or later: the write is sent ``lead_s``
    after it and held ``hold_ms``. Unrefused, the planted bug would go
    unstaged and the scenario pass for the wrong reason (ValueError)."""
    arrives = lead_s + hold_ms / 1000
    if arrives < deadline_s + DEADLINE_SLACK_S:
        raise ValueError(f"{name}: its held write reaches etcd {arrives:.2f}s into {what} ({deadline_s:g}s), not "
                         f"past it + {DEADLINE_SLACK_S:g}s; the etcd channel survives a hold of at most "
                         f"{channel_hold_ms()} ms, so run it with a shorter {what.split()[0]}")


class PlantedBugFault(Fault):
    """Shared shape of the planted-bug faults below: a watcher thread started
    at inject that reacts when a process logs reaching a failpoint, and a heal
    that first lets the watcher finish (the bug must still be armed when the
    broken code runs), then lifts everything. ``_react`` does the work and
    returns when the bug has had its chance; ``_lift`` undoes it all."""

    def __init__(self, pc: PhalanxCluster, name: str, **kw: Any) -> None:
        self.pc = pc
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        super().__init__(name, **kw)

    def _note(self, detail: str) -> None:
        self.pc.record({"src": "note", "mono": _now(), "name": self.name, "detail": detail})

    def _start_watcher(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._react, daemon=True)
        self._thread.start()

    def _react(self) -> None: ...

    def _lift(self) -> None: ...

    def _heal(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=self.react_timeout())
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._lift()

    def react_timeout(self) -> float:
        return 0.0


class StaleEpochStart(PlantedBugFault):
    """PLANTED BUG ``agent.ignore_stale_epoch`` (the agent's token check does
    not compare the epoch with etcd's leader key).

    The agents of ``az`` are armed with it and with
    ``agent.before_token_check=delay(D)`` (a slow agent: an assignment waits
    D s before its token read); a trigger gang makes the leader assign. When
    an agent logs that an assignment is waiting, the leader that sent it is
    SIGSTOPped (until heal): its lease runs out and the standby takes over
    while the assignment waits. The token read then finds another epoch (or
    none) in ``leader/<az>``; with the bug the agent starts the member anyway,
    under the dead epoch, D s after it arrived: invariant 6 ("started under
    epoch E ... after that leadership ended").
    """

    def __init__(self, pc: PhalanxCluster, az: str, delay_s: float = 8.0, **kw: Any) -> None:
        self.az, self.delay_s = az, delay_s
        self.leader, self.seen = "", 0.0
        self._pause: Pause | None = None
        super().__init__(pc, f"stale-epoch-start-{az}", **kw)

    def _inject(self) -> None:
        leader = self.pc.leader_of(self.az)
        if leader is None or not self.pc.procs[leader].alive():
            raise RuntimeError(f"{self.name}: {self.az} has no live leader")
        self.leader, self.seen, self._pause = leader, 0.0, None
        agents = f"agents-{self.az}"
        self._log = (self.pc.logs / f"{agents}.log", _log_size(self.pc.logs / f"{agents}.log"))
        self._start_watcher()
        self.pc.arm(agents, f"agent.ignore_stale_epoch=on,agent.before_token_check=delay({self.delay_s:g})")
        self.pc.trigger(self.az, f"{self.az}{int(_now() * 1000) % 100000}")

    def _react(self) -> None:
        if _wait_for_line({"agents": self._log}, "failpoint agent.before_token_check", self._stop) is None:
            return
        self.seen = _now()
        self._pause = Pause(self.pc.proc_ref(self.leader), name=f"pause-{self.leader}")
        self._pause._inject()
        self._note(f"an assignment waits {self.delay_s:g}s at agent.before_token_check; leader {self.leader} "
                   "SIGSTOPped until heal")
        # Let the waiting token checks run (with the bug still armed).
        self._stop.wait(self.delay_s + 2.0)

    def react_timeout(self) -> float:
        return self.delay_s + 3.0 if self.seen else 0.0

    def _lift(self) -> None:
        self.pc.arm(f"agents-{self.az}", "")
        if self._pause is not None:
            self._pause._heal()
            self._pause = None


def stale_epoch_start(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    return [StaleEpochStart(pc, pc.azs[0], **kw)]


class StaleLeaderWrite(PlantedBugFault):
    """PLANTED BUG ``leader.skip_fence_compare`` (a leader's txns lack the
    ``create_revision(leader/<az>) == epoch`` compare).

    The leader of ``az`` (which reaches etcd only through its etcd proxy) is
    armed with the bug and ``leader.before_reserve=delay(D)``; a trigger gang
    makes it admit. When it logs the failpoint, the AZ's standby is SIGSTOPped
    (no successor can take the key meanwhile) and, just before the
    reservation txn goes out, etcd's *requests* from the leader are held
    ``hold_ms``: its keepalives stall, so its lease expires in etcd, while the
    txn (sent inside the leader's local validity, so its own check passes)
    reaches etcd only after that. Without the fence compare it commits: a
    reservation written by an epoch that no longer leads (invariant 6). The
    hold is ``channel_hold_ms()``; its txn, sent ``delay_s - HOLD_LEAD_S``
    into the hold, must reach etcd past ``lease_ttl_s`` (its last keepalive
    went out before the hold).
    """

    HOLD_LEAD_S = 0.3  # the hold begins this long after the failpoint line

    def __init__(self, pc: PhalanxCluster, az: str, delay_s: float = 1.0, hold_ms: int | None = None,
                 **kw: Any) -> None:
        self.az, self.delay_s, self.hold_ms = az, delay_s, self.staged_hold_ms(pc.timings, delay_s, hold_ms)
        self.leader, self.epoch, self.seen = "", 0, 0.0
        self._paused: list[Pause] = []
        super().__init__(pc, f"stale-leader-write-{az}", **kw)

    @classmethod
    def staged_hold_ms(cls, t: Timings, delay_s: float = 1.0, hold_ms: int | None = None) -> int:
        """The hold (``channel_hold_ms()`` unless given), refused (ValueError)
        when ``t`` would not let the lease expire during it."""
        hold = channel_hold_ms() if hold_ms is None else hold_ms
        hold_outlasts("stale-leader-write", hold, delay_s - cls.HOLD_LEAD_S, t.lease_ttl_s, "lease_ttl_s of its leader")
        return hold

    def _inject(self) -> None:
        leader = self.pc.leader_of(self.az)
        if leader is None or leader not in self.pc.etcd_proxies:
            raise RuntimeError(f"{self.name}: {self.az}'s leader has no etcd proxy")
        self.leader, self.seen, self._paused = leader, 0.0, []
        self.epoch = self.pc.view.refresh().leaders().get(self.az, ("", 0))[1]
        log = self.pc.logs / f"{leader}.log"
        self._log = (log, _log_size(log))
        self._start_watcher()
        self.pc.arm(leader, f"leader.skip_fence_compare=on,leader.before_reserve=delay({self.delay_s:g})")
        self.pc.trigger(self.az, f"{self.az}{int(_now() * 1000) % 100000}")

    def _react(self) -> None:
        if _wait_for_line({"leader": self._log}, "failpoint leader.before_reserve", self._stop) is None:
            return
        self.seen = _now()
        self.pc.arm(self.leader, "leader.skip_fence_compare=on")  # one reservation only
        for cid in self.pc.coordinator_ids(self.az):
            if cid != self.leader and self.pc.procs[cid].alive():
                p = Pause(self.pc.proc_ref(cid), name=f"pause-{cid}")
                p._inject()
                self._paused.append(p)
        # The txn goes out delay_s after the failpoint line; hold the
        # leader's requests from a little after the line (its keepalives
        # were acknowledged until then, so it is still valid when it sends).
        self._stop.wait(max(0.0, self.seen + self.HOLD_LEAD_S - _now()))
        self.pc.etcd_proxy_control(self.leader).set_delay(self.hold_ms, 0)
        self._note(f"{self.leader} (epoch {self.epoch}) reached leader.before_reserve; standby paused; "
                   f"its etcd requests held {self.hold_ms} ms")
        self._stop.wait(max(0.0, self.seen + self.delay_s + self.hold_ms / 1000 + 1.0 - _now()))
        self.pc.etcd_proxy_control(self.leader).set_delay(0, 0)

    def react_timeout(self) -> float:
        return self.delay_s + self.hold_ms / 1000 + 2.0 if self.seen else 0.0

    def _lift(self) -> None:
        if self.leader:
            self.pc.etcd_proxy_control(self.leader).set_delay(0, 0)
            self.pc.arm(self.leader, "")
        for p in self._paused:
            p._heal()
        self._paused = []


def stale_leader_write(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    return [StaleLeaderWrite(pc, pc.etcd_proxy_azs[0], **kw)]


class DecisionOverwrite(PlantedBugFault):
    """PLANTED BUG ``twophase.decision_overwrite`` (the two-phase decision is
    a plain Put, not create-if-absent).

    Every coordinator (each reaches etcd through its own etcd proxy) is
    armed with it and with ``owner.after_prepare=delay(D)``: the first owner
    of a cross-AZ attempt to collect its votes counts them D s later (inside
    its vote timeout, still a valid leader) and sends its COMMIT. Its etcd
    requests are held ``hold_ms`` from just before that, so the COMMIT
    reaches etcd after the participants' prepare timeout: by then an in-doubt
    participant (or the owner AZ's next leader, the owner's lease having run
    out meanwhile) has written ABORT. The held COMMIT then lands on top: one
    (gang, incarnation), two decision writes (invariant 8). The hold is
    ``channel_hold_ms()``, begun ``HOLD_LEAD_S`` before the COMMIT; counted
    from the failpoint line (the votes are in by then), the COMMIT must
    reach etcd past the participants' ``prepare_timeout_s``.
    """

    HOLD_LEAD_S = 0.3  # the hold begins this long before the owner counts its votes

    def __init__(self, pc: PhalanxCluster, delay_s: float = 2.0, hold_ms: int | None = None, **kw: Any) -> None:
        self.delay_s, self.hold_ms = delay_s, self.staged_hold_ms(pc.timings, delay_s, hold_ms)
        self.seen, self.owner = 0.0, ""
        super().__init__(pc, "decision-overwrite", **kw)

    @staticmethod
    def staged_hold_ms(t: Timings, delay_s: float = 2.0, hold_ms: int | None = None) -> int:
        """The hold (``channel_hold_ms()`` unless given), refused (ValueError)
        when the COMMIT would not arrive past ``t``'s prepare timeout."""
        hold = channel_hold_ms() if hold_ms is None else hold_ms
        hold_outlasts("decision-overwrite", hold, delay_s, t.prepare_timeout_s, "prepare_timeout_s of the participants")
        return hold

    def _inject(self) -> None:
        self.seen, self.owner = 0.0, ""
        missing = [cid for cid in self.pc.coordinator_ids() if cid not in self.pc.etcd_proxies]
        if missing:
            raise RuntimeError(f"{self.name}: {', '.join(missing)} have no etcd proxy")
        self._logs = {cid: (self.pc.logs / f"{cid}.log", _log_size(self.pc.logs / f"{cid}.log"))
                      for cid in self.pc.coordinator_ids()}
        self._start_watcher()
        for cid in self.pc.coordinator_ids():
            self.pc.arm(cid, f"twophase.decision_overwrite=on,owner.after_prepare=delay({self.delay_s:g})")

    def _react(self) -> None:
        owner = _wait_for_line(self._logs, "failpoint owner.after_prepare", self._stop)
        if owner is None:
            return
        self.seen, self.owner = _now(), owner
        for cid in self.pc.coordinator_ids():
            self.pc.arm(cid, "twophase.decision_overwrite=on")  # one held decision is enough
        ctl = self.pc.etcd_proxy_control(owner)
        self._stop.wait(max(0.0, self.seen + self.delay_s - self.HOLD_LEAD_S - _now()))
        ctl.set_delay(self.hold_ms, 0)
        self._note(f"owner {owner} counts its votes in {self.delay_s:g}s; its etcd requests held {self.hold_ms} ms")
        self._stop.wait(max(0.0, self.seen + self.delay_s + self.hold_ms / 1000 + 1.0 - _now()))
        ctl.set_delay(0, 0)
        self._stop.wait(2.0)

    def react_timeout(self) -> float:
        return self.delay_s + self.hold_ms / 1000 + 4.0 if self.seen else 0.0

    def _lift(self) -> None:
        for cid in self.pc.coordinator_ids():
            self.pc.arm(cid, "")
            if cid in self.pc.etcd_proxies:
                self.pc.etcd_proxy_control(cid).set_delay(0, 0)


def decision_overwrite(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    return [DecisionOverwrite(pc, **kw)]


def mixed(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    out: list[Fault] = []
    for make in (partition_az, leader_etcd_cut, agents_cut, one_way, leader_pause, coordinator_crash,
                 etcd_member_restart, etcd_quorum_loss, agent_restart):
        out.extend(make(pc, kw))
    return out


def fencing_disabled(pc: PhalanxCluster, kw: dict[str, Any]) -> list[Fault]:
    return agents_cut(pc, kw)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("partition-az", "full partition of one AZ from the others", partition_az, hold=(5.0, 10.0)),
    Scenario("leader-etcd-cut", "an AZ leader cut off from etcd, not from its agents", leader_etcd_cut,
             hold=(3.0, 8.0)),
    Scenario("agents-cut", "an AZ's agents cut off from their coordinators (and so from their token reads)", agents_cut,
             hold=(2.0, 9.0)),
    Scenario("one-way", "one-way loss at the leader's proxy: requests delivered, replies lost (or reverse)",
             one_way, hold=(3.0, 8.0), proxies=True),
    Scenario("leader-pause", "SIGSTOP of an AZ leader for 1.5-4x its lease TTL, then SIGCONT", leader_pause,
             hold=(3.0, 8.0)),
    Scenario("coordinator-crash", "the AZ leader SIGKILLs itself at failpoint leader.after_reserve", coordinator_crash,
             hold=(6.0, 9.0)),
    Scenario("etcd-member-restart", "SIGKILL of one etcd member, restarted after the hold", etcd_member_restart,
             hold=(2.0, 6.0)),
    Scenario("etcd-quorum-loss", "SIGKILL of two of three etcd members, restarted after the hold",
             etcd_quorum_loss, hold=(3.0, 7.0)),
    Scenario("agent-restart", "SIGKILL and immediate restart of an AZ's agent process (members adopted)",
             agent_restart, hold=(1.0, 2.0), max_steps=2, gap=(3.0, 6.0)),
    Scenario("agent-down", "SIGKILL of an AZ's agent process, restarted only after 6-9 s (past re-placement)",
             agent_down, hold=(6.0, 9.0)),
    Scenario("etcd-slow-replies", "etcd replies to an AZ leader delayed past its request timeout, in bursts",
             etcd_slow_replies, hold=(0.6, 0.9), gap=(0.4, 1.2), max_steps=30, etcd_proxies=("a",), duration=25.0,
             rate=1.5),
    Scenario("reserve-reply-lost", "the reply to one reservation txn of AZ a's leader is lost; the txn commits",
             reserve_reply_lost, hold=(6.0, 6.0), gap=(3.0, 3.0), etcd_proxies=("a",), rate=1.5),
    Scenario("mixed", "three faults of any kind, one at a time, chosen by the seed", mixed, hold=(2.0, 8.0),
             gap=(2.0, 4.0), max_steps=3, proxies=True, duration=35.0),
    Scenario("fencing-disabled", "PLANTED BUG: agents-cut past re-placement with agent.no_fencing=on",
             fencing_disabled, hold=(9.0, 10.0), gap=(5.0, 6.0), agent_failpoints="agent.no_fencing=on",
             expect_violations=True),
    Scenario("stale-epoch-accepted", "PLANTED BUG: a slow token check passes an epoch etcd has moved past "
             "(agent.ignore_stale_epoch=on)", stale_epoch_start, hold=(14.0, 14.0), gap=(4.0, 4.0),
             expect_violations=True),
    Scenario("fence-compare-skipped", "PLANTED BUG: a deposed leader's reservation txn commits without its fence "
             "compare (leader.skip_fence_compare=on)", stale_leader_write, hold=(10.0, 10.0), gap=(4.0, 4.0),
             etcd_proxies=("a",), expect_violations=True),
    Scenario("decision-overwrite", "PLANTED BUG: an owner's COMMIT, held on its way to etcd, lands over the ABORT "
             "taken meanwhile (twophase.decision_overwrite=on)", decision_overwrite, hold=(18.0, 18.0),
             gap=(4.0, 4.0), etcd_proxies=("a", "b", "c"), duration=25.0, expect_violations=True),
)}

# `--all`: every scenario that must hold (the planted bug is run on purpose only).
MATRIX: tuple[str, ...] = tuple(n for n, s in SCENARIOS.items() if not s.expect_violations)


def scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None


def schedule_seed(name: str, seed: int) -> int:
    """The schedule's seed: the run seed mixed with the scenario name, so seed 1
    of one scenario does not strike at the same moments as seed 1 of another."""
    return zlib.crc32(f"{name}/{seed}".encode())
