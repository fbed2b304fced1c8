from phalanx.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_PHASE_UNSPECIFIED: _ClassVar[MemberPhase]
    MEMBER_PHASE_STARTING: _ClassVar[MemberPhase]
    MEMBER_PHASE_RUNNING: _ClassVar[MemberPhase]
    MEMBER_PHASE_SUCCEEDED: _ClassVar[MemberPhase]
    MEMBER_PHASE_FAILED: _ClassVar[MemberPhase]
    MEMBER_PHASE_STOPPED: _ClassVar[MemberPhase]
    MEMBER_PHASE_REJECTED: _ClassVar[MemberPhase]
MEMBER_PHASE_UNSPECIFIED: MemberPhase
MEMBER_PHASE_STARTING: MemberPhase
MEMBER_PHASE_RUNNING: MemberPhase
MEMBER_PHASE_SUCCEEDED: MemberPhase
MEMBER_PHASE_FAILED: MemberPhase
MEMBER_PHASE_STOPPED: MemberPhase
MEMBER_PHASE_REJECTED: MemberPhase

class TokenReadRequest(_message.Message):
    __slots__ = ("az", "gang")
    AZ_FIELD_NUMBER: _ClassVar[int]
    GANG_FIELD_NUMBER: _ClassVar[int]
    az: str
    gang: str
    def __init__(self, az: _Optional[str] = ..., gang: _Optional[str] = ...) -> None: ...

class StoredRecord(_message.Message):
    __slots__ = ("present", "value", "create_revision", "mod_revision", "version")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CREATE_REVISION_FIELD_NUMBER: _ClassVar[int]
    MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    present: bool
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    def __init__(self, present: _Optional[bool] = ..., value: _Optional[bytes] = ..., create_revision: _Optional[int] = ..., mod_revision: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class TokenReadReply(_message.Message):
    __slots__ = ("leader", "reservation", "revision")
    LEADER_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    leader: StoredRecord
    reservation: StoredRecord
    revision: int
    def __init__(self, leader: _Optional[_Union[StoredRecord, _Mapping]] = ..., reservation: _Optional[_Union[StoredRecord, _Mapping]] = ..., revision: _Optional[int] = ...) -> None: ...

class MemberStatus(_message.Message):
    __slots__ = ("gang", "incarnation", "rank", "phase", "exit_code", "epoch", "reason", "gpus", "pid", "at", "node")
    GANG_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    gang: str
    incarnation: int
    rank: int
    phase: MemberPhase
    exit_code: int
    epoch: int
    reason: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    pid: int
    at: float
    node: str
    def __init__(self, gang: _Optional[str] = ..., incarnation: _Optional[int] = ..., rank: _Optional[int] = ..., phase: _Optional[_Union[MemberPhase, str]] = ..., exit_code: _Optional[int] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ..., pid: _Optional[int] = ..., at: _Optional[float] = ..., node: _Optional[str] = ...) -> None: ...

class PortRange(_message.Message):
    __slots__ = ("first", "last")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    first: int
    last: int
    def __init__(self, first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("agent_id", "topology", "members", "highest_epoch", "address", "rendezvous_ports")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    HIGHEST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_PORTS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    topology: _types_pb2.NodeTopology
    members: _containers.RepeatedCompositeFieldContainer[MemberStatus]
    highest_epoch: int
    address: str
    rendezvous_ports: PortRange
    def __init__(self, agent_id: _Optional[str] = ..., topology: _Optional[_Union[_types_pb2.NodeTopology, _Mapping]] = ..., members: _Optional[_Iterable[_Union[MemberStatus, _Mapping]]] = ..., highest_epoch: _Optional[int] = ..., address: _Optional[str] = ..., rendezvous_ports: _Optional[_Union[PortRange, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq", "members")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    members: _containers.RepeatedCompositeFieldContainer[MemberStatus]
    def __init__(self, seq: _Optional[int] = ..., members: _Optional[_Iterable[_Union[MemberStatus, _Mapping]]] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "member")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    member: MemberStatus
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., member: _Optional[_Union[MemberStatus, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("coordinator_id", "heartbeat_interval_s", "fence_after_s")
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    FENCE_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    coordinator_id: str
    heartbeat_interval_s: float
    fence_after_s: float
    def __init__(self, coordinator_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., fence_after_s: _Optional[float] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("gang", "incarnation", "rank", "world_size", "local_rank", "local_world_size", "gpus", "nics", "command", "env", "duration_s", "master_addr", "master_port", "owner", "stimulus_id")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GANG_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    NICS_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    STIMULUS_ID_FIELD_NUMBER: _ClassVar[int]
    gang: str
    incarnation: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    gpus: _containers.RepeatedScalarFieldContainer[int]
    nics: _containers.RepeatedScalarFieldContainer[str]
    command: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    duration_s: float
    master_addr: str
    master_port: int
    owner: str
    stimulus_id: str
    def __init__(self, gang: _Optional[str] = ..., incarnation: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., local_rank: _Optional[int] = ..., local_world_size: _Optional[int] = ..., gpus: _Optional[_Iterable[int]] = ..., nics: _Optional[_Iterable[str]] = ..., command: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., duration_s: _Optional[float] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., owner: _Optional[str] = ..., stimulus_id: _Optional[str] = ...) -> None: ...

class Revocation(_message.Message):
    __slots__ = ("gang", "incarnation", "reason", "stimulus_id")
    GANG_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STIMULUS_ID_FIELD_NUMBER: _ClassVar[int]
    gang: str
    incarnation: int
    reason: str
    stimulus_id: str
    def __init__(self, gang: _Optional[str] = ..., incarnation: _Optional[int] = ..., reason: _Optional[str] = ..., stimulus_id: _Optional[str] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("epoch", "az", "welcome", "assign", "revoke", "heartbeat_ack")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AZ_FIELD_NUMBER: _ClassVar[int]
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    REVOKE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_ACK_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    az: str
    welcome: Welcome
    assign: Assignment
    revoke: Revocation
    heartbeat_ack: HeartbeatAck
    def __init__(self, epoch: _Optional[int] = ..., az: _Optional[str] = ..., welcome: _Optional[_Union[Welcome, _Mapping]] = ..., assign: _Optional[_Union[Assignment, _Mapping]] = ..., revoke: _Optional[_Union[Revocation, _Mapping]] = ..., heartbeat_ack: _Optional[_Union[HeartbeatAck, _Mapping]] = ...) -> None: ...
