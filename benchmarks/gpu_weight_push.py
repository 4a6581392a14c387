"""GPU-to-GPU weight push benchmark (issue 10): push_weights() vs NCCL broadcast.

One trainer process on GPU 0 holds a bf16 state dict of 1, 4 or 16 GiB (the real
Gemma-3-270M weights, tiled up to size) and sends it to 1, 3 or 7 receiver processes,
receiver i on GPU i+1 with CUDA target tensors. Compared in the same run:

  uzip            push_weights(), compression auto (the adaptive switch), CUDA tensors end to
                  end: GPU codec on the UCX path, CUDA IPC between processes of one host
  uzip-raw        the same push with compression off
  nccl-broadcast  torch.distributed.broadcast on an NCCL group of trainer + receivers, packed
                  into buckets the way vLLM's NCCL weight-transfer engine does (tensors
                  concatenated as bytes until a bucket exceeds 1 GiB, two buckets in flight)

Link modes: `nvlink` (as found; NCCL_NVLS_ENABLE=0) and `tcp` (NCCL on sockets:
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1; uzip's P2P on UCX_TLS=tcp with
CUDA IPC off), which emulates cross-node Ethernet. The coordinator (`uzip coordinator`,
a subprocess) plans a chain on tcp (fanout 1: every link carries the bytes once, as NCCL's
ring does) and a star on nvlink (fanout = receivers: a relaying receiver takes the UCX
path, not CUDA IPC); --fanout overrides.

Reported per (link, size, receivers, method): seconds per push (median; push_weights'
own time, BeginPush to COMMITTED; broadcast: first byte to the last rank done), effective
GB/s (state-dict bytes / seconds), bytes on the wire (the trainer's and all links'
together: receivers relay), bit-exactness on every receiver (a digest of every tensor,
each push changing one element so a stale copy cannot pass). Writes
docs/benchmarks/gpu_weight_push.{json,md,png}, merged with earlier results of
configurations not redone (--fresh to start over).

    python -m benchmarks.gpu_weight_push                 # receivers 1,3,7 that fit; 1,4,16 GiB
    python -m benchmarks.gpu_weight_push --links tcp --sizes 16G --time-budget 540
    python -m benchmarks.gpu_weight_push --device cpu --receivers 1,2 --sizes 64M   # CPU rehearsal

The CPU rehearsal (receivers with CPU tensors, gloo broadcast as the baseline, the C codec)
exercises the processes, the coordinator, the checks and the report, not the GPU numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import machine
from benchmarks import multigpu as mg
from benchmarks.rank_exit import release_process_groups

ME = [sys.executable, "-m", "benchmarks.gpu_weight_push"]
METHODS = ("uzip", "uzip-raw", "broadcast")
COMPRESSION = {"uzip": "auto", "uzip-raw": "off"}
# vLLM's NCCL weight-transfer engine: DEFAULT_PACKED_BUFFER_SIZE_BYTES (1 GiB) and
# DEFAULT_PACKED_NUM_BUFFERS (2) in vllm/distributed/weight_transfer/packed_tensor.py.
BUCKET_BYTES = 1 << 30
BUCKETS_IN_FLIGHT = 2
logger = logging.getLogger("benchmarks.gpu_weight_push")


def _name(device: str) -> str:
    return "gpu_weight_push" if device == "cuda" else "gpu_weight_push_cpu"


def _key(r: dict):
    return (r["device"], r["link"], r["nbytes"], r["receivers"])


# ---- the state dict ----

def tiled_specs(total: int) -> list[tuple[str, str, list[int]]]:
    """(name, source tensor, shape) of a state dict of exactly `total` bytes: copies of the
    Gemma-3-270M checkpoint in its own order, the last tensor cut along dim 0 (shapes only)."""
    src = [(name, shape) for name, shape, _ in mg.weight_source()]
    out, left, copy = [], total, 0
    while left > 0:
        for name, shape in src:
            row = 2 * math.prod(shape[1:])  # bytes per dim-0 row of bf16
            full = row * shape[0]
            if full <= left:
                out.append((f"c{copy}.{name}", name, list(shape)))
                left -= full
            elif left >= row:
                out.append((f"c{copy}.{name}", name, [left // row, *shape[1:]]))
                left -= (left // row) * row
            if left < 2:
                return out
        copy += 1
    return out


def build_state_dict(total: int, device):
    """The tiled state dict on `device`: each tensor the leading elements of its source
    (the real tensor, or on a GPU machine its carried part repeated)."""
    import torch

    src = {name: load for name, _, load in mg.weight_source()}
    flat = {}
    sd = {}
    for name, s, shape in tiled_specs(total):
        if s not in flat:
            flat[s] = src[s]().to(device=device, dtype=torch.bfloat16)
        numel = math.prod(shape)
        f = flat[s]
        reps = -(-numel // f.numel())
        sd[name] = (f.repeat(reps) if reps > 1 else f)[:numel].clone().view(shape)
    del flat
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return sd


def template(total: int, device):
    import torch

    return {name: torch.empty(shape, dtype=torch.bfloat16, device=device) for name, _, shape in tiled_specs(total)}


def mark(sd: dict, k: int) -> None:
    """Changes one element per push, so every push carries new bits."""
    import torch

    first = next(iter(sd.values()))
    first.view(-1)[0] = torch.tensor(float(k % 251) / 8, dtype=first.dtype)


def _device(a):
    import torch

    if a.device == "cuda":
        torch.cuda.set_device(0)  # this process's GPU comes first in its CUDA_VISIBLE_DEVICES
        return torch.device("cuda", 0)
    torch.set_num_threads(1)
    return torch.device("cpu")


# ---- roles ----

def role_receiver(a) -> None:
    import uzip_serve as uz
    from uzip_serve import p2p

    dev = _device(a)
    lock = threading.Lock()

    def on_commit(version, tensors):
        d = mg.dict_digest(tensors)
        with lock:
            print(f"DIGEST {version} {d}", flush=True)

    r = uz.WeightReceiver(template(a.nbytes, dev), coordinator=a.coordinator, receiver_id=a.id,
                          on_commit=on_commit, config=p2p.TransportConfig.from_env(deadline_s=a.deadline)).start()
    print("ready", flush=True)
    sys.stdin.read()  # until the orchestrator closes our stdin
    r.stop()


def role_trainer(a) -> None:
    import uzip_serve as uz
    from uzip_serve import p2p

    dev = _device(a)
    sd = build_state_dict(a.nbytes, dev)
    runs, k = [], 0
    for method in a.methods.split(","):
        cfg = p2p.TransportConfig.from_env(compression=COMPRESSION[method], deadline_s=a.deadline)
        for i in range(a.warmup + a.repeats):
            k += 1
            mark(sd, k)
            want = mg.dict_digest(sd)
            res = uz.push_weights(sd, coordinator=a.coordinator, progress=False, config=cfg, timeout=a.push_timeout)
            runs.append({"method": method, "warmup": i < a.warmup, "version": res.version, "seconds": res.seconds,
                         "raw_bytes": res.raw_bytes, "trainer_wire_bytes": res.wire_bytes,
                         "trainer_hop_raw_bytes": res.hop_raw_bytes, "receivers": len(res.receivers),
                         "digest": want})
            logger.info("%s push v%d: %.3f s, ratio %.3f", method, res.version, res.seconds, res.ratio)
    print("RESULT " + json.dumps(runs), flush=True)


def buckets(items: list, limit: int) -> list[list]:
    """vLLM's packing rule: add tensors to a bucket until its size exceeds `limit`."""
    out, cur, size = [], [], 0
    for item in items:
        cur.append(item)
        size += item[1].numel() * item[1].element_size()
        if size > limit:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def role_broadcast(a) -> None:
    import torch
    import torch.distributed as dist

    dev = _device(a)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=a.push_timeout))
    sd = build_state_dict(a.nbytes, dev) if a.rank == 0 else template(a.nbytes, dev)
    plan = buckets(list(sd.items()), a.bucket_bytes)
    streams = [torch.cuda.Stream(dev) for _ in range(BUCKETS_IN_FLIGHT)] if dev.type == "cuda" else None
    u8 = torch.uint8

    def once() -> None:
        held = [None] * BUCKETS_IN_FLIGHT
        for i, bucket in enumerate(plan):
            slot = i % BUCKETS_IN_FLIGHT
            if streams:
                streams[slot].synchronize()  # the bucket that used this slot is done
                ctx = torch.cuda.stream(streams[slot])
            else:
                ctx = _null()
            with ctx:
                if a.rank == 0:
                    packed = torch.cat([t.reshape(-1).view(u8) for _, t in bucket])
                    dist.broadcast(packed, src=0)
                else:
                    packed = torch.empty(sum(t.numel() * t.element_size() for _, t in bucket), dtype=u8, device=dev)
                    dist.broadcast(packed, src=0)
                    off = 0
                    for _, t in bucket:
                        n = t.numel() * t.element_size()
                        t.view(-1).view(u8).copy_(packed[off:off + n])
                        off += n
                held[slot] = packed
        if streams:
            for s in streams:
                s.synchronize()

    runs = []
    for i in range(a.warmup + a.repeats):
        if a.rank == 0:
            mark(sd, 1000 + i)
        dist.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        once()
        dist.barrier()  # done when every rank has everything
        seconds = time.perf_counter() - t0
        digests = [None] * a.world
        dist.all_gather_object(digests, mg.dict_digest(sd))
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        runs.append({"method": "broadcast", "warmup": i < a.warmup, "seconds": seconds, "raw_bytes": nbytes,
                     "digest": digests[0], "receiver_digests": digests[1:], "buckets": len(plan)})
    if a.rank == 0:
        print("RESULT " + json.dumps(runs), flush=True)
    dist.destroy_process_group()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- orchestration ----

