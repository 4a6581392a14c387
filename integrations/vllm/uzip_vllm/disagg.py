"""1 prefill + 1 decode vLLM instance behind a small proxy, with `UzipConnector` between them.

    uzip disagg up --model DIR [--port 8000] [--tp 1] [--compression auto]

starts the decode instance (kv_consumer, KV listener), the prefill instance (kv_producer) and
the proxy; Ctrl-C or SIGTERM stops all of them. Clients talk to the proxy's
`/v1/completions` (streaming or not) as to one vLLM server.

Per request the proxy draws a transfer id and sends the request to both instances at once:
to prefill with `max_tokens=1` and to decode unchanged, both with
`kv_transfer_params={"uzip": {"xfer_id": ...}}`. The decode instance waits (asynchronously,
bounded by `load_timeout_s`) for the prefill's KV and then decodes; if the KV does not come,
vLLM's kv_load_failure_policy recomputes or fails the request. The proxy does not hold the
request back for the prefill response, so the prefill's HTTP round trip is off the TTFT path.

Routes besides the OpenAI ones: `GET /uzip/disagg/stats` (proxy counters and each worker's
connector counters), `GET /uzip/disagg/requests` (per-request timings joined with the
workers' per-transfer timings: the TTFT split).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import glob
import json
import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

logger = logging.getLogger("uzip_vllm.disagg")


def kv_config(role: str, **extra) -> str:
    """The `--kv-transfer-config` JSON for one side."""
    return json.dumps({"kv_connector": "UzipConnector", "kv_role": role,
                       "kv_load_failure_policy": extra.pop("policy", "recompute"),
                       "kv_connector_extra_config": {k: v for k, v in extra.items() if v is not None}})


# ---- the proxy -------------------------------------------------------------------------------------

class Proxy:
    """Fans each completion out to prefill (max_tokens=1) and decode; streams decode's answer."""

    def __init__(self, prefill_url: str, decode_url: str, stats_dir: str | None = None):
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.stats_dir = stats_dir
        self.counters = {"requests": 0, "prefill_errors": 0, "decode_errors": 0}
        self.records: dict[str, dict] = {}
        self.compression: str | None = None  # per-request override sent to the prefill side
        self._session = None

    async def _client(self):
        import aiohttp

        if self._session is None:
            # A fresh connection per request: a kept-alive one that the server closes as idle
            # just when it is reused fails the request ("Server disconnected"; seen once in a
            # benchmark run, where the decode side then waited out its load timeout). A connect
            # costs well under a millisecond next to a prefill.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                                  connector=aiohttp.TCPConnector(limit=0, force_close=True))
        return self._session

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.passthrough)
        app.router.add_get("/health", self.passthrough)
        app.router.add_get("/uzip/disagg/stats", self.stats)
        app.router.add_get("/uzip/disagg/requests", self.requests)
        app.router.add_post("/uzip/disagg/config", self.set_config)

        async def close(_app):
            if self._session is not None:
                await self._session.close()

        app.on_cleanup.append(close)
        return app

    async def passthrough(self, request):
        from aiohttp import web

        s = await self._client()
        async with s.get(self.decode_url + request.path) as r:
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    async def _prefill(self, body: dict, rec: dict) -> None:
        s = await self._client()
        try:
            async with s.post(self.prefill_url + "/v1/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}")
            rec["t_prefill_done"] = time.time()
        except Exception as e:  # noqa: BLE001 - decode recomputes or fails (its policy)
            self.counters["prefill_errors"] += 1
            rec["prefill_error"] = str(e)[:200]
            logger.warning("prefill failed for %s: %s", rec["xfer_id"], e)

    async def completions(self, request):
        from aiohttp import web

        body = await request.json()
        xfer_id = uuid.uuid4().hex
        params = {"uzip": {"xfer_id": xfer_id}}
        if self.compression:
            params["uzip"]["compression"] = self.compression
        rec = {"xfer_id": xfer_id, "t_arrival": time.time(), "compression": self.compression}
        self.records[xfer_id] = rec
        while len(self.records) > 5000:
            self.records.pop(next(iter(self.records)))
        self.counters["requests"] += 1
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        pre.update(max_tokens=1, kv_transfer_params=params)
        pre.pop("max_completion_tokens", None)
        prefill_task = asyncio.ensure_future(self._prefill(pre, rec))
        dec = {**body, "kv_transfer_params": params}
        s = await self._client()
        try:
            async with s.post(self.decode_url + "/v1/completions", json=dec) as r:
                if not body.get("stream"):
                    data = await r.read()
                    rec["t_first_token"] = rec["t_done"] = time.time()
                    if r.status != 200:
                        self.counters["decode_errors"] += 1
                    return web.Response(body=data, status=r.status, content_type="application/json")
                resp = web.StreamResponse(status=r.status, headers={"content-type": r.headers.get(
                    "content-type", "text/event-stream")})
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    if "t_first_token" not in rec:
                        rec["t_first_token"] = time.time()
                    await resp.write(chunk)
                rec["t_done"] = time.time()
                await resp.write_eof()
                return resp
        except Exception:
            self.counters["decode_errors"] += 1
            raise
        finally:
            # Not awaited for the answer; bounded by the prefill's own request lifetime.
            prefill_task.add_done_callback(lambda _t: None)

    async def set_config(self, request):
        """`{"compression": "auto"|"on"|"off"|null}`: the sender's compression for later requests."""
        from aiohttp import web

        body = await request.json()
        c = body.get("compression")
        if c not in (None, "auto", "on", "off"):
            return web.json_response({"error": "compression must be auto, on, off or null"}, status=400)
        self.compression = c
        return web.json_response({"compression": c})

    def _worker_stats(self) -> dict:
        out = {}
        if self.stats_dir:
            for f in sorted(glob.glob(os.path.join(self.stats_dir, "*.json"))):
                try:
                    out[Path(f).stem] = json.loads(Path(f).read_text())
                except (OSError, ValueError):
                    pass
        return out

    async def stats(self, request):
        from aiohttp import web

        workers = self._worker_stats()
        return web.json_response({"proxy": self.counters,
                                  "workers": {k: v.get("counters", {}) for k, v in workers.items()}})

    async def requests(self, request):
        """Each request's timings (epoch seconds), joined with the workers' transfer timings."""
        from aiohttp import web

        workers = self._worker_stats()
        out = []
        for xfer_id, rec in self.records.items():
            row = dict(rec)
            for name, w in workers.items():
                x = w.get("xfers", {}).get(xfer_id)
                if x:
                    row[name.split("-")[0]] = x
            out.append(row)
        return web.json_response(out)


