// zoo's native CPU kernels: float32, row-major, no torch headers (loaded with ctypes by zoo/kernels/__init__.py).
//
// Built with -O3 -march=native -ffp-contract=off -pthread. Contraction is off so that the elementwise kernels
// round exactly like torch's separate mul / add ops (the rotation equals transformers' bit for bit); the
// reductions use explicit fused multiply-adds (fma16) instead.
//
// Shape legend:
//     M = rows of x (tokens)    K = input features    N = output features    T = tokens    D = head dim
//     H = query heads    KV = key/value heads    B = requests    BS = tokens per block
//
// Threads: a kernel splits its work into chunks that the calling thread and the pool's workers claim from
// one atomic counter (Pool below). The caller never waits for a worker that has not started, only for
// chunks a worker has claimed: on a machine shared with other processes a descheduled worker costs at
// most one chunk, where a fork-join barrier (OpenMP) waits for it at every kernel. Every output element is
// computed by one thread in a fixed order: results do not depend on the thread count.
//
// Contents: Pool; linear (GEMV / GEMM); RMS norm; rotary; SiLU-and-mul; paged attention; Mamba2's mixer, Mamba1's
// conv and scan; argmax; zoo_llama_forward, a whole decoder step made of the kernels above (zoo/kernels/fused.py).
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

// ---------------------------------------------------------------------------------------------------
// Linear: y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]); w [N, K] contiguous as in the checkpoint.
//
// Few rows (M <= gemv_rows: one float32 row, up to 16 with bfloat16 weights): each thread streams ranges of w's
// rows, one row at a time (one sequential stream reads at the memory's speed; several interleaved row streams
// measured 2x slower), and dots each row with every row of x (x stays in L1).
// More rows: x is transposed into panels of 16 rows (8 when M <= 8), xt [K, lanes]; each w element is
// broadcast against a panel row, so the outputs of one w row for a whole panel accumulate in one vector with
// no horizontal sums; a tile of R = 6 rows of w x 16 lanes keeps 12 accumulators in registers (93-95% of one
// core's FMA peak when its operands are in cache). Decode-sized x (one chunk of panels): each thread streams
// long ranges of w, each tile prefetching the next block of w. Prefill: the panels in chunks that stay in L2
// while blocks of w (from L1) pass over them. Every row of y is computed alone, in an order that depends only
// on the path (GEMV or panels): the rows' results never depend on the other rows or the thread count.
// (On this CPU's two cores: ~200 GFLOP/s of 233 peak for a prefill, MKL's sgemm ~185; 190 at decode.)

// bfloat16 weights: CH = 4 chains of sums per row (k in 16-blocks taken round robin, the chains added pairwise at
// the end; the same order for any MB, so a row's result does not depend on the other rows). One chain of fused
// multiply-adds waits on the previous add: 16 products per FMA latency (4 cycles) read 32 bytes of a bfloat16
// row, ~21 GB/s per core at 2.6 GHz, below the memory's speed (a float32 row's 64 bytes: 2x that, enough).
// On AVX2 (without AVX-512) a bfloat16 row is read in 32-byte pieces of 8 int32 lanes, each holding an even element
// (its low half) and the odd one after it (its high half): the odd ones as floats are an AND, the even ones a
// shift, and no shuffles (the 16-lane widening costs two vpmovzxwd per 16 values, which bound the GEMV at ~68% of
// the memory's speed on an EPYC). x comes permuted to match (eo_rows: per 16, the evens, then the odds), so one v16
// of it meets the same 16 weights; the sums run in that order, the same for any M and thread count.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool BF16_EO = true;
static inline v16 load_eo(const bf16* p) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)p);
    return {(v8)_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
            (v8)_mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)))};
}
#else
constexpr bool BF16_EO = false;
static inline v16 load_eo(const bf16* p) { return load(p); }
#endif
template <typename W>
static inline v16 load_row(const W* p) {
    if constexpr (sizeof(W) == 2 && BF16_EO) return load_eo(p);
    else return load(p);
}

// x [M, K] (row stride ldx) -> out [M, K] with each whole 16 of a row as its 8 even elements, then its 8 odd ones (the
// tail as it is): the order load_eo reads a bfloat16 row in
static void eo_rows(const float* x, long M, long ldx, long K, float* out) {
    for (long m = 0; m < M; m++) {
        const float* xr = x + m * ldx;
        float* o = out + m * K;
        long k = 0;
        for (; k + 16 <= K; k += 16)
            for (int i = 0; i < 8; i++) o[k + i] = xr[k + 2 * i], o[k + 8 + i] = xr[k + 2 * i + 1];
        for (; k < K; k++) o[k] = xr[k];
    }
}

template <int MB, typename W>
static inline void dot_rows(const float* x, long ldx, const W* w, long K, float* y, long ldy, float bias) {
    constexpr int CH = sizeof(W) == 2 ? 4 : 1;
    v16 acc[MB][CH];
    for (int m = 0; m < MB; m++)
        for (int c = 0; c < CH; c++) acc[m][c] = splat(0.0f);
    long k = 0;
    for (; k + 16 * CH <= K; k += 16 * CH)
        for (int c = 0; c < CH; c++) {
            v16 wv = load_row(w + k + 16 * c);
            for (int m = 0; m < MB; m++) acc[m][c] = fma16(load(x + m * ldx + k + 16 * c), wv, acc[m][c]);
        }
    for (; k + 16 <= K; k += 16) {  // (the last blocks, fewer than CH: chain 0)
        v16 wv = load_row(w + k);
        for (int m = 0; m < MB; m++) acc[m][0] = fma16(load(x + m * ldx + k), wv, acc[m][0]);
    }
    for (int m = 0; m < MB; m++) {
        if constexpr (CH == 4) acc[m][0] = (acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3]);
        float s = hsum(acc[m][0]);
        for (long kk = k; kk < K; kk++) s = std::fma(x[m * ldx + kk], to_f32(w[kk]), s);
        y[m * ldy] = s + bias;
    }
}

template <typename W>
static void linear_few(const float* x, long M, long ldx, const W* w, long n0, long n1, long K, const float* b,
                       float* y, long ldy) {
    for (long n = n0; n < n1; n++) {
        const W* wr = w + n * K;
        float bias = b ? b[n] : 0.0f;
        long m = 0;
        for (; m + 4 <= M; m += 4) dot_rows<4>(x + m * ldx, ldx, wr, K, y + m * ldy + n, ldy, bias);
        switch (M - m) {
            case 1: dot_rows<1>(x + m * ldx, ldx, wr, K, y + m * ldy + n, ldy, bias); break;
            case 2: dot_rows<2>(x + m * ldx, ldx, wr, K, y + m * ldy + n, ldy, bias); break;
            case 3: dot_rows<3>(x + m * ldx, ldx, wr, K, y + m * ldy + n, ldy, bias); break;
        }
    }
}

// One tile: out[r, l] = sum_k w[r ldw + k] xt[k, l] for R rows of w and a panel xt [K, 8 NV] of 8 NV rows of x.
// Per k: NV vector loads of xt, R broadcasts of w, R NV fused multiply-adds into 2 R NV accumulators that stay
// in registers (R = 6, NV = 2: 12 of AVX2's 16). Sums run over blocks of KB k's and each block's sum is added
// to the running total in `out`: rounding error grows with K / KB, not with K (as accurate as torch's sgemm;
// see tests/test_kernels.py). `next` (or nullptr): R rows (stride ldw) to pull towards L2 meanwhile, a line
// per 16 k's. `add`: the first block's sum is added to `out` too (a call over k's past a multiple of KB continues
// the sums of the calls before it, in the same order as one call over them all).
template <int NV, int R>
static inline void tile(const float* xt, const float* w, long ldw, long K, float* out, const float* next,
                        bool add = false);

#if defined(__AVX512F__)
// AVX-512, panels of 16 lanes: one 16-lane vector per k instead of two 8-lane halves. Every lane's sums run in
// the same order as the 8-lane tile's (lanes never mix), so the results are the same to the bit at twice the
// width per multiply-add.
template <int R>
static inline void tile16(const float* xt, const float* w, long ldw, long K, float* out, const float* next,
                          bool add) {
    constexpr long KB = 128;
    for (long k0 = 0; k0 < K; k0 += KB) {
        const long k1 = std::min(K, k0 + KB);
        v16 acc[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[r] = splat(0.0f);
        for (long k16 = k0; k16 < k1; k16 += 16) {
            if (next)
                for (int r = 0; r < R; r++) prefetch_l2(next + r * ldw + k16);
            const long k2 = std::min(k1, k16 + 16);
#pragma GCC unroll 4
            for (long k = k16; k < k2; k++) {
                const v16 xv = load(xt + k * 16);
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) acc[r] = fma16(splat(w[r * ldw + k]), xv, acc[r]);
            }
        }
        for (int r = 0; r < R; r++) store(out + r * 16, k0 == 0 && !add ? acc[r] : load(out + r * 16) + acc[r]);
    }
}
#endif

template <int NV, int R>
static inline void tile(const float* xt, const float* w, long ldw, long K, float* out, const float* next, bool add) {
#if defined(__AVX512F__)
    if constexpr (NV == 2) return tile16<R>(xt, w, ldw, K, out, next, add);
#endif
    constexpr long KB = 128;
    for (long k0 = 0; k0 < K; k0 += KB) {
        const long k1 = std::min(K, k0 + KB);
        v8 acc[R][NV];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
            for (int v = 0; v < NV; v++) acc[r][v] = splat8(0.0f);
        for (long k16 = k0; k16 < k1; k16 += 16) {  // (blocks start at multiples of 16)
            if (next)
                for (int r = 0; r < R; r++) prefetch_l2(next + r * ldw + k16);
            const long k2 = std::min(k1, k16 + 16);
#pragma GCC unroll 4
            for (long k = k16; k < k2; k++) {
                v8 xv[NV];
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) xv[v] = *(const v8*)(xt + (k * NV + v) * 8);
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) {
                    const v8 wv = splat8(w[r * ldw + k]);
                    for (int v = 0; v < NV; v++) acc[r][v] = fma8(wv, xv[v], acc[r][v]);
                }
            }
        }
        v8* o = (v8*)out;
        for (int r = 0; r < R; r++)
            for (int v = 0; v < NV; v++) o[r * NV + v] = k0 == 0 && !add ? acc[r][v] : o[r * NV + v] + acc[r][v];
    }
}

// tile<NV, rows> for 1 <= rows <= 6
template <int NV>
static inline void tile_rows(int rows, const float* xt, const float* w, long ldw, long K, float* out,
                             const float* next, bool add = false) {
    switch (rows) {
        case 6: tile<NV, 6>(xt, w, ldw, K, out, next, add); break;
        case 5: tile<NV, 5>(xt, w, ldw, K, out, next, add); break;
        case 4: tile<NV, 4>(xt, w, ldw, K, out, next, add); break;
        case 3: tile<NV, 3>(xt, w, ldw, K, out, next, add); break;
        case 2: tile<NV, 2>(xt, w, ldw, K, out, next, add); break;
        default: tile<NV, 1>(xt, w, ldw, K, out, next, add); break;
    }
}

// dst[k * ld + i] = src[i * lds + k] for 8 rows i and 8 columns k: eight 8-lane loads, three rounds of shuffles
static inline void transpose8(const float* src, long lds, float* dst, long ld) {
#if defined(__AVX2__)
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
#else
    for (int k = 0; k < 8; k++)
        for (int i = 0; i < 8; i++) dst[k * ld + i] = src[i * lds + k];
#endif
}

// rows n0 .. n1 - 1 of w against the panels [p0, p1) of xt [P, K, 8 NV]: y[m, n] (+ b[n]). Each block of R
// rows of w is read from memory once and then from L1 for the other panels. Tiles land in `stage`
// [panels, SUB, lanes] and go to y SUB columns at a time: y's rows are N floats apart, which for N = 3072 puts
// them all in one L1 set, and writing a few floats of each row per tile measured 15% slower. With yt (panels
// [P, ldt, lanes], ldt = w's row count) the tiles land there directly: no transposes, no stage.
// bfloat16 weights: each block of R rows is widened into float32 scratch KC columns at a time, and every panel's
// tiles run over that chunk (continuing their sums: the same order as over the whole row) before the next one, so
// the scratch (R KC floats) and the panels' columns of x stay in L1 together (the whole block widened at once,
// 24 KB for K = 1024, thrashed L1 against a panel's 32 KB: an 8-row step of bfloat16 GEMMs ran 1.25x float32's).
template <int NV, typename W>
static void panel_range(const float* xt, long M, long p0, long p1, const W* w, long n0, long n1, long K,
                        const float* b, float* y, long ldy, float* yt, long ldt) {
    constexpr int LANES = 8 * NV, R = 6;
    constexpr long SUB = 48, KC = 256;
    static thread_local std::vector<v8> stage_store;
    static thread_local std::vector<v16> wide_store;
    float* stage = yt ? nullptr : (float*)room(stage_store, (p1 - p0) * SUB * NV);
    float* wide = sizeof(W) == 4 ? nullptr : (float*)room(wide_store, (R * KC + 15) / 16);
    for (long n = n0; n < n1; n += SUB) {
        const long ns = std::min(SUB, n1 - n);
        for (long j = 0; j < ns; j += R) {
            const int rows = (int)std::min<long>(R, ns - j);
            const W* wn = w + (n + j) * K;
            auto out = [&](long p) {
                return yt ? yt + (p * ldt + n + j) * LANES : stage + ((p - p0) * SUB + j) * LANES;
            };
            if constexpr (sizeof(W) == 2) {
                for (long o = 0; o < R * K; o += 32) prefetch_l2(wn + R * K + o);  // the next block: a line per 32
                for (long kc = 0; kc < K; kc += KC) {
                    const long kn = std::min(KC, K - kc);
                    for (int r = 0; r < rows; r++) widen(wn + r * K + kc, kn, wide + r * kn);
                    for (long p = p0; p < p1; p++)
                        tile_rows<NV>(rows, xt + (p * K + kc) * LANES, wide, kn, kn, out(p), nullptr, kc > 0);
                }
            } else {
                for (long p = p0; p < p1; p++)  // w is read from memory on the first panel: prefetch the next block
                    tile_rows<NV>(rows, xt + p * K * LANES, (const float*)wn, K, K, out(p),
                                  p == p0 ? (const float*)(wn + R * K) : nullptr);
            }
            if (yt && b)
                for (long p = p0; p < p1; p++)
                    for (int r = 0; r < rows; r++)
                        for (int l = 0; l < LANES; l++) out(p)[r * LANES + l] += b[n + j + r];
        }
        if (yt) continue;
        for (long p = p0; p < p1; p++) {
            const long lanes = std::min((long)LANES, M - p * LANES);
            const float* st = stage + (p - p0) * SUB * LANES;
            float* yp = y + p * LANES * ldy + n;
            long l8 = 0, j8 = ns / 8 * 8;
            for (; l8 + 8 <= lanes; l8 += 8)  // 8 x 8 squares, then the bias
                for (long j = 0; j < j8; j += 8) {
                    transpose8(st + j * LANES + l8, LANES, yp + l8 * ldy + j, ldy);
                    if (b)
                        for (long l = l8; l < l8 + 8; l++)
                            for (long i = 0; i < 8; i++) yp[l * ldy + j + i] += b[n + j + i];
                }
            for (long l = 0; l < lanes; l++) {  // the rest: lanes past the squares, columns past j8
                float* yr = yp + l * ldy;
                for (long j = l < l8 ? j8 : 0; j < ns; j++) yr[j] = st[j * LANES + l] + (b ? b[n + j] : 0.0f);
            }
        }
    }
}

