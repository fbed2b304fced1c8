from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GangState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GANG_STATE_UNSPECIFIED: _ClassVar[GangState]
    GANG_STATE_PENDING: _ClassVar[GangState]
    GANG_STATE_RESERVING: _ClassVar[GangState]
    GANG_STATE_RESERVED: _ClassVar[GangState]
    GANG_STATE_STARTING: _ClassVar[GangState]
    GANG_STATE_RUNNING: _ClassVar[GangState]
    GANG_STATE_SUCCEEDED: _ClassVar[GangState]
    GANG_STATE_FAILED: _ClassVar[GangState]
    GANG_STATE_CANCELLED: _ClassVar[GangState]
    GANG_STATE_RESTARTING: _ClassVar[GangState]

class TopologyLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOPOLOGY_LEVEL_UNSPECIFIED: _ClassVar[TopologyLevel]
    TOPOLOGY_LEVEL_NVLINK_DOMAIN: _ClassVar[TopologyLevel]
    TOPOLOGY_LEVEL_NODE: _ClassVar[TopologyLevel]
    TOPOLOGY_LEVEL_LEAF: _ClassVar[TopologyLevel]
    TOPOLOGY_LEVEL_SPINE: _ClassVar[TopologyLevel]
    TOPOLOGY_LEVEL_AZ: _ClassVar[TopologyLevel]
    TOPOLOGY_LEVEL_REGION: _ClassVar[TopologyLevel]

