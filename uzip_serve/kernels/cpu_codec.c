/*
 * CPU implementation of the uzip frame codec: block payloads and the block table.
 *
 * The frame layout is specified in docs/format.md and owned on the Python side by
 * uzip_serve/format.py (header, shape, validation). This file only encodes and
 * decodes the per-block payloads those documents describe; keep the three in step.
 *
 * Parallelism: blocks are independent, so both directions fan out over blocks with
 * plain pthreads (no OpenMP: its spinning idle threads would steal the 2 cores a
 * UCX progress thread needs in the P2P pipeline). The GIL is released throughout.
 *
 * Safety: the decoder treats the frame as hostile. Every length and offset is checked
 * against the buffer before use, every loop is bounded by a symbol count, and bit
 * readers near the end of the buffer fall back to a bounds-checked load.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

/* ---- format constants (docs/format.md, "Block payload") ---- */
enum { LAYOUT_BYTES = 0, LAYOUT_BF16 = 1, LAYOUT_FP32 = 2 };
enum { BLOCK_RAW = 0, BLOCK_DENSE = 1, BLOCK_SPARSE = 2 };
enum { PLANE_RAW = 0, PLANE_CONST = 1, PLANE_HUFF = 2 };
#define MAX_CODE_LEN 11 /* longest Huffman code, bits; also the decode table index width */
#define LUT_SIZE (1u << MAX_CODE_LEN)
#define MAX_PLANES 16
#define TABLE_ENTRY_BYTES 24 /* u64 payload end, u64 UZH64(original), u64 UZH64(payload) */
#define ALIGN 16             /* payloads and every plane's data start at multiples of this */
#define FLAG_GENERAL 1u      /* header flag: some block is SPARSE or has > 1 HUFF plane */
#define MAX_BLOCK_ELEMS 65536u
#define PAIR_ENTRIES (1u << 16) /* tables indexed by two symbols */

/* The per-block encoder and decoder are built twice, for x86-64-v3 (AVX2, BMI2: shifts by
 * a register without the flag-merging uops of `shl %cl`) and for the baseline, and the
 * loader picks one when the module loads. flatten pulls every helper into each copy, so the
 * Huffman loops themselves get the wider instructions. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && !defined(UZIP_NO_CLONES)
#define HOT_PATH __attribute__((target_clones("arch=x86-64-v3", "default"), flatten))
#else
#define HOT_PATH
#endif
#define NOINLINE __attribute__((noinline))

/* ---- little-endian loads and stores (the format is little-endian everywhere) ---- */
static inline uint64_t load64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void store64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint16_t load16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline void store16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static inline uint32_t load32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline void store32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline size_t align16(size_t n) { return (n + ALIGN - 1) & ~(size_t)(ALIGN - 1); }

/* Loads up to 8 bytes that may run past `end`; missing bytes read as zero. */
static inline uint64_t load64_tail(const uint8_t *p, const uint8_t *end) {
    uint8_t tmp[8] = {0};
    if (p < end) memcpy(tmp, p, (size_t)(end - p) < 8 ? (size_t)(end - p) : 8);
    return load64(tmp);
}

/* ---- UZH64, the frame checksum (docs/format.md, "UZH64, the checksum") ---- */
#define UZH_LENGTH_MUL 0x9E3779B97F4A7C15ull

/* The key of 16-byte group g: x = mix29(g); word j of the group gets 8x + 2j + 1. */
static inline uint32_t uzh_key_base(uint32_t g) {
    uint32_t x = (g * 0x9E3779B1u) & 0x1FFFFFFFu;
    x ^= x >> 14;
    x = (x * 0x85EBCA6Bu) & 0x1FFFFFFFu;
    x ^= x >> 13;
    return x << 3;
}

static uint64_t uzh_groups_scalar(const uint8_t *p, size_t ngroups, uint32_t g0) {
    uint64_t acc = 0;
    for (size_t g = 0; g < ngroups; g++, p += 16) {
        uint32_t k = uzh_key_base(g0 + (uint32_t)g);
        acc += (uint64_t)load32(p) * (k | 1u) + (uint64_t)load32(p + 4) * (k | 3u) +
               (uint64_t)load32(p + 8) * (k | 5u) + (uint64_t)load32(p + 12) * (k | 7u);
    }
    return acc;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* Eight groups per round: one vector mix makes their eight keys, which are then spread to
 * the four words of each group; even and odd words take one 32x32->64 multiply each. */
__attribute__((target("avx2"))) static uint64_t uzh_groups_avx2(const uint8_t *p, size_t ngroups, uint32_t g0) {
    const __m256i mul_a = _mm256_set1_epi32((int)0x9E3779B1u), mul_b = _mm256_set1_epi32((int)0x85EBCA6Bu);
    const __m256i mask = _mm256_set1_epi32(0x1FFFFFFF), odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
    __m256i gv = _mm256_add_epi32(_mm256_set1_epi32((int)g0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i acc = _mm256_setzero_si256();
    size_t g = 0;
    for (; g + 8 <= ngroups; g += 8, p += 128) {
        __m256i x = _mm256_and_si256(_mm256_mullo_epi32(gv, mul_a), mask);
        x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 14));
        x = _mm256_and_si256(_mm256_mullo_epi32(x, mul_b), mask);
        x = _mm256_slli_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 13)), 3);
#define UZH_PAIR(C)                                                                                     \
        do {                                                                                            \
            __m256i k_ = _mm256_or_si256(                                                               \
                _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(2 * C, 2 * C, 2 * C, 2 * C, 2 * C + 1, \
                                                                 2 * C + 1, 2 * C + 1, 2 * C + 1)),     \
                odd);                                                                                   \
            __m256i d_ = _mm256_loadu_si256((const __m256i *)(p + 32 * C));                              \
            acc = _mm256_add_epi64(acc, _mm256_mul_epu32(d_, k_));                                      \
            acc = _mm256_add_epi64(acc, _mm256_mul_epu32(_mm256_srli_epi64(d_, 32), _mm256_srli_epi64(k_, 32))); \
        } while (0)
        UZH_PAIR(0);
        UZH_PAIR(1);
        UZH_PAIR(2);
        UZH_PAIR(3);
#undef UZH_PAIR
        gv = _mm256_add_epi32(gv, _mm256_set1_epi32(8));
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, acc);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + uzh_groups_scalar(p, ngroups - g, g0 + (uint32_t)g);
}
static int have_avx2;
#endif

static uint64_t uzh64(const uint8_t *p, size_t n) {
    size_t full = n / 16;
#if defined(__x86_64__) && defined(__GNUC__)
    uint64_t acc = have_avx2 ? uzh_groups_avx2(p, full, 0) : uzh_groups_scalar(p, full, 0);
#else
    uint64_t acc = uzh_groups_scalar(p, full, 0);
#endif
    if (n % 16) {
        uint8_t tail[16] = {0};
        memcpy(tail, p + 16 * full, n % 16);
        acc += uzh_groups_scalar(tail, 1, (uint32_t)full);
    }
    return acc + (uint64_t)n * UZH_LENGTH_MUL;
}

/* ---- CRC32C (Castagnoli), hardware when the CPU has SSE4.2: the P2P raw-chunk checksum ---- */
static uint32_t crc_table[8][256];

static void crc_init_tables(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

static uint32_t crc32c_sw(uint32_t crc, const uint8_t *p, size_t n) {
    crc = ~crc;
    while (n >= 8) {
        uint64_t v = load64(p) ^ crc;
        crc = crc_table[7][v & 0xFF] ^ crc_table[6][(v >> 8) & 0xFF] ^ crc_table[5][(v >> 16) & 0xFF] ^
              crc_table[4][(v >> 24) & 0xFF] ^ crc_table[3][(v >> 32) & 0xFF] ^
              crc_table[2][(v >> 40) & 0xFF] ^ crc_table[1][(v >> 48) & 0xFF] ^ crc_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xFF];
    return ~crc;
}

/* crc(A || B) from crc(A), crc(B) and |B|: multiply crc(A) by x^(8|B|) mod P in GF(2)
 * (the technique of zlib's crc32_combine). Lets independent lanes run in parallel. */
static uint32_t x2n_table[32];

static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
    }
    return p;
}

static void crc_init_combine(void) {
    uint32_t p = 1u << 30; /* x^1 */
    x2n_table[0] = p;
    for (int n = 1; n < 32; n++) x2n_table[n] = p = multmodp(p, p);
}

static uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b) {
    uint32_t p = 1u << 31; /* x^0 */
    for (int k = 3; len_b; len_b >>= 1, k++)
        if (len_b & 1) p = multmodp(x2n_table[k & 31], p);
    return multmodp(p, crc_a) ^ crc_b;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
/* crc32q has a 3-cycle latency and 1-cycle throughput: three independent lanes keep
 * the unit busy, then the lanes are stitched together with crc32c_combine. */
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const uint8_t *p, size_t n) {
    if (n >= 3 * 4096) {
        size_t lane = (n / 3) & ~(size_t)7;
        uint64_t a = (uint32_t)~crc, b = 0xFFFFFFFFu, c = 0xFFFFFFFFu;
        const uint8_t *pb = p + lane, *pc = p + 2 * lane;
        for (size_t i = 0; i < lane; i += 8) {
            a = _mm_crc32_u64(a, load64(p + i));
            b = _mm_crc32_u64(b, load64(pb + i));
            c = _mm_crc32_u64(c, load64(pc + i));
        }
        uint32_t ab = crc32c_combine(~(uint32_t)a, ~(uint32_t)b, lane);
        crc = crc32c_combine(ab, ~(uint32_t)c, lane);
        p += 3 * lane;
        n -= 3 * lane;
    }
    uint64_t c = (uint32_t)~crc;
    while (n >= 8) {
        c = _mm_crc32_u64(c, load64(p));
        p += 8;
        n -= 8;
    }
    while (n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return ~(uint32_t)c;
}
static int have_sse42;
static uint32_t crc32c(uint32_t crc, const uint8_t *p, size_t n) {
    return have_sse42 ? crc32c_hw(crc, p, n) : crc32c_sw(crc, p, n);
}
#else
static uint32_t crc32c(uint32_t crc, const uint8_t *p, size_t n) { return crc32c_sw(crc, p, n); }
#endif

/* ---- element <-> plane transforms (docs/format.md, "Layouts") ---- */
/* Byte histogram. Exponent planes repeat a handful of symbols, so consecutive increments
 * of one counter would serialize on store-to-load forwarding; eight tables (one per byte
 * of a 64-bit load) keep the same counter eight increments apart. Counts per table stay
 * below 2^16 for a block, which halves the tables' cache footprint. */
static void hist_of(const uint8_t *s, size_t n, uint32_t *h) {
    uint16_t a[8][256];
    memset(a, 0, sizeof(a));
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = load64(s + i);
        a[0][v & 0xFF]++;
        a[1][(v >> 8) & 0xFF]++;
        a[2][(v >> 16) & 0xFF]++;
        a[3][(v >> 24) & 0xFF]++;
        a[4][(v >> 32) & 0xFF]++;
        a[5][(v >> 40) & 0xFF]++;
        a[6][(v >> 48) & 0xFF]++;
        a[7][v >> 56]++;
    }
    for (int j = 0; j < 256; j++)
        h[j] = (uint32_t)a[0][j] + a[1][j] + a[2][j] + a[3][j] + a[4][j] + a[5][j] + a[6][j] + a[7][j];
    for (; i < n; i++) h[s[i]]++;
}

/* Histogram of a plane whose nonzero symbols span at most 64 values (exponents do; zero,
 * the exponent of 0.0 and of the smallest subnormals, is allowed besides): counts byte
 * pairs, half as many increments as bytes, into two 2^16-entry tables (zero on entry, and
 * left zero) and folds them back over the symbols that can occur. Returns 0, doing
 * nothing, for a wider span. */
#define PAIR_HIST_SPAN 64

static int hist_narrow(const uint8_t *s, size_t n, uint32_t *h, uint16_t *pc0, uint16_t *pc1) {
    if (n < 4096) return 0;
    uint8_t lo1 = 255, hi = 0; /* lo1: smallest symbol minus one, so zero wraps to 255 */
    for (size_t i = 0; i < n; i++) { /* vectorizes */
        uint8_t m1 = (uint8_t)(s[i] - 1);
        lo1 = m1 < lo1 ? m1 : lo1;
        hi = s[i] > hi ? s[i] : hi;
    }
    unsigned lo = lo1 + 1u;
    if (hi < lo || hi - lo >= PAIR_HIST_SPAN) return 0; /* (hi < lo: all zero) */
    uint8_t sym[PAIR_HIST_SPAN + 1];
    int k = 0;
    if (lo > 0) sym[k++] = 0;
    for (unsigned v = lo; v <= hi; v++) sym[k++] = (uint8_t)v;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) { /* per table at most n / 4 < 2^16 counts */
        uint64_t v = load64(s + i);
        pc0[v & 0xFFFF]++;
        pc1[(v >> 16) & 0xFFFF]++;
        pc0[(v >> 32) & 0xFFFF]++;
        pc1[v >> 48]++;
    }
    memset(h, 0, 256 * sizeof(uint32_t));
    for (int y = 0; y < k; y++)
        for (int x = 0; x < k; x++) {
            unsigned key = sym[x] | (unsigned)sym[y] << 8;
            uint32_t c = (uint32_t)pc0[key] + pc1[key];
            pc0[key] = pc1[key] = 0;
            h[sym[x]] += c;
            h[sym[y]] += c;
        }
    for (; i < n; i++) h[s[i]]++;
    return 1;
}

static int num_planes(int layout, int itemsize) {
    return layout == LAYOUT_BYTES ? itemsize : (layout == LAYOUT_BF16 ? 2 : 4);
}

/* Splits n elements into planes and returns the full histogram of plane 0 (the one
 * that is always entropy coded). For single-byte elements plane 0 aliases src. The
 * split loops stay free of the histogram so the compiler can vectorize them. */
static void split_planes(int layout, int itemsize, const uint8_t *src, size_t n, uint8_t **planes,
                         uint32_t *hist0, uint16_t *pair_counts) {
    if (layout == LAYOUT_BF16) {
        uint8_t *e = planes[0], *r = planes[1];
        for (size_t i = 0; i < n; i++) {
            uint16_t x = load16(src + 2 * i);
            e[i] = (uint8_t)(x >> 7);
            r[i] = (uint8_t)(((x >> 8) & 0x80) | (x & 0x7F));
        }
    } else if (layout == LAYOUT_FP32) {
        for (size_t i = 0; i < n; i++) {
            uint32_t x = load32(src + 4 * i);
            planes[0][i] = (uint8_t)(x >> 23);
            planes[1][i] = (uint8_t)x;
            planes[2][i] = (uint8_t)(x >> 8);
            planes[3][i] = (uint8_t)(((x >> 24) & 0x80) | ((x >> 16) & 0x7F));
        }
    } else if (itemsize == 1) {
        planes[0] = (uint8_t *)src; /* read-only from here on */
    } else if (itemsize == 2) { /* fp16, int16: the generic loop below does not vectorize */
        for (size_t i = 0; i < n; i++) {
            uint16_t x = load16(src + 2 * i);
            planes[0][i] = (uint8_t)x;
            planes[1][i] = (uint8_t)(x >> 8);
        }
    } else {
        for (size_t i = 0; i < n; i++)
            for (int j = 0; j < itemsize; j++) planes[j][i] = src[(size_t)itemsize * i + j];
    }
    if (!hist_narrow(planes[0], n, hist0, pair_counts, pair_counts + PAIR_ENTRIES)) hist_of(planes[0], n, hist0);
}

/* Inverse of split_planes for n elements. */
/* Kept out of decode_block (noinline, its own clones): inlined into that large function the
 * loops were no longer vectorized, which halved decompress speed. */
NOINLINE HOT_PATH static void merge_planes(int layout, int itemsize, const uint8_t *const *planes, size_t n, uint8_t *dst) {
    if (layout == LAYOUT_BF16) {
        const uint8_t *e = planes[0], *r = planes[1];
        for (size_t i = 0; i < n; i++) {
            uint16_t x = (uint16_t)(((r[i] & 0x80u) << 8) | ((uint32_t)e[i] << 7) | (r[i] & 0x7Fu));
            store16(dst + 2 * i, x);
        }
    } else if (layout == LAYOUT_FP32) {
        for (size_t i = 0; i < n; i++) {
            uint32_t r3 = planes[3][i];
            uint32_t x = ((r3 & 0x80u) << 24) | ((uint32_t)planes[0][i] << 23) | ((r3 & 0x7Fu) << 16) |
                         ((uint32_t)planes[2][i] << 8) | planes[1][i];
            store32(dst + 4 * i, x);
        }
    } else if (itemsize == 1) {
        if (planes[0] != dst) memcpy(dst, planes[0], n);
    } else if (itemsize == 2) {
        for (size_t i = 0; i < n; i++) store16(dst + 2 * i, (uint16_t)(planes[0][i] | (planes[1][i] << 8)));
    } else {
        for (size_t i = 0; i < n; i++)
            for (int j = 0; j < itemsize; j++) dst[(size_t)itemsize * i + j] = planes[j][i];
    }
}

