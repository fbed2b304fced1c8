"""The messages between an AZ leader and its node agents, typed.

One frozen dataclass per message of ``phalanx/v1/agent.proto``, each with
exactly one conversion to its protobuf (``to_pb``) and one from it
(``from_pb``). Both ends speak only these: the leader builds ``Assign``,
``Revoke``, ``HeartbeatAck`` and ``Welcome`` and the servicer
(coordinator/agents.py) stamps them into a ``CoordinatorMessage``; the agent
(agent/session.py) builds ``Register``, ``MemberStatus`` and ``Heartbeat``.
The wire format is the proto's, unchanged.

``from_pb`` checks what arrives and raises ``MessageError`` whose message
names the field: an agent's messages are bounded here (docs/limits.md,
``phalanx.limits``), before the leader reads or writes anything of them.
What a leader sends is checked only as far as the agent relies on it; the
decisions on it (epoch rule, token, device ledger) stay in the agent.

Shared by coordinator and agent: imports nothing of either package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Union

from phalanx import limits, wire
from phalanx.model import MemberPhase
from phalanx.ports import DEFAULT_PORTS, validate_port_range
from phalanx.topology import NodeTopology
from phalanx.v1 import agent_pb2 as apb


class MessageError(ValueError):
    """A message that cannot be taken; ``errors`` name each field and why
    (the message shows the first ten)."""

    def __init__(self, errors: list[str] | str):
        self.errors = (errors,) if isinstance(errors, str) else tuple(errors)
        super().__init__("; ".join(self.errors[:10]))


def bounded_reason(text: str, limit: int = limits.MAX_MEMBER_REASON_BYTES) -> str:
    """``text`` cut to what a member report may carry (UTF-8 bytes), so an
    agent never sends a report its leader must refuse."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= limit:
        return text
    return raw[: limit - 3].decode("utf-8", "ignore") + "..."


# --------------------------------------------------------------------------- #
# Agent -> leader
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class MemberStatus:
    """What an agent says about one of its members (``MemberStatus``): the
    leader reads ``gang``, ``incarnation``, ``rank``, ``phase``,
    ``exit_code`` and ``reason``."""

    gang: str
    incarnation: int
    rank: int
    phase: MemberPhase
    exit_code: int = 0
    epoch: int = 0  # of the leader whose word caused this change
    reason: str = ""
    gpus: tuple[int, ...] = ()
    pid: int = 0
    at: float = 0.0  # agent's wall clock, unix seconds
    node: str = ""

    def to_pb(self) -> apb.MemberStatus:
        return apb.MemberStatus(
            gang=self.gang, incarnation=self.incarnation, rank=self.rank, phase=int(self.phase),
            exit_code=self.exit_code, epoch=self.epoch, reason=self.reason, gpus=list(self.gpus), pid=self.pid,
            at=self.at, node=self.node,
        )

    @classmethod
    def from_pb(cls, pb: apb.MemberStatus, path: str = "member") -> "MemberStatus":
        """``path``: where the report sits in its message, for the errors."""
        errors = limits.member_errors(pb, path)
        if errors:
            raise MessageError(errors)
        return cls(
            gang=pb.gang, incarnation=pb.incarnation, rank=pb.rank, phase=MemberPhase(pb.phase),
            exit_code=pb.exit_code, epoch=pb.epoch, reason=pb.reason, gpus=tuple(pb.gpus), pid=pb.pid,
            at=pb.at, node=pb.node,
        )


def _members_from_pb(members: "list[apb.MemberStatus]", path: str) -> tuple[MemberStatus, ...]:
    if len(members) > limits.MAX_MEMBERS_PER_REGISTRATION:
        raise MessageError(f"{path}: {len(members)} entries, more than the limit of "
                           f"{limits.MAX_MEMBERS_PER_REGISTRATION}")
    return tuple(MemberStatus.from_pb(m, f"{path}[{i}]") for i, m in enumerate(members))


def rendezvous_of(reg: apb.Register) -> tuple[str, tuple[int, int]]:
    """The advertised address and rendezvous ports of a registration; an
    older agent sends neither (address "", the default range). ValueError
    naming the field when they are unusable."""
    address = reg.address.strip()
    if address != reg.address or any(c.isspace() for c in address) or len(address) > 253:
        raise ValueError(f"register.address: {reg.address!r} is not a host address (an IP or a DNS name, no spaces)")
    if not reg.HasField("rendezvous_ports"):
        return address, DEFAULT_PORTS
    r = reg.rendezvous_ports
    return address, validate_port_range(r.first, r.last, "register.rendezvous_ports")


