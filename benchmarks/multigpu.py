"""Helpers shared by the multi-GPU benchmarks (allreduce_gpu.py, gpu_weight_push.py).

Link modes, the GPU-count check, per-process GPU placement, a device-independent digest,
results that accumulate over several invocations, and a wall-clock budget. No torch at
import time.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "docs" / "benchmarks"

# NVLink multicast (NVLS) stays off in every mode and every process we start: on the lent
# machines a program using it can take the host's shared GPUs out of service (KINDS.md).
_ALWAYS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# NCCL on sockets only: no CUDA P2P / NVLink, no shared memory, no InfiniBand. Emulates the
# cross-node Ethernet links where compression pays.
NCCL_SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
# uzip's P2P on TCP only: UCX tcp transport, and no CUDA IPC shortcut between processes
# (which would otherwise carry same-host CUDA tensors whatever UCX_TLS says).
UCX_TCP = {"UCX_TLS": "tcp", "UZIP_P2P_TLS": "tcp", "UZIP_P2P_CUDA_IPC": "off"}

LINKS = {
    # as found: NCCL picks NVLink/P2P, uzip picks CUDA IPC between processes of one host
    "nvlink": dict(_ALWAYS),
    # NCCL forced onto sockets (the all-reduce benchmark)
    "sockets": {**_ALWAYS, **NCCL_SOCKETS},
    # NCCL on sockets and UCX on TCP (the weight-push benchmark)
    "tcp": {**_ALWAYS, **NCCL_SOCKETS, **UCX_TCP},
    # CPU rehearsal: gloo over loopback; nothing to force
    "loopback": dict(_ALWAYS),
}


class NotEnoughGPUs(SystemExit):
    pass


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no torch build with CUDA: no GPUs
        return 0


def require_gpus(needed: int, what: str) -> int:
    """The visible GPU count; exits with a clear message when it is below `needed` (>= 2)."""
    have = gpu_count()
    needed = max(needed, 2)
    if have < needed:
        raise NotEnoughGPUs(
            f"{what} needs {needed} GPUs, but this machine has {have} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). Run it on a multi-GPU "
            f"machine (nvidia-h200-x2/-x4/-x8), ask for fewer GPUs, or rehearse on CPU with "
            f"`--backend gloo --device cpu` / `--device cpu`.")
    return have


def gpu_first_env(index: int, count: int) -> dict:
    """CUDA_VISIBLE_DEVICES with GPU `index` first and every other GPU after it: the
    process's own GPU is cuda:0 in every thread (UCX's loop thread included), and the
    others stay visible, so CUDA IPC and NCCL P2P still see the whole node."""
    base = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = base.split(",") if base else [str(i) for i in range(count)]
    return {"CUDA_VISIBLE_DEVICES": ",".join([ids[index]] + ids[:index] + ids[index + 1:])}


def pythonpath() -> str:
    """PYTHONPATH for the processes we start: the repository, then what the caller had
    (carried wheels installed with --target on a GPU machine)."""
    rest = os.environ.get("PYTHONPATH")
    return str(REPO) + (os.pathsep + rest if rest else "")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_size(text: str) -> int:
    """'64M', '1G', '256K', '1048576' -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def human(nbytes: float) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << k:
            v = nbytes / (1 << k)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(nbytes)} B"


def digest(t) -> int:
    """A 64-bit checksum of a tensor's bytes, the same on CPU and GPU: 4 KiB rows of int64
    words summed (wrapping), row sums weighted by odd numbers, so a changed word or two
    swapped rows change it. Reads the data once, in 256 MiB blocks (no big temporaries)."""
    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    block = 256 << 20
    row0 = 0
    for lo in range(0, n, block):
        part = flat[lo:lo + block]
        m = part.numel()
        if m % 4096:
            pad = torch.zeros(4096 - m % 4096, dtype=torch.uint8, device=flat.device)
            part = torch.cat([part, pad])
        rows = part.view(torch.int64).view(-1, 512).sum(1)
        w = torch.arange(row0, row0 + rows.numel(), dtype=torch.int64, device=flat.device) * 2 + 1
        total += (rows * w).sum()
        row0 += rows.numel()
    return (int(total.item()) + n) & ((1 << 64) - 1)


