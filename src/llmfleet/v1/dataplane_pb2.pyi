from llmfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVStoreOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_STORE_OP_UNSPECIFIED: _ClassVar[KVStoreOp]
    KV_STORE_OP_PUT: _ClassVar[KVStoreOp]
    KV_STORE_OP_GET: _ClassVar[KVStoreOp]
    KV_STORE_OP_REPLY: _ClassVar[KVStoreOp]
KV_STORE_OP_UNSPECIFIED: KVStoreOp
KV_STORE_OP_PUT: KVStoreOp
KV_STORE_OP_GET: KVStoreOp
KV_STORE_OP_REPLY: KVStoreOp

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class KVTransferHeader(_message.Message):
    __slots__ = ("lease_id", "epoch", "request_id", "first_block", "layout", "transfer_id", "last", "traceparent", "cuda_ipc")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    epoch: int
    request_id: str
    first_block: int
    layout: KVLayout
    transfer_id: str
    last: bool
    traceparent: str
    cuda_ipc: CudaIpcBuffer
    def __init__(self, lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., request_id: _Optional[str] = ..., first_block: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., transfer_id: _Optional[str] = ..., last: _Optional[bool] = ..., traceparent: _Optional[str] = ..., cuda_ipc: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("host_id", "device_uuid", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "shape", "stride", "offset", "dtype")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    device_uuid: str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    dtype: str
    def __init__(self, host_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class KVTransferAck(_message.Message):
    __slots__ = ("lease_id", "epoch", "transfer_id", "ok", "error")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    epoch: int
    transfer_id: str
    ok: bool
    error: str
    def __init__(self, lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., transfer_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "logprobs", "finish_reason", "stop_token_id", "num_prompt_tokens", "num_cached_tokens", "num_draft_tokens", "num_accepted_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("worker_id", "step", "outputs")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    step: int
    outputs: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    def __init__(self, worker_id: _Optional[str] = ..., step: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("publisher_id", "seq", "stored", "removed", "cleared", "epoch")
    PUBLISHER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    publisher_id: str
    seq: int
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    cleared: bool
    epoch: int
    def __init__(self, publisher_id: _Optional[str] = ..., seq: _Optional[int] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., cleared: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class KVStoreHeader(_message.Message):
    __slots__ = ("op", "seq", "block_hashes", "layout", "found_count", "error", "traceparent")
    OP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FOUND_COUNT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    op: KVStoreOp
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layout: str
    found_count: int
    error: str
    traceparent: str
    def __init__(self, op: _Optional[_Union[KVStoreOp, str]] = ..., seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., layout: _Optional[str] = ..., found_count: _Optional[int] = ..., error: _Optional[str] = ..., traceparent: _Optional[str] = ...) -> None: ...

class MediaRequest(_message.Message):
    __slots__ = ("seq", "content_hashes", "traceparent")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    content_hashes: _containers.RepeatedScalarFieldContainer[str]
    traceparent: str
    def __init__(self, seq: _Optional[int] = ..., content_hashes: _Optional[_Iterable[str]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class MediaTensor(_message.Message):
    __slots__ = ("content_hash", "dtype", "shape", "grid")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    content_hash: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    grid: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, content_hash: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., grid: _Optional[_Iterable[int]] = ...) -> None: ...

class MediaReply(_message.Message):
    __slots__ = ("seq", "images", "missing", "error")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq: int
    images: _containers.RepeatedCompositeFieldContainer[MediaTensor]
    missing: _containers.RepeatedScalarFieldContainer[str]
    error: str
    def __init__(self, seq: _Optional[int] = ..., images: _Optional[_Iterable[_Union[MediaTensor, _Mapping]]] = ..., missing: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ...) -> None: ...