// xt[p] [K, lanes] = the transpose of x's rows p * lanes .., zero-padded past M
static void pack_panel(const float* x, long M, long ldx, long K, long lanes, long p, float* xt) {
    const long used = std::min(lanes, M - p * lanes);
    const float* src = x + p * lanes * ldx;
    float* dst = xt + p * K * lanes;
    long l = 0, k8 = K / 8 * 8;
    for (; l + 8 <= used; l += 8)  // whole 8 x 8 squares
        for (long k = 0; k < k8; k += 8) transpose8(src + l * ldx + k, ldx, dst + k * lanes + l, lanes);
    for (long k = 0; k < K; k++) {  // the rows past the squares (fewer than 8), and the zero lanes
        for (long i = l; i < used; i++) dst[k * lanes + i] = src[i * ldx + k];
        for (long i = used; i < lanes; i++) dst[k * lanes + i] = 0.0f;
    }
    for (long i = 0; i < l; i++)  // the squares' rows past the last whole 8 columns
        for (long k = k8; k < K; k++) dst[k * lanes + i] = src[i * ldx + k];
}

static inline long lanes_for(long M) { return M > 8 ? 16 : 8; }  // panels of 16 rows (8: no wasted lanes)

// x [M, K] (row stride ldx) packed into panels xt [P, K, lanes] (thread-local scratch, 64-byte aligned)
static float* pack(const float* x, long M, long ldx, long K, int nt) {
    static thread_local std::vector<float> xt;
    const long lanes = lanes_for(M), P = (M + lanes - 1) / lanes;
    float* xtp = room64(xt, P * K * lanes);
    parallel_for(P, 1, P * K >= 16384 ? nt : 1, [&](long p) { pack_panel(x, M, ldx, K, lanes, p, xtp); });
    return xtp;
}

// y = x w^T (+ b) for x in panels xtp [P, K, lanes] (M rows): into y's rows, or with yt into panels
// [P, N, lanes], the layout in which the next linear takes its input (zero lanes past M stay zero + b)
template <typename W>
static void linear_panels(const float* xtp, long M, const W* w, long N, long K, const float* b, float* y,
                          long ldy, float* yt, int nt) {
    const int threads = N * K >= 65536 ? nt : 1;
    const long lanes = lanes_for(M), P = (M + lanes - 1) / lanes;
    // the panels in chunks of about 384 KB, which stay in L2 while every row of w passes over them
    const long chunk = std::max(1L, (384L << 10) / (K * lanes * 4));
    auto range = [&](long p0, long p1, long n0, long n1) {
        if (lanes == 16)
            panel_range<2>(xtp, M, p0, p1, w, n0, n1, K, b, y, ldy, yt, N);
        else
            panel_range<1>(xtp, M, p0, p1, w, n0, n1, K, b, y, ldy, yt, N);
    };
    if (P <= chunk) {  // one chunk (decode): w streams once, in paired ranges
        paired_ranges(N, 48, threads, [&](long n0, long n1) { range(0, P, n0, n1); });
        return;
    }
    // many chunks (prefill): one item = one chunk x 96 rows of w, claimed in order, so the threads work on
    // the same chunk at the same time
    const long G = 96, groups = (N + G - 1) / G, chunks = (P + chunk - 1) / chunk;
    parallel_for(chunks * groups, 1, threads, [&](long i) {
        const long c = i / groups, g = i % groups;
        range(c * chunk, std::min(P, (c + 1) * chunk), g * G, std::min(N, (g + 1) * G));
    });
}

// The most rows the GEMV takes; more take the panels (chosen for path_m rows, alike by every caller: a row's result
// depends on the path, never on the other rows). float32: one. At 2..4 rows the panels' tiles already stream w at
// the memory's speed and the GEMV's 4-row dots did not ([M, 1024] x [4096, 1024]^T, 2-core EPYC: 0.49-0.55 ms
// against 0.54-0.80). bfloat16: 16. The panels widen w into scratch first, work per weight that held them at 1.25x
// float32's time at 8 rows; the GEMV widens in registers (8 rows 0.49-0.53 ms against 0.70, 12 rows 0.78 against
// 1.19-1.30, 16 rows level).
template <typename W>
constexpr long gemv_rows() { return sizeof(W) == 2 ? 16 : 1; }

template <typename W>
static void linear(const float* x, long M, long ldx, const W* w, long N, long K, const float* b, float* y,
                   long ldy, int nt, long path_m) {
    if (path_m <= gemv_rows<W>()) {
        const int threads = N * K >= 65536 ? nt : 1;
        if constexpr (sizeof(W) == 2 && BF16_EO) {  // x in the order load_eo reads the rows (dot_rows)
            static thread_local std::vector<float> eo_store;
            float* xe = room(eo_store, M * K + 1);
            eo_rows(x, M, ldx, K, xe);
            x = xe, ldx = K;
        }
        paired_ranges(N, 16, threads, [&](long n0, long n1) { linear_few(x, M, ldx, w, n0, n1, K, b, y, ldy); });
        return;
    }
    linear_panels(pack(x, M, ldx, K, nt), M, w, N, K, b, y, ldy, nullptr, nt);
}

extern "C" void zoo_linear(const float* x, long M, long ldx, const float* w, long N, long K, const float* b,
                           float* y, long ldy, int nt) {
    linear(x, M, ldx, w, N, K, b, y, ldy, nt, M);
}

// the same with bfloat16 weights w [N, K] (float32 x, bias, y and arithmetic)
extern "C" void zoo_linear_bf16(const float* x, long M, long ldx, const bf16* w, long N, long K, const float* b,
                                float* y, long ldy, int nt) {
    linear(x, M, ldx, w, N, K, b, y, ldy, nt, M);
}

// ---------------------------------------------------------------------------------------------------
// Linear over block-quantised weights (GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; loader/quant.py): y = x w^T
// (+ b) with w's rows stored as blocks. A block is unpacked into int8 values q and float scales (one per
// sub-block of SUB elements) and, for the types with a minimum (Q4_1, Q4_K, Q5_K), offsets (one per 32):
// w = scale q + offset. The GEMV (M <= 4) never writes w out: per sub-block it forms sum q x in registers,
// adds scale times that to the row's accumulator, and offset times sum x (the row of x's sums per 32,
// computed once per call): float32 math on the dequantised values, in another order (the float path sums
// w x; this sums q x, then scales). More rows: 48 rows of w at a time are dequantised (w = scale q + offset,
// the values the gguf package's dequantiser gives) into a thread-local float panel that the float GEMM's
// tiles run over. A weight may be several row segments of different types (a fused q/k/v: Q4_K, Q4_K, Q6_K).

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct QMat {  // mirrored by zoo/kernels/__init__.py's QMat
    long nseg, K;
    long rows[4], type[4];
    const uint8_t* data[4];
};

static inline long q_block(long type) { return type == Q4_K || type == Q5_K || type == Q6_K ? 256 : 32; }
static inline long q_block_bytes(long type) {
    switch (type) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        default: return 210;  // Q6_K
    }
}
static inline long q_row_bytes(long type, long K) { return K / q_block(type) * q_block_bytes(type); }

static inline float half_to_float(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) bits = sign | 0x7f800000 | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else {  // subnormal
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

struct Unpacked {
    alignas(64) int8_t q[256];
    float scale[16], off[8];
};

// the 6-bit scale and min j of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4)
static inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63, m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// one block of type T -> its int8 values (in u.q, or in the block itself for Q8_0), scales and offsets
template <int T>
static inline const int8_t* unpack(const uint8_t* b, Unpacked& u) {
    if (T == Q8_0) {
        u.scale[0] = half_to_float(b);
        return (const int8_t*)(b + 2);
    }
    if (T == Q4_0 || T == Q4_1) {
        const uint8_t* qs = b + (T == Q4_1 ? 4 : 2);
        const int8_t sub = T == Q4_0 ? 8 : 0;
        for (int j = 0; j < 16; j++) {
            u.q[j] = (int8_t)((qs[j] & 0xF) - sub);
            u.q[j + 16] = (int8_t)((qs[j] >> 4) - sub);
        }
        u.scale[0] = half_to_float(b);
        if (T == Q4_1) u.off[0] = half_to_float(b + 2);
        return u.q;
    }
    if (T == Q4_K || T == Q5_K) {
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        const uint8_t* sc = b + 4;
        const uint8_t* qh = b + 16;  // Q5_K: the fifth bits
        const uint8_t* qs = b + (T == Q5_K ? 48 : 16);
        for (int c = 0; c < 4; c++) {
            for (int l = 0; l < 32; l++) {
                int lo = qs[c * 32 + l] & 0xF, hi = qs[c * 32 + l] >> 4;
                if (T == Q5_K) {
                    lo += ((qh[l] >> (2 * c)) & 1) << 4;
                    hi += ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
                u.q[c * 64 + l] = (int8_t)lo;
                u.q[c * 64 + 32 + l] = (int8_t)hi;
            }
        }
        for (int j = 0; j < 8; j++) {
            int s, m;
            scale_min_k4(j, sc, s, m);
            u.scale[j] = d * (float)s;
            u.off[j] = -(dmin * (float)m);
        }
        return u.q;
    }
    // Q6_K: ql[128], qh[64], int8 scales[16] (one per 16), f16 d
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = (const int8_t*)(b + 192);
    const float d = half_to_float(b + 208);
    for (int n = 0; n < 2; n++) {
        const uint8_t* l0 = ql + n * 64;
        const uint8_t* h0 = qh + n * 32;
        int8_t* q = u.q + n * 128;
        for (int l = 0; l < 32; l++) {
            q[l] = (int8_t)(((l0[l] & 0xF) | (((h0[l] >> 0) & 3) << 4)) - 32);
            q[l + 32] = (int8_t)(((l0[l + 32] & 0xF) | (((h0[l] >> 2) & 3) << 4)) - 32);
            q[l + 64] = (int8_t)(((l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4)) - 32);
            q[l + 96] = (int8_t)(((l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4)) - 32);
        }
    }
    for (int j = 0; j < 16; j++) u.scale[j] = d * (float)sc[j];
    return u.q;
}

template <int T> constexpr int q_sub() { return T == Q6_K ? 16 : 32; }
template <int T> constexpr int q_elems() { return T == Q4_K || T == Q5_K || T == Q6_K ? 256 : 32; }
template <int T> constexpr bool q_has_off() { return T == Q4_1 || T == Q4_K || T == Q5_K; }

typedef int8_t c8 __attribute__((vector_size(8), aligned(1)));
static inline v8 q8_to_float(const int8_t* q) { return __builtin_convertvector(__builtin_convertvector(*(const c8*)q, i8), v8); }
static inline v8 load8(const float* p) {
    v8 r;
    memcpy(&r, p, 32);
    return r;
}

// y[m] = w_row . x[m] for MB rows of x; xs [MB, K / 32] (stride ldxs): x's sums per 32 (types with offsets)
template <int T, int MB>
static inline void qdot_rows(const uint8_t* row, long K, const float* x, long ldx, const float* xs, long ldxs,
                             float* y, long ldy, float bias) {
    constexpr int E = q_elems<T>(), S = q_sub<T>();
    constexpr long BB = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q8_0 ? 34 : T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
    v8 acc[MB];
    float off[MB];
    for (int m = 0; m < MB; m++) acc[m] = splat8(0.0f), off[m] = 0.0f;
    Unpacked u;
    const long nb = K / E;
    for (long bi = 0; bi < nb; bi++) {
        const int8_t* q = unpack<T>(row + bi * BB, u);
        const long k0 = bi * E;
#pragma GCC unroll 16
        for (int j = 0; j < E / S; j++) {
            v8 f[S / 8];
            for (int g = 0; g < S / 8; g++) f[g] = q8_to_float(q + j * S + g * 8);
            const v8 sc = splat8(u.scale[j]);
            for (int m = 0; m < MB; m++) {
                const float* xr = x + m * ldx + k0 + j * S;
                v8 s = f[0] * load8(xr);
                for (int g = 1; g < S / 8; g++) s = fma8(f[g], load8(xr + g * 8), s);
                acc[m] = fma8(sc, s, acc[m]);
            }
        }
        if (q_has_off<T>())
            for (int j = 0; j < E / 32; j++)
                for (int m = 0; m < MB; m++) off[m] = std::fma(u.off[j], xs[m * ldxs + k0 / 32 + j], off[m]);
    }
    for (int m = 0; m < MB; m++) {
        v4 h = __builtin_shufflevector(acc[m], acc[m], 0, 1, 2, 3) + __builtin_shufflevector(acc[m], acc[m], 4, 5, 6, 7);
        y[m * ldy] = ((h[0] + h[2]) + (h[1] + h[3])) + off[m] + bias;
    }
}

// The blocks of 32 with one scale (Q4_0, Q4_1, Q8_0): the block's values widened to two v16 of floats in
// registers (16 nibbles or int8 at a time: vpmovzxbd / vpmovsxbd + vcvtdq2ps), never written to memory; per
// lane s = q[l] x[l] + q[16 + l] x[16 + l], then acc += scale s (A accumulators, and A offset sums, over
// blocks in turn: 4 for one row of x, 2 for two, to break the chains of fused multiply-adds that bound the
// GEMV's speed otherwise); the offset (Q4_1's minimum) times x's sum per 32 as in qdot_rows. Float32 math on
// the dequantised values, in another order.
typedef uint8_t u8x16 __attribute__((vector_size(16)));

static inline u8x16 load16(const uint8_t* p) {
    u8x16 v;
    memcpy(&v, p, 16);
    return v;
}

// 16 bytes (int8 when SIGNED, else uint8) -> 16 floats, exactly: vpmovsxbd / vpmovzxbd + vcvtdq2ps (intrinsics:
// GCC widened int8 vectors of __builtin_convertvector byte by byte)
template <bool SIGNED>
static inline v16 widen16(u8x16 q) {
#if defined(__AVX512F__)
    const __m128i v = (__m128i)q;
    return (v16)_mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
#elif defined(__AVX2__)
    const __m128i v = (__m128i)q, h = _mm_unpackhi_epi64(v, v);
    const __m256 a = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
    const __m256 c = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h));
    return {(v8)a, (v8)c};
#else
    float r[16];
    for (int i = 0; i < 16; i++) r[i] = SIGNED ? (float)(int8_t)q[i] : (float)q[i];
    return load(r);
#endif
}

template <int T>
static inline void widen_block32(const uint8_t* b, v16& f0, v16& f1) {
    if constexpr (T == Q8_0) {
        f0 = widen16<true>(load16(b + 2));
        f1 = widen16<true>(load16(b + 18));
    } else {
        const u8x16 qs = load16(b + (T == Q4_1 ? 4 : 2));
        f0 = widen16<false>(qs & (uint8_t)0xF);
        f1 = widen16<false>(qs >> 4);
        if constexpr (T == Q4_0) f0 = f0 - splat(8.0f), f1 = f1 - splat(8.0f);  // (exact)
    }
}

template <int T, int MB>
static inline void qdot_rows32(const uint8_t* row, long K, const float* x, long ldx, const float* xs, long ldxs,
                               float* y, long ldy, float bias) {
    constexpr long BB = T == Q4_0 ? 18 : T == Q4_1 ? 20 : 34;
    constexpr int A = MB == 1 ? 4 : MB == 2 ? 2 : 1;
    v16 acc[A][MB];
    float off[A][MB];
    for (int m = 0; m < MB; m++)
        for (int a = 0; a < A; a++) acc[a][m] = splat(0.0f), off[a][m] = 0.0f;
    const long nb = K / 32;
    auto block = [&](long bi, v16* acc_a, float* off_a) {
        const uint8_t* b = row + bi * BB;
        v16 f0, f1;
        widen_block32<T>(b, f0, f1);
        const v16 sc = splat(half_to_float(b));
        for (int m = 0; m < MB; m++) {
            const float* xr = x + m * ldx + bi * 32;
            acc_a[m] = fma16(sc, fma16(f1, load(xr + 16), f0 * load(xr)), acc_a[m]);
        }
        if constexpr (T == Q4_1) {
            const float mn = half_to_float(b + 2);
            for (int m = 0; m < MB; m++) off_a[m] = std::fma(mn, xs[m * ldxs + bi], off_a[m]);
        }
    };
    long bi = 0;
    for (; bi + A <= nb; bi += A)
        for (int a = 0; a < A; a++) block(bi + a, acc[a], off[a]);
    for (; bi < nb; bi++) block(bi, acc[0], off[0]);
    for (int m = 0; m < MB; m++) {
        v16 t = acc[0][m];
        float o = off[0][m];
        for (int a = 1; a < A; a++) t = t + acc[a][m], o = o + off[a][m];
        y[m * ldy] = hsum(t) + o + bias;
    }
}

