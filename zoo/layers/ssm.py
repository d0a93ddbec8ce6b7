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
             chunk_size: int, offset: int = 0, initial_state: torch.Tensor | None = None):
    """The SSD recurrence h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = C_t h_t over one request's tokens,
    computed chunk by chunk (float32 in, float32 out).

    x [L, h, p], dt [L, h] (after softplus), A [h], B and C [L, h, N] (one row per head), `offset` = the
    absolute position of x[0] modulo chunk_size, initial_state [h, p, N] or None (zeros)
    -> (y [L, h, p] without the D skip, final state [h, p, N]).
    """
    length, heads, head_dim = x.shape
    back = -(offset + length) % chunk_size
    pad = lambda t: F.pad(t, (0, 0) * (t.dim() - 1) + (offset, back))  # noqa: E731  positions padded with 0
    q = (offset + length + back) // chunk_size
    xdt = pad(x * dt[..., None]).view(q, chunk_size, heads, head_dim)  # [Q, cs, h, p]
    a = pad(A * dt).view(q, chunk_size, heads).permute(2, 0, 1)  # [h, Q, cs]
    B = pad(B).view(q, chunk_size, heads, -1)  # [Q, cs, h, N]
    C = pad(C).view(q, chunk_size, heads, -1)  # [Q, cs, h, N]
    a_cum = a.cumsum(-1)  # [h, Q, cs]

    # 1. within each chunk: attention-like scores C_l . B_s, decayed from s to l, applied to the inputs
    decay = torch.exp(segment_sum(a))  # [h, Q, cs(l), cs(s)]
    scores = torch.einsum("qlhn,qshn->qlsh", C, B) * decay.permute(1, 2, 3, 0)  # [Q, cs, cs, h]
    y_diag = torch.einsum("qlsh,qshp->qlhp", scores, xdt)  # [Q, cs, h, p]
    # 2. the state each chunk adds by its end
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [h, Q, cs]
    added = torch.einsum("qlhn,qlhp->qhpn", B * to_end.permute(1, 2, 0)[..., None], xdt)  # [Q, h, p, N]
    # 3. the state at each chunk start: the initial state and every earlier chunk's, decayed across chunks
    start = torch.zeros_like(added[:1]) if initial_state is None else initial_state[None].to(added.dtype)
    added = torch.cat((start, added))  # [Q+1, h, p, N]
    across = torch.exp(segment_sum(F.pad(a_cum[..., -1], (1, 0))))  # [h, Q+1, Q+1]
    states = torch.einsum("hcz,zhpn->chpn", across, added)  # [Q+1, h, p, N]
    # 4. each chunk's start state read out through C, decayed to each position
    y_off = torch.einsum("qlhn,qhpn->qlhp", C, states[:-1]) * torch.exp(a_cum).permute(1, 2, 0)[..., None]
    y = (y_diag + y_off).reshape(-1, heads, head_dim)[offset:offset + length]  # [L, h, p]
    return y, states[-1]


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
    the weight (float32 inside, cast back to y's dtype before the weight)."""

    def __init__(self, dim: int, *, group_size: int, eps: float):
        super().__init__()
        if dim % group_size:
            raise ValueError(f"gated norm: {dim} channels are not a whole number of groups of {group_size}")
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.empty(dim))  # [D]

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        g = y.float() * F.silu(gate.float())  # [T, D]
        groups = g.view(*g.shape[:-1], -1, self.group_size)  # [T, D / group, group]
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view(g.shape).to(y.dtype)  # [T, D]

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, group_size={self.group_size}, eps={self.eps}"
