"""Mamba mixers over flattened tokens, carrying each request's recurrent state in the runtime's state pool.

Shape legend:
    T = tokens of the step (all requests)    H = hidden size    B = requests    R = decode rows (1 token each)
    I = intermediate size (heads * head dim for Mamba2)      h = heads    p = head dim    N = state size
    g = groups of B/C (Mamba2)    C = conv channels (Mamba2: I + 2 g N; Mamba1: I)    K = conv width
    r = dt rank (Mamba1)

Mamba2 / SSD (Mamba2, Bamba):
    in_proj [T, H] -> gate [T, I], xBC [T, C], dt [T, h]
    xBC -> causal depthwise conv (+ bias) -> SiLU -> x [T, h, p], B [T, g, N], C [T, g, N]
    dt -> softplus(dt + dt_bias) clamped to time_step_limit;  A = -exp(A_log) [h], one scalar per head
          (clamped on every path, decode included, so chunked = one-shot; transformers' one-token update skips
          the clamp, which changes nothing at the default limit (0, inf) every published config uses)
    scan (chunks of chunk_size at absolute positions) -> y [T, h, p];  y += D x
    y -> gated group RMSNorm with gate -> out_proj [T, H]
Mamba1 (Jamba):
    in_proj [T, H] -> x [T, I], z [T, I];  x -> conv -> SiLU
    x_proj(x) -> dt [T, r], B [T, N], C [T, N], each RMS-normed;  dt = softplus(dt_proj.weight dt + dt_proj.bias)
    A = -exp(A_log) [I, N];  selective scan -> y [T, I];  y = (y + D x) * silu(z) -> out_proj [T, H]

State: `cache_spec()` declares a StateSpec, conv (K-1, C) in the weights' dtype and ssm in float32; the
tensors [S, ...] are `batch.states_for(self.prefix)`. A request reads its slot only when
has_initial_state (tokens computed before this step), and writes it after each step. Without states in
the batch every request is a whole prompt from zero state. The module names are transformers' (in_proj,
conv1d, norm, out_proj, x_proj, dt_proj, ...) so checkpoint keys and parity taps join by name.

Fast path (float32, CPU, no autograd, no hook on the norm): Mamba2's conv, scan, D skip and gated norm run in one
native call between the two projections (`zoo.kernels.mamba2_mix`: the recurrence token by token, which a split
prefill computes exactly as a one-shot one); Mamba1's conv and its scan with the D skip and gate run natively
(`kernels.causal_conv`, `kernels.selective_scan`), x_proj / dt_proj between them. The torch code is the reference.

Tensor parallelism (N ranks; the Shard rules are the plugins', the collectives zoo/layers/parallel.py's): a rank
builds h / N heads of a Mamba2 mixer with its g / N groups of B / C, or, when ranks outnumber the groups, the one
group its heads read (`group_ranks` ranks share it; the gated norm then sums their squares, so the torch path runs),
or I / N channels of a Mamba1 mixer (x_proj's dt / B / C summed over the ranks); out_proj is row-parallel, so the
mixer's output is whole. Each rank's state slots hold its own heads' or channels' conv and SSM states.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zoo import kernels
from zoo.layers.linear import Linear, linear
from zoo.layers.norm import RMSNorm
from zoo.layers.ssm import (GatedRMSNorm, causal_conv, causal_conv_step, selective_scan, ssd_scan, ssd_step)
from zoo.runtime.batch import ForwardBatch, StateSpec


class CausalConv1d(nn.Module):
    """Depthwise causal conv parameters in the checkpoint's layout: weight [C, 1, K], bias [C]."""

    def __init__(self, channels: int, kernel_size: int, *, bias: bool = True):
        super().__init__()
        self.channels, self.kernel_size = channels, kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))  # [C, 1, K]
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None  # [C]

    def extra_repr(self) -> str:
        return f"channels={self.channels}, kernel_size={self.kernel_size}, bias={self.bias is not None}"


@dataclass
class Segment:
    """One request's rows start:end of the step; `computed` tokens came before them; its state slot."""

    start: int
    end: int
    computed: int
    slot: int
    has_state: bool


