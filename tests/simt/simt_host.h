/*
 * SIMT emulator: CUDA kernel source compiled as plain C++ runs on the CPU with CUDA's block and
 * warp semantics, for functional tests without a GPU:
 *
 *   g++ -std=c++17 -DUZ_SIMT -include tests/simt/simt_host.h -x c++ kernels.cu
 *
 * From C++: uzsim::launch(kernel, grid, block, smem_bytes, args...). From Python: the .cu ends
 * with UZSIM_EXPORT(kernel); lines and tests/simt/build.py turns it into an extension module.
 * Dynamic shared memory is uzsim::dynamic_smem(); there is no __shared__ (nor asm).
 *
 * Model. Every CUDA thread is a fiber (ucontext) on the one OS thread that called
 * uzsim::launch. A fiber runs until it has to wait (at a barrier or warp collective that other
 * threads have yet to reach; the last one to arrive goes straight on), calls __nanosleep /
 * uzsim_yield, or returns; the scheduler then resumes the next runnable fiber, round robin over
 * the threads of up to config().concurrent_blocks resident blocks (started in ascending linear
 * blockIdx order, or descending with config().reverse_blocks, the next one as soon as one
 * finishes). Nothing runs in between, so a plain
 * read-modify-write is atomic and no locks are needed. A spin-wait loop must call __nanosleep
 * (or uzsim_yield): nothing preempts a fiber.
 *
 * Semantics where CUDA leaves room (tests/test_simt.py pins each one):
 *  - Exited threads are excused. A __syncthreads* is released once every thread of the block
 *    that has not exited waits at one; a warp collective once every non-exited lane of its mask
 *    waits at it. Lanes past the end of a partial last warp count as exited. __activemask()
 *    is the warp's non-exited lanes, read once the other lanes have run up to their next wait.
 *  - A lane must be in the mask it passes; lanes passing the same mask must call the same
 *    collective with the same operand size; one barrier may not mix __syncthreads kinds.
 *  - Shuffles follow PTX shfl.sync: the source lane comes from the low 5 bits of
 *    srcLane / delta / laneMask and from width (a power of 2 up to 32). A source out of range
 *    (shfl_up/down past the segment, shfl_xor into a later segment) gives the caller's own
 *    value, and so does a source lane of the mask that has exited; a source lane outside the
 *    mask is an error.
 *  - A resident block with no runnable thread is deadlocked; config().spin_rounds scheduler
 *    rounds in which no thread did anything but spin (__nanosleep) are a livelock.
 * Misuse, deadlock and livelock end the launch with a uzsim::Error naming the threads and where
 * each waits; the emulator is then reset and ready for the next launch.
 */
#pragma once

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>  // before the __noinline__ macro: libstdc++ spells __attribute__((__noinline__))
#include <new>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
// ASan must be told about every stack switch, or it reports false stack overflows.
#define UZSIM_FIBER_START(save, bottom, size) __sanitizer_start_switch_fiber(save, bottom, size)
#define UZSIM_FIBER_FINISH(save, bottom, size) __sanitizer_finish_switch_fiber(save, bottom, size)
#else
#define UZSIM_FIBER_START(save, bottom, size) ((void)0)
#define UZSIM_FIBER_FINISH(save, bottom, size) ((void)0)
#endif

/* ---------------------------------------------------------------- qualifiers and vector types */

#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};
inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return uint3{x, y, z}; }

#define UZSIM_VEC2(name, T, align) \
    struct alignas(align) name { T x, y; }; \
    inline name make_##name(T x, T y) { return name{x, y}; }
#define UZSIM_VEC4(name, T, align) \
    struct alignas(align) name { T x, y, z, w; }; \
    inline name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }
UZSIM_VEC2(int2, int, 8)
UZSIM_VEC2(uint2, unsigned int, 8)
UZSIM_VEC2(ushort2, unsigned short, 4)
UZSIM_VEC2(float2, float, 8)
UZSIM_VEC2(longlong2, long long, 16)
UZSIM_VEC2(ulonglong2, unsigned long long, 16)
UZSIM_VEC4(int4, int, 16)
UZSIM_VEC4(uint4, unsigned int, 16)
UZSIM_VEC4(uchar4, unsigned char, 4)
UZSIM_VEC4(ushort4, unsigned short, 8)
UZSIM_VEC4(float4, float, 16)
#undef UZSIM_VEC2
#undef UZSIM_VEC4

constexpr int warpSize = 32;

/* ---------------------------------------------------------------- the engine */

