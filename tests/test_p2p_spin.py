"""The waits that keep a same-host GPU transfer off thread wake-ups (docs/gpu_p2p.md):
the GIL-free spin of a caller (p2p/loop.py, C extension `_spin`) and the UCX loop's busy
progress around GPU routes (ucx._Spin). Behaviour only; their speed is a benchmark's
business (benchmarks/gpu_p2p.py)."""

import asyncio
import threading

import pytest
import torch

from uzip_serve.p2p import loop
from uzip_serve.p2p import ucx
from uzip_serve.p2p.config import TransportConfig

spin_mod = pytest.importorskip("uzip_serve.p2p._spin", reason="the C extension is built by `make setup`")


def test_spin_wait_sees_a_flag_set_by_another_thread():
    flag = bytearray(1)
    threading.Timer(0.01, lambda: flag.__setitem__(0, 1)).start()
    assert spin_mod.spin_wait(flag, 30.0) is True


def test_spin_wait_gives_up_after_its_timeout():
    assert spin_mod.spin_wait(bytearray(1), 0.005) is False


def test_spin_wait_rejects_an_empty_or_read_only_flag():
    with pytest.raises(ValueError):
        spin_mod.spin_wait(bytearray(0), 0.001)
    with pytest.raises(TypeError):
        spin_mod.spin_wait(b"\x00", 0.001)


async def _value_after(seconds, value):
    await asyncio.sleep(seconds)
    return value


async def _fail_after(seconds):
    await asyncio.sleep(seconds)
    raise KeyError("from the UCX loop")


@pytest.mark.parametrize("work_s", [0.0, 0.05])  # done within the spin, and long after it
def test_a_spinning_caller_gets_the_result_from_another_loop(work_s):
    async def main():
        return await loop.on_ucx_loop(_value_after(work_s, 7), spin_s=0.01)

    assert asyncio.run(main()) == 7
    assert loop.run(_value_after(work_s, 8), spin_s=0.01) == 8


def test_a_spinning_caller_gets_the_exception():
    async def main():
        await loop.on_ucx_loop(_fail_after(0.0), spin_s=0.01)

    with pytest.raises(KeyError):
        asyncio.run(main())
    with pytest.raises(KeyError):
        loop.run(_fail_after(0.02), spin_s=0.001)


def test_cancelling_a_spinning_caller_cancels_the_work():
    started, finished = threading.Event(), threading.Event()

    async def work():
        started.set()
        await asyncio.sleep(5)
        finished.set()

    async def main():
        task = asyncio.ensure_future(loop.on_ucx_loop(work(), spin_s=0.001))
        while not started.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not finished.wait(0.2)


class _FakeUcxx:
    def __init__(self):
        self.calls = 0

    def progress(self):
        self.calls += 1


def test_the_ucx_loop_spins_while_held_and_for_its_linger_only(monkeypatch):
    fake = _FakeUcxx()
    monkeypatch.setattr(ucx, "_ucxx", lambda: fake)
    spin = ucx._Spin()

    async def main():
        with spin.held(linger_s=0.02):
            for _ in range(5):
                await asyncio.sleep(0)
            assert fake.calls >= 3 and spin.task is not None
        during_linger = fake.calls
        await asyncio.sleep(0.005)
        assert fake.calls > during_linger  # still progressing within the linger
        await asyncio.sleep(0.05)
        assert spin.task is None  # and stopped after it
        stopped = fake.calls
        await asyncio.sleep(0.01)
        assert fake.calls == stopped
        spin.touch(0.01)  # a receiver waiting for a GPU sender's header
        await asyncio.sleep(0)
        assert spin.task is not None
        await asyncio.sleep(0.05)
        assert spin.task is None

    asyncio.run(main())


def test_only_same_host_gpu_transfers_spin(monkeypatch):
    cfg = TransportConfig()
    ep = ucx.Endpoint.__new__(ucx.Endpoint)  # just the call planning, no UCX
    ep.config = cfg

    def spin_of(call):
        coro, spin = call
        coro.close()  # planned, never run
        return spin

    assert spin_of(ep.send_call({"w": torch.zeros(4)})) == 0.0
    # A receiving process that uses CUDA counts as a GPU receiver (split_send.uses_cuda).
    assert spin_of(ep.recv_call(into={"w": torch.zeros(4)})) == (cfg.caller_spin_s if torch.cuda.is_initialized()
                                                                  else 0.0)
    assert spin_of(ep.recv_call(device="cuda")) == cfg.caller_spin_s > 0
    # Not started in blocking mode (or not started): the UCX loop never spins.
    monkeypatch.setattr(ucx, "_started_with", None)
    assert not ucx._spins(cfg)
    monkeypatch.setattr(ucx, "_started_with", TransportConfig(progress_mode="polling"))
    assert not ucx._spins(cfg)
    monkeypatch.setattr(ucx, "_started_with", TransportConfig())
    assert ucx._spins(cfg) and not ucx._spins(TransportConfig(gpu_spin_s=0))


def test_spin_settings_are_validated_and_read_from_the_environment(monkeypatch):
    with pytest.raises(ValueError):
        TransportConfig(gpu_spin_s=-1)
    with pytest.raises(ValueError):
        TransportConfig(caller_spin_s=-0.1)
    monkeypatch.setenv("UZIP_P2P_GPU_SPIN_S", "0")
    monkeypatch.setenv("UZIP_P2P_CALLER_SPIN_S", "0.004")
    cfg = TransportConfig.from_env()
    assert (cfg.gpu_spin_s, cfg.caller_spin_s) == (0.0, 0.004)