/* ---- length-limited canonical Huffman ---- */

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Code lengths for a histogram with >= 2 used symbols, none longer than MAX_CODE_LEN.
 * Plain Huffman (two-queue merge over leaves sorted by count), then, if the tree is
 * too deep, the length-limiting repair of deflate encoders: clamp, move codes down a
 * level until the Kraft sum is exact, and hand the lengths back out in count order. */
static void build_lengths(const uint32_t *hist, uint8_t *len) {
    uint64_t key[256]; /* count << 8 | symbol: sorting keys sorts leaves by count */
    int n = 0;
    for (int s = 0; s < 256; s++)
        if (hist[s]) key[n++] = ((uint64_t)hist[s] << 8) | (uint64_t)s;
    if (n <= 48) {
        for (int i = 1; i < n; i++) {
            uint64_t k = key[i];
            int j = i - 1;
            for (; j >= 0 && key[j] > k; j--) key[j + 1] = key[j];
            key[j + 1] = k;
        }
    } else {
        qsort(key, (size_t)n, sizeof(key[0]), cmp_u64);
    }
    uint64_t w[512];
    uint16_t parent[512];
    uint8_t depth[512];
    for (int i = 0; i < n; i++) w[i] = key[i] >> 8;
    int leaf = 0, inode = n, next = n;
    while (next < 2 * n - 1) {
        int pick[2];
        for (int t = 0; t < 2; t++) {
            if (leaf < n && (inode >= next || w[leaf] <= w[inode]))
                pick[t] = leaf++;
            else
                pick[t] = inode++;
        }
        w[next] = w[pick[0]] + w[pick[1]];
        parent[pick[0]] = parent[pick[1]] = (uint16_t)next;
        next++;
    }
    int root = 2 * n - 2;
    uint32_t count[64] = {0}; /* codes per length; a 2^16-leaf tree is < 64 deep */
    depth[root] = 0;
    for (int i = root - 1; i >= 0; i--) {
        depth[i] = (uint8_t)(depth[parent[i]] + 1);
        if (i < n) count[depth[i]]++;
    }
    for (int l = MAX_CODE_LEN + 1; l < 64; l++) count[MAX_CODE_LEN] += count[l];
    uint32_t kraft = 0;
    for (int l = 1; l <= MAX_CODE_LEN; l++) kraft += count[l] << (MAX_CODE_LEN - l);
    while (kraft > LUT_SIZE) {
        count[MAX_CODE_LEN]--;
        for (int l = MAX_CODE_LEN - 1; l > 0; l--)
            if (count[l]) {
                count[l]--;
                count[l + 1] += 2;
                break;
            }
        kraft--;
    }
    /* Least frequent symbols (front of the sorted keys) take the longest codes. */
    memset(len, 0, 256);
    int i = 0;
    for (int l = MAX_CODE_LEN; l >= 1; l--)
        for (uint32_t c = 0; c < count[l]; c++) len[key[i++] & 0xFF] = (uint8_t)l;
}

static inline uint32_t reverse_bits(uint32_t c, int nbits) {
    uint32_t r = 0;
    for (int i = 0; i < nbits; i++) r |= ((c >> i) & 1u) << (nbits - 1 - i);
    return r;
}

/* Canonical codes ordered by (length, symbol), stored bit-reversed because the bit
 * stream is filled LSB first. Returns 0, or -1 if the lengths over-subscribe the code
 * space (only possible for a hostile frame). */
static int assign_codes(const uint8_t *len, uint16_t *code) {
    uint32_t count[MAX_CODE_LEN + 1] = {0}, next[MAX_CODE_LEN + 2];
    for (int s = 0; s < 256; s++) count[len[s]]++;
    count[0] = 0;
    uint32_t c = 0, kraft = 0;
    for (int l = 1; l <= MAX_CODE_LEN; l++) {
        c = (c + count[l - 1]) << 1;
        next[l] = c;
        kraft += count[l] << (MAX_CODE_LEN - l);
    }
    if (kraft > LUT_SIZE) return -1;
    for (int s = 0; s < 256; s++)
        if (len[s]) code[s] = (uint16_t)reverse_bits(next[len[s]]++, len[s]);
    return 0;
}

/* Decode table over the next MAX_CODE_LEN bits of a stream. Each entry yields every
 * whole code, up to three, that fits in the window; exponent codes average 2-3 bits, so
 * most lookups yield three symbols and the serial chain of lookups that bounds Huffman
 * decoding gets that much shorter:
 *   bits 0-23 up to three symbols, 24 "no code starts here", 25-26 symbols yielded,
 *   27-31 bits consumed.
 * Invalid entries yield one (garbage) symbol and consume nothing, so every loop makes
 * progress; the flag turns the stream into an error. The single-symbol decoder at a
 * stream's end reads the first code's length from a byte table beside it. */
typedef struct {
    uint32_t e[LUT_SIZE];
    uint8_t len1[LUT_SIZE];
} lut_t;

#define LUT_BAD_BIT (1u << 24)
#define LUT_NSYM(e) (((e) >> 25) & 0x3)
#define LUT_BITS(e) ((e) >> 27)

static int build_lut(const uint8_t *len, lut_t *lut) {
    uint16_t code[256], single[LUT_SIZE]; /* symbol | length << 8; length 0: no code */
    if (assign_codes(len, code) < 0) return -1;
    memset(single, 0, sizeof(single));
    for (int s = 0; s < 256; s++)
        if (len[s])
            for (uint32_t j = code[s]; j < LUT_SIZE; j += 1u << len[s]) single[j] = (uint16_t)(s | len[s] << 8);
    for (uint32_t j = 0; j < LUT_SIZE; j++) {
        uint32_t e = single[j] & 0xFF, used = single[j] >> 8, n = 1;
        lut->len1[j] = (uint8_t)used;
        if (!used) {
            lut->e[j] = LUT_BAD_BIT | (1u << 25);
            continue;
        }
        for (; n < 3; n++) { /* codes of length <= 11 - used are decided by the bits left */
            uint32_t next = single[j >> used], l = next >> 8;
            if (!l || used + l > MAX_CODE_LEN) break;
            e |= (next & 0xFFu) << (8 * n);
            used += l;
        }
        lut->e[j] = e | (n << 25) | (used << 27);
    }
    return 0;
}

/* ---- bit streams ---- */

/* Encoder table over symbol pairs, indexed by the two bytes as they sit in memory
 * (a | b << 8): both codes joined, a's first, and their total length in bits 27-31. Only
 * pairs of used symbols are written; stale entries of an earlier block are never read
 * because only used symbols occur. Worth it while used^2 stores are few against the
 * lookups it saves (n / 2): exponent planes use 20-40 symbols, mantissa bytes all 256. */
static int build_pairs(const uint8_t *len, const uint16_t *code, size_t n, uint32_t *pairs) {
    uint8_t used[256];
    int k = 0;
    for (int s = 0; s < 256; s++)
        if (len[s]) used[k++] = (uint8_t)s;
    if ((size_t)k * (size_t)k > n / 8) return 0;
    for (int i = 0; i < k; i++)
        for (int m = 0; m < k; m++) {
            int a = used[i], b = used[m];
            pairs[a | b << 8] = (uint32_t)code[a] | (uint32_t)code[b] << len[a] | (uint32_t)(len[a] + len[b]) << 27;
        }
    return 1;
}

/* Appends one code to a bit buffer that flushes whole bytes. */
#define PUT_BITS(P, BUF, NBITS, CODE, LEN) \
    do {                                    \
        (BUF) |= (uint64_t)(CODE) << (NBITS); \
        (NBITS) += (LEN);                   \
        store64((P), (BUF));                \
        (P) += (NBITS) >> 3;                \
        (BUF) >>= (NBITS) & ~7u;            \
        (NBITS) &= 7;                       \
    } while (0)

