"""Triton paged attention over the zoo's KV cache: one kernel for decode (split-K over long contexts, then a
reduce kernel) and for prefill / extend (query tiles of ragged requests over their cached prefix + the chunk).

Shape legend (as zoo/layers/attention.py):
    T = query tokens of the step   B = requests   H = query heads   KV = key/value heads   G = H / KV
    D = head dim                   NB = blocks    BS = tokens per block    S = key splits (split-K)

The cache is `[NB, BS, 2, KV, D]` (0 = K, 1 = V); request b's new tokens are q rows query_start_loc[b] ..
query_start_loc[b+1] - 1 at positions seq_lens[b] - n .. seq_lens[b] - 1, its context the blocks
block_tables[b, :]. Token at position p attends to positions c <= p (and c > p - W with a window W).

One program: request b, a tile of BLOCK_M query tokens, one KV head and all its G query heads (rows = token x
head, so K/V are read once per KV head: GQA without repeating them), one split s of the context; it walks
the split's key positions BLOCK_N at a time (each row of K/V found through block_tables, any BS), with an
online softmax in float32. With S = 1 it writes the output; else (m, l, acc) per split and
`_reduce_kernel` combines them (and a sink logit, gpt-oss). Softcap: cap * tanh(s / cap) on the scores.
The torch reference is zoo/layers/attention.py's own path (tests/test_triton_kernels.py compares them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _attention_kernel(
        q_ptr, q_s0, q_s1, cache_ptr, c_blk, c_tok, c_kv, c_head, tables_ptr, t_s0, qsl_ptr, seq_lens_ptr,
        sinks_ptr, out_ptr, o_s0, o_s1, part_ptr, ml_ptr, scale, softcap, window,
        BS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, S: tl.constexpr, H: tl.constexpr,
        SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr, USE_DOT: tl.constexpr,
        PRECISION: tl.constexpr):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kh = tl.program_id(2) // S
    split = tl.program_id(2) % S
    q0 = tl.load(qsl_ptr + b)
    n_new = tl.load(qsl_ptr + b + 1) - q0
    if tile * BLOCK_M >= n_new:  # (also an empty request)
        return
    seq_len = tl.load(seq_lens_ptr + b)
    rows = tl.arange(0, BLOCK_M * GP)  # [M*GP] row = token * GP + head in group
    t = tile * BLOCK_M + rows // GP  # token index within the request
    g = rows % GP
    row_ok = (t < n_new) & (g < G)
    pos = seq_len - n_new + t  # [rows] absolute position of the query token
    head = kh * G + g
    d = tl.arange(0, DP)
    d_ok = d < D
    q = tl.load(q_ptr + (q0 + t)[:, None] * q_s0 + head[:, None] * q_s1 + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [rows, DP]
    # key positions this program reads: [first, last) of the tile's rows, cut into S splits of whole BLOCK_Ns
    p_lo = seq_len - n_new + tile * BLOCK_M
    p_hi = tl.minimum(seq_len - n_new + tile * BLOCK_M + BLOCK_M, seq_len)  # one past the tile's last position
    first = 0
    if WINDOW:
        first = tl.maximum(p_lo - window + 1, 0)
    span = tl.cdiv(tl.cdiv(p_hi - first, S), BLOCK_N) * BLOCK_N
    start = first + split * span
    end = tl.minimum(start + span, p_hi)
    m_i = tl.full([BLOCK_M * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GP], tl.float32)
    acc = tl.zeros([BLOCK_M * GP, DP], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for k0 in range(start, end, BLOCK_N):
        kpos = k0 + offs_n  # [N]
        k_ok = kpos < end
        page = tl.load(tables_ptr + b * t_s0 + kpos // BS, mask=k_ok, other=0).to(tl.int64)
        base = page * c_blk + (kpos % BS) * c_tok + kh * c_head  # [N]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, DP]
        v = tl.load(cache_ptr + c_kv + base[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, DP]
        if USE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [rows, N]
        else:
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [rows, N]
        s = s * scale
        if SOFTCAP:
            s = _tanh(s / softcap) * softcap
        ok = k_ok[None, :] & (kpos[None, :] <= pos[:, None])
        if WINDOW:
            ok = ok & (kpos[None, :] > pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])  # [rows, N]
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # [rows, DP]
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out_rows = q0 + t
    if S == 1:
        if SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            m_all = tl.maximum(m_i, sink)
            l_i = l_i * tl.exp(m_i - m_all) + tl.exp(sink - m_all)
            acc = acc * tl.exp(m_i - m_all)[:, None]
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + out_rows[:, None] * o_s0 + head[:, None] * o_s1 + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:  # partials: part [T, H, S, D], ml [T, H, S, 2]
        idx = (out_rows * H + head) * S + split
        tl.store(part_ptr + idx[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(ml_ptr + idx * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + idx * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _reduce_kernel(part_ptr, ml_ptr, sinks_ptr, out_ptr, o_s0, o_s1,
                   H: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                   SINKS: tl.constexpr):
    """One (token, head): out = sum_s exp(m_s - M) acc_s / (sum_s exp(m_s - M) l_s [+ exp(sink - M)])."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SP)
    s_ok = s < S
    d = tl.arange(0, DP)
    idx = (row * H + head) * S + s
    m = tl.load(ml_ptr + idx * 2, mask=s_ok, other=float("-inf"))  # [SP]
    l = tl.load(ml_ptr + idx * 2 + 1, mask=s_ok, other=0.0)
    m_all = tl.max(m, axis=0)
    if SINKS:
        m_all = tl.maximum(m_all, tl.load(sinks_ptr + head).to(tl.float32))
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))  # [SP]
    total = tl.sum(w * l, axis=0)
    if SINKS:
        total += tl.exp(tl.load(sinks_ptr + head).to(tl.float32) - m_all)
    acc = tl.load(part_ptr + idx[:, None] * D + d[None, :], mask=s_ok[:, None] & (d[None, :] < D), other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / total  # [DP]
    tl.store(out_ptr + row * o_s0 + head * o_s1 + d, o.to(out_ptr.dtype.element_ty), mask=d < D)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, *, scale: float, max_query_len: int, max_seq_len: int,
                    sliding_window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """q [T, H, D] -> [T, H * D] over the cache [NB, BS, 2, KV, D] (already holding this step's keys and values).

    `max_query_len`, `max_seq_len`: host ints (the batch's lists), sizing the grid without reading the device.
    Decode steps (max_query_len 1) take one token per program and split long contexts into `num_splits`
    (default: enough programs to fill the device, at least 128 keys per split); extend steps take query tiles.
    """
    t, h, d = q.shape
    nb, bs, two, kvh, d2 = kv_cache.shape
    if two != 2 or d2 != d or h % kvh or q.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} and kv_cache {tuple(kv_cache.shape)} must be "
                         f"[T, H, D] and [NB, BS, 2, KV, D] with H a multiple of KV and unit last strides")
    g = h // kvh
    gp = triton.next_power_of_2(g)
    dp = triton.next_power_of_2(d)
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    b = seq_lens.shape[0]
    if t == 0 or b == 0:
        return out.view(t, h * d)
    block_m = 1 if max_query_len <= 1 else max(1, 16 // gp)
    block_n = 16 if dp >= 128 else 32
    tiles = triton.cdiv(max(max_query_len, 1), block_m)
    if num_splits is None:
        sm = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        num_splits = 1 if max_query_len > 1 else max(1, min(triton.cdiv(max_seq_len, 128),
                                                            triton.cdiv(2 * sm, b * kvh), 64))
    rows = block_m * gp
    use_dot = rows >= 16 and dp >= 16 and block_n >= 16
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    part = ml = out
    if num_splits > 1:
        part = torch.empty(t, h, num_splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(t, h, num_splits, 2, dtype=torch.float32, device=q.device)
    window = sliding_window or 0
    _attention_kernel[(b, tiles, kvh * num_splits)](
        q, q.stride(0), q.stride(1), kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), block_tables, block_tables.stride(0), query_start_loc, seq_lens,
        sinks if sinks is not None else q, out, out.stride(0), out.stride(1), part, ml,
        float(scale), float(softcap or 1.0), int(window),
        BS=bs, G=g, GP=gp, D=d, DP=dp, BLOCK_M=block_m, BLOCK_N=block_n, S=num_splits, H=h,
        SOFTCAP=softcap is not None, WINDOW=bool(window), SINKS=sinks is not None, USE_DOT=use_dot,
        PRECISION=precision)
    if num_splits > 1:
        _reduce_kernel[(t, h)](part, ml, sinks if sinks is not None else q, out, out.stride(0), out.stride(1),
                               H=h, S=num_splits, SP=triton.next_power_of_2(num_splits), D=d, DP=dp,
                               SINKS=sinks is not None)
    return out.view(t, h * d)
