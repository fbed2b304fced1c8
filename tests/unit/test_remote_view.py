"""The other AZs' inventory (coordinator/remote_view.py, docs/design.md §19.10):
fed by real etcd key/value records (NodeRecord and Reservation dicts as the
AZ leaders write them), it ignores this AZ's keys, skips unreadable records,
says when the admission cycle must wake, bumps its version when the set of
registered topologies changes, and rebuilds its cached view only when
something it is built from changed."""

from __future__ import annotations

import json

import pytest

from coordinator.core.placement import FabricIndex, Placement, PlacementRequest, place
from coordinator.core.records import NodeRecord
from coordinator.remote_view import RemoteInventory
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.store import KV, Keys
from phalanx.topology import Gpu, Nic, NodeTopology

KEYS = Keys("c1")
HERE = "a"


def topo(node: str, az: str = "b", gpus: int = 4) -> NodeTopology:
    return NodeTopology(node=node, az=az, gpus=tuple(Gpu(index=i) for i in range(gpus)),
                        nics=(Nic(name="mlx5_0", state="ACTIVE"), Nic(name="mlx5_1", state="ACTIVE")))


def kv(key: str, doc: object, rev: int = 1) -> KV:
    return KV(key=key, value=json.dumps(doc).encode(), create_revision=rev, mod_revision=rev, version=1, lease=0)


def node_kv(node: str, az: str = "b", ready: bool = True, gpus: int = 4, heartbeat: float = 0.0, rev: int = 1) -> KV:
    rec = NodeRecord(topology=topo(node, az, gpus), ready=ready, agent_id=f"agent-{node}", last_heartbeat=heartbeat)
    return kv(KEYS.node(az, node), rec.to_dict(), rev)


def hold_kv(gang: str, nodes: dict[str, tuple[tuple[int, ...], tuple[str, ...]]], az: str = "b",
            state: HoldState = HoldState.PREPARED, rev: int = 1) -> KV:
    r = Reservation(az, gang, 0, state, {n: NodeDevices(*d) for n, d in nodes.items()}, epoch=7,
                    two_phase=True, owner_az="a")
    return kv(KEYS.reservation(az, gang), r.to_dict(), rev)


def leader_kv(az: str, epoch: int = 1, rev: int | None = None) -> KV:
    """leader/<az> as its leader writes it: created at ``epoch`` (its create
    revision), last written at ``rev``."""
    return KV(key=KEYS.leader(az), value=json.dumps({"id": f"coord-{az}"}).encode(), create_revision=epoch,
              mod_revision=rev if rev is not None else epoch, version=1, lease=0)


def inventory(*azs_led: str) -> RemoteInventory:
    inv = RemoteInventory(HERE, KEYS)
    for az in azs_led:
        inv.on_leader(az, leader_kv(az), 0.0)
    return inv


def free(inv: RemoteInventory) -> dict[tuple[str, str], tuple[set[int], bool]]:
    return {(v.az, v.name): (set(v.free_gpus), v.ready) for v in inv.view()}


# --- node records -------------------------------------------------------------


