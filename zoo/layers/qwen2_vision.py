"""Qwen2-VL's vision transformer: patches in, merged patch features out, each image attending to itself.

Shape legend:
    P = patches of the step's images (all of them, concatenated)    K = C * Tp * p * p values of one patch
    C = channels (3)    Tp = temporal patch size (2)    p = patch size    m = spatial merge size (2)
    E = vision hidden size    I = vision MLP size    Hd = vision heads    D = head dim (E / Hd)
    H = language model hidden size    P / m^2 = output rows (one per merged m x m block)

The image processor resizes an image to multiples of p * m, repeats it to Tp frames and lays its patches
out as rows of K values, merge-block-major: the m x m patches of one merged block are consecutive rows, in
row-major order within the block, blocks in row-major order; `image_grid_thw` is (t, h, w) in patches.
The patch embedding (a Conv3d whose stride equals its kernel in the checkpoint) is then a linear map of
those rows. Each block: x + attn(norm1(x)), x + mlp(norm2(x)) with LayerNorms (eps 1e-6), a fused qkv,
2-D rotary embeddings on each patch's (row, column) in the image (the first D/4 frequencies by row, the
next D/4 by column, rotate-half over the whole head), and full attention within each frame of each image
(its own sequence boundaries). The merger LayerNorms each patch, concatenates the m^2 patches of a block
and projects them with a GELU MLP into the language model's hidden size.

Tensor parallelism (`parallel` ranks, zoo/layers/vision.py's split): Hd / parallel heads per rank (qkv's q, k and v
rows column-parallel, proj row-parallel), I / parallel of each MLP and m^2 E / parallel of the merger's inner width
(its first linear column-parallel, its second row-parallel); the patch embedding, the LayerNorms and the rotary
tables are whole on every rank, and so are the merged features after the merger's all-reduce.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo.layers.linear import Linear
from zoo.layers.rotary import rotate
from zoo.layers.vision import VisionMLP, split


class PatchLinear(nn.Module):
    """The patch embedding: weight [E, C, Tp, p, p] as the checkpoint's Conv3d, applied as a linear map."""

    def __init__(self, *, channels: int, temporal_patch_size: int, patch_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, channels, temporal_patch_size, patch_size, patch_size))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return F.linear(patches.to(self.weight.dtype), self.weight.flatten(1))  # [P, K] -> [P, E]


class PatchEmbed(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.proj = PatchLinear(**kw)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)  # [P, K] -> [P, E]


def patch_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch in its image, in the processor's merge-block-major order: [P, 2]."""
    out = []
    for t, h, w in grid_thw:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")  # [h, w] each
        blocks = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(blocks).transpose(1, 2).flatten()  # [h * w]
        cols = cols.reshape(blocks).transpose(1, 2).flatten()
        out.append(torch.stack((rows, cols), dim=-1).repeat(t, 1))  # [t * h * w, 2]
    return torch.cat(out)  # [P, 2]


class VisionRotary:
    """2-D rotary embedding: D/4 frequencies of base theta over the row, the same over the column."""

    def __init__(self, *, head_dim: int, theta: float):
        half = head_dim // 2  # (built on the host even when the model is built on the meta device)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32, device="cpu") / half))  # [D/4]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [P, 2, D/4]
        freqs = freqs.flatten(1)  # [P, D/2]: row frequencies, then column frequencies
        return freqs.cos(), freqs.sin()  # [P, D/2] each


class Qwen2VisionAttention(nn.Module):
    def __init__(self, *, hidden_size: int, num_heads: int, parallel: int = 1):
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.num_heads = split(num_heads, parallel, "vision_config.num_heads")  # this rank's heads
        width = self.num_heads * self.head_dim
        self.qkv = Linear(hidden_size, 3 * width, bias=True)  # q | k | v, this rank's heads of each
        self.proj = Linear(width, hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        p = x.shape[0]
        q, k, v = self.qkv(x).view(p, 3, self.num_heads, self.head_dim).unbind(1)  # 3x [P, Hd, D]
        q, k = rotate(q.float(), cos, sin).to(x.dtype), rotate(k.float(), cos, sin).to(x.dtype)
        out = torch.empty_like(q)  # [P, Hd, D]
        start = 0
        for n in seq_lens:  # full attention within each frame of each image
            s = slice(start, start + n)
            o = F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1),
                                               scale=self.head_dim ** -0.5)  # [Hd, n, D]
            out[s] = o.transpose(0, 1)
            start += n
        return self.proj(out.flatten(1))  # [P, E]


class Qwen2VisionBlock(nn.Module):
    def __init__(self, config, parallel: int = 1):
        super().__init__()
        e = config.embed_dim
        self.norm1 = nn.LayerNorm(e, eps=1e-6)
        self.norm2 = nn.LayerNorm(e, eps=1e-6)
        self.attn = Qwen2VisionAttention(hidden_size=e, num_heads=config.num_heads, parallel=parallel)
        self.mlp = VisionMLP(hidden_size=e, intermediate_size=int(e * config.mlp_ratio), hidden_act=config.hidden_act,
                             parallel=parallel, field="vision_config.embed_dim x mlp_ratio")

    def forward(self, x, cos, sin, seq_lens):
        x = x + self.attn(self.norm1(x), cos, sin, seq_lens)  # [P, E]
        return x + self.mlp(self.norm2(x))  # [P, E]


class PatchMerger(nn.Module):
    def __init__(self, *, hidden_size: int, context_dim: int, merge: int, parallel: int = 1):
        super().__init__()
        self.width = context_dim * merge ** 2
        inner = split(self.width, parallel, "vision_config.embed_dim x spatial_merge_size^2")
        self.ln_q = nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(Linear(self.width, inner, bias=True), nn.GELU(), Linear(inner, hidden_size, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))  # [P, E] -> [P / m^2, m^2 E] -> [P / m^2, H]


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, config, parallel: int = 1):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(channels=config.in_channels, temporal_patch_size=config.temporal_patch_size,
                                      patch_size=config.patch_size, hidden_size=config.embed_dim)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(head_dim=config.embed_dim // config.num_heads, theta=theta)
        self.blocks = nn.ModuleList(Qwen2VisionBlock(config, parallel) for _ in range(config.depth))
        self.merger = PatchMerger(hidden_size=config.hidden_size, context_dim=config.embed_dim, merge=self.merge,
                                  parallel=parallel)

    def forward(self, patches: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.patch_embed(patches)  # [P, K] -> [P, E]
        cos, sin = self.rotary.cos_sin(patch_positions(grid_thw, self.merge).to(x.device))  # [P, D/2] each
        seq_lens = [h * w for t, h, w in grid_thw for _ in range(t)]  # one sequence per frame
        for block in self.blocks:
            x = block(x, cos, sin, seq_lens)  # [P, E]
        return self.merger(x)  # [P / m^2, H]
