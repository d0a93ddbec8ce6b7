"""Multi-head latent attention (DeepSeek-V2/V3) on flattened tokens, with a paged latent cache.

Shape legend:
    T  = tokens of the step            NH = attention heads             H = hidden size
    R  = kv_lora_rank (the latent)     DR = qk_rope_head_dim            DN = qk_nope_head_dim
    DV = v_head_dim                    DQ = DN + DR                     QR = q_lora_rank
    Q  = new tokens of one request     S  = its context length (cached + new)
    D  = decode requests of the step   L  = longest context among them (padded to whole blocks)
    C  = R + DR, one cache row         NB, BS = blocks in the pool, tokens per block

A token's cache row is [normalised latent (R) | rotated rope key (DR)], one row shared by all heads:
C elements per token and layer instead of 2 * NH * DQ.

Two ways to attend over the same cache rows (kv_b_proj.weight = [W_UK; W_UV] per head):
  expand   (prefill): up-project each cached latent to per-head k_nope = W_UK c and v = W_UV c, then
           ordinary causal attention with k = [k_nope | k_rope broadcast over the heads].
  absorbed (decode):  fold W_UK into the query and W_UV into the output and attend in latent space:
           score = (W_UK^T q_nope) . c + q_rope . k_rope,   out = W_UV (softmax . c).
           Each context token then costs C, not NH * (DQ + DV), and nothing is up-projected.
Rotary acts on the DR rope lanes only. DeepSeek-V2 (always) and V3 (rope_interleave) rotate adjacent pairs;
the layer gathers the even lanes then the odd ones and rotates halves, which yields the rotated lanes in
that gathered order (transformers' V3 output order) for q and k alike, so every score is unchanged.

CPU fast path (float32 activations, kernels on; the latent cache and kv_b_proj float32, or bfloat16 read widened):
the absorbed decode of every one-token request is one native call,
`kernels.mla_decode` (per request and head: W_UK^T q, the scores over the cached rows, the softmax, the
latents' weighted sum through W_UV), and the layer's small torch ops run on one thread (kernels.serial_torch).

A request with one new token takes the absorbed path, any other the expanded one (`self.mode` forces
either for every request, which is how the tests check that the two agree).
"""
from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from zoo import kernels
from zoo.layers.linear import Linear
from zoo.layers.norm import RMSNorm
from zoo.layers.rotary import RotaryEmbedding
from zoo.runtime.batch import CacheSpec, ForwardBatch


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope_parameters: dict | None) -> float:
    """DQ^-0.5, times mscale(factor, mscale_all_dim)^2 when a scaled rope sets mscale_all_dim (DeepSeek yarn)."""
    rp = rope_parameters or {}
    scale = qk_head_dim ** -0.5
    if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
        scale *= _yarn_mscale(rp["factor"], rp["mscale_all_dim"]) ** 2
    return scale


