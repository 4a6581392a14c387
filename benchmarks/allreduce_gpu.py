"""Multi-GPU all-reduce benchmark (issue 9): the compressed ring vs NCCL's all-reduce.

For every world size (GPU count) and link mode, one rank per GPU all-reduces real bf16
data of 1 MiB to 256 MiB, in one set of processes, interleaving:

  native      x.clone(); dist.all_reduce(...) on the NCCL group (out-of-place, like the others;
              gloo's all-reduce in the CPU rehearsal)
  compressed  the compressed ring, always on: the GPU codec on every hop, frames over NCCL
              send/recv (uzip_serve.collectives' CUDA backend)
  adaptive    the ring communicator deciding per call (compressed ring or NCCL all-reduce)

Link modes: `nvlink` (as found; NCCL_NVLS_ENABLE=0 always) and `sockets` (NCCL_P2P_DISABLE=1
NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1: every byte through the TCP stack, the cross-node case).
Data: Gemma-3-270M bf16 activations and all-MiniLM-L6-v2 gradients cast to bf16
(benchmarks/realdata.py), tiled to size, a different slice on every rank.

Reported per (link, world, data, size, mode): median latency (slowest rank, call by call),
bus bandwidth (NCCL's convention: size/time * 2(n-1)/n), the ratio to NCCL, the wire ratio,
bit-identity of the result across ranks (64-bit digest), bitwise equality of the compressed
result with the uncompressed ring's (losslessness), and the adaptive switch's choice. Writes
docs/benchmarks/allreduce_gpu.{json,md,png}, merged with an earlier result of configurations
not redone (so a long run can be split; --fresh to start over).

    python -m benchmarks.allreduce_gpu                      # every GPU count of 2,4,8 that fits
    python -m benchmarks.allreduce_gpu --gpus 8 --links sockets --time-budget 540
    torchrun --nproc-per-node 4 -m benchmarks.allreduce_gpu --role rank --link nvlink  # one config
    python -m benchmarks.allreduce_gpu --backend gloo --device cpu --gpus 2,3 --sizes 256K,1M

The last is the CPU rehearsal (ranks on CPU, gloo, the CPU codec; `--lockstep` runs the CUDA
backend's lock-step NCCL engine over gloo instead): it exercises the launcher, the loop,
the checks and the report, not the GPU numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import machine
from benchmarks import multigpu as mg
from benchmarks.rank_exit import release_process_groups

ME = [sys.executable, "-m", "benchmarks.allreduce_gpu"]
MODES = ("native", "compressed", "adaptive")  # native: NCCL all_reduce (gloo's on cpu)
DEFAULT_SIZES = ",".join(f"{1 << k}M" for k in range(9))  # 1 MiB .. 256 MiB
logger = logging.getLogger("benchmarks.allreduce_gpu")


def _name(device: str) -> str:
    return "allreduce_gpu" if device == "cuda" else "allreduce_gpu_cpu"


def _key(r: dict):
    return (r["device"], r["link"], r["world"])


# ---- data ----

_BASE: dict = {}


def base_data(which: str, device):
    """The real tensors of one set, flattened in name order, as one bf16 vector on `device`
    (benchmarks/multigpu.py: realdata's cache, or the carried slice on a GPU machine)."""
    import torch

    if which not in _BASE:
        t = mg.allreduce_base(which)
        _BASE[which] = torch.cat([t[k].reshape(-1) for k in sorted(t)]).to(device)
    return _BASE[which]


def rank_data(which: str, nbytes: int, rank: int, world: int, device):
    """`nbytes` of set `which` for `rank`: tiled, starting at a rank-dependent offset."""
    flat = base_data(which, device)
    numel = max(1, nbytes // flat.element_size())
    start = (rank * flat.numel()) // world
    reps = -(-(start + numel) // flat.numel())
    return (flat.repeat(reps) if reps > 1 else flat)[start:start + numel].clone()


# ---- one rank ----

def rank_main(a) -> None:
    import torch
    import torch.distributed as dist

    from uzip_serve import collectives as C

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if a.device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    backend = a.backend or ("nccl" if a.device == "cuda" else "gloo")
    for k, v in mg.LINKS[a.link].items():  # under torchrun nobody else sets the link mode; NCCL reads it at init
        os.environ.setdefault(k, v)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=a.collective_timeout),
                            **({"device_id": dev} if backend == "nccl" else {}))
    small = dev if backend == "nccl" else torch.device("cpu")  # where the bookkeeping collectives run

    def comm(lockstep: bool = a.lockstep, **kw):
        c = C.build_communicator(config=C.RingConfig.from_env(**kw))
        if lockstep:
            _use_lockstep(c)
        return c

    # "ring" is the lossless reference: the same sums, uncompressed; on the backend's own
    # engine even with --lockstep, so the lock-step engine is checked against the gloo one.
    comms = {"compressed": comm(compression="on"), "adaptive": comm(compression="auto"),
             "ring": comm(lockstep=False, compression="off", fallback="ring")}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def call(mode, x):
        if mode == "native":
            y = x.clone()
            dist.all_reduce(y)
            return y
        return comms[mode].all_reduce(x)

    def agree(values: list[int]) -> tuple[list[int], list[int]]:
        t = torch.tensor(values, dtype=torch.int64, device=small)
        hi, lo = t.clone(), t.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        return hi.tolist(), lo.tolist()

    def signed(d: int) -> int:
        return d - (1 << 64) if d >= 1 << 63 else d

    rows = []
    sizes = [mg.parse_size(s) for s in a.sizes.split(",")]
    for which in a.data.split(","):
        for nbytes in sizes:
            x = rank_data(which, nbytes, rank, world, dev)
            nbytes = x.numel() * x.element_size()
            for _ in range(a.warmup):  # connections, allocator, kernels, the adaptive calibration
                for mode in MODES:
                    call(mode, x)
            sync()
            before = {m: dict(c.stats.__dict__) for m, c in comms.items()}
            times = {m: [] for m in MODES}
            outs = {}
            for i in range(a.repeats):
                for mode in (MODES if i % 2 == 0 else MODES[::-1]):  # interleaved against drift
                    dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    outs[mode] = call(mode, x)
                    sync()
                    times[mode].append(time.perf_counter() - t0)
            outs["ring"] = comms["ring"].all_reduce(x)
            sync()
            digests = [signed(mg.digest(outs[m])) for m in (*MODES, "ring")]
            hi, lo = agree(digests)
            # Every rank timed each call itself; the call took as long as its slowest rank.
            t = torch.tensor([times[m] for m in MODES], dtype=torch.float64, device=small)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            t = t.cpu()
            ring_digest = digests[3]
            for k, mode in enumerate(MODES):
                sec = statistics.median(t[k].tolist())
                row = {"device": a.device, "backend": backend, "link": a.link, "world": world, "data": which,
                       "nbytes": nbytes, "mode": mode, "seconds": sec, "seconds_all": t[k].tolist(),
                       "algbw_GBps": nbytes / sec / 1e9, "busbw_GBps": nbytes / sec / 1e9 * 2 * (world - 1) / world,
                       "identical_across_ranks": hi[k] == lo[k],
                       "equals_uncompressed_ring": hi[k] == lo[k] == ring_digest if hi[3] == lo[3] else False,
                       "digest": f"{digests[k] & ((1 << 64) - 1):016x}"}
                if mode in comms:
                    s, b = comms[mode].stats, before[mode]
                    raw, wire = s.raw_bytes - b["raw_bytes"], s.wire_bytes - b["wire_bytes"]
                    row["compressed_calls"] = s.compressed - b["compressed"]
                    row["native_calls"] = s.native - b["native"]
                    row["wire_ratio"] = wire / raw if raw else None
                if mode == "adaptive":
                    pol = comms["adaptive"].policy
                    row["path"] = ("compressed" if row["native_calls"] == 0 else
                                   "native" if row["compressed_calls"] == 0 else "mixed")
                    if pol.m is not None:
                        tn, tc = pol.predict(nbytes, "bfloat16")
                        row["predicted_native_s"], row["predicted_compressed_s"] = tn, tc
                rows.append(row)
            if rank == 0:
                logger.info("%s w%d %s %s: %s", a.link, world, which, mg.human(nbytes), "  ".join(
                    f"{r['mode']} {r['seconds'] * 1e3:.2f} ms" for r in rows[-3:]))
            del x, outs
    pol = comms["adaptive"].policy
    info = {"threshold_bytes": pol.threshold("bfloat16") if pol.m else None,
            "policy": pol.describe("bfloat16") if pol.m else None,
            "ring_config": str(comms["adaptive"].config)}
    for c in comms.values():
        c.close()
    dist.destroy_process_group()
    if rank == 0:
        result = {"rows": rows, "adaptive": {f"{a.link}/w{world}": info}}
        if a.result_file:
            Path(a.result_file).write_text(json.dumps(result))
        else:  # run by torchrun: this rank reports the one configuration
            report(result["rows"], result["adaptive"], [], a)


def _use_lockstep(comm) -> None:
    """CPU rehearsal of the CUDA backend: its lock-step engine and NCCL-style transport
    (batch_isend_irecv, exact sizes, headers first), here over gloo."""
    from uzip_serve import format as fmt
    from uzip_serve.collectives.cuda import LockstepRingEngine, NcclP2P

    comm._engine = LockstepRingEngine(NcclP2P(comm.group), comm.rank, comm.world_size,
                                      dtype_code_of=lambda d: fmt.dtype_by_name(str(d)[6:]).code,
                                      sub_chunk_bytes=comm.config.sub_chunk_bytes,
                                      min_sub_chunk_bytes=comm.config.min_sub_chunk_bytes)


# ---- the launcher ----

def launch(world: int, link: str, a, tmp: Path) -> dict:
    """Starts `world` ranks (env:// rendezvous, the variables torchrun sets) in `link` mode
    and returns rank 0's result."""
    port = mg.free_port()
    result_file = tmp / f"result-{link}-{world}.json"
    procs, logs = [], []
    argv = ME + ["--role", "rank", "--device", a.device, "--link", link, "--sizes", a.sizes, "--data", a.data,
                 "--repeats", str(a.repeats), "--warmup", str(a.warmup), "--result-file", str(result_file),
                 "--collective-timeout", str(a.collective_timeout)]
    if a.backend:
        argv += ["--backend", a.backend]
    if a.lockstep:
        argv.append("--lockstep")
    for rank in range(world):
        env = {**os.environ, **mg.LINKS[link], "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "PYTHONPATH": mg.pythonpath()}
        if a.device == "cpu":
            env.update(OMP_NUM_THREADS="1", UZIP_NUM_THREADS="1")
        log = tmp / f"rank{rank}-{link}-{world}.log"
        logs.append(log)
        with open(log, "w") as f:
            procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=mg.REPO))
    deadline = time.monotonic() + a.config_timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{link} x{world}: ranks still running after {a.config_timeout} s")
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(3)  # let the others print their side of it
                break
            time.sleep(0.5)
        bad = [r for r, p in enumerate(procs) if p.poll() != 0]
        if bad or not result_file.exists():
            raise RuntimeError(f"{link} x{world}: ranks {bad or 'all'} failed\n" + "\n".join(
                f"--- rank {r} ---\n{mg.tail(logs[r], 2500)}" for r in (bad or range(world))))
        return json.loads(result_file.read_text())
    finally:
        mg.kill_all(procs)


