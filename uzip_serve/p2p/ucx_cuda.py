"""The FLAG_CUDA_UCX part of a transfer, both sides: UCX moves CUDA tensors itself (docs/gpu_p2p.md).

Between two processes of one host UCX's cuda_ipc transport maps the sender's GPU memory
and copies at device speed, with its own handle and mapping caches; measured on the H200 it
beat our own IPC handle exchange (whose fixed cost, a fresh torch export per transfer, was
~1.1 ms). So for CUDA destinations this route comes first:

    sender                                   receiver
    header, manifest, CudaRouteOffer  ->
                                      <-     ACK_OK or ACK_IPC_REFUSED
    one UCX message per tensor (small
    ones batched), straight from GPU  ->     straight into the destination tensors
                                      <-     final ACK (after digests, if offered)

UCX copies on streams of its own, outside the callers' streams, so each side first waits
(asynchronously) for its caller's stream: the sender for the writes into its tensors, the
receiver for earlier work on its destinations. The receiver acknowledges only after its
receives completed, so the sender's tensors are never read after `send_tensors` returned.

A refusal (host destination, relaying, another host, no CUDA transports in the receiver's
UCX) costs one round trip; the refusals that no later transfer can change are remembered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from typing import Protocol

import torch

from uzip_serve.p2p import cuda_ipc
from uzip_serve.p2p import protocol as proto
from uzip_serve.p2p.adaptive import AdaptivePolicy, Decision, TransferStats
from uzip_serve.p2p.errors import ChecksumError
from uzip_serve.p2p.ipc_send import MIN_LINK_SAMPLE, _raise_for, _stream_for
from uzip_serve.p2p.split_send import _flat_bytes

logger = logging.getLogger(__name__)


class BulkChannel(Protocol):
    """A Channel that can post several messages at once (ucx.Endpoint)."""

    def send(self, buf) -> Awaitable[None]: ...

    def recv(self, buf) -> Awaitable[None]: ...

    async def send_many(self, bufs) -> None: ...

    async def recv_many(self, bufs) -> None: ...


class Route:
    """The CUDA route's state on one endpoint whose UCX carries CUDA memory."""

    def __init__(self):
        self.refused = False  # the peer refused for good: offer it no more


def _bufs(flats, messages, *, make_batch):
    """One buffer per planned message: a tensor's own bytes, or a batch buffer."""
    return [flats[m[0]] if len(m) == 1 else make_batch(m) for m in messages]


# ---- sender -------------------------------------------------------------------------------

async def send(channel: BulkChannel, entries, flats, *, config, policy: AdaptivePolicy, route: Route,
               stream) -> TransferStats | None:
    """Offers the CUDA route for tensors on one GPU. Returns the stats, or None if the peer
    refused (the caller goes on with the next step of the same transfer)."""
    return await _send(channel, entries, flats, config=config, policy=policy, route=route, stream=stream)


async def _send(channel, entries, flats, *, config, policy, route, stream):
    dev = next(f.device for f in flats if f.numel()).index
    stream = _stream_for(stream, dev)
    total = sum(e.nbytes for e in entries)
    messages = proto.plan_cuda_messages(entries)
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        digests = None
        if config.ipc_checksum:
            digests = tuple(cuda_ipc.digest(f) if f.numel() else 0 for f in flats)
        # detach: UCX takes the buffers through __cuda_array_interface__, which torch refuses
        # for tensors that require grad (model parameters). Batches are gathered on the
        # caller's stream, after its writes.
        flats = [f.detach() for f in flats]
        bufs = _bufs(flats, messages, make_batch=lambda m: torch.cat([flats[i] for i in m]))
        ready = torch.cuda.Event()
        ready.record(stream)
    # The offer goes first: the receiver's checks overlap with this side's wait for the GPU.
    await channel.send(proto.CudaRouteOffer(cuda_ipc.host_id(), digests).pack(len(entries)))
    await cuda_ipc.wait_event(ready, config.deadline_s, "CUDA route: the caller's writes")
    status, detail = await _reply(channel)
    if status == proto.ACK_IPC_REFUSED:
        if detail == proto.ACK_REFUSED_FOR_GOOD:
            route.refused = True
            logger.info("peer refused the CUDA route for good; this endpoint will not offer it again")
        return None
    _raise_for(status)
    t0 = time.perf_counter()
    await channel.send_many(bufs)
    _raise_for((await _reply(channel))[0])
    if total >= MIN_LINK_SAMPLE:
        policy.observe_link(total, time.perf_counter() - t0)
    if policy.mode == "on":  # only without a GPU codec: the caller compresses otherwise
        decision = Decision(False, "forced on, but no GPU codec here", total, None, None, None, None)
    else:
        decision = policy.decide(total, None)
    stats = TransferStats(raw_bytes=total, wire_bytes=total, chunks=len(messages), path="ucx_cuda",
                          decisions=[decision])
    logger.debug("CUDA route: %d tensors, %.1f MB in %d messages (%s)", len(entries), total / 1e6, len(messages),
                 decision.reason)
    return stats


