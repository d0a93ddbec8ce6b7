// zoo/kernels/cpu/linear.h: linear: y = x w^T (+ b), the GEMV for few rows and the panel GEMM, float32 and bfloat16
// weights. Built as one unit by ../cpu.cpp, which includes every family in order; the includes below name what this
// one reads.
#pragma once

#include "common.h"

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
