"""The intra-node CUDA IPC data path: the receiver maps the sender's GPU memory and copies
from it on its own stream, so a CUDA tensor crosses processes at device-copy speed.

Handles come from torch's own CUDA IPC (what torch.multiprocessing uses): the sender
exports a tensor's allocation with `UntypedStorage._share_cuda_()`, the receiver maps it
with `UntypedStorage._new_shared_cuda(...)`. Only the resulting bytes and integers travel,
in the binary IPC offer of protocol.py, over the endpoint's existing UCX connection; nothing
is pickled. torch's IPC reference counting stays intact: a mapping the receiver holds keeps
the sender's block out of its caching allocator until the receiver lets it go.

Ordering: the sender records an interprocess event on the caller's stream after the caller's
writes; the receiver's stream waits on it before copying, and the receiver acknowledges
only after its copies completed, so the sender's tensors are never read after
`send_tensors` returned. docs/gpu_p2p.md has the measurements and the design.

torch.cuda is touched only when a CUDA transfer happens; importing this module is cheap.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import socket
import time

from uzip_serve.p2p import protocol as proto
from uzip_serve.p2p.errors import TransferTimeout

# Opened mappings kept per receiving endpoint: opening one costs a driver call (tens to
# hundreds of microseconds), which at device speed is the price of a 256 MiB copy. A
# cached mapping pins the sender's block (torch's IPC reference count), so the cache is
# bounded and dropped when the endpoint closes.
MAX_CACHED_MAPPINGS = 256


def _torch():
    import torch

    return torch


def available() -> bool:
    """Whether this process can take part in CUDA IPC (torch with a CUDA device)."""
    try:
        torch = _torch()
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch, no driver: simply not available
        return False


@functools.lru_cache(maxsize=1)
def host_id() -> bytes:
    """16 bytes naming this host's running kernel: CUDA IPC handles are meaningless elsewhere.
    boot_id differs between hosts (and reboots); the hostname guards against a missing one."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    return hashlib.sha256(boot + b"|" + socket.gethostname().encode()).digest()[:16]


@functools.lru_cache(maxsize=64)
def device_id(index: int) -> bytes:
    """16 bytes naming a GPU independently of CUDA_VISIBLE_DEVICES (ordinals differ per process)."""
    props = _torch().cuda.get_device_properties(index)
    return hashlib.sha256(str(getattr(props, "uuid", props.name)).encode()).digest()[:16]


def local_device(dev_id: bytes) -> int | None:
    torch = _torch()
    for i in range(torch.cuda.device_count()):
        if device_id(i) == dev_id:
            return i
    return None


def caller_stream(device=None):
    """The calling thread's current CUDA stream, or None when this process has not used CUDA
    (asking would create a CUDA context in processes that never need one)."""
    try:
        torch = _torch()
        if not torch.cuda.is_initialized():
            return None
        return torch.cuda.current_stream(device)
    except Exception:  # noqa: BLE001
        return None


def digest(flat) -> int:
    """A 64-bit position-weighted checksum of a flat uint8 tensor, identical on CPU and GPU.

    Rows of 512 int64 words are summed (wrapping), and the row sums are weighted by odd
    numbers, so any change of one word and any exchange of rows changes it. It costs one
    read of the data at memory speed in torch, which CRC32C on a GPU does not (docs/gpu_p2p.md).
    """
    torch = _torch()
    n = flat.numel()
    main = n - n % 4096
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    if main:
        rows = flat[:main].view(torch.int64).view(-1, 512).sum(1)
        w = torch.arange(rows.numel(), dtype=torch.int64, device=flat.device) * 2 + 1
        total = (rows * w).sum()
    if n - main:
        tail = torch.zeros(4096, dtype=torch.uint8, device=flat.device)
        tail[: n - main] = flat[main:]
        total = total + tail.view(torch.int64).sum() * 0x5851F42D4C957F2D
    return (int(total.item()) + n) & ((1 << 64) - 1)