template <int T, int MB>
static inline void qdot(const uint8_t* row, long K, const float* x, long ldx, const float* xs, long ldxs, float* y,
                        long ldy, float bias) {
    if constexpr (T == Q4_0 || T == Q4_1 || T == Q8_0) qdot_rows32<T, MB>(row, K, x, ldx, xs, ldxs, y, ldy, bias);
    else qdot_rows<T, MB>(row, K, x, ldx, xs, ldxs, y, ldy, bias);
}

template <int T>
static void qlinear_few_t(const uint8_t* w, long n0, long n1, long K, const float* x, long M, long ldx,
                          const float* xs, long ldxs, const float* b, float* y, long ldy) {
    const long rb = q_row_bytes(T, K);
    for (long n = n0; n < n1; n++) {
        const uint8_t* wr = w + n * rb;
        const float bias = b ? b[n] : 0.0f;
        long m = 0;
        for (; m + 4 <= M; m += 4) qdot<T, 4>(wr, K, x + m * ldx, ldx, xs + m * ldxs, ldxs, y + m * ldy + n, ldy, bias);
        switch (M - m) {
            case 1: qdot<T, 1>(wr, K, x + m * ldx, ldx, xs + m * ldxs, ldxs, y + m * ldy + n, ldy, bias); break;
            case 2: qdot<T, 2>(wr, K, x + m * ldx, ldx, xs + m * ldxs, ldxs, y + m * ldy + n, ldy, bias); break;
            case 3: qdot<T, 3>(wr, K, x + m * ldx, ldx, xs + m * ldxs, ldxs, y + m * ldy + n, ldy, bias); break;
        }
    }
}

// rows n0 .. n1 - 1 of one segment (w: its first row; b, y: already offset to the segment's first column)
static void qlinear_few(long type, const uint8_t* w, long n0, long n1, long K, const float* x, long M, long ldx,
                        const float* xs, long ldxs, const float* b, float* y, long ldy) {
    switch (type) {
        case Q4_0: qlinear_few_t<Q4_0>(w, n0, n1, K, x, M, ldx, xs, ldxs, b, y, ldy); break;
        case Q4_1: qlinear_few_t<Q4_1>(w, n0, n1, K, x, M, ldx, xs, ldxs, b, y, ldy); break;
        case Q8_0: qlinear_few_t<Q8_0>(w, n0, n1, K, x, M, ldx, xs, ldxs, b, y, ldy); break;
        case Q4_K: qlinear_few_t<Q4_K>(w, n0, n1, K, x, M, ldx, xs, ldxs, b, y, ldy); break;
        case Q5_K: qlinear_few_t<Q5_K>(w, n0, n1, K, x, M, ldx, xs, ldxs, b, y, ldy); break;
        case Q6_K: qlinear_few_t<Q6_K>(w, n0, n1, K, x, M, ldx, xs, ldxs, b, y, ldy); break;
    }
}

// one row of a segment, dequantised: out[k] = scale q + offset (as the gguf package computes it)
template <int T>
static void dequant_row_t(const uint8_t* row, long K, float* out) {
    constexpr int E = q_elems<T>(), S = q_sub<T>();
    const long rb = q_row_bytes(T, K);
    (void)rb;
    Unpacked u;
    for (long bi = 0; bi < K / E; bi++) {
        const int8_t* q = unpack<T>(row + bi * q_block_bytes(T), u);
        float* o = out + bi * E;
        for (int i = 0; i < E; i++) {
            const float w = u.scale[i / S] * (float)q[i];
            o[i] = q_has_off<T>() ? w + u.off[i / 32] : w;
        }
    }
}

static void dequant_row(long type, const uint8_t* row, long K, float* out) {
    switch (type) {
        case Q4_0: dequant_row_t<Q4_0>(row, K, out); break;
        case Q4_1: dequant_row_t<Q4_1>(row, K, out); break;
        case Q8_0: dequant_row_t<Q8_0>(row, K, out); break;
        case Q4_K: dequant_row_t<Q4_K>(row, K, out); break;
        case Q5_K: dequant_row_t<Q5_K>(row, K, out); break;
        case Q6_K: dequant_row_t<Q6_K>(row, K, out); break;
    }
}

// row n of the whole weight (its segment found) -> out [K]
static void qmat_row(const QMat& w, long n, float* out) {
    for (long s = 0; s < w.nseg; n -= w.rows[s], s++)
        if (n < w.rows[s]) return dequant_row(w.type[s], w.data[s] + n * q_row_bytes(w.type[s], w.K), w.K, out);
}

static long qmat_rows(const QMat& w) {
    long n = 0;
    for (long s = 0; s < w.nseg; s++) n += w.rows[s];
    return n;
}

// fn(type, data, a, e, first) for each segment that rows [n0, n1) of w meet: its rows [a, e) counted from the
// segment's first row, `first` the segment's first row in w (where its outputs and biases start)
template <typename Fn>
static void each_segment(const QMat& w, long n0, long n1, const Fn& fn) {
    long first = 0;
    for (long g = 0; g < w.nseg; first += w.rows[g], g++) {
        const long a = std::max(n0, first), e = std::min(n1, first + w.rows[g]);
        if (a < e) fn(w.type[g], w.data[g], a - first, e - first, first);
    }
}

// ---------------------------------------------------------------------------------------------------
// int8 / int16 activations (decode, M <= 4; Q4_0, Q4_1, Q8_0 weights): each row of x is quantised once per call,
// per block of 32, to integers X: int8 as llama.cpp's Q8_1, dx = max|x| / 127, or int16, dx = max|x| / 32767;
// qx = round(x / dx) (to nearest even; x times the float 1 / dx), and sx = dx sum qx. A weight block (dw, qw, and
// Q4_1's minimum mw; Q4_0 as qw - 8, i.e. mw = -8 dw) then gives y += (dw dx) sum qw qx + mw sx, the sum of
// products in integers, exact: int8, u8 x s8 products summed in pairs into int16 (_mm256_maddubs_epi16,
// |pair| <= 2 * 128 * 127 < 2^15), then into int32 (_mm256_madd_epi16); int16, the weights widened to int16
// (vpmovzxbw / vpmovsxbw), the products summed in pairs into int32 (_mm256_madd_epi16: |pair| <= 2 * 128 * 32767
// < 2^31; a block's 32 <= 2^27, rounded to float32 in the multiply-add); then one float multiply-add per block (8
// lanes, summed at the end of the row). Against float32 math on the dequantised weights the error is that of x's
// rounding: |y - w . x| <= sum_k |w_k| dx(k) / 2 (+ float32 rounding), 258x smaller with int16; tests/test_quant.py
// checks both. zoo_set_act_bits picks (ZOO_QUANT_ACT, zoo/kernels/__init__.py): 16, zoo run's default; 8, opt-in;
// 0 float32 math, which the K-quants and M > 4 keep either way.
// Why int16: on SmolLM2-135M (Q4_1, Q8_0 head) int8 rounding costs top-1 agreement in every matrix class, none
// dominant (each alone, 512 teacher-forced positions: the head, gate_up 8 misses, down 6, q/k/v 4, o 3; all: 11-17,
// 0.967-0.979; KL mean 2e-3), so no per-matrix choice reaches 99%; int16 everywhere: 512 / 512, KL mean 3.3e-8
// (README, issue 19), at 1.15-1.18x int8's time per token (bench/quant.py; a block of int16 x takes two loads of
// x and two madds where int8 takes one load, a maddubs and a madd, and x is twice the bytes).
// Speed (batch-1 decode of the embedded Q4_1 default, 2 cores of an AVX2-only EPYC): the hardware prefetcher
// alone held a core's stream over these short rows at ~5.7 GB/s; each block now prefetches the bytes QPF ahead
// (7.1 GB/s, one thread; without it the whole step was 1.4x slower). A row's accumulators stay in registers (a
// runtime index had kept them on the stack), M = 1 takes two rows of Q4_0 / Q4_1 per pass (their offset sums
// are serial chains), x is quantised 8 lanes at a time (3x faster, the same values): an int8 step 0.72x its time
// before these (pairs in turn, load 2.7; results equal to the bit). int16 took the same code (it had one row of
// w a pass): its step 0.97x, the GEMVs alone 0.93x (5.86 -> 5.67 ms/token, medians of 5 bench/quant.py runs in
// turn, load 0.9-1.7; results equal to the bit: each row's arithmetic, and the lanes of idot32, are unchanged).
static int g_act_bits = 0;  // the activations' bits: 0 (float32 math), 8 or 16 (set from Python at load)
extern "C" int zoo_set_act_bits(int bits) {
    const int was = g_act_bits;
    if (bits >= 0) g_act_bits = bits;
    return was;
}

// value l (0..31) of a Q4_0 / Q4_1 / Q8_0 block as the integer the block stores (the portable integer loops)
template <int T>
static inline int block_q(const uint8_t* b, int l) {
    if constexpr (T == Q8_0) return (int)(int8_t)b[2 + l];
    else return (b[(T == Q4_1 ? 4 : 2) + (l & 15)] >> (l < 16 ? 0 : 4)) & 0xF;
}

template <typename X>  // int8_t or int16_t
struct XQ {  // x quantised: q [M, K], ds [M, K / 32, 2]: each block's (dx, sx) side by side
    const X* q;
    const float* ds;
    long K;
};

template <typename X>
static void quantize_rows(const float* x, long M, long ldx, long K, X* q, float* ds) {
    constexpr float QMAX = sizeof(X) == 1 ? 127.0f : 32767.0f;
    for (long m = 0; m < M; m++)
        for (long j = 0; j < K / 32; j++) {
            const float* xr = x + m * ldx + j * 32;
            X* qr = q + m * K + j * 32;
            float* dsj = ds + 2 * (m * (K / 32) + j);
#if defined(__AVX2__)  // the scalar loop's values, 8 at a time (a maximum, and integer sums, in any order)
            __m256 v[4], a = _mm256_setzero_ps();
            const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
            for (int c = 0; c < 4; c++) {
                v[c] = _mm256_loadu_ps(xr + 8 * c);
                a = _mm256_max_ps(_mm256_and_ps(v[c], abs), a);  // (a NaN x: a kept, as std::max(amax, NaN))
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float dx = _mm_cvtss_f32(h) / QMAX, id = dx != 0.0f ? 1.0f / dx : 0.0f;
            __m256i iv[4], sum = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {  // vroundps in the current mode (to nearest even), as nearbyint
                iv[c] = _mm256_cvtps_epi32(
                    _mm256_round_ps(_mm256_mul_ps(v[c], _mm256_set1_ps(id)), _MM_FROUND_CUR_DIRECTION));
                sum = _mm256_add_epi32(sum, iv[c]);
            }
            // int32 -> X (|v| <= QMAX: no saturation); the packs interleave 128-bit lanes, the permutes undo it
            const __m256i p0 = _mm256_packs_epi32(iv[0], iv[1]), p1 = _mm256_packs_epi32(iv[2], iv[3]);
            if constexpr (sizeof(X) == 1) {
                _mm256_storeu_si256((__m256i*)qr, _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p0, p1),
                                                                              _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            } else {
                _mm256_storeu_si256((__m256i*)qr, _mm256_permute4x64_epi64(p0, 0xD8));
                _mm256_storeu_si256((__m256i*)(qr + 16), _mm256_permute4x64_epi64(p1, 0xD8));
            }
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
            const int total = _mm_cvtsi128_si32(t);
#else
            float amax = 0.0f;
            for (int l = 0; l < 32; l++) amax = std::max(amax, std::fabs(xr[l]));
            const float dx = amax / QMAX, id = dx != 0.0f ? 1.0f / dx : 0.0f;
            int total = 0;
            for (int l = 0; l < 32; l++) {  // |x * id| <= QMAX + a few ulps: no clamp needed
                const int v = (int)std::nearbyint(xr[l] * id);  // (the default rounding: to nearest even)
                qr[l] = (X)v;
                total += v;
            }
#endif
            dsj[0] = dx;
            dsj[1] = dx * (float)total;
        }
}

#if defined(__AVX2__)
// a block's 32 weights as idot32 takes them: for int8 x, its 32 bytes in w[0] (unsigned 0..15, Q8_0 signed); for
// int16 x, values 0..15 in w[0] and 16..31 in w[1] widened to int16
template <int T, typename X>
static inline void wload(const uint8_t* b, __m256i w[2]) {
    if constexpr (T == Q8_0 && sizeof(X) == 1) {
        w[0] = _mm256_loadu_si256((const __m256i*)(b + 2));
    } else if constexpr (T == Q8_0) {
        w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 2)));
        w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 18)));
    } else {  // (Q4_0 / Q4_1: the low nibbles are values 0..15, the high ones 16..31)
        const __m128i qs = _mm_loadu_si128((const __m128i*)(b + (T == Q4_1 ? 4 : 2)));
        if constexpr (sizeof(X) == 1) {
            w[0] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0xF));
        } else {
            w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(qs, _mm_set1_epi8(0xF)));
            w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(qs, 4), _mm_set1_epi8(0xF)));
        }
    }
}

// the 32 integer products of one block, weights w (wload's) against the activations xq, summed into 8 int32
// lanes (as 8 floats). Each X sums its own products into lane i (int8: bytes 4i..4i+3 of w[0]; int16: values 2i,
// 2i + 1, 2i + 16, 2i + 17): the float sums after depend on which, and each kept the lanes it had alone.
template <int T, typename X>
static inline __m256 idot32(const __m256i w[2], const X* xq) {
    __m256i p;
    if constexpr (sizeof(X) == 2) {
        p = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i*)xq)),
                             _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i*)(xq + 16))));
    } else {
        const __m256i x8 = _mm256_loadu_si256((const __m256i*)xq);
        if constexpr (T == Q8_0)  // (maddubs takes unsigned bytes first: |w|, and x with w's sign)
            p = _mm256_maddubs_epi16(_mm256_sign_epi8(w[0], w[0]), _mm256_sign_epi8(x8, w[0]));
        else p = _mm256_maddubs_epi16(w[0], x8);
        p = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
    }
    return _mm256_cvtepi32_ps(p);
}
#endif

