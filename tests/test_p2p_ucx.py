"""UCX transfers between real processes on loopback: bit-exactness, peer death, adaptivity.

The receiving side runs in a spawned process; it reports a digest of every tensor it
got (or its exception) through a queue, so each test fails once, with the peer's
traceback, instead of hanging.
"""

import asyncio
import hashlib
import multiprocessing as mp
import os
import signal
import traceback

import pytest
import torch

pytest.importorskip("ucxx")

from uzip_serve import p2p  # noqa: E402
from uzip_serve import format as fmt  # noqa: E402

CTX = mp.get_context("spawn")
DTYPES = [getattr(torch, d.name) for d in fmt.DTYPES_BY_CODE.values()
          if hasattr(torch, d.name) and d.name not in ("complex32",)]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _receiver(q, config_kwargs, rounds, stall):
    """Accepts one connection and receives `rounds` transfers, reporting digests."""
    async def main():
        lst = await p2p.listen(0, p2p.TransportConfig(**config_kwargs))
        q.put(("port", lst.port, os.getpid()))
        ep = await lst.accept(timeout=60)
        for _ in range(rounds):
            got = await ep.recv_tensors()
            q.put(("got", {k: (str(v.dtype), tuple(v.shape), digest(v)) for k, v in got.items()},
                   ep.last_stats.chunks_compressed))
        if stall:
            await asyncio.sleep(3600)
        await ep.close()

    try:
        asyncio.run(main())
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put(("error", type(e).__name__, traceback.format_exc()))


class Peer:
    def __init__(self, rounds=1, stall=False, **config_kwargs):
        self.q = CTX.Queue()
        self.proc = CTX.Process(target=_receiver, args=(self.q, config_kwargs, rounds, stall), daemon=True)
        self.proc.start()
        kind, self.port, self.pid = self.get()

    def get(self, timeout=120):
        msg = self.q.get(timeout=timeout)
        if msg[0] == "error":
            raise AssertionError(f"receiver failed: {msg[1]}\n{msg[2]}")
        return msg

    def stop(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def send(port, batches, **config_kwargs):
    async def main():
        ep = await p2p.connect("127.0.0.1", port, p2p.TransportConfig(**config_kwargs))
        stats = []
        for tensors in batches:
            stats.append(await ep.send_tensors(tensors))
        await ep.close()
        return stats

    return asyncio.run(main())


def tensor_of(dtype, nbytes, gen):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = nbytes // itemsize
    if dtype.is_floating_point and itemsize > 1:
        return (torch.randn(n, generator=gen) * 0.02).to(dtype)
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    return (raw & 1).view(torch.bool) if dtype == torch.bool else raw.view(dtype)


def check(expected: dict, reported: dict):
    assert set(reported) == set(expected)
    for k, v in expected.items():
        assert reported[k] == (str(v.dtype), tuple(v.shape), digest(v)), k


@pytest.mark.parametrize("compression", ["on", "off"])
def test_every_dtype_and_size_bit_exact(compression):
    gen = torch.Generator().manual_seed(0)
    sizes = [0, 1, 7, 4095, 65537, (1 << 20) + 3, 9 << 20]
    batches = [{f"{dt}-{n}": tensor_of(dt, n, gen) for dt in DTYPES} for n in sizes]
    big = {"big": (torch.randn(128 << 20, generator=gen) * 0.02).to(torch.bfloat16)}  # 256 MiB
    batches.append(big)
    peer = Peer(rounds=len(batches), compression=compression)
    try:
        stats = send(peer.port, batches, compression=compression)
        for tensors in batches:
            _, reported, compressed_chunks = peer.get()
            check(tensors, reported)
        if compression == "off":
            assert all(s.chunks_compressed == 0 and s.wire_bytes == s.raw_bytes for s in stats)
        else:
            assert stats[-1].chunks_compressed == stats[-1].chunks
            assert stats[-1].wire_bytes < 0.7 * stats[-1].raw_bytes
    finally:
        peer.stop()


def test_dict_of_200_mixed_tensors():
    from test_p2p_protocol import mixed_tensors

    tensors = mixed_tensors(200, seed=3)
    peer = Peer(rounds=2, compression="auto")
    try:
        send(peer.port, [tensors, tensors], compression="auto")
        check(tensors, peer.get()[1])
        check(tensors, peer.get()[1])
    finally:
        peer.stop()


def test_random_bytes_go_raw_and_weights_get_compressed_in_auto_mode():
    gen = torch.Generator().manual_seed(5)
    noise = {"noise": torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=gen)}
    weights = {"w": (torch.randn(32 << 20, generator=gen) * 0.02).to(torch.bfloat16)}
    peer = Peer(rounds=2, compression="auto")
    try:
        async def main():
            ep = await p2p.connect("127.0.0.1", peer.port, p2p.TransportConfig(compression="auto"))
            # Pin the link estimate at 1 Gbit/s (loopback is faster than the codec, where
            # nothing is worth compressing) and the codec at 1 GB/s (on a loaded 2-core host
            # it can measure slower than that link), and keep the measured outcomes of whole
            # transfers out (they would tell the truth about loopback): then only the data decides.
            ep.policy.observe_link(8 << 20, (8 << 20) / 0.125e9)
            ep.policy.observe_compress(1 << 20, (1 << 20) / 1e9)
            ep.policy.observe_decompress(1 << 20, (1 << 20) / 1e9)
            for name in ("observe_link", "observe_transfer", "observe_compress"):
                setattr(ep.policy, name, lambda *a, **k: None)
            s_noise = await ep.send_tensors(noise)
            s_w = await ep.send_tensors(weights)
            await ep.close()
            return s_noise, s_w

        s_noise, s_w = asyncio.run(main())
        check(noise, peer.get()[1])
        check(weights, peer.get()[1])
        assert s_noise.chunks_compressed == 0
        assert any(d.reason == "incompressible" for d in s_noise.decisions)
        assert s_w.chunks_compressed == s_w.chunks
        assert all(d.probe_ratio < 0.7 for d in s_w.decisions if d.compress)
    finally:
        peer.stop()


