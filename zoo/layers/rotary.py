"""Rotary position embeddings: rope types (how frequencies are made) x layouts (which dims pair up).

Shape legend:
    T = tokens (flattened)    n = heads    D = head dim    R = rotary dim (D * partial_rotary_factor)
    F = R / 2 frequencies     L = positions in the cached cos/sin table

`rope_parameters(config, layer_type)` reads transformers' normalised `config.rope_parameters` (nested by
layer type for models such as Gemma3, whose sliding and full layers use different bases).
`compute_inv_freq` follows transformers' rope init functions type by type, in float32 on the host, so
the frequencies match bit for bit. `RotaryEmbedding` is a plain object, not a module: it owns no tensor
the loader could see, and computes its table lazily per (device, dtype) the first time it runs, so a
model built on the meta device needs nothing materialised for it.

Extension points (docs/plugins.md): `ROPE_TYPES` / `register_rope_type` (default, linear, dynamic, yarn,
llama3, longrope built in), `LAYOUTS` ("rotate_half", "interleaved"), partial rotary through
`partial_rotary_factor` (only the first R dims of a head rotate, the rest pass through), and
`get_rope(..., layout=, cls=)` for a RotaryEmbedding subclass.

"dynamic" (NTK) depends on the context length: as in transformers, a sequence longer than the type's
`grows_past` length uses frequencies recomputed for its own length (here per request, from
`batch.seq_lens_cpu`; transformers uses the longest sequence of its padded batch).

"longrope" (Phi-3) has two fixed sets (`long_past`: short factors up to original_max_position_embeddings,
long ones past it). transformers picks one per forward by max(position_ids) + 1, and its Phi-3 `generate`
drops the cache when a sequence first passes the switch, recomputing every key with the long set: a request
is short or long as a whole. The zoo does the same, per request (vLLM switches the whole batch when any token
is past it): a request rotates with the long set iff its length (prompt and outputs, `batch.num_tokens_cpu`)
is past the switch, however its prompt is chunked, and the scheduler recomputes a request whose decode
crosses it (zoo/runtime/scheduler.py). The table stays a table: rows [0, L) short, rows [L, 2L) long, a long
request's tokens reading the second half (`table_rows`); the native kernels and the fused step take those
rows as their positions.

Fast path (float32, CPU, no autograd, rotate-half): `zoo.kernels.rotary` reads the table rows itself and
rotates in one pass, rounding exactly as `rotate` does (same products, same sums).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Callable

import torch

from zoo import kernels



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
    if "partial_rotary_factor" not in params and getattr(config, "partial_rotary_factor", None) is not None:
        params["partial_rotary_factor"] = config.partial_rotary_factor
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _frequencies(base, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # [F]
    return 1.0 / (base ** exponents)  # [F] float32


@dataclass(frozen=True)
class RopeType:
    """One entry of ROPE_TYPES: how a rope type's frequencies are computed.

    `init(params, base, dim, max_position_embeddings, seq_len) -> (inv_freq [F] float32 host, scaling)`, with
    `dim` the rotary dim R and `seq_len` None or the context length of one request.
    `grows_past(params, max_position_embeddings) -> int | None`: the context length past which the
    frequencies depend on seq_len (a request longer than that gets its own), None when they never do.
    `long_past(params, max_position_embeddings) -> int`: for a type with exactly two sets of frequencies
    (init's seq_len up to that length, and past it), the switch; a request uses the second set for all of its
    tokens once its length is past it (module docstring).
    """
    init: Callable[[dict, float, int, int, int | None], tuple[torch.Tensor, float]]
    grows_past: Callable[[dict, int], int | None] | None = None
    long_past: Callable[[dict, int], int] | None = None


def _default(params, base, dim, max_position_embeddings, seq_len):
    return _frequencies(base, dim), 1.0


def _linear(params, base, dim, max_position_embeddings, seq_len):
    return _frequencies(base, dim) / params["factor"], 1.0


def _ntk_dynamic(params, base, dim, max_position_embeddings, seq_len):
    if seq_len is None or seq_len <= max_position_embeddings:  # the original frequencies
        factor, m = params["factor"], max_position_embeddings
        return _frequencies(base * ((factor * m / m) - (factor - 1)) ** (dim / (dim - 2)), dim), 1.0
    # grown past the trained length: NTK-stretched base, computed in float32 as transformers does
    stretch = params["factor"] * torch.tensor(seq_len, dtype=torch.int64) / max_position_embeddings
    return _frequencies(base * (stretch - (params["factor"] - 1)) ** (dim / (dim - 2)), dim), 1.0


def _longrope(params, base, dim, max_position_embeddings, seq_len):
    """Phi-3's: per-frequency factors, `short_factor` up to the trained length, `long_factor` past it."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    scaling = params.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = params["long_factor"] if seq_len and seq_len > original else params["short_factor"]
    if len(factors) != dim // 2:
        raise ValueError(f"rope_parameters: longrope has {len(factors)} factors but the rotary dim {dim} has "
                         f"{dim // 2} frequencies")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # [F]
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents), scaling  # [F]


