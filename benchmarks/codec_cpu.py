"""CPU codec benchmark: uzip against zstd, byte-grouped zstd, lz4 and zipnn, same run.

Every codec sees the same real tensors (benchmarks/realdata.py), flattened and
concatenated per data set the way a weight-sync bucket would be, and is timed at one
thread and at every core. Each result is checked for a bit-exact round trip before
its time counts. Writes docs/benchmarks/codec_cpu.{json,png}.

    python -m benchmarks.codec_cpu [--max-mb 64] [--repeats 3] [--quick]
    uzip bench codec ...      (the same)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import uzip_serve as uz
from benchmarks import machine, realdata

logger = logging.getLogger("benchmarks.codec_cpu")
OUT_DIR = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


# ---- data ----------------------------------------------------------------------------

def _concat(tensors, dtype) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def datasets(max_bytes: int) -> dict[str, torch.Tensor]:
    """name -> one flat tensor of real data, cut to max_bytes."""
    w = realdata.load("minilm_weights")
    g = realdata.load("minilm_grads")
    act = realdata.load("gemma_activations")
    gemma = realdata.load("gemma_weights")
    weights = [t for t in w.values() if t.is_floating_point()]
    out = {
        "minilm weights bf16": _concat(weights, torch.bfloat16),
        "minilm weights fp16": _concat(weights, torch.float16),
        "minilm weights fp32": _concat(weights, torch.float32),
        "gemma weights bf16": _concat(gemma.values(), torch.bfloat16),
        "gemma hidden states bf16": _concat([v for k, v in sorted(act.items()) if k.startswith("hidden.")],
                                            torch.bfloat16),
        "gemma kv cache bf16": _concat([v for k, v in sorted(act.items()) if k.startswith("kv.")], torch.bfloat16),
        "minilm grads fp32 dense": _concat([v for k, v in sorted(g.items()) if k.startswith("dense.")],
                                           torch.float32),
        "minilm grads fp32 sparse": _concat([v for k, v in sorted(g.items()) if k.startswith("sparse.")],
                                            torch.float32),
        "random bytes": torch.from_numpy(np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8)),
    }
    for name, t in out.items():
        n = max_bytes // t.element_size()
        out[name] = t[:n].contiguous()
    return out


# ---- codecs: each is (compress(tensor) -> bytes-like, decompress(bytes, like) -> tensor) ----

def _raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _from_raw(buf, like: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(like.dtype)


def uzip_codec(threads: int):
    return (lambda t: uz.compress(t, threads=threads),
            lambda b, like: uz.decompress(b, threads=threads))


def zstd_codec(level: int, threads: int):
    import zstandard

    # zstd's own threading splits compression only; its decoder is single-threaded.
    cctx = zstandard.ZstdCompressor(level=level, threads=threads if threads > 1 else 0)
    dctx = zstandard.ZstdDecompressor()
    return (lambda t: cctx.compress(_raw(t)),
            lambda b, like: _from_raw(dctx.decompress(b), like))


def byte_grouped_zstd_codec(threads: int):
    """zstd-1 on each byte plane separately, the classic float-compression trick."""
    import zstandard

    cctx = zstandard.ZstdCompressor(level=1, threads=threads if threads > 1 else 0)
    dctx = zstandard.ZstdDecompressor()

    def compress(t):
        k = t.element_size()
        planes = t.reshape(-1).view(torch.uint8).numpy().reshape(-1, k).T
        return [cctx.compress(np.ascontiguousarray(p).tobytes()) for p in planes]

    def decompress(parts, like):
        planes = [np.frombuffer(dctx.decompress(p), np.uint8) for p in parts]
        return torch.from_numpy(np.stack(planes, axis=1).reshape(-1)).view(like.dtype)

    return compress, decompress


def lz4_codec(threads: int):
    import lz4.frame

    return (lambda t: lz4.frame.compress(_raw(t)),
            lambda b, like: _from_raw(lz4.frame.decompress(b), like))


def zipnn_codec(threads: int, dtype: torch.dtype):
    from zipnn import ZipNN

    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}.get(dtype)
    z = ZipNN(bytearray_dtype=name, threads=threads) if name else ZipNN(threads=threads)

    # zipnn 0.5.4 rewrites its input in place for bf16/fp32: always hand it a copy
    # (the copy is made outside the timed region by the caller via `prepare`).
    def compress(buf):
        return z.compress(buf)

    def decompress(b, like):
        return _from_raw(z.decompress(b), like)

    return compress, decompress


# ---- timing ---------------------------------------------------------------------------

def _median_time(fn: Callable[[], object], repeats: int, prepare: Callable[[], object] | None = None):
    times, result = [], None
    for _ in range(repeats):
        arg = prepare() if prepare else None
        t0 = time.perf_counter()
        result = fn(arg) if prepare else fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def _nbytes(c) -> int:
    return sum(len(p) for p in c) if isinstance(c, list) else len(c)


def measure(codec_name: str, data: torch.Tensor, threads: int, repeats: int) -> dict:
    raw_bytes = data.nbytes
    if codec_name == "zipnn":
        comp, decomp = zipnn_codec(threads, data.dtype)
        raw = _raw(data)
        t_c, c = _median_time(lambda buf: comp(buf), repeats, prepare=lambda: bytearray(raw))
    else:
        comp, decomp = {
            "uzip": lambda: uzip_codec(threads),
            "zstd-1": lambda: zstd_codec(1, threads),
            "zstd-3": lambda: zstd_codec(3, threads),
            "bytegroup-zstd-1": lambda: byte_grouped_zstd_codec(threads),
            "lz4": lambda: lz4_codec(threads),
        }[codec_name]()
        t_c, c = _median_time(lambda: comp(data), repeats)
    t_d, back = _median_time(lambda: decomp(c, data), repeats)
    exact = bool(torch.equal(back.reshape(-1).view(torch.uint8), data.reshape(-1).view(torch.uint8)))
    if not exact:
        raise AssertionError(f"{codec_name} did not round-trip {data.dtype} data bit-exactly")
    return {
        "codec": codec_name,
        "threads": threads,
        "ratio": _nbytes(c) / raw_bytes,
        "compress_gbps": raw_bytes / t_c / 1e9,
        "decompress_gbps": raw_bytes / t_d / 1e9,
    }


CODECS = ["uzip", "zipnn", "zstd-1", "zstd-3", "bytegroup-zstd-1", "lz4"]


def run(max_mb: int = 64, repeats: int = 3, quick: bool = False, out_dir: Path = OUT_DIR) -> dict:
    all_threads = len(os.sched_getaffinity(0))
    thread_counts = sorted({1, all_threads})
    codecs = ["uzip", "zipnn", "zstd-1"] if quick else CODECS
    data = datasets(max_mb << 20)
    rows = []
    for name, t in data.items():
        for codec in codecs:
            for threads in thread_counts:
                r = measure(codec, t, threads, repeats)
                r.update(data=name, dtype=str(t.dtype).removeprefix("torch."), mbytes=t.nbytes / 1e6)
                rows.append(r)
                logger.info("%-26s %-17s %d thr  ratio %.4f  c %.3f GB/s  d %.3f GB/s", name, codec, threads,
                            r["ratio"], r["compress_gbps"], r["decompress_gbps"])
    result = {"benchmark": "codec_cpu", "machine": machine.describe(), "repeats": repeats,
              "max_mb": max_mb, "rows": rows, "checks": checks(rows, all_threads)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "codec_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, out_dir / "codec_cpu.png", result["machine"])
    print(table(rows))
    print(format_checks(result["checks"]))
    return result


def checks(rows: list[dict], all_threads: int) -> dict:
    """The issue's speed bars, derived from this run."""
    def get(codec, threads, data="minilm weights bf16"):
        return next((r for r in rows if r["codec"] == codec and r["threads"] == threads and r["data"] == data), None)

    out = {}
    u1, z1 = get("uzip", 1), get("zipnn", 1)
    if u1 and z1:
        out["1 thread compress vs zipnn"] = u1["compress_gbps"] / z1["compress_gbps"]
        out["1 thread decompress vs zipnn"] = u1["decompress_gbps"] / z1["decompress_gbps"]
    un = get("uzip", all_threads)
    if u1 and un and all_threads > 1:
        out[f"{all_threads} threads compress vs uzip 1 thread"] = un["compress_gbps"] / u1["compress_gbps"]
        out[f"{all_threads} threads decompress vs uzip 1 thread"] = un["decompress_gbps"] / u1["decompress_gbps"]
    return out


