"""GPU codec benchmark: uzip's CUDA kernels against nvCOMP (ANS, Bitcomp) in the same process.

Data: real tensors (Gemma-3 weights / activations / KV, MiniLM fp32 weights; a slice made
by `--make-slice` from benchmarks/realdata.py's cache) tiled up to each size, and bf16
N(0, 0.02) generated on the device. Sizes 1 MiB .. 1 GiB; inputs rotate among several
copies so they do not sit in L2. CUDA events, median of --repeats runs after warm-up.
GB/s count ORIGINAL bytes. Every uzip frame is checked bit-exact on the GPU (both decoders),
and (up to 64 MiB) on the CPU decoder too. Decompress is timed for both GPU decoders:
uz_dec_wide (d_ms; its single- or pair-lookup build by frame size) and round 3's uz_dec_fast
(d_fast_ms). Writes codec_gpu.json / codec_gpu.png to --out.

    python -m benchmarks.codec_gpu --data .gpudata/real.safetensors --out docs/benchmarks

Up to 64 MiB it also replays the capture-safe calls from CUDA graphs (GPU time without
Python: graph_c/d/cd_ms). --crc-micro times crc_par alone; --profile prints per-kernel times
(torch profiler) and, for a build with -DUZ_PHASES (UZIP_CUDA_CUBIN), block 0's phase marks.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

import uzip_serve as uz
from uzip_serve import codec
from uzip_serve.kernels import cuda as kc

MiB = 1 << 20
SIZES = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB]

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


def time_ms(fn, inputs, repeats: int, warmup: int = 2) -> float:
    for i in range(warmup):
        fn(inputs[i % len(inputs)], i)
    times = []
    for r in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(inputs[r % len(inputs)], r)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def tile(src: torch.Tensor, nbytes: int) -> torch.Tensor:
    n = nbytes // src.element_size()
    reps = -(-n // src.numel())
    return src.repeat(reps)[:n].contiguous()


def load_real(path: str | None) -> dict[str, torch.Tensor]:
    if not path or not Path(path).exists():
        return {}
    from safetensors.torch import load_file

    t = load_file(path)
    groups = {"gemma-weights-bf16": [v for k, v in t.items() if k.startswith("gemma.")],
              "gemma-acts-kv-bf16": [v for k, v in t.items() if k.startswith("act.")],
              "minilm-weights-fp32": [v for k, v in t.items() if k.startswith("minilm.")]}
    out = {k: torch.cat([x.reshape(-1) for x in v]) for k, v in groups.items() if v}
    if "minilm-weights-fp32" in out:
        out["minilm-weights-bf16"] = out["minilm-weights-fp32"].to(torch.bfloat16)
    return out


def ours(x_list, repeats, check_cpu):
    x = x_list[0]
    cap = uz.max_compressed_size(x.numel() * x.element_size(), x.dtype)
    outs = [torch.empty(cap, dtype=torch.uint8, device="cuda") for _ in x_list]
    size = torch.zeros(1, dtype=torch.int64, device="cuda")
    sizes = []
    for xi, oi in zip(x_list, outs):
        codec.compress_device_async(xi, oi, size)
        sizes.append(int(size.item()))
    n = sizes[0]
    frame_host = outs[0][:n].cpu().numpy().tobytes()
    hdr = uz.read_header(frame_host)
    # bit-exactness: GPU decode, and the CPU decoder on the GPU frame
    y = codec.decompress_device(outs[0][:n], header=hdr)
    exact = torch.equal(y.view(torch.uint8), x.view(torch.uint8))
    if check_cpu:
        exact &= torch.equal(uz.decompress(frame_host).view(torch.uint8), x.cpu().view(torch.uint8))
        cframe = uz.compress(x.cpu())
        exact &= torch.equal(uz.decompress(cframe, device="cuda").view(torch.uint8), x.view(torch.uint8))
    ys = [torch.empty_like(x) for _ in x_list]
    c_ms = time_ms(lambda i, r: codec.compress_device_async(x_list[r % len(x_list)], outs[r % len(outs)], size),
                   list(range(len(x_list))), repeats)
    hdrs = [uz.read_header(o[:m].cpu().numpy().tobytes()) for o, m in zip(outs, sizes)]
    res = {"ratio": n / (x.numel() * x.element_size()), "c_ms": c_ms, "exact": bool(exact)}
    # uz_dec_wide, then round 3's uz_dec_fast on the same frames in the same run
    for key, decoder in (("d_ms", "wide"), ("d_fast_ms", "fast")):
        kc.DECODER = decoder
        try:
            y = codec.decompress_device(outs[0][:n], header=hdr)
            res["exact"] &= torch.equal(y.view(torch.uint8), x.view(torch.uint8))
            res[key] = time_ms(lambda i, r: codec.decompress_device(
                outs[r % len(outs)][:sizes[r % len(outs)]], header=hdrs[r % len(outs)], out=ys[r % len(ys)],
                check=False), list(range(len(x_list))), repeats)
        finally:
            kc.DECODER = "wide"
    if x.numel() * x.element_size() <= 64 * MiB:
        res.update(graph_times(x, outs[0], n, hdrs[0], ys[0], repeats))
    return res


def graph_times(x, out, n, hdr, y, repeats):
    """The capture-safe path replayed from CUDA graphs (no Python or launch overhead):
    compress alone, decompress alone, and compress + decompress in one graph."""
    size = torch.zeros(1, dtype=torch.int64, device="cuda")
    decode = lambda: codec.decompress_device(out[:n], header=hdr, out=y, check=False)  # noqa: E731
    steps = {"c": lambda: codec.compress_device_async(x, out, size), "d": decode, "d_fast": decode,
             "cd": lambda: (codec.compress_device_async(x, out, size), decode())}
    res = {}
    for key, fn in steps.items():
        kc.DECODER = "fast" if key == "d_fast" else "wide"  # the choice is made at capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        res[f"graph_{key}_ms"] = time_ms(lambda i, r: g.replay(), [0], max(repeats, 20))
    kc.DECODER = "wide"
    torch.cuda.synchronize()
    return res


def nvcomp_configs(dtype):
    hint = "<f2" if dtype in (torch.bfloat16, torch.float16) else "<f4"
    return {"nvcomp-ANS-256K": dict(algorithm="ANS", uncomp_chunk_size=1 << 18, data_type=hint),
            "nvcomp-ANS-default": dict(algorithm="ANS"),
            "nvcomp-Bitcomp": dict(algorithm="Bitcomp")}


def run_nvcomp(nvcomp, kw, x_list, repeats):
    try:
        cdc = nvcomp.Codec(**kw)
    except Exception as e:  # noqa: BLE001
        kw = {k: v for k, v in kw.items() if k != "data_type"}
        cdc = nvcomp.Codec(**kw)
    arrs = [nvcomp.as_array(x.view(torch.uint8)) for x in x_list]
    encs = [cdc.encode(a) for a in arrs]
    torch.cuda.synchronize()
    dec = cdc.decode(encs[0])
    torch.cuda.synchronize()
    back = torch.as_tensor(dec, device="cuda").view(torch.uint8).reshape(-1)
    exact = torch.equal(back, x_list[0].view(torch.uint8).reshape(-1))
    nbytes = x_list[0].numel() * x_list[0].element_size()
    ratio = encs[0].buffer_size / nbytes
    c_ms = time_ms(lambda i, r: cdc.encode(arrs[r % len(arrs)]), list(range(len(arrs))), repeats)
    d_ms = time_ms(lambda i, r: cdc.decode(encs[r % len(encs)]), list(range(len(encs))), repeats)
    return {"ratio": ratio, "c_ms": c_ms, "d_ms": d_ms, "exact": bool(exact), "kw": str(kw)}


def split_floor(x_list, repeats):
    import cupy

    k = cupy.RawKernel(SPLIT_SRC, "split_bf16")
    x = x_list[0]
    n16 = x.numel() * 2 // 16
    e = torch.empty(x.numel(), dtype=torch.uint8, device="cuda")
    m = torch.empty_like(e)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def go(i, r):
        xi = x_list[r % len(x_list)]
        k((132 * 16,), (256,), (xi.data_ptr(), e.data_ptr(), m.data_ptr(), cupy.uint64(n16)), stream=stream)

    return {"ms": time_ms(go, [0], repeats)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".gpudata/real.safetensors")
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sizes", default=",".join(str(s // MiB) for s in SIZES))
    ap.add_argument("--no-nvcomp", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated data names (default: all)")
    ap.add_argument("--crc-micro", action="store_true", help="time crc_par alone (1 GiB in 128 KiB segments)")
    ap.add_argument("--profile", action="store_true", help="per-kernel times (torch profiler) at 1 MiB and 256 MiB")
    args = ap.parse_args(argv)
    if args.crc_micro:
        return crc_micro(args.repeats)
    if args.profile:
        return profile_kernels()
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    torch.manual_seed(0)
    base = {"normal-bf16": (torch.randn(64 * MiB, device="cuda") * 0.02).to(torch.bfloat16)}
    base.update({k: v.cuda() for k, v in load_real(args.data).items()})
    nvcomp = None
    if not args.no_nvcomp:
        try:
            from nvidia import nvcomp as _nv

            nvcomp = _nv
        except ImportError as e:
            print("nvCOMP unavailable:", e)
    results = []
    only = [o for o in args.only.split(",") if o]
    for name, src in base.items():
        if only and name not in only:
            continue
        for size in sizes:
            if name != "normal-bf16" and size > 256 * MiB:
                continue
            if name == "normal-bf16" and size > src.numel() * 2:
                x0 = (torch.randn(size // 2, device="cuda") * 0.02).to(torch.bfloat16)
            else:
                x0 = tile(src, size)
            copies = max(2, min(4, (2048 * MiB) // size))
            xs = [x0] + [x0.roll(i * 4099) for i in range(1, copies)]
            row = {"data": name, "dtype": str(x0.dtype).removeprefix("torch."), "bytes": size}
            row["uzip"] = ours(xs, args.repeats, check_cpu=size <= 64 * MiB)
            if x0.dtype == torch.bfloat16:
                row["split-floor"] = split_floor(xs, args.repeats)
            if nvcomp is not None and (name == "normal-bf16" or size in (MiB, 64 * MiB)):
                for cname, kw in nvcomp_configs(x0.dtype).items():
                    try:
                        row[cname] = run_nvcomp(nvcomp, kw, xs, args.repeats)
                    except Exception as e:  # noqa: BLE001
                        row[cname] = {"error": repr(e)[:200]}
            results.append(row)
            u = row["uzip"]
            print(f"{name:22s} {size // MiB:5d} MiB  uzip r={u['ratio']:.4f} c={size / u['c_ms'] / 1e6:7.1f} GB/s "
                  f"({u['c_ms'] * 1e3:8.1f} us) d={size / u['d_ms'] / 1e6:7.1f} GB/s ({u['d_ms'] * 1e3:8.1f} us) "
                  f"[d old {size / u['d_fast_ms'] / 1e6:7.1f}] exact={u['exact']}" + (f" graph c/d/d_old/cd {u['graph_c_ms'] * 1e3:.1f}/{u['graph_d_ms'] * 1e3:.1f}/"
                                            f"{u['graph_d_fast_ms'] * 1e3:.1f}/"
                                            f"{u['graph_cd_ms'] * 1e3:.1f} us" if "graph_c_ms" in u else ""),
                  flush=True)
            for cname in ("nvcomp-ANS-256K", "nvcomp-ANS-default", "nvcomp-Bitcomp"):
                r = row.get(cname)
                if r and "ratio" in r:
                    print(f"{'':22s} {'':9s}  {cname:18s} r={r['ratio']:.4f} c={size / r['c_ms'] / 1e6:7.1f} "
                          f"d={size / r['d_ms'] / 1e6:7.1f} GB/s ({r['c_ms'] * 1e3:.1f} / {r['d_ms'] * 1e3:.1f} us)"
                          f" exact={r['exact']}", flush=True)
                elif r:
                    print(f"{'':33s}{cname}: {r['error']}")
            if "split-floor" in row:
                print(f"{'':33s}split floor {size / row['split-floor']['ms'] / 1e6:7.1f} GB/s")
            del xs, x0
            torch.cuda.empty_cache()
    stamp = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "python": platform.python_version()}
    try:
        import cupy

        stamp["cupy"] = cupy.__version__
        stamp["driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception:  # noqa: BLE001
        pass
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codec_gpu.json").write_text(json.dumps({"machine": stamp, "results": results}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        rows = [r for r in results if r["data"] == "normal-bf16"]
        xs_ = [r["bytes"] / MiB for r in rows]
        for ax, key, title in ((axes[0], "c_ms", "compress"), (axes[1], "d_ms", "decompress")):
            for cname in ("uzip", "nvcomp-ANS-256K", "nvcomp-ANS-default", "nvcomp-Bitcomp"):
                pts = [(x, r["bytes"] / r[cname][key] / 1e6) for x, r in zip(xs_, rows)
                       if cname in r and key in r[cname]]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=cname)
            if key == "d_ms":  # the round-3 decoder, same frames, same run
                pts = [(x, r["bytes"] / r["uzip"]["d_fast_ms"] / 1e6) for x, r in zip(xs_, rows)
                       if "d_fast_ms" in r["uzip"]]
                ax.plot(*zip(*pts), marker="x", linestyle="--", label="uzip, uz_dec_fast (round 3)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("MiB (bf16 N(0,0.02))")
            ax.set_ylabel("GB/s of original bytes")
            ax.set_title(f"{title} on {stamp['gpu']}")
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "codec_gpu.png", dpi=110)
    except Exception as e:  # noqa: BLE001
        print("no plot:", e)


def crc_micro(repeats):
    """crc_par's throughput and correctness on its own (the variant timing for CRC_SLICE)."""
    from uzip_serve.kernels import cuda as kc

    crc = uz.codec.get_backend("cpu").crc32c
    g = torch.Generator(device="cuda").manual_seed(1)
    data = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device="cuda", generator=g)
    for seg in (128 * 1024, 87 * 1024 + 5):
        got = kc.crc32c_segments(data, seg)
        head = data[: 3 * seg].cpu().numpy().tobytes()
        ok = all((int(got[i]) & 0xFFFFFFFF) == crc(head[i * seg:(i + 1) * seg]) for i in range(3))
        ms = time_ms(lambda i, r: kc.crc32c_segments(data, seg), [0], repeats)
        print(f"CRC_SLICE={kc.CRC_SLICE} seg={seg} crc_par {data.numel() / ms / 1e6:7.1f} GB/s  correct={ok}",
              flush=True)