@pytest.mark.parametrize("steps, wakes, nodes, version", [
    # A new node wakes the cycle (it may fit a waiting gang) and is registered.
    ([("put", node_kv("n0"))], [True], {("b", "n0"): ({0, 1, 2, 3}, True)}, 1),
    # A node that is not ready wakes too (never-fits may now be judged), placed on it is not.
    ([("put", node_kv("n0", ready=False))], [True], {("b", "n0"): ({0, 1, 2, 3}, False)}, 1),
    # A heartbeat re-write changes nothing placement sees: no wake, no version.
    ([("put", node_kv("n0")), ("put", node_kv("n0", heartbeat=99.0, rev=2))], [True, False],
     {("b", "n0"): ({0, 1, 2, 3}, True)}, 1),
    # Readiness flips wake (up) and change the view, not the registered set.
    ([("put", node_kv("n0")), ("put", node_kv("n0", ready=False, rev=2)), ("put", node_kv("n0", rev=3))],
     [True, True, True], {("b", "n0"): ({0, 1, 2, 3}, True)}, 1),
    # A new topology (more GPUs) wakes and bumps the version.
    ([("put", node_kv("n0")), ("put", node_kv("n0", gpus=8, rev=2))], [True, True],
     {("b", "n0"): (set(range(8)), True)}, 2),
    # A delete shrinks capacity (no wake) and the registered set (version).
    ([("put", node_kv("n0")), ("delete", node_kv("n0"))], [True, False], {}, 2),
    # Deleting an unknown node changes nothing.
    ([("delete", node_kv("n9"))], [False], {}, 0),
    # This AZ's own records belong to the leader's view: ignored.
    ([("put", node_kv("n0", az=HERE)), ("delete", node_kv("n0", az=HERE))], [False, False], {}, 0),
    # The same node name in two other AZs: two nodes.
    ([("put", node_kv("n0", az="b")), ("put", node_kv("n0", az="c"))], [True, True],
     {("b", "n0"): ({0, 1, 2, 3}, True), ("c", "n0"): ({0, 1, 2, 3}, True)}, 2),
], ids=["new-node", "new-not-ready", "heartbeat", "ready-flips", "new-topology", "delete", "delete-unknown",
        "this-az-ignored", "same-name-two-azs"])
def test_node_records(steps, wakes, nodes, version) -> None:  # type: ignore[no-untyped-def]
    inv = inventory("a", "b", "c")
    got = [inv.on_node(k.key, k if kind == "put" else None) for kind, k in steps]
    assert got == wakes
    assert free(inv) == nodes
    assert inv.version == version
    assert {(t.az, t.node) for t in inv.registered()} == set(nodes)


def test_cordoned_and_expired_nodes_are_not_placed_on_nor_registered_for_never_fits() -> None:
    """docs/nodes.md: another AZ's cordoned or expired node leaves the
    never-fits set (a version bump, so memoised verdicts are judged again)
    and is not placed on; back in service, it returns to both."""
    inv = inventory("a", "b")

    def put(node: str, rev: int, **flags: bool) -> bool:
        rec = NodeRecord(topology=topo(node), ready=not flags.get("expired", False), **flags)
        return inv.on_node(KEYS.node("b", node), kv(KEYS.node("b", node), rec.to_dict(), rev))

    assert put("n0", 1) and put("n1", 1)
    before = inv.version
    assert put("n0", 2, cordoned=True)
    assert put("n1", 2, expired=True)
    assert inv.version == before + 2
    assert inv.registered() == ()
    assert {k: ready for k, (_, ready) in free(inv).items()} == {("b", "n0"): False, ("b", "n1"): False}
    assert put("n0", 3) and put("n1", 3)
    assert {t.node for t in inv.registered()} == {"n0", "n1"}
    assert {k: ready for k, (_, ready) in free(inv).items()} == {("b", "n0"): True, ("b", "n1"): True}


@pytest.mark.parametrize("doc", [b"not json", json.dumps({"ready": True}).encode(),
                                 json.dumps({"topology": {"az": "b"}, "ready": True}).encode()],
                         ids=["not-json", "no-topology", "topology-without-node"])
def test_unreadable_node_record_is_skipped_and_the_last_readable_one_stays(doc: bytes, caplog) -> None:  # type: ignore[no-untyped-def]
    inv = inventory("b")
    inv.on_node(KEYS.node("b", "n0"), node_kv("n0"))
    bad = KV(key=KEYS.node("b", "n0"), value=doc, create_revision=1, mod_revision=2, version=2, lease=0)
    assert inv.on_node(bad.key, bad) is False
    assert free(inv) == {("b", "n0"): ({0, 1, 2, 3}, True)}
    assert inv.version == 1
    assert "skipped unreadable node record" in caplog.text
    # An unreadable record of a node never seen adds nothing.
    other = KV(key=KEYS.node("b", "n1"), value=doc, create_revision=1, mod_revision=2, version=1, lease=0)
    assert inv.on_node(other.key, other) is False
    assert inv.node("b", "n1") is None


