"""Rotary position embeddings (the "rotate half" / NeoX layout Llama-family checkpoints use).

Shape legend:
    T = tokens (flattened)    n = heads    D = head dim    R = rotary dim (D * partial_rotary_factor)
    F = R / 2 frequencies     L = positions in the cached cos/sin table

`rope_parameters(config, layer_type)` reads transformers' normalised `config.rope_parameters` (nested by
layer type for models such as Gemma3, whose sliding and full layers use different bases).
`compute_inv_freq` follows transformers' rope init functions type by type, in float32 on the host, so
the frequencies match bit for bit. `RotaryEmbedding` is a plain object, not a module: it owns no tensor
the loader could see, and computes its table lazily per (device, dtype) the first time it runs, so a
model built on the meta device needs nothing materialised for it.

"dynamic" (NTK) depends on the context length: as in transformers, a sequence longer than
max_position_embeddings uses frequencies recomputed for its own length (here per request, from
`batch.seq_lens_cpu`; transformers uses the longest sequence of its padded batch).

Fast path (float32, CPU, no autograd): `zoo.kernels.rotary` reads the table rows itself and rotates in
one pass, rounding exactly as `rotate` does (same products, same sums).
"""
from __future__ import annotations

import functools
import json
import math

import torch

from zoo import kernels

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The rope parameters of one layer type: {"rope_type", "rope_theta", and the type's own keys}."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = {k: v for k, v in params.items() if isinstance(v, dict)}
    if nested:
        if layer_type not in nested:
            raise ValueError(f"config.rope_parameters is nested by layer type ({sorted(nested)}) "
                             f"but has no entry for layer type {layer_type!r}")
        params = nested[layer_type]
    if not params:  # a config that predates rope_parameters
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _frequencies(base, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # [F]
    return 1.0 / (base ** exponents)  # [F] float32


def compute_inv_freq(params: dict, *, head_dim: int, max_position_embeddings: int,
                     seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [F] float32 on the host, attention scaling applied to cos and sin) for one rope type.

    `seq_len` matters to "dynamic" only: the context length the frequencies are stretched for.
    """
    rope_type = params["rope_type"]
    base = params["rope_theta"]
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if rope_type == "default":
        return _frequencies(base, dim), 1.0
    if rope_type == "linear":
        return _frequencies(base, dim) / params["factor"], 1.0
    if rope_type == "dynamic":
        if seq_len is None or seq_len <= max_position_embeddings:  # the original frequencies
            factor, m = params["factor"], max_position_embeddings
            return _frequencies(base * ((factor * m / m) - (factor - 1)) ** (dim / (dim - 2)), dim), 1.0
        # grown past the trained length: NTK-stretched base, computed in float32 as transformers does
        stretch = params["factor"] * torch.tensor(seq_len, dtype=torch.int64) / max_position_embeddings
        return _frequencies(base * (stretch - (params["factor"] - 1)) ** (dim / (dim - 2)), dim), 1.0
    if rope_type == "yarn":
        return _yarn(params, base, dim, max_position_embeddings)
    if rope_type == "llama3":
        return _llama3(params, base, dim, max_position_embeddings)
    raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


def _yarn(params: dict, base: float, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    scaling = params.get("attention_factor")
    if scaling is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        scaling = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength makes `rotations` turns in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no empty ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)  # [F]
    extrapolated = _frequencies(base, dim)  # [F] high frequencies keep their trained values
    interpolated = 1.0 / (factor * (base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)))  # [F]
    keep = 1 - ramp  # [F] 1 = extrapolate, 0 = interpolate
    return interpolated * (1 - keep) + extrapolated * keep, scaling


def _llama3(params: dict, base: float, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    inv_freq = _frequencies(base, dim)  # [F]
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    wavelen = 2 * math.pi / inv_freq  # [F]
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)  # long waves: divided by factor
    smooth = (original / wavelen - low) / (high - low)  # [F] in (0, 1) for the medium band
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled), 1.0


class RotaryEmbedding:
    """Rotates q and k by position. One instance is shared by every layer with the same parameters."""

    def __init__(self, *, head_dim: int, rope_parameters: dict, max_position_embeddings: int):
        rope_type = rope_parameters.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not supported; "
                             f"supported: {', '.join(ROPE_TYPES)}")
        self.head_dim = head_dim
        self.params = {**rope_parameters, "rope_type": rope_type}
        self.rope_type = rope_type
        self.rotary_dim = int(head_dim * self.params.get("partial_rotary_factor", 1.0))
        self.max_position_embeddings = max_position_embeddings
        self._inv_freq: tuple[torch.Tensor, float] | None = None  # ([F] float32 host, scaling), made on first use
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def inv_freq(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        if seq_len is not None and self.rope_type == "dynamic" and seq_len > self.max_position_embeddings:
            return compute_inv_freq(self.params, head_dim=self.head_dim,
                                    max_position_embeddings=self.max_position_embeddings, seq_len=seq_len)
        if self._inv_freq is None:
            self._inv_freq = compute_inv_freq(self.params, head_dim=self.head_dim,
                                              max_position_embeddings=self.max_position_embeddings)
        return self._inv_freq

    def _cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
        freqs = positions[:, None].float() * inv_freq.to(positions.device)  # [T, F] float32
        return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)  # [T, F], [T, F]

    def table(self, device: torch.device, dtype: torch.dtype, num_positions: int):
        """The cos, sin tables [L, F] of positions 0 .. L - 1, L >= num_positions (grown to a power of two)."""
        key = (device, dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < num_positions:
            length = max(256, 1 << (num_positions - 1).bit_length())
            inv_freq, scaling = self.inv_freq()
            table = self._cos_sin(torch.arange(length, device=device), inv_freq, scaling, dtype)  # [L, F]
            self._tables[key] = table
        return table

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, num_positions: int):
        """cos, sin [T, F] for positions < num_positions, looked up in the table."""
        cos, sin = self.table(positions.device, dtype, num_positions)
        return cos[positions], sin[positions]  # [T, F], [T, F]

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, batch=None):
        """q [T, n, D], k [T, n_kv, D] -> both rotated, same shapes and dtype. `batch` gives host lengths."""
        if batch is not None and batch.seq_lens_cpu:
            num_positions = max(batch.seq_lens_cpu)
        else:
            num_positions = int(positions.max()) + 1 if positions.numel() else 1  # one device sync
        grown = self.rope_type == "dynamic" and num_positions > self.max_position_embeddings
        if not grown and kernels.fast(q, k):
            cos, sin = self.table(positions.device, q.dtype, num_positions)  # [L, F]
            return kernels.rotary(q, k, positions, cos, sin)
        cos, sin = self.cos_sin(positions, q.dtype, num_positions)
        if grown:
            cos, sin = self._dynamic(positions, q.dtype, cos, sin, batch, num_positions)
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def _dynamic(self, positions, dtype, cos, sin, batch, num_positions):
        """Rows of requests longer than the trained length use frequencies stretched for their length."""
        cos, sin = cos.clone(), sin.clone()
        if batch is None or not batch.seq_lens_cpu:
            spans = [(0, positions.shape[0], num_positions)]
        else:
            starts = batch.query_start_loc_cpu
            spans = [(starts[i], starts[i + 1], n) for i, n in enumerate(batch.seq_lens_cpu)]
        for start, end, seq_len in spans:
            if seq_len > self.max_position_embeddings and end > start:
                inv_freq, scaling = self.inv_freq(seq_len)
                cos[start:end], sin[start:end] = self._cos_sin(positions[start:end], inv_freq, scaling, dtype)
        return cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, n, D] rotated in its first R = 2F dims: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    f = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, F]
    x1, x2, rest = x[..., :f], x[..., f:2 * f], x[..., 2 * f:]  # [T, n, F], [T, n, F], [T, n, D - R]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)  # [T, n, D]


@functools.lru_cache(maxsize=None)
def _shared(head_dim: int, params_json: str, max_position_embeddings: int) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim=head_dim, rope_parameters=json.loads(params_json),
                           max_position_embeddings=max_position_embeddings)


def get_rope(*, head_dim: int, rope_parameters: dict, max_position_embeddings: int) -> RotaryEmbedding:
    """The shared RotaryEmbedding for these parameters (layers with equal parameters share one table)."""
    return _shared(head_dim, json.dumps(rope_parameters, sort_keys=True), max_position_embeddings)