async def wait_event(event, deadline_s: float, what: str) -> None:
    """Waits for a CUDA event without blocking the event loop (UCX keeps progressing) and
    without a thread hop: yield while young, then poll every 100 us."""
    t0 = time.perf_counter()
    spins = 0
    while not event.query():
        spins += 1
        waited = time.perf_counter() - t0
        if waited > deadline_s:
            raise TransferTimeout(f"{what}: GPU work did not finish within the deadline")
        await asyncio.sleep(0 if waited < 2e-3 else 1e-4)


class Exporter:
    """Sender-side IPC state of one endpoint."""

    def __init__(self):
        self.refused = False  # the peer refused IPC once: it will again (another host, no CUDA)
        self._events: dict[int, object] = {}
        self._staging = None

    def event_for(self, device: int):
        """(event, its IPC handle bytes): one interprocess event per device, re-recorded per transfer."""
        ev = self._events.get(device)
        if ev is None:
            torch = _torch()
            with torch.cuda.device(device):
                e = torch.cuda.Event(interprocess=True, blocking=False)
                e.record()  # an event gets its handle only once it exists on the device
                ev = (e, bytes(e.ipc_handle()))
            self._events[device] = ev
        return ev

    def staging(self, device: int, nbytes: int):
        """A device buffer for compressed chunks, reused across transfers (so the peer's
        mapping of it stays cached)."""
        torch = _torch()
        if self._staging is None or self._staging.numel() < nbytes or self._staging.device.index != device:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device))
        return self._staging

    @staticmethod
    def share(flat, stream) -> tuple[proto.IpcStorage, int]:
        """Exports the allocation under a flat uint8 CUDA tensor: (storage, byte offset)."""
        torch = _torch()
        storage = flat.untyped_storage()
        with torch.cuda.stream(stream):
            (_, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = storage._share_cuda_()
        return (proto.IpcStorage(int(size), int(offset), bytes(handle), None if rc_handle is None else bytes(rc_handle),
                                 int(rc_offset), None if ev_handle is None else bytes(ev_handle), bool(ev_sync)),
                flat.storage_offset())


class Importer:
    """Receiver-side IPC state of one endpoint: mapped storages and events, cached."""

    def __init__(self):
        self._maps: collections.OrderedDict = collections.OrderedDict()
        self._events: dict[tuple[int, bytes], object] = {}

    def storage(self, s: proto.IpcStorage, device: int, stream):
        torch = _torch()
        key = (s.handle, s.offset)
        hit = self._maps.get(key)
        if hit is not None:
            self._maps.move_to_end(key)
            # The sender counted one more reference for this export; give it back, as
            # torch.multiprocessing does for a storage it already holds.
            if s.ref_counter_handle is not None:
                torch.UntypedStorage._release_ipc_counter(s.ref_counter_handle, s.ref_counter_offset, device=device)
            return hit
        with torch.cuda.device(device), torch.cuda.stream(stream):
            st = torch.UntypedStorage._new_shared_cuda(device, s.handle, s.nbytes, s.offset, s.ref_counter_handle,
                                                       s.ref_counter_offset, s.event_handle, s.event_sync_required)
        self._maps[key] = st
        while len(self._maps) > MAX_CACHED_MAPPINGS:
            self._maps.popitem(last=False)
        return st

    def view(self, st, byte_offset: int, nbytes: int, device: int):
        """A flat uint8 tensor over bytes [byte_offset, +nbytes) of a mapped storage."""
        torch = _torch()
        return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device)).set_(st, byte_offset, (nbytes,))

    def event(self, handle: bytes, device: int):
        key = (device, handle)
        ev = self._events.get(key)
        if ev is None:
            torch = _torch()
            ev = torch.cuda.Event.from_ipc_handle(torch.device("cuda", device), handle)
            self._events[key] = ev
        return ev

    def close(self) -> None:
        self._maps.clear()
        self._events.clear()


def refusal(offer: proto.IpcOffer | None, enabled: bool = True) -> str | None:
    """Why this process cannot take the offer, or None if it can (the mapping may still fail)."""
    if not enabled:
        return "CUDA IPC disabled here"
    if not available():
        return "no CUDA here"
    if offer is not None:
        if offer.host_id != host_id():
            return "another host"
        if local_device(offer.device_id) is None:
            return "the sender's GPU is not visible here"
    return None