/* Encodes count symbols LSB-first; needs 8 bytes of slack after the output. Four codes
 * (<= 44 bits, beside <= 7 pending) are joined among themselves first, through the pair
 * table when there is one, so the serial chain (position, pending bits) advances once per
 * four symbols. */
static size_t encode_stream(const uint8_t *s, size_t count, const uint32_t *pairs, const uint16_t *code,
                            const uint8_t *len, uint8_t *out) {
    uint8_t *p = out;
    uint64_t buf = 0;
    unsigned nbits = 0;
    size_t i = 0;
    if (pairs) {
        for (; i + 4 <= count; i += 4) {
            uint32_t s4 = load32(s + i);
            uint32_t e0 = pairs[s4 & 0xFFFF], e1 = pairs[s4 >> 16];
            unsigned l0 = e0 >> 27;
            PUT_BITS(p, buf, nbits, (e0 & 0x7FFFFFFu) | (uint64_t)(e1 & 0x7FFFFFFu) << l0, l0 + (e1 >> 27));
        }
    } else {
        for (; i + 4 <= count; i += 4) {
            uint32_t s4 = load32(s + i);
            unsigned a = s4 & 0xFF, b = (s4 >> 8) & 0xFF, c = (s4 >> 16) & 0xFF, d = s4 >> 24;
            unsigned la = len[a], lab = la + len[b], lc = len[c];
            uint64_t ab = (uint64_t)code[a] | ((uint64_t)code[b] << la);
            uint64_t cd = (uint64_t)code[c] | ((uint64_t)code[d] << lc);
            PUT_BITS(p, buf, nbits, ab | (cd << lab), lab + lc + len[d]);
        }
    }
    for (; i < count; i++) PUT_BITS(p, buf, nbits, code[s[i]], len[s[i]]);
    if (nbits) {
        store64(p, buf);
        p++;
    }
    return (size_t)(p - out);
}

/* A stream being decoded: its data, its declared length and the symbols it yields. */
typedef struct {
    const uint8_t *data;
    size_t nbytes;
    uint8_t *out;
    size_t count;
} stream_t;

/* Bounds-checked decoder: finishes a stream from bit `pos`, symbol `i`, one symbol per
 * lookup. Returns 0 if it ends exactly at its declared length with valid codes. */
static int decode_stream_tail(const stream_t *st, size_t pos, size_t i, const lut_t *lut,
                              const uint8_t *buf_end) {
    unsigned bad = 0;
    for (; i < st->count; i++) {
        const uint8_t *p = st->data + (pos >> 3);
        uint64_t v = (p + 8 <= buf_end) ? load64(p) : load64_tail(p, buf_end);
        uint32_t k = (v >> (pos & 7)) & (LUT_SIZE - 1);
        st->out[i] = (uint8_t)lut->e[k];
        bad |= !lut->len1[k];
        pos += lut->len1[k];
    }
    return (bad || (pos + 7) >> 3 != st->nbytes) ? -1 : 0;
}

/* One table lookup: stores four bytes (up to three symbols, the rest is overwritten
 * later), keeps what is real. The flag bits of all entries are OR-ed and checked once. */
#define DEC1(POS, V, OUT)                      \
    do {                                        \
        uint32_t e_ = lut[(V) & (LUT_SIZE - 1)]; \
        store32((OUT), e_);                      \
        (OUT) += LUT_NSYM(e_);                   \
        flags |= e_;                             \
        (V) >>= LUT_BITS(e_);                    \
        (POS) += LUT_BITS(e_);                   \
    } while (0)

/* Four lookups from one 64-bit load: at least 57 fresh bits, at most 4 x 11 used. */
#define DEC4(P, POS, OUT)                                         \
    do {                                                          \
        uint64_t v_ = load64((P) + ((POS) >> 3)) >> ((POS) & 7); \
        DEC1(POS, v_, OUT);                                       \
        DEC1(POS, v_, OUT);                                       \
        DEC1(POS, v_, OUT);                                       \
        DEC1(POS, v_, OUT);                                       \
    } while (0)

/* A DEC4 round yields at most 12 symbols per stream, and its last store reaches one byte
 * further: a stream no closer than DEC4_MARGIN to its end can take another round without
 * writing into the next stream's output. */
#define DEC4_MAX_SYMS 12
#define DEC4_MARGIN 13

/* Decodes four streams together: their dependency chains interleave, which is where
 * single-stream Huffman decoding loses most of its time. The caller guarantees that
 * reading count * MAX_CODE_LEN bits plus 8 bytes from each start stays in the buffer;
 * the outputs need 8 bytes of slack. */
#define DEC4_EACH()         \
    do {                     \
        DEC4(p0, q0, o0);    \
        DEC4(p1, q1, o1);    \
        DEC4(p2, q2, o2);    \
        DEC4(p3, q3, o3);    \
    } while (0)

static int decode_4streams(const stream_t *st, const lut_t *table, const uint8_t *buf_end) {
    const uint32_t *lut = table->e;
    const uint8_t *p0 = st[0].data, *p1 = st[1].data, *p2 = st[2].data, *p3 = st[3].data;
    uint8_t *o0 = st[0].out, *o1 = st[1].out, *o2 = st[2].out, *o3 = st[3].out;
    size_t q0 = 0, q1 = 0, q2 = 0, q3 = 0;
    uint32_t flags = 0;
    size_t count = st[0].count; /* all four are full streams */
    if (count > DEC4_MARGIN) {
        /* Rounds that are safe whatever the streams yield, counted up front: the loop then
         * carries no per-stream end checks, which would not fit in registers beside it. */
        for (size_t r = (count - DEC4_MARGIN) / DEC4_MAX_SYMS + 1; r; r--) DEC4_EACH();
        uint8_t *e0 = st[0].out + count - DEC4_MARGIN, *e1 = st[1].out + count - DEC4_MARGIN;
        uint8_t *e2 = st[2].out + count - DEC4_MARGIN, *e3 = st[3].out + count - DEC4_MARGIN;
        while (o0 <= e0 && o1 <= e1 && o2 <= e2 && o3 <= e3) DEC4_EACH();
    }
    if (flags & LUT_BAD_BIT) return -1;
    return decode_stream_tail(&st[0], q0, (size_t)(o0 - st[0].out), table, buf_end) |
           decode_stream_tail(&st[1], q1, (size_t)(o1 - st[1].out), table, buf_end) |
           decode_stream_tail(&st[2], q2, (size_t)(o2 - st[2].out), table, buf_end) |
           decode_stream_tail(&st[3], q3, (size_t)(o3 - st[3].out), table, buf_end);
}

/* ---- planes (docs/format.md, "Plane header") ---- */

/* How the encoder stores one plane: its mode and, for HUFF, the code. */
typedef struct {
    int mode;
    uint8_t value; /* CONST */
    int lo, hi;    /* HUFF: the symbols with a code lie in lo..hi */
    size_t k;      /* HUFF: sub-streams */
    uint8_t len[256];
    uint16_t code[256];
} plane_plan_t;

static size_t plan_header_nbytes(const plane_plan_t *pl) {
    if (pl->mode == PLANE_RAW) return 1;
    if (pl->mode == PLANE_CONST) return 2;
    return 3 + (size_t)(pl->hi - pl->lo + 2) / 2 + 2 * pl->k;
}

/* Chooses how to store a plane of n symbols. hist is its exact histogram, or NULL to store
 * it raw without looking. HUFF only when its header and data beat a RAW plane's; the data
 * size is estimated from the histogram, an upper bound (each sub-stream pads to a byte), so
 * the plane never turns out larger than planned and its ends fit in u16. */
static void plan_plane(size_t n, const uint32_t *hist, size_t substream, plane_plan_t *pl) {
    pl->mode = PLANE_RAW;
    if (n == 0 || hist == NULL) return;
    int used = 0, lo = 255, hi = 0;
    for (int s = 0; s < 256; s++)
        if (hist[s]) {
            used++;
            if (s < lo) lo = s;
            hi = s;
        }
    if (used == 1) {
        pl->mode = PLANE_CONST;
        pl->value = (uint8_t)lo;
        return;
    }
    build_lengths(hist, pl->len);
    uint64_t bits = 0;
    for (int s = lo; s <= hi; s++) bits += (uint64_t)hist[s] * pl->len[s];
    pl->lo = lo;
    pl->hi = hi;
    pl->k = (n + substream - 1) / substream;
    size_t est = bits / 8 + pl->k;
    if (3 + (size_t)(hi - lo + 2) / 2 + 2 * pl->k + est >= 1 + n || est > 0xFFFF) return;
    assign_codes(pl->len, pl->code);
    pl->mode = PLANE_HUFF;
}