// y[m, r] = row r . x[m] for RW rows of w (rb bytes apart) and MB rows of x. Per block, its scale and minimum
// leave f16 in one conversion, [dw, mw] (Q4_0: [dw, -8 dw]), and meet x's [dx, sx] in one multiply-add: lane 0
// gives the products' scale dw dx, lane 1 the offset sum, fma(mw, sx, off) block after block (the scalar loop's
// roundings in fewer instructions). A row's offset sum is one chain of multiply-adds (4 cycles a block, longer
// than the block's other work): two rows of w per x (RW = 2, decode's M = 1) run two chains side by side, and
// each row's arithmetic stays what it is alone.
static constexpr long QPF = 1536;  // bytes of w prefetched ahead
template <int T, typename X, int RW, int MB>
static inline void qdot_int(const uint8_t* row, long rb, long K, const XQ<X>& x, float* y, long ldy,
                            const float* bias) {
    constexpr long BB = T == Q4_0 ? 18 : T == Q4_1 ? 20 : 34;
    const long nb = K / 32;
#if defined(__AVX2__)
    constexpr int A = MB == 1 ? 2 : 1;  // accumulators per row of x (two chains of multiply-adds for one row)
    __m256 acc[RW][A][MB];
    __m128 off[RW][MB];
    for (int r = 0; r < RW; r++)
        for (int m = 0; m < MB; m++) {
            off[r][m] = _mm_setzero_ps();
            for (int a = 0; a < A; a++) acc[r][a][m] = _mm256_setzero_ps();
        }
    // block bi into acc[bi % A]; A blocks per iteration, so that a is a constant and acc stays in registers (a
    // runtime index kept it on the stack: a store and a reload in every block's chain of multiply-adds)
    for (long b0 = 0; b0 < nb; b0 += A)
#pragma GCC unroll 2
        for (int a = 0; a < A; a++) {
            const long bi = b0 + a;
            if (A > 1 && bi >= nb) break;
#pragma GCC unroll 2
            for (int r = 0; r < RW; r++) {
                const uint8_t* b = row + r * rb + bi * BB;
                _mm_prefetch((const char*)b + QPF, _MM_HINT_T0);
                __m256i wq[2];
                wload<T, X>(b, wq);
                uint32_t h2;  // the block's first two f16 (Q4_0, Q8_0: dw and two bytes of q, not used)
                memcpy(&h2, b, 4);
                __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)h2));
                if constexpr (T == Q4_0) dm = _mm_mul_ps(_mm_moveldup_ps(dm), _mm_setr_ps(1.0f, -8.0f, 0.0f, 0.0f));
#pragma GCC unroll 4
                for (int m = 0; m < MB; m++) {
                    const __m128 ds = _mm_castpd_ps(_mm_load_sd((const double*)(x.ds + 2 * (m * nb + bi))));
                    const __m256 p = idot32<T>(wq, x.q + m * x.K + bi * 32);
                    acc[r][a][m] = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_mul_ss(dm, ds)), p, acc[r][a][m]);
                    if constexpr (T != Q8_0) off[r][m] = _mm_fmadd_ps(dm, ds, off[r][m]);
                }
            }
        }
    for (int r = 0; r < RW; r++)
        for (int m = 0; m < MB; m++) {
            __m256 t = acc[r][0][m];
            for (int a = 1; a < A; a++) t = _mm256_add_ps(t, acc[r][a][m]);
            const __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
            float v[4], o[4];
            _mm_storeu_ps(v, h);
            _mm_storeu_ps(o, off[r][m]);
            y[m * ldy + r] = ((v[0] + v[2]) + (v[1] + v[3])) + o[1] + (bias ? bias[r] : 0.0f);
        }
#else  // the same integers and scales, one block at a time (no AVX2: a portable loop, not tuned)
    for (int r = 0; r < RW; r++)
        for (int m = 0; m < MB; m++) {
            float acc = 0.0f, off = 0.0f;
            for (long bi = 0; bi < nb; bi++) {
                const uint8_t* b = row + r * rb + bi * BB;
                const X* xq = x.q + m * x.K + bi * 32;
                const float* ds = x.ds + 2 * (m * nb + bi);
                int sum = 0;
                for (int l = 0; l < 32; l++) sum += block_q<T>(b, l) * xq[l];
                const float dw = half_to_float(b);
                acc = std::fma(dw * ds[0], (float)sum, acc);
                if (T != Q8_0) off = std::fma(T == Q4_1 ? half_to_float(b + 2) : -8.0f * dw, ds[1], off);
            }
            y[m * ldy + r] = acc + off + (bias ? bias[r] : 0.0f);
        }
#endif
}

template <int T, typename X>
static void qlinear_int_t(const uint8_t* w, long n0, long n1, long K, const XQ<X>& x, long M, const float* b,
                          float* y, long ldy) {
    const long rb = q_row_bytes(T, K), nb = K / 32;
    long n = n0;
    if (M == 1 && T != Q8_0)  // (Q8_0 has no offset sum: one row at a time streams faster)
        for (; n + 2 <= n1; n += 2) qdot_int<T, X, 2, 1>(w + n * rb, rb, K, x, y + n, ldy, b ? b + n : nullptr);
    for (; n < n1; n++) {
        const uint8_t* wr = w + n * rb;
        const float* bias = b ? b + n : nullptr;
        long m = 0;
        for (; m + 4 <= M; m += 4) {
            const XQ<X> xm{x.q + m * K, x.ds + 2 * m * nb, K};
            qdot_int<T, X, 1, 4>(wr, rb, K, xm, y + m * ldy + n, ldy, bias);
        }
        const XQ<X> xm{x.q + m * K, x.ds + 2 * m * nb, K};
        switch (M - m) {
            case 1: qdot_int<T, X, 1, 1>(wr, rb, K, xm, y + m * ldy + n, ldy, bias); break;
            case 2: qdot_int<T, X, 1, 2>(wr, rb, K, xm, y + m * ldy + n, ldy, bias); break;
            case 3: qdot_int<T, X, 1, 3>(wr, rb, K, xm, y + m * ldy + n, ldy, bias); break;
        }
    }
}

static bool int_act_types(const QMat& w) {  // integer activations on: every segment Q4_0 / Q4_1 / Q8_0
    if (!g_act_bits || w.K % 32) return false;
    for (long s = 0; s < w.nseg; s++)
        if (w.type[s] != Q4_0 && w.type[s] != Q4_1 && w.type[s] != Q8_0) return false;
    return true;
}

template <typename X>
static void qlinear_int(const float* x, long M, long ldx, const QMat& w, const float* b, float* y, long ldy,
                        int threads) {
    const long N = qmat_rows(w), K = w.K;
    static thread_local std::vector<X> q_store;
    static thread_local std::vector<float> ds_store;
    X* q = room(q_store, M * K + 32);
    float* ds = room(ds_store, 2 * M * (K / 32) + 2);
    quantize_rows(x, M, ldx, K, q, ds);
    const XQ<X> xq{q, ds, K};
    paired_ranges(N, 16, threads, [&](long n0, long n1) {
        each_segment(w, n0, n1, [&](long type, const uint8_t* data, long a, long e, long first) {
            const float* bb = b ? b + first : nullptr;
            switch (type) {
                case Q4_0: qlinear_int_t<Q4_0>(data, a, e, K, xq, M, bb, y + first, ldy); break;
                case Q4_1: qlinear_int_t<Q4_1>(data, a, e, K, xq, M, bb, y + first, ldy); break;
                case Q8_0: qlinear_int_t<Q8_0>(data, a, e, K, xq, M, bb, y + first, ldy); break;
            }
        });
    });
}

static void qlinear(const float* x, long M, long ldx, const QMat& w, const float* b, float* y, long ldy, int nt,
                    long path_m) {
    const long N = qmat_rows(w), K = w.K;
    const int threads = N * K >= 65536 ? nt : 1;
    if (path_m <= 4) {
        if (int_act_types(w))
            return g_act_bits == 16 ? qlinear_int<int16_t>(x, M, ldx, w, b, y, ldy, threads)
                                    : qlinear_int<int8_t>(x, M, ldx, w, b, y, ldy, threads);
        static thread_local std::vector<float> xs_store;
        const long ldxs = K / 32;
        float* xs = room(xs_store, M * ldxs + 1);
        for (long m = 0; m < M; m++)  // x's sums per 32, for the offsets
            for (long j = 0; j < ldxs; j++) {
                const float* xr = x + m * ldx + j * 32;
                v8 s = load8(xr) + load8(xr + 8) + load8(xr + 16) + load8(xr + 24);
                v4 h = __builtin_shufflevector(s, s, 0, 1, 2, 3) + __builtin_shufflevector(s, s, 4, 5, 6, 7);
                xs[m * ldxs + j] = (h[0] + h[2]) + (h[1] + h[3]);
            }
        paired_ranges(N, 16, threads, [&](long n0, long n1) {
            each_segment(w, n0, n1, [&](long type, const uint8_t* data, long a, long e, long first) {
                qlinear_few(type, data, a, e, K, x, M, ldx, xs, ldxs, b ? b + first : nullptr, y + first, ldy);
            });
        });
        return;
    }
    const float* xtp = pack(x, M, ldx, K, nt);
    const long lanes = lanes_for(M), P = (M + lanes - 1) / lanes, G = 48;
    parallel_for((N + G - 1) / G, 1, threads, [&](long g) {
        static thread_local std::vector<float> panel;
        const long n0 = g * G, n1 = std::min(N, n0 + G);
        float* wf = room64(panel, G * K);
        for (long n = n0; n < n1; n++) qmat_row(w, n, wf + (n - n0) * K);
        const float* wbase = wf - n0 * K;  // panel_range indexes w by the absolute row
        if (lanes == 16)
            panel_range<2>(xtp, M, 0, P, wbase, n0, n1, K, b, y, ldy, nullptr, N);
        else
            panel_range<1>(xtp, M, 0, P, wbase, n0, n1, K, b, y, ldy, nullptr, N);
    });
}

extern "C" void zoo_qlinear(const float* x, long M, long ldx, const QMat* w, const float* b, float* y, long ldy,
                            int nt) {
    qlinear(x, M, ldx, *w, b, y, ldy, nt, M);
}

// out [T, K] = rows ids of w, dequantised (an embedding lookup); ids are checked by the caller
extern "C" void zoo_qembed(const int64_t* ids, long T, const QMat* w, float* out, int nt) {
    parallel_for(T, 8, T >= 64 ? nt : 1, [&](long t) { qmat_row(*w, ids[t], out + t * w->K); });
}

// either weight: rows of W (float32, bfloat16), or (q non-null) blocks
template <typename W>
static void any_linear(const float* x, long M, long ldx, const W* w, const QMat* q, long N, long K,
                       const float* b, float* y, long ldy, int nt, long path_m) {
    if (q) qlinear(x, M, ldx, *q, b, y, ldy, nt, path_m);
    else linear(x, M, ldx, w, N, K, b, y, ldy, nt, path_m);
}

// ---------------------------------------------------------------------------------------------------
// RMS norm over rows of D: out = w * (x * r) (Llama), or (x * r) * (1 + w) (Gemma), r = 1 / sqrt(mean(x^2) + eps)

static inline void norm_row(const float* xr, long D, const float* w, float eps, int gemma, float* o) {
    v16 acc = splat(0.0f);
    long d = 0;
    for (; d + 16 <= D; d += 16) {
        v16 xv = load(xr + d);
        acc = acc + xv * xv;  // the squares rounded first, as x.pow(2).mean()
    }
    float ss = hsum(acc);
    for (; d < D; d++) ss += xr[d] * xr[d];
    float r = 1.0f / std::sqrt(ss / (float)D + eps);
    if (gemma)
        for (d = 0; d < D; d++) o[d] = (xr[d] * r) * (1.0f + w[d]);
    else
        for (d = 0; d < D; d++) o[d] = w[d] * (xr[d] * r);
}

extern "C" void zoo_rms_norm(const float* x, long R, long D, long ldx, const float* w, float eps, int gemma,
                             float* out, int nt) {
    parallel_for(R, 16, R * D >= 131072 ? nt : 1,
                 [&](long i) { norm_row(x + i * ldx, D, w, eps, gemma, out + i * D); });
}

// per-head norm: out [T, n, D] = rms_norm of the n heads of each token, x's heads D apart and its tokens st apart
static void heads_norm(const float* x, long T, long n, long st, long D, const float* w, float eps, int gemma,
                       float* out, int nt) {
    parallel_for(T * n, 16, T * n * D >= 131072 ? nt : 1, [&](long i) {
        norm_row(x + i / n * st + i % n * D, D, w, eps, gemma, out + i * D);
    });
}

// ---------------------------------------------------------------------------------------------------
// Rotary (rotate-half layout) of q [T, n, D] and k [T, m, D] (strides (st, sh, 1)) into contiguous outputs;
// the first 2F dims rotate by the table rows cos/sin [L, F] at pos[t], the rest are copied.
// Returns the index of a token whose position is outside the table (nothing written), or -1.

static inline void rotate_row(const float* x, float* o, const float* c, const float* s, long F, long D) {
    for (long f = 0; f < F; f++) {
        o[f] = x[f] * c[f] - x[f + F] * s[f];
        o[f + F] = x[f + F] * c[f] + x[f] * s[f];
    }
    for (long d = 2 * F; d < D; d++) o[d] = x[d];
}

extern "C" long zoo_rope(const float* q, long q_st, long q_sh, long n, float* q_out, const float* k, long k_st,
                         long k_sh, long m, float* k_out, long T, long D, const int64_t* pos, const float* cos,
                         const float* sin, long L, long F, int nt) {
    for (long t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= L) return t;
    parallel_for(T, 16, T * (n + m) * D >= 131072 ? nt : 1, [&](long t) {
        const float* c = cos + pos[t] * F;
        const float* s = sin + pos[t] * F;
        for (long h = 0; h < n; h++) rotate_row(q + t * q_st + h * q_sh, q_out + (t * n + h) * D, c, s, F, D);
        for (long h = 0; h < m; h++) rotate_row(k + t * k_st + h * k_sh, k_out + (t * m + h) * D, c, s, F, D);
    });
    return -1;
}

// ---------------------------------------------------------------------------------------------------
// act(gate) * up for gate_up [T, 2I] (row stride ld) -> out [T, I]: silu(g) = g / (1 + e^-g) as torch, or
// Gemma's gelu_tanh(g) = g / 2 (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), with 1 + tanh(y) =
// 2 / (e^2|y| + 1) for y < 0 and 2 - that for y >= 0 (no cancellation where tanh(y) is near -1)
enum Act { SILU = 0, GELU_TANH = 1 };

template <int ACT>
static inline v16 act16(v16 g) {
    if (ACT == SILU) return g / (splat(1.0f) + exp16(-g));
    const v16 y = splat(0.7978845608028654f) * (g + splat(0.044715f) * (g * g * g));
    const v16 ay = select(y < splat(0.0f), -y, y);
    const v16 low = splat(2.0f) / (exp16(ay + ay) + splat(1.0f));  // 1 + tanh(-|y|)
    return splat(0.5f) * g * select(y < splat(0.0f), low, splat(2.0f) - low);
}

template <int ACT>
static void act_mul(const float* gu, long T, long I, long ld, float* out, int nt) {
    constexpr long CH = 2048;  // items: a row's I in pieces of CH (a multiple of 16), so few long rows split too
    const long pieces = (I + CH - 1) / CH;
    parallel_for(T * pieces, pieces > 1 ? 1 : 4, T * I >= 16384 ? nt : 1, [&](long item) {
        const long t = item / pieces, i0 = item % pieces * CH, i1 = std::min(I, i0 + CH);
        const float* g = gu + t * ld;
        const float* u = g + I;
        float* o = out + t * I;
        long i = i0;
        for (; i + 16 <= i1; i += 16) store(o + i, act16<ACT>(load(g + i)) * load(u + i));
        if (i < i1) {  // the tail through a padded vector: every element gets the same arithmetic
            float gt[16] = {0}, ut[16] = {0}, ot[16];
            memcpy(gt, g + i, (i1 - i) * sizeof(float));
            memcpy(ut, u + i, (i1 - i) * sizeof(float));
            store(ot, act16<ACT>(load(gt)) * load(ut));
            memcpy(o + i, ot, (i1 - i) * sizeof(float));
        }
    });
}

extern "C" void zoo_silu_mul(const float* gu, long T, long I, long ld, float* out, int nt) {
    act_mul<SILU>(gu, T, I, ld, out, nt);
}

extern "C" void zoo_gelu_tanh_mul(const float* gu, long T, long I, long ld, float* out, int nt) {
    act_mul<GELU_TANH>(gu, T, I, ld, out, nt);
}

