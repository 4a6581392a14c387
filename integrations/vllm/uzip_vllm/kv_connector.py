"""`UzipConnector`: vLLM KV-cache transfer for disaggregated prefill/decode over uzip_serve.p2p.

    vllm serve M --kv-transfer-config '{"kv_connector":"UzipConnector","kv_role":"kv_producer",
        "kv_connector_extra_config":{"peer":"DECODE_HOST:PORT"}}'            # prefill
    vllm serve M --kv-transfer-config '{"kv_connector":"UzipConnector","kv_role":"kv_consumer",
        "kv_connector_extra_config":{"listen":"0.0.0.0:PORT"}}'              # decode

A request takes part when its `kv_transfer_params` carry `{"uzip": {"xfer_id": "<32 hex>"}}`;
the proxy (`uzip_vllm.disagg`) sends the same id to both instances at once. Design, hooks,
failure policy and measurements: docs/kv_connector.md.

How KV moves (push, layer by layer):
- prefill, worker side: in the step that finishes a request's prompt, `save_kv_layer` copies
  that layer's blocks of the request (`index_select`, so the blocks may be freed at once) and
  hands them to a sender thread, which sends them to the decode worker of the same TP rank
  while the forward computes the next layers, over a connection kept open between requests
  (no connect and no answered hello per request). The split-send pipeline compresses each
  chunk (auto / on / off);
- decode, worker side: a listener thread receives each transfer (a store entry keyed by xfer
  id); the scheduler admits the request with an asynchronous load of the first `prompt - 1`
  tokens; each layer is written into the paged cache as soon as it is decoded (or, if it came
  before the load was registered, by the engine's step at the end), and `get_transfer_results`
  reports the request finished receiving once all have arrived. The last prompt token is
  computed locally, which produces the first token's logits.

Nothing from the network is unpickled: control messages are fixed structs, tensors come
through the p2p wire protocol (manifest + checksummed chunks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from uzip_vllm.kv_wire import (
    HELLO,
    KIND_PROBE,
    KIND_SESSION,
    KIND_TRANSFER,
    REPLY_WINDOW_TRIM,
    XFER_ID,
    Hello,
    dtype_code,
    pack_reply,
    unpack_reply,
    window_first_block,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("uzip_vllm.kv_connector")

CONNECTOR_NAME = "UzipConnector"
PARAMS_KEY = "uzip"

# ---- settings -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class UzipKVConfig:
    """`kv_connector_extra_config`, parsed once (`parse_config`)."""
    peer: str | None = None          # producer: decode's kv listener HOST:PORT (rank r uses PORT + r)
    listen: str = "127.0.0.1:0"      # consumer: HOST:PORT to bind (rank r binds PORT + r)
    compression: str = "auto"        # p2p TransportConfig.compression: auto | on | off
    progress_mode: str = "thread"    # ucxx progress: thread (does not spin while idle) | thread-polling
    chunk_bytes: int = 1 << 20       # small: a layer is a few MB, so chunks pipeline within it
    deadline_s: float = 10.0         # every p2p send/receive must progress within it
    load_timeout_s: float = 30.0     # decode: a load not complete by then fails (policy applies)
    startup_timeout_s: float = 300.0 # producer: how long start-up waits for the decode listener
    stats_dir: str | None = None     # where each worker writes its counters (JSON) for the proxy
    # Tests only: while this file exists the sender sends one layer per batch and holds every
    # layer after the first, so a test can kill the prefill instance mid-transfer (the hello and
    # one layer on the decode side) without racing a timer (a timed delay was flaky on CI).
    test_hold_file: str | None = None
    # Send a sliding-window layer's KV only from where its window starts (Gemma-3: 15 of 18 layers
    # keep 512 tokens; 3.7x fewer bytes at 4096 tokens). Used when the decode side allows it,
    # which it does with prefix caching off (REPLY_WINDOW_TRIM); `uzip disagg up` starts it so.
    window_trim: bool = True
    # Tests only: the decode side fills the blocks a trimmed layer did not send with NaN, so a
    # kernel that read them would show in the output.
    test_poison_untransferred: bool = False
    # False: the sender starts only once the forward is done (wait_for_save), so the whole
    # transfer lies on the TTFT path. For measuring what the transfer costs TTFT (uzip bench
    # disagg --no-overlap); serving keeps the default, which sends layers as they are computed.
    overlap: bool = True
    # Decode: how long a step that schedules nothing waits for a pending transfer to arrive (an
    # arrival ends the wait at once). While requests wait for KV the engine steps in a loop; a
    # longer wait takes that loop off the cores the receiver and its codec threads need. Steps
    # with a forward wait 1 ms at most, so running requests are not held up.
    idle_wait_ms: float = 10.0
    # Chunks go as UCX eager messages (TransportConfig.eager_bytes = the largest chunk on the
    # wire), not rendezvous: over TCP each rendezvous left the link idle for a round trip and
    # two thread wake-ups per chunk, which with both instances on 2 cores cost the compressed
    # path most (docs/kv_connector.md). A request's KV is bounded, so what a late receiver
    # buffers is too.
    ucx_eager: bool = True

    @property
    def peer_host_port(self) -> tuple[str, int]:
        host, _, port = (self.peer or "").rpartition(":")
        return host, int(port)

    def transport(self):
        """The p2p TransportConfig of the connector's connections (UZIP_P2P_* env vars apply first)."""
        from uzip_serve import format as fmt
        from uzip_serve.p2p import TransportConfig

        eager = fmt.max_compressed_size(self.chunk_bytes, "uint8") if self.ucx_eager else 0
        return TransportConfig.from_env(compression=self.compression, progress_mode=self.progress_mode,
                                        chunk_bytes=self.chunk_bytes, deadline_s=self.deadline_s, cuda_ipc="off",
                                        eager_bytes=eager)


