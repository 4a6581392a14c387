"""Pipeline-parallel activation transfer between two stages over a 1 Gbit/s link.

Two processes in two network namespaces joined by a rate-limited veth pair
(benchmarks/netns.py; needs root): stage A sends what vLLM's PP path sends between the
stages of Gemma-3-270M (18 layers, split after layer 9) through `uzip_serve.p2p` exactly as
`uzip_vllm.pipeline` does (one endpoint, 1 MiB split-send chunks); stage B receives into new
tensors, decoding before it acknowledges. Per step, the two tensors of vLLM's
`IntermediateTensors`, built from real Gemma-3-270M activations over public-domain prose
(`benchmarks.realdata`, 493 tokens): `residual` = `hidden.9` (the residual stream entering
layer 9), `hidden_states` = a residual-branch output: vLLM sends the last layer's branch output
before its residual add; the cache keeps hidden states of layers 0, 4, 9, 13, 17 only, so
`hidden.13 - hidden.9` (the branch outputs of layers 9-12, rounded to bf16) stands in for it.
Both [tokens, 640] bf16.

Workload per batch of B sequences (B = 1, 8, 64), each a 493-token prompt and G generated tokens:
  prefill step: B x 493 tokens (sequence k is the prose rotated by 37k tokens)
  decode step:  B tokens
Four modes, one endpoint each, interleaved (raw, compressed, adaptive, raw_again, raw, ...):
  raw         compression off (what the link carries without uzip's codec)
  compressed  compression forced on
  adaptive    the per-link policy (the plugin's default)
  raw_again   raw on another connection: the A/A control, the noise floor of every ratio
Both stages share the machine's cores (`--pin`: one core each).
Reports the median transfer time per step (send until the receiver's ack) and the
link-bound end-to-end tokens/s, (B x (493 + G)) / (prefill + G x decode transfer time):
the tokens per second the link allows; the model's compute is not included. Writes
docs/benchmarks/pp_link.{json,png}.

    python -m benchmarks.pp_link [--rate 1gbit] [--repeats 15] [--decode-steps 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import machine

OUT_DIR = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
PORT = 13347
BATCHES = (1, 8, 64)
GENERATED = 64  # tokens generated per sequence in the end-to-end figure
CHUNK_BYTES = 1 << 20  # as uzip_vllm.pipeline
CODEC_THREADS = int(os.environ.get("UZIP_PP_BENCH_CODEC_THREADS", "0")) or None  # None: every core, as the plugin
# raw_again: raw once more, on a connection of its own: an A/A control whose ratio to raw is
# this machine's noise for that cell (a batch-1 step varies 0.9-1.5x from one transfer to the next).
MODES = {"raw": "off", "compressed": "on", "adaptive": "auto", "raw_again": "off"}
logger = logging.getLogger("benchmarks.pp_link")


def activations():
    """(residual, hidden_states) rows of the real prose: [493, 640] bf16 each."""
    import torch

    from benchmarks import realdata

    acts = realdata.load("gemma_activations")
    residual = acts["hidden.9"]
    hidden = (acts["hidden.13"].float() - residual.float()).to(torch.bfloat16)
    return residual.contiguous(), hidden.contiguous()


def step_tensors(residual, hidden, batch: int, phase: str) -> dict:
    import torch

    n = residual.shape[0]
    if phase == "prefill":
        idx = torch.cat([torch.roll(torch.arange(n), -37 * k) for k in range(batch)])
    else:  # one token per sequence, each at another position
        idx = torch.tensor([(101 + 37 * k) % n for k in range(batch)])
    return {"hidden_states": hidden[idx].contiguous(), "residual": residual[idx].contiguous()}


# ---- the two stages, each run inside its namespace ----

def run_receiver(port: int) -> None:
    from uzip_serve import p2p

    async def main():
        cfg = p2p.TransportConfig.from_env(ucx_tls="tcp", deadline_s=300, chunk_bytes=CHUNK_BYTES,
                                           codec_threads=CODEC_THREADS)
        lst = await p2p.listen(port, cfg)
        print("ready", flush=True)
        eps = [None] * len(MODES)
        for _ in MODES:  # one connection per mode (each names its index), then transfers in the sender's order
            ep = await lst.accept()
            eps[int(await ep.recv_bytes())] = ep
        order = eps[0]
        while True:
            which = int(await order.recv_bytes())
            if which < 0:
                break
            await eps[which].recv_tensors()
        for ep in eps:
            await ep.close()

    asyncio.run(main())


def run_sender(host: str, port: int, repeats: int, decode_steps: int) -> None:
    from uzip_serve import p2p

    residual, hidden = activations()

    async def main():
        eps = {}
        for mode, compression in MODES.items():
            cfg = p2p.TransportConfig.from_env(ucx_tls="tcp", deadline_s=300, chunk_bytes=CHUNK_BYTES,
                                               compression=compression, codec_threads=CODEC_THREADS)
            eps[mode] = await p2p.connect(host, port, cfg)
            await eps[mode].send_bytes(str(len(eps) - 1).encode())
        order = eps["raw"]
        index = {m: i for i, m in enumerate(MODES)}

        async def transfer(mode, tensors):
            await order.send_bytes(str(index[mode]).encode())
            t0 = time.perf_counter()
            st = await eps[mode].send_tensors(tensors)
            return time.perf_counter() - t0, st

        steps = {(b, ph): step_tensors(residual, hidden, b, ph) for b in BATCHES for ph in ("prefill", "decode")}
        # Warm-up: page faults, TCP ramp-up, and the adaptive policy's link and codec estimates
        # (a PP link carries thousands of steps; the first few teach the policy).
        for _ in range(3):
            for (b, ph), t in steps.items():
                for mode in MODES:
                    await transfer(mode, t)
        runs = []
        for rep in range(repeats):
            for (b, ph), t in steps.items():
                for mode in MODES:
                    n = 1 if ph == "prefill" else decode_steps
                    secs, comp, wire, raw, chunks = [], 0, 0, 0, 0
                    reasons = set()
                    for _ in range(n):
                        s, st = await transfer(mode, t)
                        reasons.update(d.reason for d in st.decisions)
                        secs.append(s)
                        comp += st.chunks_compressed
                        chunks += st.chunks
                        wire += st.wire_bytes
                        raw += st.raw_bytes
                    runs.append({"batch": b, "phase": ph, "mode": mode, "rep": rep,
                                 "seconds": statistics.median(secs), "raw_bytes": raw // n, "wire_bytes": wire // n,
                                 "chunks": chunks // n, "chunks_compressed": comp / n,
                                 "reasons": sorted(reasons)})
        await order.send_bytes(b"-1")
        # What each endpoint's policy measured: the link (wire bytes/s) and this side's codec.
        est = {m: {"link_gbps": (ep.policy.link.value or 0) / 1e9,
                   "compress_gbps": (ep.policy.compress_speed.value or 0) / 1e9} for m, ep in eps.items()}
        for ep in eps.values():
            await ep.close()
        print("RESULT " + json.dumps({"runs": runs, "estimates": est}), flush=True)

    asyncio.run(main())


# ---- the orchestrator ----

def summarize(runs: list[dict], decode_steps: int) -> tuple[list[dict], list[dict]]:
    rows = []
    for b in BATCHES:
        for ph in ("prefill", "decode"):
            for mode in MODES:
                rs = [r for r in runs if r["batch"] == b and r["phase"] == ph and r["mode"] == mode]
                rows.append({"batch": b, "phase": ph, "mode": mode, "tokens": rs[0]["raw_bytes"] // (2 * 640 * 2),
                             "seconds": statistics.median(r["seconds"] for r in rs),
                             "seconds_min": min(r["seconds"] for r in rs),
                             "seconds_all": [r["seconds"] for r in rs], "raw_bytes": rs[0]["raw_bytes"],
                             "wire_bytes": statistics.median(r["wire_bytes"] for r in rs),
                             "chunks": rs[0]["chunks"],
                             "chunks_compressed": statistics.median(r["chunks_compressed"] for r in rs),
                             "reasons": sorted({x for r in rs for x in r.get("reasons", ())})})
    for r in rows:
        raw = next(x for x in rows if x["batch"] == r["batch"] and x["phase"] == r["phase"] and x["mode"] == "raw")
        r["vs_raw"] = r["seconds"] / raw["seconds"]
        r["vs_raw_min"] = r["seconds_min"] / raw["seconds_min"]  # the least-disturbed samples
    e2e = []
    for b in BATCHES:
        for mode in MODES:
            pre = next(x for x in rows if x["batch"] == b and x["phase"] == "prefill" and x["mode"] == mode)
            dec = next(x for x in rows if x["batch"] == b and x["phase"] == "decode" and x["mode"] == mode)
            seconds = pre["seconds"] + GENERATED * dec["seconds"]
            e2e.append({"batch": b, "mode": mode, "seconds": seconds,
                        "tokens_per_s": b * (pre["tokens"] // b + GENERATED) / seconds})
    for r in e2e:
        raw = next(x for x in e2e if x["batch"] == r["batch"] and x["mode"] == "raw")
        r["vs_raw"] = r["tokens_per_s"] / raw["tokens_per_s"]
    return rows, e2e


def run(rate: str | None, repeats: int, decode_steps: int, out_dir: Path, pin_cores: bool = False,
        burst: str | None = None) -> dict:
    from benchmarks import netns
    from benchmarks.netns import ADDR, RateLimitedLink

    # Namespaces of our own: other benchmarks (p2p_link, ...) may hold the default pair right now.
    netns.NS, netns.DEV = ("uz_ppa", "uz_ppb"), {"a": "uz_ppva", "b": "uz_ppvb"}

    me = [sys.executable, "-m", "benchmarks.pp_link"]
    load_before = os.getloadavg()
    # --pin: each stage on one core of its own (sender core 0, receiver core 1), as if on two
    # hosts. Off by default: on a machine shared with other work, pinning keeps a stage off the
    # other core when that one is idle.
    pin = {side: ["taskset", "-c", str(core)] if pin_cores else [] for side, core in (("a", 0), ("b", 1))}
    with RateLimitedLink() as link:
        link.set_rate(rate, burst)
        recv = link.popen("b", pin["b"] + me + ["--role", "recv", "--port", str(PORT)], stdout=subprocess.PIPE,
                          text=True)
        try:
            if recv.stdout.readline().strip() != "ready":
                raise RuntimeError("receiver did not start")
            out = subprocess.run(["ip", "netns", "exec", netns.NS[0], *pin["a"], *me, "--role", "send", "--host",
                                  ADDR["b"], "--port", str(PORT), "--repeats", str(repeats), "--decode-steps",
                                  str(decode_steps)], capture_output=True, text=True, timeout=3600)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"sender failed:\n{out.stderr[-3000:]}")
            recv.wait(60)
        finally:
            if recv.poll() is None:
                recv.kill()
            recv.wait(10)
    got = json.loads(line[len("RESULT "):])
    rows, e2e = summarize(got["runs"], decode_steps)
    bars = check_bars(rows)
    result = {"benchmark": "pp_link", "machine": machine.describe(), "rate": rate or "unlimited",
              "repeats": repeats, "decode_steps_per_sample": decode_steps, "generated_tokens": GENERATED,
              "chunk_bytes": CHUNK_BYTES, "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
              "pinned": pin_cores, "codec_threads": CODEC_THREADS, "tbf_burst": (burst or netns.default_burst(rate)) if rate else None,
              "data": "Gemma-3-270M activations after layer 9 of 18 (hidden_states + residual, [tokens, 640] bf16)",
              "policy_estimates": got["estimates"], "rows": rows, "end_to_end": e2e, "bars": bars}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pp_link.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, e2e, out_dir / "pp_link.png", result)
    print(table(rows, e2e, bars))
    return result


def check_bars(rows) -> dict:
    """The issue's bars: compressed <= 0.75x raw per step for batches >= 8; adaptive <= 1.05x raw at batch 1."""
    out = {}
    for r in rows:
        if r["mode"] == "compressed" and r["batch"] >= 8:
            out[f"compressed/raw b={r['batch']} {r['phase']} <= 0.75"] = [round(r["vs_raw"], 3), r["vs_raw"] <= 0.75]
        if r["mode"] == "adaptive" and r["batch"] >= 8:
            out[f"adaptive/raw b={r['batch']} {r['phase']} <= 0.75"] = [round(r["vs_raw"], 3), r["vs_raw"] <= 0.75]
        if r["mode"] == "adaptive" and r["batch"] == 1:
            out[f"adaptive/raw b=1 {r['phase']} <= 1.05"] = [round(r["vs_raw"], 3), r["vs_raw"] <= 1.05]
        if r["mode"] == "raw_again":  # not a bar: how far the same raw transfer moves here
            out[f"A/A raw_again/raw b={r['batch']} {r['phase']}"] = [round(r["vs_raw"], 3), None]
    return out


