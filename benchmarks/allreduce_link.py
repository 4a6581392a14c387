"""All-reduce benchmark: the compressed ring vs gloo's all-reduce over a rate-limited link.

Two ranks, each in its own network namespace, joined by a veth pair capped with tbf
(benchmarks/netns.py; needs root). Each rank all-reduces real Gemma-3-270M bf16
activations (hidden states and KV cache of a forward pass over prose, tiled to size;
each rank a different slice) from 256 KiB to 64 MiB, with, interleaved in one run:

  gloo        torch.distributed.all_reduce on the gloo group (what CPU TP runs today)
  compressed  the compressed ring, always on, its hops over the default transport
              (RingConfig.transport / UZIP_ALLREDUCE_TRANSPORT)
  compressed_T  the same over transport T, for each T of --transports (an A/B of the
              hop transports: gloo isend/irecv, ucx, tcp; docs/collectives.md)
  adaptive    the ring communicator deciding per call (falls back to gloo's all-reduce)
  gloo_again  gloo once more: an A/A control, the noise floor of every ratio

Each size gets at least --repeats calls per mode (about 1.5 s of them, up to 101),
interleaved, after a warm-up that lets the adaptive mode calibrate and try both paths
where its model is unsure (the paths of that warm-up are recorded per row).
Reports the median latency per mode and size, the wire ratio of the compressed path and
the speed-up over gloo; writes docs/benchmarks/allreduce_link.{json,png}.

    python -m benchmarks.allreduce_link [--rates 1gbit,10gbit] [--repeats 7] [--max-mib 64]
                                        [--transports gloo,ucx,tcp]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import machine
from benchmarks.rank_exit import release_process_groups

OUT_DIR = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
ME = [sys.executable, "-m", "benchmarks.allreduce_link"]
# gloo_again: the same call as gloo, measured as a mode of its own: an A/A control whose
# ratio to gloo is this machine's noise for that size (gloo's calls vary up to 5x here).
MODES = ("gloo", "compressed", "adaptive", "gloo_again")
PORT = 29650
BUDGET_S = 1.5  # per mode and size
MAX_REPEATS = 101
logger = logging.getLogger("benchmarks.allreduce_link")


def sizes_bytes(max_mib: int) -> list[int]:
    out, b = [], 256 << 10
    while b <= max_mib << 20:
        out.append(b)
        b *= 2
    return out


def activations(nbytes: int, rank: int, world: int, dtype=None):
    """`nbytes` of real Gemma-3 activations for `rank`: the cached tensors flattened in
    name order, tiled, and rotated by rank so every rank holds different values."""
    import torch

    from benchmarks import realdata

    dtype = dtype or torch.bfloat16
    act = realdata.load("gemma_activations")
    flat = torch.cat([act[k].reshape(-1) for k in sorted(act)]).to(dtype)
    numel = max(1, nbytes // flat.element_size())
    reps = -(-(numel + flat.numel()) // flat.numel())
    tiled = flat.repeat(reps)
    start = (rank * flat.numel()) // world
    return tiled[start:start + numel].clone()


# ---- one rank, inside its namespace ----

def modes_for(transports: list[str]) -> tuple[str, ...]:
    return ("gloo", "compressed", *[f"compressed_{t}" for t in transports], "adaptive", "gloo_again")


def role_rank(rank: int, world: int, master: str, sizes: list[int], repeats: int, threads: int,
              transports: list[str] = ()) -> None:
    import torch
    import torch.distributed as dist

    from uzip_serve import collectives as C

    host, port = master.rsplit(":", 1)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    comms = {
        "compressed": C.build_communicator(config=C.RingConfig.from_env(compression="on", codec_threads=threads)),
        "adaptive": C.build_communicator(config=C.RingConfig.from_env(compression="auto", codec_threads=threads)),
    }
    for t in transports:
        comms[f"compressed_{t}"] = C.build_communicator(
            config=C.RingConfig.from_env(compression="on", codec_threads=threads, transport=t))
    MODES = modes_for(transports)

    def run(mode, x):
        if mode in ("gloo", "gloo_again"):
            y = x.clone()
            dist.all_reduce(y)
            return y
        return comms[mode].all_reduce(x)

    rows = []
    explore = comms["adaptive"].config.explore_calls
    for nbytes in sizes:
        x = activations(nbytes, rank, world)
        # Warm-up: connections, page faults, the adaptive calibration and, near the
        # break-even, its trial of both paths (2 * explore_calls calls, then the agreement):
        # the rows report the steady state; the trial's paths are recorded.
        t0 = time.perf_counter()
        run("gloo", x)
        t_gloo = time.perf_counter() - t0
        for mode in MODES:
            if mode.startswith("compressed"):
                run(mode, x)
        a = comms["adaptive"].stats
        warm_paths = []
        for _ in range(2 + 2 * explore):
            c0 = a.compressed
            run("adaptive", x)
            warm_paths.append("compressed" if a.compressed > c0 else "native")
        # Enough calls for a stable median (gloo itself varies by 2x call to call here):
        # about BUDGET_S per mode, at least `repeats`, the same count on both ranks.
        reps = torch.tensor([min(max(repeats, math.ceil(BUDGET_S / max(t_gloo, 1e-4))), MAX_REPEATS)])
        dist.all_reduce(reps, op=dist.ReduceOp.MAX)
        times = {m: [] for m in MODES}
        before = {m: (dict(c.stats.__dict__)) for m, c in comms.items()}
        for i in range(int(reps)):
            order = MODES if i % 2 == 0 else tuple(reversed(MODES))  # interleave against drift
            for mode in order:
                dist.barrier()
                t0 = time.perf_counter()
                run(mode, x)
                times[mode].append(time.perf_counter() - t0)
        # Every rank's time for a call is its own; report the slower rank, call by call.
        t = torch.tensor([times[m] for m in MODES], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        for k, mode in enumerate(MODES):
            row = {"nbytes": nbytes, "mode": mode, "seconds": statistics.median(t[k].tolist()),
                   "seconds_all": t[k].tolist()}
            if mode == "adaptive":
                row["warmup_paths"] = warm_paths
            if mode in comms:
                s, b = comms[mode].stats, before[mode]
                raw, wire = s.raw_bytes - b["raw_bytes"], s.wire_bytes - b["wire_bytes"]
                row["compressed_calls"] = s.compressed - b["compressed"]
                row["native_calls"] = s.native - b["native"]
                row["ratio"] = wire / raw if raw else None
            rows.append(row)
    if rank == 0:
        pol = comms["adaptive"].policy
        info = {"threshold_bytes": pol.threshold("bfloat16") if pol.m else None,
                "policy": pol.describe("bfloat16") if pol.m else None}
        info["transport"] = comms["compressed"].config.transport
        print("RESULT " + json.dumps({"rows": rows, "adaptive": info}), flush=True)
    for c in comms.values():
        c.close()
    dist.destroy_process_group()


# ---- the orchestrator ----

def run_rate(link, rate: str, sizes: list[int], repeats: int, threads: int, pin: bool = False,
             transports: list[str] = ()) -> dict:
    from benchmarks.netns import ADDR, DEV

    link.set_rate(rate)
    master = f"{ADDR['a']}:{PORT}"
    procs = []
    for rank, side in enumerate("ab"):
        # One torch thread per rank: the two ranks stand for two hosts but share this
        # machine's cores, and torch's idle OpenMP workers spin on the core the other rank's
        # codec needs (measured: decode+reduce 0.03 GB/s with 2 threads each, 0.28 with 1).
        # UCX: TCP over the veth only (its default would use shared memory between two
        # processes of one host, bypassing the link under test).
        env = dict(os.environ, GLOO_SOCKET_IFNAME=DEV[side], PYTHONPATH=str(Path(__file__).resolve().parents[1]),
                   OMP_NUM_THREADS="1", UCX_TLS="tcp", UCX_NET_DEVICES=DEV[side])
        # --pin: one core per rank, as if on two hosts (the kernel's network work still
        # lands on either).
        taskset = ["taskset", "-c", str(rank)] if pin else []
        procs.append(link.popen(side, taskset + ME + ["--role", "rank", "--rank", str(rank), "--world", "2", "--master",
                                            master, "--sizes", ",".join(map(str, sizes)), "--repeats",
                                            str(repeats), "--threads", str(threads),
                                            "--transports", ",".join(transports)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        out, err = procs[0].communicate(timeout=3000)
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            _, err1 = procs[1].communicate(timeout=30)
            raise RuntimeError(f"rank 0 failed at {rate}:\n{err[-3000:]}\nrank 1:\n{err1[-2000:]}")
        res = json.loads(line[len("RESULT "):])
        for ln in err.splitlines():
            if "uzip all-reduce" in ln:
                logger.info("%s: %s", rate, ln.strip())
        return res
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def run(rates: list[str], repeats: int, max_mib: int, threads: int, out_dir: Path, pin: bool = False,
        transports: list[str] = ()) -> dict:
    from benchmarks.netns import RateLimitedLink, default_burst

    sizes = sizes_bytes(max_mib)
    rows, adaptive = [], {}
    load_before = os.getloadavg()
    with RateLimitedLink() as link:
        for rate in rates:
            res = run_rate(link, rate, sizes, repeats, threads, pin, transports)
            adaptive[rate] = res["adaptive"]
            for r in res["rows"]:
                r["rate"] = rate
                rows.append(r)
    for r in rows:
        g = next(p for p in rows if p["rate"] == r["rate"] and p["nbytes"] == r["nbytes"] and p["mode"] == "gloo")
        r["speedup_vs_gloo"] = g["seconds"] / r["seconds"]
    result = {"benchmark": "allreduce_link", "machine": machine.describe(), "repeats": repeats, "world": 2,
              "codec_threads": threads, "pinned": pin, "transports": list(transports),
              "default_transport": next(iter(adaptive.values()))["transport"], "load_before": load_before,
              "load_after": os.getloadavg(),
              "data": "Gemma-3-270M bf16 activations (hidden states + KV cache), tiled; rank-rotated",
              "adaptive": adaptive, "rows": rows,
              "tbf_burst": {rate: default_burst(rate) for rate in adaptive}}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "allreduce_link.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, out_dir / "allreduce_link.png", result)
    print(table(rows))
    if transports:
        print(transport_table(rows, transports))
    return result


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def table(rows) -> str:
    lines = [f"{'link':7} {'size':>8} {'gloo ms':>8} {'compr ms':>9} {'ratio':>6} {'x gloo':>7} "
             f"{'adapt ms':>9} {'x gloo':>7} {'path':>10} {'A/A':>5}"]
    for rate in dict.fromkeys(r["rate"] for r in rows):
        for nb in dict.fromkeys(r["nbytes"] for r in rows if r["rate"] == rate):
            get = {r["mode"]: r for r in rows if r["rate"] == rate and r["nbytes"] == nb}
            g, c, a, aa = get["gloo"], get["compressed"], get["adaptive"], get["gloo_again"]
            path = "compressed" if a["compressed_calls"] else "native"
            lines.append(f"{rate:7} {_size(nb):>8} {g['seconds'] * 1e3:8.2f} {c['seconds'] * 1e3:9.2f} "
                         f"{c['ratio']:6.3f} {c['speedup_vs_gloo']:7.2f} {a['seconds'] * 1e3:9.2f} "
                         f"{a['speedup_vs_gloo']:7.2f} {path:>10} {aa['speedup_vs_gloo']:5.2f}")
    return "\n".join(lines)


def transport_table(rows, transports) -> str:
    """The A/B of hop transports: each compressed_T mode's speed-up over gloo's all-reduce."""
    lines = [f"{'link':7} {'size':>8} {'gloo ms':>8} " + " ".join(f"{'x gloo ' + t:>12}" for t in transports)
             + f" {'A/A':>5}"]
    for rate in dict.fromkeys(r["rate"] for r in rows):
        for nb in dict.fromkeys(r["nbytes"] for r in rows if r["rate"] == rate):
            get = {r["mode"]: r for r in rows if r["rate"] == rate and r["nbytes"] == nb}
            lines.append(f"{rate:7} {_size(nb):>8} {get['gloo']['seconds'] * 1e3:8.2f} "
                         + " ".join(f"{get['compressed_' + t]['speedup_vs_gloo']:12.2f}" for t in transports)
                         + f" {get['gloo_again']['speedup_vs_gloo']:5.2f}")
    return "\n".join(lines)


def plot(rows, path: Path, result) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = sorted((r["nbytes"], r["speedup_vs_gloo"]) for r in rows if r["rate"] == rate and r["mode"] == mode)
            ax.plot([p[0] / 2**20 for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.95, color="r", lw=0.6, ls=":", label="5% slower than gloo")
        ax.axhline(1.3, color="g", lw=0.6, ls=":", label="1.3x target")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (MiB)")
        ax.set_ylabel("speed-up over gloo all_reduce (higher is better)")
        ax.set_title(f"{rate} veth, 2 ranks")
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['data']}; {result['machine']['cores']} cores, {result['machine']['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["orchestrate", "rank"], default="orchestrate")
    p.add_argument("--rates", default="1gbit,10gbit")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--max-mib", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="codec threads per call")
    p.add_argument("--pin", action="store_true", help="rank 0 on core 0, rank 1 on core 1")
    p.add_argument("--transports", default="",
                   help="also time the compressed ring over each of these hop transports (gloo,ucx,tcp)")
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--master")
    p.add_argument("--sizes")
    p.add_argument("--out", type=Path, default=OUT_DIR)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if a.role == "rank":
        role_rank(a.rank, a.world, a.master, [int(s) for s in a.sizes.split(",")], a.repeats, a.threads,
                  [t for t in a.transports.split(",") if t])
        release_process_groups()
    else:
        run(a.rates.split(","), a.repeats, a.max_mib, a.threads, a.out, a.pin,
            [t for t in a.transports.split(",") if t])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
