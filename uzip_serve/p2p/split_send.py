"""The split-send pipeline: chunk k+1 is compressed while chunk k is on the wire, and
the receiver decompresses each chunk into its destination tensor as it arrives.

Transport-agnostic: it talks to a Channel (exact-size send/recv of buffers), so the
UCX endpoint and tests can both drive it. The codec runs on executor threads (the C
codec releases the GIL), which keeps the event loop free to progress the transport.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

import torch

import uzip_serve as uz
from uzip_serve.codec import default_threads
from uzip_serve import format as fmt
from uzip_serve.kernels import get_backend
from uzip_serve.p2p import protocol as proto
from uzip_serve.p2p.adaptive import AdaptivePolicy, CodecPacer, TransferStats
from uzip_serve.p2p.config import TransportConfig
from uzip_serve.p2p.errors import ChecksumError, ProtocolError

logger = logging.getLogger(__name__)

# How much of a chunk is compressed to estimate its ratio before deciding (one block).
PROBE_BYTES = 128 << 10
# A chunk stream of at least this many wire bytes measures the link end to end (first chunk
# posted to the receiver's ack); 1 MiB at 1 Gbit/s is 8 ms against ~0.2 ms of ack latency.
END_TO_END_SAMPLE = 1 << 20
# Chunk sends posted at once. Two keep the wire busy: the next chunk is queued at the
# receiver before the current one completes.
SEND_WINDOW = 2
RECV_WINDOW = 2


class Channel(Protocol):
    """Ordered, exact-size message transport (one UCX endpoint). `send` and `recv` post
    the operation when called and return an awaitable of its completion: messages match
    in the order of the calls, however many are in flight."""

    def send(self, buf) -> Awaitable[None]: ...

    def recv(self, buf) -> Awaitable[None]: ...


# ---- tensors <-> bytes --------------------------------------------------------------------

def as_tensor(value: Any) -> torch.Tensor:
    """torch tensors as they are; numpy arrays and CuPy arrays (via __cuda_array_interface__)
    wrapped without copying."""
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "__cuda_array_interface__"):
        return torch.as_tensor(value, device="cuda")
    import numpy as np

    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise TypeError(f"cannot send a {type(value).__name__}; expected a torch tensor, numpy or CuPy array")


def entries_of(items) -> list[proto.TensorEntry]:
    """The manifest entries of (name, tensor) pairs."""
    return [proto.TensorEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
            for n, t in items]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor sharing its memory (bf16 included)."""
    return t.reshape(-1).view(torch.uint8)


def _host_view(t: torch.Tensor):
    """A numpy view for UCX: CPU memory is passed by pointer, zero copy."""
    return t.numpy()


