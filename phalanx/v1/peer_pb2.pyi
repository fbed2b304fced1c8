from phalanx.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Vote(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VOTE_UNSPECIFIED: _ClassVar[Vote]
    VOTE_YES: _ClassVar[Vote]
    VOTE_NO: _ClassVar[Vote]
VOTE_UNSPECIFIED: Vote
VOTE_YES: Vote
VOTE_NO: Vote

class PeerIdentity(_message.Message):
    __slots__ = ("az", "epoch", "coordinator_id")
    AZ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    az: str
    epoch: int
    coordinator_id: str
    def __init__(self, az: _Optional[str] = ..., epoch: _Optional[int] = ..., coordinator_id: _Optional[str] = ...) -> None: ...

class NodeDevices(_message.Message):
    __slots__ = ("node", "gpus", "nics")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    NICS_FIELD_NUMBER: _ClassVar[int]
    node: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    nics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ..., nics: _Optional[_Iterable[str]] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("caller", "gang", "incarnation", "priority", "submitted_at", "nodes", "members")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    GANG_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    caller: PeerIdentity
    gang: str
    incarnation: int
    priority: int
    submitted_at: float
    nodes: _containers.RepeatedCompositeFieldContainer[NodeDevices]
    members: _containers.RepeatedCompositeFieldContainer[_types_pb2.MemberPlacement]
    def __init__(self, caller: _Optional[_Union[PeerIdentity, _Mapping]] = ..., gang: _Optional[str] = ..., incarnation: _Optional[int] = ..., priority: _Optional[int] = ..., submitted_at: _Optional[float] = ..., nodes: _Optional[_Iterable[_Union[NodeDevices, _Mapping]]] = ..., members: _Optional[_Iterable[_Union[_types_pb2.MemberPlacement, _Mapping]]] = ...) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ("vote", "reason", "shortfalls")
    VOTE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SHORTFALLS_FIELD_NUMBER: _ClassVar[int]
    vote: Vote
    reason: str
    shortfalls: _containers.RepeatedCompositeFieldContainer[_types_pb2.DomainShortfall]
    def __init__(self, vote: _Optional[_Union[Vote, str]] = ..., reason: _Optional[str] = ..., shortfalls: _Optional[_Iterable[_Union[_types_pb2.DomainShortfall, _Mapping]]] = ...) -> None: ...

class DecisionRequest(_message.Message):
    __slots__ = ("caller", "gang", "incarnation")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    GANG_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    caller: PeerIdentity
    gang: str
    incarnation: int
    def __init__(self, caller: _Optional[_Union[PeerIdentity, _Mapping]] = ..., gang: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class DecisionResponse(_message.Message):
    __slots__ = ("applied", "state")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    state: str
    def __init__(self, applied: _Optional[bool] = ..., state: _Optional[str] = ...) -> None: ...
