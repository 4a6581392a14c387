"""Per-hop GPU work of the compressed ring, measured on one GPU, and the model of where
the GPU path beats an uncompressed ring on 25-400 Gbit/s links.

A ring all-reduce hop moves one sub-chunk: the sender compresses it, the wire carries
the frame, the receiver decompresses it and adds its own data. With the hops pipelined,
a rank's time per raw byte is the slowest stage:

    uncompressed   1 / link
    compressed     max(ratio / link,  compress + decompress + reduce per byte)

(the codec stages share one GPU, so their times add), plus one pipeline fill of a
sub-chunk per hop. This script times compress_device, decompress_device and the bf16
add for real Gemma-3 activations at 256 KiB .. 64 MiB, and prints for each link speed
the predicted speed-up of the compressed ring (>1 = compression wins), next to the
measured stage times. Writes docs/benchmarks/allreduce_gpu_hops.{json,png}.

Run on a GPU machine (it skips without CUDA; importing it needs no GPU):

    python -m benchmarks.allreduce_gpu_hops [--repeats 20] [--max-mib 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks import machine

OUT_DIR = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
LINKS_GBIT = (25, 50, 100, 200, 400)


def time_hops(nbytes: int, repeats: int) -> dict:
    """Median milliseconds of each GPU stage for one sub-chunk of `nbytes`."""
    import torch

    from benchmarks.allreduce_link import activations
    from uzip_serve import codec

    x = activations(nbytes, 0, 2).cuda()
    y = activations(nbytes, 1, 2).cuda()
    out = torch.empty(codec.max_compressed_size(x.numel() * x.element_size(), x.dtype), dtype=torch.uint8,
                      device="cuda")
    tmp = torch.empty_like(x)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    t = {"compress": [], "decompress": [], "reduce": []}
    n = 0
    for i in range(repeats + 3):
        ev[0].record()
        n = codec.compress_device(x, out)  # includes its one host sync for the size, as in the ring
        ev[1].record()
        codec.decompress_device(out[:n], out=tmp)
        ev[2].record()
        torch.add(tmp, y, out=tmp)
        ev[3].record()
        torch.cuda.synchronize()
        if i >= 3:  # warm-up: NVRTC compile, allocator
            t["compress"].append(ev[0].elapsed_time(ev[1]))
            t["decompress"].append(ev[1].elapsed_time(ev[2]))
            t["reduce"].append(ev[2].elapsed_time(ev[3]))
    res = {k: statistics.median(v) for k, v in t.items()}
    res["ratio"] = n / (x.numel() * x.element_size())
    res["nbytes"] = nbytes
    return res


def model(row: dict, link_gbit: float, sub_bytes: int = 4 << 20, world: int = 2) -> dict:
    """Predicted ring all-reduce times (ms) for a message of row['nbytes'] on the link."""
    nbytes, ratio = row["nbytes"], row["ratio"]
    link = link_gbit * 1e9 / 8  # bytes/s
    hops = 2 * (world - 1)
    wire = hops / world * nbytes
    codec_s_per_byte = (row["compress"] + row["decompress"] + row["reduce"]) / 1e3 / nbytes
    sub = min(sub_bytes, nbytes // world)
    plain = wire / link
    compressed = max(ratio * wire / link, nbytes * codec_s_per_byte) + hops * sub * codec_s_per_byte
    return {"link_gbit": link_gbit, "plain_ms": plain * 1e3, "compressed_ms": compressed * 1e3,
            "speedup": plain / compressed}


def run(sizes: list[int], repeats: int, out_dir: Path) -> dict | None:
    import torch

    if not torch.cuda.is_available():
        print("allreduce_gpu_hops: no CUDA device; nothing measured", file=sys.stderr)
        return None
    rows = [time_hops(nb, repeats) for nb in sizes]
    for r in rows:
        r["model"] = [model(r, g) for g in LINKS_GBIT]
    result = {"benchmark": "allreduce_gpu_hops", "machine": machine.describe(), "repeats": repeats,
              "data": "Gemma-3-270M bf16 activations, tiled", "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "allreduce_gpu_hops.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, out_dir / "allreduce_gpu_hops.png", result)
    print(table(rows))
    return result


def table(rows) -> str:
    head = f"{'size':>8} {'ratio':>6} {'comp ms':>8} {'dec ms':>7} {'add ms':>7} {'GB/s':>6} " + \
        " ".join(f"{g:>4}G x" for g in LINKS_GBIT)
    lines = [head]
    for r in rows:
        gbs = r["nbytes"] / ((r["compress"] + r["decompress"] + r["reduce"]) / 1e3) / 1e9
        lines.append(f"{r['nbytes'] >> 10:>6}Ki {r['ratio']:6.3f} {r['compress']:8.3f} {r['decompress']:7.3f} "
                     f"{r['reduce']:7.3f} {gbs:6.1f} " + " ".join(f"{m['speedup']:7.2f}" for m in r["model"]))
    return "\n".join(lines)


def plot(rows, path: Path, result) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    mib = [r["nbytes"] / 2**20 for r in rows]
    for k in ("compress", "decompress", "reduce"):
        ax1.plot(mib, [r["nbytes"] / (r[k] / 1e3) / 1e9 for r in rows], marker="o", label=k)
    ax1.set(xscale="log", yscale="log", xlabel="sub-chunk (MiB)", ylabel="GB/s (measured)",
            title=f"per-hop GPU stages, {result['machine'].get('gpu', {}).get('name', '?')}")
    ax1.legend()
    for i, g in enumerate(LINKS_GBIT):
        ax2.plot(mib, [r["model"][i]["speedup"] for r in rows], marker="o", label=f"{g} Gbit/s")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set(xscale="log", xlabel="message (MiB)", ylabel="predicted speed-up vs uncompressed ring",
            title="model: max(ratio/link, codec) vs 1/link")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--max-mib", type=int, default=64)
    p.add_argument("--out", type=Path, default=OUT_DIR)
    a = p.parse_args(argv)
    from benchmarks.allreduce_link import sizes_bytes

    run(sizes_bytes(a.max_mib), a.repeats, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
