"""One admission order for single- and cross-AZ gangs (pure; docs/admission.md "One order").

The AZ leader's plan ranks every gang it owns by (priority, submit time, id);
a single-AZ gang is placed on this AZ's nodes only, a cross-AZ gang on every
AZ's, and both go through the same rules (timeout, never fits, backoff,
backfill).
"""

from __future__ import annotations

from coordinator.core.admission import FailAdmission, KeepPending, Reserve, plan_admissions, without
from coordinator.core.placement import NodeView
from coordinator.core.records import GangRecord
from phalanx.model import GangState
from phalanx.spec import GangSpec, Policy, Resources, Topology
from phalanx.topology import Gpu, NodeTopology

AZ = "az-a"
WINDOW = 30.0


def topo(name: str, az: str = AZ) -> NodeTopology:
    return NodeTopology(node=name, az=az, spine=f"s-{az}", leaf=f"l-{az}",
                        gpus=tuple(Gpu(index=i, model="H100") for i in range(8)))


def node(name: str, az: str = AZ, free: int = 8, ready: bool = True) -> NodeView:
    return NodeView(topology=topo(name, az), free_gpus=frozenset(range(free)), free_nics=frozenset(), ready=ready)


def gang(gid: str, members: int, gpus: int, *, at: float, cross: bool = False, priority: int = 0,
         timeout: float = 600, state: GangState = GangState.PENDING, not_before: float = 0.0) -> GangRecord:
    spec = GangSpec(name=gid, members=members, resources=Resources(gpus=gpus), priority=priority,
                    policy=Policy(admission_timeout_s=timeout), topology=Topology(allow_cross_az=cross))
    return GangRecord(id=gid, spec=spec, state=state, owner_az=AZ, submitted_at=at, updated_at=at,
                      not_before=not_before)


def plan(pending, nodes, now, registered=None):
    return plan_admissions(pending, nodes, now, az=AZ, backfill_window_s=WINDOW, registered=registered)


def by_id(decisions, gid: str):
    return next(d for d in decisions if d.gang.id == gid)


def test_an_older_cross_az_gang_is_not_overtaken_by_a_younger_single_az_gang_for_the_same_devices() -> None:
    # n0 is this AZ's only node; the cross-AZ gang needs it and b's node.
    nodes = [node("n0"), node("m0", "az-b")]
    ds = plan([gang("young-local", 1, 8, at=20), gang("old-span", 2, 8, at=10, cross=True)], nodes, now=21)
    assert [d.gang.id for d in ds] == ["old-span", "young-local"]
    span = by_id(ds, "old-span")
    assert isinstance(span, Reserve) and span.placement.azs() == frozenset({AZ, "az-b"})
    assert isinstance(by_id(ds, "young-local"), KeepPending), "the cross-AZ gang took n0 first"


def test_a_higher_priority_single_az_gang_goes_first_and_the_cross_az_gang_waits() -> None:
    nodes = [node("n0"), node("m0", "az-b")]
    ds = plan([gang("span", 2, 8, at=10, cross=True), gang("vip", 1, 8, at=20, priority=5)], nodes, now=21)
    assert [type(d) for d in ds] == [Reserve, KeepPending]
    assert ds[0].gang.id == "vip" and ds[1].gang.id == "span"
    assert ds[1].position == 2 and ds[1].queue == 2


def test_a_single_az_gang_never_places_on_another_az_even_when_only_that_has_room() -> None:
    ds = plan([gang("local", 1, 8, at=10)], [node("n0", free=0), node("m0", "az-b")], now=11)
    assert isinstance(ds[0], KeepPending), ds[0]


def test_equal_node_names_in_two_azs_are_two_nodes() -> None:
    # Both AZs name their node n0: taking a's n0 must not take b's.
    nodes = [node("n0"), node("n0", "az-b"), node("n0", "az-c")]
    ds = plan([gang("s1", 2, 8, at=1, cross=True), gang("s2", 1, 8, at=2, cross=True)], nodes, now=3)
    assert all(isinstance(d, Reserve) for d in ds), ds
    taken = [{(m.az, m.node) for m in d.placement.members} for d in ds]
    assert not (taken[0] & taken[1]) and len(taken[0] | taken[1]) == 3


