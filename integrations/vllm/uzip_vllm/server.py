"""API-server side: apply each committed version whole, and say which version answered.

`VersionGate` (ASGI middleware) admits generation requests and stamps each response with the
header `X-Uzip-Weight-Version`. A swap closes the gate, waits until the requests it admitted
have finished (streams included), then, with vLLM's scheduler paused (which also drops the
prefix cache, whose KV came from the old weights), pins the version on every worker, loads it
through vLLM's weight-update verbs, and reopens. So no request ever runs on two versions, and
the stamped version is the one that produced every token of the response. vLLM's own
per-token `weight_versions` spans are set too (`update_weight_version`).

A version is applied only if every worker holds it; one committed without this server (it
joined later) is skipped, and the old version keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from uzip_vllm import plugin

logger = logging.getLogger("uzip_vllm")

HEADER = b"x-uzip-weight-version"
GATED_PREFIXES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/", "/generate")


class VersionState:
    """What this server serves, and the admission gate around swaps."""

    def __init__(self) -> None:
        self.version = 0
        self.inflight = 0
        self.swapping = False
        self.cond = asyncio.Condition()
        self.swaps: list[dict[str, Any]] = []
        self.last_error: str | None = None
        self.coordinator_committed = 0

    async def enter(self) -> int:
        async with self.cond:
            await self.cond.wait_for(lambda: not self.swapping)
            self.inflight += 1
            return self.version

    async def leave(self) -> None:
        async with self.cond:
            self.inflight -= 1
            self.cond.notify_all()

    async def close(self) -> None:
        async with self.cond:
            self.swapping = True
            await self.cond.wait_for(lambda: self.inflight == 0)

    async def open(self) -> None:
        async with self.cond:
            self.swapping = False
            self.cond.notify_all()


STATE = VersionState()


class VersionGate:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(GATED_PREFIXES):
            return await self.app(scope, receive, send)
        version = await STATE.enter()

        async def send_stamped(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER, str(version).encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_stamped)
        finally:  # after the last body chunk: a stream counts as in flight until it ends
            await STATE.leave()


class Swapper:
    """Watches the coordinator and applies each new committed version."""

    def __init__(self, engine_client, cfg: dict[str, Any]) -> None:
        self.engine = engine_client
        self.cfg = cfg
        self.queue: asyncio.Queue[int] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, name="uzip-version-watch", daemon=True).start()
        self.task = asyncio.ensure_future(self._run())

    def _watch(self) -> None:
        import grpc

        from uzip_serve.coordinator import client, pb
        from uzip_vllm.weight_transfer import read_token

        channel, stub = client.connect(self.cfg["coordinator"], token=read_token(self.cfg.get("token_file")))
        after = None
        while not self.stop.is_set():
            try:
                if after is None:  # versions committed before we joined were made without our workers
                    after = stub.GetState(pb.GetStateRequest(), timeout=10).committed_version
                    self.loop.call_soon_threadsafe(setattr, STATE, "coordinator_committed", after)
                for ev in stub.WatchVersions(pb.WatchVersionsRequest(after_version=after)):
                    after = max(after, ev.version)
                    if ev.state == pb.VersionState.VERSION_STATE_COMMITTED:
                        self.loop.call_soon_threadsafe(setattr, STATE, "coordinator_committed", ev.version)
                        self.loop.call_soon_threadsafe(self.queue.put_nowait, ev.version)
            except grpc.RpcError as e:  # coordinator restart or network: watch again from where we were
                logger.debug("uzip: watch interrupted: %s", e)
                if self.stop.wait(0.5):
                    break
        channel.close()

    async def _run(self) -> None:
        while True:
            version = await self.queue.get()
            while not self.queue.empty():  # several commits queued: only the newest matters
                version = max(version, self.queue.get_nowait())
            if version <= STATE.version:
                continue
            try:
                await self.swap(version)
            except Exception as e:  # noqa: BLE001 - keep serving; the error is visible on /uzip/version
                STATE.last_error = f"version {version}: {type(e).__name__}: {e}"
                logger.exception("uzip: could not apply version %d; still serving %d", version, STATE.version)

    async def swap(self, version: int) -> None:
        t0 = time.perf_counter()
        pinned = await self.engine.collective_rpc("uzip_pin", args=(version, 30.0))
        if any(v != version for v in pinned):
            await self.engine.collective_rpc("uzip_unpin")
            newest = max(pinned)
            if newest > version and newest > STATE.version:
                self.queue.put_nowait(newest)  # a newer commit overtook this one: take that
            else:
                logger.warning("uzip: version %d was committed without this server's workers (they hold %s); "
                               "still serving %d", version, pinned, STATE.version)
            return
        await STATE.close()
        t_drained = time.perf_counter()
        try:
            await self.engine.pause_generation(mode="wait", clear_cache=True)
            try:
                await self.engine.collective_rpc("uzip_apply", args=(version,))
                await self.engine.update_weight_version(str(version))
                STATE.version = version
                STATE.last_error = None
            finally:
                await self.engine.resume_generation()
        finally:
            await STATE.open()
        done = time.perf_counter()
        STATE.swaps.append({"version": version, "drain_s": round(t_drained - t0, 4),
                            "apply_s": round(done - t_drained, 4), "unix_s": time.time()})
        del STATE.swaps[:-20]
        logger.info("uzip: now serving version %d (drain %.2f s, apply %.2f s)", version, t_drained - t0,
                    done - t_drained)


router = APIRouter()


@router.get("/uzip/version")
async def uzip_version(request: Request) -> JSONResponse:
    body = {"version": STATE.version, "coordinator": (plugin.SERVER_CONFIG or {}).get("coordinator"),
            "coordinator_committed": STATE.coordinator_committed, "swapping": STATE.swapping,
            "last_error": STATE.last_error, "recent_swaps": STATE.swaps[-5:]}
    engine = getattr(request.app.state, "uzip_engine", None)
    if engine is not None and (plugin.SERVER_CONFIG or {}).get("coordinator"):
        body["workers"] = await engine.collective_rpc("uzip_status")
    return JSONResponse(body)


@router.get("/uzip/allreduce")
async def uzip_allreduce(request: Request) -> JSONResponse:
    """Per worker: all-reduces on the compressed ring, on the native path, bytes raw and on the wire."""
    engine = getattr(request.app.state, "uzip_engine", None)
    if engine is None:
        return JSONResponse({"error": "no engine"}, status_code=404)
    return JSONResponse({"mode": plugin.SERVER_CONFIG.get("allreduce"),
                         "workers": await engine.collective_rpc("uzip_counters")})


@router.get("/uzip/pipeline")
async def uzip_pipeline(request: Request) -> JSONResponse:
    """Per worker: PP activation transfers on the uzip path (uzip_vllm.pipeline), how many compressed,
    bytes raw and on the wire."""
    engine = getattr(request.app.state, "uzip_engine", None)
    if engine is None:
        return JSONResponse({"error": "no engine"}, status_code=404)
    return JSONResponse({"workers": await engine.collective_rpc("uzip_pipeline_counters")})


class UzipEndpointPlugin:
    """A `vllm.endpoint_plugins` plugin; added by `plugin.register` only with `--comm-plugin uzip`."""

    name = "uzip"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)
        app.add_middleware(VersionGate)

    async def init_state(self, engine_client, state, args) -> None:
        cfg = plugin.SERVER_CONFIG
        state.uzip_engine = engine_client
        if engine_client is None or not cfg or not cfg.get("coordinator"):
            return
        swapper = Swapper(engine_client, cfg)
        swapper.start()
        state.uzip_swapper = swapper