class MLAttention(nn.Module):
    """DeepSeek's attention; submodule names equal the checkpoint's (`q_a_proj`, `kv_b_proj`, ...)."""

    MODES = ("auto", "expand", "absorbed")
    # steps whose longest request has at most this many new tokens run torch's ops on one thread; a longer
    # prompt's expanded attention (SDPA over [NH, Q, S]) is work enough to keep torch's threads
    SERIAL_MAX_QUERY = 256

    def __init__(self, *, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope: RotaryEmbedding,
                 scale: float, rope_interleave: bool, attention_bias: bool = False,
                 lora_norm_eps: float = 1e-6, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.rotary_emb = rope  # a shared plain object, not a submodule
        self.rope_interleave, self.scale = rope_interleave, scale
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, num_heads * self.qk_dim)  # H -> NH*DQ
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=attention_bias)  # H -> QR
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=lora_norm_eps)
            self.q_b_proj = Linear(q_lora_rank, num_heads * self.qk_dim)  # QR -> NH*DQ
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=attention_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=lora_norm_eps)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        self.kv_b_proj.weight.quantizable = False  # read as per-head matrices by the absorbed decode
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size, bias=attention_bias)
        self.mode = "auto"  # "expand" / "absorbed" force one path for every request
        self.path_counts: Counter = Counter()  # requests served by each path, for tests and stats

    def cache_spec(self) -> CacheSpec:
        """One token of this layer's cache: the latent and the rope key, (R + DR,), keyed by `self.prefix`."""
        return CacheSpec((self.kv_lora_rank + self.rope_dim,), self.kv_b_proj.weight.dtype)

    # -- projections -------------------------------------------------------------------------------
    def _project(self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch):
        """-> q_nope [T, NH, DN], rotated q_rope [T, NH, DR], cache rows [T, C] = [latent | rotated k_rope]."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)  # [T, NH*DQ]
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # [T, H] -> [T, QR] -> [T, NH*DQ]
        q_nope, q_rope = q.view(-1, self.num_heads, self.qk_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)  # [T, R + DR]
        latent, k_rope = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [T, R], [T, DR]
        k_rope = k_rope[:, None, :]  # [T, 1, DR], one key shared by all heads
        if self.rope_interleave:  # rotate pairs (x0, x1), (x2, x3)...: move even lanes first, odd lanes last
            q_rope, k_rope = (torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1) for t in (q_rope, k_rope))
        q_rope, k_rope = self.rotary_emb(positions, q_rope, k_rope, batch)  # [T, NH, DR], [T, 1, DR]
        return q_nope, q_rope, torch.cat([self.kv_a_layernorm(latent), k_rope[:, 0]], dim=-1)  # .., [T, C]

    def _w_uk_uv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.to(dtype).view(self.num_heads, -1, self.kv_lora_rank)  # [NH, DN+DV, R]
        return w[:, : self.nope_dim], w[:, self.nope_dim:]  # [NH, DN, R], [NH, DV, R]

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.mode not in self.MODES:
            raise ValueError(f"{self.prefix}.mode={self.mode!r} is not one of {self.MODES}")
        qsl = batch.query_start_loc_cpu
        if kernels.fast(x) and max(
                (b - a for a, b in zip(qsl, qsl[1:])), default=0) <= self.SERIAL_MAX_QUERY:
            with kernels.serial_torch():  # torch's small ops on one thread (kernels.serial_torch)
                return self._forward(positions, x, batch)
        return self._forward(positions, x, batch)

    def _forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q_nope, q_rope, rows = self._project(x, positions, batch)  # [T, NH, DN], [T, NH, DR], [T, C]
        cache = batch.cache_for(self.prefix)  # [NB, BS, C] or None (whole prompts only)
        if cache is not None:  # [T, C] into their slots (a bfloat16 cache under float32 activations: rounded)
            cache.view(-1, cache.shape[-1]).index_copy_(0, batch.slot_mapping, rows.to(cache.dtype))
        qsl, seq_lens = batch.query_start_loc_cpu, batch.seq_lens_cpu
        out = x.new_empty(x.shape[0], self.num_heads, self.v_dim)  # [T, NH, DV]
        expand, decode, absorbed_multi = [], [], []  # request indices per path
        for i in range(len(seq_lens)):
            q_len = qsl[i + 1] - qsl[i]
            if q_len == 0:
                continue
            path = self.mode if self.mode != "auto" else ("absorbed" if q_len == 1 else "expand")
            (expand if path == "expand" else decode if q_len == 1 else absorbed_multi).append(i)
        for i in expand:
            self._expand_one(i, q_nope, q_rope, rows, cache, batch, out)
        for i in absorbed_multi:
            self._absorbed_one(i, q_nope, q_rope, rows, cache, batch, out)
        if decode:
            self._absorbed_decode(decode, q_nope, q_rope, rows, cache, batch, out)
        return self.o_proj(out.flatten(1))  # [T, NH*DV] -> [T, H]

    def _context(self, i: int, rows: torch.Tensor, cache, batch: ForwardBatch) -> torch.Tensor:
        """Request i's context rows [S, C] (as the step's rows' dtype): from the paged cache, or from this step when
        there is none."""
        s, q0, q1 = batch.seq_lens_cpu[i], batch.query_start_loc_cpu[i], batch.query_start_loc_cpu[i + 1]
        if cache is None:
            if s != q1 - q0:
                raise ValueError(f"{self.prefix}: request {i} has {s - (q1 - q0)} cached tokens but "
                                 f"batch.kv_caches holds no cache for {self.prefix!r}")
            return rows[q0:q1]
        n_blocks = -(-s // batch.block_size)
        blocks = batch.block_tables[i, :n_blocks].long()  # [S/BS]
        return cache[blocks].reshape(-1, cache.shape[-1])[:s].to(rows.dtype)  # [S, C]

    @staticmethod
    def _causal(s: int, q_len: int, device) -> torch.Tensor:
        """valid [Q, S]: new token j sits at context index S - Q + j and sees indices up to it."""
        return torch.arange(s, device=device) <= torch.arange(s - q_len, s, device=device)[:, None]

    def _expand_one(self, i, q_nope, q_rope, rows, cache, batch, out) -> None:
        self.path_counts["expand"] += 1
        q0, q1 = batch.query_start_loc_cpu[i], batch.query_start_loc_cpu[i + 1]
        ctx = self._context(i, rows, cache, batch)  # [S, C]
        latent, k_rope = ctx.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [S, R], [S, DR]
        kv = self.kv_b_proj(latent).view(-1, self.num_heads, self.nope_dim + self.v_dim)  # [S, NH, DN+DV]
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [S, NH, DN], [S, NH, DV]
        k = torch.cat([k_nope, k_rope[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)  # [S, NH, DQ]
        q = torch.cat([q_nope[q0:q1], q_rope[q0:q1]], dim=-1)  # [Q, NH, DQ]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),  # [NH, Q|S, DQ|DQ|DV]
            attn_mask=self._causal(ctx.shape[0], q1 - q0, ctx.device), scale=self.scale)  # [NH, Q, DV]
        out[q0:q1] = o.transpose(0, 1)  # [Q, NH, DV]

    def _absorbed(self, q_nope, q_rope, ctx, valid) -> torch.Tensor:
        """q_nope [D, Q, NH, DN], q_rope [D, Q, NH, DR], ctx [D, L, C], valid [D, Q, L] -> [D, Q, NH, DV].

        With W_UK folded into the query, [W_UK^T q_nope | q_rope] . [c | k_rope] is the whole score: the
        attention is multi-query, every head reading the one cache row, and the value is the latent c.
        """
        w_uk, w_uv = self._w_uk_uv(q_nope.dtype)  # [NH, DN, R], [NH, DV, R]
        q = torch.cat([torch.einsum("dqnk,nkr->dqnr", q_nope, w_uk), q_rope], dim=-1)  # [D, Q, NH, C]
        o_lat = F.scaled_dot_product_attention(
            q.transpose(1, 2), ctx[:, None], ctx[:, None, :, : self.kv_lora_rank],  # [D, NH|1|1, Q|L|L, C|C|R]
            attn_mask=valid[:, None], scale=self.scale, enable_gqa=True)  # [D, NH, Q, R]
        return torch.einsum("dnqr,nvr->dqnv", o_lat, w_uv)  # [D, Q, NH, DV]

    def _absorbed_decode(self, reqs, q_nope, q_rope, rows, cache, batch, out) -> None:
        """Every one-token request of the step at once, over contexts padded to L."""
        self.path_counts["absorbed"] += len(reqs)
        if cache is not None and kernels.fast(q_nope, q_rope) and kernels.stored(cache, self.kv_b_proj.weight):
            kernels.mla_decode(q_nope, q_rope, cache, self.kv_b_proj.weight, batch.block_tables,  # one native call
                               [batch.query_start_loc_cpu[i] for i in reqs], reqs,
                               [batch.seq_lens_cpu[i] for i in reqs], v_dim=self.v_dim, scale=self.scale, out=out)
            return
        tok = torch.tensor([batch.query_start_loc_cpu[i] for i in reqs], device=rows.device)  # [D]
        lens = [batch.seq_lens_cpu[i] for i in reqs]
        if cache is None:
            ctx = torch.stack([self._context(i, rows, None, batch) for i in reqs])  # [D, 1, C]
        else:
            n_blocks = -(-max(lens) // batch.block_size)
            blocks = batch.block_tables[reqs][:, :n_blocks].long()  # [D, L/BS]
            ctx = cache[blocks].flatten(1, 2).to(rows.dtype)  # [D, L, C]
        lens_t = torch.tensor(lens, device=rows.device)  # [D]
        valid = torch.arange(ctx.shape[1], device=rows.device) < lens_t[:, None]  # [D, L]
        ctx = ctx.masked_fill(~valid[..., None], 0.0)  # padding rows may hold anything (NaN): 0 * NaN is NaN
        o = self._absorbed(q_nope[tok, None], q_rope[tok, None], ctx, valid[:, None])  # [D, 1, NH, DV]
        out[tok] = o[:, 0]

    def _absorbed_one(self, i, q_nope, q_rope, rows, cache, batch, out) -> None:
        """A multi-token request through the absorbed path (only when `mode` forces it)."""
        self.path_counts["absorbed"] += 1
        q0, q1 = batch.query_start_loc_cpu[i], batch.query_start_loc_cpu[i + 1]
        ctx = self._context(i, rows, cache, batch)  # [S, C]
        valid = self._causal(ctx.shape[0], q1 - q0, ctx.device)  # [Q, S]
        out[q0:q1] = self._absorbed(q_nope[None, q0:q1], q_rope[None, q0:q1], ctx[None], valid[None])[0]

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
                f"nope={self.nope_dim}, rope={self.rope_dim}, v={self.v_dim}, scale={self.scale:.6g}")
