"""A gRPC channel to the coordinator, with the token attached to every call."""

from __future__ import annotations

import grpc

from uzip_serve.coordinator import pb


class _Token(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self._md = ("authorization", f"Bearer {token}")

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_Details(details, list(details.metadata or []) + [self._md]), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_Details(details, list(details.metadata or []) + [self._md]), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata):
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials, self.wait_for_ready = d.credentials, d.wait_for_ready
        self.compression = getattr(d, "compression", None)


# gRPC's default reconnect backoff grows to 120 s: after a coordinator restart that took
# a few seconds, a receiver's channel would stay in TRANSIENT_FAILURE for seconds more
# (every call failing at once with the stale "connection refused") and miss its lease.
# One coordinator, one connection: retrying it every second at most costs nothing.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 1000)]


def connect(address: str, *, token: str | None = None, tls_root_cert: bytes | None = None):
    """Returns (channel, stub). `address` is "host:port"."""
    if tls_root_cert is not None:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_root_cert), options=RECONNECT_OPTIONS)
    else:
        channel = grpc.insecure_channel(address, options=RECONNECT_OPTIONS)
    if token:
        channel = grpc.intercept_channel(channel, _Token(token))
    return channel, pb.grpc_api.CoordinatorStub(channel)
