from llmfleet.v1 import common_pb2 as _common_pb2
from llmfleet.v1 import embedding_pb2 as _embedding_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AddRequestRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "reply_endpoint", "num_replayed_tokens", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    REPLY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLAYED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    reply_endpoint: str
    num_replayed_tokens: int
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageRef]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., reply_endpoint: _Optional[str] = ..., num_replayed_tokens: _Optional[int] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageRef, _Mapping]]] = ...) -> None: ...

class AddRequestResponse(_message.Message):
    __slots__ = ("num_cached_tokens",)
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    def __init__(self, num_cached_tokens: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id", "index", "reason", "stop_string")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    reason: _common_pb2.FinishReason
    stop_string: str
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_string: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetWorkerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWorkerStatsResponse(_message.Message):
    __slots__ = ("worker_id", "role", "load", "prefix_cache_queries", "prefix_cache_hits", "kvstore_blocks_fetched", "kvstore_blocks_stored", "kvstore_view_blocks", "kvstore_lookups_skipped", "kvstore_blocks_dropped", "kv_pushed_bytes", "kv_push_us", "kv_pushes_gpu", "kv_pushes_host", "spec_decode")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_BLOCKS_FETCHED_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_VIEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_LOOKUPS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    KV_PUSHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_US_FIELD_NUMBER: _ClassVar[int]
    KV_PUSHES_GPU_FIELD_NUMBER: _ClassVar[int]
    KV_PUSHES_HOST_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.WorkerRole
    load: _common_pb2.LoadReport
    prefix_cache_queries: int
    prefix_cache_hits: int
    kvstore_blocks_fetched: int
    kvstore_blocks_stored: int
    kvstore_view_blocks: int
    kvstore_lookups_skipped: int
    kvstore_blocks_dropped: int
    kv_pushed_bytes: int
    kv_push_us: int
    kv_pushes_gpu: int
    kv_pushes_host: int
    spec_decode: SpecDecodeStats
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., load: _Optional[_Union[_common_pb2.LoadReport, _Mapping]] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., kvstore_blocks_fetched: _Optional[int] = ..., kvstore_blocks_stored: _Optional[int] = ..., kvstore_view_blocks: _Optional[int] = ..., kvstore_lookups_skipped: _Optional[int] = ..., kvstore_blocks_dropped: _Optional[int] = ..., kv_pushed_bytes: _Optional[int] = ..., kv_push_us: _Optional[int] = ..., kv_pushes_gpu: _Optional[int] = ..., kv_pushes_host: _Optional[int] = ..., spec_decode: _Optional[_Union[SpecDecodeStats, _Mapping]] = ...) -> None: ...

class SpecDecodeStats(_message.Message):
    __slots__ = ("method", "num_speculative_tokens", "disable_batch_size", "num_steps", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    method: str
    num_speculative_tokens: int
    disable_batch_size: int
    num_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_emitted_tokens: int
    def __init__(self, method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., disable_batch_size: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_emitted_tokens: _Optional[int] = ...) -> None: ...

class GetKVSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetKVSnapshotResponse(_message.Message):
    __slots__ = ("publisher_id", "seq", "block_hashes", "epoch")
    PUBLISHER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    publisher_id: str
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    epoch: int
    def __init__(self, publisher_id: _Optional[str] = ..., seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., epoch: _Optional[int] = ...) -> None: ...

class KVLease(_message.Message):
    __slots__ = ("lease_id", "epoch", "expires_at_unix_ms", "kv_endpoint", "num_blocks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    epoch: int
    expires_at_unix_ms: int
    kv_endpoint: str
    num_blocks: int
    def __init__(self, lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., expires_at_unix_ms: _Optional[int] = ..., kv_endpoint: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ReserveKVRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "ttl_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    ttl_ms: int
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class ReserveKVResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: KVLease
    def __init__(self, lease: _Optional[_Union[KVLease, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "lease", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    lease: KVLease
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageRef]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., lease: _Optional[_Union[KVLease, _Mapping]] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageRef, _Mapping]]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprobs", "num_cached_tokens", "kv_bytes", "kv_transfer_us", "finished")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_US_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprobs: _common_pb2.PositionLogprobs
    num_cached_tokens: int
    kv_bytes: int
    kv_transfer_us: int
    finished: bool
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.PositionLogprobs, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., kv_transfer_us: _Optional[int] = ..., finished: _Optional[bool] = ...) -> None: ...

class StartDecodeRequest(_message.Message):
    __slots__ = ("lease_id", "epoch", "request_id", "prompt_token_ids", "first_token_id", "sampling", "cache_salt", "reply_endpoint", "images")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    REPLY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    epoch: int
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    reply_endpoint: str
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageRef]
    def __init__(self, lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., reply_endpoint: _Optional[str] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageRef, _Mapping]]] = ...) -> None: ...

class StartDecodeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("lease_id", "epoch")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    epoch: int
    def __init__(self, lease_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
