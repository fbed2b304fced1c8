"""One AZ leader's admission decisions (pure; docs/admission.md).

Input: the pending gangs owned by this AZ, single- and cross-AZ alike, the
nodes with their free devices, every registered node (for the never-fits
rule) and ``now``. Output: one decision per pending gang, each with a short
reason that names the rule behind it. Placement itself is
``coordinator.core.placement.place``.

One order for every gang the AZ owns: single-AZ gangs and gangs that may span
AZs (two-phase, docs/two-phase.md) are ranked together, so an older cross-AZ
gang is placed before a younger single-AZ one and takes its devices from the
free view first. What differs is only the *scope* a gang is placed in: a
single-AZ gang sees this AZ's nodes, a cross-AZ gang every AZ's (the caller's
view of other AZs may be stale; their participants' ledgers refuse a
conflicting prepare). A ``Reserve`` of a cross-AZ gang starts its two-phase
attempt with that placement; one that does not fit stays pending like any
other gang, and the next cycle places it again.

Rules, in the order they are applied to each gang (queue order: priority
desc, first submit time asc, id):

1. **Admission timeout**: PENDING past ``policy.admission_timeout_s`` fails.
2. **Never fits**: a gang that cannot be placed even if every registered node
   of the AZ were ready and empty fails at once, with the limit it breaks
   (only when the caller passes ``registered``: the leader does so once its
   agents have had time to register). A cross-AZ gang is judged against
   every AZ's registered nodes.
3. **Restart backoff**: a restarted gang waits out its backoff.
4. **Placement** on the free devices, except the nodes kept for an older
   gang (rule 5).
5. **Backfill**: a gang that does not fit does not hold back the gangs behind
   it, until it has waited longer than ``backfill_window_s``. Then the nodes
   it would take on the AZ's placeable nodes if they were empty are *kept*
   for it: gangs behind it may still be admitted on every other node, so it
   delays nobody who does not compete for its nodes, and its nodes drain
   until it fits. A gang that would not fit even on the empty placeable
   nodes (it needs nodes that are down) keeps nothing: holding others back
   would not make it fit. One gang keeps nodes at a time (the oldest).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, MutableMapping, Sequence

from coordinator.core.placement import (
    FabricIndex, NodeView, Placement, PlacementRequest, Shortfall, Unplaceable, drained, never_fits, place,
)
from coordinator.core.records import GangRecord
from phalanx.model import GangState
from phalanx.topology import NodeTopology


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
    # Where the gang stands and who holds it: for `explain`.
    position: int = 0  # 1-based place in this AZ's queue
    queue: int = 0  # gangs in the queue
    held_by: str = ""  # the older gang whose kept nodes this gang would need
    keeps: tuple[str, ...] = ()  # nodes kept for this gang (it is the head past its backfill window)
    rule: str = ""  # the rule that keeps it waiting, when it is more than "no room now" (also in reason)


@dataclass(frozen=True)
class FailAdmission:
    gang: GangRecord
    reason: str
    never_fits: bool = False


Decision = Reserve | KeepPending | FailAdmission

PlaceFn = Callable[..., Placement | Unplaceable]


NodeKey = tuple[str, str]  # (az, node): node names are unique only within an AZ


def _take(nodes: dict[NodeKey, NodeView], placement: Placement) -> None:
    """Remove a placement's devices from the free view (so the next gang in
    the same cycle sees them as used)."""
    for m in placement.members:
        key = (m.az, m.node)
        v = nodes[key]
        nodes[key] = replace(v, free_gpus=v.free_gpus - set(m.gpus), free_nics=v.free_nics - set(m.nics))


def without(views: Sequence[NodeView], taken: Mapping[NodeKey, tuple[Iterable[int], Iterable[str]]]) -> list[NodeView]:
    """``views`` (a free view, ``coordinator.core.capacity.free_view``) less
    the devices in ``taken`` ((az, node) -> (gpus, nics), as
    ``capacity.held`` gives them): placements a caller has made whose holds
    do not show in the view yet (two-phase attempts in flight)."""
    if not taken:
        return list(views)
    out = []
    for v in views:
        t = taken.get((v.az, v.name))
        out.append(v if t is None else replace(v, free_gpus=v.free_gpus - set(t[0]), free_nics=v.free_nics - set(t[1])))
    return out


def spans_azs(gang: GangRecord) -> bool:
    """Whether the gang is placed over every AZ (and admitted by two-phase
    reservations, even when its plan lands in one AZ) rather than over its
    owner AZ alone (the single-AZ fast path: one fenced txn). The one
    definition: the leader, the two-phase driver and explain's etcd
    fallback (coordinator/service.py) all ask this."""
    return gang.spec.topology.may_span_azs


def request_for(gang: GangRecord, az: str) -> PlacementRequest:
    """The placement request of ``gang`` in its scope: this AZ, or every AZ."""
    return PlacementRequest.from_spec(gang.id, gang.spec, azs=None if spans_azs(gang) else frozenset({az}))


def _shown(key: NodeKey, az: str) -> str:
    """A kept node as explain names it: this AZ's by name, another's with its AZ."""
    return key[1] if key[0] == az else f"{key[0]}/{key[1]}"


def shape_of(request: PlacementRequest) -> tuple:
    """What placement depends on, besides the gang's name."""
    return (request.members, request.gpus_per_member, request.rdma_nics_per_member, request.gpu_model,
            request.required, request.preferred, request.allow_cross_az, request.azs)