def parse_config(extra: dict[str, Any], role: str | None) -> UzipKVConfig:
    fields = {f.name: f for f in dataclasses.fields(UzipKVConfig)}
    unknown = sorted(set(extra) - set(fields))
    if unknown:
        raise ValueError(f"UzipConnector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(fields)}")
    kwargs = {}
    for key, value in extra.items():
        want = type(UzipKVConfig.__dataclass_fields__[key].default)
        if want is bool and not isinstance(value, bool):  # bool("false") would be True
            if str(value).lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"UzipConnector: kv_connector_extra_config[{key!r}]={value!r}: not a boolean")
            value = str(value).lower() in ("true", "1")
        try:
            kwargs[key] = value if value is None or want in (type(None), str) else want(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"UzipConnector: kv_connector_extra_config[{key!r}]={value!r}: {e}") from None
    cfg = UzipKVConfig(**kwargs)
    if cfg.compression not in ("auto", "on", "off"):
        raise ValueError(f"UzipConnector: compression must be auto/on/off, got {cfg.compression!r}")
    # In "blocking" and "polling" UCX is progressed by awaits on an event loop; inside a vLLM worker
    # the listener's handshakes then timed out and no transfer arrived (measured 2026-12-07).
    if cfg.progress_mode not in ("thread", "thread-polling"):
        raise ValueError(f"UzipConnector: progress_mode must be thread or thread-polling (UCX progressed by its "
                         f"own thread inside vLLM's workers), got {cfg.progress_mode!r}")
    if role == "kv_producer":
        if not cfg.peer or ":" not in cfg.peer:
            raise ValueError("UzipConnector (kv_producer) needs kv_connector_extra_config.peer = 'DECODE_HOST:PORT'")
        cfg.peer_host_port  # noqa: B018 - validates the port
    elif role != "kv_consumer":
        raise ValueError(f"UzipConnector supports kv_role kv_producer or kv_consumer, not {role!r}")
    return cfg


def _params(request: "Request") -> dict:
    params = getattr(request, "kv_transfer_params", None) or {}
    entry = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    return entry if isinstance(entry, dict) else {}


def xfer_id_of(request: "Request") -> str | None:
    xfer = _params(request).get("xfer_id")
    return xfer if isinstance(xfer, str) and XFER_ID.match(xfer) else None


def compression_of(request: "Request") -> str | None:
    """A per-request override of the sender's compression (auto/on/off), e.g. for A/B runs."""
    c = _params(request).get("compression")
    return c if c in ("auto", "on", "off") else None


# ---- metadata (scheduler -> worker; lives in-process or is serialized by vLLM) -------------------

@dataclasses.dataclass
class SaveSpec:
    req_id: str
    xfer_id: str
    block_ids: list[int]   # the request's first ceil(num_tokens / block_size) blocks
    num_tokens: int
    compression: str | None = None  # overrides the configured compression for this transfer


@dataclasses.dataclass
class LoadSpec:
    req_id: str
    xfer_id: str
    block_ids: list[int]   # destination blocks, by position in the request's block table
    first_pos: int         # positions before it are local prefix-cache hits: not overwritten
    num_tokens: int


@dataclasses.dataclass
class UzipConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)
    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    idle: bool = False  # the step schedules no tokens: no forward, nobody waits on it


# ---- worker-side helpers ---------------------------------------------------------------------------

class _Stats:
    """Counters and recent per-transfer timings of one worker, written to `stats_dir` as JSON.

    A writer thread writes the file, a few ms after a burst of updates: the notes made in the
    engine's step (a load requested, a load injected) must not wait for a JSON dump of up to
    500 transfers, which takes 1-3 ms here and held up every running request's step."""

    MAX_XFERS = 500
    COALESCE_S = 0.005

    def __init__(self, path: str | None):
        self._path = path
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self.counters: dict[str, float] = {}
        self.xfers: dict[str, dict[str, Any]] = {}
        self._dirty = threading.Event()
        if path:
            threading.Thread(target=self._write_loop, name="uzip-kv-stats", daemon=True).start()

    def add(self, **inc: float) -> None:
        with self._lock:
            for k, v in inc.items():
                self.counters[k] = self.counters.get(k, 0) + v
        self._dirty.set()

    def note(self, xfer_id: str, **fields: Any) -> None:
        with self._lock:
            self.xfers.setdefault(xfer_id, {}).update(fields)
            while len(self.xfers) > self.MAX_XFERS:
                self.xfers.pop(next(iter(self.xfers)))
        self._dirty.set()

    def _write_loop(self) -> None:
        while True:
            self._dirty.wait()
            time.sleep(self.COALESCE_S)  # one write for the notes of one step or one transfer
            self._dirty.clear()
            try:
                self.flush()
            except OSError as e:  # the stats dir went away: counters stay in memory
                logger.warning("UzipConnector: writing %s failed: %s", self._path, e)

    def flush(self) -> None:
        """Writes the file now (start-up and shutdown; the writer thread otherwise)."""
        if not self._path:
            return
        with self._write_lock:  # a later snapshot is never overwritten by an earlier one
            with self._lock:  # copies, so the dump runs outside the lock the notes take
                counters = dict(self.counters)
                xfers = {k: dict(v) for k, v in self.xfers.items()}
            data = json.dumps({"counters": counters, "xfers": xfers, "pid": os.getpid(), "time": time.time()})
            tmp = f"{self._path}.tmp"
            with open(tmp, "w") as f:
                f.write(data)
            os.replace(tmp, self._path)


