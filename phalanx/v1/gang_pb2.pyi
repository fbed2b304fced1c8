from phalanx.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CordonNodeRequest(_message.Message):
    __slots__ = ("az", "node", "cordoned")
    AZ_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    az: str
    node: str
    cordoned: bool
    def __init__(self, az: _Optional[str] = ..., node: _Optional[str] = ..., cordoned: _Optional[bool] = ...) -> None: ...

class DrainNodeRequest(_message.Message):
    __slots__ = ("az", "node", "requeue")
    AZ_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    REQUEUE_FIELD_NUMBER: _ClassVar[int]
    az: str
    node: str
    requeue: bool
    def __init__(self, az: _Optional[str] = ..., node: _Optional[str] = ..., requeue: _Optional[bool] = ...) -> None: ...

class DrainNodeResponse(_message.Message):
    __slots__ = ("node", "gangs", "requeued")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GANGS_FIELD_NUMBER: _ClassVar[int]
    REQUEUED_FIELD_NUMBER: _ClassVar[int]
    node: _types_pb2.NodeStatus
    gangs: _containers.RepeatedScalarFieldContainer[str]
    requeued: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node: _Optional[_Union[_types_pb2.NodeStatus, _Mapping]] = ..., gangs: _Optional[_Iterable[str]] = ..., requeued: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteNodeRequest(_message.Message):
    __slots__ = ("az", "node", "force")
    AZ_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    az: str
    node: str
    force: bool
    def __init__(self, az: _Optional[str] = ..., node: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DeleteNodeResponse(_message.Message):
    __slots__ = ("gangs",)
    GANGS_FIELD_NUMBER: _ClassVar[int]
    gangs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, gangs: _Optional[_Iterable[str]] = ...) -> None: ...

