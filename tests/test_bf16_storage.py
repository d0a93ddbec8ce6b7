"""bfloat16 on the CPU, every architecture: zoo stores the compact weights (matrices, embedding tables, expert
stacks) and the KV caches in bfloat16 and computes in float32 (zoo.build.storage_dtypes, zoo.layers.linear's
"Compact storage"). From a bfloat16 checkpoint (the hub's usual form, which float32 holds exactly) zoo then computes
what transformers float32 computes on it, except that the cache rounds what it keeps: k and v (a latent cache's
normalised latent and rope key) to bfloat16. The reference is transformers float32 with exactly that rounding
(tests/rounded_reference.cache_rounded), so what is left between them is the order of float32 sums: greedy tokens
equal and log-probabilities as `judge` bounds them, on the path users run (the fused native step where the model takes
it, else the modules on the native kernels) and on the torch path (kernels off). The multimodal models run with images: their vision towers' matrices are bfloat16
too, and keep no cache.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from multimodal_tiny import drawn_image, qwen2_vl_inputs, random_image, save_tiny_llava, save_tiny_qwen2_vl
from rounded_reference import cache_rounded
from tiny_configs import TINY_CONFIGS, save_arch
from zoo import kernels
from zoo.build import build_model
from zoo.runtime.batch import CacheSpec, StateSpec
from zoo.runtime.engine import LLMEngine
from zoo.runtime.sampling_params import SamplingParams

BF16 = torch.bfloat16
# |log-probability| differences of the generated tokens. A sum in another order (the native kernels', another CPU's
# vector width) now and then lands one k or v value on the other side of a bfloat16 rounding step, and every later
# token of that request reads it: up to 6.6e-3 (Qwen2-VL's text request on an AVX2 machine; 2.4e-3 SmolLM3, the rest
# <= 6e-4). A rounding that is a bug (any activation rounded to bfloat16: every Linear's output planted rounded) moves
# every request's tokens: median 8.5e-4 to 0.44 over 28 architectures, where a correct model's is <= 9.4e-6. So the
# typical token is held tight and the worst loosely.
TYPICAL = 1e-4  # the median over every generated token of every prompt (~10x over the worst measured)
FLIP = 2e-2  # every token (3x over the worst flip measured)
PROMPTS = [[5, 17, 99, 3, 42, 8, 77, 12, 64, 31, 9, 100, 23, 54], [11, 22, 33, 44, 55], [7, 3, 120]]
STEPS = 10
ARCHS = [a for a in TINY_CONFIGS if not a.endswith("ForConditionalGeneration")]  # (multimodal: text-only elsewhere)


def save_bf16(arch: str, path: Path) -> Path:
    """The tiny checkpoint of `arch`, every floating-point tensor saved as bfloat16."""
    return to_bf16(save_arch(arch, path))


def to_bf16(path: Path) -> Path:
    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v.to(BF16) if v.is_floating_point() else v for k, v in tensors.items()}, f,
                  metadata={"format": "pt"})
    return path


def judge(what: str, diffs: list[float]) -> None:
    """diffs: |zoo - reference| log-probability of each generated token of each prompt."""
    typical, worst = statistics.median(diffs), max(diffs)
    assert typical <= TYPICAL and worst <= FLIP, (f"{what}: log-probabilities part by {typical:.2e} (median), "
                                                  f"{worst:.2e} (worst); bounds {TYPICAL:g}, {FLIP:g}")


def generate(model, fast: bool):
    """Greedy tokens and their log-probabilities for PROMPTS, prefill chunked at 8 tokens, blocks of 4."""
    before = kernels.set_enabled(fast)
    try:
        engine = LLMEngine(model, model.config, block_size=4, max_num_batched_tokens=8)
        params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
        ids = [engine.add_request(p, params) for p in PROMPTS]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return [done[i] for i in ids], engine.runner.step_path
    finally:
        kernels.set_enabled(before)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_storage_computes_what_float32_computes_on_the_rounded_cache(arch, tmp_path):
    path = save_bf16(arch, tmp_path)
    model, *_ = build_model(path, dtype=BF16)
    stored = {name: p.dtype for name, p in model.named_parameters()}
    compact = {name for name, p in model.named_parameters() if getattr(p, "compact", False)}
    assert compact and {stored[n] for n in compact} == {BF16}
    assert {d for n, d in stored.items() if n not in compact} <= {torch.float32}
    specs = [m.cache_spec() for m in model.modules() if callable(getattr(m, "cache_spec", None))]
    assert all(s.dtype is BF16 for s in specs if isinstance(s, CacheSpec))  # the KV / latent caches
    assert all(dtype is torch.float32 for s in specs if isinstance(s, StateSpec)
               for _, _, dtype in s.tensors)  # the SSM's conv and scan states
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    ref.generation_config.eos_token_id = None
    with cache_rounded(ref), torch.no_grad():
        want = [ref.generate(torch.tensor([p]), max_new_tokens=STEPS, do_sample=False, pad_token_id=0)[0].tolist()
                for p in PROMPTS]
        logprobs = [torch.log_softmax(ref(torch.tensor([w])).logits[0].float(), -1) for w in want]
    for fast in ([True, False] if kernels.enabled() else [False]):
        outs, path_taken = generate(model, fast)
        diffs = []
        for out, prompt, seq, lp in zip(outs, PROMPTS, want, logprobs):
            assert out.token_ids == seq[len(prompt):], f"{arch} ({path_taken}) prompt {prompt}"
            diffs += [abs(d[t] - lp[len(prompt) - 1 + j, t].item()) for j, (t, d) in
                      enumerate(zip(out.token_ids, out.logprobs))]
        judge(f"{arch} ({path_taken})", diffs)


IMAGES = [random_image(0), drawn_image(1), drawn_image(2, (30, 70))]
MULTIMODAL = {  # name -> (save, the placeholder in a prompt, processor inputs for transformers or None (its own))
    "llava": (save_tiny_llava, "<image>", None),
    "qwen2_vl": (save_tiny_qwen2_vl, "<|vision_start|> <|image_pad|> <|vision_end|>", qwen2_vl_inputs),
}


@pytest.mark.parametrize("name", list(MULTIMODAL))
def test_bf16_storage_with_images(name, tmp_path):
    """LLaVA (CLIP tower) and Qwen2-VL (its vision transformer, M-RoPE) from bfloat16 checkpoints, one and two images
    and a text-only request in one batch through the runtime: transformers float32's tokens with the language
    model's cache rounded, log-probabilities as `judge` bounds them."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from zoo import LLM, SamplingParams

    save, image, inputs_of = MULTIMODAL[name]
    path = to_bf16(save(tmp_path / name))
    prompts = [(f"user : w1 {image} w2 w3 assistant :", IMAGES[:1]),
               (f"user : {image} w4 w5 {image} w6 assistant :", IMAGES[1:]), ("user : w7 w8 w9 assistant :", [])]
    llm = LLM(str(path), dtype="bfloat16", block_size=4, max_num_batched_tokens=16)
    tower = {p.dtype for n, p in llm.model.named_parameters() if "vision" in n or "visual" in n}
    assert tower == {BF16, torch.float32}  # (its matrices; its norms, biases, patch embedding)
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": i}} if i else t for t, i in prompts],
                        SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0))
    ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ref.generation_config.eos_token_id = None
    processor = None if inputs_of else AutoProcessor.from_pretrained(path)
    diffs = []
    for (text, images), out in zip(prompts, outs):
        inputs = inputs_of(path, text, images) if inputs_of else dict(
            processor(text=[text], images=images or None, return_tensors="pt"))
        n = inputs["input_ids"].shape[1]
        with cache_rounded(ref.model.language_model), torch.no_grad():
            want = ref.generate(**inputs, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)[0]
            whole = {**inputs, "input_ids": want[None], "attention_mask": torch.ones_like(want)[None]}
            if "mm_token_type_ids" in inputs:  # (Qwen2-VL: the generated tokens are text)
                whole["mm_token_type_ids"] = torch.zeros_like(whole["input_ids"], dtype=torch.int32)
                whole["mm_token_type_ids"][:, :n] = inputs["mm_token_type_ids"]
            ref.model.rope_deltas = None  # (Qwen2-VL keeps generate's M-RoPE offsets: computed anew for this input)
            lp = torch.log_softmax(ref(**whole).logits[0].float(), -1)
        assert out.token_ids == want[n:].tolist(), f"{name}: {text}"
        diffs += [abs(d[t] - lp[n - 1 + j, t].item()) for j, (t, d) in enumerate(zip(out.token_ids, out.logprobs))]
    judge(name, diffs)
