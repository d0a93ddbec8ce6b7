"""State-space building blocks, pure torch (the reference path): the causal depthwise conv with its carried
window, Mamba2's chunked SSD scan with chunks aligned to absolute positions, its one-token recurrence,
Mamba1's selective scan, and the gated group RMSNorm.

Shape legend:
    L = new tokens of one request     R = requests of a decode group (one token each)
    C = conv channels    K = conv width
    h = heads    p = head dim    N = state size    I = Mamba1 channels
    cs = chunk size      Q = chunks of one request    P = Q * cs padded positions

Chunk alignment: request tokens at absolute positions c .. c + L - 1 are scanned in the chunks
[k * cs, (k + 1) * cs) a one-shot scan of the whole sequence would use, so a prefill split anywhere
computes the same chunks. The first chunk is filled in front with c % cs positions of dt = 0: they
neither decay the state (exp(0 * A) = 1) nor add to it (dt * x = 0), and their outputs are dropped.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


# -- causal depthwise conv ---------------------------------------------------------------------------------

def causal_conv(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """x [L, C] new inputs, prev [K-1, C] the K-1 inputs before them (zeros at a sequence start), weight
    [C, 1, K] -> (silu(conv + bias) [L, C], the last K-1 inputs [K-1, C], the window carried on)."""
    k = weight.shape[-1]
    window = torch.cat((prev.to(x.dtype), x))  # [K-1+L, C]
    # (a channels-first copy: conv1d on the transposed view takes a path ~100x slower on the CPU)
    out = F.conv1d(window.t().contiguous()[None].to(weight.dtype), weight, bias, groups=x.shape[1])[0].t()  # [L, C]
    return F.silu(out).to(x.dtype), window[window.shape[0] - (k - 1):]


def causal_conv_step(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """One token per request: x [R, C], prev [R, K-1, C] -> (silu(conv + bias) [R, C], new prev [R, K-1, C])."""
    window = torch.cat((prev.to(x.dtype), x[:, None]), dim=1)  # [R, K, C]
    out = F.conv1d(window.transpose(1, 2).contiguous().to(weight.dtype), weight, bias, groups=x.shape[1])[..., 0]
    return F.silu(out).to(x.dtype), window[:, 1:]


# -- Mamba2 (SSD): chunked scan and one-token recurrence ----------------------------------------------------

@functools.lru_cache(maxsize=32)
def _above(n: int, diagonal: int, device: torch.device) -> torch.Tensor:
    """[n, n] bool: True where j > i - diagonal (the entries segment_sum masks)."""
    return ~torch.ones(n, n, dtype=torch.bool, device=device).tril(-diagonal)


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """a [..., n] -> [..., n, n]: entry (i, j) = a[j+1] + ... + a[i] for j <= i (0 on the diagonal), -inf above."""
    n = a.shape[-1]
    rows = a[..., :, None].expand(*a.shape, n).masked_fill(_above(n, 1, a.device), 0)  # (i, j) = a[i] if i > j
    sums = rows.cumsum(-2)  # entry (i, j) = sum of a[k] for j < k <= i
    return sums.masked_fill(_above(n, 0, a.device), float("-inf"))


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
             chunk_size: int, spans: list[tuple[int, int, int]], initial_states: torch.Tensor):
    """The SSD recurrence h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = C_t h_t, chunk by chunk, for b requests
    at once (float32 in, float32 out).

    x [T, h, p], dt [T, h] (after softplus), A [h], B and C [T, h, N] (one row per head): the step's rows;
    spans: per request (first row, rows, absolute position of its first row modulo chunk_size);
    initial_states [b, h, p, N] (zeros for a request without one)
    -> (y [sum of rows, h, p] without the D skip, the spans' rows in order; final states [b, h, p, N]).
    Each request is laid out in Q chunks of its own, offset so chunks fall at absolute multiples of
    chunk_size; the padding (in front, and behind up to the longest request) has dt = 0, so it changes nothing.
    """
    heads, head_dim = x.shape[1:]
    b = len(spans)
    q = max(-(-(offset + length) // chunk_size) for _, length, offset in spans)
    width = q * chunk_size
    src = torch.cat([torch.arange(s, s + n) for s, n, _ in spans]).to(x.device)  # rows of the step
    dst = torch.cat([torch.arange(n) + i * width + o for i, (_, n, o) in enumerate(spans)]).to(x.device)

    def place(t):  # [T, ...] -> [b, Q, cs, ...], zeros outside the spans
        out = t.new_zeros(b * width, *t.shape[1:])
        out[dst] = t[src]
        return out.view(b, q, chunk_size, *t.shape[1:])

    xdt = place(x * dt[..., None])  # [b, Q, cs, h, p]
    a = place(A * dt).permute(0, 3, 1, 2)  # [b, h, Q, cs]
    B, C = place(B), place(C)  # [b, Q, cs, h, N]
    a_cum = a.cumsum(-1)  # [b, h, Q, cs]

    # 1. within each chunk: attention-like scores C_l . B_s, decayed from s to l, applied to the inputs
    decay = torch.exp(segment_sum(a))  # [b, h, Q, cs(l), cs(s)]
    scores = torch.einsum("bqlhn,bqshn->bqlsh", C, B) * decay.permute(0, 2, 3, 4, 1)  # [b, Q, cs, cs, h]
    y_diag = torch.einsum("bqlsh,bqshp->bqlhp", scores, xdt)  # [b, Q, cs, h, p]
    # 2. the state each chunk adds by its end
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b, h, Q, cs]
    added = torch.einsum("bqlhn,bqlhp->bqhpn", B * to_end.permute(0, 2, 3, 1)[..., None], xdt)  # [b, Q, h, p, N]
    # 3. the state at each chunk start: the initial state and every earlier chunk's, decayed across chunks
    added = torch.cat((initial_states[:, None].to(added.dtype), added), dim=1)  # [b, Q+1, h, p, N]
    across = torch.exp(segment_sum(F.pad(a_cum[..., -1], (1, 0))))  # [b, h, Q+1, Q+1]
    states = torch.einsum("bhcz,bzhpn->bchpn", across, added)  # [b, Q+1, h, p, N]
    # 4. each chunk's start state read out through C, decayed to each position
    y_off = torch.einsum("bqlhn,bqhpn->bqlhp", C, states[:, :-1]) * torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(b * width, heads, head_dim)[dst]  # [sum of rows, h, p]
    return y, states[:, -1]


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor):
    """One token per request: x [R, h, p], dt [R, h], A [h], B and C [R, h, N], state [R, h, p, N] float32
    -> (y [R, h, p] without the D skip, new state [R, h, p, N])."""
    decay = torch.exp(dt * A)[..., None, None]  # [R, h, 1, 1]
    state = state * decay + (dt[..., None] * B)[:, :, None, :] * x[..., None]  # [R, h, p, N]
    return (state @ C[..., None])[..., 0], state  # [R, h, p]


# -- Mamba1: selective scan -----------------------------------------------------------------------------

def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   state: torch.Tensor | None):
    """h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = h_t C_t, token by token (float32).

    x and dt [L, I], A [I, N], B and C [L, N], state [I, N] or None (zeros) -> (y [L, I], final state [I, N]).
    """
    decay = torch.exp(A[None] * dt[..., None])  # [L, I, N]
    inputs = dt[..., None] * B[:, None, :] * x[..., None]  # [L, I, N]
    h = torch.zeros_like(decay[0]) if state is None else state.float()  # [I, N]
    ys = []
    for t in range(x.shape[0]):
        h = decay[t] * h + inputs[t]
        ys.append(h @ C[t])  # [I]
    return torch.stack(ys), h  # [L, I], [I, N]


# -- gated group RMSNorm -----------------------------------------------------------------------------------

class GatedRMSNorm(nn.Module):
    """Mamba2's output norm: y * silu(gate) first, then RMS over each group of `group_size` channels, then
    the weight (float32 inside, cast back to y's dtype before the weight).

    `group_ranks` > 1 only in a tensor-parallel rank's model whose ranks outnumber the groups: these `dim` channels
    are this rank's part of one group that `group_ranks` ranks share (each its own consecutive part), so the mean
    square is over all of their parts (zoo/layers/parallel.py's GroupRMSOverRanks, swapped in by `parallelize`;
    this module alone would normalise its part only)."""

    def __init__(self, dim: int, *, group_size: int, eps: float, group_ranks: int = 1):
        super().__init__()
        if dim % group_size:
            raise ValueError(f"gated norm: {dim} channels are not a whole number of groups of {group_size}")
        if group_ranks > 1 and group_size != dim:
            raise ValueError(f"gated norm: a group shared by {group_ranks} ranks leaves each rank one group's part "
                             f"({dim} channels), not groups of {group_size}")
        self.group_size, self.eps, self.group_ranks = group_size, eps, group_ranks
        self.weight = nn.Parameter(torch.empty(dim))  # [D]

    def gated(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return y.float() * F.silu(gate.float())  # [T, D]

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        g = self.gated(y, gate)  # [T, D]
        groups = g.view(*g.shape[:-1], -1, self.group_size)  # [T, D / group, group]
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view(g.shape).to(y.dtype)  # [T, D]

    def extra_repr(self) -> str:
        ranks = f", group_ranks={self.group_ranks}" if self.group_ranks > 1 else ""
        return f"{tuple(self.weight.shape)}, group_size={self.group_size}, eps={self.eps}{ranks}"
