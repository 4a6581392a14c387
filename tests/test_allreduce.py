"""The compressed ring all-reduce, with real processes: 2, 3 and 4 ranks over gloo on
127.0.0.1 (torch.multiprocessing spawn).

Lossless means bitwise: every result is compared as bytes with the uncompressed
reference ring (`reference_ring_all_reduce`, distributed) and with the same sums done
in one process (`ring_sum_reference`), and across ranks. Data: random tensors with
NaN/inf/-0/subnormals mixed in, and real Gemma-3 activations (benchmarks/realdata.py)
in bf16 and fp32, from 1 element to 64 MiB (64 MiB with 2 ranks only).

Each world size spawns its ranks once and runs every case in them (spawning costs
seconds on a 2-core machine); every rank reports each case, and a failing test shows
all ranks' messages.
"""

from __future__ import annotations

import hashlib
import socket
import traceback

import pytest
import torch

RANDOM_ELEMS = [1, 2, 3, 7, 1000, 65536 + 3, (1 << 20) + 5]
REAL_BYTES = [2, 8194, 256 << 10, (4 << 20) + 6]
BIG_BYTES = 64 << 20  # 2 ranks only
TIMEOUT_S = 600


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _random(numel: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int64).to(dtype)
    x = torch.randn(numel, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 4, (numel,), generator=g)
    x = x.to(dtype)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -1e-42]).to(dtype)
    if numel >= 64:  # a few specials at seeded places
        idx = torch.randint(0, numel, (len(specials),), generator=g)
        x[idx] = specials
    return x


# ---- inside each rank ----