class Lines(threading.Thread):
    """Collects a process's stdout lines (and mirrors them to a log)."""

    def __init__(self, proc, log: Path):
        super().__init__(daemon=True)
        self.proc, self.log, self.lines = proc, log, []
        self.start()

    def run(self):
        with open(self.log, "a") as f:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                f.write(line)
                f.flush()

    def wait_for(self, pred, timeout: float):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            hit = next((ln for ln in self.lines if pred(ln)), None)
            if hit is not None:
                return hit
            if self.proc.poll() is not None and not self.is_alive():
                break
            time.sleep(0.2)
        return next((ln for ln in self.lines if pred(ln)), None)


def _spawn(argv, env, log: Path, stdin=False):
    p = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env, cwd=mg.REPO)
    return p, Lines(p, log)


def _env(a, link: str, gpu: int, ngpus: int) -> dict:
    env = {**os.environ, **mg.LINKS[link], "PYTHONPATH": mg.pythonpath()}
    if a.device == "cuda":
        env.update(mg.gpu_first_env(gpu, ngpus))
    else:
        env.update(OMP_NUM_THREADS="1", UZIP_NUM_THREADS="1")
    return env


def _common(a, nbytes: int) -> list[str]:
    return ["--device", a.device, "--nbytes", str(nbytes), "--repeats", str(a.repeats), "--warmup", str(a.warmup),
            "--deadline", str(a.deadline), "--push-timeout", str(a.push_timeout)]


