"""Faults as objects: ``inject()``, ``heal()``, a name, health checks before and after.

Every fault acts only inside the chaos cluster: iptables rules in the
*namespaces* of the hosts involved (never the root namespace), commands to a
:mod:`chaos.proxy`, or signals to process groups that the cluster started.

Each ``inject``/``heal`` is recorded as a :class:`FaultEvent` through the
``record`` callback (pass ``some_list.append`` to collect a history), so the
checker can line faults up with what the system did. The recorded window is
conservative: "inject" is stamped *before* the fault takes effect and "heal"
*after* it is fully lifted.

Health checks (``before``/``after``) are callables returning true when the
system is healthy. ``inject`` first waits (up to ``settle_timeout``) for all
``before`` checks, so a fault never lands on a system that is still broken
from the last one; ``heal`` waits for all ``after`` checks, so recovery is
proven, not assumed. Either raises :class:`HealthCheckFailed` when a check
does not pass in time.
"""

from __future__ import annotations

import abc
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tenacity import RetryError, Retrying, retry_if_exception, retry_if_result, stop_after_delay, wait_fixed

from chaos.netns import ChaosEnvironmentError, Host, NetnsError
from chaos.proxy import Direction, LossAction, ProxyControl

Action = Literal["inject", "heal"]
HealthCheck = Callable[[], bool]
ProcRef = subprocess.Popen[Any] | Callable[[], "subprocess.Popen[Any] | None"]


@dataclass(frozen=True)
class FaultEvent:
    """One entry of the fault history."""

    ts: float  # time.monotonic() of this process
    name: str
    action: Action
    detail: str = ""


Recorder = Callable[[FaultEvent], None]


class HealthCheckFailed(RuntimeError):
    """A health check did not pass before injecting, or after healing, in time."""


class Fault(abc.ABC):
    """Base class: subclasses implement ``_inject`` and ``_heal``.

    ``hold`` is the fault's own preferred duration (used by :func:`schedule`);
    None lets the schedule pick one.
    """

    def __init__(
        self,
        name: str,
        *,
        before: Sequence[HealthCheck] = (),
        after: Sequence[HealthCheck] = (),
        record: Recorder | None = None,
        settle_timeout: float = 30.0,
        hold: float | None = None,
    ) -> None:
        self.name = name
        self.before = list(before)
        self.after = list(after)
        self.record = record
        self.settle_timeout = settle_timeout
        self.hold = hold
        self.active = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}{' active' if self.active else ''}>"

    def inject(self) -> None:
        """Check health, then break things. Raises if already active."""
        if self.active:
            raise RuntimeError(f"fault {self.name} is already injected")
        self._wait_for(self.before, "before inject")
        self._emit("inject")
        try:
            self._inject()
        except BaseException:
            # Undo whatever part was applied; a half-injected fault must not
            # outlive the error that interrupted it.
            try:
                self._heal()
            finally:
                self._emit("heal", "rolled back after a failed inject")
            raise
        self.active = True

    def heal(self) -> None:
        """Lift the fault, then wait for health. A no-op when not active."""
        if not self.active:
            return
        self._heal()
        self.active = False
        self._emit("heal")
        self._wait_for(self.after, "after heal")

    @abc.abstractmethod
    def _inject(self) -> None: ...

    @abc.abstractmethod
    def _heal(self) -> None: ...

    def _emit(self, action: Action, detail: str = "") -> None:
        if self.record is not None:
            self.record(FaultEvent(time.monotonic(), self.name, action, detail))

    def _wait_for(self, checks: Sequence[HealthCheck], when: str) -> None:
        """Poll each check every 0.1 s until it passes; all of them share one
        ``settle_timeout``. A check that raises is a failing check, except when
        the machine cannot run it at all (a missing program): that is said at once."""
        deadline = time.monotonic() + self.settle_timeout
        for check in checks:
            retrying = Retrying(
                stop=stop_after_delay(max(0.0, deadline - time.monotonic())),
                wait=wait_fixed(0.1),
                retry=retry_if_result(lambda ok: not ok) | retry_if_exception(
                    lambda e: isinstance(e, Exception) and not isinstance(e, ChaosEnvironmentError)),
                sleep=time.sleep,
            )
            try:
                retrying(check)
            except RetryError as err:
                exc = err.last_attempt.exception()
                last = f"raised {type(exc).__name__}: {exc}" if exc is not None else "returned false"
                label = getattr(check, "__name__", repr(check))
                raise HealthCheckFailed(
                    f"{self.name}: health check {label} {last} {when} (waited {self.settle_timeout}s)"
                ) from None


