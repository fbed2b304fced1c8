"""Placement engine: small fabrics whose best answer is known by hand.

Each case builds a fabric with the builders below, asks for one gang and
checks the answer; ids read as the rule being checked. The property tests in
``test_placement_properties.py`` cover random fabrics.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import pytest

from coordinator.core.placement import (
    FabricIndex,
    NodeView,
    Placement,
    PlacementRequest,
    Shortfall,
    Unplaceable,
    drained,
    never_fits,
    place,
    span_of,
    violations,
)
from phalanx.model import Level, PcieDistance
from phalanx.spec import parse_spec
from phalanx.topology import Gpu, GpuNicLink, Nic, NodeTopology

# --- builders -------------------------------------------------------------------


def dgx_links(gpus: int, nics: int) -> tuple[GpuNicLink, ...]:
    """DGX/HGX H100 shape: GPU i shares a PCIe switch with NIC i (PIX), pairs
    of switches share a host bridge (PXB), four per CPU socket (NODE)."""
    out = []
    for g in range(gpus):
        for n in range(nics):
            if g == n:
                d = PcieDistance.PIX
            elif g // 2 == n // 2:
                d = PcieDistance.PXB
            elif g // 4 == n // 4:
                d = PcieDistance.NODE
            else:
                d = PcieDistance.SYS
            out.append(GpuNicLink(g, f"mlx5_{n}", d))
    return tuple(out)


def node(
    name: str,
    *,
    az: str = "az-a",
    spine: str = "s1",
    leaf: str = "l1",
    gpus: int = 8,
    nics: int = 8,
    islands: Sequence[int] | None = None,
    model: str = "NVIDIA H100 80GB HBM3",
    rails: bool = True,
    clique: str = "",
    region: str = "",
    down_nics: Iterable[int] = (),
) -> NodeTopology:
    down = set(down_nics)
    return NodeTopology(
        node=name,
        az=az,
        region=region,
        spine=spine,
        leaf=leaf,
        nvlink_domain=clique,
        gpus=tuple(
            Gpu(index=i, model=model, nvlink_island=(islands[i] if islands else 0)) for i in range(gpus)
        ),
        nics=tuple(
            Nic(name=f"mlx5_{i}", rail=(i if rails else -1), state="DOWN" if i in down else "ACTIVE")
            for i in range(nics)
        ),
        links=dgx_links(gpus, nics),
    )


def view(topo: NodeTopology, busy_gpus: Iterable[int] = (), busy_nics: Iterable[int] = (), ready: bool = True,
         full: bool = False) -> NodeView:
    """A node with everything free except ``busy_*`` (by index); ``full``: nothing free."""
    if full:
        return NodeView(topo, frozenset(), frozenset(), ready)
    bg, bn = set(busy_gpus), {f"mlx5_{i}" for i in busy_nics}
    return NodeView(
        topo,
        frozenset(g.index for g in topo.gpus if g.index not in bg),
        frozenset(n.name for n in topo.nics if n.name not in bn),
        ready,
    )


def leaf_of(leaf: str, free: int, busy: int = 0, *, az: str = "az-a", spine: str = "s1", prefix: str = "") -> list[NodeView]:
    """A leaf with ``free`` empty nodes then ``busy`` full ones."""
    p = prefix or f"{az}-{spine}-{leaf}-"
    return [view(node(f"{p}n{i}", az=az, spine=spine, leaf=leaf)) for i in range(free)] + [
        view(node(f"{p}b{i}", az=az, spine=spine, leaf=leaf), full=True) for i in range(busy)
    ]


def req(members: int, gpus: int = 8, nics: int = 0, **kw: object) -> PlacementRequest:
    return PlacementRequest(gang="g", members=members, gpus_per_member=gpus, rdma_nics_per_member=nics, **kw)  # type: ignore[arg-type]


def placed(result: Placement | Unplaceable) -> Placement:
    assert isinstance(result, Placement), result.reason
    return result


def leaves_of(p: Placement, nodes: Sequence[NodeView]) -> set[str]:
    by_name = {v.name: v.topology for v in nodes}
    return {by_name[s.node].domain(Level.LEAF) for s in p.members}


# --- the table ----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    nodes: Callable[[], list[NodeView]]
    request: PlacementRequest
    check: Callable[[Placement | Unplaceable, list[NodeView]], None]


def expect_span(level: Level, domain: str) -> Callable[[Placement | Unplaceable, list[NodeView]], None]:
    def check(result: Placement | Unplaceable, nodes: list[NodeView]) -> None:
        p = placed(result)
        assert (p.span, p.domain) == (level, domain)

    return check


def expect_nodes(*names: str) -> Callable[[Placement | Unplaceable, list[NodeView]], None]:
    def check(result: Placement | Unplaceable, nodes: list[NodeView]) -> None:
        assert placed(result).nodes() == names

    return check


def expect_slots(*slots: tuple[str, tuple[int, ...], tuple[str, ...]]) -> Callable[[Placement | Unplaceable, list[NodeView]], None]:
    def check(result: Placement | Unplaceable, nodes: list[NodeView]) -> None:
        got = tuple((s.node, s.gpus, s.nics) for s in placed(result).members)
        assert got == slots

    return check


def expect_preferred(*, met: bool, reason_has: str) -> Callable[[Placement | Unplaceable, list[NodeView]], None]:
    def check(result: Placement | Unplaceable, nodes: list[NodeView]) -> None:
        p = placed(result)
        assert p.preferred_met is met
        assert reason_has in p.reason

    return check


def expect_unplaceable(*shortfalls: Shortfall, reason_has: str = "") -> Callable[[Placement | Unplaceable, list[NodeView]], None]:
    def check(result: Placement | Unplaceable, nodes: list[NodeView]) -> None:
        assert isinstance(result, Unplaceable), result
        assert result.shortfalls[: len(shortfalls)] == shortfalls
        assert reason_has in result.reason

    return check


def _all(*checks: Callable[[Placement | Unplaceable, list[NodeView]], None]) -> Callable[[Placement | Unplaceable, list[NodeView]], None]:
    def check(result: Placement | Unplaceable, nodes: list[NodeView]) -> None:
        for c in checks:
            c(result, nodes)

    return check


def _one_leaf(result: Placement | Unplaceable, nodes: list[NodeView]) -> None:
    assert len(leaves_of(placed(result), nodes)) == 1


CASES = [
    # --- span first ---
    Case(
        "gang that fits one leaf is never spread over two",
        lambda: leaf_of("l1", 3) + leaf_of("l2", 3),
        req(3),
        _all(_one_leaf, expect_span(Level.LEAF, "az-a/s1/l1")),
    ),
    Case(
        "gang that fits one node stays on it, on one NVLink island",
        lambda: leaf_of("l1", 2),
        req(4, gpus=2),
        _all(expect_span(Level.NVLINK_DOMAIN, "az-a/az-a-s1-l1-n0"), expect_nodes("az-a-s1-l1-n0")),
    ),
    Case(
        "gang too big for any leaf spans the fewest leaves of one spine",
        lambda: leaf_of("l1", 2) + leaf_of("l2", 4) + leaf_of("l3", 3),
        req(6),
        # roomiest leaf first (l2: 4), then the best fit for the last 2 (l1).
        _all(expect_span(Level.SPINE, "az-a/s1"),
             expect_nodes(*(f"az-a-s1-l1-n{i}" for i in range(2)), *(f"az-a-s1-l2-n{i}" for i in range(4)))),
    ),
    Case(
        "a spine that holds the gang beats spreading over spines",
        lambda: leaf_of("l1", 3, spine="s1") + leaf_of("l1", 2, spine="s2") + leaf_of("l2", 2, spine="s2"),
        req(4),
        expect_span(Level.SPINE, "az-a/s2"),
    ),
    # --- best fit ---
    Case(
        "best fit picks the fuller leaf",
        lambda: leaf_of("l1", 4) + leaf_of("l2", 2, busy=2),
        req(2),
        expect_span(Level.LEAF, "az-a/s1/l2"),
    ),
    Case(
        "best fit picks the node with the smallest hole that fits",
        lambda: [view(node("a"), busy_gpus=range(2)), view(node("b"), busy_gpus=range(5)), view(node("c"))],
        req(1, gpus=3),
        expect_nodes("b"),
    ),
    Case(
        "equal nodes: the one in the fuller leaf is taken, empty leaves stay whole",
        lambda: leaf_of("l1", 4) + leaf_of("l2", 1, busy=3),
        req(1),
        expect_nodes("az-a-s1-l2-n0"),
    ),
    # --- required / preferred ---
    Case(
        "required leaf that no leaf can meet is unplaceable with the shortfall",
        lambda: leaf_of("l1", 3, busy=1) + leaf_of("l2", 2, busy=2),
        req(4, required=Level.LEAF),
        expect_unplaceable(
            Shortfall(Level.LEAF, "az-a/s1/l1", 24, 32, 32, 3, 4, "8 GPUs short"),
            Shortfall(Level.LEAF, "az-a/s1/l2", 16, 32, 32, 2, 4, "16 GPUs short"),
            reason_has="no single leaf can host 4 × 8 GPU",
        ),
    ),
    Case(
        "required spine: fragmented free GPUs are named as such",
        lambda: [view(node(f"n{i}"), busy_gpus=range(4)) for i in range(4)],
        req(2, required=Level.SPINE),
        expect_unplaceable(
            Shortfall(Level.SPINE, "az-a/s1", 16, 32, 16, 0, 2,
                      "free GPUs fragmented over nodes: a member needs 8 on one node"),
        ),
    ),
    Case(
        "required node: a gang is never split over nodes",
        lambda: leaf_of("l1", 2),
        req(3, gpus=4, required=Level.NODE),
        expect_unplaceable(reason_has="no single node can host 3 × 4 GPU"),
    ),
    Case(
        "preferred leaf that cannot be met still places, and says so",
        lambda: leaf_of("l1", 2) + leaf_of("l2", 2),
        req(3, preferred=Level.LEAF),
        _all(expect_span(Level.SPINE, "az-a/s1"), expect_preferred(met=False, reason_has="preferred leaf not possible now")),
    ),
    # --- inside a node ---
    Case(
        "GPU↔NIC affinity: each GPU gets the NIC on its own PCIe switch",
        lambda: [view(node("dgx"), busy_gpus=[0, 1], busy_nics=[0, 1])],
        req(1, gpus=2, nics=2),
        expect_slots(("dgx", (2, 3), ("mlx5_2", "mlx5_3"))),
    ),
    Case(
        "GPU↔NIC affinity: a GPU whose own NIC is taken is passed over",
        lambda: [view(node("dgx"), busy_gpus=[1], busy_nics=[0])],
        req(1, gpus=1, nics=1),
        expect_slots(("dgx", (2,), ("mlx5_2",))),
    ),
    Case(
        "NIC affinity falls back to the closest free NIC",
        lambda: [view(node("dgx"), busy_gpus=range(1, 8), busy_nics=[0])],
        req(1, gpus=1, nics=1),
        expect_slots(("dgx", (0,), ("mlx5_1",))),  # PXB beats NODE and SYS
    ),
    Case(
        "a DOWN NIC is never handed out",
        lambda: [view(node("dgx", down_nics=[0, 1, 2]), busy_gpus=range(4, 8))],
        req(1, gpus=2, nics=2),
        expect_slots(("dgx", (2, 3), ("mlx5_3", "mlx5_4"))),
    ),
    Case(
        "one NVLink island: the member goes to the island that can hold it",
        lambda: [view(node("pcie", islands=[0, 0, 0, 0, 1, 1, 1, 1]), busy_gpus=[0, 1])],
        req(1, gpus=3),
        _all(expect_slots(("pcie", (4, 5, 6), ())), expect_span(Level.NVLINK_DOMAIN, "az-a/pcie")),
    ),
    Case(
        "one NVLink island: members sharing a node share an island",
        lambda: [view(node("pcie", islands=[0, 0, 0, 0, 1, 1, 1, 1]), busy_gpus=[0, 1])],
        req(2, gpus=2),
        _all(expect_slots(("pcie", (4, 5), ()), ("pcie", (6, 7), ())), expect_span(Level.NVLINK_DOMAIN, "az-a/pcie")),
    ),
    Case(
        "one NVLink island: a node with a whole island free beats a split one",
        lambda: [view(node("split", islands=[0, 0, 0, 0, 1, 1, 1, 1]), busy_gpus=[0, 1, 4, 5]),
                 view(node("whole", islands=[0, 0, 0, 0, 1, 1, 1, 1]), busy_gpus=[0, 1, 2, 3])],
        req(1, gpus=4),
        expect_slots(("whole", (4, 5, 6, 7), ())),
    ),
    Case(
        "no island big enough: the member spans islands and the span is node",
        lambda: [view(node("pcie", islands=[0, 0, 0, 0, 1, 1, 1, 1]), busy_gpus=[0, 1, 4])],
        req(1, gpus=5),
        _all(expect_slots(("pcie", (2, 3, 5, 6, 7), ())), expect_span(Level.NODE, "az-a/pcie")),
    ),
    # --- across nodes ---
    Case(
        "rail alignment: the second node's member gets the first one's rails",
        lambda: [view(node("a"), busy_gpus=[0, 1], busy_nics=[0, 1]), view(node("b"), busy_gpus=[6, 7], busy_nics=[6, 7])],
        req(2, gpus=4, nics=4),
        expect_slots(
            ("a", (2, 3, 4, 5), ("mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5")),
            ("b", (2, 3, 4, 5), ("mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5")),
        ),
    ),
    Case(
        "ranks: consecutive per node, nodes in (az, spine, leaf, node) order",
        lambda: [view(node("z", leaf="l1"), busy_gpus=range(4)), view(node("a", leaf="l2"), busy_gpus=range(4)),
                 view(node("m", leaf="l1"), busy_gpus=range(4))],
        req(6, gpus=2),
        expect_nodes("m", "z", "a"),  # slots are in rank order; see test_rank_order for the ranks themselves
    ),
    Case(
        "multi-node NVLink domain (NVL72) counts as the NVLink level",
        lambda: [view(node(f"tray{i}", gpus=4, nics=4, clique="rack1", leaf=f"l{i % 2}")) for i in range(4)]
        + leaf_of("l0", 2),
        req(3, gpus=4),
        expect_span(Level.NVLINK_DOMAIN, "az-a/nvl:rack1"),
    ),
    # --- filters ---
    Case(
        "not-ready nodes are skipped",
        lambda: [view(node("sick"), ready=False), view(node("well"), busy_gpus=range(4))],
        req(1, gpus=4),
        expect_nodes("well"),
    ),
    Case(
        "not-ready nodes show in the shortfall",
        lambda: [view(node("sick"), ready=False), view(node("well"), busy_gpus=range(4))],
        req(1, gpus=8),
        expect_unplaceable(
            Shortfall(Level.AZ, "az-a", 4, 16, 8, 0, 1, "4 GPUs short; 1 node not ready"),
            reason_has="1 node not ready",
        ),
    ),
    Case(
        "gpu_model filter matches a case-insensitive substring",
        lambda: [view(node("a100", model="NVIDIA A100-SXM4-80GB")), view(node("h100"), busy_gpus=range(6))],
        req(1, gpus=2, gpu_model="h100"),
        expect_nodes("h100"),
    ),
    Case(
        "gpu_model filter with no match is unplaceable and says why",
        lambda: [view(node("a100", model="NVIDIA A100-SXM4-80GB"))],
        req(1, gpus=2, gpu_model="B200"),
        expect_unplaceable(reason_has="1 node without GPU model 'B200'"),
    ),
    Case(
        "capacity: only free GPUs, and NICs bound the member count",
        lambda: [view(node("a"), busy_gpus=[0, 2, 4, 6], busy_nics=range(5))],
        req(2, gpus=2, nics=2),
        expect_unplaceable(
            Shortfall(Level.AZ, "az-a", 4, 8, 4, 1, 2,
                      "RDMA NICs short: 2 free NICs per member on too few nodes"),
        ),
    ),
    Case(
        "capacity: a member takes exactly the free GPUs there are",
        lambda: [view(node("a"), busy_gpus=[0, 2, 4, 6])],
        req(2, gpus=2),
        expect_slots(("a", (1, 3), ()), ("a", (5, 7), ())),
    ),
    Case(
        "azs restricts the nodes considered",
        lambda: leaf_of("l1", 2, az="az-a") + leaf_of("l1", 1, az="az-b"),
        req(1, azs=frozenset({"az-b"})),
        expect_nodes("az-b-s1-l1-n0"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_placement_rule(case: Case) -> None:
    nodes = case.nodes()
    case.check(place(case.request, nodes), nodes)


def test_rank_order_is_consecutive_per_node_and_follows_the_network() -> None:
    nodes = [view(node("z", leaf="l1"), busy_gpus=range(4)), view(node("a", leaf="l2"), busy_gpus=range(4)),
             view(node("m", leaf="l1"), busy_gpus=range(4))]
    p = placed(place(req(6, gpus=2), nodes))
    assert [(s.rank, s.node) for s in p.members] == [(0, "m"), (1, "m"), (2, "z"), (3, "z"), (4, "a"), (5, "a")]


# --- cross-AZ ---------------------------------------------------------------------------


def three_azs() -> list[NodeView]:
    return leaf_of("l1", 4, az="az-a") + leaf_of("l1", 2, az="az-b") + leaf_of("l1", 3, az="az-c")


@pytest.mark.parametrize(
    "request_, azs, span",
    [
        pytest.param(req(3, allow_cross_az=True), {"az-c"}, Level.LEAF, id="allowed but one AZ fits: one AZ, best fit"),
        pytest.param(req(6, allow_cross_az=True), {"az-a", "az-b"}, Level.REGION,
                     id="allowed and no AZ fits: fewest AZs, roomiest first then best fit"),
        pytest.param(req(8, required=Level.REGION), {"az-a", "az-b", "az-c"}, Level.REGION,
                     id="required region implies cross-AZ"),
    ],
)
def test_cross_az(request_: PlacementRequest, azs: set[str], span: Level) -> None:
    p = placed(place(request_, three_azs()))
    assert p.azs() == azs
    assert p.span == span
    assert [s.az for s in p.members] == sorted(s.az for s in p.members)  # ranks grouped by AZ


def test_cross_az_not_allowed_is_unplaceable_and_says_why() -> None:
    result = place(req(6), three_azs())
    assert isinstance(result, Unplaceable)
    assert "allow_cross_az is false" in result.reason
    assert [(s.domain, s.members_fit) for s in result.shortfalls] == [("az-a", 4), ("az-c", 3), ("az-b", 2)]


def test_required_leaf_never_crosses_azs_even_when_allowed() -> None:
    result = place(req(5, required=Level.LEAF, allow_cross_az=True), three_azs())
    assert isinstance(result, Unplaceable)
    assert {s.level for s in result.shortfalls} == {Level.LEAF, Level.SPINE, Level.AZ, Level.REGION}


def test_cross_az_region_is_never_crossed() -> None:
    nodes = leaf_of("l1", 2, az="az-a") + [view(node(f"x{i}", az="az-x", region="other")) for i in range(2)]
    assert isinstance(place(req(3, allow_cross_az=True), nodes), Unplaceable)


# --- determinism, index, API ---------------------------------------------------------------


def mixed_fabric() -> list[NodeView]:
    rng = random.Random(7)
    out = []
    for s in range(2):
        for l in range(3):
            for i in range(4):
                busy = rng.sample(range(8), rng.choice([0, 0, 2, 4, 8]))
                out.append(view(node(f"s{s}l{l}n{i}", spine=f"s{s}", leaf=f"l{l}"), busy_gpus=busy, busy_nics=busy))
    return out


@pytest.mark.parametrize(
    "request_",
    [req(1, gpus=1), req(3, gpus=2, nics=2), req(2), req(5), req(9, gpus=4, nics=4), req(40, gpus=1)],
    ids=lambda r: r.describe(),
)
def test_ties_break_the_same_way_whatever_the_input_order(request_: PlacementRequest) -> None:
    nodes = mixed_fabric()
    first = place(request_, nodes)
    for seed in range(5):
        shuffled = list(nodes)
        random.Random(seed).shuffle(shuffled)
        assert place(request_, shuffled) == first
        assert place(request_, shuffled, FabricIndex.build(v.topology for v in shuffled)) == first


def test_index_reuse_gives_the_same_answer_and_refresh_keeps_unchanged_entries() -> None:
    nodes = mixed_fabric()
    index = FabricIndex.build(v.topology for v in nodes)
    assert place(req(5), nodes, index) == place(req(5), nodes)
    changed = node("s0l0n0", spine="s0", leaf="l0", gpus=4)
    topologies = [changed] + [v.topology for v in nodes[1:]]
    fresh = index.refreshed(topologies)
    assert len(fresh) == len(index)
    assert fresh.facts(nodes[1].topology) is index.facts(nodes[1].topology)
    assert fresh.facts(changed).gpu_ids == frozenset(range(4))


def test_duplicate_node_is_a_caller_bug() -> None:
    n = view(node("a"))
    with pytest.raises(ValueError, match="appears twice"):
        place(req(1), [n, n])


@pytest.mark.parametrize(
    "kwargs",
    [dict(members=0), dict(gpus_per_member=0), dict(rdma_nics_per_member=-1),
     dict(required=Level.LEAF, preferred=Level.SPINE)],
    ids=["no members", "no GPUs", "negative NICs", "preferred wider than required"],
)
def test_nonsense_request_is_refused(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = dict(gang="g", members=1, gpus_per_member=1)
    with pytest.raises(ValueError):
        PlacementRequest(**{**base, **kwargs})  # type: ignore[arg-type]


def test_request_from_spec() -> None:
    spec = parse_spec({
        "name": "llama", "members": 4,
        "resources": {"gpus": 8, "gpu_model": "H100", "rdma_nics": 8},
        "topology": {"required": "spine", "preferred": "leaf"},
    })
    r = PlacementRequest.from_spec("llama-1234abcd", spec, azs=frozenset({"az-a"}))
    assert r == PlacementRequest(
        gang="llama-1234abcd", members=4, gpus_per_member=8, rdma_nics_per_member=8, gpu_model="H100",
        required=Level.SPINE, preferred=Level.LEAF, allow_cross_az=False, azs=frozenset({"az-a"}),
    )
    region = parse_spec({"name": "x", "members": 1, "resources": {"gpus": 1}, "topology": {"required": "region"}})
    assert PlacementRequest.from_spec("x", region).may_span_azs


def test_by_az_groups_members_per_node() -> None:
    p = placed(place(req(3, gpus=4, nics=1, allow_cross_az=True),
                     [view(node("a", az="az-a")), view(node("b", az="az-b"))]))
    assert p.by_az() == {
        "az-a": {"a": ((0, 1, 2, 3, 4, 5, 6, 7), ("mlx5_0", "mlx5_4"))},
        "az-b": {"b": ((0, 1, 2, 3), ("mlx5_0",))},
    }
    assert p.azs() == frozenset({"az-a", "az-b"})


def test_shortfall_describe() -> None:
    s = Shortfall(Level.SPINE, "P10", 56, 64, 64, 7, 8, "")
    assert s.describe() == "spine P10: 56 of 64 GPUs free, 7 of 8 members fit"
    assert Shortfall(Level.LEAF, "x", 1, 8, 8, 0, 1, "7 GPUs short").describe().endswith("(7 GPUs short)")


def test_span_of() -> None:
    a, b = node("a", leaf="l1"), node("b", leaf="l2")
    assert span_of([(a, (0, 1))]) == (Level.NVLINK_DOMAIN, "az-a/a")
    assert span_of([(a, (0,)), (b, (0,))]) == (Level.SPINE, "az-a/s1")
    split = node("p", gpus=4, nics=4, islands=[0, 0, 1, 1])
    assert span_of([(split, (0, 2))]) == (Level.NODE, "az-a/p")


def test_required_node_shortfall_lists_nodes_too_full_for_one_member() -> None:
    result = place(req(1, required=Level.NODE), [view(node("a"), busy_gpus=[0, 1]), view(node("b"), busy_gpus=[0])])
    assert isinstance(result, Unplaceable)
    assert [s.describe() for s in result.shortfalls if s.level == Level.NODE] == [
        "node az-a/b: 7 of 8 GPUs free, 0 of 1 members fit (1 GPU short)",
        "node az-a/a: 6 of 8 GPUs free, 0 of 1 members fit (2 GPUs short)",
    ]


def _tamper(p: Placement, at: int, **changes: object) -> Placement:
    members = list(p.members)
    members[at] = replace(members[at], **changes)  # type: ignore[arg-type]
    return replace(p, members=tuple(members))


@pytest.mark.parametrize(
    "tamper, complaint",
    [
        (lambda p: p, None),
        (lambda p: _tamper(p, 1, gpus=p.members[0].gpus), "given twice"),
        (lambda p: _tamper(p, 0, gpus=(0, 1)), "not a free"),
        (lambda p: _tamper(p, 0, nics=("mlx5_7",)), "not free and usable"),
        (lambda p: _tamper(p, 1, rank=5), "ranks are"),
        (lambda p: _tamper(p, 1, node="nowhere"), "not in the inventory"),
        (lambda p: _tamper(p, 1, node="sick"), "not ready"),
        (lambda p: replace(p, span=Level.NODE), "span says"),
    ],
    ids=["sound plan", "GPU twice", "busy GPU", "DOWN NIC", "bad ranks", "unknown node", "not-ready node", "wrong span"],
)
def test_violations_name_every_broken_rule(tamper: Callable[[Placement], Placement], complaint: str | None) -> None:
    nodes = [view(node("a", down_nics=[7]), busy_gpus=[0, 1]), view(node("sick"), ready=False)]
    request = req(2, gpus=2, nics=1)
    p = placed(place(request, nodes))
    found = violations(request, tamper(p), nodes)
    if complaint is None:
        assert found == []
    else:
        assert any(complaint in v for v in found), found


# --- never fits -------------------------------------------------------------------------


def two_leaves(az: str = "az-a") -> list[NodeTopology]:
    """Four 8-GPU nodes, two per leaf: 32 GPUs in the AZ, 16 per leaf."""
    return [node(f"{az}-{leaf}-n{i}", az=az, leaf=leaf) for leaf in ("l1", "l2") for i in range(2)]


AZ_A = frozenset({"az-a"})


@pytest.mark.parametrize(
    "request_,nodes,expected",
    [
        pytest.param(req(4, azs=AZ_A), two_leaves(), "", id="fits the empty AZ: not never"),
        pytest.param(req(5, azs=AZ_A), two_leaves(),
                     "never fits: needs 40 GPUs, the most it may span holds 32 (az az-a)", id="more GPUs than the AZ"),
        pytest.param(req(3, required=Level.LEAF, azs=AZ_A), two_leaves(),
                     "never fits: needs 24 GPUs, the most it may span holds 16 (leaf az-a/s1/l1)",
                     id="required leaf: the largest leaf counts"),
        pytest.param(req(1, gpus=16, azs=AZ_A), two_leaves(),
                     "never fits: a member needs 16 GPUs on one node, the largest node in AZ az-a has 8",
                     id="member larger than any node"),
        pytest.param(req(1, gpus=8, nics=9, azs=AZ_A), two_leaves(),
                     "never fits: a member needs 9 RDMA NICs on one node, the most any node in AZ az-a with 8 GPUs has is 8",
                     id="more NICs per member than any node"),
        pytest.param(req(1, gpus=1, gpu_model="H200", azs=AZ_A), two_leaves(),
                     "never fits: no node in AZ az-a has a GPU of model 'H200' (models registered: NVIDIA H100 80GB HBM3)",
                     id="GPU model no node has"),
        pytest.param(req(1, gpus=4, gpu_model="h100", azs=AZ_A), two_leaves(), "", id="model matched case-insensitively"),
        pytest.param(req(1, azs=AZ_A), [], "", id="no node registered yet: nothing to judge against"),
        pytest.param(req(1, gpus=16, azs=AZ_A), two_leaves("az-b"), "",
                     id="nodes of other AZs do not count for a single-AZ gang"),
        pytest.param(req(3, gpus=5, azs=AZ_A), [node(f"n{i}") for i in range(2)],
                     "never fits: even with every registered node in AZ az-a ready and empty, no single az in AZs az-a "
                     "can host 3 × 5 GPU; closest: az az-a: 16 of 16 GPUs free, 2 of 3 members fit "
                     "(free GPUs fragmented over nodes: a member needs 5 on one node)",
                     id="enough GPUs, but one member per node"),
        pytest.param(req(6, allow_cross_az=True), two_leaves() + two_leaves("az-b"), "", id="cross-AZ: every AZ counts"),
        pytest.param(req(9, allow_cross_az=True), two_leaves() + two_leaves("az-b"),
                     "never fits: needs 72 GPUs, the most it may span holds 64 (region region)",
                     id="cross-AZ: the whole region is the most it may span"),
    ],
)
def test_never_fits_names_the_limit_the_gang_breaks(request_: PlacementRequest, nodes: list[NodeTopology],
                                                    expected: str) -> None:
    assert never_fits(request_, nodes) == expected
    # The verdict is placement on the empty inventory, so the two agree
    # (where anything is registered in scope).
    empty = drained([view(t, full=True) for t in nodes])
    if any(request_.azs is None or t.az in request_.azs for t in nodes):
        assert isinstance(place(request_, empty), Unplaceable) == bool(expected)


def test_never_fits_counts_nodes_that_are_not_ready() -> None:
    """The judge sees topologies only: a node that is down now still counts
    (it may come back), so a gang that needs it is not failed."""
    topos = two_leaves()
    now = [view(t) for t in topos[:2]] + [view(t, ready=False) for t in topos[2:]]
    assert isinstance(place(req(4, azs=AZ_A), now), Unplaceable)
    assert never_fits(req(4, azs=AZ_A), topos) == ""


def test_drained_frees_every_device_and_keeps_readiness() -> None:
    v = view(node("n0", down_nics=[7]), busy_gpus=[0, 1], busy_nics=[0], ready=False)
    (d,) = drained([v])
    assert d.free_gpus == frozenset(range(8)) and d.free_nics == frozenset(f"mlx5_{i}" for i in range(7))
    assert d.ready is False


def test_cross_az_shortfalls_list_each_az_after_the_region() -> None:
    nodes = [view(t) for t in two_leaves()] + [view(t, full=True) for t in two_leaves("az-b")]
    result = place(req(6, allow_cross_az=True), nodes)
    assert isinstance(result, Unplaceable)
    assert [(s.level, s.domain, s.members_fit) for s in result.shortfalls] == [
        (Level.REGION, "region", 4), (Level.AZ, "az-a", 4), (Level.AZ, "az-b", 0)]
