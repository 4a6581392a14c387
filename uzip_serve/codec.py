"""Public codec API: compress / decompress torch tensors into uzip frames.

Frames are self-describing (dtype, shape, checksums; see docs/format.md), so a frame
made on one host decodes on any other. Decoding either returns the exact original
bits or raises FrameError; it never returns a wrong tensor.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from uzip_serve import format as fmt
from uzip_serve.format import FrameError, FrameHeader
from uzip_serve.kernels import get_backend

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Buffer = Any  # bytes, bytearray, memoryview, numpy array: anything with the buffer protocol


def default_threads() -> int:
    """Threads the codec uses when the caller does not say: $UZIP_NUM_THREADS, else every
    core this process may run on."""
    env = os.environ.get("UZIP_NUM_THREADS")
    if env:
        return max(1, int(env))
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_host_tensor(tensor) -> "torch.Tensor":
    import numpy as np
    import torch

    if isinstance(tensor, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(tensor))
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or numpy array, got {type(tensor).__name__}")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise TypeError(f"only dense (strided) tensors can be compressed, got layout {tensor.layout}")
    if tensor.device.type != "cpu":
        # No GPU backend yet: stage through host memory so CUDA callers still work.
        logger.debug("compressing a %s tensor on the CPU", tensor.device)
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        # Frames hold elements in row-major order; a strided view is gathered first.
        tensor = tensor.contiguous()
    return tensor


def _bytes_view(tensor: "torch.Tensor"):
    """A writable uint8 numpy view sharing the tensor's memory (no copy)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy()


def max_compressed_size(nbytes: int, dtype) -> int:
    """The largest frame `compress` can produce for `nbytes` bytes of `dtype` (a torch
    dtype or its name). Size `compress_into` buffers with it."""
    return fmt.max_compressed_size(nbytes, _dtype_name(dtype))


def _checked_out(out: Buffer, nbytes: int, dtype: str, ndim: int) -> memoryview:
    """`out` as bytes, refused unless it can hold the largest frame of such a tensor."""
    out_mv = memoryview(out).cast("B")
    need = fmt.max_compressed_size(nbytes, dtype, ndim=ndim)
    if len(out_mv) < need:
        raise ValueError(f"output buffer holds {len(out_mv)} bytes; max_compressed_size needs {need}")
    return out_mv


def compress_into(tensor, out: Buffer, *, threads: int | None = None) -> int:
    """Compresses `tensor` into the writable buffer `out` and returns the frame's size.

    `out` must hold at least max_compressed_size(tensor.nbytes, tensor.dtype) bytes;
    only the first (returned) bytes are the frame. Blocks until done.
    """
    if _is_cuda_tensor(tensor):  # [cuda hook]
        out_mv = _checked_out(out, tensor.numel() * tensor.element_size(), _dtype_name(tensor.dtype), tensor.dim())
        n = _compress_cuda(tensor, out_mv)
        if n is not None:
            return n
    t = _as_host_tensor(tensor)
    if t.dim() > fmt.MAX_NDIM:
        raise ValueError(f"tensors of more than {fmt.MAX_NDIM} dims are not supported (got {t.dim()})")
    out_mv = _checked_out(out, t.numel() * t.element_size(), _dtype_name(t.dtype), t.dim())
    return _encode_host(t, out_mv, threads or default_threads())


def _encode_host(t: "torch.Tensor", out_mv: memoryview, threads: int, *, block_elems: int = fmt.DEFAULT_BLOCK_ELEMS,
                 substream_elems: int = fmt.DEFAULT_SUBSTREAM_ELEMS, backend=None) -> int:
    """The C codec's frame of a contiguous host tensor, written into `out_mv` (which the caller
    sized); returns its size. Other block and sub-stream sizes, which the format allows, and
    another build of the codec (`backend`) are for tests and benchmarks."""
    dt = fmt.dtype_by_name(_dtype_name(t.dtype))
    numel, ndim = t.numel(), t.dim()
    backend = backend or get_backend("cpu")
    head = fmt.pack_header(dt, tuple(t.shape), numel, 0, block_elems, substream_elems)
    out_mv[: len(head)] = head
    payload_offset = fmt.payload_offset(ndim, fmt.num_blocks(numel, block_elems))
    end, flags = backend.compress_blocks(_bytes_view(t), numel, dt.layout, dt.itemsize, block_elems,
                                         substream_elems, out_mv, len(head), payload_offset, threads)
    fmt.finish_header(out_mv, end, ndim, fmt.num_blocks(numel, block_elems), flags, backend.uzh64)
    return end


def compress(tensor, *, threads: int | None = None) -> memoryview:
    """Compresses a tensor (any dtype, any shape, CPU or CUDA) into a uzip frame.

    Returns a memoryview over exactly the frame (`bytes(frame)` copies it out).
    Lossless: decompress() gives back the same bits, NaN payloads and signed zeros
    included.
    """
    if _is_cuda_tensor(tensor):  # [cuda hook] CUDA tensors are coded on their GPU
        if tensor.dim() > fmt.MAX_NDIM:
            raise ValueError(f"tensors of more than {fmt.MAX_NDIM} dims are not supported (got {tensor.dim()})")
        frame = _compress_cuda(tensor)
        if frame is not None:
            return frame
    import numpy as np

    t = _as_host_tensor(tensor)
    # np.empty, not bytearray: a bytearray is zero-filled first, a serial pass over the
    # worst-case size that cost more than the compression's second thread gained.
    out = np.empty(max_compressed_size(t.numel() * t.element_size(), t.dtype), dtype=np.uint8)
    n = compress_into(t, out, threads=threads)
    return memoryview(out)[:n]


