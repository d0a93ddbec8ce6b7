// zoo/kernels/cpu/quant.h: linear over GGUF block-quantised weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) and the int8
// / int16 activation GEMV. Built as one unit by ../cpu.cpp, which includes every family in order; the includes below
// name what this one reads.
#pragma once

#include "linear.h"

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
