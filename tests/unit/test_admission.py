"""The AZ leader's admission decisions (pure; docs/admission.md)."""

from __future__ import annotations

import pytest

from coordinator.core.admission import FailAdmission, KeepPending, Reserve, plan_admissions
from coordinator.core.placement import NodeView
from coordinator.core.records import GangRecord
from phalanx.model import GangState
from phalanx.spec import GangSpec, Policy, Resources
from phalanx.topology import Gpu, NodeTopology

AZ = "az-a"
WINDOW = 30.0


def topo(name: str, leaf: str = "l") -> NodeTopology:
    return NodeTopology(node=name, az=AZ, spine="s", leaf=leaf, gpus=tuple(Gpu(index=i, model="H100") for i in range(8)))


def node(name: str, free: int = 8, leaf: str = "l") -> NodeView:
    return NodeView(topology=topo(name, leaf), free_gpus=frozenset(range(free)), free_nics=frozenset())


def gang(gid: str, members: int, gpus: int, *, at: float, priority: int = 0, timeout: float = 600, model: str = "",
         not_before: float = 0.0) -> GangRecord:
    spec = GangSpec(name=gid, members=members, resources=Resources(gpus=gpus, gpu_model=model), priority=priority,
                    policy=Policy(admission_timeout_s=timeout))
    return GangRecord(id=gid, spec=spec, state=GangState.PENDING, owner_az=AZ, submitted_at=at, updated_at=at,
                      not_before=not_before)


def kinds(decisions) -> dict[str, str]:
    return {d.gang.id: type(d).__name__ for d in decisions}


def by_id(decisions, gid: str):
    return next(d for d in decisions if d.gang.id == gid)


def plan(pending, nodes, now, registered=None, **kw):
    return plan_admissions(pending, nodes, now, az=AZ, backfill_window_s=WINDOW, registered=registered, **kw)


def test_priority_then_age_orders_admission_and_capacity_is_taken_in_cycle() -> None:
    pending = [gang("young", 1, 8, at=20), gang("old", 1, 8, at=10), gang("vip", 1, 8, at=30, priority=5)]
    ds = plan(pending, [node("n0"), node("n1")], now=31)
    assert [d.gang.id for d in ds] == ["vip", "old", "young"]
    assert kinds(ds) == {"vip": "Reserve", "old": "Reserve", "young": "KeepPending"}
    used = [set((m.node, g) for m in d.placement.members for g in m.gpus) for d in ds if isinstance(d, Reserve)]
    assert not (used[0] & used[1]), "two gangs in one cycle never get the same GPU"
    young = by_id(ds, "young")
    assert (young.position, young.queue) == (3, 3)


# One table for the head-of-line rules. Nodes: name -> free GPUs ("!" suffix:
# registered but not ready, so not placeable). Each row: the queue (id,
# members, gpus, submitted at; all 8-GPU nodes), now, whether never-fits is
# judged, and the decision kind per gang; `held` is which gang is held back
# by whose kept nodes.
@pytest.mark.parametrize(
    "nodes,queue,now,judge,expected,held",
    [
        pytest.param({"n0": 8, "n1": 8}, [("big", 3, 8, 100), ("small", 1, 1, 101)], 110, True,
                     {"big": "FailAdmission", "small": "Reserve"}, {},
                     id="issue 12 repro: 3x8 into 16 GPUs never fits, fails at once; the 1-GPU gang runs"),
        pytest.param({"n0": 8, "n1": 8}, [("big", 3, 8, 100), ("small", 1, 1, 101)], 200, False,
                     {"big": "KeepPending", "small": "Reserve"}, {},
                     id="not judged yet (start-up grace): it still holds nobody back past its window"),
        pytest.param({"n0": 8, "n1": 8, "n2!": 8}, [("big", 3, 8, 100), ("small", 1, 1, 101)], 200, True,
                     {"big": "KeepPending", "small": "Reserve"}, {},
                     id="fits some day (a node is down), not on the ready nodes: keeps nothing"),
        pytest.param({"n0": 0, "n1": 8}, [("big", 2, 8, 100), ("small", 1, 1, 101)], 110, True,
                     {"big": "KeepPending", "small": "Reserve"}, {},
                     id="inside its backfill window: smaller gangs go first"),
        pytest.param({"n0": 0, "n1": 8}, [("big", 2, 8, 100), ("small", 1, 1, 101)], 200, True,
                     {"big": "KeepPending", "small": "KeepPending"}, {"small": "big"},
                     id="past its window: the nodes it needs are kept for it (starvation guard)"),
        pytest.param({"n0": 0, "n1": 4, "n2/l2": 8}, [("big", 2, 8, 100), ("other", 1, 8, 101), ("small", 1, 4, 102)],
                     200, True, {"big": "KeepPending", "other": "Reserve", "small": "KeepPending"}, {"small": "big"},
                     id="past its window: gangs behind still use nodes it does not need"),
        pytest.param({"n0": 0, "n1": 4, "n2/l2": 8}, [("big", 2, 8, 100), ("other", 1, 8, 101), ("small", 1, 4, 102)],
                     110, True, {"big": "KeepPending", "other": "Reserve", "small": "Reserve"}, {},
                     id="the same queue inside the window: everything that fits goes"),
    ],
)
def test_head_of_line_rules(nodes: dict[str, int], queue, now: float, judge: bool, expected: dict[str, str],
                            held: dict[str, str]) -> None:
    views, registered = [], []
    for spec, free in nodes.items():
        name, _, leaf = spec.rstrip("!").partition("/")
        v = node(name, free, leaf or "l")
        registered.append(v.topology)
        if not spec.endswith("!"):
            views.append(v)
    pending = [gang(g, m, n, at=at) for g, m, n, at in queue]
    ds = plan(pending, views, now, registered if judge else None)
    assert kinds(ds) == expected, [d.reason for d in ds]
    assert {d.gang.id: d.held_by for d in ds if isinstance(d, KeepPending) and d.held_by} == held
    for d in ds:
        if isinstance(d, KeepPending) and d.held_by:
            assert f"nodes kept for older gang {d.held_by}" in d.reason and "backfill" in d.reason
        if isinstance(d, Reserve):
            kept = {n for x in ds if isinstance(x, KeepPending) for n in x.keeps}
            assert not {m.node for m in d.placement.members} & kept, "a backfilled gang never lands on kept nodes"


