"""The design's invariants (docs/design.md §14), checked on a recorded history. PURE.

Every check is a function of a :class:`chaos.history.History` (records parsed
once) returning how many things it examined and the violations it found,
each with the records that show it. No I/O, no clock: unit tests build small
histories by hand (tests/unit/test_chaos_checker.py).

Timestamps: every source is stamped with the machine's one monotonic clock.
Agent stamps are taken right after the effect (member started / exited);
the etcd recorder's stamps are when it *saw* an event, which is never before
the event happened. Each check uses the recorder's stamps only in the
direction where that lag can hide a violation but never invent one, and says
so. Revision-ordered facts (which leader epoch was current when a
reservation was written) are exact.

| # | invariant | checked from |
|---|---|---|
| 1 | all-or-nothing | gang RUNNING writes vs member starts; live members at settle time |
| 2 | no GPU held twice; no GPU held after etcd released it | member intervals per (node, GPU); reservation deletes |
| 3 | at most one incarnation of a gang running | member intervals per gang |
| 4 | no acknowledged submission lost | client acks vs final etcd state; idempotency keys |
| 5 | nothing stranded | final reservations vs gang states; live members at settle |
| 6 | no effect from a superseded epoch | reservation writes vs leader key (by revision); member starts vs leader terms |
| 7 | a leader and admission resume after healing | leader terms and the post-heal probe gangs, within the stated bound |
| 8 | two-phase decisions are final and agree | ``decisions/`` and two-phase reservation writes, replayed by revision |
| 9 | a finished gang's members stop in time | each gang's first terminal write (recorder) vs its member exits (agents) |

Cross-AZ gangs are ordinary gangs for 1-7: their members run on the agents
of several AZs and every check groups members by (gang, incarnation, rank)
whatever agent reported them; reservations are per (AZ, gang), as the keys.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chaos.history import (
    HOLDING,
    INF,
    TERMINAL,
    EtcdEvent,
    History,
    LeaderTerm,
    MemberInterval,
    gang_observations,
    leader_at_rev,
    leader_terms,
    member_intervals,
    reservation_observations,
)
from chaos.history import Tracer
from coordinator.core.records import DeviceLedger
from phalanx.reservation import Reservation
from phalanx.timings import Timings

INVARIANTS: dict[int, str] = {
    1: "all-or-nothing",
    2: "no GPU held by two live members",
    3: "at most one incarnation running",
    4: "no acknowledged submission lost",
    5: "nothing stranded",
    6: "no effect from a superseded epoch",
    7: "leader and admission resume after healing",
    8: "two-phase decisions are final and agree",
    9: "no member outlives its gang's end",
}

SUBMIT_OPS = frozenset({"submit", "submit_cross_az"})


@dataclass(frozen=True)
class Violation:
    invariant: int
    what: str
    evidence: tuple[str, ...] = ()
    at: float | None = None  # monotonic time it shows at, when there is one

    def render(self, t0: float = 0.0) -> str:
        when = f" (at +{self.at - t0:.2f}s)" if self.at is not None and math.isfinite(self.at) else ""
        lines = [f"[{self.invariant}] {self.what}{when}"]
        lines += [f"      - {e}" for e in self.evidence]
        return "\n".join(lines)


@dataclass(frozen=True)
class InvariantResult:
    number: int
    name: str
    checked: int
    violations: tuple[Violation, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.violations


@dataclass(frozen=True)
class Verdict:
    results: tuple[InvariantResult, ...]
    measurements: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def violations(self) -> list[Violation]:
        return [v for r in self.results for v in r.violations]

    def result(self, number: int) -> InvariantResult:
        return next(r for r in self.results if r.number == number)


Check = tuple[int, list[Violation]]


def _t(h: History, t: float) -> str:
    """A monotonic time as seconds since the run started, for evidence lines."""
    if not math.isfinite(t):
        return "never"
    return f"+{t - h.params.started_at:.3f}s"


def _iv(h: History, iv: MemberInterval) -> str:
    end = "still running" if iv.end == INF else f"exited {_t(h, iv.end)} ({iv.exit_phase or iv.exit_code})"
    return f"{iv.key} on {iv.node} gpus={list(iv.gpus)} epoch={iv.epoch} started {_t(h, iv.start)}, {end}"


def _by_member(ivs: Iterable[MemberInterval]) -> dict[tuple[str, int, int], list[MemberInterval]]:
    out: dict[tuple[str, int, int], list[MemberInterval]] = defaultdict(list)
    for iv in ivs:
        out[(iv.gang, iv.incarnation, iv.rank)].append(iv)
    return out


def _world(final_gang: Mapping[str, Any] | None) -> int:
    if not isinstance(final_gang, Mapping):
        return 0
    spec = final_gang.get("spec")
    return int(spec.get("members", 0)) if isinstance(spec, Mapping) else 0


# ---------------------------------------------------------------------------
# 1. all-or-nothing


def check_all_or_nothing(h: History, ivs: Sequence[MemberInterval]) -> Check:
    """(a) A gang written RUNNING had every rank of that incarnation started
    before the write was *seen* (a member start is recorded before its report
    is sent, the report precedes the write, the write precedes its sighting:
    a missing start cannot be an artefact of lag). (b) At settle time no gang
    has some but not all of its members running. (c) No gang left RUNNING in
    the final state without all its members running at settle time."""
    out: list[Violation] = []
    checked = 0
    members = _by_member(ivs)
    for gid, obs in gang_observations(h.etcd).items():
        seen: set[int] = set()
        for o in obs:
            if o.state != "RUNNING" or o.incarnation in seen:
                continue
            seen.add(o.incarnation)
            checked += 1
            missing = [r for r in range(o.members)
                       if not any(iv.start <= o.mono for iv in members.get((gid, o.incarnation, r), ()))]
            if missing:
                out.append(Violation(1, f"gang {gid} written RUNNING (rev {o.rev}) before ranks {missing} of "
                                        f"incarnation {o.incarnation} had started", (
                    f"RUNNING seen {_t(h, o.mono)}: {o.reason}",
                    *[_iv(h, iv) for r in range(o.members) for iv in members.get((gid, o.incarnation, r), ())],
                ), o.mono))
    t = h.params.settle_at
    final_gangs = h.final.gangs if h.final is not None else {}
    live: dict[tuple[str, int], list[MemberInterval]] = defaultdict(list)
    for iv in ivs:
        if iv.live_at(t):
            live[(iv.gang, iv.incarnation)].append(iv)
    for (gid, inc), ms in sorted(live.items()):
        checked += 1
        world = _world(final_gangs.get(gid)) or max(iv.rank for iv in ms) + 1
        ranks = sorted({iv.rank for iv in ms})
        if len(ranks) < world:
            out.append(Violation(1, f"gang {gid}#{inc} has {len(ranks)} of {world} members running at settle time",
                                 tuple(_iv(h, iv) for iv in ms), t))
    for gid, g in sorted(final_gangs.items()):
        if not isinstance(g, Mapping) or g.get("state") != "RUNNING":
            continue
        checked += 1
        inc = int(g.get("incarnation", 1))
        running = {iv.rank for iv in live.get((gid, inc), ())}
        missing = [r for r in range(_world(g)) if r not in running]
        if missing:
            out.append(Violation(1, f"gang {gid} is RUNNING in the final state but ranks {missing} are not running "
                                    "at settle time",
                                 tuple(_iv(h, iv) for r in range(_world(g)) for iv in members.get((gid, inc, r), ())), t))
    return checked, out


# ---------------------------------------------------------------------------
# 2. no GPU held twice


def check_no_double_booking(h: History, ivs: Sequence[MemberInterval]) -> Check:
    """(a) No (node, GPU) held by two live members at any instant (member
    intervals from the agents' own stamps; an agent records its members'
    GPUs, not their NICs, so NICs are checked in etcd only); (c) no (node,
    GPU) and no (node, NIC) reserved twice in etcd at any revision (see
    _reservation_overlaps). (b) No member holds its GPUs after
    etcd released them: once the reservation of its incarnation is *seen*
    deleted (true deletion is earlier), the member must be gone within
    ``release_tolerance_s``; else the coordinator's ledger hands out GPUs a
    member still uses. This is what a missing self-fence looks like."""
    out: list[Violation] = []
    checked = 0
    per_gpu: dict[tuple[str, int], list[MemberInterval]] = defaultdict(list)
    for iv in ivs:
        for g in iv.gpus:
            per_gpu[(iv.node, g)].append(iv)
    for (node, gpu), lst in sorted(per_gpu.items()):
        lst = sorted(lst, key=lambda i: i.start)
        checked += 1
        for i, a in enumerate(lst):
            for b in lst[i + 1:]:
                if b.start >= a.end:
                    continue
                if a.key != b.key and a.overlaps(b):
                    out.append(Violation(2, f"GPU {gpu} of {node} held by {a.key} and {b.key} at once",
                                         (_iv(h, a), _iv(h, b)), max(a.start, b.start)))
    checked_res, res_overlaps = _reservation_overlaps(h)
    checked += checked_res
    out.extend(res_overlaps)
    tol = h.params.release_tolerance_s
    gap = any(e.kind == "gap" for e in h.etcd)
    res = reservation_observations(h.etcd)
    for iv in ivs:
        checked += 1
        obs = res.get((iv.az, iv.gang), [])
        if not obs:
            if not gap and h.etcd:
                out.append(Violation(2, f"{iv.key} ran on {iv.node} but no reservation of {iv.gang} in {iv.az} "
                                        "was ever written", (_iv(h, iv),), iv.start))
            continue
        releases: list[tuple[float, int]] = []  # (seen at, rev) of each release of this incarnation
        held = False
        for o in obs:
            if o.kind == "put" and o.incarnation == iv.incarnation:
                held = True
            elif held and (o.kind == "delete" or o.incarnation != iv.incarnation):
                releases.append((o.mono, o.rev))
                held = False
        for seen_at, rev in releases:
            if iv.start <= seen_at + tol < iv.end:
                out.append(Violation(2, f"{iv.key} still held GPUs {list(iv.gpus)} of {iv.node} "
                                        f"{'until the end' if iv.end == INF else f'{iv.end - seen_at:.2f}s'} after "
                                        f"its reservation was released (rev {rev})",
                                     (_iv(h, iv), f"reservation {iv.az}/{iv.gang} released at rev {rev}, "
                                                  f"seen {_t(h, seen_at)}"), seen_at))
        if releases and not held and iv.start > releases[-1][0] + tol:
            seen_at, rev = releases[-1]
            out.append(Violation(2, f"{iv.key} started on {iv.node} after its reservation was released (rev {rev})",
                                 (_iv(h, iv), f"reservation {iv.az}/{iv.gang} released, seen {_t(h, seen_at)}"),
                                 iv.start))
    return checked, out


def _reservation_overlaps(h: History) -> Check:
    """(c) etcd never holds two reservations on one GPU or one NIC (NICs are
    exclusive as GPUs are: capacity.free_view subtracts held NICs): replayed
    in revision order (exact), after every reservation write the AZ's
    reservations at that revision go through the coordinator's own ledger
    invariant (``coordinator.core.records.DeviceLedger.conflicts``,
    docs/style.md §12), which counts GPUs, and the same check of NICs; any
    status holds devices, except a two-phase record whose incarnation's
    decision is already ABORT at that revision: the decision key is the
    commit point (docs/two-phase.md), so such a hold is dead and its devices
    are free, even while its ``ReleaseHold`` delete is still on its way. (A
    COMMITTED record of an ABORTed incarnation is invariant 8's business.)"""
    out: list[Violation] = []
    held: dict[str, dict[str, tuple[int, Reservation]]] = defaultdict(dict)  # az -> gang -> (rev, reservation)
    aborted: set[tuple[str, int]] = set()  # (gang, incarnation) decided ABORT so far
    checked = 0
    for e in h.etcd:
        if e.key.startswith("decisions/") and e.kind == "put":
            parsed = _decision_key(e.key)
            if parsed is not None and isinstance(e.value, Mapping) and e.value.get("outcome") == "ABORT":
                aborted.add(parsed)
            continue
        if not e.key.startswith("reservations/"):
            continue
        az, _, gang = e.key[len("reservations/"):].partition("/")
        if e.kind == "delete":
            held[az].pop(gang, None)
            continue
        if e.kind != "put" or not isinstance(e.value, Mapping):
            continue
        checked += 1
        try:
            held[az][gang] = (e.rev, Reservation.from_dict(e.value))
        except (KeyError, TypeError, ValueError):
            out.append(Violation(2, f"unreadable reservation {e.key} at rev {e.rev}", (str(e.value),), e.mono))
            continue
        live = {g: r for g, (_, r) in held[az].items() if not (r.two_phase and (g, r.incarnation) in aborted)}
        if gang not in live:
            continue
        ledger = DeviceLedger.from_reservations(live)
        conflicts = ledger.conflicts()
        nic_holder: dict[tuple[str, str], str] = {}
        for g, r in sorted(live.items()):
            for node, dev in r.nodes.items():
                for nic in dev.nics:
                    if (node, nic) in nic_holder:
                        conflicts.append(f"{node} nic {nic} held by {nic_holder[(node, nic)]} and {g}")
                    nic_holder[(node, nic)] = g
        mine = [c for c in conflicts if c.endswith(f" {gang}") or f" {gang} and " in c]
        if mine:
            others = sorted({g for g in held[az] if g != gang and any(f" {g} " in f" {c} " for c in mine)})
            kinds = " and ".join(sorted({"NICs" if " nic " in c else "GPUs" for c in mine}))
            out.append(Violation(2, f"etcd holds reservations of {gang} and {', '.join(others)} on the same {kinds}",
                                 (f"{e.key} written at rev {e.rev} (seen {_t(h, e.mono)}): {dict(e.value)}",
                                  *[f"reservations/{az}/{g} written at rev {held[az][g][0]}" for g in others],
                                  *[f"{az}: {c}" for c in mine]), e.mono))
    return checked, out


# ---------------------------------------------------------------------------
# 3. one incarnation at a time


def check_one_incarnation(h: History, ivs: Sequence[MemberInterval]) -> Check:
    """No two incarnations of a gang have live members at the same instant, and
    no member (gang, incarnation, rank) runs twice at once (e.g. re-placed on a
    second node while the first copy still runs)."""
    out: list[Violation] = []
    by_gang: dict[str, list[MemberInterval]] = defaultdict(list)
    for iv in ivs:
        by_gang[iv.gang].append(iv)
    for gid, lst in sorted(by_gang.items()):
        lst = sorted(lst, key=lambda i: i.start)
        for i, a in enumerate(lst):
            for b in lst[i + 1:]:
                if not a.overlaps(b):
                    continue
                if a.incarnation != b.incarnation:
                    out.append(Violation(3, f"gang {gid}: incarnations {a.incarnation} and {b.incarnation} "
                                            "running at once", (_iv(h, a), _iv(h, b)), max(a.start, b.start)))
                elif a.rank == b.rank:
                    out.append(Violation(3, f"member {a.key} running twice at once",
                                         (_iv(h, a), _iv(h, b)), max(a.start, b.start)))
    return len(by_gang), out


# ---------------------------------------------------------------------------
# 4. no acknowledged submission lost


# The recorder sees events late, never early: a terminal write seen late can
# make a legitimate collection look up to this much earlier than retention.
RETENTION_LAG_TOLERANCE_S = 2.0


def collected_gangs(h: History) -> dict[str, int]:
    """Gangs deleted by retention (docs/etcd-keys.md "Retention"): gang id ->
    revision of the delete of ``gangs/<id>``, for deletes whose last recorded
    write of the record was a terminal state at least the run's
    ``gang_retention_s`` earlier. Any other delete of a gang record is not
    retention (and the gang counts as lost): with the default retention of
    seven days, no delete in a chaos run is."""
    retention = float(h.params.timings.get("gang_retention_s", 7 * 24 * 3600.0))
    last: dict[str, EtcdEvent] = {}
    out: dict[str, int] = {}
    for e in sorted(h.etcd, key=lambda e: e.rev):
        if not e.key.startswith("gangs/"):
            continue
        gid = e.key[len("gangs/"):]
        if e.kind == "put":
            last[gid] = e
            out.pop(gid, None)
        elif e.kind == "delete":
            prev = last.get(gid)
            if (prev is not None and isinstance(prev.value, Mapping) and prev.value.get("state") in TERMINAL
                    and e.mono - prev.mono >= retention - RETENTION_LAG_TOLERANCE_S):
                out[gid] = e.rev
    return out



def check_acked_not_lost(h: History) -> Check:
    """Every acknowledged submission's gang exists in the final etcd state (or
    was collected by retention after it finished: ``collected_gangs``); one
    idempotency key never yields two gangs. Cross-AZ submissions are ordinary
    submissions (two-phase reservations): acknowledged ones must survive like
    any other, and a refusal as UNIMPLEMENTED (the pre-two-phase answer) is
    a regression."""
    out: list[Violation] = []
    if h.final is None:
        return 0, [Violation(4, "no final etcd state was recorded: cannot tell whether acknowledged gangs survive")]
    gangs = h.final.gangs
    collected = collected_gangs(h)
    checked = 0
    for o in h.outcomes:
        if o.op not in SUBMIT_OPS:
            continue
        if o.acked:
            checked += 1
            if o.gang_id not in gangs and o.gang_id not in collected:
                kind = "cross-AZ gang" if o.op == "submit_cross_az" else "gang"
                out.append(Violation(4, f"acknowledged {kind} {o.gang_id} ({o.name}, key {o.key}) is not in etcd",
                                     (f"acked {_t(h, o.end)} after {o.attempts} attempt(s) in {o.az}",), o.end))
        elif o.op == "submit_cross_az" and o.code == "UNIMPLEMENTED":
            checked += 1
            out.append(Violation(4, f"cross-AZ submission {o.name} refused UNIMPLEMENTED: cross-AZ gangs must be "
                                    "accepted (two-phase reservations)", (o.detail,), o.end))
    ids_by_key: dict[str, set[str]] = defaultdict(set)
    for c in h.calls:
        if c.op in SUBMIT_OPS and c.code == "OK" and c.gang_id:
            ids_by_key[c.key].add(c.gang_id)
    for key, ids in sorted(ids_by_key.items()):
        if len(ids) > 1:
            out.append(Violation(4, f"idempotency key {key} acknowledged as {len(ids)} different gangs",
                                 tuple(sorted(ids))))
    by_key: dict[str, list[str]] = defaultdict(list)
    for gid, g in gangs.items():
        if isinstance(g, Mapping) and g.get("idempotency_key"):
            by_key[g["idempotency_key"]].append(gid)
    for key, gids in sorted(by_key.items()):
        if len(gids) > 1:
            out.append(Violation(4, f"idempotency key {key} has {len(gids)} gangs in etcd", tuple(sorted(gids))))
    return checked, out


# ---------------------------------------------------------------------------
# 5. nothing stranded


def check_nothing_stranded(h: History, ivs: Sequence[MemberInterval]) -> Check:
    """After settling: no reservation for a gang that is not RESERVED/STARTING/
    RUNNING (a RELEASING one is stranded too: its members should be gone by
    now); no gang left half-started (RESERVED/STARTING) or half-torn-down
    (RESTARTING); no member still running whose gang is finished or unknown.

    Two-phase holds: a PREPARED record is accepted only for a gang that is
    RESERVING at that incarnation (an attempt still in flight at settle time)
    and whose incarnation has no ABORT decision; a COMMITTED record of a gang
    still RESERVING only next to a COMMIT decision of that incarnation (the
    owner has yet to mark the gang RESERVED). Anything else is stranded."""
    if h.final is None:
        return 0, [Violation(5, "no final etcd state was recorded")]
    out: list[Violation] = []
    gangs = h.final.gangs
    decisions = h.final.prefix("decisions/")
    checked = 0
    for (az, gid), r in sorted(h.final.reservations.items()):
        checked += 1
        g = gangs.get(gid)
        status = r.get("status") if isinstance(r, Mapping) else "?"
        state = g.get("state") if isinstance(g, Mapping) else None
        r_inc = int(r.get("incarnation", 0) or 0) if isinstance(r, Mapping) else 0
        d = decisions.get(f"{gid}/{r_inc}")
        outcome = d.get("outcome") if isinstance(d, Mapping) else None
        same_inc = isinstance(g, Mapping) and int(g.get("incarnation", 1)) == r_inc
        if state is None:
            out.append(Violation(5, f"reservation {az}/{gid} ({status}) for a gang that does not exist", (str(r),)))
        elif status == "PREPARED":
            if not (state == "RESERVING" and same_inc and outcome != "ABORT"):
                out.append(Violation(5, f"PREPARED hold {az}/{gid}#{r_inc} left for a {state} gang "
                                        f"(incarnation {g.get('incarnation', 1)}, decision {outcome or 'none'})",
                                     (f"gang reason: {g.get('reason', '')}", f"reservation: {r}")))
        elif state == "RESERVING" and status == "COMMITTED" and same_inc and outcome == "COMMIT":
            continue
        elif state not in HOLDING or status == "RELEASING":
            out.append(Violation(5, f"reservation {az}/{gid} ({status}) left for a {state} gang",
                                 (f"gang reason: {g.get('reason', '')}", f"reservation: {r}")))
    for gid, g in sorted(gangs.items()):
        if isinstance(g, Mapping) and g.get("state") in ("RESERVED", "STARTING", "RESTARTING"):
            checked += 1
            out.append(Violation(5, f"gang {gid} left {g.get('state')} after settling (half-started or half-torn-down)",
                                 (f"reason: {g.get('reason', '')}",)))
    t = h.params.settle_at
    for iv in ivs:
        if not iv.live_at(t):
            continue
        checked += 1
        g = gangs.get(iv.gang)
        state = g.get("state") if isinstance(g, Mapping) else None
        if state is None or state in TERMINAL or int(g.get("incarnation", 1)) != iv.incarnation:
            out.append(Violation(5, f"{iv.key} still running at settle time for a "
                                    f"{state or 'missing'} gang", (_iv(h, iv),), t))
    return checked, out


# ---------------------------------------------------------------------------
# 6. no effect from a superseded epoch


def check_epochs(h: History) -> Check:
    """etcd side (exact, by revision): every reservation write carries the
    epoch of the leader key that existed at that revision. Agent side: every
    member start carries an epoch that led its AZ, and started no later than
    ``token_window_s`` after that leadership was *seen* ending (the agent
    confirms the epoch in etcd just before starting; the window covers the
    spawn). The sighting is never early, so a flagged start was truly late."""
    out: list[Violation] = []
    terms = leader_terms(h.etcd)
    checked = 0
    for e in h.etcd:
        if e.kind != "put" or not e.key.startswith("reservations/") or not isinstance(e.value, Mapping):
            continue
        checked += 1
        az = e.key[len("reservations/"):].split("/", 1)[0]
        epoch = int(e.value.get("epoch", 0) or 0)
        term = leader_at_rev(terms.get(az, ()), e.rev)
        if term is None or term.epoch != epoch:
            cur = f"epoch {term.epoch} ({term.coordinator})" if term else "no leader"
            out.append(Violation(6, f"reservation {e.key} written at rev {e.rev} by epoch {epoch} while {az} had {cur}",
                                 (f"value: {dict(e.value)}",), e.mono))
    w = h.params.token_window_s
    for ev in h.agents:
        if ev.event != "member_started":
            continue
        checked += 1
        az_terms = terms.get(ev.az, [])
        term = next((t for t in az_terms if t.epoch == ev.epoch), None)
        if term is None:
            out.append(Violation(6, f"{ev.key} started on {ev.node} under epoch {ev.epoch}, which never led {ev.az}",
                                 (f"started {_t(h, ev.mono)}", f"{ev.az} epochs: {[t.epoch for t in az_terms]}"), ev.mono))
        elif ev.mono - w > term.end:
            nxt = next((t for t in az_terms if t.start_rev > term.start_rev), None)
            out.append(Violation(6, f"{ev.key} started on {ev.node} under epoch {ev.epoch} "
                                    f"{ev.mono - term.end:.2f}s after that leadership ended",
                                 (f"started {_t(h, ev.mono)}", f"epoch {term.epoch} ({term.coordinator}) seen ending "
                                                              f"{_t(h, term.end)} (rev {term.end_rev})",
                                  f"next: {f'epoch {nxt.epoch} ({nxt.coordinator})' if nxt else 'none'}"), ev.mono))
    return checked, out


# ---------------------------------------------------------------------------
# 7. leader and admission resume after healing


def _first_leader_after(terms: Sequence[LeaderTerm], t: float) -> float | None:
    """The earliest time >= t at which the AZ had a leader (per the sightings)."""
    best: float | None = None
    for term in terms:
        if term.end < t:
            continue
        at = max(t, term.start)
        best = at if best is None else min(best, at)
    return best


def check_recovery(h: History) -> tuple[int, list[Violation], dict[str, Any]]:
    """Within ``recovery_bound_s`` of the last heal every AZ has a leader and a
    gang submitted after healing (the probe) is seen RUNNING (or already
    SUCCEEDED). Also: every AZ has a leader in the final state, and no gang
    is still PENDING more than the bound past its own admission timeout (its
    leader should have admitted or failed it: it has forgotten it)."""
    out: list[Violation] = []
    p = h.params
    bound = p.recovery_bound_s
    probes = [o for o in h.outcomes if o.probe and o.op == "submit"]
    heal = p.healed_at
    if heal is None:
        heal = min((o.first_start for o in probes), default=p.started_at)
    terms = leader_terms(h.etcd)
    gobs = gang_observations(h.etcd)
    measured: dict[str, Any] = {"bound_s": bound, "leader_after_heal_s": {}, "admission_after_heal_s": {}}
    checked = 0
    for az in p.azs:
        checked += 1
        at = _first_leader_after(terms.get(az, []), heal)
        if at is None or at > heal + bound:
            out.append(Violation(7, f"{az} had no leader within {bound:.0f}s of the last heal",
                                 tuple(f"epoch {t.epoch} ({t.coordinator}) {_t(h, t.start)}..{_t(h, t.end)}"
                                       for t in terms.get(az, [])[-4:]), heal))
        else:
            measured["leader_after_heal_s"][az] = round(at - heal, 3)
        if h.final is not None and az not in h.final.leaders:
            out.append(Violation(7, f"{az} has no leader in the final state", ()))
        mine = [o for o in probes if o.az == az]
        acked = [o for o in mine if o.acked]
        if not acked:
            out.append(Violation(7, f"the post-heal probe gang of {az} was never acknowledged",
                                 tuple(f"{o.name}: {o.code} after {o.attempts} attempt(s)" for o in mine) or
                                 ("no probe was submitted",), heal))
            continue
        gid = acked[0].gang_id
        seen = [o for o in gobs.get(gid, []) if o.state in ("RUNNING", "SUCCEEDED")]
        if not seen or seen[0].mono > heal + bound:
            states = [f"{o.state} {_t(h, o.mono)}" for o in gobs.get(gid, [])]
            out.append(Violation(7, f"admission in {az} did not resume within {bound:.0f}s of the last heal: "
                                    f"probe {gid} {'reached RUNNING only ' + _t(h, seen[0].mono) if seen else 'never ran'}",
                                 tuple(states) or ("no write of the probe gang seen",), heal))
        else:
            measured["admission_after_heal_s"][az] = round(seen[0].mono - heal, 3)
    if h.final is not None and h.final.wall:
        for gid, g in sorted(h.final.gangs.items()):
            if not isinstance(g, Mapping) or g.get("state") != "PENDING":
                continue
            checked += 1
            policy = (g.get("spec") or {}).get("policy") or {}
            timeout = float(policy.get("admission_timeout_s", 600.0))
            overdue = h.final.wall - (float(g.get("submitted_at", 0.0)) + timeout)
            if overdue > bound:
                out.append(Violation(7, f"gang {gid} still PENDING {overdue:.0f}s past its admission timeout "
                                        f"({timeout:g}s): its owner {g.get('owner_az')} is not admitting it",
                                     (f"reason: {g.get('reason', '')}",)))
    return checked, out, measured


# ---------------------------------------------------------------------------
# 8. two-phase decisions (cross-AZ gangs)


def _decision_key(key: str) -> tuple[str, int] | None:
    gang, _, inc = key[len("decisions/"):].rpartition("/")
    return (gang, int(inc)) if gang and inc.isdigit() else None


def _plan_azs(gang_writes: Sequence[EtcdEvent], inc: int, rev: int) -> set[str] | None:
    """The AZs of incarnation ``inc``'s plan: those of the placement in the last
    write of the gang record at that incarnation before ``rev`` (the owner
    records the attempt, with its full placement, before any Prepare)."""
    azs: set[str] | None = None
    for e in gang_writes:
        if e.rev > rev:
            break
        v = e.value
        if not isinstance(v, Mapping) or int(v.get("incarnation", 1) or 1) != inc:
            continue
        placement = v.get("placement") or ()
        found = {str(m.get("az", "")) for m in placement if isinstance(m, Mapping) and m.get("az")}
        if found:
            azs = found
    return azs


def check_two_phase(h: History) -> Check:
    """Exact, on the recorded etcd history (every put and delete, by revision):

    (a) one decision per (gang, incarnation): ``decisions/<gang>/<inc>`` is
        written once (create-if-absent), holds COMMIT or ABORT, and is never
        rewritten nor deleted, except with its finished gang's record in one
        txn (retention);
    (b) COMMIT only if prepared everywhere: at the decision's revision every
        AZ of that incarnation's plan holds a PREPARED (or COMMITTED) record
        ``reservations/<az>/<gang>`` of exactly that incarnation;
    (c) agreement: a two-phase COMMITTED record of an incarnation is written
        only after that incarnation's decision is COMMIT (so never next to an
        ABORT, whichever came first in the history)."""
    out: list[Violation] = []
    checked = 0
    gap = any(e.kind == "gap" for e in h.etcd)
    decided: dict[tuple[str, int], EtcdEvent] = {}  # the first write of each decision key
    gang_writes: dict[str, list[EtcdEvent]] = defaultdict(list)
    holds: dict[tuple[str, str], EtcdEvent] = {}  # (az, gang) -> current reservation write
    collected = collected_gangs(h)
    for e in sorted(h.etcd, key=lambda e: e.rev):
        if e.kind == "put" and e.key.startswith("gangs/"):
            gang_writes[e.key[len("gangs/"):]].append(e)
        elif e.key.startswith("reservations/") and e.kind in ("put", "delete"):
            az, _, gid = e.key[len("reservations/"):].partition("/")
            if e.kind == "delete":
                holds.pop((az, gid), None)
                continue
            holds[(az, gid)] = e
            v = e.value if isinstance(e.value, Mapping) else {}
            if not v.get("two_phase") or v.get("status") != "COMMITTED":
                continue
            checked += 1
            inc = int(v.get("incarnation", 0) or 0)
            d = decided.get((gid, inc))
            outcome = d.value.get("outcome") if d is not None and isinstance(d.value, Mapping) else None
            if outcome != "COMMIT":
                out.append(Violation(8, f"reservation {az}/{gid}#{inc} written COMMITTED at rev {e.rev} while the "
                                        f"decision of incarnation {inc} is {outcome or 'not yet made'}",
                                     (f"{e.key} rev {e.rev} (seen {_t(h, e.mono)}): {dict(v)}",
                                      *([f"decisions/{gid}/{inc} = {dict(d.value)} at rev {d.rev}"]
                                        if d is not None and isinstance(d.value, Mapping) else [])), e.mono))
        elif e.key.startswith("decisions/"):
            parsed = _decision_key(e.key)
            if parsed is None:
                continue
            gid, inc = parsed
            first = decided.get(parsed)
            if e.kind == "delete":
                if collected.get(gid) == e.rev:
                    continue  # retention: deleted with its finished gang's record, in one txn
                out.append(Violation(8, f"decision {gid}#{inc} deleted at rev {e.rev}: decisions are final",
                                     (f"first written at rev {first.rev}: {first.value}" if first else
                                      "never seen written",), e.mono))
                continue
            if e.kind != "put":
                continue
            checked += 1
            value = e.value if isinstance(e.value, Mapping) else {}
            outcome = value.get("outcome")
            if first is not None:
                old = first.value.get("outcome") if isinstance(first.value, Mapping) else None
                out.append(Violation(8, f"decision {gid}#{inc} written twice (rev {first.rev}: {old}, "
                                        f"rev {e.rev}: {outcome}): a decision key is created once",
                                     (f"rev {first.rev} (seen {_t(h, first.mono)}): {first.value}",
                                      f"rev {e.rev} (seen {_t(h, e.mono)}): {e.value}"), e.mono))
                continue
            decided[parsed] = e
            if outcome not in ("COMMIT", "ABORT"):
                out.append(Violation(8, f"decision {gid}#{inc} at rev {e.rev} is neither COMMIT nor ABORT",
                                     (str(e.value),), e.mono))
                continue
            if outcome != "COMMIT":
                continue
            azs = _plan_azs(gang_writes.get(gid, ()), inc, e.rev)
            if azs is None:
                if not gap:
                    out.append(Violation(8, f"COMMIT of {gid}#{inc} at rev {e.rev} with no recorded plan of that "
                                            "incarnation (the attempt is written before any Prepare)",
                                         (f"{e.key} = {dict(value)}",), e.mono))
                continue
            missing = []
            for az in sorted(azs):
                r = holds.get((az, gid))
                rv = r.value if r is not None and isinstance(r.value, Mapping) else {}
                if (r is None or int(rv.get("incarnation", 0) or 0) != inc
                        or rv.get("status") not in ("PREPARED", "COMMITTED")):
                    missing.append((az, r))
            if missing:
                out.append(Violation(8, f"COMMIT of {gid}#{inc} at rev {e.rev} although "
                                        f"{', '.join(az for az, _ in missing)} held no PREPARED record of "
                                        f"incarnation {inc} (plan: {', '.join(sorted(azs))})",
                                     (f"{e.key} = {dict(value)} (seen {_t(h, e.mono)})",
                                      *[f"reservations/{az}/{gid}: " + (
                                          f"{r.value.get('status') if isinstance(r.value, Mapping) else r.value} "
                                          f"incarnation "
                                          f"{r.value.get('incarnation') if isinstance(r.value, Mapping) else '?'} "
                                          f"(rev {r.rev})" if r is not None else "absent")
                                        for az, r in missing]), e.mono))
    return checked, out


# ---------------------------------------------------------------------------
# 9. a finished gang's members stop within the stop grace and the fence bound


# The Timings fields whose sum bounds how long a member may outlive the
# terminal write of its gang: its agent is told (or, cut off from every
# valid leader, fences: the node's fence deadline fence_after_s +
# replace_margin_s, docs/timing.md) and stops it, SIGTERM then SIGKILL after
# stop_grace_s.
STOP_BOUND_FIELDS = ("stop_grace_s", "fence_after_s", "replace_margin_s")


def stop_bound(timings: Mapping[str, Any]) -> float:
    """``stop_grace_s + fence_after_s + replace_margin_s`` of the run's
    timings (a field the run did not record takes its ``Timings`` default)."""
    default = Timings()
    return sum(float(timings.get(f, getattr(default, f))) for f in STOP_BOUND_FIELDS)


def check_terminal_stops(h: History, ivs: Sequence[MemberInterval]) -> tuple[int, list[Violation], dict[str, Any]]:
    """For every gang whose record was written terminal (SUCCEEDED, FAILED,
    CANCELLED) at T, no member interval of that gang, of any incarnation,
    ends later than T + ``stop_bound`` (stop_grace_s + fence_after_s +
    replace_margin_s of the run's timings); a member with no recorded exit
    counts as running at settle time.

    The stamps compared, all ``time.monotonic()`` of the one machine: T is
    when the recorder *saw* the gang's first terminal put (``etcd.jsonl``;
    never before the write, so a late sighting can hide a violation but not
    invent one); a member's end is its agent's ``member_exited`` stamp,
    taken right after the exit (for an exit learnt late, the shim's
    recorded end), or ``settle_at`` (the final dump) when none was recorded.
    A cancel that races a start (the member is started after T) is held to
    the same bound."""
    out: list[Violation] = []
    bound = stop_bound(h.params.timings)
    fields = " + ".join(STOP_BOUND_FIELDS)
    by_gang: dict[str, list[MemberInterval]] = defaultdict(list)
    for iv in ivs:
        by_gang[iv.gang].append(iv)
    checked = 0
    outlived = 0
    longest = 0.0
    for gid, obs in sorted(gang_observations(h.etcd).items()):
        end = next((o for o in obs if o.state in TERMINAL), None)
        if end is None:
            continue
        checked += 1
        members = by_gang.get(gid, [])
        lags = []
        for iv in members:
            stop = iv.end if iv.end != INF else max(h.params.settle_at, iv.start)
            lags.append(stop - end.mono)
            if stop - end.mono > bound:
                alive = "still running at settle time" if iv.end == INF else f"exited {stop - end.mono:.2f}s"
                out.append(Violation(9, f"{iv.key} of {end.state} gang {gid} {alive} after its terminal write "
                                        f"(rev {end.rev}), past {fields} = {bound:g}s", (
                    f"gang {gid} written {end.state} at rev {end.rev}, seen {_t(h, end.mono)}: {end.reason}",
                    _iv(h, iv)), end.mono + bound))
        if any(lag > 0 for lag in lags):
            outlived += 1
            longest = max(longest, max(lags))
    return checked, out, {"bound_s": bound, "outlived_terminal_write": outlived,
                          "longest_after_terminal_write_s": round(longest, 3)}


# ---------------------------------------------------------------------------


def check(h: History) -> Verdict:
    """Every invariant, with what each examined and found."""
    ivs = member_intervals(h.agents)
    results = []
    for number, (checked, violations) in (
        (1, check_all_or_nothing(h, ivs)),
        (2, check_no_double_booking(h, ivs)),
        (3, check_one_incarnation(h, ivs)),
        (4, check_acked_not_lost(h)),
        (5, check_nothing_stranded(h, ivs)),
        (6, check_epochs(h)),
    ):
        results.append(InvariantResult(number, INVARIANTS[number], checked, tuple(violations)))
    checked7, v7, measured = check_recovery(h)
    results.append(InvariantResult(7, INVARIANTS[7], checked7, tuple(v7)))
    checked8, v8 = check_two_phase(h)
    results.append(InvariantResult(8, INVARIANTS[8], checked8, tuple(v8)))
    checked9, v9, measured["terminal_stops"] = check_terminal_stops(h, ivs)
    results.append(InvariantResult(9, INVARIANTS[9], checked9, tuple(v9)))
    measured["members"] = len(ivs)
    measured["incarnations"] = len({(iv.gang, iv.incarnation) for iv in ivs})
    measured["anomalies"] = anomalies(h, ivs)
    return Verdict(_traced(h, results), measured)


def _traced(h: History, results: Sequence[InvariantResult]) -> tuple[InvariantResult, ...]:
    """Each violation with, as more evidence, the stimulus ids of the writes
    it names (chaos.history.Tracer; docs/chaos.md "Following a violation
    back"), so it leads to the coordinator's log lines of those decisions."""
    if not any(r.violations for r in results):
        return tuple(results)
    tracer = Tracer(h.etcd)
    return tuple(dataclasses.replace(r, violations=tuple(
        dataclasses.replace(v, evidence=v.evidence + tracer.lines((v.what, *v.evidence))) for v in r.violations))
        for r in results)


def anomalies(h: History, ivs: Sequence[MemberInterval]) -> list[str]:
    """Not invariant violations, but worth a look: a gang that ended FAILED
    although every member of its last incarnation exited 0 (the coordinator
    lost track of a success, e.g. a leader that forgot finished members)."""
    out: list[str] = []
    if h.final is None:
        return out
    members = _by_member(ivs)
    for gid, g in sorted(h.final.gangs.items()):
        if not isinstance(g, Mapping) or g.get("state") != "FAILED":
            continue
        inc, world = int(g.get("incarnation", 1)), _world(g)
        runs = [members.get((gid, inc, r), []) for r in range(world)]
        if world and all(runs) and all(run[-1].exit_code == 0 for run in runs):
            out.append(f"gang {gid} ended FAILED ({g.get('reason', '')}) although all {world} member(s) of "
                       f"incarnation {inc} exited 0")
    return out
