"""Qwen2-VL: Qwen2's decoder with M-RoPE, and its own vision transformer (zoo/layers/qwen2_vision.py).

Shape legend:
    T = tokens of the step    H = hidden size    A = 3 position axes (temporal, height, width)
    P = patches of one image    K = values of one patch    m = spatial merge size    L = prompt tokens

Images only (video is out of scope). An image's P / m^2 merged patch features replace its <|image_pad|>
placeholders (as LLaVA's do, plugins/llava.py). Positions are three axes (`mrope_positions`, computed once per
request by the runtime): text advances all three by one per token; the tokens of an image with a merged grid
of (t, h', w') sit at (start + t_i, start + h_i, start + w_i), and the text after it resumes at start +
max(h', w'); `delta` = the largest prompt position + 1 - L, and a token at context position p >= L
(generated) sits at p + delta on every axis.

Module names are transformers' in-memory names (model.visual.*, model.language_model.*, lm_head); the
checkpoints (the hub's and what 5.24's save_pretrained writes) hold visual.* and model.{embed_tokens,
layers, norm}.*.
"""
from __future__ import annotations

import torch
from torch import nn

from loader.rules import Rename, Rules, Shard
from plugins.llama import LLAMA_RULES, head_dim_of, validate as validate_text
from plugins.llava import MultimodalEmbedding, multimodal_tensor_parallel
from plugins.qwen2 import Qwen2DecoderLayer, Qwen2Model
from registry import ArchSpec, get_registry, hookimpl
from zoo.layers.embedding import LMHead
from zoo.layers.mrope import MRotaryEmbedding
from zoo.layers.qwen2_vision import Qwen2VisionTransformer
from zoo.layers.rotary import get_rope, rope_parameters
from zoo.layers.vision import vision_activation
from zoo.runtime.batch import ForwardBatch

QWEN2_VL_RULES = LLAMA_RULES + Rules(renames=(
    Rename("^visual.", "model.visual."),
    Rename("^model.embed_tokens.", "model.language_model.embed_tokens."),
    Rename("^model.layers.", "model.language_model.layers."),
    Rename("^model.norm.", "model.language_model.norm."),
))


# transformers' Qwen2VLRotaryEmbedding takes this when rope_parameters names no mrope_section (Qwen2-VL's own
# 2B / 7B / 72B sections of head_dim 128; Qwen2VLConfig() saves none)
MROPE_SECTION_DEFAULT = (16, 24, 24)


def mrope_parameters(config, layer_type: str | None = None) -> dict:
    """The text config's rope parameters with transformers' default mrope_section where it gives none."""
    params = rope_parameters(config, layer_type)
    params["mrope_section"] = list(params.get("mrope_section") or MROPE_SECTION_DEFAULT)
    return params


class Qwen2VLDecoderLayer(Qwen2DecoderLayer):
    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Qwen2: M-RoPE, three position axes over mrope_section of the frequencies
        params = mrope_parameters(config, self.layer_type(config, layer_idx))
        rope = get_rope(head_dim=head_dim_of(config), rope_parameters=params,
                        max_position_embeddings=config.max_position_embeddings, cls=MRotaryEmbedding)
        return {**super().attention_kwargs(config, layer_idx), "rope": rope}


class Qwen2VLTextModel(MultimodalEmbedding, Qwen2Model):
    layer_class = Qwen2VLDecoderLayer


class Qwen2VLModel(nn.Module):
    def __init__(self, config, *, prefix: str = "model"):
        super().__init__()
        self.visual = Qwen2VisionTransformer(config.vision_config, parallel=getattr(config, "vision_parallel", 1))
        self.language_model = Qwen2VLTextModel(config.text_config, prefix=f"{prefix}.language_model")


