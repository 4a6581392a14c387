"""Synchronous facade for callers on plain threads: the async API, run on one
background event loop per process (UCX progress happens there)."""

from __future__ import annotations

from uzip_serve.p2p import ucx
from uzip_serve.p2p.config import TransportConfig
from uzip_serve.p2p.loop import run, ucx_loop


class SyncEndpoint:
    def __init__(self, ep: ucx.Endpoint):
        self._ep = ep

    @property
    def last_stats(self):
        return self._ep.last_stats

    @property
    def policy(self):
        return self._ep.policy

    def send_tensors(self, tensors):
        # The stream is read here: the coroutine runs on the UCX loop's thread.
        coro, spin = self._ep.send_call(tensors)
        return run(coro, spin_s=spin)

    def recv_tensors(self, into=None, device=None, on_tensor=None):
        coro, spin = self._ep.recv_call(into, device=device, on_tensor=on_tensor)
        return run(coro, spin_s=spin)

    def send_bytes(self, data: bytes) -> None:
        run(self._ep.send_bytes(data))

    def recv_bytes(self, limit: int = 64 << 20, *, idle: bool = False) -> bytes:
        return run(self._ep.recv_bytes(limit, idle=idle))

    @property
    def alive(self) -> bool:
        return self._ep.alive

    def abort(self) -> None:
        ucx_loop().call_soon_threadsafe(self._ep.abort)

    def close(self) -> None:
        run(self._ep.close())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SyncListener:
    def __init__(self, port: int = 0, config: TransportConfig | None = None):
        self._lst = run(ucx.listen(port, config))

    @property
    def port(self) -> int:
        return self._lst.port

    def accept(self, timeout: float | None = None) -> SyncEndpoint:
        return SyncEndpoint(run(self._lst.accept(timeout)))

    def close(self) -> None:
        ucx_loop().call_soon_threadsafe(self._lst.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(host: str, port: int, config: TransportConfig | None = None) -> SyncEndpoint:
    return SyncEndpoint(run(ucx.connect(host, port, config)))