/* Writes a plane's header at hdr; returns where a HUFF plane's ends go (else NULL). */
static uint8_t *write_plane_header(const plane_plan_t *pl, uint8_t *hdr) {
    hdr[0] = (uint8_t)pl->mode;
    if (pl->mode == PLANE_CONST) hdr[1] = pl->value;
    if (pl->mode != PLANE_HUFF) return NULL;
    hdr[1] = (uint8_t)pl->lo;
    hdr[2] = (uint8_t)(pl->hi - pl->lo);
    uint8_t *q = hdr + 3;
    for (int s = pl->lo; s <= pl->hi; s += 2)
        *q++ = (uint8_t)(pl->len[s] | ((s + 1 <= pl->hi ? pl->len[s + 1] : 0) << 4));
    return q;
}

/* Writes a plane's data (RAW: the symbols; HUFF: its sub-streams, filling in ends) and
 * returns its size. HUFF output needs 8 bytes of slack after it. */
static size_t write_plane_data(const plane_plan_t *pl, const uint8_t *syms, size_t n, size_t substream,
                               uint32_t *pairs, uint8_t *ends, uint8_t *data) {
    if (pl->mode == PLANE_RAW) {
        memcpy(data, syms, n);
        return n;
    }
    if (pl->mode == PLANE_CONST) return 0;
    if (!build_pairs(pl->len, pl->code, n, pairs)) pairs = NULL;
    uint8_t *p = data;
    for (size_t j = 0; j < pl->k; j++) {
        size_t c = (j + 1 < pl->k) ? substream : n - j * substream;
        p += encode_stream(syms + j * substream, c, pairs, pl->code, pl->len, p);
        store16(ends + 2 * j, (uint16_t)(p - data));
    }
    return (size_t)(p - data);
}

/* Lays out a DENSE or SPARSE payload (docs/format.md, "Block payload") behind the `prefix`
 * bytes already at out (mode, and m for SPARSE): the plane headers, then each plane's data
 * at the next multiple of 16, zero padding between and up to a multiple of 16. Returns the
 * payload's size. */
static size_t assemble(uint8_t *out, size_t prefix, int np, const plane_plan_t *plans, uint8_t *const *syms,
                       size_t count0, size_t count, size_t substream, uint32_t *pairs) {
    uint8_t *ends[MAX_PLANES + 1];
    size_t off = prefix;
    for (int j = 0; j < np; j++) {
        ends[j] = write_plane_header(&plans[j], out + off);
        off += plan_header_nbytes(&plans[j]);
    }
    for (int j = 0; j < np; j++) {
        if (plans[j].mode == PLANE_CONST) continue;
        size_t at = align16(off);
        memset(out + off, 0, at - off);
        off = at + write_plane_data(&plans[j], syms[j], j ? count : count0, substream, pairs, ends[j], out + at);
    }
    size_t end = align16(off);
    memset(out + off, 0, end - off);
    return end;
}

/* A plane header as read by the decoder, checked against the payload. */
typedef struct {
    int mode;
    uint8_t value;
    size_t count, k;
    const uint8_t *ends;
    uint8_t len[256];
} plane_desc_t;

/* Parses the header at *pp of a plane of `count` symbols; headers end before `end`. */
static const char *parse_plane_header(const uint8_t **pp, const uint8_t *end, size_t count, size_t substream,
                                      plane_desc_t *d) {
    const uint8_t *p = *pp;
    if (p >= end) return "plane header runs past the block";
    d->mode = *p++;
    d->count = count;
    if (d->mode == PLANE_CONST) {
        if (p >= end) return "constant plane runs past the block";
        d->value = *p++;
    } else if (d->mode == PLANE_HUFF) {
        if (count == 0) return "entropy-coded plane with no symbols";
        if (end - p < 2) return "Huffman table runs past the block";
        int lo = p[0], hi = lo + p[1];
        p += 2;
        if (hi > 255) return "Huffman symbol range exceeds a byte";
        size_t nib = (size_t)(hi - lo + 2) / 2;
        if ((size_t)(end - p) < nib) return "Huffman table runs past the block";
        memset(d->len, 0, sizeof(d->len));
        for (int s = lo; s <= hi; s++) {
            int l = (p[(s - lo) / 2] >> (((s - lo) & 1) * 4)) & 0xF;
            if (l > MAX_CODE_LEN) return "Huffman code length over the limit";
            d->len[s] = (uint8_t)l;
        }
        if (((hi - lo) & 1) == 0 && (p[nib - 1] >> 4)) return "Huffman table padding is not zero";
        p += nib;
        d->k = (count + substream - 1) / substream;
        if ((size_t)(end - p) < 2 * d->k) return "sub-stream offsets run past the block";
        d->ends = p;
        p += 2 * d->k;
    } else if (d->mode != PLANE_RAW) {
        return "unknown plane mode";
    }
    *pp = p;
    return NULL;
}

/* Decodes a plane's data, which starts at the first multiple of 16 at or after *off in the
 * payload blk. On success *off moves past the data and *syms points at the symbols: into
 * the frame for a RAW plane, else into scratch (count + 8 bytes). */
static const char *decode_plane_data(const plane_desc_t *d, const uint8_t *blk, size_t blk_len, size_t *off,
                                     const uint8_t *buf_end, size_t substream, uint8_t *scratch, lut_t *lut,
                                     const uint8_t **syms) {
    size_t n = d->count;
    if (d->mode == PLANE_CONST) {
        memset(scratch, d->value, n);
        *syms = scratch;
        return NULL;
    }
    size_t at = align16(*off);
    if (at > blk_len) return "plane data runs past the block";
    if (d->mode == PLANE_RAW) {
        if (blk_len - at < n) return "raw plane runs past the block";
        *syms = blk + at;
        *off = at + n;
        return NULL;
    }
    if (build_lut(d->len, lut) < 0) return "Huffman code lengths over-subscribe the code space";
    size_t k = d->k;
    const uint8_t *ends = d->ends, *data = blk + at;
    size_t total = load16(ends + 2 * (k - 1));
    if (blk_len - at < total) return "sub-streams run past the block";

    stream_t st[4];
    size_t j = 0, start = 0;
    while (j < k) {
        int group = 0;
        /* Gather up to four full-length streams for the interleaved decoder. */
        while (group < 4 && j < k) {
            size_t stop = load16(ends + 2 * j);
            if (stop < start) return "sub-stream offsets go backwards";
            size_t c = (j + 1 < k) ? substream : n - j * substream;
            st[group].data = data + start;
            st[group].nbytes = stop - start;
            st[group].out = scratch + j * substream;
            st[group].count = c;
            group++;
            j++;
            start = stop;
            if (c != substream) break;
        }
        /* Worst case a corrupt stream reads count * MAX_CODE_LEN bits past its start. */
        int fast = group == 4 && st[3].count == substream;
        for (int g = 0; fast && g < 4; g++)
            fast = st[g].data + (st[g].count * MAX_CODE_LEN + 7) / 8 + 16 <= buf_end;
        if (fast) {
            if (decode_4streams(st, lut, buf_end)) return "corrupt Huffman sub-stream";
        } else {
            for (int g = 0; g < group; g++)
                if (decode_stream_tail(&st[g], 0, 0, lut, buf_end)) return "corrupt Huffman sub-stream";
        }
    }
    if (start != total) return "sub-stream offsets disagree with their total";
    *syms = scratch;
    *off = at + total;
    return NULL;
}

/* ---- blocks ---- */

typedef struct {
    int layout, itemsize, nplanes;
    size_t block_elems, substream;
} params_t;

/* Per-thread scratch, sized for one block. */
typedef struct {
    uint8_t *planes[MAX_PLANES]; /* split planes, block_elems (+8) each */
    uint8_t *sparse[MAX_PLANES]; /* nonzero elements only */
    uint8_t *mask;               /* block_elems / 8 */
    uint8_t *enc[2];             /* two candidate encodings of a block */
    uint8_t *compact;            /* decoder: merged nonzero elements */
    lut_t lut;                   /* decoder table */
    uint32_t *pairs;             /* encoder pair table, PAIR_ENTRIES */
    uint16_t *pair_counts;       /* hist_narrow's two tables, 2 x PAIR_ENTRIES, kept zero */
    size_t enc_cap;
    void *mem;
} scratch_t;

