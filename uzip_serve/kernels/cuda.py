"""Launcher for the CUDA codec kernels (cuda_codec.cu): argument plumbing only.

The .cu source ships in the package and is compiled once per process and device by NVRTC
through CuPy (cupy.RawModule; CuPy caches the binary on disk), or loaded from a prebuilt
cubin ($UZIP_CUDA_CUBIN). CuPy is imported only here, so `import uzip_serve` stays light.
Kernels run on torch's current CUDA stream unless a stream is passed; every buffer is a torch
tensor, handed to the kernels by pointer. The same launcher drives the CPU emulator of the
tests (tests/simt), which runs these kernels on host memory: it is a `runtime` like CuPy's.

Host synchronization points (docs/gpu.md):
  - loading the kernels on a device (once per process and device);
  - compress_device(): reading back the frame size (compress_device_async: none);
  - decompress_device(): reading the header and block table of a device-resident frame
    (skipped when the caller passes the parsed header), and one read of the lowest error word
    at the end (skipped with check=False, which hands the error words back instead).
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
import warnings
from pathlib import Path

import numpy as np

from uzip_serve import format as fmt
from uzip_serve.format import FrameError, FrameHeader

# Must match cuda_codec.cu.
NT = 512  # threads per CUDA block
NW = NT // 32
WBUF_BYTES = 1424  # an encoder warp's sub-stream buffer (the histogram's counters first)
WIN_BYTES = 2304  # the fast decoder's copy of a payload's first bytes
LUT_BYTES = 2048 * 4 + 2048 * 2  # decode table + single-symbol table
MAX_ENC_SUBSTREAM = 1024
SM_SHARED_BYTES = 228 * 1024  # shared memory per SM on Hopper (H100/H200)
SM_BLOCK_RESERVED = 1024  # the system's share of it per CUDA block
CLEAN = (1 << 63) - 1  # a block's error word when it decoded clean (UZ_CLEAN)

_ERRORS = {
    1: "block checksum mismatch (payload corrupted)",
    2: "decoded block checksum mismatch",
    3: "empty block payload",
    4: "raw block has the wrong size",
    5: "unknown block mode",
    6: "plane header runs past the block",
    7: "unknown plane mode",
    8: "raw plane runs past the block",
    9: "constant plane runs past the block",
    10: "entropy-coded plane with no symbols",
    11: "Huffman table runs past the block",
    12: "Huffman symbol range exceeds a byte",
    13: "Huffman code length over the limit",
    14: "Huffman table padding is not zero",
    15: "Huffman code lengths over-subscribe the code space",
    16: "sub-stream offsets run past the block",
    17: "sub-streams run past the block",
    18: "sub-stream offsets go backwards",
    19: "corrupt Huffman sub-stream",
    20: "block payload size disagrees with its plane headers",
    21: "sparse block header runs past the block",
    22: "sparse block claims more nonzeros than elements",
    23: "sparse mask padding is not zero",
    24: "sparse mask disagrees with the nonzero count",
    25: "payload end is out of order, unaligned or past the frame",
    26: "block needs the general decoder but the header's GENERAL flag is clear",
    27: "plane data runs past the block",
}


def _layout_name(dt: fmt.DType) -> str:
    """Which kernel build serves a dtype: bf16, fp32, or bN (the bytes layout, N-byte items)."""
    if dt.layout == fmt.LAYOUT_BF16:
        return "bf16"
    if dt.layout == fmt.LAYOUT_FP32:
        return "fp32"
    return f"b{dt.itemsize}"


def _nplanes(dt: fmt.DType) -> int:
    return {fmt.LAYOUT_BF16: 2, fmt.LAYOUT_FP32: 4}.get(dt.layout, dt.itemsize)


# The fast decoder serves the layouts whose 16-element merge is a handful of byte permutes;
# wider bytes-layout dtypes (int32/int64/float64/complex, stored RAW by the GPU encoder) take
# the general decoder, which is correct for every block and slower.
FAST_DECODERS = ("bf16", "fp32", "b1", "b2")


def encoder_substream(nbytes: int, block_elems: int) -> int:
    """Symbols per sub-stream in a GPU frame of `nbytes` original bytes in blocks of
    `block_elems` (docs/gpu.md). Each sub-stream costs 2 bytes of offsets and half a byte of
    padding; a decoding thread takes one, so its length is a small frame's decode latency.
    $UZIP_GPU_SUBSTREAM overrides."""
    env = os.environ.get("UZIP_GPU_SUBSTREAM")
    if env:
        s = int(env)
        if s < fmt.MIN_SUBSTREAM_ELEMS or s > MAX_ENC_SUBSTREAM or s & (s - 1):
            raise ValueError(f"UZIP_GPU_SUBSTREAM={s}: a power of two in [64, {MAX_ENC_SUBSTREAM}]")
        return s
    if nbytes >= 8 << 20:
        return 512
    if block_elems <= fmt.SMALL_BLOCK_ELEMS:
        # the smallest blocks (tensors under 2M elements): a frame is one wave of blocks, so
        # one decode chain is the decoder's latency. 64 against 128 (H100, round 13, GPU time
        # in a graph, compress + decompress): 1 MiB bf16 29.2 against 30.5 us, for 1.4% more
        # bytes
        return 64
    if block_elems <= 2 * fmt.SMALL_BLOCK_ELEMS:
        # 8192-element blocks (tensors of 2M to 4M elements). 128 against 256 (H100, round
        # 11, GPU time in a graph, compress + decompress): 4 MiB bf16 44.8 against 49.1-49.8
        # us, for 0.5-0.7% more bytes (and 1 MiB, in 4096-element blocks then, 34.5 against
        # 35.6 us). 64 here (round 13): 37.4 against 38.7 us at 4 MiB for 1.4% more bytes,
        # not taken.
        return 128
    return 256


def encoder_block_elems(numel: int) -> int:
    """Elements per block in a GPU frame: format.small_block_elems, whose frames fit
    max_compressed_size's bound. $UZIP_GPU_BLOCK_ELEMS overrides it for benchmarks; a smaller
    block than the default needs an output buffer sized for it (max_compressed_size(...,
    block_elems=...)), else compress refuses the buffer."""
    env = os.environ.get("UZIP_GPU_BLOCK_ELEMS")
    if env:
        be = int(env)
        if be < fmt.MIN_BLOCK_ELEMS or be > fmt.MAX_BLOCK_ELEMS or be & (be - 1):
            raise ValueError(f"UZIP_GPU_BLOCK_ELEMS={be}: a power of two in "
                             f"[{fmt.MIN_BLOCK_ELEMS}, {fmt.MAX_BLOCK_ELEMS}]")
        return be
    return fmt.small_block_elems(numel)


def fast_decoder_launch(block_elems: int, substream: int, dec_shared: int) -> tuple[int, int, int]:
    """(symbol buffer bytes, dynamic shared memory, bytes for the staged HUFF data) of the fast
    decoder for a frame's block and sub-stream sizes: the HUFF plane's data is staged in shared
    memory up to what still fits with two CUDA blocks per SM (typical exponent planes: 20-25
    KB); larger sections are read from the frame."""
    sym_bytes = -(-block_elems // substream) * (substream + 16)
    base = sym_bytes + LUT_BYTES + WIN_BYTES + dec_shared
    sect = max(0, (SM_SHARED_BYTES // 2 - SM_BLOCK_RESERVED - base) // 16 * 16)
    return sym_bytes, base + sect, sect


class CupyRuntime:
    """Compiles (NVRTC via CuPy) and launches the kernels on CUDA devices."""

    def __init__(self):
        self._modules: dict = {}
        self._funcs: dict = {}
        self._streams: dict = {}

    def loaded(self, device_index: int) -> bool:
        return device_index in self._modules

    def module(self, device_index: int):
        mod = self._modules.get(device_index)
        if mod is None:
            import cupy

            src = Path(__file__).with_name("cuda_codec.cu").read_text()
            cubin = os.environ.get("UZIP_CUDA_CUBIN")  # a prebuilt cubin of this source
            with cupy.cuda.Device(device_index):
                mod = cupy.RawModule(path=cubin) if cubin else cupy.RawModule(code=src, options=("-std=c++17",))
                mod.compile()
            self._modules[device_index] = mod
        return mod

    def _function(self, index: int, name: str, smem: int):
        f = self._funcs.get((index, name))
        if f is None:
            import cupy

            with cupy.cuda.Device(index):
                f = self.module(index).get_function(name)
                # over 48 KB of dynamic shared memory needs the attribute; ask for the most
                f.max_dynamic_shared_size_bytes = 227 * 1024
            self._funcs[(index, name)] = f
        return f

    def stream(self, stream):
        import cupy
        import torch

        if stream is None:
            stream = torch.cuda.current_stream()
        ptr = stream.cuda_stream
        st = self._streams.get(ptr)
        if st is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                st = self._streams[ptr] = cupy.cuda.ExternalStream(ptr)
        return st

    def launch(self, device, name: str, grid: int, block: int, args: tuple, stream, smem: int = 0) -> None:
        import cupy

        index = device.index or 0
        f = self._function(index, name, smem)
        st = self.stream(stream)
        if cupy.cuda.runtime.getDevice() == index:
            f((grid,), (block,), args, stream=st, shared_mem=smem)
        else:
            with cupy.cuda.Device(index):
                f((grid,), (block,), args, stream=st, shared_mem=smem)

    def sm_count(self, device) -> int:
        import torch

        return torch.cuda.get_device_properties(device).multi_processor_count


def _u64(x: int):
    return np.uint64(x)


def _u32(x: int):
    return np.uint32(x)


@functools.lru_cache(maxsize=1024)
def _header_words(dt: fmt.DType, shape, numel, block_elems, substream) -> tuple:
    """The header and dims as 13 u64 kernel arguments, frame_nbytes 0 (filled in on the device)."""
    head = fmt.pack_header(dt, tuple(shape), numel, 0, block_elems, substream)
    head = head + b"\0" * (104 - len(head))
    return tuple(_u64(w) for w in struct.unpack("<13Q", head))


class CudaCodec:
    """The GPU codec: compress / decompress between CUDA tensors and frames in device memory."""

    name = "cuda"

    def __init__(self, runtime=None):
        if runtime is None:
            import cupy  # noqa: F401  (without CuPy, codec.py falls back to the CPU codec)
        self._rt = runtime or CupyRuntime()
        self._sizes: dict = {}  # device index -> (sizeof EncShared, sizeof DecShared)

    def loaded(self, device_index: int) -> bool:
        """Whether the kernels are compiled and loaded on that device (see load)."""
        return device_index in self._sizes

    def load(self, device_index: int) -> None:
        """Compiles (NVRTC; CuPy caches the binary on disk) and loads the kernels on a device.
        The first time on a machine this takes seconds: callers with deadlines (the P2P paths)
        do it before their first deadline-bound step, not inside it. Syncs once."""
        import torch

        if device_index in self._sizes:
            return
        dev = self._device(device_index)
        out = torch.zeros(2, dtype=torch.int32, device=dev)
        self._rt.launch(dev, "uz_layout_sizes", 1, 1, (_u64(out.data_ptr()),), None)
        enc, dec = (int(v) for v in out.cpu())
        self._sizes[device_index] = (enc, dec)

    def _device(self, index):
        import torch

        return torch.device("cuda", index) if index >= 0 else torch.device("cpu")

    def _shared_sizes(self, device) -> tuple[int, int]:
        index = device.index if device.type == "cuda" else -1
        if index is None:
            import torch

            index = torch.cuda.current_device()
        if index not in self._sizes:
            self.load(index)
        return self._sizes[index]

    # ---- compress ----

    def compress_device_async(self, tensor, out, size_out, *, stream=None) -> None:
        """Compresses a contiguous CUDA tensor into the CUDA uint8 tensor `out` (at least
        max_compressed_size bytes, 16-byte aligned) and writes the frame size to the CUDA
        int64/uint64 tensor `size_out` (1 element). One kernel launch (and a memset of its
        scratch); never synchronizes with the host; fixed buffers, so it can be captured in a
        CUDA graph (scratch comes from torch's allocator)."""
        import torch

        if size_out.dtype not in (torch.int64, torch.uint64) or size_out.numel() < 1:
            raise ValueError("size_out must be a 1-element int64 tensor")
        dt = fmt.dtype_by_name(str(tensor.dtype).removeprefix("torch."))
        shape = tuple(tensor.shape)
        if len(shape) > fmt.MAX_NDIM:
            raise ValueError(f"tensors of more than {fmt.MAX_NDIM} dims are not supported (got {len(shape)})")
        numel = tensor.numel()
        be = encoder_block_elems(numel)
        ss = encoder_substream(numel * dt.itemsize, be)
        need = fmt.max_compressed_size(numel * dt.itemsize, dt.name, ndim=len(shape), block_elems=be)
        if out.dtype != torch.uint8 or out.device != tensor.device or out.numel() < need or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous uint8 tensor on {tensor.device} of at least {need} bytes")
        if out.data_ptr() % 16:
            raise ValueError("out must be 16-byte aligned")
        src = tensor.contiguous()
        if src.data_ptr() % 16:
            src = src.clone()
        dev = tensor.device
        enc_shared, _ = self._shared_sizes(dev)
        nblocks = fmt.num_blocks(numel, be)
        table_offset = fmt.HEADER_NBYTES + fmt.DIM.size * len(shape)
        payload_offset = fmt.payload_offset(len(shape), nblocks)
        # [0] ticket, [1] blocks done, [2] the table's share of the header hash, then the
        # look-back status of every block: all zero before the launch
        state = torch.zeros(3 + nblocks, dtype=torch.int64, device=dev)
        smem = be + NW * WBUF_BYTES + enc_shared
        args = (_u64(src.data_ptr()), _u64(numel), _u32(be), _u32(ss), _u64(out.data_ptr()), _u64(table_offset),
                _u64(payload_offset), _u32(nblocks), _u64(state.data_ptr()), _u64(size_out.data_ptr()),
                *_header_words(dt, shape, numel, be, ss))
        self._rt.launch(dev, f"uz_enc_{_layout_name(dt)}", max(nblocks, 1), NT, args, stream, smem)
        if stream is not None:  # scratch freed here must outlive the other stream's work
            for t_ in (src, state):
                t_.record_stream(stream)

    def compress_device(self, tensor, out, *, stream=None) -> int:
        """As compress_device_async, then reads the size back: the one host sync."""
        import torch

        size = torch.empty(1, dtype=torch.int64, device=tensor.device)
        self.compress_device_async(tensor, out, size, stream=stream)
        return int(size.item())

    # ---- decompress ----

    def decompress_device(self, frame, header: FrameHeader | None = None, *, out=None, stream=None,
                          check: bool = True):
        """Decodes a frame held in a CUDA uint8 tensor into a CUDA tensor.

        header: the parsed header (format.parse_header) if the caller has it; else the header
        and block table are copied to the host and validated there (a sync). check=False
        returns (tensor, errors) without synchronizing: errors is a CUDA int64 tensor of one
        word per block, which the kernel writes itself (first_error reads it). One kernel
        launch, nothing filled before it: inside a CUDA graph a fill would be a node of its
        own."""
        import torch

        if header is None:
            header = read_header_device(frame)
        dt = header.dtype
        dev = frame.device
        if out is None:
            out = torch.empty(header.shape, dtype=getattr(torch, dt.name), device=dev)
        err = torch.empty(header.num_blocks, dtype=torch.int64, device=dev)
        if header.numel == 0:
            return out if check else (out, err)
        if frame.data_ptr() % 16:
            frame = frame.clone()
        target = out if out.data_ptr() % 16 == 0 else torch.empty_like(out)
        _, dec_shared = self._shared_sizes(dev)
        name = _layout_name(dt)
        nb, be, ss = header.num_blocks, header.block_elems, header.substream_elems
        payload_len = header.frame_nbytes - header.payload_offset
        args = (_u64(frame.data_ptr()), _u64(header.payload_offset), _u64(payload_len), _u64(header.table_offset),
                _u64(header.numel), _u32(be), _u32(ss), _u32(nb), _u64(target.data_ptr()), _u64(err.data_ptr()))
        scratch = None
        if header.general or name not in FAST_DECODERS:
            grid = min(nb, 2 * self._rt.sm_count(dev))
            stride = (be + 31) // 16 * 16
            scratch = torch.empty(grid * (1 + _nplanes(dt)) * stride, dtype=torch.uint8, device=dev)
            self._rt.launch(dev, f"uz_dec_general_{name}", grid, NT,
                            args + (_u32(header.flags), _u64(scratch.data_ptr()), _u32(stride)), stream,
                            LUT_BYTES + dec_shared)
        else:
            sym_bytes, smem, sect_bytes = fast_decoder_launch(be, ss, dec_shared)
            self._rt.launch(dev, f"uz_dec_{name}", nb, NT, args + (_u32(sym_bytes), _u32(sect_bytes)), stream, smem)
        if target is not out:
            out.copy_(target)
        if stream is not None:
            for t_ in (frame, err) + ((scratch,) if scratch is not None else ()):
                t_.record_stream(stream)
        if not check:
            return out, err
        # the reduction over the error words runs on the decoder's stream, after the kernel
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            raise_on_error(err)
        return out

    def hash_segments(self, data, seg: int, *, stream=None):
        """UZH64 of each `seg`-byte segment of the uint8 tensor `data` (the last may be short),
        one CUDA block each: the checksum on its own, for the tests and the benchmark."""
        import torch

        n = data.numel()
        nseg = max(1, -(-n // seg))
        out = torch.empty(nseg, dtype=torch.int64, device=data.device)
        self._rt.launch(data.device, "uz_hash_segs", nseg, NT,
                        (_u64(data.data_ptr()), _u64(seg), _u64(n), _u64(out.data_ptr())), stream, 8 * NW)
        return out


def error_message(word: int) -> str | None:
    """What an error word says: None when clean, else which block failed and why."""
    if word == CLEAN:
        return None
    block, code = word >> 8, word & 0xFF
    return f"block {block}: {_ERRORS.get(code, f'error {code}')}"


def first_error(errors) -> str | None:
    """The lowest failing block's message from a decoder's per-block error words (a CUDA
    tensor: one reduction and one host sync), or None when every block decoded clean."""
    if errors.numel() == 0:
        return None
    return error_message(int(errors.min().item()))


def raise_on_error(errors) -> None:
    """Raises FrameError if any block of the decode failed (a host sync)."""
    msg = first_error(errors)
    if msg is not None:
        raise FrameError(f"corrupt uzip frame: {msg}")


def read_header_device(frame) -> FrameHeader:
    """Copies the header and block table of a device-resident frame to the host and
    validates them with format.parse_header (two small device-to-host copies: a sync)."""
    from uzip_serve.kernels import get_backend

    n = frame.numel()
    head = frame[: min(n, fmt.HEADER_NBYTES)].cpu().numpy().tobytes()
    if len(head) < fmt.HEADER_NBYTES:
        raise FrameError(f"truncated frame: {n} bytes, the header alone needs {fmt.HEADER_NBYTES}")
    (_, _, _, ndim, _, _, _, _, nblocks, _) = fmt.FRAME_HEADER.unpack_from(head, 0)
    end = min(n, fmt.payload_offset(min(ndim, fmt.MAX_NDIM), nblocks))
    # parse_header compares frame_nbytes with the buffer's length and reads only the header
    # and table: hand it a lazily zeroed host buffer (calloc: untouched pages cost nothing).
    buf = np.zeros(n, dtype=np.uint8)
    buf[:end] = frame[:end].cpu().numpy()
    return fmt.parse_header(buf, get_backend("cpu").uzh64)
