"""GPU codec benchmark: uzip's CUDA kernels against nvCOMP (ANS, Bitcomp) in the same process.

Data: real tensors (Gemma-3 weights, activations and KV, MiniLM weights in fp32 and bf16; a
slice made here by `--make-slice` from benchmarks/realdata.py's cache, small enough to carry to
a GPU machine) tiled up to each size, and bf16 N(0, 0.02) generated on the device. Sizes 1 MiB
.. 1 GiB; inputs rotate among several copies so they do not sit in L2. CUDA events around each
call (Python and launch overhead included), median of --repeats runs after warm-up; up to
64 MiB also the capture-safe calls replayed from CUDA graphs, timed as GPU time alone (queued
behind a spin kernel, gpu_time_ms) and host-paced (time_ms, graph launch included). GB/s count
ORIGINAL bytes. Every frame is checked bit-exact on the GPU, and up to 64 MiB GPU frames are
decoded on the CPU and CPU frames on the GPU. The floor is a kernel that only splits bf16 into
its two planes (memory speed). Writes codec_gpu.json / codec_gpu.png to --out.

    python -m benchmarks.codec_gpu --make-slice .gpudata/real.safetensors    # here, once
    python -m benchmarks.codec_gpu --data .gpudata/real.safetensors --out docs/benchmarks

--hash-micro times UZH64 alone; --profile prints per-kernel GPU times (torch profiler).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import uzip_serve as uz
from uzip_serve import codec

MiB = 1 << 20
SIZES = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB]
NVCOMP = ("nvcomp-ANS-256K", "nvcomp-ANS-256K-batched", "nvcomp-ANS-default", "nvcomp-Bitcomp")

SPLIT_SRC = r"""
extern "C" __global__ void split_bf16(const uint4* __restrict__ in, uint2* __restrict__ e, uint2* __restrict__ m,
                                      unsigned long long n16) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n16;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        uint4 v = in[i];
        unsigned w[4] = {v.x, v.y, v.z, v.w}, ee[2] = {0, 0}, mm[2] = {0, 0};
        for (int k = 0; k < 8; k++) {
            unsigned x = (w[k / 2] >> (16 * (k & 1))) & 0xFFFF;
            ee[k / 4] |= ((x >> 7) & 0xFF) << (8 * (k & 3));
            mm[k / 4] |= (((x >> 8) & 0x80) | (x & 0x7F)) << (8 * (k & 3));
        }
        e[i] = make_uint2(ee[0], ee[1]);
        m[i] = make_uint2(mm[0], mm[1]);
    }
}
"""


def time_ms(fn, repeats: int, warmup: int = 2) -> float:
    """Median of `repeats` calls fn(r) timed with CUDA events, after `warmup` calls. The GPU
    is idle when the start event is recorded, so the time also holds whatever the host spends
    launching fn's work: a call's time, as a caller without a queue in front of it sees it."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for r in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(r)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


# About 0.5 ms of spinning at Hopper's clocks: far longer than the host needs to enqueue an
# event, a graph replay and an event (10-30 us), which gpu_time_ms checks on every call.
SPIN_CYCLES = 1_000_000


