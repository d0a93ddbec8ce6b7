"""Vision towers: a CLIP vision transformer (LLaVA's), and LLaVA's projector into the language model.

Shape legend:
    N = images    C = channels of a pixel (3)    Hp, Wp = image height, width in pixels    p = patch size
    P = patches of one image ((Hp / p) * (Wp / p))    S = P + 1 (the class token first)
    E = vision hidden size    I = vision MLP size    Hd = vision heads    D = head dim (E / Hd)
    F = feature rows of one image (S, or P with the class token dropped)    H = language model hidden size

CLIP (transformers' CLIPVisionModel): patch embedding (a stride-p convolution without bias), a learned
class token prepended, learned absolute position embeddings, a LayerNorm before the encoder
(`pre_layrnorm`, spelt as in the checkpoints), then pre-norm encoder layers: x + attn(ln1(x)), then
x + mlp(ln2(x)), full (bidirectional) attention within each image, a quick-GELU MLP. `hidden_states[0]` is
the pre-normed embedding, `hidden_states[k]` the output of layer k - 1; LLaVA takes its features from
`vision_feature_layer` (an index into those, or a list of them concatenated on channels) and never
reads the last layers past it nor `post_layernorm` (which normalises only the pooled class token): the
tower builds only `num_layers` layers, and the model names the rest as ignored checkpoint keys.

Tensor parallelism (`parallel` = the ranks of the group, 1 without): each rank builds Hd / parallel heads of every
attention (q / k / v column-parallel, out_proj row-parallel), I / parallel of every MLP (fc1 column, fc2 row) and
H / parallel of the projector's inner width (linear_1 column, linear_2 row); the row-parallel outputs are summed
over the ranks (zoo/layers/parallel.py), so the residual stream, the LayerNorms, the embeddings and every
hidden state are whole on every rank, and so are the image features.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo.layers.linear import Linear, QKVLinear
from zoo.layers.mlp import ACTIVATIONS

# transformers' ACT2FN names the vision towers use, beyond the language models' ones
VISION_ACTIVATIONS = {**ACTIVATIONS, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


def vision_activation(name: str, *, field: str):
    if name not in VISION_ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported; supported: {', '.join(sorted(VISION_ACTIVATIONS))}")
    return VISION_ACTIVATIONS[name]


class PatchConv(nn.Module):
    """A stride-p convolution over non-overlapping patches: weight [E, C, p, p] as in the checkpoint."""

    def __init__(self, channels: int, hidden_size: int, patch_size: int):
        super().__init__()
        self.patch_size = patch_size
        self.weight = nn.Parameter(torch.empty(hidden_size, channels, patch_size, patch_size))  # [E, C, p, p]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = F.conv2d(pixel_values, self.weight, stride=self.patch_size)  # [N, C, Hp, Wp] -> [N, E, Hp/p, Wp/p]
        return x.flatten(2).transpose(1, 2)  # [N, P, E], patches in row-major order


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, *, hidden_size: int, image_size: int, patch_size: int, channels: int = 3):
        super().__init__()
        self.image_size, self.patch_size = image_size, patch_size
        self.num_positions = (image_size // patch_size) ** 2 + 1
        self.class_embedding = nn.Parameter(torch.empty(hidden_size))  # [E]
        self.patch_embedding = PatchConv(channels, hidden_size, patch_size)
        self.position_embedding = nn.Embedding(self.num_positions, hidden_size)  # weight [S, E]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"image of {h}x{w} pixels; this CLIP tower takes {self.image_size}x{self.image_size}")
        patches = self.patch_embedding(pixel_values.to(self.class_embedding.dtype))  # [N, P, E]
        cls = self.class_embedding.expand(n, 1, -1)  # [N, 1, E]
        return torch.cat((cls, patches), dim=1) + self.position_embedding.weight  # [N, S, E]


def split(n: int, parallel: int, field: str) -> int:
    """n / parallel: one rank's share of `field` (ValueError naming it when it does not split)."""
    if n % parallel:
        raise ValueError(f"{field}={n} does not split over tensor parallel size {parallel}")
    return n // parallel


class VisionAttention(nn.Module):
    """Full attention within each image: q, k, v fused (each biased), an output projection (this rank's
    Hd / parallel heads)."""

    def __init__(self, *, hidden_size: int, num_heads: int, bias: bool = True, parallel: int = 1):
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.num_heads = heads = split(num_heads, parallel, "vision_config.num_attention_heads")
        self.qkv_proj = QKVLinear(hidden_size, head_dim=self.head_dim, num_heads=heads, num_kv_heads=heads, bias=bias)
        self.out_proj = Linear(heads * self.head_dim, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, e = x.shape
        q, k, v = self.qkv_proj.split(self.qkv_proj(x.reshape(n * s, e)))  # 3x [N*S, Hd*D]
        q, k, v = (t.view(n, s, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))  # [N, Hd, S, D]
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)  # [N, Hd, S, D]
        return self.out_proj(o.transpose(1, 2).reshape(n * s, -1)).view(n, s, e)  # [N, S, E]