def orchestrate(a) -> int:
    if a.device == "cuda":
        worlds_req = None if a.gpus == "auto" else [int(g) for g in a.gpus.split(",")]
        have = mg.require_gpus(max(worlds_req or [2]), "benchmarks.allreduce_gpu")
        # largest first: a many-GPU machine is the scarce one, smaller worlds can run elsewhere later
        worlds = worlds_req or ([have] if have not in (2, 4, 8) else []) + [w for w in (8, 4, 2) if w <= have]
        links = a.links.split(",") if a.links else ["nvlink", "sockets"]
    else:
        worlds = [2, 3] if a.gpus == "auto" else [int(g) for g in a.gpus.split(",")]
        if min(worlds) < 2:
            raise SystemExit("an all-reduce benchmark needs at least 2 ranks")
        links = a.links.split(",") if a.links else ["loopback"]
    budget = mg.Budget(a.time_budget)
    rows, adaptive, errors, skipped = [], {}, [], []
    if a.report_only:
        report([], {}, [], a)
        return 0
    tmp = Path(a.logs) if a.logs else Path(tempfile.mkdtemp(prefix="uzip-allreduce-gpu-"))
    tmp.mkdir(parents=True, exist_ok=True)
    logger.info("rank logs in %s", tmp)
    for world in worlds:
        for link in links:
            if budget.left() <= 0:
                skipped.append(f"--gpus {world} --links {link}")
                continue
            t0 = time.monotonic()
            try:
                res = launch(world, link, a, tmp)
                rows += res["rows"]
                adaptive.update(res["adaptive"])
            except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the others
                errors.append({"link": link, "world": world, "error": str(e)[-6000:]})
                logger.error("%s", e)
            logger.info("%s x%d done in %.0f s", link, world, time.monotonic() - t0)
            report(rows, adaptive, errors, a, skipped, quiet=True)  # after every configuration: a killed run keeps them
    report(rows, adaptive, errors, a, skipped)
    if skipped:
        print("not run (time budget): " + "; ".join(skipped) + " -- run them with a later call")
    return 1 if errors else 0


