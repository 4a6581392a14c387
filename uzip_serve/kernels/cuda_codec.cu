/*
 * CUDA kernels for the uzip frame codec, format v2 (docs/format.md). Compiled at run time by
 * NVRTC through CuPy; launched by uzip_serve/kernels/cuda.py. Every frame written here decodes
 * bit-exactly on the CPU reference, uzip_serve/kernels/cpu_codec.c, and every frame the CPU
 * writes decodes here:
 *
 *   CPU reference (cpu_codec.c)              here
 *   uzh64                                    uzh_chunk (per 16 bytes) + block_sum
 *   split_planes / merge_planes              Layout::split / Layout::merge (16 elements at once)
 *   hist_of                                  lane-column counters in enc_block
 *   build_lengths                            build_lengths_warp (<= 32 symbols, one warp) and
 *                                            build_lengths (same algorithm, all threads)
 *   assign_codes                             chunk_rank + rank_before (match_any per warp)
 *   encode_stream                            encode_stream (a thread per sub-stream)
 *   build_lut                                build_lut (same table, built in parallel)
 *   decode_4streams / decode_stream_tail     decode_merge (a thread per sub-stream, merging as
 *                                            it goes) and decode_substream (general path)
 *   encode_block / compress_worker           uz_enc_* (a CUDA block per codec block)
 *   decode_block / decompress_worker         uz_dec_* (RAW and DENSE blocks with <= 1 HUFF
 *                                            plane) and uz_dec_general_* (every block kind)
 *
 * One CUDA block of NT threads handles one codec block. The encoder takes its block index from
 * a ticket, so lower blocks always run first, and finds its payload's offset with a decoupled
 * look-back over the sizes its predecessors publish: one launch writes the whole frame, the
 * header by whichever CUDA block finishes last. The decoder needs no cross-block step: the
 * block table gives every payload's end. docs/gpu.md has the design and the measurements.
 *
 * Portability (HIP): plain CUDA C++, no inline PTX, no tensor cores. The warp-level parts
 * (shuffles, ballots, __reduce_*_sync, __match_any_sync) assume 32 lanes; docs/gpu.md lists
 * what a 64-lane AMD build would change. Under UZ_SIMT the same source compiles as C++ for the
 * CPU emulator the tests use (tests/simt), which is why shared memory is only dynamic.
 */
#ifdef UZ_SIMT
#define UZ_DYN_SMEM(name) unsigned char *name = uzsim::dynamic_smem()
#else
extern __shared__ __align__(16) unsigned char uz_dynamic_smem[]; /* every kernel's shared memory */
#define UZ_DYN_SMEM(name) unsigned char *name = uz_dynamic_smem
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NT 512             /* threads per CUDA block, encoder and decoder; cuda.py agrees */
#define NW (NT / 32)
#define MAX_CODE_LEN 11
#define LUT_SIZE 2048
#define MAX_ENC_S 1024     /* longest sub-stream the GPU encoder writes (its warp buffer) */
#define WBUF_BYTES 1424    /* a warp's sub-stream buffer: MAX_ENC_S * 11 bits, rounded up */
#define WIN_BYTES 2304     /* payload bytes a fast decoder reads first: all headers of a fast block */
#define HDR_BYTES 2304     /* the encoder's block header (mode, plane headers, ends) */
#define RUNS_BYTES 5120    /* the encoder's per-lane code bits (EncShared::runs) */
#define ALIGN 16
#define FUSE_HASH_MAX_BLOCK 8192 /* blocks up to this hash their HUFF data as it is written */
#define UZH_LENGTH_MUL 0x9E3779B97F4A7C15ull
#define LOOKBACK_AGG (1ull << 62)   /* a block's own payload size is published */
#define LOOKBACK_INCL (2ull << 62)  /* the sum of sizes up to and including it is published */
#define LOOKBACK_VALUE ((1ull << 62) - 1)
#define LOOKBACK_LOADS 4            /* status words each lane of the look-back reads per round */

enum { BLOCK_RAW = 0, BLOCK_DENSE = 1, BLOCK_SPARSE = 2 };
enum { PLANE_RAW = 0, PLANE_CONST = 1, PLANE_HUFF = 2 };

/* Error codes, reported through one u64 word as (block << 8) | code; the lowest block wins
 * (atomicMin). cuda.py's _ERRORS has the texts. */
enum {
    E_PAYLOAD_HASH = 1, E_ORIG_HASH, E_EMPTY, E_RAW_SIZE, E_MODE, E_PLANE_HDR, E_PLANE_MODE,
    E_RAW_PLANE, E_CONST_PLANE, E_HUFF_EMPTY, E_HUFF_TABLE, E_HUFF_RANGE, E_HUFF_LEN, E_HUFF_PAD,
    E_HUFF_KRAFT, E_ENDS, E_STREAMS_PAST, E_ENDS_BACK, E_STREAM, E_SIZE, E_SPARSE_HDR, E_SPARSE_M,
    E_SPARSE_PAD, E_SPARSE_POP, E_PAYLOAD_END, E_GENERAL, E_PLANE_DATA
};

/* -DUZ_PHASES (benchmarks/codec_gpu.py --phases): thread 0 of every CUDA block adds the cycles
 * between consecutive marks to uz_phase_cycles[kernel][mark]; [kernel][15] counts the blocks. */
#if defined(UZ_PHASES) && !defined(UZ_SIMT)
__device__ unsigned long long uz_phase_cycles[2][16];
#define PHASE_START() long long uz_t_ = clock64()
#define PHASE(k, i)                                                                                    \
    do {                                                                                               \
        if (threadIdx.x == 0) {                                                                        \
            long long t_ = clock64();                                                                  \
            atomicAdd(&uz_phase_cycles[k][i], (unsigned long long)(t_ - uz_t_));                        \
            uz_t_ = t_;                                                                                \
            if ((i) == 14) atomicAdd(&uz_phase_cycles[k][15], 1ull);                                   \
        }                                                                                              \
    } while (0)
#else
#define PHASE_START()
#define PHASE(k, i)
#endif

__device__ __forceinline__ u32 align16(u32 x) { return (x + ALIGN - 1) & ~(u32)(ALIGN - 1); }
/* Decoder errors: one word per codec block, (block << 8) | code, the lowest code if several;
 * UZ_CLEAN when the block decoded clean. The block's thread 0 writes UZ_CLEAN into its own word
 * before any thread of the block can report, so the launcher fills nothing beforehand (a fill
 * is a graph node: about 1.4 us of GPU time on an H100, docs/gpu.md round 11). */
#define UZ_CLEAN 0x7FFFFFFFFFFFFFFFull
__device__ __forceinline__ void report(u64 *err, u32 block, u32 code) {
    atomicMin(&err[block], ((u64)block << 8) | code);
}
__device__ __forceinline__ u32 lanemask_lt() { return (1u << (threadIdx.x & 31)) - 1u; }

/* ---- UZH64 (docs/format.md): each 16-byte group hashed from its index alone ---- */

__device__ __forceinline__ u32 uzh_key(u32 g) {
    u32 x = (g * 0x9E3779B1u) & 0x1FFFFFFFu;
    x ^= x >> 14;
    x = (x * 0x85EBCA6Bu) & 0x1FFFFFFFu;
    x ^= x >> 13;
    return x << 3;
}

/* The share of 16-byte group number g (from the hashed range's start) of the sum. */
__device__ __forceinline__ u64 uzh_chunk(uint4 v, u32 g) {
    u32 k = uzh_key(g);
    return (u64)v.x * (k | 1u) + (u64)v.y * (k | 3u) + (u64)v.z * (k | 5u) + (u64)v.w * (k | 7u);
}

/* The share of the 32-bit word at byte offset `off` (a multiple of 4) of the range. */
__device__ __forceinline__ u64 uzh_word(u32 w, u64 off) {
    return (u64)w * (uzh_key((u32)(off >> 4)) | (u32)(2 * ((off >> 2) & 3) + 1));
}

/* Sum over the CUDA block (any size, a multiple of 32 up to NT); every thread gets the
 * total. `red`: NW words of shared memory. */
__device__ u64 block_sum(u64 v, u64 *red) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* red may still be read from a previous call */
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    u64 t = 0;
    for (u32 i = 0; i < blockDim.x / 32; i++) t += red[i];
    return t;
}

/* Two sums over the CUDA block in one barrier, for thread 0 only (the two hashes at the end of
 * a block, where nothing else waits on them). `red`: 2 * NW words that nothing else uses, so
 * no barrier is needed before they are written (each kernel calls this once, last). */