def plan_admissions(
    pending: Sequence[GangRecord],
    nodes: Sequence[NodeView],
    now: float,
    *,
    az: str,
    backfill_window_s: float = 30.0,
    registered: Sequence[NodeTopology] | None = None,
    verdicts: MutableMapping[tuple, str] | None = None,
    place_fn: PlaceFn = place,
    index: FabricIndex | None = None,
) -> list[Decision]:
    """``pending``: the gangs waiting for placement (PENDING, or RESERVING for
    a cross-AZ gang between two two-phase attempts: the caller passes only
    gangs whose owner waits for a placement). ``nodes``: this AZ's nodes and,
    when some pending gang may span AZs, other AZs' (a node that cannot be
    placed on now comes as not ready). ``registered``: every node the leader
    knows of (ready or not; other AZs' for cross-AZ gangs); None skips the
    never-fits rule. ``verdicts``: a memo of never-fits answers by request
    shape that the caller keeps while ``registered`` does not change (the
    answer depends on nothing else)."""
    free: dict[NodeKey, NodeView] = {(n.az, n.name): n for n in nodes}

    def placed(request: PlacementRequest, views: list[NodeView]) -> Placement | Unplaceable:
        return place_fn(request, views, index) if index is not None else place_fn(request, views)

    def scope(gang: GangRecord, unkept: bool = False) -> list[NodeView]:
        wide = spans_azs(gang)
        return [v for k, v in free.items() if (wide or k[0] == az) and (unkept or k not in kept)]

    waiting = (GangState.PENDING, GangState.RESERVING)
    order = sorted((g for g in pending if g.state in waiting), key=lambda g: g.order_key)
    decisions: list[Decision] = []
    head: GangRecord | None = None  # the gang nodes are kept for
    kept: frozenset[NodeKey] = frozenset()
    memo = verdicts if verdicts is not None else {}
    # Within one cycle free capacity only shrinks (and kept nodes only make
    # the view smaller), so a request shape that did not fit will not fit
    # later in the same cycle: remember the answer (a queue of equal gangs
    # then costs one placement, not one each).
    failed: dict[tuple, Unplaceable] = {}
    for pos, gang in enumerate(order, 1):
        where = dict(position=pos, queue=len(order))
        waited = now - gang.submitted_at
        if waited > gang.spec.policy.admission_timeout_s:
            decisions.append(FailAdmission(gang, f"not admitted within admission_timeout_s={gang.spec.policy.admission_timeout_s:g}s"))
            continue
        request = request_for(gang, az)
        shape = shape_of(request)
        if registered is not None:
            verdict = memo.get(shape)
            if verdict is None:
                verdict = memo[shape] = never_fits(request, registered, index)
            if verdict:
                decisions.append(FailAdmission(gang, verdict, never_fits=True))
                continue
        if gang.not_before > now:
            why = f"restart backoff: not re-placed for {gang.not_before - now:.1f}s"
            decisions.append(KeepPending(gang, why, rule=why, **where))
            continue
        result = failed.get(shape)
        if result is None:
            result = placed(request, scope(gang))
        if isinstance(result, Placement):
            _take(free, result)
            decisions.append(Reserve(gang, result, result.reason))
            continue
        failed[shape] = result
        if head is not None:
            # Would it fit but for the nodes kept for the head?
            unkept = placed(request, scope(gang, unkept=True))
            if isinstance(unkept, Placement):
                shown = ", ".join(sorted(_shown(k, az) for k in kept))
                why = (f"held back by the backfill rule: the only room for it is on nodes kept for older gang {head.id} "
                       f"({shown}), which has waited past backfill_window_s={backfill_window_s:g}s")
                decisions.append(KeepPending(gang, why, result.shortfalls, held_by=head.id, rule=why, **where))
                continue
        if head is None and waited > backfill_window_s:
            # Only this AZ's nodes can drain for it: this leader holds back
            # its own gangs alone, and other AZs' leaders keep filling
            # theirs. So a cross-AZ head sees other AZs as they are now, and
            # keeps nodes only where that makes it fit as they drain here.
            views = scope(gang, unkept=True)
            empty = placed(request, drained([v for v in views if v.az == az]) + [v for v in views if v.az != az])
            if isinstance(empty, Placement):
                head, kept = gang, frozenset((m.az, m.node) for m in empty.members)
                shown = sorted(_shown(k, az) for k in kept)
                why = (f"waited {waited:.0f}s, past backfill_window_s={backfill_window_s:g}s: nodes "
                       f"{', '.join(shown)} are kept for it until it fits (gangs behind it may use the others)")
                decisions.append(KeepPending(gang, f"{result.reason}; {why}", result.shortfalls,
                                             keeps=tuple(shown), rule=why, **where))
                continue
            where_ = ("this AZ's ready nodes were empty and other AZs' stayed as they are" if spans_azs(gang)
                      else "this AZ's ready nodes were empty")
            why = (f"it would not fit even if {where_}, so it keeps no nodes and holds back "
                   "no gang behind it")
            decisions.append(KeepPending(gang, f"{result.reason}; {why}", result.shortfalls, rule=why, **where))
            continue
        decisions.append(KeepPending(gang, result.reason, result.shortfalls, **where))
    return decisions
