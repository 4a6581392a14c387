"""Bitwise round trips: every dtype, awkward sizes, special values, random bit patterns."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import uzip_serve as uz
from uzip_serve import format as fmt

SIZES = [0, 1, 7, 4095, 4096, 65537, (1 << 22) + 3]
DTYPES = [getattr(torch, d.name) for d in fmt.DTYPES_BY_CODE.values() if hasattr(torch, d.name)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor: lossless means these compare equal."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_exact(x: torch.Tensor, y: torch.Tensor) -> None:
    assert y.dtype == x.dtype
    assert y.shape == x.shape
    assert torch.equal(bits(x), bits(y))


def random_bits(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw & 1).view(torch.bool)  # other byte values are not valid bools
    return raw.view(dtype)


def weight_like(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Near-Gaussian values, the case the exponent coder is built for."""
    return (torch.randn(n, generator=gen) * 0.02).to(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_random_bits(dtype, n):
    gen = torch.Generator().manual_seed(n)
    x = random_bits(n, dtype, gen)
    frame = uz.compress(x)
    assert_bit_exact(x, uz.decompress(frame))
    if n * x.element_size() >= 1 << 20:
        # Incompressible data may grow by at most 0.2% plus the header.
        assert len(frame) <= 1.002 * x.nbytes
    assert len(frame) <= uz.max_compressed_size(x.nbytes, dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_roundtrip_weight_like(dtype, n):
    x = weight_like(n, dtype, torch.Generator().manual_seed(1))
    assert_bit_exact(x, uz.decompress(uz.compress(x)))


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """NaNs with payloads, infinities, signed zeros, subnormals, extremes."""
    finfo = torch.finfo(dtype)
    vals = [0.0, -0.0, math.inf, -math.inf, math.nan, finfo.tiny, -finfo.tiny, finfo.max, finfo.min,
            finfo.eps, 1.0, -1.0]
    x = torch.tensor(vals, dtype=torch.float64).to(dtype)
    itemsize = x.element_size()
    int_view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    # Smallest subnormals and NaNs with distinct payloads, written as raw bit patterns.
    extra = {
        1: [0x01, 0x81, 0x7F, 0xFF, 0x7E],
        2: [0x0001, -0x7FFF, 0x7FC1, -0x3F, 0x7E01, 0x03FF],
        4: [0x00000001, -0x7FFFFFFF, 0x7FC00001, 0x7FBFFFFF, -0x00400001, 0x007FFFFF],
        8: [1, -0x7FFFFFFFFFFFFFFF, 0x7FF8000000000001, 0x7FF0000000000001, 0x000FFFFFFFFFFFFF],
    }[itemsize]
    raw = torch.tensor(extra, dtype=torch.int64).to(int_view).view(dtype)
    both = torch.cat([x, raw])
    return both.repeat(5000)  # enough to fill a block and exercise the coded path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_special_values(dtype):
    x = special_values(dtype)
    assert_bit_exact(x, uz.decompress(uz.compress(x)))
    # Also mixed into ordinary data, where they are rare symbols with long codes.
    y = weight_like(200_000, dtype, torch.Generator().manual_seed(2))
    y[::997] = x[: len(y[::997])]
    assert_bit_exact(y, uz.decompress(uz.compress(y)))


@settings(max_examples=300, deadline=None)
@given(data=st.binary(min_size=0, max_size=70_000), dtype=st.sampled_from(DTYPES))
def test_hypothesis_random_bytes(data, dtype):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    data = data[: len(data) - len(data) % itemsize]
    x = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype) if data else torch.empty(0, dtype=dtype)
    assert_bit_exact(x, uz.decompress(uz.compress(x)))


@settings(max_examples=100, deadline=None)
@given(data=st.lists(st.sampled_from([0, 0, 0, 0, 1, 0x3C00, 0x8000, 0x7FFF, 0xFFFF, 0x0080]),
                     min_size=1, max_size=20_000))
def test_hypothesis_low_entropy_bf16(data):
    # Few distinct patterns and many zeros: constant, sparse and coded planes all occur.
    x = torch.tensor(data, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert_bit_exact(x, uz.decompress(uz.compress(x)))


def test_shapes_are_kept():
    gen = torch.Generator().manual_seed(3)
    for shape in [(), (0,), (3, 0, 5), (2, 3, 4, 5, 1, 2, 1, 3), (1, 70_000)]:
        x = torch.randn(shape, generator=gen).to(torch.bfloat16)
        assert_bit_exact(x, uz.decompress(uz.compress(x)))


def test_too_many_dims_is_rejected():
    with pytest.raises(ValueError, match="dims"):
        uz.compress(torch.zeros([1] * 9))


def test_non_contiguous_tensor_is_gathered():
    x = torch.randn(300, 500).to(torch.bfloat16)
    view = x.t()[::2]
    y = uz.decompress(uz.compress(view))
    assert y.is_contiguous()
    assert_bit_exact(view.contiguous(), y)


def test_numpy_input():
    a = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    y = uz.decompress(uz.compress(a))
    assert np.array_equal(y.numpy().view(np.uint32), a.view(np.uint32))


def test_decompress_into_out():
    x = weight_like(100_000, torch.bfloat16, torch.Generator().manual_seed(4)).reshape(100, 1000)
    out = torch.empty_like(x)
    y = uz.decompress(uz.compress(x), out=out)
    assert y is out
    assert_bit_exact(x, out)
    with pytest.raises(ValueError, match="out is"):
        uz.decompress(uz.compress(x), out=torch.empty(100, 1000, dtype=torch.float16))
    with pytest.raises(ValueError, match="out is"):
        uz.decompress(uz.compress(x), out=torch.empty(1000, 100, dtype=torch.bfloat16))


def test_compress_into_preallocated_buffer():
    x = weight_like(300_000, torch.bfloat16, torch.Generator().manual_seed(5))
    buf = bytearray(uz.max_compressed_size(x.nbytes, x.dtype))
    n = uz.compress_into(x, buf)
    assert n == len(uz.compress(x))
    assert bytes(buf[:n]) == bytes(uz.compress(x))
    assert_bit_exact(x, uz.decompress(memoryview(buf)[:n]))
    with pytest.raises(ValueError, match="max_compressed_size"):
        uz.compress_into(x, bytearray(100))


def test_frames_do_not_depend_on_thread_count():
    x = weight_like(1_000_003, torch.bfloat16, torch.Generator().manual_seed(6))
    assert bytes(uz.compress(x, threads=1)) == bytes(uz.compress(x, threads=2)) == bytes(uz.compress(x, threads=7))


def test_unsupported_input_types():
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        uz.compress([1.0, 2.0])
    with pytest.raises(TypeError, match="cannot encode dtype"):
        uz.compress(torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.qint8))
    with pytest.raises(TypeError, match="dense"):
        uz.compress(torch.zeros(4, 4).to_sparse())


def test_read_header_reports_what_the_frame_holds():
    x = weight_like(70_000, torch.bfloat16, torch.Generator().manual_seed(7)).reshape(7, 10_000)
    frame = uz.compress(x)
    h = uz.read_header(frame)
    assert (h.dtype.name, h.shape, h.numel, h.frame_nbytes, h.num_blocks) == ("bfloat16", (7, 10_000), 70_000,
                                                                             len(frame), 2)
    assert h.nbytes == x.nbytes


def test_header_size_is_pinned():
    # Changing the header layout requires a FORMAT_VERSION bump and a docs/format.md update.
    assert fmt.HEADER_NBYTES == 40
    assert fmt.TABLE_ENTRY.size == 24
    assert fmt.HASH.size == 8
    assert fmt.FORMAT_VERSION == 2


def test_block_size_policy_keeps_the_bound():
    """GPU frames of small tensors use smaller blocks (format.small_block_elems); the default
    max_compressed_size must hold for them, hence for the CPU's larger blocks too."""
    assert fmt.small_block_elems(0) == fmt.small_block_elems(1 << 20) == fmt.SMALL_BLOCK_ELEMS
    assert fmt.small_block_elems(1 << 22) == 16384
    assert fmt.small_block_elems(1 << 24) == fmt.small_block_elems(1 << 34) == fmt.DEFAULT_BLOCK_ELEMS
    prev = 0
    for numel in [0, 1, 5000, 1 << 20, 3 << 20, 1 << 22, 12345678, 1 << 24, 1 << 26]:
        be = fmt.small_block_elems(numel)
        assert be >= prev and be & (be - 1) == 0
        prev = be
        for dtype, item in (("bfloat16", 2), ("float32", 4), ("uint8", 1)):
            bound = uz.max_compressed_size(numel * item, dtype)
            assert bound == fmt.max_compressed_size(numel * item, dtype, block_elems=be)
            assert bound >= fmt.max_compressed_size(numel * item, dtype, block_elems=fmt.DEFAULT_BLOCK_ELEMS)
