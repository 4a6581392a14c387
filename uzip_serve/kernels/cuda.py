"""Launcher for the CUDA codec kernels (cuda_codec.cu): argument plumbing only.

The .cu source ships in the package and is compiled once per process by NVRTC through
CuPy (cupy.RawModule; CuPy caches the binary on disk). CuPy is imported only here, so
`import uzip_serve` stays light. Kernels run on torch's current CUDA stream unless a
stream is passed; every buffer is a torch CUDA tensor, handed to the kernels by pointer.

Host synchronization points (docs/gpu.md):
  - compress_device(): one, reading back the frame size (compress_device_async: none).
  - decompress_device(): reading the header + block table of a device-resident frame
    (skipped when the caller passes the parsed header), and one read of the error word
    at the end (skipped with check=False, which hands the error word back instead).
"""

from __future__ import annotations

import functools
import os
import struct
import warnings
from pathlib import Path

import numpy as np

from uzip_serve import format as fmt
from uzip_serve.format import FrameError, FrameHeader

TPB = 512  # threads per CUDA block (one per codec block); must match cuda_codec.cu
INFO_BYTES = 1024  # must match cuda_codec.cu
ENC_BLOCK_ELEMS = fmt.DEFAULT_BLOCK_ELEMS  # 65536: max_compressed_size's bound holds for GPU frames
ENC_SUBSTREAM = 512  # ENC_S in cuda_codec.cu: 128 sub-streams per block (docs/gpu.md says why)
NSHIFT = 30  # must match cuda_codec.cu
# CRC tables per CUDA block: CRC_SLICE tables of 256 entries x 32 lane copies (cuda_codec.cu)
CRC_SLICE = int(os.environ.get("UZIP_CRC_SLICE", "1"))
STG_BYTES = 32768  # crc_par's row staging (16 warps x 2 KB)
SYM_BYTES = 128 * (512 + 16)  # uz_dec_fast's decoded symbols
# dynamic shared memory per kernel (static shared memory comes on top): CRC tables first
CRC_SMEM = CRC_SLICE * 256 * 32 * 4 + 4096 + STG_BYTES  # tables, the 32 KB-shift table, staging
SMEM_STATS = CRC_SMEM + 128 * 32 * 4  # + per-lane histogram counters (two u16 per word)
SMEM_WRITE = CRC_SMEM  # the per-warp sub-stream buffers share crc_par's staging
SMEM_DEC = CRC_SMEM - STG_BYTES + SYM_BYTES  # the symbol buffer doubles as crc_par's staging
# uz_dec_wide's dynamic shared memory: slicing-by-4 CRC tables (+ the 32 KB-shift table), then
# per group of 128 threads (one codec block) 256 words of descriptor, the LUT and its scratch
WIDE_TAB_WORDS = 4 * 256 * 32 + 1024
WIDE_GROUP_WORDS = 256 + 2048 + (36 + 256 + 4 + 64)
WIDE_MAX_GROUPS = 8  # 1024 threads, ~215 KB: one CUDA block per SM


def wide_smem(groups: int) -> int:
    return 4 * (WIDE_TAB_WORDS + groups * WIDE_GROUP_WORDS)


# Which decoder: "wide" (uz_dec_wide: every thread decodes a sub-stream; the default),
# "wide-pair" (its pair-lookup build at every size) or "fast" (uz_dec_fast, round 3's: one
# CUDA block of 512 threads per codec block, kept one round for side-by-side benchmarks).
# See _decoder_launch for how "wide" picks; docs/gpu.md, round 4.
DECODER = os.environ.get("UZIP_GPU_DECODER", "wide")
NO_ERROR = (1 << 64) - 1

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
    20: "block has trailing bytes",
    21: "sparse block header runs past the block",
    22: "sparse block claims more nonzeros than elements",
    23: "sparse mask padding is not zero",
    24: "sparse mask disagrees with the nonzero count",
    25: "block payloads do not cover the frame exactly",
}


def _kernel_suffix(dt: fmt.DType) -> str:
    if dt.layout == fmt.LAYOUT_BF16:
        return "bf16"
    if dt.layout == fmt.LAYOUT_FP32:
        return "fp32"
    return f"b{dt.itemsize}"


def _entropy_plane(dt: fmt.DType) -> int:
    """Plane the GPU encoder entropy-codes; -1: the dtype is stored as RAW blocks."""
    if dt.layout in (fmt.LAYOUT_BF16, fmt.LAYOUT_FP32):
        return 0
    if dt.name == "float16":
        return 1  # the high byte: sign, exponent, 2 mantissa bits
    return -1


