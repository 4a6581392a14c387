"""The RL weight-sync loop end to end, on a real model: `make demo` runs this.

    python -m uzip_vllm.demo [--model DIR] [--versions 3] [--tp 1] [--port 8000]

1. starts `uzip coordinator` (SQLite state) and `vllm serve DIR --comm-plugin uzip`;
2. as the trainer: loads the same weights, applies a deterministic RL-like update per step and
   pushes each version with `uzip_serve.push_weights()`; prints the version, push seconds, MB
   raw and on the wire, the ratio, and the server's greedy completion (with the version the
   server says produced it);
3. checks that the server's greedy output equals that of a fresh vLLM engine loaded from the
   last pushed weights (saved as a checkpoint);
4. stops every process it started, also on Ctrl-C or failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

PROMPTS = ["Once upon a time, in a small village,", "The capital of France is"]

VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


# ---- the trainer's side -----------------------------------------------------------------------

def load_state(model_dir: str | Path) -> dict:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def rl_update(state: dict, step: int, rel: float = 0.01) -> dict:
    """A deterministic stand-in for one optimizer step: every weight moves by ~1% of itself
    (seeded by `step`), so exponents stay put and mantissas change, as in real training."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, t in state.items():
        if not t.is_floating_point():
            out[name] = t
            continue
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        out[name] = (t.float() * (1 + rel * noise)).to(t.dtype)
    return out


def save_checkpoint(state: dict, template_dir: str | Path, out_dir: str | Path) -> Path:
    """`state` as a servable HF checkpoint: the template's config and tokenizer, new weights."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(template_dir).iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---- processes ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A process group of its own, but in the caller's session. Linux's autogroup scheduler
# (sched_autogroup_enabled, on by default) shares the CPUs between sessions first: two vLLM
# instances started as sessions of their own starved each other for ~1 s at a time on the 2-core
# VM (a thread pinned to the CPU could not run either), and prefill took 3-13 s instead of 1.2 s
# (docs/kv_connector.md, "The ~1 s stalls").
NEW_PROCESS_GROUP: dict = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def spawn(stack: ExitStack, args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Starts a process in its own process group; the stack kills the whole group on exit."""
    fh = open(log, "wb")
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, **NEW_PROCESS_GROUP)

    def stop():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        else:  # the leader exited: take any children it left behind
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        fh.close()

    stack.callback(stop)
    return proc


def http_json(url: str, body: dict | None = None, timeout: float = 120) -> tuple[dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read()), dict(r.headers)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}; last lines of {log}:\n"
                               + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} not up after {timeout:.0f} s; see {log}")


def start_coordinator(stack: ExitStack, workdir: Path, token_file: Path | None = None,
                      lease: float = 5.0) -> str:
    from uzip_serve.coordinator import client

    address = f"127.0.0.1:{free_port()}"
    args = [sys.executable, "-m", "uzip_serve.cli", "coordinator", "--listen", address,
            "--state", str(workdir / "uzip-state.sqlite3"), "--lease", str(lease)]
    if token_file:
        args += ["--token-file", str(token_file)]
    log = workdir / "coordinator.log"
    proc = spawn(stack, args, log)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ch, _ = client.connect(address)
    try:
        health = health_pb2_grpc.HealthStub(ch)
        for _ in range(150):
            if proc.poll() is not None:
                raise RuntimeError(f"coordinator exited: {log.read_text()[-2000:]}")
            try:
                health.Check(health_pb2.HealthCheckRequest(service="uzip.v1.Coordinator"), timeout=1)
                return address
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.1)
    finally:
        ch.close()
    raise TimeoutError("coordinator did not come up")


def start_server(stack: ExitStack, model: str, workdir: Path, *, coordinator: str | None, tp: int = 1,
                 token_file: Path | None = None, port: int | None = None, extra: list[str] = (),
                 name: str = "vllm", timeout: float = 600) -> str:
    port = port or free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port", str(port),
            "--host", "127.0.0.1", "--enforce-eager", "--max-model-len", "1024", "--tensor-parallel-size", str(tp),
            "--seed", "0", *extra]
    if coordinator is not None:
        args += ["--comm-plugin", "uzip", "--uzip-coordinator", coordinator, "--uzip-receiver-id", name]
        if token_file:
            args += ["--uzip-token-file", str(token_file)]
    env = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else "0-1"}
    log = workdir / f"{name}.log"
    proc = spawn(stack, args, log, env)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, log, timeout)
    return url


def complete(url: str, model: str, prompt: str, max_tokens: int = 16) -> tuple[str, int | None]:
    """Greedy completion and the weight version the server stamped on it."""
    body, headers = http_json(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0})
    version = headers.get("x-uzip-weight-version") or headers.get("X-Uzip-Weight-Version")
    return body["choices"][0]["text"], int(version) if version is not None else None


def served_version(url: str) -> int:
    return http_json(url + "/uzip/version")[0]["version"]


