"""The communicator contract shared by every collectives backend.

Modelled on vLLM's device communicators: one object per process group, built once by
every rank in the group, exposing the collective verbs. Every verb is a collective:
each rank of the group must call the same verb, in the same order, with tensors of the
same dtype and element count, or the ranks hang or raise `CollectiveError`.

Backends (registered by name in uzip_serve/collectives/__init__.py, imported lazily):

  gloo   CPU tensors on a gloo group; the ring's hops over TCP sockets of its own (default),
         UCX, or torch.distributed point-to-point on the group (RingConfig.transport)
  cuda   CUDA tensors, the GPU codec plus NCCL send/recv (untested on multi-GPU)
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


class CollectiveError(ValueError):
    """A collective was called with arguments it cannot run: an unsupported dtype, a
    wrong device, or tensors whose sizes differ between ranks. The message names the
    verb, the rank and the offending value."""


class CollectivePeerError(CollectiveError):
    """A hop of the ring could not complete: the peer is gone, sent a message larger than
    the posted buffer (ranks disagree on the input), or made no progress within the
    transport's deadline (`RingConfig.deadline_s`). Raised by the ucx and tcp transports."""


# Dtypes the ring can sum. Elementwise `torch.add` on these is exact IEEE/integer
# arithmetic, so the same operands in the same order give the same bits anywhere.
SUM_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "uint8", "int8", "int16", "int32", "int64")


@dataclasses.dataclass
class CollectiveStats:
    """Counters of one communicator (or, summed, of the process; see `counters()`).

    `compressed` counts all-reduces that took the compressed ring; `ring` those that
    took the uncompressed ring; `native` those handed to the group's own all-reduce.
    Byte counts are this rank's: `raw_bytes` what it would have sent uncompressed on
    the compressed path, `wire_bytes` what it actually sent there.
    """

    calls: int = 0
    compressed: int = 0
    ring: int = 0
    native: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0
    seconds_compressed: float = 0.0
    seconds_native: float = 0.0

    def add(self, other: "CollectiveStats") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def ratio(self) -> float:
        """Wire bytes over raw bytes on the compressed path (1.0 before any)."""
        return self.wire_bytes / self.raw_bytes if self.raw_bytes else 1.0


_GLOBAL = CollectiveStats()
_GLOBAL_LOCK = threading.Lock()


def _count_globally(delta: CollectiveStats) -> None:
    with _GLOBAL_LOCK:
        _GLOBAL.add(delta)


def counters() -> dict:
    """Process-wide counters over every communicator (a snapshot, as a dict)."""
    with _GLOBAL_LOCK:
        return dataclasses.asdict(_GLOBAL)


class Communicator(abc.ABC):
    """One process group's collectives. Not thread-safe: one thread calls the verbs,
    in the same order on every rank (the order vLLM's model forward gives them).

    All verbs are out-of-place: they return a new tensor and leave the input alone.
    """

    #: device type of the tensors this backend takes ("cpu" or "cuda")
    device_type: str = "cpu"

    def __init__(self, group: "dist.ProcessGroup | None" = None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise CollectiveError("torch.distributed is not initialized: call init_process_group first")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.stats = CollectiveStats()

    # ---- the verbs ----

    @abc.abstractmethod
    def all_reduce(self, tensor: "torch.Tensor") -> "torch.Tensor":
        """The elementwise sum over all ranks, same shape and dtype as `tensor`.
        Blocks until this rank has the whole result."""

    @abc.abstractmethod
    def reduce_scatter(self, tensor: "torch.Tensor") -> "torch.Tensor":
        """Sums over ranks and returns this rank's slice: `tensor` is split into
        `world_size` equal parts along dim 0 and rank r gets the sum of part r."""

    @abc.abstractmethod
    def all_gather(self, tensor: "torch.Tensor") -> "torch.Tensor":
        """Concatenates every rank's `tensor` along dim 0, in rank order."""

    # ---- shared argument checks (one place, one message style) ----

    def _check(self, verb: str, tensor, *, sum_: bool) -> "torch.Tensor":
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise CollectiveError(f"{verb}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != self.device_type:
            raise CollectiveError(f"{verb}: rank {self.rank} got a tensor on {tensor.device}; "
                                  f"{type(self).__name__} takes {self.device_type} tensors")
        if tensor.layout != torch.strided:
            raise CollectiveError(f"{verb}: only dense tensors are supported, got layout {tensor.layout}")
        name = str(tensor.dtype).removeprefix("torch.")
        if sum_ and name not in SUM_DTYPE_NAMES:
            raise CollectiveError(f"{verb}: dtype {tensor.dtype} cannot be summed by the ring; "
                                  f"supported: {', '.join(SUM_DTYPE_NAMES)}")
        return tensor if tensor.is_contiguous() else tensor.contiguous()

    def _check_splittable(self, verb: str, tensor: "torch.Tensor") -> None:
        if tensor.dim() == 0 or tensor.shape[0] % self.world_size:
            raise CollectiveError(f"{verb}: dim 0 of shape {tuple(tensor.shape)} must be a multiple of the "
                                  f"world size {self.world_size}")

    def _record(self, delta: CollectiveStats) -> None:
        self.stats.add(delta)
        _count_globally(delta)

    def close(self) -> None:
        """Releases threads and buffers; the communicator cannot be used afterwards."""
