"""P2P benchmark: the real Gemma-3-270M bf16 state dict over a rate-limited link.

Two processes in two network namespaces joined by a veth pair capped with tbf
(benchmarks/netns.py; needs root). For each link rate, four ways to send the same
tensors, each in the same run:

  plain              UCX, no compression
  compress-then-send every chunk compressed first, then all sent (no overlap)
  split-send         chunk k+1 compressed while chunk k is on the wire
  adaptive           split-send, deciding per chunk whether compression pays

Reports seconds, effective GB/s (raw bytes over wall time), bytes on the wire and
the ratio to plain; writes docs/benchmarks/p2p_link.{json,png}.

    python -m benchmarks.p2p_link [--rates 1gbit,10gbit,none] [--repeats 2] [--max-mb 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import machine

OUT_DIR = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
PORT = 13337
MODES = {
    "plain": dict(compression="off", pipeline=True),
    "compress-then-send": dict(compression="on", pipeline=False),
    "split-send": dict(compression="on", pipeline=True),
    "adaptive": dict(compression="auto", pipeline=True),
}
logger = logging.getLogger("benchmarks.p2p_link")


def load_state_dict(max_mb: int) -> dict:
    from benchmarks import realdata

    sd = realdata.load("gemma_weights")
    if max_mb:
        out, total = {}, 0
        for k, v in sd.items():
            if total >= max_mb << 20:
                break
            out[k] = v
            total += v.nbytes
        sd = out
    return sd


# ---- the two roles, each run inside its namespace ----

def run_receiver(port: int) -> None:
    from uzip_serve import p2p

    async def main():
        lst = await p2p.listen(port, p2p.TransportConfig.from_env(ucx_tls="tcp", deadline_s=120))
        print("ready", flush=True)
        while True:
            ep = await lst.accept()
            n = int(await ep.recv_bytes())  # transfers on this connection, all of the same tensors
            if n == 0:
                return
            prev = None
            for _ in range(n):
                prev = await ep.recv_tensors(into=prev)
            await ep.close()

    asyncio.run(main())


def run_sender(host: str, port: int, repeats: int, max_mb: int) -> None:
    """Sends with every mode, interleaved (plain, c-then-s, split, adaptive, plain, ...),
    each on its own endpoint, so slow drift of a shared machine hits all modes alike."""
    from uzip_serve import p2p

    sd = load_state_dict(max_mb)

    async def one_endpoint(mode: str) -> dict:
        cfg = p2p.TransportConfig.from_env(ucx_tls="tcp", deadline_s=120, **MODES[mode])
        ep = await p2p.connect(host, port, cfg)
        await ep.send_bytes(b"2")
        await ep.send_tensors(sd)  # warm-up: page faults, TCP ramp-up, the link estimate
        t0 = time.perf_counter()
        st = await ep.send_tensors(sd)
        run = {"seconds": time.perf_counter() - t0, "raw_bytes": st.raw_bytes, "wire_bytes": st.wire_bytes,
               "chunks": st.chunks, "chunks_compressed": st.chunks_compressed}
        await ep.close()
        return run

    async def main():
        runs = {m: [] for m in MODES}
        for _ in range(repeats):
            for mode in MODES:
                runs[mode].append(await one_endpoint(mode))
        print("RESULT " + json.dumps(runs), flush=True)

    asyncio.run(main())


def stop_receiver(host: str, port: int) -> None:
    from uzip_serve import p2p

    async def main():
        ep = await p2p.connect(host, port, p2p.TransportConfig.from_env(ucx_tls="tcp"))
        await ep.send_bytes(b"0")
        await ep.close()

    asyncio.run(main())


# ---- the orchestrator ----

def run(rates: list[str | None], repeats: int, max_mb: int, out_dir: Path) -> dict:
    from benchmarks.netns import ADDR, RateLimitedLink

    me = [sys.executable, "-m", "benchmarks.p2p_link"]
    rows = []
    with RateLimitedLink() as link:
        recv = link.popen("b", me + ["--role", "recv", "--port", str(PORT)], stdout=subprocess.PIPE, text=True)
        try:
            if recv.stdout.readline().strip() != "ready":
                raise RuntimeError("receiver did not start")
            for rate in rates:
                link.set_rate(rate)
                out = subprocess.run(["ip", "netns", "exec", "uz_a", *me, "--role", "send", "--host", ADDR["b"],
                                      "--port", str(PORT), "--repeats", str(repeats), "--max-mb", str(max_mb)],
                                     capture_output=True, text=True, timeout=3600)
                line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    raise RuntimeError(f"sender failed ({rate}):\n{out.stderr[-3000:]}")
                for mode, runs in json.loads(line[len("RESULT "):]).items():
                    secs = statistics.median(r["seconds"] for r in runs)
                    row = {"rate": rate or "unlimited", "mode": mode, "seconds": secs,
                           "seconds_all": [r["seconds"] for r in runs], "raw_bytes": runs[0]["raw_bytes"],
                           "wire_bytes": runs[0]["wire_bytes"], "chunks": runs[0]["chunks"],
                           "chunks_compressed": runs[0]["chunks_compressed"],
                           "effective_gbps": runs[0]["raw_bytes"] / secs / 1e9}
                    rows.append(row)
                    logger.info("%-9s %-19s %.3f s  %.3f GB/s  wire %.1f MB  (runs: %s)", row["rate"], mode, secs,
                                row["effective_gbps"], row["wire_bytes"] / 1e6,
                                ", ".join(f"{x:.3f}" for x in row["seconds_all"]))
            subprocess.run(["ip", "netns", "exec", "uz_a", *me, "--role", "stop", "--host", ADDR["b"],
                            "--port", str(PORT)], timeout=60, capture_output=True)
        finally:
            if recv.poll() is None:
                recv.kill()
            recv.wait(10)
    for r in rows:
        plain = next(p for p in rows if p["rate"] == r["rate"] and p["mode"] == "plain")
        ctos = next(p for p in rows if p["rate"] == r["rate"] and p["mode"] == "compress-then-send")
        r["vs_plain"] = r["seconds"] / plain["seconds"]
        r["vs_compress_then_send"] = r["seconds"] / ctos["seconds"]
    result = {"benchmark": "p2p_link", "machine": machine.describe(), "repeats": repeats,
              "data": "Gemma-3-270M bf16 state dict" + (f" (first {max_mb} MB)" if max_mb else ""), "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "p2p_link.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, out_dir / "p2p_link.png", result)
    print(table(rows))
    return result


def table(rows) -> str:
    lines = [f"{'link':10} {'mode':19} {'seconds':>8} {'GB/s':>7} {'wire MB':>8} {'vs plain':>9} {'vs c-then-s':>11}"]
    for r in rows:
        lines.append(f"{r['rate']:10} {r['mode']:19} {r['seconds']:8.3f} {r['effective_gbps']:7.3f} "
                     f"{r['wire_bytes'] / 1e6:8.1f} {r['vs_plain']:9.3f} {r['vs_compress_then_send']:11.3f}")
    return "\n".join(lines)


def plot(rows, path: Path, result) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        vals = [next(r["vs_plain"] for r in rows if r["rate"] == rate and r["mode"] == mode) for rate in rates]
        ax.bar([j + i * width for j in range(len(rates))], vals, width, label=mode)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rates))])
    ax.set_xticklabels(rates)
    ax.set_ylabel("time relative to plain UCX (lower is better)")
    ax.set_title(f"{result['data']} over a veth link; {result['machine']['cores']} cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["orchestrate", "recv", "send", "stop"], default="orchestrate")
    p.add_argument("--rates", default="1gbit,10gbit,none", help="comma-separated tbf rates; 'none' = unlimited")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-mb", type=int, default=0, help="send only the first MB of the state dict (0 = all)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--out", type=Path, default=OUT_DIR)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.role == "recv":
        run_receiver(a.port)
    elif a.role == "send":
        run_sender(a.host, a.port, a.repeats, a.max_mb)
    elif a.role == "stop":
        stop_receiver(a.host, a.port)
    else:
        rates = [None if r == "none" else r for r in a.rates.split(",")]
        run(rates, a.repeats, a.max_mb, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