@pytest.mark.parametrize("key", [KEYS.nodes() + "b", KEYS.nodes() + "b/", KEYS.nodes() + "/n0"],
                         ids=["no-node", "empty-node", "empty-az"])
def test_malformed_keys_are_ignored(key: str) -> None:
    inv = inventory("b")
    assert inv.on_node(key, kv(key, NodeRecord(topology=topo("n0"), ready=True).to_dict())) is False
    assert inv.view() == ()


def test_node_record_is_kept_for_the_rendezvous_with_a_stable_topology() -> None:
    inv = inventory("b")
    inv.on_node(KEYS.node("b", "n0"), node_kv("n0"))
    first = inv.node("b", "n0")
    inv.on_node(KEYS.node("b", "n0"), node_kv("n0", heartbeat=5.0, rev=9))
    now = inv.node("b", "n0")
    assert first is not None and now is not None
    assert now.mod_revision == 9 and now.last_heartbeat == 5.0
    assert now.topology is first.topology  # same object: the index and caches match it by identity
    assert inv.node("c", "n0") is None


# --- reservations -------------------------------------------------------------


@pytest.mark.parametrize("steps, wakes, free_n0", [
    # A new hold takes devices: nothing new fits, no wake.
    ([("put", hold_kv("g1", {"n0": ((0, 1), ("mlx5_0",))}))], [False], {2, 3}),
    # Same devices, new state: no wake, same view.
    ([("put", hold_kv("g1", {"n0": ((0, 1), ())})), ("put", hold_kv("g1", {"n0": ((1, 0), ())}, state=HoldState.COMMITTED))],
     [False, False], {2, 3}),
    # Fewer devices held: wake.
    ([("put", hold_kv("g1", {"n0": ((0, 1), ())})), ("put", hold_kv("g1", {"n0": ((0,), ())}, state=HoldState.RELEASING))],
     [False, True], {1, 2, 3}),
    # The hold goes: wake, all free.
    ([("put", hold_kv("g1", {"n0": ((0, 1), ())})), ("delete", hold_kv("g1", {}))], [False, True], {0, 1, 2, 3}),
    # Deleting a hold never seen: nothing.
    ([("delete", hold_kv("g9", {}))], [False], {0, 1, 2, 3}),
    # Two holds on one node both count.
    ([("put", hold_kv("g1", {"n0": ((0,), ())})), ("put", hold_kv("g2", {"n0": ((3,), ())}))], [False, False], {1, 2}),
    # This AZ's reservations are the leader's business: ignored.
    ([("put", hold_kv("g1", {"n0": ((0, 1, 2, 3), ())}, az=HERE))], [False], {0, 1, 2, 3}),
], ids=["new-hold", "state-change", "shrinks", "deleted", "delete-unknown", "two-holds", "this-az-ignored"])
def test_reservations(steps, wakes, free_n0) -> None:  # type: ignore[no-untyped-def]
    inv = inventory("b")
    inv.on_node(KEYS.node("b", "n0"), node_kv("n0"))
    got = [inv.on_reservation(k.key, k if kind == "put" else None) for kind, k in steps]
    assert got == wakes
    assert free(inv)[("b", "n0")] == (free_n0, True)
    assert inv.version == 1  # holds never change the registered set


def test_unreadable_reservation_keeps_the_devices_it_held(caplog) -> None:  # type: ignore[no-untyped-def]
    inv = inventory("b")
    inv.on_node(KEYS.node("b", "n0"), node_kv("n0"))
    inv.on_reservation(KEYS.reservation("b", "g1"), hold_kv("g1", {"n0": ((0, 1), ())}))
    bad = kv(KEYS.reservation("b", "g1"), {"az": "b", "gang": "g1", "nodes": {"n0": {"gpus": ["x"]}}}, rev=2)
    assert inv.on_reservation(bad.key, bad) is False
    assert free(inv)[("b", "n0")] == ({2, 3}, True)
    assert "skipped unreadable reservation" in caplog.text


