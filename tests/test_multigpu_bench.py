"""The multi-GPU benchmarks' CPU rehearsals (benchmarks/allreduce_gpu.py, gpu_weight_push.py):
their helpers, the clear refusal without GPUs, and one tiny end-to-end run of each CPU mode
(real processes: launcher, measurement loop, bit-identity checks, report)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import multigpu as mg

REPO = Path(__file__).resolve().parents[1]
NO_GPU = not torch.cuda.is_available() or torch.cuda.device_count() < 2


def _run(args, tmp_path, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", *args, "--out", str(tmp_path), "--logs", str(tmp_path / "logs")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_digest_sees_any_change_and_ignores_device():
    x = torch.arange(300_001, dtype=torch.int32).view(torch.uint8)  # not a multiple of the row size
    d = mg.digest(x)
    y = x.clone()
    y[123_457] ^= 1
    assert mg.digest(y) != d
    z = x.clone().view(-1)[:4096 * 4].view(4, 4096).flip(0).reshape(-1)  # rows swapped, same words
    assert mg.digest(z) != mg.digest(x[:4096 * 4])
    assert mg.dict_digest({"a": x}) != mg.dict_digest({"b": x})


def test_sizes_link_modes_and_gpu_placement(monkeypatch):
    assert mg.parse_size("64M") == 64 << 20 and mg.parse_size("1G") == 1 << 30 and mg.parse_size("256K") == 256 << 10
    assert mg.LINKS["sockets"]["NCCL_P2P_DISABLE"] == "1" and mg.LINKS["tcp"]["UZIP_P2P_CUDA_IPC"] == "off"
    assert all(env["NCCL_NVLS_ENABLE"] == "0" for env in mg.LINKS.values())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert mg.gpu_first_env(2, 4) == {"CUDA_VISIBLE_DEVICES": "6,4,5,7"}  # own GPU first, all still visible
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert mg.gpu_first_env(1, 3) == {"CUDA_VISIBLE_DEVICES": "1,0,2"}


def test_tiled_state_dict_is_exactly_the_size_and_buckets_like_vllm():
    from benchmarks import gpu_weight_push as gwp

    for total in (8 << 20, (600 << 20) + 4 * 640):  # inside one copy; across two copies
        specs = gwp.tiled_specs(total)
        assert sum(2 * torch.Size(s).numel() for _, _, s in specs) == total
        assert len({n for n, _, _ in specs}) == len(specs)
    items = [(str(i), torch.empty(n, dtype=torch.uint8)) for i, n in enumerate([6, 6, 6, 1, 20, 3])]
    # a bucket closes once it exceeds the limit (vLLM's packed_tensor rule)
    assert [[k for k, _ in b] for b in gwp.buckets(items, 10)] == [["0", "1"], ["2", "3", "4"], ["5"]]


@pytest.mark.skipif(not NO_GPU, reason="this machine has GPUs")
def test_refuses_clearly_without_gpus():
    from benchmarks import allreduce_gpu, gpu_weight_push

    for main in (allreduce_gpu.main, gpu_weight_push.main):
        with pytest.raises(SystemExit) as e:
            main(["--out", "/nonexistent-never-written"])
        assert "needs 2 GPUs" in str(e.value.code) and "--device cpu" in str(e.value.code)


def test_allreduce_cpu_rehearsal_end_to_end(tmp_path):
    r = _run(["benchmarks.allreduce_gpu", "--backend", "gloo", "--device", "cpu", "--gpus", "2", "--sizes", "64K",
              "--data", "activations", "--repeats", "1", "--warmup", "1", "--lockstep"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "allreduce_gpu_cpu.json").read_text())
    assert {row["mode"] for row in res["rows"]} == {"native", "compressed", "adaptive"}
    assert all(row["identical_across_ranks"] for row in res["rows"])
    assert all(row["equals_uncompressed_ring"] for row in res["rows"] if row["mode"] == "compressed")
    assert (tmp_path / "allreduce_gpu_cpu.png").stat().st_size > 0 and (tmp_path / "allreduce_gpu_cpu.md").exists()


def test_weight_push_cpu_rehearsal_end_to_end(tmp_path):
    pytest.importorskip("grpc")
    pytest.importorskip("ucxx")
    r = _run(["benchmarks.gpu_weight_push", "--device", "cpu", "--receivers", "1", "--sizes", "8M", "--repeats", "1",
              "--warmup", "0"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_weight_push_cpu.json").read_text())
    assert {row["method"] for row in res["rows"]} == {"uzip", "uzip-raw", "broadcast"}
    assert all(row["bit_exact"] and row["pushes_checked"] == 1 for row in res["rows"])
    assert (tmp_path / "gpu_weight_push_cpu.png").stat().st_size > 0