@dataclass(frozen=True)
class Register:
    """An agent's first message on a session: who it is, its node, and what
    it runs now."""

    agent_id: str
    topology: NodeTopology
    members: tuple[MemberStatus, ...] = ()
    highest_epoch: int = 0  # the highest leader epoch the agent has heard
    address: str = ""  # for MASTER_ADDR ("" from older agents: the node name)
    rendezvous_ports: tuple[int, int] = DEFAULT_PORTS

    def to_pb(self) -> apb.Register:
        first, last = self.rendezvous_ports
        return apb.Register(
            agent_id=self.agent_id, topology=wire.topology_to_pb(self.topology),
            members=[m.to_pb() for m in self.members], highest_epoch=self.highest_epoch, address=self.address,
            rendezvous_ports=apb.PortRange(first=first, last=last),
        )

    @classmethod
    def from_pb(cls, pb: apb.Register) -> "Register":
        """Everything a registration would write is checked here, before
        any of it is (docs/limits.md): every error found, each naming its
        field."""
        try:
            topology = wire.topology_from_pb(pb.topology)
        except ValueError as exc:
            raise MessageError(f"register.topology: {exc}") from None
        errors = limits.registration_errors(topology, pb.agent_id, pb.members)
        if errors:
            raise MessageError(errors)
        try:
            address, ports = rendezvous_of(pb)
        except ValueError as exc:
            raise MessageError(str(exc)) from None
        return cls(agent_id=pb.agent_id, topology=topology, members=_members_from_pb(pb.members, "register.members"),
                   highest_epoch=pb.highest_epoch, address=address, rendezvous_ports=ports)


@dataclass(frozen=True)
class Heartbeat:
    """Sent every heartbeat interval; now and then with every member (anti-entropy)."""

    seq: int
    members: tuple[MemberStatus, ...] = ()

    def to_pb(self) -> apb.Heartbeat:
        return apb.Heartbeat(seq=self.seq, members=[m.to_pb() for m in self.members])

    @classmethod
    def from_pb(cls, pb: apb.Heartbeat) -> "Heartbeat":
        return cls(seq=pb.seq, members=_members_from_pb(pb.members, "heartbeat.members"))


ToLeader = Union[Register, Heartbeat, MemberStatus]
_UPWARD_KIND = {Register: "register", Heartbeat: "heartbeat", MemberStatus: "member"}
_UPWARD_TYPE = {"register": Register, "heartbeat": Heartbeat}


@dataclass(frozen=True)
class FromAgent:
    """One ``AgentMessage``: its ``body`` is the one message it carries."""

    body: ToLeader

    def to_pb(self) -> apb.AgentMessage:
        return apb.AgentMessage(**{_UPWARD_KIND[type(self.body)]: self.body.to_pb()})

    @classmethod
    def from_pb(cls, pb: apb.AgentMessage) -> "FromAgent":
        kind = pb.WhichOneof("kind")
        if kind is None:
            raise MessageError("kind: the message carries none of register, heartbeat, member")
        if kind == "member":
            return cls(MemberStatus.from_pb(pb.member, "member"))
        return cls(_UPWARD_TYPE[kind].from_pb(getattr(pb, kind)))


# --------------------------------------------------------------------------- #
# Leader -> agent
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class Welcome:
    """The leader's answer to a registration: the session is up."""

    coordinator_id: str
    heartbeat_interval_s: float = 0.0
    fence_after_s: float = 0.0

    def to_pb(self) -> apb.Welcome:
        return apb.Welcome(coordinator_id=self.coordinator_id, heartbeat_interval_s=self.heartbeat_interval_s,
                           fence_after_s=self.fence_after_s)

    @classmethod
    def from_pb(cls, pb: apb.Welcome) -> "Welcome":
        return cls(coordinator_id=pb.coordinator_id, heartbeat_interval_s=pb.heartbeat_interval_s,
                   fence_after_s=pb.fence_after_s)


