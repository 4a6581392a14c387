/*
 * CUDA kernels for the uzip frame codec (docs/format.md), compiled at run time by NVRTC
 * through CuPy (uzip_serve/kernels/cuda.py). Every kernel must produce / accept exactly
 * the bytes the CPU reference in uzip_serve/kernels/cpu_codec.c does:
 *
 *   CPU reference                       GPU counterpart here
 *   crc32c / crc32c_combine             crc_par (table CRC per 32-byte slot + linear combine)
 *   split_planes / hist_of              plane_sym + uz_enc_stats (per-lane counters)
 *   build_lengths                       build_lengths_tail (same algorithm, rank sort)
 *   assign_codes                        assign_codes_par / build_lut_group
 *   encode_stream                       warp-cooperative writer in uz_enc_write
 *   decode_plane / decode_stream_tail   HuffReader + uz_dec_fast / uz_dec_slow
 *   merge_planes                        merge16 (fast) / merge1 (slow)
 *   encode_block / decode_block         uz_enc_stats + uz_enc_write / uz_dec_fast + uz_dec_slow
 *
 * One codec block is handled by one CUDA block of TPB = 512 threads (docs/gpu.md has the
 * design and the measurements). CRCs: crc_par (coalesced rows, per-lane shared-memory
 * tables, slots joined by CRC linearity); the Huffman encoder codes a sub-stream per warp
 * (prefix sum of code lengths); the decoder decodes a sub-stream per thread into shared
 * memory, then merges planes coalesced. GPU frames use 512-symbol sub-streams (128 per
 * block). Portable CUDA C++: __funnelshift_r, __brev, __popc, __shfl_*_sync and
 * __reduce_*_sync have HIP equivalents; the only inline PTX (%globaltimer) is in the
 * UZ_PHASES timing build, never in the shipped kernels.
 *
 * GPU encoder choices (valid frames, may differ from the CPU's): only the "entropy plane"
 * (plane 0 for bf16/fp32, plane 1 = high byte for fp16) is Huffman/CONST coded, every other
 * plane is stored RAW, SPARSE blocks are never emitted, and all other dtypes are stored as
 * RAW blocks. The decoder reads every valid frame: uz_dec_fast handles RAW blocks and DENSE
 * blocks with at most one HUFF plane; anything else (SPARSE, several HUFF planes) is
 * queued to uz_dec_slow, which decodes planes through global scratch.
 */
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define TPB 512             /* threads per CUDA block (one CUDA block per codec block) */
#define ENC_BLOCK 65536     /* elements per GPU-encoded block (the default: max_compressed_size holds) */
#define ENC_S 512           /* symbols per sub-stream in GPU-encoded frames */
#define MAX_ENC_STREAMS (ENC_BLOCK / ENC_S)
#define PER (ENC_S / 32)    /* symbols per lane when a warp codes one sub-stream */
#define STG_WORDS ((ENC_S * 11 + 31) / 32 + 4) /* per-warp sub-stream buffer in uz_enc_write */
#define MAX_CODE_LEN 11
#define LUT_SIZE 2048
#define INFO_BYTES 1024     /* per-block record written by uz_enc_stats */
#define MAX_PLANES 16

enum { LAYOUT_BYTES = 0, LAYOUT_BF16 = 1, LAYOUT_FP32 = 2 };
enum { BLOCK_RAW = 0, BLOCK_DENSE = 1, BLOCK_SPARSE = 2 };
enum { PLANE_RAW = 0, PLANE_CONST = 1, PLANE_HUFF = 2 };

/* Error codes reported through the u64 error word: (block << 8) | code, lowest wins. */
enum {
    E_PAYLOAD_CRC = 1, E_ORIG_CRC, E_EMPTY, E_RAW_SIZE, E_MODE, E_PLANE_HDR, E_PLANE_MODE,
    E_RAW_PLANE, E_CONST_PLANE, E_HUFF_EMPTY, E_HUFF_TABLE, E_HUFF_RANGE, E_HUFF_LEN, E_HUFF_PAD,
    E_HUFF_KRAFT, E_ENDS, E_STREAMS_PAST, E_ENDS_BACK, E_STREAM, E_TRAILING, E_SPARSE_HDR, E_SPARSE_M,
    E_SPARSE_PAD, E_SPARSE_POP, E_TOTAL
};

/* global, not __constant__: load_crc_table reads it with 256 different addresses per step,
 * which the constant cache would serialize */
__device__ const u32 CRC_TAB[256] = {
0x00000000u, 0xf26b8303u, 0xe13b70f7u, 0x1350f3f4u, 0xc79a971fu, 0x35f1141cu, 0x26a1e7e8u, 0xd4ca64ebu,
0x8ad958cfu, 0x78b2dbccu, 0x6be22838u, 0x9989ab3bu, 0x4d43cfd0u, 0xbf284cd3u, 0xac78bf27u, 0x5e133c24u,
0x105ec76fu, 0xe235446cu, 0xf165b798u, 0x030e349bu, 0xd7c45070u, 0x25afd373u, 0x36ff2087u, 0xc494a384u,
0x9a879fa0u, 0x68ec1ca3u, 0x7bbcef57u, 0x89d76c54u, 0x5d1d08bfu, 0xaf768bbcu, 0xbc267848u, 0x4e4dfb4bu,
0x20bd8edeu, 0xd2d60dddu, 0xc186fe29u, 0x33ed7d2au, 0xe72719c1u, 0x154c9ac2u, 0x061c6936u, 0xf477ea35u,
0xaa64d611u, 0x580f5512u, 0x4b5fa6e6u, 0xb93425e5u, 0x6dfe410eu, 0x9f95c20du, 0x8cc531f9u, 0x7eaeb2fau,
0x30e349b1u, 0xc288cab2u, 0xd1d83946u, 0x23b3ba45u, 0xf779deaeu, 0x05125dadu, 0x1642ae59u, 0xe4292d5au,
0xba3a117eu, 0x4851927du, 0x5b016189u, 0xa96ae28au, 0x7da08661u, 0x8fcb0562u, 0x9c9bf696u, 0x6ef07595u,
0x417b1dbcu, 0xb3109ebfu, 0xa0406d4bu, 0x522bee48u, 0x86e18aa3u, 0x748a09a0u, 0x67dafa54u, 0x95b17957u,
0xcba24573u, 0x39c9c670u, 0x2a993584u, 0xd8f2b687u, 0x0c38d26cu, 0xfe53516fu, 0xed03a29bu, 0x1f682198u,
0x5125dad3u, 0xa34e59d0u, 0xb01eaa24u, 0x42752927u, 0x96bf4dccu, 0x64d4cecfu, 0x77843d3bu, 0x85efbe38u,
0xdbfc821cu, 0x2997011fu, 0x3ac7f2ebu, 0xc8ac71e8u, 0x1c661503u, 0xee0d9600u, 0xfd5d65f4u, 0x0f36e6f7u,
0x61c69362u, 0x93ad1061u, 0x80fde395u, 0x72966096u, 0xa65c047du, 0x5437877eu, 0x4767748au, 0xb50cf789u,
0xeb1fcbadu, 0x197448aeu, 0x0a24bb5au, 0xf84f3859u, 0x2c855cb2u, 0xdeeedfb1u, 0xcdbe2c45u, 0x3fd5af46u,
0x7198540du, 0x83f3d70eu, 0x90a324fau, 0x62c8a7f9u, 0xb602c312u, 0x44694011u, 0x5739b3e5u, 0xa55230e6u,
0xfb410cc2u, 0x092a8fc1u, 0x1a7a7c35u, 0xe811ff36u, 0x3cdb9bddu, 0xceb018deu, 0xdde0eb2au, 0x2f8b6829u,
0x82f63b78u, 0x709db87bu, 0x63cd4b8fu, 0x91a6c88cu, 0x456cac67u, 0xb7072f64u, 0xa457dc90u, 0x563c5f93u,
0x082f63b7u, 0xfa44e0b4u, 0xe9141340u, 0x1b7f9043u, 0xcfb5f4a8u, 0x3dde77abu, 0x2e8e845fu, 0xdce5075cu,
0x92a8fc17u, 0x60c37f14u, 0x73938ce0u, 0x81f80fe3u, 0x55326b08u, 0xa759e80bu, 0xb4091bffu, 0x466298fcu,
0x1871a4d8u, 0xea1a27dbu, 0xf94ad42fu, 0x0b21572cu, 0xdfeb33c7u, 0x2d80b0c4u, 0x3ed04330u, 0xccbbc033u,
0xa24bb5a6u, 0x502036a5u, 0x4370c551u, 0xb11b4652u, 0x65d122b9u, 0x97baa1bau, 0x84ea524eu, 0x7681d14du,
0x2892ed69u, 0xdaf96e6au, 0xc9a99d9eu, 0x3bc21e9du, 0xef087a76u, 0x1d63f975u, 0x0e330a81u, 0xfc588982u,
0xb21572c9u, 0x407ef1cau, 0x532e023eu, 0xa145813du, 0x758fe5d6u, 0x87e466d5u, 0x94b49521u, 0x66df1622u,
0x38cc2a06u, 0xcaa7a905u, 0xd9f75af1u, 0x2b9cd9f2u, 0xff56bd19u, 0x0d3d3e1au, 0x1e6dcdeeu, 0xec064eedu,
0xc38d26c4u, 0x31e6a5c7u, 0x22b65633u, 0xd0ddd530u, 0x0417b1dbu, 0xf67c32d8u, 0xe52cc12cu, 0x1747422fu,
0x49547e0bu, 0xbb3ffd08u, 0xa86f0efcu, 0x5a048dffu, 0x8ecee914u, 0x7ca56a17u, 0x6ff599e3u, 0x9d9e1ae0u,
0xd3d3e1abu, 0x21b862a8u, 0x32e8915cu, 0xc083125fu, 0x144976b4u, 0xe622f5b7u, 0xf5720643u, 0x07198540u,
0x590ab964u, 0xab613a67u, 0xb831c993u, 0x4a5a4a90u, 0x9e902e7bu, 0x6cfbad78u, 0x7fab5e8cu, 0x8dc0dd8fu,
0xe330a81au, 0x115b2b19u, 0x020bd8edu, 0xf0605beeu, 0x24aa3f05u, 0xd6c1bc06u, 0xc5914ff2u, 0x37faccf1u,
0x69e9f0d5u, 0x9b8273d6u, 0x88d28022u, 0x7ab90321u, 0xae7367cau, 0x5c18e4c9u, 0x4f48173du, 0xbd23943eu,
0xf36e6f75u, 0x0105ec76u, 0x12551f82u, 0xe03e9c81u, 0x34f4f86au, 0xc69f7b69u, 0xd5cf889du, 0x27a40b9eu,
0x79b737bau, 0x8bdcb4b9u, 0x988c474du, 0x6ae7c44eu, 0xbe2da0a5u, 0x4c4623a6u, 0x5f16d052u, 0xad7d5351u
};
/* x^(2^n) mod P, as x2n_table in cpu_codec.c */
__constant__ u32 X2N[32] = {0x40000000u, 0x20000000u, 0x08000000u, 0x00800000u, 0x00008000u, 0x82f63b78u, 0x6ea2d55cu, 0x18b8ea18u, 0x510ac59au, 0xb82be955u, 0xb8fdb1e7u, 0x88e56f72u, 0x74c360a4u, 0xe4172b16u, 0x0d65762au, 0x35d73a62u, 0x28461564u, 0xbf455269u, 0xe2ea32dcu, 0xfe7740e6u, 0xf946610bu, 0x3c204f8fu, 0x538586e3u, 0x59726915u, 0x734d5309u, 0xbc1ac763u, 0x7d0722ccu, 0xd289cabeu, 0xe94ca9bcu, 0x05b74f3fu, 0xa51e1f42u, 0x40000000u};

/* Phase timing for tuning (built only with -DUZ_PHASES): clock64 of CUDA block 0, thread 0
 * at the marks of uz_dec_fast (row 0), uz_enc_stats (1) and uz_enc_write (2); columns 14/15
 * hold %globaltimer (ns) at the first and last mark, for the clock rate. Inline PTX, debug only. */
#ifdef UZ_PHASES
__device__ unsigned long long UZ_PH[3][16];
__device__ __forceinline__ unsigned long long gtimer() {
    unsigned long long v;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
    return v;
}
#define PH(k, i) do { if (blockIdx.x == 0 && threadIdx.x == 0) { UZ_PH[k][i] = clock64(); if ((i) == 0) UZ_PH[k][14] = gtimer(); else UZ_PH[k][15] = gtimer(); } } while (0)
#else
#define PH(k, i) do {} while (0)
#endif

__device__ __forceinline__ void report(u64 *err, u64 block, u32 code) {
    atomicMin(err, (block << 8) | code);
}

/* ---- CRC32C ---- */
/* Table-driven CRC (crc32c of cpu_codec.c) with the tables in shared memory, replicated once
 * per lane: entry i of table k for lane L is word ((k * 256 + i) * 32 + L), so the 32 lanes
 * of a warp always read 32 different banks. With one shared copy, 32 data-dependent lookups
 * hit ~3.5 times the same bank and every lookup costs 3-4 shared-memory wavefronts; CRC32C
 * then ran at less than a third of the shared-memory rate. CRC_SLICE tables (slicing-by-1,
 * -2 or -4; 32 KB each) trade shared memory for a shorter per-byte chain. */
#ifndef CRC_SLICE
#define CRC_SLICE 1
#endif
#define CRC_SMEM_WORDS (CRC_SLICE * 256 * 32 + 1024) /* + the 32 KB-shift table (crc_par) */
#define CRC_SMEM_BYTES (CRC_SMEM_WORDS * 4)
/* dynamic shared memory of every kernel: the CRC tables first (launcher: cuda.py SMEM_*) */
extern __shared__ __align__(16) u32 dsm[];
#define STG_BYTES 32768     /* crc_par's row staging: 16 warps x 2 KB, after the CRC tables */
#define SYM_BYTES (128 * (512 + 16)) /* uz_dec_fast: decoded symbols, sub-stream j at j * (S + 16) */
#define NSHIFT 30           /* shift tables: by 2^l bytes, l < NSHIFT */

