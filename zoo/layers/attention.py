"""Causal attention over flattened tokens, reading and writing the paged KV cache (torch, or a native kernel).

Shape legend:
    T = tokens of the step (all requests)    B = requests     H = query heads    KV = key/value heads
    G = H / KV (query heads per KV head)     D = head dim
    Tq = new tokens of one request           L = context positions of one request read this step
    NB = blocks in the pool                  BS = tokens per block

The cache of one layer is `[NB, BS, 2, KV, D]` (index 0 = K, 1 = V), owned by the runtime and passed in.
Request i's new token j sits at absolute position p = seq_len - Tq + j and attends to the context
positions c with c <= p and, with a sliding window W, c > p - W (the last W positions, itself
included: transformers' `kv_idx > q_idx - sliding_window`). Blocks wholly outside the window are never
read, so a cache manager may recycle them.

Fast path (float32, CPU, no autograd): `zoo.kernels.attention` writes the cache and attends for every
token of every request in one call (no per-request loop, no masks); the torch path below is the reference.
Device path (CUDA): `zoo.kernels.triton.paged_attention`, one launch for the step (decode with split-K, or
prefill / extend tiles), sized from the batch's host lists; the torch path below is its reference too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo import kernels
from zoo.kernels import triton as triton_kernels
from zoo.runtime.batch import CacheSpec, ForwardBatch


class Attention(nn.Module):
    """The attention core of a layer: no parameters; q/k/v come in projected and rotated.

    The module that owns the projections (e.g. `...self_attn`) owns the cache: it declares `cache_spec()`
    (see `spec()`) and passes `batch.kv_caches[its prefix]` here. With no caches at all in the batch
    (an empty `kv_caches`), each request attends to its new tokens only (a whole prompt, nothing cached).
    """

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None, prefix: str = ""):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{prefix}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.sliding_window, self.softcap = scale, sliding_window, softcap
        self.prefix = prefix

    def spec(self, dtype: torch.dtype) -> CacheSpec:
        """What one token costs in this layer's cache: K and V for every KV head."""
        return CacheSpec((2, self.num_kv_heads, self.head_dim), dtype, self.sliding_window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None,
                batch: ForwardBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k and v [T, KV, D] -> [T, H * D]. `sinks` [H] (gpt-oss): one more logit per head in every
        softmax, attending to nothing (it only takes probability away from the context)."""
        if kv_cache is None and batch.seq_lens_cpu:
            self._check_whole_prompts(batch)
        if kernels.device_path(q) and kv_cache is not None and triton_kernels.use(q):  # CUDA: one Triton launch
            kv_cache.view(-1, 2, self.num_kv_heads, self.head_dim).index_copy_(
                0, batch.slot_mapping, torch.stack((k, v), dim=1).to(kv_cache.dtype))  # [T, 2, KV, D] into their slots
            qsl = batch.query_start_loc_cpu
            return triton_kernels.paged_attention(
                q, kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale=self.scale,
                max_query_len=max((qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)), default=0),
                max_seq_len=max(batch.seq_lens_cpu, default=0), sliding_window=self.sliding_window,
                softcap=self.softcap, sinks=sinks)  # [T, H * D]
        if sinks is None and kernels.fast(q, k, v) and (kv_cache is None or (
                kernels.stored(kv_cache) and kv_cache.is_contiguous())):
            return kernels.attention(q, k, v, kv_cache, batch, scale=self.scale, sliding_window=self.sliding_window,
                                     softcap=self.softcap)  # [T, H * D]
        if kv_cache is not None:  # (a bfloat16 cache under float32 activations stores k and v rounded)
            flat = kv_cache.view(-1, 2, self.num_kv_heads, self.head_dim)  # [NB * BS, 2, KV, D]
            flat.index_copy_(0, batch.slot_mapping, torch.stack((k, v), dim=1).to(kv_cache.dtype))  # [T, 2, KV, D]
        starts, out = batch.query_start_loc_cpu, torch.empty_like(q)  # [T, H, D]
        for i, seq_len in enumerate(batch.seq_lens_cpu):
            s, e = starts[i], starts[i + 1]
            if e == s:
                continue
            first = 0 if self.sliding_window is None else max(0, seq_len - (e - s) - self.sliding_window + 1)
            if kv_cache is None:
                ctx_k, ctx_v, first = k[s:e], v[s:e], 0  # [L, KV, D]
            else:
                ctx_k, ctx_v, first = self._context(kv_cache, batch, i, first, seq_len, q.dtype)
            out[s:e] = self._attend(q[s:e], ctx_k, ctx_v, first, seq_len, sinks)
        return out.flatten(1)  # [T, H * D]

    def _check_whole_prompts(self, batch: ForwardBatch) -> None:
        starts = batch.query_start_loc_cpu
        for i, seq_len in enumerate(batch.seq_lens_cpu):
            if seq_len != starts[i + 1] - starts[i]:
                raise ValueError(f"{self.prefix}: request {i} has {seq_len - (starts[i + 1] - starts[i])} cached "
                                 f"tokens but the batch carries no KV cache for this layer")

    def _context(self, kv_cache, batch, i, first, seq_len, dtype):
        """K, V [L, KV, D] of request i's context positions first // BS * BS .. seq_len - 1, as `dtype`."""
        bs = kv_cache.shape[1]
        b0, b1 = first // bs, (seq_len + bs - 1) // bs
        blocks = kv_cache[batch.block_tables[i, b0:b1]]  # [nb, BS, 2, KV, D]
        ctx = blocks.flatten(0, 1)[: seq_len - b0 * bs].to(dtype)  # [L, 2, KV, D]
        return ctx[:, 0], ctx[:, 1], b0 * bs

    def _attend(self, q, k, v, first, seq_len, sinks=None):
        """q [Tq, H, D] at positions seq_len - Tq ..; k, v [L, KV, D] at positions first .. seq_len - 1."""
        tq, length = q.shape[0], k.shape[0]
        q_pos = torch.arange(seq_len - tq, seq_len, device=q.device)[:, None]  # [Tq, 1]
        k_pos = torch.arange(first, first + length, device=q.device)[None, :]  # [1, L]
        mask = k_pos <= q_pos  # [Tq, L]
        if self.sliding_window is not None:
            mask &= k_pos > q_pos - self.sliding_window
        if self.softcap is None and sinks is None:
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],  # [1, H|KV, Tq|L, D]
                attn_mask=mask, scale=self.scale, enable_gqa=True)  # [1, H, Tq, D]
            return o[0].transpose(0, 1)  # [Tq, H, D]
        # softcapped scores, or scores with a sink, are not SDPA's: q grouped per KV head (no repeated K/V)
        g = self.num_heads // self.num_kv_heads
        qg = q.view(tq, self.num_kv_heads, g, self.head_dim).permute(1, 2, 0, 3)  # [KV, G, Tq, D]
        scores = (qg.flatten(1, 2) @ k.permute(1, 2, 0)) * self.scale  # [KV, G*Tq, D] @ [KV, D, L] = [KV, G*Tq, L]
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.view(self.num_kv_heads, g, tq, length).masked_fill(~mask, float("-inf"))  # [KV, G, Tq, L]
        if sinks is None:
            probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        else:  # head h = kv * G + g has one more logit, sinks[h]; its probability is dropped
            sink = sinks.view(self.num_kv_heads, g, 1, 1).expand(-1, -1, tq, 1).to(scores.dtype)  # [KV, G, Tq, 1]
            probs = torch.cat((scores, sink), -1).softmax(-1, dtype=torch.float32)[..., :-1].to(q.dtype)
        o = probs.flatten(1, 2) @ v.transpose(0, 1)  # [KV, G*Tq, L] @ [KV, L, D] = [KV, G*Tq, D]
        return o.view(self.num_kv_heads, g, tq, self.head_dim).permute(2, 0, 1, 3).flatten(1, 2)  # [Tq, H, D]

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"scale={self.scale:.4g}, sliding_window={self.sliding_window}, softcap={self.softcap}")
