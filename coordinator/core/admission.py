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

The rules (admission timeout, never fits, restart backoff, placement,
backfill) are named functions in coordinator/core/admission_rules.py,
applied to each gang in queue order (priority desc, first submit time asc,
id) by ``plan_admissions``; docs/admission.md "Rules" says what each does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping, MutableMapping, Sequence

from coordinator.core.admission_rules import (
    RULES, AdmissionView, Candidate, Decision, FailAdmission, KeepPending, NodeKey, PlaceFn, Reserve, Rule, decide,
)
from coordinator.core.placement import FabricIndex, NodeView, PlacementRequest, place
from coordinator.core.records import GangRecord
from phalanx.model import GangState
from phalanx.topology import NodeTopology

# The decisions are defined with the rules that make them; callers import
# them from here, with plan_admissions.
__all__ = ["Decision", "FailAdmission", "KeepPending", "Reserve", "plan_admissions", "request_for", "shape_of",
           "spans_azs", "without"]


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
    rules: Sequence[Rule] = RULES,
) -> list[Decision]:
    """``pending``: the gangs waiting for placement (PENDING, or RESERVING for
    a cross-AZ gang between two two-phase attempts: the caller passes only
    gangs whose owner waits for a placement). ``nodes``: this AZ's nodes and,
    when some pending gang may span AZs, other AZs' (a node that cannot be
    placed on now comes as not ready). ``registered``: every node the leader
    knows of (ready or not; other AZs' for cross-AZ gangs); None skips the
    never-fits rule. ``verdicts``: a memo of never-fits answers by request
    shape that the caller keeps while ``registered`` does not change (the
    answer depends on nothing else). ``rules``: the pipeline
    (coordinator/core/admission_rules.py), applied to each gang in queue
    order; the first decision wins, and what it leaves (devices taken, nodes
    kept) is seen by the gangs after it."""
    view = AdmissionView(az=az, free={(n.az, n.name): n for n in nodes}, backfill_window_s=backfill_window_s,
                         registered=registered, verdicts=verdicts if verdicts is not None else {},
                         place_fn=place_fn, index=index)
    waiting = (GangState.PENDING, GangState.RESERVING)
    order = sorted((g for g in pending if g.state in waiting), key=lambda g: g.order_key)
    decisions: list[Decision] = []
    for pos, gang in enumerate(order, 1):
        request = request_for(gang, az)
        c = Candidate(gang, request, shape_of(request), spans_azs(gang), position=pos, queue=len(order))
        decision = decide(c, view, now, rules)
        view.record(decision)
        decisions.append(decision)
    return decisions
