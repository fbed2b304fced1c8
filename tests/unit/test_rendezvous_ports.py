"""The rendezvous port choice and checks (coordinator/core/rendezvous.py,
agent/core/rendezvous.py, agent/rendezvous.py), by tables."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agent.core.rendezvous import port_refusal
from agent.rendezvous import bind_error, local_address_towards
from agent.sim import node_port_slices
from coordinator.core.records import GangRecord, NodeRecord
from coordinator.core.rendezvous import pick_master_port, ports_taken_on
from phalanx.agent_messages import rendezvous_of
from phalanx.ports import DEFAULT_PORTS, parse_port_range, split_port_range
from phalanx.model import GangState
from phalanx.spec import parse_spec
from phalanx.topology import NodeTopology
from phalanx.v1 import agent_pb2 as apb

REPO = Path(__file__).resolve().parents[2]


def test_the_pick_is_in_range_and_the_same_for_the_same_incarnation() -> None:
    for gang in ("a-1", "b-2", "llama-0f3e"):
        for inc in (1, 2, 3):
            p = pick_master_port((30000, 30009), gang, inc)
            assert 30000 <= p <= 30009
            assert p == pick_master_port((30000, 30009), gang, inc), "every leader computes the same"


def test_incarnations_move_the_port() -> None:
    ports = {pick_master_port(DEFAULT_PORTS, "train-abc", inc) for inc in range(1, 21)}
    assert len(ports) > 15, "the start point depends on the incarnation"


@pytest.mark.parametrize("ports, taken, expected", [
    ((1100, 1100), set(), 1100),                        # one port: that one
    ((1100, 1102), {1100, 1101}, 1102),                  # the only free one
    ((1100, 1102), {1101, 1102}, 1100),
    ((1100, 1102), {1100, 1101, 1102}, None),            # all taken: the start (the agent refuses it)
])
def test_taken_ports_are_skipped(ports, taken, expected) -> None:
    got = pick_master_port(ports, "g-1", 1, taken)
    start = pick_master_port(ports, "g-1", 1)
    assert got == (start if expected is None else expected)


def test_previous_and_live_ports_are_never_picked() -> None:
    # Every start point of a 5-port range, with 4 taken: always the fifth.
    for inc in range(1, 30):
        assert pick_master_port((2000, 2004), "g-1", inc, {2000, 2001, 2003, 2004}) == 2002


def test_ports_taken_on_a_node() -> None:
    live = [("a", "n0", 2000), ("b", "n1", 2001), ("c", "n0", 2002), ("d", "n0", 0), ("self", "n0", 2003)]
    assert ports_taken_on("n0", live, except_gang="self") == {2000, 2002}


@pytest.mark.parametrize("text, expected", [("20000-29999", (20000, 29999)), ("29500", (29500, 29500)),
                                            (" 1024-65535 ", (1024, 65535))])
def test_parse_port_range(text, expected) -> None:
    assert parse_port_range(text, "--rendezvous-ports") == expected


@pytest.mark.parametrize("text, why", [
    ("80-90", "below 1024 needs root"), ("20000-70000", "1024-65535"), ("30000-20000", "is above the last"),
    ("a-b", "expected FIRST-LAST"), ("", "expected FIRST-LAST"),
])
def test_bad_port_ranges_name_the_flag_and_why(text, why) -> None:
    with pytest.raises(ValueError) as e:
        parse_port_range(text, "--rendezvous-ports")
    assert str(e.value).startswith("--rendezvous-ports: ") and why in str(e.value)


@pytest.mark.parametrize("first, last, parts, expected", [
    (20000, 29999, 3, [(20000, 23333), (23334, 26666), (26667, 29999)]),
    (100, 103, 4, [(100, 100), (101, 101), (102, 102), (103, 103)]),
    (100, 109, 1, [(100, 109)]),
])
def test_split_port_range_is_disjoint_and_complete(first, last, parts, expected) -> None:
    got = split_port_range(first, last, parts)
    assert got == expected
    assert sum(b - a + 1 for a, b in got) == last - first + 1


def test_simulated_nodes_share_slices_only_without_real_members() -> None:
    assert node_port_slices((2000, 2001), 3, strict=False) == [(2000, 2000), (2001, 2001), (2000, 2000)]
    with pytest.raises(ValueError, match="fewer than the 3 nodes"):
        node_port_slices((2000, 2001), 3, strict=True)


@pytest.mark.parametrize("port, held, bind, expected", [
    (2000, {}, None, ""),
    (2000, {"same": 2000}, None, ""),  # this gang's own (a re-sent assignment)
    (2000, {"other": 2000}, None, "held by rank 0 of gang other"),
    (2000, {}, "bind: EADDRINUSE", "is in use (bind: EADDRINUSE)"),
    (1999, {}, None, "outside the rendezvous ports 2000-2009"),
])
def test_port_refusal(port, held, bind, expected) -> None:
    why = port_refusal(port, "n0", "same", held, bind, (2000, 2009))
    assert (why == "") if expected == "" else (expected in why and "MASTER_PORT" in why and "n0" in why)


def test_bind_error_sees_a_listener_and_ignores_a_closed_port() -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.listen()
        assert bind_error(port, "127.0.0.1") == "bind: EADDRINUSE"
    assert bind_error(port, "127.0.0.1") is None


def test_local_address_towards_a_loopback_peer_is_loopback() -> None:
    assert local_address_towards("127.0.0.1:2379") == "127.0.0.1"
    assert local_address_towards("not an address") == ""


def test_registration_fields() -> None:
    assert rendezvous_of(apb.Register()) == ("", DEFAULT_PORTS), "an older agent sends neither"
    reg = apb.Register(address="10.0.0.5", rendezvous_ports=apb.PortRange(first=30000, last=30099))
    assert rendezvous_of(reg) == ("10.0.0.5", (30000, 30099))
    with pytest.raises(ValueError, match="register.rendezvous_ports"):
        rendezvous_of(apb.Register(rendezvous_ports=apb.PortRange(first=0, last=10)))
    with pytest.raises(ValueError, match="register.address"):
        rendezvous_of(apb.Register(address="10.0.0.5 evil"))


def test_records_round_trip_and_read_older_records() -> None:
    topo = NodeTopology(node="n0", az="az-a")
    rec = NodeRecord(topology=topo, ready=True, address="10.0.0.5", ports=(30000, 30099))
    assert NodeRecord.from_dict(rec.to_dict()) == rec
    old = {k: v for k, v in rec.to_dict().items() if k not in ("address", "ports")}
    back = NodeRecord.from_dict(old)
    assert back.address == "" and back.ports == DEFAULT_PORTS
    spec = parse_spec({"name": "g", "members": 1, "resources": {"gpus": 1}})
    g = GangRecord(id="g-1", spec=spec, state=GangState.RESERVED, owner_az="az-a", submitted_at=1.0, updated_at=1.0,
                   master_addr="10.0.0.5", master_port=30007)
    assert GangRecord.from_dict(g.to_dict()) == g
    unplaced = g.evolve(master_addr="", master_port=0)
    assert "master_port" not in unplaced.to_dict(), "records without a rendezvous keep their old shape"


def test_agent_refuses_a_bad_range_with_one_error_line() -> None:
    p = subprocess.run([sys.executable, "-m", "agent", "--az", "az-a", "--etcd", "127.0.0.1:1",
                        "--rendezvous-ports", "80-90", "--insecure"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: --rendezvous-ports: ports must lie in 1024-65535 (below 1024 needs root), got 80-90"]
