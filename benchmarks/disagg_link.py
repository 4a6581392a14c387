"""Disaggregated prefill/decode over a rate-limited link: `uzip bench disagg` (needs root).

The prefill instance runs in network namespace uz_pf (10.78.0.1), the decode instance and
the proxy in uz_dc (10.78.0.2); a veth pair joins them, capped with tbf in both directions.
`vllm bench serve` (random dataset, fixed input/output lengths, one request at a time) drives
the proxy. The same UzipConnector pair serves every run: compression is switched per request
through the proxy (`POST /uzip/disagg/config`), interleaved on/off within each repeat, so slow
drift of a shared machine hits both modes alike. Every run uses fresh random prompts (its own
seed), so no prefix cache helps either mode.

Per run: TTFT p50/p99, ITL p50/p99, throughput (from `vllm bench serve`); the TTFT split
(prefill compute, KV transfer exposed on the TTFT path, decode start) and bytes on the wire
(from the proxy's per-request records joined with both workers' transfer timings); the KV
transfer time (seconds the sender spent sending, not waiting for the forward).

    python -m benchmarks.disagg_link [--rates 100mbit,1gbit] [--input-lens 1024,4096]
        [--output-len 32] [--num-prompts 5] [--repeats 2]

Writes docs/benchmarks/disagg_link.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import machine
# children: a process group each, in our session (autogroup: see there)
from uzip_vllm.demo import NEW_PROCESS_GROUP

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "docs" / "benchmarks"
NS = {"pf": "uz_pf", "dc": "uz_dc"}
ADDR = {"pf": "10.78.0.1", "dc": "10.78.0.2"}
DEV = {"pf": "uz_vpf", "dc": "uz_vdc"}


# ---- the link (root namespace) ----------------------------------------------------------------------

def _sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(list(cmd), check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def link_down() -> None:
    for ns in NS.values():
        _sh("ip", "netns", "del", ns, check=False)


def link_up(mtu: int = 65520) -> None:
    link_down()
    for ns in NS.values():
        _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", DEV["pf"], "type", "veth", "peer", "name", DEV["dc"])
    for side, ns in NS.items():
        _sh("ip", "link", "set", DEV[side], "netns", ns)
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ADDR[side]}/24", "dev", DEV[side])
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", DEV[side], "mtu", str(mtu), "up")


def set_rate(rate: str) -> None:
    """Both directions capped at `rate` ("100mbit", "1gbit"), tbf's bucket as for the other
    link benchmarks (benchmarks/netns.py: default_burst, 2 ms of the rate)."""
    from benchmarks.netns import default_burst

    burst = default_burst(rate)
    for side, ns in NS.items():
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", DEV[side], "root", check=False)
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", DEV[side], "root", "tbf", "rate", rate,
            "burst", burst, "latency", "50ms")


# ---- the runs (inside uz_dc) -------------------------------------------------------------------------

def _http(url: str, body: dict | None = None):
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _bench_serve(url: str, model: str, input_len: int, output_len: int, num_prompts: int, seed: int,
                 out: Path) -> dict:
    args = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
            "--base-url", url, "--model", model, "--tokenizer", model, "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", "0", "--num-prompts", str(num_prompts), "--max-concurrency", "1",
            "--ignore-eos", "--seed", str(seed), "--percentile-metrics", "ttft,itl,tpot,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
            "--result-filename", out.name, "--disable-tqdm", "--num-warmups", "0"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def _kv_extra(pairs: list[str]) -> dict[str, str]:
    """--kv-extra KEY=VALUE pairs (the connector's parse_config checks keys and values)."""
    out = {}
    for kv in pairs:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise SystemExit(f"--kv-extra {kv!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _split(records: list[dict]) -> dict:
    """Medians over requests of the TTFT split and transfer figures (seconds, bytes)."""
    rows = []
    for r in records:
        p, d = r.get("prefill") or {}, r.get("decode") or {}
        if not all(k in p for k in ("t_compute_done", "t_send_start", "t_send_done")) or "t_injected" not in d \
                or "t_first_token" not in r:
            continue
        # The last layer's save marks the end of the KV's compute; wait_for_save (t_compute_done)
        # comes later by sampling and by any GIL wait in the prefill worker (older runs lack it).
        t_done = p.get("t_last_layer", p["t_compute_done"])
        rows.append({
            "ttft_s": r["t_first_token"] - r["t_arrival"],
            "prefill_compute_s": t_done - r["t_arrival"],
            "kv_exposed_s": d["t_injected"] - t_done,
            "decode_start_s": r["t_first_token"] - d["t_injected"],
            "kv_transfer_s": p["send_active_s"],
            "kv_send_span_s": p["t_send_done"] - p["t_send_start"],
            # from the send's start to the KV in decode's cache: with overlap=False, the transfer
            # alone (kv_exposed_s also holds the forward's tail, last layer -> wait_for_save)
            "kv_after_send_start_s": d["t_injected"] - p["t_send_start"],
            # ... split at the receiver: the last layer decoded, then the decode engine's next
            # step writing it into the paged cache (older runs lack these notes)
            "kv_recv_done_after_send_start_s": d.get("t_recv_done", math.nan) - p["t_send_start"],
            "kv_inject_wait_s": d["t_injected"] - d.get("t_recv_done", math.nan),
            "kv_recv_span_s": d.get("t_recv_done", math.nan) - d.get("t_recv_begin", math.nan),
            "raw_bytes": p["raw_bytes"], "wire_bytes": p["wire_bytes"],
        })
    if not rows:
        return {"requests": 0}
    out = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    out["requests"] = len(rows)
    # each request's, in order: one slow transfer shows here, not in the median
    out["each"] = {k: [round(row[k], 4) for row in rows] for k in ("ttft_s", "kv_after_send_start_s", "kv_transfer_s")}
    out["ratio"] = out["wire_bytes"] / out["raw_bytes"] if out["raw_bytes"] else None
    return out


def inner(args) -> int:
    """Runs in uz_dc: starts the pair (prefill wrapped into uz_pf) and the proxy, then the runs."""
    import asyncio
    import threading
    from contextlib import ExitStack

    sys.path.insert(0, str(REPO / "integrations" / "vllm"))
    from uzip_vllm import demo, disagg

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    max_len = max(args.input_lens) + args.output_len + 64
    results = []
    with ExitStack() as stack:
        t0 = time.perf_counter()
        pair = disagg.start_pair(stack, args.model, work, compression="on", kv_port=args.kv_port,
                                 decode_host=ADDR["dc"], prefill_host=ADDR["pf"],
                                 prefill_wrap=["ip", "netns", "exec", NS["pf"]], max_model_len=max_len,
                                 extra_extra={"load_timeout_s": 120.0, "deadline_s": 30.0,
                                              "overlap": not args.no_overlap, **_kv_extra(args.kv_extra)},
                                 vllm_args=["--max-num-batched-tokens", str(max_len), "--max-num-seqs", "4",
                                            "--kv-cache-memory-bytes", str(320 << 20)],
                                 # the env var would override --kv-cache-memory-bytes (1 GiB minimum)
                                 env_extra={"VLLM_CPU_KVCACHE_SPACE": None})
        print(f"pair up in {time.perf_counter() - t0:.0f} s", flush=True)
        proxy = disagg.Proxy(pair.prefill_url, pair.decode_url, pair.stats_dir)
        port = demo.free_port()
        loop = asyncio.new_event_loop()
        stop = asyncio.Event()
        th = threading.Thread(target=lambda: loop.run_until_complete(
            disagg.serve_proxy(proxy, "127.0.0.1", port, stop)), daemon=True)
        th.start()
        stack.callback(lambda: (loop.call_soon_threadsafe(stop.set), th.join(10)))
        url = f"http://127.0.0.1:{port}"
        time.sleep(1)
        # warm-up: both modes, short prompts, not recorded
        for mode in ("on", "off"):
            _http(url + "/uzip/disagg/config", {"compression": mode})
            _bench_serve(url, args.model, 256, 8, 2, 999 + len(mode), work / f"warm-{mode}.json")
        seed = 1
        for rate in args.rates:
            set_rate(rate)
            for rep in range(args.repeats):
                for input_len in args.input_lens:
                    modes = ("on", "off") if rep % 2 == 0 else ("off", "on")
                    for mode in modes:
                        seed += 1
                        _http(url + "/uzip/disagg/config", {"compression": mode})
                        t_start, ticks = time.time(), machine.cpu_ticks()
                        bench = _bench_serve(url, args.model, input_len, args.output_len, args.num_prompts, seed,
                                             work / f"b-{rate}-{input_len}-{mode}-{rep}.json")
                        time.sleep(0.5)  # the workers' stats files are written after the answer
                        recs = [r for r in _http(url + "/uzip/disagg/requests") if r["t_arrival"] >= t_start]
                        row = {"rate": rate, "input_len": input_len, "output_len": args.output_len,
                               "compression": mode, "repeat": rep, "num_prompts": args.num_prompts,
                               "ttft_p50_ms": bench.get("median_ttft_ms"), "ttft_p99_ms": bench.get("p99_ttft_ms"),
                               "itl_p50_ms": bench.get("median_itl_ms"), "itl_p99_ms": bench.get("p99_itl_ms"),
                               "request_throughput": bench.get("request_throughput"),
                               "output_throughput": bench.get("output_throughput"),
                               "completed": bench.get("completed"), "split": _split(recs),
                               "host_cpu": machine.cpu_share(ticks)}
                        results.append(row)
                        print("RUN " + json.dumps(row), flush=True)
        stats = _http(url + "/uzip/disagg/stats")
    print("RESULT " + json.dumps({"runs": results, "stats": stats}), flush=True)
    return 0


# ---- summary, JSON, PNG ------------------------------------------------------------------------------

def summarize(runs: list[dict], overlap: bool = True) -> list[dict]:
    """Medians per link and prompt length. With overlap=False the sender starts after the
    forward, so the transfer is the time from its start to the KV in decode's cache, and all of
    its saving is predicted to reach TTFT."""
    table = []
    keys = sorted({(r["rate"], r["input_len"]) for r in runs}, key=lambda k: (k[0] != "100mbit", k[1]))
    for rate, n in keys:
        row = {"rate": rate, "input_len": n}
        failed = {}
        for mode in ("on", "off"):
            rs = [r for r in runs if r["rate"] == rate and r["input_len"] == n and r["compression"] == mode]
            # A run whose requests all failed has no split; it is counted, not summarized.
            failed[mode] = sum(not r["split"].get("requests") for r in rs)
            rs = [r for r in rs if r["split"].get("requests")]
            if not rs:
                continue
            med = lambda f: statistics.median(f(r) for r in rs)  # noqa: E731
            row[mode] = {
                "ttft_p50_ms": med(lambda r: r["ttft_p50_ms"]), "ttft_p99_ms": med(lambda r: r["ttft_p99_ms"]),
                "itl_p50_ms": med(lambda r: r["itl_p50_ms"]), "output_throughput": med(lambda r: r["output_throughput"]),
                "prefill_compute_s": med(lambda r: r["split"]["prefill_compute_s"]),
                "kv_transfer_s": med(lambda r: r["split"]["kv_transfer_s"]),
                "kv_exposed_s": med(lambda r: r["split"]["kv_exposed_s"]),
                "decode_start_s": med(lambda r: r["split"]["decode_start_s"]),
                "raw_mb": med(lambda r: r["split"]["raw_bytes"] / 1e6),
                "wire_mb": med(lambda r: r["split"]["wire_bytes"] / 1e6),
            }
            row[mode]["ttft_p50_ms_runs"] = [r["ttft_p50_ms"] for r in rs]  # the spread between runs
            if not overlap:
                row[mode]["kv_after_send_start_s"] = med(lambda r: r["split"]["kv_after_send_start_s"])
            each = [x for r in rs for x in r["split"].get("each", {}).get(_transfer_key(overlap), [])]
            if each:  # every request of every run: the median over all, and the slowest
                row[mode]["transfer_each_median_s"] = statistics.median(each)
                row[mode]["transfer_each_max_s"] = max(each)
        row["runs_without_requests"] = failed
        if "on" not in row or "off" not in row:
            row["error"] = ("no run of this setting completed a request in both modes: see the runs and "
                            "the instances' logs in the workdir")
            table.append(row)
            continue
        on, off = row["on"], row["off"]
        row["ttft_saved_ms"] = off["ttft_p50_ms"] - on["ttft_p50_ms"]
        if "transfer_each_median_s" in on and "transfer_each_median_s" in off:
            # Every request of every run pooled: less moved by one odd run than the median of
            # run medians, which transfer_ratio is.
            row["transfer_ratio_every_request"] = on["transfer_each_median_s"] / off["transfer_each_median_s"]
        if not overlap:
            row["transfer_ratio"] = on["kv_after_send_start_s"] / off["kv_after_send_start_s"]
            row["ttft_saved_predicted_ms"] = 1000 * (off["kv_after_send_start_s"] - on["kv_after_send_start_s"])
            row["bar_transfer_le_0_75"] = row["transfer_ratio"] <= 0.75
            table.append(row)
            continue
        row["transfer_ratio"] = on["kv_transfer_s"] / off["kv_transfer_s"]
        # What the transfer saving predicts for TTFT: the seconds compression takes off the
        # transfer, but no more than the part of it that was exposed after the forward (the
        # rest overlapped the prefill compute and was never on the TTFT path).
        row["ttft_saved_predicted_ms"] = 1000 * max(0.0, min(off["kv_exposed_s"],
                                                             off["kv_transfer_s"] - on["kv_transfer_s"]))
        row["bar_transfer_le_0_75"] = row["transfer_ratio"] <= 0.75
        table.append(row)
    return table


def _transfer_key(overlap: bool) -> str:
    """The transfer time in a table: the sender's active time, or with overlap=False from the
    send's start to the KV in decode's cache (see summarize)."""
    return "kv_transfer_s" if overlap else "kv_after_send_start_s"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xkey = _transfer_key(result["settings"].get("overlap", True))
    table = [r for r in result["table"] if "error" not in r]
    if not table:
        return
    labels = [f"{r['rate']}\n{r['input_len']} tok" for r in table]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    x = range(len(table))
    w = 0.38
    for ax, title in zip(axes, ("TTFT split, p50 request (s)", "KV transfer time (s)")):
        for j, mode in enumerate(("off", "on")):
            xs = [i + (j - 0.5) * w for i in x]
            if title.startswith("TTFT"):
                bottom = [0.0] * len(table)
                for part, color in (("prefill_compute_s", "#888888"), ("kv_exposed_s", "#d62728"),
                                    ("decode_start_s", "#1f77b4")):
                    vals = [r[mode][part] for r in table]
                    ax.bar(xs, vals, w, bottom=bottom, color=color, alpha=1.0 if mode == "on" else 0.55,
                           label=part.removesuffix('_s') if mode == "on" else None, edgecolor="black")
                    bottom = [b + v for b, v in zip(bottom, vals)]
                for xi, b in zip(xs, bottom):
                    ax.text(xi, b, "raw" if mode == "off" else "uzip", ha="center", va="bottom", fontsize=7)
            else:
                vals = [r[mode][xkey] for r in table]
                ax.bar(xs, vals, w, label=f"compression {mode}", color="#2ca02c" if mode == "on" else "#bbbbbb",
                       edgecolor="black")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels)
        ax.set_title(title)
        ax.legend(fontsize=8)
    for i, r in enumerate(table):
        axes[1].text(i, max(r["on"][xkey], r["off"][xkey]), f"{r['transfer_ratio']:.2f}x",
                     ha="center", va="bottom", fontsize=8)
    m = result["machine"]
    fig.suptitle(f"UzipConnector, Gemma-3-270M bf16, prefill and decode on one {m.get('cores')}-core host in two "
                 f"netns over a tbf-capped veth (left: raw = pale, uzip = solid)"
                 + ("" if result["settings"].get("overlap", True) else "; KV sent after the forward"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


def _wait_for_memory(need_gib: float, timeout: float = 900) -> None:
    """Two Gemma-3-270M instances take about 12 GB; on a shared host the OOM killer picks a
    vLLM worker when they do not fit, so wait for room first."""
    deadline = time.monotonic() + timeout
    while _mem_available_gib() < need_gib and time.monotonic() < deadline:
        print(f"waiting for {need_gib:.0f} GiB of free memory ({_mem_available_gib():.1f} GiB now)", flush=True)
        time.sleep(10)


# ---- --kv-only: the connector's transfer path alone, real Gemma-3-270M KV, no vLLM ----------------------

KV_NS = {"pf": "uz_kpf", "dc": "uz_kdc"}
KV_ADDR = {"pf": "10.79.0.1", "dc": "10.79.0.2"}
KV_DEV = {"pf": "uz_vkpf", "dc": "uz_vkdc"}
BLOCK = 16


def _gemma_windows() -> list:
    """Gemma-3-270M's sliding window per layer (None for its 3 global layers), from its config."""
    from benchmarks import realdata

    cfg = json.loads((realdata.gemma_dir() / "config.json").read_text())
    return [cfg["sliding_window"] if t == "sliding_attention" else None for t in cfg["layer_types"]]


def _kv_connector(window_trim: bool = False, **cfg):
    """A UzipConnector worker half without vLLM: the layout of Gemma-3-270M on vLLM's CPU backend
    ([blocks, 1 kv head, 16 tokens, 2 x 256]), 18 layers, TP=1. window_trim: both halves know
    the model's sliding windows, and the receiver allows trimmed layers (as with prefix caching
    off on the decode instance)."""
    import torch
    from uzip_vllm import kv_connector as kc

    c = kc.UzipConnector.__new__(kc.UzipConnector)
    c._cfg = kc.UzipKVConfig(**cfg)
    c._producer = "peer" in cfg
    c._tp_size, c._tp_rank, c._block_size = 1, 0, BLOCK
    c._layer_names = [f"layer.{i}" for i in range(18)]
    c._dtype, c._page_shape = torch.bfloat16, (1, BLOCK, 512)
    c._page_nbytes = BLOCK * 512 * 2
    c._stats = kc._Stats(None)
    c._init_link_state()
    c._windows = _gemma_windows() if window_trim else []
    c._allow_trim = window_trim and not c._producer
    c._transport = c._cfg.transport()
    return c


def _real_kv_blocks(num_tokens: int) -> list:
    """Per layer, [blocks, 1, 16, 512] bf16 from the real Gemma-3-270M KV cache (493 tokens of
    prose from benchmarks.realdata, repeated to length)."""
    import torch

    from benchmarks import realdata

    d = realdata.load("gemma_activations")
    out = []
    nblk = -(-num_tokens // BLOCK)
    for i in range(18):
        k, v = d[f"kv.{i}.k"][0, 0], d[f"kv.{i}.v"][0, 0]  # [tokens, 256]
        kv = torch.cat([k, v], dim=-1)
        reps = -(-nblk * BLOCK // kv.shape[0])
        kv = kv.repeat(reps, 1)[:nblk * BLOCK]
        out.append(kv.reshape(nblk, 1, BLOCK, 512).contiguous())
    return out


def kv_only_recv(port: int, window_trim: bool) -> int:
    c = _kv_connector(window_trim, listen=f"{KV_ADDR['dc']}:{port}", deadline_s=30.0)
    c._start_listener()
    print("READY", flush=True)
    while True:  # until killed; drop what arrived
        time.sleep(0.5)
        with c._incoming_lock:
            for x in [x for x, e in c._incoming.items() if e.done or e.error]:
                del c._incoming[x]


def kv_only_send(args) -> int:
    import uuid

    from uzip_vllm import kv_connector as kc

    c = _kv_connector(args.kv_only_window_trim, peer=f"{KV_ADDR['dc']}:{args.kv_port}", deadline_s=30.0,
                      chunk_bytes=args.kv_chunk_bytes)
    from concurrent.futures import ThreadPoolExecutor

    c._sender = ThreadPoolExecutor(max_workers=1)
    rows = []
    for n in args.input_lens:
        blocks = _real_kv_blocks(n - 1)
        for rep in range(-1, args.repeats):  # -1: warm-up (connection set-up, codec tables), not kept
            for mode in (("on", "off") if rep % 2 == 0 else ("off", "on")):
                xfer = uuid.uuid4().hex
                out = kc._Outgoing(kc.SaveSpec("r", xfer, list(range(blocks[0].shape[0])), n - 1, mode))
                for i, b in enumerate(blocks):
                    out.q.put((i, 0, b))  # saved whole; the send trims it if the receiver allows
                out.q.put(kc._END)
                time.sleep(args.kv_only_gap)
                if args.kv_only_touch:  # untimed: the KV read once, as a forward that just wrote it leaves it
                    for b in blocks:
                        b.sum()
                c._send_one(out)
                x = c._stats.xfers[xfer]
                if "error" in x:
                    raise RuntimeError(x["error"])
                if rep < 0:
                    continue
                rows.append({"input_len": n, "compression": mode, "repeat": rep,
                             "kv_transfer_s": x["t_send_done"] - x["t_send_start"],
                             "raw_bytes": x["raw_bytes"], "wire_bytes": x["wire_bytes"]})
    print("COUNTERS " + json.dumps({k: c._stats.counters.get(k, 0) for k in ("connects", "reconnects", "sends_ok")}),
          flush=True)
    print("RESULT " + json.dumps(rows), flush=True)
    return 0


def kv_only(args) -> int:
    from benchmarks.netns import default_burst

    global NS, ADDR, DEV
    NS, ADDR, DEV = KV_NS, KV_ADDR, KV_DEV
    link_up()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "integrations" / "vllm"),
                                                        os.environ.get("PYTHONPATH", "")])}
    runs, counters, host_cpu = [], {}, {}
    try:
        for k, rate in enumerate(args.rates):
            set_rate(rate)
            port = args.kv_port + k  # a fresh port: the last receiver's may linger
            trim = ["--kv-only-window-trim"] if args.kv_only_window_trim else []
            recv = subprocess.Popen(["ip", "netns", "exec", NS["dc"], sys.executable, "-m", "benchmarks.disagg_link",
                                     "--kv-only-role", "recv", "--kv-port", str(port), *trim],
                                    stdout=subprocess.PIPE, text=True, cwd=str(REPO), env=env, **NEW_PROCESS_GROUP)
            try:
                assert recv.stdout.readline().strip() == "READY"
                ticks = machine.cpu_ticks()
                r = subprocess.run(["ip", "netns", "exec", NS["pf"], sys.executable, "-m", "benchmarks.disagg_link",
                                    "--kv-only-role", "send", "--kv-port", str(port), "--input-lens",
                                    ",".join(map(str, args.input_lens)), "--repeats", str(args.repeats),
                                    "--kv-chunk-bytes", str(args.kv_chunk_bytes),
                                    "--kv-only-gap", str(args.kv_only_gap)]
                                   + (["--kv-only-touch"] if args.kv_only_touch else []) + trim,
                                   capture_output=True, text=True, cwd=str(REPO), env=env, timeout=1200)
                host_cpu[rate] = machine.cpu_share(ticks)
                line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
                if not line:
                    raise RuntimeError(f"sender failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
                counters[rate] = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("COUNTERS "))[9:])
                for row in json.loads(line[0][7:]):
                    runs.append({"rate": rate, **row})
                    print("KV " + json.dumps(runs[-1]), flush=True)
            finally:
                os.killpg(recv.pid, signal.SIGKILL)
                recv.wait()
    finally:
        link_down()
    table = []
    for rate in args.rates:
        for n in args.input_lens:
            med = {m: statistics.median(r["kv_transfer_s"] for r in runs if r["rate"] == rate and
                                        r["input_len"] == n and r["compression"] == m) for m in ("on", "off")}
            wire = {m: statistics.median(r["wire_bytes"] for r in runs if r["rate"] == rate and
                                         r["input_len"] == n and r["compression"] == m) for m in ("on", "off")}
            raw = next(r["raw_bytes"] for r in runs if r["rate"] == rate and r["input_len"] == n)
            table.append({"rate": rate, "input_len": n, "raw_mb": raw / 1e6, "wire_mb_on": wire["on"] / 1e6,
                          "kv_transfer_s_on": med["on"], "kv_transfer_s_off": med["off"],
                          "transfer_ratio": med["on"] / med["off"], "bar_transfer_le_0_75": med["on"] / med["off"] <= 0.75})
            t = table[-1]
            print(f"{rate:>8} {n:>5} tok: {t['raw_mb']:.1f} MB raw, {t['wire_mb_on']:.1f} MB compressed; "
                  f"{t['kv_transfer_s_on']:.3f} s vs {t['kv_transfer_s_off']:.3f} s raw ({t['transfer_ratio']:.2f}x)")
    # The host's own cost of touching memory again after the gap, no link, no codec: on the
    # sandbox VM it is most of what a transfer after idle costs (docs/kv_connector.md).
    from benchmarks import idle_memory

    print("host memory after idle (benchmarks.idle_memory):", flush=True)
    host = idle_memory.probe(runs[0]["raw_bytes"], sorted({0.0, args.kv_only_gap}), 3)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "disagg_kv_only", "machine": machine.describe(),
              "host_idle_memory": host, "host_cpu": host_cpu,
              "what": "UzipConnector's sender and receiver code (a connection kept open across transfers: transfer "
                      "hello + the p2p transfers of the layers) without vLLM, real Gemma-3-270M bf16 KV "
                      "(benchmarks.realdata gemma_activations, 493 tokens repeated), vLLM CPU page layout, over the "
                      "netns veth link",
              "repeats": args.repeats, "chunk_bytes": args.kv_chunk_bytes, "idle_gap_s": args.kv_only_gap,
              "window_trim": args.kv_only_window_trim,
              "tbf_burst": {rate: default_burst(rate) for rate in args.rates},
              "sender_counters": counters, "table": table, "runs": runs}
    name = "disagg_kv_only_window_trim.json" if args.kv_only_window_trim else "disagg_kv_only.json"
    (out / name).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="uzip bench disagg", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="100mbit,1gbit")
    ap.add_argument("--input-lens", default="1024,4096")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default=None, help="default: the converted Gemma-3-270M")
    ap.add_argument("--out-dir", default=str(OUT_DIR))
    ap.add_argument("--workdir", default="/tmp/uzip-bench-disagg")
    ap.add_argument("--kv-port", type=int, default=14600)
    ap.add_argument("--need-gib", type=float, default=13.0, help="free memory to wait for before starting")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kv-only", action="store_true",
                    help="only the connector's transfer path with real Gemma KV (no vLLM): fast, little memory")
    ap.add_argument("--kv-only-role", choices=["send", "recv"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kv-chunk-bytes", type=int, default=1 << 20, help="--kv-only: the connector's chunk_bytes")
    ap.add_argument("--kv-only-gap", type=float, default=0.0,
                    help="--kv-only: seconds the kept-open connection idles before each transfer (as between "
                         "requests when serving)")
    ap.add_argument("--kv-only-touch", action="store_true",
                    help="--kv-only: after the gap, read the KV once before the timed send (as just computed); "
                         "on the sandbox VM memory idle for a second is several times slower to touch "
                         "(benchmarks/idle_memory.py)")
    ap.add_argument("--kv-only-window-trim", action="store_true",
                    help="--kv-only: sliding-window layers send only the blocks their window still reads (as "
                         "with prefix caching off on the decode instance); writes disagg_kv_only_window_trim.json")
    ap.add_argument("--no-overlap", action="store_true",
                    help="the prefill side sends its KV only after the forward (the connector's overlap=false): "
                         "the whole transfer on the TTFT path; writes disagg_link_sequential.json / .png")
    ap.add_argument("--kv-extra", action="append", default=[], metavar="KEY=VALUE",
                    help="more kv_connector_extra_config for both instances, e.g. progress_mode=blocking (repeatable)")
    ap.add_argument("--resummarize", metavar="JSON", default=None,
                    help="rebuild the table and PNG of an earlier result file (no runs)")
    args = ap.parse_args(argv)
    args.rates = args.rates.split(",")
    args.input_lens = [int(n) for n in args.input_lens.split(",")]
    if args.model is None:
        from benchmarks import realdata

        args.model = str(realdata.gemma_dir())
    if args.kv_only_role == "recv":
        return kv_only_recv(args.kv_port, args.kv_only_window_trim)
    if args.kv_only_role == "send":
        return kv_only_send(args)
    if args.kv_only:
        return kv_only(args)
    if args.resummarize:
        result = json.loads(Path(args.resummarize).read_text())
        result["table"] = summarize(result["runs"], result["settings"].get("overlap", True))
        return _write(result, Path(args.out_dir))
    if args.inner:
        # SIGTERM from the outer process unwinds the stack, which stops the vLLM pair.
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        return inner(args)
    if os.geteuid() != 0:
        print("uzip bench disagg needs root (network namespaces and tc)", file=sys.stderr)
        return 2

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    _wait_for_memory(args.need_gib)
    link_up()
    proc = None
    try:
        argv_inner = [sys.executable, "-m", "benchmarks.disagg_link", "--inner", "--rates", ",".join(args.rates),
                      "--input-lens", ",".join(map(str, args.input_lens)), "--output-len", str(args.output_len),
                      "--num-prompts", str(args.num_prompts), "--repeats", str(args.repeats), "--model", args.model,
                      "--workdir", args.workdir, "--kv-port", str(args.kv_port)]
        argv_inner += ["--no-overlap"] if args.no_overlap else []
        argv_inner += [f"--kv-extra={kv}" for kv in args.kv_extra]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "integrations" / "vllm"),
                                                            os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen(["ip", "netns", "exec", NS["dc"], *argv_inner], stdout=subprocess.PIPE, text=True,
                                cwd=str(REPO), env=env, **NEW_PROCESS_GROUP)
        final = None
        for line in proc.stdout:
            if line.startswith("RESULT "):
                final = json.loads(line[7:])
            else:
                print(line, end="", flush=True)
        proc.wait()
        if proc.returncode != 0 or final is None:
            print(f"the benchmark failed ({proc.returncode}); logs in {args.workdir}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        link_down()
    result = {"benchmark": "disagg_link", "machine": machine.describe(), "model": "Gemma-3-270M bf16",
              "settings": {"rates": args.rates, "input_lens": args.input_lens, "output_len": args.output_len,
                           "num_prompts": args.num_prompts, "repeats": args.repeats, "max_concurrency": 1,
                           "overlap": not args.no_overlap, "kv_extra": _kv_extra(args.kv_extra)},
              "table": summarize(final["runs"], not args.no_overlap), "runs": final["runs"],
              "connector_stats": final["stats"]}
    return _write(result, Path(args.out_dir))


def _write(result: dict, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    name = "disagg_link" if result["settings"].get("overlap", True) else "disagg_link_sequential"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / f"{name}.png")
    xkey = _transfer_key(result["settings"].get("overlap", True))
    for r in result["table"]:
        if "error" in r:
            print(f"{r['rate']:>8} {r['input_len']:>5} tok: {r['error']} (runs without requests: "
                  f"{r['runs_without_requests']})")
            continue
        pooled = r.get("transfer_ratio_every_request")
        pooled = f"; every request pooled {pooled:.2f}x" if pooled is not None else ""
        print(f"{r['rate']:>8} {r['input_len']:>5} tok: KV transfer {r['on'][xkey]:.3f} s vs "
              f"{r['off'][xkey]:.3f} s raw ({r['transfer_ratio']:.2f}x{pooled}), TTFT p50 "
              f"{r['on']['ttft_p50_ms']:.0f} vs {r['off']['ttft_p50_ms']:.0f} ms (saved {r['ttft_saved_ms']:.0f}, "
              f"predicted {r['ttft_saved_predicted_ms']:.0f})")
    return 0

if __name__ == "__main__":
    sys.exit(main())