class RecurrentMixer(nn.Module):
    """What both mixers share: the per-request walk over the flattened step, the conv with its carried
    window, and the state slots. Subclasses define `_scan(segment, x, ..., state) -> (y, new state)`."""

    conv1d: CausalConv1d

    def segments(self, batch: ForwardBatch, num_tokens: int, states) -> list[Segment]:
        starts, lens = batch.query_start_loc_cpu, batch.seq_lens_cpu
        if not lens:
            return [Segment(0, num_tokens, 0, -1, False)]
        out = []
        for i, seq_len in enumerate(lens):
            s, e = starts[i], starts[i + 1]
            computed = seq_len - (e - s)
            if states is None:
                if computed:
                    raise ValueError(f"{self.prefix}: request {i} has {computed} computed tokens but the batch "
                                     f"carries no recurrent state for this layer")
                out.append(Segment(s, e, 0, -1, False))
                continue
            if len(batch.has_initial_state_cpu) != len(lens) or len(batch.state_indices_cpu) != len(lens):
                raise ValueError(f"{self.prefix}: the batch carries states but not one has_initial_state and "
                                 f"state index per request")
            has_state = bool(batch.has_initial_state_cpu[i])
            if has_state != (computed > 0):
                raise ValueError(f"{self.prefix}: request {i} has {computed} computed tokens but "
                                 f"has_initial_state={has_state}")
            out.append(Segment(s, e, computed, batch.state_indices_cpu[i], has_state))
        return out

    @staticmethod
    def requests(segments: list[Segment], num_tokens: int) -> dict:
        """The segments as the native kernels take them: row starts [B+1], state slots [B], has_state [B]."""
        return dict(starts=[s.start for s in segments] + [num_tokens], slots=[s.slot for s in segments],
                    has_state=[s.has_state for s in segments])

    def conv(self, x: torch.Tensor, segments: list[Segment], conv_state: torch.Tensor | None) -> torch.Tensor:
        """x [T, C] -> silu(causal conv) [T, C]; each request continues the window its slot carries."""
        w, b = self.conv1d.weight, self.conv1d.bias
        if kernels.fast(x, w, *([] if conv_state is None else [conv_state])) and self.conv1d.kernel_size <= 17:
            return kernels.causal_conv(x, w, b, conv_state, **self.requests(segments, x.shape[0]))  # [T, C]
        out = torch.empty_like(x)  # [T, C]
        decode = [s for s in segments if s.has_state and s.end - s.start == 1]
        if decode:  # one token per request: all in one call
            rows = torch.tensor([s.start for s in decode], device=x.device)
            slots = torch.tensor([s.slot for s in decode], device=x.device)
            out[rows], conv_state[slots] = causal_conv_step(x[rows], conv_state[slots], w, b)  # [R, C], [R, K-1, C]
        for s in segments:
            if s.end == s.start or (s.has_state and s.end - s.start == 1):
                continue
            prev = conv_state[s.slot] if s.has_state else x.new_zeros(self.conv1d.kernel_size - 1, x.shape[1])
            out[s.start:s.end], last = causal_conv(x[s.start:s.end], prev, w, b)  # [L, C], [K-1, C]
            if conv_state is not None:
                conv_state[s.slot] = last
        return out