async def serve_proxy(proxy: Proxy, host: str, port: int, stop: asyncio.Event) -> None:
    from aiohttp import web

    runner = web.AppRunner(proxy.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


# ---- the launcher ----------------------------------------------------------------------------------

def start_pair(stack: ExitStack, model: str, workdir: Path, *, tp: int = 1, compression: str = "auto",
               kv_port: int | None = None, decode_host: str = "127.0.0.1", prefill_host: str = "127.0.0.1",
               prefill_wrap: list[str] = (), decode_wrap: list[str] = (), max_model_len: int = 1024,
               extra_extra: dict | None = None, policy: str = "recompute", timeout: float = 900,
               vllm_args: list[str] = (), env_extra: dict | None = None) -> "Pair":
    """Starts decode and prefill (concurrently) and waits for both. `*_wrap` prefixes a
    command (e.g. `ip netns exec X`). The stack stops both (their whole process groups).
    The decode instance runs without prefix caching: every prompt's KV comes from the prefill
    instance anyway (which keeps its prefix cache), and without it decode accepts
    sliding-window layers trimmed to their window (kv_connector.REPLY_WINDOW_TRIM)."""
    from uzip_vllm.demo import VLLM_ENV, free_port, spawn, wait_http

    if tp not in (1, 2):
        raise ValueError("--tp must be 1 or 2 on this launcher (both instances use the same TP)")

    kv_port = kv_port or free_port()
    stats_dir = str(workdir / "kv-stats")
    os.makedirs(stats_dir, exist_ok=True)
    extra = {"stats_dir": stats_dir, "compression": compression, **(extra_extra or {})}
    env = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else "0-1", **(env_extra or {})}
    env = {k: v for k, v in env.items() if v is not None}  # None in env_extra: leave the variable unset
    procs = []
    urls = []
    for role, host, wrap, cfg in (
            ("decode", decode_host, decode_wrap, kv_config("kv_consumer", listen=f"{decode_host}:{kv_port}",
                                                            policy=policy, **extra)),
            ("prefill", prefill_host, prefill_wrap, kv_config("kv_producer", peer=f"{decode_host}:{kv_port}",
                                                               policy=policy, **extra))):
        port = free_port()
        args = [*wrap, sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port", str(port),
                "--host", host, "--enforce-eager", "--max-model-len", str(max_model_len),
                "--tensor-parallel-size", str(tp), "--seed", "0", "--kv-transfer-config", cfg,
                *(["--no-enable-prefix-caching"] if role == "decode" else []), *vllm_args]  # the caller's last
        log = workdir / f"{role}.log"
        procs.append((spawn(stack, args, log, env), log))
        urls.append(f"http://{host}:{port}")
    for (proc, log), url in zip(procs, urls):
        wait_http(url + "/health", proc, log, timeout)
    return Pair(prefill_url=urls[1], decode_url=urls[0], stats_dir=stats_dir, prefill_proc=procs[1][0],
                decode_proc=procs[0][0])


