"""`zoo parity --tiny CONFIG`: a shrunken random-weight checkpoint with a new model's structure.

From a config.json (or a directory holding one) we keep everything that makes the architecture what
it is and shrink only sizes, so parity can run in seconds before any weights are downloaded:

  kept        architecture (a config naming none: the one registered architecture transformers' auto mappings
              give its model_type, said in a note), rope type/theta/scaling (longrope's factor lists resampled
              to the new rotary dim, evenly spaced, ends kept), partial rotary, NoPE layers, norms and eps,
              activations, biases, tied embeddings, softcapping, q/k norms, top-k and routing style, shared
              experts, MLA structure (q LoRA or not), and the head_dim x heads / hidden ratio
  layers      the first layer plus the first layer of every other kind (each layer_types / no_rope_layers
              entry, dense vs MoE): at least 2; those lists and the dense/MoE placement fields are rewritten
  heads       MHA stays MHA (4 heads), MQA stays MQA (1 KV head), GQA keeps its group size up to 4 with
              2 KV heads; head_dim 16 (query_pre_attn_scalar scaled with it)
  shrunk      hidden size (from the heads and the kept ratio), intermediate sizes (same ratio to
              hidden), experts (at most 8; DeepSeek groups kept), vocabulary (at most 256), sliding window
              (at most 8, so the default prompts cross it), MLA ranks
  vision      a multimodal config's vision tower too: 4 heads of HEAD_DIM, widths by the same ratios, patch
              size, merge size, temporal patches and channels kept; CLIP (LLaVA) keeps a layer for each distinct
              vision_feature_layer depth (signs kept: -2 is still the penultimate layer) and one after the
              deepest when the original had one (the zoo builds up to the deepest and names the rest ignores),
              images of 4 x 4 patches; Qwen2-VL keeps 2 blocks (initializer_range raised as the text's), its
              merger's output width follows the text's hidden size and the text's mrope_section (transformers'
              default [16, 24, 24] where the config has none) is rescaled to the new head_dim / 2; the special ids
              (image placeholder, vision start / end, pad) move into the shrunk vocabulary; an image processor
              for those sizes is saved with the checkpoint (the source's own, resized, when it has a
              preprocessor_config.json)
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
    """A transformers config from a directory with config.json or from a .json file (errors say what is wrong, not
    which path: `zoo parity --tiny PATH` names it)."""
    p = Path(source)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError("no config.json there")
    with open(p) as f:
        d = json.load(f, object_hook=_special_float)
    model_type = d.get("model_type")
    if not model_type:
        raise ValueError("the config has no model_type")
    try:
        cls = transformers.AutoConfig.for_model(model_type).__class__
    except ValueError as e:
        raise ValueError(f"transformers {transformers.__version__} does not know model_type "
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
    """The shrunken copy of a config dict (a multimodal config: its text_config and its vision_config)."""
    d = dict(d)
    if isinstance(d.get("text_config"), dict):
        d["text_config"] = text = shrink_dict(d["text_config"])
        if isinstance(d.get("vision_config"), dict):
            d["vision_config"] = _shrink_vision(d, dict(d["vision_config"]), text)
        _remap_special_ids(d, text)
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
    _default_mrope_section(d, head_dim)
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
    _shrink_mrope_section(d)
    _shrink_ssm(d, hidden=hidden, hidden_new=hidden_new)
    return _shrink_tail(d)


VISION_HEADS = 4
IMAGE_SIDE = 4  # CLIP: images of 4 x 4 patches
QWEN_VISION_DEPTH = 2


def feature_layers_for(layer, n: int) -> tuple[int, int | list[int]]:
    """LLaVA's vision_feature_layer (an index into the tower's hidden states: 0 the embeddings, n the last layer,
    negative from the end; or a list of them) for a tower of n layers -> (layers kept, the index or list for them).
    Each distinct selected depth keeps a layer of its own, in order; a layer follows the deepest when the original
    had layers past it; layers are added in front up to 3 (never making a selected depth deeper than it was).
    Signs are kept: -2 stays the penultimate layer, a non-negative index counts from the embeddings."""
    values = layer if isinstance(layer, list) else [layer]
    absolute = [v + n + 1 if v < 0 else v for v in values]
    if any(not 0 <= a <= n for a in absolute):
        raise ValueError(f"vision_feature_layer={layer!r} is outside a tower of {n} layers")
    depths = sorted({a for a in absolute if a > 0})
    rank = {0: 0, **{a: i + 1 for i, a in enumerate(depths)}}
    tail = int(max(absolute) < n)
    pad = max(0, min([3 - len(depths) - tail] + [a - rank[a] for a in depths]))
    n_new = len(depths) + tail + pad
    new = [rank[a] + (pad if a else 0) for a in absolute]
    out = [i if v >= 0 else i - (n_new + 1) for v, i in zip(values, new)]
    return n_new, (out if isinstance(layer, list) else out[0])


def _shrink_vision(top: dict, v: dict, text: dict) -> dict:
    """A vision tower of VISION_HEADS heads of HEAD_DIM (see the module docstring)."""
    kind = v.get("model_type")
    if kind == "clip_vision_model":
        hidden, heads = v["hidden_size"], v["num_attention_heads"]
        ratio = (hidden // heads) * heads / hidden
        v["num_attention_heads"] = min(heads, VISION_HEADS)
        v["hidden_size"] = _round8(v["num_attention_heads"] * HEAD_DIM / ratio)
        v["intermediate_size"] = _round8(v["intermediate_size"] * v["hidden_size"] / hidden)
        if v.get("projection_dim"):
            v["projection_dim"] = min(v["projection_dim"], v["hidden_size"])
        side = min(v["image_size"] // v["patch_size"], IMAGE_SIDE)
        v["image_size"] = side * v["patch_size"]
        v["num_hidden_layers"], top["vision_feature_layer"] = feature_layers_for(
            top.get("vision_feature_layer", -2), v["num_hidden_layers"])
        if "image_seq_length" in top:
            top["image_seq_length"] = side * side
    elif kind == "qwen2_vl_vision":
        v["num_heads"] = min(v["num_heads"], VISION_HEADS)
        v["embed_dim"] = v["num_heads"] * HEAD_DIM
        v["depth"] = min(v["depth"], QWEN_VISION_DEPTH)
        v["hidden_size"] = text["hidden_size"]  # the merger writes the language model's embeddings
        if "spatial_patch_size" in v:
            v["spatial_patch_size"] = v["patch_size"]
        # its own init range (0.02) leaves attention near uniform: (row, column) swapped in the vision rotary moved
        # the output 4e-4, under the tolerance; at 0.2 it moves it 0.4 (a correct tower stays at 1e-6)
        v["initializer_range"] = max(v.get("initializer_range") or 0.0, WIDE_INIT)
    else:
        raise ValueError(f"vision_config.model_type={kind!r}: the shrinker knows clip_vision_model (LLaVA) and "
                         f"qwen2_vl_vision (Qwen2-VL)")
    v["dtype"] = "float32"
    v.pop("torch_dtype", None)
    return v


def _remap_special_ids(top: dict, text: dict) -> None:
    """A multimodal config's own special ids (image placeholder, vision start / end, pad) past the shrunk
    vocabulary move to its top free ids, distinct, in their old order; its vocab_size follows the text's."""
    vocab = text["vocab_size"]
    if "vocab_size" in top:
        top["vocab_size"] = vocab
    ids = lambda value: value if isinstance(value, list) else [value]  # noqa: E731
    keys = [k for k in top if k.endswith(("_token_id", "_token_index"))]
    used = {i for k in ("bos_token_id", "eos_token_id", "pad_token_id") for i in ids(text.get(k)) if isinstance(i, int)}
    used |= {top[k] for k in keys if isinstance(top[k], int) and top[k] < vocab}
    free = (i for i in range(vocab - 1, 2, -1) if i not in used)
    moved = {}
    for old in sorted({top[k] for k in keys if isinstance(top[k], int) and top[k] >= vocab}, reverse=True):
        moved[old] = next(free)
    for k in keys:
        if isinstance(top[k], int) and top[k] in moved:
            top[k] = moved[top[k]]
    top["dtype"] = "float32"
    top.pop("torch_dtype", None)