def named_items(tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    out, seen = [], set()
    for name, value in items:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        if name in seen:
            raise ValueError(f"tensor {name!r} is listed twice")
        seen.add(name)
        t = as_tensor(value)
        out.append((name, t if t.is_contiguous() else t.contiguous()))
    return out


def _chunk_source(chunk: proto.Chunk, flats: list[torch.Tensor]) -> torch.Tensor:
    """A chunk's raw bytes where they live: a view for a slice of one tensor, a copy for a batch."""
    parts = [flats[p.tensor][p.start:p.start + p.nbytes] for p in chunk.pieces]
    if len(parts) == 1:
        return parts[0]
    if len({p.device for p in parts}) > 1:
        parts = [p.cpu() for p in parts]
    return torch.cat(parts)


def _chunk_bytes(chunk: proto.Chunk, flats: list[torch.Tensor]) -> torch.Tensor:
    """A chunk's raw bytes on the host (a no-op view for host tensors)."""
    return _chunk_source(chunk, flats).cpu()


def _gpu_codec():
    """The GPU codec backend, or None (no CuPy / no GPU): then CUDA chunks use the CPU codec."""
    try:
        from uzip_serve.kernels import get_backend as _get

        return _get("cuda")
    except Exception:  # noqa: BLE001 - ImportError, or a driver that will not load
        return None


def uses_cuda(into, device) -> bool:
    """Whether this receiving process works on a GPU (CUDA destinations, or CUDA in use)."""
    if into is not None and any(t.is_cuda for t in into.values()):
        return True
    return (device is not None and torch.device(device).type == "cuda") or torch.cuda.is_initialized()


async def _load_gpu_codec(gpu, device_index: int | None, executor) -> None:
    """Loads the GPU codec before a transfer's first deadline-bound step: its first load on a
    machine compiles for tens of seconds (CudaCodec.load), which inside the transfer made the
    peer's deadline (10 s by default) expire on the first compressed transfer of a process."""
    if gpu is not None and device_index is not None and not gpu.loaded(device_index):
        await asyncio.get_running_loop().run_in_executor(executor, gpu.load, device_index)


def _typed(data: torch.Tensor, dtype: str) -> torch.Tensor:
    """Reinterprets raw bytes as the chunk's dtype so the codec sees the real element layout."""
    itemsize = fmt.dtype_by_name(dtype).itemsize
    if data.numel() % itemsize:
        return data
    return data.view(getattr(torch, dtype))


# ---- send ---------------------------------------------------------------------------------

def _run_codec(call, raw_bytes: int, pacer: CodecPacer, config: TransportConfig, stats: TransferStats):
    """`call(threads)` on the configured thread count, else the pacer's; the pacer learns
    from it and the stats record it. Returns (its result, seconds)."""
    threads = config.codec_threads or pacer.threads(default_threads())
    stats.codec_threads = max(stats.codec_threads, threads)
    t0 = time.perf_counter()
    result = call(threads)
    seconds = time.perf_counter() - t0
    pacer.observe_codec(raw_bytes, seconds, threads)
    return result, seconds


class StagingPool:
    """Staging buffers kept between the transfers of one endpoint and direction. A new
    bytearray is zero-filled, 0.05-2 ms per MiB on the 2-core VM, and a transfer needs three
    on each side before its first chunk can move: on the critical path of every PP step.
    Buffers come back only from transfers that completed, so none is still read by a send."""

    KEEP = 8  # per size, so a transfer made with many buffers (pipeline=False) is not all kept

    def __init__(self):
        self._free: dict[int, list[bytearray]] = {}

    def take(self, n: int, nbytes: int) -> list[bytearray]:
        free = self._free.get(nbytes, [])
        got = [free.pop() for _ in range(min(n, len(free)))]
        return got + [bytearray(nbytes) for _ in range(n - len(got))]

    def give(self, bufs: list[bytearray]) -> None:
        for b in bufs:
            free = self._free.setdefault(len(b), [])
            if len(free) < self.KEEP:
                free.append(b)


class _Encoded:
    __slots__ = ("header", "payload", "decision")

    def __init__(self, header, payload, decision):
        self.header, self.payload, self.decision = header, payload, decision


async def send_tensors(channel: Channel, tensors, *, config: TransportConfig, policy: AdaptivePolicy,
                       executor: Executor, transfer_id: int = 0, ipc=None, ipc_policy: AdaptivePolicy | None = None,
                       stream=None, cuda_route=None, staging_pool: StagingPool | None = None) -> TransferStats:
    """Sends named tensors as one transfer. Returns when the peer verified all of it.

    GPU routes for tensors on one GPU, offered in this order (docs/gpu_p2p.md):
    `cuda_route` (a ucx_cuda.Route, where this process's UCX carries CUDA memory): UCX moves
    the tensors GPU to GPU; `ipc` (a cuda_ipc.Exporter): the peer maps them through CUDA IPC
    handles. Both need the peer on this host. `ipc_policy` is their adaptive policy, `stream`
    the caller's CUDA stream (its pending writes are waited for). `staging_pool`: buffers
    kept from this endpoint's earlier sends.
    """
    loop = asyncio.get_running_loop()
    items = named_items(tensors)
    entries = entries_of(items)
    num_chunks = proto.count_chunks(entries, config.chunk_bytes)
    chunks: list[proto.Chunk] = []  # planned only if the chunk stream carries the transfer
    flats = [_flat_bytes(t) for _, t in items]
    manifest = proto.encode_manifest(entries)
    stats = TransferStats(raw_bytes=sum(e.nbytes for e in entries), chunks=num_chunks)
    crc32c = get_backend("cpu").crc32c
    cap = fmt.max_compressed_size(config.chunk_bytes, "uint8")
    staging: list[bytearray] = []  # taken from the pool once the chunk stream carries the transfer
    gpu_codec = _gpu_codec() if any(f.is_cuda for f in flats) else None
    if gpu_codec is not None and config.compression != "off":
        await _load_gpu_codec(gpu_codec, next(f.device.index for f in flats if f.is_cuda), executor)

    def encode(k: int) -> _Encoded:
        chunk = chunks[k]
        data = _chunk_source(chunk, flats)
        # A CUDA chunk is compressed on its GPU (frame copied out, ~0.67 of the bytes) when
        # the GPU codec exists; that runs here, on a codec thread, while the previous chunk
        # is on the wire. Raw chunks and the CPU codec take the bytes to the host first.
        if not (data.is_cuda and gpu_codec is not None):
            data = data.cpu()
        typed = _typed(data, chunk.dtype)
        probe = None
        if policy.needs_probe(data.numel(), stats.raw_bytes):
            sample = typed[: PROBE_BYTES // typed.element_size()]
            probe = len(uz.compress(sample, threads=1)) / sample.nbytes
        decision = policy.decide(data.numel(), probe, chunks_in_transfer=len(chunks), transfer_bytes=stats.raw_bytes)
        if not decision.compress and data.is_cuda:
            data = data.cpu()
        if decision.compress:
            buf = staging[k % len(staging)]
            n, seconds = _run_codec(lambda threads: uz.compress_into(typed, buf, threads=threads), data.numel(),
                                    policy.pacer, config, stats)
            policy.observe_compress(data.numel(), seconds)
            header = proto.ChunkHeader(k, proto.CODEC_UZIP, data.numel(), n)
            return _Encoded(header, memoryview(buf)[:n], decision)
        header = proto.ChunkHeader(k, proto.CODEC_RAW, data.numel(), data.numel(), crc32c(_host_view(data)))
        return _Encoded(header, _host_view(data), decision)

    t_start = time.perf_counter()
    one_gpu = on_one_gpu(items)
    use_ipc = one_gpu and ipc is not None and not ipc.refused and config.cuda_ipc != "off"
    # The CUDA route carries raw bytes only: where compression could pay, the IPC path's
    # chunked mode (GPU codec) does the transfer.
    use_route = one_gpu and cuda_route is not None and not cuda_route.refused
    if use_route:
        from uzip_serve.p2p import ipc_send

        use_route = not ipc_send.wants_chunks(ipc_policy or policy, gpu_codec, stats.raw_bytes, config)
    flags = (proto.FLAG_CUDA_IPC if use_ipc else 0) | (proto.FLAG_CUDA_UCX if use_route else 0)
    if use_route and cuda_route.standing:
        flags |= proto.FLAG_CUDA_UCX_EAGER
    posted = [channel.send(proto.TransferHeader(len(manifest), num_chunks, config.chunk_bytes, transfer_id,
                                                flags).pack())]
    if manifest:
        posted.append(channel.send(manifest))
    done = None
    with _gpu_spin(channel, use_route or use_ipc):
        if use_route:
            from uzip_serve.p2p import ucx_cuda

            # The route's offer is posted behind these before they are awaited: one fewer wait.
            done = await ucx_cuda.send(channel, entries, flats, config=config, policy=ipc_policy or policy,
                                       route=cuda_route, stream=stream, posted=posted,
                                       tag=proto.payload_tag(transfer_id, manifest))
            # None: refused (a host destination, say); the IPC offer or the chunk stream follows
        else:
            for sent in posted:
                await sent
        if done is None and use_ipc:
            from uzip_serve.p2p import ipc_send

            done = await ipc_send.send(channel, items, entries, flats, config=config, policy=ipc_policy or policy,
                                       exporter=ipc, stream=stream, executor=executor)
            # None: refused (another host, no CUDA there); the transfer goes on as a chunk stream
    if done is not None:
        done.seconds = time.perf_counter() - t_start
        return done
    chunks.extend(proto.plan_chunks(entries, config.chunk_bytes))  # encode() reads it
    if stream is not None and any(f.is_cuda for f in flats):
        stream.synchronize()  # the codec threads read on their own streams: wait for the caller's writes
    # A staging buffer per chunk in flight, plus the one being compressed.
    pool = staging_pool or StagingPool()
    staging.extend(pool.take(SEND_WINDOW + 1 if config.pipeline else max(1, len(chunks)), cap))
    if config.pipeline:
        first_posted = await _pipelined_send(channel, len(chunks), lambda k: loop.run_in_executor(executor, encode, k),
                                             policy, stats, slots=len(staging))
    else:
        encoded = [await loop.run_in_executor(executor, encode, k) for k in range(len(chunks))]
        first_posted = await _pipelined_send(channel, len(chunks), lambda k: _done(encoded[k]), policy, stats,
                                             slots=len(chunks))
    ack = bytearray(proto.ACK.size)
    await channel.recv(ack)
    acked = time.perf_counter()
    status, _ = proto.ACK.unpack(ack)
    if status == proto.ACK_CHECKSUM:
        raise ChecksumError("the receiver rejected a chunk: checksum mismatch or undecodable frame")
    if first_posted is not None and stats.wire_bytes >= END_TO_END_SAMPLE:
        # End to end, first chunk posted to the receiver's ack: what the link really carried.
        policy.observe_link(stats.wire_bytes, acked - first_posted, lower_bound=stats.chunks_compressed > 0)
    if first_posted is not None:
        # Smaller transfers too (from 64 KiB, CodecPacer.observe_wire): their fixed costs make
        # the link look slower, which only means fewer threads, and an endpoint that carries
        # only small transfers (PP steps of short prompts) must not stay on every core.
        policy.pacer.observe_wire(stats.wire_bytes, acked - first_posted)
    if status != proto.ACK_OK:
        raise ProtocolError(f"the receiver rejected the transfer (status {status})")
    pool.give(staging)
    stats.seconds = time.perf_counter() - t_start
    if stats.chunks_compressed in (0, stats.chunks):  # all one path: an outcome for its size class
        policy.observe_transfer(stats.raw_bytes, stats.seconds, compressed=stats.chunks_compressed > 0)
    logger.debug("sent %d tensors, %d chunks (%d compressed): %.1f MB raw, %.1f MB on the wire, %.3f s",
                 len(entries), stats.chunks, stats.chunks_compressed, stats.raw_bytes / 1e6, stats.wire_bytes / 1e6,
                 stats.seconds)
    return stats


def _gpu_spin(channel, on: bool):
    """While a same-host GPU route runs, the channel's UCX loop spins instead of sleeping
    (ucx._Spin; channels without it, the tests' fakes, need nothing)."""
    spin = getattr(channel, "gpu_spin", None)
    return spin() if on and spin is not None else contextlib.nullcontext()


def on_one_gpu(items) -> bool:
    """GPU routes are offered for a transfer whose non-empty tensors all sit on one GPU."""
    devices = {t.device for _, t in items if t.numel()}
    return len(devices) == 1 and next(iter(devices)).type == "cuda"


async def _done(value):
    return value


async def _pipelined_send(channel: Channel, n: int, encode, policy: AdaptivePolicy, stats: TransferStats,
                          *, slots: int) -> float | None:
    """Sends chunks 0..n-1 in order, keeping up to SEND_WINDOW of them posted at once while
    the next is encoded. `encode(k)` returns an awaitable of chunk k, written into staging
    slot k % slots; a slot is reused only once the send that read it completed. Returns
    when chunk 0 was posted (None without chunks)."""
    inflight: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
    first_posted = None
    try:
        pending = encode(0) if n else None
        for k in range(n):
            enc = await pending
            while inflight and (len(inflight) >= SEND_WINDOW or inflight[0][0] <= k + 1 - slots):
                await inflight.popleft()[1]
            if k + 1 < n:  # compress the next chunk while this one is on the wire
                pending = encode(k + 1)
            if first_posted is None:
                first_posted = time.perf_counter()
            inflight.append((k, asyncio.ensure_future(_send_chunk(channel, enc, policy, stats))))
        while inflight:
            await inflight.popleft()[1]
        return first_posted
    finally:
        # On failure, let the sends already posted settle before their buffers go away.
        rest = [f for _, f in inflight]
        if rest:
            await asyncio.gather(*rest, return_exceptions=True)


async def _send_chunk(channel: Channel, enc: _Encoded, policy: AdaptivePolicy, stats: TransferStats) -> None:
    # Header and payload are posted together, in order (see Channel).
    # With the next chunk already posted behind this one, the link never waits for the
    # round trip in which this sender learns that the previous chunk arrived.
    posted = time.perf_counter()
    await asyncio.gather(channel.send(enc.header.pack()), channel.send(enc.payload))
    done = time.perf_counter()
    # The link was busy with the chunk ahead of this one until that one completed.
    policy.observe_chunk_send(enc.header.wire_nbytes, done - max(posted, policy.link_free_at))
    policy.link_free_at = done
    stats.wire_bytes += enc.header.wire_nbytes
    stats.chunks_compressed += enc.header.codec == proto.CODEC_UZIP
    stats.decisions.append(enc.decision)
    logger.debug("chunk %d: %s (%s)", enc.header.index, "compressed" if enc.decision.compress else "raw",
                 enc.decision.reason)


# ---- receive ------------------------------------------------------------------------------

def _check_into(into: Mapping[str, torch.Tensor], entries: list[proto.TensorEntry]) -> None:
    for e in entries:
        t = into.get(e.name)
        if t is None:
            raise ProtocolError(f"peer sent tensor {e.name!r}, which the destination does not have")
        if str(t.dtype).removeprefix("torch.") != e.dtype or tuple(t.shape) != e.shape or not t.is_contiguous():
            raise ProtocolError(f"tensor {e.name!r}: peer sent {e.dtype} {e.shape}, destination is "
                                f"{t.dtype} {tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")


async def recv_tensors(channel: Channel, *, config: TransportConfig, executor: Executor,
                       into: Mapping[str, torch.Tensor] | None = None,
                       forward: Sequence[Channel] = (), ipc=None, stream=None,
                       device=None, cuda_route=None, prepost=None,
                       pacer: CodecPacer | None = None,
                       staging_pool: StagingPool | None = None,
                       on_tensor: Callable[[str, torch.Tensor], None] | None = None,
                       ) -> tuple[dict[str, torch.Tensor], TransferStats]:
    """Receives one transfer. Tensors are returned only once every chunk arrived and
    passed its checksum; on any failure nothing is returned (an `into` tensor may then
    hold partial data) and the sender is told why, where the connection still allows.

    `forward` relays the transfer, cut-through: every message is passed on to each of
    these channels as it arrives (compressed chunks as they are, never recompressed),
    so a chain of receivers costs one slow-link transfer plus a chunk per hop. Returns
    once the relayed peers acknowledged too.

    `device`: where new tensors are allocated when `into` is not given (default: CPU).
    `cuda_route` (a ucx_cuda.Route, where this process's UCX carries CUDA memory) accepts
    the sender's CUDA route into CUDA destinations; `ipc` (a cuda_ipc.Importer) its CUDA IPC
    offer. Both order their work after `stream`'s (default: the device's current stream).
    `prepost` (a ucx_cuda.PrePost): the route's receives, posted early for the layout expected.
    `pacer`: this side's codec threads per chunk, kept across the transfers of one endpoint
    (config.codec_threads, where set, wins); `staging_pool` its buffers, the same way.
    `on_tensor(name, tensor)` is called once per tensor as soon as all of its bytes are in
    place and verified, before the rest of the transfer has arrived, from a codec thread
    (several may run at once, for different tensors); tensors of a GPU route are handed over
    when that route completes. The transfer can still fail after a call. An exception it
    raises fails the receive (the sender is told)."""
    relay = _Relay(forward)
    try:
        result = await _recv_tensors(channel, config, executor, into, relay, ipc=ipc, stream=stream, device=device,
                                     cuda_route=cuda_route, prepost=prepost, pacer=pacer or CodecPacer(),
                                     staging_pool=staging_pool or StagingPool(), on_tensor=on_tensor)
    except (ChecksumError, ProtocolError) as e:
        status = proto.ACK_CHECKSUM if isinstance(e, ChecksumError) else proto.ACK_PROTOCOL
        try:
            await channel.send(proto.ACK.pack(status, 0))
        except Exception:  # noqa: BLE001 - best effort; the original error is what matters
            pass
        raise
    finally:
        await relay.drain()
    await channel.send(proto.ACK.pack(proto.ACK_OK, 0))
    await relay.acks(result[0])
    return result


class _Relay:
    """Passes every received message on to downstream channels, in order, without
    holding up the receive: each send is posted at once and awaited only before its
    buffer could be reused."""

    def __init__(self, channels: Sequence[Channel]):
        self.channels = list(channels)
        self.held: list[Channel] = []  # forwarded whole once received, not cut through
        self.inflight: list[asyncio.Future] = []

    def hold(self) -> None:
        """Store and forward instead: the transfer goes on, as one transfer of its own per
        downstream endpoint, once it is received whole (see acks)."""
        self.held, self.channels = self.channels, []

    def pass_on(self, buf) -> list[asyncio.Future]:
        futs = [asyncio.ensure_future(c.send(buf)) for c in self.channels]
        self.inflight.extend(futs)
        return futs

    def pass_header(self, header: proto.TransferHeader) -> None:
        """The transfer header, renumbered with each downstream endpoint's own next transfer
        id: ids on an endpoint must only grow (ucx_cuda.PrePost relies on it)."""
        for c in self.channels:
            next_id = getattr(c, "next_transfer_id", None)
            h = dataclasses.replace(header, transfer_id=next_id()) if next_id else header
            self.inflight.append(asyncio.ensure_future(c.send(h.pack())))

    async def drain(self) -> None:
        if self.inflight:
            await asyncio.gather(*self.inflight)
            self.inflight.clear()

    async def acks(self, tensors) -> None:
        if self.held:  # ucx.Endpoints: the only channels a held (eager CUDA route) transfer has
            await asyncio.gather(*(c.send_tensors(tensors) for c in self.held))
        for c in self.channels:
            ack = bytearray(proto.ACK.size)
            await c.recv(ack)
            status, _ = proto.ACK.unpack(ack)
            if status != proto.ACK_OK:
                raise ChecksumError(f"a relayed peer rejected the transfer (status {status})")


def _hand_over(on_tensor, name: str, t: torch.Tensor) -> None:
    try:
        on_tensor(name, t)
    except Exception as e:  # noqa: BLE001 - the receiver's own refusal: the sender is told
        raise ProtocolError(f"tensor {name!r}: the receiver refused it: {type(e).__name__}: {e}") from e


class _Landed:
    """Counts each tensor's chunks as they are decoded or verified, and hands a tensor to
    `on_tensor` when its last one is in (chunks finish on several codec threads, in any order)."""

    def __init__(self, entries, chunks, outputs, on_tensor):
        self.on_tensor = on_tensor
        if on_tensor is None:
            return
        self.names = [e.name for e in entries]
        self.outputs = outputs
        self.left = [0] * len(entries)
        for chunk in chunks:
            for p in chunk.pieces:
                self.left[p.tensor] += 1
        self.lock = threading.Lock()
        for i, n in enumerate(self.left):
            if n == 0:  # no bytes: complete already
                _hand_over(on_tensor, self.names[i], outputs[self.names[i]])

    def chunk_done(self, chunk: proto.Chunk) -> None:
        if self.on_tensor is None:
            return
        complete = []
        with self.lock:
            for p in chunk.pieces:
                self.left[p.tensor] -= 1
                if self.left[p.tensor] == 0:
                    complete.append(self.names[p.tensor])
        for name in complete:
            _hand_over(self.on_tensor, name, self.outputs[name])


async def _recv_tensors(channel, config, executor, into, relay: _Relay, ipc=None, stream=None, device=None,
                        cuda_route=None, prepost=None, *, pacer: CodecPacer, staging_pool: StagingPool,
                        on_tensor=None):
    loop = asyncio.get_running_loop()
    if config.compression != "off" and uses_cuda(into, device):  # compressed chunks get decoded on the GPU
        await _load_gpu_codec(_gpu_codec(), torch.cuda.current_device(), executor)
    t_start = time.perf_counter()
    head = bytearray(proto.TRANSFER_HEADER.size)
    await channel.recv(head)
    header = proto.TransferHeader.unpack(head, max_manifest_bytes=config.max_manifest_bytes)
    gpu_flags = proto.FLAG_CUDA_IPC | proto.FLAG_CUDA_UCX | proto.FLAG_CUDA_UCX_EAGER
    eager = bool(header.flags & proto.FLAG_CUDA_UCX_EAGER)
    if eager and relay.channels:
        # An eager CUDA route payload is on its way: nothing downstream can be cut through.
        # The whole transfer is taken first, then sent on (_Relay.hold).
        relay.hold()
    else:
        # Downstream peers get the chunk stream this receiver asks for, never an offer.
        relay.pass_header(dataclasses.replace(header, flags=header.flags & ~gpu_flags))
    manifest = bytearray(header.manifest_nbytes)
    if manifest:
        await channel.recv(manifest)
        relay.pass_on(manifest)
    entries = proto.decode_manifest(manifest, max_tensors=config.max_tensors) if manifest else []
    num_chunks = proto.count_chunks(entries, header.chunk_bytes)
    if num_chunks != header.num_chunks:
        raise ProtocolError(f"peer announced {header.num_chunks} chunks, its manifest makes {num_chunks}")
    if into is not None:
        _check_into(into, entries)
    got = None
    with _gpu_spin(channel, bool(header.flags & (proto.FLAG_CUDA_UCX | proto.FLAG_CUDA_IPC))):
        if header.flags & proto.FLAG_CUDA_UCX:
            from uzip_serve.p2p import ucx_cuda

            got = await ucx_cuda.recv(channel, entries, config=config, route=cuda_route,
                                      relaying=bool(relay.channels), into=into, stream=stream, device=device,
                                      eager=eager, prepost=prepost,
                                      tag=proto.payload_tag(header.transfer_id, manifest))
            # None: refused; the sender goes on with the IPC offer or the chunk stream
        if cuda_route is not None:  # what the next transfer's PrePost expects
            cuda_route.note_header(header.transfer_id, bytes(manifest) if got is not None else None)
        if got is None and header.flags & proto.FLAG_CUDA_IPC:
            from uzip_serve.p2p import ipc_send

            got = await ipc_send.recv(channel, entries, header, config=config,
                                      importer=None if relay.channels else ipc, into=into, stream=stream,
                                      device=device, executor=executor)
            # None: refused; the sender goes on with the ordinary chunk stream
    if got is not None:
        if on_tensor is not None:
            for name, t in got[0].items():
                _hand_over(on_tensor, name, t)
        got[1].seconds = time.perf_counter() - t_start
        return got
    chunks = proto.plan_chunks(entries, header.chunk_bytes)
    if into is not None:
        outputs = {e.name: into[e.name] for e in entries}
    else:
        outputs = {e.name: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=device) for e in entries}
    flats = [_flat_bytes(outputs[e.name]) for e in entries]
    landed = _Landed(entries, chunks, outputs, on_tensor)
    stats = TransferStats(raw_bytes=sum(e.nbytes for e in entries), chunks=len(chunks))
    crc32c = get_backend("cpu").crc32c
    cap = fmt.max_compressed_size(header.chunk_bytes, "uint8")
    # A staging buffer per posted receive, plus the one being decoded.
    staging = staging_pool.take(RECV_WINDOW + 1, cap)
    pending: list[asyncio.Future | None] = [None] * len(staging)
    relayed: list[list[asyncio.Future]] = [[] for _ in staging]  # sends still reading each staging buffer

    def finish(k: int, ch: proto.ChunkHeader, payload) -> None:
        """Decodes or verifies chunk k and scatters it into the destination tensors."""
        chunk = chunks[k]
        if ch.codec == proto.CODEC_UZIP:
            p0 = chunk.pieces[0]
            dst = flats[p0.tensor][p0.start:p0.start + p0.nbytes]
            # One slice of one tensor: decode straight into it, no staging copy (a CUDA
            # destination is decoded on its GPU when the GPU codec exists).
            direct = len(chunk.pieces) == 1
            try:
                if direct:
                    typed = _typed(dst, chunk.dtype)
                    if uz.read_header(payload).shape != tuple(typed.shape):
                        raise ProtocolError(f"chunk {k}: frame shape differs from the plan")
                    _run_codec(lambda threads: uz.decompress(payload, out=typed, threads=threads), chunk.nbytes,
                               pacer, config, stats)
                    landed.chunk_done(chunk)
                    return
                data, _ = _run_codec(lambda threads: uz.decompress(payload, threads=threads), chunk.nbytes,
                                     pacer, config, stats)
            except uz.FrameError as e:
                raise ChecksumError(f"chunk {k}: {e}") from None
            except ValueError as e:  # a valid frame of another dtype or shape than planned
                raise ProtocolError(f"chunk {k}: {e}") from None
            data = data.reshape(-1).view(torch.uint8)
            if data.numel() != chunk.nbytes:
                raise ProtocolError(f"chunk {k}: frame holds {data.numel()} bytes, plan says {chunk.nbytes}")
        else:
            data = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
            if crc32c(payload) != ch.crc32c:
                raise ChecksumError(f"chunk {k}: checksum mismatch")
        at = 0
        for p in chunk.pieces:
            dst = flats[p.tensor][p.start:p.start + p.nbytes]
            if dst.data_ptr() != data[at:at + p.nbytes].data_ptr():  # a raw chunk received in place needs no copy
                dst.copy_(data[at:at + p.nbytes])
            at += p.nbytes
        landed.chunk_done(chunk)

    # Up to RECV_WINDOW payload receives are posted at once: chunk k+1's header arrives
    # while chunk k's data is still flowing (the sender posts it early), so its receive is
    # posted before chunk k completes and the link never idles for a rendezvous round trip.
    inflight: collections.deque = collections.deque()  # (k, header bytes, header, payload, receive)
    first_arrival = None  # (when chunk 0's payload was in, wire bytes then): the link's pace from there on

    try:
        for k, chunk in enumerate(chunks):
            hb = bytearray(proto.CHUNK_HEADER.size)
            await channel.recv(hb)
            ch = proto.ChunkHeader.unpack_expected(hb, k, chunk.nbytes, cap)
            slot = k % len(staging)
            if pending[slot] is not None:  # this staging buffer is still being decoded
                await pending[slot]
                pending[slot] = None
            if relayed[slot]:  # ...or still being relayed
                await asyncio.gather(*relayed[slot])
                relayed[slot] = []
            single = len(chunk.pieces) == 1 and flats[chunk.pieces[0].tensor].device.type == "cpu"
            if ch.codec == proto.CODEC_RAW and single:
                p = chunk.pieces[0]
                payload = _host_view(flats[p.tensor][p.start:p.start + p.nbytes])  # straight into the destination
            else:
                payload = memoryview(staging[slot])[: ch.wire_nbytes]
            inflight.append((k, hb, ch, payload, asyncio.ensure_future(channel.recv(payload))))
            while len(inflight) >= RECV_WINDOW or (inflight and k + 1 == len(chunks)):
                j, hb_j, ch_j, payload_j, receive = inflight.popleft()
                await receive
                # Relayed in order: header, then payload, chunk after chunk.
                relay.pass_on(hb_j)
                relayed[j % len(staging)] = relay.pass_on(payload_j)
                stats.wire_bytes += ch_j.wire_nbytes
                if first_arrival is None:
                    first_arrival = (time.perf_counter(), stats.wire_bytes)
                stats.chunks_compressed += ch_j.codec == proto.CODEC_UZIP
                pending[j % len(staging)] = loop.run_in_executor(executor, finish, j, ch_j, payload_j)
    finally:
        for *_, receive in inflight:  # only after a failure: the endpoint is aborted, stop waiting
            receive.cancel()
    arrived = time.perf_counter()
    for fut in pending:
        if fut is not None:
            await fut
    if first_arrival is not None:
        # After the last decode, so every chunk of this transfer was paced the same way.
        pacer.observe_wire(stats.wire_bytes - first_arrival[1], arrived - first_arrival[0])
    await relay.drain()  # relayed sends may still read the staging buffers
    staging_pool.give(staging)
    stats.seconds = time.perf_counter() - t_start
    return outputs, stats
