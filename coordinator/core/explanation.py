"""What ``phalanx explain`` says about a waiting gang (pure): the text of
``AzLeader.explain``'s answer from the admission plan's decision, or from a
cross-AZ gang's two-phase owner state and where it would be placed
(docs/admission.md, docs/design.md §19.9)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from coordinator.core.admission import Decision, FailAdmission, Reserve
from coordinator.core.gang_effects import queue_reason
from coordinator.core.placement import Placement, Shortfall, Unplaceable
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