# M-RoPE text configs whose modeling code takes a default mrope_section when the config gives none
MROPE_DEFAULTS = {"qwen2_vl_text": "plugins.qwen2_vl:MROPE_SECTION_DEFAULT"}


def _default_mrope_section(d: dict, head_dim: int) -> None:
    """A config without mrope_section gets the section transformers' modeling code defaults to (Qwen2-VL: [16, 24,
    24], made for head_dim 128), written into its rope_parameters so the shrunk one can scale it; one whose head_dim
    that default does not fit is refused, as transformers' forward would fail on it."""
    where = MROPE_DEFAULTS.get(d.get("model_type"))
    tables = [t for t in (d.get("rope_scaling"), d.get("rope_parameters")) if isinstance(t, dict)]
    if where is None or any(t.get("mrope_section") for t in tables):
        return
    import importlib

    module, name = where.split(":")
    default = list(getattr(importlib.import_module(module), name))
    if sum(default) != head_dim // 2:
        raise ValueError(f"text_config: no rope_parameters.mrope_section, and transformers' default {default} does "
                         f"not fit head_dim {head_dim} (its sections add up to head_dim / 2)")
    d["rope_parameters"] = {**(d.get("rope_parameters") or {}), "mrope_section": default}


def _shrink_mrope_section(d: dict) -> None:
    """M-RoPE's (t, h, w) sections of the rotary frequencies follow the new head_dim / 2, in proportion, each >= 1."""
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    for params in (d.get("rope_scaling"), d.get("rope_parameters")):
        old = params.get("mrope_section") if isinstance(params, dict) else None
        if not old or sum(old) == head_dim // 2:
            continue
        total, m = sum(old), head_dim // 2
        new = [max(1, int(s * m / total)) for s in old]
        for i in sorted(range(len(old)), key=lambda i: -(old[i] * m / total - int(old[i] * m / total))):
            if sum(new) >= m:
                break
            new[i] += 1
        while sum(new) > m:
            new[new.index(max(new))] -= 1
        params["mrope_section"] = new


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


