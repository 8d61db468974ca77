from nori.v1 import common_pb2 as _common_pb2
from nori.v1 import handoff_pb2 as _handoff_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "compute_prompt", "resumed_output_token_ids", "resumed_text_chars", "priority", "coalesce_ms", "stream_interval")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    COALESCE_MS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    compute_prompt: bool
    resumed_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resumed_text_chars: int
    priority: int
    coalesce_ms: int
    stream_interval: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., compute_prompt: _Optional[bool] = ..., resumed_output_token_ids: _Optional[_Iterable[int]] = ..., resumed_text_chars: _Optional[int] = ..., priority: _Optional[int] = ..., coalesce_ms: _Optional[int] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class LeaseRenewal(_message.Message):
    __slots__ = ("request_id", "started")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    started: bool
    def __init__(self, request_id: _Optional[str] = ..., started: _Optional[bool] = ...) -> None: ...

class RenewLeasesRequest(_message.Message):
    __slots__ = ("prefill_worker_id", "renewals")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RENEWALS_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    renewals: _containers.RepeatedCompositeFieldContainer[LeaseRenewal]
    def __init__(self, prefill_worker_id: _Optional[str] = ..., renewals: _Optional[_Iterable[_Union[LeaseRenewal, _Mapping]]] = ...) -> None: ...

class RenewLeasesResponse(_message.Message):
    __slots__ = ("unknown_request_ids",)
    UNKNOWN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    unknown_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unknown_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("reservation", "delta")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    reservation: _handoff_pb2.KVDestination
    delta: _common_pb2.TokenDelta
    def __init__(self, reservation: _Optional[_Union[_handoff_pb2.KVDestination, _Mapping]] = ..., delta: _Optional[_Union[_common_pb2.TokenDelta, _Mapping]] = ...) -> None: ...