# ---- the report ----

def report(rows, adaptive, errors, a, skipped=(), quiet: bool = False) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{_name(a.device)}.json"
    prev = {}
    if not a.fresh and path.exists():
        try:
            prev = json.loads(path.read_text())
        except ValueError:
            prev = {}
    rows = mg.merge_rows(path, rows, _key, a.fresh)
    for r in rows:
        ref = next((p for p in rows if _key(p) == _key(r) and p["data"] == r["data"] and p["nbytes"] == r["nbytes"]
                    and p["mode"] == "native"), None)
        r["vs_native"] = ref["seconds"] / r["seconds"] if ref else None  # > 1: faster than NCCL (gloo on cpu)
    adaptive = {**prev.get("adaptive", {}), **adaptive}
    result = {"benchmark": "allreduce_gpu", "device": a.device, "machine": machine.describe(),
              "topology": mg.topology() if a.device == "cuda" else None,
              "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("NCCL_", "UZIP_", "UCX_"))},
              "repeats": a.repeats, "warmup": a.warmup, "baseline": "x.clone(); dist.all_reduce(x) (out-of-place)",
              "data": {"activations": "Gemma-3-270M bf16 activations (hidden states + KV cache), tiled, rank-rotated",
                       "gradients": "all-MiniLM-L6-v2 fp32 gradients of one step cast to bf16, tiled, rank-rotated"},
              "adaptive": adaptive, "errors": errors, "not_run": list(skipped), "verdict": verdict(rows),
              "rows": rows}
    path.write_text(json.dumps(result, indent=2) + "\n")
    text = table(rows)
    (out / f"{_name(a.device)}.md").write_text(
        f"# {result['benchmark']} ({a.device})\n\n{json.dumps(result['machine'])}\n\n```\n{text}\n```\n\n"
        + "\n".join(f"- {v}" for v in result["verdict"]) + "\n")
    try:
        plot(rows, out / f"{_name(a.device)}.png", result)
    except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
        logger.warning("plot failed: %s", e)
    if not quiet:
        print(text)
        for v in result["verdict"]:
            print(v)
        for e in errors:
            print(f"ERROR {e['link']} x{e['world']}: {e['error'][-1500:]}")
    return result


