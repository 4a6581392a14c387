"""Shared fixtures: the real tensors prepared by `make setup` (benchmarks/realdata.py), a
chunk corrupter for the P2P path, and vLLM's environment for the tests that start it."""

import contextlib
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def realdata():
    """Loads a prepared real-tensor set by name. Missing data is an error, not a skip:
    the real tensors are what the codec's claims rest on."""
    from benchmarks import realdata as rd

    cache = {}

    def load(name):
        if name not in cache:
            cache[name] = rd.load(name)
        return cache[name]

    return load


# vLLM reads these at import: offline, CPU. The servers and reference engines the tests start
# get them from uzip_vllm.demo.VLLM_ENV.
VLLM_TEST_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                 "VLLM_NO_USAGE_STATS": "1"}


def use_vllm_test_env() -> None:
    """Call before importing vllm; what the caller's environment already says wins."""
    for k, v in VLLM_TEST_ENV.items():
        os.environ.setdefault(k, v)


@pytest.fixture
def corrupt_chunks(monkeypatch):
    """`with corrupt_chunks(mask):` every chunk this process sends over P2P inside the block has
    its middle byte XORed with `mask` after it was encoded (and checksummed)."""
    from uzip_serve.p2p import split_send

    real = split_send._send_chunk

    @contextlib.contextmanager
    def flipping(mask: int):
        async def corrupting(channel, enc, policy, stats):
            payload = bytearray(memoryview(enc.payload).cast("B"))
            payload[len(payload) // 2] ^= mask
            enc.payload = payload
            return await real(channel, enc, policy, stats)

        monkeypatch.setattr(split_send, "_send_chunk", corrupting)
        try:
            yield
        finally:
            monkeypatch.setattr(split_send, "_send_chunk", real)

    return flipping