static int scratch_alloc(scratch_t *s, const params_t *pr) {
    size_t be = pr->block_elems, P = (size_t)pr->nplanes;
    size_t plane = be + 64;
    s->enc_cap = 2 * be * (size_t)pr->itemsize + 4096 + P * 1024;
    size_t total = PAIR_ENTRIES * (sizeof(uint32_t) + 2 * sizeof(uint16_t)) + 2 * P * plane + (be / 8 + 64) + 2 * s->enc_cap +
                   be * (size_t)pr->itemsize + 64;
    uint8_t *m = calloc(1, total); /* fresh zero pages: pair_counts must start at zero */
    if (!m) return -1;
    s->mem = m;
    s->pairs = (uint32_t *)m; /* calloc's alignment; decoders never touch these pages */
    m += PAIR_ENTRIES * sizeof(uint32_t);
    s->pair_counts = (uint16_t *)m;
    m += 2 * PAIR_ENTRIES * sizeof(uint16_t);
    for (size_t i = 0; i < P; i++, m += plane) s->planes[i] = m;
    for (size_t i = 0; i < P; i++, m += plane) s->sparse[i] = m;
    s->mask = m;
    m += be / 8 + 64;
    s->enc[0] = m;
    m += s->enc_cap;
    s->enc[1] = m;
    m += s->enc_cap;
    s->compact = m;
    return 0;
}

/* Scratch is kept per thread between calls: a fresh one cost page faults on a MiB or more
 * per call (5% of an 8 MiB compress), and the P2P pipeline's codec threads call once per
 * chunk. A few layouts are kept (weights mix bf16 and fp32 tensors); a thread's scratch is
 * freed when it exits (the workers of a multi-threaded call exit at its end). */
#define SCRATCH_SLOTS 4

typedef struct {
    scratch_t s[SCRATCH_SLOTS];
    params_t pr[SCRATCH_SLOTS];
    int used, next;
} scratch_cache_t;

static pthread_key_t scratch_key;

static void scratch_cache_free(void *p) {
    scratch_cache_t *c = p;
    for (int i = 0; i < c->used; i++) free(c->s[i].mem);
    free(c);
}

static scratch_t *scratch_get(const params_t *pr) {
    scratch_cache_t *c = pthread_getspecific(scratch_key);
    if (!c) {
        if (!(c = calloc(1, sizeof(*c)))) return NULL;
        if (pthread_setspecific(scratch_key, c)) {
            free(c);
            return NULL;
        }
    }
    for (int i = 0; i < c->used; i++)
        if (c->pr[i].layout == pr->layout && c->pr[i].itemsize == pr->itemsize &&
            c->pr[i].block_elems == pr->block_elems)
            return &c->s[i];
    scratch_t fresh;
    if (scratch_alloc(&fresh, pr)) return NULL;
    int i;
    if (c->used < SCRATCH_SLOTS) {
        i = c->used++;
    } else { /* all taken: replace them round-robin */
        i = c->next;
        c->next = (i + 1) % SCRATCH_SLOTS;
        free(c->s[i].mem);
    }
    c->s[i] = fresh;
    c->pr[i] = *pr;
    return &c->s[i];
}

/* log2 of 0..4096, for entropy estimates on samples. */
static float log2_table[4097];

/* Whether a plane looks worth a full histogram: the order-0 entropy of a 1-in-16
 * sample must promise more than 5% savings. Deterministic, so frames are reproducible. */
static int plane_worth_coding(const uint8_t *s, size_t n) {
    if (n < 1024) return 1;
    uint32_t h[256] = {0};
    size_t m = 0;
    for (size_t i = 0; i < n && m < 4096; i += 16, m++) h[s[i]]++;
    double bits = 0; /* sum over symbols of f * log2(m / f) */
    for (int j = 0; j < 256; j++)
        if (h[j]) bits += h[j] * (double)(log2_table[m] - log2_table[h[j]]);
    return bits < 0.95 * 8.0 * (double)m;
}

/* Plans the planes of n elements (already split into planes[]); hist0 is plane 0's full
 * histogram. Returns how many of them are HUFF. */
static int plan_planes(const params_t *pr, uint8_t *const *planes, size_t n, const uint32_t *hist0,
                       plane_plan_t *plans) {
    int huff = 0;
    for (int j = 0; j < pr->nplanes; j++) {
        uint32_t h[256];
        const uint32_t *hp = NULL;
        /* Plane 0 of the float layouts is the exponent: always worth coding. A byte
         * plane of a wider element (fp16's low byte) often is not: sample first. */
        int split_exponent = pr->layout != LAYOUT_BYTES || pr->itemsize == 1;
        if (j == 0 && (split_exponent || plane_worth_coding(planes[0], n))) {
            hp = hist0;
        } else if (j > 0 && plane_worth_coding(planes[j], n)) {
            hist_of(planes[j], n, h);
            hp = h;
        }
        plan_plane(n, hp, pr->substream, &plans[j]);
        huff += plans[j].mode == PLANE_HUFF;
    }
    return huff;
}

/* Encodes one block into s->enc[...] and returns a pointer to the chosen encoding; *general
 * says whether it needs a decoder's general path (SPARSE, or more than one HUFF plane). */
HOT_PATH static const uint8_t *encode_block(const params_t *pr, scratch_t *s, const uint8_t *src, size_t n,
                                            size_t *size, int *general) {
    size_t raw_size = ALIGN + align16(n * (size_t)pr->itemsize);
    uint32_t hist0[256];
    uint8_t *planes[MAX_PLANES];
    plane_plan_t plans[MAX_PLANES + 1];
    memcpy(planes, s->planes, sizeof(planes));
    split_planes(pr->layout, pr->itemsize, src, n, planes, hist0, s->pair_counts);

    uint8_t *dense = s->enc[0];
    dense[0] = BLOCK_DENSE;
    *general = plan_planes(pr, planes, n, hist0, plans) > 1;
    size_t best_size = assemble(dense, 1, pr->nplanes, plans, planes, n, n, pr->substream, s->pairs);
    const uint8_t *best = dense;

    /* Zero elements map to zero in every plane, so plane 0's zero count bounds them. */
    if (hist0[0] >= n / 8 && n >= 64) {
        size_t nmask = (n + 7) / 8, m = 0;
        memset(s->mask, 0, nmask);
        for (size_t i = 0; i < n; i++) {
            int nz = 0;
            for (int j = 0; j < pr->nplanes; j++) nz |= planes[j][i];
            if (nz) {
                s->mask[i >> 3] |= (uint8_t)(1u << (i & 7));
                for (int j = 0; j < pr->nplanes; j++) s->sparse[j][m] = planes[j][i];
                m++;
            }
        }
        uint8_t *sp = s->enc[1];
        sp[0] = BLOCK_SPARSE;
        store32(sp + 1, (uint32_t)m);
        uint32_t hm[256], hs0[256];
        hist_of(s->mask, nmask, hm);
        plan_plane(nmask, hm, pr->substream, &plans[0]);
        hist_of(s->sparse[0], m, hs0);
        plan_planes(pr, s->sparse, m, hs0, plans + 1);
        uint8_t *syms[MAX_PLANES + 1];
        syms[0] = s->mask;
        memcpy(syms + 1, s->sparse, sizeof(s->sparse));
        size_t off = assemble(sp, 5, 1 + pr->nplanes, plans, syms, nmask, m, pr->substream, s->pairs);
        if (off < best_size) {
            best = sp;
            best_size = off;
            *general = 1;
        }
    }
    if (best_size >= raw_size) {
        uint8_t *r = s->enc[1];
        memset(r, 0, ALIGN);
        r[0] = BLOCK_RAW;
        memcpy(r + ALIGN, src, n * (size_t)pr->itemsize);
        memset(r + ALIGN + n * (size_t)pr->itemsize, 0, raw_size - ALIGN - n * (size_t)pr->itemsize);
        best = r;
        best_size = raw_size;
        *general = 0;
    }
    *size = best_size;
    return best;
}

/* Decodes the data of `np` planes whose headers were parsed into d[], from payload offset
 * *off on; syms[j] gets plane j's symbols (scratch[j] unless RAW). */
