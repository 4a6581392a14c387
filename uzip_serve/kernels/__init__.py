"""Codec backends, registered by name and imported on first use.

A backend encodes and decodes the block payloads of docs/format.md for one kind of
device; the frame header is written and validated by uzip_serve.format. Importing
this package imports no backend, so `import uzip_serve` never pulls in a compiled
extension, CuPy or CUDA.
"""

from __future__ import annotations

import importlib
from typing import Protocol

from uzip_serve.format import FrameHeader


class CodecBackend(Protocol):
    """What uzip_serve.codec needs from a backend."""

    name: str

    def compress_blocks(self, src, numel: int, dtype_layout: int, itemsize: int, block_elems: int,
                        substream_elems: int, out, table_offset: int, payload_offset: int,
                        threads: int) -> int:
        """Writes the block table and payloads into `out`; returns (the frame's end offset,
        the header flags)."""
        ...

    def decompress_blocks(self, frame, header: FrameHeader, out, threads: int) -> None:
        """Decodes every block of `frame` into `out`; raises FrameError on corruption."""
        ...

    def uzh64(self, data) -> int:
        ...


# name -> "module:attribute"; the attribute is a zero-argument factory.
_REGISTRY: dict[str, str] = {
    "cpu": "uzip_serve.kernels.cpu:CpuCodec",
    # [cuda hook] GPU kernels (cuda_codec.cu via CuPy/NVRTC); imported only on first use.
    "cuda": "uzip_serve.kernels.cuda:CudaCodec",
}
_LOADED: dict[str, CodecBackend] = {}


def register_backend(name: str, target: str) -> None:
    """Registers a backend by import path ("package.module:Factory")."""
    if name in _REGISTRY:
        raise ValueError(f"codec backend {name!r} is already registered")
    _REGISTRY[name] = target


def get_backend(name: str) -> CodecBackend:
    """Imports (once) and returns the backend registered under `name`."""
    backend = _LOADED.get(name)
    if backend is not None:
        return backend
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown codec backend {name!r}; available: {', '.join(sorted(_REGISTRY))}") from None
    module_name, _, attr = target.partition(":")
    backend = getattr(importlib.import_module(module_name), attr)()
    _LOADED[name] = backend
    return backend