class Qwen2VLForConditionalGeneration(nn.Module):
    def __init__(self, config, *, prefix: str = ""):
        super().__init__()
        self.config = config
        self.image_token_id = config.image_token_id
        self.merge = config.vision_config.spatial_merge_size
        self.model = Qwen2VLModel(config)
        tc = config.text_config
        self.lm_head = LMHead(tc.vocab_size, tc.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.mrope_positions is not None:
            positions = batch.mrope_positions  # [A, T]
        return self.model.language_model(input_ids, positions, batch)  # [T] -> [T, H]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)  # [N, H] -> [N, V]

    # -- the multimodal contract (zoo/runtime/multimodal.py) ------------------------------------------
    def split_images(self, processed) -> list[dict[str, torch.Tensor]]:
        grids = processed["image_grid_thw"]  # [N, 3]
        rows = processed["pixel_values"].split([int(g.prod()) for g in grids])  # N x [P, K]
        return [{"pixel_values": r, "image_grid_thw": g[None]} for r, g in zip(rows, grids)]

    def num_image_tokens(self, item: dict[str, torch.Tensor]) -> int:
        return int(item["image_grid_thw"].prod()) // self.merge ** 2

    def encode_images(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        grids = [tuple(int(v) for v in it["image_grid_thw"][0]) for it in items]
        patches = torch.cat([it["pixel_values"] for it in items])  # [sum P, K]
        feats = self.model.visual(patches, grids)  # [sum P / m^2, H]
        return list(feats.split([t * h * w // self.merge ** 2 for t, h, w in grids]))

    def mrope_positions(self, num_tokens: int, items) -> tuple[torch.Tensor, int]:
        """Positions [A, L] of a prompt of L tokens whose images sit at items' (offset, length), and delta."""
        parts, pos, cursor = [], 0, 0  # pos: the next text position; cursor: the next prompt index
        for item in items:
            t, h, w = (int(v) for v in item.data["image_grid_thw"][0])
            h, w = h // self.merge, w // self.merge
            n_text = item.offset - cursor
            parts.append(torch.arange(pos, pos + n_text).expand(3, -1))  # text before the image
            pos += n_text
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            parts.append(grid.flatten(1) + pos)  # [A, t * h * w]
            pos += max(h, w)
            cursor = item.offset + item.length
        parts.append(torch.arange(pos, pos + num_tokens - cursor).expand(3, -1))
        positions = torch.cat(parts, dim=1)  # [A, L]
        return positions, int(positions.max()) + 1 - num_tokens


def validate(config) -> None:
    validate_text(config.text_config)
    params = mrope_parameters(config.text_config)
    if params.get("rope_type") != "default":
        raise ValueError(f"config.text_config.rope_parameters: rope_type {params.get('rope_type')!r} with M-RoPE is "
                         f"not supported (default only)")
    section = params["mrope_section"]
    if sum(section) != head_dim_of(config.text_config) // 2 or len(section) != 3:
        given = "" if rope_parameters(config.text_config).get("mrope_section") else \
            " (none given: transformers' default for head_dim 128)"
        raise ValueError(f"config.text_config.rope_parameters.mrope_section={section}{given} must be 3 sections "
                         f"adding up to head_dim / 2 = {head_dim_of(config.text_config) // 2}")
    vision_activation(config.vision_config.hidden_act, field="config.vision_config.hidden_act")


# tensor parallelism: Qwen2's layout for the language model; the vision transformer split by heads as vLLM splits it:
# qkv's q, k and v rows each column-parallel (read part by part), fc1 and the merger's first linear column-parallel
# with their biases, proj, fc2 and the merger's second linear row-parallel (the bias added once); the patch
# embedding and the LayerNorms replicated. First, so that the text model's patterns never take a vision key.
VISION_SHARDS = (Shard(r"(^|\.)visual\.blocks\.\d+\.attn\.qkv\.(weight|bias)$", "fused",
                       parts=("column", "column", "column")),
                 Shard(r"(^|\.)visual\.(blocks\.\d+\.mlp\.fc1|merger\.mlp\.0)\.(weight|bias)$", "column"),
                 Shard(r"(^|\.)visual\.(blocks\.\d+\.(attn\.proj|mlp\.fc2)|merger\.mlp\.2)\.weight$", "row"),
                 Shard(r"(^|\.)visual\.", "replicated"))


def tensor_parallel(config, size: int):
    vc = config.vision_config
    return multimodal_tensor_parallel(config, size, {
        "vision_config.num_heads": vc.num_heads,
        "vision_config.embed_dim x mlp_ratio": int(vc.embed_dim * vc.mlp_ratio),
        "vision_config.embed_dim x spatial_merge_size^2": vc.embed_dim * vc.spatial_merge_size ** 2}, VISION_SHARDS,
        text=get_registry().specs["Qwen2ForCausalLM"])


@hookimpl
def register_architectures(register):
    register(ArchSpec(("Qwen2VLForConditionalGeneration",), "plugins.qwen2_vl:Qwen2VLForConditionalGeneration",
                      "multimodal", rules=QWEN2_VL_RULES, validate=validate, tensor_parallel=tensor_parallel))