static void act_mul(int act, const float* gu, long T, long I, long ld, float* out, int nt) {
    if (act == GELU_TANH)
        act_mul<GELU_TANH>(gu, T, I, ld, out, nt);
    else
        act_mul<SILU>(gu, T, I, ld, out, nt);
}

// ---------------------------------------------------------------------------------------------------
// Mixture-of-experts (zoo/layers/moe.py's StackedExperts, one call per layer): out [T, Hd] = for each token t,
// the sum over its K experts e of w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)), w13 [E, 2I, Hd] (gate rows,
// then up rows), w2 [E, Hd, I]. The T K assignments are grouped by expert (token order kept within an expert,
// as a stable sort of ids); each expert's rows take the path their count picks (the experts with <= 4 rows one
// GEMV over all their rows: one pass, the threads splitting every expert's rows, not one region per expert; the
// others linear's choice, gemv_rows: a row's result never depends on the other rows).
// The combine: out[t] = y_0 w_0 + y_1 w_1 + ..., the token's experts in ascending id (moe.py's
// combine_in_expert_order, the same roundings). ids must lie in [0, E) (the caller checks).

struct ExpertGroup { long e, start, n; };

// y [A, N] rows g.start .. of each group = x's rows times w_e^T (w [E, N, K]), for groups of <= 4 rows
template <typename W>
static void grouped_gemv(const std::vector<ExpertGroup>& groups, const float* x, long ldx, const W* w, long N,
                         long K, float* y, long ldy, int nt) {
    const long total = (long)groups.size() * N;
    if (total == 0) return;
    if constexpr (sizeof(W) == 2 && BF16_EO) {  // the groups' rows of x in the order load_eo reads w's (linear)
        static thread_local std::vector<float> eo_store;
        const ExpertGroup& last = groups.back();  // (the groups ascend: their rows end with the last one's)
        const long rows = last.start + last.n;
        float* xe = room(eo_store, rows * K + 1);
        for (const ExpertGroup& g : groups) eo_rows(x + g.start * ldx, g.n, ldx, K, xe + g.start * K);
        x = xe, ldx = K;
    }
    const int threads = total * K >= 65536 ? nt : 1;
    paired_ranges(total, 16, threads, [&](long b, long e) {
        for (long i = b; i < e;) {
            const ExpertGroup& g = groups[i / N];
            const long n0 = i % N, n1 = std::min(N, n0 + (e - i));
            linear_few(x + g.start * ldx, g.n, ldx, w + g.e * N * K, n0, n1, K, nullptr, y + g.start * ldy, ldy);
            i += n1 - n0;
        }
    });
}

template <typename W>
static void moe_experts(const float* x, long T, long Hd, const int64_t* ids, const float* wts, long K,
                        const W* w13, const W* w2, long E, long I, int act, float* out, int nt) {
    const long A = T * K;
    static thread_local std::vector<long> order_store, count_store, pos_store;
    static thread_local std::vector<float> xs_store, gu_store, a_store, ys_store;
    long* counts = room(count_store, E + 1);
    long* order = room(order_store, A);  // sorted position -> assignment
    long* pos = room(pos_store, A);      // assignment -> sorted position
    std::fill(counts, counts + E + 1, 0L);
    for (long i = 0; i < A; i++) counts[ids[i] + 1]++;
    for (long e = 0; e < E; e++) counts[e + 1] += counts[e];  // offsets
    std::vector<long> fill(counts, counts + E);
    for (long i = 0; i < A; i++) order[pos[i] = fill[ids[i]]++] = i;
    float* xs = room(xs_store, A * Hd);
    float* gu = room(gu_store, A * 2 * I);
    float* a = room(a_store, A * I);
    float* ys = room(ys_store, A * Hd);
    for (long r = 0; r < A; r++) memcpy(xs + r * Hd, x + order[r] / K * Hd, Hd * sizeof(float));
    std::vector<ExpertGroup> few, many;
    for (long e = 0; e < E; e++) {
        const long n = counts[e + 1] - counts[e];
        if (n) (n <= 4 ? few : many).push_back({e, counts[e], n});
    }
    grouped_gemv(few, xs, Hd, w13, 2 * I, Hd, gu, 2 * I, nt);
    for (const ExpertGroup& g : many)
        linear(xs + g.start * Hd, g.n, Hd, w13 + g.e * 2 * I * Hd, 2 * I, Hd, (const float*)nullptr,
               gu + g.start * 2 * I, 2 * I, nt, g.n);
    act_mul(act, gu, A, I, 2 * I, a, nt);
    grouped_gemv(few, a, I, w2, Hd, I, ys, Hd, nt);
    for (const ExpertGroup& g : many)
        linear(a + g.start * I, g.n, I, w2 + g.e * Hd * I, Hd, I, (const float*)nullptr, ys + g.start * Hd, Hd, nt,
               g.n);
    parallel_for(T, 4, T * Hd * K >= 65536 ? nt : 1, [&](long t) {
        long rows[64];
        const long k = std::min(K, 64L);
        for (long j = 0; j < k; j++) rows[j] = pos[t * K + j];
        std::sort(rows, rows + k);  // sorted positions ascend with the expert id
        float* o = out + t * Hd;
        const float w0 = wts[order[rows[0]]];
        const float* y0 = ys + rows[0] * Hd;
        for (long d = 0; d < Hd; d++) o[d] = y0[d] * w0;
        for (long j = 1; j < k; j++) {
            const float wj = wts[order[rows[j]]];
            const float* yj = ys + rows[j] * Hd;
            for (long d = 0; d < Hd; d++) o[d] = o[d] + yj[d] * wj;
        }
    });
}

extern "C" void zoo_moe_experts(const float* x, long T, long Hd, const int64_t* ids, const float* wts, long K,
                                const float* w13, const float* w2, long E, long I, int act, float* out, int nt) {
    moe_experts(x, T, Hd, ids, wts, K, w13, w2, E, I, act, out, nt);
}

// the same with bfloat16 experts (float32 x, weights, out and arithmetic)
extern "C" void zoo_moe_experts_bf16(const float* x, long T, long Hd, const int64_t* ids, const float* wts, long K,
                                     const bf16* w13, const bf16* w2, long E, long I, int act, float* out, int nt) {
    moe_experts(x, T, Hd, ids, wts, K, w13, w2, E, I, act, out, nt);
}

// Mixtral's router on logits [T, E]: softmax (float32), the K largest (ties: the lower id), divided by their
// sum when renorm: weights [T, K], ids [T, K] (largest first)
static void softmax_topk(const float* logits, long T, long E, long K, int renorm, float* wts, int64_t* ids) {
    for (long t = 0; t < T; t++) {
        const float* l = logits + t * E;
        float p[256], m = -INFINITY, s = 0.0f;
        for (long e = 0; e < E; e++) m = std::max(m, l[e]);
        for (long e = 0; e < E; e++) s += (p[e] = std::exp(l[e] - m));
        for (long e = 0; e < E; e++) p[e] = p[e] / s;
        bool used[256] = {false};
        float sum = 0.0f;
        for (long j = 0; j < K; j++) {
            long best = -1;
            for (long e = 0; e < E; e++)
                if (!used[e] && (best < 0 || p[e] > p[best])) best = e;
            used[best] = true;
            ids[t * K + j] = best;
            sum += (wts[t * K + j] = p[best]);
        }
        if (renorm)
            for (long j = 0; j < K; j++) wts[t * K + j] = wts[t * K + j] / sum;
    }
}

// ---------------------------------------------------------------------------------------------------
// Multi-head latent attention, the absorbed decode (zoo/layers/mla.py): D requests with one new token each,
// token toks[i] of the step, request reqs[i] of the block tables, lens[i] context tokens (the new one's row
// already in the cache). The cache [NB, BS, C] holds rows [latent (R) | rotated rope key (DR)], C = R + DR;
// wkv = kv_b_proj.weight [NH (DN + DV), R], per head W_UK [DN, R] then W_UV [DV, R]. Per request and head:
//     ql = W_UK^T q_nope [R];  score_s = scale (ql . c_s + q_rope . k_rope_s);  p = softmax(score)
//     out = W_UV (sum_s p_s c_s) [DV]
// One work item per (request, head). Returns 0, 2 (a length outside 1 .. max_blocks BS) or 4 (a block id
// outside the pool). T: float, or bf16 (a bfloat16 model: the cache and wkv read widened, float32 arithmetic).

template <typename T>
static inline void axpy(float a, const T* x, float* y, long n) {  // y += a x, one rounding each
    const v16 av = splat(a);
    long i = 0;
    for (; i + 16 <= n; i += 16) store(y + i, fma16(av, load(x + i), load(y + i)));
    for (; i < n; i++) y[i] = std::fma(a, to_f32(x[i]), y[i]);
}

template <typename T>
static int mla_decode(const float* qn, long qn_st, long qn_sh, const float* qr, long qr_st, long qr_sh,
                      long NH, long DN, long DR, const T* wkv, long R, long DV, const T* cache,
                      long nb, long bs, const int32_t* tables, long max_blocks, const int64_t* toks,
                      const int64_t* reqs, const int64_t* lens, long D, float scale, float* out, int nt) {
    for (long i = 0; i < D; i++) {
        if (lens[i] < 1 || lens[i] > max_blocks * bs) return 2;
        for (long b = 0; b < (lens[i] + bs - 1) / bs; b++) {
            const long blk = tables[reqs[i] * max_blocks + b];
            if (blk < 0 || blk >= nb) return 4;
        }
    }
    const long C = R + DR;
    parallel_for(D * NH, 1, D * NH > 1 ? nt : 1, [&](long item) {
        const long i = item / NH, n = item % NH, L = lens[i];
        static thread_local std::vector<float> store_ql, store_sc, store_ol;
        float* ql = room(store_ql, R);
        float* sc = room(store_sc, L);
        float* ol = room(store_ol, R);
        const float* q = qn + toks[i] * qn_st + n * qn_sh;
        const float* qrr = qr + toks[i] * qr_st + n * qr_sh;
        const T* wuk = wkv + n * (DN + DV) * R;
        const T* wuv = wuk + DN * R;
        const int32_t* table = tables + reqs[i] * max_blocks;
        std::fill(ql, ql + R, 0.0f);
        for (long k = 0; k < DN; k++) axpy(q[k], wuk + k * R, ql, R);
        float m = -INFINITY;
        for (long s = 0; s < L; s++) {
            const T* row = cache + ((long)table[s / bs] * bs + s % bs) * C;
            sc[s] = (dot(ql, row, R) + dot(qrr, row + R, DR)) * scale;
            m = std::max(m, sc[s]);
        }
        float sum = 0.0f;
        for (long s = 0; s < L; s++) sum += (sc[s] = std::exp(sc[s] - m));
        std::fill(ol, ol + R, 0.0f);
        for (long s = 0; s < L; s++) axpy(sc[s] / sum, cache + ((long)table[s / bs] * bs + s % bs) * C, ol, R);
        float* o = out + toks[i] * NH * DV + n * DV;
        for (long v = 0; v < DV; v++) o[v] = dot(ol, wuv + v * R, R);
    });
    return 0;
}

extern "C" int zoo_mla_decode(const float* qn, long qn_st, long qn_sh, const float* qr, long qr_st, long qr_sh,
                              long NH, long DN, long DR, const float* wkv, long R, long DV, const float* cache,
                              long nb, long bs, const int32_t* tables, long max_blocks, const int64_t* toks,
                              const int64_t* reqs, const int64_t* lens, long D, float scale, float* out, int nt) {
    return mla_decode(qn, qn_st, qn_sh, qr, qr_st, qr_sh, NH, DN, DR, wkv, R, DV, cache, nb, bs, tables, max_blocks,
                      toks, reqs, lens, D, scale, out, nt);
}

extern "C" int zoo_mla_decode_bf16(const float* qn, long qn_st, long qn_sh, const float* qr, long qr_st, long qr_sh,
                                   long NH, long DN, long DR, const bf16* wkv, long R, long DV, const bf16* cache,
                                   long nb, long bs, const int32_t* tables, long max_blocks, const int64_t* toks,
                                   const int64_t* reqs, const int64_t* lens, long D, float scale, float* out, int nt) {
    return mla_decode(qn, qn_st, qn_sh, qr, qr_st, qr_sh, NH, DN, DR, wkv, R, DV, cache, nb, bs, tables, max_blocks,
                      toks, reqs, lens, D, scale, out, nt);
}

// ---------------------------------------------------------------------------------------------------
// Causal attention over flattened tokens and the paged cache [NB * BS, 2, KV, D] (0 = K, 1 = V).
//
// The new tokens' k and v are first written to their slots; then each token attends to its request's context
// positions lo .. p (p = its own position; lo = p - window + 1 with a sliding window), read through the
// request's block table. Without a cache (cache == nullptr) every request is a whole prompt and its context is
// its own rows of k and v. q/k/v rows are strided ([T, heads, D], unit last stride). The metadata is checked
// first (nothing is read or written out of bounds); returns 0, or the code of the first problem:
// 1 query_start_loc, 2 seq_lens, 3 slot_mapping, 4 block_tables.
//
// Two schedules. A request with few new tokens (decode): one work item per token, all heads, exact softmax
// over the whole context row (below). A request with at least QB / 2 new tokens (prefill): one work item per
// QB = 16 consecutive tokens and one query head, the 16 tokens in the lanes of a vector (attend_block).

// One token (decode): the scores of every head in one pass over the K rows (all_scores), a softmax per head,
// then for each KV head a pass over the V rows accumulating the outputs of up to 4 query heads sharing it (in
// registers). ND = D / 16 vectors per row; other head sizes take the per-head loops (scores_any /
// weighted_any).

// out[g][:] = sum_j p[g * ld + j] v_j over the L rows vrows[j] + at; summed in blocks of 64 rows, then added
template <int GS, int ND, typename C>
static void group_weighted(const float* p, long ld, const C* const* vrows, long at, long L, float* const* out) {
    v16 total[GS][ND];
    for (int g = 0; g < GS; g++)
        for (int d = 0; d < ND; d++) total[g][d] = splat(0.0f);
    for (long j0 = 0; j0 < L; j0 += 64) {
        const long j1 = std::min(L, j0 + 64);
        v16 acc[GS][ND];
        for (int g = 0; g < GS; g++)
            for (int d = 0; d < ND; d++) acc[g][d] = splat(0.0f);
        for (long j = j0; j < j1; j++) {
            const C* vr = vrows[j] + at;
            v16 vv[ND];
            for (int d = 0; d < ND; d++) vv[d] = load(vr + 16 * d);
            for (int g = 0; g < GS; g++) {
                v16 pj = splat(p[g * ld + j]);
                for (int d = 0; d < ND; d++) acc[g][d] = fma16(pj, vv[d], acc[g][d]);
            }
        }
        for (int g = 0; g < GS; g++)
            for (int d = 0; d < ND; d++) total[g][d] = total[g][d] + acc[g][d];
    }
    for (int g = 0; g < GS; g++)
        for (int d = 0; d < ND; d++) store(out[g] + 16 * d, total[g][d]);
}

// Decode: sc[h * ld + j] = (q_h . k_j) * scale for all H query heads (q_h = q + h * q_sh) over the L rows, row by
// row, every KV head of a row at once: a row's K lines are read together and in order, and `ahead` floats of
// the row 8 rows on (its K and V, or 0: nothing) are pulled towards L2 meanwhile, so the value passes that
// follow find the rows there. (Head by head, each pass read a few lines of every row: 2x slower from memory.)
template <int ND, typename C>
static void all_scores(const float* q, long q_sh, long H, long KV, long k_head, const C* const* krows, long L,
                       float scale, float* sc, long ld, long ahead) {
    const long G = H / KV;
    for (long j = 0; j < L; j++) {
        if (ahead && j + 8 < L)
            for (long off = 0; off < ahead; off += 16) prefetch_l2(krows[j + 8] + off);
        for (long kh = 0; kh < KV; kh++) {
            const C* kr = krows[j] + kh * k_head;
            v16 kv[ND];
            for (int d = 0; d < ND; d++) kv[d] = load(kr + 16 * d);
            for (long g = 0; g < G; g++) {
                const float* qh = q + (kh * G + g) * q_sh;
                v16 a = load(qh) * kv[0];
                for (int d = 1; d < ND; d++) a = fma16(load(qh + 16 * d), kv[d], a);
                sc[(kh * G + g) * ld + j] = hsum(a) * scale;
            }
        }
    }
}

