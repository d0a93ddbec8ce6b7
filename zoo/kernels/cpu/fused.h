// zoo/kernels/cpu/fused.h: zoo_llama_step (its arguments in one struct, StepArgs): a whole decoder step of a
// Llama-structured model, made of the kernels above. Built as one unit by ../cpu.cpp, which includes every family in
// order; the includes below name what this one reads (zoo_argmax: sampling.h).
#pragma once

#include "linear.h"
#include "quant.h"
#include "rows.h"
#include "moe.h"
#include "attention.h"
#include "sampling.h"

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

// the step's arguments: the model's fields, which the runner sets once (zoo/kernels/fused.py's StepBuffers), and the
// step's metadata arrays, which it updates in place (one argument to convert per call: after a decode step has
// streamed the weights through the caches, each converted ctypes argument costs misses), plus each sampled row's
// argmax, read from the logits while the head's threads still hold them
struct StepArgs {
    const int64_t *ids, *pos, *slots, *rows;
    const int32_t *tables, *qsl, *seq_lens;
    long T, B, N, max_blocks;
    const float *cos, *sin;
    long table_len, F;
    const void *embed, *head;  // float or bf16 (bf16 != 0)
    const void* layers;        // LayerWeights or LayerWeightsT<bf16, bf16>
    const QMat *embed_q, *head_q;
    const float* final_norm;
    long vocab, Hd, nl, H, KV, D, I, nb, bs;
    float eps, scale, embed_scale;
    int gemma, act, nt, bf16;
    float* logits;           // [N, vocab]
    int64_t* argmax;         // [N] or null: each row's zoo_argmax index ...
    float* argmax_values;    // [N] ... and its value (the sampler checks it is finite)
};

template <typename W, typename C>
static int llama_forward(const StepArgs& s) {
    const int64_t *ids = s.ids, *pos = s.pos, *rows = s.rows;
    const long T = s.T, N = s.N, vocab = s.vocab, Hd = s.Hd, nl = s.nl, H = s.H, KV = s.KV, D = s.D, I = s.I;
    const float eps = s.eps;
    const int gemma = s.gemma, act = s.act, nt = s.nt;
    const LayerWeightsT<W, C>* layers = (const LayerWeightsT<W, C>*)s.layers;
    const QMat *embed_q = s.embed_q, *head_q = s.head_q;
    for (long t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= vocab) return 5;
    for (long t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= s.table_len) return 2;
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
        else widen((const W*)s.embed + ids[t] * Hd, Hd, hidden + t * Hd);
        if (s.embed_scale != 0.0f)  // Gemma: rows times sqrt(Hd)
            for (long d = 0; d < Hd; d++) hidden[t * Hd + d] = hidden[t * Hd + d] * s.embed_scale;
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
        zoo_rope(q, q_st, D, H, qr, k, k_st, D, KV, kr, T, D, pos, w.cos ? w.cos : s.cos, w.sin ? w.sin : s.sin,
                 s.table_len, s.F, nt);
        int bad = attention(qr, H * D, D, kr, KV * D, D, qkv + (H + KV) * D, nqkv, D, att, T, H, KV, D, w.cache,
                            s.nb, s.bs, s.slots, s.tables, s.max_blocks, s.qsl, s.seq_lens, s.B, s.scale, w.window,
                            0.0f, nt);
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
    zoo_rms_norm(x, N, Hd, Hd, s.final_norm, eps, gemma, last, nt);
    any_linear(last, N, Hd, (const W*)s.head, head_q, vocab, Hd, nullptr, s.logits, vocab, nt, N);
    return 0;
}

// a float32 model (its matrices float32 or block-quantised), or a bfloat16 one: bfloat16 matrices, embedding, head and
// KV cache; float32 activations and arithmetic (no block-quantised embedding or head)
extern "C" int zoo_llama_step(const StepArgs* a) {
    int bad = a->bf16 ? llama_forward<bf16, bf16>(*a) : llama_forward<float, float>(*a);
    if (!bad && a->argmax) zoo_argmax(a->logits, a->N, a->vocab, a->vocab, a->argmax, a->argmax_values, a->nt);
    return bad;
}
