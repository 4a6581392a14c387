"""The uzip frame: the one place its header layout, dtype table and limits live.

docs/format.md is the human-readable specification; this module is its executable
twin. Every codec backend (the C CPU codec, the GPU kernels) writes and reads block
payloads as docs/format.md describes, and leaves the header to this module.

Everything is little-endian. A frame is::

    header      40 bytes, FRAME_HEADER below
    dims        ndim x u64, the tensor's shape
    block table num_blocks x 24 bytes: u64 payload end (from the first payload's start),
                u64 UZH64(original block bytes), u64 UZH64(payload bytes)
    header_hash u64, UZH64 of every byte above
    padding     zeros up to a multiple of 16
    payloads    num_blocks block payloads, back to back, each a multiple of 16 bytes

Nothing here imports torch; dtypes are named by their torch names ("bfloat16").
"""

from __future__ import annotations

import dataclasses
import struct

MAGIC = b"UZIP"
FORMAT_VERSION = 2

# magic(4s) version(u16) dtype(u8) ndim(u8) numel(u64) frame_nbytes(u64)
# block_elems(u32) substream_elems(u32) num_blocks(u32) flags(u32)
FRAME_HEADER = struct.Struct("<4sHBBQQIIII")
HEADER_NBYTES = FRAME_HEADER.size  # 40, pinned by a test
DIM = struct.Struct("<Q")
_FRAME_NBYTES = struct.Struct("<Q")
_FRAME_NBYTES_OFFSET = 16  # after magic, version, dtype, ndim, numel
_FLAGS = struct.Struct("<I")
_FLAGS_OFFSET = 36
TABLE_ENTRY = struct.Struct("<QQQ")  # payload end, UZH64(original), UZH64(payload)
HASH = struct.Struct("<Q")
ALIGN = 16  # payloads and every plane's data start at multiples of this (docs/format.md)
FLAG_GENERAL = 1  # some block is SPARSE or has more than one entropy-coded plane

MAX_NDIM = 8
MIN_BLOCK_ELEMS = 256
MAX_BLOCK_ELEMS = 65536  # keeps every sub-stream offset inside a u16
MIN_SUBSTREAM_ELEMS = 64
DEFAULT_BLOCK_ELEMS = 65536
DEFAULT_SUBSTREAM_ELEMS = 1024
# The GPU encoder codes a block per CUDA block. For small tensors it takes smaller blocks, down
# to this, so that about PARALLEL_BLOCKS of them keep an H200's 132 SMs busy (small_block_elems).
SMALL_BLOCK_ELEMS = 4096
PARALLEL_BLOCKS = 256
# Refuse to allocate more than this for one decoded tensor, whatever a header claims.
MAX_DECODED_NBYTES = 1 << 46

# Element layouts: how an element is cut into byte planes (docs/format.md, "Layouts").
LAYOUT_BYTES = 0  # plane j = byte j of the element
LAYOUT_BF16 = 1  # plane 0 = 8-bit exponent, plane 1 = sign | 7-bit mantissa
LAYOUT_FP32 = 2  # plane 0 = exponent, planes 1..3 = sign | 23-bit mantissa, low byte first


@dataclasses.dataclass(frozen=True)
class DType:
    code: int  # the u8 stored in the header; never reuse a retired code
    name: str  # torch's name, e.g. "bfloat16"
    itemsize: int  # bytes per element
    layout: int  # LAYOUT_*


_DTYPES = [
    DType(1, "bool", 1, LAYOUT_BYTES),
    DType(2, "uint8", 1, LAYOUT_BYTES),
    DType(3, "int8", 1, LAYOUT_BYTES),
    DType(4, "int16", 2, LAYOUT_BYTES),
    DType(5, "int32", 4, LAYOUT_BYTES),
    DType(6, "int64", 8, LAYOUT_BYTES),
    DType(7, "uint16", 2, LAYOUT_BYTES),
    DType(8, "uint32", 4, LAYOUT_BYTES),
    DType(9, "uint64", 8, LAYOUT_BYTES),
    # fp16's high byte is sign + 5-bit exponent + 2 mantissa bits: coding that byte
    # beat splitting out the 5-bit exponent (docs/format.md, "Layouts").
    DType(10, "float16", 2, LAYOUT_BYTES),
    DType(11, "bfloat16", 2, LAYOUT_BF16),
    DType(12, "float32", 4, LAYOUT_FP32),
    DType(13, "float64", 8, LAYOUT_BYTES),
    DType(14, "complex64", 8, LAYOUT_BYTES),
    DType(15, "complex128", 16, LAYOUT_BYTES),
    DType(16, "float8_e4m3fn", 1, LAYOUT_BYTES),
    DType(17, "float8_e5m2", 1, LAYOUT_BYTES),
    DType(18, "float8_e4m3fnuz", 1, LAYOUT_BYTES),
    DType(19, "float8_e5m2fnuz", 1, LAYOUT_BYTES),
    DType(20, "float8_e8m0fnu", 1, LAYOUT_BYTES),
    DType(21, "complex32", 4, LAYOUT_BYTES),
    DType(22, "float4_e2m1fn_x2", 1, LAYOUT_BYTES),  # two fp4 values per byte
]
DTYPES_BY_CODE = {d.code: d for d in _DTYPES}
DTYPES_BY_NAME = {d.name: d for d in _DTYPES}