static const char *decode_planes(const plane_desc_t *d, int np, const uint8_t *blk, size_t blk_len, size_t *off,
                                 const uint8_t *buf_end, size_t substream, uint8_t *const *scratch, lut_t *lut,
                                 const uint8_t **syms) {
    const char *err;
    for (int j = 0; j < np; j++)
        if ((err = decode_plane_data(&d[j], blk, blk_len, off, buf_end, substream, scratch[j], lut, &syms[j])))
            return err;
    if (align16(*off) != blk_len) return "block payload size disagrees with its plane headers";
    return NULL;
}

/* Decodes one block's payload into dst (n elements). Returns NULL or an error text; *general
 * says whether the block needed a decoder's general path. */
HOT_PATH static const char *decode_block(const params_t *pr, scratch_t *s, const uint8_t *blk, size_t blk_len, size_t n,
                                         uint8_t *dst, const uint8_t *buf_end, int *general) {
    const uint8_t *p = blk, *end = blk + blk_len;
    size_t nbytes = n * (size_t)pr->itemsize;
    plane_desc_t d[MAX_PLANES + 1];
    const uint8_t *syms[MAX_PLANES + 1];
    const char *err;
    *general = 0;
    if (blk_len < 1) return "empty block payload";
    int mode = *p++;
    if (mode == BLOCK_RAW) {
        if (blk_len != ALIGN + align16(nbytes)) return "raw block has the wrong size";
        memcpy(dst, blk + ALIGN, nbytes);
        return NULL;
    }
    if (mode == BLOCK_DENSE) {
        int huff = 0;
        for (int j = 0; j < pr->nplanes; j++) {
            if ((err = parse_plane_header(&p, end, n, pr->substream, &d[j]))) return err;
            huff += d[j].mode == PLANE_HUFF;
        }
        *general = huff > 1;
        size_t off = (size_t)(p - blk);
        if ((err = decode_planes(d, pr->nplanes, blk, blk_len, &off, buf_end, pr->substream, s->planes, &s->lut, syms)))
            return err;
        merge_planes(pr->layout, pr->itemsize, syms, n, dst);
        return NULL;
    }
    if (mode != BLOCK_SPARSE) return "unknown block mode";
    *general = 1;
    if (end - p < 4) return "sparse block header runs past the block";
    size_t m = load32(p), nmask = (n + 7) / 8;
    p += 4;
    if (m > n) return "sparse block claims more nonzeros than elements";
    if ((err = parse_plane_header(&p, end, nmask, pr->substream, &d[0]))) return err;
    for (int j = 0; j < pr->nplanes; j++)
        if ((err = parse_plane_header(&p, end, m, pr->substream, &d[1 + j]))) return err;
    uint8_t *scratch[MAX_PLANES + 1];
    scratch[0] = s->mask;
    memcpy(scratch + 1, s->sparse, sizeof(s->sparse));
    size_t off = (size_t)(p - blk);
    if ((err = decode_planes(d, 1 + pr->nplanes, blk, blk_len, &off, buf_end, pr->substream, scratch, &s->lut, syms)))
        return err;
    const uint8_t *mask = syms[0];
    size_t pop = 0;
    for (size_t i = 0; i < nmask; i++) pop += (size_t)__builtin_popcount(mask[i]);
    if (n & 7 && (mask[nmask - 1] >> (n & 7))) return "sparse mask padding is not zero";
    if (pop != m) return "sparse mask disagrees with the nonzero count";
    merge_planes(pr->layout, pr->itemsize, syms + 1, m, s->compact);
    size_t isz = (size_t)pr->itemsize, c = 0;
    for (size_t i = 0; i < n; i++) {
        if (mask[i >> 3] >> (i & 7) & 1) {
            memcpy(dst + i * isz, s->compact + c * isz, isz);
            c++;
        } else {
            memset(dst + i * isz, 0, isz);
        }
    }
    return NULL;
}

/* ---- the thread fan-out ---- */

typedef struct {
    params_t pr;
    size_t numel, nblocks;
    /* compress */
    const uint8_t *src;
    uint8_t *table, *payload;
    size_t payload_cap, written;
    /* decompress */
    const uint8_t *frame_payload, *buf_end;
    const size_t *offsets;
    uint8_t *dst;
    /* shared */
    size_t next_block;     /* atomically claimed work */
    size_t next_to_write;  /* compress: blocks are appended in order */
    int general;           /* compress: some block needs the general path; decompress: the header flag */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    const char *err;
    size_t err_block;
} job_t;

