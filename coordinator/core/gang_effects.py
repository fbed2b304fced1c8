"""A single-AZ gang's effects, and the events performing them returns (pure;
docs/design.md §19.9).

The AZ leader decides with ``admission.plan_admissions`` and
``lifecycle.*``; the functions here turn those decisions into effects
(imperative: ``ReserveDevices``, ``WriteTransition``, ``SendRevoke``, ...)
and, from the event that performing one returned (past tense:
``GangWritten``, ``WriteRefused``, ``NotApplied``), decide the follow-up (a
reservation that committed is dispatched, then marked STARTING). An
agent's registration is decided here too: its node record, then what
becomes of each member it reports and of those it does not.
``GangPerformer.perform`` (coordinator/gang_performer.py) is the one interpreter: a
handler per effect, doing only the I/O and the cache updates. Nothing here
does I/O; ``now`` is passed in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Container, Iterable, Mapping, Protocol, Sequence

from coordinator.core import events as ev
from coordinator.core import lifecycle
from coordinator.core.admission import Decision, KeepPending, Reserve, spans_azs
from coordinator.core.admission import FailAdmission as FailDecision
from coordinator.core.placement import Placement
from coordinator.core.progress import MemberReport
from coordinator.core.records import GangRecord, MemberAssignment, NodeRecord
from coordinator.core.rendezvous import pick_master_port
from phalanx.agent_messages import Assign, MemberStatus
from phalanx.errors import AlreadyExists, Conflict
from phalanx.model import GangState, MemberPhase
from phalanx.ports import DEFAULT_PORTS
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.timings import Timings
from phalanx.topology import NodeTopology


# ------------------------------------------------------------------ effects
@dataclass(frozen=True)
class ReserveDevices:
    """Hold a placed gang's devices: the RESERVED gang record and its
    reservation in one fenced txn (the devices are held in memory from the
    moment this is decided, undone if the txn does not apply)."""

    gang: GangRecord  # as planned (PENDING)
    placement: Placement
    reservation: Reservation
    stimulus_id: str = ""


@dataclass(frozen=True)
class StartTwoPhaseAttempt:
    """A cross-AZ gang's turn came and it fits: its owner prepares this placement."""

    gang: GangRecord
    placement: Placement
    stimulus_id: str = ""


@dataclass(frozen=True)
class FailAdmission:
    """Fail a gang that was not admitted (timeout, never fits)."""

    gang: GangRecord
    reason: str
    never_fits: bool = False
    stimulus_id: str = ""


@dataclass(frozen=True)
class KeepWaiting:
    """Note why a gang stays pending (explain, the pending gauge's class)."""

    gang: GangRecord
    reason: str
    pending_class: str
    stimulus_id: str = ""


@dataclass(frozen=True)
class WriteTransition:
    """A run-time transition that tears nothing down (e.g. STARTING -> RUNNING)."""

    old: GangRecord
    record: GangRecord
    events: tuple[ev.GangEvent, ...] = ()
    stimulus_id: str = ""


@dataclass(frozen=True)
class Finish:
    """Tear the incarnation down to ``state`` (terminal or RESTARTING):
    ``GangApi.finish``, which asks ``finish_effect`` how."""

    gang: GangRecord
    state: GangState
    reason: str
    events: tuple[ev.GangEvent, ...] = ()
    stimulus_id: str = ""


@dataclass(frozen=True)
class TearDown:
    """Write a teardown ``lifecycle.teardown`` decided: the gang record, the
    reservation RELEASING or deleted, the name freed, in one write."""

    gang: GangRecord
    teardown: lifecycle.Teardown
    stimulus_id: str = ""


@dataclass(frozen=True)
class Requeue:
    """RESTARTING -> PENDING as the next incarnation (``lifecycle.requeue``)."""

    gang: GangRecord
    requeue: lifecycle.Requeue
    stimulus_id: str = ""


@dataclass(frozen=True)
class ReleaseDevices:
    """Delete a terminal gang's reservation: every member is gone."""

    gang: GangRecord
    stimulus_id: str = ""