def test_a_cross_az_gang_between_two_attempts_is_planned_like_a_pending_one() -> None:
    # RESERVING: its last attempt was aborted; the caller passes it because
    # its owner waits for a placement again.
    ds = plan([gang("span", 2, 8, at=1, cross=True, state=GangState.RESERVING)],
              [node("n0"), node("m0", "az-b")], now=2)
    assert isinstance(ds[0], Reserve)


def test_the_admission_timeout_applies_to_cross_az_gangs_too() -> None:
    ds = plan([gang("span", 2, 8, at=0, cross=True, timeout=5)], [node("n0", free=0), node("m0", "az-b", free=0)],
              now=6)
    assert isinstance(ds[0], FailAdmission) and "admission_timeout_s=5" in ds[0].reason


def test_never_fits_of_a_cross_az_gang_counts_every_az_and_of_a_single_az_gang_only_its_own() -> None:
    registered = [topo("n0"), topo("m0", "az-b")]
    views = [node("n0", free=0), node("m0", "az-b", free=0)]
    ds = plan([gang("span", 2, 8, at=1, cross=True), gang("local", 2, 8, at=2)], views, now=3, registered=registered)
    assert isinstance(by_id(ds, "span"), KeepPending), "16 GPUs exist over two AZs: it may fit later"
    local = by_id(ds, "local")
    assert isinstance(local, FailAdmission) and local.never_fits, local


def test_restart_backoff_holds_a_cross_az_gang_too() -> None:
    ds = plan([gang("span", 2, 8, at=1, cross=True, not_before=50)], [node("n0"), node("m0", "az-b")], now=10)
    assert isinstance(ds[0], KeepPending) and ds[0].rule.startswith("restart backoff")


def test_a_cross_az_head_past_its_window_keeps_nodes_where_draining_this_az_makes_it_fit() -> None:
    # The head needs 8 GPUs of this AZ and 8 of b's. b's node is free now;
    # this AZ's n0 has only 4 free (a running gang holds the rest). Draining
    # this AZ makes it fit, so it keeps what it would take (n0 and b's m0),
    # and a younger local gang that would fit on n0's free half is held
    # back; explain names b's node with its AZ.
    nodes = [node("n0", free=4), node("m0", "az-b")]
    ds = plan([gang("span", 2, 8, at=0, cross=True), gang("small", 1, 4, at=40)], nodes, now=41)
    head = by_id(ds, "span")
    assert isinstance(head, KeepPending) and head.keeps == ("az-b/m0", "n0"), head
    small = by_id(ds, "small")
    assert isinstance(small, KeepPending) and small.held_by == "span", small


def test_a_cross_az_head_keeps_nothing_here_when_its_shortfall_is_in_another_az() -> None:
    # b's node is full: only b's leader could drain it, and it does not hold
    # its gangs back for an AZ it does not own. Keeping n0 would idle it for
    # nothing, so the younger local gang gets n0.
    nodes = [node("n0"), node("m0", "az-b", free=0)]
    ds = plan([gang("span", 2, 8, at=0, cross=True), gang("small", 1, 8, at=40)], nodes, now=41)
    head = by_id(ds, "span")
    assert isinstance(head, KeepPending) and head.keeps == () and "other AZs' stayed as they are" in head.reason, head
    assert isinstance(by_id(ds, "small"), Reserve)


def test_devices_of_attempts_in_flight_are_not_free_in_the_next_cycle() -> None:
    # A cross-AZ attempt placed by an earlier cycle holds GPUs 0-7 of n0 and
    # of b's n0 before any hold shows: the next cycle's view must not offer
    # them, and only the matching (AZ, node) loses them.
    views = [node("n0"), node("n0", "az-b"), node("n0", "az-c")]
    taken = {(AZ, "n0"): (tuple(range(8)), ()), ("az-b", "n0"): (tuple(range(4)), ())}
    left = {(v.az, v.name): v.free_gpus for v in without(views, taken)}
    assert left == {(AZ, "n0"): frozenset(), ("az-b", "n0"): frozenset(range(4, 8)), ("az-c", "n0"): frozenset(range(8))}
    queue = [gang("local", 1, 8, at=1), gang("span", 2, 8, at=2, cross=True)]
    assert all(isinstance(d, KeepPending) for d in plan(queue, without(views, taken), now=3)), \
        "only az-c's n0 is whole: neither gang fits"
    assert all(isinstance(d, Reserve) for d in plan(queue, views, now=3)), "without the attempt both would"
