"""CPU backend: the C codec, compressed bytes between ring neighbours over TCP sockets of
the ring's own (default), UCX, or torch.distributed point-to-point on the gloo group
(`RingConfig.transport`; transports.py). Messages are uint8 tensors (a size header, then
the frame); nothing is pickled."""

from __future__ import annotations

from typing import TYPE_CHECKING

from uzip_serve.collectives.base import CollectiveError
from uzip_serve.collectives.communicator import RingCommunicator

if TYPE_CHECKING:
    import torch


class TorchP2P:
    """Transport over torch.distributed isend/irecv on one group (group-local ranks).

    gloo matches messages by (peer, tag) and receives a message into a buffer larger
    than it, so hops go as one message each, header first (`exact_sizes = False`).
    """

    exact_sizes = False

    def __init__(self, group):
        self.group = group

    def isend(self, buf, peer: int, tag: int):
        import torch.distributed as dist

        return dist.isend(buf, group=self.group, group_dst=peer, tag=tag)

    def irecv(self, buf, peer: int, tag: int):
        import torch.distributed as dist

        return dist.irecv(buf, group=self.group, group_src=peer, tag=tag)


class CpuHopCodec:
    """uzip frames made by the C codec; `threads` per call (the GIL is released)."""

    def __init__(self, threads: int):
        self.threads = threads

    def max_nbytes(self, numel: int, dtype) -> int:
        from uzip_serve import codec

        return codec.max_compressed_size(numel * _itemsize(dtype), dtype)

    def encode_into(self, src: "torch.Tensor", out: "torch.Tensor") -> int:
        from uzip_serve import codec

        return codec.compress_into(src, out.numpy(), threads=self.threads)

    def decode(self, payload: "torch.Tensor", out: "torch.Tensor") -> None:
        from uzip_serve import codec

        codec.decompress(payload.numpy(), out=out, threads=self.threads)

    def empty_bytes(self, nbytes: int) -> "torch.Tensor":
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)


class RawHopCodec:
    """No compression: the sub-chunk's own bytes (the uncompressed ring)."""

    def __init__(self, device: str = "cpu"):
        self.device = device

    def max_nbytes(self, numel: int, dtype) -> int:
        return numel * _itemsize(dtype)

    def encode_into(self, src: "torch.Tensor", out: "torch.Tensor") -> int:
        import torch

        n = src.numel() * src.element_size()
        out[:n].copy_(src.reshape(-1).view(torch.uint8))
        return n

    def decode(self, payload: "torch.Tensor", out: "torch.Tensor") -> None:
        import torch

        if payload.numel() != out.numel() * out.element_size():
            raise CollectiveError(f"raw hop payload of {payload.numel()} bytes for {out.numel()} x {out.dtype}")
        out.reshape(-1).view(torch.uint8).copy_(payload)

    def empty_bytes(self, nbytes: int) -> "torch.Tensor":
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


def _itemsize(dtype) -> int:
    import torch

    return torch.empty(0, dtype=dtype).element_size()


class GlooRingCommunicator(RingCommunicator):
    """CPU tensors on a gloo group (vLLM: the tp group's `cpu_group`)."""

    device_type = "cpu"

    def __init__(self, group=None, **kw):
        import torch.distributed as dist

        backend = dist.get_backend(group if group is not None else dist.group.WORLD)
        if "gloo" not in str(backend):
            raise CollectiveError(f"GlooRingCommunicator needs a gloo group, got backend {backend!r}")
        super().__init__(group, **kw)

    def _make_transport(self):
        # Collective: ucx and tcp exchange addresses on the group and connect neighbours.
        kind = self.config.transport
        if kind == "ucx":
            from uzip_serve.collectives.transports import UcxP2P

            return UcxP2P(self.group, deadline_s=self.config.deadline_s)
        if kind == "tcp":
            from uzip_serve.collectives.transports import SocketP2P

            return SocketP2P(self.group, deadline_s=self.config.deadline_s)
        return TorchP2P(self.group)

    def _make_codec(self):
        return CpuHopCodec(self.config.codec_threads)

    def _make_raw_codec(self):
        return RawHopCodec("cpu")