__device__ u32 SHIFT_TAB[NSHIFT * 1024]; /* see uz_init_tables */

/* Fills the replicated tables: T0 = CRC_TAB, Tk[i] = (Tk-1[i] >> 8) ^ T0[Tk-1[i] & 0xFF].
 * SL tables, then the 32 KB-shift table (crc_par). */
template <int SL = CRC_SLICE>
__device__ __forceinline__ void crc_init_smem(u32 *sm) {
    for (u32 e = threadIdx.x; e < SL * 256; e += blockDim.x) {
        u32 v = CRC_TAB[e & 255u];
        for (u32 q = 0; q < (e >> 8); q++) v = (v >> 8) ^ CRC_TAB[v & 255u];
        uint4 *d = (uint4 *)(sm + e * 32);
        const uint4 vv = make_uint4(v, v, v, v);
#pragma unroll
        for (int r = 0; r < 8; r++) d[r] = vv;
    }
    for (u32 e = threadIdx.x; e < 1024; e += blockDim.x) sm[SL * 256 * 32 + e] = SHIFT_TAB[15 * 1024 + e];
}
/* tab = smem tables + lane: this lane's copy */
#define CRCT(tab, k, i) ((tab)[((k) * 256u + (i)) * 32u])
__device__ __forceinline__ u32 crc_b(const u32 *tab, u32 c, u32 b) {
    return (c >> 8) ^ CRCT(tab, 0, (c ^ b) & 0xFFu);
}
/* c: raw register; feeds the 4 bytes of w, low byte first; SL tables (slicing-by-SL) */
template <int SL = CRC_SLICE>
__device__ __forceinline__ u32 crc_w(const u32 *tab, u32 c, u32 w) {
    c ^= w;
    if constexpr (SL == 4) {
        /* CRCT in byte offsets (entry i of table k at k * 32768 + i * 128): one shift and one
         * mask per lookup, and the table's offset becomes the load's immediate */
        const u8 *t = (const u8 *)tab;
        return *(const u32 *)(t + 3 * 32768 + ((c << 7) & 0x7F80u)) ^ *(const u32 *)(t + 2 * 32768 + ((c >> 1) & 0x7F80u)) ^
               *(const u32 *)(t + 32768 + ((c >> 9) & 0x7F80u)) ^ *(const u32 *)(t + ((c >> 17) & 0x7F80u));
    } else if constexpr (SL == 2) {
        c = CRCT(tab, 1, c & 0xFFu) ^ CRCT(tab, 0, (c >> 8) & 0xFFu) ^ (c >> 16);
        return CRCT(tab, 1, c & 0xFFu) ^ CRCT(tab, 0, (c >> 8) & 0xFFu) ^ (c >> 16);
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) c = (c >> 8) ^ CRCT(tab, 0, c & 0xFFu);
        return c;
    }
}
template <int SL = CRC_SLICE>
__device__ __forceinline__ u32 crc_q(const u32 *tab, u32 c, uint4 v) {
    c = crc_w<SL>(tab, c, v.x); c = crc_w<SL>(tab, c, v.y);
    c = crc_w<SL>(tab, c, v.z); return crc_w<SL>(tab, c, v.w);
}
/* multmodp of cpu_codec.c: a * b mod P, reflected (x^0 = bit 31) */
__device__ u32 multmodp(u32 a, u32 b) {
    u32 p = 0;
    for (; a; a <<= 1) {
        if (a & 0x80000000u) p ^= b;
        b = (b & 1) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
    }
    return p;
}
/* SHIFT_TAB[l][k][v] = (v << 8k) * x^(8 * 2^l) mod P: multiplying a register by x^(8 * 2^l)
 * (appending 2^l zero bytes) is linear, so it is 4 byte lookups instead of multmodp's
 * 32-step loop. X8LO[i] = x^(8 i), X8HI[j] = x^(8 * 4096 j), POW32[j] = x^(8 * 32 j): one or
 * two lookups and one multmodp append any number of zero bytes. All filled once per device
 * by uz_init_tables, read through L2; crc_par fetches what it needs before its main loop. */
#define X8LO_N 4096
#define X8HI_N 16384
#define POW32_N 32768
__device__ u32 X8LO[X8LO_N], X8HI[X8HI_N], POW32[POW32_N];
/* x^(8 n * 2^sh) by square-and-multiply over the bits of n (init only) */
__device__ u32 xpow_slow(u64 n, u32 sh) {
    u32 p = 0x80000000u; /* x^0 */
    for (u32 k = 3 + sh; n; n >>= 1, k++)
        if (n & 1) p = multmodp(X2N[k & 31], p);
    return p;
}
extern "C" __global__ void uz_init_tables() {
    const u32 e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < NSHIFT * 1024) {
        const u32 l = e >> 10, k = (e >> 8) & 3u, v = e & 255u;
        SHIFT_TAB[e] = multmodp(X2N[(l + 3) & 31], v << (8 * k));
    }
    if (e < X8LO_N) X8LO[e] = xpow_slow(e, 0);
    if (e < X8HI_N) X8HI[e] = xpow_slow(e, 12);
    if (e < POW32_N) POW32[e] = xpow_slow(e, 5);
}
#define INIT_TABLE_THREADS (NSHIFT * 1024 > POW32_N ? NSHIFT * 1024 : POW32_N)
__device__ __forceinline__ u32 crc_shift_pow2(u32 c, u32 l) {
    const u32 *t = SHIFT_TAB + l * 1024u;
    return __ldg(t + (c & 0xFFu)) ^ __ldg(t + 256 + ((c >> 8) & 0xFFu)) ^ __ldg(t + 512 + ((c >> 16) & 0xFFu)) ^
           __ldg(t + 768 + (c >> 24));
}
/* x^(8 n) mod P; n < 2^26 by table, beyond by the bit loop (header CRCs of huge tensors) */
__device__ __forceinline__ u32 xpow8(u64 n) {
    if (n < X8LO_N) return __ldg(X8LO + n);
    if ((n >> 12) < X8HI_N) return multmodp(__ldg(X8HI + (n >> 12)), __ldg(X8LO + (n & 4095)));
    return xpow_slow(n, 0);
}
/* register c followed by n zero bytes (crc32c_combine's multiply) */
__device__ __forceinline__ u32 crc_shift(u32 c, u64 n) { return n ? multmodp(xpow8(n), c) : c; }
/* the same by 2^15 bytes, from the shared-memory copy of SHIFT_TAB[15] */
__device__ __forceinline__ u32 crc_shift_32k(const u32 *t, u32 c) {
    return t[c & 0xFFu] ^ t[256 + ((c >> 8) & 0xFFu)] ^ t[512 + ((c >> 16) & 0xFFu)] ^ t[768 + (c >> 24)];
}

/* Continues registers c[0..K) over K byte ranges of equal length len starting at q + k * stride
 * (any alignment, all with the same alignment); the K chains are independent, interleaved
 * so their table-lookup latencies overlap. Reads exactly the bytes of the ranges. */
template <int K, int SL = CRC_SLICE>
__device__ __forceinline__ void crc_run(const u32 *tab, u32 *c, const u8 *q, u64 stride, u32 len) {
    u32 o = 0;
    for (; o < len && (((size_t)q + o) & 3); o++)
#pragma unroll
        for (int k = 0; k < K; k++) c[k] = crc_b(tab, c[k], q[k * stride + o]);
    for (; o + 4 <= len && (((size_t)q + o) & 15); o += 4)
#pragma unroll
        for (int k = 0; k < K; k++) c[k] = crc_w<SL>(tab, c[k], *(const u32 *)(q + k * stride + o));
    for (; o + 32 <= len; o += 32) {
        uint4 v[K][2];
#pragma unroll
        for (int k = 0; k < K; k++) {
            v[k][0] = *(const uint4 *)(q + k * stride + o);
            v[k][1] = *(const uint4 *)(q + k * stride + o + 16);
        }
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int k = 0; k < K; k++) c[k] = crc_q<SL>(tab, c[k], v[k][h]);
    }
    for (; o + 4 <= len; o += 4)
#pragma unroll
        for (int k = 0; k < K; k++) c[k] = crc_w<SL>(tab, c[k], *(const u32 *)(q + k * stride + o));
    for (; o < len; o++)
#pragma unroll
        for (int k = 0; k < K; k++) c[k] = crc_b(tab, c[k], q[k * stride + o]);
}
/* CRC32C (finished) of [p, p + n), by all TPB threads; returns it to every thread.
 * The range is cut into a head (up to the first 16-byte boundary, one thread), a middle of
 * whole 32-byte slots, and a tail (< 32 bytes, one thread). The middle is read in rows of
 * 1 KB: a warp loads a row with coalesced 16-byte loads (lane L: pieces L and L + 32),
 * passes each piece to f (the histogram of uz_enc_stats), and transposes the row through
 * shared memory (XOR-swizzled: conflict-free both ways) so that lane u then holds slot u
 * (32 contiguous bytes) and runs the table CRC over it. When every lane streamed its own
 * contiguous chunk instead, each warp load touched 32 cache lines and crc_par ran at
 * ~1.2 TB/s (4.6 bytes per clock per SM). A warp takes two rows per step (two independent
 * chains per lane); chain c of warp w covers rows w + 16 c, w + 16 (c + 2), ...: 32 KB apart,
 * so each slot register is folded in Horner-style with one x^(8 * 2^15) shift (4 lookups).
 * At the end each chain is shifted to the end of the middle (crc_shift), all are XORed,
 * and thread 0 joins head, middle and tail (CRC linearity, as crc32c_combine).
 * red: TPB / 32 + 4 words; stg: 16 warps x 2 KB of shared memory (16-byte aligned). */
struct NoPieceFn { __device__ __forceinline__ void operator()(const uint4 &, u64) const {} };
template <class F>
__device__ u32 crc_par(const u32 *tab, const u8 *p, u64 n, u32 *red, uint4 *stg, F f) {
    static_assert(TPB == 512, "row schedule assumes 16 warps (32 KB between a chain's rows)");
    const u32 t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const u8 *A = (const u8 *)min(((size_t)p + 15) & ~(size_t)15, (size_t)(p + n));
    const u64 head = (u64)(A - p);
    const u64 mid = (n - head) & ~(u64)31;
    const u64 tail = n - head - mid;
    const u64 Cm = mid / 32, R = (mid + 1023) / 1024;
    uint4 *sw = stg + warp * 128;
    const u32 *sh32k = tab - (threadIdx.x & 31) + CRC_SLICE * 256 * 32;
    u32 acc[2] = {0u, 0u};
    long long lastm[2] = {-1, -1};
    /* each chain's final shift (to the end of the middle) is known up front: fetch its
     * constant now, so the end costs one multmodp instead of a chain of L2 lookups */
    u32 kfin[2] = {0u, 0u};
    {
        const u64 Rl = Cm > lane ? (Cm - lane + 31) / 32 : 0; /* rows in which this lane has a slot */
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const u64 r1 = warp + 16 * c;
            if (Rl > r1) {
                const u64 rl = r1 + 32 * ((Rl - 1 - r1) / 32);
                const u64 d = Cm - 1 - (rl * 32 + lane);
                kfin[c] = d < POW32_N ? __ldg(POW32 + d) : xpow8(32 * d);
            }
        }
    }
    u32 hshift = 0, ktail = 0;
    if (t == 0) { /* head: from ~0, any alignment, < 16 bytes; moved to the end right away */
        u32 c = 0xFFFFFFFFu;
        for (u64 i = 0; i < head; i++) c = crc_b(tab, c, p[i]);
        hshift = crc_shift(c, mid + tail);
        ktail = xpow8(tail);
    }
    /* software-pipelined: the next step's rows are loaded before this step's chains run */
    uint4 v[2][2];
    auto load = [&](u64 r0) {
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const u64 r = r0 + 16 * c;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const u64 off = r * 1024 + 16 * (lane + 32 * h);
                if (r < R && off < mid) {
                    v[c][h] = *(const uint4 *)(A + off);
                    f(v[c][h], head + off);
                }
            }
        }
    };
    if (warp < R) load(warp);
    for (u64 r0 = warp; r0 < R; r0 += 32) {
#pragma unroll
        for (int c = 0; c < 2; c++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const u32 q = lane + 32 * h, u = q >> 1, hh = q & 1;
                sw[c * 64 + u * 2 + (hh ^ ((u >> 2) & 1))] = v[c][h];
            }
        __syncwarp();
        uint4 s[2][2];
#pragma unroll
        for (int c = 0; c < 2; c++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) s[c][hh] = sw[c * 64 + lane * 2 + (hh ^ ((lane >> 2) & 1))];
        __syncwarp();
        if (r0 + 32 < R) load(r0 + 32);
        u32 cr[2] = {0u, 0u};
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
#pragma unroll
            for (int c = 0; c < 2; c++) cr[c] = crc_q(tab, cr[c], s[c][hh]);
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const u64 m = (r0 + 16 * c) * 32 + lane;
            if (m < Cm) {
                acc[c] = (lastm[c] >= 0 ? crc_shift_32k(sh32k, acc[c]) : 0u) ^ cr[c];
                lastm[c] = (long long)m;
            }
        }
    }
    u32 x = 0;
#pragma unroll
    for (int c = 0; c < 2; c++)
        if (lastm[c] >= 0) x ^= multmodp(kfin[c], acc[c]);
    x = __reduce_xor_sync(0xFFFFFFFFu, x);
    if (lane == 0) red[warp] = x;
    if (t == 32) { /* tail: 16-byte aligned, < 32 bytes */
        u32 c = 0;
        const u8 *q = A + mid;
        u64 i = 0;
        for (; i + 4 <= tail; i += 4) c = crc_w(tab, c, *(const u32 *)(q + i));
        for (; i < tail; i++) c = crc_b(tab, c, q[i]);
        red[TPB / 32 + 1] = c;
    }
    __syncthreads();
    if (t == 0) {
        u32 m = 0;
        for (int w = 0; w < TPB / 32; w++) m ^= red[w];
        const u32 reg = hshift ^ multmodp(ktail, m) ^ red[TPB / 32 + 1];
        red[TPB / 32 + 2] = n ? ~reg : 0u;
    }
    __syncthreads();
    const u32 r = red[TPB / 32 + 2];
    __syncthreads();
    return r;
}
__device__ __forceinline__ u32 crc_par(const u32 *tab, const u8 *p, u64 n, u32 *red, uint4 *stg) {
    return crc_par(tab, p, n, red, stg, NoPieceFn());
}