__device__ void block_sum2(u64 &a, u64 &b, u64 *red) {
    for (int o = 16; o; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    const u32 nw = blockDim.x / 32;
    if ((threadIdx.x & 31) == 0) {
        red[threadIdx.x >> 5] = a;
        red[nw + (threadIdx.x >> 5)] = b;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        a = b = 0;
        for (u32 i = 0; i < nw; i++) {
            a += red[i];
            b += red[nw + i];
        }
    }
}

__device__ __forceinline__ uint4 zero4() { return make_uint4(0u, 0u, 0u, 0u); }

/* Bytes [0, valid) of the 16 at p, the rest zero: the tail of a tensor, which may end
 * anywhere, is never read past its end. */
__device__ uint4 load16_partial(const u8 *p, u32 valid) {
    if (valid >= 16) return *(const uint4 *)p;
    u32 w[4] = {0u, 0u, 0u, 0u};
    for (u32 i = 0; i < valid; i++) w[i >> 2] |= (u32)p[i] << (8 * (i & 3));
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ void store16_partial(u8 *p, uint4 v, u32 valid) {
    if (valid >= 16) {
        *(uint4 *)p = v;
        return;
    }
    u32 w[4] = {v.x, v.y, v.z, v.w};
    for (u32 i = 0; i < valid; i++) p[i] = (u8)(w[i >> 2] >> (8 * (i & 3)));
}

__device__ __forceinline__ uint4 zero_tail(uint4 v, u32 valid) {
    if (valid >= 16) return v;
    u32 w[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; i++) {
        u32 keep = valid <= 4u * i ? 0u : valid >= 4u * i + 4 ? 0xffffffffu : (1u << (8 * (valid - 4 * i))) - 1u;
        w[i] &= keep;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* ---- layouts (docs/format.md, "Layouts"): 16 elements <-> one 16-byte vector per plane ---- */

/* bf16 pairs: word w holds two elements; exponents are bits 14..7 of each half. */
__device__ __forceinline__ void bf16_split4(u32 w0, u32 w1, u32 &e, u32 &s) {
    e = __byte_perm(w0 >> 7, w1 >> 7, 0x6420);
    u32 s0 = (w0 & 0x007F007Fu) | ((w0 >> 8) & 0x00800080u);
    u32 s1 = (w1 & 0x007F007Fu) | ((w1 >> 8) & 0x00800080u);
    s = __byte_perm(s0, s1, 0x6420);
}

__device__ __forceinline__ void bf16_merge4(u32 e, u32 s, u32 &w0, u32 &w1) {
    u32 e0 = __byte_perm(e, 0u, 0x4140), e1 = __byte_perm(e, 0u, 0x4342);
    u32 s0 = __byte_perm(s, 0u, 0x4140), s1 = __byte_perm(s, 0u, 0x4342);
    w0 = (e0 << 7) | (s0 & 0x007F007Fu) | ((s0 << 8) & 0x80008000u);
    w1 = (e1 << 7) | (s1 & 0x007F007Fu) | ((s1 << 8) & 0x80008000u);
}

struct LayoutBf16 {
    enum { ITEM = 2, NPLANES = 2, HPLANE = 0 };
    __device__ static void split(const uint4 *in, uint4 *pl) {
        bf16_split4(in[0].x, in[0].y, pl[0].x, pl[1].x);
        bf16_split4(in[0].z, in[0].w, pl[0].y, pl[1].y);
        bf16_split4(in[1].x, in[1].y, pl[0].z, pl[1].z);
        bf16_split4(in[1].z, in[1].w, pl[0].w, pl[1].w);
    }
    __device__ static void merge(const uint4 *pl, uint4 *out) {
        bf16_merge4(pl[0].x, pl[1].x, out[0].x, out[0].y);
        bf16_merge4(pl[0].y, pl[1].y, out[0].z, out[0].w);
        bf16_merge4(pl[0].z, pl[1].z, out[1].x, out[1].y);
        bf16_merge4(pl[0].w, pl[1].w, out[1].z, out[1].w);
    }
    __device__ static void merge1(const u8 *b, u8 *dst) {
        u32 x = ((b[1] & 0x80u) << 8) | ((u32)b[0] << 7) | (b[1] & 0x7Fu);
        dst[0] = (u8)x;
        dst[1] = (u8)(x >> 8);
    }
};

/* fp32: the high half of an element is laid out like a bf16 (exponent, sign | top mantissa);
 * planes 1 and 2 are its low two bytes. */
__device__ __forceinline__ void fp32_split4(uint4 x, u32 &e, u32 &p1, u32 &p2, u32 &p3) {
    u32 t01 = __byte_perm(x.x, x.y, 0x5140), t23 = __byte_perm(x.z, x.w, 0x5140);
    p1 = __byte_perm(t01, t23, 0x5410);
    p2 = __byte_perm(t01, t23, 0x7632);
    bf16_split4(__byte_perm(x.x, x.y, 0x7632), __byte_perm(x.z, x.w, 0x7632), e, p3);
}

__device__ __forceinline__ uint4 fp32_merge4(u32 e, u32 p1, u32 p2, u32 p3) {
    u32 h01, h23;
    bf16_merge4(e, p3, h01, h23);
    u32 t01 = __byte_perm(p1, p2, 0x5140), t23 = __byte_perm(p1, p2, 0x7362);
    return make_uint4(__byte_perm(t01, h01, 0x5410), __byte_perm(t01, h01, 0x7632),
                      __byte_perm(t23, h23, 0x5410), __byte_perm(t23, h23, 0x7632));
}

struct LayoutFp32 {
    enum { ITEM = 4, NPLANES = 4, HPLANE = 0 };
    __device__ static void split(const uint4 *in, uint4 *pl) {
        fp32_split4(in[0], pl[0].x, pl[1].x, pl[2].x, pl[3].x);
        fp32_split4(in[1], pl[0].y, pl[1].y, pl[2].y, pl[3].y);
        fp32_split4(in[2], pl[0].z, pl[1].z, pl[2].z, pl[3].z);
        fp32_split4(in[3], pl[0].w, pl[1].w, pl[2].w, pl[3].w);
    }
    __device__ static void merge(const uint4 *pl, uint4 *out) {
        out[0] = fp32_merge4(pl[0].x, pl[1].x, pl[2].x, pl[3].x);
        out[1] = fp32_merge4(pl[0].y, pl[1].y, pl[2].y, pl[3].y);
        out[2] = fp32_merge4(pl[0].z, pl[1].z, pl[2].z, pl[3].z);
        out[3] = fp32_merge4(pl[0].w, pl[1].w, pl[2].w, pl[3].w);
    }
    __device__ static void merge1(const u8 *b, u8 *dst) {
        u32 x = ((b[3] & 0x80u) << 24) | ((u32)b[0] << 23) | ((b[3] & 0x7Fu) << 16) | ((u32)b[2] << 8) | b[1];
        for (int i = 0; i < 4; i++) dst[i] = (u8)(x >> (8 * i));
    }
};

/* bytes layout: plane j = byte j of each element. The GPU encoder codes the byte that holds
 * the exponent: the only one of 1-byte dtypes (fp8, int8, ...), the high byte of fp16; wider
 * integer and float64/complex dtypes are stored as RAW blocks (HPLANE -1). */
template <int N>
struct LayoutBytes {
    enum { ITEM = N, NPLANES = N, HPLANE = N == 1 ? 0 : N == 2 ? 1 : -1 };
    /* 16 elements <-> N planes of 16 bytes (a byte transpose); N = 1 and 2 with byte permutes */
    __device__ static void split(const uint4 *in, uint4 *pl) {
        if (N == 1) {
            pl[0] = in[0];
        } else if (N == 2) {
            pl[0] = make_uint4(__byte_perm(in[0].x, in[0].y, 0x6420), __byte_perm(in[0].z, in[0].w, 0x6420),
                               __byte_perm(in[1].x, in[1].y, 0x6420), __byte_perm(in[1].z, in[1].w, 0x6420));
            pl[1] = make_uint4(__byte_perm(in[0].x, in[0].y, 0x7531), __byte_perm(in[0].z, in[0].w, 0x7531),
                               __byte_perm(in[1].x, in[1].y, 0x7531), __byte_perm(in[1].z, in[1].w, 0x7531));
        } else {
            const u8 *src = (const u8 *)in;
            u8 *dst = (u8 *)pl;
            for (int i = 0; i < 16; i++)
                for (int j = 0; j < N; j++) dst[16 * j + i] = src[N * i + j];
        }
    }
    __device__ static void merge(const uint4 *pl, uint4 *out) {
        if (N == 1) {
            out[0] = pl[0];
        } else if (N == 2) {
            out[0] = make_uint4(__byte_perm(pl[0].x, pl[1].x, 0x5140), __byte_perm(pl[0].x, pl[1].x, 0x7362),
                                __byte_perm(pl[0].y, pl[1].y, 0x5140), __byte_perm(pl[0].y, pl[1].y, 0x7362));
            out[1] = make_uint4(__byte_perm(pl[0].z, pl[1].z, 0x5140), __byte_perm(pl[0].z, pl[1].z, 0x7362),
                                __byte_perm(pl[0].w, pl[1].w, 0x5140), __byte_perm(pl[0].w, pl[1].w, 0x7362));
        } else {
            const u8 *src = (const u8 *)pl;
            u8 *dst = (u8 *)out;
            for (int i = 0; i < 16; i++)
                for (int j = 0; j < N; j++) dst[N * i + j] = src[16 * j + i];
        }
    }
    __device__ static void merge1(const u8 *b, u8 *dst) {
        for (int j = 0; j < N; j++) dst[j] = b[j];
    }
};

/* Plane byte i of a 16-byte vector. */
__device__ __forceinline__ u32 byte_of(uint4 v, int i) {
    u32 w = i < 4 ? v.x : i < 8 ? v.y : i < 12 ? v.z : v.w;
    return (w >> (8 * (i & 3))) & 0xFFu;
}

/* ---- Huffman codes (docs/format.md, "Plane header") ---- */

/* Shared tables of one plane's code, used by the encoder and both decoders. */
struct CodeTables {
    u32 hist[256];
    u32 keys[256];     /* encoder: (count << 8 | symbol) of the used symbols, ascending */
    u32 first[MAX_CODE_LEN + 2], limit[MAX_CODE_LEN + 2], offset[MAX_CODE_LEN + 2], lcount[MAX_CODE_LEN + 2];
    u32 tab[256];      /* encoder: bit-reversed code | length << 16 */
    u16 ccnt[8][MAX_CODE_LEN + 1]; /* symbols of each length in each chunk of 32 symbols */
    u8 len[256];
    u8 sym_at[256];    /* symbols in canonical order: by length, then value */
};

/* The canonical first code and the 11-bit window limit of every length, and each length's
 * offset in canonical order, into ct (with lcount[]). A whole warp calls it: lane m
 * (1 <= m <= MAX_CODE_LEN) passes the number of codes of length m, every other lane 0. Returns
 * the Kraft sum in units of 2^-MAX_CODE_LEN (over LUT_SIZE: the lengths over-subscribe the code
 * space, which only a hostile frame's do). first[l] = (first[l-1] + count[l-1]) << 1 is
 * unrolled into a sum, so every lane computes its own length's values from 11 shuffles. */
__device__ u32 canonical_bounds(CodeTables &ct, u32 cnt) {
    const u32 lane = threadIdx.x & 31;
    u32 first = 0, off = 0, kraft = 0;
    for (u32 m = 1; m <= MAX_CODE_LEN; m++) {
        const u32 cm = __shfl_sync(0xffffffffu, cnt, m);
        if (m < lane && lane <= MAX_CODE_LEN) {
            first += cm << (lane - m);
            off += cm;
        }
        kraft += cm << (MAX_CODE_LEN - m);
    }
    if (lane <= MAX_CODE_LEN) {
        ct.lcount[lane] = cnt;
        ct.first[lane] = first;
        ct.limit[lane] = (first + cnt) << (MAX_CODE_LEN - lane);
        ct.offset[lane] = off;
    }
    return kraft;
}

/* The Huffman tree of n >= 2 leaves with weights w[0, n) in ascending order (one thread): the
 * two-queue merge of cpu_codec.c's build_lengths. Internal node i (n <= i < 2n - 1) gets
 * weight w[i]; up[] links every node to its parent, the root to itself. The two front
 * weights of each queue are kept in registers, so a pick never waits for the shared-memory
 * load of the weight it compares next (that chain was most of a small block's tree). */
__device__ void huffman_tree(int n, u32 *w, u16 *up) {
    const int nodes = 2 * n - 1;
    int leaf = 0, inode = n;
    /* lw, lw2: leaves leaf and leaf + 1; iw, iw2: internal nodes inode and inode + 1, each
     * valid once that node exists (index < next) */
    u32 lw = w[0], lw2 = n > 1 ? w[1] : 0u, iw = 0, iw2 = 0;
    for (int next = n; next < nodes; next++) {
        u32 pick_w[2];
        int pick[2];
        for (int t = 0; t < 2; t++) {
            if (leaf < n && (inode >= next || lw <= iw)) {
                pick[t] = leaf;
                pick_w[t] = lw;
                leaf++;
                lw = lw2;
                lw2 = leaf + 1 < n ? w[leaf + 1] : 0u;
            } else {
                pick[t] = inode;
                pick_w[t] = iw;
                inode++;
                iw = iw2;
                iw2 = inode + 1 < next ? w[inode + 1] : 0u;
            }
        }
        u32 sum = pick_w[0] + pick_w[1];
        w[next] = sum;
        up[pick[0]] = up[pick[1]] = (u16)next;
        if (inode == next)
            iw = sum;
        else if (inode + 1 == next)
            iw2 = sum;
    }
    up[nodes - 1] = (u16)(nodes - 1);
}

/* Deflate's length-limiting repair (cpu_codec.c's build_lengths) on per-length leaf counts
 * held one per lane: lane m (1 <= m <= MAX_CODE_LEN) passes count[m], with the leaves deeper
 * than the limit counted at the limit, every other lane 0. While the Kraft sum is over,
 * one leaf at the limit goes, and a leaf at the longest length below the limit that is still
 * used moves one level down with a new sibling. Returns this lane's repaired count. A whole
 * warp calls it; the counts stay in registers. */
__device__ u32 limit_lengths(u32 cnt) {
    const u32 FULL = 0xffffffffu, lane = threadIdx.x & 31;
    u32 kraft = __reduce_add_sync(FULL, lane >= 1 && lane <= MAX_CODE_LEN ? cnt << (MAX_CODE_LEN - lane) : 0u);
    for (; kraft > LUT_SIZE; kraft--) {
        cnt -= lane == MAX_CODE_LEN ? 1u : 0u;
        const u32 m = __ballot_sync(FULL, lane >= 1 && lane < MAX_CODE_LEN && cnt != 0);
        if (m) {
            const u32 l = 31 - __clz(m);
            cnt += lane == l ? 0xFFFFFFFFu : lane == l + 1 ? 2u : 0u;
        }
    }
    return cnt;
}

/* build_lengths (below) for n <= 32 used symbols, in warp 0 alone and with no block barrier:
 * the same lengths. The tree's 2n - 1 <= 63 nodes live two per lane (node i in lane i & 31),
 * so the pointer doubling gathers with shuffles; the per-length counts come from ballots and
 * limit_lengths repairs them in registers (lane m holds count[m]). Exponent
 * planes of real tensors use 12-40 symbols. The caller syncs the block after it. */
__device__ void build_lengths_warp(CodeTables &ct, int n, u32 *w, u16 *up) {
    const u32 FULL = 0xffffffffu, lane = threadIdx.x & 31;
    const u32 nodes = 2 * n - 1, root = 2 * n - 2, i1 = lane + 32;
    if (lane < (u32)n) w[lane] = ct.keys[lane] >> 8;
    __syncwarp();
    if (lane == 0) huffman_tree(n, w, up);
    __syncwarp();
    /* depth = hops to the root: d += d[a], a = a[a], until every node points at the root */
    u32 d0 = lane < nodes && lane != root ? 1u : 0u, a0 = lane < nodes ? up[lane] : root;
    u32 d1 = i1 < nodes && i1 != root ? 1u : 0u, a1 = i1 < nodes ? up[i1] : root;
    while (__any_sync(FULL, a0 != root || a1 != root)) {
        const u32 x0 = __shfl_sync(FULL, d0, a0 & 31), y0 = __shfl_sync(FULL, d1, a0 & 31);
        const u32 p0 = __shfl_sync(FULL, a0, a0 & 31), q0 = __shfl_sync(FULL, a1, a0 & 31);
        const u32 x1 = __shfl_sync(FULL, d0, a1 & 31), y1 = __shfl_sync(FULL, d1, a1 & 31);
        const u32 p1 = __shfl_sync(FULL, a0, a1 & 31), q1 = __shfl_sync(FULL, a1, a1 & 31);
        d0 += a0 < 32 ? x0 : y0;
        a0 = a0 < 32 ? p0 : q0;
        d1 += a1 < 32 ? x1 : y1;
        a1 = a1 < 32 ? p1 : q1;
    }
    /* leaves are nodes 0..n-1; lengths over the limit count as the limit, then the repair */
    const u32 dc = lane < (u32)n ? (d0 < MAX_CODE_LEN ? d0 : MAX_CODE_LEN) : 0u;
    u32 cnt = 0;
#pragma unroll
    for (u32 m = 1; m <= MAX_CODE_LEN; m++) {
        const u32 c = __popc(__ballot_sync(FULL, dc == m));
        cnt = lane == m ? c : cnt;
    }
    cnt = limit_lengths(cnt);
    canonical_bounds(ct, cnt);
    /* the least frequent symbols (front of keys) take the longest codes: leaf i's length is
     * the longest l with i < count[l] + ... + count[MAX_CODE_LEN], else 1 */
    u32 l = 1, above = 0;
    bool found = false;
    for (u32 m = MAX_CODE_LEN; m >= 2; m--) {
        above += __shfl_sync(FULL, cnt, m);
        if (!found && lane < above) {
            l = m;
            found = true;
        }
    }
    if (lane < (u32)n) ct.len[ct.keys[lane] & 0xFF] = (u8)l;
}

/* Code lengths for a histogram with n >= 2 used symbols, none longer than MAX_CODE_LEN: the
 * algorithm of cpu_codec.c's build_lengths (two-queue Huffman over leaves sorted by count,
 * then deflate's length-limiting repair), so the same lengths. Call with all NT threads
 * (build_lengths_warp above takes n <= 32 with one warp and no barriers);
 * keys[] holds the n used symbols sorted, len[] is zero. Writes len[], lcount[] and the
 * canonical bounds (first[], limit[], offset[]).
 *   - the merge is sequential (thread 0, huffman_tree);
 *   - depths come from pointer doubling over the parent links (all threads, log2 rounds),
 *     where a sequential pass over the 2n - 1 nodes was a chain of shared-memory loads;
 *   - the repair runs in warp 0's registers (limit_lengths);
 *   - each leaf finds its length from the per-length counts (all threads). */
__device__ void build_lengths(CodeTables &ct, int n, u32 *w, u16 *up, u32 *depth, u32 *count) {
    const int tid = threadIdx.x, nodes = 2 * n - 1, root = 2 * n - 2;
    for (int i = tid; i < n; i += NT) w[i] = ct.keys[i] >> 8;
    if (tid < 64) count[tid] = 0;
    __syncthreads();
    if (tid == 0) huffman_tree(n, w, up);
    __syncthreads();
    u32 d = tid < nodes && tid != root ? 1u : 0u, a = tid < nodes ? up[tid] : 0u;
    if (tid < nodes) depth[tid] = d;
    __syncthreads();
    const int rounds = 32 - __clz(nodes); /* 2^rounds > every depth */
    for (int round = 0; round < rounds; round++) { /* depth = hops to the root: d += d[a], a = a[a] */
        u32 nd = 0, na = 0;
        if (tid < nodes) {
            nd = d + depth[a];
            na = up[a];
        }
        __syncthreads();
        if (tid < nodes) {
            depth[tid] = d = nd;
            up[tid] = (u16)(a = na);
        }
        /* done once every node points at the root (typically after 4 of the 7 rounds) */
        if (!__syncthreads_or(tid < nodes && a != (u32)root)) break;
    }
    /* lengths over the limit count as the limit; the repair below fixes the Kraft sum */
    if (tid < n) atomicAdd(&count[d < MAX_CODE_LEN ? d : MAX_CODE_LEN], 1u);
    __syncthreads();
    if (tid < 32) canonical_bounds(ct, limit_lengths(tid >= 1 && tid <= MAX_CODE_LEN ? count[tid] : 0u));
    __syncthreads();
    /* the least frequent symbols (front of keys) take the longest codes */
    if (tid < n) {
        u32 before = 0, l = MAX_CODE_LEN;
        for (; l > 1 && (u32)tid >= before + ct.lcount[l]; l--) before += ct.lcount[l];
        ct.len[ct.keys[tid] & 0xFF] = (u8)l;
    }
    __syncthreads();
}

/* Canonical ranks in two steps around one barrier (cpu_codec.c's assign_codes, in parallel):
 * thread s < 256 holds symbol s, of length l (0: unused), so warp c holds the chunk of
 * symbols [32c, 32c + 32). chunk_rank returns s's rank among the symbols of length l in its
 * chunk and records each chunk's per-length counts in ccnt; after a barrier, rank_before adds
 * the counts of the chunks before. The sum is s's rank among all symbols of its length by
 * value: its code is first[l] + rank. */
__device__ __forceinline__ u32 chunk_rank(CodeTables &ct, u32 l) {
    const u32 lane = threadIdx.x & 31, c = threadIdx.x >> 5;
    if (lane <= MAX_CODE_LEN) ct.ccnt[c][lane] = 0;
    __syncwarp();
    const u32 peers = __match_any_sync(0xffffffffu, l);
    if (lane == __ffs(peers) - 1) ct.ccnt[c][l] = (u16)__popc(peers);
    return __popc(peers & lanemask_lt());
}

__device__ __forceinline__ u32 rank_before(const CodeTables &ct, u32 l) {
    u32 r = 0;
    for (u32 c = 0; c < (threadIdx.x >> 5); c++) r += ct.ccnt[c][l];
    return r;
}

/* ---- decoding tables (cpu_codec.c's build_lut) ---- */

#define LUT_BAD_BIT (1u << 24)

/* Builds the single-symbol table (symbol | length << 8, 0 = no code starts here) and the
 * decode table over 11-bit windows: up to three symbols (bits 0-23), the error flag (24),
 * the symbols yielded (25-26) and the bits consumed (27-31). Invalid entries yield one
 * symbol and consume nothing, as on the CPU. Call with all NT threads; thread s < 256 passes
 * symbol s's code length as the frame gives it (0 for the others). Returns 0, or for every
 * thread E_HUFF_LEN (a length over MAX_CODE_LEN) or E_HUFF_KRAFT (lengths that
 * over-subscribe the code space; only a hostile frame has either). `mid()` runs in every
 * thread between two of the barriers (the fast decoder stages its HUFF data there, so the
 * load's latency overlaps the build, and the data is in place when the build returns).
 *
 * Five barriers: the per-length counts come from chunk_rank's, and warp 0 turns them into the
 * canonical bounds with shuffles. (With a count pass, a thread-0 bounds pass and a rank pass
 * of their own it took nine; docs/gpu.md, round 12.) */
template <class Mid>
__device__ u32 build_lut(CodeTables &ct, u32 l, u32 *lut, u16 *single, u32 *flag, Mid mid) {
    const u32 tid = threadIdx.x, lane = tid & 31;
    const bool too_long = l > MAX_CODE_LEN;
    l = too_long ? 0u : l;
    u32 r = tid < 256 ? chunk_rank(ct, l) : 0u;
    if (__syncthreads_or(too_long)) return E_HUFF_LEN;
    if (tid < 32) { /* lane m: the number of codes of length m */
        u32 cnt = 0;
        if (lane >= 1 && lane <= MAX_CODE_LEN)
            for (u32 c = 0; c < 8; c++) cnt += ct.ccnt[c][lane];
        const u32 kraft = canonical_bounds(ct, cnt);
        if (lane == 0) *flag = kraft <= LUT_SIZE ? 1u : 0u;
    }
    __syncthreads();
    if (!*flag) return E_HUFF_KRAFT;
    mid();
    if (tid < 256 && l) ct.sym_at[ct.offset[l] + r + rank_before(ct, l)] = (u8)tid;
    __syncthreads();
    u32 limit[MAX_CODE_LEN + 1];
    for (int m = 1; m <= MAX_CODE_LEN; m++) limit[m] = ct.limit[m];
    for (u32 j = tid; j < LUT_SIZE; j += NT) {
        u32 v = __brev(j) >> (32 - MAX_CODE_LEN); /* the window, first bit most significant */
        u32 m = MAX_CODE_LEN + 1; /* the shortest length whose codes reach past v */
        for (int q = MAX_CODE_LEN; q >= 1; q--) m = v < limit[q] ? (u32)q : m;
        u16 e = 0;
        if (m <= MAX_CODE_LEN) e = (u16)(ct.sym_at[ct.offset[m] + (v >> (MAX_CODE_LEN - m)) - ct.first[m]] | (m << 8));
        single[j] = e;
    }
    __syncthreads();
    for (u32 j = tid; j < LUT_SIZE; j += NT) {
        u32 e = single[j] & 0xFFu, used = single[j] >> 8, n = 1;
        if (!used) {
            lut[j] = LUT_BAD_BIT | (1u << 25);
            continue;
        }
        for (; n < 3; n++) { /* codes no longer than the bits left are decided by them */
            u32 next = single[j >> used], q = next >> 8;
            if (!q || used + q > MAX_CODE_LEN) break;
            e |= (next & 0xFFu) << (8 * n);
            used += q;
        }
        lut[j] = e | (n << 25) | (used << 27);
    }
    __syncthreads();
    return 0;
}

/* Decodes one sub-stream: bytes [start, stop) of a plane's data, `count` symbols into
 * base[o, o + count). `words` is the data as aligned 32-bit words (the HUFF section staged in
 * shared memory, or the frame), nwords of them; past them the last one is read again (bits
 * past a stream's end are never consumed by a valid stream, and a corrupt one fails the length
 * check). Returns true if the stream ends exactly at its length with valid codes. Like the CPU
 * decoder it takes up to three symbols per lookup while three more fit, then one at a time.
 *
 * The refill is one word ahead: `next` was loaded when the word before it was taken and is
 * read only when it is needed. A refill that loaded its word itself made a warp wait for the
 * load whenever one of its 32 streams refilled, i.e. at almost every lookup (350 cycles per
 * lookup instead of ~60; docs/gpu.md). (So was a funnel-shifted window of two words, tried in
 * round 14: ptxas loaded its next word into a temporary and moved it at once, which waits.)
 * Round 14 counts the bits taken from where the reader stands, not per lookup, stores the
 * symbols at base + o (an offset into shared memory for the fast decoder) and refills once
 * per two lookups: 23 instructions a lookup where there were 35 (SASS). */
__device__ __forceinline__ bool decode_substream(const u32 *words, u32 nwords, u32 start, u32 stop, u32 count,
                                                 const u32 *lut, const u16 *single, u8 *base, u32 o) {
    const u32 last = nwords - 1;
    const u32 wi0 = start >> 2;
    u32 wi = wi0;
    const u32 sh = 8u * (start & 3u);
    u32 w0 = words[wi < last ? wi : last], w1 = words[wi + 1 < last ? wi + 1 : last];
    u32 next = words[wi + 2 < last ? wi + 2 : last];
    u64 buf = ((u64)w0 | ((u64)w1 << 32)) >> sh;
    u32 nb = 64 - sh, flags = 0;
    wi += 3;
    const u32 oend = o + count;
    const int o3 = (int)oend - 2; /* three symbols fit while o < o3 */
#define UZ_REFILL()                                     \
    do {                                                \
        if (nb < 32) {                                  \
            buf |= (u64)next << nb;                     \
            nb += 32;                                   \
            next = words[wi < last ? wi : last];        \
            wi++;                                       \
        }                                               \
    } while (0)
    /* a refill leaves 32 bits or more, two lookups' worth: one refill per two lookups (its
     * predicated instructions were 16% of the decoder's, issued at every lookup; round 14) */
#define UZ_LOOKUP()                                     \
    do {                                                \
        const u32 e = lut[buf & (LUT_SIZE - 1)];        \
        u8 *q = base + o;                               \
        q[0] = (u8)e;                                   \
        q[1] = (u8)(e >> 8);                            \
        q[2] = (u8)(e >> 16);                           \
        const u32 used = e >> 27;                       \
        buf >>= used;                                   \
        nb -= used;                                     \
        o += (e >> 25) & 3u;                            \
        flags |= e;                                     \
    } while (0)
    while ((int)o < o3) {
        UZ_REFILL();
        UZ_LOOKUP();
        if ((int)o >= o3) break;
        UZ_LOOKUP();
    }
#undef UZ_LOOKUP
    while (o < oend) {
        UZ_REFILL();
        u32 sy = single[buf & (LUT_SIZE - 1)], l = sy >> 8;
        flags |= l ? 0u : LUT_BAD_BIT;
        l = l ? l : 1u; /* an invalid code ends the stream as corrupt; keep the loop finite */
        base[o++] = (u8)sy;
        buf >>= l;
        nb -= l;
    }
#undef UZ_REFILL
    /* the bits taken: those loaded (two words from bit sh, then 32 a refill) less those left */
    const u32 consumed = 64 - sh + 32 * (wi - wi0 - 3) - nb;
    return !(flags & LUT_BAD_BIT) && (consumed + 7) / 8 == stop - start;
}

/* ---- block payload structure (docs/format.md, "Block payload") ---- */

struct PlaneDesc {
    u32 mode, value, count, k, lo, span, len_off, ends_off, data_off, size;
};

/* Parses `np` plane headers from h[off..] and places their data sections; the first plane
 * has count0 symbols, the others count. Headers lie in h[0, hlen); the payload is len bytes.
 * hlen < len means h is a fast decoder's window: a header past it belongs to a block only the
 * general decoder takes. Returns 0 or an error code; *hdr_end is where the headers end. */
__device__ u32 parse_planes(const u8 *h, u32 hlen, u32 len, u32 off, int np, u32 count0, u32 count, u32 S,
                            PlaneDesc *d, u32 *nhuff, u32 *hdr_end) {
    const u32 cut = hlen < len ? (u32)E_GENERAL : 0u;
    *nhuff = 0;
    for (int i = 0; i < np; i++) {
        PlaneDesc &p = d[i];
        p.count = i ? count : count0;
        if (off >= hlen) return cut ? cut : E_PLANE_HDR;
        p.mode = h[off++];
        if (p.mode == PLANE_CONST) {
            if (off >= hlen) return cut ? cut : E_CONST_PLANE;
            p.value = h[off++];
        } else if (p.mode == PLANE_HUFF) {
            if (p.count == 0) return E_HUFF_EMPTY;
            if (hlen - off < 2) return cut ? cut : E_HUFF_TABLE;
            p.lo = h[off];
            p.span = h[off + 1];
            off += 2;
            if (p.lo + p.span > 255) return E_HUFF_RANGE;
            u32 nib = (p.span + 2) / 2;
            if (hlen - off < nib) return cut ? cut : E_HUFF_TABLE;
            /* lengths over MAX_CODE_LEN: build_lut checks them, a thread per symbol */
            if ((p.span & 1) == 0 && (h[off + nib - 1] >> 4)) return E_HUFF_PAD;
            p.len_off = off;
            off += nib;
            p.k = (p.count + S - 1) / S;
            if (hlen - off < 2 * p.k) return cut ? cut : E_ENDS;
            p.ends_off = off;
            off += 2 * p.k;
            (*nhuff)++;
        } else if (p.mode != PLANE_RAW) {
            return E_PLANE_MODE;
        }
    }
    *hdr_end = off;
    for (int i = 0; i < np; i++) {
        PlaneDesc &p = d[i];
        if (p.mode == PLANE_CONST) continue;
        off = align16(off);
        if (off > len) return E_PLANE_DATA;
        p.data_off = off;
        if (p.mode == PLANE_RAW) {
            p.size = p.count;
            if (len - off < p.size) return E_RAW_PLANE;
        } else {
            const u8 *e = h + p.ends_off + 2 * (p.k - 1);
            p.size = e[0] | ((u32)e[1] << 8);
            if (len - off < p.size) return E_STREAMS_PAST;
        }
        off += p.size;
    }
    return align16(off) == len ? 0u : (u32)E_SIZE;
}

/* Symbol s's code length in a parsed HUFF plane (0 if unused), as the frame gives it. */
__device__ __forceinline__ u32 plane_length(const u8 *h, const PlaneDesc &p, u32 s) {
    if (s < p.lo || s > p.lo + p.span) return 0u;
    const u32 i = s - p.lo;
    return (h[p.len_off + i / 2] >> (4 * (i & 1))) & 15u;
}

__device__ __forceinline__ u32 load_u16(const u8 *p) { return p[0] | ((u32)p[1] << 8); }

/* The block table entry of block b: its payload's start and length, checked against the
 * frame (docs/format.md, "Frame"). Thread 0. Returns 0 or E_PAYLOAD_END. */
__device__ u32 read_entry(const u8 *frame, u64 table_off, u64 payload_len, u32 b, u32 nblocks, u64 *start,
                          u32 *len, u64 *hash_orig, u64 *hash_payload) {
    const u64 *ent = (const u64 *)(frame + table_off) + 3ull * b;
    u64 s = b ? ent[-3] : 0, e = ent[0];
    *hash_orig = ent[1];
    *hash_payload = ent[2];
    if (e < s || e > payload_len || (e & 15) || (s & 15) || (b == nblocks - 1 && e != payload_len) ||
        e - s > 0x7FFFFFFFull)
        return E_PAYLOAD_END;
    *start = s;
    *len = (u32)(e - s);
    return 0;
}

/* ---- encoder ---- */

/* The histogram's counters: a u32 per symbol and lane, 32 KB. They fill the warp buffers and
 * run on into the first fields of EncShared, which step 1 does not touch (asserted below). */
#define HIST_BYTES (256 * 32 * 4)

struct EncShared {
    /* first: the fields under the histogram's end, none used before step 2 has read it */
    union {
        struct {
            u32 w[512];      /* build_lengths: node weights */
            u16 parent[512]; /* build_lengths: parent links, then ancestors */
            u32 depth[512];  /* build_lengths: distance to the ancestor */
        } build;
        /* then the code bits of each lane's run of each sub-stream (u8, or u16 above 512
         * symbols), counted once by the size pass and used again to place the runs */
        u8 runs[RUNS_BYTES];
    };
    __align__(16) u8 hdr[HDR_BYTES]; /* mode byte and plane headers, zero padded */
    u32 sbytes[LUT_SIZE / 2]; /* per sub-stream bytes, then their start offsets (k <= 1024) */
    CodeTables ct;
    u32 count[64];   /* build_lengths: leaves per depth */
    u32 used_mask[8];
    u32 wbits[8];    /* code bits of the entropy plane, per warp of symbols */
    u32 wsum[NW];
    u64 red[2 * NW];
    u32 data_off[16];
    u32 ticket, plane_mode, value, lo, hi, k, huff_total, hdr_nbytes, size, raw_block;
    u64 base;
};
static_assert(NW * WBUF_BYTES + RUNS_BYTES + HDR_BYTES + 4 * (LUT_SIZE / 2) >= HIST_BYTES,
              "the histogram overruns a field of EncShared that step 1 uses");

/* In-place exclusive scan of a[0, n) (n <= 2 * NT) in shared memory; returns the total. */
__device__ u32 block_scan(u32 *a, u32 n, u32 *wsum) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    u32 i0 = 2 * tid, x0 = i0 < n ? a[i0] : 0u, x1 = i0 + 1 < n ? a[i0 + 1] : 0u;
    u32 v = x0 + x1, incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        u32 t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    __syncthreads();
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    u32 before = 0, total = 0;
    for (int w = 0; w < NW; w++) {
        if (w < warp) before += wsum[w];
        total += wsum[w];
    }
    u32 ex = before + incl - v;
    if (i0 < n) a[i0] = ex;
    if (i0 + 1 < n) a[i0 + 1] = ex + x0;
    __syncthreads();
    return total;
}

/* A block's payload offset from the sizes of the blocks before it: the decoupled look-back
 * of single-pass prefix sums. status[i] holds block i's size (AGG) or its inclusive prefix
 * (INCL); tickets make every lower block resident or done, so the wait ends. Warp 0 reads
 * LOOKBACK_LOADS x 32 predecessors per round, all loads in flight at once: a small frame's 128
 * blocks are one round trip to L2, not four (with one thread they were a chain of up to a
 * hundred dependent loads). Windows are taken nearest first, up to the first INCL; a window
 * with a block not yet published ends the round, and the next one starts there. Every lane
 * returns the offset. */
__device__ u64 lookback(u64 *status, u32 b, u64 size) {
    volatile u64 *st = status;
    const u32 lane = threadIdx.x & 31;
    if (b == 0) {
        if (lane == 0) st[0] = LOOKBACK_INCL | size;
        return 0;
    }
    if (lane == 0) st[b] = LOOKBACK_AGG | size;
    u64 acc = 0;
    for (long long top = (long long)b - 1;;) {
        u64 v[LOOKBACK_LOADS];
#pragma unroll
        for (int r = 0; r < LOOKBACK_LOADS; r++) { /* lane 0 of window 0 is the nearest predecessor */
            const long long i = top - 32 * r - (long long)lane;
            v[r] = i >= 0 ? st[i] : LOOKBACK_INCL; /* before block 0: a prefix of 0 */
        }
        u64 x = 0;
        int taken = 0;
        bool found = false;
#pragma unroll
        for (int r = 0; r < LOOKBACK_LOADS; r++) {
            const u32 incl = __ballot_sync(0xffffffffu, (v[r] >> 62) == 2);
            const u32 ready = __ballot_sync(0xffffffffu, (v[r] >> 62) != 0);
            const u32 need = incl ? ((incl & (0u - incl)) << 1) - 1u : 0xffffffffu; /* lanes up to the nearest INCL */
            if ((ready & need) != need) break;
            x += (need >> lane) & 1u ? v[r] & LOOKBACK_VALUE : 0ull;
            taken++;
            if (incl) {
                found = true;
                break;
            }
        }
        for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
        acc += x;
        if (found) break;
        if (taken < LOOKBACK_LOADS) __nanosleep(64);
        top -= 32 * taken;
    }
    if (lane == 0) st[b] = LOOKBACK_INCL | (acc + size);
    return acc;
}

/* The frame header, once every block is written: header and dims from the launcher (with
 * frame_nbytes filled in), header_hash = the header's share + the table's (which every block
 * added to state[2]) + the length term; zero padding up to the payloads. Thread 0 of the
 * CUDA block that finished last. */
struct HeaderWords { /* the header and dims as the launcher packed them (kernel parameters) */
    u64 w[13];
};

__device__ void enc_finalize(u8 *out, u64 table_off, u64 payload_off, u32 nblocks, u64 *state, u64 *size_out,
                             const HeaderWords hw) {
    volatile u64 *st = state;
    u64 payload_len = nblocks ? (st[3 + nblocks - 1] & LOOKBACK_VALUE) : 0;
    u64 frame_nbytes = payload_off + payload_len;
    u64 h = atomicAdd(&state[2], 0ull);
#pragma unroll
    for (u32 i = 0; i < 13; i++) { /* constant indices: hw stays in parameter space */
        if (i >= table_off / 8) break;
        u64 v = i == 2 ? frame_nbytes : hw.w[i];
        ((u64 *)out)[i] = v;
        h += uzh_word((u32)v, 8ull * i) + uzh_word((u32)(v >> 32), 8ull * i + 4);
    }
    u64 hash_off = table_off + 24ull * nblocks;
    *(u64 *)(out + hash_off) = h + hash_off * UZH_LENGTH_MUL;
    for (u64 i = hash_off + 8; i < payload_off; i++) out[i] = 0;
    *size_out = frame_nbytes;
}

/* Loads chunk c (16 elements, ITEM x 16 bytes) of a block of nbytes bytes, zero past its end. */
template <int ITEM>
__device__ __forceinline__ void load_chunk(const u8 *in, u32 c, u32 nbytes, uint4 *v) {
#pragma unroll
    for (int i = 0; i < ITEM; i++) {
        int rem = (int)nbytes - 16 * (ITEM * (int)c + i);
        const u8 *p = in + 16u * (ITEM * c + i);
        v[i] = rem >= 16 ? *(const uint4 *)p : load16_partial(p, rem > 0 ? (u32)rem : 0u);
    }
}

/* Chunks c0, c0 + NT, ... (F of them) of a block of nchunks chunks, nbytes bytes. A block that
 * is whole rounds of whole chunks (`whole`, a constant at each call) takes plain loads, none of
 * load_chunk's bounds; otherwise chunks past the block are not loaded. */
template <int ITEM, int F>
__device__ __forceinline__ void load_round(const u8 *in, u32 c0, u32 nchunks, u32 nbytes, bool whole,
                                           uint4 (*v)[ITEM]) {
#pragma unroll
    for (int h = 0; h < F; h++) {
        const u32 c = c0 + h * NT;
        if (whole) {
#pragma unroll
            for (int i = 0; i < ITEM; i++) v[h][i] = ((const uint4 *)in)[ITEM * c + i];
        } else if (c < nchunks) {
            load_chunk<ITEM>(in, c, nbytes, v[h]);
        }
    }
}

/* The code bits of symbols E[s0, s0 + cnt): lengths from a 256-entry table; the symbols are
 * read 8 at a time (a lane's run is 8 or 16 at 256 or 512 symbols per sub-stream) so the
 * lookups are independent loads. */
__device__ __forceinline__ u32 run_bits(const u8 *E, u32 s0, u32 cnt, const CodeTables &ct) {
    const u8 *len = ct.len;
    u32 bits = 0;
    if ((cnt & 7) == 0 && (s0 & 7) == 0) {
        for (u32 i = 0; i < cnt; i += 8) {
            const uint2 v = *(const uint2 *)(E + s0 + i);
            const u32 w[2] = {v.x, v.y};
#pragma unroll
            for (int q = 0; q < 2; q++)
                bits += len[__byte_perm(w[q], 0u, 0x4440)] + len[__byte_perm(w[q], 0u, 0x4441)] +
                        len[__byte_perm(w[q], 0u, 0x4442)] + len[__byte_perm(w[q], 0u, 0x4443)];
        }
    } else {
        for (u32 i = 0; i < cnt; i++) bits += len[E[s0 + i]];
    }
    return bits;
}

/* Appends `len` code bits (at most 22: two codes) to a lane's 32-bit accumulator and stores
 * each word it fills with a plain store, the run's first word too: the bits of the lanes
 * before that share it are zeros here, and they OR theirs in after the warp's barrier (a word
 * is filled by one lane only, the one that writes its top bit). Round 14 dropped the `head`
 * and `started` logic for that first word and the 64-bit accumulator: 15 instructions a pair
 * of codes where there were 25 (SASS of the sm_90 build). */
__device__ __forceinline__ void put_bits(u32 code, u32 len, u32 &acc, u32 &nacc, u8 *smem, u32 &wa) {
    acc |= code << nacc;
    nacc += len;
    if (nacc >= 32) {
        *(u32 *)(smem + wa) = acc;
        wa += 4;
        nacc -= 32;
        acc = code >> (len - nacc); /* the bits that did not fit */
    }
}

/* Two codes (t: bits | length << 16, as CodeTables::tab) in one accumulator update: with at
 * most 31 bits pending and 22 added, one word at most fills. */
#define UZ_PUT_PAIR(ta, tb) \
    put_bits(((ta) & 0xFFFFu) | (((tb) & 0xFFFFu) << ((ta) >> 16)), ((ta) >> 16) + ((tb) >> 16), acc, nacc, smem, wa)

/* Encodes the symbols [s0, s0 + cnt) of each lane of a group of G lanes (a warp, or a half or
 * a quarter of one), `bits` code bits, as one sub-stream (LSB first, as cpu_codec.c's
 * encode_stream) into the group's buffer: lanes take consecutive runs and a scan of their bit
 * counts over the group places each run. Every word is stored whole by the lane that fills it,
 * except the stream's last, which only the lanes' closing ORs write: it is zeroed first.
 * All 32 lanes of the warp call it together (a group with no sub-stream passes cnt = bits =
 * 0). */
__device__ void encode_substream(const u8 *E, u32 s0, u32 cnt, u32 bits, const CodeTables &ct, u32 *wb32, u32 G) {
    const u32 gl = threadIdx.x & (G - 1);
    u32 incl = bits;
    for (u32 o = 1; o < G; o <<= 1) {
        u32 t = __shfl_up_sync(0xffffffffu, incl, o, G);
        if (gl >= o) incl += t;
    }
    const u32 off = incl - bits;
    wb32[incl >> 5] = 0;
    __syncwarp();
    UZ_DYN_SMEM(smem); /* the words by their offset in shared memory: one add a word, not three */
    u32 nacc = off & 31, acc = 0, wa = (u32)((u8 *)wb32 - smem) + 4 * (off >> 5);
    if ((cnt & 7) == 0 && (s0 & 7) == 0) {
        for (u32 i = 0; i < cnt; i += 8) {
            const uint2 v = *(const uint2 *)(E + s0 + i);
            const u32 w[2] = {v.x, v.y};
#pragma unroll
            for (int q = 0; q < 2; q++) {
                u32 t0 = ct.tab[__byte_perm(w[q], 0u, 0x4440)], t1 = ct.tab[__byte_perm(w[q], 0u, 0x4441)],
                    t2 = ct.tab[__byte_perm(w[q], 0u, 0x4442)], t3 = ct.tab[__byte_perm(w[q], 0u, 0x4443)];
                UZ_PUT_PAIR(t0, t1);
                UZ_PUT_PAIR(t2, t3);
            }
        }
    } else {
        u32 i = 0;
        for (; i + 2 <= cnt; i += 2) {
            u32 t0 = ct.tab[E[s0 + i]], t1 = ct.tab[E[s0 + i + 1]];
            UZ_PUT_PAIR(t0, t1);
        }
        if (i < cnt) { /* an odd last symbol, paired with no bits */
            u32 t0 = ct.tab[E[s0 + i]];
            UZ_PUT_PAIR(t0, 0u);
        }
    }
    __syncwarp(); /* every whole word is in before the shared ones are OR-ed */
    if (nacc) atomicOr((u32 *)(smem + wa), acc);
    __syncwarp();
}
#undef UZ_PUT_PAIR

/* Copies a warp buffer's first nbytes bytes to dst, which may start at any byte: the aligned
 * words of dst inside the range as whole words (a funnel shift of two buffer words each), the
 * partial words at either end byte by byte, because the sub-streams before and after (other
 * warps) share them. A byte per lane was 7% of the encoder's instructions.
 *
 * With HASH, returns this lane's share of the payload hash of the bytes it stored (dst_off:
 * dst's offset in the payload). UZH64 is a sum of word x key terms, and sub-streams share no
 * byte, so the shares of the streams that meet in one word add up to that word's term: the
 * section needs no second pass over global memory. That pass is a barrier and a round trip to
 * L2, which a small block's latency feels (1 MiB: -0.6 us); at 65536-element blocks the
 * writer's extra key per word cost more than the pass (64 MiB: +2%), so those keep the pass. */
template <bool HASH>
__device__ __forceinline__ u64 copy_substream(const u32 *wb32, u8 *dst, u32 dst_off, u32 nbytes, u32 G) {
    const u32 lane = threadIdx.x & (G - 1); /* the lane within its group of G */
    const u32 lead = (4u - (dst_off & 3u)) & 3u; /* bytes before dst's first aligned word */
    const u32 head = lead < nbytes ? lead : nbytes;
    const u32 nw = (nbytes - head) / 4, tail = head + 4 * nw;
    const u8 *src = (const u8 *)wb32;
    u64 h = 0;
    if (lane < head) {
        const u32 at = dst_off + lane;
        dst[lane] = src[lane];
        if (HASH) h += uzh_word((u32)src[lane] << (8 * (at & 3)), at & ~3u);
    }
    if (lane < nbytes - tail) {
        const u32 at = dst_off + tail + lane;
        dst[tail + lane] = src[tail + lane];
        if (HASH) h += uzh_word((u32)src[tail + lane] << (8 * (at & 3)), at & ~3u);
    }
    u32 *dw = (u32 *)(dst + head);
    for (u32 i = lane; i < nw; i += G) {
        const u32 r = head + 4 * i; /* the word's first byte in the buffer */
        const u32 w = __funnelshift_r(wb32[r >> 2], wb32[(r >> 2) + 1], 8 * (r & 3));
        dw[i] = w;
        if (HASH) h += uzh_word(w, dst_off + r);
    }
    return h;
}

/* Symbols in a lane's run that starts at s0: up to `per`, none past the block's n or for a
 * group of lanes with no sub-stream left (!live). */
__device__ __forceinline__ u32 run_count(bool live, u32 s0, u32 n, u32 per) {
    return live && s0 < n ? (n - s0 < per ? n - s0 : per) : 0u;
}

/* One codec block per CUDA block (docs/gpu.md, "Encoder"). Shared memory: the entropy
 * plane's symbols (block_elems bytes), NW warp buffers (the histogram's per-lane counters
 * first), then EncShared; cuda.py computes the size. */
template <class L>
__device__ void enc_block(const u8 *src, u64 numel, u32 be, u32 S, u8 *out, u64 table_off, u64 payload_off,
                          u32 nblocks, u64 *state, u64 *size_out, const HeaderWords hw) {
    UZ_DYN_SMEM(smem);
    u8 *E = smem;
    u8 *wbufs = smem + be;
    u32 *hist32 = (u32 *)wbufs; /* HIST_BYTES: symbol s, lane l at word 32 s + l */
    EncShared &sm = *(EncShared *)(wbufs + NW * WBUF_BYTES);
    CodeTables &ct = sm.ct;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    PHASE_START();

    if (tid == 0) sm.ticket = (u32)atomicAdd(&state[0], 1ull);
    /* The ticket is an L2 round trip, and the block's data a DRAM trip after it. Tickets come
     * mostly in launch order, so a small block's threads start loading the chunk of codec
     * block blockIdx.x before the ticket is back and keep it if the guess was right. If not,
     * that block's data is in L2 for whichever CUDA block drew it. */
    uint4 pre[L::ITEM];
    const u32 g = blockIdx.x;
    const u64 gfirst = (u64)g * be;
    const u32 gn = g < nblocks ? (u32)(numel - gfirst < be ? numel - gfirst : be) : 0u;
    const bool small = L::ITEM <= 2 && (gn + 15) / 16 <= NT; /* (4-byte items: 16 registers more spilled) */
    if (small && (u32)tid < (gn + 15) / 16) load_chunk<L::ITEM>(src + gfirst * L::ITEM, tid, gn * L::ITEM, pre);
    for (int i = tid; i < HIST_BYTES / 16; i += NT) ((uint4 *)hist32)[i] = zero4();
    __syncthreads();
    const u32 b = sm.ticket;
    const bool hit = small && b == g;
    if (b >= nblocks) { /* an empty tensor: one CUDA block writes the header */
        if (tid == 0 && nblocks == 0) enc_finalize(out, table_off, payload_off, 0, state, size_out, hw);
        return;
    }
    const u64 first = (u64)b * be;
    const u32 n = (u32)(numel - first < be ? numel - first : be);
    const u32 nbytes = n * L::ITEM, nchunks = (n + 15) / 16;
    const u8 *in = src + first * L::ITEM;
    const bool coded = L::HPLANE >= 0;
    const int hp = L::HPLANE < 0 ? 0 : L::HPLANE;

    /* 1. read the block (two chunks in flight per thread): its hash, its entropy plane into
     *    E, the plane's histogram in per-lane counters (one bank per lane: no conflicts; u32,
     *    so a count is a byte permute, an address and the atomic: two u16 per word took 7
     *    instructions a symbol, and it was a fifth of the encoder's) */
    /* (lane through a shuffle, which the compiler cannot see through: it would fold the
     * lane into each symbol's index, two instructions more a symbol than one shift-add) */
    const u32 hlane = __shfl_sync(0xffffffffu, 4u * lane, lane); /* the lane's column, in bytes */
    auto count = [&](u32 sym) { atomicAdd((u32 *)((u8 *)hist32 + (sym * 128u + hlane)), 1u); };
    u64 h_orig = 0, h_pay = 0;
    constexpr int F = L::ITEM > 2 ? 2 : 4; /* chunks in flight per thread, within 64 registers */
    const bool whole = n % 16 == 0 && nchunks % (F * NT) == 0; /* whole rounds of F chunks a thread */
    /* A block of at most NT chunks with two planes (bf16, fp16) keeps its chunk's RAW plane in
     * 4 registers until step 5 writes it: no second read of the block from L2 after the
     * look-back, where a small block's latency is the cost (docs/gpu.md, round 12). */
    constexpr int KP = L::NPLANES == 2 ? 1 - L::HPLANE : -1; /* the plane kept */
    const bool kept = KP >= 0 && coded && nchunks <= NT;
    uint4 keep = zero4();
    /* chunk c: its share of the hash, its entropy symbols into E and the histogram */
    auto take = [&](const uint4 *v, u32 c, bool first, bool full) {
#pragma unroll
        for (int i = 0; i < L::ITEM; i++) h_orig += uzh_chunk(v[i], L::ITEM * c + i);
        if (coded) {
            uint4 pl[L::NPLANES];
            L::split(v, pl);
            const uint4 sy = pl[hp];
            *(uint4 *)(E + 16 * c) = sy;
            if (KP >= 0 && first) keep = pl[KP < 0 ? 0 : KP];
            const u32 cnt = full || n - 16 * c >= 16 ? 16 : n - 16 * c;
            if (cnt == 16) { /* every chunk but a block's last: no per-symbol branches */
                const u32 w[4] = {sy.x, sy.y, sy.z, sy.w};
#pragma unroll
                for (int i = 0; i < 16; i++) count(__byte_perm(w[i >> 2], 0u, 0x4440 | (i & 3)));
            } else {
                for (u32 i = 0; i < cnt; i++) count(byte_of(sy, i));
            }
        }
    };
    if (hit) { /* a chunk per thread at most, loaded before the ticket */
        if ((u32)tid < nchunks) take(pre, tid, true, false);
    } else {
        /* (a constant argument at each call: inlined, the whole-round loop has no bounds) */
        auto read_rounds = [&](const bool WHOLE) {
            for (u32 c0 = tid; c0 < nchunks; c0 += F * NT) {
                uint4 v[F][L::ITEM];
                load_round<L::ITEM, F>(in, c0, nchunks, nbytes, WHOLE, v);
#pragma unroll
                for (int h = 0; h < F; h++)
                    if (WHOLE || c0 + h * NT < nchunks) take(v[h], c0 + h * NT, h == 0, WHOLE);
            }
        };
        if (whole)
            read_rounds(true);
        else
            read_rounds(false);
    }
    __syncthreads();
    PHASE(0, 0);

    /* 2. the code: histogram, used symbols sorted by count, Huffman lengths, canonical codes */
    u32 nused = 0, lo = 256, hi = 0;
    if (coded) {
        if (tid < 256) {
            u32 c = 0;
            for (int l = 0; l < 32; l++) c += hist32[tid * 32 + ((l + tid) & 31)];
            ct.hist[tid] = c;
            ct.len[tid] = 0;
            u32 m = __ballot_sync(0xffffffffu, c != 0);
            if (lane == 0) sm.used_mask[warp] = m;
        }
        __syncthreads();
        /* every thread, from the 8 masks: no thread-0 step and barrier */
        for (int w = 0; w < 8; w++) {
            u32 m = sm.used_mask[w];
            nused += __popc(m);
            if (m && lo == 256) lo = 32 * w + __ffs(m) - 1;
            if (m) hi = 32 * w + 31 - __clz(m);
        }
        if (tid == 0) {
            sm.lo = lo;
            sm.hi = hi;
        }
        if ((u32)tid >= lo && (u32)tid <= hi && ct.hist[tid]) { /* rank sort over the used range */
            u32 key = ct.hist[tid] << 8 | tid, r = 0;
            for (u32 t = lo; t <= hi; t++) {
                u32 h = ct.hist[t];
                r += h && (h << 8 | t) < key;
            }
            ct.keys[r] = key;
        }
        __syncthreads();
        PHASE(0, 1);
        if (nused >= 2) {
            if (nused <= 32) {
                if (warp == 0) build_lengths_warp(ct, (int)nused, sm.build.w, sm.build.parent);
                __syncthreads();
            } else {
                build_lengths(ct, (int)nused, sm.build.w, sm.build.parent, sm.build.depth, sm.count);
            }
            PHASE(0, 2);
            /* the codes (thread s: symbol s) and the code bits of each warp's 32 symbols, which
             * step 3 adds up after the barrier below */
            const u32 l = tid < 256 ? ct.len[tid] : 0u;
            const u32 r = tid < 256 ? chunk_rank(ct, l) : 0u;
            __syncthreads();
            if (tid < 256) {
                if (l) ct.tab[tid] = (__brev(ct.first[l] + r + rank_before(ct, l)) >> (32 - l)) | (l << 16);
                const u32 bits = __reduce_add_sync(0xffffffffu, ct.hist[tid] * l);
                if (lane == 0) sm.wbits[warp] = bits;
            }
        }
        __syncthreads();
        PHASE(0, 3);
    }

    /* 3. how the entropy plane is stored: CONST, HUFF when it beats RAW (cpu_codec.c's
     *    plan_plane rule), else RAW; HUFF: each sub-stream's size, then their offsets. The
     *    header is zeroed here, not earlier: the histogram's counters ran over it. */
    for (int i = tid; i < HDR_BYTES / 16; i += NT) ((uint4 *)sm.hdr)[i] = zero4();
    if (tid == 0) {
        u32 mode = PLANE_RAW;
        if (coded && nused == 1) {
            mode = PLANE_CONST;
            sm.value = sm.lo;
        } else if (coded) {
            u32 k = (n + S - 1) / S;
            u64 bits = 0;
            for (int w = 0; w < 8; w++) bits += sm.wbits[w];
            u64 est = bits / 8 + k;
            sm.k = k;
            if (3 + (sm.hi - sm.lo + 2) / 2 + 2 * k + est < 1 + (u64)n && est <= 0xFFFF) mode = PLANE_HUFF;
        }
        sm.plane_mode = mode;
    }
    __syncthreads();
    const u32 pmode = sm.plane_mode, k = sm.k;
    /* a group of G lanes per sub-stream, a lane per run of S / G symbols, as the writer will
     * place them; each run's bits are kept for the writer when they fit (always at the default
     * sizes). Up to 256 symbols G is S / 8 lanes (a warp, a half or a quarter): a lane's run
     * stays at 8 symbols (the writer's fast path), and a small block's 32 or 64 sub-streams
     * take one round of 16 warps, not two or four (rounds 11 and 13), where latency counts.
     * From 512, frames of 8 MiB and more, a lane takes 32 symbols (G = S / 32): a sub-stream
     * costs each lane ~110 instructions besides its symbols (scan, offsets, copy), 7 per
     * element at 16 symbols a lane (round 14). */
    const u32 G = S >> (S >= 512 ? 5 : 3), spw = 32 / G, gl = lane & (G - 1), sub = lane / G;
    const u32 per = S / G;
    const bool wide_runs = per * MAX_CODE_LEN > 0xFF;
    const bool keep_runs = k * G * (wide_runs ? 2u : 1u) <= RUNS_BYTES;
    u32 huff_total = 0;
    if (pmode == PLANE_HUFF) {
        for (u32 j0 = warp * spw; j0 < k; j0 += NW * spw) {
            const u32 j = j0 + sub, s0 = j * S + gl * per, cnt = run_count(j < k, s0, n, per);
            u32 bits = run_bits(E, s0, cnt, ct);
            if (j < k && keep_runs && wide_runs) ((u16 *)sm.runs)[G * j + gl] = (u16)bits;
            if (j < k && keep_runs && !wide_runs) sm.runs[G * j + gl] = (u8)bits;
            if (G == 32)
                bits = __reduce_add_sync(0xffffffffu, bits);
            else
                for (u32 o = G / 2; o; o >>= 1) bits += __shfl_xor_sync(0xffffffffu, bits, o);
            if (gl == 0 && j < k) sm.sbytes[j] = (bits + 7) / 8;
        }
        __syncthreads();
        huff_total = block_scan(sm.sbytes, k, sm.wsum); /* every thread */
        if (tid == 0) sm.huff_total = huff_total;
    }
    PHASE(0, 4);

    /* 4. the block's layout and size; its offset from the look-back */
    if (tid == 0) {
        u32 o = 1, plane_off[16];
        for (int p = 0; p < L::NPLANES; p++) {
            plane_off[p] = o;
            u32 mode = (coded && p == L::HPLANE) ? pmode : (u32)PLANE_RAW;
            o += mode == PLANE_RAW ? 1 : mode == PLANE_CONST ? 2 : 3 + (sm.hi - sm.lo + 2) / 2 + 2 * k;
        }
        sm.hdr_nbytes = o;
        for (int p = 0; p < L::NPLANES; p++) {
            u32 mode = (coded && p == L::HPLANE) ? pmode : (u32)PLANE_RAW;
            if (mode == PLANE_CONST) continue;
            o = align16(o);
            sm.data_off[p] = o;
            o += mode == PLANE_HUFF ? sm.huff_total : n;
        }
        u32 dense = align16(o), raw = ALIGN + align16(nbytes);
        sm.raw_block = dense >= raw || !coded;
        sm.size = sm.raw_block ? raw : dense;
        if (!sm.raw_block) {
            u8 *h = sm.hdr;
            h[0] = BLOCK_DENSE;
            for (int p = 0; p < L::NPLANES; p++) {
                u32 mode = p == L::HPLANE ? pmode : (u32)PLANE_RAW;
                u8 *q = h + plane_off[p];
                q[0] = (u8)mode;
                if (mode == PLANE_CONST) q[1] = (u8)sm.value;
                if (mode == PLANE_HUFF) { /* its lengths and ends: warps 1-15, below */
                    q[1] = (u8)sm.lo;
                    q[2] = (u8)(sm.hi - sm.lo);
                }
            }
        }
        PHASE(0, 5);
    }
    if (warp == 0) {
        __syncwarp();
        const u64 base = lookback(state + 3, b, sm.size);
        if (lane == 0) sm.base = base;
    } else if (pmode == PLANE_HUFF) {
        /* meanwhile the coded plane's code lengths (two per byte) and sub-stream ends go into
         * its header, which starts after one byte per RAW plane before it. (Thread 0 wrote them
         * before the look-back could start; in a RAW block they are written and not used.) */
        u8 *q = sm.hdr + 1 + hp;
        const u32 nib = (hi - lo + 2) / 2, ends = 1 + hp + 3 + nib;
        for (u32 i = tid - 32; i < nib; i += NT - 32) {
            const u32 s = lo + 2 * i;
            q[3 + i] = (u8)(ct.len[s] | ((s + 1 <= hi ? ct.len[s + 1] : 0) << 4));
        }
        for (u32 j = tid - 32; j < k; j += NT - 32) {
            const u32 e = j + 1 < k ? sm.sbytes[j + 1] : huff_total;
            sm.hdr[ends + 2 * j] = (u8)e;
            sm.hdr[ends + 2 * j + 1] = (u8)(e >> 8);
        }
    }
    __syncthreads();
    PHASE(0, 6);
    u8 *dst = out + payload_off + sm.base;
    const u32 size = sm.size;

    /* 5. write the payload, hashing it on the way */
    if (sm.raw_block) {
        for (u32 u = tid; u < size / 16; u += NT) {
            uint4 v = u ? load16_partial(in + 16 * (u - 1), nbytes - 16 * (u - 1) < 16 ? nbytes - 16 * (u - 1) : 16u)
                        : make_uint4(BLOCK_RAW, 0u, 0u, 0u);
            *(uint4 *)(dst + 16 * u) = v;
            h_pay += uzh_chunk(v, u);
        }
    } else {
        const bool huff = pmode == PLANE_HUFF;
        for (u32 u = tid; u < align16(sm.hdr_nbytes) / 16; u += NT) {
            uint4 v = ((const uint4 *)sm.hdr)[u];
            *(uint4 *)(dst + 16 * u) = v;
            h_pay += uzh_chunk(v, u);
        }
        if (kept && tid < nchunks) { /* RAW planes from the registers, and from E if the coded plane is RAW */
            const u32 c = tid;
            for (int p = 0; p < L::NPLANES; p++) {
                if (p == L::HPLANE && pmode != PLANE_RAW) continue;
                const uint4 v = p == L::HPLANE ? *(const uint4 *)(E + 16 * c) : keep;
                *(uint4 *)(dst + sm.data_off[p] + 16 * c) = v;
                h_pay += uzh_chunk(v, (sm.data_off[p] >> 4) + c);
            }
        }
        if (whole && !kept && pmode != PLANE_RAW) { /* whole rounds, the coded plane not RAW: no bounds */
            u32 doff[L::NPLANES];
#pragma unroll
            for (int p = 0; p < L::NPLANES; p++) doff[p] = sm.data_off[p];
            for (u32 c0 = tid; c0 < nchunks; c0 += F * NT) {
                uint4 v[F][L::ITEM];
                load_round<L::ITEM, F>(in, c0, nchunks, nbytes, true, v);
#pragma unroll
                for (int h = 0; h < F; h++) {
                    const u32 c = c0 + h * NT;
                    uint4 pl[L::NPLANES];
                    L::split(v[h], pl);
#pragma unroll
                    for (int p = 0; p < L::NPLANES; p++) {
                        if (p == L::HPLANE) continue;
                        *(uint4 *)(dst + doff[p] + 16 * c) = pl[p];
                        h_pay += uzh_chunk(pl[p], (doff[p] >> 4) + c);
                    }
                }
            }
        }
        /* RAW planes: the block again, from L2. (One loop with the whole-round one above, by
         * a constant flag as in step 1, spilled fp32's registers in it: 8 -> 64 bytes.) */
        for (u32 c0 = kept || (whole && pmode != PLANE_RAW) ? nchunks : tid; c0 < nchunks; c0 += F * NT) {
            uint4 v[F][L::ITEM];
            load_round<L::ITEM, F>(in, c0, nchunks, nbytes, false, v);
#pragma unroll
            for (int h = 0; h < F; h++) {
                const u32 c = c0 + h * NT;
                if (c >= nchunks) continue;
                uint4 pl[L::NPLANES];
                L::split(v[h], pl);
                for (int p = 0; p < L::NPLANES; p++) {
                    if (p == L::HPLANE && pmode != PLANE_RAW) continue;
                    *(uint4 *)(dst + sm.data_off[p] + 16 * c) = pl[p];
                    h_pay += uzh_chunk(pl[p], (sm.data_off[p] >> 4) + c);
                }
            }
        }
        PHASE(0, 7);
        if (huff) { /* a group of G lanes per sub-stream, each copied out whole */
            u8 *sec = dst + sm.data_off[hp];
            const bool fuse_hash = be <= FUSE_HASH_MAX_BLOCK;
            /* a group's buffer is its share of the warp's: at most S x 11 bits, 176 words
             * for a half warp at S = 512 (of 178), 44 at S = 128 and 22 for a quarter (S = 64) */
            u32 *wb32 = (u32 *)(wbufs + warp * WBUF_BYTES) + sub * (WBUF_BYTES / 4 / spw);
            for (u32 j0 = warp * spw; j0 < k; j0 += NW * spw) {
                const u32 j = j0 + sub;
                const bool live = j < k; /* a group past the last sub-stream writes nothing */
                u32 start = live ? sm.sbytes[j] : 0u, stop = !live ? 0u : j + 1 < k ? sm.sbytes[j + 1] : sm.huff_total;
                const u32 s0 = j * S + gl * per, cnt = run_count(live, s0, n, per);
                u32 bits = !live       ? 0u
                           : !keep_runs ? run_bits(E, s0, cnt, ct)
                           : wide_runs  ? ((const u16 *)sm.runs)[G * j + gl] : sm.runs[G * j + gl];
                encode_substream(E, s0, cnt, bits, ct, wb32, G);
                if (fuse_hash)
                    h_pay += copy_substream<true>(wb32, sec + start, sm.data_off[hp] + start, stop - start, G);
                else
                    copy_substream<false>(wb32, sec + start, sm.data_off[hp] + start, stop - start, G);
                __syncwarp();
            }
            for (u32 i = sm.huff_total + tid; i < align16(sm.huff_total); i += NT) sec[i] = 0; /* hashes to 0 */
            PHASE(0, 8);
            if (!fuse_hash) {
                __syncthreads();
                for (u32 u = tid; u < align16(sm.huff_total) / 16; u += NT)
                    h_pay += uzh_chunk(*(const uint4 *)(sec + 16 * u), (sm.data_off[hp] >> 4) + u);
            }
        }
    }

    /* 6. the table entry, the table's share of the header hash, and the header if last */
    PHASE(0, 9);
    block_sum2(h_orig, h_pay, sm.red);
    if (tid == 0) {
        u64 ent[3] = {sm.base + size, h_orig + (u64)nbytes * UZH_LENGTH_MUL, h_pay + (u64)size * UZH_LENGTH_MUL};
        u64 at = table_off + 24ull * b, share = 0;
        for (int i = 0; i < 3; i++) {
            *(u64 *)(out + at + 8 * i) = ent[i];
            share += uzh_word((u32)ent[i], at + 8 * i) + uzh_word((u32)(ent[i] >> 32), at + 8 * i + 4);
        }
        atomicAdd(&state[2], share);
        __threadfence();
        if (atomicAdd(&state[1], 1ull) == nblocks - 1) {
            __threadfence();
            enc_finalize(out, table_off, payload_off, nblocks, state, size_out, hw);
        }
    }
    PHASE(0, 14);
}

/* ---- decoder, fast path: RAW blocks and DENSE blocks with at most one HUFF plane ---- */

struct __align__(16) DecShared {
    CodeTables ct;
    PlaneDesc pd[17];
    u64 red[2 * NW];
    u64 start, hash_orig, hash_payload;
    u32 len, mode, bad, hp, np, hdr_end, flag, m;
    u32 wsum[NW];
};

/* Shared memory: the decoded symbols (k sub-streams, S + 16 bytes apart so that threads
 * storing at the same offset of their streams hit different banks), the decode tables, the
 * payload's first WIN_BYTES, DecShared, then a copy of the HUFF plane's data (sect_bytes:
 * what fits beside the rest with two CUDA blocks per SM; a larger section is read from the
 * frame, correct but slower). cuda.py computes the sizes.
 *
 * Threads j < k decode sub-stream j into the symbol buffer while the others hash the RAW
 * planes (bringing them from DRAM into L2); then all merge 16 elements at a time, consecutive
 * threads on consecutive elements, so RAW-plane loads and output stores are coalesced. (A
 * version where each decoding thread merged its own sub-stream's elements needed no symbol
 * buffer, but its loads and stores were 1 KB apart across a warp: twice as slow at 1 GiB.) */
template <class L>
__device__ void dec_block_fast(const u8 *frame, u64 payload_off, u64 payload_len, u64 table_off, u64 numel, u32 be,
                               u32 S, u32 nblocks, u8 *out, u64 *err, u32 sym_bytes, u32 sect_bytes) {
    UZ_DYN_SMEM(smem);
    u8 *sym = smem;
    u32 *lut = (u32 *)(smem + sym_bytes);
    u16 *single = (u16 *)(lut + LUT_SIZE);
    u8 *win = (u8 *)(single + LUT_SIZE);
    DecShared &sm = *(DecShared *)(win + WIN_BYTES);
    u8 *sect = (u8 *)(&sm + 1);
    const u32 tid = threadIdx.x;
    const u32 b = blockIdx.x;
    const u64 first = (u64)b * be;
    const u32 n = (u32)(numel - first < be ? numel - first : be);
    const u32 nbytes = n * L::ITEM, nchunks = (n + 15) / 16;
    const u8 *payload = frame + payload_off;
    u8 *dst = out + first * L::ITEM;
    PHASE_START();

    if (tid == 0) {
        err[b] = UZ_CLEAN; /* before the barrier below, after which any thread may report */
        u32 code = read_entry(frame, table_off, payload_len, b, nblocks, &sm.start, &sm.len, &sm.hash_orig,
                              &sm.hash_payload);
        sm.bad = code;
        if (code) report(err, b, code);
    }
    __syncthreads();
    if (sm.bad) return;
    PHASE(1, 0);
    const u8 *blk = payload + sm.start;
    const u32 len = sm.len, wlen = len < WIN_BYTES ? len : WIN_BYTES;
    for (u32 u = tid; u < wlen / 16; u += NT) ((uint4 *)win)[u] = ((const uint4 *)blk)[u];
    __syncthreads();
    PHASE(1, 1);
    if (tid == 0) {
        u32 code = 0, nhuff = 0;
        sm.mode = len ? win[0] : 255u;
        sm.hp = 255;
        if (!len)
            code = E_EMPTY;
        else if (sm.mode == BLOCK_RAW)
            code = len == ALIGN + align16(nbytes) ? 0u : (u32)E_RAW_SIZE;
        else if (sm.mode == BLOCK_DENSE) {
            code = parse_planes(win, wlen, len, 1, L::NPLANES, n, n, S, sm.pd, &nhuff, &sm.hdr_end);
            if (!code && nhuff > 1) code = E_GENERAL;
            for (int p = 0; p < L::NPLANES; p++)
                if (sm.pd[p].mode == PLANE_HUFF) sm.hp = p;
        } else
            code = sm.mode == BLOCK_SPARSE ? (u32)E_GENERAL : (u32)E_MODE;
        sm.bad = code;
        if (code) report(err, b, code);
    }
    __syncthreads();
    if (sm.bad) return;
    PHASE(1, 2);

    u64 h_orig = 0, h_pay = 0;
    if (sm.mode == BLOCK_RAW) {
        for (u32 u = tid; u < len / 16; u += NT) {
            uint4 v = ((const uint4 *)blk)[u];
            h_pay += uzh_chunk(v, u);
            if (u) {
                u32 o = 16 * (u - 1), valid = nbytes - o < 16 ? nbytes - o : 16u;
                store16_partial(dst + o, v, valid);
                h_orig += uzh_chunk(zero_tail(v, valid), u - 1);
            }
        }
    } else {
        const u32 hp = sm.hp;
        /* the payload but its RAW planes: the headers' units and the HUFF plane's data, which is
         * copied into shared memory on the way when it fits (refills then take ~30 cycles) */
        const u32 hunits = align16(sm.hdr_end) / 16;
        const u32 hu = hp != 255 ? align16(sm.pd[hp].size) / 16 : 0u, hoff = hp != 255 ? sm.pd[hp].data_off : 0u;
        const bool staged = 16 * hu <= sect_bytes;
        const u32 units = hunits + hu;
        auto take = [&](u32 u, uint4 v) {
            h_pay += uzh_chunk(v, (u < hunits ? 16 * u : hoff + 16 * (u - hunits)) >> 4);
            if (u >= hunits && staged) ((uint4 *)sect)[u - hunits] = v;
        };
        auto load = [&](u32 u) {
            const u32 at = u < hunits ? 16 * u : hoff + 16 * (u - hunits);
            return at + 16 <= wlen ? *(const uint4 *)(win + at) : *(const uint4 *)(blk + at);
        };
        /* a small block's units, one per thread, are loaded now and taken inside build_lut */
        const bool one = units <= NT && hp != 255;
        uint4 early = zero4();
        if (one) {
            if (tid < units) early = load(tid);
        } else {
            for (u32 u = tid; u < units; u += NT) take(u, load(u));
        }
        u32 k = 0;
        if (hp != 255) {
            const u32 code = build_lut(sm.ct, plane_length(win, sm.pd[hp], tid), lut, single, &sm.flag, [&] {
                if (one && tid < units) take(tid, early);
            });
            if (code) {
                if (tid == 0) report(err, b, code);
                return;
            }
            PHASE(1, 3);
            const PlaneDesc &p = sm.pd[hp];
            k = p.k;
            /* a 4-byte multiple: frames are whole 16-byte units, so these words stay inside.
             * (One call through a generic pointer: a second call for the staged words made
             * shared-memory loads, but ptxas turned its refill into a branch, and a branch in
             * this latency-bound chain is what round 14's 1 MiB decode lost 0.2 us to.) */
            const u32 *words = staged ? (const u32 *)sect : (const u32 *)(blk + p.data_off);
            const u32 nwords = staged ? 4 * hu : (u32)((payload_len - sm.start - p.data_off) / 4);
            for (u32 j = tid; j < k; j += NT) {
                u32 start = j ? load_u16(win + p.ends_off + 2 * j - 2) : 0u, stop = load_u16(win + p.ends_off + 2 * j);
                u32 code = 0;
                if (stop < start)
                    code = E_ENDS_BACK;
                else if (!decode_substream(words, nwords, start, stop, p.count - j * S < S ? p.count - j * S : S, lut,
                                           single, sym, j * (S + 16)))
                    code = E_STREAM;
                if (code) {
                    report(err, b, code);
                    sm.bad = 1;
                }
            }
        }
        /* threads without a sub-stream hash the RAW planes meanwhile, two chunks in flight */
        const u32 helpers = k < NT ? NT - k : 0u;
        if (helpers && tid >= k)
            for (u32 c = tid - k; c < nchunks; c += 2 * helpers) {
                uint4 v[2][L::NPLANES];
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int q = 0; q < L::NPLANES; q++)
                        if (sm.pd[q].mode == PLANE_RAW && c + h * helpers < nchunks)
                            v[h][q] = *(const uint4 *)(blk + sm.pd[q].data_off + 16 * (c + h * helpers));
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int q = 0; q < L::NPLANES; q++)
                        if (sm.pd[q].mode == PLANE_RAW && c + h * helpers < nchunks)
                            h_pay += uzh_chunk(v[h][q], (sm.pd[q].data_off >> 4) + c + h * helpers);
            }
        __syncthreads();
        if (sm.bad) return;
        PHASE(1, 4);
        constexpr int F = L::NPLANES > 2 ? 1 : 2; /* chunks in flight; fp32 keeps one: 64 registers */
        /* The common block, whole chunks whose one HUFF plane is the layout's coded plane and the
         * rest RAW, takes a loop with its plane modes fixed at compile time, the symbols' place by
         * shifts and no partial stores: 19 -> 8.5 instructions per element in SASS. */
        constexpr int HP = L::HPLANE < 0 ? 0 : L::HPLANE;
        bool simple = L::HPLANE >= 0 && n % 16 == 0 && hp == (u32)HP;
        u32 doff[L::NPLANES];
#pragma unroll
        for (int q = 0; q < L::NPLANES; q++) {
            doff[q] = sm.pd[q].data_off;
            if (q != HP) simple = simple && sm.pd[q].mode == PLANE_RAW;
        }
        const u32 ls = 31 - __clz(S); /* S is a power of two (the header's check) */
        /* (a constant argument at each call: inlined, each call is its own loop) */
        auto merge_chunks = [&](const bool SIMPLE) {
            for (u32 c0 = tid; c0 < nchunks; c0 += F * NT) {
                uint4 pl[F][L::NPLANES];
#pragma unroll
                for (int h = 0; h < F; h++) {
                    const u32 c = c0 + h * NT, e = 16 * c;
                    if (c >= nchunks) continue;
#pragma unroll
                    for (int q = 0; q < L::NPLANES; q++) {
                        const u32 mode = SIMPLE ? (q == HP ? (u32)PLANE_HUFF : (u32)PLANE_RAW) : sm.pd[q].mode;
                        if (mode == PLANE_HUFF) {
                            pl[h][q] = *(const uint4 *)(sym + (e >> ls) * (S + 16) + (e & (S - 1)));
                        } else if (mode == PLANE_RAW) {
                            pl[h][q] = *(const uint4 *)(blk + doff[q] + e);
                        } else {
                            u32 v = sm.pd[q].value * 0x01010101u;
                            pl[h][q] = make_uint4(v, v, v, v);
                        }
                    }
                }
#pragma unroll
                for (int h = 0; h < F; h++) {
                    const u32 c = c0 + h * NT;
                    if (c >= nchunks) continue;
                    uint4 o[L::ITEM];
                    if (!helpers)
#pragma unroll
                        for (int q = 0; q < L::NPLANES; q++)
                            if (SIMPLE ? q != HP : sm.pd[q].mode == PLANE_RAW)
                                h_pay += uzh_chunk(pl[h][q], (doff[q] >> 4) + c);
                    L::merge(pl[h], o);
#pragma unroll
                    for (int i = 0; i < L::ITEM; i++) {
                        if (SIMPLE) {
                            *(uint4 *)(dst + 16 * (L::ITEM * c + i)) = o[i];
                            h_orig += uzh_chunk(o[i], L::ITEM * c + i);
                            continue;
                        }
                        int rem = (int)nbytes - 16 * (L::ITEM * (int)c + i);
                        if (rem <= 0) continue;
                        u32 valid = rem < 16 ? (u32)rem : 16u;
                        store16_partial(dst + 16 * (L::ITEM * c + i), o[i], valid);
                        h_orig += uzh_chunk(zero_tail(o[i], valid), L::ITEM * c + i);
                    }
                }
            }
        };
        if (simple)
            merge_chunks(true);
        else
            merge_chunks(false);
        PHASE(1, 5);
    }
    block_sum2(h_orig, h_pay, sm.red);
    if (tid == 0) {
        if (h_pay + (u64)len * UZH_LENGTH_MUL != sm.hash_payload)
            report(err, b, E_PAYLOAD_HASH);
        else if (h_orig + (u64)nbytes * UZH_LENGTH_MUL != sm.hash_orig)
            report(err, b, E_ORIG_HASH);
    }
    PHASE(1, 14);
}

/* ---- decoder, general path: every block kind, planes decoded through global scratch ---- */

/* Symbol i of plane p: decoded (scratch), in the payload (RAW) or constant. */
__device__ __forceinline__ u32 plane_sym(const PlaneDesc &p, const u8 *blk, const u8 *dec, u32 i) {
    return p.mode == PLANE_HUFF ? dec[i] : p.mode == PLANE_RAW ? blk[p.data_off + i] : p.value;
}

/* A persistent grid: CUDA block g takes codec blocks g, g + grid, ... with its own scratch
 * slot of (1 + NPLANES) planes, plane_stride bytes apart. Slower than the fast path and only
 * used for frames whose GENERAL flag is set (CPU frames of zero-heavy or integer data) and for
 * dtypes of more than 2 bytes in the bytes layout. */
template <class L>
__device__ void dec_block_general(const u8 *frame, u64 payload_off, u64 payload_len, u64 table_off, u64 numel,
                                  u32 be, u32 S, u32 nblocks, u32 flags, u8 *out, u64 *err, u8 *scratch,
                                  u32 plane_stride) {
    UZ_DYN_SMEM(smem);
    u32 *lut = (u32 *)smem;
    u16 *single = (u16 *)(lut + LUT_SIZE);
    DecShared &sm = *(DecShared *)(single + LUT_SIZE);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u8 *payload = frame + payload_off;
    u8 *slot = scratch + (u64)blockIdx.x * (1 + L::NPLANES) * plane_stride;

    for (u32 b = blockIdx.x; b < nblocks; b += gridDim.x) {
        const u64 first = (u64)b * be;
        const u32 n = (u32)(numel - first < be ? numel - first : be);
        const u32 nbytes = n * L::ITEM;
        u8 *dst = out + first * L::ITEM;
        __syncthreads(); /* sm is reused across blocks */
        if (tid == 0) {
            err[b] = UZ_CLEAN; /* before the barrier below, after which any thread may report */
            u32 code = read_entry(frame, table_off, payload_len, b, nblocks, &sm.start, &sm.len, &sm.hash_orig,
                                  &sm.hash_payload);
            sm.bad = code;
            if (code) report(err, b, code);
        }
        __syncthreads();
        if (sm.bad) continue;
        const u8 *blk = payload + sm.start;
        const u32 len = sm.len;
        u64 h = 0;
        for (u32 u = tid; u < len / 16; u += NT) h += uzh_chunk(((const uint4 *)blk)[u], u);
        h = block_sum(h, sm.red);
        if (tid == 0) {
            u32 code = 0, nhuff = 0, general = 0;
            sm.mode = len ? blk[0] : 255u;
            sm.np = L::NPLANES;
            sm.m = n;
            if (h + (u64)len * UZH_LENGTH_MUL != sm.hash_payload)
                code = E_PAYLOAD_HASH;
            else if (!len)
                code = E_EMPTY;
            else if (sm.mode == BLOCK_RAW)
                code = len == ALIGN + align16(nbytes) ? 0u : (u32)E_RAW_SIZE;
            else if (sm.mode == BLOCK_DENSE) {
                code = parse_planes(blk, len, len, 1, L::NPLANES, n, n, S, sm.pd, &nhuff, &sm.hdr_end);
                general = nhuff > 1;
            } else if (sm.mode == BLOCK_SPARSE) {
                general = 1;
                if (len < 5) {
                    code = E_SPARSE_HDR;
                } else {
                    sm.m = blk[1] | ((u32)blk[2] << 8) | ((u32)blk[3] << 16) | ((u32)blk[4] << 24);
                    sm.np = 1 + L::NPLANES;
                    code = sm.m > n ? (u32)E_SPARSE_M
                                    : parse_planes(blk, len, len, 5, 1 + L::NPLANES, (n + 7) / 8, sm.m, S, sm.pd,
                                                   &nhuff, &sm.hdr_end);
                }
            } else {
                code = E_MODE;
            }
            if (!code && general && !(flags & 1u)) code = E_GENERAL;
            sm.bad = code;
            if (code) report(err, b, code);
        }
        __syncthreads();
        if (sm.bad) continue;
        if (sm.mode == BLOCK_RAW) {
            for (u32 u = tid; u < align16(nbytes) / 16; u += NT) {
                u32 o = 16 * u, valid = nbytes - o < 16 ? nbytes - o : 16u;
                store16_partial(dst + o, ((const uint4 *)blk)[u + 1], valid);
            }
        } else {
            const u32 np = sm.np;
            for (u32 q = 0; q < np; q++) {
                const PlaneDesc &p = sm.pd[q];
                if (p.mode != PLANE_HUFF) continue;
                const u32 code = build_lut(sm.ct, plane_length(blk, p, tid), lut, single, &sm.flag, [] {});
                if (code) {
                    if (tid == 0) {
                        report(err, b, code);
                        sm.bad = 1;
                    }
                    break;
                }
                for (u32 j = tid; j < p.k; j += NT) {
                    u32 start = j ? load_u16(blk + p.ends_off + 2 * j - 2) : 0u, stop = load_u16(blk + p.ends_off + 2 * j);
                    u32 code = 0;
                    if (stop < start)
                        code = E_ENDS_BACK;
                    else if (!decode_substream((const u32 *)(blk + p.data_off),
                                               (u32)((payload_len - sm.start - p.data_off) / 4), start, stop,
                                               p.count - j * S < S ? p.count - j * S : S, lut, single,
                                               slot + q * plane_stride + j * S, 0u))
                        code = E_STREAM;
                    if (code) {
                        report(err, b, code);
                        sm.bad = 1;
                    }
                }
                __syncthreads();
                if (sm.bad) break;
            }
            __syncthreads();
            if (sm.bad) continue;
            const bool sparse = sm.mode == BLOCK_SPARSE;
            const u32 pl0 = sparse ? 1u : 0u, nmask = (n + 7) / 8;
            if (sparse) { /* the mask must hold exactly m ones and zero padding bits */
                u32 pop = 0;
                for (u32 i = tid; i < nmask; i += NT) pop += __popc(plane_sym(sm.pd[0], blk, slot, i));
                u64 total = block_sum(pop, sm.red);
                if (tid == 0) {
                    u32 code = 0;
                    if ((n & 7) && (plane_sym(sm.pd[0], blk, slot, nmask - 1) >> (n & 7))) code = E_SPARSE_PAD;
                    else if (total != sm.m) code = E_SPARSE_POP;
                    sm.bad = code;
                    if (code) report(err, b, code);
                }
                __syncthreads();
                if (sm.bad) continue;
            }
            u32 base = 0; /* nonzero elements before this tile */
            for (u32 t0 = 0; t0 < n; t0 += NT) {
                u32 i = t0 + tid;
                bool nz = i < n && (!sparse || ((plane_sym(sm.pd[0], blk, slot, i >> 3) >> (i & 7)) & 1u));
                u32 ballot = __ballot_sync(0xffffffffu, nz);
                if (lane == 0) sm.wsum[warp] = __popc(ballot);
                __syncthreads();
                u32 rank = base + __popc(ballot & lanemask_lt());
                for (int w = 0; w < NW; w++) {
                    if (w < warp) rank += sm.wsum[w];
                    if (w == NW - 1) base = base; /* keeps the loop shape simple for the compiler */
                }
                u32 tile = 0;
                for (int w = 0; w < NW; w++) tile += sm.wsum[w];
                if (i < n) {
                    u8 bytes[16], el[16];
                    for (int q = 0; q < L::NPLANES; q++)
                        bytes[q] = nz ? (u8)plane_sym(sm.pd[pl0 + q], blk, slot + (pl0 + q) * plane_stride, rank) : 0;
                    if (nz) {
                        L::merge1(bytes, el);
                    } else {
                        for (int q = 0; q < L::ITEM; q++) el[q] = 0;
                    }
                    for (int q = 0; q < L::ITEM; q++) dst[(u64)i * L::ITEM + q] = el[q];
                }
                base += tile;
                __syncthreads();
            }
        }
        __syncthreads();
        u64 ho = 0;
        for (u32 u = tid; u < align16(nbytes) / 16; u += NT) {
            u32 o = 16 * u, valid = nbytes - o < 16 ? nbytes - o : 16u;
            ho += uzh_chunk(load16_partial(dst + o, valid), u);
        }
        ho = block_sum(ho, sm.red);
        if (tid == 0 && ho + (u64)nbytes * UZH_LENGTH_MUL != sm.hash_orig) report(err, b, E_ORIG_HASH);
    }
}

/* ---- the kernels cuda.py launches ---- */

/* h0..h12: the header and dims, 13 scalar parameters (enc_finalize indexes them only with
 * constants, so they never become a per-thread array in local memory) */
#define UZ_ENC_ARGS                                                                                        \
    const u8 *src, u64 numel, u32 block_elems, u32 substream, u8 *out, u64 table_off, u64 payload_off,    \
        u32 nblocks, u64 *state, u64 *size_out, u64 h0, u64 h1, u64 h2, u64 h3, u64 h4, u64 h5, u64 h6, u64 h7, \
        u64 h8, u64 h9, u64 h10, u64 h11, u64 h12
#define UZ_ENC_BODY(LAYOUT)                                                                                  \
    {                                                                                                        \
        const HeaderWords hw = {{h0, h1, h2, h3, h4, h5, h6, h7, h8, h9, h10, h11, h12}};                  \
        enc_block<LAYOUT>(src, numel, block_elems, substream, out, table_off, payload_off, nblocks, state,  \
                          size_out, hw);                                                                     \
    }
#define UZ_DEC_ARGS                                                                                       \
    const u8 *frame, u64 payload_off, u64 payload_len, u64 table_off, u64 numel, u32 block_elems,         \
        u32 substream, u32 nblocks, u8 *out, u64 *err
#define UZ_DEC_GENERAL_ARGS UZ_DEC_ARGS, u32 flags, u8 *scratch, u32 plane_stride

extern "C" __global__ void __launch_bounds__(NT, 2) uz_enc_bf16(UZ_ENC_ARGS) UZ_ENC_BODY(LayoutBf16)
extern "C" __global__ void __launch_bounds__(NT, 2) uz_enc_fp32(UZ_ENC_ARGS) UZ_ENC_BODY(LayoutFp32)
extern "C" __global__ void __launch_bounds__(NT, 2) uz_enc_b1(UZ_ENC_ARGS) UZ_ENC_BODY(LayoutBytes<1>)
extern "C" __global__ void __launch_bounds__(NT, 2) uz_enc_b2(UZ_ENC_ARGS) UZ_ENC_BODY(LayoutBytes<2>)
extern "C" __global__ void __launch_bounds__(NT, 2) uz_enc_b4(UZ_ENC_ARGS) UZ_ENC_BODY(LayoutBytes<4>)
extern "C" __global__ void __launch_bounds__(NT, 2) uz_enc_b8(UZ_ENC_ARGS) UZ_ENC_BODY(LayoutBytes<8>)
extern "C" __global__ void __launch_bounds__(NT, 2) uz_enc_b16(UZ_ENC_ARGS) UZ_ENC_BODY(LayoutBytes<16>)

#define UZ_DEC_KERNELS(NAME, LAYOUT)                                                                       \
    extern "C" __global__ void __launch_bounds__(NT, 2) uz_dec_##NAME(UZ_DEC_ARGS, u32 sym_bytes,         \
                                                                         u32 sect_bytes) {                 \
        dec_block_fast<LAYOUT>(frame, payload_off, payload_len, table_off, numel, block_elems, substream,  \
                               nblocks, out, err, sym_bytes, sect_bytes);                                  \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(NT) uz_dec_general_##NAME(UZ_DEC_GENERAL_ARGS) {          \
        dec_block_general<LAYOUT>(frame, payload_off, payload_len, table_off, numel, block_elems, substream, \
                                  nblocks, flags, out, err, scratch, plane_stride);                        \
    }
