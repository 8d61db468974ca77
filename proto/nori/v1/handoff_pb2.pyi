from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVDestination(_message.Message):
    __slots__ = ("worker_id", "transfer_address", "block_ids", "grpc_address", "lease_seconds", "lease_epoch", "transfer_token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    transfer_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    grpc_address: str
    lease_seconds: float
    lease_epoch: int
    transfer_token: str
    def __init__(self, worker_id: _Optional[str] = ..., transfer_address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., grpc_address: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., lease_epoch: _Optional[int] = ..., transfer_token: _Optional[str] = ...) -> None: ...

class HandOff(_message.Message):
    __slots__ = ("request_id", "destination", "output_token_ids", "generator_state", "trace_context", "sender")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    destination: KVDestination
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generator_state: bytes
    trace_context: _containers.ScalarMap[str, str]
    sender: str
    def __init__(self, request_id: _Optional[str] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., generator_state: _Optional[bytes] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., sender: _Optional[str] = ...) -> None: ...

class KVTransferHeader(_message.Message):
    __slots__ = ("hand_off", "buffer_nbytes", "buffer_checksums", "checksums_follow", "source_runs", "pull_offer")
    HAND_OFF_FIELD_NUMBER: _ClassVar[int]
    BUFFER_NBYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RUNS_FIELD_NUMBER: _ClassVar[int]
    PULL_OFFER_FIELD_NUMBER: _ClassVar[int]
    hand_off: HandOff
    buffer_nbytes: _containers.RepeatedScalarFieldContainer[int]
    buffer_checksums: _containers.RepeatedScalarFieldContainer[int]
    checksums_follow: bool
    source_runs: _containers.RepeatedScalarFieldContainer[int]
    pull_offer: CrossMemoryOffer
    def __init__(self, hand_off: _Optional[_Union[HandOff, _Mapping]] = ..., buffer_nbytes: _Optional[_Iterable[int]] = ..., buffer_checksums: _Optional[_Iterable[int]] = ..., checksums_follow: _Optional[bool] = ..., source_runs: _Optional[_Iterable[int]] = ..., pull_offer: _Optional[_Union[CrossMemoryOffer, _Mapping]] = ...) -> None: ...

class CrossMemoryOffer(_message.Message):
    __slots__ = ("probe", "region_addresses", "region_nbytes", "segment_socket", "segment_addresses", "segment_nbytes", "segment_keys")
    PROBE_FIELD_NUMBER: _ClassVar[int]
    REGION_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    REGION_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    probe: bytes
    region_addresses: _containers.RepeatedScalarFieldContainer[int]
    region_nbytes: _containers.RepeatedScalarFieldContainer[int]
    segment_socket: str
    segment_addresses: _containers.RepeatedScalarFieldContainer[int]
    segment_nbytes: _containers.RepeatedScalarFieldContainer[int]
    segment_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, probe: _Optional[bytes] = ..., region_addresses: _Optional[_Iterable[int]] = ..., region_nbytes: _Optional[_Iterable[int]] = ..., segment_socket: _Optional[str] = ..., segment_addresses: _Optional[_Iterable[int]] = ..., segment_nbytes: _Optional[_Iterable[int]] = ..., segment_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class KVTransferReply(_message.Message):
    __slots__ = ("accepted", "rejected", "done_nbytes", "pulled", "destination_runs", "pull")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    DONE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_RUNS_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    rejected: str
    done_nbytes: int
    pulled: bool
    destination_runs: _containers.RepeatedScalarFieldContainer[int]
    pull: bool
    def __init__(self, accepted: _Optional[bool] = ..., rejected: _Optional[str] = ..., done_nbytes: _Optional[int] = ..., pulled: _Optional[bool] = ..., destination_runs: _Optional[_Iterable[int]] = ..., pull: _Optional[bool] = ...) -> None: ...