/* ---- unaligned little-endian access to global memory ---- */
/* 16 bytes at p (any alignment) as 4 words; reads only the aligned 16-byte words holding
 * them (CUDA allocations come in multiples of 16 bytes: it never leaves one), with 16-byte
 * loads: a warp's loads touch half as many L1 wavefronts as 4-byte ones would */
__device__ __forceinline__ void load16a(const u8 *p, u32 w[4]) {
    const size_t a = (size_t)p;
    const uint4 *q = (const uint4 *)(a & ~(size_t)15);
    const u32 sh = (u32)(a & 15);
    const uint4 x = q[0];
    if (!sh) { w[0] = x.x; w[1] = x.y; w[2] = x.z; w[3] = x.w; return; }
    const uint4 y = q[1];
    const u32 X[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
    const u32 ws = sh >> 2, bs = (sh & 3) * 8;
    u32 s[5];
#pragma unroll
    for (int k = 0; k < 5; k++) s[k] = ws == 0 ? X[k] : (ws == 1 ? X[k + 1] : (ws == 2 ? X[k + 2] : X[(k + 3) & 7]));
#pragma unroll
    for (int k = 0; k < 4; k++) w[k] = __funnelshift_r(s[k], s[k + 1], bs);
}

__device__ __forceinline__ u32 ld_u16(const u8 *p) { return (u32)p[0] | ((u32)p[1] << 8); }
__device__ __forceinline__ u32 ld_u32(const u8 *p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}
__device__ __forceinline__ u32 bytew(const u32 *w, int e) { return (w[e >> 2] >> ((e & 3) * 8)) & 0xFFu; }

/* ---- element layouts (split_planes / merge_planes of cpu_codec.c) ---- */
template <int LAYOUT, int ISZ> struct Lay {
    static constexpr int P = LAYOUT == LAYOUT_BYTES ? ISZ : (LAYOUT == LAYOUT_BF16 ? 2 : 4);
};
/* plane j byte of the element whose bytes are given as words (ISZ <= 4: one word) */
template <int LAYOUT, int ISZ> __device__ __forceinline__ u32 plane_sym(u32 x, int j) {
    if (LAYOUT == LAYOUT_BF16) return j == 0 ? (x >> 7) & 0xFFu : (((x >> 8) & 0x80u) | (x & 0x7Fu));
    if (LAYOUT == LAYOUT_FP32) {
        if (j == 0) return (x >> 23) & 0xFFu;
        if (j == 1) return x & 0xFFu;
        if (j == 2) return (x >> 8) & 0xFFu;
        return ((x >> 24) & 0x80u) | ((x >> 16) & 0x7Fu);
    }
    return (x >> (8 * j)) & 0xFFu;
}
/* 16 elements from P planes of 16 bytes each -> 4*ISZ output words */
template <int LAYOUT, int ISZ> __device__ __forceinline__ void merge16(const u32 (*pw)[4], u32 *o) {
    if (LAYOUT == LAYOUT_BF16) {
        /* two elements per word: spread their plane bytes to the 16-bit halves (one byte
         * permute per plane), then shift and mask both halves at once */
#pragma unroll
        for (int e = 0; e < 16; e += 2) {
            const u32 sel = (e & 2) ? 0x4342u : 0x4140u; /* bytes e, e+1 of the word -> bytes 0, 2 */
            const u32 E = __byte_perm(pw[0][e >> 2], 0u, sel), R = __byte_perm(pw[1][e >> 2], 0u, sel);
            o[e / 2] = ((R << 8) & 0x80008000u) | (E << 7) | (R & 0x007F007Fu);
        }
    } else if (LAYOUT == LAYOUT_FP32) {
#pragma unroll
        for (int e = 0; e < 16; e++) {
            u32 r3 = bytew(pw[3], e);
            o[e] = ((r3 & 0x80u) << 24) | (bytew(pw[0], e) << 23) | ((r3 & 0x7Fu) << 16) | (bytew(pw[2], e) << 8) |
                   bytew(pw[1], e);
        }
    } else {
#pragma unroll
        for (int w = 0; w < 4 * ISZ; w++) {
            u32 v = 0;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                int i = 4 * w + b;
                v |= bytew(pw[i % ISZ], i / ISZ) << (8 * b);
            }
            o[w] = v;
        }
    }
}
/* one element from its P plane bytes -> ISZ bytes */
template <int LAYOUT, int ISZ> __device__ __forceinline__ void merge1(const u32 *pb, u8 *ob) {
    if (LAYOUT == LAYOUT_BF16) {
        u32 x = ((pb[1] & 0x80u) << 8) | (pb[0] << 7) | (pb[1] & 0x7Fu);
        ob[0] = (u8)x; ob[1] = (u8)(x >> 8);
    } else if (LAYOUT == LAYOUT_FP32) {
        u32 x = ((pb[3] & 0x80u) << 24) | (pb[0] << 23) | ((pb[3] & 0x7Fu) << 16) | (pb[2] << 8) | pb[1];
        ob[0] = (u8)x; ob[1] = (u8)(x >> 8); ob[2] = (u8)(x >> 16); ob[3] = (u8)(x >> 24);
    } else {
#pragma unroll
        for (int j = 0; j < ISZ; j++) ob[j] = (u8)pb[j];
    }
}

/* ---- Huffman decoding ---- */
/* LUT entry (u32), indexed by the next 11 bits of the stream (LSB first):
 *   bits 0-7 first symbol, 8-15 second symbol (0 when there is none), 16-20 bits consumed
 *   by the pair (= first length when there is no second code), 21: a second code fits in the
 *   11 bits, 22: no code starts here (lengths read as 1), 27-31 first code's length.
 * The first length sits on top so a single-symbol decoder gets it with one shift; the
 * 2-symbol entries halve the serial lookup chain of the pair decoder, as the CPU's do. */
#define LUT_LEN1(e) ((e) >> 27)
#define LUT_LEN2(e) (((e) >> 16) & 0x1Fu)
#define LUT_TWO(e) (((e) >> 21) & 1u)
#define LUT_BAD_BIT (1u << 22)
#define LUT_SINGLE(sym, l) ((sym) | ((u32)(l) << 27) | ((u32)(l) << 16))
#define LUT_NOCODE (LUT_SINGLE(0u, 1u) | LUT_BAD_BIT)
struct HuffReader {
    u64 buf;          /* bit buffer, next bit at bit 0 */
    int nb;           /* valid bits in buf */
    const uint4 *qp, *qend; /* next aligned 16-byte word to load / end */
    uint4 cur, nxt;   /* the 16-byte word being consumed and the next one, loaded one word ahead */
    u32 wi;           /* next 4-byte word of cur */
    /* A refill takes a word already in registers; the load of `nxt` is issued 4 refills
     * (~12 symbols each) before it is needed, so the decode chain never waits for L2. With
     * one word loaded at refill time, lanes refilled at different symbols and the warp
     * stalled on some lane's load at nearly every lookup. */
    u32 used, bad;    /* bits consumed; nonzero once a lookup hit "no code" */
    u64 pend;         /* decoded symbols not handed out yet (at most one, low byte first) */
    u32 npend;
    __device__ __forceinline__ uint4 ldq() {
        const uint4 v = qp < qend ? *qp : make_uint4(0u, 0u, 0u, 0u);
        qp++;
        return v;
    }
    __device__ __forceinline__ u32 word() {
        const u32 w = wi == 0 ? cur.x : (wi == 1 ? cur.y : (wi == 2 ? cur.z : cur.w));
        if (++wi == 4) { cur = nxt; nxt = ldq(); wi = 0; }
        return w;
    }
    __device__ __forceinline__ void init(const u8 *p, u32 nbytes) {
        const size_t a = (size_t)p;
        qp = (const uint4 *)(a & ~(size_t)15);
        qend = (const uint4 *)((a + nbytes + 15) & ~(size_t)15);
        used = 0; bad = 0; pend = 0; npend = 0;
        cur = ldq(); nxt = ldq();
        wi = (u32)(a & 15) / 4;
        const u32 sk = (u32)(a & 3) * 8;
        const u32 w0 = word(), w1 = word();
        buf = ((u64)w0 | ((u64)w1 << 32)) >> sk;
        nb = 64 - (int)sk;
    }
    __device__ __forceinline__ void refill() {
        buf |= (u64)word() << nb;
        nb += 32;
    }
    /* one symbol (single-code fields of the entry) */
    __device__ __forceinline__ u32 dec(const u32 *lut) {
        u32 e = lut[buf & (LUT_SIZE - 1)];
        u32 l = LUT_LEN1(e);
        bad |= e & LUT_BAD_BIT;
        buf >>= l; nb -= l; used += l;
        return e & 0xFFu;
    }
    __device__ __forceinline__ u32 dec1(const u32 *lut) {
        if (npend) { u32 s = (u32)pend & 0xFFu; pend >>= 8; npend--; return s; }
        if (nb < 11) refill();
        return dec(lut);
    }
    /* 16 symbols into 4 words with single lookups (for a sub-stream's last 16 symbols) */
    __device__ __forceinline__ void dec16_single(const u32 *lut, u32 *w) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            u32 a = dec1(lut), b = dec1(lut), c = dec1(lut), d = dec1(lut);
            w[q] = a | (b << 8) | (c << 16) | (d << 24);
        }
    }
    /* 16 symbols into 4 words with pair lookups. The caller guarantees the sub-stream holds
     * at least one more symbol after these 16, so a pair never reads past its end; the
     * 17th symbol, if a pair produced it, is kept in pend. */
    __device__ __forceinline__ void dec16(const u32 *lut, u32 *w) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u64 acc = pend;
            u32 na = npend, carry = 0;
            while (na < 8) {
                if (nb < 32) refill();
                u32 e = lut[buf & (LUT_SIZE - 1)];
                u32 l = LUT_LEN2(e), two = LUT_TWO(e);
                bad |= e & LUT_BAD_BIT;
                buf >>= l; nb -= l; used += l;
                acc |= (u64)(e & 0xFFFFu) << (8 * na); /* at na == 7 the second symbol falls off: carry */
                if (na == 7) carry = (e >> 8) & 0xFFu;
                na += 1 + two;
            }
            w[2 * h] = (u32)acc; w[2 * h + 1] = (u32)(acc >> 32);
            npend = na - 8;
            pend = npend ? carry : 0;
        }
    }
    __device__ __forceinline__ bool ok(u32 nbytes) const { return !bad && npend == 0 && (used + 7) / 8 == nbytes; }
};

/* Parsed Huffman plane (decode_plane's checks). */
struct HuffPlane {
    const u8 *lens;  /* nibbles */
    const u8 *ends;
    const u8 *data;
    u32 lo, hi, k, total, count;
};

#define LUT_SCRATCH (36 + 256 + 4 + 64)
/* Builds the 2^11-entry pair LUT in smem from the nibble-coded lengths, with NT threads
 * (t = 0..NT-1): a whole CUDA block (uz_dec_fast/slow) or a group of uz_dec_wide. Every
 * thread of the CUDA block calls it (uniform barriers); with active == false a thread's
 * group does nothing. Returns 0, E_HUFF_LEN (a length over 11) or E_HUFF_KRAFT
 * (over-subscribed). Everything is parallel: a thread per symbol reads its length once (a
 * serial loop of dependent global loads on thread 0 cost ~20 us per block), counts go
 * through shared atomics, and a symbol's place in the canonical order is a count over the
 * smaller symbols. scratch: >= LUT_SCRATCH words of smem. */
template <int NT>
__device__ u32 build_lut_group(const HuffPlane &h, bool active, u32 *lut, u32 *scratch, u32 t) {
    u32 *cnt = scratch, *first = scratch + 12, *offs = scratch + 24, *sorted = scratch + 36, *okp = scratch + 36 + 256;
    u8 *slen = (u8 *)(scratch + 36 + 256 + 4);
    const u32 span = active ? h.hi - h.lo + 1 : 0;
    if (active) {
        if (t < 12) cnt[t] = 0;
        if (t == 0) *okp = 0;
    }
    __syncthreads();
    if (active)
        for (u32 s = t; s < 256; s += NT) {
            u32 l = 0;
            if (s < span) {
                l = (h.lens[s / 2] >> ((s & 1) * 4)) & 0xFu;
                if (l > MAX_CODE_LEN) { atomicOr(okp, 1u); l = 0; }
                else if (l) atomicAdd(&cnt[l], 1u);
            }
            slen[s] = (u8)l;
        }
    __syncthreads();
    if (active && t == 0) {
        u32 c = 0, kraft = 0, o = 0;
        for (int l = 1; l <= MAX_CODE_LEN; l++) {
            c = (c + cnt[l - 1]) << 1;
            first[l] = c;
            offs[l] = o;
            o += cnt[l];
            kraft += cnt[l] << (MAX_CODE_LEN - l);
        }
        if (kraft > LUT_SIZE) *okp |= 2u;
    }
    __syncthreads();
    const u32 bad = active ? *okp : 1u;
    if (!bad)
        for (u32 s = t; s < span; s += NT)
            if (slen[s]) {
                const u32 l = slen[s];
                u32 r = 0;
                for (u32 q = 0; q < s; q++) r += slen[q] == l;
                sorted[offs[l] + r] = h.lo + s;
            }
    __syncthreads();
    if (!bad)
        for (u32 j = t; j < LUT_SIZE; j += NT) {
            u32 r = __brev(j) >> 21, e = LUT_NOCODE;
            for (int l = 1; l <= MAX_CODE_LEN; l++) {
                u32 c = r >> (MAX_CODE_LEN - l);
                if (c - first[l] < cnt[l]) {
                    e = LUT_SINGLE(sorted[offs[l] + c - first[l]], l);
                    break;
                }
            }
            lut[j] = e;
        }
    __syncthreads();
    u32 v[LUT_SIZE / NT];
    if (!bad)
#pragma unroll
        for (int q = 0; q < LUT_SIZE / NT; q++) {
            const u32 j = t + q * NT;
            u32 e = lut[j];
            if (!(e & LUT_BAD_BIT)) {
                const u32 l1 = LUT_LEN1(e), e2 = lut[j >> l1], l2 = LUT_LEN1(e2);
                if (!(e2 & LUT_BAD_BIT) && l1 + l2 <= MAX_CODE_LEN)
                    e = (e & ~(0x1Fu << 16)) | ((e2 & 0xFFu) << 8) | ((l1 + l2) << 16) | (1u << 21);
            }
            v[q] = e;
        }
    __syncthreads();
    if (!bad)
#pragma unroll
        for (int q = 0; q < LUT_SIZE / NT; q++) lut[t + q * NT] = v[q];
    __syncthreads();
    if (!active) return 0;
    return (bad & 1u) ? (u32)E_HUFF_LEN : (bad ? (u32)E_HUFF_KRAFT : 0u);
}