class Mamba2Mixer(RecurrentMixer):
    def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, state_size: int, n_groups: int,
                 conv_kernel: int, chunk_size: int, time_step_limit=(0.0, float("inf")), norm_eps: float,
                 use_bias: bool = False, use_conv_bias: bool = True, group_ranks: int = 1, prefix: str = ""):
        """`group_ranks` (tensor parallelism with more ranks than groups): the ranks sharing this rank's one group of
        B / C and of the gated norm (each holding the group's B / C and its part of the heads)."""
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"{prefix}: {num_heads} heads are not a multiple of n_groups={n_groups}")
        self.prefix = prefix
        self.num_heads, self.head_dim, self.state_size, self.n_groups = num_heads, head_dim, state_size, n_groups
        self.chunk_size = chunk_size
        self.time_step_limit = tuple(float(v) for v in (time_step_limit or (0.0, float("inf"))))
        self.intermediate_size = inter = num_heads * head_dim
        self.conv_dim = inter + 2 * n_groups * state_size
        self.in_proj = Linear(hidden_size, inter + self.conv_dim + num_heads, bias=use_bias)  # gate | xBC | dt
        self.conv1d = CausalConv1d(self.conv_dim, conv_kernel, bias=use_conv_bias)
        # the column groups (a tensor-parallel rank reads its part of each: loader "fused" Shards)
        gn = n_groups * state_size
        for p in (self.in_proj.weight, self.in_proj.bias):
            if p is not None:
                p.shard_sizes = (inter, inter, gn, gn, num_heads)  # gate | x | B | C | dt
        for p in (self.conv1d.weight, self.conv1d.bias):
            if p is not None:
                p.shard_sizes = (inter, gn, gn)  # x | B | C
        self.dt_bias = nn.Parameter(torch.empty(num_heads))  # [h]
        self.A_log = nn.Parameter(torch.empty(num_heads))  # [h]
        self.D = nn.Parameter(torch.empty(num_heads))  # [h]
        self.norm = GatedRMSNorm(inter, group_size=inter // n_groups, eps=norm_eps, group_ranks=group_ranks)
        self.out_proj = Linear(inter, hidden_size, bias=use_bias)

    def cache_spec(self) -> StateSpec:
        k = self.conv1d.kernel_size
        return StateSpec((("conv", (k - 1, self.conv_dim), self.conv1d.weight.dtype),
                          ("ssm", (self.num_heads, self.head_dim, self.state_size), torch.float32)))

    def forward(self, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = hidden_states.shape[0]
        inter, gn = self.intermediate_size, self.n_groups * self.state_size
        states = batch.states_for(self.prefix)  # (conv [S, K-1, C], ssm [S, h, p, N]) or None
        conv_state, ssm_state = states if states is not None else (None, None)
        segments = self.segments(batch, t, states)
        zx = self.in_proj(hidden_states)  # [T, I + C + h]
        if self.native(zx, states):  # conv, scan and gated norm in one native call
            y = kernels.mamba2_mix(
                zx, heads=self.num_heads, head_dim=self.head_dim, state_size=self.state_size, n_groups=self.n_groups,
                conv_weight=self.conv1d.weight, conv_bias=self.conv1d.bias, dt_bias=self.dt_bias, A_log=self.A_log,
                D=self.D, norm_weight=self.norm.weight, eps=self.norm.eps, time_step_limit=self.time_step_limit,
                states=states, **self.requests(segments, t))  # [T, I]
            return self.out_proj(y)  # [T, H]
        gate, xbc, dt = zx.split((inter, self.conv_dim, self.num_heads), -1)
        xbc = self.conv(xbc, segments, conv_state)  # [T, C]
        x, B, C = xbc.split((inter, gn, gn), -1)  # [T, I], [T, gN], [T, gN]
        x = x.reshape(t, self.num_heads, self.head_dim).float()  # [T, h, p]
        per_group = self.num_heads // self.n_groups
        B = B.reshape(t, self.n_groups, self.state_size).float().repeat_interleave(per_group, 1)  # [T, h, N]
        C = C.reshape(t, self.n_groups, self.state_size).float().repeat_interleave(per_group, 1)  # [T, h, N]
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp(*self.time_step_limit).float()  # [T, h]
        A = -torch.exp(self.A_log.float())  # [h]
        y = torch.empty_like(x)  # [T, h, p]
        decode = [s for s in segments if s.has_state and s.end - s.start == 1]
        if decode:
            rows = torch.tensor([s.start for s in decode], device=x.device)
            slots = torch.tensor([s.slot for s in decode], device=x.device)
            y[rows], ssm_state[slots] = ssd_step(x[rows], dt[rows], A, B[rows], C[rows], ssm_state[slots])
        prefill = [s for s in segments if s.end > s.start and not (s.has_state and s.end - s.start == 1)]
        if prefill:  # every other request in one chunked scan
            zero = x.new_zeros(self.num_heads, self.head_dim, self.state_size)
            initial = torch.stack([ssm_state[s.slot] if s.has_state else zero for s in prefill])  # [b, h, p, N]
            spans = [(s.start, s.end - s.start, s.computed % self.chunk_size) for s in prefill]
            out, final = ssd_scan(x, dt, A, B, C, chunk_size=self.chunk_size, spans=spans,
                                  initial_states=initial)  # [rows, h, p], [b, h, p, N]
            y[torch.cat([torch.arange(s.start, s.end) for s in prefill]).to(x.device)] = out
            if ssm_state is not None:
                ssm_state[torch.tensor([s.slot for s in prefill], device=x.device)] = final
        y = y + self.D[:, None] * x  # [T, h, p], the D skip
        y = self.norm(y.view(t, inter), gate)  # [T, I]
        return self.out_proj(y.to(hidden_states.dtype))  # [T, H]

    def native(self, zx: torch.Tensor, states) -> bool:
        """Whether this step takes kernels.mamba2_mix: float32 on the CPU, kernels on, the norm's groups within this
        process (not shared with other tensor-parallel ranks), no hook on the norm (a parity tap reads it, so the
        torch path runs)."""
        norm = self.norm
        return kernels.fast(zx, self.conv1d.weight, norm.weight, *(states or ())) and self.conv1d.kernel_size <= 17 \
            and norm.group_ranks == 1 \
            and not (norm._forward_hooks or norm._forward_pre_hooks or nn.modules.module._global_forward_hooks
                     or nn.modules.module._global_forward_pre_hooks)

    def extra_repr(self) -> str:
        ranks = f", group_ranks={self.norm.group_ranks}" if self.norm.group_ranks > 1 else ""
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, state={self.state_size}, groups={self.n_groups}"
                f"{ranks}, chunk_size={self.chunk_size}, time_step_limit={self.time_step_limit}")


class MambaMixer(RecurrentMixer):
    """Mamba1's selective-scan mixer as Jamba uses it (RMS norms on dt, B and C)."""

    def __init__(self, *, hidden_size: int, intermediate_size: int, state_size: int, conv_kernel: int,
                 dt_rank: int, norm_eps: float, use_bias: bool = False, use_conv_bias: bool = True,
                 prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.intermediate_size, self.state_size, self.dt_rank = intermediate_size, state_size, dt_rank
        self.in_proj = Linear(hidden_size, 2 * intermediate_size, bias=use_bias)  # x | z
        self.conv1d = CausalConv1d(intermediate_size, conv_kernel, bias=use_conv_bias)
        self.x_proj = Linear(intermediate_size, dt_rank + 2 * state_size)  # dt | B | C
        self.dt_proj = Linear(dt_rank, intermediate_size, bias=True)
        self.dt_proj.weight.quantizable = False  # read by forward beside its bias (not a GGUF block layer)
        self.A_log = nn.Parameter(torch.empty(intermediate_size, state_size))  # [I, N]
        self.D = nn.Parameter(torch.empty(intermediate_size))  # [I]
        self.out_proj = Linear(intermediate_size, hidden_size, bias=use_bias)
        self.dt_layernorm = RMSNorm(dt_rank, eps=norm_eps)
        self.b_layernorm = RMSNorm(state_size, eps=norm_eps)
        self.c_layernorm = RMSNorm(state_size, eps=norm_eps)

    def cache_spec(self) -> StateSpec:
        k = self.conv1d.kernel_size
        return StateSpec((("conv", (k - 1, self.intermediate_size), self.conv1d.weight.dtype),
                          ("ssm", (self.intermediate_size, self.state_size), torch.float32)))

    def forward(self, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = hidden_states.shape[0]
        states = batch.states_for(self.prefix)  # (conv [S, K-1, I], ssm [S, I, N]) or None
        conv_state, ssm_state = states if states is not None else (None, None)
        segments = self.segments(batch, t, states)
        x, z = self.in_proj(hidden_states).chunk(2, -1)  # [T, I], [T, I]
        x = self.conv(x, segments, conv_state)  # [T, I]
        dt, B, C = self.x_proj(x).split((self.dt_rank, self.state_size, self.state_size), -1)  # [T, r], [T, N] x2
        dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B).float(), self.c_layernorm(C).float()
        dt = F.softplus(linear(dt, self.dt_proj.weight) + self.dt_proj.bias.float())  # [T, I], bias inside
        A = -torch.exp(self.A_log.float())  # [I, N]
        if kernels.fast(x, dt, B, C, z, self.D, *([] if ssm_state is None else [ssm_state])):  # scan, D skip, gate
            y = kernels.selective_scan(x, dt, A, B, C, self.D, z, ssm_state, **self.requests(segments, t))  # [T, I]
            return self.out_proj(y)  # [T, H]
        xf = x.float()
        y = torch.empty_like(xf)  # [T, I]
        decode = [s for s in segments if s.has_state and s.end - s.start == 1]
        if decode:
            rows = torch.tensor([s.start for s in decode], device=x.device)
            slots = torch.tensor([s.slot for s in decode], device=x.device)
            h = ssm_state[slots] * torch.exp(dt[rows, :, None] * A) \
                + dt[rows, :, None] * B[rows, None, :] * xf[rows, :, None]  # [R, I, N]
            ssm_state[slots] = h
            y[rows] = (h @ C[rows, :, None])[..., 0]  # [R, I]
        for s in segments:
            if s.end == s.start or (s.has_state and s.end - s.start == 1):
                continue
            r = slice(s.start, s.end)
            y[r], final = selective_scan(xf[r], dt[r], A, B[r], C[r], ssm_state[s.slot] if s.has_state else None)
            if ssm_state is not None:
                ssm_state[s.slot] = final
        y = (y + xf * self.D.float()) * F.silu(z.float())  # [T, I]
        return self.out_proj(y.to(hidden_states.dtype))  # [T, H]

    def extra_repr(self) -> str:
        return f"intermediate={self.intermediate_size}, state={self.state_size}, dt_rank={self.dt_rank}"