def format_checks(c: dict) -> str:
    return "\n".join(f"  {k}: {v:.2f}x" for k, v in c.items())


def table(rows: list[dict]) -> str:
    lines = [f"{'data':26} {'codec':17} {'thr':>3} {'ratio':>7} {'comp GB/s':>10} {'decomp GB/s':>11}"]
    for r in rows:
        lines.append(f"{r['data']:26} {r['codec']:17} {r['threads']:>3} {r['ratio']:7.4f} "
                     f"{r['compress_gbps']:10.3f} {r['decompress_gbps']:11.3f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, machine_info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["data"] for r in rows))
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    threads = min(r["threads"] for r in rows)
    fig, axes = plt.subplots(1, 3, figsize=(18, 6))
    width = 0.8 / len(codecs)
    for ax, key, label in zip(axes, ["ratio", "compress_gbps", "decompress_gbps"],
                              ["ratio (compressed / original, lower is better)",
                               f"compress GB/s ({threads} thread)", f"decompress GB/s ({threads} thread)"]):
        for i, codec in enumerate(codecs):
            vals = [next((r[key] for r in rows if r["data"] == n and r["codec"] == codec and r["threads"] == threads),
                         0) for n in names]
            ax.barh([j + i * width for j in range(len(names))], vals, height=width, label=codec)
        ax.set_yticks([j + 0.4 - width / 2 for j in range(len(names))])
        ax.set_yticklabels(names if ax is axes[0] else [""] * len(names))
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"uzip CPU codec vs baselines on real tensors: {machine_info.get('cpu', '?')}, "
                 f"{machine_info.get('cores', '?')} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-mb", type=int, default=64, help="cut each data set to this many MB (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the median counts")
    p.add_argument("--quick", action="store_true", help="only uzip, zipnn and zstd-1 (for `make demo`)")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="where the JSON and PNG go")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run(args.max_mb, args.repeats, args.quick, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
