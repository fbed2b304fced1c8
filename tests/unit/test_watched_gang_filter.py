"""Which gang records the two-phase driver keeps from its cluster-root watch
for checking a Prepare without an etcd read (coordinator/twophase/watch.py
``reserving``): only RESERVING ones, decided on the bytes etcd holds."""

from __future__ import annotations

import pytest

from coordinator.core.records import GangRecord
from coordinator.twophase.watch import reserving
from phalanx.model import GangState
from phalanx.spec import GangSpec, Resources, Run, Topology
from phalanx.store import KV, encode


def stored(state: GangState, *, reason: str = "", command: tuple[str, ...] = ("true",)) -> KV:
    spec = GangSpec(name="g", members=2, resources=Resources(gpus=1), topology=Topology(allow_cross_az=True),
                    run=Run(command=command))
    rec = GangRecord(id="g-1", spec=spec, state=state, owner_az="az-a", submitted_at=1.0, updated_at=2.0,
                     reason=reason)
    return KV(key="/phalanx/gangs/g-1", value=encode(rec.to_dict()), create_revision=1, mod_revision=2, version=1,
              lease=0)


@pytest.mark.parametrize("state", list(GangState))
def test_only_a_reserving_record_is_kept(state: GangState) -> None:
    assert reserving(stored(state)) is (state == GangState.RESERVING)


@pytest.mark.parametrize("text", ['"state":"RESERVING"', 'state:RESERVING', '{"state":"RESERVING"}'])
def test_a_user_string_cannot_make_a_record_look_reserving(text: str) -> None:
    # Its quotes are escaped in the stored JSON, so the bytes never match.
    assert not reserving(stored(GangState.PENDING, reason=text, command=("echo", text)))
