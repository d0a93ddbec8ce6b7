// zoo/kernels/cpu/moe.h: mixture-of-experts: tokens grouped by expert, each group through its expert's gate/up and
// down. Built as one unit by ../cpu.cpp, which includes every family in order; the includes below name what this one
// reads.
#pragma once

#include "linear.h"
#include "rows.h"

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