def gpu_time_ms(fn, repeats: int, warmup: int = 2) -> tuple[float, bool]:
    """Median GPU time of fn(r)'s work, and whether every timed call was queued in time.

    A spin kernel runs before the start event, so the host enqueues the start event, fn's work
    and the end event while the GPU is still busy, and the events bracket the work alone: the
    time the same kernels take inside a larger graph or behind other work, where nothing waits
    for the host (the way nvbench times kernels). time_ms's figure for the same fn is higher by
    the host's launch time. The check: the host must finish enqueueing before the spin ends."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times, queued = [], True
    for r in range(repeats):
        b, s, e = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        b.record()
        torch.cuda._sleep(SPIN_CYCLES)
        t0 = time.perf_counter()
        s.record()
        fn(r)
        e.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        e.synchronize()
        queued &= b.elapsed_time(s) > host_ms
        times.append(s.elapsed_time(e))
    return statistics.median(times), bool(queued)


def tile(src: torch.Tensor, nbytes: int) -> torch.Tensor:
    n = nbytes // src.element_size()
    reps = -(-n // src.numel())
    return src.repeat(reps)[:n].contiguous()


def make_slice(path: Path) -> None:
    """A few MB of each real data set, from realdata's cache, for a GPU machine."""
    from safetensors.torch import save_file

    from benchmarks import realdata

    def sample(tensors, mbytes, dtype):
        parts, total = [], 0
        per = max(1, int(mbytes * 1e6 / max(1, len(tensors))))
        for t in tensors.values():
            flat = t.reshape(-1).to(dtype)
            take = flat[: per // flat.element_size()]
            parts.append(take)
            total += take.nbytes
        return torch.cat(parts).contiguous()

    g = realdata.load("gemma_weights")
    out = {"gemma-weights-bf16": sample(g, 6, torch.bfloat16),
           "gemma-acts-kv-bf16": sample(realdata.load("gemma_activations"), 6, torch.bfloat16),
           "minilm-weights-fp32": sample(realdata.load("minilm_weights"), 4, torch.float32)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path))
    print(f"wrote {path}: " + ", ".join(f"{k} {v.nbytes / 1e6:.1f} MB" for k, v in out.items()))


def load_real(path: str | None) -> dict[str, torch.Tensor]:
    if not path or not Path(path).exists():
        return {}
    from safetensors.torch import load_file

    out = dict(load_file(path))
    if "minilm-weights-fp32" in out:
        out["minilm-weights-bf16"] = out["minilm-weights-fp32"].to(torch.bfloat16)
    return out


def capacity(x: torch.Tensor) -> int:
    """Frame buffer bytes for x: max_compressed_size for the block size the GPU encoder will
    take, which $UZIP_GPU_BLOCK_ELEMS (--sweep) may set below the default bound's."""
    from uzip_serve import format as fmt
    from uzip_serve.kernels import cuda as kc

    return fmt.max_compressed_size(x.numel() * x.element_size(), str(x.dtype).removeprefix("torch."),
                                   block_elems=kc.encoder_block_elems(x.numel()))


def ours(xs, repeats: int, check_cpu: bool, graphs: bool) -> dict:
    x = xs[0]
    nbytes = x.numel() * x.element_size()
    cap = capacity(x)
    outs = [torch.empty(cap, dtype=torch.uint8, device="cuda") for _ in xs]
    size = torch.zeros(1, dtype=torch.int64, device="cuda")
    sizes = [codec.compress_device(xi, oi) for xi, oi in zip(xs, outs)]
    hdrs = [uz.read_header(o[:m].cpu().numpy().tobytes()) for o, m in zip(outs, sizes)]
    ys = [torch.empty_like(x) for _ in xs]
    exact = True
    for xi, oi, m, h, yi in zip(xs, outs, sizes, hdrs, ys):
        codec.decompress_device(oi[:m], header=h, out=yi)
        exact &= torch.equal(yi.view(torch.uint8), xi.view(torch.uint8))
    if check_cpu:
        frame = outs[0][:sizes[0]].cpu().numpy().tobytes()
        exact &= torch.equal(uz.decompress(frame).view(torch.uint8), x.cpu().view(torch.uint8))
        exact &= torch.equal(uz.decompress(uz.compress(x.cpu()), device="cuda").view(torch.uint8), x.view(torch.uint8))
    k = len(xs)
    res = {"ratio": sizes[0] / nbytes, "exact": bool(exact), "substream": hdrs[0].substream_elems,
           "block_elems": hdrs[0].block_elems,
           "c_ms": time_ms(lambda r: codec.compress_device_async(xs[r % k], outs[r % k], size), repeats),
           "d_ms": time_ms(lambda r: codec.decompress_device(outs[r % k][:sizes[r % k]], header=hdrs[r % k],
                                                              out=ys[r % k], check=False), repeats)}
    if graphs:
        res.update(graph_times(xs, outs, sizes, hdrs, ys, repeats))
    return res


