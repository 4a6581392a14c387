"""UCX endpoints and listeners (through `ucxx`), carrying the split-send pipeline.

Asynchronous API first::

    listener = await p2p.listen(port=0)              # in the receiving process
    ep = await listener.accept()
    tensors = await ep.recv_tensors()

    ep = await p2p.connect(host, listener.port)      # in the sending process
    stats = await ep.send_tensors({"w": weight})
    await ep.close()

Every operation is bounded by TransportConfig.deadline_s; a dead or stuck peer
surfaces as PeerError or TransferTimeout, never as a hang. UCX and its settings are
process-wide: the first endpoint or listener starts UCX with its config, and every UCX
operation runs on the process's one UCX loop (loop.py), whatever loop the caller uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
import weakref
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor

from uzip_serve.p2p import cuda_ipc, split_send, ucx_cuda
from uzip_serve.p2p.loop import call_soon, cancel_quietly, on_ucx_loop
from uzip_serve.p2p.adaptive import AdaptivePolicy, CodecPacer, TransferStats
from uzip_serve.p2p.config import TransportConfig
from uzip_serve.p2p.errors import PeerError, ProtocolError, TransferError, TransferTimeout

logger = logging.getLogger(__name__)

_started_with: TransportConfig | None = None
_started_tls: str | None = None  # the UCX_TLS that UCX really started with
# What ucx_tls="auto" asks for on a host with CUDA: UCX then moves GPU memory itself,
# through cuda_ipc between processes of one host (docs/gpu_p2p.md).
CUDA_TLS = "tcp,cuda_copy,cuda_ipc"


def _ucxx():
    try:
        import ucxx
    except ImportError as e:
        raise ImportError("uzip_serve.p2p needs ucxx: pip install 'uzip-serve[p2p]' (ucxx-cu12 or ucxx-cu13)") from e
    return ucxx


def resolve_tls(tls: str) -> str:
    """ucx_tls as UCX gets it: "auto" adds the CUDA transports where this process sees a GPU.
    (UCX initialises the CUDA driver with them: a process that forks CUDA children after
    starting UCX should set ucx_tls="tcp".)"""
    if tls != "auto":
        return tls
    return CUDA_TLS if cuda_ipc.available() else "tcp"


def carries_cuda() -> bool:
    """Whether this process's UCX was started with the transports that move GPU memory
    (cuda_copy to recognise it, cuda_ipc to move it between processes)."""
    if _started_tls is None or not cuda_ipc.available():
        return False
    names = {t.strip() for t in _started_tls.split(",")}
    if any(n.startswith("^") for n in names):  # an exclusion list: everything else is in
        excluded = {n.lstrip("^") for n in names}
        return not excluded & {"cuda", "cuda_copy", "cuda_ipc"}
    return bool(names & {"all", "cuda"}) or {"cuda_copy", "cuda_ipc"} <= names


# What importing ucxx puts into UCX_RNDV_THRESH when it is unset.
UCXX_RNDV_THRESH = "8192"


def start_ucx(config: TransportConfig) -> None:
    """Starts UCX for this process with `config`'s transports and progress mode (once)."""
    global _started_with, _started_tls
    if _started_with is not None:
        started = (_started_with.ucx_tls, _started_with.progress_mode, _started_with.eager_bytes)
        if started != (config.ucx_tls, config.progress_mode, config.eager_bytes):
            logger.warning("UCX already started with tls=%s progress=%s eager_bytes=%s; ignoring tls=%s "
                           "progress=%s eager_bytes=%s", *started, config.ucx_tls, config.progress_mode,
                           config.eager_bytes)
        return
    # ucxx sets UCX variables of its own that this UCX build does not know; quiet that.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # A listener restarted on its port (a restarted server) must not wait a minute for the
    # TIME_WAIT of the connections its previous process held open (measured: bind() failed
    # for ~60 s after a kill). Linux still refuses a port another socket listens on.
    os.environ.setdefault("UCX_CM_REUSEADDR", "y")
    ucxx = _ucxx()
    # The environment wins if the user set UCX_TLS themselves (e.g. for RDMA).
    # In the thread modes, completions reach asyncio as Python futures set by a notifier
    # thread. Without that, every pending request is awaited by a yield loop: measured
    # here, an idle receive then burns ~0.9 of a core (docs/p2p.md).
    futures = config.progress_mode.startswith("thread")
    tls = resolve_tls(config.ucx_tls)
    if config.eager_bytes and os.environ.get("UCX_RNDV_THRESH", UCXX_RNDV_THRESH) == UCXX_RNDV_THRESH:
        # The environment beats init's options, and importing ucxx sets UCX_RNDV_THRESH to
        # its own default: only a user's own value is kept.
        os.environ["UCX_RNDV_THRESH"] = str(config.eager_bytes)
    ucxx.init(options={"TLS": tls}, env_takes_precedence=True, progress_mode=config.progress_mode,
              enable_python_future=futures)
    _started_with = config
    _started_tls = os.environ.get("UCX_TLS") or tls
    logger.info("UCX started: tls=%s progress=%s", _started_tls, config.progress_mode)


