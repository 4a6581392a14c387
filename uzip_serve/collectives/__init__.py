"""Lossless compressed collectives (docs/collectives.md).

    from uzip_serve import collectives
    comm = collectives.build_communicator(group)      # gloo group -> CPU, nccl group -> CUDA
    out = comm.all_reduce(tensor)                     # same bits on every rank
    collectives.counters()["compressed"]              # all-reduces that took the compressed ring

Importing this package imports neither torch nor a backend: backends are registered
by import path and loaded on first use.
"""

from __future__ import annotations

import importlib

from uzip_serve.collectives.base import CollectiveError, CollectivePeerError, CollectiveStats, Communicator, counters

__all__ = [
    "CollectiveError",
    "CollectivePeerError",
    "CollectiveStats",
    "Communicator",
    "RingConfig",
    "build_communicator",
    "counters",
    "reference_ring_all_reduce",
    "register_backend",
    "ring_sum_reference",
]

# name -> "module:Class"; the class takes (group, *, config=None, native_all_reduce=None).
_BACKENDS: dict[str, str] = {
    "gloo": "uzip_serve.collectives.gloo:GlooRingCommunicator",
    # Untested on multi-GPU (no GPUs in CI): see uzip_serve/collectives/cuda.py.
    "cuda": "uzip_serve.collectives.cuda:CudaRingCommunicator",
}


def register_backend(name: str, target: str) -> None:
    """Registers a communicator class by import path ("package.module:Class")."""
    if name in _BACKENDS:
        raise ValueError(f"collectives backend {name!r} is already registered")
    _BACKENDS[name] = target


def build_communicator(group=None, backend: str | None = None, **kw) -> Communicator:
    """The communicator for `group` (default: the world group). Collective: call it on
    every rank of the group. `backend` defaults from the group's own backend (gloo ->
    "gloo", nccl -> "cuda"); `kw` go to the class (config=RingConfig(...),
    native_all_reduce=callable)."""
    if backend is None:
        import torch.distributed as dist

        kind = str(dist.get_backend(group if group is not None else dist.group.WORLD))
        backend = "cuda" if "nccl" in kind else "gloo"
    try:
        target = _BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown collectives backend {backend!r}; available: {', '.join(sorted(_BACKENDS))}") \
            from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(group, **kw)


def __getattr__(name):
    if name in ("reference_ring_all_reduce", "ring_sum_reference"):
        from uzip_serve.collectives import ring

        return getattr(ring, name)
    if name == "RingConfig":
        from uzip_serve.collectives.adaptive import RingConfig

        return RingConfig
    raise AttributeError(f"module 'uzip_serve.collectives' has no attribute {name!r}")