class _Cases:
    def __init__(self, rank: int, world: int):
        import torch.distributed as dist

        from uzip_serve import collectives as C

        self.C, self.dist = C, dist
        self.rank, self.world = rank, world
        self.results: dict[str, str] = {}  # case -> "" (pass) or what went wrong

    def _gather(self, x):
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self.dist.all_gather(parts, x)
        return parts

    def _same_on_all_ranks(self, out) -> bool:
        digest = torch.tensor(list(hashlib.sha256(_bits(out).numpy().tobytes()).digest()), dtype=torch.uint8)
        return all(torch.equal(d, digest) for d in self._gather(digest))

    def case(self, name: str, fn) -> None:
        try:
            problem = fn()
            self.results[name] = problem or ""
        except Exception:  # noqa: BLE001 - reported with the rank
            self.results[name] = traceback.format_exc()

    def check_all_reduce(self, comm, x, *, expect: str = "compressed") -> str:
        before = comm.stats.__dict__.copy()
        out = comm.all_reduce(x)
        delta = {k: v - before[k] for k, v in comm.stats.__dict__.items()}
        problems = []
        if delta.get(expect) != 1:
            problems.append(f"expected the {expect} path, counters moved {delta}")
        if out.dtype != x.dtype or out.shape != x.shape:
            problems.append(f"result is {out.dtype} {tuple(out.shape)}, input {x.dtype} {tuple(x.shape)}")
        if expect in ("compressed", "ring"):
            ref = self.C.reference_ring_all_reduce(x)
            local = self.C.ring_sum_reference(self._gather(x))
            if not torch.equal(_bits(ref), _bits(local)):
                problems.append("reference ring differs from ring_sum_reference")
            if not torch.equal(_bits(out), _bits(ref)):
                n = int((_bits(out) != _bits(ref)).sum())
                problems.append(f"{expect} result differs from the reference ring in {n} bytes")
        if not self._same_on_all_ranks(out):
            problems.append("ranks got different bits")
        return "; ".join(problems)

    def run(self) -> dict[str, str]:
        C, rank, world = self.C, self.rank, self.world
        from benchmarks.allreduce_link import activations

        on = C.build_communicator(config=C.RingConfig(compression="on", sub_chunk_bytes=256 << 10,
                                                      min_sub_chunk_bytes=64 << 10))
        for dtype in (torch.bfloat16, torch.float32, torch.float16, torch.int32):
            for numel in RANDOM_ELEMS:
                x = _random(numel, dtype, seed=1000 * rank + numel)
                self.case(f"random/{dtype}/{numel}", lambda: self.check_all_reduce(on, x))
        x2d = _random(6 * 35, torch.bfloat16, seed=rank).view(6, 35)
        self.case("random/2d", lambda: self.check_all_reduce(on, x2d))
        sizes = REAL_BYTES + ([BIG_BYTES] if world == 2 else [])
        for dtype in (torch.bfloat16, torch.float32):
            for nbytes in sizes:
                x = activations(nbytes, rank, world, dtype)
                self.case(f"real/{dtype}/{nbytes}", lambda: self.check_all_reduce(on, x))

        self.case("counters", lambda: self._counters(on))
        self.case("adaptive", self._adaptive)
        self.case("verbs", lambda: self._verbs(on))
        self.case("errors/dtype", lambda: self._bad_dtype(on))
        self.case("errors/validate", self._mismatch_validated)
        if world == 2:  # last: a mismatch caught by the hop headers leaves messages behind
            self.case("errors/header", lambda: self._mismatch_header(on))
        return self.results

    def _counters(self, comm) -> str:
        before = self.C.counters()["compressed"]
        for _ in range(3):
            comm.all_reduce(_random(5000, torch.float32, seed=self.rank))
        moved = self.C.counters()["compressed"] - before
        return "" if moved == 3 else f"the compressed counter moved by {moved}, not 3"

    def _adaptive(self) -> str:
        C = self.C
        problems = []
        fixed = C.build_communicator(config=C.RingConfig(compression="auto", min_bytes=64 << 10))
        problems.append(self.check_all_reduce(fixed, _random(1000, torch.float32, self.rank), expect="native"))
        problems.append(self.check_all_reduce(fixed, _random(1 << 16, torch.bfloat16, self.rank),
                                              expect="compressed"))
        ring = C.build_communicator(config=C.RingConfig(compression="off", fallback="ring"))
        problems.append(self.check_all_reduce(ring, _random(70001, torch.bfloat16, self.rank), expect="ring"))
        # The model calibrates on first use; whatever it picks, every rank picks the same.
        auto = C.build_communicator(config=C.RingConfig(compression="auto"))
        x = _random(1 << 19, torch.bfloat16, self.rank)
        out = auto.all_reduce(x)
        if auto.stats.compressed + auto.stats.native != 1 or auto.policy.m is None:
            problems.append(f"auto mode: counters {auto.stats}, measured {auto.policy.m}")
        if not self._same_on_all_ranks(out):
            problems.append("auto mode: ranks got different bits")
        picks = self._gather(torch.tensor([auto.stats.compressed]))
        if len({int(p) for p in picks}) != 1:
            problems.append(f"ranks took different paths: {picks}")
        # A band that covers every size: each size class is tried both ways, then settles on
        # what the ranks measured, and every rank follows the same sequence of paths.
        trial = C.build_communicator(config=C.RingConfig(compression="auto", explore_band=100.0, explore_calls=2))
        x = _random(1 << 18, torch.bfloat16, self.rank)
        paths = []
        for _ in range(6):
            before = trial.stats.compressed
            out = trial.all_reduce(x)
            paths.append(int(trial.stats.compressed - before))
            if not self._same_on_all_ranks(out):
                problems.append("trial: ranks got different bits")
        if paths[:4] != [1, 0, 1, 0] or len(set(paths[4:])) != 1:
            problems.append(f"trial: paths {paths}, expected compressed/native alternating, then one")
        seqs = self._gather(torch.tensor(paths))
        if any(not torch.equal(s, seqs[0]) for s in seqs):
            problems.append(f"trial: ranks took different paths: {[s.tolist() for s in seqs]}")
        return "; ".join(p for p in problems if p)

    def _verbs(self, comm) -> str:
        problems = []
        x = _random(self.world * 3 * 5, torch.float32, seed=7 + self.rank).view(self.world * 3, 5)
        rs = comm.reduce_scatter(x)
        want = self.C.ring_sum_reference(self._gather(x))[3 * self.rank:3 * (self.rank + 1)]
        if rs.shape != (3, 5) or not torch.equal(_bits(rs), _bits(want)):
            problems.append(f"reduce_scatter: got {tuple(rs.shape)}, bits differ or shape wrong")
        y = _random(4 * 3, torch.bfloat16, seed=9 + self.rank).view(4, 3)
        ag = comm.all_gather(y)
        if ag.shape != (4 * self.world, 3) or not torch.equal(_bits(ag), _bits(torch.cat(self._gather(y)))):
            problems.append(f"all_gather: got {tuple(ag.shape)}, bits differ or shape wrong")
        return "; ".join(problems)

    def _expect_error(self, fn, *words) -> str:
        try:
            fn()
        except self.C.CollectiveError as e:
            missing = [w for w in words if w not in str(e)]
            return f"message {str(e)!r} lacks {missing}" if missing else ""
        return "no CollectiveError raised"

    def _bad_dtype(self, comm) -> str:
        return "; ".join(p for p in (
            self._expect_error(lambda: comm.all_reduce(torch.ones(8, dtype=torch.bool)), "torch.bool", "supported"),
            self._expect_error(lambda: comm.all_reduce(torch.ones(8, dtype=torch.complex64)), "complex64"),
            self._expect_error(lambda: comm.all_reduce([1.0, 2.0]), "torch.Tensor"),
            self._expect_error(lambda: comm.reduce_scatter(torch.ones(self.world + 1)), "multiple"),
        ) if p)

    def _mismatch_validated(self) -> str:
        C = self.C
        comm = C.build_communicator(config=C.RingConfig(compression="on", validate=True))
        problem = self._expect_error(lambda: comm.all_reduce(torch.ones(1000 + self.rank)), "disagree",
                                     "[1000, ")
        # The check runs before any data moves: the group is still usable.
        return problem or self.check_all_reduce(comm, _random(100, torch.float32, self.rank))

    def _mismatch_header(self, comm) -> str:
        return self._expect_error(lambda: comm.all_reduce(torch.ones(100000 + 5000 * self.rank)),
                                  "every rank must pass the same size and dtype")


