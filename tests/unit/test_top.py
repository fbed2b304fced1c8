"""``phalanx top``'s view (phalanx/top.py): built from the answers of
ClusterStatus, ListNodes and ListGangs by a pure function, drawn as plain
text and as rich tables."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from phalanx import cli
from phalanx.top import AzRow, TopView, build_view, explained_reason, render_rich, render_text, with_error
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb

NOW = 1_000_000.0


def az(name: str, leader: str = "", epoch: int = 0, ready: int = 0, total: int = 0, gpus: int = 0, free: int = 0) -> gpb.AzStatus:
    return gpb.AzStatus(az=name, has_leader=bool(leader), leader_id=leader, leader_address=f"{leader}:7070" if leader else "",
                        epoch=epoch, nodes_ready=ready, nodes_total=total, gpus_total=gpus, gpus_free=free)


def node(name: str, az_: str, used: int, total: int = 8, ready: bool = True) -> pb.NodeStatus:
    return pb.NodeStatus(topology=pb.NodeTopology(node=name, az=az_), ready=ready, gpus_total=total, gpus_used=used)


def gang(id_: str, submitted_at: float, *, state: int = pb.GANG_STATE_PENDING, members: int = 2, gpus: int = 8,
         timeout: float = 3600.0, reason: str = "", queue: str = "", owner_az: str = "az-a") -> pb.Gang:
    return pb.Gang(id=id_, state=state, owner_az=owner_az, submitted_at=submitted_at, reason=reason,
                   spec=pb.GangSpec(name=f"name-{id_}", queue=queue, members=members, resources=pb.Resources(gpus=gpus),
                                    policy=pb.Policy(admission_timeout_s=timeout)))


def status(*azs: gpb.AzStatus, **states: int) -> gpb.ClusterStatusResponse:
    return gpb.ClusterStatusResponse(cluster="c1", served_by="az-a-c0", azs=list(azs), gangs_by_state=states)


# (AZ statuses, nodes, expected AZ rows). Used GPUs come from ClusterStatus
# (total - free, every node); "free (ready)" only from ready nodes: GPUs on
# a node that is down are neither used nor placeable.
AZ_CASES = [
    pytest.param([az("az-b", "b0", 4, 1, 1, 8, 8), az("az-a", "a1", 7, 2, 2, 16, 13)],
                 [node("n0", "az-a", 3), node("n1", "az-a", 0), node("m0", "az-b", 0)],
                 [AzRow("az-a", "a1", "a1:7070", 7, 2, 2, 3, 13, 16), AzRow("az-b", "b0", "b0:7070", 4, 1, 1, 0, 8, 8)],
                 id="sorted-by-az"),
    pytest.param([az("az-a", "", 9, 1, 2, 16, 16)], [node("n0", "az-a", 0), node("n1", "az-a", 0, ready=False)],
                 [AzRow("az-a", "", "", 0, 1, 2, 0, 8, 16)], id="no-leader-and-a-node-down"),
    pytest.param([az("az-a", "a0", 2, 0, 0, 0, 0)], [], [AzRow("az-a", "a0", "a0:7070", 2, 0, 0, 0, 0, 0)], id="no-nodes"),
    pytest.param([az("az-a", "a0", 2, 1, 1, 8, 0)], [node("n0", "az-a", 9)], [AzRow("az-a", "a0", "a0:7070", 2, 1, 1, 8, 0, 8)],
                 id="over-used-node-counts-no-negative-free"),
]


@pytest.mark.parametrize("azs, nodes, want", AZ_CASES)
def test_az_rows(azs: list[gpb.AzStatus], nodes: list[pb.NodeStatus], want: list[AzRow]) -> None:
    view = build_view(status(*azs), nodes, [], now=NOW)
    assert list(view.azs) == want
    assert [a.has_leader for a in view.azs] == [bool(w.leader) for w in want]


@pytest.mark.parametrize("states, want", [
    ({"RUNNING": 3, "PENDING": 1, "SUCCEEDED": 0}, (("PENDING", 1), ("RUNNING", 3))),
    ({"GANG_STATE_FAILED": 2, "GANG_STATE_RESERVING": 1}, (("RESERVING", 1), ("FAILED", 2))),
    ({"UNREADABLE": 1, "RESTARTING": 2, "PENDING": 4}, (("PENDING", 4), ("RESTARTING", 2), ("UNREADABLE", 1))),
    ({}, ()),
])
def test_gangs_by_state_in_lifecycle_order_without_zeros(states: dict[str, int], want: tuple) -> None:
    assert build_view(status(**states), [], [], now=NOW).gangs_by_state == want


def test_pending_oldest_first_capped_and_counted() -> None:
    gangs = [gang("g3", NOW - 10), gang("g1", NOW - 300, reason="queue position 1 of 3 in az-a:\n  waited"),
             gang("g2", NOW - 300), gang("r1", NOW - 999, state=pb.GANG_STATE_RUNNING), gang("g4", NOW + 5)]
    view = build_view(status(), [], gangs, now=NOW, rows=2)
    assert [p.id for p in view.pending] == ["g1", "g2"]  # equal times: by id
    assert view.pending_total == 4  # the RUNNING one is not pending
    first = view.pending[0]
    assert (first.gpus, first.waited_s, first.reason) == (16, 300.0, "queue position 1 of 3 in az-a: waited")
    # A submission time ahead of this clock waited 0, not a negative time.
    assert build_view(status(), [], gangs, now=NOW).pending[-1].waited_s == 0.0
    assert build_view(status(), [], gangs, now=NOW, rows=0).pending == ()


@pytest.mark.parametrize("answer, want", [
    (gpb.ExplainGangResponse(leader_reason="queue position 2 of 2 in az-a: held back", summary="long"), "queue position 2 of 2 in az-a: held back"),
    (gpb.ExplainGangResponse(summary="no leader in az-a answered"), "no leader in az-a answered"),
    (gpb.ExplainGangResponse(), ""),
])
def test_explained_reason_prefers_the_leaders_own(answer: gpb.ExplainGangResponse, want: str) -> None:
    assert explained_reason(answer) == want


def test_reasons_from_explain_win_over_the_records() -> None:
    gangs = [gang("g1", NOW - 5, reason="restarted: member 1 exited 3"), gang("g2", NOW - 4, reason="on record")]
    view = build_view(status(), [], gangs, now=NOW, reasons={"g1": "queue position 1 of 2 in az-a:  waiting"})
    assert [p.reason for p in view.pending] == ["queue position 1 of 2 in az-a: waiting", "on record"]


@pytest.mark.parametrize("waited, timeout, overdue", [(59.0, 60.0, False), (60.0, 60.0, False), (60.5, 60.0, True)])
def test_overdue_is_past_the_admission_timeout(waited: float, timeout: float, overdue: bool) -> None:
    view = build_view(status(), [], [gang("g", NOW - waited, timeout=timeout)], now=NOW)
    assert view.pending[0].overdue is overdue
    assert ("(overdue)" in render_text(view)) is overdue


def sample() -> TopView:
    return build_view(
        status(az("az-a", "a0", 5, 2, 2, 16, 8), az("az-b", "", 0, 0, 1, 8, 8), PENDING=2, RUNNING=1),
        [node("n0", "az-a", 8), node("n1", "az-a", 0), node("m0", "az-b", 0, ready=False)],
        [gang("g-old", NOW - 4000, timeout=3600, reason="no room"), gang("g-new", NOW - 30, members=1, gpus=4, queue="q1")],
        now=NOW, address="127.0.0.1:7070")


def test_render_text() -> None:
    assert render_text(sample()) == """\