@dataclass(frozen=True)
class Assign:
    """Start one member of a gang's incarnation here (``Assignment``)."""

    gang: str
    incarnation: int
    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 0
    gpus: tuple[int, ...] = ()
    nics: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    duration_s: float = 0.0
    master_addr: str = ""
    master_port: int = 0
    owner: str = ""  # "<role>/<name>" of the submitter ("" for plaintext): the run-as account's key
    stimulus_id: str = ""  # the leader's decision that sent it ("" from an older leader)

    def to_pb(self) -> apb.Assignment:
        return apb.Assignment(
            gang=self.gang, incarnation=self.incarnation, rank=self.rank, world_size=self.world_size,
            local_rank=self.local_rank, local_world_size=self.local_world_size, gpus=list(self.gpus),
            nics=list(self.nics), command=list(self.command), env=dict(self.env), duration_s=self.duration_s,
            master_addr=self.master_addr, master_port=self.master_port, owner=self.owner,
            stimulus_id=self.stimulus_id,
        )

    @classmethod
    def from_pb(cls, pb: apb.Assignment) -> "Assign":
        errors = []
        if not pb.gang:
            errors.append("assign.gang: empty")
        if pb.incarnation < 0:
            errors.append(f"assign.incarnation: must not be negative, got {pb.incarnation}")
        if pb.rank < 0:
            errors.append(f"assign.rank: must not be negative, got {pb.rank}")
        if any(g < 0 for g in pb.gpus):
            errors.append(f"assign.gpus: negative index in {list(pb.gpus)[:8]}")
        if not 0 <= pb.master_port <= 65535:
            errors.append(f"assign.master_port: not a port: {pb.master_port}")
        if errors:
            raise MessageError(errors)
        return cls(
            gang=pb.gang, incarnation=pb.incarnation, rank=pb.rank, world_size=pb.world_size,
            local_rank=pb.local_rank, local_world_size=pb.local_world_size, gpus=tuple(pb.gpus),
            nics=tuple(pb.nics), command=tuple(pb.command), env=dict(pb.env), duration_s=pb.duration_s,
            master_addr=pb.master_addr, master_port=pb.master_port, owner=pb.owner, stimulus_id=pb.stimulus_id,
        )


@dataclass(frozen=True)
class Revoke:
    """Stop (or, when none runs, forget) the members of a gang's incarnation here."""

    gang: str
    incarnation: int
    reason: str = ""
    stimulus_id: str = ""  # as in Assign

    def to_pb(self) -> apb.Revocation:
        return apb.Revocation(gang=self.gang, incarnation=self.incarnation, reason=self.reason,
                              stimulus_id=self.stimulus_id)

    @classmethod
    def from_pb(cls, pb: apb.Revocation) -> "Revoke":
        if not pb.gang:
            raise MessageError("revoke.gang: empty")
        return cls(gang=pb.gang, incarnation=pb.incarnation, reason=pb.reason, stimulus_id=pb.stimulus_id)


@dataclass(frozen=True)
class HeartbeatAck:
    """Sent only while the leader's lease is valid: an agent that hears none
    for fence_after_s fences its members."""

    seq: int

    def to_pb(self) -> apb.HeartbeatAck:
        return apb.HeartbeatAck(seq=self.seq)

    @classmethod
    def from_pb(cls, pb: apb.HeartbeatAck) -> "HeartbeatAck":
        return cls(seq=pb.seq)


ToAgent = Union[Welcome, Assign, Revoke, HeartbeatAck]
_DOWNWARD_KIND = {Welcome: "welcome", Assign: "assign", Revoke: "revoke", HeartbeatAck: "heartbeat_ack"}
_DOWNWARD_TYPE = {kind: t for t, kind in _DOWNWARD_KIND.items()}


@dataclass(frozen=True)
class FromLeader:
    """One ``CoordinatorMessage``: ``body`` stamped with the sending
    leader's epoch (the agent's epoch rule reads it) and AZ."""

    epoch: int
    az: str
    body: ToAgent

    def to_pb(self) -> apb.CoordinatorMessage:
        return apb.CoordinatorMessage(epoch=self.epoch, az=self.az, **{_DOWNWARD_KIND[type(self.body)]: self.body.to_pb()})

    @classmethod
    def from_pb(cls, pb: apb.CoordinatorMessage) -> "FromLeader":
        kind = pb.WhichOneof("kind")
        if kind is None:
            raise MessageError("kind: the message carries none of welcome, assign, revoke, heartbeat_ack")
        return cls(epoch=pb.epoch, az=pb.az, body=_DOWNWARD_TYPE[kind].from_pb(getattr(pb, kind)))
