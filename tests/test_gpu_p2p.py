"""CUDA tensors between two processes: the CUDA route (UCX moves GPU memory itself,
uzip_serve/p2p/ucx_cuda.py), the CUDA IPC path (cuda_ipc.py, ipc_send.py) and the fallbacks
between them and to the chunk stream. The GPU tests skip without a GPU or ucxx; the offers'
wire formats are checked everywhere.

Both processes regenerate the same tensors from a seed on the GPU, so a 1 GiB check is a
`torch.equal` on the device, not a hash on the host.
"""

import asyncio
import multiprocessing as mp
import os
import signal
import traceback

import pytest
import torch

from uzip_serve.p2p import protocol as proto
from uzip_serve.p2p.errors import ProtocolError

HAS_GPU = torch.cuda.is_available()
try:
    import ucxx  # noqa: F401

    HAS_UCXX = True
except ImportError:
    HAS_UCXX = False
gpu = pytest.mark.skipif(not (HAS_GPU and HAS_UCXX), reason="needs a CUDA GPU and ucxx")
CTX = mp.get_context("spawn")
MiB = 1 << 20


# ---- the offer's wire format (no GPU needed) ------------------------------------------------

def _offer(entries, **kw):
    st = proto.IpcStorage(1 << 20, 512, b"h" * 64, b"/torch_rc", 8, None, True)
    base = dict(mode=proto.IPC_MODE_WHOLE, host_id=b"H" * 16, device_id=b"D" * 16, pid=7, event_handle=b"e" * 64,
                storages=(st,), tensors=tuple((0, 4096 * i, i) for i in range(len(entries))))
    return proto.IpcOffer(**{**base, **kw})


def test_ipc_offer_round_trip_and_validation():
    entries = [proto.TensorEntry("a", "bfloat16", (8,), 16), proto.TensorEntry("b", "uint8", (0,), 0)]
    offer = _offer(entries, tensors=((0, 0, 5), (proto.NO_STORAGE, 0, 0)))
    head, body = offer.pack()
    assert proto.IpcOffer.unpack(proto.IpcOffer.unpack_head(head), body, entries) == offer
    chunked = _offer(entries, tensors=((0, 0, 5), (proto.NO_STORAGE, 0, 0)), mode=proto.IPC_MODE_CHUNKED,
                     staging=0, slots=2, slot_bytes=4096, chunk_bytes=1 << 16)
    h, b = chunked.pack()
    assert proto.IpcOffer.unpack(proto.IpcOffer.unpack_head(h), b, entries) == chunked
    with pytest.raises(ProtocolError, match="magic"):
        proto.IpcOffer.unpack_head(b"XXXX" + head[4:])
    with pytest.raises(ProtocolError, match="outside"):  # a tensor past its storage's end
        bad = _offer(entries, tensors=((0, (1 << 20) - 8, 0), (proto.NO_STORAGE, 0, 0)))
        proto.IpcOffer.unpack(proto.IpcOffer.unpack_head(bad.pack()[0]), bad.pack()[1], entries)
    with pytest.raises(ProtocolError):  # truncated body
        proto.IpcOffer.unpack(proto.IpcOffer.unpack_head(head), body[:-3], entries)
    with pytest.raises(ProtocolError, match="staging"):
        bad = _offer(entries, tensors=((0, 0, 5), (proto.NO_STORAGE, 0, 0)), mode=proto.IPC_MODE_CHUNKED,
                     staging=0, slots=2, slot_bytes=1 << 20, chunk_bytes=1 << 16)
        proto.IpcOffer.unpack(proto.IpcOffer.unpack_head(bad.pack()[0]), bad.pack()[1], entries)
    # the transfer header accepts the IPC flag and nothing else new
    hdr = proto.TransferHeader(10, 0, 1 << 20, 1, proto.FLAG_CUDA_IPC).pack()
    assert proto.TransferHeader.unpack(hdr, max_manifest_bytes=100).flags == proto.FLAG_CUDA_IPC
    both = proto.FLAG_CUDA_IPC | proto.FLAG_CUDA_UCX
    assert proto.TransferHeader.unpack(proto.TransferHeader(10, 0, 1 << 20, 1, both).pack(),
                                       max_manifest_bytes=100).flags == both
    eager = proto.FLAG_CUDA_UCX | proto.FLAG_CUDA_UCX_EAGER
    assert proto.TransferHeader.unpack(proto.TransferHeader(10, 0, 1 << 20, 1, eager).pack(),
                                       max_manifest_bytes=100).flags == eager
    with pytest.raises(ProtocolError, match="without a CUDA route offer"):
        proto.TransferHeader.unpack(proto.TransferHeader(10, 0, 1 << 20, 1, proto.FLAG_CUDA_UCX_EAGER).pack(),
                                    max_manifest_bytes=100)
    with pytest.raises(ProtocolError, match="flags"):
        proto.TransferHeader.unpack(proto.TransferHeader(10, 0, 1 << 20, 1, 8).pack(), max_manifest_bytes=100)


