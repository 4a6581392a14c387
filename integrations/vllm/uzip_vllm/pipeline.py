"""Compressed pipeline-parallel activation transfer inside vLLM (`--comm-plugin uzip`).

Patch point (vLLM 0.32): `GroupCoordinator.isend_tensor_dict` and `irecv_tensor_dict` of the
*PP group only*. Every stage-to-stage transfer of `IntermediateTensors` ends there:
`Worker.execute_model` (also the CPU worker's) calls `irecv_tensor_dict(all_gather_group=tp)`
before the forward and `isend_tensor_dict(output.tensors, all_gather_group=tp)` after it, and
the blocking `send_tensor_dict` / `recv_tensor_dict` (the model runner's rare path) call the
two. Below them vLLM uses, on CPU, `CpuCommunicator.send_tensor_dict` (the shared-memory
`shm_send_tensor_list`, keys and shapes pickled) and elsewhere one `torch.distributed.isend`
per tensor after a pickled metadata object on the gloo group.

With the patch, a transfer from stage r to stage r+1 goes through one `uzip_serve.p2p`
endpoint per neighbour pair: split-send (chunk k+1 compressed while chunk k is on the wire)
and the per-link adaptive compress-vs-raw policy. Keys, shapes and dtypes travel in the
p2p manifest (a binary header); nothing is pickled. The methods are bound on the one group
object, outside any torch.compile region (the worker calls them between forwards), so no
custom op is needed. Anything the endpoints do not cover (non-tensor values, another
source or destination than the neighbour stage) falls back to vLLM's own methods.

TP inside a stage: vLLM's all-gather trick is kept. Each TP rank sends 1/tp of every
replicated tensor (its rows; the name is suffixed `@rows<tp>` in the manifest) and the
receiving TP rank all-gathers the rows over its TP group. Tensors whose first dimension
does not divide go whole.

Sends are asynchronous: `isend_tensor_dict` returns at once with a handle that the worker
waits for at the top of its next step (as with vLLM's own handles), so the transfer and
compression overlap the rest of the step. Transfers on one endpoint never overlap.

Settings: `UZIP_PP_COMPRESSION` = auto (default; the adaptive policy) | on | off;
`UZIP_PP_CHUNK_BYTES` (default 1 MiB: activations are MBs, small chunks keep the codec
and the wire overlapped); `UZIP_PP_DEADLINE_S` (default 600: a receiving stage waits for
the previous stage's whole forward); `UZIP_PP_HOST` (the address this worker advertises to
its neighbour on another host; default vLLM's `get_ip()`); `UZIP_PP=off` leaves vLLM's path.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import socket
import threading
from typing import Any

import torch

logger = logging.getLogger("uzip_vllm")

ROWS_SUFFIX = "@rows"
DEFAULT_CHUNK_BYTES = 1 << 20


@dataclasses.dataclass
class Counters:
    """What this worker's patched PP path carried, since start. One side of each link."""

    sends: int = 0  # transfers sent on the uzip path
    recvs: int = 0  # transfers received on the uzip path
    tensors: int = 0  # activation tensors sent or received on the uzip path
    compressed_tensors: int = 0  # ...of which travelled in at least one compressed chunk
    compressed_transfers: int = 0  # transfers with at least one compressed chunk
    raw_bytes: int = 0  # activation bytes carried (uncompressed size)
    wire_bytes: int = 0  # bytes they took on the wire
    chunks: int = 0
    chunks_compressed: int = 0
    seconds: float = 0.0  # wall time inside transfers (send: until the peer's ack)
    fallbacks: int = 0  # calls left to vLLM's own path

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ratio"] = self.wire_bytes / self.raw_bytes if self.raw_bytes else 1.0
        return d


_counters = Counters()
_lock = threading.Lock()
_installed: dict[str, "PipelineLink"] = {}


def counters() -> dict[str, Any]:
    """This worker's PP counters (all zero where nothing was installed)."""
    with _lock:
        return _counters.as_dict()


def worker_counters(worker=None) -> dict[str, Any]:
    """For `LLM.collective_rpc(worker_counters)`: the callable form takes the worker."""
    return counters()


