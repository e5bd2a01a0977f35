from llmfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "role", "address", "kv_events_endpoint", "model", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.WorkerRole
    address: str
    kv_events_endpoint: str
    model: _common_pb2.ModelInfo
    load: _common_pb2.LoadReport
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., address: _Optional[str] = ..., kv_events_endpoint: _Optional[str] = ..., model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.LoadReport, _Mapping]] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms",)
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: _common_pb2.LoadReport
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.LoadReport, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "draining", "request_ids", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    draining: bool
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., draining: _Optional[bool] = ..., request_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ("moved_request_ids", "replaced")
    MOVED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    moved_request_ids: _containers.RepeatedScalarFieldContainer[str]
    replaced: bool
    def __init__(self, moved_request_ids: _Optional[_Iterable[str]] = ..., replaced: _Optional[bool] = ...) -> None: ...
