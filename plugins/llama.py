"""Llama, and the base classes of the dense / GQA family: attention -> MLP -> decoder layer -> model -> LM.

Shape legend:
    T = tokens of the step (all requests, flattened)    H = hidden size     V = vocab size
    Hq = query heads    KV = key/value heads    D = head dim    I = intermediate size
    N = rows whose logits are sampled

Leaf modules take explicit keyword arguments; only the decoder layer, the model and the LM read the
config. Module names are checkpoint names, so parameter names are checkpoint keys after LLAMA_RULES.

Subclassing (every built-in dense plugin, and the MoE ones, which reuse the attention and the layer; the
plugin author's guide, docs/plugins.md, lists each hook with the plugin that uses it):
    norm_class, norm_eps(config), make_norm(config, dim)            (layer and model) which norm, which eps
    LlamaAttention.norm_class, make_qk_norms(eps), norm_qk(q, k)    the optional q/k norms and how they apply
    LlamaDecoderLayer.attention_kwargs(config, layer_idx) -> dict   what the attention is built with
    LlamaDecoderLayer.make_mlp(config, layer_idx, prefix)           the feed-forward (a MoE block, ...)
    LlamaDecoderLayer.make_norms(config)                            the layer's norms (names are checkpoint names)
    LlamaDecoderLayer.attention_class                               class used by the layer
    LlamaModel.layer_class, LlamaModel.embed_scale(config), LlamaModel.embed(ids, batch)
    LlamaForCausalLM.model_class, LlamaForCausalLM.make_head(config)
A layer built with `rope=None` has no positional encoding (SmolLM3's NoPE layers).
"""
from __future__ import annotations

import torch
from torch import nn

from loader.rules import Fuse, Ignore, Rules, Shard, padded_vocab
from registry import ArchSpec, hookimpl
from zoo.layers.attention import Attention
from zoo.layers.embedding import LMHead, VocabEmbedding
from zoo.layers.linear import Linear, QKVLinear
from zoo.layers.mlp import GatedMLP, activation
from zoo.layers.norm import RMSNorm
from zoo.layers.rotary import ROPE_TYPES, RotaryEmbedding, get_rope, rope_parameters
from zoo.runtime.batch import CacheSpec, ForwardBatch

LLAMA_RULES = Rules(
    fuses=(Fuse(("q_proj", "k_proj", "v_proj"), "qkv_proj"), Fuse(("gate_proj", "up_proj"), "gate_up_proj")),
    # No Tie rule: a tied config shares the tensor in the model itself (and the loader unties it if the
    # checkpoint holds a real lm_head.weight); an untied model whose checkpoint lacks its head must fail.
    ignores=(Ignore(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$",
                    "rotary tables that old checkpoints saved; recomputed from the config"),),
)


class NormHooks:
    """Which norm a layer or model builds, and from which config field its eps comes."""
    norm_class = RMSNorm

    def norm_eps(self, config) -> float:
        return config.rms_norm_eps

    def make_norm(self, config, dim: int) -> nn.Module:
        return self.norm_class(dim, eps=self.norm_eps(config))


