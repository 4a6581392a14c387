/*
 * Toy kernels for tests/test_simt.py, each exercising one part of the SIMT emulator. Written
 * the way the real kernels are: CUDA C++, dynamic shared memory through a macro, and the
 * emulator-only parts (smem pointer, UZSIM_EXPORT) under UZ_SIMT.
 */
#ifdef UZ_SIMT
#define DYN_SMEM(type, name) type *name = reinterpret_cast<type *>(uzsim::dynamic_smem())
#else
#define DYN_SMEM(type, name) \
    extern __shared__ __align__(16) unsigned char uz_smem_[]; \
    type *name = reinterpret_cast<type *>(uz_smem_)
#endif

#ifndef SELFTEST_SCALE
#define SELFTEST_SCALE 1
#endif

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 linear_tid() {
    return threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y;
}
__device__ __forceinline__ u32 linear_bid() {
    return blockIdx.x + blockIdx.y * gridDim.x + blockIdx.z * gridDim.x * gridDim.y;
}
__device__ __forceinline__ u32 lane_id() { return linear_tid() % 32; }

/* 14 words per thread: threadIdx, blockIdx, blockDim, gridDim, its warp's first linear id, warpSize */
extern "C" __global__ void k_indices(u32 *out) {
    const u32 nt = blockDim.x * blockDim.y * blockDim.z, t = linear_tid();
    u32 *o = out + (linear_bid() * nt + t) * 14;
    const u32 v[14] = {threadIdx.x, threadIdx.y, threadIdx.z, blockIdx.x, blockIdx.y, blockIdx.z,
                       blockDim.x,  blockDim.y,  blockDim.z,  gridDim.x,  gridDim.y,  gridDim.z,
                       __shfl_sync(__activemask(), t, 0), (u32)warpSize};
    for (int i = 0; i < 14; ++i) o[i] = v[i];
}

/* Tree reduction in shared memory; out[gridDim.x + b] = smem address % 16. */
extern "C" __global__ void k_block_sum(const u32 *in, u32 *out) {
    DYN_SMEM(u32, s);
    const u32 t = threadIdx.x;
    s[t] = in[blockIdx.x * blockDim.x + t];
    __syncthreads();
    for (u32 half = blockDim.x / 2; half > 0; half /= 2) {
        if (t < half) s[t] += s[t + half];
        __syncthreads();
    }
    if (t == 0) {
        out[blockIdx.x] = s[0];
        out[gridDim.x + blockIdx.x] = (u32)((unsigned long)s % 16);
    }
}

/* Threads >= live exit first; the rest vote through the barrier variants. */
extern "C" __global__ void k_sync_votes(const int *pred, int *out, u32 live) {
    const u32 t = threadIdx.x;
    if (t >= live) return;
    const int c = __syncthreads_count(pred[t]);
    const int a = __syncthreads_and(pred[t]);
    const int o = __syncthreads_or(pred[t]);
    out[3 * t] = c, out[3 * t + 1] = a, out[3 * t + 2] = o;
}

/* One shuffle of a per-lane value; `type` picks the operand type, the result's bits go out. */
template <class T> __device__ T shfl_op(int op, T v, int arg, int width) {
    switch (op) {
    case 0: return __shfl_sync(0xffffffffu, v, arg, width);
    case 1: return __shfl_up_sync(0xffffffffu, v, (u32)arg, width);
    case 2: return __shfl_down_sync(0xffffffffu, v, (u32)arg, width);
    default: return __shfl_xor_sync(0xffffffffu, v, arg, width);
    }
}
extern "C" __global__ void k_shfl(u64 *out, int op, int arg, int width, int type) {
    const u32 l = lane_id(), t = linear_tid();
    switch (type) {
    case 0: out[t] = (u32)shfl_op(op, -(int)(3 * l + 1), arg, width); break;
    case 1: out[t] = shfl_op(op, 0x80000000u | l, arg, width); break;
    case 2: out[t] = (u64)shfl_op(op, -((long long)l << 40) - l, arg, width); break;
    case 3: out[t] = shfl_op(op, (u64)l << 56 | 0x100000000ull | l, arg, width); break;
    case 4: out[t] = __float_as_uint(shfl_op(op, l + 0.5f, arg, width)); break;
    default: out[t] = (u64)__double_as_longlong(shfl_op(op, l * 1e10 + 0.25, arg, width));
    }
}