/* Parses one plane at *p (bounded by end) with count symbols: decode_plane's header checks.
 * Returns 0 or an error code. Thread-local. */
__device__ u32 parse_plane(const u8 *&p, const u8 *end, u32 count, u32 substream, u32 &mode, u32 &cval,
                           const u8 *&raw, HuffPlane &h) {
    if (p >= end) return E_PLANE_HDR;
    mode = *p++;
    if (mode == PLANE_RAW) {
        if ((u64)(end - p) < count) return E_RAW_PLANE;
        raw = p;
        p += count;
        return 0;
    }
    if (mode == PLANE_CONST) {
        if (p >= end) return E_CONST_PLANE;
        cval = *p++;
        return 0;
    }
    if (mode != PLANE_HUFF) return E_PLANE_MODE;
    if (count == 0) return E_HUFF_EMPTY;
    if (end - p < 2) return E_HUFF_TABLE;
    h.lo = p[0];
    h.hi = h.lo + p[1];
    p += 2;
    if (h.hi > 255) return E_HUFF_RANGE;
    u32 nib = (h.hi - h.lo + 2) / 2;
    if ((u64)(end - p) < nib) return E_HUFF_TABLE;
    if (((h.hi - h.lo) & 1) == 0 && (p[nib - 1] >> 4)) return E_HUFF_PAD;
    h.lens = p;
    p += nib;
    h.k = (count + substream - 1) / substream;
    h.count = count;
    if ((u64)(end - p) < 2ull * h.k) return E_ENDS;
    h.ends = p;
    h.data = p + 2 * h.k;
    h.total = ld_u16(h.ends + 2 * (h.k - 1));
    if ((u64)(end - h.data) < h.total) return E_STREAMS_PAST;
    p = h.data + h.total;
    return 0;
}

/* ======================= encoder ======================= */

/* Element i of a block (ISZ <= 4) as a word. */
template <int ISZ> __device__ __forceinline__ u32 elem_at(const u8 *bsrc, u32 i) {
    if (ISZ == 1) return bsrc[i];
    if (ISZ == 2) return ((const u16 *)bsrc)[i];
    return ((const u32 *)bsrc)[i];
}
/* Plane j byte of element i (split_planes). */
template <int LAYOUT, int ISZ> __device__ __forceinline__ u32 plane_byte(const u8 *bsrc, u32 i, int j) {
    if (LAYOUT == LAYOUT_BYTES) return bsrc[(size_t)i * ISZ + j];
    return plane_sym<LAYOUT, ISZ>(elem_at<ISZ>(bsrc, i), j);
}
/* Element el (0..15) of a 16-element chunk held as 4*ISZ words (ISZ <= 4). */
template <int ISZ> __device__ __forceinline__ u32 elem_of(const u32 *wds, int el) {
    if (ISZ == 1) return bytew(wds, el);
    if (ISZ == 2) return (wds[el >> 1] >> ((el & 1) * 16)) & 0xFFFFu;
    return wds[(el * ISZ) / 4];
}

/* build_lengths of cpu_codec.c, after the keys are sorted; one thread. */
__device__ void build_lengths_tail(const u64 *key, int n, u32 *w, u16 *parent, u8 *depth, u8 *len) {
    for (int i = 0; i < n; i++) w[i] = (u32)(key[i] >> 8);
    int leaf = 0, inode = n, next = n;
    while (next < 2 * n - 1) {
        int pick[2];
        for (int t = 0; t < 2; t++) {
            if (leaf < n && (inode >= next || w[leaf] <= w[inode])) pick[t] = leaf++;
            else pick[t] = inode++;
        }
        w[next] = w[pick[0]] + w[pick[1]];
        parent[pick[0]] = parent[pick[1]] = (u16)next;
        next++;
    }
    int root = 2 * n - 2;
    u32 count[64];
    for (int l = 0; l < 64; l++) count[l] = 0;
    depth[root] = 0;
    for (int i = root - 1; i >= 0; i--) {
        depth[i] = (u8)(depth[parent[i]] + 1);
        if (i < n) count[depth[i] < 63 ? depth[i] : 63]++;
    }
    for (int l = MAX_CODE_LEN + 1; l < 64; l++) count[MAX_CODE_LEN] += count[l];
    u32 kraft = 0;
    for (int l = 1; l <= MAX_CODE_LEN; l++) kraft += count[l] << (MAX_CODE_LEN - l);
    while (kraft > LUT_SIZE) {
        count[MAX_CODE_LEN]--;
        for (int l = MAX_CODE_LEN - 1; l > 0; l--)
            if (count[l]) { count[l]--; count[l + 1] += 2; break; }
        kraft--;
    }
    for (int s = 0; s < 256; s++) len[s] = 0;
    int i = 0;
    for (int l = MAX_CODE_LEN; l >= 1; l--)
        for (u32 c = 0; c < count[l]; c++) len[key[i++] & 0xFF] = (u8)l;
}

/* Info record (INFO_BYTES per block), words: 0 payload bytes, 1 crc_original, 2 block mode,
 * 3 entropy-plane mode, 4 lo, 5 hi, 6 const value, 7 sub-stream data bytes, 8 k, 9 nibble bytes;
 * bytes 64..319 code lengths, 320.. u16 inclusive sub-stream ends (k <= MAX_ENC_STREAMS). */

/* Pass 1 (encode_block's analysis), one CUDA block of TPB threads per codec block:
 *   1. histogram of the entropy plane: per-lane counter columns cnt[sym][lane], so the lanes
 *      of a warp never collide (shared atomics only between warps);
 *   2. CRC of the original block (crc_par);
 *   3. the length-limited code (rank sort in parallel, build_lengths_tail on one thread);
 *   4. each sub-stream's byte count: one warp per sub-stream sums the code lengths of its
 *      symbols (re-reading the block, which is in L1/L2 by now); the writer needs these
 *      offsets, and the block's payload size must count each sub-stream's padding.
 *   src    the tensor's bytes (16-byte aligned)   numel  elements
 *   S      sub-stream elements (ENC_S)             cp     entropy plane, -1: RAW blocks
 *   info   out: INFO_BYTES per block (see above)                                              */
template <int LAYOUT, int ISZ>
__device__ void enc_stats(const u8 *__restrict__ src, u64 numel, u32 S, int cp, u8 *__restrict__ info) {
    constexpr int P = Lay<LAYOUT, ISZ>::P;
    u32 *const crc_sm = dsm;                                   /* CRC_SMEM_WORDS */
    uint4 *const stg = (uint4 *)(dsm + CRC_SMEM_WORDS);        /* STG_BYTES */
    u32 *const cnt = dsm + CRC_SMEM_WORDS + STG_BYTES / 4;     /* 128 x 32: two u16 counters per word */
    __shared__ u32 hist[256];
    __shared__ u8 len[256];
    __shared__ u32 red[TPB / 32 + 4];
    __shared__ u32 sbytes[MAX_ENC_STREAMS];
    __shared__ u64 keys[256];
    __shared__ u32 wt[512];
    __shared__ u16 parent[512];
    __shared__ u8 depth[512];
    __shared__ u32 misc[4];
    const u32 b = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const u64 first = (u64)b * ENC_BLOCK;
    const u32 n = (u32)min((u64)ENC_BLOCK, numel - first);
    const u8 *bsrc = src + first * ISZ;
    const u32 nbytes = n * ISZ;
    PH(1, 0);
    crc_init_smem(crc_sm);
    const bool coded = cp >= 0 && ISZ <= 4;
    if (coded)
        for (u32 i = t; i < 128 * 32; i += TPB) cnt[i] = 0;
    __syncthreads();
    /* the histogram rides on crc_par's coalesced loads: lane-private counter words (no
     * collisions inside a warp), two symbols' u16 counters per word (a lane column counts
     * at most 65536 / 32 elements) */
    auto hist_fn = [&](const uint4 &x, u64) {
        if (!coded) return;
        const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int el = 0; el < 16 / ISZ; el++) {
            const u32 sy = plane_sym<LAYOUT, ISZ>(elem_of<ISZ>(w, el), cp);
            atomicAdd(&cnt[(sy >> 1) * 32 + lane], 1u << (16 * (sy & 1)));
        }
    };
    const u32 crc_orig = crc_par(crc_sm + lane, bsrc, nbytes, red, stg, hist_fn);
    PH(1, 1);
    if (coded) /* elements of the tail crc_par does not hand to hist_fn (< 32 bytes) */
        for (u32 e = (nbytes & ~31u) / ISZ + t; e < n; e += TPB) {
            const u32 sy = plane_byte<LAYOUT, ISZ>(bsrc, e, cp);
            atomicAdd(&cnt[(sy >> 1) * 32 + lane], 1u << (16 * (sy & 1)));
        }
    __syncthreads();
    u32 *inf = (u32 *)(info + (size_t)b * INFO_BYTES);
    if (!coded) {
        if (t == 0) { inf[0] = 1 + nbytes; inf[1] = crc_orig; inf[2] = BLOCK_RAW; }
        return;
    }
    for (u32 s = t; s < 256; s += TPB) {
        u32 h = 0;
        for (int k = 0; k < 32; k++) h += (cnt[(s >> 1) * 32 + ((k + s) & 31)] >> (16 * (s & 1))) & 0xFFFFu;
        hist[s] = h;
    }
    __syncthreads();
    for (u32 s = t; s < 256; s += TPB) {
        len[s] = 0;
        if (hist[s]) {
            const u64 k = ((u64)hist[s] << 8) | (u64)s;
            u32 r = 0;
            for (int s2 = 0; s2 < 256; s2++) r += hist[s2] && ((((u64)hist[s2] << 8) | (u64)s2) < k);
            keys[r] = k;
        }
    }
    if (t == 0) { misc[1] = 255; misc[2] = 0; }
    __syncthreads();
    if (t < 256 && hist[t]) { atomicMin(&misc[1], t); atomicMax(&misc[2], t); }
    const u32 used = __syncthreads_count(t < 256 && hist[t] != 0);
    const u32 lo = misc[1], hi = misc[2];
    PH(1, 2);
    if (used >= 2 && t == 0) build_lengths_tail(keys, (int)used, wt, parent, depth, len);
    __syncthreads();
    PH(1, 3);
    const u32 k = (n + S - 1) / S;
    if (used >= 2) {
        /* sub-stream j: elements [j*S, min((j+1)*S, n)); S * ISZ is a multiple of 16 */
        for (u32 j = warp; j < k; j += TPB / 32) {
            const u32 e0 = j * S, e1 = min(e0 + S, n);
            const u32 v0 = e0 * ISZ / 16, v1 = e1 * ISZ / 16;
            u32 bits = 0;
            for (u32 i = v0 + lane; i < v1; i += 32) {
                const uint4 x = ((const uint4 *)bsrc)[i];
                const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
                for (int el = 0; el < 16 / ISZ; el++) bits += len[plane_sym<LAYOUT, ISZ>(elem_of<ISZ>(w, el), cp)];
            }
            for (u32 e = v1 * 16 / ISZ + lane; e < e1; e += 32) bits += len[plane_byte<LAYOUT, ISZ>(bsrc, e, cp)];
            bits = __reduce_add_sync(0xFFFFFFFFu, bits);
            if (lane == 0) sbytes[j] = (bits + 7) / 8;
        }
    }
    __syncthreads();
    PH(1, 4);
    if (warp == 0 && used >= 2) { /* inclusive scan of the k <= 128 sub-stream sizes: 4 per lane */
        u32 v[MAX_ENC_STREAMS / 32], sum = 0;
#pragma unroll
        for (int q = 0; q < MAX_ENC_STREAMS / 32; q++) {
            const u32 j = lane * (MAX_ENC_STREAMS / 32) + q;
            sum += j < k ? sbytes[j] : 0u;
            v[q] = sum;
        }
        u32 incl = sum;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const u32 o = __shfl_up_sync(0xFFFFFFFFu, incl, d);
            if (lane >= (u32)d) incl += o;
        }