@dataclasses.dataclass
class _Incoming:
    """One transfer on the decode worker. Each layer is written into the paged cache as it
    arrives once the request's load is registered (`spec`); until then it waits in `layers`,
    and the engine's step writes those at the end. `lock` orders a receiver thread's write
    against the step that gives the load up (timed out, failed): after that, vLLM may hand
    the blocks to another request, so nothing is written any more (`abandoned`)."""
    hello: Hello
    t_begin: float
    layers: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    done: bool = False
    error: str | None = None
    t_done: float = 0.0
    raw_bytes: int = 0
    wire_bytes: int = 0
    spec: LoadSpec | None = None
    written: set[int] = dataclasses.field(default_factory=set)
    abandoned: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class _Outgoing:
    """Layers of one transfer waiting for the sender thread (prefill worker)."""

    def __init__(self, spec: SaveSpec):
        self.spec = spec
        self.q: queue.Queue = queue.Queue()
        self.t_first = time.time()


_END = object()


class _Links:
    """The prefill worker's open connections to its decode peer, kept between transfers so that
    a request pays neither a connect nor a hello round trip. A transfer takes an idle one and puts
    it back once its last layer was acknowledged; concurrent transfers each hold their own, so
    there are at most as many as sender threads. Kept per compression mode: a connection's
    transport config and adaptive policy are fixed when it opens."""

    def __init__(self):
        self._idle: dict[str, list] = {}  # compression mode -> idle SyncEndpoints
        self._lock = threading.Lock()
        self._closed = False

    def take(self, mode: str):
        with self._lock:
            idle = self._idle.get(mode)
            return idle.pop() if idle else None

    def put(self, mode: str, ep) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(mode, []).append(ep)
                return
        ep.abort()  # closed meanwhile (shutdown)

    def close(self) -> None:
        """Closes the idle connections (nothing in flight on them); ones in use close when
        their transfer ends."""
        with self._lock:
            self._closed = True
            eps = [ep for idle in self._idle.values() for ep in idle]
            self._idle.clear()
        for ep in eps:
            ep.abort()


def _instance_cpus() -> set[int] | None:
    """The CPUs the connector's threads should run on, or None where affinity is not a thing.

    vLLM's CPU worker binds each OpenMP thread to one core, its main thread (the OpenMP master)
    included, and threads inherit the affinity of the thread that starts them. Left alone, every
    sender, receiver, UCX progress and codec thread of both instances shared core 0 with two
    busy OpenMP masters. The engine process that spawned the worker keeps the instance's set."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = os.sched_getaffinity(0)
    with contextlib.suppress(OSError):
        cpus = cpus | os.sched_getaffinity(os.getppid())
    return cpus


def _unpin_this_thread() -> None:
    cpus = _instance_cpus()
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def _threads_start_unpinned():
    """Threads started inside (the connector's, and UCX's progress and notifier threads when
    UCX starts here) run on the instance's CPUs; the calling thread gets its own set back."""
    cpus = _instance_cpus()
    before = os.sched_getaffinity(0) if cpus else None
    if not cpus or cpus == before:
        yield
        return
    os.sched_setaffinity(0, cpus)
    logger.info("UzipConnector: its threads run on CPUs %s (this worker's main thread is pinned to %s)",
                sorted(cpus), sorted(before))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _copy_blocks(kv: torch.Tensor, ids: list[int], blocks: torch.Tensor) -> None:
    """kv[ids[j]] = blocks[j]. On the CPU through numpy, on the calling thread alone: torch's
    index_copy_ on a receiver thread started an OpenMP team of its own there, whose threads
    spin for milliseconds after each copy on the cores the transfer needs."""
    if kv.is_cuda:
        kv.index_copy_(0, torch.tensor(ids, dtype=torch.long, device=kv.device), blocks.to(kv.device))
        return
    dst = kv.view(kv.shape[0], -1).view(torch.uint8).numpy()
    dst[ids] = blocks.reshape(len(ids), -1).view(torch.uint8).numpy()


def _tp() -> tuple[int, int]:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()


# ---- the connector ---------------------------------------------------------------------------------

def _layer_windows(vllm_config: "VllmConfig", layer_names: list[str]) -> list[int | None]:
    """Each KV layer's sliding window (None: full attention, or a layer not found). Read from the
    attention layers themselves: with the hybrid KV cache manager off (always, on CPU, and with
    connectors that lack HMA support) the cache spec merges windowed and global layers."""
    layers = vllm_config.compilation_config.static_forward_context
    out = []
    for name in layer_names:
        w = getattr(layers.get(name), "sliding_window", None)
        out.append(w if isinstance(w, int) and w > 0 else None)
    return out