def capture(fn) -> "torch.cuda.CUDAGraph":
    """fn captured in a CUDA graph, after one warm-up call on a side stream (as torch asks)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_times(xs, outs, sizes, hdrs, ys, repeats) -> dict:
    """The capture-safe calls replayed from CUDA graphs (GPU time, no Python or launch
    overhead): compress alone, decompress alone, and compress + decompress in one graph. One
    graph per input copy, replayed in turn, so inputs still rotate."""
    size = torch.zeros(1, dtype=torch.int64, device="cuda")

    def steps(i):
        dec = lambda: codec.decompress_device(outs[i][:sizes[i]], header=hdrs[i], out=ys[i], check=False)  # noqa: E731
        enc = lambda: codec.compress_device_async(xs[i], outs[i], size)  # noqa: E731
        return {"c": enc, "d": dec, "cd": lambda: (enc(), dec())}

    res = {}
    for key in ("c", "d", "cd"):
        graphs = [capture(steps(i)[key]) for i in range(len(xs))]
        res.update(graph_replay_times(f"graph_{key}", graphs, repeats))
    torch.cuda.synchronize()
    return res


def graph_replay_times(key: str, graphs, repeats: int) -> dict:
    """The graphs replayed in turn, timed both ways: GPU time (gpu_time_ms: {key}_ms) and with
    the host's graph launch in it (time_ms: {key}_host_paced_ms)."""
    n = max(repeats, 20)
    replay = lambda r: graphs[r % len(graphs)].replay()  # noqa: E731
    ms, queued = gpu_time_ms(replay, n)
    return {f"{key}_ms": ms, f"{key}_queued": queued, f"{key}_host_paced_ms": time_ms(replay, n)}


def nvcomp_configs(dtype):
    hint = "<f2" if dtype in (torch.bfloat16, torch.float16) else "<f4"
    return {"nvcomp-ANS-256K": dict(algorithm="ANS", uncomp_chunk_size=1 << 18, data_type=hint),
            "nvcomp-ANS-default": dict(algorithm="ANS"),
            "nvcomp-Bitcomp": dict(algorithm="Bitcomp")}


def run_nvcomp(nvcomp, kw, xs, repeats) -> dict:
    """nvCOMP through its Python API (nvidia.nvcomp.Codec), which allocates each output."""
    try:
        cdc = nvcomp.Codec(**kw)
    except Exception:  # noqa: BLE001 - an older nvCOMP without the type hint
        kw = {k: v for k, v in kw.items() if k != "data_type"}
        cdc = nvcomp.Codec(**kw)
    arrs = [nvcomp.as_array(x.view(torch.uint8)) for x in xs]
    encs = [cdc.encode(a) for a in arrs]
    torch.cuda.synchronize()
    back = torch.as_tensor(cdc.decode(encs[0]), device="cuda").view(torch.uint8).reshape(-1)
    torch.cuda.synchronize()
    nbytes = xs[0].numel() * xs[0].element_size()
    k = len(xs)
    return {"ratio": encs[0].buffer_size / nbytes, "kw": str(kw),
            "exact": bool(torch.equal(back, xs[0].view(torch.uint8).reshape(-1))),
            "c_ms": time_ms(lambda r: cdc.encode(arrs[r % k]), repeats),
            "d_ms": time_ms(lambda r: cdc.decode(encs[r % k]), repeats)}


def run_nvcomp_batched(xs, repeats) -> dict:
    """nvCOMP ANS, 256 KiB chunks, type hint, through the batched C API with every buffer
    allocated once (benchmarks/nvcomp_batched.py): the call the issue's bars came from."""
    from benchmarks.nvcomp_batched import BatchedANS, hint

    nbytes = xs[0].numel() * xs[0].element_size()
    cods = [BatchedANS(nbytes, hint(xs[0].dtype)) for _ in xs]
    ys = [torch.empty_like(x) for x in xs]
    for c, x, y in zip(cods, xs, ys):
        c.compress(x)
        c.decompress(y)
    torch.cuda.synchronize()
    exact = all(torch.equal(y.view(torch.uint8), x.view(torch.uint8)) for x, y in zip(xs, ys))
    k = len(xs)
    res = {"ratio": cods[0].compressed_bytes() / nbytes, "exact": bool(exact),
           "failed_chunks": sum(c.failed_chunks() for c in cods), "kw": "batched C API, 256 KiB, type hint",
           "c_ms": time_ms(lambda r: cods[r % k].compress(xs[r % k]), repeats),
           "d_ms": time_ms(lambda r: cods[r % k].decompress(ys[r % k]), repeats)}
    if nbytes <= 64 * MiB:  # compress + decompress replayed from one CUDA graph, as uzip's graph_cd
        try:
            graphs = [capture(lambda c=c, x=x, y=y: (c.compress(x), c.decompress(y))) for c, x, y in zip(cods, xs, ys)]
            res.update(graph_replay_times("graph_cd", graphs, repeats))
        except Exception as e:  # noqa: BLE001 - nvCOMP may refuse capture; say so in the JSON
            res["graph_error"] = repr(e)[:200]
    return res