def table(rows, e2e, bars) -> str:
    lines = [f"{'batch':>5} {'phase':8} {'mode':10} {'tokens':>6} {'MB raw':>7} {'MB wire':>7} {'ms/step':>8} "
             f"{'vs raw':>7} {'min ms':>8} {'vs raw':>7}"]
    for r in rows:
        lines.append(f"{r['batch']:5d} {r['phase']:8} {r['mode']:10} {r['tokens']:6d} {r['raw_bytes'] / 1e6:7.3f} "
                     f"{r['wire_bytes'] / 1e6:7.3f} {r['seconds'] * 1e3:8.2f} {r['vs_raw']:7.3f} "
                     f"{r['seconds_min'] * 1e3:8.2f} {r['vs_raw_min']:7.3f}")
    lines.append("")
    lines.append(f"{'batch':>5} {'mode':10} {'tokens/s':>10} {'vs raw':>7}   (link-bound, 493 prompt + "
                 f"{GENERATED} generated tokens per sequence)")
    for r in e2e:
        lines.append(f"{r['batch']:5d} {r['mode']:10} {r['tokens_per_s']:10.0f} {r['vs_raw']:7.3f}")
    lines.append("")
    lines += [f"{'control' if ok is None else 'met ' if ok else 'MISSED'} {name}: {v}" for name, (v, ok) in bars.items()]
    return "\n".join(lines)