namespace uzsim {

struct Config {
    unsigned concurrent_blocks = 3;   // resident blocks whose fibers interleave
    size_t stack_bytes = 128 * 1024;  // per CUDA thread, plus a guard page
    unsigned spin_rounds = 10000;     // rounds of nothing but spinning before "livelock"
    bool reverse_blocks = false;      // start blocks in descending blockIdx order (CUDA promises no order)
};
inline Config& config() { static Config c; return c; }

// Every emulator error: misuse, deadlock, livelock, bad launch, exception in a kernel.
struct Error : std::runtime_error { using std::runtime_error::runtime_error; };

inline std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
inline std::string fmt(const char* f, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

enum class Op : unsigned char {
    SyncWarp, Shfl, ShflUp, ShflDown, ShflXor, Ballot, Any, All,
    Add, MinU, MinI, MaxU, MaxI, And, Or, Xor, MatchAny, MatchAll
};
inline const char* op_name(Op op) {
    static const char* const names[] = {
        "__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
        "__ballot_sync", "__any_sync", "__all_sync", "__reduce_add_sync",
        "__reduce_min_sync(unsigned)", "__reduce_min_sync(int)", "__reduce_max_sync(unsigned)",
        "__reduce_max_sync(int)", "__reduce_and_sync", "__reduce_or_sync", "__reduce_xor_sync",
        "__match_any_sync", "__match_all_sync"};
    return names[static_cast<int>(op)];
}

enum class Bar : unsigned char { Sync, Count, And, Or };
inline const char* bar_name(Bar b) {
    static const char* const names[] = {"__syncthreads", "__syncthreads_count", "__syncthreads_and",
                                        "__syncthreads_or"};
    return names[static_cast<int>(b)];
}

enum class Wait : unsigned char { None, Barrier, Warp, Exited };  // None: runnable

// A fiber stack: mmap'd (only touched pages cost memory) with a PROT_NONE guard page below it,
// so an overflow faults instead of corrupting the neighbouring stack.
struct Stack {
    void* map = nullptr;
    size_t map_bytes = 0, usable = 0;
    Stack() = default;
    Stack(const Stack&) = delete;
    Stack& operator=(const Stack&) = delete;
    ~Stack() { release(); }
    char* bottom() const { return static_cast<char*>(map) + (map_bytes - usable); }
    void allocate(size_t bytes) {
        release();
        const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        usable = (bytes + page - 1) / page * page;
        map_bytes = usable + page;
        map = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
        if (map == MAP_FAILED) {
            map = nullptr;
            throw Error("cannot map a fiber stack");
        }
        mprotect(map, page, PROT_NONE);
    }
    void release() {
        if (map) munmap(map, map_bytes);
        map = nullptr;
        map_bytes = usable = 0;
    }
};

struct Block;

struct Thread {
    ucontext_t ctx;
    Stack stack;
    void* asan_fake_stack = nullptr;
    uint3 tid;
    unsigned lin = 0;  // linear id in the block: warp = lin / 32, lane = lin % 32
    Block* blk = nullptr;
    Wait wait = Wait::None;
    bool spinning = false;  // suspended in __nanosleep / uzsim_yield / __activemask
    // What the thread deposited at its pending barrier / collective, and the result for it.
    Op op = Op::SyncWarp;
    unsigned char size = 0;  // operand bytes
    unsigned mask = 0;
    int arg = 0, width = 32;
    unsigned long long in = 0, out = 0;
};

// Lanes of one warp waiting at one collective; a warp can have several (disjoint masks).
struct Group {
    unsigned mask, arrived;
    Op op;
    unsigned char size;
};
struct Warp {
    unsigned gone = 0;  // exited lanes, and lanes past the end of the block
    std::vector<Group> groups;
};

struct AlignedFree {
    void operator()(unsigned char* p) const { ::operator delete(p, std::align_val_t(16)); }
};

// A resident-block slot; its threads and their stacks are reused by the blocks it runs.
struct Block {
    bool busy = false;
    uint3 idx;
    unsigned linear = 0, n = 0, live = 0, at_barrier = 0;
    Bar bar = Bar::Sync;
    std::vector<std::unique_ptr<Thread>> threads;
    std::vector<Warp> warps;
    std::unique_ptr<unsigned char[], AlignedFree> smem;
    size_t smem_bytes = std::numeric_limits<size_t>::max();
    Thread& lane(unsigned warp, unsigned l) { return *threads[warp * 32 + l]; }
};

struct Engine {
    ucontext_t sched;
    void* sched_fake_stack = nullptr;
    const void* sched_bottom = nullptr;  // the scheduler's stack, for ASan
    size_t sched_size = 0;
    Thread* cur = nullptr;  // the running fiber; null in the scheduler / on the host
    std::vector<std::unique_ptr<Block>> slots;
    std::vector<Block*> active;  // resident blocks, in start order
    dim3 grid, block;
    size_t smem_bytes = 0;
    std::function<void()> body;  // the kernel call with its arguments bound
    std::string error;           // set by a failing fiber, thrown by the scheduler
    bool progress = false;       // this round did more than spin
    unsigned long long garbage_seed = 0x243f6a8885a308d3ull;
};
inline Engine& eng() { static Engine e; return e; }
inline Thread& cur() { return *eng().cur; }

inline std::string describe(const Thread& t);

// Fiber -> scheduler. `dying`: the fiber will never be resumed (ASan frees its fake stack).
inline void suspend([[maybe_unused]] bool dying = false) {
    Engine& E = eng();
    Thread& t = *E.cur;
    UZSIM_FIBER_START(dying ? nullptr : &t.asan_fake_stack, E.sched_bottom, E.sched_size);
    swapcontext(&t.ctx, &E.sched);
    UZSIM_FIBER_FINISH(t.asan_fake_stack, &E.sched_bottom, &E.sched_size);
}

// Scheduler -> fiber, until it suspends.
inline void resume(Thread& t) {
    Engine& E = eng();
    E.cur = &t;
    UZSIM_FIBER_START(&E.sched_fake_stack, t.stack.bottom(), t.stack.usable);
    swapcontext(&E.sched, &t.ctx);
    UZSIM_FIBER_FINISH(E.sched_fake_stack, nullptr, nullptr);
    E.cur = nullptr;
}

// Ends the launch with an error blamed on `who`. Exceptions never cross swapcontext: the
// message goes to the scheduler, which throws it from its own stack; this fiber is abandoned.
[[noreturn]] inline void fail(const Thread& who, const std::string& msg) {
    Engine& E = eng();
    E.error = describe(who) + ": " + msg;
    suspend(true);
    __builtin_unreachable();
}

/* Source lane of a shuffle, as PTX shfl.sync computes it; the caller's own lane when out of range. */
inline unsigned shfl_src(Op op, unsigned lane, int arg, int width) {
    const unsigned b = static_cast<unsigned>(arg) & 31, first = lane & ~(width - 1u), last = first + width - 1;
    switch (op) {
    case Op::Shfl: return first | (b & (width - 1u));
    case Op::ShflUp: return lane >= first + b ? lane - b : lane;
    case Op::ShflDown: return lane + b <= last ? lane + b : lane;
    default: return (lane ^ b) <= last ? lane ^ b : lane;  // ShflXor: earlier segments only
    }
}

// Every non-exited lane of group `gi` has arrived: compute each lane's result, release them.
inline void resolve(Block& b, unsigned warp, size_t gi) {
    Warp& w = b.warps[warp];
    const Group g = w.groups[gi];
    w.groups.erase(w.groups.begin() + static_cast<std::ptrdiff_t>(gi));
    unsigned long long acc = 0, ballot = 0;
    bool first = true, all_equal = true;
    for (unsigned l = 0; l < 32; ++l) {
        if (!(g.arrived >> l & 1)) continue;
        const unsigned long long v = b.lane(warp, l).in;
        const int s = static_cast<int>(v), sa = static_cast<int>(acc);
        ballot |= static_cast<unsigned long long>(v != 0) << l;
        if (!first) all_equal = all_equal && v == acc;
        switch (g.op) {
        case Op::Add: acc = first ? v : acc + v; break;
        case Op::MinU: acc = first || v < acc ? v : acc; break;
        case Op::MaxU: acc = first || v > acc ? v : acc; break;
        case Op::MinI: acc = first || s < sa ? v : acc; break;
        case Op::MaxI: acc = first || s > sa ? v : acc; break;
        case Op::And: acc = first ? v : acc & v; break;
        case Op::Or: acc |= v; break;
        case Op::Xor: acc ^= v; break;
        default: if (first) acc = v;  // MatchAll compares against the first lane's value
        }
        first = false;
    }
    for (unsigned l = 0; l < 32; ++l) {
        if (!(g.arrived >> l & 1)) continue;
        Thread& t = b.lane(warp, l);
        switch (g.op) {
        case Op::SyncWarp: break;
        case Op::Shfl: case Op::ShflUp: case Op::ShflDown: case Op::ShflXor: {
            const unsigned j = shfl_src(g.op, l, t.arg, t.width);  // in the mask: checked on arrival
            t.out = g.arrived >> j & 1 ? b.lane(warp, j).in : t.in;  // exited source: own value
            break;
        }
        case Op::Ballot: t.out = ballot; break;
        case Op::Any: t.out = ballot != 0; break;
        case Op::All: t.out = ballot == g.arrived; break;
        case Op::MatchAny: {
            unsigned same = 0;
            for (unsigned k = 0; k < 32; ++k)
                if (g.arrived >> k & 1 && b.lane(warp, k).in == t.in) same |= 1u << k;
            t.out = same;
            break;
        }
        case Op::MatchAll: t.out = all_equal ? g.arrived : 0; break;
        default: t.out = acc;  // reductions
        }
        t.wait = Wait::None;
    }
}

inline void release_barrier(Block& b) {
    unsigned count = 0;
    for (unsigned i = 0; i < b.n; ++i)
        if (b.threads[i]->wait == Wait::Barrier) count += b.threads[i]->in != 0;
    const unsigned long long result = b.bar == Bar::Count ? count
                                      : b.bar == Bar::And ? count == b.at_barrier
                                      : b.bar == Bar::Or  ? count != 0
                                                          : 0;
    for (unsigned i = 0; i < b.n; ++i) {
        Thread& t = *b.threads[i];
        if (t.wait != Wait::Barrier) continue;
        t.out = result;
        t.wait = Wait::None;
    }
    b.at_barrier = 0;
}

inline bool group_complete(const Warp& w, const Group& g) { return ((g.arrived | w.gone) & g.mask) == g.mask; }

// A result is written into each waiting thread's own `out` when the collective completes, so
// a fast thread depositing for its next collective can never clobber what a slow one has yet
// to read: one wait per collective is enough.
inline unsigned long long collective(Op op, unsigned mask, unsigned long long in, unsigned size = 4,
                                     int arg = 0, int width = 32) {
    Engine& E = eng();
    Thread& t = *E.cur;
    Block& b = *t.blk;
    const unsigned lane = t.lin % 32, warp = t.lin / 32;
    Warp& w = b.warps[warp];
    E.progress = true;
    if (!(mask >> lane & 1))
        fail(t, fmt("%s(mask 0x%08x): the mask does not include the calling lane", op_name(op), mask));
    if (op == Op::Shfl || op == Op::ShflUp || op == Op::ShflDown || op == Op::ShflXor) {
        if (width < 1 || width > 32 || (width & (width - 1)))
            fail(t, fmt("%s: width %d is not a power of 2 in [1, 32]", op_name(op), width));
        const unsigned j = shfl_src(op, lane, arg, width);
        if (!(mask >> j & 1))
            fail(t, fmt("%s(mask 0x%08x) reads lane %u, which is not in the mask", op_name(op), mask, j));
    }
    t.op = op;
    t.size = static_cast<unsigned char>(size);
    t.mask = mask;
    t.in = in;
    t.arg = arg;
    t.width = width;
    size_t gi = 0;
    while (gi < w.groups.size() && w.groups[gi].mask != mask) ++gi;
    if (gi == w.groups.size()) {
        w.groups.push_back(Group{mask, 0, op, t.size});
    } else if (w.groups[gi].op != op || w.groups[gi].size != t.size) {
        const Group& g = w.groups[gi];
        fail(t, fmt("%s (%u-byte operand, mask 0x%08x) while lanes 0x%08x of the warp wait at %s (%u-byte "
                    "operand) with the same mask",
                    op_name(op), size, mask, g.arrived, op_name(g.op), unsigned{g.size}));
    }
    w.groups[gi].arrived |= 1u << lane;
    t.wait = Wait::Warp;
    if (group_complete(w, w.groups[gi]))
        resolve(b, warp, gi);  // the last lane to arrive releases the others and goes on
    else
        suspend();
    return t.out;
}

inline int barrier(Bar kind, int pred) {
    Engine& E = eng();
    Thread& t = *E.cur;
    Block& b = *t.blk;
    E.progress = true;
    if (b.at_barrier == 0)
        b.bar = kind;
    else if (b.bar != kind)
        fail(t, fmt("%s() while %u threads of the block wait at %s()", bar_name(kind), b.at_barrier,
                    bar_name(b.bar)));
    t.in = pred != 0;
    t.wait = Wait::Barrier;
    if (++b.at_barrier == b.live)
        release_barrier(b);
    else
        suspend();
    return static_cast<int>(t.out);
}

// __nanosleep / uzsim_yield: let the other fibers run (spin-wait loops must call one of them).
inline void spin_yield() {
    Thread* t = eng().cur;
    if (!t) return;
    t->spinning = true;
    suspend();
    t->spinning = false;
}

// Lanes of the caller's warp that have not exited. A point-in-time read, so first the other
// lanes run until each has exited or stopped (at a barrier, a collective, or spinning): lanes
// about to return, as after `if (i >= n) return;`, must not count.
inline unsigned active_mask() {
    Thread& t = *eng().cur;
    Block& b = *t.blk;
    const unsigned warp = t.lin / 32;
    for (;;) {
        bool others_running = false;
        for (unsigned l = 0; l < 32 && warp * 32 + l < b.n; ++l) {
            const Thread& o = b.lane(warp, l);
            others_running |= &o != &t && o.wait == Wait::None && !o.spinning;
        }
        if (!others_running) return ~b.warps[warp].gone;
        spin_yield();
    }
}

// The thread returned from the kernel: waits that counted on it may now be complete.
inline void thread_exit(Thread& t) {
    Block& b = *t.blk;
    Warp& w = b.warps[t.lin / 32];
    eng().progress = true;
    t.wait = Wait::Exited;
    --b.live;
    w.gone |= 1u << (t.lin % 32);
    for (size_t gi = 0; gi < w.groups.size();) {
        if (group_complete(w, w.groups[gi]))
            resolve(b, t.lin / 32, gi);
        else
            ++gi;
    }
    if (b.at_barrier && b.at_barrier == b.live) release_barrier(b);
}

inline void fiber_main() {
    Engine& E = eng();
    Thread& t = *E.cur;
    UZSIM_FIBER_FINISH(nullptr, &E.sched_bottom, &E.sched_size);
    std::string err;  // reported after the catch: a fiber must not suspend inside a handler
    try {
        E.body();
    } catch (const std::exception& e) {
        err = e.what();
    } catch (...) {
        err = "unknown exception";
    }
    if (!err.empty()) fail(t, "exception in kernel: " + err);
    thread_exit(t);
    suspend(true);
}

inline std::string describe(const Thread& t) {
    const Block& b = *t.blk;
    return fmt("block (%u,%u,%u) thread (%u,%u,%u) [warp %u lane %u]", b.idx.x, b.idx.y, b.idx.z, t.tid.x,
               t.tid.y, t.tid.z, t.lin / 32, t.lin % 32);
}

// Where every thread of `b` is, one line per run of warps that are in the same state.
inline std::string block_report(const Block& b) {
    const Engine& E = eng();
    std::string out = fmt("\nblock (%u,%u,%u) [linear %u] of grid (%u,%u,%u), blockDim (%u,%u,%u):", b.idx.x,
                          b.idx.y, b.idx.z, b.linear, E.grid.x, E.grid.y, E.grid.z, E.block.x, E.block.y,
                          E.block.z);
    std::string prev;
    unsigned first = 0;
    const unsigned nwarps = static_cast<unsigned>(b.warps.size());
    for (unsigned w = 0; w <= nwarps; ++w) {
        std::string line;
        if (w < nwarps) {
            std::vector<std::pair<std::string, unsigned>> places;  // where -> lanes
            for (unsigned l = 0; l < 32 && w * 32 + l < b.n; ++l) {
                const Thread& t = *b.threads[w * 32 + l];
                const std::string where =
                    t.wait == Wait::None      ? "spin (__nanosleep / uzsim_yield)"
                    : t.wait == Wait::Barrier ? fmt("wait at %s()", bar_name(b.bar))
                    : t.wait == Wait::Warp    ? fmt("wait at %s(mask 0x%08x)", op_name(t.op), t.mask)
                                              : std::string("exited");
                auto it = std::find_if(places.begin(), places.end(), [&](auto& p) { return p.first == where; });
                if (it == places.end()) places.emplace_back(where, 1u << l);
                else it->second |= 1u << l;
            }
            for (auto& p : places) line += fmt("%slanes 0x%08x ", line.empty() ? "" : "; ", p.second) + p.first;
        }
        if (w == nwarps || line != prev) {
            if (w > 0)
                out += (first == w - 1 ? fmt("\n  warp %u: ", first) : fmt("\n  warps %u-%u: ", first, w - 1)) +
                       prev;
            prev = line;
            first = w;
        }
    }
    return out;
}

// Points the thread's context at fiber_main on its own stack.
inline void init_fiber(Thread& t) {
    t.asan_fake_stack = nullptr;
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack.bottom();
    t.ctx.uc_stack.ss_size = t.stack.usable;
    t.ctx.uc_link = nullptr;  // fiber_main never returns
    makecontext(&t.ctx, fiber_main, 0);
}

inline void start_block(unsigned long long linear) {
    Engine& E = eng();
    const Config& cfg = config();
    Block* slot = nullptr;
    for (auto& s : E.slots)
        if (!s->busy) slot = s.get();
    if (!slot) {
        E.slots.push_back(std::make_unique<Block>());
        slot = E.slots.back().get();
    }
    Block& b = *slot;
    const unsigned n = E.block.x * E.block.y * E.block.z;
    b.busy = true;
    b.linear = static_cast<unsigned>(linear);
    b.idx = uint3{static_cast<unsigned>(linear % E.grid.x), static_cast<unsigned>(linear / E.grid.x % E.grid.y),
                  static_cast<unsigned>(linear / (static_cast<unsigned long long>(E.grid.x) * E.grid.y))};
    b.n = b.live = n;
    b.at_barrier = 0;
    while (b.threads.size() < n) b.threads.push_back(std::make_unique<Thread>());
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t stack = (cfg.stack_bytes + page - 1) / page * page;
    for (unsigned i = 0; i < n; ++i) {
        Thread& t = *b.threads[i];
        if (t.stack.usable != stack) t.stack.allocate(stack);
        t.tid = uint3{i % E.block.x, i / E.block.x % E.block.y, i / (E.block.x * E.block.y)};
        t.lin = i;
        t.blk = &b;
        t.wait = Wait::None;
        t.spinning = false;
        init_fiber(t);
    }
    b.warps.assign((n + 31) / 32, Warp{});
    if (n % 32) b.warps.back().gone = ~0u << (n % 32);
    // Exact size (no rounding), so ASan builds catch overruns; garbage, so reads of unwritten
    // shared memory show up in tests. A different pattern for every block.
    if (b.smem_bytes != E.smem_bytes) {
        void* p = ::operator new(E.smem_bytes ? E.smem_bytes : 1, std::align_val_t(16));
        b.smem.reset(static_cast<unsigned char*>(p));
        b.smem_bytes = E.smem_bytes;
    }
    unsigned long long x = (E.garbage_seed += 0x9e3779b97f4a7c15ull) | 1;
    for (size_t i = 0; i < E.smem_bytes; i += 8) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64
        std::memcpy(b.smem.get() + i, &x, std::min<size_t>(8, E.smem_bytes - i));
    }
    E.active.push_back(&b);
    E.progress = true;
}

inline void run_grid() {
    Engine& E = eng();
    const Config& cfg = config();
    const unsigned long long nblocks = static_cast<unsigned long long>(E.grid.x) * E.grid.y * E.grid.z;
    unsigned long long next = 0;
    unsigned idle_rounds = 0;
    for (;;) {
        while (E.active.size() < cfg.concurrent_blocks && next < nblocks) {
            start_block(cfg.reverse_blocks ? nblocks - 1 - next : next);
            ++next;
        }
        if (E.active.empty()) return;
        E.progress = false;
        for (Block* b : E.active) {
            for (unsigned i = 0; i < b->n; ++i) {
                Thread& t = *b->threads[i];
                if (t.wait != Wait::None) continue;
                resume(t);
                if (!E.error.empty()) throw Error(E.error);
            }
        }
        for (size_t k = 0; k < E.active.size();) {
            Block& b = *E.active[k];
            if (b.live == 0) {
                b.busy = false;
                E.active.erase(E.active.begin() + static_cast<std::ptrdiff_t>(k));
                continue;
            }
            bool runnable = false;
            for (unsigned i = 0; i < b.n && !runnable; ++i) runnable = b.threads[i]->wait == Wait::None;
            if (!runnable) throw Error("deadlock: no thread of a block can proceed" + block_report(b));
            ++k;
        }
        idle_rounds = E.progress ? 0 : idle_rounds + 1;
        if (idle_rounds >= cfg.spin_rounds) {
            std::string msg = fmt("livelock: for %u scheduler rounds no thread did anything but spin in "
                                  "__nanosleep / uzsim_yield",
                                  idle_rounds);
            for (Block* b : E.active) msg += block_report(*b);
            throw Error(msg);
        }
    }
}

// H100/H200 (sm_90) opt-in maximum of dynamic shared memory per block.
constexpr size_t kMaxDynamicSmem = 227 * 1024;

// Runs `body` as every thread of the grid; throws Error (after a reset) on any failure.
inline void run(dim3 grid, dim3 block, size_t smem_bytes, std::function<void()> body) {
    Engine& E = eng();
    if (E.cur) throw Error("uzsim::launch from device code (dynamic parallelism) is not supported");
    const auto bad = [&](const char* why) {
        return Error(fmt("invalid launch (grid (%u,%u,%u), block (%u,%u,%u), %zu bytes of shared memory): %s",
                         grid.x, grid.y, grid.z, block.x, block.y, block.z, smem_bytes, why));
    };
    if (!grid.x || !grid.y || !grid.z || !block.x || !block.y || !block.z) throw bad("a dimension is 0");
    if (static_cast<unsigned long long>(block.x) * block.y * block.z > 1024 || block.z > 64)
        throw bad("a block has at most 1024 threads, and blockDim.z <= 64");
    if (grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) throw bad("grid too large");
    if (smem_bytes > kMaxDynamicSmem) throw bad("more than 227 KiB of dynamic shared memory");
    if (config().concurrent_blocks < 1) throw bad("config().concurrent_blocks is 0");
    E.grid = grid;
    E.block = block;
    E.smem_bytes = smem_bytes;
    E.body = std::move(body);
    E.error.clear();
    const auto reset = [&] {
        for (Block* b : E.active) b->busy = false;
        E.active.clear();
        E.body = nullptr;
        E.error.clear();
        std::fflush(stdout);  // kernel printf shows up by the end of the launch, as after a CUDA sync
    };
    try {
        run_grid();
    } catch (...) {
        reset();
        throw;
    }
    reset();
}

// Launches `kernel` like kernel<<<grid, block, dyn_smem_bytes>>>(args...) and returns when the
// grid is done. Arguments convert to the parameter types as in a call.
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t dyn_smem_bytes, A... args) {
    static_assert(sizeof...(P) == sizeof...(A), "uzsim::launch: wrong number of kernel arguments");
    const std::tuple<P...> params(args...);
    run(grid, block, dyn_smem_bytes, [kernel, &params] { std::apply(kernel, params); });
}

