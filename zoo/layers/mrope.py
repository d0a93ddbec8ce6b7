"""Multimodal rotary embedding (Qwen2-VL's M-RoPE): three position axes (temporal, height, width), each
rotating its own section of the frequencies.

Shape legend:
    T = tokens    n = heads    D = head dim    F = D / 2 frequencies    A = 3 position axes

`mrope_section` [s_t, s_h, s_w] (summing to F) splits the F frequencies in order: the first s_t rotate by
the temporal position, the next s_h by the height position, the last s_w by the width position; the
rotation is rotate-half over the whole head, as transformers' Qwen2-VL. Text tokens carry the same
position on all three axes, which makes M-RoPE the plain rotary embedding; image tokens carry their
(t, h, w) grid position (the runtime computes them per request: zoo/runtime/multimodal.py).
"""
from __future__ import annotations

import torch

from zoo.layers.rotary import RotaryEmbedding, rotate


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(self, *, head_dim: int, rope_parameters: dict, max_position_embeddings: int,
                 layout: str = "rotate_half"):
        super().__init__(head_dim=head_dim, rope_parameters=rope_parameters,
                         max_position_embeddings=max_position_embeddings, layout=layout)
        self.section = [int(s) for s in rope_parameters.get("mrope_section") or ()]
        if sum(self.section) != head_dim // 2 or len(self.section) != 3:
            raise ValueError(f"rope_parameters.mrope_section={self.section} must be 3 sections adding up to "
                             f"head_dim / 2 = {head_dim // 2}")

    @property
    def native_layout(self) -> bool:
        return False  # three position axes: the torch path below

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, batch=None):
        """positions [A, T] (or [T]: the same on every axis); q [T, n, D], k [T, n_kv, D] -> both rotated."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)  # [A, T]
        inv_freq, scaling = self.inv_freq()
        freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [A, T, F]
        axis = torch.repeat_interleave(torch.arange(3, device=positions.device),
                                       torch.tensor(self.section, device=positions.device))  # [F]: each one's axis
        freqs = freqs.gather(0, axis.view(1, 1, -1).expand(1, freqs.shape[1], -1))[0]  # [T, F]
        cos, sin = (freqs.cos() * scaling).to(q.dtype), (freqs.sin() * scaling).to(q.dtype)  # [T, F]
        return rotate(q, cos, sin), rotate(k, cos, sin)