#pragma unroll
        for (int q = 0; q < MAX_ENC_STREAMS / 32; q++) {
            const u32 j = lane * (MAX_ENC_STREAMS / 32) + q;
            if (j < k) sbytes[j] = v[q] + incl - sum;
        }
    }
    __syncthreads();
    if (t == 0) {
        const u32 total = used >= 2 ? sbytes[k - 1] : 0u;
        const u32 nib = (hi - lo + 2) / 2;
        u32 cmode, psize;
        if (used == 1) { cmode = PLANE_CONST; psize = 2; }
        else {
            psize = 3 + nib + 2 * k + total;
            cmode = PLANE_HUFF;
            if (total > 0xFFFFu || psize >= 1 + n) { cmode = PLANE_RAW; psize = 1 + n; }
        }
        const u32 dense = 1 + (P - 1) * (1 + n) + psize;
        const u32 raw = 1 + nbytes;
        inf[0] = dense < raw ? dense : raw;
        inf[1] = crc_orig;
        inf[2] = dense < raw ? BLOCK_DENSE : BLOCK_RAW;
        inf[3] = cmode; inf[4] = lo; inf[5] = hi; inf[6] = lo; inf[7] = total; inf[8] = k; inf[9] = nib;
    }
    __syncthreads();
    u8 *ilen = info + (size_t)b * INFO_BYTES + 64;
    for (u32 s = t; s < 256; s += TPB) ilen[s] = len[s];
    u16 *iends = (u16 *)(info + (size_t)b * INFO_BYTES + 320);
    for (u32 j = t; j < k && used >= 2; j += TPB) iends[j] = (u16)sbytes[j];
    PH(1, 5);
}


/* Exclusive scan of u32 sizes; one CUDA block of 1024 threads. The decoder's first kernel,
 * so it also initializes the decoder's error word and queue count (saves two launches).
 *   sizes      first size; the others follow every `stride` bytes (count of them)
 *   offsets    out: offsets[i] = sum of the sizes before i
 *   total_out  out (or null): base + the sum of all sizes
 *   expect     with check != 0: the sum must equal it ("payloads cover exactly the frame"),
 *              else E_TOTAL goes to *err
 *   err        with check != 0: the decoder's error word, set to ~0 here first
 *   zero_out   (or null) a u32 set to 0 here: uz_dec_fast's queue count */
extern "C" __global__ void uz_scan(const u8 *__restrict__ sizes, u32 stride, u32 count, u64 *__restrict__ offsets,
                                   u64 *__restrict__ total_out, u64 base, u64 expect, int check, u64 *err,
                                   u32 *zero_out) {
    __shared__ u64 part[1024];
    const u32 t = threadIdx.x;
    if (t == 0) {
        if (check) *err = ~0ull;
        if (zero_out) *zero_out = 0;
    }
    const u32 per = (count + 1023) / 1024;
    const u32 a = min(t * per, count), e = min(a + per, count);
    u64 s = 0;
    for (u32 i = a; i < e; i++) s += *(const u32 *)(sizes + (size_t)i * stride);
    part[t] = s;
    __syncthreads();
    for (u32 d = 1; d < 1024; d <<= 1) {
        u64 v = t >= d ? part[t - d] : 0;
        __syncthreads();
        part[t] += v;
        __syncthreads();
    }
    u64 run = part[t] - s;
    for (u32 i = a; i < e; i++) {
        offsets[i] = run;
        run += *(const u32 *)(sizes + (size_t)i * stride);
    }
    if (t == 1023) {
        if (total_out) *total_out = base + part[1023];
        if (check && part[1023] != expect) report(err, 0xFFFFFFFFull, E_TOTAL);
    }
}

/* Writes `nbytes` at any alignment of dst from 16-aligned src, coalesced; all threads. */
__device__ void coop_copy_to_unaligned(u8 *dst, const u8 *src, u32 nbytes) {
    const u32 mis = (u32)((size_t)dst & 3);
    u8 *pa = dst - mis;
    const u32 W = (mis + nbytes + 3) / 4;
    const u32 *s32 = (const u32 *)src;
    const u32 sh = (4 - mis) & 3;
    for (u32 w = threadIdx.x; w < W; w += TPB) {
        long long i0 = 4ll * w - mis;
        if (w > 0 && i0 + 4 <= (long long)nbytes) {
            u32 q = (u32)(i0 >> 2);
            u32 v = sh ? __funnelshift_r(s32[q], s32[q + 1], 8 * sh) : s32[q];
            *(u32 *)(pa + 4 * w) = v;
        } else {
            for (int k = 0; k < 4; k++) {
                long long i = i0 + k;
                if (i >= 0 && i < (long long)nbytes) pa[4 * w + k] = src[i];
            }
        }
    }
}
/* Plane j bytes of the 4 elements at p4 (aligned to 4 * ISZ bytes, ISZ <= 4) as one word. */
template <int LAYOUT, int ISZ> __device__ __forceinline__ u32 plane_word4(const u8 *p4, int j) {
    u32 wds[ISZ];
    if (ISZ == 1) wds[0] = *(const u32 *)p4;
    else if (ISZ == 2) { uint2 v = *(const uint2 *)p4; wds[0] = v.x; wds[ISZ > 1 ? 1 : 0] = v.y; }
    else { uint4 v = *(const uint4 *)p4; wds[0] = v.x; wds[1 % ISZ] = v.y; wds[2 % ISZ] = v.z; wds[3 % ISZ] = v.w; }
    u32 r = 0;
#pragma unroll
    for (int el = 0; el < 4; el++) r |= plane_sym<LAYOUT, ISZ>(elem_of<ISZ>(wds, el), j) << (8 * el);
    return r;
}
/* Writes plane j of the n elements at bsrc (16-byte aligned) to dst (any alignment),
 * coalesced, 16 output bytes per thread and step; threads tid = 0..nth-1 of the block.
 * Output word k of 16-byte group g (at dst - mis + 16g + 4k) holds the plane bytes of
 * elements 16g + 4k - mis .. + 3: a funnel shift of two element-aligned plane words. */
template <int LAYOUT, int ISZ> __device__ void coop_plane(u8 *dst, const u8 *bsrc, u32 n, int j, u32 tid, u32 nth) {
    const u32 mis = (u32)((size_t)dst & 3);
    u8 *pa = dst - mis;
    const u32 G = (mis + n + 15) / 16;
    for (u32 g = tid; g < G; g += nth) {
        if (ISZ <= 4 && g > 0 && 16 * g + 16 <= n) {
            u32 x[5];
            x[0] = plane_word4<LAYOUT, ISZ>(bsrc + (size_t)(16 * g - 4) * ISZ, j);
#pragma unroll
            for (int k = 0; k < 4; k++) x[k + 1] = plane_word4<LAYOUT, ISZ>(bsrc + (size_t)(16 * g + 4 * k) * ISZ, j);
            u32 *o = (u32 *)(pa + 16 * g);
#pragma unroll
            for (int k = 0; k < 4; k++) o[k] = mis ? __funnelshift_r(x[k], x[k + 1], 8 * (4 - mis)) : x[k + 1];
        } else {
            for (int k = 0; k < 16; k++) {
                long long i = 16ll * g + k - mis;
                if (i >= 0 && i < (long long)n) pa[16 * g + k] = (u8)plane_byte<LAYOUT, ISZ>(bsrc, (u32)i, j);
            }
        }
    }
}
/* Canonical codes (assign_codes of cpu_codec.c): (length, symbol) order, stored bit-reversed
 * (LSB-first streams), packed as code | len << 16. All threads, no serial loop over symbols:
 * symbol s's code is the first code of its length plus the number of smaller symbols of
 * that length. cl: 256 words; sc: 12 + 12 + 64 words of smem. */
__device__ void assign_codes_par(const u8 *ilen, u32 *cl, u32 *sc) {
    u32 *cntl = sc, *first = sc + 12;
    u8 *sl = (u8 *)(sc + 24);
    const u32 t = threadIdx.x;
    if (t < 12) cntl[t] = 0;
    __syncthreads();
    if (t < 256) {
        const u32 l = ilen[t];
        sl[t] = (u8)l;
        if (l) atomicAdd(&cntl[l], 1u);
    }
    __syncthreads();
    if (t == 0) {
        u32 cc = 0;
        for (int l = 1; l <= MAX_CODE_LEN; l++) { cc = (cc + cntl[l - 1]) << 1; first[l] = cc; }
    }
    __syncthreads();
    if (t < 256) {
        const u32 l = sl[t];
        u32 r = 0;
        for (u32 s = 0; s < t; s++) r += sl[s] == l; /* same s for all lanes: a broadcast read */
        cl[t] = l ? ((__brev(first[l] + r) >> (32 - l)) | (l << 16)) : 0u;
    }
    __syncthreads();
}

/* Pass 2 (encode_block's output): writes each block's payload at its final offset and its
 * block-table entry (payload bytes, crc_original, crc_payload). One CUDA block per codec block:
 *   - RAW planes by all threads (coalesced, 16 output bytes per thread and step);
 *   - Huffman sub-streams one warp each: every lane codes S/32 consecutive symbols, a warp
 *     scan of their bit counts gives each lane its bit offset, lanes OR their bits into a
 *     per-warp shared buffer, and the warp copies the finished sub-stream to its byte offset
 *     (from uz_enc_stats). No per-symbol serial chain: a sub-stream costs a few dozen steps.
 *   - payload CRC (crc_par, reading the payload back from L2).
 *   src, numel, S, cp    as uz_enc_stats          info     uz_enc_stats' records
 *   offsets              uz_scan's exclusive prefix of payload sizes
 *   out                  the frame buffer; payloads start at payload_offset, the table at table_offset */
template <int LAYOUT, int ISZ>
__device__ void enc_write(const u8 *__restrict__ src, u64 numel, u32 S, int cp, const u8 *__restrict__ info,
                          const u64 *__restrict__ offsets, u8 *out, u64 payload_offset, u64 table_offset) {
    constexpr int P = Lay<LAYOUT, ISZ>::P;
    u32 *const crc_sm = dsm;                                  /* CRC_SMEM_WORDS */
    u32 *const stg_all = dsm + CRC_SMEM_WORDS;                /* TPB / 32 warps x STG_WORDS, then crc_par's */
    __shared__ u32 cl[256];
    __shared__ u32 csc[12 + 12 + 64];
    __shared__ u32 red[TPB / 32 + 4];
    const u32 b = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const u64 first_el = (u64)b * ENC_BLOCK;
    const u32 n = (u32)min((u64)ENC_BLOCK, numel - first_el);
    const u8 *bsrc = src + first_el * ISZ;
    const u32 *inf = (const u32 *)(info + (size_t)b * INFO_BYTES);
    const u32 size = inf[0], crc_orig = inf[1], mode = inf[2];
    u8 *dst = out + payload_offset + offsets[b];
    PH(2, 0);
    crc_init_smem(crc_sm);
    if (mode == BLOCK_RAW) {
        if (t == 0) dst[0] = BLOCK_RAW;
        coop_copy_to_unaligned(dst + 1, bsrc, n * ISZ);
    } else {
        const u32 cmode = inf[3], lo = inf[4], hi = inf[5], total = inf[7], k = inf[8], nib = inf[9];
        if (t == 0) dst[0] = BLOCK_DENSE;
        u8 *p = dst + 1;
        for (int j = 0; j < P; j++) {
            if (j == cp && cmode == PLANE_CONST) {
                if (t == 0) { p[0] = PLANE_CONST; p[1] = (u8)inf[6]; }
                p += 2;
            } else if (j == cp && cmode == PLANE_HUFF) {
                const u8 *ilen = info + (size_t)b * INFO_BYTES + 64;
                assign_codes_par(ilen, cl, csc);
                if (t == 0) { p[0] = PLANE_HUFF; p[1] = (u8)lo; p[2] = (u8)(hi - lo); }
                for (u32 q = t; q < nib; q += TPB) {
                    const u32 s = lo + 2 * q;
                    p[3 + q] = (u8)(ilen[s] | ((s + 1 <= hi ? ilen[s + 1] : 0) << 4));
                }
                PH(2, 1);
                const u16 *iends = (const u16 *)(info + (size_t)b * INFO_BYTES + 320);
                u8 *ends = p + 3 + nib, *data = ends + 2 * k;
                for (u32 q = t; q < k; q += TPB) { const u32 e = iends[q]; ends[2 * q] = (u8)e; ends[2 * q + 1] = (u8)(e >> 8); }
                u32 *stg = stg_all + warp * STG_WORDS;
                for (u32 j = warp; j < k; j += TPB / 32) {
                    const u32 start = j ? iends[j - 1] : 0u, nb = iends[j] - start;
                    for (u32 w = lane; w < STG_WORDS; w += 32) stg[w] = 0;
                    /* this lane's symbols: elements [a, a + cntv), loaded as 16-byte words */
                    const u32 a = j * ENC_S + lane * PER;
                    const u32 cntv = a < n ? min(PER, n - a) : 0u;
                    u32 sy[PER];
                    if (cntv == PER && ISZ <= 4) {
                        u32 wds[PER * ISZ / 4];
#pragma unroll
                        for (u32 q = 0; q < PER * ISZ / 16; q++) {
                            const uint4 x = ((const uint4 *)(bsrc + (size_t)a * ISZ))[q];
                            wds[4 * q] = x.x; wds[4 * q + 1] = x.y; wds[4 * q + 2] = x.z; wds[4 * q + 3] = x.w;
                        }
#pragma unroll
                        for (u32 i = 0; i < PER; i++)
                            sy[i] = plane_sym<LAYOUT, ISZ>(elem_of<ISZ>(wds + (i / 16) * (4 * ISZ), i % 16), cp);
                    } else {
#pragma unroll
                        for (u32 i = 0; i < PER; i++) sy[i] = i < cntv ? plane_byte<LAYOUT, ISZ>(bsrc, a + i, cp) : 0u;
                    }
                    u32 mybits = 0;
#pragma unroll
                    for (u32 i = 0; i < PER; i++) {
                        sy[i] = i < cntv ? cl[sy[i]] : 0u; /* code | len << 16; 0 past the end */
                        mybits += sy[i] >> 16;
                    }
                    u32 incl = mybits;
#pragma unroll
                    for (int d = 1; d < 32; d <<= 1) {
                        const u32 o = __shfl_up_sync(0xFFFFFFFFu, incl, d);
                        if (lane >= (u32)d) incl += o;
                    }
                    const u32 pos = incl - mybits;
                    __syncwarp();
                    u32 wi = pos >> 5;
                    u64 acc = 0;
                    u32 nbits = pos & 31;
#pragma unroll
                    for (u32 i = 0; i < PER; i++) {
                        acc |= (u64)(sy[i] & 0xFFFFu) << nbits;
                        nbits += sy[i] >> 16;
                        if (nbits >= 32) {
                            atomicOr(&stg[wi++], (u32)acc);
                            acc >>= 32;
                            nbits -= 32;
                        }
                    }
                    if (nbits) atomicOr(&stg[wi], (u32)acc);
                    __syncwarp();
                    /* copy nb bytes to data + start (any alignment): whole aligned words where
                     * the sub-stream covers them, bytes at its ends (shared with neighbours) */
                    u8 *d = data + start;
                    const u32 mis = (u32)((size_t)d & 3);
                    u8 *pa = d - mis;
                    const u32 W = (mis + nb + 3) / 4;
                    for (u32 w = lane; w < W; w += 32) {
                        const int i0 = 4 * (int)w - (int)mis;
                        if (i0 >= 0 && i0 + 4 <= (int)nb) {
                            const u32 qq = (u32)i0 >> 2, sh = (u32)i0 & 3;
                            *(u32 *)(pa + 4 * w) = sh ? __funnelshift_r(stg[qq], stg[qq + 1], 8 * sh) : stg[qq];
                        } else {
                            for (int kb = 0; kb < 4; kb++) {
                                const int i = i0 + kb;
                                if (i >= 0 && i < (int)nb) pa[4 * w + kb] = (u8)(stg[i >> 2] >> (8 * (i & 3)));
                            }
                        }
                    }
                    __syncwarp();
                }
                PH(2, 2);
                p = data + total;
            } else {
                if (t == 0) p[0] = PLANE_RAW;
                coop_plane<LAYOUT, ISZ>(p + 1, bsrc, n, j, t, TPB);
                p += 1 + n;
            }
        }
    }
    __syncthreads();
    PH(2, 3);
    const u32 crc_pay = crc_par(crc_sm + lane, dst, size, red, (uint4 *)stg_all);
    PH(2, 4);
    if (t == 0) {
        u32 *te = (u32 *)(out + table_offset + 12ull * b);
        te[0] = size; te[1] = crc_orig; te[2] = crc_pay;
    }
}