inline const uint3& thread_idx() { return eng().cur->tid; }
inline const uint3& block_idx() { return eng().cur->blk->idx; }
inline const dim3& block_dim() { return eng().block; }
inline const dim3& grid_dim() { return eng().grid; }
// The block's dynamic shared memory: 16-byte aligned, the launch's size, garbage-filled.
inline unsigned char* dynamic_smem() { return eng().cur->blk->smem.get(); }

template <class T>
T shuffle(Op op, unsigned mask, T v, int arg, int width) {
    static_assert(std::is_arithmetic_v<T>, "shuffles move arithmetic values");
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof v);
    bits = collective(op, mask, bits, sizeof v, arg, width);
    std::memcpy(&v, &bits, sizeof v);
    return v;
}
template <class T>
unsigned match(Op op, unsigned mask, T v) {
    static_assert(std::is_arithmetic_v<T>, "__match_*_sync compares arithmetic values");
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof v);
    return static_cast<unsigned>(collective(op, mask, bits, sizeof v));
}

template <class T> struct identity { using type = T; };
template <class T> using nodeduce = typename identity<T>::type;  // atomicAdd(&u, 1) with u unsigned
template <class T, class... U> constexpr bool one_of = (std::is_same_v<T, U> || ...);
template <class T> T wrap_add(T a, T b) {  // CUDA integer atomics wrap; C++ signed overflow is UB
    if constexpr (std::is_integral_v<T>) return T(std::make_unsigned_t<T>(a) + std::make_unsigned_t<T>(b));
    else return a + b;
}

}  // namespace uzsim

