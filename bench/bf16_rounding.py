"""Which bfloat16 rounding parts greedy decoding from float32: transformers float32 on the embedded SmolLM2-135M
GGUF, 16 ragged prompts, greedy, with only the named parts rounded to bfloat16 (float32 arithmetic everywhere
else), each against the unrounded float32 model; then zoo's `--dtype bfloat16` (the fused step: bfloat16 weights and
KV cache) against the same.

    python bench/bf16_rounding.py [--new 16] [--threads 1] [--prompts test|generate]

--prompts: tests/test_bf16.py's (8 .. 113 tokens, the default) or bench/generate.py's (16 .. 256 tokens).

Prints per variant: prompts equal throughout, and per parting (prompt length, token index, how far float32's top
logit led the rounded model's token there). The KV variants round k (after the rotation) and v to bfloat16 as
zoo's bfloat16 cache stores them (the current token's too: zoo's attention reads them back from the cache).
The thread count changes torch's float32 sums, which alone can flip the closest ties (runs on the test's prompts gave
k and v alone 15 or 16 of 16 and all of it 12 to 14, by thread count and run): compare variants within one run.
"""
from __future__ import annotations

import argparse
import collections
import logging
import os
import unittest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers.models.llama.modeling_llama as modeling  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from zoo.default_model import default_model_path  # noqa: E402

VARIANTS = {  # name -> (which parameters are rounded, whether k and v are)
    "all weights": (lambda n: True, False),
    "the layers' matrices": (lambda n: "layers" in n and "norm" not in n, False),
    "the tied embedding / head": (lambda n: "embed" in n or "lm_head" in n, False),
    "the norm weights": (lambda n: "norm" in n, False),
    "k and v (the KV cache)": (lambda n: False, True),
    "all weights, k and v (zoo bfloat16)": (lambda n: True, True),
}


def prompts(tok, which: str) -> list[list[int]]:
    """16 ragged prompts from offline standard-library docstrings: tests/test_bf16.py's (8 .. 113 tokens) or
    bench/generate.py's (16 .. 256)."""
    if which == "generate":
        from generate import make_prompts
        return make_prompts(tok, 16)
    ids = tok.encode("\n\n".join(m.__doc__ for m in (argparse, logging, unittest, collections)))
    return [ids[i * 41:i * 41 + n] for i, n in enumerate(range(8, 8 + 16 * 7, 7))]


def partings(ps, base, outs) -> tuple[int, list[tuple[int, int, float]]]:
    """Prompts equal throughout, and (prompt length, token, float32's lead there) where each parts."""
    equal, parted = 0, []
    for p, (want, logits), got in zip(ps, base, outs):
        at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if at is None:
            equal += 1
        else:
            parted.append((len(p), at, round((logits[at][want[at]] - logits[at][got[at]]).item(), 4)))
    return equal, parted


def greedy(model, ps: list[list[int]], new: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    out = []
    for p in ps:
        g = model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        out.append((g.sequences[0, len(p):].tolist(), [x[0] for x in g.logits]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new", type=int, default=16, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (changes float32's sums, see above)")
    ap.add_argument("--prompts", choices=["test", "generate"], default="test")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ps = prompts(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), args.prompts)
    rope, round_kv = modeling.apply_rotary_pos_emb, [False]

    def rotated(q, k, *a, **kw):  # k as the cache stores it
        q, k = rope(q, k, *a, **kw)
        return q, k.to(torch.bfloat16).float() if round_kv[0] else k

    modeling.apply_rotary_pos_emb = rotated
    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(
            lambda mod, i, o: o.to(torch.bfloat16).float() if round_kv[0] else o)
    with torch.no_grad():
        base = greedy(model, ps, args.new)
        original = {n: p.detach().clone() for n, p in model.named_parameters()}
        print(f"{len(ps)} prompts x {args.new} greedy tokens, against transformers float32")
        for name, (rounded, kv) in VARIANTS.items():
            for n, p in model.named_parameters():
                p.copy_(original[n].to(torch.bfloat16).float() if rounded(n) else original[n])
            round_kv[0] = kv
            equal, parted = partings(ps, base, [got for got, _ in greedy(model, ps, args.new)])
            print(f"{name} rounded: equal on {equal} of {len(ps)}; partings (prompt length, token, gap) {parted}",
                  flush=True)
    from zoo import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", enable_prefix_caching=False, max_model_len=1024)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True))
    equal, parted = partings(ps, base, [list(o.token_ids) for o in outs])
    print(f"zoo --dtype bfloat16 ({llm.engine.runner.step_path}): equal on {equal} of {len(ps)}; partings {parted}")


if __name__ == "__main__":
    main()
