"""Two-phase fields of ``reservations/<az>/<gang>`` (phalanx.reservation.Reservation)."""

from __future__ import annotations

from phalanx.reservation import HoldState, NodeDevices, Reservation


def test_old_and_single_az_records_read_back_as_single_az() -> None:
    old = {"az": "az-a", "gang": "g-1", "incarnation": 2, "status": "COMMITTED",
           "nodes": {"n0": {"gpus": [0, 1], "nics": ["mlx5_0"]}}, "epoch": 7}
    r = Reservation.from_dict(old, 42)
    assert (r.two_phase, r.owner_az, r.priority, r.submitted_at) == (False, "", 0, 0.0)
    assert r.nodes["n0"] == NodeDevices((0, 1), ("mlx5_0",)) and r.mod_revision == 42
    assert r.to_dict() == old, "single-AZ records keep their exact shape"


def test_two_phase_records_carry_owner_and_order_and_round_trip() -> None:
    r = Reservation("az-b", "g-2", 3, HoldState.PREPARED, {"n1": NodeDevices((4,), ())}, 9,
                    two_phase=True, owner_az="az-a", priority=5, submitted_at=123.5)
    d = r.to_dict()
    assert d["two_phase"] is True and d["owner_az"] == "az-a" and d["priority"] == 5 and d["submitted_at"] == 123.5
    assert Reservation.from_dict(d) == r