class VisionMLP(nn.Module):
    """fc2(act(fc1(x))), both biased (CLIP: quick-GELU), I / parallel of the width on this rank."""

    def __init__(self, *, hidden_size: int, intermediate_size: int, hidden_act: str, parallel: int = 1,
                 field: str = "vision_config.intermediate_size"):
        super().__init__()
        self.act = vision_activation(hidden_act, field="vision_config.hidden_act")
        inner = split(intermediate_size, parallel, field)
        self.fc1 = Linear(hidden_size, inner, bias=True)
        self.fc2 = Linear(inner, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = self.fc2(self.act(self.fc1(x.reshape(-1, shape[-1]))))  # [N*S, E] -> [N*S, I / parallel] -> [N*S, E]
        return x.view(shape)


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config, parallel: int = 1):
        super().__init__()
        e = config.hidden_size
        self.layer_norm1 = nn.LayerNorm(e, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(hidden_size=e, num_heads=config.num_attention_heads, parallel=parallel)
        self.layer_norm2 = nn.LayerNorm(e, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(hidden_size=e, intermediate_size=config.intermediate_size, hidden_act=config.hidden_act,
                             parallel=parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))  # [N, S, E]
        return x + self.mlp(self.layer_norm2(x))  # [N, S, E]


class CLIPEncoder(nn.Module):
    def __init__(self, config, num_layers: int, parallel: int = 1):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config, parallel) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """CLIPVisionModel up to its `num_layers`-th layer; `forward` returns hidden_states[0 .. num_layers]."""

    def __init__(self, config, num_layers: int, parallel: int = 1):
        super().__init__()
        if not 0 <= num_layers <= config.num_hidden_layers:
            raise ValueError(f"vision tower: {num_layers} layers asked of {config.num_hidden_layers}")
        self.num_layers = num_layers
        self.embeddings = CLIPVisionEmbeddings(hidden_size=config.hidden_size, image_size=config.image_size,
                                               patch_size=config.patch_size, channels=config.num_channels)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config, num_layers, parallel)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        x = self.pre_layrnorm(self.embeddings(pixel_values))  # [N, C, Hp, Wp] -> [N, S, E]
        hidden_states = [x]
        for layer in self.encoder.layers:
            x = layer(x)  # [N, S, E]
            hidden_states.append(x)
        return hidden_states  # num_layers + 1 of [N, S, E]


def feature_layers(vision_feature_layer, num_hidden_layers: int) -> list[int]:
    """`vision_feature_layer` (an int or a list, negative counting from the end of hidden_states, which has
    num_hidden_layers + 1 entries) as non-negative indices; ValueError naming the field when out of range."""
    layers = [vision_feature_layer] if isinstance(vision_feature_layer, int) else list(vision_feature_layer)
    n = num_hidden_layers + 1
    if not layers or any(not isinstance(i, int) or not -n <= i < n for i in layers):
        raise ValueError(f"config.vision_feature_layer={vision_feature_layer!r}: each index must lie in "
                         f"[-{n}, {n - 1}] (hidden_states of a {num_hidden_layers}-layer vision tower)")
    return [i % n for i in layers]


def select_features(hidden_states: list[torch.Tensor], layers: list[int], strategy: str) -> torch.Tensor:
    """hidden_states[i] for i in layers, concatenated on channels; "default" drops the class token."""
    picked = [hidden_states[i] for i in layers]  # each [N, S, E]
    if strategy == "default":
        picked = [h[:, 1:] for h in picked]  # [N, P, E]
    return torch.cat(picked, dim=-1)  # [N, F, E * len(layers)]


class MultiModalProjector(nn.Module):
    """LLaVA's projector: linear_2(act(linear_1(features))), into the language model's hidden size (H / parallel
    of the inner width on this rank)."""

    def __init__(self, *, in_features: int, hidden_size: int, hidden_act: str, bias: bool = True, parallel: int = 1):
        super().__init__()
        self.act = vision_activation(hidden_act, field="config.projector_hidden_act")
        inner = split(hidden_size, parallel, "config.text_config.hidden_size")
        self.linear_1 = Linear(in_features, inner, bias=bias)
        self.linear_2 = Linear(inner, hidden_size, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))  # [M, E'] -> [M, H / parallel] -> [M, H]