@dataclass(frozen=True)
class ForgetGang:
    """A terminal cross-AZ gang with nothing held here: drop it from the cache
    (its participants release their own holds)."""

    gang: GangRecord
    stimulus_id: str = ""


@dataclass(frozen=True)
class SendAssignments:
    """Send this AZ's members of ``gang`` their assignments."""

    gang: GangRecord
    only_node: str | None = None
    skip_ranks: frozenset[int] = frozenset()
    stimulus_id: str = ""


@dataclass(frozen=True)
class SendRevoke:
    """Tell ``node`` to stop the gang's members of this incarnation."""

    node: str
    gang: str
    incarnation: int
    reason: str
    stimulus_id: str = ""


@dataclass(frozen=True)
class MarkStarting:
    """RESERVED -> STARTING once the assignments went out."""

    gang: GangRecord
    stimulus_id: str = ""


@dataclass(frozen=True)
class CloseSession:
    """End a silent node's session: it is no longer placeable."""

    node: str
    stimulus_id: str = ""


@dataclass(frozen=True)
class MarkNodeNotReady:
    """Write the node record not ready, with why."""

    node: str
    record: NodeRecord
    stimulus_id: str = ""


@dataclass(frozen=True)
class NodeLost:
    """Past its fence deadline the node's agent has stopped every member:
    the gangs with members there learn they stopped."""

    node: str
    reason: str
    stimulus_id: str = ""


@dataclass(frozen=True)
class RegisterNode:
    """An agent registered: end the session it replaces, write its node
    record ready (fenced) unless etcd has it already, then keep its session
    and its liveness. ``session`` is the agent's live stream (the leader's
    ``AgentConn``), opaque here: the leader keeps it as the node's session."""

    node: str
    record: NodeRecord
    replaces_session: bool  # another session of this node is open: it is closed first
    announce_ready: bool  # the node was unknown or not ready: "node %s ready" is logged
    session: object = None
    stimulus_id: str = ""
    # False: the record in etcd already says all this (``record`` is it), a
    # re-registration (a new leader, a reconnect) changes nothing to write.
    write: bool = True


@dataclass(frozen=True)
class IgnoreMemberReport:
    """A member report at registration that is not taken (placed on another
    node): only logged. Not revoked: a revocation names gang and
    incarnation, not the rank, and would stop this node's own members of it."""

    why: str
    stimulus_id: str = ""


@dataclass(frozen=True)
class PublishMemberReport:
    """A member of a cross-AZ gang committed here: kept by the two-phase
    participant and published for its owner (a call into
    ``TwoPhaseDriver.on_member``, which decides the rest)."""

    node: str
    member: MemberStatus
    stimulus_id: str = ""


@dataclass(frozen=True)
class TrackMembers:
    """Record what members of one incarnation report, or are taken to
    report: adopted at registration, stopping after a revoke, vanished or
    gone. Merged into what the leader already knows of that incarnation."""

    gang: str
    incarnation: int
    reports: Mapping[int, MemberReport]
    stimulus_id: str = ""


Effect = (ReserveDevices | StartTwoPhaseAttempt | FailAdmission | KeepWaiting | WriteTransition | Finish | TearDown
          | Requeue | ReleaseDevices | ForgetGang | SendAssignments | SendRevoke | MarkStarting | CloseSession
          | MarkNodeNotReady | NodeLost | RegisterNode | IgnoreMemberReport | PublishMemberReport | TrackMembers)


# ------------------------------------------------------------------- events
@dataclass(frozen=True)
class Performed:
    """The effect was performed; nothing to report back."""


@dataclass(frozen=True)
class GangWritten:
    """The gang record (and what rode with it) was written."""

    record: GangRecord


@dataclass(frozen=True)
class WriteRefused:
    """A guarded write lost its compare: the record changed meanwhile."""

    why: str


@dataclass(frozen=True)
class NotApplied:
    """A write whose reply was lost turned out not to have applied (or was
    dropped): nothing changed in etcd, the in-memory hold is undone."""

    gang: str


Event = Performed | GangWritten | WriteRefused | NotApplied