/* Collectives over partial masks: two halves, then even / odd lanes, side by side in one warp. */
extern "C" __global__ void k_partial_masks(int *out) {
    const int l = (int)lane_id();
    const u32 half = l < 16 ? 0x0000ffffu : 0xffff0000u;
    const u32 parity = l & 1 ? 0xaaaaaaaau : 0x55555555u;
    int *o = out + 6 * l;
    o[0] = __shfl_xor_sync(half, l, 1);
    o[1] = __shfl_sync(half, 10 * l, l < 16 ? 3 : 19);
    o[2] = __shfl_xor_sync(parity, l, 2);
    o[3] = __shfl_down_sync(parity, l, 2);
    o[4] = (int)__ballot_sync(parity, l % 4 == 0);
    o[5] = (int)__reduce_add_sync(parity, (u32)l);
}

/* Lanes >= 20 return while the others already wait in the shuffle, which then completes
 * without them: lanes 16-19 read exited lanes and get their own value. */
extern "C" __global__ void k_exit_midway(u32 *out) {
    const u32 l = lane_id();
    if (l >= 20) return;
    out[2 * l] = __shfl_down_sync(0xffffffffu, l, 4);
    out[2 * l + 1] = __ballot_sync(0xffffffffu, 1);
}

/* Lanes named in `exited` return at once; the rest vote with the full mask. */
extern "C" __global__ void k_votes(const int *pred, u32 *out, u32 exited) {
    const u32 t = linear_tid();
    if (exited >> lane_id() & 1) return;
    const int p = pred[t];
    u32 *o = out + 5 * t;
    o[0] = __activemask();
    o[1] = __ballot_sync(0xffffffffu, p);
    o[2] = (u32)__any_sync(0xffffffffu, p);
    o[3] = (u32)__all_sync(0xffffffffu, p);
    o[4] = __shfl_down_sync(0xffffffffu, t, 1);  // from an exited lane: own value
}

/* Every __reduce_*_sync over the lanes of `mask`; the other lanes only write zeros. */
extern "C" __global__ void k_reduce(const u32 *in, u32 *out, u32 mask) {
    const u32 t = linear_tid(), v = in[t];
    u32 *o = out + 9 * t;
    for (int i = 0; i < 9; ++i) o[i] = 0;
    if (!(mask >> lane_id() & 1)) return;
    o[0] = __reduce_add_sync(mask, v);
    o[1] = (u32)__reduce_add_sync(mask, (int)v);
    o[2] = __reduce_min_sync(mask, v);
    o[3] = (u32)__reduce_min_sync(mask, (int)v);
    o[4] = __reduce_max_sync(mask, v);
    o[5] = (u32)__reduce_max_sync(mask, (int)v);
    o[6] = __reduce_and_sync(mask, v);
    o[7] = __reduce_or_sync(mask, v);
    o[8] = __reduce_xor_sync(mask, v);
}

/* __match_any_sync / __match_all_sync on 32- and 64-bit values. */
extern "C" __global__ void k_match(const u64 *in, u32 *out) {
    const u32 t = linear_tid();
    const u64 v = in[t];
    int p32 = -1, p64 = -1;
    u32 *o = out + 6 * t;
    o[0] = __match_any_sync(0xffffffffu, (u32)v);
    o[1] = __match_any_sync(0xffffffffu, v);
    o[2] = __match_all_sync(0xffffffffu, (u32)v, &p32);
    o[3] = (u32)p32;
    o[4] = __match_all_sync(0xffffffffu, v, &p64);
    o[5] = (u32)p64;
}

/* Every atomic from every thread of many blocks; __nanosleep mixes the order. */
extern "C" __global__ void k_atomics(u32 *u, int *i, u64 *ull, float *f, long long *ll) {
    const u32 g = linear_bid() * blockDim.x + threadIdx.x;
    atomicAdd(&u[0], 1);
    atomicSub(&i[0], 2);
    atomicAdd(&ull[0], 1ull << 33);
    atomicAdd(&f[0], 1.0f);
    if (g % 3 == 0) __nanosleep(100);
    atomicMax(&u[1], g);
    atomicMin(&i[1], -(int)g);
    atomicMin(&ull[1], (u64)g + 5);
    atomicMax(&ll[0], -(long long)g);
    atomicOr(&u[2], 1u << (g % 32));
    atomicAnd(&u[3], ~(1u << (g % 29)));
    atomicXor(&u[4], g);
    atomicInc(&u[5], 9);
    __syncthreads();
    atomicDec(&u[6], 9);
    u32 old;
    do {
        old = u[7];
        if (g % 2) __nanosleep(10);  // let other threads race for the same word
    } while (atomicCAS(&u[7], old, old + 3) != old);
    atomicAdd(&ull[2], (u64)atomicExch(&u[8], g));
    atomicExch(&f[1], 2.5f);
}