def test_receiver_killed_mid_transfer_raises_on_the_sender():
    deadline = 3.0
    peer = Peer(rounds=1, compression="off")
    big = {"w": torch.randn(256 << 20, dtype=torch.float32).view(torch.uint8)}  # 1 GiB: long enough to kill

    async def main():
        ep = await p2p.connect("127.0.0.1", peer.port, p2p.TransportConfig(compression="off", deadline_s=deadline))
        task = asyncio.ensure_future(ep.send_tensors(big))
        await asyncio.sleep(0.3)
        os.kill(peer.pid, signal.SIGKILL)
        # The watchdog turns a hang into a test failure: the error must come within the deadline.
        return await asyncio.wait_for(task, deadline + 5)

    try:
        with pytest.raises((p2p.PeerError, p2p.TransferTimeout)):
            asyncio.run(main())
    finally:
        peer.stop()


def test_sender_killed_mid_transfer_raises_on_the_receiver():
    deadline = 3.0
    ready = CTX.Queue()

    async def main():
        lst = await p2p.listen(0, p2p.TransportConfig(compression="off", deadline_s=deadline))
        proc = CTX.Process(target=_sender_proc, args=(lst.port, ready), daemon=True)
        proc.start()
        ep = await lst.accept(timeout=60)
        task = asyncio.ensure_future(ep.recv_tensors())
        await asyncio.sleep(0.5)
        proc.kill()
        try:
            return await asyncio.wait_for(task, deadline + 5)
        finally:
            proc.join(10)

    with pytest.raises((p2p.PeerError, p2p.TransferTimeout)):
        asyncio.run(main())


def _sender_proc(port, ready):
    async def main():
        ep = await p2p.connect("127.0.0.1", port, p2p.TransportConfig(compression="off"))
        await ep.send_tensors({"w": torch.zeros(1 << 30, dtype=torch.uint8)})

    asyncio.run(main())


def test_stuck_receiver_times_out():
    # The receiver takes the first transfer and then stops reading: the sender's next
    # transfer cannot complete and must end in TransferTimeout, not hang.
    peer = Peer(rounds=1, stall=True, compression="off")
    try:
        async def main():
            cfg = p2p.TransportConfig(compression="off", deadline_s=2.0)
            ep = await p2p.connect("127.0.0.1", peer.port, cfg)
            await ep.send_tensors({"a": torch.ones(10)})
            return await asyncio.wait_for(ep.send_tensors({"b": torch.ones(64 << 20)}), 10)

        with pytest.raises(p2p.TransferTimeout):
            asyncio.run(main())
        peer.get()
    finally:
        peer.stop()


def test_sync_facade():
    peer = Peer(rounds=1)
    try:
        ep = p2p.connect_sync("127.0.0.1", peer.port)
        x = {"x": torch.randn(100_000).to(torch.bfloat16)}
        stats = ep.send_tensors(x)
        ep.close()
        check(x, peer.get()[1])
        assert stats.raw_bytes == x["x"].nbytes
    finally:
        peer.stop()


def _adopting_sender(port, q):
    """p2p.use_running_loop() in a process of its own: it binds the process's UCX to this loop."""
    import threading

    from uzip_serve.p2p import loop

    async def main():
        p2p.use_running_loop()
        ep = await p2p.connect("127.0.0.1", port)
        x = {"x": torch.randn(300_000).to(torch.bfloat16)}
        await ep.send_tensors(x)
        await ep.close()
        threads = [t.name for t in threading.enumerate()]
        return loop.ucx_loop() is asyncio.get_running_loop(), "uzip-p2p-loop" in threads, digest(x["x"])

    try:
        on_this_loop, p2p_thread, sent = asyncio.run(main())
        try:  # UCX now lives on that (closed) loop: adopting another one must be refused
            asyncio.run(_adopt())
            refused = None
        except RuntimeError as e:
            refused = str(e)
        q.put(("sender", on_this_loop, p2p_thread, sent, refused))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put(("error", type(e).__name__, traceback.format_exc()))


