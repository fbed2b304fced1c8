"""The recorded history of one chaos run, parsed once into frozen records.

Sources (all stamped with ``time.monotonic()``: every namespace on the machine
shares one monotonic clock, so stamps from different processes compare):

| source | file | written by |
|---|---|---|
| faults and process starts/kills | ``events.jsonl`` | the runner (:mod:`chaos.run`) |
| client calls and outcomes | ``workload.jsonl``, ``probe.jsonl`` | :mod:`chaos.workload` in the ``client`` host |
| agent effects | ``agents-<az>.jsonl`` | ``python -m agent.sim --history`` |
| every etcd put/delete, in revision order | ``etcd.jsonl`` | :mod:`chaos.recorder` in the ``ctl`` host |
| final etcd state | ``final.json`` | ``chaos.recorder dump`` after settling |
| run parameters | ``run.json`` | the runner |

:func:`load` reads a run directory; everything else here is PURE (functions
over records), so the checker can be unit-tested with hand-made histories:
:func:`member_intervals`, :func:`leader_terms`, :func:`gang_observations`,
:func:`reservation_observations`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INF = math.inf
_MEMBER_KEY = re.compile(r"^(?P<gang>.+)#(?P<inc>\d+)/r(?P<rank>\d+)$")

# Gang states in which a gang owns a committed reservation (phalanx.model).
HOLDING = frozenset({"RESERVED", "STARTING", "RUNNING"})
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


# ---------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class FaultRecord:
    """A fault injected or healed (``chaos.faults.FaultEvent``)."""

    mono: float
    name: str
    action: str  # inject | heal | note
    detail: str = ""


@dataclass(frozen=True)
class ProcessEvent:
    """The runner started, killed or restarted a cluster process."""

    mono: float
    action: str  # started | killed | exited
    name: str  # e.g. coord-a1, agents-a, etcd-b
    role: str  # coordinator | agents | etcd | recorder | workload
    az: str = ""
    detail: str = ""


@dataclass(frozen=True)
class ClientCall:
    """One RPC attempt by the workload (or the post-heal probe)."""

    op: str  # submit | submit_cross_az | cancel | get
    key: str  # idempotency key (submit) or gang id (cancel/get)
    name: str
    az: str
    target: str
    attempt: int
    start: float
    end: float
    code: str  # OK or a grpc status code name
    gang_id: str = ""
    state: str = ""
    detail: str = ""
    probe: bool = False
    aim: str = ""  # a cancel's aim: admission | restart | late (chaos.workload.CANCEL_AIMS)
    trigger: str = ""  # a restart-aimed cancel's trigger: incarnation | fault | terminal | timeout


@dataclass(frozen=True)
class ClientOutcome:
    """The end of one logical client operation, after its retries."""

    op: str
    key: str
    name: str
    az: str
    acked: bool
    gang_id: str
    first_start: float
    end: float
    code: str
    attempts: int
    probe: bool = False
    detail: str = ""
    aim: str = ""
    trigger: str = ""


@dataclass(frozen=True)
class AgentEvent:
    """One line of an agent's ``--history`` file."""

    event: str
    node: str
    az: str
    mono: float
    epoch: int = 0
    key: str = ""
    gpus: tuple[int, ...] = ()
    code: int | None = None
    phase: str = ""
    detail: str = ""
    # For an exit the agent learnt of late (the member ended while the agent
    # was down): when it learnt of it; ``mono`` is then the shim's recorded end.
    reported_mono: float | None = None


@dataclass(frozen=True)
class EtcdEvent:
    """One put/delete under the cluster prefix, in revision order."""

    kind: str  # put | delete | gap
    key: str  # relative to /phalanx/<cluster>/
    rev: int
    mono: float  # when the recorder saw it (never before it happened)
    create_rev: int = 0
    lease: int = 0
    value: Any = None


