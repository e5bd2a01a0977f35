from llmfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "max_num_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: _common_pb2.ChatPrompt
    max_num_tokens: int
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.ChatPrompt, _Mapping]] = ..., max_num_tokens: _Optional[int] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "images")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageRef]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageRef, _Mapping]]] = ...) -> None: ...

class DetokenizeOpen(_message.Message):
    __slots__ = ("sequence_id", "prompt_token_ids", "stop", "include_stop_str_in_output", "skip_special_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    def __init__(self, sequence_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeFeed(_message.Message):
    __slots__ = ("sequence_id", "token_ids", "finished")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    def __init__(self, sequence_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("opens", "feeds", "closes")
    OPENS_FIELD_NUMBER: _ClassVar[int]
    FEEDS_FIELD_NUMBER: _ClassVar[int]
    CLOSES_FIELD_NUMBER: _ClassVar[int]
    opens: _containers.RepeatedCompositeFieldContainer[DetokenizeOpen]
    feeds: _containers.RepeatedCompositeFieldContainer[DetokenizeFeed]
    closes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, opens: _Optional[_Iterable[_Union[DetokenizeOpen, _Mapping]]] = ..., feeds: _Optional[_Iterable[_Union[DetokenizeFeed, _Mapping]]] = ..., closes: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizedText(_message.Message):
    __slots__ = ("sequence_id", "text", "stop_string", "error", "num_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    text: str
    stop_string: str
    error: str
    num_tokens: int
    def __init__(self, sequence_id: _Optional[int] = ..., text: _Optional[str] = ..., stop_string: _Optional[str] = ..., error: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedCompositeFieldContainer[DetokenizedText]
    def __init__(self, texts: _Optional[_Iterable[_Union[DetokenizedText, _Mapping]]] = ...) -> None: ...