async def _adopt():
    p2p.use_running_loop()


def test_use_running_loop_runs_transfers_on_the_callers_loop():
    peer = Peer(rounds=1)
    try:
        proc = CTX.Process(target=_adopting_sender, args=(peer.port, peer.q), daemon=True)
        proc.start()
        msgs = [peer.get(), peer.get()]
        proc.join(30)
        (_, got, _), = [m for m in msgs if m[0] == "got"]
        (_, on_this_loop, p2p_thread, sent, refused), = [m for m in msgs if m[0] == "sender"]
        assert on_this_loop and not p2p_thread  # no dedicated loop thread, hence no hop
        assert got["x"][2] == sent
        assert refused is not None and "use_running_loop" in refused
    finally:
        peer.stop()


def test_idle_receive_outlasts_the_deadline_and_ends_when_the_peer_goes():
    """A kept-open connection waits for its next message longer than deadline_s; when the peer
    goes away the wait ends at once with PeerError, and `alive` says so on the other side too."""
    import threading
    import time

    config = p2p.TransportConfig(deadline_s=1.0, progress_mode="thread")
    with p2p.SyncListener(0, config) as lst:
        sender = p2p.connect_sync("127.0.0.1", lst.port, config)
        receiver = lst.accept(timeout=10)
        threading.Timer(2.5, sender.send_bytes, args=(b"next",)).start()
        t0 = time.monotonic()
        assert receiver.recv_bytes(64, idle=True) == b"next"
        assert time.monotonic() - t0 > 2.0
        assert sender.alive and receiver.alive
        threading.Timer(0.5, sender.abort).start()
        t0 = time.monotonic()
        with pytest.raises(p2p.PeerError):
            receiver.recv_bytes(64, idle=True)
        assert time.monotonic() - t0 < 3.0
        deadline = time.monotonic() + 5
        while receiver.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sender.alive and not receiver.alive
        receiver.abort()


def test_the_side_that_sent_last_waits_for_the_peer_to_close():
    """The receiver's last message is its ack, and it closes right after (Peer). ucxx closes by
    force: a receiver hanging up at once could have its ack dropped, or the sender's receive of
    it cancelled (seen under load on a relay waiting for its last hop). So the receiver's close
    waits for the sender, which read the last message, to hang up first."""
    w = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    peer = Peer()
    try:
        async def main():
            ep = await p2p.connect("127.0.0.1", peer.port)
            await ep.send_tensors(w)
            hung_up = False
            for _ in range(20):  # the receiver has called close() by now; its end must stay up
                await asyncio.sleep(0.1)
                hung_up = hung_up or not ep.alive
            await ep.close()
            return hung_up

        assert not asyncio.run(main()), "the receiver closed the connection before the sender did"
        check(w, peer.get()[1])
    finally:
        peer.stop()


EAGER_SCRIPT = r"""
import asyncio, sys, torch, ucxx
from uzip_serve import p2p
from uzip_serve.p2p import ucx

async def main(eager):
    cfg = p2p.TransportConfig(eager_bytes=eager, chunk_bytes=1 << 20, compression=sys.argv[2])
    lst = await p2p.listen(0, cfg)
    got = {}

    async def serve():
        ep = await lst.accept(timeout=30)
        got.update(await ep.recv_tensors())
        await ep.close()

    task = asyncio.ensure_future(serve())
    ep = await p2p.connect("127.0.0.1", lst.port, cfg)
    x = (torch.randn(1_500_000, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    stats = await ep.send_tensors({"x": x})
    await task
    await ep.close()
    assert torch.equal(got["x"].view(torch.int16), x.view(torch.int16)), "differs"
    print("RNDV_THRESH", ucxx.get_config()["RNDV_THRESH"], "chunks", stats.chunks)

asyncio.run(main(int(sys.argv[1])))
"""


@pytest.mark.parametrize("user_env, eager, compression, expect", [
    (None, 1 << 20, "on", ":1M"),            # our threshold: 1 MiB chunks go eagerly
    (None, 1 << 20, "off", ":1M"),
    (None, 0, "on", ":8K"),                  # ucxx's own default (8192) when not asked
    ("65536", 1 << 20, "on", ":64K"),        # a user's UCX_RNDV_THRESH wins
])
def test_eager_bytes_sets_the_rendezvous_threshold_unless_the_user_did(user_env, eager, compression, expect):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "UCX_RNDV_THRESH"}
    if user_env:
        env["UCX_RNDV_THRESH"] = user_env
    out = subprocess.run([sys.executable, "-c", EAGER_SCRIPT, str(eager), compression], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RNDV_THRESH"))
    thresh, chunks = line.split()[1], int(line.split()[3])
    assert chunks == 3  # 3 MB in 1 MiB chunks, received bit-exact either way
    assert all(part.endswith(expect) for part in thresh.split(",")), thresh


def test_eager_bytes_is_checked():
    with pytest.raises(ValueError, match="eager_bytes"):
        p2p.TransportConfig(eager_bytes=-1)
