"""The chaos workload: seeded gang submissions (single- and cross-AZ), cancels, every call recorded.

Runs inside the ``client`` host (the root namespace cannot reach the cluster)::

    python -m chaos.workload --targets '{"a": ["10.213.7.5:7070", ...], ...}' \
        --seed 7 --duration 20 --rate 1.0 --out workload.jsonl
    python -m chaos.workload --probe --targets ... --seed 7 --out probe.jsonl

The plan (:func:`plan`) is a pure function of the seed: which AZ, how many
members (1-2) of how many GPUs (1/2/4/8), how long they run (1-4 s), which
gangs are cancelled, when, and what each cancel aims at (:data:`CANCEL_AIMS`):
half of them land in the admission window (0-0.3 s after the ack, while the
gang is placed, reserved and started), a quarter at a restart (0-0.3 s after
the workload sees the gang's incarnation grow, or a fault injected or in
effect: ``--fault-events`` is the runner's ``events.jsonl``; such a gang runs
to the end of the workload with at least one restart, so a fault finds it
running), the rest 0.1-3 s after the ack. About a quarter of the gangs are cross-AZ
(``allow_cross_az: true``, two-phase reservations, docs/two-phase.md), with
shapes from :data:`CROSS_AZ_SHAPES` (2-4 members of 4 or 8 GPUs): an AZ of
the chaos cluster has 2 nodes x 8 GPUs, so 3 x 8 always spans AZs and the
others span when their owner AZ is busy. They are ordinary gangs: accepted,
run, cancelled and restarted like the rest. Every gang is owned by the AZ
whose coordinators receive it.

Each submission carries an idempotency key and is retried, with the same key,
across that AZ's coordinators on UNAVAILABLE, DEADLINE_EXCEEDED or ABORTED
(the coordinator's "raced; retry with the same key") until acknowledged or
``--retry-budget`` seconds have passed. A timed-out attempt may still have
created the gang; the retry then returns the same gang (``created=false``),
never a second one. That is what invariant 4 checks.

Output, one JSON line per event (monotonic stamps, comparable with every
other history source on the machine)::

    {"kind": "call", "op": "submit"|"submit_cross_az"|"cancel", "key", "name",
     "az", "target", "attempt", "start", "end", "code": "OK"|<status>,
     "gang_id", "created", "state", "detail", "probe"}
    {"kind": "outcome", "op", "key", "name", "az", "acked", "gang_id",
     "first_start", "end", "code", "attempts", "probe"}

A cancel's lines also carry ``"aim": "admission"|"restart"|"late"`` and,
for a restart-aimed one, ``"trigger"``: what it waited for, ``"incarnation"``
(the gang seen RESTARTING or past incarnation 1), ``"fault"``, or, when
neither came, ``"terminal"`` (the gang ended first) or ``"timeout"``.

``--probe`` submits one small high-priority gang per AZ (used right after
the last heal: invariant 7, "admission resumes").

Calls go over TLS with the client certificate in ``--tls-dir`` (ca.crt
client.crt client.key; the chaos cluster gives an admin one) and check that
the server is a coordinator of the CA's cluster, whatever address it is
dialled at (``phalanx.tls.coordinator_channel``); plaintext only with
``--insecure``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_fixed

GPU_CHOICES = (1, 2, 4, 8)
# (members, GPUs per member) of cross-AZ gangs. An AZ of the chaos cluster has
# 2 nodes x 8 GPUs (chaos/cluster.py), so 3 x 8 (24 GPUs) always needs two AZs
# and 2 x 8 / 4 x 4 need them whenever part of the owner AZ is busy (the
# steady gang holds 8 of its 16 GPUs for the whole run).
CROSS_AZ_SHAPES = ((2, 8), (3, 8), (3, 8), (4, 4), (2, 4))
RETRY_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED"})
PROBE_PRIORITY = 1000
# What a planned cancel aims at, and the share of the cancelled gangs each
# gets (the rest are "late": 0.1-3 s after the ack, as before).
CANCEL_AIMS = ("admission", "restart", "late")
ADMISSION_SHARE, RESTART_SHARE = 0.5, 0.25
# The admission window: a cancel this soon after the ack races placement,
# the reservation txn, dispatch and the start barrier (issue 26 item 1).
ADMISSION_WINDOW_S = 0.3
# A restart-aimed cancel waits at most this long for its trigger (polling
# the gang every RESTART_POLL_S), then is sent anyway ("timeout"). Its gang
# runs to the end of the workload (plan()), so a fault finds it running.
RESTART_WAIT_S, RESTART_POLL_S = 60.0, 0.2


@dataclass(frozen=True)
class PlannedSubmit:
    """One gang the workload will submit (and maybe cancel)."""

    n: int
    at: float  # seconds after the start
    az: str
    name: str
    key: str
    members: int
    gpus: int
    duration_s: float
    cancel_after: float | None = None  # seconds after the ack (aim "restart": after its trigger)
    cancel_aim: str = ""  # one of CANCEL_AIMS when cancel_after is set
    cross_az: bool = False
    priority: int = 0
    admission_timeout_s: float = 30.0
    max_restarts: int = 0
    start_timeout_s: float = 30.0

    def spec(self) -> dict[str, Any]:
        """The gang spec (docs/design.md §6.1) as plain data."""
        return {
            "name": self.name,
            "members": self.members,
            "priority": self.priority,
            "resources": {"gpus": self.gpus},
            "topology": {"allow_cross_az": self.cross_az},
            # No command: the launcher runs its built-in sleeper for duration_s.
            "run": {"duration_s": self.duration_s},
            "policy": {"admission_timeout_s": self.admission_timeout_s, "max_restarts": self.max_restarts,
                       "start_timeout_s": self.start_timeout_s},
        }


def plan(
    seed: int,
    duration: float,
    rate: float,
    azs: Sequence[str],
    *,
    cancel_fraction: float = 0.3,
    cross_az_fraction: float = 0.25,
    steady_s: float = 0.0,
    prefix: str = "w",
) -> list[PlannedSubmit]:
    """The whole workload, reproducible from ``seed`` (pure).

    Arrivals are a Poisson process of ``rate`` gangs/s over ``duration``
    seconds, spread uniformly over ``azs``; a third of them may restart once
    (``max_restarts``), so a failed incarnation is followed by a new one. With
    ``steady_s`` each AZ also gets, first thing, one 2 x 4-GPU gang that runs
    ``steady_s`` seconds with 2 restarts: a long-running gang is what a fault
    in the middle of the run hits. A ``cross_az_fraction`` of the gangs are
    cross-AZ, shaped by :data:`CROSS_AZ_SHAPES` (drawn from a per-gang stream,
    so the rest of the plan is what it was). A ``cancel_fraction`` of the
    gangs are cancelled; each cancel's aim and delay come from another
    per-gang stream (:func:`cancel_aim`).
    """
    rng = random.Random(f"workload/{seed}")
    out: list[PlannedSubmit] = []
    t = rng.expovariate(rate)
    n = 0
    while t < duration:
        az = azs[rng.randrange(len(azs))]
        members = rng.choice((1, 1, 2))
        gpus = rng.choice(GPU_CHOICES)
        run_s = round(rng.uniform(1.0, 4.0), 2)
        cancel = round(rng.uniform(0.1, 3.0), 2) if rng.random() < cancel_fraction else None
        cross = rng.random() < cross_az_fraction
        restarts = rng.choice((0, 0, 1))
        name = f"{prefix}{seed}-{n:04d}"
        if cross:
            members, gpus = random.Random(f"workload/{seed}/xaz/{n}").choice(CROSS_AZ_SHAPES)
        aim = ""
        if cancel is not None:
            aim, cancel = cancel_aim(seed, n, cancel)
        if aim == "restart":
            # alive, and restartable, when a fault strikes: it runs to the
            # end of the workload unless cancelled at its trigger
            run_s, restarts = round(max(run_s, duration - t), 2), max(restarts, 1)
        out.append(PlannedSubmit(n, round(t, 3), az, name, f"{name}-k", members, gpus, run_s,
                                 cancel, aim, cross, max_restarts=restarts))
        n += 1
        t += rng.expovariate(rate)
    if steady_s > 0:
        for az in azs:
            name = f"{prefix}{seed}-steady-{az}"
            out.append(PlannedSubmit(n, 0.0, az, name, f"{name}-k", 2, 4, steady_s, max_restarts=2))
            n += 1
    return out


def cancel_aim(seed: int, n: int, late_after: float) -> tuple[str, float]:
    """(aim, delay) of gang ``n``'s cancel, from its own stream (pure):
    "admission" with a delay in the admission window, "restart" with a
    delay after its trigger (both 0-0.3 s), else "late" after ``late_after``."""
    rng = random.Random(f"workload/{seed}/cancel/{n}")
    draw = rng.random()
    delay = round(rng.uniform(0.0, ADMISSION_WINDOW_S), 3)
    if draw < ADMISSION_SHARE:
        return "admission", delay
    if draw < ADMISSION_SHARE + RESTART_SHARE:
        return "restart", delay
    return "late", late_after


def probe_plan(seed: int, azs: Sequence[str], tag: str = "") -> list[PlannedSubmit]:
    """One 1-GPU gang per AZ, ahead of any queue (invariant 7's probe)."""
    out = []
    for i, az in enumerate(azs):
        name = f"probe{tag}{seed}-{az}"
        out.append(PlannedSubmit(i, 0.0, az, name, f"{name}-k", 1, 1, 1.0, priority=PROBE_PRIORITY,
                                 admission_timeout_s=300.0))
    return out


# ---------------------------------------------------------------------------
# Driver (I/O): real gRPC from inside the client namespace


class Recorder:
    def __init__(self, out: TextIO, probe: bool) -> None:
        self.out = out
        self.probe = probe

    def write(self, **line: Any) -> None:
        line["probe"] = self.probe
        self.out.write(json.dumps(line, separators=(",", ":")) + "\n")
        self.out.flush()


class FaultWatch:
    """The runner's fault injections and heals, read from its ``events.jsonl``
    as it grows (the workload cannot see faults otherwise); nothing without a
    path."""

    def __init__(self, path: str, poll_s: float = 0.1) -> None:
        self.path = path
        self.poll_s = poll_s
        self.injected: list[float] = []  # monotonic stamps of injections
        self.open: set[str] = set()  # faults injected and not yet healed
        self._pos = 0
        self._partial = ""

    def since(self, t: float) -> bool:
        """A fault was injected after ``t``, or one is in effect now."""
        self.read()
        return bool(self.open) or any(m > t for m in self.injected)

    def read(self) -> None:
        if not self.path:
            return
        try:
            with open(self.path) as f:
                f.seek(self._pos)
                chunk = f.read()
                self._pos = f.tell()
        except FileNotFoundError:
            return
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()  # an unfinished last line waits for the rest
        for line in lines:
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if not isinstance(d, dict) or d.get("src") != "fault":
                continue
            if d.get("action") == "inject":
                self.injected.append(float(d.get("mono", 0.0)))
                self.open.add(str(d.get("name", "")))
            elif d.get("action") == "heal":
                self.open.discard(str(d.get("name", "")))

    async def follow(self) -> None:
        while self.path:
            self.read()
            await asyncio.sleep(self.poll_s)


class Workload:
    def __init__(
        self,
        targets: Mapping[str, Sequence[str]],
        rec: Recorder,
        *,
        tls_dir: str = "",
        attempt_timeout: float = 3.0,
        retry_budget: float = 30.0,
        retry_pause: float = 0.3,
        fault_events: str = "",
    ) -> None:
        import grpc

        from phalanx.v1 import gang_pb2_grpc

        self._grpc = grpc
        self.targets = {az: list(a) for az, a in targets.items()}
        self.rec = rec
        self.attempt_timeout = attempt_timeout
        self.retry_budget = retry_budget
        self.retry_pause = retry_pause
        self.faults = FaultWatch(fault_events)
        # Short reconnect backoff: after a healed partition the client should
        # find the coordinator again within a second, not after grpc's default
        # exponential backoff (up to 120 s), which would look like an outage.
        opts = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.min_reconnect_backoff_ms", 200)]
        if tls_dir:
            from phalanx.client import client_tls
            from phalanx.tls import coordinator_channel

            files, cluster = client_tls(tls_dir)
            self.channels = {a: coordinator_channel(a, files, cluster=cluster, options=opts)
                             for addrs in self.targets.values() for a in addrs}
        else:
            self.channels = {a: grpc.aio.insecure_channel(a, options=opts) for addrs in self.targets.values() for a in addrs}
        self.stubs = {a: gang_pb2_grpc.GangServiceStub(ch) for a, ch in self.channels.items()}

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()

    async def _retrying(self, op: str, p: PlannedSubmit, key: str, call: Any,
                        extra: Mapping[str, str] | None = None) -> tuple[bool, str, Any, int, float]:
        """Run ``call(stub)`` across the AZ's coordinators until OK or a final error."""
        grpc = self._grpc
        addrs = self.targets[p.az]
        first = time.monotonic()
        attempt = 0
        # Each attempt goes to the AZ's next coordinator; a retryable failure
        # is retried until retry_budget seconds after the first attempt.
        retrying = AsyncRetrying(
            stop=stop_after_delay(self.retry_budget), wait=wait_fixed(self.retry_pause), reraise=True,
            retry=retry_if_exception(lambda e: isinstance(e, grpc.aio.AioRpcError) and e.code().name in RETRY_CODES))
        try:
            async for tries in retrying:
                with tries:
                    addr = addrs[(p.n + attempt) % len(addrs)]
                    attempt += 1
                    t0 = time.monotonic()
                    try:
                        resp = await call(self.stubs[addr])
                    except grpc.aio.AioRpcError as exc:
                        self.rec.write(kind="call", op=op, key=key, name=p.name, az=p.az, target=addr,
                                       attempt=attempt, start=t0, end=time.monotonic(), code=exc.code().name,
                                       detail=(exc.details() or "")[:300], **(extra or {}))
                        raise
        except grpc.aio.AioRpcError as exc:
            return False, exc.code().name, exc, attempt, first
        return True, "OK", (resp, addr, t0), attempt, first

    async def submit(self, p: PlannedSubmit) -> str:
        """Submit until acknowledged (or given up); returns the gang id or ""."""
        from phalanx.spec import parse_spec
        from phalanx.v1 import gang_pb2
        from phalanx import wire

        req = gang_pb2.SubmitGangRequest(spec=wire.spec_to_pb(parse_spec(p.spec())), idempotency_key=p.key)
        op = "submit_cross_az" if p.cross_az else "submit"
        ok, code, res, attempts, first = await self._retrying(
            op, p, p.key, lambda stub: stub.SubmitGang(req, timeout=self.attempt_timeout))
        gang_id = ""
        if ok:
            resp, addr, t0 = res
            gang_id = resp.gang.id
            self.rec.write(kind="call", op=op, key=p.key, name=p.name, az=p.az, target=addr, attempt=attempts,
                           start=t0, end=time.monotonic(), code="OK", gang_id=gang_id, created=resp.created,
                           state=resp.gang.state)
        self.rec.write(kind="outcome", op=op, key=p.key, name=p.name, az=p.az, acked=ok, gang_id=gang_id,
                       first_start=first, end=time.monotonic(), code=code, attempts=attempts)
        return gang_id

    async def cancel(self, p: PlannedSubmit, gang_id: str, trigger: str = "") -> None:
        from phalanx.v1 import gang_pb2

        aim = {"aim": p.cancel_aim, **({"trigger": trigger} if trigger else {})}
        req = gang_pb2.CancelGangRequest(id=gang_id, reason=f"chaos workload cancel ({p.cancel_aim})")
        ok, code, res, attempts, first = await self._retrying(
            "cancel", p, gang_id, lambda stub: stub.CancelGang(req, timeout=self.attempt_timeout), aim)
        if ok:
            resp, addr, t0 = res
            self.rec.write(kind="call", op="cancel", key=gang_id, name=p.name, az=p.az, target=addr,
                           attempt=attempts, start=t0, end=time.monotonic(), code="OK", gang_id=gang_id,
                           state=resp.state, **aim)
        self.rec.write(kind="outcome", op="cancel", key=gang_id, name=p.name, az=p.az, acked=ok, gang_id=gang_id,
                       first_start=first, end=time.monotonic(), code=code, attempts=attempts, **aim)

    async def restart_trigger(self, p: PlannedSubmit, gang_id: str, since: float) -> str:
        """Wait for what a restart-aimed cancel aims at: the gang seen
        RESTARTING or past incarnation 1 (GetGang, every RESTART_POLL_S, at
        the AZ's coordinators in turn), or a fault injected after ``since``
        or still in effect. Returns the trigger; "terminal" when the gang
        ended first, "timeout" after RESTART_WAIT_S."""
        from phalanx.v1 import gang_pb2, types_pb2

        grpc = self._grpc
        addrs = self.targets[p.az]
        req = gang_pb2.GetGangRequest(id=gang_id)
        polls = 0
        while time.monotonic() < since + RESTART_WAIT_S:
            if self.faults.since(since):
                return "fault"
            stub = self.stubs[addrs[(p.n + polls) % len(addrs)]]
            polls += 1
            try:
                g = await stub.GetGang(req, timeout=self.attempt_timeout)
            except grpc.aio.AioRpcError:
                g = None
            if g is not None:
                state = types_pb2.GangState.Name(g.state).removeprefix("GANG_STATE_")
                if state == "RESTARTING" or g.incarnation > 1:
                    return "incarnation"
                if state in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    return "terminal"
            await asyncio.sleep(RESTART_POLL_S)
        return "timeout"

    async def one(self, p: PlannedSubmit, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + p.at - time.monotonic()))
        gang_id = await self.submit(p)
        if gang_id and p.cancel_after is not None:
            trigger = ""
            if p.cancel_aim == "restart":
                trigger = await self.restart_trigger(p, gang_id, time.monotonic())
            await asyncio.sleep(p.cancel_after)
            await self.cancel(p, gang_id, trigger)

    async def run(self, planned: Sequence[PlannedSubmit], stop: asyncio.Event) -> None:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(self.one(p, t0)) for p in planned]
        watch = asyncio.create_task(self.faults.follow())
        done = asyncio.gather(*tasks, return_exceptions=True)
        halt = asyncio.create_task(stop.wait())
        await asyncio.wait({done, halt}, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        halt.cancel()
        watch.cancel()
        await asyncio.gather(done, halt, watch, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos.workload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", required=True, help='JSON: {"az": ["ip:port", ...], ...}')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=1.0, help="gangs per second, all AZs together")
    p.add_argument("--cancel-fraction", type=float, default=0.3,
                   help="share of gangs cancelled (aims: half admission, a quarter restart, the rest late)")
    p.add_argument("--fault-events", default="", metavar="PATH",
                   help="the runner's events.jsonl: restart-aimed cancels also fire at a fault's injection")
    p.add_argument("--cross-az-fraction", type=float, default=0.25,
                   help="share of gangs submitted with allow_cross_az (two-phase reservations)")
    p.add_argument("--steady", type=float, default=0.0, help="seconds: one long 2x4-GPU gang per AZ at the start")
    p.add_argument("--attempt-timeout", type=float, default=3.0)
    p.add_argument("--retry-budget", type=float, default=30.0)
    p.add_argument("--probe", action="store_true", help="one high-priority gang per AZ (post-heal probe)")
    p.add_argument("--tag", default="", help="probe/trigger: distinguishes several of one run")
    p.add_argument("--trigger", default="", metavar="AZ",
                   help="submit one high-priority 1-GPU gang to AZ (a fault's trigger; not a probe)")
    p.add_argument("--out", required=True)
    p.add_argument("--tls-dir", default="", help="client certificate dir: ca.crt client.crt client.key")
    p.add_argument("--insecure", action="store_true", help="call the coordinators in plaintext")
    a = p.parse_args(argv)
    if not a.tls_dir and not a.insecure:
        p.error("--tls-dir: required (pass --insecure to call in plaintext)")
    targets = json.loads(a.targets)
    azs = sorted(targets)
    if a.trigger:
        planned = [dataclasses.replace(p, name=p.name.replace("probe", "trigger"), key=p.key.replace("probe", "trigger"))
                   for p in probe_plan(a.seed, [a.trigger], a.tag)]
    elif a.probe:
        planned = probe_plan(a.seed, azs, a.tag)
    else:
        planned = plan(a.seed, a.duration, a.rate, azs, cancel_fraction=a.cancel_fraction,
                       cross_az_fraction=a.cross_az_fraction, steady_s=a.steady)

    async def amain() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        with open(a.out, "a", buffering=1) as out:
            w = Workload(targets, Recorder(out, a.probe), attempt_timeout=a.attempt_timeout,
                         retry_budget=a.retry_budget, tls_dir=a.tls_dir, fault_events=a.fault_events)
            try:
                print(f"PHALANX_WORKLOAD_STARTED planned={len(planned)}", flush=True)
                await w.run(planned, stop)
            finally:
                await w.close()

    asyncio.run(amain())
    return 0


if __name__ == "__main__":
    sys.exit(main())