template <typename C>
static bool all_scores_d(long D, const float* q, long q_sh, long H, long KV, long k_head, const C* const* krows,
                         long L, float scale, float* sc, long ld, long ahead) {
    switch (D) {
        case 32: all_scores<2>(q, q_sh, H, KV, k_head, krows, L, scale, sc, ld, ahead); return true;
        case 64: all_scores<4>(q, q_sh, H, KV, k_head, krows, L, scale, sc, ld, ahead); return true;
        case 128: all_scores<8>(q, q_sh, H, KV, k_head, krows, L, scale, sc, ld, ahead); return true;
        default: return false;
    }
}

template <typename C>
static void scores_any(const float* q, const C* const* krows, long at, long L, long D, float scale, float* out) {
    for (long j = 0; j < L; j++) out[j] = dot(q, krows[j] + at, D) * scale;
}

template <typename C>
static void weighted_any(const float* p, const C* const* vrows, long at, long L, long D, float* out) {
    for (long d = 0; d < D; d++) out[d] = 0.0f;
    for (long j = 0; j < L; j++)
        for (long d = 0; d < D; d++) out[d] = std::fma(p[j], to_f32(vrows[j][at + d]), out[d]);
}

template <int GS, typename C>
static bool group_weighted_d(long D, const float* p, long ld, const C* const* vrows, long at, long L,
                             float* const* out) {
    switch (D) {
        case 32: group_weighted<GS, 2>(p, ld, vrows, at, L, out); return true;
        case 64: group_weighted<GS, 4>(p, ld, vrows, at, L, out); return true;
        case 128: group_weighted<GS, 8>(p, ld, vrows, at, L, out); return true;
        default: return false;
    }
}

template <typename C>
static void weighted_pass(int gs, long D, const float* p, long ld, const C* const* vrows, long at, long L,
                          float* const* out) {
    bool done = gs == 1   ? group_weighted_d<1>(D, p, ld, vrows, at, L, out)
                : gs == 2 ? group_weighted_d<2>(D, p, ld, vrows, at, L, out)
                : gs == 3 ? group_weighted_d<3>(D, p, ld, vrows, at, L, out)
                          : group_weighted_d<4>(D, p, ld, vrows, at, L, out);
    if (!done)
        for (int g = 0; g < gs; g++) weighted_any(p + g * ld, vrows, at, L, D, out[g]);
}

// in place: row r [Lp] (L scores, then padding) -> softmax probabilities, padding 0
static void softmax_row(float* r, long L, long Lp, float softcap) {
    if (softcap > 0.0f)
        for (long j = 0; j < L; j++) r[j] = std::tanh(r[j] / softcap) * softcap;
    for (long j = L; j < Lp; j++) r[j] = -INFINITY;  // exp gives exactly 0
    v16 mv = splat(-INFINITY);
    for (long j = 0; j < Lp; j += 16) mv = select(load(r + j) > mv, load(r + j), mv);
    v16 mx = splat(hmax(mv)), sv = splat(0.0f);
    for (long j = 0; j < Lp; j += 16) {
        v16 e = exp16(load(r + j) - mx);
        store(r + j, e);
        sv = sv + e;
    }
    v16 inv = splat(1.0f / hsum(sv));
    for (long j = 0; j < Lp; j += 16) store(r + j, load(r + j) * inv);
}

// Prefill: QB = 16 consecutive tokens of one request (lane l = token; n <= 16 real, the other lanes repeat the
// last one) against one head's context rows, 16 rows at a time, with an online softmax per lane. Scores
// st [rows, lanes] = K qt (qt [D, lanes]: the tokens' q transposed), then ot [D, lanes] += V^T pt: every
// step is a broadcast of one K or V element times a vector of 16 tokens, no horizontal sums (the per-token
// path spends most of its time in them).
constexpr long QB = 16;

// st[j, :] = sum_d qt[d, :] krows[j][at + d] for the nj rows, RJ rows at a time (2 RJ accumulators: with RJ = 8
// the 16 of AVX-512's 32 registers keep both FMA pipes busy; 4 rows were latency-bound); every element sums
// over d in order, whatever the grouping
template <int RJ, typename C>
static inline void scores_rows(const float* qt, long D, const C* const* krows, long at, float* st) {
    const C* kr[RJ];
    for (int r = 0; r < RJ; r++) kr[r] = krows[r] + at;
    v8 a[RJ][2];
    for (int r = 0; r < RJ; r++) a[r][0] = a[r][1] = splat8(0.0f);
    for (long d = 0; d < D; d++) {
        const v8 x0 = *(const v8*)(qt + d * QB), x1 = *(const v8*)(qt + d * QB + 8);
#pragma GCC unroll 8
        for (int r = 0; r < RJ; r++) {
            const v8 kv = splat8(to_f32(kr[r][d]));
            a[r][0] = fma8(kv, x0, a[r][0]);
            a[r][1] = fma8(kv, x1, a[r][1]);
        }
    }
    for (int r = 0; r < RJ; r++) {
        *(v8*)(st + r * QB) = a[r][0];
        *(v8*)(st + r * QB + 8) = a[r][1];
    }
}

template <typename C>
static inline void block_scores(const float* qt, long D, const C* const* krows, long at, long nj, float* st) {
    constexpr int RJ = REGS >= 32 ? 8 : 4;
    long j = 0;
    for (; j + RJ <= nj; j += RJ) scores_rows<RJ>(qt, D, krows + j, at, st + j * QB);
    for (; j + 4 <= nj; j += 4) scores_rows<4>(qt, D, krows + j, at, st + j * QB);
    for (; j < nj; j++) scores_rows<1>(qt, D, krows + j, at, st + j * QB);
}

// ot[d, :] += sum_j vrows[j][d] pt[j, :] over the nj rows (offset at), for RD values of d from d0 (2 RD
// accumulators); every element sums over j in order, whatever the grouping
template <int RD, typename C>
static inline void values_cols(const float* pt, long nj, const C* const* vrows, long at, long d0, float* ot) {
    v8 a[RD][2];
    for (int r = 0; r < RD; r++) a[r][0] = *(v8*)(ot + (d0 + r) * QB), a[r][1] = *(v8*)(ot + (d0 + r) * QB + 8);
    for (long j = 0; j < nj; j++) {
        const C* vr = vrows[j] + at + d0;
        const v8 x0 = *(const v8*)(pt + j * QB), x1 = *(const v8*)(pt + j * QB + 8);
#pragma GCC unroll 8
        for (int r = 0; r < RD; r++) {
            const v8 vv = splat8(to_f32(vr[r]));
            a[r][0] = fma8(vv, x0, a[r][0]);
            a[r][1] = fma8(vv, x1, a[r][1]);
        }
    }
    for (int r = 0; r < RD; r++) *(v8*)(ot + (d0 + r) * QB) = a[r][0], *(v8*)(ot + (d0 + r) * QB + 8) = a[r][1];
}

template <typename C>
static inline void block_values(const float* pt, long nj, const C* const* vrows, long at, long D, float* ot) {
    constexpr int RD = REGS >= 32 ? 8 : 6;
    long d0 = 0;
    for (; d0 + RD <= D; d0 += RD) values_cols<RD>(pt, nj, vrows, at, d0, ot);
    for (; d0 + 4 <= D; d0 += 4) values_cols<4>(pt, nj, vrows, at, d0, ot);  // (a single d was latency-bound)
    for (; d0 < D; d0++) values_cols<1>(pt, nj, vrows, at, d0, ot);
}

// out rows out[l * out_st ..] (l < n) = attention of the n tokens q[l * q_st ..] at positions pos0 + l over the
// context rows krows[j] / vrows[j] (offsets at_k / at_v) of positions j = 0 .. pos0 + n - 1
template <typename C>
static void attend_block(const float* q, long q_st, long n, long pos0, const C* const* krows,
                         const C* const* vrows, long at_k, long at_v, long D, float scale, long window,
                         float softcap, float* out, long out_st) {
    static thread_local std::vector<v16> mem;
    float* qt = (float*)room(mem, 2 * D + 2 * QB);  // [D, QB]
    float* ot = qt + D * QB;         // [D, QB]
    float* st = ot + D * QB;         // [QB rows, QB lanes] scores, then probabilities
    if (n == QB && D % 8 == 0)  // whole blocks through 8 x 8 transposes
        for (long l = 0; l < QB; l += 8)
            for (long d = 0; d < D; d += 8) transpose8(q + l * q_st + d, q_st, qt + d * QB + l, QB);
    else
        for (long d = 0; d < D; d++)
            for (long l = 0; l < QB; l++) qt[d * QB + l] = q[std::min(l, n - 1) * q_st + d];
    std::fill(ot, ot + D * QB, 0.0f);
    int32_t pos_l[QB];
    for (int l = 0; l < QB; l++) pos_l[l] = (int32_t)(pos0 + std::min((long)l, n - 1));
    const i16 pos = load_i(pos_l);
    v16 m = splat(-INFINITY), sum = splat(0.0f);
    const long last = pos0 + n - 1, first = window > 0 ? std::max(0L, pos0 - window + 1) : 0;
    for (long j0 = first; j0 <= last; j0 += QB) {
        const long nj = std::min(QB, last + 1 - j0);
        block_scores(qt, D, krows + j0, at_k, nj, st);
        v16 mb = splat(-INFINITY);
        for (long j = 0; j < nj; j++) {
            float* sr = st + j * QB;
            store(sr, load(sr) * splat(scale));
            if (softcap > 0.0f)
                for (int l = 0; l < QB; l++) sr[l] = std::tanh(sr[l] / softcap) * softcap;
            const i16 jv = splat_i((int32_t)(j0 + j));
            i16 masked = jv > pos;  // a later position (causal)
            if (window > 0) masked |= jv <= pos - (int32_t)window;
            const v16 sj = select(masked, splat(-INFINITY), load(sr));
            store(sr, sj);
            mb = select(sj > mb, sj, mb);
        }
        const v16 m_new = select(mb > m, mb, m);
        const v16 base = select(m_new == splat(-INFINITY), splat(0.0f), m_new);  // a lane with nothing yet: no NaN
        const v16 corr = exp16(m - base);
        v16 bsum = splat(0.0f);
        for (long j = 0; j < nj; j++) {
            const v16 e = exp16(load(st + j * QB) - base);
            store(st + j * QB, e);
            bsum = bsum + e;
        }
        sum = sum * corr + bsum;
        for (long d = 0; d < D; d++) store(ot + d * QB, load(ot + d * QB) * corr);
        block_values(st, nj, vrows + j0, at_v, D, ot);
        m = m_new;
    }
    const v16 inv = splat(1.0f) / sum;
    for (long d = 0; d < D; d++) store(ot + d * QB, load(ot + d * QB) * inv);
    if (n == QB && D % 8 == 0)
        for (long d = 0; d < D; d += 8)
            for (long l = 0; l < QB; l += 8) transpose8(ot + d * QB + l, QB, out + l * out_st + d, out_st);
    else
        for (long l = 0; l < n; l++)
            for (long d = 0; d < D; d++) out[l * out_st + d] = ot[d * QB + l];
}

static int check_batch(long T, long B, const int32_t* qsl, const int32_t* seq_lens, const void* cache, long nb,
                       long bs, const int64_t* slots, const int32_t* tables, long max_blocks) {
    if (qsl[0] != 0 || qsl[B] != T) return 1;
    for (long b = 0; b < B; b++) {
        long n = qsl[b + 1] - qsl[b];
        if (n < 0) return 1;
        if (seq_lens[b] < n || (!cache && seq_lens[b] != n)) return 2;
        if (cache) {
            if (seq_lens[b] > max_blocks * bs) return 2;
            for (long i = 0; i < (seq_lens[b] + bs - 1) / bs; i++)
                if (tables[b * max_blocks + i] < 0 || tables[b * max_blocks + i] >= nb) return 4;
        }
    }
    if (cache)
        for (long t = 0; t < T; t++)
            if (slots[t] < 0 || slots[t] >= nb * bs) return 3;
    return 0;
}