/* ---------------------------------------------------------------- device API */

#define threadIdx (::uzsim::thread_idx())
#define blockIdx (::uzsim::block_idx())
#define blockDim (::uzsim::block_dim())
#define gridDim (::uzsim::grid_dim())

inline void __syncthreads() { uzsim::barrier(uzsim::Bar::Sync, 0); }
inline int __syncthreads_count(int pred) { return uzsim::barrier(uzsim::Bar::Count, pred); }
inline int __syncthreads_and(int pred) { return uzsim::barrier(uzsim::Bar::And, pred); }
inline int __syncthreads_or(int pred) { return uzsim::barrier(uzsim::Bar::Or, pred); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { uzsim::collective(uzsim::Op::SyncWarp, mask, 0); }

template <class T> T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize) {
    return uzsim::shuffle(uzsim::Op::Shfl, mask, var, srcLane, width);
}
template <class T> T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    return uzsim::shuffle(uzsim::Op::ShflUp, mask, var, static_cast<int>(delta), width);
}
template <class T> T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    return uzsim::shuffle(uzsim::Op::ShflDown, mask, var, static_cast<int>(delta), width);
}
template <class T> T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize) {
    return uzsim::shuffle(uzsim::Op::ShflXor, mask, var, laneMask, width);
}

