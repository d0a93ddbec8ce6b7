// zoo/kernels/cpu/rows.h: row-wise kernels: RMS norm, rotary, SiLU / GELU-and-mul. Built as one unit by
// ../cpu.cpp, which includes every family in order; the includes below name what this one reads.
#pragma once

#include "common.h"

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