# ---------------------------------------------------------------------------
# Network faults: iptables inside the hosts' namespaces


Rule = tuple[Host, tuple[str, ...]]


class _IptablesFault(Fault):
    """Adds DROP rules with ``-A`` and removes exactly those with ``-D``.

    ``-D`` of an identical spec removes one copy, so two overlapping faults
    each keep their own rules and can heal in any order.
    """

    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(name, **kw)
        self._applied: list[Rule] = []

    @abc.abstractmethod
    def rules(self) -> list[Rule]:
        """The (host, rule spec) pairs this fault adds."""

    def _inject(self) -> None:
        for host, spec in self.rules():
            host.iptables("-A", *spec)
            self._applied.append((host, spec))

    def _heal(self) -> None:
        errors: list[str] = []
        while self._applied:
            host, spec = self._applied.pop()
            try:
                host.iptables("-D", *spec)
            except NetnsError as e:
                # The namespace (and the rule with it) is already gone after a
                # teardown; anything else is a real failure.
                if os.path.exists(f"/run/netns/{host.netns}"):
                    errors.append(str(e))
        if errors:
            raise NetnsError(f"{self.name}: could not remove rules: {'; '.join(errors)}")


def _names(hosts: Sequence[Host]) -> str:
    return ",".join(h.name for h in hosts)


def _disjoint(a: Sequence[Host], b: Sequence[Host]) -> None:
    both = {h.name for h in a} & {h.name for h in b}
    if both:
        raise ValueError(f"hosts on both sides of a fault: {sorted(both)}")
    if not a or not b:
        raise ValueError("a network fault needs hosts on both sides")


class Partition(_IptablesFault):
    """No packet between any host of ``group_a`` and any of ``group_b``, either way.

    Rules on both sides (INPUT and OUTPUT), so each side is cut off even if the
    other side's rules were lifted first.
    """

    def __init__(self, group_a: Sequence[Host], group_b: Sequence[Host], name: str | None = None, **kw: Any) -> None:
        _disjoint(group_a, group_b)
        self.group_a, self.group_b = list(group_a), list(group_b)
        super().__init__(name or f"partition({_names(group_a)}|{_names(group_b)})", **kw)

    def rules(self) -> list[Rule]:
        out: list[Rule] = []
        for side, other in ((self.group_a, self.group_b), (self.group_b, self.group_a)):
            for h in side:
                for o in other:
                    out.append((h, ("INPUT", "-s", o.ip, "-j", "DROP")))
                    out.append((h, ("OUTPUT", "-d", o.ip, "-j", "DROP")))
        return out


class Isolate(Partition):
    """``host`` cut off from each of ``from_hosts`` (typically: everyone else)."""

    def __init__(self, host: Host, from_hosts: Sequence[Host], name: str | None = None, **kw: Any) -> None:
        others = [h for h in from_hosts if h.name != host.name]
        super().__init__([host], others, name=name or f"isolate({host.name})", **kw)


class OneWayDrop(_IptablesFault):
    """Packets from ``src_hosts`` to ``dst_hosts`` are dropped (OUTPUT on the sources).

    This is one-way at the IP level only. TCP breaks *both* ways: a connection
    from src to dst never gets its SYN through, and one from dst to src never
    gets src's SYN-ACK (or, if established, its ACKs and replies) back, so both
    sides see timeouts. Use :class:`ProxyOneWay` for "request delivered, reply
    lost". UDP through this fault is truly one-way.
    """

    def __init__(self, src_hosts: Sequence[Host], dst_hosts: Sequence[Host], name: str | None = None, **kw: Any) -> None:
        _disjoint(src_hosts, dst_hosts)
        self.src_hosts, self.dst_hosts = list(src_hosts), list(dst_hosts)
        super().__init__(name or f"oneway({_names(src_hosts)}->{_names(dst_hosts)})", **kw)

    def rules(self) -> list[Rule]:
        return [(s, ("OUTPUT", "-d", d.ip, "-j", "DROP")) for s in self.src_hosts for d in self.dst_hosts]