def split_floor(xs, repeats) -> dict:
    """The memory floor: split bf16 into its exponent and sign+mantissa planes, nothing else."""
    import cupy

    kern = cupy.RawKernel(SPLIT_SRC, "split_bf16")
    n16 = xs[0].numel() * 2 // 16
    e = torch.empty(xs[0].numel(), dtype=torch.uint8, device="cuda")
    m = torch.empty_like(e)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def go(r):
        kern((sms * 16,), (256,), (xs[r % len(xs)].data_ptr(), e.data_ptr(), m.data_ptr(), cupy.uint64(n16)),
             stream=stream)

    return {"ms": time_ms(go, repeats)}


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def report(row: dict) -> None:
    size, u = row["bytes"], row["uzip"]
    line = (f"{row['data']:22s} {size // MiB:5d} MiB  uzip r={u['ratio']:.4f} S={u['substream']:4d} "
            f"c={gbps(size, u['c_ms']):7.1f} GB/s ({u['c_ms'] * 1e3:7.1f} us) "
            f"d={gbps(size, u['d_ms']):7.1f} GB/s ({u['d_ms'] * 1e3:7.1f} us) exact={u['exact']}")
    if "graph_c_ms" in u:
        line += (f"  graph c/d/c+d {u['graph_c_ms'] * 1e3:.1f}/{u['graph_d_ms'] * 1e3:.1f}/{u['graph_cd_ms'] * 1e3:.1f} us"
                 f" (host-paced c+d {u['graph_cd_host_paced_ms'] * 1e3:.1f}, queued={u['graph_cd_queued']})")
    print(line, flush=True)
    for cname in NVCOMP:
        r = row.get(cname)
        if r and "ratio" in r:
            print(f"{'':33s}{cname:18s} r={r['ratio']:.4f} c={gbps(size, r['c_ms']):7.1f} d={gbps(size, r['d_ms']):7.1f}"
                  f" GB/s ({r['c_ms'] * 1e3:.1f} / {r['d_ms'] * 1e3:.1f} us) exact={r['exact']}"
                  + (f"  graph c+d {r['graph_cd_ms'] * 1e3:.1f} us (host-paced {r['graph_cd_host_paced_ms'] * 1e3:.1f})"
                     if "graph_cd_ms" in r else ""), flush=True)
        elif r:
            print(f"{'':33s}{cname}: {r['error']}")
    if "split-floor" in row:
        print(f"{'':33s}split floor {gbps(size, row['split-floor']['ms']):7.1f} GB/s")


def machine() -> dict:
    stamp = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "python": platform.python_version(), "format": uz.FORMAT_VERSION}
    try:
        import cupy

        stamp["cupy"] = cupy.__version__
        stamp["driver"] = cupy.cuda.runtime.driverGetVersion()
        import subprocess

        stamp["driver_version"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                                 capture_output=True, text=True).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    try:
        from importlib.metadata import version

        stamp["nvcomp"] = version("nvidia-nvcomp-cu13")
    except Exception:  # noqa: BLE001
        pass
    return stamp


