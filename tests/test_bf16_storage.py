"""bfloat16 on the CPU, every architecture: zoo stores the compact weights (matrices, embedding tables, expert
stacks) and the KV caches in bfloat16 and computes in float32 (zoo.build.storage_dtypes, zoo.layers.linear's
"Compact storage"). From a bfloat16 checkpoint (the hub's usual form, which float32 holds exactly) zoo then computes
what transformers float32 computes on it, except that the cache rounds what it keeps: k and v (a latent cache's
normalised latent and rope key) to bfloat16. The reference is transformers float32 with exactly that rounding
(tests/rounded_reference.cache_rounded), so what is left between them is the order of float32 sums: greedy tokens
equal, the log-probability of every generated token within TOL, on the path users run (the fused native step where
the model takes it, else the modules on the native kernels) and on the torch path (kernels off). A bfloat16
activation anywhere would part them by ~1e-2 (what rounding the cache alone, not the reference, does: measured on
DeepSeek-V3's latent, 2.4e-2).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from rounded_reference import cache_rounded
from tiny_configs import TINY_CONFIGS, save_arch
from zoo import kernels
from zoo.build import build_model
from zoo.runtime.batch import CacheSpec, StateSpec
from zoo.runtime.engine import LLMEngine
from zoo.runtime.sampling_params import SamplingParams

BF16 = torch.bfloat16
TOL = 3e-3  # |log-probability| difference per generated token (measured: <= 1e-3, most ~1e-5)
PROMPTS = [[5, 17, 99, 3, 42, 8, 77, 12, 64, 31, 9, 100, 23, 54], [11, 22, 33, 44, 55], [7, 3, 120]]
STEPS = 10
ARCHS = [a for a in TINY_CONFIGS if not a.endswith("ForConditionalGeneration")]  # (multimodal: text-only elsewhere)


def save_bf16(arch: str, path: Path) -> Path:
    """The tiny checkpoint of `arch`, every floating-point tensor saved as bfloat16."""
    path = save_arch(arch, path)
    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v.to(BF16) if v.is_floating_point() else v for k, v in tensors.items()}, f,
                  metadata={"format": "pt"})
    return path


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
        for out, prompt, seq, lp in zip(outs, PROMPTS, want, logprobs):
            assert out.token_ids == seq[len(prompt):], f"{arch} ({path_taken}) prompt {prompt}"
            got = [d[t] for t, d in zip(out.token_ids, out.logprobs)]
            ref_lp = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(out.token_ids)]
            worst = max(abs(a - b) for a, b in zip(got, ref_lp))
            assert worst <= TOL, f"{arch} ({path_taken}) prompt {prompt}: log-probabilities part by {worst:.2e}"