class SubmitGangRequest(_message.Message):
    __slots__ = ("spec", "idempotency_key")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    spec: _types_pb2.GangSpec
    idempotency_key: str
    def __init__(self, spec: _Optional[_Union[_types_pb2.GangSpec, _Mapping]] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class SubmitGangResponse(_message.Message):
    __slots__ = ("gang", "created")
    GANG_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    gang: _types_pb2.Gang
    created: bool
    def __init__(self, gang: _Optional[_Union[_types_pb2.Gang, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class GetGangRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListGangsRequest(_message.Message):
    __slots__ = ("states", "queue", "owner_az", "name_prefix", "limit", "page_token")
    STATES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    OWNER_AZ_FIELD_NUMBER: _ClassVar[int]
    NAME_PREFIX_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[_types_pb2.GangState]
    queue: str
    owner_az: str
    name_prefix: str
    limit: int
    page_token: str
    def __init__(self, states: _Optional[_Iterable[_Union[_types_pb2.GangState, str]]] = ..., queue: _Optional[str] = ..., owner_az: _Optional[str] = ..., name_prefix: _Optional[str] = ..., limit: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListGangsResponse(_message.Message):
    __slots__ = ("gangs", "next_page_token")
    GANGS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    gangs: _containers.RepeatedCompositeFieldContainer[_types_pb2.Gang]
    next_page_token: str
    def __init__(self, gangs: _Optional[_Iterable[_Union[_types_pb2.Gang, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchGangRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class GangEvent(_message.Message):
    __slots__ = ("gang", "revision")
    GANG_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    gang: _types_pb2.Gang
    revision: int
    def __init__(self, gang: _Optional[_Union[_types_pb2.Gang, _Mapping]] = ..., revision: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("queue", "after_revision")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    AFTER_REVISION_FIELD_NUMBER: _ClassVar[int]
    queue: str
    after_revision: int
    def __init__(self, queue: _Optional[str] = ..., after_revision: _Optional[int] = ...) -> None: ...

class ClusterEvent(_message.Message):
    __slots__ = ("gang_id", "gang_name", "queue", "event", "revision")
    GANG_ID_FIELD_NUMBER: _ClassVar[int]
    GANG_NAME_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    gang_id: str
    gang_name: str
    queue: str
    event: _types_pb2.GangEventRecord
    revision: int
    def __init__(self, gang_id: _Optional[str] = ..., gang_name: _Optional[str] = ..., queue: _Optional[str] = ..., event: _Optional[_Union[_types_pb2.GangEventRecord, _Mapping]] = ..., revision: _Optional[int] = ...) -> None: ...

class CancelGangRequest(_message.Message):
    __slots__ = ("id", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    reason: str
    def __init__(self, id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ExplainGangRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ExplainGangResponse(_message.Message):
    __slots__ = ("gang", "summary", "shortfalls", "leader_reason", "never_fits")
    GANG_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    SHORTFALLS_FIELD_NUMBER: _ClassVar[int]
    LEADER_REASON_FIELD_NUMBER: _ClassVar[int]
    NEVER_FITS_FIELD_NUMBER: _ClassVar[int]
    gang: _types_pb2.Gang
    summary: str
    shortfalls: _containers.RepeatedCompositeFieldContainer[_types_pb2.DomainShortfall]
    leader_reason: str
    never_fits: bool
    def __init__(self, gang: _Optional[_Union[_types_pb2.Gang, _Mapping]] = ..., summary: _Optional[str] = ..., shortfalls: _Optional[_Iterable[_Union[_types_pb2.DomainShortfall, _Mapping]]] = ..., leader_reason: _Optional[str] = ..., never_fits: _Optional[bool] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("az",)
    AZ_FIELD_NUMBER: _ClassVar[int]
    az: str
    def __init__(self, az: _Optional[str] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[_types_pb2.NodeStatus]
    def __init__(self, nodes: _Optional[_Iterable[_Union[_types_pb2.NodeStatus, _Mapping]]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AzStatus(_message.Message):
    __slots__ = ("az", "has_leader", "leader_id", "leader_address", "epoch", "nodes_ready", "nodes_total", "gpus_total", "gpus_free", "nodes_not_ready", "nodes_cordoned", "nodes_expired", "gpus_usable", "gpus_usable_free")
    AZ_FIELD_NUMBER: _ClassVar[int]
    HAS_LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODES_READY_FIELD_NUMBER: _ClassVar[int]
    NODES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GPUS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GPUS_FREE_FIELD_NUMBER: _ClassVar[int]
    NODES_NOT_READY_FIELD_NUMBER: _ClassVar[int]
    NODES_CORDONED_FIELD_NUMBER: _ClassVar[int]
    NODES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    GPUS_USABLE_FIELD_NUMBER: _ClassVar[int]
    GPUS_USABLE_FREE_FIELD_NUMBER: _ClassVar[int]
    az: str
    has_leader: bool
    leader_id: str
    leader_address: str
    epoch: int
    nodes_ready: int
    nodes_total: int
    gpus_total: int
    gpus_free: int
    nodes_not_ready: int
    nodes_cordoned: int
    nodes_expired: int
    gpus_usable: int
    gpus_usable_free: int
    def __init__(self, az: _Optional[str] = ..., has_leader: _Optional[bool] = ..., leader_id: _Optional[str] = ..., leader_address: _Optional[str] = ..., epoch: _Optional[int] = ..., nodes_ready: _Optional[int] = ..., nodes_total: _Optional[int] = ..., gpus_total: _Optional[int] = ..., gpus_free: _Optional[int] = ..., nodes_not_ready: _Optional[int] = ..., nodes_cordoned: _Optional[int] = ..., nodes_expired: _Optional[int] = ..., gpus_usable: _Optional[int] = ..., gpus_usable_free: _Optional[int] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("cluster", "azs", "served_by", "gangs_by_state", "etcd")
    class GangsByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    AZS_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    GANGS_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    ETCD_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    azs: _containers.RepeatedCompositeFieldContainer[AzStatus]
    served_by: str
    gangs_by_state: _containers.ScalarMap[str, int]
    etcd: EtcdSpace
    def __init__(self, cluster: _Optional[str] = ..., azs: _Optional[_Iterable[_Union[AzStatus, _Mapping]]] = ..., served_by: _Optional[str] = ..., gangs_by_state: _Optional[_Mapping[str, int]] = ..., etcd: _Optional[_Union[EtcdSpace, _Mapping]] = ...) -> None: ...

class EtcdSpace(_message.Message):
    __slots__ = ("db_size_bytes", "quota_bytes", "alarms", "level", "summary", "error")
    DB_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALARMS_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    db_size_bytes: int
    quota_bytes: int
    alarms: _containers.RepeatedScalarFieldContainer[str]
    level: str
    summary: str
    error: str
    def __init__(self, db_size_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., alarms: _Optional[_Iterable[str]] = ..., level: _Optional[str] = ..., summary: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PolicyRecord(_message.Message):
    __slots__ = ("policy_json", "revision", "set_by", "set_at")
    POLICY_JSON_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SET_BY_FIELD_NUMBER: _ClassVar[int]
    SET_AT_FIELD_NUMBER: _ClassVar[int]
    policy_json: str
    revision: int
    set_by: str
    set_at: float
    def __init__(self, policy_json: _Optional[str] = ..., revision: _Optional[int] = ..., set_by: _Optional[str] = ..., set_at: _Optional[float] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy_json", "expected_revision")
    POLICY_JSON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_REVISION_FIELD_NUMBER: _ClassVar[int]
    policy_json: str
    expected_revision: int
    def __init__(self, policy_json: _Optional[str] = ..., expected_revision: _Optional[int] = ...) -> None: ...