class _Spin:
    """Progresses UCX in a tight loop on the UCX loop while a same-host GPU transfer runs,
    and for a moment after it (TransportConfig.gpu_spin_s).

    In "blocking" mode UCX is progressed when its epoll descriptor wakes the event loop, and
    an idle loop pays a thread wake-up (~0.1-0.2 ms in the H200's VM) for each step. A GPU
    transfer on one host is a chain of such steps of microseconds each. Chunk streams and idle endpoints keep blocking mode's economy:
    nothing spins once no GPU transfer ran for gpu_spin_s.
    """

    def __init__(self):
        self.users = 0
        self.until = 0.0
        self.task: asyncio.Task | None = None

    @contextlib.contextmanager
    def held(self, linger_s: float):
        self.users += 1
        self._start()
        try:
            yield
        finally:
            self.users -= 1
            self.until = max(self.until, time.perf_counter() + linger_s)

    def touch(self, seconds: float) -> None:
        self.until = max(self.until, time.perf_counter() + seconds)
        self._start()

    def _start(self) -> None:
        if self.task is None:
            self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        progress = _ucxx().progress
        try:
            while self.users > 0 or time.perf_counter() < self.until:
                progress()
                await asyncio.sleep(0)
        finally:
            self.task = None


_spin = _Spin()


def _spins(config: TransportConfig) -> bool:
    return config.gpu_spin_s > 0 and _started_with is not None and _started_with.progress_mode == "blocking"


def _translate(exc: BaseException, what: str) -> TransferError:
    import ucxx.exceptions as ux

    if isinstance(exc, TransferError):
        return exc
    if isinstance(exc, asyncio.TimeoutError):
        return TransferTimeout(f"{what}: no progress within the deadline")
    if isinstance(exc, (ux.UCXConnectionResetError, ux.UCXCloseError, ux.UCXCanceledError, ux.UCXCanceled,
                        ux.UCXEndpointTimeoutError, ux.UCXNotConnectedError, ux.UCXUnreachableError)):
        return PeerError(f"{what}: peer unreachable or gone ({type(exc).__name__}: {exc})")
    if isinstance(exc, ux.UCXMessageTruncatedError):
        return ProtocolError(f"{what}: message larger than announced ({exc})")
    if isinstance(exc, ux.UCXError):
        return PeerError(f"{what}: {type(exc).__name__}: {exc}")
    raise exc


