"""The FLAG_CUDA_UCX part of a transfer, both sides: UCX moves CUDA tensors itself (docs/gpu_p2p.md).

Between two processes of one host UCX's cuda_ipc transport maps the sender's GPU memory
and copies at device speed, with its own handle and mapping caches; measured on the H200 it
beat our own IPC handle exchange (whose fixed cost, a fresh torch export per transfer, was
~1.1 ms). So for CUDA destinations this route comes first:

    sender                                   receiver
    header, manifest, CudaRouteOffer  ->
                                      <-     ACK_OK (+ ACK_STANDING) or ACK_IPC_REFUSED
    one UCX message per tensor (small
    ones batched), straight from GPU  ->     straight into the destination tensors
                                      <-     final ACK (after digests, if offered)

The go-ahead is asked for once per endpoint: a receiver that accepted grants a standing one,
and later transfers set FLAG_CUDA_UCX_EAGER and post the payload right behind the offer. At
~1 TB/s a round trip of the event loops (0.3 ms measured) costs as much as the copy of a
quarter GiB. An eager payload cannot be refused, so a receiver whose destination is not on
one GPU takes it through a GPU buffer of its own and copies it on.

UCX copies on streams of its own, outside the callers' streams, so each side first waits
(asynchronously) for its caller's stream: the sender for the writes into its tensors, the
receiver for earlier work on its destinations. The receiver acknowledges only after its
receives completed, so the sender's tensors are never read after `send_tensors` returned.

A refusal (host destination, relaying, another host, no CUDA transports in the receiver's
UCX) costs one round trip; the refusals that no later transfer can change are remembered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Protocol

import torch

from uzip_serve.p2p import cuda_ipc
from uzip_serve.p2p import protocol as proto
from uzip_serve.p2p.adaptive import AdaptivePolicy, Decision, TransferStats
from uzip_serve.p2p.errors import ChecksumError, ProtocolError
from uzip_serve.p2p.ipc_send import MIN_LINK_SAMPLE, _raise_for, _stream_for
from uzip_serve.p2p.loop import cancel_quietly
from uzip_serve.p2p.split_send import _flat_bytes, entries_of

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
        self.refused = False  # sender: the peer refused for good: offer it no more
        self.standing = False  # sender: the peer granted a standing go-ahead: send eagerly
        self.granted = False  # receiver: this side granted one: the peer sends eagerly
        # receiver: the last transfer header's id and, if it came by this route, its
        # manifest: what PrePost expects of the next one
        self.last_id: int | None = None
        self.last_manifest: bytes | None = None
        self._ids_grow = True

    def note_header(self, transfer_id: int, route_manifest: bytes | None) -> None:
        """Receiver: a transfer header arrived (`route_manifest`: its manifest if the route
        carried it). Ids that ever fail to grow switch PrePost off for good: a receive posted
        for an id that never came must never match a later transfer."""
        if self.last_id is not None and transfer_id <= self.last_id:
            self._ids_grow = False
        self.last_id = transfer_id
        self.last_manifest = route_manifest if self._ids_grow else None


def _bufs(flats, messages, *, make_batch):
    """One buffer per planned message: a tensor's own bytes, or a batch buffer."""
    return [flats[m[0]] if len(m) == 1 else make_batch(m) for m in messages]


# ---- sender -------------------------------------------------------------------------------

