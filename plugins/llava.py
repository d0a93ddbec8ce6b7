"""LLaVA: a CLIP vision tower, a projector, and any registered dense language model (Llama, Mistral, Qwen2...).

Shape legend:
    T = tokens of the step    H = language model hidden size    V = vocab size
    N = images    F = feature rows of one image    M = placeholder rows of the step    E = vision hidden size

An image is encoded apart from the step (the runtime calls `encode_images` when a request's scheduled
tokens first reach the image, and caches the result); its F rows of [F, H] replace the embeddings of its
F placeholder tokens (`image_token_id`) when the step runs, through ForwardBatch.mm_embeds / mm_positions.

Module names are transformers' in-memory names (model.language_model.*, model.vision_tower.*,
model.multi_modal_projector.*, lm_head), so parity taps join by name; LLAVA_RULES map both checkpoint
layouts onto them: what transformers 5.24's save_pretrained writes (language_model.model.*,
language_model.lm_head, vision_tower.embeddings.*, multi_modal_projector.*) and the hub's older one, whose
CLIP tower sits under vision_tower.vision_model.*.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from loader.rules import Fuse, Ignore, Rename, Rules, Shard
from registry import ArchSpec, get_registry, hookimpl
from zoo.layers.embedding import LMHead
from zoo.layers.vision import (CLIPVisionTower, MultiModalProjector, feature_layers, select_features,
                               vision_activation)
from zoo.runtime.batch import ForwardBatch

_TOWER = r"(^|\.)vision_tower\.(vision_model\.)?"
LLAVA_RULES = Rules(
    renames=(
        Rename("^language_model.model.", "model.language_model."),
        Rename("^language_model.lm_head.", "lm_head."),
        Rename("^vision_tower.vision_model.", "model.vision_tower."),  # the hub layout
        Rename("^vision_tower.", "model.vision_tower."),  # what 5.24's save_pretrained writes
        Rename("^multi_modal_projector.", "model.multi_modal_projector."),
    ),
    fuses=(Fuse(("q_proj", "k_proj", "v_proj"), "qkv_proj"),),  # the vision attention's (the text's come with it)
    ignores=(
        Ignore(_TOWER + r"post_layernorm\.", "CLIP's post_layernorm normalises the pooled class token only, "
                                              "which LLaVA never reads"),
        Ignore(_TOWER + r"embeddings\.position_ids$", "position ids that old checkpoints saved (arange)"),
    ),
)


def text_spec(config) -> ArchSpec:
    """The registered dense architecture of config.text_config."""
    spec = get_registry().resolve(config.text_config)
    if spec.family != "dense":
        raise ValueError(f"config.text_config: {spec.architectures[0]} is a {spec.family} model; LLaVA here "
                         f"takes dense language models")
    return spec


class MultimodalEmbedding:
    """Mixed into a language model's class: `embed` puts the step's image features at their placeholders."""

    def embed(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.mm_positions is None:
            return super().embed(input_ids, batch)  # [T, H]
        if batch.mm_positions.shape[0] != batch.mm_embeds.shape[0]:
            raise ValueError(f"{batch.mm_positions.shape[0]} placeholder rows but {batch.mm_embeds.shape[0]} "
                             f"feature rows in this step")
        ids = input_ids.index_fill(0, batch.mm_positions, 0)  # placeholder ids may lie outside the vocabulary
        x = super().embed(ids, batch)  # [T, H]
        return x.index_copy(0, batch.mm_positions, batch.mm_embeds.to(x.dtype))  # [T, H]


class LlavaModel(nn.Module):
    def __init__(self, config, *, prefix: str = "model"):
        super().__init__()
        vc = config.vision_config
        self.feature_layers = feature_layers(config.vision_feature_layer, vc.num_hidden_layers)
        self.strategy = config.vision_feature_select_strategy
        parallel = getattr(config, "vision_parallel", 1)  # a rank-local config's (tensor_parallel below)
        self.vision_tower = CLIPVisionTower(vc, num_layers=max(self.feature_layers), parallel=parallel)
        self.multi_modal_projector = MultiModalProjector(
            in_features=vc.hidden_size * len(self.feature_layers), hidden_size=config.text_config.hidden_size,
            hidden_act=config.projector_hidden_act, bias=config.multimodal_projector_bias, parallel=parallel)
        base = text_spec(config).model_class().model_class  # e.g. plugins.llama.LlamaModel
        merged = type(f"Multimodal{base.__name__}", (MultimodalEmbedding, base), {})
        self.language_model = merged(config.text_config, prefix=f"{prefix}.language_model")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.language_model(input_ids, positions, batch)  # [T] -> [T, H]

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden_states = self.vision_tower(pixel_values)  # [N, 3, Hp, Wp] -> list of [N, S, E]
        features = select_features(hidden_states, self.feature_layers, self.strategy)  # [N, F, E * layers]
        return self.multi_modal_projector(features.flatten(0, 1)).view(*features.shape[:2], -1)  # [N, F, H]


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, config, *, prefix: str = ""):
        super().__init__()
        self.config = config
        self.image_token_id = config.image_token_id
        self.model = LlavaModel(config)
        tc = config.text_config
        self.lm_head = LMHead(tc.vocab_size, tc.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight
        vc, built = config.vision_config, self.model.vision_tower.num_layers
        skipped = "|".join(str(i) for i in range(built, vc.num_hidden_layers))
        self.load_rules = text_spec(config).rules + Rules(ignores=(Ignore(
            _TOWER + rf"encoder\.layers\.({skipped})\.",
            f"vision layers {built}..{vc.num_hidden_layers - 1}: past the deepest vision_feature_layer "
            f"({config.vision_feature_layer}), their output is never read"),) if skipped else ())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)  # [T] -> [T, H]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)  # [N, H] -> [N, V]

    # -- the multimodal contract (zoo/runtime/multimodal.py) ------------------------------------------
    def split_images(self, processed) -> list[dict[str, torch.Tensor]]:
        """The image processor's output for N images -> one input dict per image."""
        return [{"pixel_values": p[None]} for p in processed["pixel_values"]]  # each [1, 3, Hp, Wp]

    def num_image_tokens(self, item: dict[str, torch.Tensor]) -> int:
        """Placeholder tokens (= feature rows) of one image."""
        emb = self.model.vision_tower.embeddings
        *_, h, w = item["pixel_values"].shape
        return (h // emb.patch_size) * (w // emb.patch_size) + (self.model.strategy != "default")

    def encode_images(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One [F, H] feature tensor per image (all images of a CLIP tower have its one size)."""
        pixels = torch.cat([it["pixel_values"] for it in items])  # [N, 3, Hp, Wp]
        dtype = self.model.vision_tower.embeddings.class_embedding.dtype
        return list(self.model.image_features(pixels.to(dtype)))  # N x [F, H]


def validate(config) -> None:
    """Raise ValueError naming the config field this plugin cannot serve."""
    spec = text_spec(config)
    if spec.validate is not None:
        spec.validate(config.text_config)
    if config.vision_feature_select_strategy not in ("default", "full"):
        raise ValueError(f"config.vision_feature_select_strategy={config.vision_feature_select_strategy!r} is not "
                         f"'default' or 'full'")
    vc = config.vision_config
    if getattr(vc, "model_type", "") != "clip_vision_model":
        raise ValueError(f"config.vision_config.model_type={getattr(vc, 'model_type', None)!r}: only CLIP "
                         f"vision towers (clip_vision_model) are supported")
    feature_layers(config.vision_feature_layer, vc.num_hidden_layers)
    vision_activation(vc.hidden_act, field="config.vision_config.hidden_act")
    vision_activation(config.projector_hidden_act, field="config.projector_hidden_act")


# tensor parallelism: the CLIP tower split by heads as vLLM splits it (q / k / v and fc1 column-parallel with their
# biases, out_proj and fc2 row-parallel, the bias added once), the projector likewise (linear_1 column, linear_2
# row); embeddings and LayerNorms replicated (whole hidden states between the all-reduces). First, so that the text
# model's patterns (q_proj, k_proj...) never take a vision key.
VISION_SHARDS = (Shard(_TOWER + r".*\.self_attn\.(q_proj|k_proj|v_proj)\.(weight|bias)$", "column"),
                 Shard(_TOWER + r".*\.mlp\.fc1\.(weight|bias)$", "column"),
                 Shard(_TOWER + r".*\.(self_attn\.out_proj|mlp\.fc2)\.weight$", "row"),
                 Shard(_TOWER, "replicated"),
                 Shard(r"(^|\.)multi_modal_projector\.linear_1\.(weight|bias)$", "column"),
                 Shard(r"(^|\.)multi_modal_projector\.linear_2\.weight$", "row"))


def multimodal_tensor_parallel(config, size: int, splits: dict[str, int], shards: tuple[Shard, ...], text=None):
    """(rank-local config, Shard rules) of a multimodal model: the language model's own layout (its registered
    architecture's `tensor_parallel` on text_config; `text` another one), the vision side by `shards`, built with
    `vision_parallel` = size (each tower's layers build their share: zoo/layers/vision.py). `splits`: the fields
    (as their names) the vision side splits, each checked to divide by `size` (a ValueError naming it)."""
    for field, n in splits.items():
        if n % size:
            raise ValueError(f"config.{field}={n} does not split over tensor parallel size {size}")
    spec = text or text_spec(config)
    if spec.tensor_parallel is None:
        raise ValueError(f"config.text_config: {spec.architectures[0]} has no tensor-parallel layout "
                         f"({spec.no_tensor_parallel})")
    local = copy.deepcopy(config)
    local.text_config, text_rules = spec.tensor_parallel(config.text_config, size)
    local.vision_parallel = size
    return local, Rules(shards=shards) + text_rules


def tensor_parallel(config, size: int):
    vc = config.vision_config
    return multimodal_tensor_parallel(config, size, {
        "vision_config.num_attention_heads": vc.num_attention_heads,
        "vision_config.intermediate_size": vc.intermediate_size,
        "text_config.hidden_size (the projector's inner width)": config.text_config.hidden_size}, VISION_SHARDS)


@hookimpl
def register_architectures(register):
    register(ArchSpec(("LlavaForConditionalGeneration",), "plugins.llava:LlavaForConditionalGeneration",
                      "multimodal", rules=LLAVA_RULES, validate=validate, tensor_parallel=tensor_parallel))
