// zoo/kernels/cpu/ssm.h: recurrent mixers: Mamba2 / SSD (conv, chunked scan, gated norm), Mamba1's conv and selective
// scan. Built as one unit by ../cpu.cpp, which includes every family in order; the includes below name what this one
// reads.
#pragma once

#include "rows.h"

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
