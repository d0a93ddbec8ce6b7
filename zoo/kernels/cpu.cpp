// zoo's native CPU kernels: float32, row-major, no torch headers (loaded with ctypes by zoo/kernels/__init__.py).
//
// Built with -O3 -march=native -ffp-contract=off -fopenmp. Contraction is off so that the elementwise kernels
// round exactly like torch's separate mul / add ops (the rotation equals transformers' bit for bit); the
// reductions use explicit fused multiply-adds (fma16) instead.
//
// Shape legend:
//     M = rows of x (tokens)    K = input features    N = output features    T = tokens    D = head dim
//     H = query heads    KV = key/value heads    B = requests    BS = tokens per block
//
// Threads: OpenMP regions take the caller's count (torch.get_num_threads()); the library resolves to the
// libgomp torch already loaded, so both share one thread pool. Every output element is computed by one
// thread in a fixed order: results do not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v16 load(const float* p) { return *(const v16u*)p; }
static inline void store(float* p, v16 v) { *(v16u*)p = v; }
static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// a * b + c with one rounding
static inline v16 fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    __m256 a0, a1, b0, b1, c0, c1;
    memcpy(&a0, &a, 32); memcpy(&a1, (const char*)&a + 32, 32);
    memcpy(&b0, &b, 32); memcpy(&b1, (const char*)&b + 32, 32);
    memcpy(&c0, &c, 32); memcpy(&c1, (const char*)&c + 32, 32);
    c0 = _mm256_fmadd_ps(a0, b0, c0);
    c1 = _mm256_fmadd_ps(a1, b1, c1);
    v16 r;
    memcpy(&r, &c0, 32); memcpy((char*)&r + 32, &c1, 32);
    return r;
#else
    return a * b + c;
#endif
}

// sum of the 16 lanes, in a fixed tree order
static inline float hsum(v16 v) {
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
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
    v16 xc = x < lo ? lo : x;
    xc = xc > hi ? hi : xc;
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
    i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;  // 2^n
    v16 res = y * (v16)bits;
    return x < lo ? splat(0.0f) : res;
}