/* Decoupled look-back inclusive scan, one element per thread. state[b] = flag << 32 | value
 * (flag 1: block aggregate, 2: inclusive prefix). Blocks differ in how long they take, so a
 * block often waits for its predecessor; spins counts the waits. */
extern "C" __global__ void k_lookback(const u32 *in, u32 *out, u64 *state, u32 *spins) {
    DYN_SMEM(u32, s);
    const u32 t = threadIdx.x, n = blockDim.x, b = blockIdx.x;
    s[t] = in[b * n + t];
    __syncthreads();
    for (u32 d = 1; d < n; d *= 2) {  // Hillis-Steele scan
        const u32 v = t >= d ? s[t - d] : 0;
        __syncthreads();
        s[t] += v;
        __syncthreads();
    }
    for (u32 k = 0; k < (b % 4) * 3; ++k) __syncthreads();
    if (t == 0) {
        const u32 aggregate = s[n - 1];
        atomicExch(&state[b], (u64)(b == 0 ? 2 : 1) << 32 | aggregate);
        u32 prefix = 0;
        for (int p = (int)b - 1; p >= 0;) {
            const u64 st = *(volatile u64 *)&state[p];
            if (st >> 32 == 0) {
                atomicAdd(spins, 1);
                __nanosleep(100);
                continue;
            }
            prefix += (u32)st;
            if (st >> 32 == 2) break;
            --p;
        }
        if (b > 0) atomicExch(&state[b], 2ull << 32 | (prefix + aggregate));
        s[n] = prefix;
    }
    __syncthreads();
    out[b * n + t] = s[n] + s[t];
}

/* The integer intrinsics, 16 results per 32-bit input and 6 per 64-bit one. */
extern "C" __global__ void k_intrinsics(const u32 *x, const u32 *y, const u32 *s, const u64 *a, const u64 *b, u32 *o32,
                                        u64 *o64, u32 n) {
    for (u32 i = linear_bid() * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        u32 *o = o32 + 16 * i;
        o[0] = __byte_perm(x[i], y[i], s[i]);
        o[1] = __funnelshift_l(x[i], y[i], s[i]);
        o[2] = __funnelshift_lc(x[i], y[i], s[i]);
        o[3] = __funnelshift_r(x[i], y[i], s[i]);
        o[4] = __funnelshift_rc(x[i], y[i], s[i]);
        o[5] = __brev(x[i]);
        o[6] = (u32)__clz((int)x[i]);
        o[7] = (u32)__ffs((int)x[i]);
        o[8] = (u32)__popc(x[i]);
        o[9] = __umulhi(x[i], y[i]);
        o[10] = (u32)__mulhi((int)x[i], (int)y[i]);
        o[11] = __sad((int)x[i], (int)y[i], s[i]);
        o[12] = __usad(x[i], y[i], s[i]);
        o[13] = (u32)min((int)x[i], (int)y[i]);
        o[14] = max(x[i], y[i]);
        o[15] = min((int)x[i], y[i]);  // int and unsigned: compared as unsigned, like CUDA
        u64 *q = o64 + 6 * i;
        q[0] = __brevll(a[i]);
        q[1] = (u64)__popcll(a[i]);
        q[2] = (u64)__clzll((long long)a[i]);
        q[3] = (u64)__ffsll((long long)a[i]);
        q[4] = __umul64hi(a[i], b[i]);
        q[5] = (u64)__mul64hi((long long)a[i], (long long)b[i]);
    }
}

/* Misuse and deadlocks, one kernel each (block of 64 unless the test says otherwise). */
extern "C" __global__ void k_deadlock_barrier(int *out) {  // even threads at the barrier, odd at __syncwarp
    if (threadIdx.x % 2 == 0) __syncthreads();
    else __syncwarp();
    out[threadIdx.x] = 1;
}
extern "C" __global__ void k_deadlock_shfl(int *out) {  // lane 7 of warp 0 skips the shuffle
    int v = (int)threadIdx.x;
    if (threadIdx.x < 32 && threadIdx.x != 7) v = __shfl_sync(0xffffffffu, v, 0);
    __syncthreads();
    out[threadIdx.x] = v;
}
extern "C" __global__ void k_mismatch(int *out) {  // half the warp ballots, half shuffles
    const int l = (int)lane_id();
    out[l] = l < 16 ? (int)__ballot_sync(0xffffffffu, 1) : __shfl_sync(0xffffffffu, l, 0);
}
extern "C" __global__ void k_bad_mask(int *out) {  // lane 1 syncs with a mask of lane 0 only
    if (lane_id() == 1) __syncwarp(0x1u);
    out[lane_id()] = 1;
}
extern "C" __global__ void k_bad_source(int *out) {  // even lanes read odd ones outside the mask
    const int l = (int)lane_id();
    out[l] = __shfl_xor_sync(l & 1 ? 0xaaaaaaaau : 0x55555555u, l, 1);
}
extern "C" __global__ void k_mixed_barrier(int *out) {
    if (threadIdx.x % 2) out[threadIdx.x] = __syncthreads_count(1);
    else __syncthreads();
}
extern "C" __global__ void k_spin_forever(const int *flag) {
    while (*(volatile const int *)flag == 0) __nanosleep(100);
}
extern "C" __global__ void k_trap(int *) {
    if (blockIdx.x == 1 && threadIdx.x == 5) __trap();
}

