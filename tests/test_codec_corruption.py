"""A damaged frame raises FrameError: it never crashes, hangs or returns a wrong tensor."""

import random
import struct

import pytest
import torch

import uzip_serve as uz
from uzip_serve import format as fmt
from uzip_serve.kernels import get_backend


def sample_frames():
    """Frames that exercise every block and plane mode: coded, sparse, constant, raw."""
    gen = torch.Generator().manual_seed(0)
    dense = (torch.randn(70_000, generator=gen) * 0.02).to(torch.bfloat16)
    sparse = torch.zeros(70_000, dtype=torch.float32)
    sparse[torch.randint(0, 70_000, (2_000,), generator=gen)] = torch.randn(2_000, generator=gen)
    const = torch.full((5_000,), 3.0, dtype=torch.float16)
    raw = torch.randint(0, 256, (9_000,), dtype=torch.uint8, generator=gen)
    fp8 = (torch.randn(20_000, generator=gen)).to(torch.float8_e4m3fn)
    return [(t, bytes(uz.compress(t))) for t in (dense, sparse, const, raw, fp8)]


FRAMES = sample_frames()


def decode_is_exact_or_frame_error(original: torch.Tensor, frame) -> bool:
    """True if the frame decoded to exactly `original`, False if it raised FrameError.
    Anything else (a wrong tensor, another exception) fails the test."""
    try:
        y = uz.decompress(frame)
    except uz.FrameError:
        return False
    assert y.dtype == original.dtype and y.shape == original.shape, "decoded a different tensor"
    assert torch.equal(y.reshape(-1).view(torch.uint8), original.reshape(-1).view(torch.uint8)), \
        "decoded wrong bits without raising"
    return True


def single_bit_flips(frame, seed: int, payload_samples: int):
    """Copies of `frame`, each with one random bit flipped: in every byte of the header and
    block table, and in a sample of payload bytes."""
    rng = random.Random(seed)
    head = uz.read_header(frame).payload_offset
    positions = list(range(head)) + rng.sample(range(head, len(frame)), min(payload_samples, len(frame) - head))
    for pos in positions:
        bad = bytearray(frame)
        bad[pos] ^= 1 << rng.randrange(8)
        yield bad


@pytest.mark.parametrize("index", range(len(FRAMES)))
def test_every_single_bit_flip_is_detected(index):
    _, frame = FRAMES[index]
    for bad in single_bit_flips(frame, seed=index, payload_samples=2000):
        with pytest.raises(uz.FrameError):
            uz.decompress(bad)


