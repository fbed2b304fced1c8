"""An unreadable reservation still holds the devices its gang's record names
(coordinator/core/records.py holds_for_unreadable): safety before liveness."""

from __future__ import annotations

from coordinator.core.records import UNREADABLE_HOLD, DeviceLedger, GangRecord, MemberAssignment, holds_for_unreadable
from phalanx.model import GangState
from phalanx.spec import parse_spec

PREFIX = "/phalanx/t/reservations/az-a/"


def gang(gid: str, placement: list[MemberAssignment]) -> GangRecord:
    spec = parse_spec({"name": gid.rsplit("-", 1)[0], "members": len(placement), "resources": {"gpus": 2}})
    return GangRecord(id=gid, spec=spec, state=GangState.RUNNING, owner_az="az-a", submitted_at=1.0, updated_at=1.0,
                      placement=tuple(placement))


G1 = gang("one-00000001", [MemberAssignment(0, "az-a", "n0", (0, 1), ("mlx5_0",)),
                           MemberAssignment(1, "az-a", "n1", (2, 3), ()),
                           MemberAssignment(2, "az-b", "m0", (0, 1), ())])


def test_the_gangs_devices_in_this_az_stay_held() -> None:
    holds = holds_for_unreadable([PREFIX + G1.id], PREFIX, [G1], "az-a")
    ledger = DeviceLedger()
    for h in holds:
        ledger.hold(h)
    assert ledger.used_gpus("n0") == {0, 1} and ledger.used_nics("n0") == {"mlx5_0"}
    assert ledger.used_gpus("n1") == {2, 3}
    assert ledger.used_gpus("m0") == frozenset()  # another AZ's devices are not ours to hold
    assert [h.gang for h in holds] == [UNREADABLE_HOLD + G1.id]


def test_two_members_on_one_node_add_up() -> None:
    g = gang("two-00000002", [MemberAssignment(0, "az-a", "n0", (0, 1), ()),
                              MemberAssignment(1, "az-a", "n0", (2, 3), ())])
    (h,) = holds_for_unreadable([PREFIX + g.id], PREFIX, [g], "az-a")
    assert h.nodes["n0"].gpus == (0, 1, 2, 3)


def test_nothing_known_nothing_held() -> None:
    # The gang record is unreadable or gone, the key is not a reservation of
    # this AZ, or the gang has no placement here: no hold.
    assert holds_for_unreadable([PREFIX + "gone-00000003"], PREFIX, [G1], "az-a") == []
    assert holds_for_unreadable(["/phalanx/t/nodes/az-a/x"], PREFIX, [G1], "az-a") == []
    assert holds_for_unreadable([PREFIX + G1.id], PREFIX, [G1], "az-c") == []