async def send(channel: BulkChannel, entries, flats, *, config, policy: AdaptivePolicy, route: Route,
               stream, tag: int, posted=()) -> TransferStats | None:
    """Offers the CUDA route for tensors on one GPU (eagerly where the peer granted a standing
    go-ahead: the header then says so). Returns the stats, or None if the peer refused (the
    caller goes on with the next step of the same transfer). `posted`: the header's and the
    manifest's sends, in flight; awaited here, after the offer is posted behind them. `tag`:
    the payload's (protocol.payload_tag)."""
    dev = next(f.device for f in flats if f.numel()).index
    stream = _stream_for(stream, dev)
    total = sum(e.nbytes for e in entries)
    messages = proto.plan_cuda_messages(entries)
    eager = route.standing
    digests = None
    if config.ipc_checksum:
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            digests = tuple(cuda_ipc.digest(f) if f.numel() else 0 for f in flats)
    # The offer goes first: the receiver's checks overlap this side's preparation.
    offered = channel.send(proto.CudaRouteOffer(cuda_ipc.host_id(), digests).pack(len(entries)))
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        # detach: UCX takes the buffers through __cuda_array_interface__, which torch refuses
        # for tensors that require grad (model parameters). Batches are gathered on the
        # caller's stream, after its writes.
        flats = [f.detach() for f in flats]
        bufs = _bufs(flats, messages, make_batch=lambda m: torch.cat([flats[i] for i in m]))
        ready = torch.cuda.Event()
        ready.record(stream)
    for sent in (*posted, offered):
        await sent
    await cuda_ipc.wait_event(ready, config.deadline_s, "CUDA route: the caller's writes")
    if not eager:
        status, detail = await _reply(channel)
        if status == proto.ACK_IPC_REFUSED:
            if detail == proto.ACK_REFUSED_FOR_GOOD:
                route.refused = True
                logger.info("peer refused the CUDA route for good; this endpoint will not offer it again")
            return None
        _raise_for(status)
        route.standing = detail == proto.ACK_STANDING
    t0 = time.perf_counter()
    await _payload(channel, bufs, tag)
    if total >= MIN_LINK_SAMPLE:
        policy.observe_link(total, time.perf_counter() - t0)
    if policy.mode == "on":  # only without a GPU codec: the caller compresses otherwise
        decision = Decision(False, "forced on, but no GPU codec here", total, None, None, None, None)
    else:
        decision = policy.decide(total, None)
    stats = TransferStats(raw_bytes=total, wire_bytes=total, chunks=len(messages), path="ucx_cuda",
                          decisions=[decision])
    logger.debug("CUDA route%s: %d tensors, %.1f MB in %d messages (%s)", " (eager)" if eager else "",
                 len(entries), total / 1e6, len(messages), decision.reason)
    return stats


async def _payload(channel, bufs, tag) -> None:
    """Sends the payload and takes the final ACK. The ACK's receive is posted with the payload:
    a receiver that failed before taking it (say, an `into` that does not fit) is heard at
    once, not after a deadline of payload sends that nobody will match."""
    sending = asyncio.ensure_future(channel.send_many(bufs, tag))
    reply = asyncio.ensure_future(_reply(channel))
    try:
        await asyncio.wait((sending, reply), return_when=asyncio.FIRST_COMPLETED)
        if reply.done():
            _raise_for(reply.result()[0])
        await sending
        _raise_for((await reply)[0])
    finally:
        cancel_quietly((sending, reply))


async def _reply(channel) -> tuple[int, int]:
    buf = bytearray(proto.ACK.size)
    await channel.recv(buf)
    return proto.ACK.unpack(buf)


# ---- receiver -----------------------------------------------------------------------------

def _one_gpu(entries, into, device) -> torch.device | None:
    """The GPU every destination tensor is (or will be) on, or None."""
    if into is not None:
        devices = {into[e.name].device for e in entries if e.nbytes}
    else:
        devices = {torch.device(device) if device is not None else torch.device("cpu")}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return None
    dest = next(iter(devices))
    return dest if dest.index is not None else torch.device("cuda", torch.cuda.current_device())


def _refusal(offer, route, config, relaying: bool, on_one_gpu: bool) -> tuple[str | None, bool]:
    """(why the route is refused, whether no later transfer of this endpoint can take it
    either), or (None, _) to take it."""
    if route is None or config.cuda_ucx == "off":
        return "the CUDA route is off here, or UCX here lacks the CUDA transports (UCX_TLS)", True
    if offer.host_id != cuda_ipc.host_id():
        return "another host: the chunk stream can compress", True
    if relaying:
        return "this receiver relays: downstream peers get the chunk stream", False
    if not on_one_gpu:
        return "the destination is not on one GPU", False
    return None, False