def test_the_never_fits_reason_names_what_it_needs_and_the_most_it_may_span() -> None:
    ds = plan([gang("big", 3, 8, at=0)], [node("n0"), node("n1")], 1, [topo("n0"), topo("n1")])
    d = ds[0]
    assert isinstance(d, FailAdmission) and d.never_fits
    assert d.reason == "never fits: needs 24 GPUs, the most it may span holds 16 (az az-a)"


def test_a_gpu_model_no_node_has_never_fits_and_blocks_nobody() -> None:
    pending = [gang("odd", 1, 1, at=0, model="MI300X"), gang("small", 1, 1, at=1)]
    ds = plan(pending, [node("n0")], 100, [topo("n0")])
    assert kinds(ds) == {"odd": "FailAdmission", "small": "Reserve"}
    assert "no node in AZ az-a has a GPU of model 'MI300X'" in by_id(ds, "odd").reason


def test_the_head_past_its_window_says_which_nodes_it_keeps() -> None:
    ds = plan([gang("big", 2, 8, at=100)], [node("n0", 0), node("n1")], 200, [topo("n0"), topo("n1")])
    d = ds[0]
    assert isinstance(d, KeepPending) and d.keeps == ("n0", "n1")
    assert "past backfill_window_s=30s: nodes n0, n1 are kept for it" in d.reason


def test_a_head_that_needs_down_nodes_says_it_holds_nobody_back() -> None:
    ds = plan([gang("big", 3, 8, at=100)], [node("n0"), node("n1")], 200, [topo("n0"), topo("n1"), topo("n2")])
    assert "keeps no nodes and holds back no gang behind it" in ds[0].reason


def test_restart_backoff_keeps_pending_and_blocks_nobody() -> None:
    pending = [gang("again", 2, 8, at=0, not_before=105), gang("small", 1, 8, at=1)]
    ds = plan(pending, [node("n0"), node("n1")], 100, [topo("n0"), topo("n1")])
    assert kinds(ds) == {"again": "KeepPending", "small": "Reserve"}
    assert by_id(ds, "again").reason == "restart backoff: not re-placed for 5.0s"


def test_never_fits_verdicts_are_remembered_by_shape() -> None:
    memo: dict = {}
    pending = [gang(f"g{i}", 3, 8, at=i) for i in range(3)]
    ds = plan(pending, [node("n0"), node("n1")], 10, [topo("n0"), topo("n1")], verdicts=memo)
    assert kinds(ds) == {f"g{i}": "FailAdmission" for i in range(3)}
    assert len(memo) == 1 and next(iter(memo.values())).startswith("never fits")
    # A kept memo answers without judging again: a planted verdict is used.
    memo[next(iter(memo))] = "never fits: planted"
    assert plan(pending[:1], [node("n0")], 10, [topo("n0")], verdicts=memo)[0].reason == "never fits: planted"


def test_admission_timeout_fails_the_gang_with_the_reason() -> None:
    ds = plan([gang("slow", 2, 8, at=0, timeout=60)], [node("n0", 0), node("n1")], now=61)
    assert isinstance(ds[0], FailAdmission) and "admission_timeout_s=60" in ds[0].reason and not ds[0].never_fits


def test_unplaceable_gang_keeps_pending_with_shortfall_numbers() -> None:
    ds = plan([gang("wide", 3, 8, at=0)], [node("n0"), node("n1", free=4)], now=1)
    assert isinstance(ds[0], KeepPending)
    assert ds[0].shortfalls and ds[0].shortfalls[0].gpus_free == 12
