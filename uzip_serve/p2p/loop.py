"""The one event loop per process on which every UCX operation runs.

ucxx ties its progress and, in the thread progress modes, its Python futures to the
event loop that first used it. Running every endpoint of a process on one dedicated
loop (in a daemon thread) lets callers use any loop they like, `asyncio.run` as often
as they like, or no loop at all (the sync facade).
"""

from __future__ import annotations

import asyncio
import functools
import threading

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def ucx_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="uzip-p2p-loop", daemon=True).start()
        return _loop


def use_running_loop() -> None:
    """Makes the calling coroutine's loop this process's UCX loop: its transfers then run
    without the two thread hops of a call from another loop (~0.1 ms each measured on the
    H200's host, a third of a 256 MiB GPU-to-GPU transfer). For an application with one
    long-lived loop; call it before the first endpoint or listener, and keep the loop running
    while P2P is used (one `asyncio.run` per transfer would leave UCX on a closed loop).
    Plain threads may still use the sync facade: their calls hop onto this loop."""
    global _loop
    running = asyncio.get_running_loop()
    with _lock:
        if _loop is not None and _loop is not running:
            raise RuntimeError("the P2P loop is already another event loop (an endpoint, listener or sync "
                               "call came first): call use_running_loop() before any of them")
        _loop = running


def on_ucx_loop(coro, spin_s: float = 0.0):
    """An awaitable for `coro` run on the UCX loop (the coroutine itself when already there).
    `spin_s`: first wait up to that long without sleeping (TransportConfig.caller_spin_s)."""
    loop = ucx_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return coro
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    if spin_s > 0 and _spin_wait() is not None:
        return _spin_then_await(fut, spin_s)
    return asyncio.wrap_future(fut)


def run(coro, timeout: float | None = None, spin_s: float = 0.0):
    """Runs `coro` on the UCX loop from a plain thread and waits for its result."""
    fut = asyncio.run_coroutine_threadsafe(coro, ucx_loop())
    if spin_s > 0 and _spin_wait() is not None:
        _spin(fut, spin_s)
    return fut.result(timeout)


def _spin(fut, spin_s: float) -> None:
    """Waits for `fut` up to spin_s in C, without the GIL and without sleeping: a result
    that comes within that time is seen without a thread wake-up (~0.1-0.2 ms measured in
    the H200's VM). The caller's thread (and its event loop, if any) is held that long."""
    flag = bytearray(1)
    fut.add_done_callback(lambda _: flag.__setitem__(0, 1))
    _spin_wait()(flag, spin_s)


async def _spin_then_await(fut, spin_s: float):
    _spin(fut, spin_s)
    if fut.done():
        return fut.result()
    return await asyncio.wrap_future(fut)


@functools.cache
def _spin_wait():
    """spin_wait from the C extension; None (and no spinning) where it was not built."""
    try:
        from uzip_serve.p2p._spin import spin_wait
    except ImportError:
        return None
    return spin_wait


def cancel_quietly(futures) -> None:
    """Cancels the futures not done yet, and retrieves whatever they end with, so that
    asyncio logs no "exception was never retrieved" for requests abandoned after an error."""
    for f in futures:
        if not f.done():
            f.cancel()
        f.add_done_callback(_retrieve)


def _retrieve(fut) -> None:
    if not fut.cancelled():
        fut.exception()


def call_soon(fn, *args) -> None:
    """Calls fn on the UCX loop: directly when already there, else at its next turn."""
    loop = ucx_loop()
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if here:
        fn(*args)
    else:
        loop.call_soon_threadsafe(fn, *args)
