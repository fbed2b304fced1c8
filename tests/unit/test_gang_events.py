"""A gang's bounded event history (coordinator/core/events.py) and its place
in the gang record."""

from __future__ import annotations

import pytest

from coordinator.core import events as ev
from coordinator.core.events import GangEvent
from coordinator.core.progress import MemberReport
from coordinator.core.records import GangRecord, MemberAssignment
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.store import encode
from phalanx import limits
from phalanx.model import EventKind, GangState, MemberPhase
from phalanx.spec import parse_spec

SPEC = parse_spec({"name": "g", "members": 2, "resources": {"gpus": 1}})


def e(i: int, message: str = "") -> GangEvent:
    return GangEvent(EventKind.STARTED.value, 1000.0 + i, 7, message or f"event {i}")


def grow(n: int, message: str = "", **bounds: int) -> tuple[GangEvent, ...]:
    out: tuple[GangEvent, ...] = ()
    for i in range(n):
        out = ev.append(out, [e(i, message)], **bounds)
    return out


def test_events_are_numbered_in_order_and_kept_while_under_the_bounds() -> None:
    out = grow(5)
    assert [x.seq for x in out] == [1, 2, 3, 4, 5]
    assert [x.message for x in out] == [f"event {i}" for i in range(5)]
    assert all(x.kind != EventKind.DROPPED.value for x in out)


def test_past_the_count_the_oldest_go_behind_one_marker_that_counts_them() -> None:
    out = grow(25, max_count=10)
    assert len(out) == 10
    marker, kept = out[0], out[1:]
    assert marker.kind == EventKind.DROPPED.value and marker.dropped == 16
    assert marker.message == "16 earlier events dropped"
    assert [x.seq for x in kept] == list(range(17, 26)), "the newest kept, in order, numbers never reused"
    assert marker.seq == 16 and marker.at == 1015.0, "the marker stands where the newest dropped event stood"


def test_past_the_bytes_the_oldest_go_too() -> None:
    out = grow(40, message="x" * 400, max_count=1000, max_bytes=4096)
    assert ev.list_bytes(out) <= 4096
    assert out[0].kind == EventKind.DROPPED.value and out[0].dropped + len(out) - 1 == 40
    assert out[-1].seq == 40


def test_the_default_bounds_hold_with_worst_case_messages() -> None:
    out = grow(3 * limits.MAX_GANG_EVENTS, message="é" * 10_000)
    assert len(out) <= limits.MAX_GANG_EVENTS
    assert ev.list_bytes(out) <= limits.MAX_GANG_EVENTS_BYTES
    assert all(len(x.message) <= limits.MAX_EVENT_MESSAGE_CHARS for x in out)
    assert "more characters" in out[-1].message, "a clipped message says so"


def test_an_event_round_trips_through_json() -> None:
    x = GangEvent(EventKind.MEMBER_EXITED.value, 12.5, 3, "rank 1 exited", incarnation=2, by="", rank=0, exit_code=3, seq=9)
    assert GangEvent.from_dict(x.to_dict()) == x
    assert "by" not in x.to_dict() and "dropped" not in x.to_dict(), "defaults are not stored"
    with pytest.raises(TypeError, match="events: must be a list"):
        ev.from_json({"kind": "x"})


def record(**over) -> GangRecord:
    fields = {"id": "g-1", "spec": SPEC, "state": GangState.PENDING, "owner_az": "az-a", "submitted_at": 1.0,
              "updated_at": 1.0, **over}
    return GangRecord(**fields)


def test_a_record_written_before_events_reads_and_keeps_its_shape() -> None:
    old = record().to_dict()
    assert "events" not in old
    back = GangRecord.from_dict(old)
    assert back.events == () and back.to_dict() == old


def test_a_record_carries_its_events_through_to_dict_and_back() -> None:
    g = record().with_events([ev.submitted(1.0, 5, "submitter/alice", "default", 0)])
    g = g.with_events([ev.placed(2.0, 5, 1, [MemberAssignment(0, "az-a", "n0", (0,), ())], "best leaf")])
    back = GangRecord.from_dict(g.to_dict())
    assert back.events == g.events
    assert [x.kind for x in back.events] == ["submitted", "placed"] and [x.seq for x in back.events] == [1, 2]
    assert back.events[0].by == "submitter/alice"


