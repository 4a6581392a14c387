"""The compressed ring all-reduce: a reduce-scatter then an all-gather, every hop's
payload a uzip frame, pipelined over sub-chunks.

Summation order (fixed; see docs/collectives.md)
------------------------------------------------
The flat tensor of `numel` elements is cut into `world` chunks, chunk c covering
elements [c * numel // world, (c + 1) * numel // world). Chunk c is summed around the
ring starting at rank c+1 and ending at rank c:

    s = x[c+1]; s = s + x[c+2]; ...; s = s + x[c]        (rank indices mod world)

each `+` one elementwise `torch.add(received, local)` in the tensor's own dtype (bf16
partial sums are rounded to bf16 after every hop, as NCCL's ring does). Rank c then
owns the final chunk c and the all-gather copies it, bit for bit, to every other
rank: the result is identical on all ranks. The codec is lossless, so the compressed
ring returns exactly what `reference_ring_all_reduce` (the same ring, uncompressed,
one hop after another) and `ring_sum_reference` (the same sums, in one process) do.

Hops, for rank r at step s (0-based):

    reduce-scatter  send chunk (r - s - 1) % world   receive chunk (r - s - 2) % world
    all-gather      send chunk (r - s)     % world   receive chunk (r - s - 1) % world

The chunk a rank sends at step s+1 is the one it received and reduced at step s, so
each chunk is cut into sub-chunks (same cut on every rank) and sub-chunk j of step s+1
can leave as soon as sub-chunk j of step s is reduced. In the all-gather a rank
forwards the frames it received without recompressing them: only the owner of a chunk
compresses its final values, once.

Every hop message is a 32-byte header (the frame size, the collective's size and
dtype, for a clear error when ranks disagree) then the frame, both uint8/int64
tensors: nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from uzip_serve.collectives.base import CollectiveError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# ---- the schedule: pure functions shared by every implementation ----------------------


def chunk_bounds(numel: int, world: int) -> list[int]:
    """Element offsets of the `world` chunks: chunk c is [b[c], b[c+1])."""
    return [c * numel // world for c in range(world + 1)]


def sub_bounds(lo: int, hi: int, sub_elems: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into sub-chunks of `sub_elems` (the last may be shorter); one empty
    sub-chunk for an empty chunk, so every hop still exchanges one message."""
    if hi <= lo:
        return [(lo, lo)]
    return [(a, min(a + sub_elems, hi)) for a in range(lo, hi, sub_elems)]


def rs_send_chunk(rank: int, step: int, world: int) -> int:
    return (rank - step - 1) % world


def rs_recv_chunk(rank: int, step: int, world: int) -> int:
    return (rank - step - 2) % world


def ag_send_chunk(rank: int, step: int, world: int) -> int:
    return (rank - step) % world


def ag_recv_chunk(rank: int, step: int, world: int) -> int:
    return (rank - step - 1) % world


def reduce_into(out: "torch.Tensor", received: "torch.Tensor", local: "torch.Tensor") -> None:
    """The one reduction every path uses: out = received + local, in their dtype."""
    import torch

    torch.add(received, local, out=out)


def ring_sum_reference(inputs: Sequence["torch.Tensor"]) -> "torch.Tensor":
    """What the ring computes, in one process: `inputs[r]` is rank r's tensor. Tests
    compare the distributed result against this bit for bit."""
    import torch

    world = len(inputs)
    if world == 0:
        raise ValueError("ring_sum_reference needs at least one input")
    flat = [x.contiguous().reshape(-1) for x in inputs]
    out = torch.empty_like(flat[0])
    b = chunk_bounds(flat[0].numel(), world)
    for c in range(world):
        lo, hi = b[c], b[c + 1]
        acc = flat[(c + 1) % world][lo:hi].clone()
        for k in range(2, world + 1):
            reduce_into(acc, acc, flat[(c + k) % world][lo:hi])
        out[lo:hi] = acc
    return out.view(inputs[0].shape)


