"""The GPU codec (uzip_serve/kernels/cuda_codec.cu) against the CPU codec, both ways, bit for
bit, and every corruption class raising FrameError on the GPU path.

The same kernels run on two targets:
  - "sim": the SIMT emulator (tests/simt) compiles the CUDA source as C++ and runs it on the
    CPU, block and warp semantics included: CI checks the kernels' logic on every change;
  - "cuda": a real GPU through CuPy, skipped cleanly without one (run on the device machine).
Sizes are smaller on the emulator, which runs a CUDA thread as a fiber.
"""

import os
import random
import struct

import pytest
import torch

import uzip_serve as uz
from uzip_serve import format as fmt
from uzip_serve.kernels import cuda as kc

from tests import test_codec_corruption as corr

ALL_DTYPES = [getattr(torch, d.name) for d in fmt.DTYPES_BY_CODE.values() if hasattr(torch, d.name)]


class Target:
    """Where the kernels run: compress a host tensor into a GPU-made frame (bytes), decode a
    frame with the GPU decoder into a host tensor."""

    def __init__(self, kind: str):
        self.kind = kind
        if kind == "sim":
            from simt.build import compiler
            if compiler() is None:
                pytest.skip("no C++ compiler for the SIMT emulator")
            from simt.codec_runtime import SimRuntime

            self.codec = kc.CudaCodec(runtime=SimRuntime())
            self.dev = torch.device("cpu")
            self.sizes = [0, 1, 7, 16, 255, 1000, 4096, 65536, 65537 + 300]
        else:
            pytest.importorskip("cupy")
            if not torch.cuda.is_available():
                pytest.skip("no CUDA GPU")
            self.codec = uz.codec.get_backend("cuda")
            self.dev = torch.device("cuda")
            self.sizes = [0, 1, 7, 16, 255, 1000, 4096, 65535, 65536, 65537, 200_003, 1 << 21]

    def compress(self, x: torch.Tensor) -> bytes:
        xd = x.to(self.dev)
        if self.kind == "cuda":
            return bytes(uz.compress(xd))  # the public dispatch path
        out = torch.empty(uz.max_compressed_size(xd.numel() * xd.element_size(), xd.dtype), dtype=torch.uint8)
        n = self.codec.compress_device(xd, out)
        return out[:n].numpy().tobytes()

    def decompress(self, frame) -> torch.Tensor:
        if self.kind == "cuda":
            return uz.decompress(frame, device="cuda").cpu()
        header = uz.read_header(frame)
        buf = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        return self.codec.decompress_device(buf, header).cpu()


@pytest.fixture(scope="module", params=["sim", "cuda"])
def gpu(request):
    return Target(request.param)


def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


def random_tensor(dtype, n, seed=0, kind="bits"):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal" and dtype.is_floating_point and dtype.itemsize >= 2:
        return (torch.randn(n, generator=g) * 0.02).to(dtype)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype) if n else torch.empty(0, dtype=dtype)


def check_both_ways(gpu, x):
    """GPU frame -> CPU and GPU decoders; CPU frame -> GPU decoder; all bit-exact."""
    gframe = gpu.compress(x)
    fmt.parse_header(gframe, uz.codec.get_backend("cpu").uzh64)
    assert len(gframe) <= uz.max_compressed_size(x.numel() * x.element_size(), x.dtype)
    y_cpu = uz.decompress(gframe)
    assert y_cpu.dtype == x.dtype and tuple(y_cpu.shape) == tuple(x.shape)
    assert torch.equal(bits(y_cpu), bits(x)), "GPU frame decoded wrong on the CPU"
    y_gpu = gpu.decompress(gframe)
    assert tuple(y_gpu.shape) == tuple(x.shape) and torch.equal(bits(y_gpu), bits(x)), "GPU frame wrong on the GPU"
    cframe = bytes(uz.compress(x))
    y2 = gpu.decompress(cframe)
    assert torch.equal(bits(y2), bits(x)), "CPU frame decoded wrong on the GPU"
    return gframe, cframe


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_every_size(gpu, dtype):
    for i, n in enumerate(gpu.sizes):
        for kind in ("bits", "normal"):
            check_both_ways(gpu, random_tensor(dtype, n, seed=i, kind=kind))