def verdict(rows) -> list[str]:
    """Issue 9's bars, per configuration present."""
    out = []
    for key in dict.fromkeys(_key(r) for r in rows):
        dev, link, world = key
        rs = [r for r in rows if _key(r) == key]
        same = all(r["identical_across_ranks"] for r in rs)
        lossless = all(r["equals_uncompressed_ring"] for r in rs if r["mode"] == "compressed")
        line = f"{link} x{world}: results bit-identical across ranks: {same}; compressed == uncompressed ring: " \
               f"{lossless}"
        if dev == "cpu":
            line += " (CPU rehearsal: issue 9's speed bars apply to GPUs only)"
        elif link in ("sockets", "tcp"):
            big = [r for r in rs if r["mode"] == "compressed" and r["nbytes"] >= 16 << 20]
            ada = [r for r in rs if r["mode"] == "adaptive" and r["nbytes"] >= 16 << 20]
            if big:
                line += (f"; >= 16 MiB: compressed {min(r['vs_native'] for r in big):.2f}x..{max(r['vs_native'] for r in big):.2f}x"
                         f" NCCL, adaptive min {min(r['vs_native'] for r in ada):.2f}x (bar: >= 1.30x) -> "
                         f"{'PASS' if min(r['vs_native'] for r in ada) >= 1.3 else 'FAIL'}")
        else:
            ada = [r for r in rs if r["mode"] == "adaptive"]
            worst = min(r["vs_native"] for r in ada)
            line += f"; adaptive worst {worst:.3f}x NCCL (bar: >= 0.952x, i.e. <= 5% slower) -> " \
                    f"{'PASS' if worst >= 1 / 1.05 else 'FAIL'}"
        out.append(line)
    return out