def wait_version(url: str, version: int, timeout: float = 60) -> None:
    """push_weights returns on commit; the server swaps right after. Wait for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = http_json(url + "/uzip/version")[0]
        if info["version"] >= version:
            return
        time.sleep(0.05)
    raise TimeoutError(f"server still serves {info['version']} {timeout:.0f} s after version {version} committed "
                       f"(last_error: {info.get('last_error')})")


def reference(checkpoints: list[Path], prompts: list[str], tp: int = 1, max_tokens: int = 16,
              env: dict | None = None) -> dict[str, list[str]]:
    """Greedy completions from fresh engines (uzip_vllm.reference in a subprocess)."""
    args = [sys.executable, "-m", "uzip_vllm.reference", "--tp", str(tp), "--max-tokens", str(max_tokens),
            "--max-model-len", "1024"]
    for p in prompts:
        args += ["--prompt", p]
    bind = "0|1" if tp == 2 else "0-1"
    out = subprocess.run(args + [str(c) for c in checkpoints], capture_output=True, text=True, timeout=900,
                         env={**os.environ, **VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": bind, **(env or {})})
    if out.returncode != 0:
        raise RuntimeError(f"reference engine failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- the demo -----------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the converted Gemma-3-270M)")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--workdir", default=None, help="logs and state (default: a temp dir, removed on success)")
    ap.add_argument("--compression", choices=["on", "auto", "off"], default="on",
                    help="'on' (default here): compress every chunk. On loopback 'auto' sends raw, rightly: "
                         "the link is faster than the codec on a small host; it compresses on real links.")
    args = ap.parse_args(argv)

    import uzip_serve
    from uzip_serve.p2p.config import TransportConfig

    model = args.model
    if model is None:
        from benchmarks import realdata

        model = str(realdata.gemma_dir())
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="uzip-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # Ctrl-C and SIGTERM unwind the ExitStack, which stops every process group we started.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    ok = False
    with ExitStack() as stack:
        try:
            t0 = time.perf_counter()
            coordinator = start_coordinator(stack, workdir)
            print(f"coordinator  {coordinator}  (state {workdir / 'uzip-state.sqlite3'})", flush=True)
            print(f"vllm serve   {model} --comm-plugin uzip --uzip-coordinator {coordinator} (TP={args.tp}) ...",
                  flush=True)
            url = start_server(stack, model, workdir, coordinator=coordinator, tp=args.tp, name="demo")
            print(f"server up    {url} in {time.perf_counter() - t0:.0f} s; serving version {served_version(url)}")
            text, v = complete(url, model, PROMPTS[0], args.max_tokens)
            print(f"v{v}: {PROMPTS[0]!r} -> {text!r}\n", flush=True)

            state = load_state(model)
            header = f"{'version':>7} {'push s':>7} {'MB raw':>8} {'MB wire':>8} {'ratio':>6} {'swap s':>7}  completion"
            print(header)
            print("-" * len(header))
            for step in range(1, args.versions + 1):
                state = rl_update(state, step)
                t_push = time.perf_counter()
                res = uzip_serve.push_weights(state, coordinator=coordinator, progress=sys.stderr.isatty(),
                                              config=TransportConfig(compression=args.compression))
                wait_version(url, res.version)
                t_served = time.perf_counter() - t_push
                text, v = complete(url, model, PROMPTS[0], args.max_tokens)
                if v != res.version:
                    raise AssertionError(f"pushed version {res.version}, the server answered with {v}")
                print(f"{res.version:>7} {res.seconds:>7.2f} {res.raw_bytes / 1e6:>8.1f} {res.wire_bytes / 1e6:>8.1f} "
                      f"{res.ratio:>6.3f} {t_served - res.seconds:>7.2f}  {text!r}", flush=True)

            served = [complete(url, model, p, args.max_tokens) for p in PROMPTS]
            ckpt = save_checkpoint(state, model, workdir / f"pushed-v{res.version}")
            print(f"\nchecking against a fresh vLLM engine loaded from the pushed weights ({ckpt}) ...", flush=True)
            fresh = reference([ckpt], PROMPTS, tp=args.tp, max_tokens=args.max_tokens)[str(ckpt)]
            for prompt, (text, v), ref in zip(PROMPTS, served, fresh):
                same = "identical" if text == ref else "DIFFERENT"
                print(f"  {same}: v{v} {prompt!r} -> {text!r}" + ("" if text == ref else f"\n   fresh engine: {ref!r}"))
            ok = all(text == ref for (text, _), ref in zip(served, fresh))
            print(f"\n{'OK' if ok else 'FAILED'}: {args.versions} versions pushed; the server's greedy output "
                  f"{'equals' if ok else 'differs from'} a fresh engine's on the pushed weights "
                  f"({time.perf_counter() - t0:.0f} s in all)")
        except KeyboardInterrupt:
            print("\ninterrupted: stopping everything", file=sys.stderr)
        finally:
            print(f"stopping the server and the coordinator (logs in {workdir})", flush=True)
    if ok and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