class UzipConnector(KVConnectorBase_V1):
    """KV hand-off from a prefill instance (kv_producer) to a decode instance (kv_consumer).

    Scheduler side (EngineCore process): decides which requests send or load and when.
    Worker side (each TP worker): moves the bytes; rank r of prefill talks to rank r of decode.
    """

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self._cfg = parse_config(dict(ktc.kv_connector_extra_config or {}), ktc.kv_role)
        self._producer = ktc.kv_role == "kv_producer"
        self._block_size = vllm_config.cache_config.block_size
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        # scheduler side
        self._to_send: dict[str, "Request"] = {}
        self._claimed: set[str] = set()
        self._local_hits: dict[str, int] = {}
        self._to_load: dict[str, LoadSpec] = {}
        # worker side (filled by register_kv_caches)
        self._kv: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._layer_names: list[str] = []
        self._windows: list[int | None] = []  # per layer: its sliding window, None for full attention
        self._stats: _Stats | None = None
        self._outgoing: dict[str, _Outgoing] = {}
        self._transport = None
        self._init_link_state()
        self._allow_trim = (not self._producer and self._cfg.window_trim
                            and vllm_config.cache_config.enable_prefix_caching is False)

    def _init_link_state(self) -> None:
        """What the sender and receiver threads share (also used by benchmarks/disagg_link.py)."""
        self._sender: ThreadPoolExecutor | None = None  # producer: sender threads
        self._links = _Links()                          # producer: kept-open connections
        self._listener = None                           # consumer
        self._sessions: set = set()                     # consumer: open connections, aborted at shutdown
        self._incoming: dict[str, _Incoming] = {}       # consumer: transfers by xfer id
        self._pending: dict[str, tuple[LoadSpec, float]] = {}  # consumer: loads by request, with deadlines
        self._load_specs: dict[str, LoadSpec] = {}      # consumer: the same loads by xfer id
        self._incoming_lock = threading.Lock()
        self._arrived = threading.Event()               # set by receiver threads when a transfer ends
        self._closed = False
        self._allow_trim = False                        # consumer: replies REPLY_WINDOW_TRIM
        self._peer_trim = False                         # producer: the decode peer's last reply allowed trimming

    # ==== scheduler side ====================================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """Decode: the first `prompt - 1` tokens come from the prefill instance, loaded
        asynchronously (the request waits in WAITING_FOR_REMOTE_KVS). Asked once per request:
        after a load, finished or failed, the request computes locally."""
        if self._producer or request.request_id in self._claimed or xfer_id_of(request) is None:
            return 0, False
        num_tokens = len(request.prompt_token_ids or ()) - 1
        external = num_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        return external, True

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        xfer = xfer_id_of(request)
        if xfer is None:
            return
        if self._producer:
            if len(request.prompt_token_ids or ()) > 1:
                self._to_send.setdefault(request.request_id, request)
            return
        if num_external_tokens <= 0 or request.request_id in self._claimed:
            return
        self._claimed.add(request.request_id)
        num_tokens = len(request.prompt_token_ids or ()) - 1
        num_blocks = math.ceil(num_tokens / self._block_size)
        block_ids = list(blocks.get_block_ids()[0][:num_blocks])
        local = self._local_hits.pop(request.request_id, 0)
        self._to_load[request.request_id] = LoadSpec(request.request_id, xfer, block_ids,
                                                     local // self._block_size, num_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """Producer: a request is saved in the step that computes the end of its prompt
        (chunked prefill sends once, all blocks). Consumer: this step's new loads."""
        meta = UzipConnectorMetadata()
        for req_id, request in list(self._to_send.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            prompt_len = len(request.prompt_token_ids or ())
            if scheduled and request.num_computed_tokens + scheduled >= prompt_len:
                num_tokens = prompt_len - 1
                blocks = self._kv_cache_manager.get_block_ids(req_id)[0]
                meta.saves.append(SaveSpec(req_id, xfer_id_of(request), list(blocks[:math.ceil(num_tokens /
                                                                                               self._block_size)]),
                                           num_tokens, compression_of(request)))
                del self._to_send[req_id]
        meta.loads = list(self._to_load.values())
        self._to_load.clear()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are free at once: the producer copied them in save_kv_layer, the consumer
        wrote them before reporting the load finished."""
        self._to_send.pop(request.request_id, None)
        self._claimed.discard(request.request_id)
        self._local_hits.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        return False, None

    # ==== worker side: both roles ==============================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Called once per worker after the KV cache is allocated: layout, then the listener
        (consumer) or the start-up probe of the decode side (producer)."""
        self._kv = {name: (t[0] if isinstance(t, (list, tuple)) else t) for name, t in kv_caches.items()}
        self._layer_names = list(self._kv)
        self._layer_index = {n: i for i, n in enumerate(self._layer_names)}
        self._windows = _layer_windows(self._vllm_config, self._layer_names)
        first = self._kv[self._layer_names[0]]
        for name, t in self._kv.items():
            if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
                raise ValueError(f"UzipConnector: layer {name} has KV pages {tuple(t.shape[1:])} {t.dtype}, "
                                 f"unlike {tuple(first.shape[1:])} {first.dtype}: mixed layouts are not supported")
        self._page_shape = tuple(first.shape[1:])
        self._page_nbytes = first[0].numel() * first.element_size()
        self._dtype = first.dtype
        dtype_code(first.dtype)
        tp_size, self._tp_rank = _tp()
        role = "prefill" if self._producer else "decode"
        stats_path = None
        if self._cfg.stats_dir:
            os.makedirs(self._cfg.stats_dir, exist_ok=True)
            stats_path = os.path.join(self._cfg.stats_dir, f"{role}-tp{self._tp_rank}.json")
        self._transport = self._cfg.transport()
        with _threads_start_unpinned():
            self._stats = _Stats(stats_path)
            if self._producer:
                # its threads start later, from the (pinned) forward: each unpins itself
                self._sender = ThreadPoolExecutor(max_workers=4, thread_name_prefix="uzip-kv-send",
                                                  initializer=_unpin_this_thread)
                self._probe_peer()
            else:
                self._start_listener()
        self._stats.flush()

    def _hello(self, kind: int, xfer_id: str = "", num_tokens: int = 0, num_blocks: int = 0) -> Hello:
        return Hello(kind, self._tp_size, self._tp_rank, len(self._layer_names), dtype_code(self._dtype),
                     self._block_size, num_tokens, num_blocks, self._page_nbytes, xfer_id)

    def _check_hello(self, h: Hello) -> str | None:
        """The decode side's layout check; the reason is sent back and raised at prefill start-up."""
        if h.tp_size != self._tp_size:
            return (f"tensor-parallel sizes differ: prefill TP={h.tp_size}, decode TP={self._tp_size}; "
                    f"UzipConnector needs the same TP on both sides")
        if h.tp_rank != self._tp_rank:
            return f"prefill rank {h.tp_rank} reached decode rank {self._tp_rank} (ports are PORT + rank)"
        mine = self._hello(KIND_PROBE)
        for field in ("num_layers", "dtype_code", "block_size", "page_nbytes"):
            if getattr(h, field) != getattr(mine, field):
                return (f"KV layout differs: prefill {field}={getattr(h, field)}, decode {getattr(mine, field)} "
                        f"(same model, dtype and --block-size on both sides?)")
        return None

    # ==== worker side: producer ================================================================

    def _probe_peer(self) -> None:
        from uzip_serve import p2p

        host, port = self._cfg.peer_host_port
        port += self._tp_rank
        deadline = time.monotonic() + self._cfg.startup_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                ep = p2p.connect_sync(host, port, self._transport)
            except Exception as e:  # noqa: BLE001 - not up yet; retried until the deadline
                last = e
                time.sleep(1.0)
                continue
            try:
                ep.send_bytes(self._hello(KIND_PROBE).pack())
                reason, flags = unpack_reply(ep.recv_bytes(4096))
            except Exception as e:  # noqa: BLE001
                last = e
                ep.abort()
                time.sleep(1.0)
                continue
            ep.close()
            if reason:
                raise RuntimeError(f"UzipConnector: the decode instance at {host}:{port} refused this prefill "
                                   f"instance: {reason}")
            self._peer_trim = bool(flags & REPLY_WINDOW_TRIM)
            logger.info("UzipConnector: decode peer %s:%d accepted the layout (sliding-window layers %s)", host,
                        port, "trimmed to their window" if self._peer_trim and self._cfg.window_trim else "sent whole")
            return
        logger.warning("UzipConnector: decode peer %s:%d not reachable within %.0f s (%s); transfers will be "
                       "tried per request", host, port, self._cfg.startup_timeout_s, last)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Called by each attention layer after its forward: copy this step's finishing
        requests' blocks of this layer and queue them; the sender thread sends while the
        next layers compute."""
        if not self._producer or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, UzipConnectorMetadata) or not meta.saves:
            return
        idx = self._layer_index.get(layer_name)
        if idx is None:
            return
        layer = kv_layer[0] if isinstance(kv_layer, (list, tuple)) else kv_layer
        for spec in meta.saves:
            out = self._outgoing.get(spec.xfer_id)
            if out is None:
                out = self._outgoing[spec.xfer_id] = _Outgoing(spec)
                if self._cfg.overlap:
                    self._sender.submit(self._send_one, out)
            first = self._first_block(idx, spec.num_tokens)
            ids = torch.tensor(spec.block_ids[first:], dtype=torch.long, device=layer.device)
            out.q.put((idx, first, layer.index_select(0, ids).cpu()))
            if idx == len(self._layer_names) - 1:
                # The last layer's KV exists: the prompt's compute, as far as the transfer is concerned.
                self._stats.note(spec.xfer_id, t_last_layer=time.time())

    def wait_for_save(self):
        """No wait: the blocks were copied in save_kv_layer. Marks the end of the transfers'
        layers (a missing layer aborts the transfer, so decode never sees a partial one)."""
        if not self._producer or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, UzipConnectorMetadata):
            return
        now = time.time()
        for spec in meta.saves:
            out = self._outgoing.pop(spec.xfer_id, None)
            if out is not None:
                self._stats.note(spec.xfer_id, t_compute_done=now, t_first_layer=out.t_first)
                out.q.put(_END)
                if not self._cfg.overlap:  # every layer is queued: send it all now
                    self._sender.submit(self._send_one, out)

    def _send_one(self, out: _Outgoing) -> None:
        spec, stats = out.spec, self._stats
        t0 = time.time()
        raw = wire = 0
        active = 0.0  # seconds spent in hello + sends, i.e. not waiting for the forward
        ep = None
        try:
            transport = self._transport
            if spec.compression and spec.compression != transport.compression:
                transport = dataclasses.replace(transport, compression=spec.compression)
            hello = self._hello(KIND_TRANSFER, spec.xfer_id, spec.num_tokens, len(spec.block_ids)).pack()
            sent, total = 0, len(self._layer_names)
            while sent < total:
                layers = self._next_layers(out, sent, total)
                ts = time.perf_counter()
                if ep is None:
                    ep, st = self._begin(transport, hello, spec, layers)
                else:
                    st = ep.send_tensors(self._wire_layers(spec, layers))
                active += time.perf_counter() - ts
                raw += st.raw_bytes
                wire += st.wire_bytes
                sent += len(layers)
            self._links.put(transport.compression, ep)  # for the next transfer; no longer ours to abort
            ep = None
            t1 = time.time()
            stats.note(spec.xfer_id, t_send_start=t0, t_send_done=t1, send_active_s=active, raw_bytes=raw,
                       wire_bytes=wire, compression=transport.compression)
            # what the sliding windows saved: every layer's every block, less what went
            skipped = total * len(spec.block_ids) * self._page_nbytes - raw
            stats.add(sends_ok=1, send_raw_bytes=raw, send_wire_bytes=wire, send_seconds=t1 - t0,
                      send_active_seconds=active, send_window_skipped_bytes=skipped)
        except Exception as e:  # noqa: BLE001 - the decode side applies its load-failure policy
            logger.warning("UzipConnector: sending KV of %s failed: %s", spec.req_id, e)
            if ep is not None:
                ep.abort()  # the decode side sees the transfer cut short and drops it
            stats.note(spec.xfer_id, t_send_start=t0, error=str(e)[:300])
            stats.add(sends_failed=1)

    def _window_first_block(self, idx: int, num_tokens: int) -> int:
        """window_first_block for layer idx (0 for a layer of unknown window)."""
        window = self._windows[idx] if idx < len(self._windows) else None
        return window_first_block(num_tokens, window, self._block_size)

    def _first_block(self, idx: int, num_tokens: int) -> int:
        """The first block of layer idx to send: past what its sliding window no longer reads
        when the decode peer accepts that, else 0."""
        if not (self._cfg.window_trim and self._peer_trim):
            return 0
        return self._window_first_block(idx, num_tokens)

    def _wire_layers(self, spec: SaveSpec, layers: list) -> dict[str, torch.Tensor]:
        """The messages of saved (layer, first block, blocks) entries, as the connection's peer
        takes them: trimmed where it allows (even if saved whole, before its reply was known);
        a trimmed save on a connection whose peer does not allow it fails the transfer."""
        msgs = {}
        for idx, first, blocks in layers:
            want = self._first_block(idx, spec.num_tokens)
            if first > want:
                raise RuntimeError(f"layer {idx} was saved without its first {first} blocks, but the decode peer "
                                   f"now wants every block (prefix caching on there?); later transfers send all")
            msgs[str(idx)] = blocks[want - first:]
        return msgs

    def _next_layers(self, out: _Outgoing, sent: int, total: int) -> list:
        """Every layer saved by now, waiting for the first: while the forward outruns the link,
        layers queue up, and one transfer pipelines their chunks (compress the next while one is
        on the wire) where one transfer per layer would pay compress, wire, decode and an ack in
        series for each."""
        ready = [out.q.get(timeout=self._cfg.load_timeout_s)]
        held = self._held()
        while not held and len(ready) < total - sent and not out.q.empty() and ready[-1] is not _END:
            ready.append(out.q.get_nowait())
        if ready[-1] is _END:
            raise RuntimeError(f"only {sent + len(ready) - 1} of {total} layers were saved")
        if held and sent > 0:
            hold_until = time.monotonic() + 300
            while self._held() and time.monotonic() < hold_until:
                time.sleep(0.05)
        return ready

    def _held(self) -> bool:
        return bool(self._cfg.test_hold_file) and os.path.exists(self._cfg.test_hold_file)

    def _begin(self, transport, hello: bytes, spec: SaveSpec, layers: list):
        """Starts a transfer: its hello and first layers, on a kept-open connection when there is
        one. A kept connection that turns out broken (the decode instance restarted, the link
        dropped) is replaced once: nothing of this transfer was accepted on it (the decode side
        drops a transfer cut short), so it starts again on a new connection. Any error there is
        the transfer's. Returns the connection and the first send's stats."""
        from uzip_serve.p2p import TransferError

        ep = self._links.take(transport.compression)
        if ep is not None and not ep.alive:  # UCX saw the peer go while the connection was idle
            ep.abort()
            ep = None
            self._stats.add(reconnects=1)
        if ep is not None:
            try:
                return ep, self._start(ep, hello, self._wire_layers(spec, layers))
            except TransferError as e:
                logger.info("UzipConnector: a kept connection to the decode peer broke (%s); reconnecting", e)
                self._stats.add(reconnects=1)
        ep = self._connect(transport)  # its reply may change what the peer takes
        try:
            msgs = self._wire_layers(spec, layers)
        except BaseException:
            self._links.put(transport.compression, ep)  # nothing sent on it: still good
            raise
        return ep, self._start(ep, hello, msgs)

    @staticmethod
    def _start(ep, hello: bytes, layers: dict[str, torch.Tensor]):
        """A transfer's hello and first layers on ep; ep is aborted if that fails."""
        try:
            ep.send_bytes(hello)
            return ep.send_tensors(layers)
        except BaseException:
            ep.abort()
            raise

    def _connect(self, transport):
        """A new connection for transfers: connect, then the session hello, answered (the
        decode side checks the layout once per connection, and every transfer's hello again)."""
        from uzip_serve import p2p

        host, port = self._cfg.peer_host_port
        ep = p2p.connect_sync(host, port + self._tp_rank, transport)
        try:
            ep.send_bytes(self._hello(KIND_SESSION).pack())
            reason, flags = unpack_reply(ep.recv_bytes(4096))
        except BaseException:
            ep.abort()
            raise
        if reason:
            ep.abort()
            raise RuntimeError(f"decode refused: {reason}")
        self._peer_trim = bool(flags & REPLY_WINDOW_TRIM)
        self._stats.add(connects=1)
        return ep

    # ==== worker side: consumer ================================================================

    def _start_listener(self) -> None:
        from uzip_serve import p2p

        host, _, port = self._cfg.listen.rpartition(":")
        port = int(port) + self._tp_rank if int(port) else 0
        self._listener = p2p.SyncListener(port, self._transport)
        logger.info("UzipConnector: decode rank %d listening for KV on port %d (host %s)", self._tp_rank,
                    self._listener.port, host)
        self._stats.counters["listen_port"] = self._listener.port
        threading.Thread(target=self._accept_loop, name="uzip-kv-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                ep = self._listener.accept(timeout=1.0)
            except Exception:  # noqa: BLE001 - accept timeout: check for shutdown
                continue
            threading.Thread(target=self._serve, args=(ep,), name="uzip-kv-recv", daemon=True).start()

    def _serve(self, ep) -> None:
        """One connection from a prefill worker, on its own thread. The first hello (probe or
        session) is checked and answered; a session then carries transfers one after another
        until the prefill side closes it. Any error ends the connection (aborted): the transfer
        in progress fails, and the prefill side opens a new connection for its next one."""
        from uzip_serve.p2p import PeerError

        try:
            hello = Hello.unpack(ep.recv_bytes(HELLO.size))
            reason = self._check_hello(hello)
            if reason is None and hello.kind == KIND_TRANSFER:
                reason = "a transfer hello before a session hello"
            ep.send_bytes(pack_reply(reason, REPLY_WINDOW_TRIM if self._allow_trim else 0))
            if reason is not None:
                logger.warning("UzipConnector: refused a prefill peer: %s", reason)
                self._stats.add(refused=1)
                ep.close()
                return
            if hello.kind == KIND_PROBE:
                ep.close()
                return
            self._stats.add(sessions=1)
            self._sessions.add(ep)
            while not self._closed:
                try:
                    data = ep.recv_bytes(HELLO.size, idle=True)
                except PeerError:
                    return  # closed by the prefill side (or it died) between transfers: nothing lost
                self._receive(ep, Hello.unpack(data))
        except Exception as e:  # noqa: BLE001 - PeerError, TransferTimeout, ChecksumError, ProtocolError, ...
            logger.warning("UzipConnector: KV connection from a prefill worker failed: %s: %s", type(e).__name__, e)
            ep.abort()
        finally:
            self._sessions.discard(ep)

    def _receive(self, ep, hello: Hello) -> None:
        """One transfer of a session: its hello is checked as a session's is, plus its own fields,
        then its layers arrive into a new store entry, each checked (name = the next layer index,
        shape, dtype). Raises on anything wrong, with the entry marked failed."""
        reason = self._check_hello(hello)
        if reason is None and hello.kind != KIND_TRANSFER:
            reason = f"hello kind {hello.kind} inside a session"
        expect = math.ceil(hello.num_tokens / self._block_size) if hello.num_tokens else 0
        if reason is None and (hello.num_blocks != expect or hello.num_tokens == 0):
            reason = f"{hello.num_blocks} blocks for {hello.num_tokens} tokens"
        if reason is not None:
            self._stats.add(refused=1)
            raise ValueError(f"refused a transfer: {reason}")
        entry = _Incoming(hello, time.time())
        with self._incoming_lock:
            self._incoming[hello.xfer_id] = entry
            spec = self._load_specs.get(hello.xfer_id)
            if spec is not None:
                self._attach(entry, spec)
        try:
            i = 0
            while i < hello.num_layers:  # one transfer carries the next one or more layers, in order
                got = ep.recv_tensors(on_tensor=lambda name, t, first=i: self._arrive(entry, first, name, t))
                st = ep.last_stats
                if list(got) != [str(j) for j in range(i, i + len(got))]:
                    raise ValueError(f"layer {i}: unexpected message {list(got)}")
                i += len(got)
                if not got:
                    raise ValueError(f"layer {i}: an empty transfer")
                if len(got) == i:  # the first message: how far a transfer cut short got
                    self._stats.note(hello.xfer_id, t_recv_first=time.time(), first_layers=i)
                if st is not None:
                    entry.raw_bytes += st.raw_bytes
                    entry.wire_bytes += st.wire_bytes
        except Exception as e:
            entry.error = f"{type(e).__name__}: {e}"
            self._arrived.set()
            raise
        entry.t_done = time.time()
        entry.done = True
        self._arrived.set()

    def _arrive(self, entry: _Incoming, first: int, name: str, t: torch.Tensor) -> None:
        """A layer is complete (a p2p codec thread, as soon as its last chunk is in): checked,
        then written into the paged cache if the load is registered, else kept. An error
        refuses the transfer."""
        h = entry.hello
        i = int(name) if name.isdigit() else -1
        trimmed = self._window_first_block(i, h.num_tokens) if self._allow_trim and i >= 0 else 0
        if not (first <= i < h.num_layers and tuple(t.shape[1:]) == self._page_shape and t.dtype == self._dtype
                and h.num_blocks - trimmed <= t.shape[0] <= h.num_blocks):
            raise ValueError(f"layer {first}: unexpected message {name!r} {tuple(t.shape)} {t.dtype}")
        with entry.lock:
            if entry.spec is None or entry.abandoned:
                entry.layers[i] = t
                return
            self._write_layer(entry.spec, h, i, t, sync=True)
            entry.written.add(i)
        self._stats.add(layers_on_arrival=1)

    def _attach(self, entry: _Incoming, spec: LoadSpec) -> None:
        """The load of a transfer that is arriving: later layers go into the cache as they come.
        A transfer that does not fit the load is left to _inject, which fails it."""
        if self._load_error(spec, entry.hello) is None:
            with entry.lock:
                entry.spec = spec

    @staticmethod
    def _load_error(spec: LoadSpec, h: Hello) -> str | None:
        if h.num_tokens != spec.num_tokens:
            return (f"prefill sent KV of {h.num_tokens} tokens, decode expects {spec.num_tokens} "
                    f"(different tokenization?)")
        if len(spec.block_ids) != h.num_blocks:
            return f"{h.num_blocks} blocks sent, {len(spec.block_ids)} allocated"
        return None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Registers this step's new loads; they complete in get_transfer_results."""
        if self._producer or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, UzipConnectorMetadata):
            return
        now = time.monotonic()
        for spec in meta.loads:
            self._register_load(spec, now + self._cfg.load_timeout_s)
            self._stats.note(spec.xfer_id, t_load_requested=time.time())

    def _register_load(self, spec: LoadSpec, deadline: float) -> None:
        self._pending[spec.req_id] = (spec, deadline)
        with self._incoming_lock:
            self._load_specs[spec.xfer_id] = spec
            entry = self._incoming.get(spec.xfer_id)
            if entry is not None:
                self._attach(entry, spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous and complete before the request is scheduled: nothing to wait for."""
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Each step: completes the transfers that arrived (their layers are in the paged cache,
        most of them written as they came); a failed, refused or overdue one is reported in
        failed_recving, and vLLM applies kv_load_failure_policy (recompute or fail: blocks of a
        partial transfer are recomputed or freed, never read)."""
        res = KVConnectorTransferResults()
        if self._producer or not self._pending:
            self._gc()
            return res
        # While loads are pending the engine may step without a forward in a tight loop,
        # holding the GIL and the cores the receiver threads need (idle_wait_ms).
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, UzipConnectorMetadata) and meta.idle
        self._arrived.wait(self._cfg.idle_wait_ms / 1000 if idle else 0.001)
        self._arrived.clear()
        now = time.monotonic()
        for req_id, (spec, deadline) in list(self._pending.items()):
            with self._incoming_lock:
                entry = self._incoming.get(spec.xfer_id)
            error = None
            if entry is not None and entry.error:
                error = entry.error
            elif entry is not None and entry.done:
                try:
                    self._inject(spec, entry)
                except Exception as e:  # noqa: BLE001
                    error = f"inject: {e}"
            elif now > deadline:
                error = f"no complete KV within {self._cfg.load_timeout_s:.0f} s"
            else:
                continue
            del self._pending[req_id]
            with self._incoming_lock:
                # a retry of a refused transfer may have replaced the entry since: give both up
                latest = self._incoming.pop(spec.xfer_id, None)
                self._load_specs.pop(spec.xfer_id, None)
            for e in {id(x): x for x in (entry, latest) if x is not None}.values():
                with e.lock:  # waits for a layer being written; none is written after this
                    e.abandoned = True
            res.finished_recving.add(req_id)
            t = time.time()
            if error:
                res.failed_recving.add(req_id)
                logger.warning("UzipConnector: KV load for %s failed (%s); vLLM's kv_load_failure_policy applies",
                               req_id, error)
                self._stats.note(spec.xfer_id, t_load_failed=t, error=error[:300])
                self._stats.add(loads_failed=1)
            else:
                self._stats.note(spec.xfer_id, t_recv_begin=entry.t_begin, t_recv_done=entry.t_done, t_injected=t,
                                 raw_bytes=entry.raw_bytes, wire_bytes=entry.wire_bytes)
                self._stats.add(loads_ok=1, tokens_loaded=spec.num_tokens - spec.first_pos * self._block_size,
                                recv_raw_bytes=entry.raw_bytes, recv_wire_bytes=entry.wire_bytes)
        self._gc()
        return res

    def _inject(self, spec: LoadSpec, entry: _Incoming) -> None:
        """The engine's step, once a transfer is complete: writes the layers that arrived
        before its load was registered (or all of them, for a load registered too late)."""
        error = self._load_error(spec, entry.hello)
        if error:
            raise ValueError(error)
        late = 0
        with entry.lock:
            for i in range(len(self._layer_names)):
                if i not in entry.written:
                    self._write_layer(spec, entry.hello, i, entry.layers.pop(i))
                    entry.written.add(i)
                    late += 1
        if late:
            self._stats.add(layers_in_step=late)

    def _write_layer(self, spec: LoadSpec, h: Hello, i: int, blocks: torch.Tensor, sync: bool = False) -> None:
        """Layer i's received blocks into the request's blocks of the paged cache (those past
        its local prefix-cache hits). Called with the transfer's lock held. `sync`: a receiver
        thread's copy to a GPU is complete before the step that reports the load done."""
        kv = self._kv[self._layer_names[i]]
        skipped = h.num_blocks - blocks.shape[0]  # a sliding-window layer's blocks before its window
        start = max(spec.first_pos, skipped)
        if start < len(spec.block_ids):
            _copy_blocks(kv, spec.block_ids[start:], blocks[start - skipped:])
        if self._cfg.test_poison_untransferred and skipped > spec.first_pos:
            gone = torch.tensor(spec.block_ids[spec.first_pos:skipped], dtype=torch.long, device=kv.device)
            kv.index_fill_(0, gone, float("nan"))
        if sync and kv.is_cuda:
            torch.cuda.current_stream(kv.device).synchronize()

    def _gc(self) -> None:
        """Drops received transfers nobody claimed (the decode request never came)."""
        if not self._incoming:
            return
        cutoff = time.time() - 2 * self._cfg.load_timeout_s
        claimed = {spec.xfer_id for spec, _ in self._pending.values()}
        with self._incoming_lock:
            for xfer, entry in list(self._incoming.items()):
                if xfer not in claimed and (entry.t_done or entry.t_begin) < cutoff:
                    del self._incoming[xfer]
                    self._stats.add(unclaimed_dropped=1)

    def shutdown(self):
        """Closes the listener, the kept-open connections (both sides) and the sender threads."""
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        self._links.close()
        for ep in list(self._sessions):
            ep.abort()
        if self._sender is not None:
            self._sender.shutdown(wait=False, cancel_futures=True)
        if self._stats is not None:
            self._stats.flush()


def register() -> None:
    """Adds `UzipConnector` to vLLM's KV connector factory (lazy: the module loads on use)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "uzip_vllm.kv_connector", "UzipConnector")
