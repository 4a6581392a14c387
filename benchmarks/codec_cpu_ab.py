"""The C codec against an earlier build of itself, in one process: `python -m benchmarks.codec_cpu_ab`.

On a shared VM the same call moves by 30-50% from one minute to the next, so two runs of
benchmarks/codec_cpu.py cannot tell a 20% change. This loads two builds of the extension side by
side (the installed one and `cpu_codec.c` from a git revision, compiled into a temporary
directory with the flags of setup.py), checks that they write byte-identical frames, and
alternates their calls: compress and decompress, one thread, the best of --repeats calls each.

    python -m benchmarks.codec_cpu_ab [--base REV] [--mb 8] [--repeats 21]

Writes docs/benchmarks/codec_cpu_ab.{json,png}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from benchmarks import machine

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "docs" / "benchmarks"
SETS = {  # name: (real-data set, dtype)
    "minilm weights bf16": ("minilm_weights", "bfloat16"),
    "minilm weights fp32": ("minilm_weights", "float32"),
    "gemma weights bf16": ("gemma_weights", "bfloat16"),
    "gemma activations + kv bf16": ("gemma_activations", "bfloat16"),
}


def build(rev: str, out_dir: Path) -> Path:
    """Compiles cpu_codec.c as of `rev` into out_dir; returns the extension's path."""
    src = subprocess.run(["git", "show", f"{rev}:uzip_serve/kernels/cpu_codec.c"], cwd=REPO, check=True,
                         capture_output=True).stdout
    c = out_dir / "cpu_codec.c"
    c.write_bytes(src)
    so = out_dir / ("_cpu_codec" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(["cc", "-shared", "-fPIC", "-O3", "-std=c11", "-fno-strict-aliasing",
                    f"-I{sysconfig.get_paths()['include']}", str(c), "-o", str(so), "-lpthread"], check=True)
    return so


def load(path: Path, alias: str):
    # Both builds export PyInit__cpu_codec; distinct parent names keep them apart in sys.modules.
    sys.modules.setdefault(alias, type(sys)(alias))
    spec = importlib.util.spec_from_file_location(f"{alias}._cpu_codec", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tensor_of(set_name: str, dtype: str, mb: int):
    import torch

    from benchmarks import realdata

    t = torch.cat([v.flatten().to(getattr(torch, dtype)) for v in realdata.load(set_name).values()
                   if v.is_floating_point()])
    return t[: (mb << 20) // t.element_size()].contiguous()


def measure(builds: dict, x, repeats: int) -> dict:
    import torch

    from uzip_serve import codec
    from uzip_serve import format as fmt

    cap = codec.max_compressed_size(x.nbytes, x.dtype)
    outs = {name: memoryview(bytearray(cap)) for name in builds}
    frames = {name: bytes(outs[name][:codec._encode_host(x, outs[name], 1, backend=be)])
              for name, be in builds.items()}
    if len(set(frames.values())) != 1:
        raise SystemExit("the two builds write different frames: not the same codec, nothing to compare")
    frame = next(iter(frames.values()))
    header = fmt.parse_header(frame, builds["head"].uzh64)
    dst = torch.empty_like(x)
    dview = codec._bytes_view(dst)
    times = {name: {"compress": [], "decompress": []} for name in builds}
    order = list(builds)
    for r in range(repeats):
        for name in order if r % 2 == 0 else order[::-1]:  # alternate who goes first
            be = builds[name]
            t0 = time.perf_counter()
            codec._encode_host(x, outs[name], 1, backend=be)
            t1 = time.perf_counter()
            be.decompress_blocks(frame, header, dview, 1)
            t2 = time.perf_counter()
            times[name]["compress"].append(t1 - t0)
            times[name]["decompress"].append(t2 - t1)
    if not torch.equal(dst.view(torch.uint8), x.view(torch.uint8)):
        raise SystemExit("decoded bytes differ from the input")
    return {"ratio": len(frame) / x.nbytes, "mbytes": x.nbytes / 1e6,
            **{name: {op: x.nbytes / min(ts) / 1e9 for op, ts in t.items()} for name, t in times.items()}}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.2
    for j, (build, op, color) in enumerate((("base", "compress", "#bbbbbb"), ("head", "compress", "#2ca02c"),
                                            ("base", "decompress", "#888888"), ("head", "decompress", "#1f77b4"))):
        xs = [i + (j - 1.5) * w for i in range(len(rows))]
        ax.bar(xs, [r[build][op] for r in rows], w, color=color, label=f"{op}, {result[build + '_rev']}")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["data"] for r in rows], fontsize=8)
    ax.set_ylabel("GB/s of original bytes, 1 thread (best call)")
    ax.legend(fontsize=8)
    ax.set_title(f"C codec, two builds alternating in one process ({result['machine'].get('cpu')}, "
                 f"{result['machine'].get('cores')} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="ce49b0e", help="git revision of the build to compare against")
    p.add_argument("--mb", type=int, default=8, help="MB of each data set")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--out", type=Path, default=OUT_DIR)
    a = p.parse_args(argv)
    from uzip_serve.kernels.cpu import CpuCodec

    head_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base = CpuCodec(load(build(a.base, Path(tmp)), "uzip_codec_base"))
    builds = {"base": base, "head": CpuCodec()}
    rows = []
    print(f"{'data':30s} {'ratio':>6s}  {'compress base / head GB/s':>26s}  {'decompress base / head':>24s}")
    for label, (set_name, dtype) in SETS.items():
        r = {"data": label, **measure(builds, tensor_of(set_name, dtype, a.mb), a.repeats)}
        r["compress_speedup"] = r["head"]["compress"] / r["base"]["compress"]
        r["decompress_speedup"] = r["head"]["decompress"] / r["base"]["decompress"]
        rows.append(r)
        print(f"{label:30s} {r['ratio']:6.4f}  {r['base']['compress']:8.3f} / {r['head']['compress']:.3f} "
              f"({r['compress_speedup']:.2f}x)  {r['base']['decompress']:8.3f} / {r['head']['decompress']:.3f} "
              f"({r['decompress_speedup']:.2f}x)", flush=True)
    result = {"benchmark": "codec_cpu_ab", "machine": machine.describe(), "base_rev": a.base,
              "head_rev": head_rev + " (installed build)", "mb": a.mb, "repeats": a.repeats, "threads": 1,
              "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "codec_cpu_ab.json").write_text(json.dumps(result, indent=1))
    plot(result, a.out / "codec_cpu_ab.png")
    print(f"wrote {a.out / 'codec_cpu_ab.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
