"""Stimulus ids where they are kept and shown (docs/design.md §19.5): a gang
event stores the id of the decision that wrote it (old records without one
still read), the wire and `phalanx describe` carry it, and every two-phase
effect has one log line at the level docs/logging.md "Effects" gives it."""

from __future__ import annotations

import logging

import pytest

from coordinator.convert import gang_to_pb
from coordinator.core import events as ev
from coordinator.core import twophase_events as tp
from coordinator.core.effect_lines import CHATTY, effect_line
from coordinator.core.records import GangRecord
from coordinator.core.twophase_model import Outcome
from phalanx.cli import describe_full, event_line
from phalanx.spec import parse_spec
from phalanx.model import GangState


def record(**kw) -> GangRecord:
    spec = parse_spec({"name": "g", "members": 1, "resources": {"gpus": 1}, "run": {"command": ["true"]}})
    return GangRecord(id="g-00000001", spec=spec, state=GangState.PENDING, owner_az="az-a", submitted_at=1.7e9,
                      updated_at=1.7e9, **kw)


def test_an_event_keeps_its_stimulus_through_the_record_and_an_old_one_reads_without() -> None:
    e = ev.started(1.7e9, 5, 1, 2).stamped("az-a-17")
    assert e.stimulus == "az-a-17" and e.to_dict()["stimulus"] == "az-a-17"
    assert e.stamped("az-a-99").stimulus == "az-a-17", "the decision that made it, not a later write"
    assert ev.started(1.7e9, 5, 1, 2).stamped("").stimulus == ""
    g = record().with_events([e, ev.finished(1.7e9, 5, 1, "SUCCEEDED", "done")])
    back = GangRecord.from_dict(g.to_dict(), 7)
    assert [x.stimulus for x in back.events] == ["az-a-17", ""]
    assert "stimulus" not in back.events[1].to_dict(), "a default costs no bytes"
    old = {"kind": "submitted", "at": 1.7e9, "epoch": 3, "message": "submitted", "seq": 1}  # before the field
    assert ev.GangEvent.from_dict(old).stimulus == ""
    assert len(ev.GangEvent(kind="placed", at=1, epoch=1, message="m").stamped("x" * 1000).stimulus) == ev.MAX_STIMULUS_CHARS


def test_the_stimulus_survives_the_events_bound() -> None:
    events: tuple[ev.GangEvent, ...] = ()
    for i in range(3 * ev.limits.MAX_GANG_EVENTS):
        events = ev.append(events, [ev.started(1.7e9 + i, 5, 1, 2).stamped(f"az-a-{i}")])
    kept = [e for e in events if e.kind != "dropped"]
    assert kept and all(e.stimulus == f"az-a-{int(e.at - 1.7e9)}" for e in kept)
    assert ev.list_bytes(events) <= ev.limits.MAX_GANG_EVENTS_BYTES


def test_the_wire_and_describe_show_each_events_stimulus() -> None:
    g = record().with_events([ev.submitted(1.7e9, 5, "admin/t", "default", 0).stamped("az-a-3"),
                              ev.started(1.7e9 + 1, 5, 1, 1)])
    msg = gang_to_pb(g)
    assert [e.stimulus for e in msg.events] == ["az-a-3", ""]
    lines = describe_full(msg).split("\nevents:\n", 1)[1].splitlines()
    assert lines == ["  " + event_line(msg.events[0]) + "  [stimulus=az-a-3]", "  " + event_line(msg.events[1])]


EFFECTS = [
    (tp.CreateDecision(stimulus_id="s1", gang="g", incarnation=2, outcome=Outcome.COMMIT, reason="all voted yes"),
     logging.INFO, "create decision g#2 = COMMIT (all voted yes)"),
    (tp.ReleaseHold(stimulus_id="s1", az="az-b", gang="g", incarnation=2, reason="aborted"),
     logging.INFO, "release the hold of g#2 in az-b (aborted)"),
    (tp.MarkGangFailed(stimulus_id="s1", gang="g", incarnation=2, reason="never fits"), logging.INFO, "fail g#2: never fits"),
    (tp.SendCommit(stimulus_id="s1", to_az="az-b", gang="g", incarnation=2), logging.DEBUG, "send commit of g#2 to az-b"),
    (tp.MarkGangPending(stimulus_id="s1", gang="g", incarnation=2, reason="no room"), logging.DEBUG, "note g#2 pending: no room"),
]


@pytest.mark.parametrize("effect,level,text", EFFECTS, ids=[type(e).__name__ for e, _, _ in EFFECTS])
def test_each_effect_has_one_line_at_its_level(effect, level, text) -> None:
    assert effect_line(effect) == (level, text)


def test_every_effect_class_gets_a_line_and_only_messages_timers_and_notes_are_chatty() -> None:
    effects = [c for c in vars(tp).values() if isinstance(c, type) and issubclass(c, tp.Effect) and c is not tp.Effect]
    assert effects
    names = {c.__name__ for c in effects}
    assert CHATTY <= names, CHATTY - names  # no name in CHATTY that is no effect
    writes = {"WriteHold", "MarkCommitted", "ReleaseHold", "CreateDecision", "WriteAttempt", "MarkGangReserved",
              "MarkGangFailed", "DispatchGang"}
    assert not (writes & CHATTY) and writes <= names