def reference_ring_all_reduce(tensor: "torch.Tensor", group=None) -> "torch.Tensor":
    """The same ring, uncompressed and unpipelined: every hop sends raw chunks with
    torch.distributed point-to-point on `group`, one step after another. Same result
    bits as the compressed ring; meant for tests and as a readable specification."""
    import torch
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x = tensor.contiguous().reshape(-1)
    out = x.clone()
    if world == 1:
        return out.view(tensor.shape)
    b = chunk_bounds(x.numel(), world)
    right, left = (rank + 1) % world, (rank - 1) % world

    def hop(send_c: int, recv_c: int, tag: int) -> torch.Tensor:
        buf = torch.empty(b[recv_c + 1] - b[recv_c], dtype=x.dtype)
        works = [dist.isend(out[b[send_c]:b[send_c + 1]].clone(), group=group, group_dst=right, tag=tag),
                 dist.irecv(buf, group=group, group_src=left, tag=tag)]
        for w in works:
            w.wait()
        return buf

    for s in range(world - 1):  # reduce-scatter
        c = rs_recv_chunk(rank, s, world)
        recv = hop(rs_send_chunk(rank, s, world), c, s)
        reduce_into(out[b[c]:b[c + 1]], recv, x[b[c]:b[c + 1]])
    for s in range(world - 1):  # all-gather
        c = ag_recv_chunk(rank, s, world)
        out[b[c]:b[c + 1]] = hop(ag_send_chunk(rank, s, world), c, world + s)
    return out.view(tensor.shape)


# ---- what the engine needs from a device and a wire --------------------------------------


class Work(Protocol):
    def wait(self) -> Any: ...


class Transport(Protocol):
    """Point-to-point messages between ranks of one group, matched by (peer, tag).

    `exact_sizes`: True if a receive buffer must have the size of the message sent
    (NCCL); then every hop sends a header message before its payload. False if a
    larger buffer may receive a shorter message (gloo); then the header leads the same
    message and every receive is posted before the data leaves, which halves the
    messages and takes the size round trip off the critical path.
    """

    exact_sizes: bool

    def isend(self, buf: "torch.Tensor", peer: int, tag: int) -> Work: ...

    def irecv(self, buf: "torch.Tensor", peer: int, tag: int) -> Work: ...


class HopCodec(Protocol):
    """Writes a 1-D tensor into a uint8 buffer losslessly, and reads it back."""

    def max_nbytes(self, numel: int, dtype) -> int:
        """The most bytes `encode_into` can write for `numel` elements of `dtype`."""
        ...

    def encode_into(self, src: "torch.Tensor", out: "torch.Tensor") -> int:
        """Encodes `src` into the uint8 tensor `out`; returns the bytes written."""
        ...

    def decode(self, payload: "torch.Tensor", out: "torch.Tensor") -> None:
        """Decodes exactly `payload` into `out` (contiguous, the encoded shape)."""
        ...

    def empty_bytes(self, nbytes: int) -> "torch.Tensor": ...


# Every hop message carries this header, int64[HEADER_WORDS] (32 bytes), little-endian:
#   [0] HEADER_MAGIC: "UZAR" << 16 | protocol version (bumped on any layout change)
#   [1] numel of the collective's whole input on the sender (elements)
#   [2] dtype code of docs/format.md
#   [3] payload size in bytes (the uzip frame, or the raw bytes on the uncompressed ring)
# On exact-size transports it is its own message, before the payload; otherwise the
# payload follows it in the same message.
HEADER_WORDS = 4
HEADER_NBYTES = HEADER_WORDS * 8
HEADER_VERSION = 1
HEADER_MAGIC = (0x55_5A_41_52 << 16) | HEADER_VERSION


@dataclasses.dataclass
class RunStats:
    raw_bytes: int = 0
    wire_bytes: int = 0
    compress_s: float = 0.0
    decompress_s: float = 0.0