/* Writes the 40-byte header and dims (h[0..12], prepared by the host with frame_nbytes 0),
 * patches frame_nbytes from *total, then the header CRC at payload_offset - 4. One CUDA block. */
extern "C" __global__ void __launch_bounds__(TPB) uz_enc_header(u8 *out, const u64 *__restrict__ total, u32 hwords,
                                                                u64 payload_offset, u64 h0, u64 h1, u64 h2, u64 h3,
                                                                u64 h4, u64 h5, u64 h6, u64 h7, u64 h8, u64 h9,
                                                                u64 h10, u64 h11, u64 h12) {
    __shared__ u32 red[TPB / 32 + 4];
    crc_init_smem(dsm);
    if (threadIdx.x == 0) {
        u64 h[13] = {h0, h1, h2, h3, h4, h5, h6, h7, h8, h9, h10, h11, h12};
        h[2] = *total; /* frame_nbytes at byte 16 */
        for (u32 i = 0; i < hwords; i++) ((u64 *)out)[i] = h[i];
    }
    __syncthreads();
    const u32 c = crc_par(dsm + (threadIdx.x & 31), out, payload_offset - 4, red, (uint4 *)(dsm + CRC_SMEM_WORDS));
    if (threadIdx.x == 0) *(u32 *)(out + payload_offset - 4) = c;
}


/* ======================= decoder ======================= */

struct BlockCtx {
    const u8 *blk;
    u32 size, crc_o, crc_p, n;
    u64 first;
    bool ok;
};
/* Reads block b's table entry and checks that its payload lies inside the frame. */
__device__ __forceinline__ BlockCtx block_ctx(const u8 *frame, u64 payload_offset, u64 payload_len, u64 table_offset,
                                              const u64 *offsets, u64 numel, u32 block_elems, u32 b) {
    BlockCtx c;
    const u32 *te = (const u32 *)(frame + table_offset + 12ull * b);
    c.size = te[0]; c.crc_o = te[1]; c.crc_p = te[2];
    u64 off = offsets[b];
    c.ok = off <= payload_len && c.size <= payload_len - off;
    if (!c.ok) c.size = 0;
    c.blk = frame + payload_offset + (c.ok ? off : 0);
    c.first = (u64)b * block_elems;
    c.n = (u32)min((u64)block_elems, numel - c.first);
    return c;
}


/* decode_block for RAW blocks and DENSE blocks with at most one HUFF plane; other blocks go
 * to clist for uz_dec_slow. One CUDA block (TPB threads) per codec block:
 *   1. all threads: payload CRC, staging the payload's first STAGE_BYTES in shared memory;
 *   2. thread 0: block/plane parse with every check of decode_block/decode_plane;
 *   3. all threads: pair LUT; then one thread per sub-stream decodes from shared memory (the
 *      HUFF plane comes first in GPU frames, so it is staged whenever it fits), merges with
 *      the RAW planes (global memory) and stores 16-byte words;
 *   4. all threads: CRC of the decoded block (read back; it is in L1/L2).
 *   frame            the whole frame on the device (16-byte aligned)
 *   payload_offset   where payloads start; payload_len = frame_nbytes - payload_offset
 *   table_offset     where the block table starts
 *   offsets          uz_scan's exclusive prefix of payload sizes
 *   numel, block_elems, S  from the (host-validated) header; S = substream_elems
 *   out              decoded tensor bytes (16-byte aligned)
 *   err              u64 error word: min over (block << 8 | code); ~0 when clean
 *   clist, ccount    queue of blocks for uz_dec_slow                                         */
template <int LAYOUT, int ISZ>
__device__ void dec_fast(const u8 *__restrict__ frame, u64 payload_offset, u64 payload_len, u64 table_offset,
                         const u64 *__restrict__ offsets, u64 numel, u32 block_elems, u32 S, u8 *out,
                         u64 *err, u32 *clist, u32 *ccount) {
    constexpr int P = Lay<LAYOUT, ISZ>::P;
    __shared__ u32 lut[LUT_SIZE];
    __shared__ u32 scratch[LUT_SCRATCH];
    __shared__ u32 red[TPB / 32 + 4];
    __shared__ u32 pm[MAX_PLANES], pc[MAX_PLANES];
    __shared__ const u8 *pr[MAX_PLANES];
    __shared__ HuffPlane hp;
    __shared__ int hidx;
    __shared__ u32 status;
    const u32 b = blockIdx.x, t = threadIdx.x;
    BlockCtx bc = block_ctx(frame, payload_offset, payload_len, table_offset, offsets, numel, block_elems, b);
    PH(0, 0);
    crc_init_smem(dsm);
    __syncthreads();
    PH(0, 1);
    u8 *const sym = (u8 *)(dsm + CRC_SMEM_WORDS); /* SYM_BYTES; crc_par's staging while no symbols live */
    const u32 crc = crc_par(dsm + (t & 31), bc.blk, bc.size, red, (uint4 *)sym);
    PH(0, 2);
    if (t == 0) {
        u32 st = 0, code = 0;
        hidx = -1;
        const u8 *p = bc.blk, *end = bc.blk + bc.size;
        if (!bc.ok) code = E_TOTAL;
        else if (crc != bc.crc_p) code = E_PAYLOAD_CRC;
        else if (bc.size < 1) code = E_EMPTY;
        else {
            u32 mode = *p++;
            if (mode == BLOCK_RAW) {
                if (bc.size != 1 + bc.n * ISZ) code = E_RAW_SIZE;
                st = 3;
            } else if (mode == BLOCK_DENSE) {
                for (int j = 0; j < P && !code; j++) {
                    u32 m = 0, cv = 0;
                    const u8 *raw = 0;
                    HuffPlane h;
                    code = parse_plane(p, end, bc.n, S, m, cv, raw, h);
                    pm[j] = m; pc[j] = cv; pr[j] = raw;
                    if (!code && m == PLANE_HUFF) {
                        if (hidx >= 0) st = 2;
                        else { hidx = j; hp = h; }
                    }
                }
                if (!code && p != end) code = E_TRAILING;
                if (!code && hidx >= 0 && hp.k * (S + 16) > SYM_BYTES) st = 2; /* odd sub-stream sizes */
            } else if (mode == BLOCK_SPARSE) {
                st = 2;
            } else {
                code = E_MODE;
            }
        }
        if (code) { report(err, b, code); st = 1; }
        if (st == 2) clist[atomicAdd(ccount, 1u)] = b;
        status = st;
    }
    __syncthreads();
    const u32 st = status;
    PH(0, 3);
    if (st == 1 || st == 2) return;
    u8 *bout = out + bc.first * ISZ;
    if (st == 3) {
        /* RAW block: 16-byte groups, consecutive threads on consecutive groups (coalesced) */
        const u32 N = bc.n * ISZ;
        const u8 *sp = bc.blk + 1;
        for (u32 g = t; g < N / 16; g += TPB) {
            u32 w[4];
            load16a(sp + 16 * g, w);
            *(uint4 *)(bout + 16 * g) = make_uint4(w[0], w[1], w[2], w[3]);
        }
        for (u32 i = (N & ~15u) + t; i < N; i += TPB) bout[i] = sp[i];
    } else {
        const int h = hidx;
        const u32 lcode = build_lut_group<TPB>(hp, h >= 0, lut, scratch, threadIdx.x);
        if (lcode) {
            if (t == 0) report(err, b, lcode);
            return;
        }
        PH(0, 4);
        /* 1. thread j decodes sub-stream j into shared memory (16-symbol stores; the
         *    16-byte pad per sub-stream keeps a quarter-warp's stores on distinct banks) */
        const u32 stride = S + 16;
        u32 bad = 0;
        if (h >= 0) {
            for (u32 j = t; j < hp.k; j += TPB) {
                const u32 cnt = min(S, bc.n - j * S);
                const u32 start = j ? ld_u16(hp.ends + 2 * (j - 1)) : 0, stop = ld_u16(hp.ends + 2 * j);
                if (stop < start || stop > hp.total) { bad = E_ENDS_BACK; break; }
                HuffReader rd;
                rd.init(hp.data + start, stop - start);
                u8 *ds = sym + (size_t)j * stride;
                u32 i = 0;
                for (; i + 16 <= cnt; i += 16) {
                    u32 w[4];
                    if (i + 16 < cnt) rd.dec16(lut, w);
                    else rd.dec16_single(lut, w);
                    *(uint4 *)(ds + i) = make_uint4(w[0], w[1], w[2], w[3]);
                }
                for (; i < cnt; i++) ds[i] = (u8)rd.dec1(lut);
                if (!rd.ok(stop - start)) { bad = E_STREAM; break; }
            }
        }
        if (bad) report(err, b, bad);
        __syncthreads();
        PH(0, 5);
        /* 2. merge: 16 elements per thread and step, consecutive threads on consecutive
         *    elements: coalesced RAW-plane loads and output stores */
        const u32 G = (bc.n + 15) / 16;
        for (u32 g = t; g < G; g += TPB) {
            const u32 i = 16 * g;
            if (i + 16 <= bc.n) {
                u32 pw[P][4];
#pragma unroll
                for (int q = 0; q < P; q++) {
                    if (q == h) {
                        const uint4 v = *(const uint4 *)(sym + (size_t)(i / S) * stride + (i % S));
                        pw[q][0] = v.x; pw[q][1] = v.y; pw[q][2] = v.z; pw[q][3] = v.w;
                    } else if (pm[q] == PLANE_RAW) {
                        load16a(pr[q] + i, pw[q]);
                    } else {
                        const u32 v = pc[q] * 0x01010101u;
                        pw[q][0] = pw[q][1] = pw[q][2] = pw[q][3] = v;
                    }
                }
                u32 o[4 * ISZ];
                merge16<LAYOUT, ISZ>(pw, o);
                uint4 *dst = (uint4 *)(bout + (size_t)i * ISZ);
#pragma unroll
                for (int q = 0; q < ISZ; q++) dst[q] = make_uint4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
            } else {
                for (u32 e = i; e < bc.n; e++) {
                    u32 pb[P];
                    for (int q = 0; q < P; q++)
                        pb[q] = q == h ? sym[(size_t)(e / S) * stride + (e % S)] : (pm[q] == PLANE_RAW ? pr[q][e] : pc[q]);
                    u8 ob[ISZ];
                    merge1<LAYOUT, ISZ>(pb, ob);
                    for (int q = 0; q < ISZ; q++) bout[(size_t)e * ISZ + q] = ob[q];
                }
            }
        }
    }
    __syncthreads(); /* the decoded block is visible to the whole CUDA block */
    PH(0, 6);
    const u32 crc_out = crc_par(dsm + (t & 31), bout, (u64)bc.n * ISZ, red, (uint4 *)sym);
    PH(0, 7);
    if (t == 0 && crc_out != bc.crc_o) report(err, b, E_ORIG_CRC);
}

/* decode_block for the blocks uz_dec_fast queued (SPARSE, or several HUFF planes): each
 * plane is decoded into a per-CUDA-block scratch slot in global memory, then merged
 * element by element. Persistent grid; arguments as uz_dec_fast, plus
 *   scratch, slot_bytes   gridDim.x slots of (P + 1) * block_elems bytes                      */
