"""The P2P protocol and pipeline without UCX: an in-memory channel carries the bytes,
so corruption and protocol violations can be injected exactly."""

import asyncio
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from uzip_serve.p2p import protocol as proto
from uzip_serve.p2p import split_send
from uzip_serve.p2p.adaptive import AdaptivePolicy, CodecPacer
from uzip_serve.p2p.config import TransportConfig
from uzip_serve.p2p.errors import ChecksumError, ProtocolError


class MemoryChannel:
    """One direction each way; `tamper(index, bytes) -> bytes` may rewrite a message."""

    def __init__(self, inbox: asyncio.Queue, outbox: asyncio.Queue, tamper=None):
        self.inbox, self.outbox, self.tamper, self.sent = inbox, outbox, tamper, 0
        self.received = 0  # messages taken from the inbox so far

    # Like a UCX endpoint, each call takes its place in the order at once (see split_send.Channel).
    def send(self, buf):
        data = bytes(memoryview(buf).cast("B"))
        if self.tamper:
            data = self.tamper(self.sent, data)
        self.sent += 1
        self.outbox.put_nowait(data)
        return asyncio.sleep(0)

    def recv(self, buf):
        return asyncio.ensure_future(self._recv(self.inbox.get(), buf))

    async def _recv(self, get, buf) -> None:
        data = await get
        self.received += 1
        mv = memoryview(buf).cast("B")
        if len(data) != len(mv):
            raise ProtocolError(f"message of {len(data)} bytes, expected {len(mv)}")
        mv[:] = data


def pair(tamper=None):
    a, b = asyncio.Queue(), asyncio.Queue()
    return MemoryChannel(a, b, tamper), MemoryChannel(b, a)


def transfer(tensors, *, tamper=None, into=None, on_tensor=None, **cfg):
    """(sender's result, receiver's result); on_tensor(rx channel, name, tensor) if given."""
    config = TransportConfig(**{"chunk_bytes": 1 << 20, **cfg})

    async def main():
        tx, rx = pair(tamper)
        hand = None if on_tensor is None else (lambda name, t: on_tensor(rx, name, t))
        with ThreadPoolExecutor(2) as pool:
            send = split_send.send_tensors(tx, tensors, config=config, policy=AdaptivePolicy(config.compression),
                                           executor=pool)
            recv = split_send.recv_tensors(rx, config=config, executor=pool, into=into, on_tensor=hand)
            return await asyncio.gather(send, recv, return_exceptions=True)

    return asyncio.run(main())


def bits(t):
    return t.reshape(-1).view(torch.uint8)


def mixed_tensors(n=200, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.float8_e4m3fn]
    out = {}
    for i in range(n):
        dt = dtypes[i % len(dtypes)]
        numel = int(torch.randint(0, 3000, (1,), generator=gen)) if i % 17 else 600_000
        x = torch.randn(numel, generator=gen) * 0.05
        out[f"layer{i}.{dt}"] = x.to(dt) if dt.is_floating_point else x.mul(1000).to(dt)
    return out


@pytest.mark.parametrize("compression", ["on", "off", "auto"])
def test_mixed_dict_round_trips(compression):
    tensors = mixed_tensors()
    sent, (got, stats) = transfer(tensors, compression=compression)
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert torch.equal(bits(got[k]), bits(v)), k
    # 200 tensors, most of them small: batched into far fewer chunks than tensors.
    assert sent.chunks < 60
    assert sent.raw_bytes == sum(v.nbytes for v in tensors.values()) == stats.raw_bytes
    if compression == "on":
        assert sent.wire_bytes < 0.9 * sent.raw_bytes and sent.chunks_compressed == sent.chunks
    if compression == "off":
        assert sent.wire_bytes == sent.raw_bytes and sent.chunks_compressed == 0


def test_receive_into_existing_tensors():
    tensors = {"a": torch.randn(3_000_000).to(torch.bfloat16), "b": torch.arange(10)}
    into = {k: torch.empty_like(v) for k, v in tensors.items()}
    _, (got, _) = transfer(tensors, into=into, compression="on")
    assert got["a"] is into["a"] and torch.equal(bits(into["a"]), bits(tensors["a"]))
    wrong = {"a": torch.empty(3_000_000, dtype=torch.float16), "b": torch.empty(10, dtype=torch.int64)}
    sent, received = transfer(tensors, into=wrong)
    assert isinstance(received, ProtocolError) and "destination" in str(received)
    assert isinstance(sent, ProtocolError)  # the receiver said why, the sender raised


