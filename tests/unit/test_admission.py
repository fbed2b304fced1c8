"""The AZ leader's admission decisions (pure)."""

from __future__ import annotations

from coordinator.core.admission import FailAdmission, KeepPending, Reserve, plan_admissions
from coordinator.core.placement import NodeView
from coordinator.core.records import GangRecord
from phalanx.model import GangState
from phalanx.spec import GangSpec, Policy, Resources
from phalanx.topology import Gpu, NodeTopology

AZ = "az-a"


def node(name: str, free: int = 8) -> NodeView:
    t = NodeTopology(node=name, az=AZ, spine="s", leaf="l", gpus=tuple(Gpu(index=i) for i in range(8)))
    return NodeView(topology=t, free_gpus=frozenset(range(free)), free_nics=frozenset())


def gang(gid: str, members: int, gpus: int, *, at: float, priority: int = 0, timeout: float = 600) -> GangRecord:
    spec = GangSpec(name=gid, members=members, resources=Resources(gpus=gpus), priority=priority,
                    policy=Policy(admission_timeout_s=timeout))
    return GangRecord(id=gid, spec=spec, state=GangState.PENDING, owner_az=AZ, submitted_at=at, updated_at=at)


def kinds(decisions) -> dict[str, str]:
    return {d.gang.id: type(d).__name__ for d in decisions}


def test_priority_then_age_orders_admission_and_capacity_is_taken_in_cycle() -> None:
    pending = [gang("young", 1, 8, at=20), gang("old", 1, 8, at=10), gang("vip", 1, 8, at=30, priority=5)]
    ds = plan_admissions(pending, [node("n0"), node("n1")], now=31, az=AZ)
    assert [d.gang.id for d in ds] == ["vip", "old", "young"]
    assert kinds(ds) == {"vip": "Reserve", "old": "Reserve", "young": "KeepPending"}
    used = [set((m.node, g) for m in d.placement.members for g in m.gpus) for d in ds if isinstance(d, Reserve)]
    assert not (used[0] & used[1]), "two gangs in one cycle never get the same GPU"


def test_small_gangs_backfill_behind_a_big_one_until_its_window_passes() -> None:
    big, small = gang("big", 3, 8, at=100), gang("small", 1, 1, at=101)
    nodes = [node("n0"), node("n1")]
    assert kinds(plan_admissions([big, small], nodes, now=110, az=AZ, backfill_window_s=30)) == {"big": "KeepPending", "small": "Reserve"}
    late = plan_admissions([big, small], nodes, now=200, az=AZ, backfill_window_s=30)
    assert kinds(late) == {"big": "KeepPending", "small": "KeepPending"}
    assert "waiting behind older gang big" in [d for d in late if d.gang.id == "small"][0].reason


def test_admission_timeout_fails_the_gang_with_the_reason() -> None:
    ds = plan_admissions([gang("slow", 9, 8, at=0, timeout=60)], [node("n0")], now=61, az=AZ)
    assert isinstance(ds[0], FailAdmission) and "admission_timeout_s=60" in ds[0].reason


def test_unplaceable_gang_keeps_pending_with_shortfall_numbers() -> None:
    ds = plan_admissions([gang("wide", 3, 8, at=0)], [node("n0"), node("n1", free=4)], now=1, az=AZ)
    assert isinstance(ds[0], KeepPending)
    assert ds[0].shortfalls and ds[0].shortfalls[0].gpus_free == 12