def _record(stats, n_tensors: int, *, sent: bool) -> None:
    with _lock:
        c = _counters
        if sent:
            c.sends += 1
        else:
            c.recvs += 1
        c.tensors += n_tensors
        c.raw_bytes += stats.raw_bytes
        c.wire_bytes += stats.wire_bytes
        c.chunks += stats.chunks
        c.chunks_compressed += stats.chunks_compressed
        c.seconds += stats.seconds
        if stats.chunks_compressed:
            c.compressed_transfers += 1
            c.compressed_tensors += n_tensors


class _Done:
    """A handle that is already complete (stands where vLLM expects its metadata handle)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _SendHandle:
    """vLLM's `Handle` protocol (wait / is_completed) over a send running on the UCX loop.
    Counted when it completes, whether or not anyone waits for it."""

    def __init__(self, fut: concurrent.futures.Future, n_tensors: int):
        self._fut = fut
        fut.add_done_callback(lambda f: f.exception() is None and _record(f.result(), n_tensors, sent=True))

    def is_completed(self) -> bool:
        return self._fut.done()

    def wait(self, timeout=None) -> bool:
        self._fut.result(timeout)  # raises the transfer's error in the worker
        return True


def _row_split(tensor_dict, all_gather_group, all_gather_tensors, should_use) -> tuple[dict, bool]:
    """(named tensors to send, all tensors?) applying vLLM's all-gather trick by rows."""
    out = {}
    ag = 1 if all_gather_group is None else all_gather_group.world_size
    rank = 0 if all_gather_group is None else all_gather_group.rank_in_group
    for key, t in tensor_dict.items():
        if not isinstance(t, torch.Tensor):
            return {}, False
        if ROWS_SUFFIX in key:
            return {}, False
        if ag > 1 and t.dim() > 0 and t.shape[0] % ag == 0 and t.numel() and \
                should_use(key, t.numel(), all_gather_group, all_gather_tensors):
            rows = t.shape[0] // ag
            out[f"{key}{ROWS_SUFFIX}{ag}"] = t[rank * rows:(rank + 1) * rows].contiguous()
        else:
            out[key] = t.contiguous()
    return out, True


class PipelineLink:
    """The endpoints of one PP group coordinator: to the next stage and from the previous.

    Built by `install_on_pp_group`, collectively over the PP group (every stage calls it)."""

    def __init__(self, pp, config, host: str):
        from uzip_serve import p2p

        self.pp = pp
        self.config = config
        rank, world = pp.rank_in_group, pp.world_size
        listener = p2p.SyncListener(0, config) if rank > 0 else None
        me = (socket.gethostname(), host, listener.port if listener else 0)
        peers: list = [None] * world
        torch.distributed.all_gather_object(peers, me, group=pp.cpu_group)
        self.next_ep = self.prev_ep = None
        # Each stage connects forward, then accepts from behind: stage 0 connects first, so no cycle.
        if rank + 1 < world:
            hostname, addr, port = peers[rank + 1]
            self.next_ep = p2p.connect_sync("127.0.0.1" if hostname == me[0] else addr, port, config)
            self.next_ep.send_bytes(rank.to_bytes(4, "little"))  # the accept side learns who connected
        if listener is not None:
            self.prev_ep = listener.accept(timeout=config.deadline_s)
            who = int.from_bytes(self.prev_ep.recv_bytes(16), "little")
            if who != rank - 1:
                raise RuntimeError(f"PP stage {rank} expected stage {rank - 1} to connect, got {who}")
            listener.close()
        self._pending: _SendHandle | None = None
        self.device = pp.device if pp.device is not None else torch.device("cpu")

    def isend(self, orig, tensor_dict, dst=None, all_gather_group=None, all_gather_tensors=None):
        pp = self.pp
        nxt = (pp.rank_in_group + 1) % pp.world_size
        if pp.world_size <= 1:
            return []
        if self.next_ep is None or (dst is not None and dst != nxt):
            return self._fallback(orig, tensor_dict, dst=dst, all_gather_group=all_gather_group,
                                  all_gather_tensors=all_gather_tensors)
        named, ok = _row_split(tensor_dict, all_gather_group, all_gather_tensors, pp._should_use_all_gather)
        if not ok:
            return self._fallback(orig, tensor_dict, dst=dst, all_gather_group=all_gather_group,
                                  all_gather_tensors=all_gather_tensors)
        if self._pending is not None:  # one transfer at a time on an endpoint
            self._pending.wait()
            self._pending = None
        from uzip_serve.p2p import cuda_ipc
        from uzip_serve.p2p.loop import ucx_loop
        import asyncio

        ep = self.next_ep._ep
        stream = cuda_ipc.caller_stream()  # taken here: the current stream is thread-local
        fut = asyncio.run_coroutine_threadsafe(ep.send_tensors(named, stream=stream), ucx_loop())
        handle = _SendHandle(fut, len(named))
        self._pending = handle
        return [_Done(), handle]

    def irecv(self, orig, src=None, all_gather_group=None, all_gather_tensors=None):
        pp = self.pp
        prev = (pp.rank_in_group - 1) % pp.world_size
        if pp.world_size <= 1:
            return None, [], []
        if self.prev_ep is None or (src is not None and src != prev):
            return self._fallback(orig, src=src, all_gather_group=all_gather_group,
                                  all_gather_tensors=all_gather_tensors)
        got = self.prev_ep.recv_tensors(device=self.device)
        _record(self.prev_ep.last_stats, len(got), sent=False)
        out: dict[str, torch.Tensor] = {}
        for name, t in got.items():
            key, sep, ag = name.rpartition(ROWS_SUFFIX)
            if sep and ag.isdigit():
                if all_gather_group is None or all_gather_group.world_size != int(ag):
                    raise RuntimeError(f"PP: {name!r} was split for {ag} TP ranks, this stage has "
                                       f"{getattr(all_gather_group, 'world_size', 1)}")
                out[key] = all_gather_group.all_gather(t, dim=0)
            else:
                out[name] = t
        return out, [], []

    def _fallback(self, orig, *args, **kwargs):
        with _lock:
            _counters.fallbacks += 1
        return orig(*args, **kwargs)

    def close(self) -> None:
        for ep in (self.next_ep, self.prev_ep):
            if ep is not None:
                ep.abort()


