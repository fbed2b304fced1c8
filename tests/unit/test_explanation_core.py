"""What explain says about a gang (coordinator/core/explanation.py): tables
a reader can check by hand, for the leader's answer and for the answer from
the records in etcd when no leader can be asked."""

from __future__ import annotations

import pytest

from coordinator.core import explanation as ex
from coordinator.core.admission import FailAdmission, KeepPending, Reserve
from coordinator.core.placement import MemberSlot, Placement, Shortfall, Unplaceable
from coordinator.core.records import DeviceLedger, GangRecord, NodeRecord
from coordinator.core.twophase_owner import OwnerPhase
from phalanx.model import GangState, Level
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.spec import GangSpec, Resources, Topology
from phalanx.topology import Gpu, NodeTopology

AZ = "az-a"
G = GangRecord(id="g", spec=GangSpec(name="g", members=1, resources=Resources(gpus=1)), state=GangState.PENDING,
               owner_az=AZ, submitted_at=0.0, updated_at=0.0)
FITS = Placement((MemberSlot(0, AZ, "n0", (0,), ()),), Level.NODE, "n0", "fits on n0")
SHORT = (Shortfall(Level.NODE, "n0", 0, 8, 1, 0, 1, "no free GPU"),)


@pytest.mark.parametrize("d, summary, leader, never", [
    pytest.param(Reserve(G, FITS, "fits on n0"),
                 "PENDING for 5s: it fits now (fits on n0); the leader's admission plan, run for this answer, "
                 "reserves it, so its next cycle does unless the inventory changes first",
                 "queue position 2 of 3 in az-a: admitted on the next cycle", False, id="reserve"),
    pytest.param(FailAdmission(G, "needs 9 GPUs on one node", never_fits=True),
                 "PENDING for 5s: the leader fails it on its next cycle: needs 9 GPUs on one node",
                 "queue position 2 of 3 in az-a: needs 9 GPUs on one node", True, id="fail-never-fits"),
    pytest.param(KeepPending(G, "no room", SHORT, position=2, queue=3),
                 "PENDING for 5s: no room; grace", "queue position 2 of 3 in az-a: waiting for devices to free up",
                 False, id="keep-pending-with-grace"),
])
def test_of_decision(d, summary, leader, never):
    e = ex.of_decision(d, 2, 3, "PENDING for 5s", "; grace", AZ)
    assert (e.summary, e.leader_reason, e.never_fits) == (summary, leader, never)
    assert e.shortfalls == (SHORT if isinstance(d, KeepPending) else ())


@pytest.mark.parametrize("phase, attempts, last, unled, want", [
    pytest.param(None, 0, "", [], "two-phase owner in az-a: NEW", id="no-owner-yet"),
    pytest.param(OwnerPhase.BACKOFF, 1, "NO from az-b", [],
                 "two-phase owner in az-a: BACKOFF after 1 aborted attempt; last: NO from az-b", id="one-attempt"),
    pytest.param(OwnerPhase.UNPLACED, 2, "", ["az-b", "az-c"],
                 "two-phase owner in az-a: UNPLACED after 2 aborted attempts; az-b, az-c have no leader: "
                 "not offered to placement", id="unled-azs"),
])
def test_owner_summary(phase, attempts, last, unled, want):
    assert ex.owner_summary(phase, attempts, last, AZ, unled) == want


@pytest.mark.parametrize("phase, verdict, result, tail, never", [
    pytest.param(None, "needs 9 GPUs", None, "needs 9 GPUs; the leader fails it on its next admission cycle", True,
                 id="never-fits"),
    pytest.param(OwnerPhase.UNPLACED, "", FITS, "comes (older or higher-priority gangs first)", False,
                 id="fits-unplaced"),
    pytest.param(OwnerPhase.BACKOFF, "", FITS, "tries again after its retry backoff", False, id="fits-backoff"),
    pytest.param(None, "", FITS, "an attempt is under way (NEW)", False, id="fits-no-owner"),
    pytest.param(OwnerPhase.UNPLACED, "", Unplaceable("no room", SHORT), "no room; grace", False, id="no-room"),
])
def test_of_two_phase(phase, verdict, result, tail, never):
    e = ex.of_two_phase(phase, "owner", "PENDING for 5s", "; grace", AZ, verdict, result)
    assert e.summary.endswith(tail) and e.leader_reason == "owner" and e.never_fits is never
    assert e.shortfalls == (SHORT if isinstance(result, Unplaceable) else ())