# ---------------------------------------------------------------- admission
def reservation_for(g: GangRecord, p: Placement, az: str, epoch: int) -> Reservation:
    """The COMMITTED reservation of a single-AZ placement: per node, the
    members' GPUs and NICs, sorted."""
    nodes: dict[str, NodeDevices] = {}
    for m in p.members:
        cur = nodes.get(m.node, NodeDevices((), ()))
        nodes[m.node] = NodeDevices(tuple(sorted(cur.gpus + tuple(m.gpus))), tuple(sorted(cur.nics + tuple(m.nics))))
    return Reservation(az, g.id, g.incarnation, HoldState.COMMITTED, nodes, epoch)


def queue_reason(d: KeepPending, az: str) -> str:
    """Why a gang waits, as explain and the cycle's debug line say it."""
    return f"queue position {d.position} of {d.queue} in {az}: {d.rule or 'waiting for devices to free up'}"


def failure_reason(d: FailDecision, last_attempt: str) -> str:
    """A failed admission's reason; a cross-AZ gang that timed out also says
    why its last two-phase attempt did not get in (``last_attempt``)."""
    if spans_azs(d.gang) and not d.never_fits and last_attempt:
        return f"{d.reason}; last: {last_attempt}"
    return d.reason


def admission_effects(decisions: Sequence[Decision], *, az: str, epoch: int, now: float,
                      pending_class: Callable[[KeepPending, float], str],
                      last_attempts: Mapping[str, str] = {}, stimulus_id: str = "") -> list[Effect]:
    """One effect per admission decision, in the plan's order: a single-AZ
    ``Reserve`` holds its devices (``ReserveDevices``), a cross-AZ one starts
    its two-phase attempt, a ``KeepPending`` keeps waiting (with its reason
    class, ``pending_class``), a ``FailAdmission`` fails the gang.
    ``last_attempts``: per cross-AZ gang, why its last attempt did not get in."""
    out: list[Effect] = []
    for d in decisions:
        if isinstance(d, Reserve) and spans_azs(d.gang):
            out.append(StartTwoPhaseAttempt(d.gang, d.placement, stimulus_id))
        elif isinstance(d, Reserve):
            out.append(ReserveDevices(d.gang, d.placement, reservation_for(d.gang, d.placement, az, epoch), stimulus_id))
        elif isinstance(d, KeepPending):
            out.append(KeepWaiting(d.gang, queue_reason(d, az), pending_class(d, now), stimulus_id))
        else:
            reason = failure_reason(d, last_attempts.get(d.gang.id, ""))
            out.append(FailAdmission(d.gang, reason, d.never_fits, stimulus_id))
    return out


def member_assignments(p: Placement) -> tuple[MemberAssignment, ...]:
    """A placement as the gang record stores it."""
    return tuple(MemberAssignment(m.rank, m.az, m.node, tuple(m.gpus), tuple(m.nics)) for m in p.members)


def reserved_record(g: GangRecord, p: Placement, r: Reservation, master: tuple[str, int], now: float,
                    epoch: int) -> tuple[GangRecord, tuple[ev.GangEvent, ...]]:
    """The RESERVED record a single-AZ reservation writes, and its events:
    placed and reserved are one decision and one write here (two-phase gangs
    record them apart). ``master``: the rendezvous picked for the placement."""
    placement = member_assignments(p)
    addr, port = master
    new = g.evolve(state=GangState.RESERVED, placement=placement, span=p.span, reason=p.reason, updated_at=now,
                   master_addr=addr, master_port=port)
    gpus = sum(len(d.gpus) for d in r.nodes.values())
    events = (ev.placed(now, epoch, g.incarnation, placement, p.reason),
              ev.reserved(now, epoch, g.incarnation, f"{gpus} GPUs on {len(r.nodes)} nodes of {r.az} in one write"))
    return new, events


