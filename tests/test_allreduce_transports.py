"""The CPU ring's hop transports (uzip_serve/collectives/transports.py: ucx, tcp; gloo for
comparison), with real processes over 127.0.0.1:

- hops are bit-exact: messages of many sizes and tags, posted out of order, into buffers
  larger than the message; a message larger than its buffer is a CollectivePeerError;
- the compressed ring over each transport equals the reference ring bit for bit (2 and 3
  ranks; tests/test_allreduce.py runs 2, 3 and 4 ranks over the default transport);
- a peer that dies in the middle of an all-reduce gives the survivor a CollectivePeerError
  within the deadline, never a hang;
- close() leaves no thread behind, and a rank that never calls it still exits cleanly.
"""

from __future__ import annotations

import collections
import gc
import os
import socket
import time
import traceback

import pytest
import torch

TIMEOUT_S = 240
TRANSPORTS = ["gloo", "ucx", "tcp"]


def _have_ucxx() -> bool:
    try:
        import ucxx._lib.libucxx  # noqa: F401
    except ImportError:
        return False
    return True


def _params():
    return [pytest.param(t, marks=pytest.mark.skipif(t == "ucx" and not _have_ucxx(), reason="ucxx not installed"))
            for t in TRANSPORTS]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int):
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return dist


def _tasks() -> collections.Counter:
    """The process's threads by name (Python's, gloo's, UCX's C++ ones alike)."""
    names = collections.Counter()
    for t in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            with open(f"/proc/{os.getpid()}/task/{t}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:  # ended meanwhile
            pass
    return names


def _random(numel: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(numel, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 4, (numel,), generator=g))
    x = x.to(dtype)
    if numel >= 64:
        idx = torch.randint(0, numel, (6,), generator=g)
        x[idx] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -1e-42]).to(dtype)
    return x


# ---- inside the ranks ----


def _hops_and_ring(rank: int, world: int, port: int, transport: str, q) -> None:
    """Transport-level hops, then the compressed ring against the reference ring."""
    try:
        dist = _init(rank, world, port)
        from uzip_serve import collectives as C
        from uzip_serve.collectives.transports import CollectivePeerError

        problems = []
        if transport == "ucx":
            import ucxx._lib.libucxx  # noqa: F401 - its import starts one thread for the process's life
        tasks_before = _tasks()
        comm = C.build_communicator(config=C.RingConfig(compression="on", transport=transport, deadline_s=60,
                                                        sub_chunk_bytes=256 << 10, min_sub_chunk_bytes=64 << 10))
        tp = comm._engine.transport
        right, left = (rank + 1) % world, (rank - 1) % world
        # Hops: sizes from 0 bytes to 3 MB, receives posted in reverse tag order, buffers
        # larger than the messages; every byte compared.
        sizes = [0, 1, 7, 4096, 65537, 1 << 20, 3_000_001]
        g = torch.Generator().manual_seed(rank)
        sent = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in sizes]
        bufs = [torch.full((n + 100,), 0xAB, dtype=torch.uint8) for n in sizes]
        recvs = [tp.irecv(bufs[k], left, 1000 + k) for k in reversed(range(len(sizes)))]
        sends = [tp.isend(sent[k], right, 1000 + k) for k in range(len(sizes))]
        for w in recvs + sends:
            w.wait()
        g = torch.Generator().manual_seed(left)
        expect = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in sizes]
        for n, b, e in zip(sizes, bufs, expect):
            if not torch.equal(b[:n], e):
                problems.append(f"hop of {n} bytes: {int((b[:n] != e).sum())} bytes differ")
            if transport != "gloo" and not bool((b[n:] == 0xAB).all()):
                problems.append(f"hop of {n} bytes wrote past the message")
        # A message larger than the posted buffer: a typed error (gloo: its own RuntimeError).
        if transport != "gloo":
            small = tp.irecv(torch.empty(10, dtype=torch.uint8), left, 2000)
            big = tp.isend(torch.zeros(1000, dtype=torch.uint8), right, 2000)
            try:
                small.wait()
                problems.append("a 1000-byte message into a 10-byte buffer raised nothing")
            except CollectivePeerError:
                pass
            big.wait()
        # The ring, bit for bit.
        from benchmarks.allreduce_link import activations

        cases = [_random(n, d, 100 * rank + n) for d in (torch.bfloat16, torch.float32)
                 for n in (1, 3, 1000, 65536 + 3, (1 << 20) + 5)]
        cases.append(activations((4 << 20) + 6, rank, world, torch.bfloat16))
        for x in cases:
            out = comm.all_reduce(x)
            ref = C.reference_ring_all_reduce(x)
            if not torch.equal(out.view(-1).view(torch.uint8), ref.view(-1).view(torch.uint8)):
                problems.append(f"all_reduce of {x.numel()} x {x.dtype} differs from the reference ring")
        # reduce_scatter / all_gather ride the same transport
        y = _random(world * 4096, torch.float32, rank)
        parts = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(parts, y)
        want = C.ring_sum_reference(parts)[4096 * rank:4096 * (rank + 1)]
        if not torch.equal(comm.reduce_scatter(y).view(torch.uint8), want.view(torch.uint8)):
            problems.append("reduce_scatter differs from ring_sum_reference")
        del recvs, sends, tp  # works hold their UCX requests, which hold the context
        if transport != "gloo":
            del small, big
        comm.close()
        comm.close()  # idempotent
        gc.collect()
        time.sleep(0.2)
        left = _tasks() - tasks_before
        if left:
            problems.append(f"threads left after close(): {dict(left)}")
        dist.destroy_process_group()
        q.put((rank, "; ".join(problems)))
    except BaseException:  # noqa: BLE001
        q.put((rank, traceback.format_exc()))