async def recv(channel: BulkChannel, entries, *, config, route: Route | None, relaying: bool, into, stream,
               device, tag: int, eager: bool = False, prepost: "PrePost | None" = None):
    """Takes (or refuses) the CUDA route. Returns (tensors, stats), or None after refusing.
    `eager` (FLAG_CUDA_UCX_EAGER): the payload is already coming; it is taken whatever the
    destination, through a GPU buffer if that is not on one GPU (a relaying caller forwards
    the received tensors afterwards). `tag`: the payload's; `prepost`: receives posted for
    this transfer before its header arrived, used if they are the ones it needs."""
    buf = bytearray(proto.CudaRouteOffer.nbytes(len(entries)))
    await channel.recv(buf)
    offer = proto.CudaRouteOffer.unpack(buf, len(entries))
    dest = _one_gpu(entries, into, device)
    # An eager payload can be staged (any destination) and forwarded afterwards (relaying).
    why, for_good = _refusal(offer, route, config, relaying=relaying and not eager,
                             on_one_gpu=eager or dest is not None)
    if eager and why is not None:
        raise ProtocolError(f"an eager CUDA route payload this side never agreed to take: {why}")
    if why is not None:
        logger.info("CUDA route refused: %s", why)
        await channel.send(proto.ACK.pack(proto.ACK_IPC_REFUSED, proto.ACK_REFUSED_FOR_GOOD if for_good else 0))
        return None
    if not eager:
        # The go-ahead leaves before the destination is prepared, so that this side's work
        # overlaps the sender's: UCX moves no byte into our memory before a receive is
        # posted for it (a rendezvous waits in UCX's queue; an eager message is copied out
        # of UCX's buffer when the receive is posted). It stands for later transfers: this
        # side can take any of them (staging through its GPU where it must).
        await channel.send(proto.ACK.pack(proto.ACK_OK, proto.ACK_STANDING))
        route.granted = True
    if prepost is not None and prepost.tag == tag and prepost.into is into:
        state = await prepost.adopt()
        await channel.wait_many(state.futs, "recv")
    else:
        state = _prepare(entries, dest, into=into, stream=stream, device=device)
        # UCX writes outside the caller's stream: work queued there on these tensors (or on
        # the memory the allocator just handed out) must be done first.
        await cuda_ipc.wait_event(state.ready, config.deadline_s, "CUDA route: earlier work on the destination")
        await channel.recv_many(state.bufs, tag)
    return _finish(state, offer)


class _Receive:
    """One route transfer's destination on the receiving side."""

    def __init__(self, entries, outputs, flats, bufs, messages, staged, gpu, stream, ready):
        self.entries, self.outputs, self.flats, self.bufs = entries, outputs, flats, bufs
        self.messages, self.staged, self.gpu, self.stream, self.ready = messages, staged, gpu, stream, ready
        self.futs: list[asyncio.Future] = []


def _prepare(entries, dest, *, into, stream, device) -> _Receive:
    # staged: the destination is not on one GPU (host memory, several GPUs), so every message
    # lands in a buffer on this process's current GPU and is copied on from there.
    staged = dest is None
    gpu = dest if not staged else torch.device("cuda", torch.cuda.current_device())
    stream = _stream_for(stream, gpu.index)
    messages = proto.plan_cuda_messages(entries)
    with torch.cuda.device(gpu), torch.cuda.stream(stream):
        if into is not None:
            outputs = {e.name: into[e.name] for e in entries}
        else:
            home = gpu if not staged else (torch.device(device) if device is not None else torch.device("cpu"))
            outputs = {e.name: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=home) for e in entries}
        flats = [_flat_bytes(outputs[e.name].detach()) for e in entries]
        bufs = [flats[m[0]] if len(m) == 1 and not staged else
                torch.empty(sum(entries[i].nbytes for i in m), dtype=torch.uint8, device=gpu) for m in messages]
        ready = torch.cuda.Event()
        ready.record(stream)
    return _Receive(entries, outputs, flats, bufs, messages, staged, gpu, stream, ready)