def assignments(g: GangRecord, az: str, rank0: NodeRecord | None, only_node: str | None = None,
                skip_ranks: Container[int] = frozenset()) -> list[tuple[str, Assign]]:
    """(node, Assign) for each of this AZ's members of ``g`` (only on
    ``only_node`` and not ``skip_ranks`` when an agent re-registers), ranks in
    order per node; a cross-AZ gang's other members are dispatched by their
    own AZ's leader. ``rank0``: the rank-0 node's record if it is in this AZ."""
    if not g.placement:
        return []
    by_node: dict[str, list[MemberAssignment]] = {}
    for m in g.placement:
        if m.az == az:
            by_node.setdefault(m.node, []).append(m)
    # The rendezvous fixed when the placement was written (rendezvous_for);
    # a record from before that field: the rank-0 node's address and the
    # first pick from its range, the same in every leader.
    addr, port = g.master_addr, g.master_port
    if not port:
        addr = (rank0.address if rank0 is not None else "") or g.placement[0].node
        port = pick_master_port(rank0.ports if rank0 is not None else DEFAULT_PORTS, g.id, g.incarnation)
    out = []
    for node, ms in by_node.items():
        if only_node is not None and node != only_node:
            continue
        for local_rank, m in enumerate(sorted(ms, key=lambda m: m.rank)):
            if m.rank in skip_ranks:
                continue
            out.append((node, Assign(
                gang=g.id, incarnation=g.incarnation, rank=m.rank, world_size=len(g.placement),
                local_rank=local_rank, local_world_size=len(ms), gpus=tuple(m.gpus), nics=tuple(m.nics),
                command=tuple(g.spec.run.command), env=dict(g.spec.run.env), duration_s=g.spec.run.duration_s,
                master_addr=addr, master_port=port, owner=g.owner,
            )))
    return out


def after_reserved(event: Event, stimulus_id: str = "") -> list[Effect]:
    """A reservation that committed is dispatched, then marked STARTING; one
    that did not apply leaves the gang PENDING (the next cycle places it).
    Dispatched even when a cancel took effect meanwhile: its agents' token
    checks then find the reservation RELEASING and report the members
    refused, which is how the leader learns that none of them runs."""
    if isinstance(event, GangWritten):
        return [SendAssignments(event.record, stimulus_id=stimulus_id), MarkStarting(event.record, stimulus_id)]
    return []


# ------------------------------------------------------------------ run time
def run_time_effect(g: GangRecord, step: lifecycle.RunTimeStep, now: float, stimulus_id: str = "") -> Effect:
    """A run-time step as its write: a teardown through ``Finish``, any other
    transition as a plain guarded write."""
    if step.teardown:
        return Finish(g, step.to, step.reason, step.events, stimulus_id)
    return WriteTransition(g, g.evolve(state=step.to, reason=step.reason, updated_at=now), step.events, stimulus_id)


def reevaluate_after(step: lifecycle.RunTimeStep, current: GangRecord | None) -> bool:
    """Whether a teardown may already allow what comes after it (no member
    was live): evaluate the gang again at once."""
    return step.teardown and current is not None and lifecycle.torn_down(current.state)


def after_teardown_effect(then: lifecycle.AfterTeardown, g: GangRecord, now: float, timings: Timings, *,
                          has_reservation: bool, stimulus_id: str = "") -> Effect:
    """What a torn-down incarnation needs once no member of it can run."""
    if then is lifecycle.AfterTeardown.REQUEUE:
        return Requeue(g, lifecycle.requeue(g, now, timings, has_reservation=has_reservation), stimulus_id)
    if then is lifecycle.AfterTeardown.RELEASE:
        return ReleaseDevices(g, stimulus_id)
    return ForgetGang(g, stimulus_id)


def after_torn_down(t: TearDown, event: Event) -> list[Effect]:
    """Once a teardown is written, every node of the placement is told to
    stop (or forget) this incarnation's members."""
    if not isinstance(event, GangWritten):
        return []
    g = t.gang
    return [SendRevoke(node, g.id, g.incarnation, t.teardown.record.reason, t.stimulus_id)
            for node in t.teardown.revoke_nodes]


def finish_effect(g: GangRecord, state: GangState, reason: str, events: Iterable[ev.GangEvent],
                  reservation: Reservation | None, reports: Mapping[int, MemberReport], now: float, epoch: int,
                  stimulus_id: str = "") -> TearDown:
    """What finishing an incarnation of ``g`` (to a terminal state, or to
    RESTARTING) writes: its teardown (``lifecycle.teardown``), from the
    reservation this leader has for it and the members that may still run
    by what they reported."""
    return TearDown(g, lifecycle.teardown(g, state, reason, events, reservation,
                                          lifecycle.live_member_nodes(g, reports), now, epoch), stimulus_id)