def plot(results, stamp, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = [r for r in results if r["data"] == "normal-bf16"]
    for ax, key, title in ((axes[0], "c_ms", "compress"), (axes[1], "d_ms", "decompress")):
        for cname in ("uzip",) + NVCOMP:
            pts = [(r["bytes"] / MiB, gbps(r["bytes"], r[cname][key])) for r in rows if key in r.get(cname, {})]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=cname)
        pts = [(r["bytes"] / MiB, gbps(r["bytes"], r["split-floor"]["ms"])) for r in rows if "split-floor" in r]
        if pts:
            ax.plot(*zip(*pts), linestyle=":", color="gray", label="split only (memory floor)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("MiB (bf16 N(0, 0.02))")
        ax.set_ylabel("GB/s of original bytes")
        ax.set_title(f"{title}, {stamp['gpu']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "codec_gpu.png", dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".gpudata/real.safetensors")
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sizes", default=",".join(str(s // MiB) for s in SIZES), help="MiB, comma-separated")
    ap.add_argument("--no-nvcomp", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated data names (default: all)")
    ap.add_argument("--make-slice", metavar="PATH", help="write the real-data slice for a GPU machine and exit")
    ap.add_argument("--hash-micro", action="store_true", help="time UZH64 alone (1 GiB in 128 KiB segments)")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU times at 1 MiB and 256 MiB")
    ap.add_argument("--once", type=int, metavar="MIB",
                    help="one warm-up, then one compress and one decompress of MIB of bf16: a target for ncu")
    ap.add_argument("--once-nvcomp", action="store_true", help="with --once: nvCOMP's batched ANS as well")
    ap.add_argument("--sweep", metavar="BE:S,...",
                    help="block and sub-stream sizes to compare (graph times and ratio, bf16 N(0, 0.02) and "
                         "Gemma-3 weights), e.g. 4096:128,65536:256; writes codec_gpu_sweep.json")
    ap.add_argument("--phases", action="store_true",
                    help="cycles per kernel phase (needs UZIP_CUDA_CUBIN built with -DUZ_PHASES)")
    args = ap.parse_args(argv)
    if args.make_slice:
        return make_slice(Path(args.make_slice))
    if args.hash_micro:
        return hash_micro(args.repeats)
    if args.profile:
        return profile_kernels()
    if args.once:
        return once(args.once * MiB, args.once_nvcomp)
    if args.sweep:
        return sweep([int(s) * MiB for s in args.sizes.split(",")], args.sweep, args.repeats, args.data,
                     Path(args.out))
    if args.phases:
        return phases([int(s) * MiB for s in args.sizes.split(",")], args.repeats)
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    torch.manual_seed(0)
    base = {"normal-bf16": None}
    base.update({k: v.cuda() for k, v in load_real(args.data).items()})
    nvcomp = None
    if not args.no_nvcomp:
        try:
            from nvidia import nvcomp as _nv

            nvcomp = _nv
        except ImportError as e:
            print("nvCOMP unavailable:", e)
    only = [o for o in args.only.split(",") if o]
    results = []
    stamp = machine()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, src in base.items():
        if only and name not in only:
            continue
        for size in sizes:
            if name != "normal-bf16" and size > 256 * MiB:
                continue
            x0 = (torch.randn(size // 2, device="cuda") * 0.02).to(torch.bfloat16) if src is None else tile(src, size)
            copies = max(2, min(4, (2048 * MiB) // size))
            xs = [x0] + [x0.roll(i * 4099) for i in range(1, copies)]
            row = {"data": name, "dtype": str(x0.dtype).removeprefix("torch."), "bytes": size}
            row["uzip"] = ours(xs, args.repeats, check_cpu=size <= 64 * MiB, graphs=size <= 64 * MiB)
            if x0.dtype == torch.bfloat16:
                row["split-floor"] = split_floor(xs, args.repeats)
            if nvcomp is not None and (name == "normal-bf16" or size in (MiB, 64 * MiB)):
                for cname, kw in nvcomp_configs(x0.dtype).items():
                    try:
                        row[cname] = run_nvcomp(nvcomp, kw, xs, args.repeats)
                    except Exception as e:  # noqa: BLE001
                        row[cname] = {"error": repr(e)[:200]}
                try:
                    row["nvcomp-ANS-256K-batched"] = run_nvcomp_batched(xs, args.repeats)
                except Exception as e:  # noqa: BLE001
                    row["nvcomp-ANS-256K-batched"] = {"error": repr(e)[:200]}
            results.append(row)
            report(row)
            # after every row: a run cut short by its time limit still leaves what it measured
            (out / "codec_gpu.json").write_text(json.dumps({"machine": stamp, "results": results}, indent=1))
            del xs, x0
            torch.cuda.empty_cache()
    try:
        plot(results, stamp, out)
    except Exception as e:  # noqa: BLE001
        print("no plot:", e)


def hash_micro(repeats):
    """UZH64 alone, against the specification's numpy version on the first segments."""
    from uzip_serve import format as fmt

    gpu = codec.get_backend("cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    data = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device="cuda", generator=g)
    for seg in (128 * 1024, 87 * 1024 + 5):
        got = gpu.hash_segments(data, seg)
        head = data[: 3 * seg].cpu().numpy().tobytes()
        ok = all((int(got[i]) & ((1 << 64) - 1)) == fmt.uzh64_reference(head[i * seg:(i + 1) * seg]) for i in range(3))
        ms = time_ms(lambda r: gpu.hash_segments(data, seg), repeats)
        print(f"UZH64 seg={seg}: {gbps(data.numel(), ms):7.1f} GB/s  correct={ok}", flush=True)


ENC_MARKS = ["read+hist", "hist reduce+sort", "lengths", "codes+bits", "sizes+scan", "layout", "look-back",
             "RAW planes", "HUFF streams", "hash HUFF", "", "", "", "", "sums+entry"]
DEC_MARKS = ["entry", "window", "parse", "hash+LUT", "decode", "merge", "", "", "", "", "", "", "", "", "sums"]


def phases(sizes, repeats):
    """Mean cycles of thread 0 between the phase marks of cuda_codec.cu (a -DUZ_PHASES build)."""
    import cupy

    gpu = codec.get_backend("cuda")
    gpu.load(0)
    acc = cupy.ndarray((2, 16), dtype=cupy.uint64, memptr=gpu._rt.module(0).get_global("uz_phase_cycles"))
    for size in sizes:
        x = (torch.randn(size // 2, device="cuda") * 0.02).to(torch.bfloat16)
        out = torch.empty(capacity(x), dtype=torch.uint8, device="cuda")
        n = codec.compress_device(x, out)
        hdr = uz.read_header(out[:n].cpu().numpy().tobytes())
        y = torch.empty_like(x)
        codec.decompress_device(out[:n], header=hdr, out=y)
        torch.cuda.synchronize()
        acc.fill(0)
        size_t = torch.zeros(1, dtype=torch.int64, device="cuda")
        c_ms = time_ms(lambda r: codec.compress_device_async(x, out, size_t), repeats, warmup=0)
        d_ms = time_ms(lambda r: codec.decompress_device(out[:n], header=hdr, out=y, check=False), repeats, warmup=0)
        a = acc.get().astype("float64")
        print(f"--- {size // MiB} MiB bf16: compress {c_ms * 1e3:.1f} us, decompress {d_ms * 1e3:.1f} us "
              f"(one call each; {hdr.num_blocks} blocks)")
        for k, (marks, ms) in enumerate(((ENC_MARKS, c_ms), (DEC_MARKS, d_ms))):
            blocks = max(1.0, a[k][15])
            per = a[k][:15] / blocks
            total = per.sum()
            print(f"  {'encoder' if k == 0 else 'decoder'}: {total:8.0f} cycles per block (thread 0), "
                  f"{blocks / repeats:.0f} blocks per call")
            print("    " + "  ".join(f"{m}={v:.0f}" for m, v in zip(marks, per) if m and v))
        del x, out, y


def sweep(sizes, spec: str, repeats: int, data: str, out: Path) -> None:
    """The capture-safe calls from CUDA graphs for each block:sub-stream setting (through
    $UZIP_GPU_BLOCK_ELEMS / $UZIP_GPU_SUBSTREAM), with each frame's ratio and a bit-exact check."""
    import os

    configs = [tuple(int(v) for v in c.split(":")) for c in spec.split(",")]
    real = load_real(data).get("gemma-weights-bf16")
    rows = []
    for size in sizes:
        torch.manual_seed(0)
        sets = {"normal-bf16": (torch.randn(size // 2, device="cuda") * 0.02).to(torch.bfloat16)}
        if real is not None:
            sets["gemma-weights-bf16"] = tile(real.cuda(), size)
        for name, x0 in sets.items():
            xs = [x0] + [x0.roll(i * 4099) for i in range(1, 4)]
            for be, ss in configs:
                os.environ["UZIP_GPU_BLOCK_ELEMS"], os.environ["UZIP_GPU_SUBSTREAM"] = str(be), str(ss)
                try:
                    r = ours(xs, repeats, check_cpu=False, graphs=True)
                finally:
                    del os.environ["UZIP_GPU_BLOCK_ELEMS"], os.environ["UZIP_GPU_SUBSTREAM"]
                row = {"data": name, "bytes": size, "block_elems": be, "substream": ss, **r}
                rows.append(row)
                print(f"{name:20s} {size // MiB:5d} MiB  be={be:6d} S={ss:5d}  ratio={r['ratio']:.4f}  "
                      f"graph c/d/c+d = {r['graph_c_ms'] * 1e3:6.1f} / {r['graph_d_ms'] * 1e3:6.1f} / "
                      f"{r['graph_cd_ms'] * 1e3:6.1f} us (host-paced c+d {r['graph_cd_host_paced_ms'] * 1e3:6.1f})  "
                      f"exact={r['exact']}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codec_gpu_sweep.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


def once(size, with_nvcomp=False):
    """Under ncu: `ncu --launch-skip 2 --launch-count 2 -k regex:uz_ python -m benchmarks.codec_gpu --once 64`
    profiles exactly one compress and one decompress after a warm-up of each. With
    `--once-nvcomp`, nvCOMP's batched ANS follows on the same tensor, and each library's
    measured calls sit in an NVTX range ("uz", "nvcomp") that `ncu --nvtx --nvtx-include`
    selects, whatever nvCOMP's kernels are called."""
    x = (torch.randn(size // 2, device="cuda") * 0.02).to(torch.bfloat16)
    out = torch.empty(uz.max_compressed_size(size, x.dtype), dtype=torch.uint8, device="cuda")
    size_t = torch.zeros(1, dtype=torch.int64, device="cuda")
    codec.compress_device_async(x, out, size_t)
    n = int(size_t.item())
    hdr = uz.read_header(out[:n].cpu().numpy().tobytes())
    y = torch.empty_like(x)
    codec.decompress_device(out[:n], header=hdr, out=y, check=False)
    torch.cuda.nvtx.range_push("uz")
    codec.compress_device_async(x, out, size_t)
    codec.decompress_device(out[:n], header=hdr, out=y, check=False)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print("exact:", torch.equal(y.view(torch.uint8), x.view(torch.uint8)))
    if with_nvcomp:
        from benchmarks.nvcomp_batched import BatchedANS, hint

        c = BatchedANS(size, hint(x.dtype))
        c.compress(x)
        c.decompress(y)
        torch.cuda.nvtx.range_push("nvcomp")
        c.compress(x)
        c.decompress(y)
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print("nvcomp exact:", torch.equal(y.view(torch.uint8), x.view(torch.uint8)))


def profile_kernels():
    from torch.profiler import ProfilerActivity, profile

    for mib in (1, 256):
        x = (torch.randn(mib << 19, device="cuda") * 0.02).bfloat16()
        out = torch.empty(uz.max_compressed_size(x.numel() * 2, x.dtype), dtype=torch.uint8, device="cuda")
        size = torch.zeros(1, dtype=torch.int64, device="cuda")
        n = codec.compress_device(x, out)
        hdr = uz.read_header(out[:n].cpu().numpy().tobytes())
        y = torch.empty_like(x)
        codec.decompress_device(out[:n], header=hdr, out=y)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                codec.compress_device_async(x, out, size)
                codec.decompress_device(out[:n], header=hdr, out=y, check=False)
            torch.cuda.synchronize()
        print(f"--- {mib} MiB bf16, 5 x (compress + decompress)")
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=28))


if __name__ == "__main__":
    main()
