"""Table tests of phalanx/agent_messages.py: every message between leader and
agents survives its protobuf (through the wire bytes, too), and a message an
agent must not send is refused with the field it got wrong."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from agent.topology.simulated import simulated_node
from phalanx import agent_messages as am
from phalanx.limits import MAX_MEMBER_REASON_BYTES
from phalanx.model import MemberPhase
from phalanx.ports import DEFAULT_PORTS
from phalanx.v1 import agent_pb2 as apb

NODE = simulated_node("n0", "az-a")
STATUS = am.MemberStatus(gang="g-00000001", incarnation=2, rank=3, phase=MemberPhase.RUNNING, exit_code=0, epoch=7,
                         reason="started", gpus=(0, 1), pid=4242, at=1.5e9, node="n0")
ASSIGN = am.Assign(gang="g-00000001", incarnation=2, rank=3, world_size=4, local_rank=1, local_world_size=2,
                   gpus=(4, 5), nics=("mlx5_0",), command=("python", "-c", "pass"), env={"A": "1"}, duration_s=2.5,
                   master_addr="10.0.0.1", master_port=29500, owner="user/alice", stimulus_id="az-a-17")

UPWARD = [
    ("register, a current agent", am.Register(agent_id="agent-1", topology=NODE, members=(STATUS,), highest_epoch=9,
                                              address="10.0.0.2", rendezvous_ports=(30000, 30099))),
    ("register, nothing running", am.Register(agent_id="agent-1", topology=NODE)),
    ("heartbeat", am.Heartbeat(seq=12)),
    ("heartbeat with its members", am.Heartbeat(seq=13, members=(STATUS, dataclasses.replace(STATUS, rank=0)))),
    ("member report", STATUS),
    ("member that failed", dataclasses.replace(STATUS, phase=MemberPhase.FAILED, exit_code=3, reason="exited 3")),
]

DOWNWARD = [
    ("welcome", am.Welcome(coordinator_id="a0", heartbeat_interval_s=0.5, fence_after_s=6.0)),
    ("assign", ASSIGN),
    ("assign, plaintext owner, no stimulus", dataclasses.replace(ASSIGN, owner="", stimulus_id="", env={})),
    ("revoke", am.Revoke(gang="g-00000001", incarnation=2, reason="cancelled", stimulus_id="az-a-18")),
    ("heartbeat ack", am.HeartbeatAck(seq=12)),
]


@pytest.mark.parametrize("what,msg", UPWARD, ids=[w for w, _ in UPWARD])
def test_an_agent_message_round_trips_through_the_wire(what: str, msg: am.ToLeader) -> None:
    wire = am.FromAgent(msg).to_pb().SerializeToString()
    assert am.FromAgent.from_pb(apb.AgentMessage.FromString(wire)) == am.FromAgent(msg), what


@pytest.mark.parametrize("what,msg", DOWNWARD, ids=[w for w, _ in DOWNWARD])
def test_a_leader_message_round_trips_with_its_stamp(what: str, msg: am.ToAgent) -> None:
    sent = am.FromLeader(epoch=41, az="az-a", body=msg)
    got = am.FromLeader.from_pb(apb.CoordinatorMessage.FromString(sent.to_pb().SerializeToString()))
    assert got == sent, what
    assert type(got.body) is type(msg)


def test_the_oneof_kind_of_each_message_is_the_protos() -> None:
    """The wire is unchanged: each typed message lands in the proto field an
    older peer reads."""
    kinds = {type(m): am.FromLeader(1, "az-a", m).to_pb().WhichOneof("kind") for _, m in DOWNWARD}
    assert kinds == {am.Welcome: "welcome", am.Assign: "assign", am.Revoke: "revoke",
                     am.HeartbeatAck: "heartbeat_ack"}
    kinds = {type(m): am.FromAgent(m).to_pb().WhichOneof("kind") for _, m in UPWARD}
    assert kinds == {am.Register: "register", am.Heartbeat: "heartbeat", am.MemberStatus: "member"}


def test_an_older_agents_registration_gets_the_default_rendezvous() -> None:
    pb = apb.Register(agent_id="agent-1", topology=am.Register(agent_id="", topology=NODE).to_pb().topology)
    reg = am.Register.from_pb(pb)
    assert (reg.address, reg.rendezvous_ports) == ("", DEFAULT_PORTS)


def _register(**fields: Any) -> apb.Register:
    pb = am.Register(agent_id="agent-1", topology=NODE).to_pb()
    for name, value in fields.items():
        if name == "members":
            pb.members.extend(value)
        elif name == "rendezvous_ports":
            pb.rendezvous_ports.CopyFrom(value)
        else:
            setattr(pb, name, value)
    return pb


def _status(**fields: Any) -> apb.MemberStatus:
    """STATUS on the wire with some scalar fields set as a peer might."""
    pb = STATUS.to_pb()
    for name, value in fields.items():
        setattr(pb, name, value)
    return pb


REFUSED: list[tuple[str, Any, Any, str]] = [
    ("register: member phase 99", am.Register.from_pb, _register(members=[_status(phase=99)]),
     "register.members[0].phase: unknown member phase 99"),
    ("register: member reason over the bound", am.Register.from_pb,
     _register(members=[_status(reason="x" * (MAX_MEMBER_REASON_BYTES + 1))]), "register.members[0].reason"),
    ("register: member gang not an id", am.Register.from_pb, _register(members=[_status(gang="a/b")]),
     "register.members[0].gang"),
    ("register: agent id with a newline", am.Register.from_pb, _register(agent_id="agent\n"), "register.agent_id"),
    ("register: address with a space", am.Register.from_pb, _register(address="10.0.0.5 evil"), "register.address"),
    ("register: ports below the range", am.Register.from_pb,
     _register(rendezvous_ports=apb.PortRange(first=0, last=10)), "register.rendezvous_ports"),
    ("register: ports the wrong way round", am.Register.from_pb,
     _register(rendezvous_ports=apb.PortRange(first=30010, last=30000)), "register.rendezvous_ports"),
    ("register: node name with NUL", am.Register.from_pb,
     am.Register(agent_id="a", topology=simulated_node("n\x00", "az-a")).to_pb(), "register.topology.node"),
    ("heartbeat: member phase 0", am.Heartbeat.from_pb, apb.Heartbeat(seq=1, members=[_status(phase=0)]),
     "heartbeat.members[0].phase"),
    ("heartbeat: negative incarnation", am.Heartbeat.from_pb, apb.Heartbeat(seq=1, members=[_status(incarnation=-1)]),
     "heartbeat.members[0].incarnation"),
    ("member: rank past the bound", am.MemberStatus.from_pb, _status(rank=1 << 20), "member.rank"),
    ("agent message with no kind", am.FromAgent.from_pb, apb.AgentMessage(), "kind"),
    ("leader message with no kind", am.FromLeader.from_pb, apb.CoordinatorMessage(epoch=3), "kind"),
    ("assign: no gang", am.Assign.from_pb, dataclasses.replace(ASSIGN, gang="").to_pb(), "assign.gang"),
    ("assign: negative GPU", am.Assign.from_pb, dataclasses.replace(ASSIGN, gpus=(-1,)).to_pb(), "assign.gpus"),
    ("assign: port past 65535", am.Assign.from_pb, dataclasses.replace(ASSIGN, master_port=70000).to_pb(),
     "assign.master_port"),
    ("revoke: no gang", am.Revoke.from_pb, apb.Revocation(incarnation=1), "revoke.gang"),
]


@pytest.mark.parametrize("what,parse,pb,words", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_bad_message_is_refused_naming_its_field(what: str, parse: Any, pb: Any, words: str) -> None:
    with pytest.raises(am.MessageError) as err:
        parse(pb)
    assert words in str(err.value), (what, str(err.value))
    assert isinstance(err.value, ValueError)


def test_every_error_of_a_registration_is_named_not_only_the_first() -> None:
    pb = _register(agent_id="agent\n", members=[_status(phase=99), _status(gang="a/b")])
    with pytest.raises(am.MessageError) as err:
        am.Register.from_pb(pb)
    fields = [e.split(":")[0] for e in err.value.errors]
    assert fields == ["register.agent_id", "register.members[0].phase", "register.members[1].gang"], err.value.errors


@pytest.mark.parametrize("reason", ["short", "x" * 5000, "é" * 1000, "🙂" * 300])
def test_an_agents_bounded_reason_is_always_taken(reason: str) -> None:
    clipped = am.bounded_reason(reason)
    assert len(clipped.encode()) <= MAX_MEMBER_REASON_BYTES
    assert clipped == reason or clipped.endswith("...")
    am.MemberStatus.from_pb(dataclasses.replace(STATUS, reason=clipped).to_pb())
