"""`zoo parity --tiny CONFIG`: a shrunken random-weight checkpoint with a new model's structure.

From a config.json (or a directory holding one) we keep everything that makes the architecture what
it is and shrink only sizes, so parity can run in seconds before any weights are downloaded:

  kept        architecture, rope type/theta/scaling (longrope's factor lists resampled to the new rotary
              dim, evenly spaced, ends kept), partial rotary, NoPE layers, norms and eps, activations, biases,
              tied embeddings, softcapping, q/k norms, top-k and routing style, shared experts, MLA
              structure (q LoRA or not), and the head_dim x heads / hidden ratio
  layers      the first layer plus the first layer of every other kind (each layer_types / no_rope_layers
              entry, dense vs MoE): at least 2; those lists and the dense/MoE placement fields are rewritten
  heads       MHA stays MHA (4 heads), MQA stays MQA (1 KV head), GQA keeps its group size up to 4 with
              2 KV heads; head_dim 16 (query_pre_attn_scalar scaled with it)
  shrunk      hidden size (from the heads and the kept ratio), intermediate sizes (same ratio to
              hidden), experts (at most 8; DeepSeek groups kept), vocabulary (at most 256), sliding window
              (at most 8, so the default prompts cross it), MLA ranks
  not shrunk  a multimodal config's vision tower (only its text_config is shrunk)
Weights are random (transformers' own init, seeded, initializer_range raised to 0.2 so that attention is
far from uniform and masking / rotary errors show), then `randomize_constants` replaces what that init
leaves constant (biases 0, norm weights 1 or Gemma's 0 offsets, router score biases 0), so a dropped
bias or a misplaced norm changes the output; saved with save_pretrained (safetensors).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import transformers

HEAD_DIM = 16
MAX_EXPERTS = 8
MAX_VOCAB = 256
MAX_WINDOW = 8
WIDE_INIT = 0.2
CONSTANT_SPREAD = 0.2  # a constant c becomes c + N(0, 0.2 * max(1, |c|)): norms 1 +- 0.2, biases +- 0.2


@torch.no_grad()
def randomize_constants(model: torch.nn.Module, *, seed: int = 0) -> list[str]:
    """Give every saved tensor that init left constant (all elements equal: a bias of zeros, a norm weight
    of ones, a router's score-correction bias) random values around that constant, seeded; tensors init
    already made random are kept. Returns the names changed. Used by `--tiny` and by the tests' tiny
    checkpoints (tests/tiny.py), so that biases, norm weights and router biases take part in parity."""
    g = torch.Generator().manual_seed(seed)
    saved = model.state_dict(keep_vars=True)  # parameters and persistent buffers, tied ones once
    changed, seen = [], set()
    for name, t in saved.items():
        if id(t) in seen or not t.is_floating_point() or t.numel() < 2:
            continue
        seen.add(id(t))
        c = t.flatten()[0]
        if not bool((t == c).all()):
            continue
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32) * CONSTANT_SPREAD * max(1.0, abs(c.item()))
        t.copy_((c.float() + noise).to(t.dtype))
        changed.append(name)
    return changed


def load_config(source) -> transformers.PretrainedConfig:
    """A transformers config from a directory with config.json or from a .json file."""
    p = Path(source)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"--tiny {source}: no config.json there")
    with open(p) as f:
        d = json.load(f, object_hook=_special_float)
    model_type = d.get("model_type")
    if not model_type:
        raise ValueError(f"--tiny {source}: config has no model_type")
    try:
        cls = transformers.AutoConfig.for_model(model_type).__class__
    except ValueError as e:
        raise ValueError(f"--tiny {source}: transformers {transformers.__version__} does not know model_type "
                         f"{model_type!r} ({e})") from None
    return cls.from_dict(d)


def _special_float(obj: dict):
    """transformers writes inf / nan as {"__float__": "Infinity"} (Mamba2's time_step_limit): read them back."""
    return float(obj["__float__"]) if obj.keys() == {"__float__"} and isinstance(obj["__float__"], str) else obj


def _round8(x: float) -> int:
    return max(16, int(round(x / 8)) * 8)


# per-layer list fields: the kept layers keep their entries, and the first layer of each distinct entry is kept
PER_LAYER = ("layer_types", "no_rope_layers")


def _kept_layers(d: dict) -> list[int]:
    n = d["num_hidden_layers"]
    if d.get("attn_layer_period"):  # Jamba: whole periods of its attention / MoE pattern, the fields unchanged
        return list(range(min(n, math.lcm(d["attn_layer_period"], d.get("expert_layer_period") or 1))))
    kept = {0}
    attn = set(d.get("attn_layer_indices") or ())  # Bamba: the first attention layer and the first Mamba one
    kept |= {min(attn)} if attn else set()
    kept |= {next((i for i in range(n) if i not in attn), 0)}
    for field in PER_LAYER:
        values = d.get(field) or []
        for t in dict.fromkeys(values):
            kept.add(values.index(t))
    # MoE placement: the first dense layer and the first MoE layer
    moe = _moe_layers(d, n)
    if moe is not None and not d.get("attn_layer_period"):
        for flag in (True, False):
            if flag in moe:
                kept.add(moe.index(flag))
    kept = sorted(kept)
    while len(kept) < 2 and len(kept) < n:
        kept.append(next(i for i in range(n) if i not in kept))
    return sorted(kept)


def _moe_layers(d: dict, n: int) -> list[bool] | None:
    """Which layers are MoE, by the config's own rules, or None for a model without experts."""
    if d.get("n_routed_experts"):  # DeepSeek
        k, freq = d.get("first_k_dense_replace", 0), d.get("moe_layer_freq", 1)
        return [i >= k and i % freq == 0 for i in range(n)]
    if d.get("num_experts") and "decoder_sparse_step" in d:  # Qwen2-MoE, Qwen3-MoE
        step, dense = d.get("decoder_sparse_step", 1) or 1, set(d.get("mlp_only_layers") or [])
        return [i not in dense and (i + 1) % step == 0 for i in range(n)]
    if d.get("num_local_experts") or d.get("num_experts"):  # Mixtral, OLMoE: every layer
        return [True] * n
    return None


def shrink_dict(d: dict) -> dict:
    """The shrunken copy of a config dict (the text part of a multimodal config is shrunk in place)."""
    d = dict(d)
    if isinstance(d.get("text_config"), dict):
        d["text_config"] = shrink_dict(d["text_config"])
        return d
    if "num_hidden_layers" not in d or "hidden_size" not in d:
        return d
    n = d["num_hidden_layers"]
    kept = _kept_layers(d)
    moe = _moe_layers(d, n)
    d["num_hidden_layers"] = len(kept)
    if d.get("attn_layer_indices"):
        d["attn_layer_indices"] = [j for j, i in enumerate(kept) if i in d["attn_layer_indices"]]
    if "num_attention_heads" not in d:  # attention-free (Mamba2): only the mixers to shrink
        _shrink_ssm(d, hidden=d["hidden_size"], hidden_new=64)
        return _shrink_tail(d)
    for field in PER_LAYER:
        if isinstance(d.get(field), list) and len(d[field]) == n:
            d[field] = [d[field][i] for i in kept]
    if moe is not None:
        new_moe = [moe[i] for i in kept]
        if d.get("n_routed_experts"):
            d["first_k_dense_replace"] = new_moe.index(True) if True in new_moe else len(kept)
            d["moe_layer_freq"] = 1
        elif "decoder_sparse_step" in d:
            d["decoder_sparse_step"] = 1
            d["mlp_only_layers"] = [i for i, m in enumerate(new_moe) if not m]

    heads, hidden = d["num_attention_heads"], d["hidden_size"]
    kv = d.get("num_key_value_heads") or heads
    head_dim = d.get("head_dim") or hidden // heads
    ratio = head_dim * heads / hidden  # kept: some models have head_dim * heads != hidden
    kv_new = 4 if kv == heads else 1 if kv == 1 else 2  # MHA stays MHA, MQA stays MQA
    heads_new = kv_new * min(heads // kv, 4)
    hidden_new = _round8(heads_new * HEAD_DIM / ratio)
    if d.get("kv_lora_rank"):  # MLA: heads are not tied to the hidden size, and there is no GQA
        heads_new = kv_new = 4
        hidden_new = 64
    d.update(num_attention_heads=heads_new, num_key_value_heads=kv_new, hidden_size=hidden_new)
    if "head_dim" in d and d["head_dim"] is not None or ratio != 1:
        d["head_dim"] = HEAD_DIM
    if d.get("query_pre_attn_scalar"):
        d["query_pre_attn_scalar"] = max(1, round(d["query_pre_attn_scalar"] * HEAD_DIM / head_dim))
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if d.get(key):
            d[key] = _round8(d[key] * hidden_new / hidden)

    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if d.get(key):
            d[key] = min(d[key], MAX_EXPERTS)
    experts = d.get("num_local_experts") or d.get("num_experts") or d.get("n_routed_experts")
    if experts:
        if d.get("n_group"):
            groups = min(d["n_group"], 2)
            topk_group = d.get("topk_group") or groups
            d["n_group"], d["topk_group"] = groups, 1 if topk_group < d["n_group"] else groups
        if d.get("num_experts_per_tok"):
            d["num_experts_per_tok"] = min(d["num_experts_per_tok"], 2, experts - 1)
        if d.get("n_shared_experts"):
            d["n_shared_experts"] = min(d["n_shared_experts"], 2)
    if d.get("kv_lora_rank"):  # MLA
        d["kv_lora_rank"] = 32
        d["q_lora_rank"] = 32 if d.get("q_lora_rank") else None
        d["qk_rope_head_dim"], d["qk_nope_head_dim"], d["v_head_dim"] = 8, 16, 16
        d["head_dim"] = 8  # DeepSeek's head_dim is the rotary part
    if d.get("sliding_window"):
        d["sliding_window"] = min(d["sliding_window"], MAX_WINDOW)
    _shrink_rope_factors(d)
    _shrink_ssm(d, hidden=hidden, hidden_new=hidden_new)
    return _shrink_tail(d)


# the SSM mixer's fields: (heads, head dim, state, groups, chunk, expand, dt rank) per model type
SSM_FIELDS = {
    "mamba2": ("num_heads", "head_dim", "state_size", "n_groups", "chunk_size", "expand", "time_step_rank"),
    "bamba": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_chunk_size", "mamba_expand",
              None),
    "jamba": (None, None, "mamba_d_state", None, None, "mamba_expand", "mamba_dt_rank"),
}


def _shrink_ssm(d: dict, *, hidden: int, hidden_new: int) -> None:
    """Mamba mixers: heads of HEAD_DIM channels filling expand x hidden, at most 2 groups, a state of at most 16,
    scan chunks of 8 (so the default prompts span several), dt rank scaled with the hidden size."""
    fields = SSM_FIELDS.get(d.get("model_type"))
    if fields is None:
        return
    heads, head_dim, state, groups, chunk, expand, rank = fields
    d["hidden_size"] = hidden_new
    if heads:
        d[head_dim] = HEAD_DIM
        d[heads] = int(d.get(expand) or 2) * hidden_new // HEAD_DIM
        d[groups] = min(d.get(groups) or 1, 2)
    d[state] = min(d.get(state) or 16, 16)
    if chunk:
        d[chunk] = 8
    if rank and isinstance(d.get(rank), int):
        d[rank] = max(1, -(-d[rank] * hidden_new // hidden))


def _shrink_tail(d: dict) -> dict:
    """The vocabulary, special tokens, init range and dtype of a shrunken config."""
    vocab = min(d.get("vocab_size") or MAX_VOCAB, MAX_VOCAB)
    d["vocab_size"] = vocab
    for key in ("bos_token_id", "pad_token_id", "eos_token_id"):
        value = d.get(key)
        if isinstance(value, list):
            d[key] = [v for v in value if v < vocab] or [vocab - 1]
        elif isinstance(value, int) and value >= vocab:
            d[key] = None if key == "pad_token_id" else vocab - 1 - ("bos" in key)
    if "initializer_range" in d:  # wide random weights: attention far from uniform, so mask/rotary errors show
        d["initializer_range"] = max(d["initializer_range"] or 0.0, WIDE_INIT)
    d["dtype"] = "float32"
    d.pop("torch_dtype", None)
    d.pop("quantization_config", None)
    return d


def _shrink_rope_factors(d: dict) -> None:
    """longrope's per-frequency factor lists follow the new rotary dim: evenly spaced entries of the old list,
    first and last kept (so short and long lists shrink alike)."""
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    tables = [d.get("rope_scaling"), d.get("rope_parameters")]
    tables += [v for t in list(tables) if isinstance(t, dict) for v in t.values() if isinstance(v, dict)]
    for params in (t for t in tables if isinstance(t, dict)):
        rotary = int(head_dim * params.get("partial_rotary_factor", d.get("partial_rotary_factor") or 1.0))
        m = rotary // 2
        for key in ("short_factor", "long_factor"):
            old = params.get(key)
            if isinstance(old, list) and len(old) != m and old:
                params[key] = [old[round(i * (len(old) - 1) / max(m - 1, 1))] for i in range(m)]


def shrink_config(config) -> transformers.PretrainedConfig:
    return type(config).from_dict(shrink_dict(config.to_dict()))


def save_tiny_checkpoint(source, out_dir, *, seed: int = 0) -> Path:
    """Shrink the config at `source`, build its architecture with random weights, save_pretrained to out_dir."""
    config = shrink_config(load_config(source))
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError(f"--tiny {source}: the config names no architectures")
    model_cls = getattr(transformers, archs[0], None)
    if model_cls is None:
        raise ValueError(f"--tiny {source}: transformers {transformers.__version__} has no class {archs[0]}")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_constants(model, seed=seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