class LlamaAttention(nn.Module):
    norm_class = RMSNorm  # of the optional q/k norms
    qk_norm_names = ("q_norm", "k_norm")  # their checkpoint names

    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope: RotaryEmbedding | None, scale: float | None = None, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm_eps: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                 prefix: str):
        super().__init__()
        self.prefix = prefix
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv_proj = QKVLinear(hidden_size, head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                  bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        if qk_norm_eps is not None:
            self.make_qk_norms(qk_norm_eps)
        self.rotary_emb = rope  # a shared plain object, not a submodule; None: no positional encoding
        self.attn = Attention(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              scale=head_dim ** -0.5 if scale is None else scale, sliding_window=sliding_window,
                              softcap=softcap, prefix=f"{prefix}.attn")

    def make_qk_norms(self, eps: float) -> None:
        """The q and k norms (named qk_norm_names): one norm on the head dim shared by every head (Qwen3,
        Gemma3, Phi), applied before the rotation."""
        q_name, k_name = self.qk_norm_names
        setattr(self, q_name, self.norm_class(self.head_dim, eps=eps))
        setattr(self, k_name, self.norm_class(self.head_dim, eps=eps))

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, KV, D] normed (when the attention has q/k norms), same shapes."""
        q_name, k_name = self.qk_norm_names
        if hasattr(self, q_name):
            q, k = getattr(self, q_name)(q), getattr(self, k_name)(k)
        return q, k

    def cache_spec(self) -> CacheSpec:
        """One token of this layer's cache: (2, KV, D) in the weights' dtype; keyed by `self.prefix`."""
        w = self.o_proj.weight
        return self.attn.spec(torch.float32 if w.dtype is torch.uint8 else w.dtype)  # (uint8: quantised blocks)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))  # [T, (Hq+2KV)*D] -> [T, Hq*D], 2x [T, KV*D]
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        q, k = self.norm_qk(q, k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k, batch)
        sinks = getattr(self, "sinks", None)  # [Hq]: an attention that owns sinks (gpt-oss) applies them
        o = self.attn(q, k, v, batch.cache_for(self.prefix), batch, sinks)  # [T, Hq*D]; cache [NB, BS, 2, KV, D]
        return self.o_proj(o)  # [T, H]


class LlamaDecoderLayer(NormHooks, nn.Module):
    attention_class = LlamaAttention

    def __init__(self, config, layer_idx: int, *, prefix: str):
        super().__init__()
        self.prefix, self.layer_idx = prefix, layer_idx
        self.self_attn = self.attention_class(**self.attention_kwargs(config, layer_idx), prefix=f"{prefix}.self_attn")
        self.mlp = self.make_mlp(config, layer_idx, prefix=f"{prefix}.mlp")
        self.make_norms(config)

    def make_norms(self, config) -> None:
        """The norms before attention and before the MLP."""
        self.input_layernorm = self.make_norm(config, config.hidden_size)
        self.post_attention_layernorm = self.make_norm(config, config.hidden_size)

    def layer_type(self, config, layer_idx: int) -> str:
        types = getattr(config, "layer_types", None)
        return types[layer_idx] if types else "full_attention"

    def attention_kwargs(self, config, layer_idx: int) -> dict:
        head_dim = head_dim_of(config)
        layer_type = self.layer_type(config, layer_idx)
        bias = getattr(config, "attention_bias", False)
        return dict(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=num_kv_heads_of(config),
            head_dim=head_dim,
            rope=get_rope(head_dim=head_dim, rope_parameters=rope_parameters(config, layer_type),
                          max_position_embeddings=config.max_position_embeddings),
            qkv_bias=bias,
            o_bias=bias,
            sliding_window=getattr(config, "sliding_window", None) if layer_type == "sliding_attention" else None,
        )

    def make_mlp(self, config, layer_idx: int, prefix: str) -> nn.Module:
        return GatedMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                        hidden_act=config.hidden_act, bias=getattr(config, "mlp_bias", False), prefix=prefix)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.self_attn(positions, self.input_layernorm(hidden_states), batch)  # [T, H]
        hidden_states = hidden_states + h
        h = self.mlp(self.post_attention_layernorm(hidden_states))  # [T, H]
        return hidden_states + h


class ParallelDecoderLayer(LlamaDecoderLayer):
    """x + attn(norm(x)) + mlp(norm(x)): attention and MLP read one normed input (Cohere, Phi, StableLM's
    use_parallel_residual)."""

    def make_norms(self, config) -> None:
        self.input_layernorm = self.make_norm(config, config.hidden_size)  # diff with Llama: one norm

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.input_layernorm(hidden_states)  # [T, H]
        return hidden_states + self.self_attn(positions, h, batch) + self.mlp(h)  # [T, H]


class LlamaModel(NormHooks, nn.Module):
    layer_class = LlamaDecoderLayer

    def __init__(self, config, *, prefix: str = "model"):
        super().__init__()
        self.prefix = prefix
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, scale=self.embed_scale(config))
        self.layers = nn.ModuleList(self.layer_class(config, i, prefix=f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = self.make_norm(config, config.hidden_size)

    def embed_scale(self, config) -> float | None:
        return None

    def embed(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # [T] -> [T, H]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden_states = self.embed(input_ids, batch)  # [T, H]
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, batch)  # [T, H]
        return self.norm(hidden_states)  # [T, H]


class LlamaForCausalLM(nn.Module):
    model_class = LlamaModel

    def __init__(self, config, *, prefix: str = ""):
        super().__init__()
        self.config = config
        self.model = self.model_class(config, prefix=f"{prefix}.model" if prefix else "model")
        self.lm_head = self.make_head(config)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight  # one Parameter under two names

    def make_head(self, config) -> LMHead:
        return LMHead(config.vocab_size, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)  # [T] -> [T, H]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)  # [N, H] -> [N, V]


# -- config helpers (read the way transformers reads them) ---------------------------------------------

def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def split_config(config, size: int, fields: tuple[str, ...]):
    """A copy of `config` with each of `fields` divided by `size` (ValueError naming a field that does not
    split) and the vocabulary cut to one rank's part of the padded vocab."""
    import copy

    local = copy.deepcopy(config)
    for field in fields:
        n = getattr(config, field, None)
        if n is None:
            continue
        if n % size:
            raise ValueError(f"config.{field}={n} does not split over tensor parallel size {size}")
        setattr(local, field, n // size)
    local.vocab_size = padded_vocab(config.vocab_size, size) // size
    return local


def tensor_parallel(config, size: int, *, fields: tuple[str, ...] = ("intermediate_size",),
                    shards: tuple[Shard, ...] = (), vocab_keys: tuple[str, ...] = ()):
    """(rank-local config, Shard rules) for `size` ranks, Megatron-style: q/k/v and gate/up split by rows
    (column-parallel; k/v by KV heads, each rank one head when size > KV), o/down by cols (row-parallel), the
    embedding and head (and a head's bias) by vocab rows (padded to a multiple of 64), norms and routers
    replicated. Every rank builds the same local shapes; the loader's Shard rules say which slice of each
    checkpoint tensor a rank reads. MoE variants pass their expert sizes in `fields` (each expert split like a
    dense MLP: per-expert gate_proj/up_proj column, down_proj row); plugins add their own key names' Shards in
    `shards` (first match wins: fused checkpoint tensors, q/k norms, other names), and in `vocab_keys` the
    checkpoint's names of the embedding and head where they are not embed_tokens / lm_head."""
    kv = num_kv_heads_of(config)
    local = split_config(config, size, ("num_attention_heads",) + fields)
    if kv % size and size % kv:
        raise ValueError(f"config.num_key_value_heads={kv} and tensor parallel size {size}: neither divides the other")
    local.head_dim = head_dim_of(config)
    local.num_key_value_heads = max(kv // size, 1)
    rules = Rules(shards=shards + (
        Shard(r"\.(q_proj|gate_proj|up_proj)\.(weight|bias)$", "column"),
        Shard(r"\.(k_proj|v_proj)\.(weight|bias)$", "kv", heads=kv),
        Shard(r"\.(o_proj|down_proj)\.weight$", "row"),
        # MoE experts as transformers v5 saves them fused (save_original_format=False): [E, 2I, H] gate | up, [E, H, I]
        Shard(r"\.experts\.gate_up_proj$", "fused", dim=1, parts=("column", "column")),
        Shard(r"\.experts\.down_proj$", "row", dim=2),
        Shard(rf"(^|\.)({'|'.join(('embed_tokens', 'lm_head') + vocab_keys)})\.(weight|bias)$", "vocab",
              size=config.vocab_size),
    ))
    return local, rules


def validate(config) -> None:
    """Raise ValueError naming the config field this family cannot serve."""
    heads, kv = config.num_attention_heads, num_kv_heads_of(config)
    if heads % kv:
        raise ValueError(f"config.num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    act_field = "hidden_activation" if getattr(config, "hidden_activation", None) else "hidden_act"
    activation(getattr(config, act_field), field=f"config.{act_field}")
    for layer_type in sorted(set(getattr(config, "layer_types", None) or ["full_attention"])):
        rope_type = rope_parameters(config, layer_type).get("rope_type")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"config.rope_parameters: rope_type {rope_type!r} (layer type {layer_type}) is not "
                             f"supported; supported: {', '.join(ROPE_TYPES)}")


@hookimpl
def register_architectures(register):
    register(ArchSpec(("LlamaForCausalLM",), "plugins.llama:LlamaForCausalLM", "dense", rules=LLAMA_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