# rope type -> how its frequencies are computed; a plugin adds its own with register_rope_type
ROPE_TYPES: dict[str, RopeType] = {}


def register_rope_type(name: str, init, *, grows_past=None, long_past=None, override: bool = False) -> None:
    """Add rope type `name` (see RopeType for `init`, `grows_past` and `long_past`); a second claim needs
    override=True."""
    if name in ROPE_TYPES and not override:
        raise ValueError(f"rope type {name!r} is already registered; pass override=True to replace it")
    if grows_past is not None and long_past is not None:
        raise ValueError(f"rope type {name!r}: give grows_past or long_past, not both")
    ROPE_TYPES[name] = RopeType(init, grows_past, long_past)


def supported_rope_type(rope_type: str | None, where: str = "rope_parameters") -> RopeType:
    """The table entry of `rope_type`, or ValueError naming it and what is supported."""
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    return ROPE_TYPES[rope_type]


def rotary_dim_of(params: dict, head_dim: int) -> int:
    """R: the leading dims of each head that rotate (`partial_rotary_factor` of D, as transformers truncates)."""
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def compute_inv_freq(params: dict, *, head_dim: int, max_position_embeddings: int,
                     seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [F] float32 on the host, attention scaling applied to cos and sin) for one rope type.

    `seq_len` matters only to types whose frequencies grow with the context ("dynamic", "longrope").
    """
    entry = supported_rope_type(params["rope_type"], "rope_parameters.rope_type")
    return entry.init(params, params["rope_theta"], rotary_dim_of(params, head_dim), max_position_embeddings,
                      seq_len)


def _yarn(params: dict, base: float, dim: int, max_position_embeddings: int, seq_len=None):
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


def _llama3(params: dict, base: float, dim: int, max_position_embeddings: int, seq_len=None):
    inv_freq = _frequencies(base, dim)  # [F]
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    wavelen = 2 * math.pi / inv_freq  # [F]
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)  # long waves: divided by factor
    smooth = (original / wavelen - low) / (high - low)  # [F] in (0, 1) for the medium band
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled), 1.0


for _name, _init, _grows in (
        ("default", _default, None), ("linear", _linear, None),
        ("dynamic", _ntk_dynamic, lambda params, max_position_embeddings: max_position_embeddings),
        ("yarn", _yarn, None), ("llama3", _llama3, None)):
    register_rope_type(_name, _init, grows_past=_grows)
register_rope_type("longrope", _longrope,
                   long_past=lambda params, max_position_embeddings: params["original_max_position_embeddings"])


# -- layouts: which dims of a head pair up in a rotation ------------------------------------------------

def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """"rotate-half" (NeoX, Llama): x [T, n, D] rotated in its first R = 2F dims, dim f paired with f + F:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); dims R.. pass through."""
    f = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, F]
    x1, x2, rest = x[..., :f], x[..., f:2 * f], x[..., 2 * f:]  # [T, n, F], [T, n, F], [T, n, D - R]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)  # [T, n, D]


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """"interleaved" (GPT-J, Cohere): x [T, n, D] rotated in its first R = 2F dims, dim 2f paired with 2f + 1;
    dims R.. pass through."""
    f = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, F]
    pairs, rest = x[..., :2 * f].unflatten(-1, (f, 2)), x[..., 2 * f:]  # [T, n, F, 2], [T, n, D - R]
    x1, x2 = pairs[..., 0], pairs[..., 1]  # [T, n, F] each
    rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)  # [T, n, R]
    return torch.cat((rotated, rest), dim=-1)  # [T, n, D]


# layout name -> rotation; only "rotate_half" has a native kernel (the others run in torch)
LAYOUTS = {"rotate_half": rotate, "interleaved": rotate_interleaved}


class RotaryEmbedding:
    """Rotates q and k by position. One instance is shared by every layer with the same parameters.

    A plugin with another rotation subclasses it (overriding `rotate_pair`) or registers a layout in LAYOUTS;
    a new frequency rule is a rope type (register_rope_type).
    """

    def __init__(self, *, head_dim: int, rope_parameters: dict, max_position_embeddings: int,
                 layout: str = "rotate_half"):
        rope_type = rope_parameters.get("rope_type", "default")
        entry = supported_rope_type(rope_type)
        if layout not in LAYOUTS:
            raise ValueError(f"rotary layout {layout!r} is not supported; supported: {', '.join(LAYOUTS)}")
        self.head_dim, self.layout = head_dim, layout
        self.params = {**rope_parameters, "rope_type": rope_type}
        self.rope_type = rope_type
        self.rotary_dim = rotary_dim_of(self.params, head_dim)
        if not 0 < self.rotary_dim <= head_dim or self.rotary_dim % 2:
            raise ValueError(f"rope_parameters: partial_rotary_factor={self.params.get('partial_rotary_factor')} "
                             f"gives a rotary dim of {self.rotary_dim} for head_dim {head_dim} (needs an even "
                             f"number in 2..{head_dim})")
        self.max_position_embeddings = max_position_embeddings
        # the context length past which a request's frequencies are its own (None: never)
        self.grows_past = entry.grows_past(self.params, max_position_embeddings) if entry.grows_past else None
        # the switch between the two frequency sets of a type such as longrope (None: one set)
        self.long_past = int(entry.long_past(self.params, max_position_embeddings)) if entry.long_past else None
        self._inv_freq: tuple[torch.Tensor, float] | None = None  # ([F] float32 host, scaling), made on first use
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def native_layout(self) -> bool:
        """The native kernel rotates this layout: rotate-half, `rotate_pair` not overridden."""
        return self.layout == "rotate_half" and type(self).rotate_pair is RotaryEmbedding.rotate_pair

    @property
    def native(self) -> bool:
        """The fused step can rotate with this: the native layout and a table for any context length (with
        `long_past`, its rows chosen by `table_rows`)."""
        return self.native_layout and self.grows_past is None

    def inv_freq(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        if seq_len is not None and self.grows_past is not None and seq_len > self.grows_past:
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
        """The cos, sin tables [L, F] of positions 0 .. L - 1, L >= num_positions (grown to a power of two).
        With `long_past`: [2L, F], rows [0, L) the first (short) set, rows [L, 2L) the long one."""
        key = (device, dtype)
        table = self._tables.get(key)
        length = table[0].shape[0] // (1 if self.long_past is None else 2) if table is not None else 0
        if length < num_positions:
            length = max(256, 1 << (num_positions - 1).bit_length())
            positions = torch.arange(length, device=device)
            inv_freq, scaling = self.inv_freq()
            table = self._cos_sin(positions, inv_freq, scaling, dtype)  # [L, F]
            if self.long_past is not None:
                long_freq, long_scaling = compute_inv_freq(self.params, head_dim=self.head_dim, seq_len=self.long_past + 1,
                                                           max_position_embeddings=self.max_position_embeddings)
                long = self._cos_sin(positions, long_freq, long_scaling, dtype)  # [L, F] each
                table = tuple(torch.cat((t, lt)) for t, lt in zip(table, long))  # [2L, F] each
            self._tables[key] = table
        return table

    def table_rows(self, positions: torch.Tensor, batch, table_len: int) -> torch.Tensor:
        """The table row of each token [T]: its position, plus L for the tokens of a request whose length is
        past `long_past` (batch.num_tokens_cpu; without it, each request's tokens so far, as in one
        transformers forward). Positions themselves without `long_past`."""
        if self.long_past is None:
            return positions
        if batch is None or not batch.seq_lens_cpu:
            long = (int(positions.max()) + 1 if positions.numel() else 0) > self.long_past  # one device sync
            return positions + table_len if long else positions
        prompts = batch.num_tokens_cpu or batch.seq_lens_cpu
        starts = batch.query_start_loc_cpu
        counts = [starts[i + 1] - starts[i] for i in range(len(prompts))]
        offsets = [table_len if n > self.long_past else 0 for n in prompts]
        if not any(offsets):
            return positions
        offset = torch.tensor(offsets, dtype=positions.dtype).repeat_interleave(torch.tensor(counts))  # [T]
        return positions + offset.to(positions.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, num_positions: int, batch=None):
        """cos, sin [T, F] for positions < num_positions, looked up in the table."""
        cos, sin = self.table(positions.device, dtype, num_positions)
        rows = self.table_rows(positions, batch, cos.shape[0] // 2) if self.long_past is not None else positions
        return cos[rows], sin[rows]  # [T, F], [T, F]

    def rotate_pair(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, n, D] rotated by cos, sin [T, F] in this layout."""
        return LAYOUTS[self.layout](x, cos, sin)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, batch=None):
        """q [T, n, D], k [T, n_kv, D] -> both rotated, same shapes and dtype. `batch` gives host lengths."""
        if batch is not None and batch.seq_lens_cpu:
            num_positions = max(batch.seq_lens_cpu)
        else:
            num_positions = int(positions.max()) + 1 if positions.numel() else 1  # one device sync
        grown = self.grows_past is not None and num_positions > self.grows_past
        if not grown and self.native_layout and kernels.fast(q, k):
            cos, sin = self.table(positions.device, q.dtype, num_positions)  # [L, F] ([2L, F] with long_past)
            return kernels.rotary(q, k, self.table_rows(positions, batch, cos.shape[0] // 2), cos, sin)
        cos, sin = self.cos_sin(positions, q.dtype, num_positions, batch)
        if grown:
            cos, sin = self._grown(positions, q.dtype, cos, sin, batch, num_positions)
        return self.rotate_pair(q, cos, sin), self.rotate_pair(k, cos, sin)

    def _grown(self, positions, dtype, cos, sin, batch, num_positions):
        """Rows of requests longer than `grows_past` use frequencies computed for their own length."""
        cos, sin = cos.clone(), sin.clone()
        if batch is None or not batch.seq_lens_cpu:
            spans = [(0, positions.shape[0], num_positions)]
        else:
            starts = batch.query_start_loc_cpu
            spans = [(starts[i], starts[i + 1], n) for i, n in enumerate(batch.seq_lens_cpu)]
        for start, end, seq_len in spans:
            if seq_len > self.grows_past and end > start:
                inv_freq, scaling = self.inv_freq(seq_len)
                cos[start:end], sin[start:end] = self._cos_sin(positions[start:end], inv_freq, scaling, dtype)
        return cos, sin


def long_rope_past(model) -> int | None:
    """The switch of the model's two-set ropes (longrope; a module's `rotary_emb` with `long_past`), or None.
    A model whose layers switch at different lengths is refused (the prefix cache keys on one)."""
    switches = {r.long_past for m in model.modules() if isinstance(r := getattr(m, "rotary_emb", None), RotaryEmbedding)
                and r.long_past is not None}
    if len(switches) > 1:
        raise ValueError(f"rotary embeddings switching frequency sets at different lengths {sorted(switches)}")
    return switches.pop() if switches else None


@functools.lru_cache(maxsize=None)
def _shared(cls, head_dim: int, params_json: str, max_position_embeddings: int, layout: str) -> RotaryEmbedding:
    return cls(head_dim=head_dim, rope_parameters=json.loads(params_json),
               max_position_embeddings=max_position_embeddings, layout=layout)


def get_rope(*, head_dim: int, rope_parameters: dict, max_position_embeddings: int, layout: str = "rotate_half",
             cls: type[RotaryEmbedding] = RotaryEmbedding) -> RotaryEmbedding:
    """The shared `cls` instance for these parameters (layers with equal parameters share one table)."""
    return _shared(cls, head_dim, json.dumps(rope_parameters, sort_keys=True), max_position_embeddings, layout)