UZ_DEC_KERNELS(bf16, LayoutBf16)
UZ_DEC_KERNELS(fp32, LayoutFp32)
UZ_DEC_KERNELS(b1, LayoutBytes<1>)
UZ_DEC_KERNELS(b2, LayoutBytes<2>)
UZ_DEC_KERNELS(b4, LayoutBytes<4>)
UZ_DEC_KERNELS(b8, LayoutBytes<8>)
UZ_DEC_KERNELS(b16, LayoutBytes<16>)

/* UZH64 of each seg-byte segment of data (the last may be short), one CUDA block each: the
 * checksum on its own, for the tests and the benchmark. */
extern "C" __global__ void __launch_bounds__(NT) uz_hash_segs(const u8 *data, u64 seg, u64 n, u64 *out) {
    UZ_DYN_SMEM(smem);
    u64 *red = (u64 *)smem; /* NW words */
    const u64 s0 = (u64)blockIdx.x * seg;
    const u64 len = n - s0 < seg ? n - s0 : seg;
    u64 h = 0;
    const bool aligned = ((unsigned long long)(data + s0) & 15) == 0; /* segments may start anywhere */
    for (u64 u = threadIdx.x; u < (len + 15) / 16; u += NT) {
        u64 o = 16 * u;
        u32 valid = len - o < 16 ? (u32)(len - o) : 16u;
        uint4 v;
        if (aligned) {
            v = load16_partial(data + s0 + o, valid);
        } else { /* bytes: only 16-byte aligned vectors can be loaded whole */
            u32 w[4] = {0u, 0u, 0u, 0u};
            for (u32 i = 0; i < valid; i++) w[i >> 2] |= (u32)data[s0 + o + i] << (8 * (i & 3));
            v = make_uint4(w[0], w[1], w[2], w[3]);
        }
        h += uzh_chunk(v, (u32)u);
    }
    h = block_sum(h, red);
    if (threadIdx.x == 0) out[blockIdx.x] = h + len * UZH_LENGTH_MUL;
}

