"""One AZ leader's admission decisions (pure; STYLE §1, §10).

Input: the pending gangs owned by this AZ, the placeable nodes with their free
devices, and ``now``. Output: one decision per pending gang, each with a short
reason. Placement itself is ``coordinator.core.placement.place``.

Order: (priority desc, first submit time asc, id). Smaller gangs behind a gang
that does not fit may be admitted first (backfill), except once the head gang
has waited longer than ``backfill_window_s``: then nothing behind it is
admitted until it is, so a large gang cannot starve (docs/admission.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from coordinator.core.placement import FabricIndex, NodeView, Placement, PlacementRequest, Shortfall, Unplaceable, place
from coordinator.core.records import GangRecord
from phalanx.model import GangState


@dataclass(frozen=True)
class Reserve:
    gang: GangRecord
    placement: Placement
    reason: str


@dataclass(frozen=True)
class KeepPending:
    gang: GangRecord
    reason: str
    shortfalls: tuple[Shortfall, ...] = ()


@dataclass(frozen=True)
class FailAdmission:
    gang: GangRecord
    reason: str


Decision = Reserve | KeepPending | FailAdmission

PlaceFn = Callable[..., Placement | Unplaceable]


def _take(nodes: dict[str, NodeView], placement: Placement) -> None:
    """Remove a placement's devices from the free view (so the next gang in
    the same cycle sees them as used)."""
    for m in placement.members:
        v = nodes[m.node]
        nodes[m.node] = replace(v, free_gpus=v.free_gpus - set(m.gpus), free_nics=v.free_nics - set(m.nics))


def plan_admissions(
    pending: Sequence[GangRecord],
    nodes: Sequence[NodeView],
    now: float,
    *,
    az: str,
    backfill_window_s: float = 30.0,
    place_fn: PlaceFn = place,
    index: FabricIndex | None = None,
) -> list[Decision]:
    free = {n.topology.node: n for n in nodes}
    decisions: list[Decision] = []
    blocked_by: GangRecord | None = None
    # Within one cycle free capacity only shrinks, so a request shape that
    # did not fit will not fit later in the same cycle: remember the answer
    # (a queue of equal gangs then costs one placement, not one each).
    failed: dict[tuple, Unplaceable] = {}
    for gang in sorted(pending, key=lambda g: g.order_key):
        if gang.state != GangState.PENDING:
            continue
        waited = now - gang.submitted_at
        if waited > gang.spec.policy.admission_timeout_s:
            decisions.append(FailAdmission(gang, f"not admitted within admission_timeout_s={gang.spec.policy.admission_timeout_s:g}s"))
            continue
        if gang.not_before > now:
            decisions.append(KeepPending(gang, f"restart backoff: not re-placed for {gang.not_before - now:.1f}s"))
            continue
        if blocked_by is not None:
            decisions.append(KeepPending(gang, f"waiting behind older gang {blocked_by.id}, which has waited past the backfill window"))
            continue
        request = PlacementRequest.from_spec(gang.id, gang.spec, azs=frozenset({az}))
        shape = (request.members, request.gpus_per_member, request.rdma_nics_per_member, request.gpu_model,
                 request.required, request.preferred, request.allow_cross_az)
        result = failed.get(shape)
        if result is None:
            result = place_fn(request, list(free.values()), index) if index is not None else place_fn(request, list(free.values()))
        if isinstance(result, Unplaceable):
            failed[shape] = result
        if isinstance(result, Placement):
            _take(free, result)
            decisions.append(Reserve(gang, result, result.reason))
        else:
            decisions.append(KeepPending(gang, result.reason, result.shortfalls))
            if waited > backfill_window_s:
                blocked_by = gang
    return decisions
