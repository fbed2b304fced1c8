"""What explain says about a waiting gang (coordinator/core/explanation.py):
tables a reader can check by hand."""

from __future__ import annotations

import pytest

from coordinator.core import explanation as ex
from coordinator.core.admission import FailAdmission, KeepPending, Reserve
from coordinator.core.placement import MemberSlot, Placement, Shortfall, Unplaceable
from coordinator.core.records import GangRecord
from coordinator.core.twophase_owner import OwnerPhase
from phalanx.model import GangState, Level
from phalanx.spec import GangSpec, Resources

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
