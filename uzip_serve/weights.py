"""Versioned weight pushes: `push_weights` on the trainer, `WeightReceiver` on each engine.

A push is a transaction run by the coordinator (docs/coordinator.md): BeginPush checks
the version and that every live receiver gets all it expects; the bytes go trainer ->
receivers (and receiver -> receiver when relaying) over uzip_serve.p2p, compressed;
each receiver stages and verifies, then reports PREPARED; FinishPush commits only when
all did. Receivers swap to a version only on its COMMITTED event, so until then they
keep serving the previous one, whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from uzip_serve import format as fmt

logger = logging.getLogger(__name__)


class PushError(RuntimeError):
    """A push did not commit. `code` is the coordinator's gRPC status name where it
    refused the push (e.g. FAILED_PRECONDITION for a stale version), else "ABORTED"."""

    def __init__(self, message: str, code: str = "ABORTED"):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True)
class PushResult:
    version: int
    receivers: list[str]
    raw_bytes: int  # bytes of the tensors pushed (per copy)
    wire_bytes: int  # bytes the trainer itself sent, over all its direct hops
    seconds: float
    hop_raw_bytes: int  # raw bytes the trainer's own hops carried (raw_bytes x direct receivers)

    @property
    def ratio(self) -> float:
        """Trainer wire bytes over the raw bytes its hops carried."""
        return self.wire_bytes / self.hop_raw_bytes if self.hop_raw_bytes else 1.0


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _spec_slice(t: torch.Tensor, spec) -> torch.Tensor:
    """The part of full tensor `t` a receiver with `spec` holds."""
    if not spec.HasField("shard"):
        return t
    s = spec.shard
    size = t.shape[s.dim] // s.world_size
    return t.narrow(s.dim, s.rank * size, size).contiguous()


def _rpc(fn, request, timeout: float | None = None, wait_for_ready: bool | None = None):
    import grpc

    try:
        return fn(request, timeout=timeout, wait_for_ready=wait_for_ready)
    except grpc.RpcError as e:
        raise PushError(f"coordinator: {e.code().name}: {e.details()}", e.code().name) from None


# ---- trainer side ---------------------------------------------------------------------------

async def push_weights_async(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                             coordinator: str, version: int | None = None, token: str | None = None,
                             timeout: float = 120.0, progress: bool = True, config=None) -> PushResult:
    """Pushes one version of the weights to every live receiver; see push_weights."""
    from uzip_serve import p2p
    from uzip_serve.coordinator import client, pb

    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    tensors = {n: t.detach() for n, t in items}
    manifest = [pb.TensorSpec(name=n, shape=list(t.shape), dtype=_dtype_name(t)) for n, t in tensors.items()]
    raw_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    channel, stub = client.connect(coordinator, token=token)
    t0 = time.perf_counter()
    try:
        begun = await asyncio.to_thread(_rpc, stub.BeginPush, pb.BeginPushRequest(
            version=version or 0, manifest=manifest, timeout_s=timeout, raw_bytes=raw_bytes), timeout)
        hops = [h for h in begun.plan if h.sender == "trainer"]
        envelope = begun.SerializeToString()
        cfg = config or p2p.TransportConfig.from_env()
        bar = _progress_bar(progress, sum(sum(_nbytes(s) for s in h.expected) for h in hops), begun.version)

        async def send_hop(hop) -> tuple[int, int]:
            host, port = hop.p2p_address.rsplit(":", 1)
            payload = {s.name: _spec_slice(tensors[s.name], s) for s in hop.expected}
            ep = await p2p.connect(host, int(port), cfg)
            try:
                await ep.send_bytes(envelope)
                stats = await ep.send_tensors(payload)
            except BaseException:
                ep.abort()  # the receiver learns at once that this version is dead
                raise
            await ep.close()
            bar.update(stats.raw_bytes)
            return stats.raw_bytes, stats.wire_bytes

        try:
            sent = await asyncio.wait_for(asyncio.gather(*(send_hop(h) for h in hops)), timeout)
        except BaseException as e:
            reason = f"trainer could not send: {type(e).__name__}: {e}"
            await asyncio.to_thread(_rpc, stub.AbortPush, pb.AbortPushRequest(version=begun.version, reason=reason),
                                    30)
            raise PushError(reason) from e
        finally:
            bar.close()
        wire = sum(w for _, w in sent)
        done = await asyncio.to_thread(_rpc, stub.FinishPush,
                                       pb.FinishPushRequest(version=begun.version, wire_bytes=wire), timeout + 30)
        if done.state != pb.VersionState.VERSION_STATE_COMMITTED:
            raise PushError(f"version {begun.version} aborted: {done.reason}")
        result = PushResult(begun.version, list(begun.receivers), raw_bytes, wire, time.perf_counter() - t0,
                            sum(r for r, _ in sent))
        logger.info("pushed version %d to %d receivers: %.1f MB raw, %.1f MB sent (ratio %.3f), %.2f s",
                    result.version, len(result.receivers), raw_bytes / 1e6, wire / 1e6, result.ratio, result.seconds)
        return result
    finally:
        channel.close()


def push_weights(named_tensors, *, coordinator: str, version: int | None = None, token: str | None = None,
                 timeout: float = 120.0, progress: bool = True, config=None) -> PushResult:
    """Pushes named tensors as version `version` (None = the next) to every live receiver.

    Returns once the coordinator COMMITTED the version, i.e. every receiver holds it whole
    and verified; raises PushError otherwise (and then no receiver switched). Blocks;
    `push_weights_async` is the coroutine twin. `timeout` bounds the whole push.
    """
    from uzip_serve.p2p import sync

    # The process's one P2P event loop runs it, as it runs every endpoint of the facade.
    return sync.run(push_weights_async(named_tensors, coordinator=coordinator, version=version, token=token,
                                       timeout=timeout, progress=progress, config=config))


def _nbytes(spec) -> int:
    n = fmt.dtype_by_name(spec.dtype).itemsize
    for d in spec.shape:
        n *= d
    if spec.HasField("shard"):
        n //= spec.shard.world_size
    return n


def _progress_bar(enabled: bool, total: int, version: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=f"push v{version}", disable=not enabled, leave=False)


# ---- receiver side --------------------------------------------------------------------------

class WeightReceiver:
    """Receives versioned weights for a torch module or a dict of tensors.

    It listens for P2P transfers, registers with the coordinator (its expected tensors
    are the target's names, shapes and dtypes; `shards` maps a name to (dim, rank,
    world_size) for tensor-parallel slices, whose *full* shape is then registered),
    heartbeats, and applies a version only when the coordinator commits it. Read the
    weights inside `with receiver.reading() as version:` to never see a swap halfway.

    A dict target may hold `device="meta"` tensors: they declare what to expect without
    allocating it, and versions are then staged in host memory. A caller that copies each
    committed version elsewhere (the vLLM plugin) calls `release()` to drop it again.
    A receiver that joins after version N was committed keeps its own weights (version 0)
    until the next commit.
    """

    def __init__(self, target: torch.nn.Module | dict[str, torch.Tensor], *, coordinator: str, receiver_id: str,
                 token: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, shards: Mapping[str, tuple[int, int, int]] | None = None,
                 on_commit: Callable[[int, dict[str, torch.Tensor]], Any] | None = None, config=None):
        self.receiver_id = receiver_id
        self._coordinator, self._token = coordinator, token
        self._host, self._port, self._advertise = host, port, advertise_host or host
        self._module = target if isinstance(target, torch.nn.Module) else None
        self._tensors: dict[str, torch.Tensor] = dict(target.state_dict() if self._module else target)
        self._shards = dict(shards or {})
        self._on_commit = on_commit
        self._config = config
        self._lock = threading.RLock()
        self._staged: dict[int, dict[str, torch.Tensor]] = {}
        self.version = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch_after = 0
        self._listener = None
        self._accept_task = None
        self.last_error: str | None = None

    # -- lifecycle --
    def start(self) -> "WeightReceiver":
        from uzip_serve.coordinator import client
        from uzip_serve.p2p import sync, ucx

        self._listener = sync.run(ucx.listen(self._port, self._config))
        self.address = f"{self._advertise}:{self._listener.port}"
        self._channel, self._stub = client.connect(self._coordinator, token=self._token)
        self._register()
        self._accept_task = sync.run(self._start_accepting())
        for fn, name in ((self._heartbeat_loop, "heartbeat"), (self._watch_loop, "watch")):
            t = threading.Thread(target=fn, name=f"uzip-{name}-{self.receiver_id}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        from uzip_serve.p2p import loop

        if self._accept_task is not None:
            loop.ucx_loop().call_soon_threadsafe(self._accept_task.cancel)
        if self._listener is not None:
            loop.ucx_loop().call_soon_threadsafe(self._listener.close)
        self._channel.close()
        for t in self._threads:
            t.join(5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @contextmanager
    def reading(self):
        """Holds off any version swap while the caller reads the weights; yields the version."""
        with self._lock:
            yield self.version

    def release(self) -> None:
        """Drops the committed tensors of a dict target, keeping only their specs (meta tensors)."""
        with self._lock:
            self._tensors = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in self._tensors.items()}

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The committed tensors (for a dict target a new dict per version, never mutated)."""
        return self._tensors

    # -- coordinator --
    def _register(self):
        from uzip_serve.coordinator import pb

        expected = []
        for name, t in self._tensors.items():
            shape = list(t.shape)
            spec = pb.TensorSpec(name=name, dtype=_dtype_name(t))
            if name in self._shards:
                dim, rank, world = self._shards[name]
                shape[dim] *= world
                spec.shard.CopyFrom(pb.ShardSpec(dim=dim, rank=rank, world_size=world))
            spec.shape.extend(shape)
            expected.append(spec)
        resp = _rpc(self._stub.Register, pb.RegisterRequest(
            receiver_id=self.receiver_id, p2p_address=self.address, device_kind=self._device_kind(),
            device_vendor="nvidia" if self._device_kind() == "cuda" else "", expected=expected,
            codec_version=fmt.FORMAT_VERSION), 30)
        # Older commits were made without us: replaying them would only say so, once each.
        self._watch_after = max(self._watch_after, resp.committed_version)
        return resp

    def _receive_device(self):
        """Where a transfer lands: the targets' GPU when they all sit on one (CUDA end to end,
        no staging in host memory), else host memory (the cast to the targets comes after)."""
        devices = {t.device for t in self._tensors.values() if t.device.type != "meta"}
        dev = next(iter(devices)) if len(devices) == 1 else None
        return dev if dev is not None and dev.type == "cuda" else None

    def _device_kind(self) -> str:
        kind = next((t.device.type for t in self._tensors.values()), "cpu")
        return "cpu" if kind == "meta" else kind  # meta placeholders stage in host memory

    def _heartbeat_loop(self) -> None:
        from uzip_serve.coordinator import pb

        interval = 1.0
        while not self._stop.wait(interval):
            try:
                _rpc(self._stub.Heartbeat, pb.HeartbeatRequest(receiver_id=self.receiver_id,
                                                               serving_version=self.version), 5)
            except PushError as e:
                if e.code == "PERMISSION_DENIED":  # the coordinator forgot us: register again
                    try:
                        self._register()
                    except PushError:
                        pass
                logger.debug("heartbeat failed: %s", e)

    def _watch_loop(self) -> None:
        import grpc

        from uzip_serve.coordinator import pb

        seen = max(self.version, self._watch_after)
        while not self._stop.is_set():
            try:
                for ev in self._stub.WatchVersions(pb.WatchVersionsRequest(after_version=seen,
                                                                           receiver_id=self.receiver_id)):
                    seen = max(seen, ev.version)
                    if ev.state == pb.VersionState.VERSION_STATE_COMMITTED:
                        self._apply(ev.version)
                    elif ev.state == pb.VersionState.VERSION_STATE_ABORTED:
                        with self._lock:
                            self._staged.pop(ev.version, None)
            except grpc.RpcError:  # the coordinator restarted or the channel closed: watch again
                if self._stop.wait(0.5):
                    return

    def _apply(self, version: int) -> None:
        with self._lock:
            staged = self._staged.pop(version, None)
            for v in [v for v in self._staged if v < version]:
                del self._staged[v]
            if staged is None:
                if version > self.version:
                    logger.warning("%s: version %d committed without us; still serving %d", self.receiver_id,
                                   version, self.version)
                return
            if self._module is not None:
                with torch.no_grad():
                    for name, t in staged.items():
                        self._tensors[name].copy_(t)
            else:
                self._tensors = staged
            self.version = version
        logger.info("%s: now serving version %d", self.receiver_id, version)
        if self._on_commit:
            self._on_commit(version, staged)

    # -- data plane --
    async def _start_accepting(self):
        return asyncio.ensure_future(self._accept_loop())

    async def _accept_loop(self) -> None:
        while not self._stop.is_set():
            ep = await self._listener.accept()
            asyncio.ensure_future(self._handle(ep))

    async def _handle(self, ep) -> None:
        from uzip_serve import p2p
        from uzip_serve.coordinator import pb

        version, ok, error, wire, children = 0, False, "", 0, []
        try:
            raw_envelope = await ep.recv_bytes()
            envelope = pb.BeginPushResponse.FromString(raw_envelope)
            version = envelope.version
            for hop in envelope.plan:  # the receivers this one relays to, cut-through
                if hop.sender == self.receiver_id:
                    host, port = hop.p2p_address.rsplit(":", 1)
                    children.append(await p2p.connect(host, int(port), self._config))
                    await children[-1].send_bytes(raw_envelope)
            got = await ep.recv_tensors(forward=children, device=self._receive_device())
            wire = ep.last_stats.wire_bytes
            staged = self._check_and_cast(got)
            with self._lock:
                self._staged[version] = staged
            ok = True
        except Exception as e:  # noqa: BLE001 - reported to the coordinator, which aborts the push
            error = f"{type(e).__name__}: {e}"
            self.last_error = error
            logger.warning("%s: version %d failed: %s", self.receiver_id, version, error)
        finally:
            # On failure the children are aborted, not closed: a close would wait for them to
            # hang up (ucx.Endpoint.close), and they would only give up at their own deadline.
            for child in children:
                await child.close() if ok else child.abort()
            ep.abort() if not ok else await ep.close()
        if version:
            await asyncio.to_thread(self._report, version, ok, error, wire, envelope.deadline_unix_s)

    def _report(self, version: int, ok: bool, error: str, wire: int, deadline_unix_s: float = 0.0) -> None:
        """Tells the coordinator the outcome, retrying until the push's deadline: a report
        lost to a moment without the coordinator (just restarted, the channel still backing
        off) would leave the push waiting for us until it aborts at its deadline."""
        from uzip_serve.coordinator import pb

        request = pb.ReportPreparedRequest(receiver_id=self.receiver_id, version=version, ok=ok, error=error,
                                           wire_bytes=wire)
        give_up = max(deadline_unix_s, time.time() + 30)  # at least 30 s, whatever the clocks say
        while True:
            try:
                # wait_for_ready: wait for the channel to (re)connect instead of failing at once.
                _rpc(self._stub.ReportPrepared, request, max(1.0, give_up - time.time()), wait_for_ready=True)
                return
            except PushError as e:
                transient = e.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
                if not transient or time.time() >= give_up or self._stop.wait(0.2):
                    logger.warning("%s: could not report version %d: %s", self.receiver_id, version, e)
                    return

    def _check_and_cast(self, got: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if set(got) != set(self._tensors):
            missing, extra = set(self._tensors) - set(got), set(got) - set(self._tensors)
            raise ValueError(f"incomplete version: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
        out = {}
        for name, held in self._tensors.items():
            t = got[name]
            if t.shape != held.shape:
                raise ValueError(f"{name}: received shape {tuple(t.shape)}, holding {tuple(held.shape)}")
            device = t.device if held.device.type == "meta" else held.device
            out[name] = t.to(device=device, dtype=held.dtype)  # the cast comes after the lossless transfer
        return out