def _transport_config():
    from uzip_serve.p2p import TransportConfig

    return TransportConfig.from_env(
        compression=os.environ.get("UZIP_PP_COMPRESSION", "auto"),
        chunk_bytes=int(os.environ.get("UZIP_PP_CHUNK_BYTES", DEFAULT_CHUNK_BYTES)),
        deadline_s=float(os.environ.get("UZIP_PP_DEADLINE_S", 600)),
    )


def install_on_pp_group(cfg: dict | None = None) -> bool:
    """Called on every worker after its process groups exist (collective over the PP group:
    the stages exchange listener addresses and connect). Returns whether the patch is in place."""
    from vllm.distributed.parallel_state import get_pp_group

    from vllm.v1.worker.worker_base import WorkerBase

    # `collective_rpc("uzip_pipeline_counters")`: the server's /uzip/pipeline route, or vLLM's dev-mode
    # /collective_rpc route. On every worker with the plugin on (all zeros where nothing is installed).
    WorkerBase.uzip_pipeline_counters = worker_counters
    pp = get_pp_group()
    if pp.world_size == 1 or os.environ.get("UZIP_PP", "on").lower() in ("off", "0", "never"):
        return False
    host = os.environ.get("UZIP_PP_HOST")
    if not host:
        from vllm.utils.network_utils import get_ip

        host = get_ip()
    config = _transport_config()
    link = PipelineLink(pp, config, host)
    orig_send, orig_recv = pp.isend_tensor_dict, pp.irecv_tensor_dict

    def isend_tensor_dict(tensor_dict, dst=None, all_gather_group=None, all_gather_tensors=None):
        return link.isend(orig_send, tensor_dict, dst, all_gather_group, all_gather_tensors)

    def irecv_tensor_dict(src=None, all_gather_group=None, all_gather_tensors=None):
        return link.irecv(orig_recv, src, all_gather_group, all_gather_tensors)

    pp.isend_tensor_dict = isend_tensor_dict
    pp.irecv_tensor_dict = irecv_tensor_dict
    _installed[pp.unique_name] = link
    logger.info("uzip: PP send/recv of %s (stage %d of %d) goes through uzip_serve.p2p, compression %s, "
                "chunks of %d bytes", pp.unique_name, pp.rank_in_group, pp.world_size, config.compression,
                config.chunk_bytes)
    return True
