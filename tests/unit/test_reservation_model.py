"""The one reservation model (phalanx/reservation.py): stored shape, parser, helpers."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.reservation import BadReservation, HoldState, NodeDevices, Reservation

OLD_SINGLE_AZ = {"az": "az-a", "gang": "g-1", "incarnation": 2, "status": "COMMITTED",
                 "nodes": {"n1": {"gpus": [3, 1], "nics": []}, "n0": {"gpus": [0], "nics": ["mlx5_0"]}}, "epoch": 7}


def test_a_stored_single_az_record_parses_and_writes_back_the_same_fields() -> None:
    r = Reservation.from_dict(OLD_SINGLE_AZ, 42)
    assert r.state is HoldState.COMMITTED and r.mod_revision == 42 and not r.two_phase
    assert r.nodes == {"n0": NodeDevices((0,), ("mlx5_0",)), "n1": NodeDevices((1, 3), ())}
    d = r.to_dict()
    assert set(d) == set(OLD_SINGLE_AZ) and d["status"] == "COMMITTED" and d["epoch"] == 7
    assert Reservation.from_dict(d, 42) == r


def test_a_two_phase_record_round_trips_with_its_order_fields() -> None:
    r = Reservation("az-b", "g-2", 3, HoldState.PREPARED, {"n1": NodeDevices((4,))}, 9,
                    two_phase=True, owner_az="az-a", priority=5, submitted_at=12.5)
    d = r.to_dict()
    assert d["status"] == "PREPARED" and d["two_phase"] is True and d["owner_az"] == "az-a"
    assert Reservation.from_dict(d) == r


def test_a_record_without_epoch_still_parses() -> None:
    old = {k: v for k, v in OLD_SINGLE_AZ.items() if k != "epoch"}
    assert Reservation.from_dict(old).epoch == 0


def test_devices_are_canonical_and_empty_nodes_kept() -> None:
    r = Reservation("a", "g", 1, HoldState.COMMITTED, {"n1": ((2, 1, 2), ()), "n0": ((), ())})
    assert list(r.nodes) == ["n0", "n1"] and r.nodes["n1"] == ((1, 2), ()) and r.nodes["n0"] == ((), ())
    gpus, nics = r.nodes["n1"]
    assert gpus == (1, 2) and nics == ()


@pytest.mark.parametrize("state, gang, inc, holds, releasing", [
    (HoldState.COMMITTED, "g", 2, True, False),
    (HoldState.COMMITTED, "g", 1, False, False),
    (HoldState.COMMITTED, "other", 2, False, False),
    (HoldState.PREPARED, "g", 2, False, False),
    (HoldState.RELEASING, "g", 2, False, True),
    (HoldState.RELEASING, "g", 3, False, False),
], ids=["committed-same-incarnation", "committed-older-incarnation", "other-gang", "prepared",
        "releasing-same", "releasing-other-incarnation"])
def test_holds_and_releasing(state: HoldState, gang: str, inc: int, holds: bool, releasing: bool) -> None:
    r = Reservation("a", "g", 2, state, {"n0": NodeDevices((0,))})
    assert r.holds(gang, inc) is holds
    assert r.releasing(inc) is releasing


def _with(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {**OLD_SINGLE_AZ, **changes}
    return {k: v for k, v in d.items() if v is not DROP}


DROP = object()


@pytest.mark.parametrize("record, field", [
    (_with(status="GONE"), "status"),
    (_with(status=DROP), "status"),
    (_with(az=DROP), "az"),
    (_with(gang=7), "gang"),
    (_with(incarnation="2"), "incarnation"),
    (_with(incarnation=True), "incarnation"),
    (_with(nodes=[1, 2]), "nodes"),
    (_with(nodes={"n0": [0]}), "nodes.n0"),
    (_with(nodes={"n0": {"gpus": "0"}}), "nodes.n0.gpus"),
    (_with(nodes={"n0": {"gpus": [0.5]}}), "nodes.n0.gpus"),
    (_with(nodes={"n0": {"gpus": [0], "nics": [1]}}), "nodes.n0.nics"),
    (_with(epoch="x"), "epoch"),
    (_with(submitted_at="late"), "submitted_at"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_bad_record_is_refused_naming_the_field(record: dict[str, Any], field: str) -> None:
    with pytest.raises(BadReservation, match=f"field '{field}'"):
        Reservation.from_dict(record)


def test_not_an_object_is_refused_as_a_value_error() -> None:
    # ValueError: coordinator.core.records.read_records counts it as unreadable.
    with pytest.raises(ValueError, match="not a JSON object"):
        Reservation.from_dict(["status", "COMMITTED"])


def test_a_bad_state_given_in_code_is_refused() -> None:
    with pytest.raises(BadReservation, match="field 'status'"):
        Reservation("a", "g", 1, "HELD", {})  # type: ignore[arg-type]