# --- leaders ------------------------------------------------------------------


def test_an_az_without_a_leader_is_not_placed_on_and_wakes_when_it_gets_one() -> None:
    inv = inventory()
    inv.on_node(KEYS.node("b", "n0"), node_kv("n0"))
    assert free(inv) == {("b", "n0"): ({0, 1, 2, 3}, False)}
    assert inv.on_leader("b", leader_kv("b"), 0.0) is True
    assert inv.on_leader("b", leader_kv("b", rev=2), 0.0) is False  # a re-put (same leader renewing): nothing new
    assert free(inv) == {("b", "n0"): ({0, 1, 2, 3}, True)}
    assert inv.led == {"b"}
    assert inv.on_leader("b", None, 0.0) is False  # losing one shrinks capacity
    assert free(inv) == {("b", "n0"): ({0, 1, 2, 3}, False)}
    assert inv.led == frozenset()


# Epochs: leader/<az>'s create revision, for peer calls checked from the watch
# (they must answer what an etcd read would). Each step: ("put", az, epoch),
# ("delete", az), ("reset", {az: epoch}) or ("compacted",); then the epochs of
# every AZ asked, None where the check must fall back to the read.
@pytest.mark.parametrize("steps, epochs, led", [
    # A put gives the AZ's epoch.
    ([("put", "b", 5)], {"b": 5, "c": None}, {"b"}),
    # A re-put by the same leader (a renewal) keeps it.
    ([("put", "b", 5), ("put", "b", 5)], {"b": 5}, {"b"}),
    # A new create revision is a new leadership: the new epoch, the old one is refused.
    ([("put", "b", 5), ("put", "b", 9)], {"b": 9}, {"b"}),
    # A delete: no leader, no epoch.
    ([("put", "b", 5), ("delete", "b")], {"b": None}, set()),
    # Led again after a delete: the new leadership's epoch.
    ([("put", "b", 5), ("delete", "b"), ("put", "b", 12)], {"b": 12}, {"b"}),
    # This AZ's own leader key counts too (a peer check may name it), though the view ignores its nodes.
    ([("put", HERE, 3)], {HERE: 3}, {HERE}),
    # A reset replaces them with the read's (this AZ's included), dropping AZs not led then.
    ([("put", "b", 5), ("put", "c", 6), ("reset", {HERE: 2, "b": 8})], {HERE: 2, "b": 8, "c": None}, {HERE, "b"}),
    # A compacted watch: no epoch answers until the next reset (the read decides); the view keeps who led.
    ([("put", "b", 5), ("compacted",)], {"b": None}, {"b"}),
    # Nor after a put in between: events before it are lost.
    ([("put", "b", 5), ("compacted",), ("put", "c", 7)], {"b": None, "c": None}, {"b", "c"}),
    # The reset after it restores them.
    ([("put", "b", 5), ("compacted",), ("reset", {"b": 9})], {"b": 9}, {"b"}),
], ids=["put", "re-put", "new-leadership", "delete", "led-again", "own-az", "reset", "compacted",
        "compacted-then-put", "compacted-then-reset"])
def test_leader_epochs(steps, epochs, led) -> None:  # type: ignore[no-untyped-def]
    inv = RemoteInventory(HERE, KEYS)
    for step in steps:
        if step[0] == "put":
            inv.on_leader(step[1], leader_kv(step[1], epoch=step[2], rev=step[2] + 1), 0.0)
        elif step[0] == "delete":
            inv.on_leader(step[1], None, 0.0)
        elif step[0] == "reset":
            inv.reset([], [], [leader_kv(az, epoch=e) for az, e in step[1].items()])
        else:
            inv.on_compacted()
    assert {az: inv.epoch(az) for az in epochs} == epochs
    assert inv.led == led