def _finish(st: _Receive, offer):
    entries = st.entries
    with torch.cuda.device(st.gpu), torch.cuda.stream(st.stream):
        for m, b in zip(st.messages, st.bufs):
            if len(m) == 1 and not st.staged:
                continue
            at = 0  # scatter a batch (or a staged message) into its tensors, on the caller's stream
            for i in m:
                # into host memory: a blocking copy, so the tensors are whole when returned
                st.flats[i].copy_(b[at:at + entries[i].nbytes], non_blocking=st.flats[i].is_cuda)
                at += entries[i].nbytes
        if offer.digests is not None:
            for i, e in enumerate(entries):
                if e.nbytes and cuda_ipc.digest(st.flats[i]) != offer.digests[i]:
                    raise ChecksumError(f"tensor {e.name!r}: CUDA route digest mismatch")
    total = sum(e.nbytes for e in entries)
    path = "ucx_cuda" if not st.staged else "ucx_cuda_staged"
    return st.outputs, TransferStats(raw_bytes=total, wire_bytes=total, chunks=len(st.messages), path=path,
                                     preposted=bool(st.futs))


class PrePost:
    """The receives of the next transfer, posted before its header arrives.

    On an endpoint whose peer sends eagerly (this side granted a standing go-ahead), a
    caller receiving `into` tensors with the layout of the last route transfer most likely
    gets that layout again (weights into the same buffers, activations of a fixed shape).
    Their receives are posted at once, on the tag that transfer will carry if it has this
    layout and the next transfer id, so UCX starts the copy as soon as the payload arrives
    instead of after this side has parsed the header, the manifest and the offer (that
    chain was the critical path: docs/gpu_p2p.md). Any other transfer carries another tag
    and never touches them; they are then abandoned, and stay posted in UCX (which cannot
    take a receive back) until the endpoint closes."""

    def __init__(self, channel, entries, dest, into, tag: int, stream, deadline_s: float):
        self.into, self.tag = into, tag
        self._adopted = False
        self._task = asyncio.ensure_future(self._post(channel, entries, dest, into, stream, deadline_s))

    async def _post(self, channel, entries, dest, into, stream, deadline_s) -> _Receive:
        state = _prepare(entries, dest, into=into, stream=stream, device=None)
        await cuda_ipc.wait_event(state.ready, deadline_s, "CUDA route: earlier work on the destination")
        state.futs = channel.post_recvs(state.bufs, self.tag)
        return state

    @classmethod
    def start(cls, channel, route: Route | None, into, stream, deadline_s: float) -> "PrePost | None":
        """A PrePost if this receive is likely the repeat of the last route transfer, else None."""
        # (last_manifest is set only together with last_id, by Route.note_header)
        if route is None or not route.granted or route.last_manifest is None or not into:
            return None
        if not all(t.is_cuda and t.is_contiguous() for t in into.values()):
            return None
        entries = entries_of(into.items())
        manifest = proto.encode_manifest(entries)
        dest = _one_gpu(entries, into, None)
        if manifest != route.last_manifest or dest is None:
            return None
        return cls(channel, entries, dest, into, proto.payload_tag(route.last_id + 1, manifest), stream, deadline_s)

    async def adopt(self) -> _Receive:
        self._adopted = True
        return await self._task

    def abandon(self) -> None:
        """Unless adopted: stop posting; receives already posted stay in UCX, unmatched."""
        if self._adopted:
            return
        if self._task.done() and not self._task.cancelled() and self._task.exception() is None:
            cancel_quietly(self._task.result().futs)
        cancel_quietly([self._task])
