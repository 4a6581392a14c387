"""How long memory that sat untouched for a while takes to read and write again.

    python -m benchmarks.idle_memory [--mb 19] [--gaps 0,0.1,0.3,1,3] [--repeats 3]

No network and no codec: two resident buffers of a 1024-token Gemma-3-270M KV cache's size
(19 MB), allocated and touched once, then after each idle gap one buffer is read (a sum) and
the other written (a fill), timed apart. On ordinary hardware the gap changes nothing. The
2-core sandbox VM where the disaggregated-serving benchmarks run (Firecracker, nested paging)
makes memory idle for 0.1-3 s several times slower to touch again, and a KV transfer that
follows an idle period touches ~19 MB on each side, in both compression modes: this is the
"restart cost" of docs/kv_connector.md. The alternative in the same run is the same buffers
touched back to back (gap 0); run it on another host (the device machine) for the comparison
across machines.

Writes docs/benchmarks/idle_memory.json and .png, stamped with the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import machine


def probe(nbytes: int, gaps: list[float], repeats: int) -> dict:
    """{"nbytes", "threads", "rows": one per gap, medians and every repeat}."""
    nbytes = nbytes // 8 * 8
    src = torch.ones(nbytes // 8, dtype=torch.int64)
    dst = torch.zeros(nbytes // 8, dtype=torch.int64)
    src.sum(), dst.fill_(1)  # resident before the first gap
    rows = []
    for gap in gaps:
        reads, writes = [], []
        for _ in range(repeats):
            time.sleep(gap)
            t0 = time.perf_counter()
            src.sum()
            t1 = time.perf_counter()
            dst.fill_(2)
            t2 = time.perf_counter()
            reads.append(t1 - t0)
            writes.append(t2 - t1)
        row = {"gap_s": gap, "read_s": statistics.median(reads), "write_s": statistics.median(writes),
               "reads_s": reads, "writes_s": writes}
        rows.append(row)
        print(f"idle {gap:5.2f} s   read {nbytes / 1e6:.0f} MB {row['read_s'] * 1e3:7.1f} ms   "
              f"write {row['write_s'] * 1e3:7.1f} ms", flush=True)
    return {"nbytes": nbytes, "threads": torch.get_num_threads(), "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    gaps = [r["gap_s"] for r in rows]
    x = list(range(len(gaps)))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], [r["read_s"] * 1e3 for r in rows], width=0.4, label="read (sum)")
    ax.bar([i + 0.2 for i in x], [r["write_s"] * 1e3 for r in rows], width=0.4, label="write (fill)")
    ax.set_xticks(x, [f"{g:g} s" for g in gaps])
    ax.set_xlabel("idle before the touch")
    ax.set_ylabel(f"ms per {result['nbytes'] / 1e6:.0f} MB (median of {result['repeats']})")
    m = result["machine"]
    ax.set_title(f"Resident memory touched again after idle\n{m.get('cpu', '')}, {m.get('cores', '')} cores, {m.get('platform', '')}",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=18.9, help="buffer size (default: 1024 tokens of Gemma-3-270M KV)")
    ap.add_argument("--gaps", default="0,0.1,0.3,1,3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    measured = probe(int(args.mb * 1e6), [float(g) for g in args.gaps.split(",")], args.repeats)
    base = measured["rows"][0]
    for r in measured["rows"]:
        r["read_x_gap0"] = r["read_s"] / base["read_s"]
        r["write_x_gap0"] = r["write_s"] / base["write_s"]
    result = {"benchmark": "idle_memory", "machine": machine.describe(), "repeats": args.repeats, **measured,
              "what": "resident buffers read / written again after an idle gap; gap 0 = back to back"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "idle_memory.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "idle_memory.png")
    print(f"wrote {out / 'idle_memory.json'} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