class RingEngine:
    """Runs ring collectives on one group, in the calling thread.

    One thread is enough: sends and receives are asynchronous (the transport's own
    threads move the bytes), so while sub-chunk t is on the wire this thread compresses
    t+1, and while t+1 is on the wire it decompresses and reduces t. Handing work between
    Python threads cost milliseconds per hop on a loaded 2-core machine (measured), more
    than it saved.
    """

    def __init__(self, transport: Transport, rank: int, world: int, *, dtype_code_of, sub_chunk_bytes: int,
                 min_sub_chunk_bytes: int):
        self.transport = transport
        self.rank = rank
        self.world = world
        self._dtype_code_of = dtype_code_of
        self.sub_chunk_bytes = sub_chunk_bytes
        self.min_sub_chunk_bytes = min_sub_chunk_bytes

    def close(self) -> None:
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    def sub_bytes(self, chunk_nbytes: int) -> int:
        """Sub-chunk size for a chunk: about a quarter of it (so the pipeline has
        depth), no smaller than min_sub_chunk_bytes, no larger than sub_chunk_bytes."""
        return min(max(chunk_nbytes // 4, self.min_sub_chunk_bytes), self.sub_chunk_bytes)

    def run(self, x: "torch.Tensor", out: "torch.Tensor", phases: str, codec: HopCodec,
            chunk_elems: int | None = None) -> RunStats:
        """One collective. `x`, `out`: flat, contiguous, same device and dtype.

        phases "rs+ag" (all-reduce), "rs" (reduce-scatter: rank r's chunk of `out`
        holds the sum) or "ag" (all-gather: `x` is this rank's chunk, `out` the
        concatenation). `chunk_elems` fixes equal chunks (rs, ag); otherwise chunks
        follow chunk_bounds(x.numel(), world).
        """
        import torch

        rank, world = self.rank, self.world
        if phases == "ag":
            b = [c * x.numel() for c in range(world + 1)]
            out[b[rank]:b[rank + 1]].copy_(x)
        else:
            b = chunk_bounds(x.numel(), world) if chunk_elems is None else [c * chunk_elems for c in range(world + 1)]
        itemsize = x.element_size()
        chunk_max = max(b[c + 1] - b[c] for c in range(world))
        sub = max(1, self.sub_bytes(chunk_max * itemsize) // itemsize)
        subs = [sub_bounds(b[c], b[c + 1], sub) for c in range(world)]
        steps = []  # (phase, send chunk, recv chunk)
        if "rs" in phases:
            steps += [("rs", rs_send_chunk(rank, s, world), rs_recv_chunk(rank, s, world)) for s in range(world - 1)]
        if "ag" in phases:
            steps += [("ag", ag_send_chunk(rank, s, world), ag_recv_chunk(rank, s, world)) for s in range(world - 1)]
        # Sends and receives, each in the one order every rank uses. The chunk sent at step
        # i is the one received at step i-1, cut the same way, so sending (i, j) needs
        # (i-1, j) received (and, in the reduce-scatter, reduced).
        send_items = [(i, j) for i, (_, c, _) in enumerate(steps) for j in range(len(subs[c]))]
        items = [(i, j) for i, (_, _, c) in enumerate(steps) for j in range(len(subs[c]))]
        max_subs = max(len(s) for s in subs)
        right, left = (rank + 1) % world, (rank - 1) % world
        total_numel = x.numel() if phases != "ag" else out.numel()
        dcode = self._dtype_code_of(x.dtype)
        exact = self.transport.exact_sizes
        dev = x.device
        stats = RunStats()

        def tag(i: int, j: int, kind: int) -> int:
            return ((i * max_subs + j) << 1) | kind

        def capacity(t: int) -> int:
            i, j = items[t]
            lo, hi = subs[steps[i][2]][j]
            return HEADER_NBYTES + codec.max_nbytes(hi - lo, x.dtype)

        # Receives: exact-size transports post the headers now and each payload once its
        # header is in; the others post every whole message now.
        recv_bufs, recv_works = [], []
        for t, (i, j) in enumerate(items):
            buf = codec.empty_bytes(HEADER_NBYTES if exact else capacity(t))
            recv_bufs.append(buf)
            recv_works.append(self.transport.irecv(buf, left, tag(i, j, 0)))
        payload_works = {}
        send_works, keep = [], []
        frames = {}  # (i, j) -> received message to forward at step i+1 (all-gather)
        header_of = torch.empty(HEADER_WORDS, dtype=torch.int64)

        def send(t: int) -> None:
            i, j = send_items[t]
            phase, c, _ = steps[i]
            lo, hi = subs[c][j]
            msg = frames.pop((i, j), None)  # the all-gather forwards what it received
            if msg is None:
                src = x if (i == 0 and phase == "rs") else out
                msg = codec.empty_bytes(HEADER_NBYTES + codec.max_nbytes(hi - lo, x.dtype))
                t0 = time.perf_counter()
                n = codec.encode_into(src[lo:hi], msg[HEADER_NBYTES:])
                stats.compress_s += time.perf_counter() - t0
                header_of.copy_(torch.tensor([HEADER_MAGIC, total_numel, dcode, n], dtype=torch.int64))
                msg[:HEADER_NBYTES].copy_(header_of.view(torch.uint8).to(dev))
                msg = msg[:HEADER_NBYTES + n]
            keep.append(msg)
            if exact:
                send_works.append(self.transport.isend(msg[:HEADER_NBYTES], right, tag(i, j, 0)))
                send_works.append(self.transport.isend(msg[HEADER_NBYTES:], right, tag(i, j, 1)))
            else:
                send_works.append(self.transport.isend(msg, right, tag(i, j, 0)))
            stats.wire_bytes += msg.numel()
            stats.raw_bytes += (hi - lo) * itemsize

        def head(t: int) -> int:
            """Waits for item t's header; on exact-size transports posts its payload."""
            try:
                recv_works[t].wait()
            except RuntimeError as e:
                raise CollectiveError(
                    f"rank {rank}: receiving hop {items[t]} from rank {left} failed ({e}); the usual cause is "
                    "ranks passing different sizes or dtypes (RingConfig(validate=True) checks before sending)"
                ) from e
            h = recv_bufs[t][:HEADER_NBYTES].cpu().view(torch.int64).tolist()
            self._check_header(h, total_numel, dcode)
            if exact:
                i, j = items[t]
                payload = codec.empty_bytes(h[3])
                payload_works[t] = (payload, self.transport.irecv(payload, left, tag(i, j, 1)))
            return h[3]

        sizes = {}

        def process(t: int) -> None:
            i, j = items[t]
            phase, _, c = steps[i]
            lo, hi = subs[c][j]
            n = sizes.pop(t)
            if exact:
                payload, work = payload_works.pop(t)
                work.wait()
                msg = torch.cat([recv_bufs[t], payload]) if phase == "ag" and i + 1 < len(steps) else None
            else:
                msg = recv_bufs[t][:HEADER_NBYTES + n]
                payload = msg[HEADER_NBYTES:]
            if phase == "ag" and i + 1 < len(steps):
                frames[i + 1, j] = msg
            t0 = time.perf_counter()
            if phase == "rs":
                tmp = torch.empty(hi - lo, dtype=x.dtype, device=dev)
                codec.decode(payload, tmp)
                reduce_into(out[lo:hi], tmp, x[lo:hi])
            else:
                codec.decode(payload, out[lo:hi])
            stats.decompress_s += time.perf_counter() - t0
            recv_bufs[t] = None

        # Sends go out as soon as their input is ready, in order; only receives block. The
        # transport moves bytes in the background, so compressing item t+1 overlaps item t
        # on the wire, and decoding a received item overlaps the next one arriving. No
        # cycle of waits can form: what a rank waits for depends only on earlier steps.
        processed = set()
        next_send = 0

        def pump() -> None:
            nonlocal next_send
            while next_send < len(send_items):
                i, j = send_items[next_send]
                if i > 0 and (i - 1, j) not in processed:
                    return
                send(next_send)
                next_send += 1

        pump()
        for t in range(len(items)):
            sizes[t] = head(t)
            process(t)
            processed.add(items[t])
            pump()
        if next_send != len(send_items):  # pragma: no cover - the schedule guarantees it
            raise RuntimeError(f"ring schedule stalled at send {next_send} of {len(send_items)}")
        for w in send_works:
            w.wait()
        del keep
        return stats

    def _check_header(self, h: list[int], numel: int, dcode: int) -> None:
        left = (self.rank - 1) % self.world
        if h[0] != HEADER_MAGIC:
            raise CollectiveError(f"rank {self.rank}: hop header from rank {left} has magic {h[0]:#x}, "
                                  f"expected {HEADER_MAGIC:#x} (another protocol version or a stray message)")
        if h[1] != numel or h[2] != dcode:
            raise CollectiveError(f"rank {self.rank}: rank {left} runs this collective on {h[1]} elements of "
                                  f"dtype code {h[2]}, this rank on {numel} elements of dtype code {dcode}: "
                                  "every rank must pass the same size and dtype")
