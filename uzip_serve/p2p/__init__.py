"""Point-to-point tensor transfers over UCX with the split-send compression pipeline.

Async (preferred; any event loop: the work runs on the process's UCX loop)::

    from uzip_serve import p2p
    listener = await p2p.listen(port=0)
    ep = await p2p.connect(host, port)
    stats = await ep.send_tensors({"w": w})      # on one side
    tensors = await (await listener.accept()).recv_tensors()   # on the other

Sync (plain threads): p2p.SyncListener, p2p.connect_sync. An application with one long-lived
loop may call `p2p.use_running_loop()` first: its calls then skip the hop to the UCX loop's
thread. Wire protocol: docs/p2p.md.
ucxx is imported on first use, not by `import uzip_serve.p2p`.
"""

from uzip_serve.p2p.adaptive import AdaptivePolicy, Decision, TransferStats
from uzip_serve.p2p.config import TransportConfig
from uzip_serve.p2p.errors import ChecksumError, PeerError, ProtocolError, TransferError, TransferTimeout

__all__ = [
    "AdaptivePolicy", "ChecksumError", "Decision", "Endpoint", "Listener", "PeerError", "ProtocolError",
    "SyncEndpoint", "SyncListener", "TransferError", "TransferStats", "TransferTimeout", "TransportConfig",
    "connect", "connect_sync", "listen", "use_running_loop",
]


def __getattr__(name):
    if name in ("Endpoint", "Listener", "connect", "listen"):
        from uzip_serve.p2p import ucx

        return getattr(ucx, name)
    if name in ("SyncEndpoint", "SyncListener"):
        from uzip_serve.p2p import sync

        return getattr(sync, name)
    if name == "use_running_loop":
        from uzip_serve.p2p import loop

        return loop.use_running_loop
    if name == "connect_sync":
        from uzip_serve.p2p import sync

        return sync.connect
    raise AttributeError(f"module 'uzip_serve.p2p' has no attribute {name!r}")
