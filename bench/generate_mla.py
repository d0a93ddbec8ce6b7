"""MLA generation benchmark: the zoo runtime against transformers' generate, on one random-weight DeepSeek-V3.

    python bench/generate_mla.py                      # hidden 1024, 16 heads, latent 256, 8 layers, 8 experts top-2
    python bench/generate_mla.py --layers 2 --quick   # a smoke run

The checkpoint is built by transformers with random weights and saved once under bench/out/ (both sides
read the same files): DeepSeek-V3's structure at a small size, multi-head latent attention (q_lora_rank
`--q-lora`, kv_lora_rank `--latent`, nope / rope / v head dims 64 / 32 / 64), the first layer dense (MLP
`--intermediate`), the others DeepSeek MoE (`--experts` routed experts of `--moe-intermediate`, top
`--top-k`, sigmoid routing in 4 groups of which 2 are kept, one shared expert). Workloads, greedy, `--new`
tokens each, EOS ignored:
    1 x P         one prompt of `--prompt` tokens
    R ragged      R prompts of P/4 .. P tokens at once, for each R of `--ragged` (transformers: left-padded
                  with a mask; 16 ragged: the dense family's ragged workload, see bench/generate_moe.py)
Rows: the zoo (zoo.LLM: paged latent cache, absorbed decode, continuous batching) and transformers with its
default experts implementation and with "eager" (transformers caches the up-projected keys and values);
each timed as the best of `--repeat` runs after a warm-up. ratio = transformers time / zoo time (above 1:
the zoo is faster). `same tokens` compares greedy outputs with the zoo's (float32 random weights: routing
ties can make a long continuation drift; where transformers' two experts implementations part from each other
too, a line under the workload says on how many).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate_moe import experts_table, ragged_lengths  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


def checkpoint(args) -> Path:
    import transformers

    path = OUT / (f"deepseekv3-e{args.experts}k{args.top_k}-h{args.hidden}-r{args.latent}-q{args.q_lora}"
                  f"-i{args.moe_intermediate}-l{args.layers}")
    if (path / "config.json").exists():
        return path
    config = transformers.DeepseekV3Config(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64, n_shared_experts=1,
        n_routed_experts=args.experts, num_experts_per_tok=args.top_k, n_group=4, topk_group=2,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, kv_lora_rank=args.latent,
        q_lora_rank=args.q_lora, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.1, num_mtp_layers=0)
    config.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(0)
    print(f"building {path.name} ...", file=sys.stderr)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises the routing bias to zeros: make it steer the choice
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(std=0.1)
    model.save_pretrained(path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2048, help="the dense first layer's MLP")
    ap.add_argument("--moe-intermediate", type=int, default=1024)
    ap.add_argument("--latent", type=int, default=256, help="kv_lora_rank")
    ap.add_argument("--q-lora", type=int, default=512, help="q_lora_rank")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--ragged", type=int, nargs="+", default=[4, 16], help="ragged workloads: prompts in each")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="hidden 256, latent 64, 16 new tokens, 1 repeat")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.hidden, args.intermediate, args.moe_intermediate, args.latent, args.q_lora = 256, 512, 256, 64, 128
        args.new, args.repeat = 16, 1

    path = checkpoint(args)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 32000, (max(args.ragged), args.prompt), generator=g)  # [R, P]
    ragged = [[p[:n].tolist() for p, n in zip(rows, ragged_lengths(args.prompt, r))] for r in args.ragged]
    print(f"DeepSeek-V3, random weights, float32, {torch.get_num_threads()} threads: hidden {args.hidden}, "
          f"{args.hidden // 64} heads, kv_lora_rank {args.latent}, q_lora_rank {args.q_lora}, {args.layers} layers "
          f"(1 dense, MLP {args.intermediate}), {args.experts} experts top-{args.top_k} + 1 shared, expert MLP "
          f"{args.moe_intermediate}; {args.new} new tokens per prompt; load average {os.getloadavg()[0]:.2f}")
    experts_table(path, [(f"1 x {args.prompt}", rows[:1].tolist()),
                         *((f"{len(b)} ragged {len(b[-1])}..{len(b[0])}", b) for b in ragged)], args.new, args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