def test_cuda_route_offer_and_message_plan():
    for digests in (None, (5, 0, 2**64 - 1)):
        offer = proto.CudaRouteOffer(b"H" * 16, digests)
        buf = offer.pack(3)
        assert len(buf) == proto.CudaRouteOffer.nbytes(3) and proto.CudaRouteOffer.unpack(buf, 3) == offer
    with pytest.raises(ProtocolError, match="bytes"):  # sized for another manifest
        proto.CudaRouteOffer.unpack(buf, 2)
    with pytest.raises(ProtocolError, match="magic"):
        proto.CudaRouteOffer.unpack(b"XXXX" + buf[4:], 3)
    with pytest.raises(ProtocolError, match="flags"):
        proto.CudaRouteOffer.unpack(buf[:4] + b"\x02\0\0\0" + buf[8:], 3)
    # big tensors alone, in manifest order; small ones batched up to CUDA_BATCH_BYTES; empties skipped
    big, small = proto.CUDA_BATCH_BELOW, proto.CUDA_BATCH_BELOW - 1
    sizes = [small, 0, big, small] + [small] * 20 + [3 * big]
    entries = [proto.TensorEntry(f"t{i}", "uint8", (n,), n) for i, n in enumerate(sizes)]
    plan = proto.plan_cuda_messages(entries)
    alone = [m for m in plan if sizes[m[0]] >= big]
    batches = [m for m in plan if sizes[m[0]] < big]
    assert alone == [(2,), (24,)] and all(len(m) > 1 for m in batches)
    assert [i for m in batches for i in m] == [0, 3] + list(range(4, 24))
    assert all(sum(sizes[i] for i in m) <= proto.CUDA_BATCH_BYTES for m in batches)