/* Copies n bytes of never-written shared memory out, then checks that blocks running side by
 * side each keep their own: bad[0] counts words that another block overwrote. */
extern "C" __global__ void k_smem_garbage(unsigned char *out, u32 n, u32 *bad) {
    DYN_SMEM(unsigned char, s);
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) out[blockIdx.x * n + i] = s[i];
    __syncthreads();
    u32 *w = reinterpret_cast<u32 *>(s);
    for (u32 i = threadIdx.x; i < n / 4; i += blockDim.x) w[i] = blockIdx.x * 100000 + i;
    for (int round = 0; round < 4; ++round) {
        __nanosleep(10);
        __syncthreads();
    }
    for (u32 i = threadIdx.x; i < n / 4; i += blockDim.x)
        if (w[i] != blockIdx.x * 100000 + i) atomicAdd(bad, 1);
}

extern "C" __global__ void k_printf() {
    if (threadIdx.x == 0) printf("hello from block %u\n", blockIdx.x);
}

/* ~100 warp collectives and a few barriers per thread, for the timing test. */
extern "C" __global__ void k_busy(u32 *out, int iters) {
    u32 v = linear_tid();
    for (int i = 0; i < iters; ++i) {
        v += __shfl_xor_sync(0xffffffffu, v, i & 31);
        if (i % 25 == 24) __syncthreads();
    }
    out[linear_bid() * blockDim.x + threadIdx.x] = v;
}

/* Arguments of every integer kind come back as they arrived; SELFTEST_SCALE shows the build's defines. */
extern "C" __global__ void k_args(long long *out, int a, u32 b, long long c, u64 d, unsigned char e, short f) {
    if (threadIdx.x) return;
    out[0] = a, out[1] = b, out[2] = c, out[3] = (long long)d, out[4] = e, out[5] = f;
    out[6] = SELFTEST_SCALE;
}

/* Recursion deep enough to need a bigger stack than 16 KiB (the test raises stack_bytes). */
__device__ __noinline__ u32 deep(u32 depth) {
    volatile unsigned char pad[512];
    pad[0] = (unsigned char)depth;
    return depth == 0 ? pad[0] : deep(depth - 1) + 1;
}
extern "C" __global__ void k_deep(u32 *out, u32 depth) { out[threadIdx.x] = deep(depth); }

#ifdef UZ_SIMT
UZSIM_EXPORT(k_indices);
UZSIM_EXPORT(k_block_sum);
UZSIM_EXPORT(k_sync_votes);
UZSIM_EXPORT(k_shfl);
UZSIM_EXPORT(k_partial_masks);
UZSIM_EXPORT(k_exit_midway);
UZSIM_EXPORT(k_votes);
UZSIM_EXPORT(k_reduce);
UZSIM_EXPORT(k_match);
UZSIM_EXPORT(k_atomics);
UZSIM_EXPORT(k_lookback);
UZSIM_EXPORT(k_intrinsics);
UZSIM_EXPORT(k_deadlock_barrier);
UZSIM_EXPORT(k_deadlock_shfl);
UZSIM_EXPORT(k_mismatch);
UZSIM_EXPORT(k_bad_mask);
UZSIM_EXPORT(k_bad_source);
UZSIM_EXPORT(k_mixed_barrier);
UZSIM_EXPORT(k_spin_forever);
UZSIM_EXPORT(k_trap);
UZSIM_EXPORT(k_smem_garbage);
UZSIM_EXPORT(k_printf);
UZSIM_EXPORT(k_busy);
UZSIM_EXPORT(k_args);
UZSIM_EXPORT(k_deep);
#endif