def start_coordinator(a, link: str, fanout: int, tmp: Path, ngpus: int):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from uzip_serve.coordinator import client

    address = f"127.0.0.1:{mg.free_port()}"
    state = tmp / f"coord-{time.time_ns()}.sqlite3"
    argv = [sys.executable, "-m", "uzip_serve.cli", "coordinator", "--listen", address, "--state", str(state),
            "--lease", str(a.lease), "--fanout", str(fanout)]
    proc, lines = _spawn(argv, _env(a, link, 0, ngpus), tmp / "coordinator.log")
    ch, _ = client.connect(address)
    try:
        health = health_pb2_grpc.HealthStub(ch)
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"coordinator exited: {mg.tail(tmp / 'coordinator.log')}")
            try:
                health.Check(health_pb2.HealthCheckRequest(service="uzip.v1.Coordinator"), timeout=1)
                return proc, address, state
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.2)
    finally:
        ch.close()
    proc.kill()
    raise TimeoutError("coordinator did not come up")


def run_uzip(a, link: str, nbytes: int, n: int, fanout: int, tmp: Path, ngpus: int) -> list[dict]:
    procs = []
    try:
        coord, address, state = start_coordinator(a, link, fanout, tmp, ngpus)
        procs.append(coord)
        receivers = []
        for i in range(n):
            log = tmp / f"receiver{i}-{link}-{nbytes}-{n}.log"
            p, lines = _spawn(ME + ["--role", "receiver", "--id", f"r{i}", "--coordinator", address]
                              + _common(a, nbytes), _env(a, link, i + 1, ngpus), log, stdin=True)
            procs.append(p)
            receivers.append((p, lines, log))
        for i, (p, lines, log) in enumerate(receivers):
            if lines.wait_for(lambda ln: ln == "ready", a.start_timeout) is None:
                raise RuntimeError(f"receiver r{i} did not start:\n{mg.tail(log)}")
        log = tmp / f"trainer-{link}-{nbytes}-{n}.log"
        tp, tl = _spawn(ME + ["--role", "trainer", "--coordinator", address, "--methods", "uzip,uzip-raw"]
                        + _common(a, nbytes), _env(a, link, 0, ngpus), log)
        procs.append(tp)
        line = tl.wait_for(lambda ln: ln.startswith("RESULT "), a.config_timeout)
        if line is None:
            raise RuntimeError(f"trainer failed:\n{mg.tail(log)}\n" + "\n".join(
                f"--- receiver r{i} ---\n{mg.tail(lg, 1500)}" for i, (_, _, lg) in enumerate(receivers)))
        runs = json.loads(line[len("RESULT "):])
        last = runs[-1]["version"]
        for i, (_, lines, log) in enumerate(receivers):  # commits reach receivers right after the trainer's
            lines.wait_for(lambda ln: ln.startswith(f"DIGEST {last} "), 60)
        got = [{int(ln.split()[1]): ln.split()[2] for ln in lines.lines if ln.startswith("DIGEST ")}
               for _, lines, _ in receivers]
        with sqlite3.connect(f"file:{state}?mode=ro", uri=True) as db:
            wire = dict(db.execute("SELECT version, SUM(wire_bytes) FROM prepared WHERE ok = 1 GROUP BY version"))
        for r in runs:
            r["receiver_digests"] = [g.get(r["version"]) for g in got]
            r["all_links_wire_bytes"] = wire.get(r["version"])
            r["fanout"] = fanout
        return runs
    finally:
        for p in procs:
            if p.stdin:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        mg.kill_all(procs)