def test_shapes_and_strided(gpu):
    x = (torch.randn(3, 5, 70, 30) * 0.02).to(torch.bfloat16)
    check_both_ways(gpu, x)
    check_both_ways(gpu, x.transpose(1, 3))  # non-contiguous: gathered first
    check_both_ways(gpu, torch.tensor(1.5, dtype=torch.float32))  # 0-d


@pytest.mark.parametrize("maker", [
    lambda: torch.zeros(70_000, dtype=torch.bfloat16),
    lambda: torch.full((70_000,), 3.0, dtype=torch.float16),
    lambda: torch.full((70_000,), -0.0, dtype=torch.float32),
    lambda: torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0] * 17_000, dtype=torch.float32),
    lambda: (torch.randn(70_000) * 1e-3).to(torch.float32),
    lambda: torch.randn(70_000).to(torch.float16),
    lambda: (torch.randn(70_000) * 50).to(torch.bfloat16),
    lambda: torch.where(torch.rand(70_000) < 0.9, 0.0, torch.randn(70_000)).to(torch.float32),  # SPARSE on the CPU
    lambda: torch.randint(0, 5, (70_000,)).to(torch.int64),  # several coded planes on the CPU
], ids=["zeros", "const-fp16", "negzero", "specials", "fp32", "fp16", "bf16-wide", "sparse-fp32", "small-ints"])
def test_special_tensors(gpu, maker):
    torch.manual_seed(0)
    check_both_ways(gpu, maker())