def corrupt_payload(target_index):
    def tamper(i, data):
        if i == target_index:
            b = bytearray(data)
            b[len(b) // 2] ^= 0x10
            return bytes(b)
        return data
    return tamper


@pytest.mark.parametrize("compression", ["on", "off"])
def test_corrupt_chunk_is_a_checksum_error(compression):
    tensors = {"w": torch.randn(2_000_000).to(torch.bfloat16)}
    # messages: 0 header, 1 manifest, then (chunk header, payload) pairs: 5 is chunk 1's payload
    sent, received = transfer(tensors, tamper=corrupt_payload(5), compression=compression)
    assert isinstance(received, ChecksumError)
    assert isinstance(sent, ChecksumError)


@pytest.mark.parametrize("compression", ["on", "off"])
def test_on_tensor_hands_over_each_tensor_as_soon_as_it_is_complete(compression):
    gen = torch.Generator().manual_seed(1)
    # Six tensors of several chunks each, and small ones that share a chunk.
    tensors = {f"big{i}": (torch.randn(1_500_000, generator=gen) * 0.02).to(torch.bfloat16) for i in range(6)}
    tensors |= {f"small{i}": torch.randn(1000, generator=gen) for i in range(3)}
    tensors["empty"] = torch.empty(0, dtype=torch.bfloat16)
    seen = {}

    def on_tensor(rx, name, t):
        assert name not in seen, f"{name} handed over twice"
        seen[name] = (bits(t).clone(), rx.received)  # its bytes, and how far the receive had got

    sent, (got, _) = transfer(tensors, on_tensor=on_tensor, compression=compression)
    assert set(seen) == set(tensors)
    for name, (at_call, _) in seen.items():
        assert torch.equal(at_call, bits(tensors[name])), name  # complete when handed over
        assert got[name].data_ptr() == 0 or torch.equal(bits(got[name]), at_call)
    # The first big tensor was handed over long before the last chunk was received.
    total = 2 + 2 * sent.chunks
    assert seen["big0"][1] < total - 6, (seen["big0"][1], total)


def test_on_tensor_refusal_fails_the_transfer_and_tells_the_sender():
    tensors = {"a": torch.randn(600_000).to(torch.bfloat16), "b": torch.randn(600_000).to(torch.bfloat16)}

    def on_tensor(rx, name, t):
        if name == "b":
            raise ValueError("layer b does not fit")

    sent, received = transfer(tensors, on_tensor=on_tensor, compression="on")
    assert isinstance(received, ProtocolError) and "refused" in str(received) and "does not fit" in str(received)
    assert isinstance(sent, ProtocolError)


def test_on_tensor_is_not_handed_a_corrupt_tensor():
    tensors = {"a": torch.randn(300_000).to(torch.bfloat16), "w": torch.randn(2_000_000).to(torch.bfloat16)}
    seen = []
    # messages: 0 header, 1 manifest, then (chunk header, payload) pairs; chunk 0 holds "a" and the start of "w"
    sent, received = transfer(tensors, tamper=corrupt_payload(5), on_tensor=lambda rx, n, t: seen.append(n),
                              compression="on")
    assert isinstance(received, ChecksumError) and isinstance(sent, ChecksumError)
    assert "w" not in seen


def test_lying_chunk_header_is_a_protocol_error():
    def tamper(i, data):
        if i == 2:  # chunk 0's header: claim more raw bytes than planned
            idx, codec, raw, wire, crc, r = proto.CHUNK_HEADER.unpack(data)
            return proto.CHUNK_HEADER.pack(idx, codec, raw + 1, wire, crc, r)
        return data
    sent, received = transfer({"w": torch.randn(500_000)}, tamper=tamper)
    assert isinstance(received, ProtocolError)


def test_empty_transfer_and_empty_tensors():
    sent, (got, _) = transfer({})
    assert got == {}
    sent, (got, _) = transfer({"e": torch.empty(0, 3, dtype=torch.bfloat16), "s": torch.tensor(1.5)})
    assert got["e"].shape == (0, 3) and got["s"].item() == 1.5


def test_manifest_round_trip_and_validation():
    entries = [proto.TensorEntry("a.weight", "bfloat16", (3, 4), 24), proto.TensorEntry("é", "int64", (), 8)]
    blob = proto.encode_manifest(entries)
    assert proto.decode_manifest(blob, max_tensors=10) == entries
    with pytest.raises(ProtocolError, match="limit"):
        proto.decode_manifest(blob, max_tensors=1)
    with pytest.raises(ProtocolError, match="trailing"):
        proto.decode_manifest(blob + b"\0", max_tensors=10)
    with pytest.raises(ProtocolError):
        proto.decode_manifest(blob[:-3], max_tensors=10)
    bad = bytearray(blob)
    struct.pack_into("<Q", bad, 4 + 4, 25)  # nbytes that disagree with the shape
    with pytest.raises(ProtocolError, match="do not match"):
        proto.decode_manifest(bytes(bad), max_tensors=10)
    dup = proto.encode_manifest([entries[0], entries[0]])
    with pytest.raises(ProtocolError, match="twice"):
        proto.decode_manifest(dup, max_tensors=10)


def test_transfer_header_validation():
    good = proto.TransferHeader(10, 2, 1 << 20, 7).pack()
    assert proto.TransferHeader.unpack(good, max_manifest_bytes=100).num_chunks == 2
    with pytest.raises(ProtocolError, match="v2"):
        proto.TransferHeader.unpack(good[:4] + struct.pack("<H", 2) + good[6:], max_manifest_bytes=100)
    with pytest.raises(ProtocolError, match="magic"):
        proto.TransferHeader.unpack(b"XXXX" + good[4:], max_manifest_bytes=100)
    with pytest.raises(ProtocolError, match="limit"):
        proto.TransferHeader.unpack(good, max_manifest_bytes=5)


def test_plan_chunks_covers_every_byte_once():
    entries = [proto.TensorEntry(f"t{i}", dt, (n,), n * sz) for i, (dt, sz, n) in enumerate(
        [("bfloat16", 2, 5_000_000), ("float32", 4, 10), ("bfloat16", 2, 3), ("uint8", 1, 0),
         ("float32", 4, 300_000), ("float32", 4, 7)])]
    chunks = proto.plan_chunks(entries, 1 << 20)
    covered = {i: [] for i in range(len(entries))}
    for c in chunks:
        assert c.nbytes <= 1 << 20
        for p in c.pieces:
            assert entries[p.tensor].dtype == c.dtype
            covered[p.tensor].append((p.start, p.nbytes))
    for i, e in enumerate(entries):
        spans = sorted(covered[i])
        assert sum(n for _, n in spans) == e.nbytes
        at = 0
        for start, n in spans:
            assert start == at and n % e.itemsize == 0
            at += n


def test_adaptive_policy_flips_with_link_and_data():
    p = AdaptivePolicy("auto")
    assert not p.decide(8 << 20, 0.67).compress  # link not measured yet: raw, and measure it
    p.observe_link(8 << 20, (8 << 20) / 0.125e9)  # a 1 Gbit/s link
    assert p.needs_probe(8 << 20)
    p.observe_compress(8 << 20, (8 << 20) / 1.5e9)
    assert p.decide(8 << 20, 0.67).compress  # weights over a slow link: compress
    assert not p.decide(8 << 20, 1.0).compress  # random bytes: raw
    assert not p.decide(1000, 0.67).compress  # tiny: raw
    for _ in range(20):
        p.observe_link(8 << 20, (8 << 20) / 5e9)  # the link becomes fast
    assert not p.needs_probe(8 << 20)  # codec-bound: no ratio could make compression pay
    d = p.decide(8 << 20, None)
    assert not d.compress and d.link_gbps > 4
    assert AdaptivePolicy("on").decide(100, 1.0).compress
    assert not AdaptivePolicy("off").decide(8 << 20, 0.1).compress


def test_adaptive_policy_link_estimate_and_pipeline_fill():
    p = AdaptivePolicy("auto")
    p.observe_chunk_send(1 << 20, (1 << 20) / 0.3e9)  # a send into socket buffers: looks fast
    assert p.link.value == pytest.approx(0.3e9)
    p.observe_link(8 << 20, (8 << 20) / 0.125e9)  # end to end: replaces the chunk-send estimate
    p.observe_chunk_send(1 << 20, (1 << 20) / 5e9)  # ignored from now on
    assert p.link.value == pytest.approx(0.125e9) and p.link_measured
    # a compressed transfer paced by its codec says only "at least this fast": never lowers it
    p.observe_link(8 << 20, (8 << 20) / 0.05e9, lower_bound=True)
    assert p.link.value == pytest.approx(0.125e9)
    p.observe_compress(1 << 20, (1 << 20) / 0.4e9)
    p.observe_decompress(1 << 20, (1 << 20) / 0.55e9)
    # a long stream: the wire at 0.69 of the bytes sets the pace, compressing pays
    assert p.decide(1 << 20, 0.69, chunks_in_transfer=64).compress
    # one or two chunks: compression and decompression are not hidden (measured 1.24x raw)
    assert not p.decide(1 << 20, 0.69, chunks_in_transfer=2).compress
    assert not p.decide(1 << 20, 0.69, chunks_in_transfer=1).compress


def test_adaptive_policy_learns_from_whole_transfers():
    p = AdaptivePolicy("auto")
    p.observe_link(8 << 20, (8 << 20) / 0.125e9)
    p.observe_compress(1 << 20, (1 << 20) / 0.8e9)
    p.observe_decompress(1 << 20, (1 << 20) / 1.0e9)
    step = 1_262_080  # a batch-1 PP prefill step: two chunks

    def decide(transfer_bytes, chunks):
        return p.decide(1 << 20, 0.69, chunks_in_transfer=chunks, transfer_bytes=transfer_bytes)

    assert decide(step, 2).compress and decide(step, 2).reason.startswith("model")  # the model predicts a gain
    p.observe_transfer(step, 0.0145, compressed=True)  # what it really took (measured: 1.1-1.4x raw)
    d = decide(step, 2)
    assert not d.compress and d.reason.startswith("measured compressed")  # vs the model's raw time
    p.observe_transfer(step, 0.0129, compressed=False)
    d = decide(step, 2)
    assert not d.compress and d.reason.startswith("measured: 1.12x raw")
    assert not p.needs_probe(1 << 20, step)  # raw measured faster: no probe either
    assert p.needs_probe(1 << 20, 10_097_000)
    assert decide(10_097_000, 10).compress  # another size class: still the model
    for _ in range(14):  # after 16 transfers of the class, the losing path is re-measured once
        p.observe_transfer(step, 0.0129, compressed=False)
    d = decide(step, 2)
    assert d.compress and "re-measuring" in d.reason
    p.observe_transfer(step, 0.0145, compressed=True)
    assert not decide(step, 2).compress


def test_adaptive_policy_outcomes_forget_a_cold_start():
    """Raw transfers measured while the link was cold (2x slow) must not keep compression on
    for good: the losing path is re-measured early, and the median of recent outcomes decides."""
    p = AdaptivePolicy("auto")
    p.observe_link(8 << 20, (8 << 20) / 0.125e9)
    step = 1_262_080

    def decide():
        return p.decide(1 << 20, 0.69, chunks_in_transfer=2, transfer_bytes=step)

    p.observe_transfer(step, 0.026, compressed=False)  # cold
    p.observe_transfer(step, 0.0145, compressed=True)
    paths = []
    for _ in range(12):
        d = decide()
        paths.append(d.compress)
        p.observe_transfer(step, 0.0145 if d.compress else 0.0129, compressed=d.compress)
    assert paths[0] and not all(paths), paths  # compression first, raw re-measured early
    assert not any(paths[-4:]), paths  # then raw, which is faster, for good


def test_codec_pacer_uses_the_fewest_threads_that_keep_ahead_of_the_link():
    p = CodecPacer()
    assert p.threads(8) == 8  # link unknown: every core
    p.observe_wire(8 << 20, (8 << 20) / 0.125e9)  # 1 Gbit/s
    assert p.threads(8) == 1  # the prior thread (0.5 GB/s) is 4x the link already
    p.observe_codec(1 << 20, (1 << 20) / 0.05e9, threads=2)  # a contended 2-thread call: ignored
    assert p.one_thread is None and p.threads(8) == 1
    p.observe_codec(1 << 20, (1 << 20) / 0.9e9, threads=1)
    p.observe_codec(1 << 20, (1 << 20) / 0.1e9, threads=1)  # preempted: does not put chunks on 4 threads
    assert p.one_thread == pytest.approx(0.9e9) and p.threads(8) == 1
    slow = CodecPacer()  # a machine whose one thread really is slow: 3 x 0.125 / 0.2
    slow.observe_wire(8 << 20, (8 << 20) / 0.125e9)
    for _ in range(3):
        slow.observe_codec(1 << 20, (1 << 20) / 0.2e9, threads=1)
    assert slow.threads(8) == 2
    for _ in range(30):
        p.observe_wire(64 << 20, (64 << 20) / 1.25e9)  # the link turns out to be 10 Gbit/s
    assert p.threads(8) == 5 and p.threads(3) == 3 and p.threads(1) == 1  # 3 x 1.25 / 0.9 GB/s
    p.observe_wire(1000, 1e-3)  # too small to say anything
    assert p.wire.value == pytest.approx(1.25e9, rel=1e-3)
    for _ in range(CodecPacer.ONE_THREAD_WINDOW):  # old samples age out
        p.observe_codec(1 << 20, (1 << 20) / 0.3e9, threads=1)
    assert p.one_thread == pytest.approx(0.3e9)


# The slow link is 80 Mbit/s: one thread must compress slower than 30 MB/s before it takes a
# second one. At 1 Gbit/s a loaded CI runner (0.37 GB/s on one thread) flipped it to two.
@pytest.mark.parametrize("link_gbps, fixed, expect", [(None, None, 4), (0.01, None, 1), (0.01, 3, 3)])
def test_transfers_take_the_paced_codec_threads_on_both_sides(monkeypatch, link_gbps, fixed, expect):
    """The sender's policy and the receiver's pacer each decide; a configured count wins."""
    monkeypatch.setenv("UZIP_NUM_THREADS", "4")
    tensors = {"w": (torch.randn(3 << 19) * 0.02).to(torch.bfloat16)}  # 3 MiB: three chunks
    config = TransportConfig(chunk_bytes=1 << 20, compression="on", codec_threads=fixed)
    policy, pacer = AdaptivePolicy("on"), CodecPacer()
    if link_gbps:
        policy.pacer.observe_wire(8 << 20, (8 << 20) / (link_gbps * 1e9))
        pacer.observe_wire(8 << 20, (8 << 20) / (link_gbps * 1e9))

    async def main():
        tx, rx = pair()
        with ThreadPoolExecutor(2) as pool:
            return await asyncio.gather(
                split_send.send_tensors(tx, tensors, config=config, policy=policy, executor=pool),
                split_send.recv_tensors(rx, config=config, executor=pool, pacer=pacer))

    sent, (got, received) = asyncio.run(main())
    assert torch.equal(bits(got["w"]), bits(tensors["w"]))
    assert sent.chunks_compressed == 3 and sent.codec_threads == expect and received.codec_threads == expect
    # every transfer teaches both sides: the link (end to end) and, at one thread, the codec
    assert (policy.pacer.one_thread is not None) == (expect == 1)
    assert (pacer.one_thread is not None) == (expect == 1)


class SlowChannel(MemoryChannel):
    """A MemoryChannel whose messages cross one after another at `rate` bytes per second."""

    def __init__(self, inbox, outbox, rate):
        super().__init__(inbox, outbox)
        self.rate, self._last = rate, None

    def send(self, buf):
        data, prev = bytes(memoryview(buf).cast("B")), self._last

        async def cross():
            if prev is not None:
                await prev
            await asyncio.sleep(len(data) / self.rate)
            self.outbox.put_nowait(data)

        self._last = asyncio.ensure_future(cross())
        return self._last


def test_an_endpoint_of_small_transfers_is_paced_too(monkeypatch):
    """Transfers under 1 MiB on the wire (a PP step of a short prompt) teach both pacers the
    link: the first goes on every core, the next on one thread over a 20 MB/s link."""
    monkeypatch.setenv("UZIP_NUM_THREADS", "4")
    tensors = {"w": (torch.randn(600_000) * 0.02).to(torch.bfloat16)}  # 1.2 MB: two chunks, ~0.8 MB wire
    config = TransportConfig(chunk_bytes=1 << 20, compression="on")
    policy, pacer = AdaptivePolicy("on"), CodecPacer()

    async def main():
        a, b = asyncio.Queue(), asyncio.Queue()
        tx, rx = SlowChannel(a, b, 20e6), SlowChannel(b, a, 20e6)
        out = []
        with ThreadPoolExecutor(2) as pool:
            for _ in range(2):
                out.append(await asyncio.gather(
                    split_send.send_tensors(tx, tensors, config=config, policy=policy, executor=pool),
                    split_send.recv_tensors(rx, config=config, executor=pool, pacer=pacer)))
        return out

    (first, (_, first_rx)), (second, (got, second_rx)) = asyncio.run(main())
    assert first.wire_bytes < split_send.END_TO_END_SAMPLE and torch.equal(bits(got["w"]), bits(tensors["w"]))
    assert (first.codec_threads, first_rx.codec_threads) == (4, 4)
    assert (second.codec_threads, second_rx.codec_threads) == (1, 1)


def test_staging_buffers_are_kept_between_transfers_that_succeed():
    tensors = {"w": (torch.randn(3 << 19) * 0.02).to(torch.bfloat16)}
    config = TransportConfig(chunk_bytes=1 << 20, compression="on")
    send_pool, recv_pool = split_send.StagingPool(), split_send.StagingPool()

    def run(tamper=None):
        async def main():
            tx, rx = pair(tamper)
            with ThreadPoolExecutor(2) as pool:
                return await asyncio.gather(
                    split_send.send_tensors(tx, tensors, config=config, policy=AdaptivePolicy("on"), executor=pool,
                                            staging_pool=send_pool),
                    split_send.recv_tensors(rx, config=config, executor=pool, staging_pool=recv_pool),
                    return_exceptions=True)
        return asyncio.run(main())

    def kept(pool):
        return {id(b) for bufs in pool._free.values() for b in bufs}

    sent, (got, _) = run()
    assert torch.equal(bits(got["w"]), bits(tensors["w"]))
    first_send, first_recv = kept(send_pool), kept(recv_pool)
    assert len(first_send) == split_send.SEND_WINDOW + 1 and len(first_recv) == split_send.RECV_WINDOW + 1
    sent, (got, _) = run()  # the same buffers carry the next transfer, bit-exact
    assert torch.equal(bits(got["w"]), bits(tensors["w"]))
    assert kept(send_pool) == first_send and kept(recv_pool) == first_recv
    # a failed transfer keeps its buffers out (a send may still read them): new ones next time
    flip = lambda i, data: data[:-9] + bytes([data[-9] ^ 1]) + data[-8:] if i == 3 else data
    sent, recv = run(flip)
    assert isinstance(recv, ChecksumError) and isinstance(sent, ChecksumError)
    assert not kept(send_pool) and not kept(recv_pool)


def test_cut_through_relay_forwards_every_chunk_unchanged():
    tensors = mixed_tensors(40, seed=9)
    config = TransportConfig(chunk_bytes=1 << 20, compression="on")

    async def main():
        tx, relay_rx = pair()
        relay_tx, child_rx = pair()
        with ThreadPoolExecutor(2) as pool:
            send = split_send.send_tensors(tx, tensors, config=config, policy=AdaptivePolicy("on"), executor=pool)
            mid = split_send.recv_tensors(relay_rx, config=config, executor=pool, forward=[relay_tx])
            end = split_send.recv_tensors(child_rx, config=config, executor=pool)
            return await asyncio.gather(send, mid, end)

    sent, (mid, mid_stats), (end, end_stats) = asyncio.run(main())
    for k, v in tensors.items():
        assert torch.equal(bits(mid[k]), bits(v)) and torch.equal(bits(end[k]), bits(v)), k
    # The relay passed the compressed frames on as they were: same bytes on both hops.
    assert sent.wire_bytes == mid_stats.wire_bytes == end_stats.wire_bytes < sent.raw_bytes


def test_chunk_header_checked_against_the_plan():
    ok = proto.ChunkHeader(3, proto.CODEC_UZIP, 1000, 700).pack()
    assert proto.ChunkHeader.unpack_expected(ok, 3, 1000, 800).wire_nbytes == 700
    with pytest.raises(ProtocolError, match="arrived where chunk 2"):
        proto.ChunkHeader.unpack_expected(ok, 2, 1000, 800)  # out of order
    with pytest.raises(ProtocolError, match="arrived where"):
        proto.ChunkHeader.unpack_expected(ok, 3, 999, 800)  # another size than planned
    with pytest.raises(ProtocolError, match="wire bytes"):
        proto.ChunkHeader.unpack_expected(ok, 3, 1000, 600)  # a frame larger than the buffer
    raw = proto.ChunkHeader(0, proto.CODEC_RAW, 1000, 999).pack()
    with pytest.raises(ProtocolError, match="wire bytes"):
        proto.ChunkHeader.unpack_expected(raw, 0, 1000, 4096)  # a raw chunk is exactly its bytes


def test_payload_tag_is_the_same_in_every_process_and_unique_per_transfer():
    """ucxx hashes user tags with hash(): the tag must be an int (str/bytes hashes are salted
    per process), equal on both sides, and differ with the transfer id or the layout."""
    import subprocess
    import sys

    m1 = proto.encode_manifest([proto.TensorEntry("w", "bfloat16", (4, 2), 16)])
    m2 = proto.encode_manifest([proto.TensorEntry("w", "bfloat16", (2, 4), 16)])
    tag = proto.payload_tag(7, m1)
    assert isinstance(tag, int) and 0 <= tag < 1 << 63 and hash(tag) == tag % ((1 << 61) - 1)
    code = f"from uzip_serve.p2p import protocol as p; print(hash(p.payload_tag(7, {m1!r})))"
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        assert int(out) == hash(tag)
    assert len({tag, proto.payload_tag(8, m1), proto.payload_tag(7, m2)}) == 3


def test_relay_renumbers_headers_so_ids_only_grow():
    """A cut-through relay forwards a header with the downstream endpoint's own next id; a
    receiver that ever sees ids fail to grow stops posting receives early."""
    from uzip_serve.p2p.ucx_cuda import Route

    r = Route()
    r.note_header(1, b"m")
    assert (r.last_id, r.last_manifest) == (1, b"m")
    r.note_header(2, None)  # another route
    assert r.last_manifest is None
    r.note_header(3, b"m")
    assert r.last_manifest == b"m"
    r.note_header(3, b"m")  # did not grow: never again
    r.note_header(9, b"m")
    assert r.last_manifest is None

    class Counting:
        def __init__(self):
            self.ids = iter(range(100, 200))
            self.sent = []

        def next_transfer_id(self):
            return next(self.ids)

        async def send(self, buf):
            self.sent.append(bytes(buf))

    async def main():
        a, b = Counting(), Counting()
        relay = split_send._Relay([a, b])
        relay.pass_header(proto.TransferHeader(10, 1, 1 << 20, 5))
        relay.pass_header(proto.TransferHeader(10, 1, 1 << 20, 6))
        await relay.drain()
        return a, b

    a, b = asyncio.run(main())
    ids = [[proto.TransferHeader.unpack(m, max_manifest_bytes=1 << 20).transfer_id for m in c.sent] for c in (a, b)]
    assert ids == [[100, 101], [100, 101]]


def test_gpu_route_policy_is_not_fooled_by_fixed_costs():
    """A 256 MiB GPU transfer takes ~1.5 ms on one H200, mostly fixed costs: as a link sample
    that is 179 GB/s. The GPU codec's chunked pipeline moves ~40 GB/s end to end, so `auto`
    must stay raw there; only a path measured slower than that (no peer access) compresses."""
    from uzip_serve.p2p import ipc_send

    class Codec:  # wants_chunks only asks whether a GPU codec exists
        pass

    cfg = TransportConfig()
    fast = AdaptivePolicy.for_cuda_ipc("auto")
    assert not ipc_send.wants_chunks(fast, Codec(), 256 << 20, cfg)  # the prior: NVLink-class
    fast.observe_link(256 << 20, 1.5e-3)
    assert not ipc_send.wants_chunks(fast, Codec(), 256 << 20, cfg)
    fast.observe_link(256 << 20, 10e-3)  # a fresh buffer's first transfer pays its IPC mapping
    assert not ipc_send.wants_chunks(fast, Codec(), 1 << 30, cfg)
    slow = AdaptivePolicy.for_cuda_ipc("auto")
    for _ in range(2):
        slow.observe_link(256 << 20, 256 / 1024 / 12)  # 12 GB/s: staged through host memory
        assert not ipc_send.wants_chunks(slow, Codec(), 256 << 20, cfg)  # could be fresh buffers
    slow.observe_link(256 << 20, 256 / 1024 / 12)
    assert ipc_send.wants_chunks(slow, Codec(), 256 << 20, cfg)  # three slow transfers: a slow path
    assert not ipc_send.wants_chunks(slow, None, 256 << 20, cfg)  # no GPU codec, nothing to compress with