template <int LAYOUT, int ISZ>
__device__ void dec_slow(const u8 *__restrict__ frame, u64 payload_offset, u64 payload_len, u64 table_offset,
                         const u64 *__restrict__ offsets, u64 numel, u32 block_elems, u32 S, u8 *__restrict__ out,
                         u64 *err, const u32 *clist, const u32 *ccount, u8 *scratch, u64 slot_bytes) {
    constexpr int P = Lay<LAYOUT, ISZ>::P;
    __shared__ u32 lut[LUT_SIZE];
    __shared__ u32 scr[LUT_SCRATCH];
    __shared__ u32 red[TPB / 32 + 4];
    __shared__ u32 pm[MAX_PLANES + 1], pc[MAX_PLANES + 1];
    __shared__ const u8 *pr[MAX_PLANES + 1];
    __shared__ HuffPlane hps[MAX_PLANES + 1];
    __shared__ u32 status, sm_m, sparse;
    __shared__ u32 pre[TPB];
    const u32 t = threadIdx.x;
    const u32 count = *ccount;
    if (blockIdx.x >= count) return; /* nothing queued for this CUDA block: the common case */
    crc_init_smem(dsm);
    __syncthreads();
    u8 *slot = scratch + slot_bytes * blockIdx.x;
    for (u32 idx = blockIdx.x; idx < count; idx += gridDim.x) {
        const u32 b = clist[idx];
        BlockCtx bc = block_ctx(frame, payload_offset, payload_len, table_offset, offsets, numel, block_elems, b);
        const u32 n = bc.n, nmask = (n + 7) / 8;
        if (t == 0) {
            u32 code = 0;
            const u8 *p = bc.blk + 1, *end = bc.blk + bc.size;
            u32 mode = bc.blk[0], cnt = n;
            sparse = mode == BLOCK_SPARSE;
            if (sparse) {
                if (end - p < 4) code = E_SPARSE_HDR;
                else {
                    sm_m = ld_u32(p);
                    p += 4;
                    cnt = sm_m;
                    if (sm_m > n) code = E_SPARSE_M;
                    else code = parse_plane(p, end, nmask, S, pm[P], pc[P], pr[P], hps[P]);
                }
            }
            for (int j = 0; j < P && !code; j++) code = parse_plane(p, end, cnt, S, pm[j], pc[j], pr[j], hps[j]);
            if (!code && p != end) code = E_TRAILING;
            if (code) report(err, b, code);
            status = code;
        }
        __syncthreads();
        if (status) { __syncthreads(); continue; }
        const int np = sparse ? P + 1 : P;
        u32 bad = 0;
        for (int j = 0; j < np; j++) {
            if (pm[j] != PLANE_HUFF) continue;
            const HuffPlane &h = hps[j];
            if ((bad = build_lut_group<TPB>(h, true, lut, scr, t)) != 0) break;
            u8 *buf = slot + (size_t)j * block_elems;
            const u32 per = (h.k + TPB - 1) / TPB;
            const u32 j0 = min(t * per, h.k), j1 = min(j0 + per, h.k);
            for (u32 s = j0; s < j1 && !bad; s++) {
                u32 start = s ? ld_u16(h.ends + 2 * (s - 1)) : 0, stop = ld_u16(h.ends + 2 * s);
                if (stop < start || stop > h.total) { bad = E_ENDS_BACK; break; }
                HuffReader rd;
                rd.init(h.data + start, stop - start);
                const u32 ss = s * S, se = min(ss + S, h.count);
                for (u32 i = ss; i < se; i++) buf[i] = (u8)rd.dec1(lut);
                if (!rd.ok(stop - start)) bad = E_STREAM;
            }
            __syncthreads();
        }
        /* plane byte accessor */
#define PBYTE(j, i) (pm[j] == PLANE_RAW ? pr[j][i] : (pm[j] == PLANE_CONST ? (u8)pc[j] : slot[(size_t)(j) * block_elems + (i)]))
        const u32 chunkb = (nmask + TPB - 1) / TPB; /* mask bytes per thread */
        const u32 ma = min(t * chunkb, nmask), me = min(ma + chunkb, nmask);
        u32 pop = 0;
        if (sparse) {
            for (u32 i = ma; i < me; i++) pop += __popc((u32)PBYTE(P, i));
            if ((n & 7) && me == nmask && me > ma && (PBYTE(P, nmask - 1) >> (n & 7))) bad = E_SPARSE_PAD;
        }
        pre[t] = pop;
        __syncthreads();
        if (t == 0) {
            u32 run = 0;
            for (int k = 0; k < TPB; k++) { u32 v = pre[k]; pre[k] = run; run += v; }
            if (sparse && run != sm_m) report(err, b, E_SPARSE_POP);
        }
        __syncthreads();
        u32 cidx = pre[t];
        const u32 ea = min(ma * 8, n), ee = min(me * 8, n);
        u8 *bout = out + bc.first * ISZ;
        for (u32 i = ea; i < ee && !bad; i++) {
            bool nz = !sparse || ((PBYTE(P, i >> 3) >> (i & 7)) & 1);
            u32 src = sparse ? cidx : i;
            if (sparse && nz && cidx >= sm_m) { bad = E_SPARSE_POP; break; }
            u32 pb[P];
            for (int q = 0; q < P; q++) pb[q] = nz ? PBYTE(q, src) : 0u;
            if (nz && sparse) cidx++;
            u8 ob[ISZ];
            merge1<LAYOUT, ISZ>(pb, ob);
            for (int q = 0; q < ISZ; q++) bout[(size_t)i * ISZ + q] = ob[q];
        }
#undef PBYTE
        if (bad) report(err, b, bad);
        __syncthreads();
        const u32 crc_out = crc_par(dsm + (t & 31), bout, (u64)n * ISZ, red, (uint4 *)(dsm + CRC_SMEM_WORDS));
        if (t == 0 && crc_out != bc.crc_o) report(err, b, E_ORIG_CRC);
        __syncthreads();
    }
}

/* ======================= wide decoder ======================= */
/* uz_dec_wide: every thread decodes. WG = 128 threads per codec block, 1 to 8 codec
 * blocks per CUDA block (the launcher picks; they share the CRC tables); thread j of a group takes chunk j of
 * the block: Huffman sub-stream j (or 1/128 of a RAW / unentropy-coded block), decodes it,
 * merges it with the RAW/CONST planes and stores the elements itself, and runs the CRCs of
 * exactly the bytes it read and wrote on the way (one chain for its output slice, one per
 * RAW-plane slice, one for its sub-stream's bytes and its `ends` entry). CRC linearity joins
 * the chains: each register is moved to the end of its range (crc_shift) and XORed; the
 * bytes no thread covers (block and plane headers, code lengths) are done by one thread.
 * uz_dec_fast gave each codec block one CUDA block whose decode phase ran on 4 of 16 warps,
 * read the block twice more for its CRCs and held 66 KB of symbols in shared memory; here
 * all 32 resident warps of an SM decode, and the CRCs ride on the decode's own loads. */
#define WG 128
#define WSL 4                /* slicing-by-4 CRC tables (128 KB, lane-replicated) */
#define WIDE_TAB_WORDS (WSL * 256 * 32 + 1024)
#define WDESC_WORDS 256      /* per group: WideDesc, then the LUT, then the LUT build's scratch */
#define WG_WORDS (WDESC_WORDS + LUT_SIZE + LUT_SCRATCH)
enum { WS_IDLE = 0, WS_CRC_ONLY = 1, WS_SLOW = 2, WS_RAW = 3, WS_DENSE = 4 };
struct WideDesc {
    HuffPlane hp;
    const u8 *blk;
    u64 first;
    u32 size, crc_o, crc_p, n;
    u32 st, C, kk, xp, xo, bad;
    int hidx;
    const u8 *gap_at[2 * MAX_PLANES + 1];
    u32 gap_len[2 * MAX_PLANES + 1];
    u32 ngap;
    u32 pm[MAX_PLANES], pc[MAX_PLANES];
    const u8 *pr[MAX_PLANES];
};

/* Sub-stream reader of uz_dec_wide: single-symbol lookups, branch-free. The stream is read
 * as aligned 32-bit words, one loaded ahead; refill() tops the 64-bit buffer up by a word
 * whenever it holds fewer than 32 bits (predicated, no divergence), so two lookups of at
 * most 11 bits always find their bits. dec16() decodes 16 symbols in a fixed sequence: one
 * basic block, which the compiler interleaves with the CRC and merge work around it. The
 * pair decoder (HuffReader) needs ~2x the instructions per symbol: a data-dependent loop
 * whose refill branch some lane of the warp takes at almost every lookup. */
struct WideReader {
    u64 buf;
    u32 nb, wpos, wend, nxt, bad, sk;
    const u32 *qw;
    __device__ __forceinline__ void init(const u8 *p, u32 nbytes) {
        const size_t a = (size_t)p, a0 = a & ~(size_t)3;
        qw = (const u32 *)a0;
        sk = (u32)(a & 3) * 8;
        wend = (u32)((((a + nbytes + 3) & ~(size_t)3) - a0) / 4);
        const u32 w0 = wend > 0 ? qw[0] : 0u, w1 = wend > 1 ? qw[1] : 0u;
        nxt = wend > 2 ? qw[2] : 0u;
        buf = ((u64)w0 | ((u64)w1 << 32)) >> sk;
        nb = 64 - sk;
        wpos = 2;
        bad = 0;
    }
    __device__ __forceinline__ void refill() {
        const bool need = nb < 32;
        const u64 add = (u64)nxt << (nb & 31);
        buf = need ? (buf | add) : buf;
        nb = need ? nb + 32 : nb;
        wpos = need ? wpos + 1 : wpos;
        /* the next word is loaded only by lanes that consumed one: an unconditional load here
         * (8 per 16 symbols, 32 cache lines per warp each) made large frames L1-bound */
        u32 nw = 0u;
        if (need && wpos < wend) nw = qw[wpos];
        nxt = need ? nw : nxt;
    }
    __device__ __forceinline__ u32 dec(const u32 *lut) {
        const u32 e = lut[buf & (LUT_SIZE - 1)], l = LUT_LEN1(e);
        bad |= e;
        buf >>= l;
        nb -= l;
        return e & 0xFFu;
    }
    __device__ __forceinline__ void dec16(const u32 *lut, u32 *w) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            refill();
            const u32 a = dec(lut), b = dec(lut);
            refill();
            const u32 c = dec(lut), d = dec(lut);
            w[q] = a | (b << 8) | (c << 16) | (d << 24);
        }
    }
    __device__ __forceinline__ void dec16_single(const u32 *lut, u32 *w) { dec16(lut, w); }
    __device__ __forceinline__ u32 dec1(const u32 *lut) {
        refill();
        return dec(lut);
    }
    /* bits consumed: every bit loaded into buf minus those still there */
    __device__ __forceinline__ bool ok(u32 nbytes) const {
        const u32 used = 32 * wpos - sk - nb;
        return !(bad & LUT_BAD_BIT) && (used + 7) / 8 == nbytes;
    }
};

/* Parses block b for uz_dec_wide (the checks of decode_block/decode_plane except the CRCs,
 * which the group computes); thread 0 of the group. */
template <int LAYOUT, int ISZ>
__device__ void wide_parse(WideDesc &d, const BlockCtx &bc, u32 S, u32 b, u64 *err) {
    constexpr int P = Lay<LAYOUT, ISZ>::P;
    d.blk = bc.blk; d.size = bc.size; d.crc_o = bc.crc_o; d.crc_p = bc.crc_p; d.n = bc.n; d.first = bc.first;
    d.xo = 0; d.bad = 0; d.hidx = -1; d.ngap = 0; d.kk = 0; d.C = 16;
    if (!bc.ok) { report(err, b, E_TOTAL); d.st = WS_IDLE; d.first = 0; return; }
    u32 code = 0, st = WS_DENSE;
    const u8 *p = bc.blk, *end = bc.blk + bc.size;
    if (bc.size < 1) code = E_EMPTY;
    else {
        const u32 mode = *p++;
        d.gap_at[0] = bc.blk; d.gap_len[0] = 1; d.ngap = 1;
        if (mode == BLOCK_RAW) {
            if (bc.size != 1 + bc.n * ISZ) code = E_RAW_SIZE;
            st = WS_RAW;
        } else if (mode == BLOCK_DENSE) {
            for (int j = 0; j < P && !code; j++) {
                u32 m = 0, cv = 0;
                const u8 *raw = 0, *ps = p;
                HuffPlane h;
                code = parse_plane(p, end, bc.n, S, m, cv, raw, h);
                if (code) break;
                d.pm[j] = m; d.pc[j] = cv; d.pr[j] = raw;
                /* the plane bytes before what the threads cover: mode (+ CONST value), or
                 * mode, lo, span and the code lengths of a HUFF plane */
                const u8 *cov = m == PLANE_RAW ? raw : (m == PLANE_CONST ? p : h.ends);
                d.gap_at[d.ngap] = ps; d.gap_len[d.ngap] = (u32)(cov - ps); d.ngap++;
                if (m == PLANE_HUFF) {
                    if (d.hidx >= 0) st = WS_SLOW;
                    else { d.hidx = j; d.hp = h; }
                }
            }
            if (!code && p != end) code = E_TRAILING;
        } else if (mode == BLOCK_SPARSE) {
            st = WS_SLOW;
        } else {
            code = E_MODE;
        }
    }
    if (code) { report(err, b, code); st = WS_CRC_ONLY; }
    if (st == WS_DENSE && d.hidx >= 0) { d.C = S; d.kk = d.hp.k; }
    else if (st == WS_RAW || st == WS_DENSE) { d.C = max(16u, ((bc.n + WG - 1) / WG + 15) & ~15u); d.kk = (bc.n + d.C - 1) / d.C; }
    d.st = st;
}

/* Chunk j of a DENSE block: decode, merge, store; CRC registers (from 0) of the output slice
 * and of every payload byte read, each moved to the end of its range and XORed into lo / lp.
 * Reader: WideReader (single-symbol lookups, branch-free: shortest time per sub-stream, for
 * frames of up to one wave) or HuffReader (pair lookups: half the LUT loads, which bound
 * large frames, where 32 warps per SM hide its branches). */