async def _reply(channel) -> tuple[int, int]:
    buf = bytearray(proto.ACK.size)
    await channel.recv(buf)
    return proto.ACK.unpack(buf)


# ---- receiver -----------------------------------------------------------------------------

def _destination(offer, route, config, relaying, entries, into, device):
    """(the GPU the tensors go to, None, _) or (None, why the route is refused, whether no
    later transfer of this endpoint can take it either)."""
    if route is None or config.cuda_ucx == "off":
        return None, "the CUDA route is off here, or UCX here lacks the CUDA transports (UCX_TLS)", True
    if offer.host_id != cuda_ipc.host_id():
        return None, "another host: the chunk stream can compress", True
    if relaying:
        return None, "this receiver relays: downstream peers get the chunk stream", False
    if into is not None:
        devices = {into[e.name].device for e in entries if e.nbytes}
    else:
        devices = {torch.device(device) if device is not None else torch.device("cpu")}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return None, "the destination is not on one GPU", False
    dest = next(iter(devices))
    return (dest if dest.index is not None else torch.device("cuda", torch.cuda.current_device())), None, False


async def recv(channel: BulkChannel, entries, *, config, route: Route | None, relaying: bool, into, stream,
               device):
    """Takes (or refuses) the CUDA route. Returns (tensors, stats), or None after refusing."""
    buf = bytearray(proto.CudaRouteOffer.nbytes(len(entries)))
    await channel.recv(buf)
    offer = proto.CudaRouteOffer.unpack(buf, len(entries))
    dev_obj, why, for_good = _destination(offer, route, config, relaying, entries, into, device)
    if why is not None:
        logger.info("CUDA route refused: %s", why)
        await channel.send(proto.ACK.pack(proto.ACK_IPC_REFUSED, proto.ACK_REFUSED_FOR_GOOD if for_good else 0))
        return None
    # The go-ahead leaves before the destination is prepared, so that this side's work
    # overlaps the sender's: UCX moves no byte into our memory before a receive is
    # posted for it (a rendezvous waits in UCX's queue; an eager message is copied out
    # of UCX's buffer when the receive is posted).
    await channel.send(proto.ACK.pack(proto.ACK_OK, 0))
    return await _recv(channel, entries, offer, dev_obj, config=config, into=into, stream=stream)


async def _recv(channel, entries, offer, dev_obj, *, config, into, stream):
    dev = dev_obj.index
    stream = _stream_for(stream, dev)
    messages = proto.plan_cuda_messages(entries)
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        if into is not None:
            outputs = {e.name: into[e.name] for e in entries}
        else:
            outputs = {e.name: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=dev_obj) for e in entries}
        flats = [_flat_bytes(outputs[e.name].detach()) for e in entries]
        bufs = _bufs(flats, messages, make_batch=lambda m: torch.empty(sum(entries[i].nbytes for i in m),
                                                                       dtype=torch.uint8, device=dev_obj))
        ready = torch.cuda.Event()
        ready.record(stream)
    # UCX writes outside the caller's stream: work queued there on these tensors (or on the
    # memory the allocator just handed out) must be done first.
    await cuda_ipc.wait_event(ready, config.deadline_s, "CUDA route: earlier work on the destination")
    await channel.recv_many(bufs)
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        for m, b in zip(messages, bufs):
            if len(m) > 1:  # scatter a batch into its tensors, on the caller's stream
                at = 0
                for i in m:
                    flats[i].copy_(b[at:at + entries[i].nbytes], non_blocking=True)
                    at += entries[i].nbytes
        if offer.digests is not None:
            for i, e in enumerate(entries):
                if e.nbytes and cuda_ipc.digest(flats[i]) != offer.digests[i]:
                    raise ChecksumError(f"tensor {e.name!r}: CUDA route digest mismatch")
    total = sum(e.nbytes for e in entries)
    return outputs, TransferStats(raw_bytes=total, wire_bytes=total, chunks=len(messages), path="ucx_cuda")