class Endpoint:
    """One connection to a peer. Not safe for concurrent transfers in the same direction."""

    def __init__(self, ucx_ep, config: TransportConfig):
        self._ep = ucx_ep
        self.config = config
        self.policy = AdaptivePolicy(config.compression)
        # Codec threads for the chunks this endpoint receives (its sends use self.policy.pacer),
        # and the staging buffers of each direction, kept between transfers.
        self.recv_pacer = CodecPacer()
        self._send_staging, self._recv_staging = split_send.StagingPool(), split_send.StagingPool()
        # The CUDA IPC path has its own link and codec, so its own policy and state.
        self.ipc_policy = AdaptivePolicy.for_cuda_ipc(config.compression)
        self._ipc_exporter = cuda_ipc.Exporter()
        self._ipc_importer = cuda_ipc.Importer()
        # The CUDA route needs UCX's CUDA transports in this process (the peer checks its own).
        self._cuda_route = ucx_cuda.Route() if config.cuda_ucx != "off" and carries_cuda() else None
        self.last_stats: TransferStats | None = None
        # Per endpoint and direction, so that a receiver can tell the next one (ucx_cuda.PrePost).
        self._transfer_ids = itertools.count(1)
        # Codec work runs here so the event loop keeps progressing UCX meanwhile.
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="uzip-codec")
        self._closed = False
        # Whether our last message may still be unread by the peer (see close).
        self._sent_last = False
        self._finalizer = weakref.finalize(self, _abort_quietly, ucx_ep, self._executor)

    # -- the Channel used by split_send: exact-size messages under a deadline --
    # Both post the operation when called, not when awaited: UCX matches one endpoint's
    # messages in the order they were posted, and the pipelines keep several in flight.
    def send(self, buf) -> Awaitable[None]:
        self._check_open()
        self._sent_last = True
        return self._within_deadline(asyncio.ensure_future(self._ep.send(buf)), "send")

    def recv(self, buf) -> Awaitable[None]:
        self._check_open()
        return self._within_deadline(asyncio.ensure_future(self._ep.recv(buf)), "recv")

    async def _within_deadline(self, request: asyncio.Future, what: str) -> None:
        try:
            await asyncio.wait_for(request, self.config.deadline_s)
        except Exception as e:  # noqa: BLE001 - translated into a typed error or re-raised
            raise _translate(e, what) from e
        self._answered(what)

    def _answered(self, what: str) -> None:
        """A completed receive: the peer read what we sent before it, or it could not have answered."""
        if what == "recv":
            self._sent_last = False

    async def send_many(self, bufs, tag: int | None = None) -> None:
        """Sends several messages, all posted at once (UCX pipelines them), awaited in order:
        each must complete within deadline_s of the one before, a deadline on progress.
        `tag`: a UCX tag of their own (protocol.payload_tag) instead of the endpoint's."""
        self._sent_last = True
        await self.wait_many(self._post(self._ep.send, bufs, tag), "send")

    async def recv_many(self, bufs, tag: int | None = None) -> None:
        """Receives into several buffers, in order; posted and awaited as in send_many."""
        await self.wait_many(self.post_recvs(bufs, tag), "recv")

    def post_recvs(self, bufs, tag: int | None = None) -> list[asyncio.Future]:
        """Posts receives now; await them with wait_many. (UCX cannot take a posted receive
        back: one never matched stays posted, harmlessly, until the endpoint closes.)"""
        return self._post(self._ep.recv, bufs, tag)

    def _post(self, op, bufs, tag) -> list[asyncio.Future]:
        self._check_open()
        kw = {} if tag is None else {"tag": tag}
        # Tasks start in creation order, and each posts its UCX request in its first step,
        # so the messages are matched in this order.
        return [asyncio.ensure_future(op(b, **kw)) for b in bufs]

    async def wait_many(self, futs, what: str) -> None:
        try:
            for f in futs:
                await asyncio.wait_for(asyncio.shield(f), self.config.deadline_s)
        except Exception as e:  # noqa: BLE001 - translated into a typed error or re-raised
            cancel_quietly(futs)
            raise _translate(e, what) from e
        self._answered(what)

    def next_transfer_id(self) -> int:
        """Transfer ids grow by one per transfer sent on this endpoint (relayed ones included)."""
        return next(self._transfer_ids)

    def _check_open(self) -> None:
        if self._closed:
            raise PeerError("endpoint is closed")

    # -- spinning for same-host GPU transfers (split_send calls these; see _Spin) --
    def gpu_spin(self):
        """A context within which UCX is progressed continuously (a same-host GPU transfer)."""
        return _spin.held(self.config.gpu_spin_s) if _spins(self.config) else contextlib.nullcontext()


    # -- transfers --
    async def send_tensors(self, tensors, *, stream=None) -> TransferStats:
        """Sends a mapping (or iterable of (name, tensor)) as one transfer. Returns once the
        peer verified all of it. CUDA tensors are read after the pending work of `stream`
        (default: the caller's current CUDA stream)."""
        return await on_ucx_loop(*self.send_call(tensors, stream))

    def send_call(self, tensors, stream=None):
        """(the coroutine to run on the UCX loop, how long its caller may spin for it). Made in
        the caller's thread: torch's current stream is thread-local, and a transfer between
        GPUs of this host is short enough to wait for without sleeping (caller_spin_s)."""
        items = split_send.named_items(tensors)
        spin = self.config.caller_spin_s if split_send.on_one_gpu(items) else 0.0
        return self._send_tensors(items, stream or cuda_ipc.caller_stream()), spin

    async def _send_tensors(self, tensors, stream=None) -> TransferStats:
        try:
            self.last_stats = await split_send.send_tensors(self, tensors, config=self.config, policy=self.policy,
                                                            executor=self._executor, transfer_id=self.next_transfer_id(),
                                                            ipc=self._ipc_exporter, ipc_policy=self.ipc_policy,
                                                            stream=stream, cuda_route=self._cuda_route,
                                                            staging_pool=self._send_staging)
            return self.last_stats
        except TransferError:
            self.abort()
            raise

    async def recv_tensors(self, into=None, forward: list["Endpoint"] = (), device=None, *, stream=None,
                           on_tensor=None) -> dict:
        """Receives one transfer: a new dict of tensors (on `device`, default CPU), or written
        into `into`'s tensors. `forward` relays it, cut-through, to other endpoints (see split_send).
        CUDA IPC copies run on `stream` (default: the caller's current CUDA stream). `on_tensor`
        (name, tensor) is handed each tensor as soon as it is complete (split_send.recv_tensors)."""
        return await on_ucx_loop(*self.recv_call(into, forward, device, stream, on_tensor))

    def recv_call(self, into=None, forward=(), device=None, stream=None, on_tensor=None):
        """As send_call, for a receive."""
        gpu = split_send.uses_cuda(into, device)
        spin = self.config.caller_spin_s if gpu else 0.0
        return self._recv_tensors(into, forward, device, stream or cuda_ipc.caller_stream(), gpu, on_tensor), spin

    async def _recv_tensors(self, into, forward, device=None, stream=None, gpu: bool = False, on_tensor=None) -> dict:
        if gpu and _spins(self.config):
            _spin.touch(self.config.gpu_spin_s)  # a GPU sender's header may be on its way
        prepost = None if forward else ucx_cuda.PrePost.start(self, self._cuda_route, into, stream,
                                                               self.config.deadline_s)
        try:
            out, self.last_stats = await split_send.recv_tensors(self, config=self.config, executor=self._executor,
                                                                 into=into, forward=forward, ipc=self._ipc_importer,
                                                                 stream=stream, device=device,
                                                                 cuda_route=self._cuda_route, prepost=prepost,
                                                                 pacer=self.recv_pacer, staging_pool=self._recv_staging,
                                                                 on_tensor=on_tensor)
            return out
        except TransferError:
            self.abort()
            raise
        finally:
            if prepost is not None:
                prepost.abandon()

    async def send_bytes(self, data: bytes) -> None:
        """A small control message: its length, then its bytes."""
        await on_ucx_loop(self._send_bytes(data))

    async def _send_bytes(self, data: bytes) -> None:
        await self.send(len(data).to_bytes(8, "little"))
        if data:
            await self.send(data)

    async def recv_bytes(self, limit: int = 64 << 20, *, idle: bool = False) -> bytes:
        """The next control message. `idle`: its first part may take any time (a kept-open
        connection waiting for its next use); the wait still ends at once, with PeerError, when
        the peer closes or dies or this endpoint is aborted. (A deadline could not be used for
        that wait: a receive that timed out would stay posted and swallow the next message.)"""
        return await on_ucx_loop(self._recv_bytes(limit, idle))

    async def _recv_bytes(self, limit: int, idle: bool = False) -> bytes:
        n = bytearray(8)
        if idle:
            self._check_open()
            try:
                await self._ep.recv(n)
            except Exception as e:  # noqa: BLE001 - translated into a typed error or re-raised
                raise _translate(e, "recv") from e
            self._answered("recv")
        else:
            await self.recv(n)
        size = int.from_bytes(n, "little")
        if size > limit:
            raise ProtocolError(f"control message of {size} bytes exceeds the limit {limit}")
        buf = bytearray(size)
        if size:
            await self.recv(buf)
        return bytes(buf)

    # -- shutdown --
    def abort(self) -> None:
        """Closes at once, dropping anything in flight. Safe to call twice, from any thread."""
        if not self._closed:
            self._closed = True
            call_soon(self._finalizer)

    async def close(self) -> None:
        """Closes after what was sent has been delivered: when our last message was a send (a
        receiver's ack), only once the peer closed, or deadline_s passed without it doing so.

        ucxx closes by force (UCP_EP_CLOSE_FLAG_FORCE, it never flushes), and a completed send
        only means the bytes left this process. Closing right after one raced the peer: under
        load the peer could learn of the close before it read the message, so its receive was
        cancelled (PeerError, UCXXCanceledError), as a relay's wait for its last hop's ack can be.
        So the side that read the last message closes first, and the other waits for that."""
        await on_ucx_loop(self._close())

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        try:
            if self._sent_last:
                await self._peer_closed(self.config.deadline_s)
            await asyncio.wait_for(self._ep.close(), self.config.deadline_s)
        except Exception:  # noqa: BLE001 - closing a dead endpoint is not an error
            self._ep.abort()
        finally:
            self._executor.shutdown(wait=False)
            self._ipc_importer.close()  # lets the peer's allocator have its blocks back

    async def _peer_closed(self, timeout: float) -> None:
        """Waits until UCX reports the peer gone (it closed, or died), or `timeout` passed."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not self._ep.closed:
            if loop.time() >= end:
                logger.debug("peer did not close within %.1f s; closing anyway", timeout)
                return
            await asyncio.sleep(0.002)  # the loop progresses UCX meanwhile, which notices the close

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def alive(self) -> bool:
        """Open here and, as far as UCX knows, at the peer: False once the peer closed, died or
        reset the connection (UCX notices that without a transfer in flight)."""
        return not self._closed and not self._ep.closed


def _abort_quietly(ucx_ep, executor) -> None:
    try:
        ucx_ep.abort()
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass
    executor.shutdown(wait=False)


class Listener:
    """Accepts connections; `accept()` hands them out in arrival order."""

    def __init__(self, config: TransportConfig):
        self.config = config
        self._queue: asyncio.Queue[Endpoint] = asyncio.Queue()
        self._listener = None

    async def _on_connect(self, ucx_ep) -> None:
        await self._queue.put(Endpoint(ucx_ep, self.config))

    @property
    def port(self) -> int:
        return self._listener.port

    async def accept(self, timeout: float | None = None) -> Endpoint:
        return await on_ucx_loop(self._accept(timeout))

    async def _accept(self, timeout: float | None) -> Endpoint:
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout("no peer connected within the timeout") from None

    def close(self) -> None:
        call_soon(self._close_now)

    def _close_now(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


async def listen(port: int = 0, config: TransportConfig | None = None) -> Listener:
    """Listens for peers on `port` (0 = any free one; see Listener.port)."""
    return await on_ucx_loop(_listen(port, config))


async def _listen(port: int, config: TransportConfig | None) -> Listener:
    config = config or TransportConfig.from_env()
    start_ucx(config)
    lst = Listener(config)
    lst._listener = _ucxx().create_listener(lst._on_connect, port=port)
    return lst


async def connect(host: str, port: int, config: TransportConfig | None = None) -> Endpoint:
    """Connects to a peer's listener; the connection is bounded by config.deadline_s."""
    return await on_ucx_loop(_connect(host, port, config))


async def _connect(host: str, port: int, config: TransportConfig | None) -> Endpoint:
    config = config or TransportConfig.from_env()
    start_ucx(config)
    try:
        ucx_ep = await asyncio.wait_for(_ucxx().create_endpoint(host, port), config.deadline_s)
    except Exception as e:  # noqa: BLE001
        raise _translate(e, f"connect to {host}:{port}") from e
    return Endpoint(ucx_ep, config)