def dict_digest(tensors: dict) -> str:
    """One hex digest of named tensors (names, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{digest(t):016x}\n".encode())
    return h.hexdigest()[:32]


def topology() -> str | None:
    """`nvidia-smi topo -m` (how the GPUs are linked), or None without nvidia-smi."""
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except Exception:  # noqa: BLE001 - a description never fails a benchmark
        return None


def merge_rows(path: Path, rows: list[dict], key, fresh: bool) -> list[dict]:
    """`rows` plus the rows of an earlier result at `path` whose configuration `key(row)`
    this run did not redo: a long run can be split over several invocations."""
    if fresh or not path.exists():
        return rows
    try:
        old = json.loads(path.read_text()).get("rows", [])
    except (OSError, ValueError):
        return rows
    redone = {key(r) for r in rows}
    return [r for r in old if key(r) not in redone] + rows


class Budget:
    """Stops starting new configurations after `seconds` (None: no limit), so one call of a
    time-limited runner still writes the report of what it finished."""

    def __init__(self, seconds: float | None):
        self.t0 = time.monotonic()
        self.seconds = seconds

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.monotonic() - self.t0)


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "<no output>"


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            pass


# ---- real data on a machine without the realdata cache ----
#
# The GPU machines start bare and take at most 64 MiB per call (working tree, wheels and data
# together), so the benchmarks there read a slice of the real tensors made here:
#
#     python -m benchmarks.multigpu --make-slice allreduce .gpudata_mg/allreduce/allreduce.safetensors
#     python -m benchmarks.multigpu --make-slice weights .gpudata_mg/weights/weights.safetensors
#
# and find it through UZIP_MULTIGPU_DATA (or the benchmarks' --data-file). "allreduce": every
# Gemma-3 activation tensor whole, and a leading part of every MiniLM gradient tensor (bf16).
# "weights": a leading part of every Gemma-3 weight tensor, with each tensor's full shape in
# the metadata; a full-size tensor is its part repeated (the codec codes 8 MiB chunks on their
# own, so it sees real weight statistics either way).

DATA_ENV = "UZIP_MULTIGPU_DATA"


def _slice_file() -> Path | None:
    p = os.environ.get(DATA_ENV)
    return Path(p) if p else None


def allreduce_base(which: str):
    """Set `which` ("activations" or "gradients") as a dict of bf16 tensors: from the slice
    file when UZIP_MULTIGPU_DATA names one, else from benchmarks/realdata.py's cache."""
    import torch

    f = _slice_file()
    prefix = {"activations": "act.", "gradients": "grad."}[which]
    if f is not None:
        from safetensors.torch import load_file

        return {k: v for k, v in load_file(str(f)).items() if k.startswith(prefix)}
    from benchmarks import realdata

    t = realdata.load({"activations": "gemma_activations", "gradients": "minilm_grads"}[which])
    return {k: v.to(torch.bfloat16) for k, v in t.items()}


def weight_source() -> list[tuple[str, list[int], object]]:
    """(name, full shape, flat bf16 tensor whose repetition fills it) of every Gemma-3 weight,
    in checkpoint order. The tensor is loaded lazily (a callable) so shapes cost no reads."""
    import torch
    from safetensors import safe_open

    f = _slice_file()
    if f is not None:
        with safe_open(str(f), "pt") as h:
            meta = h.metadata() or {}
            names = [k for k in h.keys() if k.startswith("gemma.")]
            shapes = {k: json.loads(meta[f"shape.{k}"]) for k in names}

        def loader(k, _cache={}):
            if not _cache:
                from safetensors.torch import load_file

                _cache.update(load_file(str(f)))
            return _cache[k].reshape(-1)

        return [(k.removeprefix("gemma."), shapes[k], lambda k=k: loader(k)) for k in names]
    from benchmarks import realdata

    files = sorted(realdata.gemma_dir().glob("*.safetensors"))
    out = []
    for file in files:
        with safe_open(str(file), "pt") as h:
            for k in h.keys():
                out.append((k, list(h.get_slice(k).get_shape()),
                            lambda k=k, file=file: safe_open(str(file), "pt").get_tensor(k).reshape(-1).to(torch.bfloat16)))
    return out


def make_slice(kind: str, path: Path, budget_mb: float) -> None:
    import torch
    from safetensors.torch import save_file

    from benchmarks import realdata

    out, meta = {}, {}
    if kind == "allreduce":
        acts = realdata.load("gemma_activations")
        for k, v in acts.items():
            out[f"act.{k}"] = v.to(torch.bfloat16).contiguous()
        left = budget_mb * 1e6 - sum(v.numel() * 2 for v in out.values())
        grads = realdata.load("minilm_grads")
        total = sum(v.numel() for v in grads.values()) * 2
        frac = min(1.0, left / total)
        for k, v in grads.items():
            flat = v.reshape(-1)
            out[f"grad.{k}"] = flat[:max(min(flat.numel(), 4096), int(flat.numel() * frac))].to(torch.bfloat16).clone()
    elif kind == "weights":
        w = realdata.load("gemma_weights")
        total = sum(v.numel() for v in w.values()) * 2
        frac = min(1.0, budget_mb * 1e6 / total)
        for k, v in w.items():
            flat = v.reshape(-1)
            out[f"gemma.{k}"] = flat[:max(min(flat.numel(), 640), int(flat.numel() * frac))].to(torch.bfloat16).clone()
            meta[f"shape.gemma.{k}"] = json.dumps(list(v.shape))
    else:
        raise SystemExit(f"--make-slice takes allreduce or weights, not {kind!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path), metadata=meta)
    print(f"{path}: {len(out)} tensors, {path.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Makes the real-data slices the GPU machines read (see above).")
    ap.add_argument("--make-slice", nargs=2, metavar=("KIND", "PATH"), required=True)
    ap.add_argument("--budget-mb", type=float, help="default: 34 (allreduce), 2.5 (weights)")
    a = ap.parse_args()
    kind, path = a.make_slice
    make_slice(kind, Path(path), a.budget_mb or {"allreduce": 34.0, "weights": 2.5}.get(kind, 0))