def plot(rows, e2e, path: Path, result) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    width = 0.8 / len(MODES)
    for ax, phase in zip(axes[:2], ("prefill", "decode")):
        for i, mode in enumerate(MODES):
            vals = [next(r["seconds"] * 1e3 for r in rows if r["batch"] == b and r["phase"] == phase
                         and r["mode"] == mode) for b in BATCHES]
            ax.bar([j + i * width for j in range(len(BATCHES))], vals, width, label=mode)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(BATCHES))])
        ax.set_xticklabels([f"batch {b}" for b in BATCHES])
        ax.set_yscale("log")
        ax.set_ylabel("transfer ms per step (log)")
        ax.set_title(f"{phase} step")
        ax.legend()
    ax = axes[2]
    for i, mode in enumerate(MODES):
        vals = [next(r["vs_raw"] for r in e2e if r["batch"] == b and r["mode"] == mode) for b in BATCHES]
        ax.bar([j + i * width for j in range(len(BATCHES))], vals, width, label=mode)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(BATCHES))])
    ax.set_xticklabels([f"batch {b}" for b in BATCHES])
    ax.set_ylabel("link-bound tokens/s relative to raw")
    ax.set_title("end to end")
    fig.suptitle(f"PP activations over a {result['rate']} veth link; {result['machine']['cores']} cores (shared)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["orchestrate", "recv", "send"], default="orchestrate")
    p.add_argument("--rate", default="1gbit", help="tbf rate; 'none' = unlimited")
    p.add_argument("--repeats", type=int, default=15,
                   help="samples per cell; the adaptive policy spends its first few transfers of a size learning")
    p.add_argument("--decode-steps", type=int, default=16, help="decode transfers per sample (median taken)")
    p.add_argument("--pin", action="store_true", help="pin the sender to core 0 and the receiver to core 1")
    p.add_argument("--burst", default=None,
                   help="tbf bucket (default: netns.default_burst, 2 ms of the rate); a step smaller than it "
                        "crosses at veth speed")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--out", type=Path, default=OUT_DIR)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.role == "recv":
        run_receiver(a.port)
    elif a.role == "send":
        run_sender(a.host, a.port, a.repeats, a.decode_steps)
    else:
        run(None if a.rate == "none" else a.rate, a.repeats, a.decode_steps, a.out, a.pin, a.burst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
