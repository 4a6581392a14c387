"""Compressed pipeline-parallel activation transfer inside vLLM (uzip_vllm.pipeline), on CPU.

One subprocess (tests/vllm_pp_run.py) runs the tiny Gemma-3 (2 layers, so one per stage) with
pipeline parallel size 2 twice: with `--comm-plugin uzip` (compression forced on: loopback is
faster than the codec, the adaptive switch would rightly send raw) and without it. Greedy
outputs must be identical, and the counters must show that the activations between the
stages went over the compressed path, not vLLM's own.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ucxx")

from benchmarks import realdata  # noqa: E402

PROMPTS = ["Once upon a time, in a small village,", "The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 12


def test_pp2_greedy_identical_and_compressed_path_used():
    from uzip_vllm import demo

    model = realdata.tiny_dir()
    if not model.is_dir():
        pytest.fail("the tiny model is missing: run `make setup` (python -m benchmarks.realdata)")
    args = [sys.executable, str(Path(__file__).with_name("vllm_pp_run.py")), str(model),
            "--max-tokens", str(MAX_TOKENS), "--modes", "uzip,none"]
    for p in PROMPTS:
        args += ["--prompt", p]
    env = {**os.environ, **demo.VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "UZIP_PP_COMPRESSION": "on",
           # the test reads the counters with a callable collective_rpc
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    out = subprocess.run(args, capture_output=True, text=True, timeout=1800, env=env)
    assert out.returncode == 0, f"vLLM PP=2 run failed:\n{out.stderr[-4000:]}\n{out.stdout[-4000:]}"
    res = json.loads(out.stdout.strip().splitlines()[-1])
    with_plugin, without = res["uzip"], res["none"]
    assert with_plugin["texts"] == without["texts"]
    assert all(t for t in without["texts"])  # something was generated
    first, last = with_plugin["counters"]  # PP rank 0 sends, PP rank 1 receives
    steps = MAX_TOKENS  # at least one transfer per step (prefill, then one per generated token)
    assert first["sends"] >= steps and first["recvs"] == 0, first
    assert last["recvs"] == first["sends"] and last["sends"] == 0, last
    for c in (first, last):
        assert c["fallbacks"] == 0, c
        assert c["compressed_transfers"] == c["sends"] + c["recvs"], c  # forced on: every transfer
        assert c["compressed_tensors"] >= 2 * c["compressed_transfers"], c  # hidden_states and residual
        assert c["raw_bytes"] > 0 and c["wire_bytes"] > 0, c
