// zoo/kernels/cpu/attention.h: attention: multi-head latent attention's absorbed decode, causal attention over the
// paged cache. Built as one unit by ../cpu.cpp, which includes every family in order; the includes below name what
// this one reads.
#pragma once

#include "linear.h"

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
