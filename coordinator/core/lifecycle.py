"""A single-AZ gang's run-time decisions (pure; docs/design.md §19.6).

What the AZ leader decides about a gang once it is admitted, as functions
of the gang's record, what its members reported and ``now`` (passed in):
the member-progress step and the restart policy, the teardown of an
incarnation, the requeue of a restarted gang, the start barrier, node
liveness, the reconciliation when an agent registers, and cancel.
``coordinator/core/gang_effects.py`` turns what they return into effects,
which ``GangPerformer.perform`` (coordinator/gang_performer.py) performs (fenced writes,
messages to agents); nothing here does I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Mapping

from coordinator.core import events as ev
from coordinator.core import progress
from coordinator.core.progress import MemberReport
from coordinator.core.records import GangRecord
from phalanx.model import GangState, MemberPhase
from phalanx.reservation import HoldState, Reservation
from phalanx.timings import Timings

# States in which a member that has not reported may already run: the
# leader may have sent its assignment.
_MAY_RUN = (GangState.RESERVED, GangState.STARTING, GangState.RUNNING, GangState.RESTARTING)


def torn_down(state: GangState) -> bool:
    """The incarnation is over (terminal, or RESTARTING into the next)."""
    return state.terminal or state == GangState.RESTARTING


def incarnation_over(g: GangRecord, incarnation: int) -> bool:
    """The gang's record has torn ``incarnation`` down, or moved past it."""
    return g.incarnation > incarnation or (g.incarnation == incarnation and torn_down(g.state))


def stray_member(g: GangRecord | None, incarnation: int, phase: MemberPhase) -> bool:
    """Whether a member reported live runs an incarnation of ``g`` that is
    over: it started after the revocation its leader sent when the
    incarnation was torn down (a cancel that raced its start, its agent busy
    launching others), which found nothing to stop then. It is revoked
    again: no revocation is ever sent for it otherwise, and its devices
    would stay held (RELEASING) for as long as it runs."""
    return g is not None and phase.live and incarnation_over(g, incarnation)


# ------------------------------------------------------------ (a) progress
@dataclass(frozen=True)
class RunTimeStep:
    """A run-time transition decided, with the events it records."""

    to: GangState
    reason: str
    events: tuple[ev.GangEvent, ...] = ()

    @property
    def teardown(self) -> bool:
        """Written by tearing the incarnation down (``GangApi.finish``)."""
        return torn_down(self.to)


def run_time_step(g: GangRecord, to: GangState, reason: str, reports: Mapping[int, MemberReport], now: float,
                  epoch: int, *, all_started: bool = False) -> RunTimeStep:
    """The restart policy applied to a transition: a failure restarts the
    whole gang while restarts remain (docs/design.md §10.3); a failure
    records its members' exits, a restart its restart, the first step with
    every member started its start."""
    failed = to == GangState.FAILED
    if failed and g.restarts < g.spec.policy.max_restarts:
        to = GangState.RESTARTING
    events: list[ev.GangEvent] = []
    if failed:
        events += ev.member_exits(now, epoch, g.incarnation, reports)
    if to == GangState.RESTARTING:
        events.append(ev.restarting(now, epoch, g.incarnation, g.restarts + 1, g.spec.policy.max_restarts, reason))
    elif all_started:
        events.append(ev.started(now, epoch, g.incarnation, len(g.placement)))
    return RunTimeStep(to, reason, tuple(events))


def member_progress(g: GangRecord, reports: Mapping[int, MemberReport], now: float, epoch: int) -> RunTimeStep | None:
    """The step the members' reports call for (progress.evaluate, then the
    restart policy), or None."""
    tr = progress.evaluate(g.state, len(g.placement), reports)
    if tr is None:
        return None
    return run_time_step(g, tr.to, tr.reason, reports, now, epoch, all_started=tr.all_started)


class AfterTeardown(enum.Enum):
    """What a torn-down incarnation needs once no member of it can run."""

    REQUEUE = "requeue"  # RESTARTING: the next incarnation waits for placement
    RELEASE = "release"  # terminal, its reservation still held: delete it
    FORGET = "forget"  # terminal cross-AZ gang: the participants release their own holds


def after_teardown(g: GangRecord, reports: Mapping[int, MemberReport], *, has_reservation: bool,
                   two_phase: bool) -> AfterTeardown | None:
    """None while a member may still run (one not heard from counts as
    running) or when nothing is left to do."""
    if not torn_down(g.state):
        return None
    if any(reports.get(m.rank, MemberReport(MemberPhase.RUNNING)).phase.live for m in g.placement):
        return None
    if g.state == GangState.RESTARTING:
        return AfterTeardown.REQUEUE
    if has_reservation:
        return AfterTeardown.RELEASE
    if two_phase:
        return AfterTeardown.FORGET
    return None