@dataclasses.dataclass
class Pair:
    prefill_url: str
    decode_url: str
    stats_dir: str
    prefill_proc: Any
    decode_proc: Any


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="uzip disagg up", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the converted Gemma-3-270M)")
    ap.add_argument("--host", default="127.0.0.1", help="proxy address")
    ap.add_argument("--port", type=int, default=8000, help="proxy port")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of both instances")
    ap.add_argument("--compression", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--policy", choices=["recompute", "fail"], default="recompute",
                    help="vLLM kv_load_failure_policy on the decode side")
    ap.add_argument("--load-timeout", type=float, default=30.0, help="decode waits at most this long for KV")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-port", type=int, default=None, help="decode's KV listener port (default: free)")
    ap.add_argument("--decode-host", default="127.0.0.1")
    ap.add_argument("--prefill-host", default="127.0.0.1")
    ap.add_argument("--prefill-wrap", default="", help="command prefix for prefill (e.g. 'ip netns exec A')")
    ap.add_argument("--decode-wrap", default="", help="command prefix for decode")
    ap.add_argument("--workdir", default=None, help="logs and stats (default: a temp dir)")
    ap.add_argument("--ready-file", default=None, help="written with the proxy URL once everything is up")
    ap.add_argument("vllm_args", nargs="*", help="after --: extra `vllm serve` arguments for both instances")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model = args.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
        from benchmarks import realdata

        model = str(realdata.gemma_dir())
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="uzip-disagg-"))
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with ExitStack() as stack:
        try:
            t0 = time.perf_counter()
            print(f"starting prefill + decode ({model}, TP={args.tp}, compression {args.compression}); "
                  f"logs in {workdir}", flush=True)
            pair = start_pair(
                stack, model, workdir, tp=args.tp, compression=args.compression, kv_port=args.kv_port,
                decode_host=args.decode_host, prefill_host=args.prefill_host,
                prefill_wrap=args.prefill_wrap.split(), decode_wrap=args.decode_wrap.split(),
                max_model_len=args.max_model_len, policy=args.policy,
                extra_extra={"load_timeout_s": args.load_timeout}, vllm_args=args.vllm_args)
            proxy = Proxy(pair.prefill_url, pair.decode_url, pair.stats_dir)
            url = f"http://{args.host}:{args.port}"
            print(f"prefill {pair.prefill_url}, decode {pair.decode_url}; proxy {url} "
                  f"(up in {time.perf_counter() - t0:.0f} s). Ctrl-C stops everything.", flush=True)
            stop = asyncio.Event()

            async def run():
                task = asyncio.ensure_future(serve_proxy(proxy, args.host, args.port, stop))
                await asyncio.sleep(0.3)
                if args.ready_file:
                    Path(args.ready_file).write_text(url)
                await task

            asyncio.run(run())
        except KeyboardInterrupt:
            print("\nstopping prefill, decode and the proxy", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