static inline float dot(const float* a, const float* b, long n) {
    v16 acc = splat(0.0f);
    long i = 0;
    for (; i + 16 <= n; i += 16) acc = fma16(load(a + i), load(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s = std::fma(a[i], b[i], s);
    return s;
}

// ---------------------------------------------------------------------------------------------------
// Linear: y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]); w [N, K] contiguous as in the checkpoint.
//
// Few rows (M <= 4): each thread streams its contiguous share of w's rows once, one row at a time (one
// sequential stream reads at the memory's speed; several interleaved row streams measured 2x slower), and
// dots it with every row of x (x stays in L1).
// More rows: x is transposed into panels of 16 rows, xt [K, 16]; each w element is broadcast against a
// panel column, so 16 outputs of one w row accumulate in one vector with no horizontal sums; R = 6 rows of
// w at a time keep the FMA units busy.

template <int MB>
static inline void dot_rows(const float* x, long ldx, const float* w, long K, float* y, long ldy, float bias) {
    v16 acc[MB];
    for (int m = 0; m < MB; m++) acc[m] = splat(0.0f);
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        v16 wv = load(w + k);
        for (int m = 0; m < MB; m++) acc[m] = fma16(load(x + m * ldx + k), wv, acc[m]);
    }
    for (int m = 0; m < MB; m++) {
        float s = hsum(acc[m]);
        for (long kk = k; kk < K; kk++) s = std::fma(x[m * ldx + kk], w[kk], s);
        y[m * ldy] = s + bias;
    }
}

static void linear_few(const float* x, long M, long ldx, const float* w, long n0, long n1, long K, const float* b,
                       float* y, long ldy) {
    for (long n = n0; n < n1; n++) {
        const float* wr = w + n * K;
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

// out[r * 16 + lane] = sum_k w[r, k] xt[k, lane] for R rows of w
template <int R>
static inline void panel_rows(const float* xt, const float* w, long K, float* out) {
    v16 acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = splat(0.0f);
    long k = 0;
    for (; k + 2 <= K; k += 2) {
        v16 x0 = load(xt + k * 16), x1 = load(xt + (k + 1) * 16);
        for (int r = 0; r < R; r++) {
            acc[r][0] = fma16(splat(w[r * K + k]), x0, acc[r][0]);
            acc[r][1] = fma16(splat(w[r * K + k + 1]), x1, acc[r][1]);
        }
    }
    if (k < K) {
        v16 x0 = load(xt + k * 16);
        for (int r = 0; r < R; r++) acc[r][0] = fma16(splat(w[r * K + k]), x0, acc[r][0]);
    }
    for (int r = 0; r < R; r++) store(out + 16 * r, acc[r][0] + acc[r][1]);
}

template <int R>
static inline void panel_block(const float* xt, long M, const float* w, long n, long K, const float* b, float* y,
                               long ldy) {
    float out[16 * R];
    for (long p = 0; p * 16 < M; p++) {
        panel_rows<R>(xt + p * K * 16, w + n * K, K, out);
        long lanes = std::min(16L, M - p * 16);
        for (int r = 0; r < R; r++) {
            float bias = b ? b[n + r] : 0.0f;
            for (long l = 0; l < lanes; l++) y[(p * 16 + l) * ldy + n + r] = out[16 * r + l] + bias;
        }
    }
}

static void linear_panels(const float* xt, long M, const float* w, long n0, long n1, long K, const float* b, float* y,
                          long ldy) {
    long n = n0;
    for (; n + 6 <= n1; n += 6) panel_block<6>(xt, M, w, n, K, b, y, ldy);
    for (; n < n1; n++) panel_block<1>(xt, M, w, n, K, b, y, ldy);
}

extern "C" void zoo_linear(const float* x, long M, long ldx, const float* w, long N, long K, const float* b,
                           float* y, long ldy, int nt) {
    static thread_local std::vector<float> xt;
    bool panels = M > 4;
    if (panels) {  // xt [ceil(M / 16), K, 16], zero-padded lanes
        long np = (M + 15) / 16;
        xt.assign(np * K * 16, 0.0f);
        for (long m = 0; m < M; m++)
            for (long k = 0; k < K; k++) xt[((m / 16) * K + k) * 16 + m % 16] = x[m * ldx + k];
    }
    const float* xtp = xt.data();
    int threads = (N * K >= 65536) ? nt : 1;
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nth = omp_get_num_threads();
        long per = ((N + nth - 1) / nth + 47) / 48 * 48;  // whole cache lines of y, whole 6-row blocks
        long n0 = std::min(N, t * per), n1 = std::min(N, n0 + per);
        if (panels)
            linear_panels(xtp, M, w, n0, n1, K, b, y, ldy);
        else
            linear_few(x, M, ldx, w, n0, n1, K, b, y, ldy);
    }
}

// ---------------------------------------------------------------------------------------------------
// RMS norm over rows of D: out = w * (x * r) (Llama), or (x * r) * (1 + w) (Gemma), r = 1 / sqrt(mean(x^2) + eps)

extern "C" void zoo_rms_norm(const float* x, long R, long D, long ldx, const float* w, float eps, int gemma,
                             float* out, int nt) {
    int threads = (R * D >= 131072) ? nt : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < R; i++) {
        const float* xr = x + i * ldx;
        float* o = out + i * D;
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
}

// ---------------------------------------------------------------------------------------------------
// Rotary (rotate-half layout): x [T, n, D] with strides (st, sh, 1) -> out [T, n, D] contiguous;
// the first 2F dims rotate by the table rows cos/sin [L, F] at pos[t], the rest are copied.
// Returns the index of a token whose position is outside the table (nothing written), or -1.

extern "C" long zoo_rope(const float* x, long T, long n, long st, long sh, long D, const int64_t* pos,
                         const float* cos, const float* sin, long L, long F, float* out, int nt) {
    for (long t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= L) return t;
    int threads = (T * n * D >= 131072) ? nt : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < T; t++) {
        const float* c = cos + pos[t] * F;
        const float* s = sin + pos[t] * F;
        for (long h = 0; h < n; h++) {
            const float* xi = x + t * st + h * sh;
            float* o = out + (t * n + h) * D;
            for (long f = 0; f < F; f++) {
                o[f] = xi[f] * c[f] - xi[f + F] * s[f];
                o[f + F] = xi[f + F] * c[f] + xi[f] * s[f];
            }
            for (long d = 2 * F; d < D; d++) o[d] = xi[d];
        }
    }
    return -1;
}

// ---------------------------------------------------------------------------------------------------
// silu(gate) * up for gate_up [T, 2I] (row stride ld) -> out [T, I]; silu(g) = g / (1 + e^-g) as torch

extern "C" void zoo_silu_mul(const float* gu, long T, long I, long ld, float* out, int nt) {
    int threads = (T * I >= 65536) ? nt : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < T; t++) {
        const float* g = gu + t * ld;
        const float* u = g + I;
        float* o = out + t * I;
        long i = 0;
        for (; i + 16 <= I; i += 16) {
            v16 gv = load(g + i);
            store(o + i, (gv / (splat(1.0f) + exp16(-gv))) * load(u + i));
        }
        for (; i < I; i++) o[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
    }
}

// ---------------------------------------------------------------------------------------------------
// Causal attention over flattened tokens and the paged cache [NB * BS, 2, KV, D] (0 = K, 1 = V).
//
// The new tokens' k and v are first written to their slots; then each (token, query head) attends to its
// request's context positions lo .. p (p = its own position; lo = p - window + 1 with a sliding window),
// read through the request's block table. Without a cache (cache == nullptr) every request is a whole
// prompt and its context is its own rows of k and v. q/k/v rows are strided ([T, heads, D], unit last stride).
// The metadata is checked first (nothing is read or written out of bounds); returns 0, or the code of the
// first problem: 1 query_start_loc, 2 seq_lens, 3 slot_mapping, 4 block_tables.

static int check_batch(long T, long B, const int32_t* qsl, const int32_t* seq_lens, const float* cache, long nb,
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

extern "C" int zoo_attention(const float* q, long q_st, long q_sh, const float* k, long k_st, long k_sh,
                             const float* v, long v_st, long v_sh, float* out, long T, long H, long KV, long D,
                             float* cache, long nb, long bs, const int64_t* slots, const int32_t* tables,
                             long max_blocks, const int32_t* qsl, const int32_t* seq_lens, long B, float scale,
                             long window, float softcap, int nt) {
    int bad = check_batch(T, B, qsl, seq_lens, cache, nb, bs, slots, tables, max_blocks);
    if (bad || T == 0) return bad;
    std::vector<int32_t> req(T);
    for (long b = 0; b < B; b++)
        for (long t = qsl[b]; t < qsl[b + 1]; t++) req[t] = (int32_t)b;
    const long G = H / KV, row = 2 * KV * D;
    int threads = (T * H >= 4) ? nt : 1;
#pragma omp parallel num_threads(threads)
    {
        if (cache) {
#pragma omp for schedule(static)
            for (long t = 0; t < T; t++) {
                float* dst = cache + slots[t] * row;
                for (long h = 0; h < KV; h++) {
                    memcpy(dst + h * D, k + t * k_st + h * k_sh, D * sizeof(float));
                    memcpy(dst + (KV + h) * D, v + t * v_st + h * v_sh, D * sizeof(float));
                }
            }  // implicit barrier: every slot is written before any is read
        }
        std::vector<float> sc;
        std::vector<v16> acc((D + 15) / 16);
#pragma omp for schedule(dynamic, 4)
        for (long it = 0; it < T * H; it++) {
            const long t = it / H, h = it % H, kh = h / G, b = req[t];
            const long p = seq_lens[b] - (qsl[b + 1] - t);  // this token's position
            const long lo = window > 0 ? std::max(0L, p - window + 1) : 0;
            const long L = p - lo + 1;
            sc.resize(L + 16);
            const float* qp = q + t * q_st + h * q_sh;
            const int32_t* table = tables + b * max_blocks;
            auto kv_row = [&](long c) -> const float* {  // K row of context position c (V is KV * D further)
                if (cache) return cache + ((long)table[c / bs] * bs + c % bs) * row + kh * D;
                return k + (qsl[b] + c) * k_st + kh * k_sh;
            };
            for (long j = 0; j < L; j++) {
                float s = dot(qp, kv_row(lo + j), D) * scale;
                if (softcap > 0.0f) s = std::tanh(s / softcap) * softcap;
                sc[j] = s;
            }
            v16 mv = splat(-INFINITY);
            long j = 0;
            for (; j + 16 <= L; j += 16) mv = load(&sc[j]) > mv ? load(&sc[j]) : mv;
            float mx = hmax(mv);
            for (; j < L; j++) mx = std::max(mx, sc[j]);
            v16 sv = splat(0.0f);
            for (j = 0; j + 16 <= L; j += 16) {
                v16 e = exp16(load(&sc[j]) - splat(mx));
                store(&sc[j], e);
                sv = sv + e;
            }
            if (j < L) {  // the tail through a padded vector, so every probability comes from exp16
                float tail[16];
                for (long i = 0; i < 16; i++) tail[i] = j + i < L ? sc[j + i] - mx : -INFINITY;
                v16 e = exp16(load(tail));
                for (long i = 0; j + i < L; i++) sc[j + i] = e[i];
                sv = sv + e;  // padded lanes are exactly 0
            }
            const float inv = 1.0f / hsum(sv);
            const long nd = D / 16;
            for (long d = 0; d < nd; d++) acc[d] = splat(0.0f);
            float tail_acc[16] = {0};
            for (j = 0; j < L; j++) {
                const float* vp = cache ? kv_row(lo + j) + KV * D : v + (qsl[b] + lo + j) * v_st + kh * v_sh;
                v16 pj = splat(sc[j]);
                for (long d = 0; d < nd; d++) acc[d] = fma16(pj, load(vp + 16 * d), acc[d]);
                for (long d = nd * 16; d < D; d++) tail_acc[d - nd * 16] = std::fma(sc[j], vp[d], tail_acc[d - nd * 16]);
            }
            float* o = out + (t * H + h) * D;
            for (long d = 0; d < nd; d++) store(o + 16 * d, acc[d] * splat(inv));
            for (long d = nd * 16; d < D; d++) o[d] = tail_acc[d - nd * 16] * inv;
        }
    }
    return 0;
}