def teardown_note(t: lifecycle.Teardown) -> str:
    """What the log line of a finished incarnation says of its devices."""
    if t.releasing is not None:
        return "; devices held until its members are gone"
    return "; devices released" if t.delete_reservation else ""


def reservation_applied(gang: GangRecord | None, written: Reservation | None, sent: Reservation) -> bool:
    """After a reservation txn whose reply was lost, whether it applied, from
    what was read back: the gang record (None: absent) is past PENDING and
    the reservation key holds the incarnation ``sent`` (None: absent or not
    a record this txn writes)."""
    return (written is not None and written.incarnation == sent.incarnation and gang is not None
            and gang.state != GangState.PENDING)


STRAY_MEMBER = "started after its incarnation was torn down"


def stray_member_effects(node: str, m: MemberStatus, g: GangRecord | None, stimulus_id: str = "") -> list[Effect]:
    """A member's report from ``node`` (``g``: the gang's record this leader
    has, owned or held): one that runs an incarnation that is over
    (``lifecycle.stray_member``) is revoked again on that node. Single-AZ and
    cross-AZ gangs alike: the revocation sent when the incarnation was torn
    down may have found nothing to stop there yet."""
    if g is None or not lifecycle.stray_member(g, m.incarnation, MemberPhase(m.phase)):
        return []
    return [SendRevoke(node, m.gang, m.incarnation, f"{STRAY_MEMBER} ({g.state.name}#{g.incarnation})", stimulus_id)]


# ------------------------------------------------------------------ liveness
def liveness_effects(v: lifecycle.NodeVerdict, record: NodeRecord | None, stimulus_id: str = "") -> list[Effect]:
    """A node verdict as effects, in order: close its session, write its
    record not ready, then (past its fence deadline) lose its members."""
    out: list[Effect] = []
    if v.close_session:
        out.append(CloseSession(v.node, stimulus_id))
    if record is not None and v.not_ready_reason:
        out.append(MarkNodeNotReady(v.node, dataclasses.replace(record, ready=False, reason=v.not_ready_reason),
                                    stimulus_id))
    if v.lost_reason:
        out.append(NodeLost(v.node, v.lost_reason, stimulus_id))
    return out


# -------------------------------------------------------------- registration
class AgentSession(Protocol):
    """What a registering agent's session says of its node (the leader's
    ``AgentConn`` has these)."""

    node: str
    agent_id: str
    topology: NodeTopology
    address: str
    ports: tuple[int, int]


def register_node(session: AgentSession, previous: NodeRecord | None, *, replaces_session: bool, wall: float,
                  stimulus_id: str = "") -> RegisterNode:
    """The node record a registration writes (ready, heard from at ``wall``)
    and whether the node becomes ready by it: a re-registration of a ready
    node logs no second "ready" line. A record is written only when its
    content changes: a re-registration that says what ``previous`` says
    (all but the time) writes nothing (docs/design.md D17)."""
    record = NodeRecord(topology=session.topology, ready=True, agent_id=session.agent_id, last_heartbeat=wall,
                        address=session.address, ports=session.ports,
                        cordoned=previous is not None and previous.cordoned)  # an admin's cordon outlives its agent
    same = previous is not None and dataclasses.replace(
        previous, last_heartbeat=wall, mod_revision=record.mod_revision) == record
    return RegisterNode(session.node, previous if same else record, replaces_session,
                        previous is None or not previous.ready, session, stimulus_id, write=not same)


REVOKE_UNRESERVED = "no committed reservation for this member"


@dataclass(frozen=True)
class ReportedAtRegistration:
    """What the leader does with one member an agent reports when it
    registers: the effects, in order, and whether the member counts as
    running on the node (what the two-phase driver's ``on_register`` and the
    unreported members are judged against)."""

    effects: tuple[Effect, ...]
    runs: bool


