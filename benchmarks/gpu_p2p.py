"""CUDA tensors between two processes on one GPU: uzip_serve.p2p (raw and adaptive, which
take the CUDA route; compressed, which takes the IPC path's chunked mode; the IPC path alone;
CUDA->CPU; the chunk stream) vs a reference CUDA IPC copy through torch.multiprocessing vs
plain ucxx as found (issue 11; docs/gpu_p2p.md).

    python -m benchmarks.gpu_p2p [--sizes-mib 16 256 1024] [--out docs/benchmarks]
    python -m benchmarks.gpu_p2p --diagnose --out DIR     # what UCX does: ucx_info, ucx_perftest, PROTO_INFO

Endpoints take UZIP_P2P_* settings from the environment (UZIP_P2P_GPU_SPIN_S=0 ... is how the
spins were A/B-tested). UZIP_BENCH_NO_WARM_CODEC / UZIP_BENCH_WARM_CODEC_ALWAYS skip or force
the GPU codec's warm-up in both processes (how the process-pair spread was told apart from it).

GB/s counts the tensor's bytes once, over the wall time of one transfer as the sender sees
it (from the call until the receiver confirmed its copy), median of several. Each process
holds its buffers across repetitions, as a weight push or KV transfer would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20
CTX = None


def _ctx():
    global CTX
    if CTX is None:
        import torch.multiprocessing as tmp

        CTX = tmp.get_context("spawn")
    return CTX


def _reps(nbytes: int, fast: bool = False) -> int:
    """Repetitions per size; `fast` paths (a transfer well under a millisecond) get more, so
    that the raw vs adaptive comparison is not decided by a few noisy samples."""
    base = 30 if nbytes <= 16 * MiB else 15 if nbytes <= 256 * MiB else 8
    return base * 3 if fast else base


def _src(nbytes: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(nbytes)
    return (torch.randn(nbytes // 2, generator=g, device="cuda") * 0.02).to(torch.bfloat16)


def _warm_gpu(seconds: float = 0.2) -> None:
    """Device copies for `seconds` before a size is timed: an idle GPU clocks down (between
    methods each run waits seconds for its receiving process), and a sub-millisecond transfer
    timed right after would measure the clock ramp, not the method."""
    import torch

    a = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            b.copy_(a)
        torch.cuda.synchronize()


# ---- ours ---------------------------------------------------------------------------------

def _warm_codec():
    """Compiles the GPU codec's kernels (NVRTC, cached on disk) before anything is timed:
    the first compressed transfer of a fresh machine otherwise waits for the compiler."""
    if os.environ.get("UZIP_BENCH_NO_WARM_CODEC"):
        return
    import torch

    import uzip_serve as uz

    try:
        x = _src(1 * MiB)
        frame = uz.compress(x)
        uz.decompress(frame, device="cuda")
        out = torch.empty(uz.max_compressed_size(x.nbytes, "uint8"), dtype=torch.uint8, device="cuda")
        n = uz.codec.compress_device(x, out)
        uz.codec.decompress_device(out[:n])
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - no GPU codec: the compressed rows say so
        print("GPU codec warm-up failed:", e, flush=True)


def _with_receiver(target, args, sender) -> None:
    """Starts `target(q, port_q, *args)` in a process of its own (it puts its listening port on
    port_q and its checks on q), runs `await sender(port, q)` here, then reaps the process."""
    q, port_q = _ctx().Queue(), _ctx().Queue()
    proc = _ctx().Process(target=target, args=(q, port_q, *args), daemon=True)
    proc.start()
    try:
        asyncio.run(sender(port_q.get(timeout=120), q))
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _our_receiver(q, port_q, cfg, sizes, dest, reps, own_loop=False):
    import torch

    from uzip_serve import p2p

    if cfg["compression"] != "off" or os.environ.get("UZIP_BENCH_WARM_CODEC_ALWAYS"):
        _warm_codec()

    async def main():
        if own_loop:
            p2p.use_running_loop()
        lst = await p2p.listen(0, p2p.TransportConfig.from_env(**cfg))
        port_q.put(lst.port)
        ep = await lst.accept(timeout=120)
        for nbytes in sizes:
            if dest == "cuda":
                into = {"w": torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")}
            else:
                into = {"w": torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)}
            prof = _LoopProfile("receiver") if nbytes == max(sizes) else None
            preposted = 0
            for i in range(reps[nbytes] + 2):
                if prof and i == 2:
                    prof.start()
                await ep.recv_tensors(into=into)
                preposted += ep.last_stats.preposted
            if prof:
                prof.stop()
            ok = torch.equal(into["w"].cuda().view(torch.int16), _src(nbytes).view(torch.int16))
            q.put(("checked", nbytes, ok, preposted))
        await ep.close()

    asyncio.run(main())


_MARKS: list = []


class _LoopProfile:
    """Diagnosis (UZIP_BENCH_PROFILE=1): cProfile of the UCX loop's thread, where every
    transfer runs, around the timed transfers of the largest size; printed by tottime."""

    def __init__(self, who: str):
        import cProfile

        from uzip_serve.p2p.loop import ucx_loop

        self.who, self.prof, self.loop = who, cProfile.Profile(), ucx_loop()
        self.on = os.environ.get("UZIP_BENCH_PROFILE") == "1"

    def start(self):
        if self.on:
            asyncio.run_coroutine_threadsafe(self._call(self.prof.enable), self.loop).result()

    def stop(self):
        if not self.on:
            return
        import io
        import pstats

        asyncio.run_coroutine_threadsafe(self._call(self.prof.disable), self.loop).result()
        text = io.StringIO()
        pstats.Stats(self.prof, stream=text).sort_stats("tottime").print_stats(28)
        print(f"---- profile of the UCX loop thread, {self.who}\n" + text.getvalue(), flush=True)

    @staticmethod
    async def _call(fn):
        fn()


def _trace_messages() -> list:
    """Diagnosis (--trace): records in _MARKS when each message of this process's endpoints
    completes (the endpoint methods are wrapped once per process)."""
    from uzip_serve.p2p import ucx

    if getattr(ucx.Endpoint, "_traced", False):
        return _MARKS

    def wrap(name):
        orig = getattr(ucx.Endpoint, name)

        def traced(self, buf):
            posted = orig(self, buf)  # send/recv post when called: keep that

            async def completed():
                await posted
                _MARKS.append((name, time.perf_counter()))

            return completed()

        setattr(ucx.Endpoint, name, traced)

    for name in ("send", "recv", "send_many", "recv_many"):
        wrap(name)
    ucx.Endpoint._traced = True
    return _MARKS


def _timeline(runs) -> str:
    """Median completion time of each message after the call, over traced transfers."""
    n = min(len(r) for r in runs)
    cols = []
    for k in range(n):
        cols.append(f"{runs[0][k][0]} {statistics.median(r[k][1] for r in runs) * 1e3:.3f}")
    return ", ".join(cols) + " (ms)"


def bench_ours(sizes, compression, dest="cuda", cuda_ipc="auto", cuda_ucx="auto", progress="blocking",
               trace=False, own_loop=False):
    """own_loop: both sides call p2p.use_running_loop() (a fresh process only: it binds UCX)."""
    from uzip_serve import p2p

    cfg = dict(compression=compression, cuda_ipc=cuda_ipc, cuda_ucx=cuda_ucx, deadline_s=60,
               progress_mode=progress)
    marks = _trace_messages() if trace else []
    if compression != "off" or os.environ.get("UZIP_BENCH_WARM_CODEC_ALWAYS"):
        _warm_codec()
    fast = compression != "on" and dest == "cuda" and "auto" in (cuda_ipc, cuda_ucx)
    reps = {n: _reps(n, fast) for n in sizes}
    out = {}

    async def main(port, q):
        if own_loop:
            p2p.use_running_loop()
        ep = await p2p.connect("127.0.0.1", port, p2p.TransportConfig.from_env(**cfg))
        for nbytes in sizes:
            src = {"w": _src(nbytes)}
            _warm_gpu()
            times, stats, runs = [], None, []
            prof = _LoopProfile("sender") if nbytes == max(sizes) else None
            for i in range(reps[nbytes] + 2):
                if prof and i == 2:
                    prof.start()
                marks.clear()
                t0 = time.perf_counter()
                stats = await ep.send_tensors(src)
                if i >= 2:  # two warm-ups: mapping opened, staging allocated, codec compiled
                    times.append(time.perf_counter() - t0)
                    runs.append([(name, t - t0) for name, t in marks])
            if prof:
                prof.stop()
            _, _, ok, preposted = q.get(timeout=300)
            med = statistics.median(times)
            out[nbytes] = {"gbps": nbytes / med / 1e9, "median_s": med, "min_s": min(times), "exact": bool(ok),
                           "gpu_spin_s": ep.config.gpu_spin_s, "caller_spin_s": ep.config.caller_spin_s,
                           "receiver_preposted": f"{preposted} of {len(times) + 2}",
                           "path": stats.path, "ratio": stats.ratio, "chunks_compressed": stats.chunks_compressed,
                           "decision": stats.decisions[-1].reason if stats.decisions else None}
            print(f"  ours {compression:>4} ->{dest}: {nbytes // MiB:5d} MiB {out[nbytes]['gbps']:8.1f} GB/s "
                  f"path={stats.path} ratio={stats.ratio:.3f} exact={ok} preposted={preposted}", flush=True)
            if trace and runs:
                out[nbytes]["timeline"] = _timeline(runs)
                print(f"    sender timeline: {out[nbytes]['timeline']}; total {med * 1e3:.3f} ms", flush=True)
        await ep.close()

    _with_receiver(_our_receiver, (cfg, sizes, dest, reps, own_loop), main)
    return out


# ---- adaptive vs raw in the same two processes ---------------------------------------------
# Fresh process pairs running identical code differ by up to 1.7x on the H200's VM (measured
# 2026-12-04, docs/gpu_p2p.md), more than the 5% the adaptive switch is allowed; so the switch
# is judged here on two endpoints of one pair of processes, transfers alternating between them.

MODES = ("off", "auto")


def _alternating_receiver(q, port_q, sizes, reps):
    import torch

    from uzip_serve import p2p

    async def main():
        lst = await p2p.listen(0, p2p.TransportConfig.from_env(compression="auto", deadline_s=60))
        port_q.put(lst.port)
        eps = {}
        for _ in MODES:
            ep = await lst.accept(timeout=120)
            eps[(await ep.recv_bytes()).decode()] = ep
        for nbytes in sizes:
            into = {"w": torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")}
            for i in range(reps[nbytes] + 2):
                for mode in MODES[:: 1 if i % 2 == 0 else -1]:
                    await eps[mode].recv_tensors(into=into)
            ok = torch.equal(into["w"].view(torch.int16), _src(nbytes).view(torch.int16))
            q.put(("checked", nbytes, ok))
        for ep in eps.values():
            await ep.close()

    asyncio.run(main())


def bench_alternating(sizes):
    """Raw and adaptive on two endpoints between the same two processes, one transfer each in
    turn (the order flipping every round), so both see the same process placement."""
    from uzip_serve import p2p

    reps = {n: _reps(n, fast=True) for n in sizes}
    out = {}

    async def main(port, q):
        eps = {}
        for mode in MODES:
            eps[mode] = await p2p.connect("127.0.0.1", port,
                                          p2p.TransportConfig.from_env(compression=mode, deadline_s=60))
            await eps[mode].send_bytes(mode.encode())
        for nbytes in sizes:
            src = {"w": _src(nbytes)}
            _warm_gpu()
            times = {m: [] for m in MODES}
            paths = {}
            for i in range(reps[nbytes] + 2):
                for mode in MODES[:: 1 if i % 2 == 0 else -1]:
                    t0 = time.perf_counter()
                    stats = await eps[mode].send_tensors(src)
                    if i >= 2:
                        times[mode].append(time.perf_counter() - t0)
                    paths[mode] = stats.path
            _, _, ok = q.get(timeout=300)
            med = {m: statistics.median(times[m]) for m in MODES}
            pair = statistics.median(r / a for r, a in zip(times["off"], times["auto"]))
            out[nbytes] = {"gbps": nbytes / med["auto"] / 1e9, "raw_gbps": nbytes / med["off"] / 1e9,
                           "adaptive_over_raw": med["off"] / med["auto"], "pairwise_median": pair,
                           "paths": paths, "exact": bool(ok), "transfers_each": len(times["off"])}
            print(f"  alternating: {nbytes // MiB:5d} MiB raw {out[nbytes]['raw_gbps']:7.1f} GB/s, adaptive "
                  f"{out[nbytes]['gbps']:7.1f} GB/s: adaptive / raw {out[nbytes]['adaptive_over_raw']:.3f} "
                  f"(pairwise median {pair:.3f}) paths={paths} exact={ok}", flush=True)
        for ep in eps.values():
            await ep.close()

    _with_receiver(_alternating_receiver, (sizes, reps), main)
    return out


# ---- reference: torch.multiprocessing shares the CUDA tensor, the receiver copy_()s ----------

def _ref_receiver(q, back, sizes):
    import torch

    copy_times = {}
    for nbytes in sizes:
        dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        ct = []
        for _ in range(_reps(nbytes) + 2):
            src = q.get()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            ct.append(time.perf_counter() - t0)
            del src
            back.put(1)
        copy_times[nbytes] = statistics.median(ct[2:])
        back.put(("exact", bool(torch.equal(dst.view(torch.int16), _src(nbytes).view(torch.int16)))))
    back.put(("copy", copy_times))


def bench_reference(sizes):
    q, back = _ctx().Queue(), _ctx().Queue()
    proc = _ctx().Process(target=_ref_receiver, args=(q, back, sizes), daemon=True)
    proc.start()
    e2e = {}
    try:
        for nbytes in sizes:
            src = _src(nbytes)
            _warm_gpu()
            times = []
            for i in range(_reps(nbytes) + 2):
                t0 = time.perf_counter()
                q.put(src)
                back.get(timeout=120)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            exact = back.get(timeout=120)[1]
            e2e[nbytes] = (statistics.median(times), exact)
        copy = back.get(timeout=120)[1]
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    out = {}
    for nbytes in sizes:
        med, exact = e2e[nbytes]
        out[nbytes] = {"gbps": nbytes / med / 1e9, "median_s": med, "exact": exact,
                       "copy_only_gbps": nbytes / copy[nbytes] / 1e9, "copy_only_s": copy[nbytes]}
        print(f"  reference:      {nbytes // MiB:5d} MiB {out[nbytes]['gbps']:8.1f} GB/s end to end, "
              f"{out[nbytes]['copy_only_gbps']:8.1f} GB/s copy_() alone", flush=True)
    return out


# ---- plain ucxx -----------------------------------------------------------------------------

def _ucxx_env(tls, mode):
    env = dict(os.environ, UCX_TLS=tls, UCX_WARN_UNUSED_ENV_VARS="n")
    if mode:
        env["UCXPY_PROGRESS_MODE"] = mode
    return env


def _plain_receiver(q, port_q, sizes, env):
    os.environ.update(env)
    import torch
    import ucxx

    async def main():
        done = asyncio.get_running_loop().create_future()

        async def serve(ep):
            for nbytes in sizes:
                dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                for _ in range(_reps_plain(nbytes) + 1):
                    await ep.recv(dst)
                    await ep.send(bytearray(1))
                q.put(("exact", bool(torch.equal(dst, _src(nbytes).view(torch.uint8)))))
            done.set_result(None)

        lst = ucxx.create_listener(serve)
        port_q.put(lst.port)
        await done

    asyncio.run(main())


def _reps_plain(nbytes):
    return 5 if nbytes <= 16 * MiB else 3 if nbytes <= 256 * MiB else 2


def bench_plain_ucxx(sizes, tls="cuda_ipc,cuda_copy,tcp", mode=None):
    """Plain ucxx: the sender sends the CUDA tensor, the receiver answers one byte."""
    env = _ucxx_env(tls, mode)
    q, port_q = _ctx().Queue(), _ctx().Queue()
    proc = _ctx().Process(target=_plain_receiver, args=(q, port_q, sizes, env), daemon=True)
    proc.start()
    saved = dict(os.environ)
    os.environ.update(env)
    out = {}
    try:
        import ucxx

        port = port_q.get(timeout=120)

        async def main():
            ep = await ucxx.create_endpoint("127.0.0.1", port)
            ack = bytearray(1)
            for nbytes in sizes:
                src = _src(nbytes).view(__import__("torch").uint8)
                _warm_gpu()
                times = []
                for i in range(_reps_plain(nbytes) + 1):
                    t0 = time.perf_counter()
                    await ep.send(src)
                    await ep.recv(ack)
                    if i:
                        times.append(time.perf_counter() - t0)
                exact = q.get(timeout=600)[1]
                med = statistics.median(times)
                out[nbytes] = {"gbps": nbytes / med / 1e9, "median_s": med, "exact": exact}
                print(f"  plain ucxx {mode or 'default'} {tls}: {nbytes // MiB:5d} MiB {out[nbytes]['gbps']:8.2f} GB/s "
                      f"exact={exact}", flush=True)
            await ep.close()

        asyncio.run(main())
    finally:
        os.environ.clear()
        os.environ.update(saved)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


# ---- diagnosis ------------------------------------------------------------------------------

def _ucx_bin(name):
    try:
        import libucx

        p = Path(libucx.__file__).parent / "bin" / name
        if p.exists():
            return str(p)
    except ImportError:
        pass
    return shutil.which(name)


def _sh(cmd, out: Path, env=None, timeout=60):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        text = r.stdout + r.stderr
    except Exception as e:  # noqa: BLE001 - the log says what failed
        text = f"{cmd}: {type(e).__name__}: {e}\n"
    with open(out, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{text}\n")
    return text


def _lib_env():
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
    try:
        import libucx

        lib = str(Path(libucx.__file__).parent / "lib")
        env["LD_LIBRARY_PATH"] = lib + ":" + env.get("LD_LIBRARY_PATH", "")
    except ImportError:
        pass
    return env


def perftest(tls, nbytes, out: Path, iters=20):
    """ucx_perftest tag_bw between two processes with CUDA memory (UCX's own C path, busy polling)."""
    exe = _ucx_bin("ucx_perftest")
    if not exe:
        return None
    env = dict(_lib_env(), UCX_TLS=tls)
    port = str(13337 + nbytes % 1000)
    server = subprocess.Popen([exe, "-p", port], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)
    text = _sh([exe, "127.0.0.1", "-p", port, "-t", "tag_bw", "-m", "cuda,cuda", "-s", str(nbytes), "-n", str(iters),
                "-w", "3"], out, env=env, timeout=120)
    try:
        server.wait(20)
    except subprocess.TimeoutExpired:
        server.kill()
    # the last "Final:" line: bandwidth column is MB/s (average)
    for line in text.splitlines():
        if line.strip().startswith("Final:"):
            cols = line.split()
            try:
                return float(cols[6]) * 1e6 / 1e9 if len(cols) > 6 else None
            except ValueError:
                return None
    return None


def diagnose(out_dir: Path, sizes):
    log = out_dir / "ucx_diag.log"
    log.write_text("")
    info = _ucx_bin("ucx_info")
    env = _lib_env()
    res = {"perftest_gbps": {}, "plain_ucxx": {}}
    if info:
        _sh([info, "-v"], log, env)
        text = _sh([info, "-d"], log, env)
        res["ucx_info_transports"] = sorted({ln.split(":", 1)[1].strip() for ln in text.splitlines()
                                             if "Transport:" in ln})
        _sh([info, "-c"], log, env)
        # which protocols UCX would pick for a 256 MiB CUDA tag send to itself over each transport
    for tls in ("cuda_ipc,cuda_copy,tcp", "cuda_copy,tcp"):
        for nbytes in sizes if tls.startswith("cuda_ipc") else sizes[1:2]:
            g = perftest(tls, nbytes, log)
            res["perftest_gbps"][f"{tls} {nbytes // MiB}MiB"] = g
            print(f"  ucx_perftest {tls} {nbytes // MiB} MiB: {g} GB/s", flush=True)
    # ucxx (Python) in each progress mode, with UCX_PROTO_INFO to see the protocol chosen
    for mode in ("thread", "blocking", "polling"):
        os.environ["UCX_PROTO_INFO"] = "y"
        try:
            r = _run_child_capture([sys.executable, "-m", "benchmarks.gpu_p2p", "--plain-child", mode,
                                    "--sizes-mib", *[str(s // MiB) for s in sizes[:2]]], out_dir / f"proto_{mode}.log",
                                   timeout=60)
        finally:
            os.environ.pop("UCX_PROTO_INFO", None)
        res["plain_ucxx"][mode] = r
    return res


def _run_child_capture(cmd, path: Path, timeout=240):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        text = r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += "\nTIMEOUT\n"
    path.write_text(text)
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return None


# ---- report ---------------------------------------------------------------------------------

def plot(results, sizes, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(k, v) for k, v in results.items() if isinstance(v, dict) and all(s in v for s in sizes)]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / max(1, len(rows))
    for i, (name, v) in enumerate(rows):
        ax.bar([j + i * width for j in range(len(sizes))], [max(v[s]["gbps"], 1e-3) for s in sizes], width,
               label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"{s // MiB} MiB" for s in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (tensor bytes / transfer wall time)")
    ax.set_title("CUDA tensor, process to process, one H200")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _mean_reference(first, again, sizes) -> dict:
    """Per size, the reference at the mean of its two median times (either alone if one is missing)."""
    out = {}
    for n in sizes:
        runs = [r[n] for r in (first, again) if n in r]
        if runs:
            t = statistics.mean(r["median_s"] for r in runs)
            c = statistics.mean(r["copy_only_s"] for r in runs)
            out[n] = {"gbps": n / t / 1e9, "median_s": t, "copy_only_gbps": n / c / 1e9, "copy_only_s": c,
                      "exact": all(r["exact"] for r in runs), "runs_gbps": [r["gbps"] for r in runs]}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 256, 1024])
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--diagnose", action="store_true")
    ap.add_argument("--plain-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--own-loop-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--only", default=None, help="run only the methods whose name contains this")
    ap.add_argument("--progress", default="blocking", help="ucxx progress mode of our endpoints")
    ap.add_argument("--trace", action="store_true", help="also print when each message completes (sender)")
    args = ap.parse_args()
    sizes = [s * MiB for s in args.sizes_mib]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.own_loop_child:
        r = bench_ours(sizes, "off", progress=args.progress, own_loop=True)
        print("RESULT " + json.dumps({str(k): v for k, v in r.items()}), flush=True)
        return
    if args.plain_child:
        mode = None if args.plain_child == "default" else args.plain_child
        r = bench_plain_ucxx(sizes, mode=mode)
        print("RESULT " + json.dumps({str(k): v for k, v in r.items()}), flush=True)
        return
    from benchmarks.machine import describe

    results = {"machine": describe(), "sizes": sizes}
    if args.diagnose:
        results["diagnosis"] = diagnose(out, sizes)
        (out / "gpu_p2p_diag.json").write_text(json.dumps(results, indent=1, default=str))
        return
    ours = dict(progress=args.progress, trace=args.trace)
    # The reference runs first and again after ours: on these shared machines it moved by 25%
    # between runs, so ours is compared with both measurements around it (their mean time).
    runs = [
        ("reference torch.mp IPC + copy_", lambda: bench_reference(sizes)),
        ("ours raw", lambda: bench_ours(sizes, "off", **ours)),
        ("ours adaptive", lambda: bench_ours(sizes, "auto", **ours)),
        ("ours adaptive vs raw, alternating in the same processes", lambda: bench_alternating(sizes)),
        # In a process of its own: use_running_loop binds UCX to the loop that called it.
        ("ours raw, callers on the P2P loop (use_running_loop)", lambda: _run_child_capture(
            [sys.executable, "-m", "benchmarks.gpu_p2p", "--own-loop-child", "--progress", args.progress,
             "--sizes-mib", *[str(s // MiB) for s in sizes]], out / "own_loop.log", timeout=300)),
        ("ours compressed", lambda: bench_ours(sizes, "on")),
        ("ours raw, IPC handles (CUDA route off)", lambda: bench_ours(sizes, "off", cuda_ucx="off", **ours)),
        ("ours raw, CUDA->CPU (pinned)", lambda: bench_ours(sizes, "off", dest="cpu")),
        ("reference torch.mp IPC + copy_, again", lambda: bench_reference(sizes)),
        ("plain ucxx as found (thread mode)", lambda: _run_child_capture(
            [sys.executable, "-m", "benchmarks.gpu_p2p", "--plain-child", "default", "--sizes-mib",
             *[str(s // MiB) for s in sizes]], out / "plain_ucxx_default.log", timeout=300)),
        ("ours chunk stream (GPU routes off)", lambda: bench_ours(sizes, "off", cuda_ipc="off", cuda_ucx="off")),
    ]
    for name, fn in runs:
        if any(s in name for s in args.skip) or (args.only and args.only not in name):
            continue
        print(name, flush=True)
        try:
            r = fn()
            results[name] = {int(k): v for k, v in r.items()} if r else {"error": "no result"}
        except Exception as e:  # noqa: BLE001 - one failing method must not lose the others
            import traceback

            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        # written after every method: a run stopped at the device call's limit keeps what it measured
        (out / "gpu_p2p.json").write_text(json.dumps(results, indent=1, default=str))
    ref = _mean_reference(results.get("reference torch.mp IPC + copy_", {}),
                          results.get("reference torch.mp IPC + copy_, again", {}), sizes)
    results["reference, mean of both"] = ref
    print("\n| method | " + " | ".join(f"{s // MiB} MiB" for s in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name, v in results.items():
        if not isinstance(v, dict) or not all(s in v for s in sizes):
            continue
        print(f"| {name} | " + " | ".join(f"{v[s]['gbps']:.1f}" for s in sizes) + " |")
    if all(s in ref for s in sizes):
        print(f"| reference copy_() alone | " + " | ".join(f"{ref[s]['copy_only_gbps']:.1f}" for s in sizes) + " |")
        for name in ("ours raw", "ours adaptive", "ours raw, IPC handles (CUDA route off)",
                     "ours raw, callers on the P2P loop (use_running_loop)"):
            v = results.get(name, {})
            if all(s in v for s in sizes):
                print(f"{name} / reference: " + ", ".join(
                    f"{s // MiB} MiB {v[s]['gbps'] / ref[s]['gbps']:.2f}x e2e, "
                    f"{v[s]['gbps'] / ref[s]['copy_only_gbps']:.2f}x copy-only" for s in sizes))
    raw, ada = results.get("ours raw", {}), results.get("ours adaptive", {})
    if all(s in raw and s in ada for s in sizes):
        print("adaptive / raw, separate process pairs: "
              + ", ".join(f"{s // MiB} MiB {ada[s]['gbps'] / raw[s]['gbps']:.3f}" for s in sizes))
    alt = results.get("ours adaptive vs raw, alternating in the same processes", {})
    if all(s in alt for s in sizes):
        print("adaptive / raw, alternating in the same processes: "
              + ", ".join(f"{s // MiB} MiB {alt[s]['adaptive_over_raw']:.3f}" for s in sizes))
    (out / "gpu_p2p.json").write_text(json.dumps(results, indent=1, default=str))
    try:
        plot(results, sizes, out / "gpu_p2p.png")
    except Exception as e:  # noqa: BLE001
        print("plot failed:", e)


if __name__ == "__main__":
    main()
