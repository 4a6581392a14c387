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

Threads per call (all persistent, owned by the communicator):
  caller   posts the receives, waits for each payload, hands it to the worker
  sender   compresses sub-chunks (the C codec releases the GIL) and posts the sends
  worker   decompresses and reduces received sub-chunks, in arrival order
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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
    Sizes are exact: a receive buffer has the size of the message sent."""

    def isend(self, buf: "torch.Tensor", peer: int, tag: int) -> Work: ...

    def irecv(self, buf: "torch.Tensor", peer: int, tag: int) -> Work: ...


class HopCodec(Protocol):
    """Turns a 1-D tensor into a uint8 payload tensor and back, losslessly."""

    def compress(self, src: "torch.Tensor") -> "torch.Tensor": ...

    def decompress(self, payload: "torch.Tensor", out: "torch.Tensor") -> None: ...

    def empty_bytes(self, nbytes: int) -> "torch.Tensor": ...


# One header per hop message: int64[HEADER_WORDS], sent before the payload.
#   [0] HEADER_MAGIC: "UZAR" and the protocol version (bumped on any layout change)
#   [1] numel of the whole collective's input on the sender (elements)
#   [2] dtype code of docs/format.md
#   [3] payload size in bytes (the compressed frame)
HEADER_WORDS = 4
HEADER_VERSION = 1
HEADER_MAGIC = (0x55_5A_41_52 << 16) | HEADER_VERSION


@dataclasses.dataclass
class RunStats:
    raw_bytes: int = 0
    wire_bytes: int = 0
    compress_s: float = 0.0
    decompress_s: float = 0.0


class _Slot:
    """A value one thread hands to another, or the error that prevents it."""

    __slots__ = ("event", "value")

    def __init__(self):
        self.event = threading.Event()
        self.value = None

    def put(self, value) -> None:
        self.value = value
        self.event.set()


class _Aborted(Exception):
    pass


class RingEngine:
    """Runs compressed ring collectives on one group. Owns two worker threads."""

    def __init__(self, transport: Transport, rank: int, world: int, *, dtype_code_of, sub_chunk_bytes: int,
                 min_sub_chunk_bytes: int):
        self.transport = transport
        self.rank = rank
        self.world = world
        self._dtype_code_of = dtype_code_of
        self.sub_chunk_bytes = sub_chunk_bytes
        self.min_sub_chunk_bytes = min_sub_chunk_bytes
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="uzip-ring-send")
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="uzip-ring-work")

    def close(self) -> None:
        self._sender.shutdown(wait=True)
        self._worker.shutdown(wait=True)

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
        chunk_max = max(b[c + 1] - b[c] for c in range(world))
        sub = max(1, self.sub_bytes(chunk_max * x.element_size()) // x.element_size())
        subs = [sub_bounds(b[c], b[c + 1], sub) for c in range(world)]
        steps = []  # (phase, send chunk, recv chunk)
        if "rs" in phases:
            steps += [("rs", rs_send_chunk(rank, s, world), rs_recv_chunk(rank, s, world)) for s in range(world - 1)]
        if "ag" in phases:
            steps += [("ag", ag_send_chunk(rank, s, world), ag_recv_chunk(rank, s, world)) for s in range(world - 1)]
        max_subs = max(len(s) for s in subs)
        right, left = (rank + 1) % world, (rank - 1) % world
        total_numel = x.numel() if phases != "ag" else out.numel()
        dcode = self._dtype_code_of(x.dtype)

        def tag(i: int, j: int, kind: int) -> int:
            return ((i * max_subs + j) << 1) | kind

        # ready[i][j]: what step i sends as sub-chunk j: ("src", tensor view) to compress,
        # or ("frame", payload) to forward as is.
        ready = [[_Slot() for _ in subs[c]] for (_, c, _) in steps]
        error: list[BaseException] = []
        stats = RunStats()
        stat_lock = threading.Lock()
        itemsize = x.element_size()

        def fail(e: BaseException) -> None:
            if not error:
                error.append(e)
            for row in ready:
                for slot in row:
                    slot.event.set()

        def wait(slot: _Slot):
            slot.event.wait()
            if error:
                raise _Aborted()
            return slot.value

        # Step 0 sends local data; every later step waits for the previous one's result.
        src0 = x if steps[0][0] == "rs" else out
        for j, (lo, hi) in enumerate(subs[steps[0][1]]):
            ready[0][j].put(("src", src0[lo:hi]))

        def send_all() -> list:
            works, keep = [], []
            try:
                for i, (phase, c, _) in enumerate(steps):
                    for j in range(len(subs[c])):
                        kind, val = wait(ready[i][j])
                        if kind == "src":
                            t0 = time.perf_counter()
                            payload = codec.compress(val)
                            with stat_lock:
                                stats.compress_s += time.perf_counter() - t0
                        else:
                            payload = val
                        head = torch.tensor([HEADER_MAGIC, total_numel, dcode, payload.numel()], dtype=torch.int64)
                        head = self._to_device(head, x)
                        keep += [head, payload]
                        works.append(self.transport.isend(head, right, tag(i, j, 0)))
                        works.append(self.transport.isend(payload, right, tag(i, j, 1)))
                        with stat_lock:
                            stats.wire_bytes += payload.numel() + HEADER_WORDS * 8
                            lo, hi = subs[c][j]
                            stats.raw_bytes += (hi - lo) * itemsize
                for w in works:
                    w.wait()
                return keep
            except _Aborted:
                return keep
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                fail(e)
                raise

        def process(i: int, j: int, payload: "torch.Tensor") -> None:
            try:
                phase, _, c = steps[i]
                lo, hi = subs[c][j]
                t0 = time.perf_counter()
                if phase == "rs":
                    tmp = torch.empty(hi - lo, dtype=x.dtype, device=x.device)
                    codec.decompress(payload, tmp)
                    reduce_into(out[lo:hi], tmp, x[lo:hi])
                else:
                    codec.decompress(payload, out[lo:hi])
                with stat_lock:
                    stats.decompress_s += time.perf_counter() - t0
                # The chunk received at step i is sent at step i+1 (same sub-chunks).
                if i + 1 < len(steps) and phase == "rs":
                    ready[i + 1][j].put(("src", out[lo:hi]))
            except BaseException as e:  # noqa: BLE001
                fail(e)
                raise

        sender: Future = self._sender.submit(send_all)
        processing: list[Future] = []
        try:
            heads, head_works = {}, {}
            for i, (_, _, c) in enumerate(steps):  # every header receive up front: they are tiny
                for j in range(len(subs[c])):
                    heads[i, j] = self._to_device(torch.empty(HEADER_WORDS, dtype=torch.int64), x)
                    head_works[i, j] = self.transport.irecv(heads[i, j], left, tag(i, j, 0))

            def post(i: int, j: int):
                head_works[i, j].wait()
                h = heads[i, j].cpu().tolist()
                self._check_header(h, total_numel, dcode)
                payload = codec.empty_bytes(h[3])
                return (i, j, payload, self.transport.irecv(payload, left, tag(i, j, 1)))

            for i, (_, _, c) in enumerate(steps):
                # Within a step, the next payload's receive is posted before waiting for the
                # current one. Never across steps: the next step's header depends on the peer
                # having received what this one is waiting for.
                pending = None
                for j in range(len(subs[c])):
                    nxt = post(i, j)
                    if pending is not None:
                        self._finish_recv(pending, steps, ready, processing, process)
                    pending = nxt
                    if error:
                        break
                if error:
                    break
                self._finish_recv(pending, steps, ready, processing, process)
            for f in processing:
                f.result()
            sender.result()
        except BaseException as e:
            fail(e)
            raise
        finally:
            if error:
                for f in processing:
                    f.exception()
                sender.exception()
        if error:
            raise error[0]
        return stats

    def _finish_recv(self, pending, steps, ready, processing, process) -> None:
        i, j, payload, work = pending
        work.wait()
        phase = steps[i][0]
        if phase == "ag" and i + 1 < len(steps):
            ready[i + 1][j].put(("frame", payload))  # forward the frame untouched
        processing.append(self._worker.submit(process, i, j, payload))

    def _check_header(self, h: list[int], numel: int, dcode: int) -> None:
        left = (self.rank - 1) % self.world
        if h[0] != HEADER_MAGIC:
            raise CollectiveError(f"rank {self.rank}: hop header from rank {left} has magic {h[0]:#x}, "
                                  f"expected {HEADER_MAGIC:#x} (another protocol version or a stray message)")
        if h[1] != numel or h[2] != dcode:
            raise CollectiveError(f"rank {self.rank}: rank {left} runs this collective on {h[1]} elements of "
                                  f"dtype code {h[2]}, this rank on {numel} elements of dtype code {dcode}: "
                                  "every rank must pass the same size and dtype")

    @staticmethod
    def _to_device(t: "torch.Tensor", like: "torch.Tensor") -> "torch.Tensor":
        return t if like.device.type == "cpu" else t.to(like.device)
