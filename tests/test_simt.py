"""The SIMT emulator of tests/simt/: CUDA block and warp semantics on the CPU, pinned with the
toy kernels of tests/simt/selftest.cu against numpy / pure-Python references."""

import math
from pathlib import Path

import numpy as np
import pytest

from simt.build import build, compiler

if compiler() is None:
    pytest.skip("the SIMT emulator needs g++", allow_module_level=True)

SELFTEST = Path(__file__).parent / "simt" / "selftest.cu"
FULL = 0xFFFFFFFF
rng = np.random.default_rng(20240611)


@pytest.fixture(scope="module")
def sim():
    return build(SELFTEST)


@pytest.fixture(autouse=True)
def default_config(sim):
    sim.configure()
    yield
    sim.configure()


def launch(sim, name, grid, block, *args, smem=0):
    sim.launch(name, grid, block, smem, tuple(a.ctypes.data if isinstance(a, np.ndarray) else a for a in args))


def dims(d):
    d = (d,) if isinstance(d, int) else tuple(d)
    return d + (1,) * (3 - len(d))


def assert_still_works(sim):
    """After an error the emulator must run the next launch normally."""
    x = rng.integers(0, 1 << 20, size=4 * 128, dtype=np.uint32)
    out = np.zeros(8, np.uint32)
    launch(sim, "k_block_sum", 4, 128, x, out, smem=128 * 4)
    np.testing.assert_array_equal(out[:4], x.reshape(4, 128).sum(axis=1, dtype=np.uint64).astype(np.uint32))


# ------------------------------------------------------------------ indices and barriers

