"""Chaos invariant 2 covers NICs (chaos/checker.py ``_reservation_overlaps``):
NICs are exclusive as GPUs are (capacity.free_view subtracts held NICs, an
agent's ledger refuses an overlap), so etcd must never hold two reservations
of one (node, NIC). The agents' histories record members' GPUs only, so the
member-interval half of the invariant stays GPU-only. Pure: hand-made
histories built with tests/unit/test_chaos_checker.py's builders."""

from __future__ import annotations

import pytest

from chaos.history import EtcdEvent
from tests.unit.test_chaos_checker import T0, add, healthy, released, violations


def hold(gid: str, rev: int, t: float, nodes: dict[str, tuple[list[int], list[str]]], az: str = "a") -> EtcdEvent:
    return EtcdEvent("put", f"reservations/{az}/{gid}", rev, T0 + t,
                     value={"az": az, "gang": gid, "incarnation": 1, "status": "COMMITTED", "epoch": 5,
                            "nodes": {n: {"gpus": g, "nics": nics} for n, (g, nics) in nodes.items()}})


# (what, second hold's node -> (gpus, nics), released first?, expected violation text or None)
CASES = [
    ("one NIC of one node held twice", {"a-n000": ([4], ["mlx5_2"])}, False,
     "etcd holds reservations of g8 and g7 on the same NICs"),
    ("a GPU and a NIC held twice", {"a-n000": ([3], ["mlx5_2"])}, False,
     "etcd holds reservations of g8 and g7 on the same GPUs and NICs"),
    ("the same NIC name on another node", {"a-n001": ([2], ["mlx5_2"])}, False, None),
    ("disjoint NICs of one node", {"a-n000": ([4], ["mlx5_4"])}, False, None),
    ("the NIC reused after its release", {"a-n000": ([4], ["mlx5_2"])}, True, None),
]


@pytest.mark.parametrize("what,second,after_release,expected", CASES, ids=[c[0] for c in CASES])
def test_reservation_overlaps_cover_nics(what: str, second: dict[str, tuple[list[int], list[str]]],
                                         after_release: bool, expected: str | None) -> None:
    first = hold("g7", 40, 5.0, {"a-n000": ([2, 3], ["mlx5_2", "mlx5_3"])})
    if after_release:
        events = (first, released("g7", 41, 5.5), hold("g8", 42, 6.0, second), released("g8", 43, 7.0))
    else:
        events = (first, hold("g8", 41, 6.0, second), released("g7", 42, 7.0), released("g8", 43, 7.0))
    found = violations(add(healthy(), etcd=events), 2)
    if expected is None:
        assert found == [], [v.render() for v in found]
    else:
        assert len(found) == 1 and found[0].what == expected, [v.render() for v in found]
        assert "a: a-n000 nic mlx5_2 held by g7 and g8" in found[0].evidence