def run_broadcast(a, link: str, nbytes: int, n: int, tmp: Path, ngpus: int) -> list[dict]:
    port = mg.free_port()
    procs = []
    try:
        for r in range(n + 1):
            log = tmp / f"bcast{r}-{link}-{nbytes}-{n}.log"
            procs.append(_spawn(ME + ["--role", "broadcast", "--rank", str(r), "--world", str(n + 1), "--port",
                                      str(port), "--bucket-bytes", str(a.bucket_bytes)] + _common(a, nbytes),
                                _env(a, link, r, ngpus), log) + (log,))
        line = procs[0][1].wait_for(lambda ln: ln.startswith("RESULT "), a.config_timeout)
        if line is None:
            raise RuntimeError("broadcast failed:\n" + "\n".join(
                f"--- rank {r} ---\n{mg.tail(lg, 2000)}" for r, (_, _, lg) in enumerate(procs)))
        return json.loads(line[len("RESULT "):])
    finally:
        mg.kill_all([p for p, _, _ in procs])


def summarize(runs: list[dict], link: str, nbytes: int, n: int, a) -> list[dict]:
    rows = []
    for method in dict.fromkeys(r["method"] for r in runs):
        rs = [r for r in runs if r["method"] == method and not r["warmup"]] or \
             [r for r in runs if r["method"] == method]
        every = [r for r in runs if r["method"] == method]
        sec = statistics.median(r["seconds"] for r in rs)
        raw = rs[0]["raw_bytes"]
        exact = all(len(r["receiver_digests"]) == n and all(d == r["digest"] for d in r["receiver_digests"])
                    for r in every)
        row = {"device": a.device, "link": link, "nbytes": nbytes, "receivers": n, "method": method,
               "seconds": sec, "seconds_all": [r["seconds"] for r in rs], "raw_bytes": raw,
               "effective_GBps": raw / sec / 1e9, "delivered_GBps": raw * n / sec / 1e9, "bit_exact": exact,
               "pushes_checked": len(every)}
        if method == "broadcast":
            row["buckets"] = rs[0]["buckets"]
            row["bucket_bytes"] = a.bucket_bytes
            # a ring/chain broadcast puts every byte on n links once
            row["trainer_wire_bytes"], row["all_links_wire_bytes"] = raw, raw * n
            row["backend"] = "nccl" if a.device == "cuda" else "gloo"
        else:
            row["trainer_wire_bytes"] = statistics.median(r["trainer_wire_bytes"] for r in rs)
            row["all_links_wire_bytes"] = statistics.median(r["all_links_wire_bytes"] or 0 for r in rs)
            row["wire_ratio"] = row["all_links_wire_bytes"] / (raw * n) if raw else None
            row["fanout"] = rs[0]["fanout"]
        rows.append(row)
    return rows