# The owner-loss clock: AZs without a leader for longer than `after` (here 10 s)
# are orphaned. Steps: ("put", az, now), ("delete", az, now), ("poll", {az...}, now),
# ("watch", az) (a recovered gang's owner), ("reset", {az...}); then orphaned at `at`.
@pytest.mark.parametrize("steps, at, orphaned", [
    # Leaderless since the delete: orphaned once over `after` has passed, not before.
    ([("put", "b", 0.0), ("delete", "b", 5.0)], 15.0, set()),
    ([("put", "b", 0.0), ("delete", "b", 5.0)], 15.5, {"b"}),
    # Led again: the clock stops.
    ([("delete", "b", 0.0), ("put", "b", 3.0)], 50.0, set()),
    # A later delete restarts it (the leaderless time is that of the last delete seen).
    ([("delete", "b", 0.0), ("delete", "b", 8.0)], 15.0, set()),
    # A poll that misses a led AZ starts its clock; a later poll keeps the first time.
    ([("put", "b", 0.0), ("poll", set(), 2.0), ("poll", set(), 9.0)], 12.5, {"b"}),
    # A poll that finds it led stops the clock the watch started.
    ([("delete", "b", 0.0), ("poll", {"b"}, 4.0)], 50.0, set()),
    # An AZ never seen is not clocked by a poll ...
    ([("poll", set(), 0.0)], 50.0, set()),
    # ... unless it owns a recovered gang, or a poll once found it led.
    ([("watch", "c"), ("poll", set(), 1.0)], 12.0, {"c"}),
    ([("poll", {"c"}, 0.0), ("poll", set(), 1.0)], 12.0, {"c"}),
    # This AZ is never orphaned.
    ([("put", HERE, 0.0), ("delete", HERE, 1.0)], 50.0, set()),
    # A reset (recovery read, compacted watch) leaves the clock as it was.
    ([("delete", "b", 0.0), ("reset", {"b"})], 11.0, {"b"}),
], ids=["before-after", "after", "led-again", "last-delete", "poll-starts", "poll-stops", "unknown-az",
        "recovered-owner", "polled-once", "own-az", "reset-keeps-clock"])
def test_owner_loss_clock(steps, at, orphaned) -> None:  # type: ignore[no-untyped-def]
    inv = RemoteInventory(HERE, KEYS)
    for step in steps:
        if step[0] == "put":
            inv.on_leader(step[1], leader_kv(step[1]), step[2])
        elif step[0] == "delete":
            inv.on_leader(step[1], None, step[2])
        elif step[0] == "poll":
            inv.on_leaders_polled(step[1], step[2])
        elif step[0] == "watch":
            inv.watch_for_loss(step[1])
        else:
            inv.reset([], [], [leader_kv(az) for az in step[1]])
    assert inv.orphaned(at, 10.0) == orphaned


# --- reset (recovery, compacted watch) ------------------------------------------


def test_reset_replaces_everything_and_skips_this_az() -> None:
    inv = inventory("b")
    inv.on_node(KEYS.node("b", "gone"), node_kv("gone"))
    inv.on_reservation(KEYS.reservation("b", "old"), hold_kv("old", {"gone": ((0,), ())}))
    before = inv.version
    wake = inv.reset(
        [node_kv("n0"), node_kv("m0", az="c"), node_kv("mine", az=HERE)],
        [hold_kv("g1", {"n0": ((2,), ())}), hold_kv("g2", {"mine": ((0, 1, 2, 3), ())}, az=HERE)],
        [leader_kv("a"), leader_kv("b")])
    assert wake is True
    assert inv.version > before
    assert free(inv) == {("b", "n0"): ({0, 1, 3}, True), ("c", "m0"): ({0, 1, 2, 3}, False)}
    assert inv.led == {"a", "b"}
    assert inv.node("b", "gone") is None