def test_real_tensors(gpu, realdata):
    """Real Gemma-3 and MiniLM tensors in their dtype, bf16 and fp16 (on the emulator, the first
    140k elements of a few). On a GPU machine, $UZIP_GPU_DATA names the carried slice
    (benchmarks/codec_gpu.py --make-slice) instead of the realdata cache."""
    if os.environ.get("UZIP_GPU_DATA"):
        from safetensors.torch import load_file

        tensors = load_file(os.environ["UZIP_GPU_DATA"])
    else:
        tensors = {**realdata("minilm_weights"), **realdata("gemma_activations")}
    items = list(tensors.items())
    if gpu.kind == "sim":
        items = [(k, t.reshape(-1)[:140_000]) for k, t in items[::max(1, len(items) // 4)]]
    for _, t in items:
        for dt in {t.dtype, torch.bfloat16, torch.float16}:
            check_both_ways(gpu, t.to(dt).contiguous())


def test_small_tensors_take_small_blocks(gpu):
    """Below 256 full blocks the GPU encoder shrinks its blocks (format.small_block_elems) so
    that many SMs share a small tensor; the frames stay inside max_compressed_size and decode
    on both sides."""
    x = random_tensor(torch.bfloat16, 150_000, seed=4, kind="normal")
    gframe, _ = check_both_ways(gpu, x)
    h = uz.read_header(gframe)
    assert h.block_elems == fmt.small_block_elems(150_000) == fmt.SMALL_BLOCK_ELEMS
    assert h.num_blocks == 37
    assert h.substream_elems == 64  # the shortest decode chains for the smallest blocks


def test_substream_length_follows_tensor_size(monkeypatch):
    """64 symbols per sub-stream in 4096-element blocks, 128 in 8192-element blocks, 256 up
    to 8 MiB, then 512; the environment override wins and is checked."""
    monkeypatch.delenv("UZIP_GPU_SUBSTREAM", raising=False)
    for nbytes, itemsize, want in ((2, 2, 64), (1 << 20, 2, 64), ((4 << 20) - 2, 2, 64), (4 << 20, 2, 128),
                                   (6 << 20, 2, 128), (6 << 20, 1, 256), (8 << 20, 2, 512), (1 << 30, 2, 512)):
        be = fmt.small_block_elems(nbytes // itemsize)
        assert kc.encoder_substream(nbytes, be) == want, (nbytes, be)
    monkeypatch.setenv("UZIP_GPU_SUBSTREAM", "1024")
    assert kc.encoder_substream(1 << 20, 4096) == 1024
    monkeypatch.setenv("UZIP_GPU_SUBSTREAM", "100")
    with pytest.raises(ValueError, match="power of two"):
        kc.encoder_substream(1 << 20, 4096)


def test_lookback_over_many_windows(gpu, monkeypatch):
    """201 blocks: the encoder's look-back reads its predecessors 128 at a time (4 windows of
    32) and must cross rounds and windows. A block size under the default bound needs a buffer
    sized for it; the default-sized buffer is refused."""
    monkeypatch.setenv("UZIP_GPU_BLOCK_ELEMS", "256")
    x = random_tensor(torch.bfloat16, 256 * 200 + 5, seed=6, kind="normal").to(gpu.dev)
    small = torch.empty(uz.max_compressed_size(x.nbytes, x.dtype), dtype=torch.uint8, device=gpu.dev)
    with pytest.raises(ValueError, match="at least"):
        gpu.codec.compress_device(x, small)
    out = torch.empty(fmt.max_compressed_size(x.nbytes, "bfloat16", block_elems=256), dtype=torch.uint8,
                      device=gpu.dev)
    n = gpu.codec.compress_device(x, out)
    frame = out[:n].cpu().numpy().tobytes()
    assert uz.read_header(frame).num_blocks == 201
    assert torch.equal(bits(uz.decompress(frame)), bits(x))
    assert torch.equal(bits(gpu.decompress(frame)), bits(x))


def bf16_with_exponent_counts(counts, seed=0):
    """A bf16 tensor whose exponent byte 100 + i occurs counts[i] times (shuffled), random
    sign and mantissa: a chosen histogram for the entropy-coded plane."""
    g = torch.Generator().manual_seed(seed)
    e = torch.cat([torch.full((c,), 100 + i, dtype=torch.int32) for i, c in enumerate(counts)])
    e = e[torch.randperm(len(e), generator=g)]
    low = torch.randint(0, 256, (len(e),), generator=g, dtype=torch.int32)
    return ((e << 7) | (low & 0x7F) | ((low & 0x80) << 8)).to(torch.int16).view(torch.bfloat16)


def huff_lengths(frame) -> list[int]:
    """The code lengths in block 0's entropy-plane header (a DENSE block, HUFF plane first)."""
    h = uz.read_header(frame)
    blk = frame[h.payload_offset:]
    assert (blk[0], blk[1]) == (1, 2), "block 0 is not DENSE (1) with a HUFF (2) first plane"
    span = blk[3]
    return [(blk[4 + i // 2] >> (4 * (i & 1))) & 15 for i in range(span + 1)]


FIB = [1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987]  # depth 15


@pytest.mark.parametrize("counts", [FIB, FIB + [1500], [1] * 20 + [2000, 1500], [1] * 31 + [3000],
                                    [1] * 32 + [3000], FIB + [40] * 30, [2 ** i for i in range(12)], [5] * 32,
                                    [1, 4000]],
                         ids=["fib16", "fib17", "n22", "n32", "n33", "n46deep", "pow2", "flat32", "n2"])
def test_code_lengths_match_the_cpu(gpu, counts):
    """Histograms of 2 to 46 symbols, among them trees deeper than MAX_CODE_LEN (the
    length-limiting repair), on both sides of the 32-symbol switch between the one-warp and the block-wide length builders: the GPU's
    code lengths are the CPU's, symbol for symbol (one block, so the same histogram)."""
    x = bf16_with_exponent_counts(counts)
    assert x.numel() <= fmt.SMALL_BLOCK_ELEMS
    gframe, _ = check_both_ways(gpu, x)
    assert huff_lengths(gframe) == huff_lengths(bytes(uz.compress(x)))


@pytest.mark.parametrize("block,sub", [(65536, 64), (65536, 256), (65536, 512), (65536, 1024), (4096, 64), (4096, 128),
                                       (4096, 1024)])
def test_every_substream_size(gpu, monkeypatch, block, sub):
    """The encoder's writer at each sub-stream length: 8 to 32 symbols per lane (the 8-
    and 1-symbol paths) in groups of a quarter, a half or a whole warp, run lengths kept from
    the size pass in u8 or u16 or counted again when they do not fit, and a last block whose
    runs end mid-lane."""
    monkeypatch.setenv("UZIP_GPU_BLOCK_ELEMS", str(block))
    monkeypatch.setenv("UZIP_GPU_SUBSTREAM", str(sub))
    x = random_tensor(torch.bfloat16, 2 * block + 777, seed=sub, kind="normal").to(gpu.dev)
    out = torch.empty(fmt.max_compressed_size(x.nbytes, "bfloat16", block_elems=block), dtype=torch.uint8,
                      device=gpu.dev)
    frame = out[:gpu.codec.compress_device(x, out)].cpu().numpy().tobytes()
    h = uz.read_header(frame)
    assert (h.block_elems, h.substream_elems, h.num_blocks) == (block, sub, 3)
    assert len(frame) < 0.7 * x.nbytes  # the exponent plane really was entropy-coded
    assert torch.equal(bits(uz.decompress(frame)), bits(x))
    assert torch.equal(bits(gpu.decompress(frame)), bits(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_whole_blocks_every_layout(gpu, monkeypatch, dtype):
    """65536-element blocks, two whole and a last partial one, for each coded layout: the
    encoder's and the fast decoder's loops for whole rounds of whole chunks (no bounds checks,
    plane modes fixed at compile time) beside the general ones they skip. The CPU's frame of the
    same tensor, whose blocks differ, goes through the GPU decoder too."""
    monkeypatch.setenv("UZIP_GPU_BLOCK_ELEMS", "65536")
    n = 2 * 65536 + 4000
    if dtype.itemsize == 1:
        x = (torch.randn(n, generator=torch.Generator().manual_seed(7)) * 3).to(dtype)
    else:
        x = random_tensor(dtype, n, seed=7, kind="normal")
    x = x.to(gpu.dev)
    out = torch.empty(fmt.max_compressed_size(x.nbytes, str(dtype).split(".")[1], block_elems=65536),
                      dtype=torch.uint8, device=gpu.dev)
    frame = out[:gpu.codec.compress_device(x, out)].cpu().numpy().tobytes()
    h = uz.read_header(frame)
    assert (h.block_elems, h.num_blocks) == (65536, 3)
    assert len(frame) < 0.9 * x.nbytes  # the exponent plane really was entropy-coded
    assert torch.equal(bits(uz.decompress(frame)), bits(x))
    assert torch.equal(bits(gpu.decompress(frame)), bits(x))
    assert torch.equal(bits(gpu.decompress(bytes(uz.compress(x.cpu())))), bits(x))


def test_frames_do_not_depend_on_scheduling():
    """GPU frames are a function of the tensor alone: the emulator with 1 and 5 CUDA blocks in
    flight (the look-back then waits, or never does), and with blocks started last first (so no
    CUDA block's guess at its ticket is right), writes the same bytes, and where a GPU is
    present, so does the GPU. So the emulator checks exactly the code the GPU runs."""
    from simt.build import compiler

    if compiler() is None:
        pytest.skip("no C++ compiler for the SIMT emulator")
    from simt.codec_runtime import SimRuntime

    x = (torch.randn(300_000, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    cap = uz.max_compressed_size(x.nbytes, x.dtype)
    frames = []
    for conc, rev in ((1, False), (5, False), (5, True)):
        out = torch.empty(cap, dtype=torch.uint8)
        n = kc.CudaCodec(runtime=SimRuntime(concurrent_blocks=conc, reverse_blocks=rev)).compress_device(x, out)
        frames.append(out[:n].numpy().tobytes())
    assert frames[0] == frames[1] == frames[2]
    if torch.cuda.is_available():
        pytest.importorskip("cupy")
        assert bytes(uz.compress(x.cuda())) == frames[0]


def test_hash_segments_match_the_specification(gpu):
    g = torch.Generator().manual_seed(5)
    buf = torch.randint(0, 256, (20_000,), dtype=torch.uint8, generator=g)
    data = buf.to(gpu.dev)
    for off in (0, 3, 16):
        for seg, span in ((1, 40), (15, 600), (16, 600), (17, 600), (1000, 20_000), (8192, 20_000)):
            got = gpu.codec.hash_segments(data[off:span], seg).cpu()
            for i in (0, 1, got.numel() - 1):
                want = fmt.uzh64_reference(buf[off + seg * i: min(span, off + seg * (i + 1))].numpy().tobytes())
                assert (int(got[i]) & ((1 << 64) - 1)) == want, (off, seg, i)


# ---- corruption: every class of tests/test_codec_corruption.py, decoded on the GPU ----

def gpu_decode_exact_or_error(gpu, original, frame) -> bool:
    try:
        y = gpu.decompress(frame)
    except uz.FrameError:
        return False
    assert y.dtype == original.dtype and tuple(y.shape) == tuple(original.shape)
    assert torch.equal(bits(y), bits(original)), "GPU decoded wrong bits without raising"
    return True


@pytest.fixture(scope="module")
def gpu_frames(gpu):
    return [(t, gpu.compress(t)) for t, _ in corr.FRAMES]


@pytest.mark.parametrize("which", ["cpu", "gpu"])
@pytest.mark.parametrize("index", range(len(corr.FRAMES)))
def test_bit_flips_detected_on_gpu(gpu, gpu_frames, which, index):
    _, frame = corr.FRAMES[index] if which == "cpu" else gpu_frames[index]
    samples = 300 if gpu.kind == "cuda" else 40
    for bad in corr.single_bit_flips(frame, seed=index, payload_samples=samples):
        with pytest.raises(uz.FrameError):
            gpu.decompress(bad)


@pytest.mark.parametrize("index", range(len(corr.FRAMES)))
def test_truncated_extended_on_gpu(gpu, index):
    _, frame = corr.FRAMES[index]
    for cut in (0, 1, 39, 40, len(frame) // 2, len(frame) - 1):
        with pytest.raises(uz.FrameError):
            gpu.decompress(frame[:cut])
    with pytest.raises(uz.FrameError, match="extended"):
        gpu.decompress(frame + b"\0")
    if gpu.kind == "cuda":  # a truncated frame already in device memory
        dev = torch.frombuffer(bytearray(frame[: len(frame) // 2]), dtype=torch.uint8).to(gpu.dev)
        with pytest.raises(uz.FrameError):
            gpu.codec.decompress_device(dev)


def test_block_table_lies_on_gpu(gpu, gpu_frames):
    for frame in (corr.FRAMES[0][1], gpu_frames[0][1]):
        h = uz.read_header(frame)
        for entry in (0, 1):
            at = h.table_offset + fmt.TABLE_ENTRY.size * entry
            for delta in (-16, -1, 1, 16, 1 << 40):
                bad = bytearray(frame)
                (end,) = struct.unpack_from("<Q", bad, at)
                struct.pack_into("<Q", bad, at, (end + delta) % (1 << 64))
                with pytest.raises(uz.FrameError, match="payload|block"):
                    gpu.decompress(corr.with_fresh_header_hash(bad))


def test_errors_are_one_word_per_block_with_no_fill(gpu):
    """check=False hands back one error word per block, which every block writes itself (the
    launcher allocates them without a fill): a flipped payload byte in block 2 fails block 2
    alone, and first_error names it."""
    x = random_tensor(torch.bfloat16, 5 * 4096, seed=3, kind="normal")
    frame = bytearray(gpu.compress(x))
    h = uz.read_header(bytes(frame))
    assert h.num_blocks == 5
    (end1,) = struct.unpack_from("<Q", frame, h.table_offset + fmt.TABLE_ENTRY.size * 1)
    frame[h.payload_offset + end1 + 40] ^= 0x10
    for data, bad_block in ((bytes(frame), 2), (gpu.compress(x), None)):
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(gpu.dev)
        _, errors = gpu.codec.decompress_device(buf, uz.read_header(data), check=False)
        words = [int(w) for w in errors.cpu()]
        assert len(words) == 5
        for b, w in enumerate(words):
            assert (w == kc.CLEAN) == (b != bad_block), (b, hex(w))
        if bad_block is None:
            assert kc.first_error(errors) is None
        else:
            assert words[bad_block] >> 8 == bad_block
            assert kc.first_error(errors).startswith(f"block {bad_block}: ")


def test_general_flag_is_required_on_gpu(gpu):
    _, frame = corr.FRAMES[1]  # SPARSE blocks: the general decoder
    assert gpu_decode_exact_or_error(gpu, corr.FRAMES[1][0], frame)
    with pytest.raises(uz.FrameError, match="GENERAL"):
        gpu.decompress(corr.with_fresh_header_hash(corr.patched(frame, 36, "<I", 0)))


def test_fuzz_mutations_on_gpu(gpu):
    """Mutated frames (half with consistent checksums, reaching the structural checks): the GPU
    either decodes the exact original or raises FrameError, and accepts exactly what the CPU
    accepts."""
    rng = random.Random(777)
    corpus = corr.small_fuzz_corpus()
    corpus += [(t, gpu.compress(t)) for t, _ in corpus]
    n = int(os.environ.get("UZIP_GPU_FUZZ", "3000" if gpu.kind == "cuda" else "400"))
    survived = 0
    for i in range(n):
        original, frame = corpus[i % len(corpus)]
        bad = corr.mutate(frame, rng)
        if i % 2:
            bad = corr.refresh_all_checksums(bad)
        cpu_ok = corr.decode_is_exact_or_frame_error(original, bad)
        gpu_ok = gpu_decode_exact_or_error(gpu, original, bad)
        assert cpu_ok == gpu_ok, f"mutation {i}: CPU {'accepted' if cpu_ok else 'refused'}, GPU disagrees"
        survived += gpu_ok
    assert survived < n // 10


# ---- the device API: CUDA only ----

@pytest.fixture
def cuda_codec():
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return uz.codec


def test_device_api_and_capture_safe_variant(cuda_codec):
    codec = cuda_codec
    dev = torch.device("cuda")
    x = (torch.randn(1 << 20, device=dev) * 0.02).to(torch.bfloat16)
    cap = uz.max_compressed_size(x.numel() * 2, x.dtype)
    out = torch.empty(cap, dtype=torch.uint8, device=dev)
    n = codec.compress_device(x, out)
    assert torch.equal(bits(codec.decompress_device(out[:n])), bits(x))
    size = torch.zeros(1, dtype=torch.int64, device=dev)  # capture-safe: size in device memory
    out2 = torch.zeros_like(out)
    codec.compress_device_async(x, out2, size)
    torch.cuda.synchronize()
    assert int(size.item()) == n and torch.equal(out2[:n].cpu(), out[:n].cpu())
    out3 = torch.zeros_like(out)
    size3 = torch.zeros(1, dtype=torch.int64, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        codec.compress_device_async(x, out3, size3)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    hdr = uz.read_header(out[:n].cpu().numpy().tobytes())
    y = torch.empty_like(x)
    g = torch.cuda.CUDAGraph()
    out3.zero_()
    with torch.cuda.graph(g):
        codec.compress_device_async(x, out3, size3)
        _, err = codec.decompress_device(out[:n], header=hdr, out=y, check=False)
    g.replay()
    torch.cuda.synchronize()
    assert int(size3.item()) == n and torch.equal(out3[:n].cpu(), out[:n].cpu())
    assert err.numel() == hdr.num_blocks and kc.first_error(err) is None and torch.equal(bits(y), bits(x))


def test_compress_into_host_buffer(cuda_codec):
    x = (torch.randn(100_000, device="cuda") * 0.02).to(torch.bfloat16)
    buf = bytearray(uz.max_compressed_size(x.numel() * 2, x.dtype))
    n = uz.compress_into(x, buf)
    assert torch.equal(bits(uz.decompress(buf[:n])), bits(x))
