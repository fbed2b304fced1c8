"""The one free-capacity view (coordinator/core/capacity.py): what is free on
a node, from its topology and the holds on it, as placement, the cross-AZ
view and explain from etcd all read it."""

from __future__ import annotations

import pytest

from coordinator.core.capacity import free_view, held, unready_views
from coordinator.core.records import NodeRecord
from phalanx.reservation import NodeDevices
from phalanx.topology import Gpu, Nic, NodeTopology


def node(name: str, az: str = "a", gpus: int = 4, nics: tuple[tuple[str, str], ...] = (("mlx5_0", "ACTIVE"), ("mlx5_1", "ACTIVE"))) -> NodeTopology:
    return NodeTopology(node=name, az=az, gpus=tuple(Gpu(index=i) for i in range(gpus)),
                        nics=tuple(Nic(name=n, state=s) for n, s in nics))


@pytest.mark.parametrize("holds, expected", [
    ([], {}),
    ([("a", {"n0": NodeDevices((1, 0), ("mlx5_0",))})], {("a", "n0"): NodeDevices((0, 1), ("mlx5_0",))}),
    ([("a", {"n0": NodeDevices((0,))}), ("a", {"n0": NodeDevices((2,), ("mlx5_1",))})],
     {("a", "n0"): NodeDevices((0, 2), ("mlx5_1",))}),
    # Overlapping holds (the invariants forbid them) take the union, once.
    ([("a", {"n0": NodeDevices((0, 1))}), ("a", {"n0": NodeDevices((1,))})], {("a", "n0"): NodeDevices((0, 1))}),
    # Same node name in two AZs: two nodes.
    ([("a", {"n0": NodeDevices((0,))}), ("b", {"n0": NodeDevices((3,))})],
     {("a", "n0"): NodeDevices((0,)), ("b", "n0"): NodeDevices((3,))}),
    # Plain (gpus, nics) tuples, as the two-phase cores' slices hold them.
    ([("a", {"n0": ((3,), ())})], {("a", "n0"): NodeDevices((3,))}),
], ids=["nothing-held", "one-hold-sorted", "two-holds-one-node", "overlap-counted-once",
        "same-name-other-az", "plain-tuples"])
def test_held_unions_devices_per_az_and_node(holds, expected) -> None:  # type: ignore[no-untyped-def]
    assert held(holds) == expected


@pytest.mark.parametrize("nodes, taken, expected", [
    ([(node("n0"), True)], {}, [("n0", {0, 1, 2, 3}, {"mlx5_0", "mlx5_1"}, True)]),
    ([(node("n0"), True)], {("a", "n0"): NodeDevices((0, 2), ("mlx5_1",))},
     [("n0", {1, 3}, {"mlx5_0"}, True)]),
    # A device held that the node does not list takes nothing else.
    ([(node("n0", gpus=2), True)], {("a", "n0"): NodeDevices((5,), ("ib9",))},
     [("n0", {0, 1}, {"mlx5_0", "mlx5_1"}, True)]),
    # A NIC that is down is never free.
    ([(node("n0", nics=(("mlx5_0", "DOWN"), ("mlx5_1", "ACTIVE"))), True)], {},
     [("n0", {0, 1, 2, 3}, {"mlx5_1"}, True)]),
    # Holds on a node of the same name in another AZ do not count.
    ([(node("n0", az="a"), True), (node("n0", az="b"), False)], {("b", "n0"): NodeDevices((0, 1, 2, 3))},
     [("n0", {0, 1, 2, 3}, {"mlx5_0", "mlx5_1"}, True), ("n0", set(), {"mlx5_0", "mlx5_1"}, False)]),
    # Order is the caller's; readiness is passed through.
    ([(node("n2"), False), (node("n1"), True)], {("a", "n1"): NodeDevices((0, 1, 2, 3), ("mlx5_0", "mlx5_1"))},
     [("n2", {0, 1, 2, 3}, {"mlx5_0", "mlx5_1"}, False), ("n1", set(), set(), True)]),
], ids=["all-free", "held-taken", "unknown-devices-ignored", "down-nic-not-free", "az-scoped", "order-and-ready-kept"])
def test_free_view(nodes, taken, expected) -> None:  # type: ignore[no-untyped-def]
    views = free_view(nodes, taken)
    assert [(v.name, set(v.free_gpus), set(v.free_nics), v.ready) for v in views] == expected
    assert [v.topology for v in views] == [t for t, _ in nodes]


def record(name: str, *, cordoned: bool = False, expired: bool = False) -> NodeRecord:
    return NodeRecord(topology=node(name), ready=True, cordoned=cordoned, expired=expired)


@pytest.mark.parametrize("records, placeable, expected", [
    ({}, set(), []),
    ({"n0": record("n0")}, set(), ["n0"]),
    # A placeable node is in the live view already.
    ({"n0": record("n0"), "n1": record("n1")}, {"n0"}, ["n1"]),
    # Cordoned and expired nodes take no work: not counted at all.
    ({"n0": record("n0", cordoned=True), "n1": record("n1", expired=True), "n2": record("n2")}, set(), ["n2"]),
    # A placeable name with no record adds nothing; the records' order is kept.
    ({"n2": record("n2"), "n1": record("n1")}, {"n9"}, ["n2", "n1"]),
], ids=["none", "not-placeable", "placeable-left-out", "cordoned-expired-left-out", "order-kept"])
def test_unready_views(records, placeable, expected) -> None:  # type: ignore[no-untyped-def]
    views = unready_views(records, placeable)
    assert [v.name for v in views] == expected
    assert all(not v.ready and not v.free_gpus and not v.free_nics for v in views)
    assert [v.topology for v in views] == [records[n].topology for n in expected]