# --- caches ---------------------------------------------------------------------


def fleet(n: int) -> RemoteInventory:
    inv = inventory("b", "c")
    inv.reset([node_kv(f"n{i}", az="bc"[i % 2]) for i in range(n)], [hold_kv("g1", {"n0": ((0,), ())})],
              [leader_kv("b"), leader_kv("c")])
    return inv


def test_cycles_without_changes_rebuild_nothing() -> None:
    inv = fleet(200)
    view, registered, index = inv.view(), inv.registered(), inv.index()
    local = FabricIndex.build([topo("x0", az=HERE)])
    joined = inv.placement_index(local)
    counts = (inv.view_rebuilds, inv.registered_rebuilds, inv.index_refreshes)
    for i in range(50):  # 50 admission cycles, with heartbeats and hold state changes in between
        inv.on_node(KEYS.node("b", "n0"), node_kv("n0", heartbeat=float(i), rev=10 + i))
        inv.on_reservation(KEYS.reservation("b", "g1"),
                           hold_kv("g1", {"n0": ((0,), ())}, state=HoldState.COMMITTED, rev=10 + i))
        inv.on_leader("b", leader_kv("b", rev=10 + i), float(i))
        assert inv.view() is view
        assert inv.registered() is registered
        assert inv.index() is index
        assert inv.placement_index(local) is joined
    assert (inv.view_rebuilds, inv.registered_rebuilds, inv.index_refreshes) == counts


@pytest.mark.parametrize("change, view, registered", [
    (lambda inv: inv.on_reservation(KEYS.reservation("b", "g1"), None), 1, 0),
    (lambda inv: inv.on_reservation(KEYS.reservation("c", "g2"), hold_kv("g2", {"n1": ((1,), ())}, az="c")), 1, 0),
    (lambda inv: inv.on_node(KEYS.node("b", "n0"), node_kv("n0", ready=False, rev=5)), 1, 0),
    (lambda inv: inv.on_node(KEYS.node("b", "n0"), node_kv("n0", gpus=8, rev=5)), 1, 1),
    (lambda inv: inv.on_node(KEYS.node("b", "n0"), None), 1, 1),
    (lambda inv: inv.on_leader("c", None, 0.0), 1, 0),
], ids=["hold-deleted", "hold-added", "not-ready", "new-topology", "node-deleted", "leader-lost"])
def test_a_change_rebuilds_once(change, view, registered) -> None:  # type: ignore[no-untyped-def]
    inv = fleet(20)
    inv.view(), inv.registered()
    v0, r0 = inv.view_rebuilds, inv.registered_rebuilds
    change(inv)
    for _ in range(5):
        inv.view(), inv.registered()
    assert (inv.view_rebuilds - v0, inv.registered_rebuilds - r0) == (view, registered)


def test_the_index_follows_remote_topologies_and_joins_the_local_one() -> None:
    inv = fleet(6)
    local = FabricIndex.build([topo("x0", az=HERE), topo("x1", az=HERE)])
    joined = inv.placement_index(local)
    assert len(inv.index()) == 6 and len(joined) == 8
    # Entries are those of the views' own topology objects (matched by identity).
    assert all(joined.facts(v.topology).topology is v.topology for v in inv.view())
    inv.on_node(KEYS.node("b", "n0"), node_kv("n0", gpus=8, rev=5))
    again = inv.placement_index(local)
    assert again is not joined and len(again) == 8
    n0 = next(v for v in inv.view() if v.name == "n0")
    assert again.facts(n0.topology).topology is n0.topology
    # A new local index (a node registered here) gives a new joined one too.
    local2 = local.refreshed([topo("x0", az=HERE)])
    assert len(inv.placement_index(local2)) == 7