def test_the_whole_gang_write_bound_holds_with_a_full_event_list() -> None:
    """As tests/unit/test_limits.py's worst gang, plus every event at its worst."""
    gpus, nics = 8, 8
    shape = {"name": "g", "members": limits.MAX_MEMBERS, "resources": {"gpus": gpus, "rdma_nics": nics},
             "run": {"command": ["x" * 100]}}
    spec_bytes = limits.json_bytes(parse_spec(shape, stored=True).to_dict())  # the widest member count: an upper bound
    most = limits.max_members_of_shape(gpus, nics, spec_bytes)
    node = lambda r: f"{r:0{limits.MAX_NODE_NAME_LEN}d}"  # noqa: E731
    az = "a" * limits.MAX_AZ_NAME_LEN
    spec = parse_spec({**shape, "members": most})
    placement = tuple(MemberAssignment(r, az, node(r), tuple(range(limits.MAX_GPU_INDEX - gpus + 1, limits.MAX_GPU_INDEX + 1)),
                                       tuple(f"{i:0{limits.MAX_NIC_NAME_LEN}d}" for i in range(nics))) for r in range(most))
    full = grow(2 * limits.MAX_GANG_EVENTS, message="é" * 10_000)
    g = GangRecord(id="g" * 54 + "-12345678", spec=spec, state=GangState.RESERVED, owner_az=az, submitted_at=1.7e9,
                   updated_at=1.7e9, reason="é" * limits.MAX_REASON_CHARS, placement=placement,
                   idempotency_key="k" * limits.MAX_IDEMPOTENCY_KEY_LEN, restarts=100, incarnation=101, events=full)
    r = Reservation(az=az, gang=g.id, incarnation=101, state=HoldState.COMMITTED,
                    nodes={m.node: NodeDevices(m.gpus, m.nics) for m in placement}, epoch=2**40)
    real = len(encode(g.to_dict())) + len(encode(r.to_dict()))
    assert real <= limits.reservation_txn_bound(most, gpus, nics, spec_bytes) <= limits.MAX_RESERVATION_TXN_BYTES


@pytest.mark.parametrize("reports,expected", [
    ({0: MemberReport(MemberPhase.RUNNING), 1: MemberReport(MemberPhase.FAILED, 3, "oom", "n1")},
     [(1, 3, "rank 1 on n1 exited with code 3: oom")]),
    ({0: MemberReport(MemberPhase.STOPPED, -1, "node lost", "n0")}, [(0, None, "rank 0 on n0 was stopped: node lost")]),
    ({0: MemberReport(MemberPhase.SUCCEEDED)}, []),
    ({r: MemberReport(MemberPhase.FAILED, 1, "", f"n{r}") for r in range(5)},
     [(0, 1, "rank 0 on n0 exited with code 1"), (1, 1, "rank 1 on n1 exited with code 1"),
      (2, 1, "rank 2 on n2 exited with code 1"), (None, None, "and 2 more members exited")]),
])
def test_member_exits_name_rank_and_code(reports, expected) -> None:
    out = ev.member_exits(5.0, 2, 1, reports)
    assert [(x.rank, x.exit_code, x.message) for x in out] == expected
    assert all(x.kind == "member_exited" and x.epoch == 2 and x.incarnation == 1 for x in out)


def test_messages_say_where_why_and_who() -> None:
    placement = [MemberAssignment(r, "az-a" if r < 3 else "az-b", f"n{r}", (0, 1), ()) for r in range(6)]
    assert ev.placement_summary(placement) == "6 members, 12 GPUs on 6 nodes in az-a, az-b (n0, n1, n2, n3 and 2 more)"
    assert ev.placed(1, 2, 1, placement, "leaf l0:\n  tightest").message.endswith("; leaf l0: tightest"), "one line"
    assert ev.restarting(1, 2, 3, 3, 5, "rank 0 exited").message == \
        "restarting: incarnation 3 -> 4 (restart 3 of 5) after: rank 0 exited"
    assert "unauthenticated" in ev.submitted(1, 2, "", "q", 0).message
    assert ev.cancelled(1, 2, 1, "submitter/bob", "no longer needed").message == "cancelled by submitter/bob: no longer needed"
    assert ev.fenced(1, 9, "az-a", 4, 1).message.startswith("leader epoch 9 of az-a took over from epoch 4")


def test_on_the_wire_and_in_describe_events_read_in_order() -> None:
    from coordinator.convert import gang_to_pb
    from phalanx.cli import describe_full, event_line
    from phalanx.wire import message_to_dict

    placement = (MemberAssignment(0, "az-a", "n0", (0,), ()),)
    g = record(state=GangState.RUNNING, placement=placement).with_events(
        [ev.submitted(1.7e9, 5, "admin/t", "default", 0), ev.placed(1.7e9 + 1, 5, 1, placement, "leaf l0"),
         ev.started(1.7e9 + 2, 5, 1, 1)])
    msg = gang_to_pb(g)
    assert [e.seq for e in msg.events] == [1, 2, 3] and msg.events[0].by == "admin/t"
    assert message_to_dict(msg.events[0])["at"] == "2023-11-14T22:13:20.000Z", "times as RFC 3339, as every time field"
    text = describe_full(msg)
    heads = [text.index(h) for h in ("\nspec:\n", "\nstate:\n", "\nplacement:\n", "\nevents:\n")]
    assert heads == sorted(heads)
    assert text[heads[-1]:].splitlines()[2:] == ["  " + event_line(e) for e in msg.events]
    assert "events: - (none recorded" in describe_full(gang_to_pb(record())), "an old record says why it has none"
