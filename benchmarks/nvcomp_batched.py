"""nvCOMP's low-level batched ANS API (libnvcomp, through ctypes), for the GPU codec benchmark.

nvCOMP's Python `Codec` allocates every output and header per call, which is not how a serving
system would call it, and measured 0.33-0.41 / 0.49-0.63 TB/s here at 1 GiB. The issue's bars
came from the batched C API with buffers allocated once (0.69 / 1.58 TB/s,
`../shared/notes/codec.md`). This is that call: the tensor is cut into 256 KiB chunks, every
device buffer (chunk pointers and sizes, compressed chunks, temp, statuses) is allocated here
once, and compress / decompress each make one nvCOMP call on torch's current stream.

The ratio counts the compressed chunks only. The batched API leaves framing to the caller: a
real frame would also carry the 8-byte size of each chunk (0.003% at 256 KiB) and whatever
header names the tensor; uzip's frames include all of theirs. Signatures and structs follow
nvCOMP 6.0's include/nvcomp/ans.h (the header ships in the nvidia-libnvcomp-cu13 wheel).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import torch

NVCOMP_TYPE_CHAR, NVCOMP_TYPE_FLOAT16, NVCOMP_TYPE_FLOAT32 = 0, 10, 11
_ALIGN = 256  # above every alignment nvCOMP asks for (16 for ANS)


class _CompressOpts(ctypes.Structure):  # nvcompBatchedANSCompressOpts_t
    _fields_ = [("type", ctypes.c_int), ("data_type", ctypes.c_int), ("max_sub_chunk_count", ctypes.c_uint8),
                ("states_per_lane", ctypes.c_uint8), ("histogram_reduction_log2", ctypes.c_uint8),
                ("reserved", ctypes.c_char * 53)]


class _DecompressOpts(ctypes.Structure):  # nvcompBatchedANSDecompressOpts_t
    _fields_ = [("backend", ctypes.c_int), ("data_type", ctypes.c_int), ("max_sub_chunk_count", ctypes.c_uint8),
                ("states_per_lane", ctypes.c_uint8), ("skip_validate", ctypes.c_uint8),
                ("reserved", ctypes.c_char * 53)]


assert ctypes.sizeof(_CompressOpts) == 64 and ctypes.sizeof(_DecompressOpts) == 64


def _library() -> ctypes.CDLL:
    for base in sys.path:
        for path in sorted(glob.glob(os.path.join(base, "nvidia", "libnvcomp", "lib64", "libnvcomp.so*"))):
            return ctypes.CDLL(path)
    return ctypes.CDLL("libnvcomp.so.6")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: nvcompStatus_t {status}")


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


class BatchedANS:
    """One tensor size's worth of preallocated buffers for nvCOMP batched ANS."""

    def __init__(self, nbytes: int, data_type: int, chunk_bytes: int = 1 << 18, device: str = "cuda"):
        lib = self._lib = _library()
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.nvcompBatchedANSCompressGetTempSize.argtypes = [sz, sz, _CompressOpts, ctypes.POINTER(sz), sz, vp]
        lib.nvcompBatchedANSCompressGetMaxOutputChunkSize.argtypes = [sz, _CompressOpts, ctypes.POINTER(sz)]
        lib.nvcompBatchedANSCompressAsync.argtypes = [vp, vp, sz, sz, vp, sz, vp, vp, _CompressOpts, vp, vp]
        lib.nvcompBatchedANSDecompressGetTempSize.argtypes = [sz, sz, _DecompressOpts, ctypes.POINTER(sz), sz, vp]
        lib.nvcompBatchedANSDecompressAsync.argtypes = [vp, vp, vp, vp, sz, vp, sz, vp, _DecompressOpts, vp, vp]
        self.nbytes, self.chunk = nbytes, chunk_bytes
        self.n = n = max(1, -(-nbytes // chunk_bytes))
        self.copts = _CompressOpts(type=0, data_type=data_type)
        self.dopts = _DecompressOpts(backend=0, data_type=data_type)
        stream = vp(torch.cuda.current_stream().cuda_stream)
        out_max, ctemp, dtemp = sz(), sz(), sz()
        _check(lib.nvcompBatchedANSCompressGetMaxOutputChunkSize(chunk_bytes, self.copts, ctypes.byref(out_max)),
               "GetMaxOutputChunkSize")
        _check(lib.nvcompBatchedANSCompressGetTempSize(n, chunk_bytes, self.copts, ctypes.byref(ctemp), nbytes, stream),
               "CompressGetTempSize")
        _check(lib.nvcompBatchedANSDecompressGetTempSize(n, chunk_bytes, self.dopts, ctypes.byref(dtemp), nbytes,
                                                         stream), "DecompressGetTempSize")
        self.out_stride = _round_up(out_max.value, _ALIGN)
        u8, i64 = torch.uint8, torch.int64
        self.comp = torch.empty(n * self.out_stride, dtype=u8, device=device)
        self.ctemp = torch.empty(max(1, ctemp.value), dtype=u8, device=device)
        self.dtemp = torch.empty(max(1, dtemp.value), dtype=u8, device=device)
        sizes = [min(chunk_bytes, nbytes - i * chunk_bytes) for i in range(n)]
        self.in_bytes = torch.tensor(sizes, dtype=i64, device=device)
        self.comp_bytes = torch.zeros(n, dtype=i64, device=device)
        self.out_bytes = torch.zeros(n, dtype=i64, device=device)
        self.statuses = torch.zeros(n, dtype=torch.int32, device=device)
        self.comp_ptrs = torch.tensor([self.comp.data_ptr() + i * self.out_stride for i in range(n)], dtype=i64,
                                      device=device)
        self._ptrs: dict = {}  # data_ptr -> device array of its chunk pointers

    def _chunk_ptrs(self, t: torch.Tensor) -> torch.Tensor:
        p = t.data_ptr()
        if p not in self._ptrs:
            self._ptrs[p] = torch.tensor([p + i * self.chunk for i in range(self.n)], dtype=torch.int64,
                                         device=t.device)
        return self._ptrs[p]

    def compress(self, x: torch.Tensor) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(self._lib.nvcompBatchedANSCompressAsync(
            self._chunk_ptrs(x).data_ptr(), self.in_bytes.data_ptr(), self.chunk, self.n, self.ctemp.data_ptr(),
            self.ctemp.numel(), self.comp_ptrs.data_ptr(), self.comp_bytes.data_ptr(), self.copts,
            self.statuses.data_ptr(), stream), "CompressAsync")

    def decompress(self, y: torch.Tensor) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(self._lib.nvcompBatchedANSDecompressAsync(
            self.comp_ptrs.data_ptr(), self.comp_bytes.data_ptr(), self.in_bytes.data_ptr(),
            self.out_bytes.data_ptr(), self.n, self.dtemp.data_ptr(), self.dtemp.numel(),
            self._chunk_ptrs(y).data_ptr(), self.dopts, self.statuses.data_ptr(), stream), "DecompressAsync")

    def compressed_bytes(self) -> int:
        return int(self.comp_bytes.sum().item())

    def failed_chunks(self) -> int:
        return int((self.statuses != 0).sum().item())


def hint(dtype: torch.dtype) -> int:
    if dtype in (torch.bfloat16, torch.float16):
        return NVCOMP_TYPE_FLOAT16
    return NVCOMP_TYPE_FLOAT32 if dtype == torch.float32 else NVCOMP_TYPE_CHAR