class FrameError(ValueError):
    """A buffer is not a valid uzip frame: truncated, extended, corrupted or unsupported.

    Raised before any output is handed back; a decode that raises has returned nothing.
    """


@dataclasses.dataclass(frozen=True)
class FrameHeader:
    dtype: DType
    shape: tuple[int, ...]
    numel: int
    frame_nbytes: int  # the whole frame, header included
    block_elems: int
    substream_elems: int
    num_blocks: int
    flags: int = 0

    @property
    def general(self) -> bool:
        """Whether some block may need a decoder's general path (FLAG_GENERAL)."""
        return bool(self.flags & FLAG_GENERAL)

    @property
    def nbytes(self) -> int:
        """Bytes of the original (decoded) tensor."""
        return self.numel * self.dtype.itemsize

    @property
    def table_offset(self) -> int:
        return HEADER_NBYTES + DIM.size * len(self.shape)

    @property
    def payload_offset(self) -> int:
        return payload_offset(len(self.shape), self.num_blocks)

    @property
    def ratio(self) -> float:
        """Compressed bytes over original bytes (lower is better)."""
        return self.frame_nbytes / self.nbytes if self.nbytes else float("nan")


# UZH64 (docs/format.md, "UZH64, the checksum"): the codecs compute it in C and CUDA; this
# numpy version is the specification's executable twin, for tests.
UZH_LENGTH_MUL = 0x9E3779B97F4A7C15
UZH_MIX_A, UZH_MIX_B, UZH_MASK29 = 0x9E3779B1, 0x85EBCA6B, 0x1FFFFFFF