@dataclass(frozen=True)
class FinalState:
    """The consistent etcd range read taken after settling."""

    revision: int
    mono: float
    kvs: Mapping[str, Any]  # relative key -> parsed value
    create_revs: Mapping[str, int] = field(default_factory=dict)
    wall: float = 0.0  # wall clock of the read (gang records carry wall-clock times)

    def prefix(self, p: str) -> dict[str, Any]:
        return {k[len(p):]: v for k, v in self.kvs.items() if k.startswith(p)}

    @property
    def gangs(self) -> dict[str, Mapping[str, Any]]:
        return self.prefix("gangs/")

    @property
    def reservations(self) -> dict[tuple[str, str], Mapping[str, Any]]:
        out = {}
        for k, v in self.prefix("reservations/").items():
            az, _, gang = k.partition("/")
            out[(az, gang)] = v
        return out

    @property
    def leaders(self) -> dict[str, Mapping[str, Any]]:
        return self.prefix("leader/")


@dataclass(frozen=True)
class RunParams:
    """What the checker needs to know about the run besides the records.

    ``token_window_s``: the longest a member start may trail the agent's
    token read (docs/design.md §9.3: one linearizable read "just before" starting; the
    gap is process spawn + state-file fsync). ``release_tolerance_s``: slack
    for a member exit recorded after its reservation was seen deleted
    (scheduling jitter on a loaded machine). ``recovery_bound_s``: the stated
    liveness bound of invariant 7, from the timings (see :func:`recovery_bound`).
    """

    azs: tuple[str, ...]
    started_at: float
    settle_at: float  # mono of the final dump: "settle time"
    healed_at: float | None  # mono of the last heal; None when no fault ran
    timings: Mapping[str, float] = field(default_factory=dict)
    token_window_s: float = 2.0
    release_tolerance_s: float = 1.0
    recovery_bound_s: float = 20.0
    scenario: str = ""
    seed: int = 0
    settled: bool = True  # False when settling timed out
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class History:
    params: RunParams
    faults: tuple[FaultRecord, ...] = ()
    processes: tuple[ProcessEvent, ...] = ()
    calls: tuple[ClientCall, ...] = ()
    outcomes: tuple[ClientOutcome, ...] = ()
    agents: tuple[AgentEvent, ...] = ()
    etcd: tuple[EtcdEvent, ...] = ()
    final: FinalState | None = None


def recovery_bound(timings: Mapping[str, float], slack_s: float = 10.0) -> float:
    """Invariant 7's bound after the last heal: 3 x lease TTL + fence_after_s + slack.

    Why: after a heal the old leader's lease may live one more TTL, and etcd
    restarts every lease TTL when it elects a new etcd leader (a second TTL);
    a third covers campaign, rebuild and agents re-registering. Agents whose
    members were fenced report them stopped within fence_after_s. ``slack_s``
    is for a loaded 2-core machine (python start-up of restarted processes,
    member spawn); it is a liveness deadline, not a performance claim.
    """
    return 3 * float(timings.get("lease_ttl_s", 5)) + float(timings.get("fence_after_s", 12)) + slack_s


# ---------------------------------------------------------------------------
# Parsing (pure: dicts in, records out)


def parse_member_key(key: str) -> tuple[str, int, int] | None:
    """``"gang#2/r1"`` -> ``("gang", 2, 1)``."""
    m = _MEMBER_KEY.match(key)
    if not m:
        return None
    return m.group("gang"), int(m.group("inc")), int(m.group("rank"))


def agent_event(d: Mapping[str, Any]) -> AgentEvent:
    code = d.get("code")
    return AgentEvent(
        event=str(d.get("event", "")),
        node=str(d.get("node", "")),
        az=str(d.get("az", "")),
        mono=float(d.get("mono", 0.0)),
        epoch=int(d.get("epoch", 0) or 0),
        key=str(d.get("key", "")),
        gpus=tuple(int(g) for g in d.get("gpus", ()) or ()),
        code=int(code) if code is not None else None,
        phase=str(d.get("phase", "")),
        detail=str(d.get("reason", "") or d.get("leader", "") or ""),
        reported_mono=float(d["reported_mono"]) if d.get("reported_mono") is not None else None,
    )


def etcd_event(d: Mapping[str, Any]) -> EtcdEvent:
    return EtcdEvent(
        kind=str(d["kind"]),
        key=str(d.get("key", "")),
        rev=int(d.get("rev", 0)),
        mono=float(d.get("mono", 0.0)),
        create_rev=int(d.get("create_rev", 0) or 0),
        lease=int(d.get("lease", 0) or 0),
        value=d.get("value"),
    )


