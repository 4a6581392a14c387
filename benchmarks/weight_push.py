"""Weight-sync benchmark: push_weights() vs an uncompressed push vs gloo broadcast.

The real Gemma-3-270M bf16 state dict goes from one trainer to 1, 2 and 4 receivers,
on loopback and over a 1 Gbit/s veth link between two network namespaces (trainer and
coordinator in one, all receivers in the other, as on a trainer node and a rollout
node). Compared in the same run:

  uzip               push_weights(), compression auto, receivers relay to each other
  uzip uncompressed  the same path with compression off
  gloo broadcast     torch.distributed.broadcast of every tensor over gloo, what RL
                     frameworks run today

Writes docs/benchmarks/weight_push.{json,png}. Needs root for the link.

    python -m benchmarks.weight_push [--receivers 1,2,4] [--links loopback,1gbit]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import machine
from benchmarks.rank_exit import release_process_groups

OUT_DIR = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
ME = [sys.executable, "-m", "benchmarks.weight_push"]
logger = logging.getLogger("benchmarks.weight_push")


def _state_dict():
    from benchmarks import realdata

    return realdata.load("gemma_weights")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---- roles ----

def role_receiver(rid: str, coordinator: str, host: str) -> None:
    import torch

    import uzip_serve as uz

    template = {k: torch.empty_like(v) for k, v in _state_dict().items()}
    r = uz.WeightReceiver(template, coordinator=coordinator, receiver_id=rid, host=host).start()
    print("ready", flush=True)
    sys.stdin.read()  # runs until the orchestrator closes our stdin
    r.stop()


def role_trainer(coordinator: str, compression: str, repeats: int) -> None:
    import uzip_serve as uz
    from uzip_serve import p2p

    sd = _state_dict()
    cfg = p2p.TransportConfig(compression=compression, deadline_s=120)
    uz.push_weights(sd, coordinator=coordinator, progress=False, config=cfg, timeout=600)  # warm-up
    runs = []
    for _ in range(repeats):
        res = uz.push_weights(sd, coordinator=coordinator, progress=False, config=cfg, timeout=600)
        runs.append({"seconds": res.seconds, "wire_bytes": res.wire_bytes, "raw_bytes": res.raw_bytes,
                     "receivers": len(res.receivers)})
    print("RESULT " + json.dumps(runs), flush=True)


def role_gloo(rank: int, world: int, master: str, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    host, port = master.rsplit(":", 1)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    sd = _state_dict() if rank == 0 else {k: torch.empty_like(v) for k, v in _state_dict().items()}
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for t in sd.values():
            dist.broadcast(t, src=0)
        dist.barrier()  # done when every rank has everything
        if i:  # the first round is a warm-up
            times.append(time.perf_counter() - t0)
    if rank == 0:
        print("RESULT " + json.dumps([{"seconds": s} for s in times]), flush=True)
    dist.destroy_process_group()


# ---- orchestration ----

class Placement:
    """Where the trainer side and the receiver side run: both on the host, or in netns."""

    def __init__(self, link):
        self.link = link
        self.trainer_host = "10.77.0.1" if link else "127.0.0.1"
        self.receiver_host = "10.77.0.2" if link else "127.0.0.1"

    def popen(self, side: str, argv, **kw):
        if self.link:
            return self.link.popen(side, argv, **kw)
        return subprocess.Popen(argv, **kw)


def _result(proc: subprocess.Popen, what: str) -> list[dict]:
    out, err = proc.communicate(timeout=1800)
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{what} failed:\n{err[-3000:]}")
    return json.loads(line[len("RESULT "):])


def run_uzip(place: Placement, n: int, compression: str, repeats: int, tmp: Path) -> list[dict]:
    port = 50600 + n
    coord_addr = f"{place.trainer_host}:{port}"
    state = tmp / f"state-{n}-{compression}-{time.time_ns()}.sqlite3"
    coord = place.popen("a", ME[:2] + ["uzip_serve.cli", "coordinator", "--listen", coord_addr, "--state", str(state)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    receivers = []
    try:
        time.sleep(1.5)
        for i in range(n):
            p = place.popen("b", ME + ["--role", "receiver", "--id", f"r{i}", "--coordinator", coord_addr,
                                       "--host", place.receiver_host],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            receivers.append(p)
        for p in receivers:
            for line in p.stdout:  # skip anything a library printed first
                if line.strip() == "ready":
                    break
            else:
                raise RuntimeError("a receiver did not start")
        trainer = place.popen("a", ME + ["--role", "trainer", "--coordinator", coord_addr, "--compression",
                                         compression, "--repeats", str(repeats)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return _result(trainer, f"uzip push ({compression}, {n} receivers)")
    finally:
        for p in receivers:
            p.stdin.close()
            p.kill()
            p.wait(10)
        coord.kill()
        coord.wait(10)


def run_gloo(place: Placement, n: int, repeats: int) -> list[dict]:
    master = f"{place.trainer_host}:{29500 + n}"
    procs = []
    for r in range(n + 1):
        side = "a" if r == 0 else "b"
        env = dict(os.environ)
        if place.link:  # gloo would pick its interface from the hostname, which lives outside the namespaces
            env["GLOO_SOCKET_IFNAME"] = "uz_va" if side == "a" else "uz_vb"
        procs.append(place.popen(side, ME + ["--role", "gloo", "--rank", str(r), "--world", str(n + 1),
                                             "--master", master, "--repeats", str(repeats)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        return _result(procs[0], f"gloo broadcast ({n} receivers)")
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def run(receivers: list[int], links: list[str], repeats: int, out_dir: Path) -> dict:
    import statistics
    import tempfile

    from benchmarks.netns import RateLimitedLink

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="uzip-push-"))
    for link_name in links:
        ctx = RateLimitedLink() if link_name != "loopback" else None
        link = ctx.__enter__() if ctx else None
        try:
            if link:
                link.set_rate(link_name)
            place = Placement(link)
            for n in receivers:
                for method, fn in (("uzip", lambda: run_uzip(place, n, "auto", repeats, tmp)),
                                   ("uzip uncompressed", lambda: run_uzip(place, n, "off", repeats, tmp)),
                                   ("gloo broadcast", lambda: run_gloo(place, n, repeats))):
                    runs = fn()
                    row = {"link": link_name, "receivers": n, "method": method,
                           "seconds": statistics.median(r["seconds"] for r in runs),
                           "wire_bytes": runs[0].get("wire_bytes"), "raw_bytes": runs[0].get("raw_bytes")}
                    rows.append(row)
                    logger.info("%-9s %d receivers  %-18s %.2f s", link_name, n, method, row["seconds"])
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
    for r in rows:
        peers = [p for p in rows if p["link"] == r["link"] and p["receivers"] == r["receivers"]]
        r["vs_uncompressed"] = r["seconds"] / next(p["seconds"] for p in peers if p["method"] == "uzip uncompressed")
        r["vs_gloo"] = r["seconds"] / next(p["seconds"] for p in peers if p["method"] == "gloo broadcast")
    result = {"benchmark": "weight_push", "machine": machine.describe(), "repeats": repeats,
              "data": "Gemma-3-270M bf16 state dict (536 MB)", "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "weight_push.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, out_dir / "weight_push.png", result)
    print(table(rows))
    return result


def table(rows) -> str:
    lines = [f"{'link':9} {'recv':>4} {'method':18} {'seconds':>8} {'vs uncompressed':>16} {'vs gloo':>8}"]
    for r in rows:
        lines.append(f"{r['link']:9} {r['receivers']:>4} {r['method']:18} {r['seconds']:8.2f} "
                     f"{r['vs_uncompressed']:16.3f} {r['vs_gloo']:8.3f}")
    return "\n".join(lines)


def plot(rows, path: Path, result) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.5), squeeze=False)
    for ax, link in zip(axes[0], links):
        ns = sorted({r["receivers"] for r in rows if r["link"] == link})
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            vals = [next(r["seconds"] for r in rows if r["link"] == link and r["receivers"] == n and r["method"] == m)
                    for n in ns]
            ax.bar([j + i * width for j in range(len(ns))], vals, width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ns))])
        ax.set_xticklabels([f"{n} receivers" for n in ns])
        ax.set_ylabel("seconds per push (lower is better)")
        ax.set_title(link)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['data']}, {result['machine']['cores']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["orchestrate", "receiver", "trainer", "gloo"], default="orchestrate")
    p.add_argument("--receivers", default="1,2,4")
    p.add_argument("--links", default="loopback,1gbit")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--id")
    p.add_argument("--coordinator")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--compression", default="auto")
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--master")
    p.add_argument("--out", type=Path, default=OUT_DIR)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("UZIP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    if a.role == "receiver":
        role_receiver(a.id, a.coordinator, a.host)
    elif a.role == "trainer":
        role_trainer(a.coordinator, a.compression, a.repeats)
    elif a.role == "gloo":
        role_gloo(a.rank, a.world, a.master, a.repeats)
        release_process_groups()
    else:
        run([int(x) for x in a.receivers.split(",")], a.links.split(","), a.repeats, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
