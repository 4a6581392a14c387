"""The FLAG_CUDA_IPC part of a transfer, both sides (docs/gpu_p2p.md).

After the usual transfer header and manifest, the sender sends an IPC offer (protocol.IpcOffer)
and the receiver answers with one ACK-sized reply:

- ACK_IPC_REFUSED: it cannot map the sender's memory; the sender goes on with the
  ordinary chunk stream of the same transfer (split_send), so nothing is lost but a round trip.
- whole mode (raw): the receiver copies every tensor straight out of the sender's
  allocations on its stream, waits for the copies, verifies digests if offered, and its
  reply is the transfer's final ACK. Five small messages per transfer, whatever its size.
- chunked mode (compression pays or is forced): the reply accepts; then per chunk a
  ChunkHeader from the sender (the frame sits in slot k % slots of the sender's staging
  ring, or a raw chunk is read from the source tensor) and a 4-byte credit back once the
  receiver is done with the slot; then the final ACK. The sender compresses chunk k+1
  on its GPU while the receiver decodes chunk k on its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time

import torch

import uzip_serve as uz
from uzip_serve import codec as uzcodec
from uzip_serve import format as fmt
from uzip_serve.p2p import cuda_ipc
from uzip_serve.p2p import protocol as proto
from uzip_serve.p2p.adaptive import AdaptivePolicy, Decision, TransferStats
from uzip_serve.p2p.errors import ChecksumError, ProtocolError

logger = logging.getLogger(__name__)

CREDIT = struct.Struct("<I")
SLOTS = 2
# Below this a transfer's wall time is mostly the control messages, not the copy: it says
# little about the copy's bandwidth, so it does not feed the policy's link estimate.
MIN_LINK_SAMPLE = 64 << 20


def _split():
    from uzip_serve.p2p import split_send

    return split_send


async def _reply(channel) -> int:
    buf = bytearray(proto.ACK.size)
    await channel.recv(buf)
    return proto.ACK.unpack(buf)[0]


def _raise_for(status: int) -> None:
    if status == proto.ACK_CHECKSUM:
        raise ChecksumError("the receiver rejected the transfer: checksum mismatch or undecodable frame")
    if status != proto.ACK_OK:
        raise ProtocolError(f"the receiver rejected the transfer (status {status})")


def _stream_for(stream, dev: int):
    if stream is not None and stream.device == torch.device("cuda", dev):
        return stream
    return torch.cuda.current_stream(dev)


# ---- sender -------------------------------------------------------------------------------

def wants_chunks(policy: AdaptivePolicy, gpu_codec, total: int, config) -> bool:
    """Whether a GPU-to-GPU transfer should go compressed, in chunks: only where compression
    could pay, i.e. forced on, or a link the policy measured slower than the GPU codec (e.g.
    two GPUs without peer access). On one GPU or NVLink the copy outruns the codec and the
    whole transfer goes raw in one step (CUDA route or IPC whole mode)."""
    chunk_bytes = max(config.chunk_bytes, config.ipc_chunk_bytes)
    return gpu_codec is not None and (policy.mode == "on" or policy.needs_probe(min(total, chunk_bytes)))


async def send(channel, items, entries, flats, *, config, policy: AdaptivePolicy, exporter: cuda_ipc.Exporter,
               stream, executor) -> TransferStats | None:
    """Offers the transfer over CUDA IPC. Returns its stats, or None if the peer refused
    (the caller then sends the chunk stream)."""
    split = _split()
    loop = asyncio.get_running_loop()
    dev = next(t.device for _, t in items if t.numel()).index
    stream = _stream_for(stream, dev)
    total = sum(e.nbytes for e in entries)
    gpu = split._gpu_codec()
    chunk_bytes = max(config.chunk_bytes, config.ipc_chunk_bytes)
    chunked = wants_chunks(policy, gpu, total, config)

    storages, where, descs = [], {}, []
    with torch.cuda.device(dev):
        for f in flats:
            if not f.numel():
                descs.append((proto.NO_STORAGE, 0, 0))
                continue
            key = f.untyped_storage().data_ptr()
            if key not in where:
                where[key] = len(storages)
                storages.append(exporter.share(f, stream)[0])
            with torch.cuda.stream(stream):
                dg = cuda_ipc.digest(f) if config.ipc_checksum else 0
            descs.append((where[key], f.storage_offset(), dg))
        staging_idx, slot_bytes, ring = proto.NO_STORAGE, 0, None
        if chunked:
            slot_bytes = -(-fmt.max_compressed_size(chunk_bytes, "uint8") // 512) * 512
            ring = exporter.staging(dev, SLOTS * slot_bytes)
            st, off = exporter.share(ring, stream)
            assert off == 0, "the staging ring starts its allocation"
            staging_idx = len(storages)
            storages.append(st)
        event, event_handle = exporter.event_for(dev)
        event.record(stream)  # after the caller's writes: the receiver's stream waits on it

    offer = proto.IpcOffer(proto.IPC_MODE_CHUNKED if chunked else proto.IPC_MODE_WHOLE, cuda_ipc.host_id(),
                           cuda_ipc.device_id(dev), os.getpid(), event_handle, tuple(storages),
                           tuple(descs), config.ipc_checksum, staging_idx, SLOTS if chunked else 0, slot_bytes,
                           chunk_bytes if chunked else 0)
    head, body = offer.pack()
    t0 = time.perf_counter()
    await channel.send(head)
    await channel.send(body)
    status = await _reply(channel)
    if status == proto.ACK_IPC_REFUSED:
        exporter.refused = True
        logger.info("peer refused CUDA IPC; this endpoint sends over UCX from now on")
        return None
    _raise_for(status)
    stats = TransferStats(raw_bytes=total, path="cuda_ipc")
    if not chunked:
        if policy.mode == "on":
            decision = Decision(False, "forced on, but no GPU codec here", total, None, None, None, None)
        else:
            decision = policy.decide(total, None)
        stats.wire_bytes = total
        stats.decisions.append(decision)
        if total >= MIN_LINK_SAMPLE:
            policy.observe_link(total, time.perf_counter() - t0)
        logger.debug("CUDA IPC: %d tensors, %.1f MB raw in one step (%s)", len(entries), total / 1e6, decision.reason)
        return stats

    chunks = proto.plan_chunks(entries, chunk_bytes)
    stats.chunks = len(chunks)

    def encode(k: int):
        chunk = chunks[k]
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            data = split._chunk_source(chunk, flats)
            typed = split._typed(data, chunk.dtype)
            probe = None
            if policy.needs_probe(chunk.nbytes):
                sample = typed[: split.PROBE_BYTES // typed.element_size()]
                probe = len(uz.compress(sample)) / max(1, sample.nbytes)
            decision = policy.decide(chunk.nbytes, probe, chunks_in_transfer=len(chunks))
            if not decision.compress:
                return proto.ChunkHeader(k, proto.CODEC_RAW, chunk.nbytes, chunk.nbytes), decision
            slot = k % SLOTS
            out = ring[slot * slot_bytes:(slot + 1) * slot_bytes]
            t = time.perf_counter()
            n = gpu.compress_device(typed, out, stream=stream)  # syncs: the frame is complete when it returns
            policy.observe_compress(chunk.nbytes, time.perf_counter() - t)
            return proto.ChunkHeader(k, proto.CODEC_UZIP, chunk.nbytes, n), decision

    credit = bytearray(CREDIT.size)

    async def take_credit(j: int) -> None:
        await channel.recv(credit)
        if CREDIT.unpack(credit)[0] != j:
            raise ProtocolError(f"credit for chunk {CREDIT.unpack(credit)[0]} where {j} was due")

    for k in range(len(chunks)):
        if k >= SLOTS:  # slot k % SLOTS is free once the receiver is done with chunk k - SLOTS
            await take_credit(k - SLOTS)
        header, decision = await loop.run_in_executor(executor, encode, k)
        await channel.send(header.pack())
        stats.wire_bytes += header.wire_nbytes
        stats.chunks_compressed += header.codec == proto.CODEC_UZIP
        stats.decisions.append(decision)
    for j in range(max(0, len(chunks) - SLOTS), len(chunks)):
        await take_credit(j)
    _raise_for(await _reply(channel))
    return stats


# ---- receiver -----------------------------------------------------------------------------

async def recv(channel, entries, header, *, config, importer: cuda_ipc.Importer | None, into, stream, device,
               executor):
    """Takes (or refuses) an IPC offer. Returns (tensors, stats), or None after refusing."""
    head = bytearray(proto.IPC_OFFER_HEAD.size)
    await channel.recv(head)
    fields = proto.IpcOffer.unpack_head(head)
    body = bytearray(fields[-1])
    if body:
        await channel.recv(body)
    offer = proto.IpcOffer.unpack(fields, body, entries)
    why = "this receiver does not map CUDA memory" if importer is None else \
        cuda_ipc.refusal(offer, config.cuda_ipc != "off")
    mapped = {}
    if why is None:
        try:
            dev = cuda_ipc.local_device(offer.device_id)
            stream = _stream_for(stream, dev)
            used = {t[0] for t in offer.tensors if t[0] != proto.NO_STORAGE}
            if offer.mode == proto.IPC_MODE_CHUNKED:
                used.add(offer.staging)
            for idx in sorted(used):
                mapped[idx] = importer.storage(offer.storages[idx], dev, stream)
        except Exception as e:  # noqa: BLE001 - any failure to map means: use the chunk stream
            why = f"mapping failed: {type(e).__name__}: {e}"
    if why is not None:
        logger.info("CUDA IPC offer refused: %s", why)
        await channel.send(proto.ACK.pack(proto.ACK_IPC_REFUSED, 0))
        return None

    split = _split()
    if into is not None:
        outputs = {e.name: into[e.name] for e in entries}
    else:
        target = torch.device(device) if device is not None else torch.device("cpu")
        # Host destinations are pinned, so the copy out of the GPU runs at DMA speed (torch
        # caches pinned blocks, so repeated transfers do not pay for the pinning again).
        outputs = {e.name: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=target,
                                       pin_memory=target.type == "cpu") for e in entries}
    flats = [split._flat_bytes(outputs[e.name]) for e in entries]
    total = sum(e.nbytes for e in entries)
    stats = TransferStats(raw_bytes=total, path="cuda_ipc")
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        stream.wait_event(importer.event(offer.event_handle, dev))

    def source(i: int, start: int, nbytes: int):
        idx, off, _ = offer.tensors[i]
        return importer.view(mapped[idx], off + start, nbytes, dev)

    if offer.mode == proto.IPC_MODE_WHOLE:
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            for i, e in enumerate(entries):
                if e.nbytes:
                    flats[i].copy_(source(i, 0, e.nbytes), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        await cuda_ipc.wait_event(done, config.deadline_s, "CUDA IPC copy")
        stats.wire_bytes = total
    else:
        # A first load compiles; better before the go-ahead than between the sender's chunks.
        await split._load_gpu_codec(split._gpu_codec(), dev, executor)
        await channel.send(proto.ACK.pack(proto.ACK_OK, 0))  # accepted: chunk headers follow
        await _recv_chunked(channel, entries, offer, flats, stats, importer, mapped, dev, stream, config, executor)
    if offer.checksums:
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            for i, e in enumerate(entries):
                if e.nbytes and cuda_ipc.digest(flats[i]) != offer.tensors[i][2]:
                    raise ChecksumError(f"tensor {e.name!r}: CUDA IPC digest mismatch")
    return outputs, stats


async def _recv_chunked(channel, entries, offer, flats, stats, importer, mapped, dev, stream, config, executor):
    split = _split()
    loop = asyncio.get_running_loop()
    chunks = proto.plan_chunks(entries, offer.chunk_bytes)
    stats.chunks = len(chunks)
    ring = mapped[offer.staging]

    def apply(k: int, ch: proto.ChunkHeader) -> None:
        chunk = chunks[k]
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            if ch.codec == proto.CODEC_RAW:
                for p in chunk.pieces:
                    flats[p.tensor][p.start:p.start + p.nbytes].copy_(source(p.tensor, p.start, p.nbytes),
                                                                     non_blocking=True)
                return
            frame = importer.view(ring, (k % offer.slots) * offer.slot_bytes, ch.wire_nbytes, dev)
            p0 = chunk.pieces[0]
            dst = flats[p0.tensor][p0.start:p0.start + p0.nbytes]
            direct = len(chunk.pieces) == 1 and dst.is_cuda
            out = split._typed(dst if direct else torch.empty(chunk.nbytes, dtype=torch.uint8, device=stream.device),
                               chunk.dtype)
            try:
                uzcodec.decompress_device(frame, out=out, stream=stream)  # checks: syncs on its error word
            except uz.FrameError as e:
                raise ChecksumError(f"chunk {k}: {e}") from None
            except ValueError as e:
                raise ProtocolError(f"chunk {k}: {e}") from None
            if not direct:
                data = out.reshape(-1).view(torch.uint8)
                at = 0
                for p in chunk.pieces:
                    flats[p.tensor][p.start:p.start + p.nbytes].copy_(data[at:at + p.nbytes], non_blocking=True)
                    at += p.nbytes
                torch.cuda.current_stream().synchronize()  # `out` is freed after this

    def source(i, start, nbytes):
        idx, off, _ = offer.tensors[i]
        return importer.view(mapped[idx], off + start, nbytes, dev)

    for k, chunk in enumerate(chunks):
        hb = bytearray(proto.CHUNK_HEADER.size)
        await channel.recv(hb)
        ch = proto.ChunkHeader.unpack_expected(hb, k, chunk.nbytes, offer.slot_bytes)
        await loop.run_in_executor(executor, apply, k, ch)
        stats.wire_bytes += ch.wire_nbytes
        stats.chunks_compressed += ch.codec == proto.CODEC_UZIP
        await channel.send(CREDIT.pack(k))
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        done = torch.cuda.Event()
        done.record(stream)
    await cuda_ipc.wait_event(done, config.deadline_s, "CUDA IPC copy")