def _worker(rank: int, world: int, port: int, q) -> None:
    import datetime

    import torch.distributed as dist

    try:
        torch.set_num_threads(1)  # several ranks share a 2-core CI machine
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        q.put((rank, _Cases(rank, world).run(), None))
    except BaseException:  # noqa: BLE001
        q.put((rank, None, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}ranks")
def ranks(request):
    """Every case's outcome on every rank: {case: {rank: problem or ""}}."""
    import queue

    import torch.multiprocessing as mp

    world = request.param
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    by_case: dict[str, dict[int, str]] = {}
    crashes = []
    try:
        for _ in range(world):
            try:
                rank, results, err = q.get(timeout=TIMEOUT_S)
            except queue.Empty:
                crashes.append(f"no answer within {TIMEOUT_S} s (exit codes {[p.exitcode for p in procs]})")
                break
            if err:
                crashes.append(f"rank {rank}:\n{err}")
                continue
            for case, problem in results.items():
                by_case.setdefault(case, {})[rank] = problem
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    if crashes:
        pytest.fail("ranks crashed:\n" + "\n".join(crashes))
    return world, by_case


def _assert_cases(ranks, prefix: str) -> int:
    world, by_case = ranks
    cases = {c: r for c, r in by_case.items() if c.startswith(prefix)}
    assert cases, f"no {prefix!r} cases ran"
    failures = [f"{case} rank {rank}: {problem}" for case, per_rank in sorted(cases.items())
                for rank, problem in sorted(per_rank.items()) if problem]
    missing = [c for c, r in cases.items() if len(r) != world]
    assert not failures and not missing, "\n".join(failures + [f"{c}: not every rank reported" for c in missing])
    return len(cases)


def test_random_data_bit_identical_to_reference_ring(ranks):
    assert _assert_cases(ranks, "random/") == 4 * len(RANDOM_ELEMS) + 1


def test_real_gemma_activations_bit_identical(ranks):
    world = ranks[0]
    assert _assert_cases(ranks, "real/") == 2 * (len(REAL_BYTES) + (world == 2))


def test_compressed_counter_moves(ranks):
    _assert_cases(ranks, "counters")


def test_adaptive_paths_and_fallbacks(ranks):
    _assert_cases(ranks, "adaptive")


def test_reduce_scatter_and_all_gather(ranks):
    _assert_cases(ranks, "verbs")


def test_clear_errors(ranks):
    _assert_cases(ranks, "errors/")


# ---- single-process checks (no ranks needed) ----

def test_ring_sum_reference_order():
    """Chunk c is summed starting at rank c+1 and ending at rank c, in the dtype."""
    from uzip_serve.collectives import ring_sum_reference

    # fp32 where association matters: 1e8 + 1 - 1e8 is 0 or 1 depending on the order.
    xs = [torch.tensor([1e8, 1.0, -1e8]), torch.tensor([1.0, -1e8, 1.0]), torch.tensor([-1e8, 1e8, 1e8])]
    out = ring_sum_reference(xs)
    expect = []
    for c in range(3):  # one element per chunk
        s = xs[(c + 1) % 3][c]
        for k in (2, 3):
            s = s + xs[(c + k) % 3][c]
        expect.append(s)
    assert torch.equal(out, torch.stack(expect))


def test_import_is_light():
    import subprocess
    import sys

    code = ("import sys, uzip_serve, uzip_serve.collectives as c; "
            "print(int('torch' in sys.modules), int('uzip_serve.collectives.gloo' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "0"], "importing uzip_serve.collectives pulled in torch or a backend"


def test_config_from_env(monkeypatch):
    from uzip_serve.collectives import RingConfig

    monkeypatch.setenv("UZIP_ALLREDUCE_COMPRESSION", "off")
    monkeypatch.setenv("UZIP_ALLREDUCE_MIN_BYTES", "12345")
    monkeypatch.setenv("UZIP_ALLREDUCE_VALIDATE", "1")
    cfg = RingConfig.from_env(margin=0.1)
    assert (cfg.compression, cfg.min_bytes, cfg.validate, cfg.margin) == ("off", 12345, True, 0.1)
    monkeypatch.setenv("UZIP_ALLREDUCE_COMPRESSION", "sometimes")
    with pytest.raises(ValueError, match="compression"):
        RingConfig.from_env()


def test_threshold_model():
    """A slow link with a fast codec compresses from some size up; a link faster than the
    codec never does."""
    import math

    from uzip_serve.collectives.adaptive import AdaptivePolicy, Measurements, RingConfig

    pol = AdaptivePolicy(RingConfig(), 2, lambda nbytes: min(max(nbytes // 8, 128 << 10), 1 << 20))
    pol.set_measurements(Measurements(native_latency_s=1e-4, link_Bps=0.125e9, compress_Bps=1e9,
                                      decompress_Bps=1.5e9, hop_latency_s=3e-4, ratio={"bfloat16": 0.69}))
    t = pol.threshold("bfloat16")
    assert 64 << 10 < t < 8 << 20
    assert pol.threshold("float32") == math.inf  # ratio unknown: 1.0, nothing to gain
    pol.set_measurements(Measurements(native_latency_s=1e-4, link_Bps=5e9, compress_Bps=1e9, decompress_Bps=1.5e9,
                                      hop_latency_s=3e-4, ratio={"bfloat16": 0.69}))
    assert pol.threshold("bfloat16") == math.inf


def test_trial_near_break_even():
    """Near the break-even the model is not trusted: a size class alternates both paths,
    the agreed measurements settle it, and they may overrule the model."""
    from uzip_serve.collectives.adaptive import AdaptivePolicy, Measurements, RingConfig

    pol = AdaptivePolicy(RingConfig(explore_calls=2), 2, lambda nbytes: 256 << 10)
    pol.set_measurements(Measurements(native_latency_s=2e-4, link_Bps=0.125e9, compress_Bps=0.5e9,
                                      decompress_Bps=0.45e9, hop_latency_s=1e-3, ratio={"bfloat16": 0.69}))
    t = pol.threshold("bfloat16")
    near = int(t * 1.1)
    tn, tc = pol.predict(near, "bfloat16")
    assert abs(tc / tn - 1) < 0.25, "the test needs a size near the break-even"
    far = 64 << 20
    assert pol.choose(far, "bfloat16") == "compressed" and not pol.trials  # far: the model, no trial
    assert pol.choose(4 << 10, "bfloat16") == "native"
    seq = []
    for _ in range(4):
        path = pol.choose(near, "bfloat16")
        seq.append(path)
        # compressed measured 1.5x its prediction, native as predicted: compression loses
        pol.observe(path, near, "bfloat16", (tc * 1.5) if path == "compressed" else tn, 0.69)
    assert seq == ["compressed", "native", "compressed", "native"]
    assert pol.choose(near, "bfloat16") == "agree"
    report = pol.trial_report(near, "bfloat16")
    assert report == [pytest.approx(1.5), pytest.approx(1.0)]
    pol.settle(near, "bfloat16", report)
    assert pol.choose(near, "bfloat16") == "native"  # the model said compressed
    assert pol.choose(near + 1, "bfloat16") == "native"  # the same size class
    # a fixed threshold or explore_calls=0 never tries
    fixed = AdaptivePolicy(RingConfig(explore_calls=0), 2, lambda nbytes: 256 << 10)
    fixed.set_measurements(pol.m)
    assert fixed.choose(near, "bfloat16") == "compressed"


# ---- CUDA backend: needs two GPUs (never in CI); the lead runs it on the GPU machine ----

def _cuda_worker(rank: int, world: int, port: int, q) -> None:
    import datetime

    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        from uzip_serve import collectives as C

        comm = C.build_communicator(config=C.RingConfig(compression="on"))
        problems = []
        for dtype in (torch.bfloat16, torch.float32):
            for numel in (1, 1000, (1 << 20) + 5):
                x = _random(numel, dtype, seed=1000 * rank + numel)
                out = comm.all_reduce(x.cuda()).cpu()
                parts = [torch.empty_like(x).cuda() for _ in range(world)]
                dist.all_gather(parts, x.cuda())
                want = C.ring_sum_reference([p.cpu() for p in parts])
                if not torch.equal(_bits(out), _bits(want)):
                    problems.append(f"{dtype} {numel}: differs from ring_sum_reference")
        q.put((rank, problems, None))
    except BaseException:  # noqa: BLE001
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_ring_matches_cpu_reference():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_cuda_worker, args=(r, 2, port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    answers = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [f"rank {r}: {err or problems}" for r, problems, err in answers if err or problems]
    assert not errors, "\n".join(errors)