// C: the cache's element type (float, or bf16: then a cache is required, the context rows being the cache's)
template <typename C>
static int attention(const float* q, long q_st, long q_sh, const float* k, long k_st, long k_sh,
                     const float* v, long v_st, long v_sh, float* out, long T, long H, long KV, long D,
                     C* cache, long nb, long bs, const int64_t* slots, const int32_t* tables,
                     long max_blocks, const int32_t* qsl, const int32_t* seq_lens, long B, float scale,
                     long window, float softcap, int nt) {
    if (sizeof(C) != 4 && !cache) return 3;
    int bad = check_batch(T, B, qsl, seq_lens, cache, nb, bs, slots, tables, max_blocks);
    if (bad || T == 0) return bad;
    std::vector<int32_t> req(T);
    for (long b = 0; b < B; b++)
        for (long t = qsl[b]; t < qsl[b + 1]; t++) req[t] = (int32_t)b;
    const long G = H / KV, row = 2 * KV * D;
    if (cache)  // the new tokens' k and v into their slots, before any is read
        for (long t = 0; t < T; t++) {
            C* dst = cache + slots[t] * row;
            for (long h = 0; h < KV; h++) {
                if constexpr (sizeof(C) == 4) {
                    memcpy(dst + h * D, k + t * k_st + h * k_sh, D * sizeof(float));
                    memcpy(dst + (KV + h) * D, v + t * v_st + h * v_sh, D * sizeof(float));
                } else {
                    for (long d = 0; d < D; d++) dst[h * D + d] = to_bf16(k[t * k_st + h * k_sh + d]);
                    for (long d = 0; d < D; d++) dst[(KV + h) * D + d] = to_bf16(v[t * v_st + h * v_sh + d]);
                }
            }
        }
    long work = 0;  // context rows read, to decide whether a second thread pays
    for (long b = 0; b < B; b++) work += (long)(qsl[b + 1] - qsl[b]) * seq_lens[b];
    const long k_head = cache ? D : k_sh, v_head = cache ? D : v_sh;  // stride between KV heads of a row
    // rows[c - lo] = request b's context rows of positions lo .. p (K at + 0, V at + KV D in the cache): walking
    // the block table once, one division per block, not per row
    auto context = [&](long b, long lo, long p, const C** krows, const C** vrows) {
        if (cache) {
            const int32_t* table = tables + b * max_blocks;
            for (long c = lo; c <= p;) {
                long off = c % bs, n = std::min(bs - off, p + 1 - c);
                const C* base = cache + ((long)table[c / bs] * bs + off) * row;
                for (long i = 0; i < n; i++) {
                    krows[c - lo + i] = base + i * row;
                    vrows[c - lo + i] = base + i * row + KV * D;
                }
                c += n;
            }
        } else if constexpr (sizeof(C) == 4) {
            for (long c = lo; c <= p; c++) {
                krows[c - lo] = k + (qsl[b] + c) * k_st;
                vrows[c - lo] = v + (qsl[b] + c) * v_st;
            }
        }
    };
    // work items: (request, first token, tokens) x head for the blocks of prefilling requests, then single
    // tokens; each kind longest context first, so that the threads end together (the last item claimed is a
    // short one: with requests in arrival order the longest often came last, a thread waiting on it alone)
    std::vector<std::array<long, 3>> blocks;
    std::vector<long> singles;
    for (long b = 0; b < B; b++) {
        const long n = qsl[b + 1] - qsl[b];
        if (n >= QB / 2)
            for (long t = qsl[b]; t < qsl[b + 1]; t += QB) blocks.push_back({b, t, std::min(QB, qsl[b + 1] - t)});
        else
            for (long t = qsl[b]; t < qsl[b + 1]; t++) singles.push_back(t);
    }
    auto position = [&](long t) { return seq_lens[req[t]] - (qsl[req[t] + 1] - t); };
    std::stable_sort(blocks.begin(), blocks.end(), [&](const auto& a, const auto& c) {
        return position(a[1]) + a[2] > position(c[1]) + c[2];
    });
    std::stable_sort(singles.begin(), singles.end(), [&](long a, long c) { return position(a) > position(c); });
    const long nblock = (long)blocks.size() * H;
    parallel_for(nblock + (long)singles.size(), 1, work * KV * D >= 32768 ? nt : 1, [&](long item) {
        static thread_local std::vector<float> sc;
        static thread_local std::vector<const C*> rows;
        if (item < nblock) {
            const long* blk = blocks[item / H].data();
            const long b = blk[0], t0 = blk[1], n = blk[2], h = item % H, kh = h / G;
            const long pos0 = seq_lens[b] - (qsl[b + 1] - t0), last = pos0 + n - 1;
            const C** krows = room(rows, 2 * (last + 1));
            context(b, 0, last, krows, krows + last + 1);
            attend_block(q + t0 * q_st + h * q_sh, q_st, n, pos0, krows, krows + last + 1, kh * k_head,
                         kh * v_head, D, scale, window, softcap, out + (t0 * H + h) * D, H * D);
            return;
        }
        // one token, every head: scores of all heads in one pass over the rows, then a softmax per head and
        // the value passes (from this core's cache by then)
        const long t = singles[item - nblock], b = req[t];
        const long p = seq_lens[b] - (qsl[b + 1] - t);  // this token's position
        const long lo = window > 0 ? std::max(0L, p - window + 1) : 0;
        const long L = p - lo + 1, Lp = (L + 15) / 16 * 16;
        const C** krows = room(rows, 2 * L);
        const C** vrows = krows + L;
        context(b, lo, p, krows, vrows);
        const float* qt = q + t * q_st;
        float* r = room(sc, H * Lp);
        if (cache)  // the first rows' lines, before all_scores prefetches the rest as it goes
            for (long j = 0; j < std::min(L, 8L); j++)
                for (long off = 0; off < row; off += 16) prefetch_l2(krows[j] + off);
        if (!all_scores_d(D, qt, q_sh, H, KV, k_head, krows, L, scale, r, Lp, cache ? row : 0))
            for (long h = 0; h < H; h++) scores_any(qt + h * q_sh, krows, (h / G) * k_head, L, D, scale, r + h * Lp);
        for (long h = 0; h < H; h++) softmax_row(r + h * Lp, L, Lp, softcap);
        for (long kh = 0; kh < KV; kh++) {
            for (long g0 = 0; g0 < G; g0 += 4) {  // query heads kh * G + g0 .. in groups of up to 4
                const int gs = (int)std::min(4L, G - g0);
                float* os[4];
                for (int g = 0; g < gs; g++) os[g] = out + (t * H + kh * G + g0 + g) * D;
                weighted_pass(gs, D, r + (kh * G + g0) * Lp, Lp, vrows, kh * v_head, L, os);
            }
        }
    });
    return 0;
}

extern "C" int zoo_attention(const float* q, long q_st, long q_sh, const float* k, long k_st, long k_sh,
                             const float* v, long v_st, long v_sh, float* out, long T, long H, long KV, long D,
                             float* cache, long nb, long bs, const int64_t* slots, const int32_t* tables,
                             long max_blocks, const int32_t* qsl, const int32_t* seq_lens, long B, float scale,
                             long window, float softcap, int nt) {
    return attention(q, q_st, q_sh, k, k_st, k_sh, v, v_st, v_sh, out, T, H, KV, D, cache, nb, bs, slots, tables,
                     max_blocks, qsl, seq_lens, B, scale, window, softcap, nt);
}

// the same over a bfloat16 cache (float32 q/k/v, out and arithmetic; k and v stored rounded to bfloat16)
extern "C" int zoo_attention_bf16(const float* q, long q_st, long q_sh, const float* k, long k_st, long k_sh,
                                  const float* v, long v_st, long v_sh, float* out, long T, long H, long KV, long D,
                                  bf16* cache, long nb, long bs, const int64_t* slots, const int32_t* tables,
                                  long max_blocks, const int32_t* qsl, const int32_t* seq_lens, long B, float scale,
                                  long window, float softcap, int nt) {
    return attention(q, q_st, q_sh, k, k_st, k_sh, v, v_st, v_sh, out, T, H, KV, D, cache, nb, bs, slots, tables,
                     max_blocks, qsl, seq_lens, B, scale, window, softcap, nt);
}

// ---------------------------------------------------------------------------------------------------
// Mamba2 / SSD mixer after in_proj (zoo/layers/mamba.py), for the requests of a step: zx [T, I + C + h] (row
// stride ldz) holds gate [I] | xBC [C] | dt [h] per token, I = h p, C = I + 2 g N; request r owns the rows
// starts[r] .. starts[r + 1] and the state slot slots[r], read only when has_state[r] (else it starts from zero).
//   1. xBC -> silu(causal depthwise conv + bias) -> xbc [T, C]; the conv window carries on from the slot's K - 1
//      inputs conv_state [S, K-1, C] (oldest first), which then hold the request's last K - 1 inputs.
//      Work items: (request, 16 channels).
//   2. per (request, head), token by token: dt = clamp(softplus(dt + dt_bias)), h = exp(dt A) h + (dt B) x,
//      y = C . h + D x, with A = -exp(A_log) and the state h [p, N] in place in ssm_state [S, h, p, N]. A token
//      at a time is the recurrence a chunked scan computes in another order: a split prefill computes exactly
//      what a one-shot one does, and a head's state (p N floats) stays in L1 over its request's tokens.
//   3. per (token, group): y = y silu(gate), then RMS over the group's I / g channels, times norm_w -> y [T, I].
// Without states (conv_state == nullptr) every request is a whole prompt from a zero state and nothing is kept.

static inline v16 load_n(const float* p, long n) {  // n <= 16 values, zeros after
    if (n == 16) return load(p);
    float t[16] = {0};
    memcpy(t, p, n * sizeof(float));
    return load(t);
}
static inline void store_n(float* p, v16 v, long n) {
    if (n == 16) return store(p, v);
    float t[16];
    store(t, v);
    memcpy(p, t, n * sizeof(float));
}

// out [T, C] = silu(causal depthwise conv of x [T, C] (row stride ldx) + bias), each request's window continuing
// from its slot of conv_state [S, K-1, C] (when has_state) and left there; work items (request, 16 channels)
static void conv_silu(const float* x, long ldx, long T, long C, long K, const float* conv_w, const float* conv_b,
                      float* conv_state, const int64_t* starts, const int64_t* slots, const int32_t* has_state,
                      long B, float* out, int nt) {
    const long blocks = (C + 15) / 16;
    std::vector<float> wt(K * C);  // the conv weight [C, K] as [K, C]: one vector load per tap
    for (long c = 0; c < C; c++)
        for (long k = 0; k < K; k++) wt[k * C + c] = conv_w[c * K + k];
    parallel_for(B * blocks, 8, (T * C >= 16384) ? nt : 1, [&](long item) {
        const long r = item / blocks, c = item % blocks * 16, n = std::min(16L, C - c);
        float* prev = conv_state ? conv_state + slots[r] * (K - 1) * C + c : nullptr;
        v16 win[16];  // the K - 1 inputs before the current token (K <= 17, checked by the wrapper)
        for (long k = 0; k < K - 1; k++) win[k] = prev && has_state[r] ? load_n(prev + k * C, n) : splat(0.0f);
        const v16 bias = conv_b ? load_n(conv_b + c, n) : splat(0.0f);
        for (long t = starts[r]; t < starts[r + 1]; t++) {
            const v16 xt = load_n(x + t * ldx + c, n);
            v16 acc = bias;
            for (long k = 0; k < K - 1; k++) acc = acc + load_n(wt.data() + k * C + c, n) * win[k];
            acc = acc + load_n(wt.data() + (K - 1) * C + c, n) * xt;
            store_n(out + t * C + c, act16<SILU>(acc), n);
            for (long k = 0; k + 1 < K - 1; k++) win[k] = win[k + 1];
            if (K > 1) win[K - 2] = xt;
        }
        if (prev)
            for (long k = 0; k < K - 1; k++) store_n(prev + k * C, win[k], n);
    });
}

extern "C" void zoo_mamba2_mix(const float* zx, long T, long ldz, long H, long P, long N, long G, long K,
                               const float* conv_w, const float* conv_b, const float* dt_bias, const float* A_log,
                               const float* Dskip, const float* norm_w, float eps, float dt_min, float dt_max,
                               float* conv_state, float* ssm_state, const int64_t* starts, const int64_t* slots,
                               const int32_t* has_state, long B, float* xbc, float* y, int nt) {
    const long I = H * P, C = I + 2 * G * N;
    conv_silu(zx + I, ldz, T, C, K, conv_w, conv_b, conv_state, starts, slots, has_state, B, xbc, nt);
    parallel_for(B * H, 1, nt, [&](long item) {
        const long r = item / H, hd = item % H, grp = hd / (H / G);
        thread_local std::vector<float> scratch;
        float* const buf = room(scratch, P * N + N);  // dB [N], and the state [P, N] when nothing keeps it
        float* const dB = buf + P * N;
        float* const h = ssm_state ? ssm_state + (slots[r] * H + hd) * P * N : buf;
        if (!ssm_state || !has_state[r]) std::fill(h, h + P * N, 0.0f);
        const float A = -std::exp(A_log[hd]);
        for (long t = starts[r]; t < starts[r + 1]; t++) {
            float dt = zx[t * ldz + I + C + hd] + dt_bias[hd];
            dt = dt > 20.0f ? dt : std::log1p(std::exp(dt));  // softplus (torch's threshold 20)
            dt = std::min(std::max(dt, dt_min), dt_max);
            const float decay = std::exp(dt * A);
            const float* x = xbc + t * C + hd * P;
            const float* Bt = xbc + t * C + I + grp * N;
            const float* Ct = xbc + t * C + I + G * N + grp * N;
            for (long k = 0; k < N; k++) dB[k] = dt * Bt[k];
            float* yt = y + t * I + hd * P;
            for (long i = 0; i < P; i++) {
                float* hi = h + i * N;
                const v16 xi = splat(x[i]), dv = splat(decay);
                v16 acc = splat(0.0f);
                long k = 0;
                for (; k + 16 <= N; k += 16) {
                    const v16 hv = load(hi + k) * dv + load(dB + k) * xi;
                    store(hi + k, hv);
                    acc = fma16(load(Ct + k), hv, acc);
                }
                float s = hsum(acc);
                for (; k < N; k++) {
                    hi[k] = hi[k] * decay + dB[k] * x[i];
                    s = std::fma(Ct[k], hi[k], s);
                }
                yt[i] = s + Dskip[hd] * x[i];
            }
        }
    });
    const long gs = I / G;
    parallel_for(T * G, 4, T * I >= 16384 ? nt : 1, [&](long item) {
        const long t = item / G;
        const long c0 = item % G * gs;
        const float* gate = zx + t * ldz + c0;
        float* yt = y + t * I + c0;
        v16 acc = splat(0.0f);
        for (long c = 0; c < gs; c += 16) {
            const long n = std::min(16L, gs - c);
            const v16 v = load_n(yt + c, n) * act16<SILU>(load_n(gate + c, n));
            store_n(yt + c, v, n);
            acc = acc + v * v;  // zeros past n add nothing
        }
        const float rs = 1.0f / std::sqrt(hsum(acc) / (float)gs + eps);
        for (long c = 0; c < gs; c++) yt[c] = norm_w[c0 + c] * (yt[c] * rs);
    });
}

// Mamba1 (Jamba's mixer, zoo/layers/mamba.py): the conv alone (zoo_causal_conv: conv_silu above over x [T, C]),
// then, after x_proj and dt_proj, zoo_selective_scan per (request, 16 channels), token by token: for channel i,
// h = exp(dt A_i) h + (dt B) x  [N], y = C . h, out = (y + D x) silu(z). x, dt, z [T, I] and B, C [T, N] (row
// strides ldx, ldd, ldz, ldbc), A [I, N]; the state h in place in ssm_state [S, I, N], read when has_state.

extern "C" void zoo_causal_conv(const float* x, long ldx, long T, long C, long K, const float* conv_w,
                                const float* conv_b, float* conv_state, const int64_t* starts, const int64_t* slots,
                                const int32_t* has_state, long B, float* out, int nt) {
    conv_silu(x, ldx, T, C, K, conv_w, conv_b, conv_state, starts, slots, has_state, B, out, nt);
}

