"""Generation benchmark: zoo's runtime vs transformers' `generate` on SmolLM2-135M-Instruct (the embedded
GGUF, dequantised), float32, greedy, 2 torch threads.

    python bench/generate.py [--requests 16] [--new-tokens 64] [--decode-tokens 64]

(a) throughput: R requests with prompts of 16..256 tokens, N new tokens each (EOS ignored): zoo
    (continuous batching, paged KV, prefix caching off) vs transformers on the left-padded batch.
(b) batch-1 decode, ms per token: zoo vs transformers vs the floor of reading every weight once per
    token at the memory bandwidth measured here (a read-only torch.sum over a 1 GiB tensor).
Greedy outputs are compared with transformers' and every mismatch is reported (a left-padded batch can
legitimately flip a near-tie; the report shows where). Timings on a shared machine are noisy.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

from zoo import LLM, SamplingParams  # noqa: E402
from zoo.default_model import default_model_path  # noqa: E402
from zoo.table import print_table  # noqa: E402


def corpus_ids(tokenizer) -> list[int]:
    """Plain English from the standard library's module docstrings (offline, deterministic)."""
    import argparse as a, collections, doctest, email, logging, unittest  # noqa: E401

    text = "\n\n".join(m.__doc__ for m in (a, doctest, logging, unittest, email, collections))
    return tokenizer.encode(text)


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    ids = corpus_ids(tokenizer)
    lengths = [round(16 + (256 - 16) * i / max(n - 1, 1)) for i in range(n)]
    out = []
    for i, length in enumerate(lengths):
        start = (i * 37) % (len(ids) - length)  # distinct windows: no shared prefixes
        out.append(ids[start:start + length])
    return out


def bandwidth_gbs() -> float:
    x = torch.ones(1 << 28)  # 1 GiB of float32
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    del x
    return (1 << 30) / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def zoo_batch(llm: LLM, prompts, new_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t, [o.token_ids for o in outs]


def hf_batch(ref, tokenizer, prompts, new_tokens: int):
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])  # [R, S] left-padded
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.no_grad():
        g = ref.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=pad)
    return time.perf_counter() - t, g[:, longest:].tolist()


def zoo_decode_ms(llm: LLM, prompt, n: int):
    stamps, tokens = [], []
    for out in llm.stream([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
        stamps.append(time.perf_counter())
        tokens = out.token_ids
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000, tokens


def hf_decode_ms(ref, prompt, n: int):
    ids = torch.tensor([prompt])
    times = {}
    for k in (1, n):
        t = time.perf_counter()
        with torch.no_grad():
            g = ref.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
        times[k] = time.perf_counter() - t
    return (times[n] - times[1]) / (n - 1) * 1000, g[0, len(prompt):].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    say = lambda m: print(f"[bench] {m}", file=sys.stderr, flush=True)  # noqa: E731

    say("loading zoo (embedded GGUF, float32)")
    llm = LLM(dtype="float32", enable_prefix_caching=False)
    tok = llm.tokenizer
    say("loading transformers from the same GGUF")
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None

    prompts = make_prompts(tok, args.requests)
    say("warm-up")
    zoo_batch(llm, prompts[:2], 2)
    hf_batch(ref, tok, prompts[:2], 2)

    say(f"(a) {args.requests} requests, prompts {len(prompts[0])}..{len(prompts[-1])} tokens, "
        f"{args.new_tokens} new tokens each")
    zoo_s, zoo_out = zoo_batch(llm, prompts, args.new_tokens)
    hf_s, hf_out = hf_batch(ref, tok, prompts, args.new_tokens)
    n_out = args.requests * args.new_tokens
    mismatches = [(i, first_mismatch(a, b)) for i, (a, b) in enumerate(zip(zoo_out, hf_out))
                  if first_mismatch(a, b) is not None]

    say(f"(b) batch-1 decode, {args.decode_tokens} tokens")
    short = prompts[0]
    zoo_ms, zoo_b1 = zoo_decode_ms(llm, short, args.decode_tokens)
    hf_ms, hf_b1 = hf_decode_ms(ref, short, args.decode_tokens)
    gbs = bandwidth_gbs()
    wbytes = weight_bytes(llm.model)
    floor_ms = wbytes / (gbs * 1e9) * 1000

    print(f"\nSmolLM2-135M-Instruct (GGUF Q4_1 dequantised), float32, greedy, torch threads = {args.threads}, "
          f"torch {torch.__version__}")
    print(f"weights {wbytes / 1e6:.0f} MB, measured read bandwidth {gbs:.1f} GB/s (torch.sum over 1 GiB)\n")
    print_table(["measure", "zoo", "transformers", "floor", "zoo / transformers", "zoo / floor"], [
        (f"(a) output tok/s, {args.requests} req x {args.new_tokens}", f"{n_out / zoo_s:.1f}", f"{n_out / hf_s:.1f}",
         "", f"{hf_s / zoo_s:.2f}x faster" if zoo_s < hf_s else f"{zoo_s / hf_s:.2f}x slower", ""),
        ("(b) batch-1 decode ms/token", f"{zoo_ms:.1f}", f"{hf_ms:.1f}", f"{floor_ms:.1f}",
         f"{zoo_ms / hf_ms:.2f}", f"{zoo_ms / floor_ms:.2f}"),
    ])
    print()
    print(f"(a) greedy outputs equal to transformers': {args.requests - len(mismatches)}/{args.requests}")
    for i, pos in mismatches:
        print(f"    request {i} (prompt {len(prompts[i])} tokens): first difference at output token {pos}: "
              f"zoo {zoo_out[i][pos:pos + 3]} vs transformers {hf_out[i][pos:pos + 3]}")
    b1 = first_mismatch(zoo_b1, hf_b1)
    print(f"(b) batch-1 greedy output equal to transformers': {'yes' if b1 is None else f'no, from token {b1}'}")
    return 0 if not mismatches and b1 is None else 1


if __name__ == "__main__":
    sys.exit(main())