def live_member_nodes(g: GangRecord, reports: Mapping[int, MemberReport]) -> set[str]:
    """Nodes where a member of this incarnation may still run: reported
    live, or not heard from while an assignment may have been sent."""
    nodes = set()
    for m in g.placement:
        rep = reports.get(m.rank)
        if rep is None or rep.phase.live:
            if g.state in _MAY_RUN or rep is not None:
                nodes.add(m.node)
    return nodes


@dataclass(frozen=True)
class Teardown:
    """How one write tears an incarnation down (``GangApi.finish``)."""

    record: GangRecord  # the gang in its new state
    events: tuple[ev.GangEvent, ...]
    free_name: bool  # the gang's name may be used again (not when restarting)
    releasing: Reservation | None  # written RELEASING: members may still run on its devices
    delete_reservation: bool  # no member can run: the reservation goes in the same write
    revoke_nodes: tuple[str, ...]  # nodes told to stop this incarnation's members


def teardown(g: GangRecord, state: GangState, reason: str, events: Iterable[ev.GangEvent],
             reservation: Reservation | None, live_nodes: set[str], now: float, epoch: int) -> Teardown:
    """Its devices stay held (RELEASING) until every member is known to be
    gone, so they are never handed to another gang, or to the gang's next
    incarnation, while an old member may still run."""
    releasing = None
    if reservation is not None and live_nodes:
        r = reservation
        releasing = Reservation(r.az, r.gang, r.incarnation, HoldState.RELEASING, r.nodes, epoch)
    out = list(events)
    if state.terminal:
        out.append(ev.finished(now, epoch, g.incarnation, state.name, reason))
    return Teardown(
        record=g.evolve(state=state, reason=reason, updated_at=now), events=tuple(out),
        free_name=state != GangState.RESTARTING, releasing=releasing,
        delete_reservation=reservation is not None and releasing is None,
        revoke_nodes=tuple(sorted({m.node for m in g.placement})),
    )


# ------------------------------------------------------------- (b) requeue
@dataclass(frozen=True)
class Requeue:
    record: GangRecord  # the next incarnation, PENDING until not_before
    backoff_s: float
    delete_reservation: bool


def requeue(g: GangRecord, now: float, timings: Timings, *, has_reservation: bool) -> Requeue:
    """RESTARTING -> PENDING as the next incarnation: keeps the first submit
    time (so it stays at the head of its queue) and waits out the restart
    backoff, which doubles with each restart up to its cap. (No event:
    "restarting" was recorded when the restart was decided.)"""
    backoff = timings.restart_backoff(g.restarts)
    new = g.evolve(
        state=GangState.PENDING, incarnation=g.incarnation + 1, restarts=g.restarts + 1, placement=(), span=None,
        not_before=now + backoff, updated_at=now,
        reason=f"restart {g.restarts + 1}/{g.spec.policy.max_restarts} after: {g.reason}",
    )
    return Requeue(new, backoff, has_reservation)


# ------------------------------------------------------- (c) start barrier
def start_barrier(g: GangRecord, reports: Mapping[int, MemberReport], now: float) -> str | None:
    """Why a gang fails its start barrier now (all-or-nothing at run time:
    every member started within start_timeout_s of the reservation), or
    None."""
    if g.state not in (GangState.RESERVED, GangState.STARTING):
        return None
    limit = g.spec.policy.start_timeout_s
    if now - g.updated_at <= limit:
        return None
    started = sum(1 for r in reports.values() if r.phase in (MemberPhase.RUNNING, MemberPhase.SUCCEEDED))
    return f"start barrier: {started} of {len(g.placement)} members started within start_timeout_s={limit:g}s"


# ------------------------------------------------------------ (d) liveness
@dataclass(frozen=True)
class NodeVerdict:
    node: str
    silent_s: float
    close_session: bool  # silent too long: end its session, the node is no longer placeable
    not_ready_reason: str  # non-empty: write its node record not ready, with this reason
    lost_reason: str  # non-empty: past its fence deadline, its members are gone


def node_verdict(node: str, *, last_contact: float, ready: bool, record_ready: bool | None, now: float,
                 not_ready_after_s: float, replace_after_s: float) -> NodeVerdict:
    """A node silent for not_ready_after_s is not placeable (and its record
    says so); silent past replace_after_s (its fence deadline) its agent has
    stopped every member, so the gangs placed there fail. ``record_ready``:
    what its node record says (None: no record)."""
    silent = now - last_contact
    close = ready and silent > not_ready_after_s
    ready_after = ready and not close
    not_ready = (f"no heartbeat for {silent:.1f}s"
                 if record_ready and not ready_after and silent > not_ready_after_s else "")
    lost = (f"node {node} lost (silent {silent:.0f}s, past its fence deadline)"
            if silent > replace_after_s and not ready_after else "")
    return NodeVerdict(node, silent, close, not_ready, lost)


