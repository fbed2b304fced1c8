"""What ``phalanx explain`` says about a gang (pure): the text of
``AdmissionCycle.explain``'s answer from the admission plan's decision, or from a
cross-AZ gang's two-phase owner state and where it would be placed; and,
when no leader can be asked, the answer from the records in etcd
(``of_records``) and about a gang that is not waiting (``placed_summary``)
(docs/admission.md, docs/design.md §19.9)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from coordinator.core import capacity
from coordinator.core.admission import Decision, FailAdmission, Reserve, request_for
from coordinator.core.gang_effects import queue_reason
from coordinator.core.placement import NodeView, Placement, Shortfall, Unplaceable, never_fits, place
from coordinator.core.records import DeviceLedger, GangRecord, NodeRecord
from coordinator.core.twophase_owner import OwnerPhase


@dataclass(frozen=True)
class Explanation:
    """What ExplainGang serves for a waiting gang."""

    summary: str
    leader_reason: str
    shortfalls: tuple[Shortfall, ...] = ()
    never_fits: bool = False


def of_decision(d: Decision, position: int, queue: int, head: str, grace: str, az: str) -> Explanation:
    """A single-AZ gang's answer from what the admission plan, run for this
    answer, decides about it (so it is what the next cycle does). ``head``:
    its state and wait; ``grace``: why never-fits is not judged yet, or ""."""
    where = f"queue position {position} of {queue} in {az}"
    if isinstance(d, Reserve):
        return Explanation(
            f"{head}: it fits now ({d.reason}); the leader's admission plan, run for this answer, reserves "
            "it, so its next cycle does unless the inventory changes first", f"{where}: admitted on the next cycle")
    if isinstance(d, FailAdmission):
        return Explanation(f"{head}: the leader fails it on its next cycle: {d.reason}", f"{where}: {d.reason}",
                           never_fits=d.never_fits)
    return Explanation(f"{head}: {d.reason}{grace}", queue_reason(d, az), d.shortfalls)


def owner_summary(phase: OwnerPhase | None, attempts: int, last_reason: str, az: str, unled: Sequence[str]) -> str:
    """A cross-AZ gang's two-phase owner as explain names it (``phase`` None:
    no owner state yet); ``unled``: AZs without a leader, not offered to
    placement."""
    owner = f"two-phase owner in {az}: {phase.value if phase is not None else 'NEW'}"
    if attempts:
        owner += f" after {attempts} aborted attempt{'s' if attempts != 1 else ''}"
    if last_reason:
        owner += f"; last: {last_reason}"
    if unled:
        owner += f"; {', '.join(unled)} {'has' if len(unled) == 1 else 'have'} no leader: not offered to placement"
    return owner


def of_two_phase(phase: OwnerPhase | None, owner: str, head: str, grace: str, az: str, verdict: str,
                 result: Placement | Unplaceable | None) -> Explanation:
    """A cross-AZ gang waiting for placement: it never fits (``verdict``),
    or the free devices its owner sees would fit it (``result``) and what
    happens next in its owner's ``phase``, or why they would not (``result``
    None: not placed, as it never fits)."""
    if verdict or result is None:
        return Explanation(f"{head}: {verdict}; the leader fails it on its next admission cycle", owner,
                           never_fits=True)
    if isinstance(result, Placement):
        if phase is OwnerPhase.UNPLACED:
            what = ("the leader's next admission cycle places it when its turn in the queue of "
                    f"{az} comes (older or higher-priority gangs first)")
        elif phase is OwnerPhase.BACKOFF:
            what = "its last attempt was aborted; the owner tries again after its retry backoff"
        else:
            what = f"an attempt is under way ({phase.value if phase is not None else 'NEW'})"
        return Explanation(f"{head}: the free devices the owner sees would fit it now ({result.reason}); {what}",
                           owner)
    return Explanation(f"{head}: {result.reason}{grace}", owner, result.shortfalls)


def waiting_head(g: GangRecord, now: float) -> str:
    """How an answer about a waiting gang starts: its state and how long it
    has waited (never negative: ``now`` may be another replica's clock)."""
    return f"{g.state.name} for {max(0.0, now - g.submitted_at):.0f}s"


def placed_summary(g: GangRecord) -> str:
    """A gang that is not waiting: its state, why, and where it is placed."""
    where = ", ".join(sorted({f"{m.node}" for m in g.placement}))
    span = f" spanning one {g.span.label}" if g.span else ""
    return f"{g.state.name}: {g.reason}" + (f"; placed{span} on {where}" if where else "")


def recorded_view(az: str, nodes: Iterable[NodeRecord], ledger: DeviceLedger) -> list[NodeView]:
    """One AZ's free view from its records in etcd: the nodes that take work
    (docs/nodes.md), ready as recorded, less every reservation's devices."""
    taken = capacity.held((az, s) for s in ledger.slices())
    return capacity.free_view(((n.topology, n.ready) for n in nodes if capacity.takes_work(n)), taken)


def of_records(g: GangRecord, views: Sequence[NodeView], why: str, now: float) -> Explanation:
    """A waiting gang's answer when its owner AZ's leader could not be asked
    (``why``: why not): placement recomputed on ``views``, the free views
    from etcd of every AZ it may span (``recorded_view``). It says nothing
    about when the gang is admitted, which only the leader knows."""
    head = waiting_head(g, now)
    request = request_for(g, g.owner_az)
    verdict = never_fits(request, [v.topology for v in views])
    if verdict:
        return Explanation(f"{head}: {verdict}", why, never_fits=True)
    result = place(request, views)
    if isinstance(result, Unplaceable):
        return Explanation(f"{head}: {result.reason}", why, result.shortfalls)
    return Explanation(f"{head}: the free devices recorded in etcd would fit it ({result.reason}); only the leader "
                       "admits it, and it could not be asked", why)