def table(rows) -> str:
    b = rows[0]["backend"] if rows else "nccl"
    lines = [f"{'link':8} {'n':>2} {'data':11} {'size':>8} {b + ' ms':>8} {'busbw':>7} {'compr ms':>9} {'busbw':>7} "
             f"{'wire':>5} {'x ' + b:>6} {'adapt ms':>9} {'x ' + b:>6} {'path':>10} {'same':>4} {'lossless':>8}"]
    keys = dict.fromkeys((r["link"], r["world"], r["data"], r["nbytes"]) for r in rows)
    for link, world, data, nb in keys:
        get = {r["mode"]: r for r in rows if (r["link"], r["world"], r["data"], r["nbytes"]) == (link, world, data, nb)}
        if set(get) != set(MODES):
            continue
        n, c, d = get["native"], get["compressed"], get["adaptive"]
        same = all(r["identical_across_ranks"] for r in get.values())
        lines.append(f"{link:8} {world:>2} {data:11} {mg.human(nb):>8} {n['seconds'] * 1e3:8.3f} "
                     f"{n['busbw_GBps']:7.2f} {c['seconds'] * 1e3:9.3f} {c['busbw_GBps']:7.2f} "
                     f"{(c.get('wire_ratio') or 0):5.3f} {c['vs_native']:6.2f} {d['seconds'] * 1e3:9.3f} "
                     f"{d['vs_native']:6.2f} {d['path']:>10} {'yes' if same else 'NO':>4} "
                     f"{'yes' if c['equals_uncompressed_ring'] else 'NO':>8}")
    return "\n".join(lines) + (f"\n(busbw GB/s = size/time*2(n-1)/n; x {b} > 1: faster than {b}'s all_reduce; "
                               "wire = compressed/raw bytes; same = every mode's result bit-identical on all ranks; "
                               "lossless = compressed result == uncompressed ring's, bitwise)")


def plot(rows, path: Path, result) -> None:
    """One panel per (link, world): speed-up over the native all-reduce against size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    worlds = sorted({r["world"] for r in rows})
    base = rows[0]["backend"] if rows else "nccl"
    fig, axes = plt.subplots(len(links), len(worlds), figsize=(5 * len(worlds), 4 * len(links)), squeeze=False)
    for i, link in enumerate(links):
        for j, world in enumerate(worlds):
            ax = axes[i][j]
            for mode, style in (("compressed", "--"), ("adaptive", "-")):
                for data, marker in (("activations", "o"), ("gradients", "s")):
                    pts = sorted((r["nbytes"], r["vs_native"]) for r in rows if r["link"] == link
                                 and r["world"] == world and r["mode"] == mode and r["data"] == data)
                    if pts:
                        ax.plot([p[0] / 2**20 for p in pts], [p[1] for p in pts], style, marker=marker, ms=4,
                                label=f"{mode}, {data}")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.axhline(1 / 1.05, color="r", lw=0.6, ls=":", label=f"5% slower than {base}")
            ax.axhline(1.3, color="g", lw=0.6, ls=":", label="1.3x")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message size (MiB)")
            ax.set_ylabel(f"speed-up over {base} all_reduce")
            ax.set_title(f"{link}, {world} ranks", fontsize=10)
            ax.legend(fontsize=6)
    m = result["machine"]
    gpu = m.get("gpu", {}).get("name", "CPU rehearsal (gloo)")
    fig.suptitle(f"{gpu}; {m['date']}; higher is better", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["orchestrate", "rank"], default="orchestrate")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--gpus", default="auto", help="world sizes, e.g. 2,4,8 (auto: those of 2,4,8 that fit; "
                                                  "2,3 on cpu)")
    p.add_argument("--links", help="nvlink,sockets (cuda default) or loopback (cpu default)")
    p.add_argument("--link", default="nvlink", help="(rank role) the link mode this configuration runs in")
    p.add_argument("--sizes", default=DEFAULT_SIZES)
    p.add_argument("--data", default="activations,gradients")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lockstep", action="store_true", help="cpu: run the CUDA backend's lock-step engine over gloo")
    p.add_argument("--time-budget", type=float, help="seconds; start no configuration after it (report what ran)")
    p.add_argument("--config-timeout", type=float, default=1800, help="seconds one configuration may take")
    p.add_argument("--collective-timeout", type=float, default=600)
    p.add_argument("--fresh", action="store_true", help="do not merge with an earlier result in --out")
    p.add_argument("--result-file")
    p.add_argument("--data-file", help="a real-data slice (python -m benchmarks.multigpu --make-slice allreduce ...) "
                                       "instead of benchmarks/realdata.py's cache; sets " + mg.DATA_ENV)
    p.add_argument("--logs", help="folder for every rank's log (default: a new temporary folder)")
    p.add_argument("--report-only", action="store_true", help="rewrite table and plot from the JSON in --out")
    p.add_argument("--out", default=str(mg.OUT_DIR))
    a = p.parse_args(argv)
    if a.backend == "gloo" and a.device == "cuda":
        p.error("--backend gloo runs on CPU: add --device cpu")
    if a.backend == "nccl" and a.device == "cpu":
        p.error("--backend nccl needs --device cuda")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if a.data_file:
        os.environ[mg.DATA_ENV] = str(Path(a.data_file).resolve())  # the ranks inherit it
    if a.role == "rank":
        rank_main(a)
        release_process_groups()
        return 0
    return orchestrate(a)


if __name__ == "__main__":
    raise SystemExit(main())