_MODULES: dict = {}  # device index -> the loaded module


def _module(device_index: int):
    mod = _MODULES.get(device_index)
    if mod is None:
        mod = _MODULES[device_index] = _load_module(device_index)
    return mod


def _load_module(device_index: int):
    import cupy

    src = (Path(__file__).with_name("cuda_codec.cu")).read_text()
    opts = ("-std=c++17", f"-DCRC_SLICE={CRC_SLICE}")
    cubin = os.environ.get("UZIP_CUDA_CUBIN")  # a prebuilt cubin of this source (benchmark variants)
    with cupy.cuda.Device(device_index):
        mod = cupy.RawModule(path=cubin) if cubin else cupy.RawModule(code=src, options=opts)
        mod.compile()
        # the CRC shift tables (global memory), once per device; the only sync, at first use
        n = max(NSHIFT * 1024, 32768)  # INIT_TABLE_THREADS
        mod.get_function("uz_init_tables")(((n + 255) // 256,), (256,), ())
        cupy.cuda.runtime.deviceSynchronize()
    return mod


def _stream(stream):
    import cupy
    import torch

    if stream is None:
        stream = torch.cuda.current_stream()
    ptr = stream.cuda_stream
    st = _STREAMS.get(ptr)
    if st is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            st = _STREAMS[ptr] = cupy.cuda.ExternalStream(ptr)
    return st


_STREAMS: dict = {}


def _u64(x: int):
    return np.uint64(x)


def _u32(x: int):
    return np.uint32(x)


_FUNCS: dict = {}


def _function(index: int, name: str, smem: int = 0):
    """The kernel `name` on device `index`, looked up once per process (launch overhead),
    allowed `smem` bytes of dynamic shared memory (dynamic + static over 48 KB needs the attribute)."""
    f = _FUNCS.get((index, name))
    if f is None:
        import cupy

        with cupy.cuda.Device(index):
            f = _module(index).get_function(name)
            if smem:  # over 48 KB with the static shared memory needs the attribute too
                try:
                    f.max_dynamic_shared_size_bytes = smem
                except AttributeError:  # older CuPy: the driver call itself
                    cupy.cuda.driver.funcSetAttribute(f.kernel.ptr, 8, smem)  # MAX_DYNAMIC_SHARED_SIZE_BYTES
        _FUNCS[(index, name)] = f
    return f


def _launch(tensor_device, name, grid, block, args, stream, smem: int = 0, smem_max: int = 0):
    import cupy

    index = tensor_device.index or 0
    f = _FUNCS.get((index, name)) or _function(index, name, smem_max or smem)
    if cupy.cuda.runtime.getDevice() == index:
        f((grid,), (block,), args, stream=stream, shared_mem=smem)
    else:
        with cupy.cuda.Device(index):
            f((grid,), (block,), args, stream=stream, shared_mem=smem)


@functools.lru_cache(maxsize=1024)
def _header_words(dt: fmt.DType, shape, numel, block_elems, substream) -> tuple:
    """The header and dims as 13 u64 kernel arguments, frame_nbytes 0 (patched on the device)."""
    head = fmt.pack_header(dt, tuple(shape), numel, 0, block_elems, substream)
    head = head + b"\0" * (104 - len(head))
    return tuple(_u64(w) for w in struct.unpack("<13Q", head))


class CudaCodec:
    name = "cuda"

    @staticmethod
    def loaded(device_index: int) -> bool:
        """Whether the kernels are compiled and loaded on that device (see load)."""
        return device_index in _MODULES

    @staticmethod
    def load(device_index: int) -> None:
        """Compiles (NVRTC; CuPy caches the binary on disk) and loads the kernels on a device.
        The first time on a machine this takes tens of seconds: callers with deadlines (the P2P
        paths) do it before their first deadline-bound step, not inside it."""
        _module(device_index)

    # ---- compress ----

    def compress_device_async(self, tensor, out, size_out, *, stream=None) -> None:
        """Compresses a contiguous CUDA tensor into the CUDA uint8 tensor `out` (at least
        max_compressed_size bytes) and writes the frame size to the CUDA int64/uint64
        tensor `size_out` (1 element). Never synchronizes with the host; fixed buffers,
        so it can be captured in a CUDA graph (scratch comes from torch's allocator)."""
        import torch

        dt = fmt.dtype_by_name(str(tensor.dtype).removeprefix("torch."))
        shape = tuple(tensor.shape)
        if len(shape) > fmt.MAX_NDIM:
            raise ValueError(f"tensors of more than {fmt.MAX_NDIM} dims are not supported (got {len(shape)})")
        numel = tensor.numel()
        need = fmt.max_compressed_size(numel * dt.itemsize, dt.name, ndim=len(shape))
        if out.dtype != torch.uint8 or not out.is_cuda or out.numel() < need or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous CUDA uint8 tensor of at least {need} bytes")
        if out.data_ptr() % 16:
            raise ValueError("out must be 16-byte aligned")
        src = tensor.contiguous()
        if src.data_ptr() % 16:
            src = src.clone()
        st = _stream(stream)
        dev = tensor.device
        be, ss = ENC_BLOCK_ELEMS, ENC_SUBSTREAM
        nblocks = fmt.num_blocks(numel, be)
        table_offset = fmt.HEADER_NBYTES + fmt.DIM.size * len(shape)
        payload_offset = fmt.payload_offset(len(shape), nblocks)
        sfx = _kernel_suffix(dt)
        total = size_out.view(torch.uint64) if size_out.dtype == torch.int64 else size_out
        if nblocks:
            # one scratch allocation: per-block info records, then the u64 payload offsets
            info = torch.empty(nblocks * (INFO_BYTES + 8), dtype=torch.uint8, device=dev)
            cp = _entropy_plane(dt)
            sp, ip = src.data_ptr(), info.data_ptr()
            op = ip + nblocks * INFO_BYTES
            _launch(dev, f"uz_enc_stats_{sfx}", nblocks, TPB,
                    (_u64(sp), _u64(numel), _u32(ss), np.int32(cp), _u64(ip)), st, SMEM_STATS)
            _launch(dev, "uz_scan", 1, 1024,
                    (_u64(ip), _u32(INFO_BYTES), _u32(nblocks), _u64(op), _u64(total.data_ptr()),
                     _u64(payload_offset), _u64(0), np.int32(0), _u64(0), _u64(0)), st)
            _launch(dev, f"uz_enc_write_{sfx}", nblocks, TPB,
                    (_u64(sp), _u64(numel), _u32(ss), np.int32(cp), _u64(ip), _u64(op), _u64(out.data_ptr()),
                     _u64(payload_offset), _u64(table_offset)), st, SMEM_WRITE)
        else:
            total.fill_(payload_offset)
        hw = _header_words(dt, shape, numel, be, ss)
        _launch(dev, "uz_enc_header", 1, TPB,
                (_u64(out.data_ptr()), _u64(total.data_ptr()), _u32((table_offset + 7) // 8), _u64(payload_offset),
                 *hw), st, CRC_SMEM)
        if nblocks and stream is not None:  # scratch freed here must outlive the other stream's work
            for t_ in (src, info):
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

        header: the parsed header (format.parse_header) if the caller has it; else the
        header and block table are copied to the host and validated there (a sync).
        check=False returns (tensor, error_word) without synchronizing; error_word is a
        CUDA uint64 tensor, ~0 when clean (see error_message)."""
        import torch

        if header is None:
            header = read_header_device(frame)
        dt = header.dtype
        torch_dtype = getattr(torch, dt.name)
        dev = frame.device
        if out is None:
            out = torch.empty(header.shape, dtype=torch_dtype, device=dev)
        if header.numel == 0:
            err = torch.full((1,), -1, dtype=torch.int64, device=dev)
            return out if check else (out, err)
        err = torch.empty(1, dtype=torch.int64, device=dev)  # uz_scan sets it to ~0 first
        if frame.data_ptr() % 16:
            frame = frame.clone()
        if out.data_ptr() % 16:
            raise ValueError("out must be 16-byte aligned")
        st = _stream(stream)
        nb = header.num_blocks
        nplanes = dt.itemsize if dt.layout == fmt.LAYOUT_BYTES else (2 if dt.layout == fmt.LAYOUT_BF16 else 4)
        slots = min(nb, 2 * _sm_count(dev))
        slot_bytes = ((nplanes + 1) * header.block_elems + 15) // 16 * 16
        # one scratch allocation: u64 offsets, u32 queue count (set to 0 by uz_scan), u32 queue,
        # then uz_dec_slow's slots (16-byte aligned)
        head_bytes = (8 * nb + 4 + 4 * nb + 15) // 16 * 16
        scratch = torch.empty(head_bytes + slots * slot_bytes, dtype=torch.uint8, device=dev)
        op = scratch.data_ptr()
        cp_, lp = op + 8 * nb, op + 8 * nb + 4
        sp = op + head_bytes
        payload_len = header.frame_nbytes - header.payload_offset
        fp, ep = frame.data_ptr(), err.data_ptr()
        _launch(dev, "uz_scan", 1, 1024,
                (_u64(fp + header.table_offset), _u32(12), _u32(nb), _u64(op), _u64(0), _u64(0),
                 _u64(payload_len), np.int32(1), _u64(ep), _u64(cp_)), st)
        sfx = _kernel_suffix(dt)
        common = (_u64(fp), _u64(header.payload_offset), _u64(payload_len), _u64(header.table_offset),
                  _u64(op), _u64(header.numel), _u32(header.block_elems),
                  _u32(header.substream_elems), _u64(out.data_ptr()), _u64(ep))
        name, grid, block, smem = _decoder_launch(nb, nplanes, _sm_count(dev))
        if name == "uz_dec_fast":
            args = common + (_u64(lp), _u64(cp_))
        else:  # uz_dec_wide also takes the block count
            args = common[:8] + (_u32(nb),) + common[8:] + (_u64(lp), _u64(cp_))
        _launch(dev, f"{name}_{sfx}", grid, block, args, st, smem,
                wide_smem(WIDE_MAX_GROUPS) if name != "uz_dec_fast" else 0)
        _launch(dev, f"uz_dec_slow_{sfx}", slots, TPB, common + (_u64(lp), _u64(cp_), _u64(sp), _u64(slot_bytes)), st,
                CRC_SMEM)
        if stream is not None:
            for t_ in (frame, scratch, err):
                t_.record_stream(stream)
        if not check:
            return out, err
        raise_on_error(err)
        return out


_SMS: dict = {}


def _sm_count(dev) -> int:
    n = _SMS.get(dev.index)
    if n is None:
        import torch

        n = _SMS[dev.index] = torch.cuda.get_device_properties(dev).multi_processor_count
    return n


def _decoder_launch(nb: int, nplanes: int, sms: int) -> tuple[str, int, int, int]:
    """(kernel, grid, threads per CUDA block, dynamic shared memory) for a frame of nb codec
    blocks. uz_dec_wide runs in one wave when it fits: ceil(nb / SMs) groups of 128 threads
    (up to 8) per CUDA block, one CUDA block per SM. Its single-symbol build serves frames of
    up to one wave, where one thread's time is the frame's time; above that LUT loads bound
    throughput and the pair build, with half of them, is faster. fp32 (4 planes) spills in
    uz_dec_wide: above 4 codec blocks per SM round 3's uz_dec_fast was measured faster for it."""
    if DECODER == "fast" or (DECODER == "wide" and nplanes > 2 and nb > 4 * sms):
        return "uz_dec_fast", nb, TPB, SMEM_DEC
    groups = max(1, min(WIDE_MAX_GROUPS, -(-nb // sms)))
    pair = DECODER == "wide-pair" or nb > WIDE_MAX_GROUPS * sms
    return ("uz_dec_widep" if pair else "uz_dec_wide"), -(-nb // groups), 128 * groups, wide_smem(groups)


def error_message(word: int) -> str | None:
    word &= NO_ERROR
    if word == NO_ERROR:
        return None
    block, code = word >> 8, word & 0xFF
    what = _ERRORS.get(code, f"error {code}")
    if block == 0xFFFFFFFF:
        return what
    return f"block {block}: {what}"


def raise_on_error(err) -> None:
    """Reads the device error word (a host sync) and raises FrameError if it is set."""
    msg = error_message(int(err.item()))
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
    return fmt.parse_header(buf, get_backend("cpu").crc32c)


def crc32c_segments(data, seg: int, *, stream=None):
    """CRC32C of each `seg`-byte segment of the CUDA uint8 tensor `data` (the last may be
    short), one CUDA block each: crc_par, for the tests and the benchmark."""
    import torch

    n = data.numel()
    nseg = max(1, -(-n // seg))
    out = torch.empty(nseg, dtype=torch.int32, device=data.device)
    _launch(data.device, "uz_crc_segs", nseg, TPB, (_u64(data.data_ptr()), _u64(seg), _u64(n), _u64(out.data_ptr())),
            _stream(stream), CRC_SMEM)
    return out