inline unsigned __ballot_sync(unsigned mask, int pred) {
    return static_cast<unsigned>(uzsim::collective(uzsim::Op::Ballot, mask, pred != 0));
}
inline int __any_sync(unsigned mask, int pred) {
    return static_cast<int>(uzsim::collective(uzsim::Op::Any, mask, pred != 0));
}
inline int __all_sync(unsigned mask, int pred) {
    return static_cast<int>(uzsim::collective(uzsim::Op::All, mask, pred != 0));
}
inline unsigned __activemask() { return uzsim::active_mask(); }

#define UZSIM_REDUCE(name, T, op) \
    inline T name(unsigned mask, T v) { \
        return static_cast<T>(uzsim::collective(uzsim::Op::op, mask, static_cast<unsigned>(v))); \
    }
UZSIM_REDUCE(__reduce_add_sync, unsigned, Add)
UZSIM_REDUCE(__reduce_add_sync, int, Add)
UZSIM_REDUCE(__reduce_min_sync, unsigned, MinU)
UZSIM_REDUCE(__reduce_min_sync, int, MinI)
UZSIM_REDUCE(__reduce_max_sync, unsigned, MaxU)
UZSIM_REDUCE(__reduce_max_sync, int, MaxI)
UZSIM_REDUCE(__reduce_and_sync, unsigned, And)
UZSIM_REDUCE(__reduce_or_sync, unsigned, Or)
UZSIM_REDUCE(__reduce_xor_sync, unsigned, Xor)
#undef UZSIM_REDUCE

