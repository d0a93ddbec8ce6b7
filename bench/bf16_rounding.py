"""Which bfloat16 rounding parts greedy decoding from float32, and whether zoo's bfloat16 adds error of its own:
transformers float32 on the embedded SmolLM2-135M GGUF, 16 ragged prompts, greedy, with only the named parts rounded
to bfloat16 (float32 arithmetic everywhere else: tests/rounded_reference.py), each against the unrounded float32
model; then zoo's `--dtype bfloat16` (the fused step: bfloat16 weights and KV cache) against the same.

    python bench/bf16_rounding.py [--new 16] [--threads 1] [--prompts test|generate]
    python bench/bf16_rounding.py --sets 12    # how often 16 prompts reach 15 of 16, over 12 sets

--prompts: tests/test_bf16.py's (8 .. 113 tokens, the default) or bench/generate.py's (16 .. 256 tokens).

Greedy: per variant the prompts equal throughout, and per parting (prompt length, token index, how far float32's
top logit led the rounded model's token there). The KV variants round k (after the rotation) and v to bfloat16 as
zoo's bfloat16 cache stores them (the current token's too: zoo's attention reads them back from the cache).
The thread count changes torch's float32 sums, which alone can flip the closest ties (runs on the test's prompts gave
k and v alone 15 or 16 of 16 and all of it 12 to 14, by thread count and run): compare variants within one run.

Teacher-forced (after the greedy table): over every position of the prompts plus float32's greedy tokens, the rms
difference of the log-probabilities of float32's top 20 tokens from float32's, per variant and for zoo (as
tests/test_bf16.py bounds it); then zoo against the variant with its exact rounding, beside that variant run with
transformers' eager attention instead of sdpa (rounding k and v turns float32's last-bit differences into whole
bfloat16 steps: how far two float32 computations of the same rounded model part).

--sets K: K sets of 16 prompts with the test's lengths (set 0 the test's own, the others disjoint windows of
standard-library docstrings), each rounded with all weights, then with k and v too, and zoo's bfloat16: per set the
prompts equal throughout, then how many sets reach 15 of 16. With a few partings per 256 tokens spread at random
over the prompts, whether 16 prompts reach 15 is largely chance; this says how often the rounding alone gets there.
Then the same for a checkpoint whose weights are bfloat16 already (the hub's usual; float32 reads them exactly):
transformers float32 on the rounded weights is the reference, and only the KV cache's rounding (and the order of
float32's sums) is left to part zoo, or the exact rounding, from it.
"""
from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import unittest
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the rounded reference, shared with the test

import torch  # noqa: E402
from rounded_reference import logprobs, round_to_bf16, top_error  # noqa: E402
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


def prompt_sets(tok, k: int) -> list[list[list[int]]]:
    """Set 0: the test's prompts; sets 1 .. k - 1: the same lengths from disjoint windows of the docstrings of some
    standard-library modules and their public members."""
    import functools, inspect, json, pathlib, re, subprocess, textwrap  # noqa: E401

    docs = [d for m in (argparse, logging, unittest, collections, subprocess, re, json, textwrap, inspect, pathlib,
                        functools) for d in [m.__doc__] + [getattr(m, n).__doc__ for n in sorted(dir(m))
                                                          if not n.startswith("_")] if d]
    ids, lengths = tok.encode("\n\n".join(dict.fromkeys(docs))), range(8, 8 + 16 * 7, 7)
    step = 120  # windows of 120 tokens, the prompts at their starts: set s is the same for any k
    if (k - 1) * 16 * step > len(ids):
        raise SystemExit(f"--sets {k}: the docstrings' {len(ids)} tokens hold {len(ids) // (16 * step) + 1} sets")
    return [prompts(tok, "test")] + [[ids[((s - 1) * 16 + i) * step:((s - 1) * 16 + i) * step + n]
                                      for i, n in enumerate(lengths)] for s in range(1, k)]


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
    ap.add_argument("--sets", type=int, default=0, help="K sets of the test's lengths (see above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    sets = prompt_sets(tok, args.sets) if args.sets else [prompts(tok, args.prompts)]
    from zoo import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", enable_prefix_caching=False, max_model_len=1024)
    names = ["all weights", "all weights, k and v (zoo bfloat16)"] if args.sets else list(VARIANTS)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}

    def variant(name: str | None, attention: str = "sdpa"):  # the model with that variant's rounding (None: float32)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(original[n])
        rounded, kv = VARIANTS[name] if name else (lambda n: False, False)
        return round_to_bf16(model, rounded, kv, attention)

    reached = collections.Counter()
    native = ["all weights, k and v (zoo bfloat16) on the bf16 checkpoint", "zoo --dtype bfloat16 on the bf16 checkpoint"]
    for si, ps in enumerate(sets):
        base = greedy(variant(None), ps, args.new)
        runs = {name: greedy(variant(name), ps, args.new) for name in names}
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True))
        runs["zoo --dtype bfloat16"] = [(list(o.token_ids), None) for o in outs]
        counts = {name: partings(ps, base, [got for got, _ in run]) for name, run in runs.items()}
        if args.sets:  # also against float32 on the weights rounded (a bfloat16 checkpoint): the cache's rounding
            checkpoint = runs["all weights"]
            for name, run in zip(native, (runs["all weights, k and v (zoo bfloat16)"], runs["zoo --dtype bfloat16"])):
                counts[name] = partings(ps, checkpoint, [got for got, _ in run])
            print(f"set {si}: " + "; ".join(f"{name} {e}/16" for name, (e, _) in counts.items()), flush=True)
            reached.update(name for name, (e, _) in counts.items() if e >= 15)
            continue
        print(f"{len(ps)} prompts x {args.new} greedy tokens, against transformers float32")
        for name, (equal, parted) in counts.items():
            print(f"{name}: equal on {equal} of {len(ps)}; partings (prompt length, token, gap) {parted}")
        teacher_forced(variant, llm, [p + got for p, (got, _) in zip(ps, base)])
    if args.sets:
        print(f"sets reaching 15 of 16 ({len(sets)} sets x 16 prompts x {args.new} tokens, torch threads "
              f"{args.threads}): " + "; ".join(f"{n} {reached[n]}" for n in names + ["zoo --dtype bfloat16"] + native))


def teacher_forced(variant, llm, seqs: list[list[int]]) -> None:
    """The rms log-probability errors of the docstring's second part."""
    from zoo import SamplingParams

    want = logprobs(variant(None), seqs)
    print(f"teacher-forced, {sum(map(len, seqs))} positions: rms log-probability difference over float32's top 20")
    for name in VARIANTS:
        print(f"  {name} rounded: {top_error(want, logprobs(variant(name), seqs))[0]:.5f}")
    outs = llm.generate(seqs, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=40))
    mine = [o.prompt_logprobs for o in outs]
    print(f"  zoo --dtype bfloat16: {top_error(want, mine)[0]:.5f}")
    exact = "all weights, k and v (zoo bfloat16)"
    sdpa = logprobs(variant(exact), seqs)
    print(f"  zoo against {exact}: {top_error(sdpa, mine)[0]:.5f}; the same with eager attention against it: "
          f"{top_error(sdpa, logprobs(variant(exact, 'eager'), seqs))[0]:.5f}")


if __name__ == "__main__":
    main()