def reported_member_effects(node: str, m: MemberStatus, *, refused: str | None, cross_az: bool,
                            gang: GangRecord | None, committed: Reservation | None,
                            stimulus_id: str = "") -> ReportedAtRegistration:
    """One reported member (``lifecycle.reported_member`` decides): refused
    (``refused``: placed on another node) it is only logged; of a cross-AZ
    gang committed here (``cross_az``) it goes to the two-phase participant;
    else it is adopted, or revoked (and tracked until it stops when its
    incarnation is still the gang's). The leader asks one member at a time,
    right before its turn: the two-phase call may change the hold the next
    member's facts come from."""
    if refused is not None:
        return ReportedAtRegistration((IgnoreMemberReport(refused, stimulus_id),), runs=False)
    if cross_az:
        return ReportedAtRegistration((PublishMemberReport(node, m, stimulus_id),), runs=True)
    report = MemberReport(MemberPhase(m.phase), m.exit_code, m.reason, node)
    track = TrackMembers(m.gang, m.incarnation, {m.rank: report}, stimulus_id)
    verdict = lifecycle.reported_member(gang, committed, m.gang, m.incarnation)
    if verdict is lifecycle.Reported.ADOPT:
        return ReportedAtRegistration((track,), runs=True)
    revoke = SendRevoke(node, m.gang, m.incarnation, REVOKE_UNRESERVED, stimulus_id)
    if verdict is lifecycle.Reported.REVOKE_AND_TRACK:
        # Torn down while the agent was away: the member still holds its
        # devices until the agent reports it stopped.
        return ReportedAtRegistration((revoke, track), runs=True)
    return ReportedAtRegistration((revoke,), runs=False)


def unreported_effects(node: str, az: str, gangs: Iterable[GangRecord], running: Mapping[tuple[str, int], Container[int]],
                       *, two_phase: Callable[[GangRecord], bool], stimulus_id: str = "") -> list[Effect]:
    """For each gang placed on a registering node whose agent does not
    report every member there (``lifecycle.unreported_members`` decides):
    one not started yet is dispatched again (skipping the ranks it runs),
    a running one's missing members vanished, a torn-down one's are gone.
    ``running``: per incarnation, the ranks the agent runs."""
    out: list[Effect] = []
    for g in gangs:
        have = set(running.get((g.id, g.incarnation), ()))
        u = lifecycle.unreported_members(g, node, az, have, two_phase=two_phase(g))
        if u is None:
            continue
        if u.redispatch:
            out.append(SendAssignments(g, node, frozenset(have), stimulus_id))
        else:
            out.append(TrackMembers(g.id, g.incarnation, u.reports, stimulus_id))
    return out


def pending_gauge_class(state: GangState, two_phase: bool, awaits_placement: bool, plan_class: str) -> str | None:
    """The class a gang counts under in the pending gauge, or None (not
    pending). A cross-AZ gang waits in the one queue like any other while its
    owner awaits a placement (PENDING, or RESERVING between two attempts):
    it counts under its plan class (``plan_class``, from the last cycle's
    KeepWaiting); while an attempt runs (or backs off) it counts apart."""
    if two_phase and awaits_placement:
        return plan_class
    if state != GangState.PENDING:
        return None
    return "two_phase" if two_phase else plan_class


# ---------------------------------------------------------------- submission
def submission_refused(name: str, name_holder: str | None) -> AlreadyExists | Conflict:
    """The error for a submission txn that lost its compare and is not a
    retry of an earlier one: the name is taken (``name_holder``: the gang
    holding it, or why it cannot be told), else it raced with another write."""
    if name_holder is not None:
        return AlreadyExists(f"name: a live gang named {name!r} exists ({name_holder})")
    return Conflict(f"submission of {name!r} raced with another write; retry with the same idempotency key")


def adopt_retried(existing: GangRecord, az: str, known: Container[str]) -> bool:
    """Whether a retried submission's gang (found by its idempotency key) is
    taken on here: its first attempt may have committed although its reply
    was lost, and then this leader never learnt of it and would never admit
    it. ``known``: the gangs this leader has."""
    return existing.owner_az == az and not existing.state.terminal and existing.id not in known
