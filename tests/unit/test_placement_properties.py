"""Placement engine: properties over random fabrics (hypothesis).

For any fabric, free set and request, a Placement must be capacity-correct
(exactly ``members`` slots, ranks 0..n-1, only free, ready, matching, usable
devices, none given twice), keep to the required level and the AZ rule, and
have the tightest span any placement could have; an Unplaceable must be
honest: no domain at any allowed level has the capacity. Capacity is exact in
this engine (a member needs its GPUs on one node and nothing else), so the
oracle below decides feasibility by counting, with no heuristic slack.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Sequence

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from coordinator.core.placement import (
    FabricIndex,
    NodeView,
    Placement,
    PlacementRequest,
    Unplaceable,
    place,
    violations,
)
from phalanx.model import Level, PcieDistance
from phalanx.topology import Gpu, GpuNicLink, Nic, NodeTopology

MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB")


@st.composite
def fabrics(draw: st.DrawFn) -> list[NodeView]:
    """1–3 AZs (in one or two regions) × 1–2 spines × 1–3 leaves × 1–4 nodes;
    2–8 GPUs in one or two NVLink islands, 0–8 NICs (some DOWN, rails or
    not), some multi-node NVLink cliques, random free sets and readiness.

    The shape is drawn by hypothesis; device details come from a seeded RNG,
    which keeps generation fast enough for a few hundred examples.
    """
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    busy = draw(st.sampled_from([0.0, 0.3, 0.6]))  # share of nodes with some devices taken
    views: list[NodeView] = []
    two_regions = draw(st.booleans())
    for a in range(draw(st.integers(1, 3))):
        az = f"az{a}"
        region = f"r{a % 2}" if two_regions else ""
        for s in range(draw(st.integers(1, 2))):
            for l in range(draw(st.integers(1, 3))):
                for i in range(draw(st.integers(1, 4))):
                    n_gpus = rng.choice([2, 4, 8, 8])
                    n_nics = rng.choice([0, n_gpus // 2, n_gpus, n_gpus])
                    split = rng.random() < 0.3
                    model = rng.choice(MODELS)
                    rails = rng.random() < 0.5
                    gpus = tuple(
                        Gpu(index=g, model=model, nvlink_island=(g * 2 // n_gpus if split else 0))
                        for g in range(n_gpus)
                    )
                    nics = tuple(
                        Nic(name=f"nic{k}", rail=(k if rails else -1),
                            state="DOWN" if rng.random() < 0.1 else "ACTIVE")
                        for k in range(n_nics)
                    )
                    links = tuple(
                        GpuNicLink(g, f"nic{k}", rng.choice(list(PcieDistance)))
                        for g in range(n_gpus) for k in range(n_nics)
                    )
                    topo = NodeTopology(
                        node=f"n{s}{l}{i}", az=az, region=region, spine=f"s{s}", leaf=f"l{l}",
                        # a clique per spine that may cross leaves, on some nodes only
                        nvlink_domain=f"c{s}" if rng.random() < 0.2 else "",
                        gpus=gpus, nics=nics, links=links,
                    )
                    free_gpus = set(range(n_gpus + 1))  # may name a GPU that does not exist
                    free_nics = {f"nic{k}" for k in range(n_nics + 1)}
                    if rng.random() < busy:
                        free_gpus = {g for g in free_gpus if rng.random() < 0.5}
                        free_nics = {n for n in free_nics if rng.random() < 0.5}
                    views.append(NodeView(topo, frozenset(free_gpus), frozenset(free_nics), rng.random() < 0.9))
    return views


@st.composite
def requests(draw: st.DrawFn) -> PlacementRequest:
    required = draw(st.sampled_from([None, None, *Level]))
    preferred = draw(st.sampled_from([None, *(l for l in Level if required is None or l <= required)]))
    azs = draw(st.sampled_from([None, None, frozenset({"az0"}), frozenset({"az0", "az2"})]))
    return PlacementRequest(
        gang="g",
        members=draw(st.integers(1, 12)),
        gpus_per_member=draw(st.sampled_from([1, 2, 3, 4, 8])),
        rdma_nics_per_member=draw(st.sampled_from([0, 0, 0, 1, 2])),
        gpu_model=draw(st.sampled_from(["", "", "", "h100", "A100", "b200"])),
        required=required,
        preferred=preferred,
        allow_cross_az=draw(st.booleans()),
        azs=azs,
    )


# --- the oracle: capacity by counting ---------------------------------------------------


def eligible(view: NodeView, request: PlacementRequest) -> tuple[frozenset[int], frozenset[str]]:
    model = request.gpu_model.lower()
    gpus = frozenset(g.index for g in view.topology.gpus if model in g.model.lower()) & view.free_gpus
    nics = frozenset(n.name for n in view.topology.nics if n.usable) & view.free_nics
    return gpus, nics


def in_scope(views: Sequence[NodeView], request: PlacementRequest) -> list[NodeView]:
    return [v for v in views if v.ready and (request.azs is None or v.az in request.azs)]


def node_cap(view: NodeView, request: PlacementRequest, gpus: frozenset[int] | None = None) -> int:
    free, nics = eligible(view, request)
    if gpus is not None:
        free &= gpus
    cap = len(free) // request.gpus_per_member
    if request.rdma_nics_per_member:
        cap = min(cap, len(nics) // request.rdma_nics_per_member)
    return cap


def fits_at(views: Sequence[NodeView], request: PlacementRequest, level: Level) -> bool:
    """Could any single domain of ``level`` hold the whole gang?"""
    m = request.members
    if level == Level.NVLINK_DOMAIN:
        cliques: dict[str, int] = defaultdict(int)
        for v in views:
            if v.topology.nvlink_domain:
                cliques[v.topology.domain(level)] += node_cap(v, request)
            else:
                for island in {g.nvlink_island for g in v.topology.gpus}:
                    ids = frozenset(g.index for g in v.topology.gpus if g.nvlink_island == island)
                    if node_cap(v, request, ids) >= m:
                        return True
        return any(c >= m for c in cliques.values())
    caps: dict[str, int] = defaultdict(int)
    for v in views:
        caps[v.topology.domain(level)] += node_cap(v, request)
    return any(c >= m for c in caps.values())


def limit(request: PlacementRequest) -> Level:
    if request.required is not None:
        return request.required
    return Level.REGION if request.may_span_azs else Level.AZ


# --- the properties ----------------------------------------------------------------------


def check_placement(p: Placement, views: Sequence[NodeView], request: PlacementRequest) -> None:
    scope = in_scope(views, request)
    # Capacity-correct: exactly `members` slots, ranks 0..n-1 and consecutive
    # per node, only free, ready, matching, usable devices, none given twice,
    # span measured truly and within the limit (the core's own invariant).
    assert violations(request, p, views) == []
    # And independently of it: every device free and eligible, none twice.
    by_key = {(v.az, v.name): v for v in views}
    devices = [(s.az, s.node, d) for s in p.members for d in (*s.gpus, *s.nics)]
    assert len(devices) == len(set(devices))
    for s in p.members:
        free, nics = eligible(by_key[(s.az, s.node)], request)
        assert by_key[(s.az, s.node)].ready and set(s.gpus) <= free and set(s.nics) <= nics
    # Span: the tightest any placement could have.
    tightest = next(level for level in Level if fits_at(scope, request, level))
    assert p.span == tightest, f"span {p.span.label}, but {tightest.label} was possible"
    # AZ rule: several AZs only when allowed and no AZ could hold it; then the fewest.
    azs = p.azs()
    if len(azs) > 1:
        assert request.may_span_azs and not fits_at(scope, request, Level.AZ)
        caps: dict[str, int] = defaultdict(int)
        for v in scope:
            if v.topology.domain(Level.REGION) == p.domain:
                caps[v.az] += node_cap(v, request)
        biggest = sorted(caps.values(), reverse=True)
        fewest = next(k for k in range(1, len(biggest) + 1) if sum(biggest[:k]) >= request.members)
        assert len(azs) == fewest
    assert p.preferred_met == (request.preferred is None or p.span <= request.preferred)


def check_unplaceable(u: Unplaceable, views: Sequence[NodeView], request: PlacementRequest) -> None:
    scope = in_scope(views, request)
    for level in Level:
        if level <= limit(request):
            assert not fits_at(scope, request, level), f"{level.label} fits, yet: {u.reason}"
    assert u.reason
    for s in u.shortfalls:
        assert s.members_needed == request.members and s.gpus_needed == request.gpus_needed
        assert 0 <= s.members_fit <= request.members and 0 <= s.gpus_free <= s.gpus_total
        if s.level <= limit(request):
            assert s.members_fit < request.members


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(views=fabrics(), request=requests(), seed=st.integers(0, 2**16))
def test_any_answer_is_correct_tight_and_order_independent(
    views: list[NodeView], request: PlacementRequest, seed: int
) -> None:
    result = place(request, views)
    event(f"placed, span {result.span.label}, {len(result.azs())} AZ" if isinstance(result, Placement) else "unplaceable")
    if isinstance(result, Placement):
        check_placement(result, views, request)
    else:
        check_unplaceable(result, views, request)
    shuffled = list(views)
    random.Random(seed).shuffle(shuffled)
    assert place(request, shuffled, FabricIndex.build(v.topology for v in views)) == result


@settings(max_examples=500, deadline=None)
@given(views=fabrics(), members=st.integers(1, 12), gpus=st.sampled_from([1, 2, 4, 8]))
def test_unplaceable_without_required_level_means_no_az_has_the_capacity(
    views: list[NodeView], members: int, gpus: int
) -> None:
    # The property, stated plainly: one AZ, no required level, and
    # Unplaceable means the AZ's total member capacity is below the gang.
    request = PlacementRequest(gang="g", members=members, gpus_per_member=gpus, azs=frozenset({"az0"}))
    result = place(request, views)
    total = sum(node_cap(v, request) for v in in_scope(views, request))
    assert isinstance(result, Unplaceable) == (total < members)


@settings(max_examples=500, deadline=None)
@given(views=fabrics(), members=st.integers(2, 24), gpus=st.sampled_from([2, 4, 8]),
       nics=st.sampled_from([0, 1]), required=st.sampled_from([None, Level.REGION]))
def test_cross_az_gangs_use_an_az_only_when_needed_and_the_fewest(
    views: list[NodeView], members: int, gpus: int, nics: int, required: Level | None
) -> None:
    # Big gangs that may cross AZs: the general test rarely draws them.
    request = PlacementRequest(gang="g", members=members, gpus_per_member=gpus, rdma_nics_per_member=nics,
                               required=required, allow_cross_az=True)
    result = place(request, views)
    event(f"placed, span {result.span.label}, {len(result.azs())} AZ" if isinstance(result, Placement) else "unplaceable")
    if isinstance(result, Placement):
        check_placement(result, views, request)
    else:
        check_unplaceable(result, views, request)
