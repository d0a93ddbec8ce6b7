"""Tiny multimodal checkpoints (saved by transformers, with a word-level tokenizer and the model's own
processor) and generated images; nothing is downloaded.

    path = save_tiny_llava(tmp_path, text="LlamaForCausalLM", vision_feature_layer=-2)
    images = [random_image(0, (40, 50)), drawn_image(1)]
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image, ImageDraw

from tiny import BASE

# 127 words + "<image>" (an added special token, id 127): vocab 128 as tiny.BASE
WORDS = ["<pad>", "<s>", "</s>", "<unk>", "user", "assistant", ":"] + [f"w{i}" for i in range(120)]
IMAGE_TOKEN_ID = len(WORDS)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} {% endif %}"
            "{% endfor %}{% endif %} {% endfor %}{% if add_generation_prompt %}assistant : {% endif %}")
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, image_size=32,
              patch_size=8, projection_dim=16)


def word_tokenizer(extra_special: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": extra_special})
    fast.chat_template = TEMPLATE
    return fast


def llava_config(text: str = "LlamaForCausalLM", vision: dict | None = None, text_overrides: dict | None = None,
                 **overrides):
    text_cls = getattr(transformers, text)
    tc = text_cls.config_class(**{**BASE, "initializer_range": 0.2, **(text_overrides or {})})
    vc = transformers.CLIPVisionConfig(**{**VISION, **(vision or {})})
    config = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=IMAGE_TOKEN_ID,
                                      **overrides)
    config.architectures = ["LlavaForConditionalGeneration"]
    return config


def save_tiny_llava(path: str | Path, *, seed: int = 0, randomize: bool = True, **kw) -> Path:
    """A random-weight LLaVA (CLIP 32x32 images, 8x8 patches: 16 or 17 feature rows) with its processor;
    `randomize`: what init leaves constant (biases, norm weights) made random too."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    path = Path(path)
    config = llava_config(**kw)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    if randomize:
        from parity.tiny import randomize_constants

        randomize_constants(model, seed=seed)
    model.save_pretrained(path)
    vc = config.vision_config
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": vc.image_size},
                                            crop_size={"height": vc.image_size, "width": vc.image_size})
    LlavaProcessor(image_processor=image_processor, tokenizer=word_tokenizer(["<image>"]), patch_size=vc.patch_size,
                   vision_feature_select_strategy=config.vision_feature_select_strategy,
                   num_additional_image_tokens=1).save_pretrained(path)
    return path


def load_reference(path: str | Path):
    return transformers.AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def random_image(seed: int, size: tuple[int, int] = (40, 50)) -> Image.Image:
    """Uniform noise, (height, width)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def drawn_image(seed: int, size: tuple[int, int] = (48, 36)) -> Image.Image:
    """A few filled shapes on a coloured background, (height, width)."""
    rng = np.random.default_rng(seed)
    h, w = size
    im = Image.new("RGB", (w, h), tuple(int(c) for c in rng.integers(0, 256, 3)))
    draw = ImageDraw.Draw(im)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, w - 4)), int(rng.integers(0, h - 4))
        box = (x0, y0, x0 + int(rng.integers(4, w)), y0 + int(rng.integers(4, h)))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    return im


QWEN_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_IMAGE_TOKEN_ID = len(WORDS) + 2
QWEN_VISION = dict(depth=2, embed_dim=32, num_heads=4, mlp_ratio=2, patch_size=4, temporal_patch_size=2,
                   spatial_merge_size=2)


def save_tiny_qwen2_vl(path: str | Path, *, seed: int = 0, randomize: bool = True, vision: dict | None = None,
                       **text_overrides) -> Path:
    """A random-weight Qwen2-VL (4x4 patches, 2x2 merge, at most 32x32 pixels: up to 16 image tokens) with its
    image processor and tokenizer (its processor class wants torchvision for videos: the runtime takes the
    image processor alone)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    tok = word_tokenizer(QWEN_SPECIAL)
    ids = tok.convert_tokens_to_ids(QWEN_SPECIAL)
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text = {**BASE, "vocab_size": len(tok), "initializer_range": 0.2, "rope_parameters": rope, **text_overrides}
    vc = {**QWEN_VISION, "hidden_size": text["hidden_size"], **(vision or {})}
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vc, vision_start_token_id=ids[0],
                                        vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3])
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    if randomize:
        from parity.tiny import randomize_constants

        randomize_constants(model, seed=seed)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                             size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32}).save_pretrained(path)
    return path


def qwen2_vl_inputs(path: str | Path, text: str, images: list) -> dict:
    """What Qwen2VLProcessor would give transformers: each <|image_pad|> expanded to its image's tokens."""
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok.encode(text)
    out = {}
    if images:
        out = dict(processor(images=images, return_tensors="pt"))
        counts = iter((g.prod() // 4).item() for g in out["image_grid_thw"])
        ids = [t for i in ids for t in ([i] * next(counts) if i == QWEN_IMAGE_TOKEN_ID else [i])]
    input_ids = torch.tensor([ids])
    return {**out, "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "mm_token_type_ids": (input_ids == QWEN_IMAGE_TOKEN_ID).int()}