def client_record(d: Mapping[str, Any]) -> ClientCall | ClientOutcome | None:
    kind = d.get("kind")
    common = dict(op=str(d.get("op", "")), key=str(d.get("key", "")), name=str(d.get("name", "")),
                  az=str(d.get("az", "")), probe=bool(d.get("probe", False)), aim=str(d.get("aim", "")),
                  trigger=str(d.get("trigger", "")))
    if kind == "call":
        return ClientCall(
            **common, target=str(d.get("target", "")), attempt=int(d.get("attempt", 0)),
            start=float(d["start"]), end=float(d["end"]), code=str(d.get("code", "")),
            gang_id=str(d.get("gang_id", "")), state=str(d.get("state", "")), detail=str(d.get("detail", "")),
        )
    if kind == "outcome":
        return ClientOutcome(
            **common, acked=bool(d.get("acked")), gang_id=str(d.get("gang_id", "")),
            first_start=float(d.get("first_start", 0.0)), end=float(d.get("end", 0.0)),
            code=str(d.get("code", "")), attempts=int(d.get("attempts", 0)), detail=str(d.get("detail", "")),
        )
    return None


def final_state(d: Mapping[str, Any]) -> FinalState:
    kvs = {kv["key"]: kv.get("value") for kv in d.get("kvs", ())}
    revs = {kv["key"]: int(kv.get("create_rev", 0)) for kv in d.get("kvs", ())}
    return FinalState(revision=int(d.get("revision", 0)), mono=float(d.get("mono", 0.0)), kvs=kvs, create_revs=revs,
                      wall=float(d.get("wall", 0.0)))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """Lines of a JSONL file; a torn last line (writer killed mid-write) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def load(run_dir: Path) -> History:
    """Read every source of one run directory (the only I/O in this module)."""
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "run.json").read_text())
    params = RunParams(
        azs=tuple(meta["azs"]),
        started_at=float(meta["started_at"]),
        settle_at=float(meta["settle_at"]),
        healed_at=meta.get("healed_at"),
        timings=meta.get("timings", {}),
        token_window_s=float(meta.get("token_window_s", 2.0)),
        release_tolerance_s=float(meta.get("release_tolerance_s", 1.0)),
        recovery_bound_s=float(meta.get("recovery_bound_s", 20.0)),
        scenario=str(meta.get("scenario", "")),
        seed=int(meta.get("seed", 0)),
        settled=bool(meta.get("settled", True)),
        notes=tuple(meta.get("notes", ())),
    )
    faults, procs = [], []
    for d in _jsonl(run_dir / "events.jsonl"):
        if d.get("src") == "fault":
            faults.append(FaultRecord(float(d["mono"]), d["name"], d["action"], d.get("detail", "")))
        elif d.get("src") == "note":  # what a fault resolved at run time (its target, ...)
            faults.append(FaultRecord(float(d["mono"]), d["name"], "note", d.get("detail", "")))
        elif d.get("src") == "process":
            procs.append(ProcessEvent(float(d["mono"]), d["action"], d["name"], d.get("role", ""),
                                      d.get("az", ""), d.get("detail", "")))
    calls, outcomes = [], []
    for name in ("workload.jsonl", "probe.jsonl"):
        for d in _jsonl(run_dir / name):
            rec = client_record(d)
            if isinstance(rec, ClientCall):
                calls.append(rec)
            elif isinstance(rec, ClientOutcome):
                outcomes.append(rec)
    agents = [agent_event(d) for p in sorted(run_dir.glob("agents-*.jsonl")) for d in _jsonl(p)]
    etcd = [etcd_event(d) for d in _jsonl(run_dir / "etcd.jsonl") if d.get("src") == "etcd"]
    final = None
    if (run_dir / "final.json").exists():
        final = final_state(json.loads((run_dir / "final.json").read_text()))
    return History(
        params=params,
        faults=tuple(sorted(faults, key=lambda f: f.mono)),
        processes=tuple(sorted(procs, key=lambda p: p.mono)),
        calls=tuple(sorted(calls, key=lambda c: c.start)),
        outcomes=tuple(sorted(outcomes, key=lambda o: o.first_start)),
        agents=tuple(sorted(agents, key=lambda e: e.mono)),
        etcd=tuple(sorted(etcd, key=lambda e: e.rev)),
        final=final,
    )


# ---------------------------------------------------------------------------
# Derived views (pure)


@dataclass(frozen=True)
class MemberInterval:
    """A member's life on one node: from ``member_started`` to ``member_exited``
    (``end`` is INF when no exit was recorded: still running at the end)."""

    gang: str
    incarnation: int
    rank: int
    node: str
    az: str
    gpus: tuple[int, ...]
    epoch: int
    start: float
    end: float = INF
    exit_code: int | None = None
    exit_phase: str = ""

    @property
    def key(self) -> str:
        return f"{self.gang}#{self.incarnation}/r{self.rank}"

    def live_at(self, t: float) -> bool:
        return self.start <= t < self.end

    def overlaps(self, other: "MemberInterval") -> bool:
        return self.start < other.end and other.start < self.end

    def describe(self) -> str:
        end = "still running" if self.end == INF else f"exited {self.end:.3f} ({self.exit_phase or self.exit_code})"
        return (f"{self.key} on {self.node} gpus={list(self.gpus)} epoch={self.epoch} "
                f"started {self.start:.3f}, {end}")


def member_intervals(events: Iterable[AgentEvent]) -> list[MemberInterval]:
    """Pair each ``member_started`` with the next ``member_exited`` of the same
    member on the same node. Exits are recorded by whichever agent process ran
    the member at the time (after a restart, the one that adopted it)."""
    open_: dict[tuple[str, str], MemberInterval] = {}
    done: list[MemberInterval] = []
    for e in sorted(events, key=lambda e: e.mono):
        if e.event not in ("member_started", "member_exited"):
            continue
        parsed = parse_member_key(e.key)
        if parsed is None:
            continue
        k = (e.node, e.key)
        if e.event == "member_started":
            prev = open_.pop(k, None)
            if prev is not None:  # started again without an exit: close at the restart
                done.append(_close(prev, e.mono, None, "restarted"))
            gang, inc, rank = parsed
            open_[k] = MemberInterval(gang, inc, rank, e.node, e.az, e.gpus, e.epoch, e.mono)
        else:
            iv = open_.pop(k, None)
            if iv is not None:
                done.append(_close(iv, e.mono, e.code, e.phase))
    done.extend(open_.values())
    return sorted(done, key=lambda i: (i.start, i.node, i.key))


def _close(iv: MemberInterval, end: float, code: int | None, phase: str) -> MemberInterval:
    return MemberInterval(iv.gang, iv.incarnation, iv.rank, iv.node, iv.az, iv.gpus, iv.epoch, iv.start,
                          end, code, phase)


@dataclass(frozen=True)
class LeaderTerm:
    """One leadership of an AZ: its leader key from creation to deletion.

    ``epoch`` is the key's create_revision (the fencing token). ``start`` and
    ``end`` are when the recorder *saw* the key appear and go: never earlier
    than the real events."""

    az: str
    epoch: int
    coordinator: str
    start_rev: int
    start: float
    end_rev: int | None = None
    end: float = INF


def leader_terms(events: Iterable[EtcdEvent]) -> dict[str, list[LeaderTerm]]:
    """Every leadership per AZ, in order, from the ``leader/<az>`` key history."""
    out: dict[str, list[LeaderTerm]] = {}
    current: dict[str, LeaderTerm] = {}
    for e in sorted(events, key=lambda e: e.rev):
        if not e.key.startswith("leader/"):
            continue
        az = e.key[len("leader/"):]
        cur = current.get(az)
        if e.kind == "put":
            if cur is not None and cur.epoch == e.create_rev:
                continue  # same term (a value update)
            if cur is not None:  # replaced without a delete we saw
                out[az].append(_end_term(cur, e.rev, e.mono))
            value = e.value if isinstance(e.value, Mapping) else {}
            current[az] = LeaderTerm(az, e.create_rev, str(value.get("id", "")), e.rev, e.mono)
            out.setdefault(az, [])
        elif e.kind == "delete" and cur is not None:
            out[az].append(_end_term(cur, e.rev, e.mono))
            del current[az]
    for az, term in current.items():
        out.setdefault(az, []).append(term)
    for terms in out.values():
        terms.sort(key=lambda t: t.start_rev)
    return out


def _end_term(t: LeaderTerm, rev: int, mono: float) -> LeaderTerm:
    return LeaderTerm(t.az, t.epoch, t.coordinator, t.start_rev, t.start, rev, mono)


def leader_at_rev(terms: Iterable[LeaderTerm], rev: int) -> LeaderTerm | None:
    """The term whose key existed at revision ``rev`` (exact, by revisions)."""
    for t in terms:
        if t.start_rev <= rev and (t.end_rev is None or rev < t.end_rev):
            return t
    return None


@dataclass(frozen=True)
class GangObservation:
    """A write of ``gangs/<id>`` as the recorder saw it."""

    gang: str
    rev: int
    mono: float
    state: str
    incarnation: int
    owner_az: str
    members: int
    reason: str = ""
    # The stimulus ids of the gang events first written by this write (the
    # decisions that made it, docs/logging.md "Stimulus ids"), oldest first;
    # () when it wrote no event or its events name none.
    stimuli: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()  # the kinds of those events ("placed", "reserved", ...)


def _new_events(value: Mapping[str, Any], after_seq: int) -> list[Mapping[str, Any]]:
    """The events of a stored gang record with a ``seq`` above ``after_seq``
    (those this write added: seq only counts up, docs/events.md)."""
    evs = value.get("events")
    if not isinstance(evs, list):
        return []
    return [e for e in evs if isinstance(e, Mapping) and int(e.get("seq", 0) or 0) > after_seq
            and e.get("kind") != "dropped"]


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(i for i in items if i))


def gang_observations(events: Iterable[EtcdEvent]) -> dict[str, list[GangObservation]]:
    out: dict[str, list[GangObservation]] = {}
    last_seq: dict[str, int] = {}
    for e in sorted(events, key=lambda e: e.rev):
        if e.kind != "put" or not e.key.startswith("gangs/") or not isinstance(e.value, Mapping):
            continue
        v = e.value
        spec = v.get("spec", {}) if isinstance(v.get("spec"), Mapping) else {}
        gid = e.key[len("gangs/"):]
        fresh = _new_events(v, last_seq.get(gid, 0))
        if fresh:
            last_seq[gid] = max(int(x.get("seq", 0) or 0) for x in fresh)
        out.setdefault(gid, []).append(GangObservation(
            gid, e.rev, e.mono, str(v.get("state", "")), int(v.get("incarnation", 1)),
            str(v.get("owner_az", "")), int(spec.get("members", 0) or 0), str(v.get("reason", "")),
            _unique(str(x.get("stimulus", "")) for x in fresh), _unique(str(x.get("kind", "")) for x in fresh),
        ))
    return out


@dataclass(frozen=True)
class ReservationObservation:
    az: str
    gang: str
    rev: int
    mono: float
    kind: str  # put | delete
    status: str = ""
    incarnation: int = 0
    epoch: int = 0


def reservation_observations(events: Iterable[EtcdEvent]) -> dict[tuple[str, str], list[ReservationObservation]]:
    out: dict[tuple[str, str], list[ReservationObservation]] = {}
    for e in sorted(events, key=lambda e: e.rev):
        if not e.key.startswith("reservations/"):
            continue
        az, _, gang = e.key[len("reservations/"):].partition("/")
        v = e.value if isinstance(e.value, Mapping) else {}
        out.setdefault((az, gang), []).append(ReservationObservation(
            az, gang, e.rev, e.mono, e.kind, str(v.get("status", "")), int(v.get("incarnation", 0) or 0),
            int(v.get("epoch", 0) or 0),
        ))
    return out


# ---------------------------------------------------------------------------
# Traceability (pure): from a violation back to the decisions that wrote it

# "rev 42", "revs 40", "at rev 42": how the checker names the etcd writes a
# violation is about.
_REV_RE = re.compile(r"\brevs? (\d+)")
# "g3#2", "g3#2/r0": a gang incarnation (or one of its members).
_INC_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)#(\d+)")
# "gang g3": a gang without an incarnation.
_GANG_RE = re.compile(r"\bgang ([A-Za-z0-9][A-Za-z0-9._-]*)")


class Tracer:
    """Which stimulus (the coordinator's decision, docs/logging.md) wrote
    what a violation names, from the gang events in the etcd history: each
    event carries the stimulus id of the decision that wrote it, and every
    key written in the same etcd txn (a single-AZ reservation goes with its
    gang record) shares that txn's revision.

    ``lines(texts)``: for each revision named in ``texts`` ("rev 42"), who
    wrote it; for each gang incarnation named ("g3#2", "gang g3") and no
    revision, the decisions that placed and reserved it. Bounded: at most
    ``limit`` lines."""

    ADMISSION = ("placed", "reserved", "submitted")

    def __init__(self, events: Iterable[EtcdEvent]):
        evs = sorted(events, key=lambda e: e.rev)
        self._keys: dict[int, list[str]] = {}
        for e in evs:
            if e.kind in ("put", "delete"):
                self._keys.setdefault(e.rev, []).append(e.key)
        self._by_rev: dict[int, GangObservation] = {}
        # (gang, incarnation) -> [(kind, stimulus, rev)] of its events
        self._by_inc: dict[tuple[str, int], list[tuple[str, str, int]]] = {}
        self._latest: dict[str, int] = {}
        last_seq: dict[str, int] = {}
        for e in evs:
            if e.kind != "put" or not e.key.startswith("gangs/") or not isinstance(e.value, Mapping):
                continue
            gid = e.key[len("gangs/"):]
            self._latest[gid] = int(e.value.get("incarnation", 1) or 1)
            for x in _new_events(e.value, last_seq.get(gid, 0)):
                last_seq[gid] = max(last_seq.get(gid, 0), int(x.get("seq", 0) or 0))
                inc = int(x.get("incarnation", 0) or 0) or self._latest[gid]
                self._by_inc.setdefault((gid, inc), []).append(
                    (str(x.get("kind", "")), str(x.get("stimulus", "")), e.rev))
        for gid, obs in gang_observations(evs).items():
            for o in obs:
                self._by_rev[o.rev] = o

    def at_rev(self, rev: int) -> str:
        keys = self._keys.get(rev, [])
        o = self._by_rev.get(rev)
        written = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "") or "nothing recorded"
        if o is not None and o.stimuli:
            return (f"rev {rev} ({written}) written by stimulus {', '.join(o.stimuli)} "
                    f"(with gang {o.gang}'s {', '.join(o.kinds)} event{'s' * (len(o.kinds) != 1)})")
        return f"rev {rev} ({written}): no stimulus recorded (no gang event was written with it)"

    def admission_of(self, gang: str, inc: int) -> str | None:
        evs = [(k, s, r) for k, s, r in self._by_inc.get((gang, inc), []) if k in self.ADMISSION and s]
        if not evs:
            return None
        return f"{gang}#{inc}: " + "; ".join(f"{k} by stimulus {s} (rev {r})" for k, s, r in evs)

    def lines(self, texts: Iterable[str], limit: int = 4) -> tuple[str, ...]:
        texts = list(texts)
        out: list[str] = []
        revs = _unique(m.group(1) for t in texts for m in _REV_RE.finditer(t))
        for r in revs:
            out.append(self.at_rev(int(r)))
        if not revs:
            incs = _unique(f"{m.group(1)}#{m.group(2)}" for t in texts for m in _INC_RE.finditer(t)
                           if m.group(1) in self._latest)
            named = _unique(m.group(1) for t in texts for m in _GANG_RE.finditer(t) if m.group(1) in self._latest)
            keys = [(k.rpartition("#")[0], int(k.rpartition("#")[2])) for k in incs]
            keys += [(g, self._latest[g]) for g in named if not any(g == k[0] for k in keys)]
            for g, inc in keys:
                line = self.admission_of(g, inc)
                if line is not None:
                    out.append(line)
        if len(out) > limit:
            out = out[:limit] + [f"and {len(out) - limit} more writes"]
        return tuple("traced: " + x for x in out)
