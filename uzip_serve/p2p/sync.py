"""Synchronous facade for callers on plain threads: the async API, run on one
background event loop per process (UCX progress happens there)."""

from __future__ import annotations

from uzip_serve.p2p import cuda_ipc, split_send, ucx
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
        items = split_send.named_items(tensors)
        return run(self._ep.send_tensors(items, stream=cuda_ipc.caller_stream()),
                   spin_s=self._ep.caller_spin(split_send.on_one_gpu(items)))

    def recv_tensors(self, into=None, device=None):
        return run(self._ep.recv_tensors(into, device=device, stream=cuda_ipc.caller_stream()),
                   spin_s=self._ep.caller_spin(split_send.uses_cuda(into, device)))

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
