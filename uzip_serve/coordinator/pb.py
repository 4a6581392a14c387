"""The generated protobuf messages of uzip/v1/coordinator.proto, under short names."""

from uzip_serve.coordinator._generated.uzip.v1.coordinator_pb2 import (  # noqa: F401
    AbortPushRequest, AbortPushResponse, BeginPushRequest, BeginPushResponse, FinishPushRequest,
    FinishPushResponse, GetStateRequest, GetStateResponse, HeartbeatRequest, HeartbeatResponse, ReceiverInfo,
    RegisterRequest, RegisterResponse, ReportPreparedRequest, ReportPreparedResponse, ShardSpec, TensorSpec,
    Transfer, VersionEvent, VersionState, WatchVersionsRequest)
from uzip_serve.coordinator._generated.uzip.v1 import coordinator_pb2_grpc as grpc_api  # noqa: F401
