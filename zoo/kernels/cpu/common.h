// zoo/kernels/cpu/common.h: vector types (v8, v16 as one zmm or two ymm halves), bfloat16 widening, fma, exp, dot,
// scratch; the thread Pool and parallel_for. Built as one unit by ../cpu.cpp, which includes every family in order;
// the includes below name what this one reads.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// v16 / i16: 16 float / int32 lanes. With AVX-512 a GCC vector (one zmm register). Without it GCC has no register
// mode for a 64-byte vector and keeps every such variable in memory (each operation a store and a reload: the float32
// GEMV ran 2.2x slower than on 8-lane halves, bench/kernels.py on an AVX2-only EPYC), so there v16 is a pair of 8-lane
// halves (lanes 0-7, 8-15) with the same lane-wise operators: the same results, to the bit. Code on v16 uses
// only what both forms have: lane-wise operators (with a scalar on either side), reading lane i, select(mask, a, b)
// for the lane-wise conditional, to_i16 / as_v16 for conversion / reinterpretation, lo8 / hi8 for the halves.
#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));
static inline v16 load(const float* p) { return *(const v16u*)p; }
static inline void store(float* p, v16 v) { *(v16u*)p = v; }
static inline v16 splat(float x) { return (v16){} + x; }
static inline i16 splat_i(int32_t x) { return (i16){} + x; }
template <typename M, typename V> static inline V select(M mask, V a, V b) { return mask ? a : b; }
static inline i16 to_i16(v16 v) { return __builtin_convertvector(v, i16); }  // (truncating, as a C cast)
static inline v16 as_v16(i16 v) { return (v16)v; }
static inline v8 lo8(v16 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline v8 hi8(v16 v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
#else
template <typename H>
struct Pair {
    H lo, hi;
    auto operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
};
typedef Pair<v8> v16;
typedef Pair<i8> i16;
template <typename T> struct is_pair { static constexpr bool value = false; };
template <typename H> struct is_pair<Pair<H>> { static constexpr bool value = true; };
#define ZOO_PAIR_OP(op)                                                                                      \
    template <typename H> static inline auto operator op(Pair<H> a, Pair<H> b) {                             \
        return Pair<decltype(a.lo op b.lo)>{a.lo op b.lo, a.hi op b.hi};                                     \
    }                                                                                                        \
    template <typename H, typename S, typename = typename std::enable_if<!is_pair<S>::value>::type>          \
    static inline auto operator op(Pair<H> a, S b) { return Pair<decltype(a.lo op b)>{a.lo op b, a.hi op b}; } \
    template <typename S, typename H, typename = typename std::enable_if<!is_pair<S>::value>::type>          \
    static inline auto operator op(S a, Pair<H> b) { return Pair<decltype(a op b.lo)>{a op b.lo, a op b.hi}; }
ZOO_PAIR_OP(+) ZOO_PAIR_OP(-) ZOO_PAIR_OP(*) ZOO_PAIR_OP(/) ZOO_PAIR_OP(&) ZOO_PAIR_OP(|) ZOO_PAIR_OP(<<)
ZOO_PAIR_OP(<) ZOO_PAIR_OP(>) ZOO_PAIR_OP(<=) ZOO_PAIR_OP(>=) ZOO_PAIR_OP(==) ZOO_PAIR_OP(!=)
#undef ZOO_PAIR_OP
template <typename H> static inline Pair<H> operator-(Pair<H> a) { return {-a.lo, -a.hi}; }
template <typename H> static inline Pair<H>& operator|=(Pair<H>& a, Pair<H> b) { return a = a | b; }
static inline v16 load(const float* p) { return {*(const v8u*)p, *(const v8u*)(p + 8)}; }
static inline void store(float* p, v16 v) { *(v8u*)p = v.lo, *(v8u*)(p + 8) = v.hi; }
static inline v16 splat(float x) { return {(v8){} + x, (v8){} + x}; }
static inline i16 splat_i(int32_t x) { return {(i8){} + x, (i8){} + x}; }
template <typename M, typename V> static inline V select(Pair<M> mask, V a, V b) {
    return {mask.lo ? a.lo : b.lo, mask.hi ? a.hi : b.hi};
}
static inline i16 to_i16(v16 v) { return {__builtin_convertvector(v.lo, i8), __builtin_convertvector(v.hi, i8)}; }
static inline v16 as_v16(i16 v) { return {(v8)v.lo, (v8)v.hi}; }
static inline v8 lo8(v16 v) { return v.lo; }
static inline v8 hi8(v16 v) { return v.hi; }
#endif
static inline i16 load_i(const int32_t* p) {  // 16 int32 lanes from memory
    i16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

// bfloat16 (the upper half of a float32): weights and KV caches of bfloat16 models. Read by widening, which is
// exact (16 values: a zero-extending load and a shift, vpmovzxwd + vpslld on AVX2 / AVX-512); the arithmetic is
// float32 throughout. Stored (KV cache rows) rounded to nearest even, as torch's .to(torch.bfloat16).
typedef uint16_t bf16;
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
static inline v16 load(const bf16* p) {
#if defined(__AVX512F__)  // one vpmovzxwd from memory to 512 bits (the generic form below becomes two 256-bit
    // conversions and an insert where the compiler prefers 256-bit vectors: 4 shuffle-port ops per 16 values, which
    // capped a bfloat16 GEMV at ~8 bytes a cycle)
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#else
    return {(v8)(__builtin_convertvector(*(const u16x8*)p, u32x8) << 16),
            (v8)(__builtin_convertvector(*(const u16x8*)(p + 8), u32x8) << 16)};
#endif
}
static inline float to_f32(float x) { return x; }
static inline float to_f32(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline bf16 to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// dst[0 .. n) = src widened to float32 (a copy for float32)
template <typename W>
static inline void widen(const W* src, long n, float* dst) {
    long i = 0;
    if constexpr (sizeof(W) == 2)
        for (; i + 16 <= n; i += 16) store(dst + i, load(src + i));
    for (; i < n; i++) dst[i] = to_f32(src[i]);
}

// a * b + c with one rounding
// a * b + c with one rounding, 8 lanes
static inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

// a * b + c with one rounding
static inline v16 fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    return {fma8(a.lo, b.lo, c.lo), fma8(a.hi, b.hi, c.hi)};
#endif
}

// vector registers: AVX-512 (also for 256-bit vectors with AVX-512VL) has 32, AVX2 16
#if defined(__AVX512VL__)
constexpr int REGS = 32;
#else
constexpr int REGS = 16;
#endif

static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

// sum of the 16 lanes, in a fixed tree order
static inline float hsum(v16 v) {
    v8 a = lo8(v) + hi8(v);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float hmax(v16 v) {
    float m = v[0];
    for (int i = 1; i < 16; i++) m = std::max(m, v[i]);
    return m;
}

// e^x, Cephes' single-precision polynomial (about 1 ulp); 0 below -87.3, finite above 88.3
static inline v16 exp16(v16 x) {
    const v16 lo = splat(-87.3365447505531f), hi = splat(88.3f), magic = splat(12582912.0f);
    v16 xc = select(x < lo, lo, x);
    xc = select(xc > hi, hi, xc);
    v16 n = fma16(xc, splat(1.44269504088896341f), magic) - magic;  // round(x / ln 2)
    v16 r = fma16(n, splat(-0.693359375f), xc);
    r = fma16(n, splat(2.12194440e-4f), r);
    v16 p = splat(1.9875691500e-4f);
    p = fma16(p, r, splat(1.3981999507e-3f));
    p = fma16(p, r, splat(8.3334519073e-3f));
    p = fma16(p, r, splat(4.1665795894e-2f));
    p = fma16(p, r, splat(1.6666665459e-1f));
    p = fma16(p, r, splat(5.0000001201e-1f));
    v16 y = fma16(p, r * r, r) + splat(1.0f);
    i16 bits = (to_i16(n) + 127) << 23;  // 2^n
    v16 res = y * as_v16(bits);
    return select(x < lo, splat(0.0f), res);
}

template <typename C>
static inline float dot(const float* a, const C* b, long n) {  // fixed order: lanes, then the tail
    v16 acc = splat(0.0f);
    long i = 0;
    for (; i + 16 <= n; i += 16) acc = fma16(load(a + i), load(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s = std::fma(a[i], to_f32(b[i]), s);
    return s;
}

// v's storage with room for n elements; thread-local scratch only grows (std::vector's resize zero-fills
// what it adds, every time the size goes back up: megabytes per call when sizes alternate)
template <typename T>
static inline T* room(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}

// the same, on a 64-byte line: panels are read and written with aligned vector moves
static inline float* room64(std::vector<float>& v, size_t n) {
    return (float*)(((uintptr_t)room(v, n + 16) + 63) & ~(uintptr_t)63);
}

// ---------------------------------------------------------------------------------------------------
// Pool: run(fn, ctx, n, threads) calls fn(ctx, c) once for every chunk c < n, on the caller and up to
// threads - 1 workers. state = epoch << 32 | next chunk; a chunk is claimed by a compare-and-swap that
// also checks the epoch. Publishing a job first closes the current epoch (no chunk claimable) while the
// job's fields change, then opens the next one: a worker that read an old epoch, or fields caught mid-write,
// can never claim a chunk. Workers spin briefly between jobs (decode calls kernels every few microseconds),
// then sleep on a condition variable.

typedef void (*chunk_fn)(const void* ctx, long chunk);

static inline void prefetch_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_prefetch((const char*)p, _MM_HINT_T1);
#else
    __builtin_prefetch(p, 0, 2);
#endif
}

static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
}

class Pool {
   public:
    void run(chunk_fn fn, const void* ctx, long n, int threads) {
        if (n <= 0) return;
        std::unique_lock<std::mutex> solo(run_mu_, std::try_to_lock);  // another caller thread: run alone
        if (threads <= 1 || n == 1 || !solo.owns_lock()) {
            for (long c = 0; c < n; c++) fn(ctx, c);
            return;
        }
        grow(threads - 1);
        active_.store(threads - 1, std::memory_order_relaxed);
        uint64_t epoch = publish(fn, ctx, n);
        if (sleepers_.load() > 0) {
            std::lock_guard<std::mutex> lk(mu_);
            cv_.notify_all();
        }
        claim(epoch, fn, ctx, n);
        for (long spins = 0; done_.load(std::memory_order_acquire) < n; spins++)
            if (spins > 4096) std::this_thread::yield(); else cpu_relax();
    }

   private:
    std::atomic<uint64_t> state_{0};
    std::atomic<chunk_fn> fn_{nullptr};
    std::atomic<const void*> ctx_{nullptr};
    std::atomic<long> n_{0}, done_{0};
    std::atomic<int> active_{0}, sleepers_{0};
    std::mutex run_mu_, mu_;
    std::condition_variable cv_;
    int workers_ = 0;

    uint64_t publish(chunk_fn fn, const void* ctx, long n) {
        uint64_t epoch = state_.load() >> 32;
        state_.store(((epoch + 1) << 32) | 0xffffffffu);  // closed
        fn_.store(fn, std::memory_order_relaxed);
        ctx_.store(ctx, std::memory_order_relaxed);
        n_.store(n, std::memory_order_relaxed);
        done_.store(0, std::memory_order_relaxed);
        state_.store((epoch + 2) << 32);  // open (seq_cst: after the fields, before the sleepers check)
        return epoch + 2;
    }

    void claim(uint64_t epoch, chunk_fn fn, const void* ctx, long n) {
        uint64_t s = state_.load(std::memory_order_acquire);
        while ((s >> 32) == epoch && (long)(s & 0xffffffffu) < n) {
            if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
                fn(ctx, (long)(s & 0xffffffffu));
                done_.fetch_add(1, std::memory_order_release);
                s = state_.load(std::memory_order_acquire);
            }
        }
    }

    void grow(int wanted) {
        for (; workers_ < wanted; workers_++) std::thread(&Pool::worker, this, workers_).detach();
    }

    void worker(int index) {
        uint64_t seen = state_.load() >> 32;
        for (;;) {
            uint64_t epoch = state_.load() >> 32;
            for (long spins = 0; epoch == seen && spins < 20000; spins++) {  // well under a millisecond
                cpu_relax();
                epoch = state_.load() >> 32;
            }
            if (epoch == seen) {
                std::unique_lock<std::mutex> lk(mu_);
                sleepers_.fetch_add(1);
                cv_.wait(lk, [&] { return (state_.load() >> 32) != seen; });
                sleepers_.fetch_sub(1);
                epoch = state_.load() >> 32;
            }
            seen = epoch;
            if (index >= active_.load(std::memory_order_relaxed)) continue;
            claim(epoch, fn_.load(std::memory_order_relaxed), ctx_.load(std::memory_order_relaxed),
                  n_.load(std::memory_order_relaxed));
        }
    }
};

static Pool& pool() {  // never destroyed (detached workers); a forked child starts a pool of its own
    static Pool* p = nullptr;
    static pid_t owner = 0;
    if (p == nullptr || owner != getpid()) {
        p = new Pool();
        owner = getpid();
    }
    return *p;
}

// run body(i) for i in [0, n) in chunks of `grain` items
template <typename Body>
static void parallel_for(long n, long grain, int threads, const Body& body) {
    struct Ctx { const Body* body; long n, grain; };
    Ctx ctx{&body, n, std::max(1L, grain)};
    long chunks = (n + ctx.grain - 1) / ctx.grain;
    pool().run([](const void* p, long c) {
        const Ctx* x = (const Ctx*)p;
        long e = std::min(x->n, (c + 1) * x->grain);
        for (long i = c * x->grain; i < e; i++) (*x->body)(i);
    }, &ctx, chunks, threads);
}

// run body(begin, end) over [0, n) in 2 x threads ranges (multiples of grain) claimed in the order 0, 2, .., 1,
// 3, ..: a thread's second range is likely the one after its first, so a stream over w (a GEMV, or a decode
// GEMM prefetching its next block) carries on instead of starting cold (3-4% of a decode step when ranges
// shrank from n / 2 threads down to the grain); a late thread costs a quarter of the work at most
template <typename Body>
static void paired_ranges(long n, long grain, int threads, const Body& body) {
    const long parts = 2L * std::max(1, threads), step = (n / parts + grain - 1) / grain * grain;
    parallel_for(parts, 1, threads, [&](long c) {
        const long part = (c % threads) * 2 + c / threads;
        const long b = std::min(n, part * step), e = part + 1 == parts ? n : std::min(n, (part + 1) * step);
        if (b < e) body(b, e);
    });
}