extern "C" void zoo_selective_scan(const float* x, long ldx, const float* dt, long ldd, const float* Bm,
                                   const float* Cm, long ldbc, const float* z, long ldz, const float* A,
                                   const float* Dskip, long T, long I, long N, float* ssm_state, const int64_t* starts,
                                   const int64_t* slots, const int32_t* has_state, long B, float* out, int nt) {
    const long blocks = (I + 15) / 16;
    parallel_for(B * blocks, 1, nt, [&](long item) {
        const long r = item / blocks, i0 = item % blocks * 16, i1 = std::min(I, i0 + 16);
        thread_local std::vector<float> scratch;
        float* const h0 = ssm_state ? ssm_state + (slots[r] * I + i0) * N : room(scratch, 16 * N);
        if (!ssm_state || !has_state[r]) std::fill(h0, h0 + (i1 - i0) * N, 0.0f);
        for (long t = starts[r]; t < starts[r + 1]; t++) {
            const float* Bt = Bm + t * ldbc;
            const float* Ct = Cm + t * ldbc;
            for (long i = i0; i < i1; i++) {
                const float d = dt[t * ldd + i], xi = x[t * ldx + i];
                float* h = h0 + (i - i0) * N;
                v16 acc = splat(0.0f);
                for (long k = 0; k < N; k += 16) {
                    const long n = std::min(16L, N - k);
                    const v16 hv = exp16(splat(d) * load_n(A + i * N + k, n)) * load_n(h + k, n) +
                                   (splat(d) * load_n(Bt + k, n)) * splat(xi);
                    store_n(h + k, hv, n);
                    acc = fma16(load_n(Ct + k, n), hv, acc);  // zeros past n add nothing
                }
                const float zi = z[t * ldz + i];
                out[t * I + i] = (hsum(acc) + xi * Dskip[i]) * (zi / (1.0f + std::exp(-zi)));
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------------
// Greedy sampling: out[i] = the first index of the largest value of row i of x [N, V] (row stride ld), as
// torch.argmax; a row holding a NaN gets the index of its first NaN (torch ranks NaN above everything).

// values (may be null): each row's value at its index, from the same pass (the sampler checks it is finite)
extern "C" void zoo_argmax(const float* x, long N, long V, long ld, int64_t* out, float* values, int nt) {
    parallel_for(N, 1, N * V >= 65536 ? nt : 1, [&](long i) {
        const float* r = x + i * ld;
        v16 best = splat(-INFINITY);
        static const int32_t lanes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        i16 at = splat_i(0), nan = splat_i(0);
        const i16 lane = load_i(lanes);
        long j = 0;
        for (; j + 16 <= V; j += 16) {
            v16 v = load(r + j);
            i16 gt = v > best;  // strict: the earliest index keeps a tie
            best = select(gt, v, best);
            at = select(gt, lane + (int32_t)j, at);
            nan |= v != v;
        }
        bool has_nan = false;
        for (int l = 0; l < 16; l++) has_nan |= nan[l] != 0;
        long found = 0;
        float m = -INFINITY;
        if (j > 0) {  // lanes hold the first maximum of their residue class: the largest, then the earliest
            m = best[0], found = at[0];
            for (int l = 1; l < 16; l++)
                if (best[l] > m || (best[l] == m && at[l] < found)) m = best[l], found = at[l];
        }
        for (; j < V; j++) {
            if (r[j] > m || (j == 0)) m = r[j], found = j;
            has_nan |= std::isnan(r[j]);
        }
        if (has_nan)
            for (long k = 0; k < V; k++)
                if (std::isnan(r[k])) {
                    found = k;
                    break;
                }
        out[i] = found;
        if (values) values[i] = r[found];
    });
}


// ---------------------------------------------------------------------------------------------------
// A whole forward pass of a Llama-structured decoder (zoo/kernels/fused.py decides which models qualify and
// passes their weights): the kernels above in the order the modules call them, with no Python between
// layers. The results equal the module path with kernels on, bit for bit (same kernels, same inputs; the
// residual adds round the same). Returns 0, an attention error code, 5 when a token id is outside the
// embedding table, or 6 when a row to compute logits of is outside the step's tokens.

// W: the matrices' element type, C: the cache's (float, or bf16 for a bfloat16 model: norms, biases, routers and
// the rotary tables are float32, as zoo stores them beside bfloat16 matrices)
template <typename W, typename C>
struct LayerWeightsT {
    const float* ln1;
    const W* qkv;
    const float* qkv_bias;
    const W* o;
    const float *o_bias, *ln2;
    const W* gate_up;
    const float* gate_up_bias;
    const W* down;
    const float* down_bias;
    const float *q_norm, *k_norm;  // per-head norms of q and k before the rotation (Qwen3, Gemma3), or nullptr
    const float *post_attn, *post_ff;  // norms of the attention's and the MLP's outputs (Gemma3), or nullptr
    const float *cos, *sin;  // this layer's rotary table [table_len, F] (Gemma3's two bases), or nullptr: the step's
    C* cache;     // [NB, BS, 2, KV, D]
    long window;  // sliding window, 0 = none
    const QMat *qkv_q, *o_q, *gate_up_q, *down_q;  // block-quantised matrices (then the W pointer is unused)
    // a MoE layer (router non-null: Mixtral's SparseMoeBlock, in place of gate_up / down): router [E, Hd],
    // the stacked experts [E, 2 I, Hd] and [E, Hd, I]; softmax top-k routing, renormalised when renorm
    const float* router;
    const W *experts_gate_up, *experts_down;
    long experts, top_k, renorm, moe_inter;
    // and a shared expert (Qwen2-MoE; shared_gate_up non-null): a gated MLP [2 IS, Hd], [Hd, IS] whose output,
    // times sigmoid(x . shared_gate) (shared_gate [1, Hd]), is added to the experts' sum
    const W *shared_gate_up, *shared_down, *shared_gate;
    long shared_inter;
};
typedef LayerWeightsT<float, float> LayerWeights;

// h [R, Hd] = down(act(gate) * up) of x [R, Hd]. On the panel path gate_up's output stays in panels
// [P, 2 I, lanes], and act_mul over each panel's two halves gives down's input already packed, [P, I, lanes]:
// no 8 x 8 transposes out of gate_up (its rows, 2 I floats apart, fell in one L1 set: a tenth of a prefill
// went there) nor into down, and every value is the row path's bit for bit (the same tiles, act elementwise).
template <typename W, typename C>
static void gated_mlp(const float* x, long R, long Hd, const LayerWeightsT<W, C>& w, long I, int act, float* gu,
                      float* a, float* h, int nt, long path_m) {
    if (path_m <= gemv_rows<W>() || w.gate_up_q || w.down_q) {  // (quantised: the rows of y, as the module path)
        any_linear(x, R, Hd, w.gate_up, w.gate_up_q, 2 * I, Hd, w.gate_up_bias, gu, 2 * I, nt, path_m);
        act_mul(act, gu, R, I, 2 * I, a, nt);
        any_linear(a, R, I, w.down, w.down_q, Hd, I, w.down_bias, h, Hd, nt, path_m);
        return;
    }
    const long lanes = lanes_for(R), P = (R + lanes - 1) / lanes;
    linear_panels(pack(x, R, Hd, Hd, nt), R, w.gate_up, 2 * I, Hd, w.gate_up_bias, nullptr, 0, gu, nt);
    act_mul(act, gu, P, I * lanes, 2 * I * lanes, a, nt);
    linear_panels(a, R, w.down, Hd, I, w.down_bias, h, Hd, nullptr, nt);
}

// h [R, Hd] = the MoE block of x [R, Hd]: router logits (the native linear), softmax top-k, the experts
template <typename W, typename C>
static void moe_mlp(const float* x, long R, long Hd, const LayerWeightsT<W, C>& w, int act, float* h, int nt) {
    static thread_local std::vector<float> logit_store, wt_store;
    static thread_local std::vector<int64_t> id_store;
    float* logits = room(logit_store, R * w.experts);
    float* wts = room(wt_store, R * w.top_k);
    int64_t* ids = room(id_store, R * w.top_k);
    linear(x, R, Hd, w.router, w.experts, Hd, (const float*)nullptr, logits, w.experts, nt, R);
    softmax_topk(logits, R, w.experts, w.top_k, (int)w.renorm, wts, ids);
    moe_experts(x, R, Hd, ids, wts, w.top_k, w.experts_gate_up, w.experts_down, w.experts, w.moe_inter, act, h, nt);
    if (!w.shared_gate_up) return;
    // h += sigmoid(x . shared_gate) * shared(x), as the module path (zoo/layers/moe.py's SparseMoeBlock): the shared
    // expert is a dense gated MLP on the same kernels, the sigmoid in float32, a multiply, then the add
    const long IS = w.shared_inter, Rp = (R + 15) / 16 * 16;
    static thread_local std::vector<float> sgu_store, sa_store, sh_store, sg_store;
    float* sgu = room64(sgu_store, Rp * 2 * IS);  // (rows or panels, as llama_forward's gu and a)
    float* sa = room64(sa_store, Rp * IS);
    float* sh = room(sh_store, R * Hd);
    float* sg = room(sg_store, R);
    LayerWeightsT<W, C> shared{};
    shared.gate_up = w.shared_gate_up, shared.down = w.shared_down;
    gated_mlp(x, R, Hd, shared, IS, act, sgu, sa, sh, nt, R);
    linear(x, R, Hd, w.shared_gate, 1, Hd, (const float*)nullptr, sg, 1, nt, R);
    for (long r = 0; r < R; r++) {
        const float g = 1.0f / (1.0f + std::exp(-sg[r]));
        for (long d = 0; d < Hd; d++) h[r * Hd + d] = h[r * Hd + d] + g * sh[r * Hd + d];
    }
}

// the residual add res += h, or with a norm weight (Gemma3's sandwich) res += norm(h), normed into `scratch`
static void add_normed(float* res, const float* h, float* scratch, long R, long Hd, const float* norm, float eps,
                       int gemma, int nt) {
    if (norm) {
        zoo_rms_norm(h, R, Hd, Hd, norm, eps, gemma, scratch, nt);
        h = scratch;
    }
    for (long i = 0; i < R * Hd; i++) res[i] = res[i] + h[i];
}

template <typename W, typename C>
static int llama_forward(const int64_t* ids, long T, const W* embed, long vocab, long Hd,
                         const LayerWeightsT<W, C>* layers, long nl, long H, long KV, long D, long I, float eps,
                         float scale, const int64_t* pos, const float* cos, const float* sin, long table_len,
                         long F, long nb, long bs, const int64_t* slots, const int32_t* tables,
                         long max_blocks, const int32_t* qsl, const int32_t* seq_lens, long B,
                         const float* final_norm, const int64_t* rows, long N, const W* head,
                         float* logits, int gemma, float embed_scale, int act, int nt, const QMat* embed_q,
                         const QMat* head_q) {
    for (long t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= vocab) return 5;
    for (long t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= table_len) return 2;
    for (long i = 0; i < N; i++)
        if (rows[i] < 0 || rows[i] >= T) return 6;
    // scratch kept between steps up to 64M floats (a 2048-token step of SmolLM2 takes 18M): fresh memory
    // each step cost page faults and zeroing, ~1% of a prefill
    static thread_local std::vector<float> kept;
    std::vector<float> once;
    const long nqkv = (H + 2 * KV) * D;
    const long Tp = (T + 15) / 16 * 16;  // the MLP's buffers hold whole panels of 16 rows
    const long need = T * (3 * Hd + nqkv + 2 * (H + KV) * D + H * D) + Tp * 3 * I + N * (2 * Hd + H * D) + 32;
    std::vector<float>& buf = need <= (64L << 20) ? kept : once;
    float* hidden = room64(buf, need);  // [T, Hd] the residual stream
    float* x = hidden + T * Hd;       // [T, Hd] normed
    float* h = x + T * Hd;            // [T, Hd] a block's output
    float* qkv = h + T * Hd;          // [T, (H + 2 KV) D]
    float* qr = qkv + T * nqkv;       // [T, H, D] rotated q
    float* kr = qr + T * H * D;       // [T, KV, D] rotated k
    float* qn = kr + T * KV * D;      // [T, H, D] normed q (q_norm)
    float* kn = qn + T * H * D;       // [T, KV, D] normed k (k_norm)
    float* att = kn + T * KV * D;     // [T, H D]
    float* gu = (float*)(((uintptr_t)(att + T * H * D) + 63) & ~(uintptr_t)63);  // [Tp, 2 I] (rows or panels)
    float* a = gu + Tp * 2 * I;       // [Tp, I] act(gate) * up
    float* last = a + Tp * I;         // [N, Hd] the sampled rows, normed
    float* keep_att = last + N * Hd;  // [N, H D] the sampled rows' attention output (last layer)
    float* keep_hid = keep_att + N * H * D;  // [N, Hd] and their residual stream
    for (long t = 0; t < T; t++) {
        if (embed_q) qmat_row(*embed_q, ids[t], hidden + t * Hd);
        else widen(embed + ids[t] * Hd, Hd, hidden + t * Hd);
        if (embed_scale != 0.0f)  // Gemma: rows times sqrt(Hd)
            for (long d = 0; d < Hd; d++) hidden[t * Hd + d] = hidden[t * Hd + d] * embed_scale;
    }
    bool pruned = false;  // past the last layer's attention, only the sampled rows (in keep_*)
    for (long l = 0; l < nl; l++) {
        const LayerWeightsT<W, C>& w = layers[l];
        zoo_rms_norm(hidden, T, Hd, Hd, w.ln1, eps, gemma, x, nt);
        any_linear(x, T, Hd, w.qkv, w.qkv_q, nqkv, Hd, w.qkv_bias, qkv, nqkv, nt, T);
        const float *q = qkv, *k = qkv + H * D;
        long q_st = nqkv, k_st = nqkv;
        if (w.q_norm) {  // q and k normed head by head, then rotated
            heads_norm(qkv, T, H, nqkv, D, w.q_norm, eps, gemma, qn, nt);
            heads_norm(qkv + H * D, T, KV, nqkv, D, w.k_norm, eps, gemma, kn, nt);
            q = qn, k = kn, q_st = H * D, k_st = KV * D;
        }
        zoo_rope(q, q_st, D, H, qr, k, k_st, D, KV, kr, T, D, pos, w.cos ? w.cos : cos, w.sin ? w.sin : sin,
                 table_len, F, nt);
        int bad = attention(qr, H * D, D, kr, KV * D, D, qkv + (H + KV) * D, nqkv, D, att, T, H, KV, D, w.cache,
                            nb, bs, slots, tables, max_blocks, qsl, seq_lens, B, scale, w.window, 0.0f, nt);
        if (bad) return bad;
        float *a_in = att, *res = hidden;  // the rows that go on: all, or after the last attention the sampled
        long R = T;
        if (l == nl - 1 && N < T && !w.router) {  // every token's K and V are written: only the sampled rows go on (a prefill
            // step skips the last layer's MLP for the rest, 1 / L of its work). Each kernel below computes a row
            // alone, on the path it takes for T rows: the logits are those of the whole step, bit for bit.
            for (long r = 0; r < N; r++) {
                memcpy(keep_att + r * H * D, att + rows[r] * H * D, H * D * sizeof(float));
                memcpy(keep_hid + r * Hd, hidden + rows[r] * Hd, Hd * sizeof(float));
            }
            a_in = keep_att, res = keep_hid, R = N, pruned = true;
        }
        any_linear(a_in, R, H * D, w.o, w.o_q, Hd, H * D, w.o_bias, h, Hd, nt, T);
        add_normed(res, h, x, R, Hd, w.post_attn, eps, gemma, nt);
        zoo_rms_norm(res, R, Hd, Hd, w.ln2, eps, gemma, x, nt);
        if (w.router)  // (not pruned: each expert's path depends on its row count over the whole step)
            moe_mlp(x, R, Hd, w, act, h, nt);
        else
            gated_mlp(x, R, Hd, w, I, act, gu, a, h, nt, T);
        add_normed(res, h, x, R, Hd, w.post_ff, eps, gemma, nt);
    }
    for (long r = 0; r < N; r++)
        memcpy(x + r * Hd, pruned ? keep_hid + r * Hd : hidden + rows[r] * Hd, Hd * sizeof(float));
    zoo_rms_norm(x, N, Hd, Hd, final_norm, eps, gemma, last, nt);
    any_linear(last, N, Hd, head, head_q, vocab, Hd, nullptr, logits, vocab, nt, N);
    return 0;
}

extern "C" int zoo_llama_forward(const int64_t* ids, long T, const float* embed, long vocab, long Hd,
                                 const LayerWeights* layers, long nl, long H, long KV, long D, long I, float eps,
                                 float scale, const int64_t* pos, const float* cos, const float* sin, long table_len,
                                 long F, long nb, long bs, const int64_t* slots, const int32_t* tables,
                                 long max_blocks, const int32_t* qsl, const int32_t* seq_lens, long B,
                                 const float* final_norm, const int64_t* rows, long N, const float* head,
                                 float* logits, int gemma, float embed_scale, int act, int nt, const QMat* embed_q,
                                 const QMat* head_q) {
    return llama_forward(ids, T, embed, vocab, Hd, layers, nl, H, KV, D, I, eps, scale, pos, cos, sin, table_len, F,
                         nb, bs, slots, tables, max_blocks, qsl, seq_lens, B, final_norm, rows, N, head, logits, gemma,
                         embed_scale, act, nt, embed_q, head_q);
}

// a bfloat16 model: bfloat16 matrices, embedding, head and KV cache; float32 activations and arithmetic
extern "C" int zoo_llama_forward_bf16(const int64_t* ids, long T, const bf16* embed, long vocab, long Hd,
                                      const LayerWeightsT<bf16, bf16>* layers, long nl, long H, long KV, long D,
                                      long I, float eps, float scale, const int64_t* pos, const float* cos,
                                      const float* sin, long table_len, long F, long nb, long bs,
                                      const int64_t* slots, const int32_t* tables, long max_blocks,
                                      const int32_t* qsl, const int32_t* seq_lens, long B, const float* final_norm,
                                      const int64_t* rows, long N, const bf16* head, float* logits, int gemma,
                                      float embed_scale, int act, int nt) {
    return llama_forward(ids, T, embed, vocab, Hd, layers, nl, H, KV, D, I, eps, scale, pos, cos, sin, table_len, F,
                         nb, bs, slots, tables, max_blocks, qsl, seq_lens, B, final_norm, rows, N, head, logits, gemma,
                         embed_scale, act, nt, nullptr, nullptr);
}