def read_header(buf: Buffer) -> FrameHeader:
    """Parses and validates a frame's header (dtype, shape, sizes) without decoding."""
    return fmt.parse_header(buf, get_backend("cpu").uzh64)


def decompress(buf: Buffer, *, out: "torch.Tensor | None" = None, device=None,
               threads: int | None = None) -> "torch.Tensor":
    """Decodes a uzip frame into a tensor with the original dtype, shape and bits.

    `out`, if given, must be a contiguous tensor of the frame's dtype and shape; it is
    filled in place and returned. `device` moves the result (e.g. "cuda"). Raises
    FrameError if the frame is truncated, extended, corrupted or of an unknown version;
    then `out` may hold partial data but nothing is returned.
    """
    import torch

    # [cuda hook] device frames, and device="cuda" / CUDA `out`, decode on the GPU
    if _is_cuda_tensor(buf):
        return decompress_device(buf, out=out)
    want_cuda = (device is not None and torch.device(device).type == "cuda") or (
        out is not None and out.device.type == "cuda")
    if want_cuda and _cuda_backend() is not None:
        header = read_header(buf)
        dev = out.device if out is not None else torch.device(device)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        host = torch.frombuffer(memoryview(buf).cast("B"), dtype=torch.uint8) if header.frame_nbytes else \
            torch.empty(0, dtype=torch.uint8)
        frame = host.to(dev)
        if out is not None:
            torch_dtype = getattr(torch, header.dtype.name)
            if out.dtype != torch_dtype or tuple(out.shape) != header.shape or not out.is_contiguous():
                raise ValueError(f"out is {out.dtype} {tuple(out.shape)}, the frame holds "
                                 f"{torch_dtype} {header.shape}")
        return decompress_device(frame, header=header, out=out)

    header = read_header(buf)
    torch_dtype = getattr(torch, header.dtype.name, None)
    if torch_dtype is None:
        raise FrameError(f"frame holds {header.dtype.name}, which this torch build ({torch.__version__}) lacks")
    target = out
    if out is not None:
        if out.dtype != torch_dtype or tuple(out.shape) != header.shape:
            raise ValueError(f"out is {out.dtype} {tuple(out.shape)}, the frame holds "
                             f"{torch_dtype} {header.shape}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        if out.device.type != "cpu":
            target = None  # decode on the host, then copy into the device tensor
    if target is None:
        target = torch.empty(header.shape, dtype=torch_dtype)
    if header.numel:
        get_backend("cpu").decompress_blocks(buf, header, _bytes_view(target), threads or default_threads())
    if out is not None and target is not out:
        out.copy_(target)
        target = out
    if device is not None:
        target = target.to(device)
    return target


# ---- [cuda hook] dispatch to the GPU backend (uzip_serve/kernels/cuda.py, docs/gpu.md) ----

def _cuda_backend():
    """The CUDA backend, or None when CuPy (or a GPU) is missing."""
    try:
        return get_backend("cuda")
    except ImportError:
        logger.debug("CuPy not importable: CUDA tensors are coded on the CPU")
        return None


def _is_cuda_tensor(x) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, torch.Tensor) and x.device.type == "cuda"


def _compress_cuda(tensor, out=None):
    """GPU compress into a host buffer: syncs once for the size, once for the copy."""
    import torch

    be = _cuda_backend()
    if be is None:
        return None
    t = tensor.contiguous()
    cap = fmt.max_compressed_size(t.numel() * t.element_size(), _dtype_name(t.dtype), ndim=t.dim())
    dev_out = torch.empty(cap, dtype=torch.uint8, device=t.device)
    n = be.compress_device(t, dev_out)
    host = dev_out[:n].cpu().numpy()
    if out is None:
        return memoryview(host)
    memoryview(out).cast("B")[:n] = host.data
    return n


def compress_device(tensor, out: "torch.Tensor", *, stream=None) -> int:
    """Compresses a CUDA tensor into the CUDA uint8 tensor `out` (sized with
    max_compressed_size) on the GPU; returns the frame size (one host sync)."""
    return get_backend("cuda").compress_device(tensor, out, stream=stream)


def compress_device_async(tensor, out: "torch.Tensor", size_out: "torch.Tensor", *, stream=None) -> None:
    """Capture-safe GPU compress: the frame size goes to the 1-element CUDA int64 tensor
    `size_out`; no host synchronization, fixed-size buffers."""
    get_backend("cuda").compress_device_async(tensor, out, size_out, stream=stream)


def decompress_device(frame: "torch.Tensor", *, header: FrameHeader | None = None, out=None, stream=None,
                      check: bool = True):
    """Decodes a frame held in a CUDA uint8 tensor into a CUDA tensor on the GPU."""
    return get_backend("cuda").decompress_device(frame, header, out=out, stream=stream, check=check)
