"""MoE generation benchmark: the zoo runtime against transformers' generate, on one random-weight Mixtral.

    python bench/generate_moe.py                      # 8 experts top-2, hidden 1024, expert MLP 2048, 8 layers
    python bench/generate_moe.py --layers 2 --quick   # a smoke run

The checkpoint is built by transformers with random weights and saved once under bench/out/ (both sides
read the same files). Workloads, greedy, `--new` tokens each, EOS ignored:
    1 x P     one prompt of `--prompt` tokens
    B x P     `--batch` prompts of `--prompt` tokens at once (equal lengths: transformers needs no padding)
    R ragged  R prompts of P/4 .. P tokens at once, for each R of `--ragged` (transformers: left-padded with a
              mask); 16 ragged is the dense family's ragged workload (bench/generate.py (1): 16 requests). At 1
              and 4 rows a step of either engine reads nearly the same expert weights and zoo's is near the
              memory's speed, so the ratio there is bounded by how far transformers is from that floor
Rows: the zoo (zoo.LLM: paged KV, continuous batching, grouped expert dispatch) and transformers with its
default experts implementation and with "eager"; each timed as the best of `--repeat` runs after a warm-up.
ratio = transformers time / zoo time (above 1: the zoo is faster). `same tokens` compares greedy outputs
with the zoo's (float32 random weights: routing ties can make a long continuation drift; where
transformers' two experts implementations part from each other too, a line under the workload says on how many).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


def checkpoint(args) -> Path:
    import transformers

    path = OUT / f"mixtral-e{args.experts}k{args.top_k}-h{args.hidden}-i{args.intermediate}-l{args.layers}"
    if (path / "config.json").exists():
        return path
    config = transformers.MixtralConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 256,
        num_local_experts=args.experts, num_experts_per_tok=args.top_k, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)
    config.architectures = ["MixtralForCausalLM"]
    torch.manual_seed(0)
    print(f"building {path.name} ...", file=sys.stderr)
    transformers.MixtralForCausalLM(config).eval().save_pretrained(path)
    return path


def best_of(fn, repeat: int) -> tuple[float, object]:
    fn()  # warm-up
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def ragged_lengths(prompt: int, batch: int) -> list[int]:
    """`batch` prompt lengths from `prompt` down to prompt / 4 (the first is the single prompt's)."""
    return [round(prompt / 4 + (prompt - prompt / 4) * i / max(batch - 1, 1)) for i in range(batch)][::-1]


def experts_table(path: Path, workloads: list[tuple[str, list[list[int]]]], new: int, repeat: int) -> None:
    """Print one row per workload and engine: the zoo (float32, greedy, EOS ignored) and transformers' generate
    with its default experts implementation and with "eager" (left-padded with a mask), each the best of
    `repeat` runs after a warm-up; ratio = transformers time / zoo time; same tokens against the zoo's."""
    import transformers

    from zoo import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", block_size=16)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    refs = {}
    for impl in ("default", "eager"):
        kw = {} if impl == "default" else {"experts_implementation": "eager"}
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
        ref.generation_config.eos_token_id = None
        refs[f"transformers ({ref.config._experts_implementation} experts)"] = ref

    def zoo_run(batch):
        return lambda: [list(o.token_ids) for o in llm.generate(batch, params)]

    def hf_run(ref, batch):
        longest = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in batch])  # [B, S] left-padded
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])

        def run():
            with torch.inference_mode():
                out = ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
            return out[:, longest:].tolist()
        return run

    width = max(16, *(len(name) + 1 for name, _ in workloads))
    print(f"{'workload':<{width}} {'engine':<36} {'seconds':>8} {'tok/s':>8} {'ratio':>6}  same tokens")
    for name, batch in workloads:
        new_tokens = len(batch) * new
        t_zoo, ours = best_of(zoo_run(batch), repeat)
        print(f"{name:<{width}} {'zoo':<36} {t_zoo:8.3f} {new_tokens / t_zoo:8.1f} {'1.00':>6}", flush=True)
        outs = []
        for label, ref in refs.items():
            t, theirs = best_of(hf_run(ref, batch), repeat)
            outs.append(theirs)
            same = sum(a == b for a, b in zip(ours, theirs))
            print(f"{name:<{width}} {label:<36} {t:8.3f} {new_tokens / t:8.1f} {t / t_zoo:6.2f}  {same}/{len(ours)}",
                  flush=True)
        apart = sum(a != b for a, b in zip(*outs))
        if apart:  # a routing tie that float32's summation order decides (the docstring)
            print(f"{'':<{width}} (transformers' two experts implementations part from each other on {apart})")
    print(f"load average {os.getloadavg()[0]:.2f} at the end (2 cores)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ragged", type=int, nargs="+", default=[4, 16], help="ragged workloads: prompts in each")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="hidden 256, expert MLP 512, 16 new tokens, 1 repeat")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.hidden, args.intermediate, args.new, args.repeat = 256, 512, 16, 1

    path = checkpoint(args)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 32000, (max(args.batch, *args.ragged), args.prompt), generator=g)  # [B, P]
    print(f"Mixtral, random weights, float32, {torch.get_num_threads()} threads: {args.experts} experts top-"
          f"{args.top_k}, hidden {args.hidden}, expert MLP {args.intermediate}, {args.layers} layers; "
          f"{args.new} new tokens per prompt")
    ragged = [[p[:n].tolist() for p, n in zip(prompts, ragged_lengths(args.prompt, r))] for r in args.ragged]
    experts_table(path, [(f"1 x {args.prompt}", prompts[:1].tolist()),
                         (f"{args.batch} x {args.prompt}", prompts[:args.batch].tolist()),
                         *((f"{len(b)} ragged {len(b[-1])}..{len(b[0])}", b) for b in ragged)], args.new, args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