def orchestrate(a) -> int:
    ns = [int(x) for x in a.receivers.split(",")] if a.receivers != "auto" else None
    if a.device == "cuda":
        have = mg.require_gpus(max(ns or [1]) + 1, "benchmarks.gpu_weight_push (one trainer GPU + receivers)")
        ns = ns or [n for n in (1, 3, 7) if n + 1 <= have]
        links = a.links.split(",") if a.links else ["nvlink", "tcp"]
        sizes = a.sizes or "1G,4G,16G"
    else:
        have = 0
        ns = ns or [1, 2]
        links = a.links.split(",") if a.links else ["loopback"]
        sizes = a.sizes or "64M"
    if a.report_only:
        report([], [], [], a)
        return 0
    budget = mg.Budget(a.time_budget)
    tmp = Path(a.logs) if a.logs else Path(tempfile.mkdtemp(prefix="uzip-gpu-push-"))
    tmp.mkdir(parents=True, exist_ok=True)
    logger.info("logs in %s", tmp)
    rows, errors, skipped = [], [], []
    for link in links:
        for nbytes in [mg.parse_size(s) for s in sizes.split(",")]:
            for n in ns:
                if budget.left() <= 0:
                    skipped.append(f"--links {link} --sizes {mg.human(nbytes).replace(' ', '').replace('iB', '')} "
                                   f"--receivers {n}")
                    continue
                fanout = int(a.fanout) if a.fanout != "auto" else (n if link == "nvlink" else 1)
                runs = []
                t0 = time.monotonic()
                for what, fn in (("uzip", lambda: run_uzip(a, link, nbytes, n, fanout, tmp, have)),
                                 ("broadcast", lambda: run_broadcast(a, link, nbytes, n, tmp, have))):
                    try:
                        runs += fn()
                    except Exception as e:  # noqa: BLE001 - one failure must not lose the rest
                        errors.append({"link": link, "nbytes": nbytes, "receivers": n, "method": what,
                                       "error": str(e)[-6000:]})
                        logger.error("%s %s %d receivers %s: %s", link, mg.human(nbytes), n, what, e)
                new = summarize(runs, link, nbytes, n, a) if runs else []
                rows += new
                logger.info("%s %s -> %d receivers in %.0f s: %s", link, mg.human(nbytes), n, time.monotonic() - t0,
                            "  ".join(f"{r['method']} {r['seconds']:.3f} s" for r in new))
                report(rows, errors, skipped, a, quiet=True)
    report(rows, errors, skipped, a)
    if skipped:
        print("not run (time budget): " + "; ".join(skipped) + " -- run them with a later call")
    return 1 if errors else 0