static void job_fail(job_t *j, size_t b, const char *msg) {
    pthread_mutex_lock(&j->mu);
    if (!j->err || b < j->err_block) {
        j->err = msg;
        j->err_block = b;
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

static void *compress_worker(void *arg) {
    job_t *j = arg;
    scratch_t *s = scratch_get(&j->pr);
    if (!s) {
        job_fail(j, 0, "out of memory for codec scratch");
        return NULL;
    }
    for (;;) {
        size_t b = __atomic_fetch_add(&j->next_block, 1, __ATOMIC_RELAXED);
        if (b >= j->nblocks) break;
        size_t first = b * j->pr.block_elems;
        size_t n = j->numel - first < j->pr.block_elems ? j->numel - first : j->pr.block_elems;
        const uint8_t *src = j->src + first * (size_t)j->pr.itemsize;
        size_t size;
        int general;
        const uint8_t *enc = encode_block(&j->pr, s, src, n, &size, &general);
        uint64_t hash_orig = uzh64(src, n * (size_t)j->pr.itemsize);
        uint64_t hash_enc = uzh64(enc, size);
        /* Blocks are claimed in order, so waiting for our turn is short. */
        pthread_mutex_lock(&j->mu);
        while (j->next_to_write != b && !j->err) pthread_cond_wait(&j->cv, &j->mu);
        if (j->err) {
            pthread_mutex_unlock(&j->mu);
            break;
        }
        size_t at = j->written;
        pthread_mutex_unlock(&j->mu);
        if (size > j->payload_cap - at) {
            job_fail(j, b, "output buffer too small (size it with max_compressed_size)");
            break;
        }
        memcpy(j->payload + at, enc, size);
        store64(j->table + TABLE_ENTRY_BYTES * b, (uint64_t)(at + size));
        store64(j->table + TABLE_ENTRY_BYTES * b + 8, hash_orig);
        store64(j->table + TABLE_ENTRY_BYTES * b + 16, hash_enc);
        pthread_mutex_lock(&j->mu);
        j->written = at + size;
        j->general |= general;
        j->next_to_write = b + 1;
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
    }
    return NULL;
}

static void *decompress_worker(void *arg) {
    job_t *j = arg;
    scratch_t *s = scratch_get(&j->pr);
    if (!s) {
        job_fail(j, 0, "out of memory for codec scratch");
        return NULL;
    }
    for (;;) {
        size_t b = __atomic_fetch_add(&j->next_block, 1, __ATOMIC_RELAXED);
        if (b >= j->nblocks || __atomic_load_n(&j->err, __ATOMIC_RELAXED)) break;
        size_t first = b * j->pr.block_elems;
        size_t n = j->numel - first < j->pr.block_elems ? j->numel - first : j->pr.block_elems;
        const uint8_t *entry = j->table + TABLE_ENTRY_BYTES * b;
        const uint8_t *blk = j->frame_payload + j->offsets[b];
        size_t blk_len = j->offsets[b + 1] - j->offsets[b];
        if (uzh64(blk, blk_len) != load64(entry + 16)) {
            job_fail(j, b, "block checksum mismatch (payload corrupted)");
            break;
        }
        uint8_t *dst = j->dst + first * (size_t)j->pr.itemsize;
        int general;
        const char *err = decode_block(&j->pr, s, blk, blk_len, n, dst, j->buf_end, &general);
        if (!err && general && !j->general) err = "block needs the general decoder but the header's GENERAL flag is clear";
        if (!err && uzh64(dst, n * (size_t)j->pr.itemsize) != load64(entry + 8)) err = "decoded block checksum mismatch";
        if (err) {
            job_fail(j, b, err);
            break;
        }
    }
    return NULL;
}

/* Runs fn on min(nthreads, nblocks) threads, the calling one included. */
static void run_job(job_t *j, void *(*fn)(void *), int nthreads) {
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    size_t nt = nthreads < 1 ? 1 : (size_t)nthreads;
    if (nt > j->nblocks) nt = j->nblocks ? j->nblocks : 1;
    if (nt > 256) nt = 256;
    pthread_t tids[256];
    size_t started = 0;
    for (size_t i = 1; i < nt; i++, started++)
        if (pthread_create(&tids[started], NULL, fn, j)) break;
    fn(j);
    for (size_t i = 0; i < started; i++) pthread_join(tids[i], NULL);
    pthread_cond_destroy(&j->cv);
    pthread_mutex_destroy(&j->mu);
}

/* ---- Python bindings: thin, the Python layer validates arguments ---- */

static int parse_params(params_t *pr, int layout, int itemsize, Py_ssize_t block_elems, Py_ssize_t substream) {
    if (layout < LAYOUT_BYTES || layout > LAYOUT_FP32 || itemsize < 1 || itemsize > MAX_PLANES ||
        (layout == LAYOUT_BF16 && itemsize != 2) || (layout == LAYOUT_FP32 && itemsize != 4) || block_elems < 64 ||
        (size_t)block_elems > MAX_BLOCK_ELEMS || substream < 64 || substream > block_elems) {
        PyErr_SetString(PyExc_ValueError, "invalid codec parameters");
        return -1;
    }
    pr->layout = layout;
    pr->itemsize = itemsize;
    pr->nplanes = num_planes(layout, itemsize);
    pr->block_elems = (size_t)block_elems;
    pr->substream = (size_t)substream;
    return 0;
}

PyDoc_STRVAR(compress_blocks_doc,
             "compress_blocks(src, layout, itemsize, numel, block_elems, substream_elems, dst, table_offset,\n"
             "                payload_offset, nthreads) -> int\n\n"
             "Encodes every block of src into dst: table entries at table_offset, payloads back to back\n"
             "from payload_offset. Returns (end offset of the last payload, header flags).");

static PyObject *py_compress_blocks(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int layout, itemsize, nthreads;
    Py_ssize_t numel, block_elems, substream, table_off, payload_off;
    if (!PyArg_ParseTuple(args, "y*iinnnw*nni", &src, &layout, &itemsize, &numel, &block_elems, &substream, &dst,
                          &table_off, &payload_off, &nthreads))
        return NULL;
    PyObject *result = NULL;
    job_t j;
    memset(&j, 0, sizeof(j));
    if (parse_params(&j.pr, layout, itemsize, block_elems, substream)) goto done;
    j.numel = (size_t)numel;
    j.nblocks = (j.numel + j.pr.block_elems - 1) / j.pr.block_elems;
    if (numel < 0 || (size_t)src.len != j.numel * (size_t)itemsize || table_off < 0 || payload_off < 0 ||
        (size_t)table_off + TABLE_ENTRY_BYTES * j.nblocks > (size_t)dst.len || payload_off > dst.len) {
        PyErr_SetString(PyExc_ValueError, "source or destination buffer has the wrong size");
        goto done;
    }
    j.src = src.buf;
    j.table = (uint8_t *)dst.buf + table_off;
    j.payload = (uint8_t *)dst.buf + payload_off;
    j.payload_cap = (size_t)(dst.len - payload_off);
    Py_BEGIN_ALLOW_THREADS
    run_job(&j, compress_worker, nthreads);
    Py_END_ALLOW_THREADS
    if (j.err) {
        PyErr_Format(PyExc_ValueError, "block %zu: %s", j.err_block, j.err);
        goto done;
    }
    result = Py_BuildValue("nI", payload_off + (Py_ssize_t)j.written, j.general ? FLAG_GENERAL : 0u);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

PyDoc_STRVAR(decompress_blocks_doc,
             "decompress_blocks(frame, layout, itemsize, numel, block_elems, substream_elems, table_offset,\n"
             "                  payload_offset, flags, dst, nthreads) -> str | None\n\n"
             "Validates the block table against the frame, then decodes every block into dst.\n"
             "Returns None on success, or a message describing the first corrupt block.");

static PyObject *py_decompress_blocks(PyObject *self, PyObject *args) {
    Py_buffer frame, dst;
    int layout, itemsize, nthreads;
    unsigned int flags;
    Py_ssize_t numel, block_elems, substream, table_off, payload_off;
    if (!PyArg_ParseTuple(args, "y*iinnnnnIw*i", &frame, &layout, &itemsize, &numel, &block_elems, &substream,
                          &table_off, &payload_off, &flags, &dst, &nthreads))
        return NULL;
    PyObject *result = NULL;
    size_t *offsets = NULL;
    char msg[160];
    job_t j;
    memset(&j, 0, sizeof(j));
    if (parse_params(&j.pr, layout, itemsize, block_elems, substream)) goto done;
    j.numel = (size_t)numel;
    j.nblocks = (j.numel + j.pr.block_elems - 1) / j.pr.block_elems;
    if (numel < 0 || (size_t)dst.len != j.numel * (size_t)itemsize || table_off < 0 || payload_off < table_off ||
        (size_t)table_off + TABLE_ENTRY_BYTES * j.nblocks > (size_t)payload_off || payload_off > frame.len) {
        PyErr_SetString(PyExc_ValueError, "frame or destination buffer has the wrong size");
        goto done;
    }
    const uint8_t *base = frame.buf;
    j.table = (uint8_t *)base + table_off;
    j.frame_payload = base + payload_off;
    j.buf_end = base + frame.len;
    j.dst = dst.buf;
    offsets = malloc((j.nblocks + 1) * sizeof(size_t));
    if (!offsets) {
        PyErr_NoMemory();
        goto done;
    }
    /* offsets[b] .. offsets[b + 1]: block b's payload; each end is checked against the one
     * before it, so no payload can overlap another or leave the frame. */
    size_t avail = (size_t)(frame.len - payload_off);
    offsets[0] = 0;
    for (size_t b = 0; b < j.nblocks; b++) {
        uint64_t end = load64(j.table + TABLE_ENTRY_BYTES * b);
        if (end < offsets[b] || end > avail || end % ALIGN) {
            snprintf(msg, sizeof msg, "block %zu: payload end %llu is out of order, unaligned or past the frame", b,
                     (unsigned long long)end);
            result = PyUnicode_FromString(msg);
            goto done;
        }
        offsets[b + 1] = (size_t)end;
    }
    if (offsets[j.nblocks] != avail) {
        snprintf(msg, sizeof msg, "block payloads cover %zu bytes but the frame holds %zu", offsets[j.nblocks], avail);
        result = PyUnicode_FromString(msg);
        goto done;
    }
    j.general = (flags & FLAG_GENERAL) != 0;
    j.offsets = offsets;
    Py_BEGIN_ALLOW_THREADS
    run_job(&j, decompress_worker, nthreads);
    Py_END_ALLOW_THREADS
    if (j.err) {
        snprintf(msg, sizeof msg, "block %zu: %s", j.err_block, j.err);
        result = PyUnicode_FromString(msg);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    free(offsets);
    PyBuffer_Release(&frame);
    PyBuffer_Release(&dst);
    return result;
}

static PyObject *py_uzh64(PyObject *self, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b)) return NULL;
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = uzh64(b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    Py_buffer b;
    unsigned int init = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &b, &init)) return NULL;
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = crc32c(init, b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

static PyMethodDef methods[] = {
    {"compress_blocks", py_compress_blocks, METH_VARARGS, compress_blocks_doc},
    {"decompress_blocks", py_decompress_blocks, METH_VARARGS, decompress_blocks_doc},
    {"uzh64", py_uzh64, METH_VARARGS, "uzh64(data) -> int: UZH64, the frame checksum (docs/format.md), of a buffer."},
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(data, init=0) -> int: CRC32C (Castagnoli) of a buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_codec",
                                    "C implementation of the uzip block codec (see docs/format.md).", -1, methods};

PyMODINIT_FUNC PyInit__cpu_codec(void) {
    crc_init_tables();
    crc_init_combine();
    if (pthread_key_create(&scratch_key, scratch_cache_free)) return PyErr_NoMemory();
    for (int i = 1; i <= 4096; i++) log2_table[i] = (float)log2((double)i);
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2");
    have_avx2 = __builtin_cpu_supports("avx2") && !getenv("UZIP_NO_AVX2");
#endif
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyModule_AddIntConstant(m, "MAX_CODE_LEN", MAX_CODE_LEN);
    PyModule_AddIntConstant(m, "TABLE_ENTRY_BYTES", TABLE_ENTRY_BYTES);
    PyModule_AddIntConstant(m, "MAX_BLOCK_ELEMS", MAX_BLOCK_ELEMS);
    return m;
}