def profile_kernels():
    from torch.profiler import ProfilerActivity, profile

    for mib in (1, 256):
        x = (torch.randn(mib << 19, device="cuda") * 0.02).bfloat16()
        cap = uz.max_compressed_size(x.numel() * 2, x.dtype)
        out = torch.empty(cap, dtype=torch.uint8, device="cuda")
        size = torch.zeros(1, dtype=torch.int64, device="cuda")
        codec.compress_device_async(x, out, size)
        n = int(size.item())
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
        print_phases()


def print_phases():
    """Block 0's phase marks (a build with -DUZ_PHASES): cycles between marks, and the clock."""
    try:
        import cupy

        from uzip_serve.kernels import cuda as kc

        ptr = kc._module(0).get_global("UZ_PH")
    except Exception:  # noqa: BLE001 - not an instrumented build
        return
    ph = cupy.ndarray((3, 16), dtype=cupy.uint64, memptr=ptr).get().astype("int64")
    for row, name in enumerate(("uz_dec_fast", "uz_enc_stats", "uz_enc_write")):
        marks = [int(v) for v in ph[row][:14] if v]
        ns = int(ph[row][15] - ph[row][14])
        mhz = (marks[-1] - marks[0]) / ns * 1e3 if ns > 0 and len(marks) > 1 else 0
        print(f"  phases {name}: cycles between marks {[b - a for a, b in zip(marks, marks[1:])]} "
              f"total {marks[-1] - marks[0] if marks else 0} = {ns / 1e3:.1f} us at {mhz:.0f} MHz")


if __name__ == "__main__":
    main()