# ---- the report ----

def report(rows, errors, skipped, a, quiet: bool = False) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{_name(a.device)}.json"
    rows = mg.merge_rows(path, rows, _key, a.fresh)
    for r in rows:
        peers = {p["method"]: p for p in rows if _key(p) == _key(r)}
        r["vs_broadcast"] = peers["broadcast"]["seconds"] / r["seconds"] if "broadcast" in peers else None
        r["vs_uncompressed"] = peers["uzip-raw"]["seconds"] / r["seconds"] if "uzip-raw" in peers else None
    result = {"benchmark": "gpu_weight_push", "device": a.device, "machine": machine.describe(),
              "topology": mg.topology() if a.device == "cuda" else None,
              "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("NCCL_", "UZIP_", "UCX_"))},
              "link_env": {k: v for k, v in mg.LINKS.items() if k in {r["link"] for r in rows}},
              "repeats": a.repeats, "warmup": a.warmup,
              "data": "Gemma-3-270M bf16 state dict (536 MB), tiled to size (copies in checkpoint order)",
              "baseline": f"torch.distributed.broadcast of packed buckets (> {a.bucket_bytes} bytes each, "
                          f"{BUCKETS_IN_FLIGHT} in flight), as vLLM's NCCL weight-transfer engine",
              "errors": errors, "not_run": list(skipped), "verdict": verdict(rows), "rows": rows}
    path.write_text(json.dumps(result, indent=2) + "\n")
    text = table(rows)
    (out / f"{_name(a.device)}.md").write_text(
        f"# {result['benchmark']} ({a.device})\n\n{json.dumps(result['machine'])}\n\n```\n{text}\n```\n\n"
        + "\n".join(f"- {v}" for v in result["verdict"]) + "\n")
    try:
        plot(rows, out / f"{_name(a.device)}.png", result)
    except Exception as e:  # noqa: BLE001
        logger.warning("plot failed: %s", e)
    if not quiet:
        print(text)
        for v in result["verdict"]:
            print(v)
        for e in errors:
            print(f"ERROR {e['link']} {mg.human(e['nbytes'])} x{e['receivers']} {e['method']}: {e['error'][-1500:]}")
    return result


def verdict(rows) -> list[str]:
    out = []
    for link in dict.fromkeys(r["link"] for r in rows):
        rs = [r for r in rows if r["link"] == link]
        exact = all(r["bit_exact"] for r in rs)
        uz = [r for r in rs if r["method"] == "uzip" and r["vs_broadcast"] is not None]
        line = f"{link}: bit-exact on every receiver, every push: {exact}"
        if uz:
            worst = min(r["vs_broadcast"] for r in uz)
            if rs[0]["device"] == "cpu":
                line += f"; uzip worst {worst:.2f}x broadcast (CPU rehearsal: issue 10's bars apply to GPUs only)"
            elif link == "tcp":
                line += f"; uzip worst {worst:.2f}x NCCL broadcast (bar: >= 1.35x) -> {'PASS' if worst >= 1.35 else 'FAIL'}"
            else:
                line += (f"; uzip worst {worst:.3f}x NCCL broadcast (bar: >= 0.952x, i.e. <= 5% slower) -> "
                         f"{'PASS' if worst >= 1 / 1.05 else 'FAIL'}")
        out.append(line)
    return out


