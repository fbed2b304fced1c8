"""Node lifecycle in the cores (docs/nodes.md): which nodes count for
never-fits, which state status shows, when the leader expires a node, and
that a registration keeps an admin's cordon (coordinator/core/capacity.py,
coordinator/core/gang_effects.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from coordinator.core import gang_effects as fx
from coordinator.core.capacity import expires, keep_cordon, node_state, takes_work
from coordinator.core.records import NodeRecord
from phalanx.topology import Gpu, NodeTopology

TOPO = NodeTopology(node="n0", az="a", gpus=tuple(Gpu(index=i) for i in range(8)))
REC = NodeRecord(topology=TOPO, ready=True, agent_id="ag")


@pytest.mark.parametrize("cordoned, expired, ready, counts, state", [
    (False, False, True, True, "ready"),
    (False, False, False, True, "not_ready"),  # may come back: never-fits counts it
    (True, False, True, False, "cordoned"),
    (True, False, False, False, "cordoned"),
    (False, True, False, False, "expired"),
    (True, True, False, False, "expired"),
])
def test_which_nodes_take_work_and_their_state(cordoned: bool, expired: bool, ready: bool, counts: bool,
                                                state: str) -> None:
    rec = dataclasses.replace(REC, ready=ready, cordoned=cordoned, expired=expired)
    assert takes_work(rec) is counts
    assert node_state(rec, ready) == state


@pytest.mark.parametrize("ready, expired, silent, out", [
    (False, False, 600.0, True),  # silent exactly the limit: expired
    (False, False, 599.9, False),
    (True, False, 10_000.0, False),  # heard (ready): never expired
    (False, True, 10_000.0, False),  # already expired: written once
])
def test_the_leader_expires_a_silent_node_once(ready: bool, expired: bool, silent: float, out: bool) -> None:
    rec = dataclasses.replace(REC, ready=ready, expired=expired)
    assert expires(rec, ready, silent, 600.0) is out


def session() -> SimpleNamespace:
    return SimpleNamespace(node="n0", agent_id="ag", topology=TOPO, address="", ports=REC.ports)


@pytest.mark.parametrize("previous, cordoned, write", [
    (None, False, True),
    (dataclasses.replace(REC, cordoned=True), True, False),  # cordon kept, nothing to write
    (dataclasses.replace(REC, ready=False, expired=True, reason="expired"), False, True),  # back: no longer expired
    (dataclasses.replace(REC, ready=False, expired=True, cordoned=True), True, True),
])
def test_a_registration_keeps_the_cordon_and_ends_the_expiry(previous: NodeRecord | None, cordoned: bool,
                                                             write: bool) -> None:
    e = fx.register_node(session(), previous, replaces_session=False, wall=5.0)
    assert e.record.cordoned is cordoned
    assert e.record.expired is False and e.record.ready is True
    assert e.write is write


def test_the_record_round_trips_cordon_and_expiry_and_reads_old_records() -> None:
    rec = dataclasses.replace(REC, cordoned=True, expired=True)
    assert NodeRecord.from_dict(rec.to_dict()) == rec
    old = {k: v for k, v in REC.to_dict().items() if k not in ("cordoned", "expired")}
    assert NodeRecord.from_dict(old) == REC
    # Only a true boolean cordons or expires a node.
    assert not NodeRecord.from_dict({**REC.to_dict(), "cordoned": "yes", "expired": 1}).cordoned


@pytest.mark.parametrize("decided_cordon, current, cordoned", [
    (False, dataclasses.replace(REC, cordoned=True), True),  # an admin cordoned it in between: kept
    (True, REC, False),  # uncordoned in between: kept too
    (True, None, True),  # deleted in between: as decided
])
def test_a_record_decided_earlier_is_written_with_the_cordon_last_written(decided_cordon: bool,
                                                                         current: NodeRecord | None,
                                                                         cordoned: bool) -> None:
    decided = dataclasses.replace(REC, ready=False, reason="no heartbeat", cordoned=decided_cordon)
    written = keep_cordon(decided, current)
    assert written.cordoned is cordoned
    assert (written.ready, written.reason) == (False, "no heartbeat")