def uzh64_reference(data) -> int:
    """UZH64 of a bytes-like object, straight from the definition (slow; for tests)."""
    import numpy as np

    b = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    n = b.size
    padded = np.zeros(-(-n // 16) * 16, dtype=np.uint8)
    padded[:n] = b
    w = padded.view("<u4").astype(np.uint64)
    g = np.arange(w.size, dtype=np.uint64) // 4
    x = (g * UZH_MIX_A) & UZH_MASK29
    x ^= x >> 14
    x = (x * UZH_MIX_B) & UZH_MASK29
    x ^= x >> 13
    key = 8 * x + 2 * (np.arange(w.size, dtype=np.uint64) % 4) + 1
    with np.errstate(over="ignore"):
        total = int((w * key).sum(dtype=np.uint64))  # wraps mod 2^64, as specified
    return (total + n * UZH_LENGTH_MUL) & ((1 << 64) - 1)


def dtype_by_name(name: str) -> DType:
    try:
        return DTYPES_BY_NAME[name]
    except KeyError:
        raise TypeError(
            f"uzip cannot encode dtype {name!r}; supported: {', '.join(sorted(DTYPES_BY_NAME))}"
        ) from None


def num_blocks(numel: int, block_elems: int) -> int:
    return -(-numel // block_elems)


def small_block_elems(numel: int) -> int:
    """Elements per block of a GPU-made frame of `numel` elements: DEFAULT_BLOCK_ELEMS, or for
    tensors of fewer than PARALLEL_BLOCKS such blocks the power of two that gives about that
    many blocks, never below SMALL_BLOCK_ELEMS. At 65536-element blocks a 1 MiB bf16 tensor is
    8 blocks, so 8 of 132 SMs would do all the work while the rest idle (docs/gpu.md). Depends
    on the tensor alone, never on the GPU, so a tensor's frame is the same bytes everywhere."""
    want = max(1, numel // PARALLEL_BLOCKS)
    be = 1 << (want.bit_length() - 1)  # the power of two at or below it
    return max(SMALL_BLOCK_ELEMS, min(DEFAULT_BLOCK_ELEMS, be))


def align16(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def hash_offset(ndim: int, nblocks: int) -> int:
    """Where header_hash sits: after the header, dims and block table."""
    return HEADER_NBYTES + DIM.size * ndim + TABLE_ENTRY.size * nblocks


def payload_offset(ndim: int, nblocks: int) -> int:
    return align16(hash_offset(ndim, nblocks) + HASH.size)


def max_compressed_size(nbytes: int, dtype: str, *, ndim: int = MAX_NDIM,
                        block_elems: int | None = None) -> int:
    """Upper bound on the frame size for a tensor of `nbytes` bytes of `dtype`.

    A block never takes more than a RAW block (the encoder falls back to one): 16 bytes of
    mode and padding, its bytes, and padding to 16; only the last block can be short. By
    default the bound holds for every encoder of this build: the GPU encoder's blocks
    (small_block_elems) are the smallest, and fewer, larger blocks only lower the size.
    """
    dt = dtype_by_name(dtype)
    if nbytes < 0 or nbytes % dt.itemsize:
        raise ValueError(f"nbytes={nbytes} is not a whole number of {dtype} elements")
    numel = nbytes // dt.itemsize
    nblocks = num_blocks(numel, small_block_elems(numel) if block_elems is None else block_elems)
    return payload_offset(ndim, nblocks) + nbytes + ALIGN * nblocks + (ALIGN - 1)


def pack_header(dt: DType, shape: tuple[int, ...], numel: int, frame_nbytes: int, block_elems: int,
                substream_elems: int, flags: int = 0) -> bytes:
    """Header and dims; the block table and header hash follow (see finish_header)."""
    nblocks = num_blocks(numel, block_elems)
    head = FRAME_HEADER.pack(MAGIC, FORMAT_VERSION, dt.code, len(shape), numel, frame_nbytes, block_elems,
                             substream_elems, nblocks, flags)
    return head + b"".join(DIM.pack(d) for d in shape)


def finish_header(frame, frame_nbytes: int, ndim: int, nblocks: int, flags: int, hash64) -> None:
    """Stores the final frame size, the flags and the header hash once the block table is
    written, and zeroes the padding before the payloads."""
    _FRAME_NBYTES.pack_into(frame, _FRAME_NBYTES_OFFSET, frame_nbytes)
    _FLAGS.pack_into(frame, _FLAGS_OFFSET, flags)
    at = hash_offset(ndim, nblocks)
    HASH.pack_into(frame, at, hash64(frame[:at]))
    end = payload_offset(ndim, nblocks)
    frame[at + HASH.size:end] = bytes(end - at - HASH.size)


def parse_header(buf, hash64) -> FrameHeader:
    """Validates everything up to the payloads; raises FrameError with the reason.

    `hash64(data) -> int` (UZH64) is passed in so this module stays free of compiled code.
    Every length is checked against len(buf) before anything is allocated. The block table's
    offsets are checked block by block by the decoders.
    """
    mv = memoryview(buf).cast("B")
    n = len(mv)
    if n < HEADER_NBYTES:
        raise FrameError(f"truncated frame: {n} bytes, the header alone needs {HEADER_NBYTES}")
    (magic, version, dcode, ndim, numel, frame_nbytes, block_elems, substream, nblocks,
     flags) = FRAME_HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FrameError(f"not a uzip frame (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        hint = " (re-encode it with this build)" if version < FORMAT_VERSION else ""
        raise FrameError(f"unsupported uzip format version {version}; this build reads {FORMAT_VERSION}{hint}")
    if frame_nbytes != n:
        kind = "truncated" if n < frame_nbytes else "extended"
        raise FrameError(f"{kind} frame: buffer holds {n} bytes, header declares {frame_nbytes}")
    dt = DTYPES_BY_CODE.get(dcode)
    if dt is None:
        raise FrameError(f"unknown dtype code {dcode}")
    if ndim > MAX_NDIM:
        raise FrameError(f"ndim {ndim} exceeds the maximum {MAX_NDIM}")
    if flags & ~FLAG_GENERAL:
        raise FrameError(f"unknown header flags 0x{flags:x}")
    if not (MIN_BLOCK_ELEMS <= block_elems <= MAX_BLOCK_ELEMS) or block_elems & (block_elems - 1):
        raise FrameError(f"invalid block size {block_elems} elements")
    if not (MIN_SUBSTREAM_ELEMS <= substream <= block_elems) or substream & (substream - 1):
        raise FrameError(f"invalid sub-stream size {substream} elements")
    if numel * dt.itemsize > MAX_DECODED_NBYTES:
        raise FrameError(f"declared size {numel} x {dt.name} is absurd (limit {MAX_DECODED_NBYTES} bytes)")
    if nblocks != num_blocks(numel, block_elems):
        raise FrameError(f"{nblocks} blocks declared, {numel} elements need {num_blocks(numel, block_elems)}")
    end = payload_offset(ndim, nblocks)
    if end > n:
        raise FrameError(f"truncated frame: header and block table need {end} bytes, buffer holds {n}")
    shape = tuple(DIM.unpack_from(mv, HEADER_NBYTES + DIM.size * i)[0] for i in range(ndim))
    prod = 1
    for d in shape:
        prod *= d
    if prod != numel:
        raise FrameError(f"shape {shape} has {prod} elements, header declares {numel}")
    at = hash_offset(ndim, nblocks)
    (stored,) = HASH.unpack_from(mv, at)
    if hash64(mv[:at]) != stored:
        raise FrameError("header checksum mismatch (header or block table corrupted)")
    if any(mv[at + HASH.size:end]):
        raise FrameError("padding after the header is not zero")
    return FrameHeader(dt, shape, numel, frame_nbytes, block_elems, substream, nblocks, flags)
