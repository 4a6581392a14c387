"""GPU codec (uzip_serve/kernels/cuda_codec.cu): bit-exact with the CPU codec both ways,
and every corruption class raises FrameError. Skips cleanly without CuPy or a CUDA GPU."""

import os
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

import uzip_serve as uz  # noqa: E402
from uzip_serve import codec  # noqa: E402
from uzip_serve import format as fmt  # noqa: E402

from tests import test_codec_corruption as corr  # noqa: E402

DEV = torch.device("cuda")
ALL_DTYPES = [getattr(torch, d.name) for d in fmt.DTYPES_BY_CODE.values() if hasattr(torch, d.name)]
SIZES = [0, 1, 7, 16, 255, 1000, 4096, 65535, 65536, 65537, 200_003]


@pytest.fixture(autouse=True, params=["wide", "wide-pair", "fast"])
def decoder(request, monkeypatch):
    """Every test runs with every decoder build: "wide" takes single-symbol lookups for the
    small frames here, "wide-pair" forces the pair build that large frames get, "fast" is
    round 3's decoder; each must read exactly the frames the CPU reads."""
    from uzip_serve.kernels import cuda as kc

    monkeypatch.setattr(kc, "DECODER", request.param)
    return request.param


def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


def random_tensor(dtype, n, seed=0, kind="bits"):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal" and dtype.is_floating_point and dtype.itemsize >= 2:
        return (torch.randn(n, generator=g) * 0.02).to(dtype)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype) if n else torch.empty(0, dtype=dtype)


def check_both_ways(x):
    """GPU frame -> CPU and GPU decoders; CPU frame -> GPU decoder; all bit-exact."""
    xg = x.to(DEV)
    gframe = uz.compress(xg)
    fmt.parse_header(gframe, uz.codec.get_backend("cpu").crc32c)
    y_cpu = uz.decompress(gframe)
    assert y_cpu.dtype == x.dtype and tuple(y_cpu.shape) == tuple(x.shape)
    assert torch.equal(bits(y_cpu), bits(x)), "GPU frame decoded wrong on the CPU"
    y_gpu = uz.decompress(gframe, device="cuda")
    assert y_gpu.is_cuda and torch.equal(bits(y_gpu), bits(x)), "GPU frame decoded wrong on the GPU"
    cframe = uz.compress(x)
    y2 = uz.decompress(cframe, device="cuda")
    assert y2.is_cuda and torch.equal(bits(y2), bits(x)), "CPU frame decoded wrong on the GPU"
    return gframe, cframe


def test_crc_par_matches_cpu():
    """The slot-parallel CRC32C (crc_par) against the CPU at every alignment and at lengths
    around its 128-byte slots and 512-thread rounds."""
    from uzip_serve.kernels import cuda as kc

    crc = uz.codec.get_backend("cpu").crc32c
    g = torch.Generator().manual_seed(5)
    buf = torch.randint(0, 256, (300_000,), dtype=torch.uint8, generator=g)
    dev = buf.to(DEV)
    for off in (0, 1, 2, 3, 5, 8, 15):
        for n in (0, 1, 3, 4, 17, 127, 128, 129, 255, 1000, 65535, 65536, 65537, 131072 + 17, 200_000):
            got = kc.crc32c_segments(dev[off:off + n], max(n, 1))
            assert (int(got[0]) & 0xFFFFFFFF) == crc(buf[off:off + n].numpy().tobytes()), (off, n)
    segs = kc.crc32c_segments(dev[3:], 1000)
    for i in range(0, segs.numel(), 37):
        assert (int(segs[i]) & 0xFFFFFFFF) == crc(buf[3 + 1000 * i:3 + 1000 * (i + 1)].numpy().tobytes())


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_every_size(dtype):
    for i, n in enumerate(SIZES):
        for kind in ("bits", "normal"):
            check_both_ways(random_tensor(dtype, n, seed=i, kind=kind))


def test_shapes_and_strided():
    x = (torch.randn(3, 5, 70, 300) * 0.02).to(torch.bfloat16)
    check_both_ways(x)
    check_both_ways(x.transpose(1, 3))  # non-contiguous: gathered first
    check_both_ways(torch.tensor(1.5, dtype=torch.float32))  # 0-d


@pytest.mark.parametrize("maker", [
    lambda: torch.zeros(200_000, dtype=torch.bfloat16),
    lambda: torch.full((150_000,), 3.0, dtype=torch.float16),
    lambda: torch.full((70_000,), -0.0, dtype=torch.float32),
    lambda: torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0] * 40_000, dtype=torch.float32),
    lambda: (torch.randn(300_000) * 1e-3).to(torch.float32),
    lambda: torch.randn(300_000).to(torch.float16),
    lambda: (torch.randn(300_000) * 50).to(torch.bfloat16),
    lambda: torch.where(torch.rand(300_000) < 0.9, 0.0, torch.randn(300_000)).to(torch.float32),  # sparse
], ids=["zeros", "const-fp16", "negzero", "specials", "fp32", "fp16", "bf16-wide", "sparse-fp32"])
def test_special_tensors(maker):
    check_both_ways(maker())


def test_real_tensors():
    """Real Gemma-3 / MiniLM tensors: the slice benchmarks/codec_gpu.py uses
    ($UZIP_GPU_DATA, default .gpudata/real.safetensors), else the realdata cache."""
    path = Path(os.environ.get("UZIP_GPU_DATA", Path(__file__).resolve().parents[1] / ".gpudata/real.safetensors"))
    if path.exists():
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    else:
        from benchmarks import realdata as rd

        try:
            tensors = {**rd.load("minilm_weights"), **rd.load("gemma_activations")}
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"no real tensors here: {e}")
    assert tensors
    for key, t in tensors.items():
        for dt in {t.dtype, torch.bfloat16, torch.float16}:
            check_both_ways(t.to(dt).contiguous())