@pytest.mark.parametrize("index", range(len(FRAMES)))
def test_truncated_and_extended_frames(index):
    _, frame = FRAMES[index]
    for cut in sorted({0, 1, 3, 39, 40, 47, len(frame) // 2, len(frame) - 5, len(frame) - 1}):
        with pytest.raises(uz.FrameError, match="truncated|magic"):
            uz.decompress(frame[:cut])
    for tail in (b"\x00", b"garbage" * 100):
        with pytest.raises(uz.FrameError, match="extended"):
            uz.decompress(frame + tail)


def patched(frame: bytes, offset: int, fmt_: str, value) -> bytearray:
    bad = bytearray(frame)
    struct.pack_into(fmt_, bad, offset, value)
    return bad


def with_fresh_header_hash(frame) -> bytearray:
    """Recomputes the header hash so a test reaches the checks behind it."""
    bad = bytearray(frame)
    (_, _, _, ndim, numel, _, block_elems, _, nblocks, _) = fmt.FRAME_HEADER.unpack_from(bad, 0)
    at = fmt.hash_offset(ndim, nblocks)
    if at + fmt.HASH.size <= len(bad):
        fmt.HASH.pack_into(bad, at, get_backend("cpu").uzh64(bytes(bad[:at])))
    return bad


@pytest.mark.parametrize("field,offset,fmt_,value,message", [
    ("magic", 0, "<4s", b"UZIQ", "magic"),
    ("version", 4, "<H", 1, "version 1.*re-encode"),
    ("version", 4, "<H", 3, "version 3"),
    ("version", 4, "<H", 0, "version 0"),
    ("dtype", 6, "<B", 250, "dtype code"),
    ("ndim", 7, "<B", 9, "ndim"),
    ("numel", 8, "<Q", 1 << 60, "absurd"),
    ("numel", 8, "<Q", 69_999, "blocks declared|elements"),
    ("frame_nbytes", 16, "<Q", 1 << 40, "truncated"),
    ("block_elems", 24, "<I", 1000, "block size"),
    ("block_elems", 24, "<I", 1 << 20, "block size"),
    ("substream", 28, "<I", 3, "sub-stream"),
    ("num_blocks", 32, "<I", 1 << 31, "blocks declared"),
    ("flags", 36, "<I", 2, "flags"),
])
def test_header_fields(field, offset, fmt_, value, message):
    _, frame = FRAMES[0]
    bad = patched(frame, offset, fmt_, value)
    with pytest.raises(uz.FrameError):
        uz.decompress(bad)  # caught by the header hash
    with pytest.raises(uz.FrameError, match=message):
        uz.decompress(with_fresh_header_hash(bad))  # caught by the field's own check


def test_absurd_size_is_refused_before_allocating():
    # A tiny frame claiming 2^40 elements: rejected by arithmetic, nothing allocated.
    x = torch.zeros(10, dtype=torch.bfloat16)
    frame = bytes(uz.compress(x))
    bad = with_fresh_header_hash(patched(patched(frame, 8, "<Q", 1 << 40), 40, "<Q", 1 << 40))
    with pytest.raises(uz.FrameError, match="absurd|truncated|blocks"):
        uz.decompress(bad)


def test_block_table_lies_are_caught():
    _, frame = FRAMES[0]
    h = uz.read_header(frame)
    for entry in (0, 1):  # the first block's end, and the last one's (the frame's end)
        at = h.table_offset + fmt.TABLE_ENTRY.size * entry
        for delta in (-16, -1, 1, 16, 1 << 30, 1 << 62):
            bad = bytearray(frame)
            (end,) = struct.unpack_from("<Q", bad, at)
            struct.pack_into("<Q", bad, at, (end + delta) % (1 << 64))
            with pytest.raises(uz.FrameError, match="block|payload|frame"):
                uz.decompress(with_fresh_header_hash(bad))


def test_general_flag_is_required_for_sparse_blocks():
    """A frame whose GENERAL flag was cleared (header hash made consistent) while it holds a
    SPARSE block is refused: a GPU decoder decides from the flag alone whether it needs its
    general path (docs/format.md)."""
    _, frame = FRAMES[1]  # the sparse fp32 tensor
    assert uz.read_header(frame).general
    bad = with_fresh_header_hash(patched(frame, 36, "<I", 0))
    with pytest.raises(uz.FrameError, match="GENERAL"):
        uz.decompress(bad)
    assert not uz.read_header(FRAMES[0][1]).general  # plain bf16 weights: the fast path only


def refresh_all_checksums(frame: bytearray) -> bytearray:
    """Makes a mutated frame's payload and header hashes consistent again, so the fuzzer
    reaches the decoder's structural checks instead of stopping at the first checksum."""
    try:
        (_, _, _, ndim, _, _, _, _, nblocks, _) = fmt.FRAME_HEADER.unpack_from(frame, 0)
    except struct.error:
        return frame
    table = fmt.HEADER_NBYTES + 8 * ndim
    base = fmt.payload_offset(ndim, nblocks)
    if base > len(frame) or nblocks > 64:
        return frame
    uzh = get_backend("cpu").uzh64
    start = 0
    for b in range(nblocks):
        end, _, _ = fmt.TABLE_ENTRY.unpack_from(frame, table + fmt.TABLE_ENTRY.size * b)
        if end < start or base + end > len(frame):
            break
        struct.pack_into("<Q", frame, table + fmt.TABLE_ENTRY.size * b + 16, uzh(bytes(frame[base + start:base + end])))
        start = end
    at = fmt.hash_offset(ndim, nblocks)
    fmt.HASH.pack_into(frame, at, uzh(bytes(frame[:at])))
    return frame


def mutate(frame: bytes, rng: random.Random) -> bytearray:
    bad = bytearray(frame)
    kind = rng.randrange(6)
    if kind == 0:  # flip 1-8 random bits
        for _ in range(rng.randint(1, 8)):
            bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # overwrite a run with random bytes
        at = rng.randrange(len(bad))
        for i in range(at, min(len(bad), at + rng.randint(1, 16))):
            bad[i] = rng.randrange(256)
    elif kind == 2:  # truncate
        del bad[rng.randrange(len(bad)):]
    elif kind == 3:  # append
        bad += bytes(rng.randrange(256) for _ in range(rng.randint(1, 32)))
    elif kind == 4:  # set a byte to an extreme
        bad[rng.randrange(len(bad))] = rng.choice([0, 0xFF, 0x80, 0x7F])
    else:  # duplicate a slice somewhere else
        a, b = sorted(rng.randrange(len(bad)) for _ in range(2))
        at = rng.randrange(len(bad))
        bad[at:at + (b - a)] = frame[a:b]
    return bad


def small_fuzz_corpus():
    """Small frames (fast to decode) covering every mode, so 100k mutations fit in CI."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for n in (300, 1500, 5000):
        out.append((torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16))
        out.append((torch.randn(n, generator=gen) * 1e-3).to(torch.float32))
        sp = torch.zeros(n, dtype=torch.bfloat16)
        sp[::37] = 1.5
        out.append(sp)
        out.append(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))
        out.append(torch.randn(n, generator=gen).to(torch.float8_e5m2))
        out.append(torch.randn(n, generator=gen).to(torch.float16))
    return [(t, bytes(uz.compress(t))) for t in out]


def test_fuzz_100k_mutated_frames():
    rng = random.Random(12345)
    corpus = small_fuzz_corpus()
    survived = 0
    for i in range(100_000):
        original, frame = corpus[i % len(corpus)]
        bad = mutate(frame, rng)
        if i % 2:  # half of them with checksums made consistent again
            bad = refresh_all_checksums(bad)
        survived += decode_is_exact_or_frame_error(original, bad)
    # Some mutations are no-ops (a byte set to its own value); nothing else may decode.
    assert survived < 5_000