def test_placement_over_the_cached_view_and_index_matches_a_fresh_one() -> None:
    inv = fleet(12)
    req = PlacementRequest(gang="g", members=8, gpus_per_member=4, rdma_nics_per_member=1, allow_cross_az=True,
                           azs=frozenset({"b", "c"}))
    cached = place(req, list(inv.view()), inv.placement_index(FabricIndex()))
    fresh = place(req, list(inv.view()))
    assert isinstance(cached, Placement)
    assert cached == fresh
    assert {m.az for m in cached.members} == {"b", "c"}  # n0's held GPU keeps one member off it


def test_a_hold_change_computes_only_the_nodes_it_touches() -> None:
    inv = fleet(100)
    inv.view()
    before = inv.node_views_computed
    inv.on_reservation(KEYS.reservation("b", "g7"), hold_kv("g7", {"n2": ((0,), ()), "n4": ((1,), ())}))
    assert free(inv)[("b", "n2")] == ({1, 2, 3}, True) and free(inv)[("b", "n4")] == ({0, 2, 3}, True)
    assert inv.node_views_computed - before == 2
    inv.on_leader("c", None, 0.0)  # every node of c (50) becomes unplaceable
    assert not any(ready for (az, _), (_, ready) in free(inv).items() if az == "c")
    assert inv.node_views_computed - before == 52


def test_any_sequence_of_records_gives_the_view_computed_from_scratch() -> None:
    """Random puts, deletes, unreadable records and leader changes, checked
    after every step against capacity.free_view over the records last
    written (the test's own model of etcd), not against the class."""
    import random

    from coordinator.core import capacity

    rnd = random.Random(14)
    inv = RemoteInventory(HERE, KEYS)
    nodes: dict[tuple[str, str], NodeRecord] = {}
    holds: dict[tuple[str, str], Reservation] = {}
    led: set[str] = set()
    for step in range(600):
        az, what = rnd.choice("bc" + HERE), rnd.random()
        name = f"n{rnd.randrange(6)}"
        if what < 0.3:
            rec = NodeRecord(topology=topo(name, az, gpus=rnd.choice((4, 8))), ready=rnd.random() < 0.8,
                             last_heartbeat=float(step))
            inv.on_node(KEYS.node(az, name), kv(KEYS.node(az, name), rec.to_dict(), step))
            if az != HERE:
                nodes[(az, name)] = rec
        elif what < 0.4:
            inv.on_node(KEYS.node(az, name), None)
            nodes.pop((az, name), None)
        elif what < 0.7:
            gang = f"g{rnd.randrange(5)}"
            on = {f"n{i}": (tuple(rnd.sample(range(8), rnd.randrange(3))), ()) for i in rnd.sample(range(6), 2)}
            k = hold_kv(gang, on, az=az, state=rnd.choice(list(HoldState)), rev=step)
            inv.on_reservation(k.key, k)
            if az != HERE:
                holds[(az, gang)] = Reservation.from_dict(k.json())
        elif what < 0.8:
            gang = f"g{rnd.randrange(5)}"
            inv.on_reservation(KEYS.reservation(az, gang), None)
            holds.pop((az, gang), None)
        elif what < 0.85:
            bad = KV(key=KEYS.reservation(az, "g0"), value=b"{", create_revision=1, mod_revision=step, version=1, lease=0)
            inv.on_reservation(bad.key, bad)  # skipped: the model keeps what it had
        else:
            up = rnd.random() < 0.6
            inv.on_leader(az, leader_kv(az, epoch=step) if up else None, float(step))
            (led.add if up else led.discard)(az)
        if rnd.random() < 0.5:
            continue  # several changes between two cycles
        taken = capacity.held((a, r.nodes) for (a, _), r in holds.items())
        expected = capacity.free_view(((rec.topology, rec.ready and a in led) for (a, _), rec in nodes.items()), taken)
        assert sorted(inv.view(), key=lambda v: (v.az, v.name)) == sorted(expected, key=lambda v: (v.az, v.name)), step
        assert sorted((t.az, t.node) for t in inv.registered()) == sorted(nodes)