cluster c1 (answered by az-a-c0 at 127.0.0.1:7070) 1970-01-12T13:46:40Z
AZ    LEADER  EPOCH  NODES READY/TOTAL  GPUS USED  GPUS FREE (READY)  GPUS TOTAL
az-a  a0      5      2/2                8          8                  16
az-b  (none)  -      0/1                0          0                  8
gangs: PENDING 2, RUNNING 1
pending: 2
ID     NAME        QUEUE  AZ    GPUS  WAITED  TIMEOUT        REASON
g-old  name-g-old  -      az-a  16    66m     60m (overdue)  no room
g-new  name-g-new  q1     az-a  4     30s     60m            -"""


def test_render_text_empty_cluster_and_capped_pending() -> None:
    assert render_text(build_view(status(), [], [], now=NOW)).splitlines()[1:] == ["no AZs", "gangs: none", "pending: none"]
    capped = build_view(status(), [], [gang(f"g{i}", NOW - i) for i in range(5)], now=NOW, rows=2)
    assert "pending: 5, 2 oldest shown" in render_text(capped)


def test_a_failed_refresh_keeps_the_last_view_and_says_why() -> None:
    view = with_error(sample(), "ClusterStatus: no coordinator could answer\nwithin 10s")
    text = render_text(view)
    assert text.splitlines()[1] == "refresh failed: ClusterStatus: no coordinator could answer within 10s"
    assert render_text(sample()) == "\n".join(line for i, line in enumerate(text.splitlines()) if i != 1)


def rich_text(view: TopView) -> str:
    console = Console(record=True, width=160, color_system="truecolor")
    console.print(render_rich(view))
    return console.export_text()


def test_render_rich_has_the_same_facts() -> None:
    text = rich_text(sample())
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in text.splitlines() if line.startswith("│")]
    assert ["az-a", "a0", "5", "2/2", "8", "8", "16"] in rows
    assert ["az-b", "(none)", "-", "0/1", "0", "0", "8"] in rows
    assert ["g-old", "name-g-old", "-", "az-a", "16", "66m", "60m (overdue)", "no room"] in rows
    assert "gangs: PENDING 2, RUNNING 1" in text
    assert "refresh failed: boom" in rich_text(with_error(sample(), "boom"))


def test_render_rich_marks_a_leaderless_az_and_an_overdue_gang_red() -> None:
    console = Console(record=True, width=160, color_system="truecolor")
    console.print(render_rich(sample()))
    html = console.export_html(inline_styles=True)
    red = [line for line in html.splitlines() if "color: #800000" in line]
    assert any("(none)" in line for line in red), "the AZ without a leader is not red"
    assert any("g-old" in line for line in red) and not any("g-new" in line for line in red)


def test_view_as_json_round_trips() -> None:
    data = json.loads(json.dumps(sample().to_dict()))
    assert data["azs"][0]["leader"] == "a0" and data["pending_total"] == 2
    assert data["pending"][0] == {"id": "g-old", "name": "name-g-old", "queue": "", "owner_az": "az-a", "gpus": 16,
                                  "waited_s": 4000.0, "timeout_s": 3600.0, "reason": "no room"}


@pytest.mark.parametrize("argv, field, value", [
    (["top"], "interval", 2.0),
    (["top", "--once", "--rows", "3"], "rows", 3),
    (["top", "--watch", "--interval", "0.5", "-o", "json"], "output", "json"),
])
def test_top_flags(argv: list[str], field: str, value: object) -> None:
    assert getattr(cli.build_parser().parse_args(argv), field) == value


@pytest.mark.parametrize("argv, words", [
    (["top", "--interval", "0"], "--interval"),
    (["top", "--rows", "-1"], "--rows"),
    (["top", "-o", "yaml"], "--output"),
])
def test_bad_top_flags_are_usage_errors(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert err.startswith("error:") and words in err, err