# ---------------------------------------------------------------------------
# Proxy faults


class ProxyOneWay(Fault):
    """The truly one-way fault: bytes in ``direction`` are read and discarded.

    With ``direction="s2c"`` requests reach the server and every reply is lost
    while the connection stays open. On heal the proxy passes traffic again
    and, if ``reset_on_heal``, aborts the open connections: their byte streams
    now have holes (what was dropped is gone), which HTTP/2 or gRPC framing
    cannot resynchronise from; a real network would have killed them by
    keepalive timeout, so the clients reconnect cleanly either way.
    """

    def __init__(self, control: ProxyControl, direction: Direction, name: str | None = None,
                 reset_on_heal: bool = True, **kw: Any) -> None:
        self.control, self.direction, self.reset_on_heal = control, direction, reset_on_heal
        super().__init__(name or f"proxy-drop-{direction}({control.address})", **kw)

    def _inject(self) -> None:
        self.control.set_mode(f"drop_{self.direction}")  # type: ignore[arg-type]

    def _heal(self) -> None:
        self.control.set_mode("pass")
        if self.reset_on_heal:
            self.control.reset()


class ProxyDelay(Fault):
    """Adds latency per direction in the proxy (this kernel has no netem)."""

    def __init__(self, control: ProxyControl, c2s_ms: float, s2c_ms: float, name: str | None = None, **kw: Any) -> None:
        self.control, self.c2s_ms, self.s2c_ms = control, c2s_ms, s2c_ms
        super().__init__(name or f"proxy-delay-{c2s_ms:g}/{s2c_ms:g}ms({control.address})", **kw)

    def _inject(self) -> None:
        self.control.set_delay(self.c2s_ms, self.s2c_ms)

    def _heal(self) -> None:
        self.control.set_delay(0, 0)


class ProxyLoss(Fault):
    """Random loss in the proxy; see :mod:`chaos.proxy` for ``close`` vs ``drop``."""

    def __init__(self, control: ProxyControl, p: float, action: LossAction = "close", name: str | None = None, **kw: Any) -> None:
        self.control, self.p, self.action = control, p, action
        super().__init__(name or f"proxy-loss-{p:g}-{action}({control.address})", **kw)

    def _inject(self) -> None:
        self.control.set_loss(self.p, self.action)

    def _heal(self) -> None:
        self.control.set_loss(0.0)


# ---------------------------------------------------------------------------
# Process faults: signals to whole process groups


def _resolve(ref: ProcRef) -> subprocess.Popen[Any] | None:
    return ref if isinstance(ref, subprocess.Popen) else ref()


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> bool:
    """Signal ``proc``'s process group; False if it is gone.

    Never signals our own group: a process started without its own session
    shares the caller's group, and killpg would hit the test runner itself.
    Nor a reaped process: its pid may already be someone else's.
    """
    if proc.poll() is not None:
        return False
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return False
    try:
        if pgid == os.getpgrp():
            os.kill(proc.pid, sig)
        else:
            os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


class Pause(Fault):
    """SIGSTOP the process group for ``seconds`` (the schedule's hold), SIGCONT on heal.

    Models a GC pause or a VM freeze: the process keeps its sockets and
    leases in its head, and must find itself fenced when it wakes.
    """

    def __init__(self, process: ProcRef, seconds: float | None = None, name: str = "pause", **kw: Any) -> None:
        self.process = process
        self._paused: subprocess.Popen[Any] | None = None
        super().__init__(name, hold=seconds, **kw)

    def _inject(self) -> None:
        proc = _resolve(self.process)
        if proc is None or not _signal_group(proc, signal.SIGSTOP):
            raise RuntimeError(f"{self.name}: no live process to pause")
        self._paused = proc

    def _heal(self) -> None:
        if self._paused is not None:
            _signal_group(self._paused, signal.SIGCONT)
            self._paused = None