def infer_architecture(config) -> tuple[str, str | None]:
    """(the architecture to build, a note when the config names none). A config without `architectures`
    (transformers' own defaults: LlavaConfig(), Qwen2VLConfig() save none) takes the one registered architecture
    that transformers' auto mappings give its model_type (the registry's model_type rule when they give none);
    none, or several, is a ValueError saying what to add."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0], None
    from transformers.models.auto import modeling_auto

    from registry import UnsupportedArchitecture, get_registry

    registry, model_type = get_registry(), config.model_type
    mapped = set()
    for name in dir(modeling_auto):
        if name.endswith("_MAPPING_NAMES") and name != "CONFIG_MAPPING_NAMES":
            value = getattr(modeling_auto, name).get(model_type)
            mapped.update(value if isinstance(value, (list, tuple)) else [value] if value else [])
    found = sorted(a for a in mapped if a in registry.specs)
    how = "the registered architecture transformers' auto mappings give it"
    if not found:
        try:
            found, how = list(registry.resolve({"model_type": model_type}).architectures[:1]), "the registry's rule"
        except UnsupportedArchitecture:
            pass
    if len(found) != 1:
        fits = f"it fits {', '.join(found)}" if found else "no registered architecture fits it"
        raise ValueError(f"the config names no architectures and model_type {model_type!r} does not tell one: {fits}; "
                         f"add \"architectures\": [...] to config.json")
    return found[0], f"the config names no architectures: built {found[0]}, {how} (model_type {model_type!r})"


def save_tiny_checkpoint(source, out_dir, *, seed: int = 0, notes: list[str] | None = None) -> Path:
    """Shrink the config at `source`, build its architecture with random weights, save_pretrained to out_dir.
    `notes`: what was inferred is appended there (an architecture the config does not name)."""
    config = shrink_config(load_config(source))
    arch, note = infer_architecture(config)
    if note is not None:
        config.architectures = [arch]
        if notes is not None:
            notes.append(note)
    model_cls = getattr(transformers, arch, None)
    if model_cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no class {arch}")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_constants(model, seed=seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    image_processor = tiny_image_processor(config, source)
    if image_processor is not None:
        image_processor.save_pretrained(out)
    return out


def tiny_image_processor(config, source=None):
    """The image processor for a shrunk multimodal config (None for a text model): the source's own
    (preprocessor_config.json beside its config, through AutoImageProcessor: its mean, std and resampling kept)
    or transformers' default for the architecture, with the sizes set to the tiny tower's: CLIP resizes and crops
    to image_size; Qwen2-VL's pixel bounds allow 2 x 2 to 4 x 4 merged patches."""
    vc = getattr(config, "vision_config", None)
    kind = getattr(vc, "model_type", None)
    if kind not in ("clip_vision_model", "qwen2_vl_vision"):
        return None
    src = Path(source) if source is not None else None
    src = src if src is None or src.is_dir() else src.parent
    own = None
    if src is not None and (src / "preprocessor_config.json").is_file():
        own = transformers.AutoImageProcessor.from_pretrained(src)
    if kind == "clip_vision_model":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        ip = own or CLIPImageProcessorPil()
        ip.size = {"shortest_edge": vc.image_size}
        ip.crop_size = {"height": vc.image_size, "width": vc.image_size}
        return ip
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    factor = vc.patch_size * vc.spatial_merge_size
    ip = own or Qwen2VLImageProcessorPil()
    ip.patch_size, ip.temporal_patch_size, ip.merge_size = vc.patch_size, vc.temporal_patch_size, vc.spatial_merge_size
    ip.size = {"shortest_edge": (2 * factor) ** 2, "longest_edge": (4 * factor) ** 2}  # pixels, min and max
    for key in ("min_pixels", "max_pixels"):
        if getattr(ip, key, None) is not None:
            setattr(ip, key, ip.size["shortest_edge" if key == "min_pixels" else "longest_edge"])
    return ip