class PcieDistance(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PCIE_DISTANCE_UNSPECIFIED: _ClassVar[PcieDistance]
    PCIE_DISTANCE_PIX: _ClassVar[PcieDistance]
    PCIE_DISTANCE_PXB: _ClassVar[PcieDistance]
    PCIE_DISTANCE_PHB: _ClassVar[PcieDistance]
    PCIE_DISTANCE_NODE: _ClassVar[PcieDistance]
    PCIE_DISTANCE_SYS: _ClassVar[PcieDistance]
GANG_STATE_UNSPECIFIED: GangState
GANG_STATE_PENDING: GangState
GANG_STATE_RESERVING: GangState
GANG_STATE_RESERVED: GangState
GANG_STATE_STARTING: GangState
GANG_STATE_RUNNING: GangState
GANG_STATE_SUCCEEDED: GangState
GANG_STATE_FAILED: GangState
GANG_STATE_CANCELLED: GangState
GANG_STATE_RESTARTING: GangState
TOPOLOGY_LEVEL_UNSPECIFIED: TopologyLevel
TOPOLOGY_LEVEL_NVLINK_DOMAIN: TopologyLevel
TOPOLOGY_LEVEL_NODE: TopologyLevel
TOPOLOGY_LEVEL_LEAF: TopologyLevel
TOPOLOGY_LEVEL_SPINE: TopologyLevel
TOPOLOGY_LEVEL_AZ: TopologyLevel
TOPOLOGY_LEVEL_REGION: TopologyLevel
PCIE_DISTANCE_UNSPECIFIED: PcieDistance
PCIE_DISTANCE_PIX: PcieDistance
PCIE_DISTANCE_PXB: PcieDistance
PCIE_DISTANCE_PHB: PcieDistance
PCIE_DISTANCE_NODE: PcieDistance
PCIE_DISTANCE_SYS: PcieDistance

class Resources(_message.Message):
    __slots__ = ("gpus", "gpu_model", "rdma_nics")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_MODEL_FIELD_NUMBER: _ClassVar[int]
    RDMA_NICS_FIELD_NUMBER: _ClassVar[int]
    gpus: int
    gpu_model: str
    rdma_nics: int
    def __init__(self, gpus: _Optional[int] = ..., gpu_model: _Optional[str] = ..., rdma_nics: _Optional[int] = ...) -> None: ...

class TopologyConstraint(_message.Message):
    __slots__ = ("required", "preferred", "allow_cross_az")
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_FIELD_NUMBER: _ClassVar[int]
    ALLOW_CROSS_AZ_FIELD_NUMBER: _ClassVar[int]
    required: TopologyLevel
    preferred: TopologyLevel
    allow_cross_az: bool
    def __init__(self, required: _Optional[_Union[TopologyLevel, str]] = ..., preferred: _Optional[_Union[TopologyLevel, str]] = ..., allow_cross_az: _Optional[bool] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("command", "env", "duration_s")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    command: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    duration_s: float
    def __init__(self, command: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., duration_s: _Optional[float] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("admission_timeout_s", "max_restarts", "start_timeout_s")
    ADMISSION_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    START_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    admission_timeout_s: float
    max_restarts: int
    start_timeout_s: float
    def __init__(self, admission_timeout_s: _Optional[float] = ..., max_restarts: _Optional[int] = ..., start_timeout_s: _Optional[float] = ...) -> None: ...

class GangSpec(_message.Message):
    __slots__ = ("name", "queue", "priority", "members", "resources", "topology", "run", "policy")
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    name: str
    queue: str
    priority: int
    members: int
    resources: Resources
    topology: TopologyConstraint
    run: RunSpec
    policy: Policy
    def __init__(self, name: _Optional[str] = ..., queue: _Optional[str] = ..., priority: _Optional[int] = ..., members: _Optional[int] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., topology: _Optional[_Union[TopologyConstraint, _Mapping]] = ..., run: _Optional[_Union[RunSpec, _Mapping]] = ..., policy: _Optional[_Union[Policy, _Mapping]] = ...) -> None: ...

class MemberPlacement(_message.Message):
    __slots__ = ("rank", "az", "node", "gpus", "nics")
    RANK_FIELD_NUMBER: _ClassVar[int]
    AZ_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    NICS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    az: str
    node: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    nics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., az: _Optional[str] = ..., node: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ..., nics: _Optional[_Iterable[str]] = ...) -> None: ...

class Gang(_message.Message):
    __slots__ = ("id", "spec", "state", "owner_az", "incarnation", "reason", "submitted_at", "updated_at", "placement", "restarts", "mod_revision", "span", "not_before", "owner", "events")
    ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OWNER_AZ_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
    SPAN_FIELD_NUMBER: _ClassVar[int]
    NOT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    spec: GangSpec
    state: GangState
    owner_az: str
    incarnation: int
    reason: str
    submitted_at: float
    updated_at: float
    placement: _containers.RepeatedCompositeFieldContainer[MemberPlacement]
    restarts: int
    mod_revision: int
    span: TopologyLevel
    not_before: float
    owner: str
    events: _containers.RepeatedCompositeFieldContainer[GangEventRecord]
    def __init__(self, id: _Optional[str] = ..., spec: _Optional[_Union[GangSpec, _Mapping]] = ..., state: _Optional[_Union[GangState, str]] = ..., owner_az: _Optional[str] = ..., incarnation: _Optional[int] = ..., reason: _Optional[str] = ..., submitted_at: _Optional[float] = ..., updated_at: _Optional[float] = ..., placement: _Optional[_Iterable[_Union[MemberPlacement, _Mapping]]] = ..., restarts: _Optional[int] = ..., mod_revision: _Optional[int] = ..., span: _Optional[_Union[TopologyLevel, str]] = ..., not_before: _Optional[float] = ..., owner: _Optional[str] = ..., events: _Optional[_Iterable[_Union[GangEventRecord, _Mapping]]] = ...) -> None: ...

class GangEventRecord(_message.Message):
    __slots__ = ("kind", "at", "epoch", "message", "incarnation", "by", "rank", "exit_code", "dropped", "seq", "stimulus")
    KIND_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STIMULUS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    at: float
    epoch: int
    message: str
    incarnation: int
    by: str
    rank: int
    exit_code: int
    dropped: int
    seq: int
    stimulus: str
    def __init__(self, kind: _Optional[str] = ..., at: _Optional[float] = ..., epoch: _Optional[int] = ..., message: _Optional[str] = ..., incarnation: _Optional[int] = ..., by: _Optional[str] = ..., rank: _Optional[int] = ..., exit_code: _Optional[int] = ..., dropped: _Optional[int] = ..., seq: _Optional[int] = ..., stimulus: _Optional[str] = ...) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("index", "uuid", "model", "memory_mib", "pci_bus_id", "numa_node", "nvlink_island", "nvlink_peers", "pcie_switch")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    NVLINK_ISLAND_FIELD_NUMBER: _ClassVar[int]
    NVLINK_PEERS_FIELD_NUMBER: _ClassVar[int]
    PCIE_SWITCH_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    model: str
    memory_mib: int
    pci_bus_id: str
    numa_node: int
    nvlink_island: int
    nvlink_peers: _containers.RepeatedScalarFieldContainer[int]
    pcie_switch: str
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., model: _Optional[str] = ..., memory_mib: _Optional[int] = ..., pci_bus_id: _Optional[str] = ..., numa_node: _Optional[int] = ..., nvlink_island: _Optional[int] = ..., nvlink_peers: _Optional[_Iterable[int]] = ..., pcie_switch: _Optional[str] = ...) -> None: ...

class Nic(_message.Message):
    __slots__ = ("name", "pci_bus_id", "numa_node", "rate_gbps", "link_layer", "state", "rail", "pcie_switch")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    RATE_GBPS_FIELD_NUMBER: _ClassVar[int]
    LINK_LAYER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RAIL_FIELD_NUMBER: _ClassVar[int]
    PCIE_SWITCH_FIELD_NUMBER: _ClassVar[int]
    name: str
    pci_bus_id: str
    numa_node: int
    rate_gbps: int
    link_layer: str
    state: str
    rail: int
    pcie_switch: str
    def __init__(self, name: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., numa_node: _Optional[int] = ..., rate_gbps: _Optional[int] = ..., link_layer: _Optional[str] = ..., state: _Optional[str] = ..., rail: _Optional[int] = ..., pcie_switch: _Optional[str] = ...) -> None: ...

class GpuNicLink(_message.Message):
    __slots__ = ("gpu", "nic", "distance")
    GPU_FIELD_NUMBER: _ClassVar[int]
    NIC_FIELD_NUMBER: _ClassVar[int]
    DISTANCE_FIELD_NUMBER: _ClassVar[int]
    gpu: int
    nic: str
    distance: PcieDistance
    def __init__(self, gpu: _Optional[int] = ..., nic: _Optional[str] = ..., distance: _Optional[_Union[PcieDistance, str]] = ...) -> None: ...

class NodeTopology(_message.Message):
    __slots__ = ("node", "az", "region", "spine", "leaf", "rack", "nvlink_domain", "gpus", "nics", "links", "labels", "sources")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    AZ_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    SPINE_FIELD_NUMBER: _ClassVar[int]
    LEAF_FIELD_NUMBER: _ClassVar[int]
    RACK_FIELD_NUMBER: _ClassVar[int]
    NVLINK_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    NICS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    node: str
    az: str
    region: str
    spine: str
    leaf: str
    rack: str
    nvlink_domain: str
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    nics: _containers.RepeatedCompositeFieldContainer[Nic]
    links: _containers.RepeatedCompositeFieldContainer[GpuNicLink]
    labels: _containers.ScalarMap[str, str]
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node: _Optional[str] = ..., az: _Optional[str] = ..., region: _Optional[str] = ..., spine: _Optional[str] = ..., leaf: _Optional[str] = ..., rack: _Optional[str] = ..., nvlink_domain: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., nics: _Optional[_Iterable[_Union[Nic, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[GpuNicLink, _Mapping]]] = ..., labels: _Optional[_Mapping[str, str]] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("topology", "ready", "gpus_total", "gpus_used", "used_gpus", "last_heartbeat", "agent_id", "reason", "cordoned", "expired")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    GPUS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GPUS_USED_FIELD_NUMBER: _ClassVar[int]
    USED_GPUS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    topology: NodeTopology
    ready: bool
    gpus_total: int
    gpus_used: int
    used_gpus: _containers.RepeatedScalarFieldContainer[int]
    last_heartbeat: float
    agent_id: str
    reason: str
    cordoned: bool
    expired: bool
    def __init__(self, topology: _Optional[_Union[NodeTopology, _Mapping]] = ..., ready: _Optional[bool] = ..., gpus_total: _Optional[int] = ..., gpus_used: _Optional[int] = ..., used_gpus: _Optional[_Iterable[int]] = ..., last_heartbeat: _Optional[float] = ..., agent_id: _Optional[str] = ..., reason: _Optional[str] = ..., cordoned: _Optional[bool] = ..., expired: _Optional[bool] = ...) -> None: ...

class DomainShortfall(_message.Message):
    __slots__ = ("level", "domain", "gpus_free", "gpus_total", "gpus_needed", "members_fit", "members_needed", "reason")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    GPUS_FREE_FIELD_NUMBER: _ClassVar[int]
    GPUS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GPUS_NEEDED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIT_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_NEEDED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    level: TopologyLevel
    domain: str
    gpus_free: int
    gpus_total: int
    gpus_needed: int
    members_fit: int
    members_needed: int
    reason: str
    def __init__(self, level: _Optional[_Union[TopologyLevel, str]] = ..., domain: _Optional[str] = ..., gpus_free: _Optional[int] = ..., gpus_total: _Optional[int] = ..., gpus_needed: _Optional[int] = ..., members_fit: _Optional[int] = ..., members_needed: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...