template <int LAYOUT, int ISZ, class Reader>
__device__ __forceinline__ u32 wide_dense(const WideDesc &d, const u32 *lut, const u32 *tab, u32 j, u8 *bout, u32 &lp,
                                          u32 &lo) {
    constexpr int P = Lay<LAYOUT, ISZ>::P;
    const u32 e0 = j * d.C, cnt = min(d.C, d.n - e0);
    const int h = d.hidx;
    Reader rd;
    u32 start = 0, stop = 0;
    if (h >= 0) {
        start = j ? ld_u16(d.hp.ends + 2 * (j - 1)) : 0u;
        stop = ld_u16(d.hp.ends + 2 * j);
        if (stop < start || stop > d.hp.total) return E_ENDS_BACK;
        rd.init(d.hp.data + start, stop - start);
    }
    u32 co = 0, cr[P];
#pragma unroll
    for (int q = 0; q < P; q++) cr[q] = 0;
    u8 *o = bout + (size_t)e0 * ISZ;
    u32 i = 0;
    /* RAW-plane bytes are loaded one step ahead: a load issued where it is used stalled the
     * thread for an L2/DRAM round trip every 16 symbols */
    u32 rw[P][4];
#pragma unroll
    for (int q = 0; q < P; q++)
        if (q != h && d.pm[q] == PLANE_RAW && cnt >= 16) load16a(d.pr[q] + e0, rw[q]);
    for (; i + 16 <= cnt; i += 16) {
        u32 pw[P][4];
#pragma unroll
        for (int q = 0; q < P; q++) {
            if (q == h) {
                if (i + 16 < cnt) rd.dec16(lut, pw[q]); /* HuffReader's pairs need a symbol after these */
                else rd.dec16_single(lut, pw[q]);
            } else if (d.pm[q] == PLANE_RAW) {
#pragma unroll
                for (int k = 0; k < 4; k++) pw[q][k] = rw[q][k];
                if (i + 32 <= cnt) load16a(d.pr[q] + e0 + i + 16, rw[q]);
                cr[q] = crc_q<WSL>(tab, cr[q], make_uint4(pw[q][0], pw[q][1], pw[q][2], pw[q][3]));
            } else {
                const u32 v = d.pc[q] * 0x01010101u;
                pw[q][0] = pw[q][1] = pw[q][2] = pw[q][3] = v;
            }
        }
        u32 ow[4 * ISZ];
        merge16<LAYOUT, ISZ>(pw, ow);
#pragma unroll
        for (int q = 0; q < ISZ; q++) {
            const uint4 v = make_uint4(ow[4 * q], ow[4 * q + 1], ow[4 * q + 2], ow[4 * q + 3]);
            *(uint4 *)(o + (size_t)i * ISZ + 16 * q) = v;
            co = crc_q<WSL>(tab, co, v);
        }
    }
    for (; i < cnt; i++) {
        u32 pb[P];
#pragma unroll
        for (int q = 0; q < P; q++) {
            if (q == h) pb[q] = rd.dec1(lut);
            else if (d.pm[q] == PLANE_RAW) { pb[q] = d.pr[q][e0 + i]; cr[q] = crc_b(tab, cr[q], pb[q]); }
            else pb[q] = d.pc[q];
        }
        u8 ob[ISZ];
        merge1<LAYOUT, ISZ>(pb, ob);
#pragma unroll
        for (int q = 0; q < ISZ; q++) { o[(size_t)i * ISZ + q] = ob[q]; co = crc_b(tab, co, ob[q]); }
    }
    u32 bad = 0;
    if (h >= 0 && !rd.ok(stop - start)) bad = E_STREAM;
    const u64 end_o = (u64)(e0 + cnt) * ISZ;
    lo ^= crc_shift(co, (u64)d.n * ISZ - end_o);
#pragma unroll
    for (int q = 0; q < P; q++)
        if (q != h && d.pm[q] == PLANE_RAW) lp ^= crc_shift(cr[q], d.size - (u64)(d.pr[q] + e0 + cnt - d.blk));
    if (h >= 0) {
        u32 cs = 0;
        crc_run<1, WSL>(tab, &cs, d.hp.data + start, 0, stop - start);
        lp ^= crc_shift(cs, d.size - (u64)(d.hp.data + stop - d.blk));
        const u8 *ep = d.hp.ends + 2 * j;
        lp ^= crc_shift(crc_b(tab, crc_b(tab, 0u, ep[0]), ep[1]), d.size - (u64)(ep + 2 - d.blk));
    }
    return bad;
}

/* Chunk j of a RAW block: copy, one CRC register for both the payload and the output. */
template <int ISZ>
__device__ __forceinline__ void wide_raw(const WideDesc &d, const u32 *tab, u32 j, u8 *bout, u32 &lp, u32 &lo) {
    const u32 e0 = j * d.C, cnt = min(d.C, d.n - e0);
    const u8 *s = d.blk + 1 + (size_t)e0 * ISZ;
    u8 *o = bout + (size_t)e0 * ISZ;
    const u32 nbytes = cnt * ISZ;
    u32 c = 0, i = 0;
    for (; i + 16 <= nbytes; i += 16) {
        u32 w[4];
        load16a(s + i, w);
        const uint4 v = make_uint4(w[0], w[1], w[2], w[3]);
        *(uint4 *)(o + i) = v;
        c = crc_q<WSL>(tab, c, v);
    }
    for (; i < nbytes; i++) { o[i] = s[i]; c = crc_b(tab, c, s[i]); }
    const u64 end_o = (u64)e0 * ISZ + nbytes;
    lo ^= crc_shift(c, (u64)d.n * ISZ - end_o);
    lp ^= crc_shift(c, d.size - (1 + end_o));
}

/* decode_block, every block: DENSE blocks with at most one HUFF plane and RAW blocks here;
 * SPARSE blocks and blocks with several HUFF planes get their payload CRC checked here and
 * are queued to uz_dec_slow. Arguments as uz_dec_fast, plus nblocks. */
template <int LAYOUT, int ISZ, class Reader>
__device__ void dec_wide(const u8 *__restrict__ frame, u64 payload_offset, u64 payload_len, u64 table_offset,
                         const u64 *__restrict__ offsets, u64 numel, u32 block_elems, u32 S, u32 nblocks, u8 *out,
                         u64 *err, u32 *clist, u32 *ccount) {
    static_assert(sizeof(WideDesc) <= 4 * WDESC_WORDS, "WideDesc outgrew its slot");
    /* dynamic shared memory: the CRC tables, then per group (blockDim.x / WG of them) its
     * WideDesc, LUT and LUT-build scratch; the launcher sizes it (cuda.py: wide_smem) */
    const u32 G = blockDim.x / WG, g = threadIdx.x / WG, lt = threadIdx.x % WG;
    const u32 b = blockIdx.x * G + g;
    u32 *const gbase = dsm + WIDE_TAB_WORDS + g * WG_WORDS;
    WideDesc &d = *(WideDesc *)gbase;
    u32 *const glut = gbase + WDESC_WORDS, *const gscr = glut + LUT_SIZE;
    PH(0, 0);
    crc_init_smem<WSL>(dsm);
    if (lt == 0) {
        if (b < nblocks) {
            const BlockCtx bc = block_ctx(frame, payload_offset, payload_len, table_offset, offsets, numel, block_elems, b);
            wide_parse<LAYOUT, ISZ>(d, bc, S, b, err);
        } else {
            d.st = WS_IDLE;
            d.first = 0;
        }
    }
    __syncthreads();
    PH(0, 1);
    const u32 *tab = dsm + (threadIdx.x & 31);
    const u32 st = d.st;
    if (lt == 32 && st != WS_IDLE) {
        /* the payload register's start (~0, moved over the whole payload) and the headers */
        u32 x = crc_shift(~0u, d.size);
        if (st != WS_CRC_ONLY && st != WS_SLOW)
            for (u32 q = 0; q < d.ngap; q++) {
                u32 c = 0;
                crc_run<1, WSL>(tab, &c, d.gap_at[q], 0, d.gap_len[q]);
                x ^= crc_shift(c, d.size - (u64)(d.gap_at[q] + d.gap_len[q] - d.blk));
            }
        d.xp = x;
    }
    const u32 lcode = build_lut_group<WG>(d.hp, st == WS_DENSE && d.hidx >= 0, glut, gscr, lt);
    PH(0, 2);
    u32 lp = 0, lo = 0, bad = 0;
    u8 *bout = out + d.first * ISZ;
    if (st == WS_CRC_ONLY || st == WS_SLOW) {
        const u32 per = (d.size + WG - 1) / WG, a = min(lt * per, d.size), e = min(a + per, d.size);
        u32 c = 0;
        crc_run<1, WSL>(tab, &c, d.blk + a, 0, e - a);
        lp = crc_shift(c, d.size - e);
    } else if (st == WS_RAW) {
        for (u32 j = lt; j < d.kk; j += WG) wide_raw<ISZ>(d, tab, j, bout, lp, lo);
    } else if (st == WS_DENSE && !lcode) {
        /* after an error, later chunks still run: their CRC pieces keep the payload check whole */
        for (u32 j = lt; j < d.kk; j += WG) {
            const u32 e = wide_dense<LAYOUT, ISZ, Reader>(d, glut, tab, j, bout, lp, lo);
            if (!bad) bad = e;
        }
    }
    /* E_ENDS_BACK leaves a sub-stream's bytes out of the payload CRC: report only it */
    if (bad) { report(err, b, bad); atomicOr(&d.bad, bad == E_ENDS_BACK ? 3u : 1u); }
    lp = __reduce_xor_sync(0xFFFFFFFFu, lp);
    lo = __reduce_xor_sync(0xFFFFFFFFu, lo);
    if ((lt & 31) == 0 && st != WS_IDLE) { atomicXor(&d.xp, lp); atomicXor(&d.xo, lo); }
    __syncthreads();
    PH(0, 3);
    if (lt == 0 && st != WS_IDLE) {
        const bool crc_ok = ~d.xp == d.crc_p || (d.bad & 2u);
        if (!crc_ok) report(err, b, E_PAYLOAD_CRC);
        if (lcode) report(err, b, lcode);
        if (st == WS_SLOW && crc_ok) clist[atomicAdd(ccount, 1u)] = b;
        if ((st == WS_RAW || st == WS_DENSE) && !lcode && !d.bad &&
            ~(crc_shift(~0u, (u64)d.n * ISZ) ^ d.xo) != d.crc_o)
            report(err, b, E_ORIG_CRC);
    }
}

/* ---- extern "C" entry points, one set per (layout, itemsize) ---- */
#define UZ_INSTANTIATE(NAME, LAYOUT, ISZ)                                                                        \
    extern "C" __global__ void __launch_bounds__(TPB, 2) uz_enc_stats_##NAME(const u8 *src, u64 numel, u32 S, int cp, \
                                                                          u8 *info) {                            \
        enc_stats<LAYOUT, ISZ>(src, numel, S, cp, info);                                                         \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(TPB, 2) uz_enc_write_##NAME(const u8 *src, u64 numel, u32 S, int cp, \
                                                                          const u8 *info, const u64 *offsets,      \
                                                                          u8 *out, u64 payload_offset,             \
                                                                          u64 table_offset) {                      \
        enc_write<LAYOUT, ISZ>(src, numel, S, cp, info, offsets, out, payload_offset, table_offset);            \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(TPB, 2)                                                         \
        uz_dec_fast_##NAME(const u8 *frame, u64 payload_offset, u64 payload_len, u64 table_offset,               \
                           const u64 *offsets, u64 numel, u32 block_elems, u32 S, u8 *out, u64 *err, u32 *clist,  \
                           u32 *ccount) {                                                                        \
        dec_fast<LAYOUT, ISZ>(frame, payload_offset, payload_len, table_offset, offsets, numel, block_elems, S,   \
                              out, err, clist, ccount);                                                          \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024, 1)                                                        \
        uz_dec_wide_##NAME(const u8 *frame, u64 payload_offset, u64 payload_len, u64 table_offset,               \
                           const u64 *offsets, u64 numel, u32 block_elems, u32 S, u32 nblocks, u8 *out, u64 *err, \
                           u32 *clist, u32 *ccount) {                                                            \
        dec_wide<LAYOUT, ISZ, WideReader>(frame, payload_offset, payload_len, table_offset, offsets, numel,      \
                                          block_elems, S, nblocks, out, err, clist, ccount);                     \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024, 1)                                                        \
        uz_dec_widep_##NAME(const u8 *frame, u64 payload_offset, u64 payload_len, u64 table_offset,              \
                            const u64 *offsets, u64 numel, u32 block_elems, u32 S, u32 nblocks, u8 *out,         \
                            u64 *err, u32 *clist, u32 *ccount) {                                                 \
        dec_wide<LAYOUT, ISZ, HuffReader>(frame, payload_offset, payload_len, table_offset, offsets, numel,      \
                                          block_elems, S, nblocks, out, err, clist, ccount);                     \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(TPB)                                                            \
        uz_dec_slow_##NAME(const u8 *frame, u64 payload_offset, u64 payload_len, u64 table_offset,               \
                           const u64 *offsets, u64 numel, u32 block_elems, u32 S, u8 *out, u64 *err,              \
                           const u32 *clist, const u32 *ccount, u8 *scratch, u64 slot_bytes) {                    \
        dec_slow<LAYOUT, ISZ>(frame, payload_offset, payload_len, table_offset, offsets, numel, block_elems, S,   \
                              out, err, clist, ccount, scratch, slot_bytes);                                     \
    }

UZ_INSTANTIATE(bf16, LAYOUT_BF16, 2)
UZ_INSTANTIATE(fp32, LAYOUT_FP32, 4)
UZ_INSTANTIATE(b1, LAYOUT_BYTES, 1)
UZ_INSTANTIATE(b2, LAYOUT_BYTES, 2)
UZ_INSTANTIATE(b4, LAYOUT_BYTES, 4)
UZ_INSTANTIATE(b8, LAYOUT_BYTES, 8)
UZ_INSTANTIATE(b16, LAYOUT_BYTES, 16)

/* CRC32C of nseg segments [p + i * seg, + min(seg, n - i * seg)), one CUDA block each: the
 * tests check crc_par against the CPU at every alignment and length, the benchmark times it. */
extern "C" __global__ void __launch_bounds__(TPB) uz_crc_segs(const u8 *p, u64 seg, u64 n, u32 *out) {
    __shared__ u32 red[TPB / 32 + 4];
    crc_init_smem(dsm);
    __syncthreads();
    const u64 a = (u64)blockIdx.x * seg;
    const u32 c = crc_par(dsm + (threadIdx.x & 31), p + a, min(seg, n - a), red, (uint4 *)(dsm + CRC_SMEM_WORDS));
    if (threadIdx.x == 0) out[blockIdx.x] = c;
}