def record(node: str, az: str = AZ, gpus: int = 4, ready: bool = True, **lifecycle: bool) -> NodeRecord:
    return NodeRecord(topology=NodeTopology(node=node, az=az, gpus=tuple(Gpu(index=i) for i in range(gpus))),
                      ready=ready, **lifecycle)


def holding(az: str = AZ, **nodes: tuple[int, ...]) -> DeviceLedger:
    return DeviceLedger.from_reservations({"other": Reservation(
        az=az, gang="other", incarnation=1, state=HoldState.COMMITTED,
        nodes={n: NodeDevices(gpus) for n, gpus in nodes.items()})})


def test_recorded_view_counts_nodes_that_take_work_less_what_is_held():
    nodes = [record("n0"), record("n1", ready=False), record("n2", cordoned=True), record("n3", expired=True)]
    views = ex.recorded_view(AZ, nodes, holding(n0=(1, 3)))
    assert [(v.name, sorted(v.free_gpus), v.ready) for v in views] == [("n0", [0, 2], True), ("n1", [0, 1, 2, 3], False)]


def gang(members: int, gpus: int, cross_az: bool = False) -> GangRecord:
    spec = GangSpec(name="g", members=members, resources=Resources(gpus=gpus),
                    topology=Topology(allow_cross_az=cross_az))
    return GangRecord(id="g-0000abcd", spec=spec, state=GangState.PENDING, owner_az=AZ, submitted_at=100.0,
                      updated_at=100.0)


WHY = "the leader of az-a (c1) did not answer: UNAVAILABLE"
FIT = "would fit it ("
ASKED = "); only the leader admits it, and it could not be asked"


@pytest.mark.parametrize("g, views, starts, ends, never, short", [
    pytest.param(gang(1, 4), [("n0", AZ, ())], "PENDING for 5s: the free devices recorded in etcd " + FIT, ASKED,
                 False, False, id="fits"),
    pytest.param(gang(1, 4), [("n0", AZ, (0, 1))], "PENDING for 5s: ", "", False, True, id="held-no-room"),
    pytest.param(gang(1, 8), [("n0", AZ, ())], "PENDING for 5s: ", "", True, False, id="never-fits"),
    pytest.param(gang(2, 4, cross_az=True), [("n0", AZ, ()), ("n0", "az-b", ())],
                 "PENDING for 5s: the free devices recorded in etcd " + FIT, ASKED, False, False, id="cross-az-fits"),
    # The same views for a gang that may not span AZs: only its own AZ counts.
    pytest.param(gang(2, 4), [("n0", AZ, ()), ("n0", "az-b", ())], "PENDING for 5s: ", "", True, False,
                 id="single-az-sees-its-own-az"),
    pytest.param(gang(2, 4, cross_az=True), [("n0", AZ, ()), ("n0", "az-b", (2,))], "PENDING for 5s: ", "",
                 False, True, id="cross-az-held-in-the-other-az"),
])
def test_of_records(g, views, starts, ends, never, short):
    built = [v for node, az, held in views for v in ex.recorded_view(az, [record(node, az)], holding(az, **{node: held}))]
    e = ex.of_records(g, built, WHY, now=105.0)
    assert e.summary.startswith(starts) and e.summary.endswith(ends), e.summary
    assert e.leader_reason == WHY and e.never_fits is never and bool(e.shortfalls) is short, e
    assert (FIT in e.summary) is (not never and not short)


def test_of_records_waited_is_never_negative():
    # A wall clock behind the submission's (another coordinator's clock).
    assert ex.of_records(gang(1, 4), [], "", now=90.0).summary.startswith("PENDING for 0s: ")


@pytest.mark.parametrize("g, want", [
    pytest.param(GangRecord(id="g", spec=G.spec, state=GangState.FAILED, owner_az=AZ, submitted_at=0.0,
                            updated_at=0.0, reason="cancelled"), "FAILED: cancelled", id="not-placed"),
    pytest.param(GangRecord(id="g", spec=G.spec, state=GangState.RUNNING, owner_az=AZ, submitted_at=0.0,
                            updated_at=0.0, reason="all members running",
                            placement=(MemberSlot(1, AZ, "n1", (0,), ()), MemberSlot(0, AZ, "n0", (0,), ()),
                                       MemberSlot(2, AZ, "n0", (1,), ()))),
                 "RUNNING: all members running; placed on n0, n1", id="placed"),
])
def test_placed_summary(g, want):
    assert ex.placed_summary(g) == want
