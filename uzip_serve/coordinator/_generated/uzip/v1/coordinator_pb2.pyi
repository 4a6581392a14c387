from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VersionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERSION_STATE_UNSPECIFIED: _ClassVar[VersionState]
    VERSION_STATE_PUSHING: _ClassVar[VersionState]
    VERSION_STATE_COMMITTED: _ClassVar[VersionState]
    VERSION_STATE_ABORTED: _ClassVar[VersionState]
VERSION_STATE_UNSPECIFIED: VersionState
VERSION_STATE_PUSHING: VersionState
VERSION_STATE_COMMITTED: VersionState
VERSION_STATE_ABORTED: VersionState

class ShardSpec(_message.Message):
    __slots__ = ("dim", "rank", "world_size")
    DIM_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    dim: int
    rank: int
    world_size: int
    def __init__(self, dim: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "shard")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    shard: ShardSpec
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., shard: _Optional[_Union[ShardSpec, _Mapping]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("receiver_id", "p2p_address", "device_kind", "device_vendor", "expected", "codec_version")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    P2P_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_VENDOR_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    CODEC_VERSION_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    p2p_address: str
    device_kind: str
    device_vendor: str
    expected: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    codec_version: int
    def __init__(self, receiver_id: _Optional[str] = ..., p2p_address: _Optional[str] = ..., device_kind: _Optional[str] = ..., device_vendor: _Optional[str] = ..., expected: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., codec_version: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("committed_version", "heartbeat_interval_s", "lease_s")
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    committed_version: int
    heartbeat_interval_s: float
    lease_s: float
    def __init__(self, committed_version: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., lease_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("receiver_id", "serving_version")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    SERVING_VERSION_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    serving_version: int
    def __init__(self, receiver_id: _Optional[str] = ..., serving_version: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("committed_version",)
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    committed_version: int
    def __init__(self, committed_version: _Optional[int] = ...) -> None: ...

class BeginPushRequest(_message.Message):
    __slots__ = ("version", "manifest", "timeout_s", "raw_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    timeout_s: float
    raw_bytes: int
    def __init__(self, version: _Optional[int] = ..., manifest: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., timeout_s: _Optional[float] = ..., raw_bytes: _Optional[int] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("sender", "receiver_id", "p2p_address", "expected")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    P2P_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    sender: str
    receiver_id: str
    p2p_address: str
    expected: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, sender: _Optional[str] = ..., receiver_id: _Optional[str] = ..., p2p_address: _Optional[str] = ..., expected: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class BeginPushResponse(_message.Message):
    __slots__ = ("version", "plan", "deadline_unix_s", "receivers")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    plan: _containers.RepeatedCompositeFieldContainer[Transfer]
    deadline_unix_s: float
    receivers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., plan: _Optional[_Iterable[_Union[Transfer, _Mapping]]] = ..., deadline_unix_s: _Optional[float] = ..., receivers: _Optional[_Iterable[str]] = ...) -> None: ...

class ReportPreparedRequest(_message.Message):
    __slots__ = ("receiver_id", "version", "ok", "error", "wire_bytes")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    version: int
    ok: bool
    error: str
    wire_bytes: int
    def __init__(self, receiver_id: _Optional[str] = ..., version: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., wire_bytes: _Optional[int] = ...) -> None: ...

class ReportPreparedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinishPushRequest(_message.Message):
    __slots__ = ("version", "wire_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    wire_bytes: int
    def __init__(self, version: _Optional[int] = ..., wire_bytes: _Optional[int] = ...) -> None: ...

class FinishPushResponse(_message.Message):
    __slots__ = ("version", "state", "reason", "receivers")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: VersionState
    reason: str
    receivers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., state: _Optional[_Union[VersionState, str]] = ..., reason: _Optional[str] = ..., receivers: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortPushRequest(_message.Message):
    __slots__ = ("version", "reason")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    reason: str
    def __init__(self, version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortPushResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchVersionsRequest(_message.Message):
    __slots__ = ("after_version", "receiver_id")
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    receiver_id: str
    def __init__(self, after_version: _Optional[int] = ..., receiver_id: _Optional[str] = ...) -> None: ...

class VersionEvent(_message.Message):
    __slots__ = ("version", "state", "reason", "unix_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UNIX_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: VersionState
    reason: str
    unix_s: float
    def __init__(self, version: _Optional[int] = ..., state: _Optional[_Union[VersionState, str]] = ..., reason: _Optional[str] = ..., unix_s: _Optional[float] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReceiverInfo(_message.Message):
    __slots__ = ("receiver_id", "p2p_address", "device_kind", "live", "serving_version")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    P2P_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    SERVING_VERSION_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    p2p_address: str
    device_kind: str
    live: bool
    serving_version: int
    def __init__(self, receiver_id: _Optional[str] = ..., p2p_address: _Optional[str] = ..., device_kind: _Optional[str] = ..., live: _Optional[bool] = ..., serving_version: _Optional[int] = ...) -> None: ...

class GetStateResponse(_message.Message):
    __slots__ = ("committed_version", "highest_version", "receivers")
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    HIGHEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    committed_version: int
    highest_version: int
    receivers: _containers.RepeatedCompositeFieldContainer[ReceiverInfo]
    def __init__(self, committed_version: _Optional[int] = ..., highest_version: _Optional[int] = ..., receivers: _Optional[_Iterable[_Union[ReceiverInfo, _Mapping]]] = ...) -> None: ...