def test_count_chunks_matches_the_plan():
    """GPU routes send the chunk count without building the plan; it must be the plan's."""
    import random

    rng = random.Random(1)
    for _ in range(500):
        chunk_bytes = rng.choice([4096, 1 << 16, 1 << 20])
        entries = []
        for i in range(rng.randint(0, 30)):
            dt, isz = rng.choice([("bfloat16", 2), ("float32", 4), ("uint8", 1), ("int64", 8)])
            n = rng.choice([0, 1, 3, chunk_bytes // 4 // isz, chunk_bytes // isz, 3 * chunk_bytes // isz + 1,
                            rng.randint(0, 5 * chunk_bytes // isz)])
            entries.append(proto.TensorEntry(f"t{i}", dt, (n,), n * isz))
        assert proto.count_chunks(entries, chunk_bytes) == len(proto.plan_chunks(entries, chunk_bytes))


# ---- two processes ------------------------------------------------------------------------

def make(dtype: str, numel: int, seed: int, device="cuda"):
    """The same tensor in every process: generated on the GPU from a seed."""
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(seed)
    if dt.is_floating_point:
        t = (torch.randn(numel, generator=g, device="cuda") * 0.02).to(dt)
    else:
        nbytes = numel * torch.empty(0, dtype=dt).element_size()
        t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g, device="cuda").view(dt)
    return t.to(device)


def batch(specs, device="cuda"):
    return {name: make(dt, n, seed, device) for name, dt, n, seed in specs}


def same_bits(t, dt: str, n: int, seed: int) -> bool:
    """`t` holds exactly the bytes of make(dt, n, seed), wherever it lives."""
    return torch.equal(t.reshape(-1).view(torch.uint8), make(dt, n, seed, t.device).reshape(-1).view(torch.uint8))


def _receiver(q, config_kwargs, rounds, relay_port=None):
    """Receives each round (specs, where, *options) and reports whether every tensor matched,
    the path, and how many messages this side sent during the transfer. Options: "relay"
    forwards the round to the receiver at `relay_port`; "wrong" gives an `into` one element
    too long (the transfer must fail; the error is reported and the receiver stops); "hand"
    receives with on_tensor and reports, per tensor handed over, whether it was whole then."""
    from uzip_serve import p2p

    async def main():
        lst = await p2p.listen(0, p2p.TransportConfig(**config_kwargs))
        q.put(("port", lst.port, os.getpid()))
        ep = await lst.accept(timeout=120)
        down = await p2p.connect("127.0.0.1", relay_port, p2p.TransportConfig(**config_kwargs)) if relay_port else None
        sent = 0
        plain_send = ep.send

        def counting_send(buf):
            nonlocal sent
            sent += 1
            return plain_send(buf)

        ep.send = counting_send
        for specs, where, *options in rounds:
            sent = 0
            forward = [down] if "relay" in options else []
            extra = 1 if "wrong" in options else 0
            handed: dict[str, list[bool]] = {}
            seeds = {name: (dt, n, seed) for name, dt, n, seed in specs}

            def on_tensor(name, t):  # on a codec thread or the loop: checked as handed over
                handed.setdefault(name, []).append(same_bits(t, *seeds[name]))

            hand = {"on_tensor": on_tensor} if "hand" in options else {}
            try:
                if where == "cuda_into" or where == "cpu_into":
                    dev = "cuda" if where == "cuda_into" else "cpu"
                    into = {name: torch.full((n + extra,), 7, dtype=getattr(torch, dt)).to(dev) if n else
                            torch.empty(0, dtype=getattr(torch, dt), device=dev) for name, dt, n, _ in specs}
                    got = await ep.recv_tensors(into=into, forward=forward, **hand)
                else:
                    got = await ep.recv_tensors(device="cuda" if where == "cuda_new" else None, forward=forward,
                                                **hand)
            except p2p.TransferError as e:
                if not extra:
                    raise
                q.put(("got", [type(e).__name__], None, 0, sent, False))
                break
            bad = []
            if where.endswith("_into"):
                got = {**into, **got}  # a transfer may fill only some of `into`
            for name, dt, n, seed in specs:
                t = got[name]
                want_dev = "cuda" if where.startswith("cuda") else "cpu"
                ok = t.device.type == want_dev and t.dtype == getattr(torch, dt) and t.numel() == n
                ok = ok and same_bits(t, dt, n, seed)
                if not ok:
                    bad.append(name)
            st = ep.last_stats
            q.put(("got", bad, st.path, st.chunks_compressed, sent, st.preposted, handed))
            del got
        await ep.close()
        if down is not None:
            await down.close()

    try:
        asyncio.run(main())
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put(("error", type(e).__name__, traceback.format_exc()))


class Peer:
    def __init__(self, rounds, relay_port=None, **config_kwargs):
        self.q = CTX.Queue()
        self.proc = CTX.Process(target=_receiver, args=(self.q, config_kwargs, rounds, relay_port), daemon=True)
        self.proc.start()
        _, self.port, self.pid = self.get()

    def get(self, timeout=300):
        msg = self.q.get(timeout=timeout)
        if msg[0] == "error":
            raise AssertionError(f"receiver failed: {msg[1]}\n{msg[2]}")
        return msg

    def stop(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def run_rounds(rounds, sender_cfg=None, relay_rounds=None, **receiver_cfg):
    """Sends every round to a fresh receiving process; returns [(sender stats, receiver report)].
    With `relay_rounds`, that process relays the rounds marked "relay" to a second one, whose
    reports (one per relayed round) follow as [(None, report)]."""
    from uzip_serve import p2p

    down = Peer(relay_rounds, **receiver_cfg) if relay_rounds is not None else None
    peer = Peer(rounds, relay_port=down.port if down else None, **receiver_cfg)
    try:
        async def main():
            ep = await p2p.connect("127.0.0.1", peer.port, p2p.TransportConfig(**(sender_cfg or {})))
            out = []
            for specs, *_ in rounds:
                tensors = batch(specs)
                stats = await ep.send_tensors(tensors)
                out.append((stats, peer.get()))
                del tensors
            await ep.close()
            return out

        try:
            out = asyncio.run(main())
        except Exception as e:  # noqa: BLE001 - the receiver's own error says more than a reset
            _raise_peer_error(peer, e)
            raise
        return out + [(None, down.get()) for _ in relay_rounds or ()]
    finally:
        peer.stop()
        if down is not None:
            down.stop()


def _raise_peer_error(peer: Peer, sender_error: Exception) -> None:
    """A receiver that failed resets the connection; what it reported before is the story."""
    import queue

    try:
        while True:
            msg = peer.q.get(timeout=10)
            if msg[0] == "error":
                raise AssertionError(f"receiver failed: {msg[1]}\n{msg[2]}\n(sender: {sender_error!r})") \
                    from sender_error
    except queue.Empty:
        peer.proc.join(5)
        if peer.proc.exitcode is not None:
            raise AssertionError(f"receiver died, exit code {peer.proc.exitcode} (sender: {sender_error!r})") \
                from sender_error


SIZES = [0, 1, 4095, MiB + 3, 16 * MiB, 256 * MiB, 1024 * MiB]


def size_rounds(where):
    rounds = []
    for i, nbytes in enumerate(SIZES):
        # uint8 for odd sizes; bf16 N(0, 0.02) (what weights look like) where it divides
        dt = "bfloat16" if nbytes % 2 == 0 else "uint8"
        n = nbytes // (2 if dt == "bfloat16" else 1)
        rounds.append(([(f"t{i}", dt, n, 100 + i)], where))
    # a dict of mixed small tensors, some empty, several dtypes
    mixed = [(f"m{j}", ["float32", "bfloat16", "int64", "uint8", "float16"][j % 5], (j * 997) % 5000, j)
             for j in range(40)]
    rounds.append((mixed, where))
    return rounds


@gpu
@pytest.mark.parametrize("where,receiver,path", [
    ("cuda_into", {}, "ucx_cuda"), ("cuda_new", {}, "ucx_cuda"),
    ("cpu_into", {}, "cuda_ipc"), ("cpu_new", {}, "cuda_ipc"),  # host destinations: the route is refused
    ("cuda_into", {"cuda_ucx": "off"}, "cuda_ipc"),  # IPC whole mode, CUDA to CUDA
])
def test_gpu_routes_bit_exact_0_to_1gib(where, receiver, path):
    results = run_rounds(size_rounds(where), **receiver)
    for stats, (_, bad, got_path, compressed, *_) in results:
        assert not bad, f"mismatch in {bad}"
        assert compressed == 0 and stats.chunks_compressed == 0  # auto mode: raw on this link
    # the first round is 0 bytes (no GPU route: nothing sits on a GPU)
    assert all(s.path == p == path for s, (_, _, p, *_) in results[1:]), [s.path for s, _ in results]


def _two(where, seed, *options):
    return ([("w", "bfloat16", 3 * MiB + 1, seed), ("x", "uint8", 4097, seed + 1), ("e", "int64", 0, 0)], where,
            *options)


@gpu
def test_standing_go_ahead_then_eager_transfers_to_any_destination():
    """One go-ahead per endpoint: later transfers send the payload behind the offer (the
    receiver sends the final ACK only), and take host or new destinations through a GPU buffer.
    A CUDA `into` with the layout of the last route transfer gets its receives posted before
    the header arrives (preposted); any other layout or destination does not."""
    wheres = ["cuda_into", "cuda_new", "cpu_new", "cpu_into", "cuda_into", "cuda_into", "cuda_into"]
    results = run_rounds([_two(w, 10 * i) for i, w in enumerate(wheres)])
    assert all(not bad for _, (_, bad, *_) in results)
    assert [s.path for s, _ in results] == ["ucx_cuda"] * 7
    assert [r[2] for _, r in results] == ["ucx_cuda", "ucx_cuda", "ucx_cuda_staged", "ucx_cuda_staged"] + \
        ["ucx_cuda"] * 3
    assert [r[4] for _, r in results] == [2] + [1] * 6  # go-ahead + final ACK, then the final ACK alone
    # preposted from the fifth: the staged transfers (rounds 3-4) had the same layout
    assert [r[5] for _, r in results] == [False] * 4 + [True] * 3


@gpu
def test_preposted_receives_never_catch_another_layout():
    """The receiver expects the last layout, the sender sends a subset that fits the same
    `into`: the early receives stay unmatched (another tag), the transfer takes the normal
    way, bit-exact, and the next repeats of a layout are preposted again."""
    full = _two("cuda_into", 1)
    part = ([full[0][0]], "cuda_into")  # only "w": fits an `into` that also has "x" and "e"
    from uzip_serve import p2p

    rounds = [full, full, part, full, full, full]
    peer = Peer([(full[0], "cuda_into")] * len(rounds))  # the receiver's `into` is always the full layout
    try:
        async def main():
            ep = await p2p.connect("127.0.0.1", peer.port, p2p.TransportConfig())
            out = []
            for specs, *_ in rounds:
                await ep.send_tensors(batch(specs))
                out.append(peer.get())
            await ep.close()
            return out

        reports = asyncio.run(main())
    finally:
        peer.stop()
    # the receiver checks every tensor of the full layout: after `part` only "w" is fresh
    assert [r[1] for r in reports] == [[], [], ["x"], [], [], []]
    assert [r[5] for r in reports] == [False, True, False, False, True, True]


@gpu
def test_eager_transfer_into_a_relaying_receiver_is_forwarded_whole():
    rounds = [_two("cuda_into", 1), _two("cuda_new", 5, "relay"), _two("cpu_new", 9, "relay")]
    results = run_rounds(rounds, relay_rounds=[r[:2] for r in rounds[1:]])
    assert all(not bad for _, (_, bad, *_) in results), results
    assert [r[2] for _, r in results[:3]] == ["ucx_cuda", "ucx_cuda", "ucx_cuda_staged"]
    # downstream: a transfer of its own per relayed round, from where the relay put the
    # tensors (its GPU: the CUDA route; its host memory: the chunk stream)
    assert [r[2] for _, r in results[3:]] == ["ucx_cuda", "ucx"]


@gpu
def test_eager_payload_into_a_wrong_destination_fails_fast_on_both_sides():
    """An eager payload cannot be refused: the receiver's error (an `into` that does not fit)
    must reach the sender as that error, not as a deadline on sends nobody will match."""
    from uzip_serve import p2p

    peer = Peer([_two("cuda_into", 1), _two("cuda_into", 2, "wrong")])
    try:
        async def main():
            ep = await p2p.connect("127.0.0.1", peer.port, p2p.TransportConfig(deadline_s=60))
            await ep.send_tensors(batch(_two("cuda_into", 1)[0]))
            assert not peer.get()[1]
            with pytest.raises(p2p.ProtocolError, match="rejected"):
                await ep.send_tensors(batch(_two("cuda_into", 2)[0]))
            assert peer.get()[1] == ["ProtocolError"]

        asyncio.run(asyncio.wait_for(main(), 50))  # a hang guard under the deadline: a timeout fails
    finally:
        peer.stop()


@gpu
@pytest.mark.parametrize("where,sender,path", [
    ("cuda_into", {}, "ucx_cuda"),
    ("cpu_new", {}, "cuda_ipc"),  # a host destination: the route is refused, IPC whole mode
    ("cuda_into", {"compression": "on", "chunk_bytes": 2 * MiB, "ipc_chunk_bytes": 2 * MiB}, "cuda_ipc"),  # chunks
])
def test_on_tensor_hands_over_each_tensor_once_and_whole_on_gpu_routes(where, sender, path):
    if sender.get("compression") == "on":
        pytest.importorskip("cupy")
    rounds = [_two(where, 60 + 2 * i, "hand") for i in range(2)]
    for stats, report in run_rounds(rounds, sender):
        bad, got_path, handed = report[1], report[2], report[-1]
        assert not bad and got_path == path == stats.path
        assert handed == {"w": [True], "x": [True], "e": [True]}  # the empty one too, as on the chunk stream
        if sender.get("compression") == "on":
            assert stats.chunks_compressed >= 3  # w alone is three GPU-compressed chunks


@gpu
@pytest.mark.parametrize("where", ["cuda_into", "cpu_new"])
def test_cuda_ipc_compressed_chunks_bit_exact(where):
    pytest.importorskip("cupy")
    specs = [([("w", "bfloat16", 80 * MiB + 5, 1), ("s", "float32", 1000, 2), ("e", "uint8", 0, 3)], where),
             ([("r", "uint8", 3 * MiB + 1, 4)], where)]
    cfg = dict(compression="on", ipc_chunk_bytes=32 * MiB)
    results = run_rounds(specs, cfg, **cfg)
    for stats, (_, bad, path, compressed, *_) in results:
        assert not bad and path == "cuda_ipc" and stats.path == "cuda_ipc"
    assert results[0][0].chunks_compressed >= 3 and results[0][0].wire_bytes < 0.75 * results[0][0].raw_bytes


@gpu
def test_gpu_routes_with_checksums_and_refusals_fall_back():
    spec = [([("w", "bfloat16", 4 * MiB, 9), ("x", "uint8", 4097, 10), ("y", "int64", 3, 11)], "cuda_into")]
    (stats, (_, bad, path, *_)), = run_rounds(spec, dict(ipc_checksum=True), ipc_checksum=True)
    assert not bad and stats.path == path == "ucx_cuda"
    (stats, (_, bad, path, *_)), = run_rounds(spec, dict(ipc_checksum=True), ipc_checksum=True, cuda_ucx="off")
    assert not bad and stats.path == path == "cuda_ipc"
    # a receiver whose UCX lacks the CUDA transports refuses the route for good: IPC, twice
    results = run_rounds(spec * 2, ucx_tls="tcp")
    assert all(not r[1] and s.path == r[2] == "cuda_ipc" for s, r in results)
    # both GPU routes refused: the same transfer goes as the chunk stream over UCX, still exact
    (stats, (_, bad, path, *_)), (stats2, (_, bad2, *_)) = run_rounds(spec * 2, cuda_ipc="off", cuda_ucx="off")
    assert not bad and not bad2 and stats.path == path == "ucx" and stats2.path == "ucx"


def _looping_sender(port, deadline, route):
    from uzip_serve import p2p

    async def main():
        ep = await p2p.connect("127.0.0.1", port, p2p.TransportConfig(deadline_s=deadline, cuda_ucx=route))
        big = {"w": make("bfloat16", 512 * MiB, 1)}
        while True:
            await ep.send_tensors(big)

    asyncio.run(main())


@gpu
@pytest.mark.parametrize("compression,route", [("auto", "auto"), ("auto", "off"), ("on", "auto")])
def test_receiver_killed_mid_transfer_raises_on_the_sender(compression, route):
    """auto: the CUDA route; route off: IPC whole mode; on: IPC compressed chunks."""
    from uzip_serve import p2p

    if compression == "on":
        pytest.importorskip("cupy")
    deadline = 3.0
    forever = [([("w", "bfloat16", 512 * MiB, 1)], "cuda_into")] * 100000
    peer = Peer(forever, compression=compression, cuda_ucx=route)
    big = {"w": make("bfloat16", 512 * MiB, 1)}

    async def main():
        ep = await p2p.connect("127.0.0.1", peer.port, p2p.TransportConfig(compression=compression,
                                                                            deadline_s=deadline))
        await ep.send_tensors(big)

        async def loop():
            while True:
                await ep.send_tensors(big)

        task = asyncio.ensure_future(loop())
        await asyncio.sleep(0.5)
        os.kill(peer.pid, signal.SIGKILL)
        # A hang guard, not a speed check: past it, asyncio's own TimeoutError (not a typed
        # p2p error) escapes and the test fails.
        await asyncio.wait_for(task, deadline + 5)

    try:
        with pytest.raises((p2p.PeerError, p2p.TransferTimeout)):
            asyncio.run(main())
    finally:
        peer.stop()


@gpu
@pytest.mark.parametrize("route,path", [("auto", "ucx_cuda"), ("off", "cuda_ipc")])
def test_sender_killed_mid_transfer_raises_on_the_receiver(route, path):
    from uzip_serve import p2p

    deadline = 3.0

    async def main():
        lst = await p2p.listen(0, p2p.TransportConfig(deadline_s=deadline))
        proc = CTX.Process(target=_looping_sender, args=(lst.port, deadline, route), daemon=True)
        proc.start()
        ep = await lst.accept(timeout=120)
        into = {"w": torch.empty(512 * MiB, dtype=torch.bfloat16, device="cuda")}
        await ep.recv_tensors(into=into)
        assert ep.last_stats.path == path

        async def loop():
            while True:
                await ep.recv_tensors(into=into)

        task = asyncio.ensure_future(loop())
        await asyncio.sleep(0.5)
        proc.kill()
        try:
            # The typed error must come within the deadline (+1 s for the kill to land);
            # otherwise asyncio's own TimeoutError escapes and the test fails.
            await asyncio.wait_for(task, deadline + 1)
        finally:
            proc.join(10)

    with pytest.raises((p2p.PeerError, p2p.TransferTimeout)):
        asyncio.run(main())
