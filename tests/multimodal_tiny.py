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