def _kill_and_wait(proc: subprocess.Popen[Any], timeout: float) -> None:
    _signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"pid {proc.pid} still alive {timeout}s after SIGKILL") from None


class Kill(Fault):
    """SIGKILL the process group; on heal, call ``restart`` (if given) to bring it back.

    Without ``restart`` this is a crash-stop that heal cannot undo.
    """

    def __init__(self, process: ProcRef, restart: Callable[[], object] | None = None,
                 name: str = "kill", **kw: Any) -> None:
        self.process, self.restart = process, restart
        self._killed = False
        super().__init__(name, **kw)

    def _inject(self) -> None:
        proc = _resolve(self.process)
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"{self.name}: no live process to kill")
        self._killed = True
        _kill_and_wait(proc, self.settle_timeout)

    def _heal(self) -> None:
        if self._killed and self.restart is not None:
            self.restart()
        self._killed = False


class Restart(Fault):
    """Crash-recovery in one step: SIGKILL the process group, then ``factory()`` at once.

    Heal has nothing to undo; its ``after`` checks prove the restarted process
    rejoined.
    """

    def __init__(self, process: ProcRef, factory: Callable[[], object], name: str = "restart", **kw: Any) -> None:
        self.process, self.factory = process, factory
        super().__init__(name, **kw)

    def _inject(self) -> None:
        proc = _resolve(self.process)
        if proc is not None and proc.poll() is None:
            _kill_and_wait(proc, self.settle_timeout)
        self.factory()

    def _heal(self) -> None:
        pass


# ---------------------------------------------------------------------------
# Schedules


@dataclass(frozen=True)
class Step:
    """Inject ``fault`` at ``at`` seconds from the start, heal it ``hold`` seconds later."""

    at: float
    fault: Fault
    hold: float

    def describe(self) -> dict[str, Any]:
        return {"at": round(self.at, 3), "fault": self.fault.name, "hold": round(self.hold, 3)}


def schedule(
    seed: int,
    faults: Sequence[Fault],
    duration: float,
    *,
    hold: tuple[float, float] = (1.0, 5.0),
    gap: tuple[float, float] = (0.5, 3.0),
) -> list[Step]:
    """A reproducible random fault schedule: same seed and fault list, same steps.

    One fault at a time, each healed before the next (a quiet ``gap`` in
    between), all healed by ``duration``. Overlapping faults are expressed as
    one fault that does both, so every step has a single clear cause in the
    history. A fault's own ``hold`` (e.g. ``Pause(seconds=...)``) wins over the
    random one.
    """
    if not faults:
        return []
    rng = random.Random(seed)
    steps: list[Step] = []
    t = rng.uniform(*gap)
    while True:
        fault = faults[rng.randrange(len(faults))]
        h = fault.hold if fault.hold is not None else rng.uniform(*hold)
        if t + h > duration:
            break
        steps.append(Step(at=t, fault=fault, hold=h))
        t += h + rng.uniform(*gap)
    return steps


def run_schedule(
    steps: Sequence[Step],
    *,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Execute ``steps`` in real time (blocking; use a thread from asyncio code).

    Setting ``stop`` ends it early. Whatever happens, the fault in flight is
    healed before returning.
    """
    stop = stop or threading.Event()
    t0 = clock()
    current: Fault | None = None
    try:
        for step in steps:
            if stop.wait(max(0.0, t0 + step.at - clock())):
                return
            current = step.fault
            current.inject()
            stop.wait(step.hold)
            current.heal()
            current = None
            if stop.is_set():
                return
    finally:
        if current is not None and current.active:
            current.heal()


def heal_all(faults: Sequence[Fault]) -> None:
    """Heal every active fault (for teardown paths); raises the first error at the end."""
    first: BaseException | None = None
    for f in faults:
        try:
            f.heal()
        except BaseException as e:  # keep healing the others
            first = first or e
    if first is not None:
        raise first
