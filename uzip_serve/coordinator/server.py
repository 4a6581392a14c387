"""The coordinator's gRPC server: thin servicers over core.Coordinator, a constant-time
token check on every call, gRPC health checking and Prometheus metrics.

    uzip coordinator --listen 127.0.0.1:50051 --state ./uzip-state.sqlite3 \\
        [--token-file F] [--tls-cert C --tls-key K] [--metrics-port P]
"""

from __future__ import annotations

import argparse
import hmac
import logging
import signal
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from uzip_serve.coordinator import pb
from uzip_serve.coordinator.core import Coordinator, CoordinatorError
from uzip_serve.coordinator.store import Store

logger = logging.getLogger(__name__)
SERVICE = "uzip.v1.Coordinator"
MAX_MESSAGE_BYTES = 16 << 20  # a manifest of ~100k tensors fits; anything larger is refused


class Metrics:
    """Prometheus series; exported only when a metrics port is given."""

    def __init__(self):
        from prometheus_client import Counter, Histogram

        self.pushes_begun = Counter("uzip_pushes_begun_total", "Weight pushes begun")
        self.pushes_committed = Counter("uzip_pushes_committed_total", "Weight pushes committed")
        self.failures = Counter("uzip_push_failures_total", "Weight pushes aborted, by cause", ["cause"])
        self.raw_bytes = Counter("uzip_push_raw_bytes_total", "Raw bytes of committed pushes")
        self.wire_bytes = Counter("uzip_push_wire_bytes_total", "Bytes the trainer sent for committed pushes")
        self.ratio = Histogram("uzip_push_ratio", "Wire bytes over raw bytes per push",
                               buckets=(0.1, 0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.9, 1.0, 1.1))
        self.push_seconds = Histogram("uzip_push_seconds", "BeginPush to decision, seconds")


class TokenInterceptor(grpc.ServerInterceptor):
    """Every call must carry `authorization: Bearer <token>`; compared in constant time."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return continuation(details)  # load balancers probe health without a token
        got = dict(details.invocation_metadata).get("authorization", "").encode()
        if not hmac.compare_digest(got, self._expected):
            return self._deny
        return continuation(details)


def _call(context, fn, *args):
    try:
        return fn(*args)
    except CoordinatorError as e:
        context.abort(getattr(grpc.StatusCode, e.code), str(e))


class CoordinatorServicer(pb.grpc_api.CoordinatorServicer):
    def __init__(self, core: Coordinator):
        self.core = core

    def Register(self, request, context):
        return _call(context, self.core.register, request)

    def Heartbeat(self, request, context):
        v = _call(context, self.core.heartbeat, request.receiver_id, request.serving_version)
        return pb.HeartbeatResponse(committed_version=v)

    def BeginPush(self, request, context):
        return _call(context, self.core.begin_push, request)

    def ReportPrepared(self, request, context):
        _call(context, self.core.report_prepared, request)
        return pb.ReportPreparedResponse()

    def FinishPush(self, request, context):
        resp = _call(context, self.core.finish_push, request.version, request.wire_bytes)
        m = self.core.metrics
        if m and resp.state == pb.VersionState.VERSION_STATE_COMMITTED:
            raw = self._raw_bytes(request.version)
            m.raw_bytes.inc(raw)
            m.wire_bytes.inc(request.wire_bytes)
            if raw:
                m.ratio.observe(request.wire_bytes / raw)
        return resp

    def _raw_bytes(self, version: int) -> int:
        return self.core.store.raw_bytes(version)

    def AbortPush(self, request, context):
        _call(context, self.core.abort_push, request.version, request.reason)
        return pb.AbortPushResponse()

    def WatchVersions(self, request, context):
        for e in self.core.watch(request.after_version, is_active=context.is_active):
            yield pb.VersionEvent(version=e.version, state=pb.VersionState.Value(f"VERSION_STATE_{e.state}"),
                                  reason=e.reason, unix_s=e.unix)

    def GetState(self, request, context):
        return self.core.state()


def build_server(core: Coordinator, listen: str, *, token: str | None = None, tls: tuple[bytes, bytes] | None = None,
                 max_workers: int = 32) -> tuple[grpc.Server, int]:
    interceptors = [TokenInterceptor(token)] if token else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), interceptors=interceptors,
                         options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    pb.grpc_api.add_CoordinatorServicer_to_server(CoordinatorServicer(core), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if tls:
        port = server.add_secure_port(listen, grpc.ssl_server_credentials([(tls[1], tls[0])]))
    else:
        port = server.add_insecure_port(listen)
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port


def serve(listen: str, state: str, *, token: str | None = None, tls: tuple[bytes, bytes] | None = None,
          metrics_port: int | None = None, lease_s: float = 5.0, heartbeat_interval_s: float = 1.0,
          fanout: int = 1, ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    metrics = None
    if metrics_port:
        from prometheus_client import start_http_server

        metrics = Metrics()
        start_http_server(metrics_port)
    store = Store(state)
    core = Coordinator(store, lease_s=lease_s, heartbeat_interval_s=heartbeat_interval_s, fanout=fanout,
                       metrics=metrics)
    server, port = build_server(core, listen, token=token, tls=tls)
    server.start()
    logger.info("coordinator listening on %s (port %d), state %s", listen, port, state)
    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(sig, lambda *_: stop.set())
        except ValueError:  # not the main thread (tests)
            pass
    if ready:
        ready.set()
    while not stop.wait(0.5):
        core.expire()
    server.stop(grace=2).wait()
    store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="uzip coordinator", description="Sequence versioned weight pushes.")
    p.add_argument("--listen", default="127.0.0.1:50051", help="host:port to serve gRPC on")
    p.add_argument("--state", default="./uzip-state.sqlite3", help="SQLite file holding all durable state")
    p.add_argument("--token-file", type=Path, help="file whose content every client must present")
    p.add_argument("--tls-cert", type=Path)
    p.add_argument("--tls-key", type=Path)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--lease", type=float, default=5.0, help="seconds without a heartbeat before a receiver is lost")
    p.add_argument("--fanout", type=int, default=1,
                   help="most receivers one sender feeds directly; 1 = a chain, which sends each byte over the "
                        "trainer's link once (relays forward chunks cut-through)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if bool(a.tls_cert) != bool(a.tls_key):
        p.error("--tls-cert and --tls-key go together")
    token = a.token_file.read_text().strip() if a.token_file else None
    tls = (a.tls_cert.read_bytes(), a.tls_key.read_bytes()) if a.tls_cert else None
    serve(a.listen, a.state, token=token, tls=tls, metrics_port=a.metrics_port, lease_s=a.lease, fanout=a.fanout)
    return 0
