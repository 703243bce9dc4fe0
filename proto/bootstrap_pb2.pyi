from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    PREFILL: _ClassVar[Role]
    DECODE: _ClassVar[Role]
    COLOCATED: _ClassVar[Role]

class RoomState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROOM_STATE_UNSPECIFIED: _ClassVar[RoomState]
    WAITING_FOR_DEST: _ClassVar[RoomState]
    TRANSFERRING: _ClassVar[RoomState]
    DONE: _ClassVar[RoomState]
    FAILED: _ClassVar[RoomState]
ROLE_UNSPECIFIED: Role
PREFILL: Role
DECODE: Role
COLOCATED: Role
ROOM_STATE_UNSPECIFIED: RoomState
WAITING_FOR_DEST: RoomState
TRANSFERRING: RoomState
DONE: RoomState
FAILED: RoomState

class KVLayout(_message.Message):
    __slots__ = ("model_id", "num_layers", "num_kv_heads", "head_dim", "page_size", "dtype", "tp_size", "tp_rank", "page_bytes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    tp_size: int
    tp_rank: int
    page_bytes: int
    def __init__(self, model_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., page_size: _Optional[int] = ..., dtype: _Optional[str] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("name", "addr", "length", "device")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    name: str
    addr: int
    length: int
    device: str
    def __init__(self, name: _Optional[str] = ..., addr: _Optional[int] = ..., length: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "role", "grpc_address", "transfer_backend", "transfer_endpoint", "layout", "regions", "aux_slot_bytes", "tp_ranks", "kv_events")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    AUX_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TP_RANKS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: Role
    grpc_address: str
    transfer_backend: str
    transfer_endpoint: bytes
    layout: KVLayout
    regions: _containers.RepeatedCompositeFieldContainer[MemoryRegion]
    aux_slot_bytes: int
    tp_ranks: _containers.RepeatedCompositeFieldContainer[TPRankInfo]
    kv_events: KVEventsEndpoint
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., grpc_address: _Optional[str] = ..., transfer_backend: _Optional[str] = ..., transfer_endpoint: _Optional[bytes] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., regions: _Optional[_Iterable[_Union[MemoryRegion, _Mapping]]] = ..., aux_slot_bytes: _Optional[int] = ..., tp_ranks: _Optional[_Iterable[_Union[TPRankInfo, _Mapping]]] = ..., kv_events: _Optional[_Union[KVEventsEndpoint, _Mapping]] = ...) -> None: ...

class KVEventsEndpoint(_message.Message):
    __slots__ = ("publisher", "replay", "topic", "block_size")
    PUBLISHER_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    publisher: str
    replay: str
    topic: str
    block_size: int
    def __init__(self, publisher: _Optional[str] = ..., replay: _Optional[str] = ..., topic: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class TPRankInfo(_message.Message):
    __slots__ = ("tp_rank", "transfer_endpoint", "kv", "kv_head_start", "num_kv_heads")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    transfer_endpoint: bytes
    kv: MemoryRegion
    kv_head_start: int
    num_kv_heads: int
    def __init__(self, tp_rank: _Optional[int] = ..., transfer_endpoint: _Optional[bytes] = ..., kv: _Optional[_Union[MemoryRegion, _Mapping]] = ..., kv_head_start: _Optional[int] = ..., num_kv_heads: _Optional[int] = ...) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("running_requests", "queued_requests", "free_pages", "total_pages", "transfer_queue", "bootstrap_queue", "running_tokens", "queued_tokens", "max_running_requests", "draining")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_QUEUE_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_QUEUE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    queued_requests: int
    free_pages: int
    total_pages: int
    transfer_queue: int
    bootstrap_queue: int
    running_tokens: int
    queued_tokens: int
    max_running_requests: int
    draining: bool
    def __init__(self, running_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., transfer_queue: _Optional[int] = ..., bootstrap_queue: _Optional[int] = ..., running_tokens: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node", "load")
    NODE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    load: NodeLoad
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("node_id", "heartbeat_interval_s", "heartbeat_timeout_s", "node_secret")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    node_secret: str
    def __init__(self, node_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ..., node_secret: _Optional[str] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "load")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    load: NodeLoad
    def __init__(self, node_id: _Optional[str] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: Role
    def __init__(self, role: _Optional[_Union[Role, str]] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node", "load", "alive")
    NODE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    load: NodeLoad
    alive: bool
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ..., alive: _Optional[bool] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ...) -> None: ...

class WatchNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeEvent(_message.Message):
    __slots__ = ("kind", "status")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[NodeEvent.Kind]
        JOINED: _ClassVar[NodeEvent.Kind]
        LEFT: _ClassVar[NodeEvent.Kind]
        LOAD: _ClassVar[NodeEvent.Kind]
    KIND_UNSPECIFIED: NodeEvent.Kind
    JOINED: NodeEvent.Kind
    LEFT: NodeEvent.Kind
    LOAD: NodeEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    kind: NodeEvent.Kind
    status: NodeStatus
    def __init__(self, kind: _Optional[_Union[NodeEvent.Kind, str]] = ..., status: _Optional[_Union[NodeStatus, _Mapping]] = ...) -> None: ...

class RoomDestination(_message.Message):
    __slots__ = ("room", "decode_node_id", "prefill_node_id", "page_ids", "cached_tokens", "aux_slot", "prompt_len", "cancelled", "ticket")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUX_SLOT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    room: int
    decode_node_id: str
    prefill_node_id: str
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    aux_slot: int
    prompt_len: int
    cancelled: bool
    ticket: str
    def __init__(self, room: _Optional[int] = ..., decode_node_id: _Optional[str] = ..., prefill_node_id: _Optional[str] = ..., page_ids: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., aux_slot: _Optional[int] = ..., prompt_len: _Optional[int] = ..., cancelled: _Optional[bool] = ..., ticket: _Optional[str] = ...) -> None: ...

class RoomStatus(_message.Message):
    __slots__ = ("room", "prefill_node_id", "decode_node_id", "state", "reason", "may_still_write")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MAY_STILL_WRITE_FIELD_NUMBER: _ClassVar[int]
    room: int
    prefill_node_id: str
    decode_node_id: str
    state: RoomState
    reason: str
    may_still_write: bool
    def __init__(self, room: _Optional[int] = ..., prefill_node_id: _Optional[str] = ..., decode_node_id: _Optional[str] = ..., state: _Optional[_Union[RoomState, str]] = ..., reason: _Optional[str] = ..., may_still_write: _Optional[bool] = ...) -> None: ...

class PostAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchDestinationsRequest(_message.Message):
    __slots__ = ("prefill_node_id",)
    PREFILL_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    prefill_node_id: str
    def __init__(self, prefill_node_id: _Optional[str] = ...) -> None: ...

class WatchRoomStatusRequest(_message.Message):
    __slots__ = ("decode_node_id",)
    DECODE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    decode_node_id: str
    def __init__(self, decode_node_id: _Optional[str] = ...) -> None: ...

class FailRoomRequest(_message.Message):
    __slots__ = ("room", "node_id", "reason")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    room: int
    node_id: str
    reason: str
    def __init__(self, room: _Optional[int] = ..., node_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class FailRoomResponse(_message.Message):
    __slots__ = ("safe_to_free",)
    SAFE_TO_FREE_FIELD_NUMBER: _ClassVar[int]
    safe_to_free: bool
    def __init__(self, safe_to_free: _Optional[bool] = ...) -> None: ...