@pytest.mark.parametrize("grid, block", [(3, 64), ((2, 3), (8, 4)), ((2, 2, 2), (4, 2, 3)), ((3, 1, 2), (20, 3))])
def test_indices(sim, grid, block):
    g, b = dims(grid), dims(block)
    nb, nt = math.prod(g), math.prod(b)
    out = np.zeros((nb, nt, 14), np.uint32)
    launch(sim, "k_indices", grid, block, out)
    expected = np.array([[
        [t % b[0], t // b[0] % b[1], t // (b[0] * b[1]),
         lb % g[0], lb // g[0] % g[1], lb // (g[0] * g[1]), *b, *g, t - t % 32, 32]
        for t in range(nt)] for lb in range(nb)], np.uint32)
    np.testing.assert_array_equal(out, expected)


def test_block_reduction_through_shared_memory(sim):
    x = rng.integers(0, FULL, size=6 * 256, dtype=np.uint32)
    out = np.zeros(12, np.uint32)
    launch(sim, "k_block_sum", 6, 256, x, out, smem=256 * 4)
    np.testing.assert_array_equal(out[:6], x.reshape(6, 256).sum(axis=1, dtype=np.uint64).astype(np.uint32))
    assert (out[6:] == 0).all(), "dynamic shared memory must be 16-byte aligned"


@pytest.mark.parametrize("live, kind", [(256, "random"), (256, "ones"), (256, "zeros"), (100, "random"), (100, "ones")])
def test_syncthreads_count_and_or(sim, live, kind):
    """Threads that exited before the barrier are excused from it and do not vote."""
    pred = {"random": rng.integers(0, 3, size=256, dtype=np.int32) * rng.integers(-5, 5, size=256, dtype=np.int32),
            "ones": np.ones(256, np.int32), "zeros": np.zeros(256, np.int32)}[kind]
    out = np.full((256, 3), -7, np.int32)
    launch(sim, "k_sync_votes", 1, 256, pred, out, live)
    p = pred[:live] != 0
    assert (out[:live] == [p.sum(), p.all(), p.any()]).all()
    assert (out[live:] == -7).all()


# ------------------------------------------------------------------ warp collectives

def shfl_bits(kind, lanes):
    """The per-lane operand of k_shfl as 64-bit patterns."""
    lanes = np.asarray(lanes, np.int64)
    u = lanes.astype(np.uint64)
    return {
        0: (-(3 * lanes + 1)).astype(np.int32).view(np.uint32).astype(np.uint64),
        1: (0x80000000 | lanes).astype(np.uint64),
        2: (-(lanes << 40) - lanes).view(np.uint64),
        3: (u << np.uint64(56)) | np.uint64(1 << 32) | u,
        4: (lanes + 0.5).astype(np.float32).view(np.uint32).astype(np.uint64),
        5: (lanes * 1e10 + 0.25).view(np.uint64),
    }[kind]


def shfl_source(op, lane, arg, width):
    """Source lane per the CUDA programming guide; the caller's own lane when out of range."""
    first = lane - lane % width
    if op == 0:
        return first + arg % width
    if op == 1:
        return lane - arg if lane % width >= arg else lane
    if op == 2:
        return lane + arg if lane % width + arg < width else lane
    j = lane ^ arg
    return j if j // width <= lane // width else lane  # xor may reach earlier segments only


SHFL_ARGS = {0: (0, 5, 31, -1, 37), 1: (0, 1, 3, 16, 31), 2: (0, 1, 3, 16, 31), 3: (0, 1, 5, 16, 31)}


@pytest.mark.parametrize("kind", range(6), ids=["int", "unsigned", "longlong", "ulonglong", "float", "double"])
def test_shuffles(sim, kind):
    """Every variant and width, in a block of 48: warp 1 has only 16 lanes, and a source past
    them gives the caller's own value."""
    n = 48
    out = np.zeros(n, np.uint64)
    for op, args in SHFL_ARGS.items():
        for width in (32, 16, 8, 4, 2, 1):
            for arg in args:
                launch(sim, "k_shfl", 1, n, out, op, arg, width, kind)
                src = []
                for t in range(n):
                    s = shfl_source(op, t % 32, arg, width)
                    src.append(s if t - t % 32 + s < n else t % 32)
                np.testing.assert_array_equal(out, shfl_bits(kind, src), err_msg=f"op {op} arg {arg} width {width}")


def test_collectives_on_partial_masks(sim):
    """Two halves, then even and odd lanes, each run their own collectives in one warp."""
    out = np.zeros((32, 6), np.int32)
    launch(sim, "k_partial_masks", 1, 32, out)
    lanes = np.arange(32)
    even = lanes % 2 == 0
    np.testing.assert_array_equal(out[:, 0], lanes ^ 1)
    np.testing.assert_array_equal(out[:, 1], np.where(lanes < 16, 30, 190))
    np.testing.assert_array_equal(out[:, 2], lanes ^ 2)
    np.testing.assert_array_equal(out[:, 3], np.where(lanes < 30, lanes + 2, lanes))
    np.testing.assert_array_equal(out[:, 4], np.where(even, 0x11111111, 0))
    np.testing.assert_array_equal(out[:, 5], np.where(even, 240, 256))


def test_lanes_exiting_while_others_wait(sim):
    out = np.full((32, 2), 0xDEAD, np.uint32)
    launch(sim, "k_exit_midway", 1, 32, out)
    lanes = np.arange(20)
    np.testing.assert_array_equal(out[:20, 0], np.where(lanes < 16, lanes + 4, lanes))
    assert (out[:20, 1] == 0x000FFFFF).all() and (out[20:] == 0xDEAD).all()


@pytest.mark.parametrize("block", [64, 48])
@pytest.mark.parametrize("exited", [0, 0x80020408, 0x7FFFFFFE])
def test_votes_and_activemask(sim, block, exited):
    """Exited lanes (and lanes past a partial warp) are not in __activemask and do not vote."""
    pred = rng.integers(0, 2, size=block, dtype=np.int32)
    if block == 64:
        pred[32:] = 1  # one warp where every live lane says yes
    out = np.full((block, 5), 0xDEAD, np.uint32)
    launch(sim, "k_votes", 1, block, pred, out, exited)
    for t in range(block):
        w, lane = divmod(t, 32)
        live = [l for l in range(32) if w * 32 + l < block and not exited >> l & 1]
        if lane not in live:
            assert (out[t] == 0xDEAD).all()
            continue
        ballot = sum(1 << l for l in live if pred[w * 32 + l])
        nxt = t + 1 if lane + 1 in live else t
        assert list(out[t]) == [sum(1 << l for l in live), ballot, ballot != 0,
                                all(pred[w * 32 + l] for l in live), nxt], f"thread {t}"


@pytest.mark.parametrize("mask", [FULL, 0x0F0F0F0F, 0x80000001, 1 << 5])
def test_reduce(sim, mask):
    x = rng.integers(0, 1 << 32, size=64, dtype=np.uint64).astype(np.uint32)
    x[:4] = [0, FULL, 0x80000000, 0x7FFFFFFF]
    out = np.full((64, 9), 0xDEAD, np.uint32)
    launch(sim, "k_reduce", 1, 64, x, out, mask)
    for w in range(2):
        lanes = [l for l in range(32) if mask >> l & 1]
        v = [int(x[w * 32 + l]) for l in lanes]
        s = [u - (1 << 32) if u >> 31 else u for u in v]
        and_, or_, xor = FULL, 0, 0
        for u in v:
            and_, or_, xor = and_ & u, or_ | u, xor ^ u
        row = [sum(v) & FULL, sum(v) & FULL, min(v), min(s) & FULL, max(v), max(s) & FULL, and_, or_, xor]
        for l in range(32):
            assert list(out[w * 32 + l]) == (row if mask >> l & 1 else [0] * 9), f"warp {w} lane {l}"


def test_match(sim):
    v = (rng.integers(0, 4, size=96, dtype=np.uint64)
         | rng.integers(0, 2, size=96, dtype=np.uint64) << np.uint64(40))
    v[32:64] = 0x1234_0000_0007  # warp 1: all equal
    v[64:96] = 3 + (np.arange(32, dtype=np.uint64) % 2 << np.uint64(40))  # warp 2: equal low words only
    out = np.zeros((96, 6), np.uint32)
    launch(sim, "k_match", 1, 96, v, out)
    for t in range(96):
        w = t // 32
        warp = [int(u) for u in v[w * 32:(w + 1) * 32]]
        me = warp[t % 32]
        any32 = sum(1 << l for l, u in enumerate(warp) if u & FULL == me & FULL)
        any64 = sum(1 << l for l, u in enumerate(warp) if u == me)
        all32 = len({u & FULL for u in warp}) == 1
        all64 = len(set(warp)) == 1
        assert list(out[t]) == [any32, any64, FULL if all32 else 0, all32, FULL if all64 else 0, all64], f"thread {t}"


# ------------------------------------------------------------------ atomics and inter-block protocols

def test_atomics_from_many_blocks(sim):
    grid, block = 40, 96
    n = grid * block
    u = np.array([0, 0, 0, FULL, 0, 0, 0, 0, 0], np.uint32)
    i = np.zeros(2, np.int32)
    ull = np.array([0, (1 << 64) - 1, 0], np.uint64)
    f = np.zeros(2, np.float32)
    ll = np.array([-10 ** 18], np.int64)
    launch(sim, "k_atomics", grid, block, u, i, ull, f, ll)
    xor = 0
    for g in range(n):
        xor ^= g
    assert list(u[:8]) == [n, n - 1, FULL, 0xE0000000, xor, n % 10, (10 - n % 10) % 10, 3 * n]
    assert list(i) == [-2 * n, -(n - 1)]
    assert int(ull[0]) == n << 33 and int(ull[1]) == 5
    assert int(ull[2]) + int(u[8]) == n * (n - 1) // 2  # atomicExch passed every value along once
    assert list(f) == [n, 2.5] and ll[0] == 0


@pytest.mark.parametrize("concurrent", [1, 3, 8])
def test_decoupled_lookback_scan(sim, concurrent):
    """Block b spins on block b-1's flag in global memory: only resident blocks interleave, so
    one resident block never waits and more do."""
    sim.configure(concurrent_blocks=concurrent)
    grid, block = 50, 128
    x = rng.integers(0, 1 << 24, size=grid * block, dtype=np.uint32)
    out = np.zeros_like(x)
    state = np.zeros(grid, np.uint64)
    spins = np.zeros(1, np.uint32)
    launch(sim, "k_lookback", grid, block, x, out, state, spins, smem=(block + 1) * 4)
    np.testing.assert_array_equal(out, np.cumsum(x, dtype=np.uint64).astype(np.uint32))
    assert (spins[0] == 0) if concurrent == 1 else (spins[0] > 0)


# ------------------------------------------------------------------ intrinsics

def test_integer_intrinsics(sim):
    n = 4096
    special = np.array([0, 1, 2, FULL, 0x80000000, 0x7FFFFFFF, 0x00010000, 0xFFFF0000], np.uint32)
    x, y = (np.where(rng.random(n) < 0.2, rng.choice(special, n), rng.integers(0, 1 << 32, n, dtype=np.uint64))
            .astype(np.uint32) for _ in range(2))
    s = np.where(np.arange(n) % 2 == 0, rng.integers(0, 41, n, dtype=np.uint64),
                 rng.integers(0, 1 << 32, n, dtype=np.uint64)).astype(np.uint32)
    special64 = np.array([0, 1, (1 << 64) - 1, 1 << 63, (1 << 63) - 1, 1 << 32], np.uint64)
    a, b = (np.where(rng.random(n) < 0.2, rng.choice(special64, n),
                     rng.integers(0, (1 << 64) - 1, n, dtype=np.uint64, endpoint=True)) for _ in range(2))
    o32 = np.zeros((n, 16), np.uint32)
    o64 = np.zeros((n, 6), np.uint64)
    launch(sim, "k_intrinsics", 4, 128, x, y, s, a, b, o32, o64, n)

    def signed(v, bits):
        return v - (1 << bits) if v >> (bits - 1) else v

    m64 = (1 << 64) - 1
    for k in range(n):
        X, Y, S, A, B = int(x[k]), int(y[k]), int(s[k]), int(a[k]), int(b[k])
        sx, sy = signed(X, 32), signed(Y, 32)
        cat = Y << 32 | X
        want32 = [
            sum((cat >> 8 * (S >> 4 * i & 7) & 0xFF) << 8 * i for i in range(4)),
            (cat << (S & 31)) >> 32 & FULL, (cat << min(S, 32)) >> 32 & FULL,
            (cat >> (S & 31)) & FULL, (cat >> min(S, 32)) & FULL,
            int(f"{X:032b}"[::-1], 2), 32 - X.bit_length(), (X & -X).bit_length(), bin(X).count("1"),
            X * Y >> 32, (sx * sy >> 32) & FULL, (abs(sx - sy) + S) & FULL, (abs(X - Y) + S) & FULL,
            min(sx, sy) & FULL, max(X, Y), min(X, Y)]
        want64 = [int(f"{A:064b}"[::-1], 2), bin(A).count("1"), 64 - A.bit_length(), (A & -A).bit_length(),
                  A * B >> 64, (signed(A, 64) * signed(B, 64) >> 64) & m64]
        assert [int(v) for v in o32[k]] == want32, f"x={X:#x} y={Y:#x} s={S:#x}"
        assert [int(v) for v in o64[k]] == want64, f"a={A:#x} b={B:#x}"


# ------------------------------------------------------------------ errors: deadlock, misuse, arguments

def test_deadlock_half_block_at_barrier(sim):
    with pytest.raises(RuntimeError) as e:
        launch(sim, "k_deadlock_barrier", 1, 64, np.zeros(64, np.int32))
    msg = str(e.value)
    assert "deadlock" in msg and "block (0,0,0)" in msg
    assert ("warps 0-1: lanes 0x55555555 wait at __syncthreads(); "
            "lanes 0xaaaaaaaa wait at __syncwarp(mask 0xffffffff)") in msg
    assert_still_works(sim)


def test_deadlock_lane_missing_from_shuffle(sim):
    with pytest.raises(RuntimeError) as e:
        launch(sim, "k_deadlock_shfl", 1, 64, np.zeros(64, np.int32))
    msg = str(e.value)
    assert ("warp 0: lanes 0xffffff7f wait at __shfl_sync(mask 0xffffffff); "
            "lanes 0x00000080 wait at __syncthreads()") in msg
    assert "warp 1: lanes 0xffffffff wait at __syncthreads()" in msg
    assert_still_works(sim)


@pytest.mark.parametrize("kernel, message", [
    ("k_mismatch", "__shfl_sync (4-byte operand, mask 0xffffffff) while lanes 0x0000ffff of the warp wait at "
                   "__ballot_sync"),
    ("k_bad_mask", "thread (1,0,0) [warp 0 lane 1]: __syncwarp(mask 0x00000001): the mask does not include the "
                   "calling lane"),
    ("k_bad_source", "thread (0,0,0) [warp 0 lane 0]: __shfl_xor_sync(mask 0x55555555) reads lane 1, which is not in "
                     "the mask"),
    ("k_mixed_barrier", "while 1 threads of the block wait at"),
    ("k_trap", "block (1,0,0) thread (5,0,0) [warp 0 lane 5]: __trap()"),
])
def test_misuse_is_reported(sim, kernel, message):
    sim.configure(concurrent_blocks=2)
    with pytest.raises(RuntimeError, match=r"block \(") as e:
        launch(sim, kernel, 2 if kernel == "k_trap" else 1, 32, np.zeros(32, np.int32))
    assert message in str(e.value)
    assert_still_works(sim)


def test_livelock_is_reported(sim):
    """Threads that can only ever spin end the launch instead of hanging the test run."""
    with pytest.raises(RuntimeError, match="livelock") as e:
        launch(sim, "k_spin_forever", 2, 32, np.zeros(1, np.int32))
    assert "lanes 0xffffffff spin (__nanosleep / uzsim_yield)" in str(e.value)
    assert_still_works(sim)


def test_argument_conversion_and_errors(sim):
    out = np.zeros(7, np.int64)
    launch(sim, "k_args", 1, 32, out, -5, FULL, -(1 << 63), (1 << 64) - 1, 255, np.int16(-32768))
    assert list(out) == [-5, FULL, -(1 << 63), -1, 255, -32768, 1]
    good = (out.ctypes.data, 0, 0, 0, 0, 0, 0)
    with pytest.raises(KeyError, match="k_args"):
        sim.launch("k_nope", 1, 1, 0, ())
    with pytest.raises(TypeError, match=r"k_args\(pointer, int32, uint32, int64, uint64, uint8, int16\) takes 7"):
        sim.launch("k_args", 1, 1, 0, good[:3])
    with pytest.raises(TypeError, match="argument 1 must be an int, not float"):
        sim.launch("k_args", 1, 1, 0, (good[0], 1.5, *good[2:]))
    for index, value in [(0, -1), (1, 1 << 31), (2, -1), (2, 1 << 32), (3, -(1 << 63) - 1), (4, 1 << 64),
                         (5, 256), (6, 1 << 15)]:
        bad = list(good)
        bad[index] = value
        with pytest.raises(ValueError, match=f"argument {index} = {value} does not fit"):
            sim.launch("k_args", 1, 1, 0, tuple(bad))
    for grid, block in [(0, 1), (1, (1, 2, 3, 4)), (1, -3)]:
        with pytest.raises(ValueError):
            sim.launch("k_args", grid, block, 0, good)
    for grid, block, smem in [(1, 1025, 0), (1, (1, 1, 65), 0), (1, 32, 228 * 1024)]:
        with pytest.raises(RuntimeError, match="invalid launch"):
            sim.launch("k_args", grid, block, smem, good)
    with pytest.raises(ValueError):
        sim.configure(concurrent_blocks=0)
    assert sim.kernels() == sorted(sim.kernels()) and "k_lookback" in sim.kernels()


# ------------------------------------------------------------------ shared memory, printf, stacks, builds

def test_shared_memory_is_garbage_and_per_block(sim):
    n, grid = 4096, 6
    out = np.zeros((grid, n), np.uint8)
    bad = np.zeros(1, np.uint32)
    launch(sim, "k_smem_garbage", grid, 64, out, n, bad, smem=n)
    assert bad[0] == 0, "a block saw another block's shared memory"
    for row in out:
        assert len(np.unique(row)) > 200
    assert len({row.tobytes() for row in out}) == grid
    again = np.zeros_like(out)
    launch(sim, "k_smem_garbage", grid, 64, again, n, bad, smem=n)
    assert not (again == out).all(axis=1).any(), "every block starts with fresh garbage"


def test_printf(sim, capfd):
    launch(sim, "k_printf", 3, 32)
    printed = capfd.readouterr().out
    assert all(f"hello from block {b}\n" in printed for b in range(3))


def test_stack_size(sim):
    out = np.zeros(32, np.uint32)
    launch(sim, "k_deep", 1, 32, out, 100)
    assert (out == 100).all()
    sim.configure(stack_bytes=2 << 20)
    launch(sim, "k_deep", 1, 32, out, 2000)
    assert (out == 2000).all()


def test_defines_make_a_separate_module(sim):
    assert build(SELFTEST) is sim
    scaled = build(SELFTEST, defines={"SELFTEST_SCALE": 7})
    assert scaled is not sim
    for module, scale in [(sim, 1), (scaled, 7)]:
        out = np.zeros(7, np.int64)
        launch(module, "k_args", 1, 1, out, 0, 0, 0, 0, 0, 0)
        assert out[6] == scale


def test_many_shuffles_and_barriers(sim):
    """8 blocks x 256 threads, 100 shuffles and 4 barriers each: every lane's result. (How fast
    the emulator runs is no test's business: a loaded 2-core CI machine would fail a bound.)"""
    out = np.zeros(8 * 256, np.uint32)
    launch(sim, "k_busy", 8, 256, out, 100)
    v = np.arange(256, dtype=np.uint64).reshape(8, 32)  # one row per warp
    for i in range(100):
        v = (v + v[:, np.arange(32) ^ (i & 31)]) & FULL
    np.testing.assert_array_equal(out.reshape(8, 256), np.tile(v.reshape(-1), (8, 1)))
