"""CUDA backend: the GPU codec plus NCCL send/recv.

UNTESTED ON MULTI-GPU. Written against the GPU codec's API (uzip_serve.codec
compress_device / decompress_device) and torch.distributed's NCCL point-to-point; CI
has no GPU and skips it. Before relying on it, run tests/test_allreduce.py's cases
with an nccl group on two GPUs (the lead batches device runs).

Differences from the gloo engine, because NCCL is not gloo:
  - NCCL matches point-to-point messages by issue order, not tags, and needs exact
    sizes, so every hop is a header message (int64[4], on the device) then the frame.
  - Two ranks that send to each other must issue the pair together
    (batch_isend_irecv), or each rank's send waits for the other's receive on the
    same NCCL stream. So hops run in lock step: for each step and sub-chunk, exchange
    headers, then frames, then decode and reduce. Overlap comes from the GPU running
    the codec while NCCL moves the previous batch; there is no separate pipeline.
  - Not CUDA-graph safe: compress_device syncs the host once per sub-chunk to read the
    frame size (compress_device_async is the capture-safe variant; see docs/gpu.md).
The summation order, hop layout and header are ring.py's, so the result bits equal
the CPU reference ring's (torch.add of two bf16/fp32 values rounds the same on GPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from uzip_serve.collectives.base import CollectiveError
from uzip_serve.collectives.communicator import RingCommunicator
from uzip_serve.collectives.ring import (HEADER_MAGIC, HEADER_WORDS, RingEngine, RunStats, ag_recv_chunk,
                                         ag_send_chunk, chunk_bounds, reduce_into, rs_recv_chunk, rs_send_chunk,
                                         sub_bounds)

if TYPE_CHECKING:
    import torch


class CudaHopCodec:
    """uzip frames made and read on the GPU (the caller's current stream)."""

    def max_nbytes(self, numel: int, dtype) -> int:
        import torch

        from uzip_serve import codec

        return codec.max_compressed_size(numel * torch.empty(0, dtype=dtype).element_size(), dtype)

    def encode_into(self, src: "torch.Tensor", out: "torch.Tensor") -> int:
        from uzip_serve import codec

        return codec.compress_device(src, out)  # one host sync: the frame size

    def decode(self, payload: "torch.Tensor", out: "torch.Tensor") -> None:
        from uzip_serve import codec

        codec.decompress_device(payload, out=out)

    def empty_bytes(self, nbytes: int) -> "torch.Tensor":
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


class CudaRawCodec(CudaHopCodec):
    def max_nbytes(self, numel: int, dtype) -> int:
        import torch

        return numel * torch.empty(0, dtype=dtype).element_size()

    def encode_into(self, src, out) -> int:
        import torch

        n = src.numel() * src.element_size()
        out[:n].copy_(src.reshape(-1).view(torch.uint8))
        return n

    def decode(self, payload, out) -> None:
        import torch

        out.reshape(-1).view(torch.uint8).copy_(payload)


class NcclP2P:
    exact_sizes = True

    def __init__(self, group):
        self.group = group

    def exchange(self, sends: list, recvs: list, right: int, left: int) -> None:
        """Sends `sends` to `right` and receives `recvs` from `left` as one NCCL group."""
        import torch.distributed as dist

        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=right) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=left) for t in recvs]
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()


class LockstepRingEngine(RingEngine):
    """ring.py's schedule, one (step, sub-chunk) at a time in lock step (see above)."""

    def run(self, x, out, phases, codec, chunk_elems=None) -> RunStats:
        import torch

        rank, world = self.rank, self.world
        if phases == "ag":
            b = [c * x.numel() for c in range(world + 1)]
            out[b[rank]:b[rank + 1]].copy_(x)
        else:
            b = chunk_bounds(x.numel(), world) if chunk_elems is None else [c * chunk_elems for c in range(world + 1)]
        itemsize = x.element_size()
        sub = max(1, self.sub_bytes(max(b[c + 1] - b[c] for c in range(world)) * itemsize) // itemsize)
        subs = [sub_bounds(b[c], b[c + 1], sub) for c in range(world)]
        steps = []
        if "rs" in phases:
            steps += [("rs", rs_send_chunk(rank, s, world), rs_recv_chunk(rank, s, world)) for s in range(world - 1)]
        if "ag" in phases:
            steps += [("ag", ag_send_chunk(rank, s, world), ag_recv_chunk(rank, s, world)) for s in range(world - 1)]
        right, left = (rank + 1) % world, (rank - 1) % world
        total = x.numel() if phases != "ag" else out.numel()
        dcode = self._dtype_code_of(x.dtype)
        stats = RunStats()
        forward = {}
        for i, (phase, sc, rc) in enumerate(steps):
            for j in range(max(len(subs[sc]), len(subs[rc]))):
                sends, frame = [], None
                if j < len(subs[sc]):
                    lo, hi = subs[sc][j]
                    frame = forward.pop(j, None)
                    if frame is None:
                        src = x if (i == 0 and phase == "rs") else out
                        buf = codec.empty_bytes(codec.max_nbytes(hi - lo, x.dtype))
                        frame = buf[:codec.encode_into(src[lo:hi], buf)]
                    head = torch.tensor([HEADER_MAGIC, total, dcode, frame.numel()], dtype=torch.int64,
                                        device=x.device)
                    sends = [head]
                    stats.raw_bytes += (hi - lo) * itemsize
                    stats.wire_bytes += frame.numel() + HEADER_WORDS * 8
                rhead = [torch.empty(HEADER_WORDS, dtype=torch.int64, device=x.device)] if j < len(subs[rc]) else []
                self.transport.exchange(sends, rhead, right, left)
                payload = None
                if rhead:
                    h = rhead[0].cpu().tolist()
                    self._check_header(h, total, dcode)
                    payload = codec.empty_bytes(h[3])
                self.transport.exchange([frame] if sends else [], [payload] if rhead else [], right, left)
                if rhead:
                    lo, hi = subs[rc][j]
                    if phase == "rs":
                        tmp = torch.empty(hi - lo, dtype=x.dtype, device=x.device)
                        codec.decode(payload, tmp)
                        reduce_into(out[lo:hi], tmp, x[lo:hi])
                    else:
                        codec.decode(payload, out[lo:hi])
                        if i + 1 < len(steps):
                            forward[j] = payload
        return stats


class CudaRingCommunicator(RingCommunicator):
    """CUDA tensors on an NCCL group (vLLM: the tp group's `device_group`). UNTESTED on
    multi-GPU; see the module docstring."""

    device_type = "cuda"

    def __init__(self, group=None, **kw):
        import torch
        import torch.distributed as dist

        if not torch.cuda.is_available():
            raise CollectiveError("CudaRingCommunicator needs a CUDA device")
        backend = str(dist.get_backend(group if group is not None else dist.group.WORLD))
        if "nccl" not in backend:
            raise CollectiveError(f"CudaRingCommunicator needs an nccl group, got backend {backend!r}")
        super().__init__(group, **kw)
        from uzip_serve import format as fmt

        self._engine = LockstepRingEngine(self._engine.transport, self.rank, self.world_size,
                                          dtype_code_of=lambda d: fmt.dtype_by_name(str(d)[6:]).code,
                                          sub_chunk_bytes=self.config.sub_chunk_bytes,
                                          min_sub_chunk_bytes=self.config.min_sub_chunk_bytes)

    def _make_transport(self):
        return NcclP2P(self.group)

    def _make_codec(self):
        return CudaHopCodec()

    def _make_raw_codec(self):
        return CudaRawCodec()

    def _small_device(self):
        return "cuda"