def shown_heartbeat(recorded: float, last_contact: float | None, now: float, wall: float) -> float:
    """A node's last heartbeat as `phalanx nodes` shows it (wall clock): the
    leader's last contact with its agent (monotonic ``last_contact``, read
    at ``now``/``wall``), or, not heard from in this leadership (None), the
    time its record was written at registration (``recorded``). No write
    refreshes the record (docs/design.md D17)."""
    return recorded if last_contact is None else wall - max(0.0, now - last_contact)


def lost_member_reports(gangs: Iterable[GangRecord], node: str, az: str,
                        reason: str) -> list[tuple[GangRecord, dict[int, MemberReport]]]:
    """For each gang with members on a lost node of this AZ: those members,
    reported STOPPED (each gang is then evaluated: it fails or restarts)."""
    out = []
    for g in gangs:
        stopped = {m.rank: MemberReport(MemberPhase.STOPPED, -1, reason, node)
                   for m in g.placement if m.node == node and m.az == az}
        if stopped:
            out.append((g, stopped))
    return out


# --------------------------------------------------------- (e) registration
class Reported(enum.Enum):
    """What the leader does with a member an agent reports at registration."""

    ADOPT = "adopt"  # its reservation holds it: keep it and its report
    REVOKE_AND_TRACK = "revoke_and_track"  # torn down while the agent was away: stop it, wait for its stop
    REVOKE = "revoke"  # unknown here, or of another incarnation: stop it


def reported_member(g: GangRecord | None, committed: Reservation | None, gang: str, incarnation: int) -> Reported:
    """A member runs only on a COMMITTED reservation of its incarnation, in
    a gang that is not torn down; any other is revoked. One of the gang's
    current incarnation still holds its devices until it reports stopped."""
    if (g is not None and committed is not None and committed.holds(gang, incarnation)
            and not torn_down(g.state)):
        return Reported.ADOPT
    if g is not None and g.incarnation == incarnation:
        return Reported.REVOKE_AND_TRACK
    return Reported.REVOKE


@dataclass(frozen=True)
class Unreported:
    """What to do about members placed on a registering node that its
    agent does not report."""

    redispatch: bool  # not started yet: send their assignments (again)
    reports: Mapping[int, MemberReport]  # else: what to record for them


def unreported_members(g: GangRecord, node: str, az: str, have: set[int], *, two_phase: bool) -> Unreported | None:
    """None when the agent reports every member placed on it (or none is).
    A running gang's missing member has vanished (the gang fails); a
    torn-down one's is gone (its devices may be released); one not started
    yet is dispatched again (a cross-AZ gang's by its own driver)."""
    missing = {m.rank for m in g.placement if m.node == node and m.az == az} - have
    if not missing:
        return None
    if g.state in (GangState.RESERVED, GangState.STARTING):
        return None if two_phase else Unreported(True, {})
    if g.state == GangState.RUNNING:
        return Unreported(False, {r: MemberReport(MemberPhase.FAILED, -1, "member vanished (agent restarted without it)", node)
                                  for r in sorted(missing)})
    if torn_down(g.state):
        return Unreported(False, {r: MemberReport(MemberPhase.STOPPED, 0, "gone", node) for r in sorted(missing)})
    return None


# --------------------------------------------------------------- (f) cancel
@dataclass(frozen=True)
class Cancel:
    """Cancel is a teardown to CANCELLED with this reason and event."""

    reason: str
    events: tuple[ev.GangEvent, ...]


@dataclass(frozen=True)
class CancelRefused:
    message: str  # names the field: served as FAILED_PRECONDITION


# How often the leader decides a cancel again on the record its write lost
# its compare to (another write of the gang landed first: admission, the
# start, a member's report) before the client is told ABORTED. Each loss is
# another write's progress, and a gang has few writes in its start.
CANCEL_ATTEMPTS = 5


def cancel(g: GangRecord, az: str, reason: str, by: str, now: float, epoch: int) -> Cancel | CancelRefused:
    """Only the owner AZ's leader cancels a gang, and only one that has not
    ended; ``by`` (the caller's identity) is recorded with the reason."""
    if g.owner_az != az:
        return CancelRefused(f"gang {g.id} is owned by {g.owner_az}, not {az}")
    if g.state.terminal:
        return CancelRefused(f"id: gang {g.id} is already {g.state.name}; nothing to cancel")
    reason = reason or "cancelled by user"
    return Cancel(reason, (ev.cancelled(now, epoch, g.incarnation, by, reason),))