#ifdef UZ_SIMT
UZSIM_EXPORT(uz_enc_bf16);
UZSIM_EXPORT(uz_enc_fp32);
UZSIM_EXPORT(uz_enc_b1);
UZSIM_EXPORT(uz_enc_b2);
UZSIM_EXPORT(uz_enc_b4);
UZSIM_EXPORT(uz_enc_b8);
UZSIM_EXPORT(uz_enc_b16);
UZSIM_EXPORT(uz_dec_bf16);
UZSIM_EXPORT(uz_dec_fp32);
UZSIM_EXPORT(uz_dec_b1);
UZSIM_EXPORT(uz_dec_b2);
UZSIM_EXPORT(uz_dec_b4);
UZSIM_EXPORT(uz_dec_b8);
UZSIM_EXPORT(uz_dec_b16);
UZSIM_EXPORT(uz_dec_general_bf16);
UZSIM_EXPORT(uz_dec_general_fp32);
UZSIM_EXPORT(uz_dec_general_b1);
UZSIM_EXPORT(uz_dec_general_b2);
UZSIM_EXPORT(uz_dec_general_b4);
UZSIM_EXPORT(uz_dec_general_b8);
UZSIM_EXPORT(uz_dec_general_b16);
UZSIM_EXPORT(uz_hash_segs);
#endif

/* sizeof the shared-memory structs, read once by cuda.py to size each launch's shared memory */
extern "C" __global__ void uz_layout_sizes(u32 *out) {
    out[0] = (u32)sizeof(EncShared);
    out[1] = (u32)sizeof(DecShared);
}
#ifdef UZ_SIMT
UZSIM_EXPORT(uz_layout_sizes);
#endif