template <class T> unsigned __match_any_sync(unsigned mask, T value) {
    return uzsim::match(uzsim::Op::MatchAny, mask, value);
}
template <class T> unsigned __match_all_sync(unsigned mask, T value, int* pred) {
    const unsigned r = uzsim::match(uzsim::Op::MatchAll, mask, value);
    *pred = r != 0;
    return r;
}

/* Atomics: plain read-modify-writes (fibers never interleave between sync points), each for
 * the types CUDA has it for. */
#define UZSIM_ATOMIC(name, new_value, ...) \
    template <class T> T name(T* p, uzsim::nodeduce<T> v) { \
        static_assert(uzsim::one_of<T, __VA_ARGS__>, #name ": CUDA has no overload for this type"); \
        const T old = *p; \
        *p = new_value; \
        return old; \
    }
UZSIM_ATOMIC(atomicAdd, uzsim::wrap_add(old, v), int, unsigned, unsigned long long, float, double)
UZSIM_ATOMIC(atomicSub, T(std::make_unsigned_t<T>(old) - std::make_unsigned_t<T>(v)), int, unsigned)
UZSIM_ATOMIC(atomicExch, v, int, unsigned, unsigned long long, float)
UZSIM_ATOMIC(atomicMin, v < old ? v : old, int, unsigned, long long, unsigned long long)
UZSIM_ATOMIC(atomicMax, v > old ? v : old, int, unsigned, long long, unsigned long long)
UZSIM_ATOMIC(atomicAnd, old & v, int, unsigned, unsigned long long)
UZSIM_ATOMIC(atomicOr, old | v, int, unsigned, unsigned long long)
UZSIM_ATOMIC(atomicXor, old ^ v, int, unsigned, unsigned long long)
#undef UZSIM_ATOMIC
template <class T> T atomicCAS(T* p, uzsim::nodeduce<T> compare, uzsim::nodeduce<T> v) {
    static_assert(uzsim::one_of<T, int, unsigned, unsigned long long>, "atomicCAS: CUDA has no overload for this type");
    const T old = *p;
    if (old == compare) *p = v;
    return old;
}
inline unsigned atomicInc(unsigned* p, unsigned limit) {
    const unsigned old = *p;
    *p = old >= limit ? 0 : old + 1;
    return old;
}
inline unsigned atomicDec(unsigned* p, unsigned limit) {
    const unsigned old = *p;
    *p = old == 0 || old > limit ? limit : old - 1;
    return old;
}

inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
inline void __nanosleep(unsigned) { uzsim::spin_yield(); }
inline void uzsim_yield() { uzsim::spin_yield(); }
[[noreturn]] inline void __trap() { uzsim::fail(uzsim::cur(), "__trap()"); }

/* Integer intrinsics, as the CUDA Math API documents them. */
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long bytes = static_cast<unsigned long long>(y) << 32 | x;
    unsigned r = 0;
    for (unsigned n = 0; n < 4; ++n) r |= static_cast<unsigned>(bytes >> 8 * (s >> 4 * n & 7) & 0xff) << 8 * n;
    return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
    return static_cast<unsigned>((static_cast<unsigned long long>(hi) << 32 | lo) << (shift & 31) >> 32);
}
inline unsigned __funnelshift_lc(unsigned lo, unsigned hi, unsigned shift) {
    return static_cast<unsigned>((static_cast<unsigned long long>(hi) << 32 | lo) << (shift < 32 ? shift : 32) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    return static_cast<unsigned>((static_cast<unsigned long long>(hi) << 32 | lo) >> (shift & 31));
}
inline unsigned __funnelshift_rc(unsigned lo, unsigned hi, unsigned shift) {
    return static_cast<unsigned>((static_cast<unsigned long long>(hi) << 32 | lo) >> (shift < 32 ? shift : 32));
}
inline unsigned __brev(unsigned x) {
    x = (x >> 1 & 0x55555555u) | (x & 0x55555555u) << 1;
    x = (x >> 2 & 0x33333333u) | (x & 0x33333333u) << 2;
    x = (x >> 4 & 0x0f0f0f0fu) | (x & 0x0f0f0f0fu) << 4;
    return __builtin_bswap32(x);
}
inline unsigned long long __brevll(unsigned long long x) {
    const unsigned lo = static_cast<unsigned>(x), hi = static_cast<unsigned>(x >> 32);
    return static_cast<unsigned long long>(__brev(lo)) << 32 | __brev(hi);
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz(static_cast<unsigned>(x)) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll(static_cast<unsigned long long>(x)) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __umulhi(unsigned a, unsigned b) {
    return static_cast<unsigned>(static_cast<unsigned long long>(a) * b >> 32);
}
inline int __mulhi(int a, int b) { return static_cast<int>(static_cast<long long>(a) * b >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return static_cast<unsigned long long>(static_cast<unsigned __int128>(a) * b >> 64);
}
inline long long __mul64hi(long long a, long long b) {
    return static_cast<long long>(static_cast<__int128>(a) * b >> 64);
}
inline unsigned __usad(unsigned x, unsigned y, unsigned z) { return (x > y ? x - y : y - x) + z; }
inline unsigned __sad(int x, int y, unsigned z) {
    return (x > y ? unsigned(x) - unsigned(y) : unsigned(y) - unsigned(x)) + z;  // |x - y| fits in 32 bits
}

// min / max with the usual arithmetic conversions, which is what CUDA's overloads amount to
// (min(int, unsigned) is unsigned, min(short, short) is int).
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
constexpr auto min(A a, B b) -> decltype(a + b) {
    using T = decltype(a + b);
    return T(b) < T(a) ? T(b) : T(a);
}
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
constexpr auto max(A a, B b) -> decltype(a + b) {
    using T = decltype(a + b);
    return T(a) < T(b) ? T(b) : T(a);
}

// Cache-hinted loads and stores are plain ones.
template <class T> T __ldg(const T* p) { return *p; }
template <class T> T __ldcg(const T* p) { return *p; }
template <class T> T __ldcs(const T* p) { return *p; }
template <class T> void __stcg(T* p, uzsim::nodeduce<T> v) { *p = v; }
template <class T> void __stcs(T* p, uzsim::nodeduce<T> v) { *p = v; }

template <class To, class From> To uzsim_bit_cast(From v) {
    static_assert(sizeof(To) == sizeof(From), "bit cast between types of one size");
    To r;
    std::memcpy(&r, &v, sizeof r);
    return r;
}
inline float __int_as_float(int x) { return uzsim_bit_cast<float>(x); }
inline float __uint_as_float(unsigned x) { return uzsim_bit_cast<float>(x); }
inline int __float_as_int(float x) { return uzsim_bit_cast<int>(x); }
inline unsigned __float_as_uint(float x) { return uzsim_bit_cast<unsigned>(x); }
inline double __longlong_as_double(long long x) { return uzsim_bit_cast<double>(x); }
inline long long __double_as_longlong(double x) { return uzsim_bit_cast<long long>(x); }

/* ---------------------------------------------------------------- kernels by name (Python glue) */

namespace uzsim {

// Values come from Python ints: __int128 holds every int64 and uint64 exactly, so -1 and
// 2**64 - 1 stay apart until the parameter type decides whether they fit.
struct ArgError : std::out_of_range {
    size_t index;
    explicit ArgError(size_t i) : std::out_of_range("kernel argument out of range"), index(i) {}
};

struct Kernel {
    std::vector<std::string> params;  // "pointer", "int32", "uint8", ...
    std::function<void(dim3, dim3, size_t, const __int128*)> invoke;
};
inline std::map<std::string, Kernel>& registry() {
    static std::map<std::string, Kernel> r;
    return r;
}

template <class P> std::string param_desc() {
    if constexpr (std::is_pointer_v<P>) return "pointer";
    else return (std::is_signed_v<P> ? "int" : "uint") + std::to_string(8 * sizeof(P));
}

template <class P> P from_arg(__int128 v, size_t i) {
    static_assert(std::is_pointer_v<P> || std::is_integral_v<P>,
                  "UZSIM_EXPORT: kernel parameters must be pointers or integers");
    if constexpr (std::is_pointer_v<P>) {
        if (v < 0 || v > static_cast<__int128>(UINTPTR_MAX)) throw ArgError(i);
        return reinterpret_cast<P>(static_cast<uintptr_t>(v));
    } else {
        using L = std::numeric_limits<P>;
        if (v < static_cast<__int128>(L::min()) || v > static_cast<__int128>(L::max())) throw ArgError(i);
        return static_cast<P>(v);
    }
}

template <class... P, size_t... I>
void invoke_by_value(void (*k)(P...), dim3 g, dim3 b, size_t smem, const __int128* a, std::index_sequence<I...>) {
    const std::tuple<P...> params{from_arg<P>(a[I], I)...};  // braces: checked left to right
    launch(k, g, b, smem, std::get<I>(params)...);
}

template <class... P> bool register_kernel(const char* name, void (*k)(P...)) {
    registry()[name] = Kernel{{param_desc<P>()...}, [k](dim3 g, dim3 b, size_t smem, const __int128* a) {
                                  invoke_by_value(k, g, b, smem, a, std::index_sequence_for<P...>{});
                              }};
    return true;
}

}  // namespace uzsim

// At file scope after the kernel's definition: makes it launchable by name from Python.
#define UZSIM_EXPORT(fn) [[maybe_unused]] static const bool uzsim_exported_##fn = ::uzsim::register_kernel(#fn, &fn)