def table(rows) -> str:
    lines = [f"{'link':8} {'size':>8} {'recv':>4} {'method':10} {'seconds':>8} {'GB/s':>7} {'trainer wire':>12} "
             f"{'all links':>10} {'x bcast':>7} {'x raw':>6} {'exact':>5}"]
    for r in sorted(rows, key=lambda r: (r["link"], r["nbytes"], r["receivers"], METHODS.index(r["method"]))):
        lines.append(f"{r['link']:8} {mg.human(r['nbytes']):>8} {r['receivers']:>4} {r['method']:10} "
                     f"{r['seconds']:8.3f} {r['effective_GBps']:7.2f} {r['trainer_wire_bytes'] / 1e9:10.3f}GB "
                     f"{r['all_links_wire_bytes'] / 1e9:8.3f}GB {(r['vs_broadcast'] or 0):7.2f} "
                     f"{(r['vs_uncompressed'] or 0):6.2f} {'yes' if r['bit_exact'] else 'NO':>5}")
    return "\n".join(lines) + ("\n(GB/s = state-dict bytes / seconds per push; wire: bytes sent by the trainer and "
                               "on all links together; x bcast / x raw > 1: faster than the broadcast / the "
                               "uncompressed push; exact: every receiver's digest == the trainer's, every push)")


def plot(rows, path: Path, result) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(7 * len(links), 4.8), squeeze=False)
    for ax, link in zip(axes[0], links):
        cases = sorted({(r["nbytes"], r["receivers"]) for r in rows if r["link"] == link})
        width = 0.8 / len(METHODS)
        for i, m in enumerate(METHODS):
            vals = [next((r["effective_GBps"] for r in rows if r["link"] == link and (r["nbytes"], r["receivers"]) == c
                          and r["method"] == m), 0) for c in cases]
            ax.bar([j + i * width for j in range(len(cases))], vals, width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels([f"{mg.human(b)}\n{n} recv" for b, n in cases], fontsize=7)
        ax.set_ylabel("effective GB/s (state dict / seconds; higher is better)")
        ax.set_title(link)
        ax.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"{m.get('gpu', {}).get('name', 'CPU rehearsal (gloo baseline)')}; {m['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["orchestrate", "receiver", "trainer", "broadcast"], default="orchestrate")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--receivers", default="auto", help="receiver counts, e.g. 1,3,7 (auto: those that fit; 1,2 on cpu)")
    p.add_argument("--sizes", help="state-dict sizes (default 1G,4G,16G on cuda, 64M on cpu)")
    p.add_argument("--links", help="nvlink,tcp (cuda default) or loopback (cpu default)")
    p.add_argument("--fanout", default="auto", help="coordinator fanout (auto: receivers on nvlink, 1 on tcp)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--bucket-bytes", type=int, default=BUCKET_BYTES)
    p.add_argument("--deadline", type=float, default=120.0, help="p2p progress deadline, seconds")
    p.add_argument("--push-timeout", type=float, default=1200.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--config-timeout", type=float, default=3000.0)
    p.add_argument("--lease", type=float, default=30.0, help="coordinator receiver lease, seconds")
    p.add_argument("--time-budget", type=float, help="seconds; start no configuration after it (report what ran)")
    p.add_argument("--fresh", action="store_true", help="do not merge with an earlier result in --out")
    p.add_argument("--out", default=str(mg.OUT_DIR))
    p.add_argument("--logs", help="folder for every process's log (default: a new temporary folder)")
    p.add_argument("--report-only", action="store_true", help="rewrite table and plot from the JSON in --out")
    p.add_argument("--methods", default="uzip,uzip-raw")
    p.add_argument("--data-file", help="a real-data slice (python -m benchmarks.multigpu --make-slice weights ...) "
                                       "instead of benchmarks/realdata.py's cache; sets " + mg.DATA_ENV)
    p.add_argument("--id")
    p.add_argument("--coordinator")
    p.add_argument("--nbytes", type=int)
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--port", type=int)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if a.data_file:
        os.environ[mg.DATA_ENV] = str(Path(a.data_file).resolve())  # every process it starts inherits it
    roles = {"receiver": role_receiver, "trainer": role_trainer, "broadcast": role_broadcast}
    if a.role in roles:
        roles[a.role](a)
        release_process_groups()
        return 0
    return orchestrate(a)


if __name__ == "__main__":
    raise SystemExit(main())
