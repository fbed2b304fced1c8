"""Which cross-AZ gangs get an owner, and what their owners are told, on
each tick of the leader's cycle (pure; docs/two-phase.md "Driver").

The driver (``TwoPhaseDriver.tick``) passes the gang records this leader
holds and its owners; it performs the steps in order: ``StartOwner`` starts
an ``OwnerState`` (``TwoPhaseDriver.start_owner``), a ``Routed`` is fed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol

from coordinator.core.admission import spans_azs
from coordinator.core.records import GangRecord
from coordinator.core.twophase_events import GangFinished, GangSubmitted, Routed
from coordinator.core.twophase_owner import OwnerPhase
from phalanx.model import GangState


class OwnerView(Protocol):
    """What the lifecycle reads of an ``OwnerState``."""

    phase: OwnerPhase
    incarnation: int


@dataclass(frozen=True)
class StartOwner:
    """Start an owner for ``gang`` (a cross-AZ gang this leader holds and no
    owner drives yet)."""

    gang: GangRecord


def submitted(g: GangRecord) -> Routed:
    """``GangSubmitted`` for ``g``'s current incarnation, to its owner."""
    return Routed.owner(GangSubmitted(stimulus_id=f"submit:{g.id}:{g.incarnation}", gang=g.id, incarnation=g.incarnation))


def owner_steps(gangs: Iterable[GangRecord], owners: Mapping[str, OwnerView]) -> list[StartOwner | Routed]:
    """For each cross-AZ gang, in order: no owner and not ended -> start one;
    a RESERVED owner whose incarnation is over (the record is terminal,
    RESTARTING or at a newer incarnation) -> ``GangFinished``; an owner that
    is done (FINISHED, FAILED) while the record is PENDING at a newer
    incarnation -> ``GangSubmitted`` (the restart's attempt). Both apply in
    one tick when the first leaves the owner FINISHED
    (``OwnerState`` ends a RESERVED owner on ``GangFinished`` of its
    incarnation)."""
    steps: list[StartOwner | Routed] = []
    for g in gangs:
        if not spans_azs(g):
            continue
        o = owners.get(g.id)
        if o is None:
            if not g.state.terminal:
                steps.append(StartOwner(g))
            continue
        phase = o.phase
        if phase is OwnerPhase.RESERVED and (g.state.terminal or g.state == GangState.RESTARTING
                                             or g.incarnation > o.incarnation):
            steps.append(Routed.owner(GangFinished(stimulus_id=f"owner-over:{g.id}:{o.incarnation}", gang=g.id,
                                                   incarnation=o.incarnation)))
            phase = OwnerPhase.FINISHED
        if g.state == GangState.PENDING and phase in (OwnerPhase.FINISHED, OwnerPhase.FAILED) and g.incarnation > o.incarnation:
            steps.append(submitted(g))
    return steps