def _dies_mid_collective(rank: int, world: int, port: int, transport: str, q) -> None:
    """Rank 1 exits after its first compressed sub-chunk; rank 0 must raise in time."""
    try:
        _init(rank, world, port)
        from uzip_serve import collectives as C
        from uzip_serve.collectives.transports import CollectivePeerError

        deadline = 10.0
        comm = C.build_communicator(config=C.RingConfig(compression="on", transport=transport, deadline_s=deadline,
                                                        sub_chunk_bytes=128 << 10, min_sub_chunk_bytes=64 << 10))
        x = _random(4 << 20, torch.bfloat16, rank)
        comm.all_reduce(x[:1000])  # connections up
        if rank == 1:
            encode = comm.codec.encode_into
            calls = []

            def dying_encode(src, out):
                calls.append(1)
                if len(calls) > 2:
                    os._exit(3)
                return encode(src, out)

            comm.codec.encode_into = dying_encode
            comm.all_reduce(x)
            q.put((rank, "rank 1 survived its own death"))
            return
        t0 = time.monotonic()
        try:
            comm.all_reduce(x)
            result = "the all-reduce finished although its peer died"
        except CollectivePeerError as e:
            took = time.monotonic() - t0
            result = "" if took < deadline + 5 else f"the error came after {took:.1f} s ({e})"
        except Exception as e:  # noqa: BLE001
            result = f"an untyped error: {type(e).__name__}: {e}"
        q.put((rank, result))
        q.close()
        q.join_thread()
        os._exit(0)  # the gloo group is broken too; leave without its teardown
    except BaseException:  # noqa: BLE001
        q.put((rank, traceback.format_exc()))


def _exit_without_close(rank: int, world: int, port: int, transport: str, q) -> None:
    """Builds a communicator, uses it, never closes it: the interpreter's exit must be clean."""
    dist = _init(rank, world, port)
    from uzip_serve import collectives as C

    comm = C.build_communicator(config=C.RingConfig(compression="on", transport=transport))
    comm.all_reduce(_random(100000, torch.bfloat16, rank))
    dist.barrier()
    q.put((rank, ""))
    from benchmarks.rank_exit import release_process_groups

    release_process_groups()


# ---- the tests ----


def _spawn(target, world: int, transport: str, *, expect_exit: dict | None = None):
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, transport, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        want = world if expect_exit is None else world - len(expect_exit)
        for _ in range(want):
            try:
                rank, problem = q.get(timeout=TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"no answer within {TIMEOUT_S} s (exit codes {[p.exitcode for p in procs]})")
            results[rank] = problem
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()
    return results, [p.exitcode for p in procs]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("transport", _params())
def test_hops_bit_exact_and_ring_matches_reference(transport, world):
    results, codes = _spawn(_hops_and_ring, world, transport)
    problems = [f"rank {r}: {p}" for r, p in sorted(results.items()) if p]
    assert not problems, "\n".join(problems)
    assert codes == [0] * world


@pytest.mark.parametrize("transport", [t for t in _params() if t.values[0] != "gloo"])
def test_dead_peer_is_a_typed_error_within_the_deadline(transport):
    results, codes = _spawn(_dies_mid_collective, 2, transport, expect_exit={1: 3})
    assert results.get(0) == "", results
    assert codes[1] == 3, codes


@pytest.mark.parametrize("transport", [t for t in _params() if t.values[0] != "gloo"])
def test_exit_without_close_is_clean(transport):
    for _ in range(3):  # the gloo abort at exit this guards against came about every other run
        results, codes = _spawn(_exit_without_close, 2, transport)
        assert codes == [0, 0], codes