def test_device_api_and_capture_safe_variant():
    x = (torch.randn(1 << 20, device=DEV) * 0.02).to(torch.bfloat16)
    cap = uz.max_compressed_size(x.numel() * 2, x.dtype)
    out = torch.empty(cap, dtype=torch.uint8, device=DEV)
    n = codec.compress_device(x, out)
    assert torch.equal(bits(codec.decompress_device(out[:n])), bits(x))
    # capture-safe: size in device memory, no sync; also inside a CUDA graph
    size = torch.zeros(1, dtype=torch.int64, device=DEV)
    out2 = torch.zeros_like(out)
    codec.compress_device_async(x, out2, size)
    torch.cuda.synchronize()
    assert int(size.item()) == n and torch.equal(out2[:n].cpu(), out[:n].cpu())
    out3 = torch.zeros_like(out)
    size3 = torch.zeros(1, dtype=torch.int64, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        codec.compress_device_async(x, out3, size3)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    out3.zero_()
    with torch.cuda.graph(g):
        codec.compress_device_async(x, out3, size3)
    g.replay()
    torch.cuda.synchronize()
    assert int(size3.item()) == n and torch.equal(out3[:n].cpu(), out[:n].cpu())
    # decode without a host sync: errors come back as a device word
    hdr = uz.read_header(out[:n].cpu().numpy().tobytes())
    y, err = codec.decompress_device(out[:n], header=hdr, check=False)
    assert int(err.item()) == -1 and torch.equal(bits(y), bits(x))


def test_compress_into_host_buffer():
    x = (torch.randn(100_000, device=DEV) * 0.02).to(torch.bfloat16)
    buf = bytearray(uz.max_compressed_size(x.numel() * 2, x.dtype))
    n = uz.compress_into(x, buf)
    assert torch.equal(bits(uz.decompress(buf[:n])), bits(x))


# ---- corruption: every class from tests/test_codec_corruption.py, decoded on the GPU ----

def gpu_decode_exact_or_error(original, frame) -> bool:
    try:
        y = uz.decompress(frame, device="cuda")
    except uz.FrameError:
        return False
    assert y.dtype == original.dtype and tuple(y.shape) == tuple(original.shape)
    assert torch.equal(bits(y), bits(original)), "GPU decoded wrong bits without raising"
    return True


GPU_FRAMES = [(t, bytes(uz.compress(t.to(DEV)))) for t, _ in corr.FRAMES]


@pytest.mark.parametrize("which", ["cpu", "gpu"])
@pytest.mark.parametrize("index", range(len(corr.FRAMES)))
def test_bit_flips_detected_on_gpu(which, index):
    _, frame = corr.FRAMES[index] if which == "cpu" else GPU_FRAMES[index]
    for bad in corr.single_bit_flips(frame, seed=index, payload_samples=300):
        with pytest.raises(uz.FrameError):
            uz.decompress(bad, device="cuda")


@pytest.mark.parametrize("index", range(len(corr.FRAMES)))
def test_truncated_extended_on_gpu(index):
    _, frame = corr.FRAMES[index]
    for cut in (0, 1, 39, 40, len(frame) // 2, len(frame) - 1):
        with pytest.raises(uz.FrameError):
            uz.decompress(frame[:cut], device="cuda")
    with pytest.raises(uz.FrameError, match="extended"):
        uz.decompress(frame + b"\0", device="cuda")
    dev = torch.frombuffer(bytearray(frame[: len(frame) // 2]), dtype=torch.uint8).to(DEV)
    with pytest.raises(uz.FrameError):
        codec.decompress_device(dev)


def test_block_table_lies_on_gpu():
    import struct

    for _, frame in (corr.FRAMES[0], (None, GPU_FRAMES[0][1])):
        h = uz.read_header(frame)
        for delta in (-1, 1, 1 << 30):
            bad = bytearray(frame)
            (size,) = struct.unpack_from("<I", bad, h.table_offset)
            struct.pack_into("<I", bad, h.table_offset, (size + delta) % (1 << 32))
            with pytest.raises(uz.FrameError):
                uz.decompress(corr.with_fresh_header_crc(bad), device="cuda")


def test_fuzz_mutations_on_gpu():
    """Mutated frames (half with consistent checksums, reaching the structural checks):
    the GPU either decodes the exact original or raises FrameError, like the CPU."""
    rng = random.Random(777)
    corpus = corr.small_fuzz_corpus()
    corpus += [(t, bytes(uz.compress(t.to(DEV)))) for t, _ in corpus]
    n = int(os.environ.get("UZIP_GPU_FUZZ", "3000"))
    survived = 0
    for i in range(n):
        original, frame = corpus[i % len(corpus)]
        bad = corr.mutate(frame, rng)
        if i % 2:
            bad = corr.refresh_all_checksums(bad)
        cpu_ok = corr.decode_is_exact_or_frame_error(original, bad)
        gpu_ok = gpu_decode_exact_or_error(original, bad)
        assert cpu_ok == gpu_ok, f"mutation {i}: CPU {'accepted' if cpu_ok else 'refused'}, GPU disagrees"
        survived += gpu_ok
    assert survived < n // 10
