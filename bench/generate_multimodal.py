"""Multimodal generation benchmark: the zoo runtime against transformers' generate on one random-weight LLaVA.

    python bench/generate.py --multimodal             # CLIP-B/16-shaped tower (224 px, 196 patches), SmolLM2-135M-
                                                      # shaped Llama, 8 requests with one image each, 32 new tokens
    python bench/generate_multimodal.py --quick       # a smoke run (smaller tower and language model)

The checkpoint (random weights, built by transformers) and its processor are saved once under bench/out/; both
sides read the same files and the same images (drawn with PIL, one per request, all different). Greedy, EOS
ignored. The zoo gets the prompts as vLLM's {"prompt", "multi_modal_data"} dicts (its own preprocessing with the
checkpoint's processor, the encoder run once per image, continuous batching); transformers gets the processor's
batch (equal prompt lengths: no padding) and generates all 8 at once. Each side is timed as the best of
`--repeat` runs after a warm-up, preprocessing included on both. ratio = transformers time / zoo time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_moe import best_of  # noqa: E402  (the best of `repeat` runs after a warm-up)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(2000)]


def checkpoint(args) -> Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    path = OUT / f"llava-v{args.vision_hidden}x{args.vision_layers}-i{args.image_size}-t{args.hidden}x{args.layers}"
    if (path / "preprocessor_config.json").exists():
        return path
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vc = transformers.CLIPVisionConfig(hidden_size=args.vision_hidden, intermediate_size=4 * args.vision_hidden,
                                       num_hidden_layers=args.vision_layers, num_attention_heads=args.vision_hidden // 64,
                                       image_size=args.image_size, patch_size=args.patch)
    tc = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=args.hidden, intermediate_size=args.intermediate,
                                  num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                  num_key_value_heads=args.hidden // 192, max_position_embeddings=2048,
                                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=len(fast) - 1,
                                      tie_word_embeddings=True)
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(0)
    print(f"building {path.name} ...", file=sys.stderr)
    transformers.LlavaForConditionalGeneration(config).eval().save_pretrained(path)
    ip = CLIPImageProcessorPil(size={"shortest_edge": args.image_size},
                               crop_size={"height": args.image_size, "width": args.image_size})
    transformers.LlavaProcessor(image_processor=ip, tokenizer=fast, patch_size=args.patch,
                                vision_feature_select_strategy="default",
                                num_additional_image_tokens=1).save_pretrained(path)
    return path


def images(n: int, size: int):
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        im = Image.fromarray(rng.integers(0, 256, (size + 40, size + 20, 3), dtype=np.uint8))
        draw = ImageDraw.Draw(im)
        for _ in range(6):
            x, y = (int(v) for v in rng.integers(0, size, 2))
            draw.ellipse((x, y, x + 40, y + 30), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        out.append(im)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vision-hidden", type=int, default=768)
    ap.add_argument("--vision-layers", type=int, default=12)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="a 4-layer 256-wide tower, 8 text layers, 1 repeat")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.vision_hidden, args.vision_layers, args.layers, args.repeat = 256, 4, 8, 1

    import transformers

    from zoo import LLM, SamplingParams
    from zoo.runtime.multimodal import EncoderCache

    path = checkpoint(args)
    text = "w1 w2 <image> w3 w4 w5 w6 w7 w8 w9 w10"
    pics = images(args.requests, args.image_size)
    # no prefix caching and a fresh encoder cache per run: each timed run encodes its images and prefills anew
    llm = LLM(str(path), dtype="float32", block_size=16, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    processor = transformers.AutoProcessor.from_pretrained(path)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None

    def zoo_run():
        mm = llm.engine.mm
        mm.cache = EncoderCache(mm.cache.budget)
        mm.encoder_runs = 0
        requests = [{"prompt": text, "multi_modal_data": {"image": im}} for im in pics]
        return [list(o.token_ids) for o in llm.generate(requests, params)]

    def hf_run():
        inputs = processor(text=[text] * len(pics), images=pics, return_tensors="pt")
        with torch.inference_mode():
            out = ref.generate(**inputs, max_new_tokens=args.new, do_sample=False, pad_token_id=0)
        return out[:, inputs["input_ids"].shape[1]:].tolist()

    n_img = (args.image_size // args.patch) ** 2
    print(f"LLaVA, random weights, float32, {torch.get_num_threads()} threads: CLIP tower {args.vision_hidden} x "
          f"{args.vision_layers} layers ({n_img} patches of {args.image_size} px images), Llama {args.hidden} x "
          f"{args.layers} layers; {args.requests} requests with one image each, {args.new} new tokens each")
    t_zoo, ours = best_of(zoo_run, args.repeat)
    t_hf, theirs = best_of(hf_run, args.repeat)
    new_tokens = args.requests * args.new
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"{'engine':<14} {'seconds':>8} {'tok/s':>8} {'ratio':>6}")
    print(f"{'zoo':<14} {t_zoo:8.3f} {new_tokens / t_zoo:8.1f} {'1.00':>6}")
    print(f"{'transformers':<14} {t_hf:8.3f} {new_tokens / t_hf:8.1f} {t_hf / t_zoo:6.2f}")
    print(f"same greedy tokens: {same}/{len(ours)}; zoo encoder runs {llm.engine.mm.encoder_runs} "
          f"(cache hits {llm.engine.mm.cache.hits}); last step {llm.engine.runner.last_timings}")
    return 0 if same == len(ours) else 1


if __name__ == "__main__":
    raise SystemExit(main())
