"""bfloat16 in every family: zoo's decode time in bfloat16 against its own float32 and against transformers' bfloat16.

    python bench/bf16_families.py                      # six families, hidden 1024, 8 layers (bench/out, built once)
    python bench/bf16_families.py --families llama deepseek --quick

On the CPU `--dtype bfloat16` stores the matrices, embedding tables, expert stacks and KV caches in bfloat16 and
computes in float32 (docs/design.md, "Precision (CPU)"): a decode step streams half the bytes, whichever path the
family takes (the fused native step, or its modules on the native kernels). Each family's checkpoint is a random
transformers model saved in bfloat16 (the hub's usual form: float32 reads it exactly), ~100-250M parameters.
Rows, per family, side by side in this one process (`--threads`, default 2):
    zoo f32 / bf16      batch-1 decode, ms per token: (time of `--new` greedy tokens - time of 1) / (new - 1),
                        best of `--repeat` after a warm-up; and a step of 8 ragged requests decoding, ms
    bf16 / f32          zoo's bfloat16 time over its float32 time (the issue's goal for decode: <= 0.65x)
    hf bf16             transformers' generate in bfloat16 on the same prompt, batch 1, ms per token the same way
    vs hf bf16          transformers bf16 time / zoo bf16 time (above 1: zoo is faster)
    same                zoo bf16's greedy tokens equal to zoo f32's on the batch-1 prompt (of `--new`; random weights
                        have near ties: tests/test_bf16_storage.py is the parity check)
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
COMMON = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
              max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              initializer_range=0.05)
FAMILIES = {  # name -> (architecture, config overrides of COMMON)
    "llama": ("LlamaForCausalLM", dict(intermediate_size=4096)),
    "gemma2": ("Gemma2ForCausalLM", dict(intermediate_size=4096, head_dim=64, sliding_window=512)),
    "mixtral": ("MixtralForCausalLM", dict(intermediate_size=2048, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2moe": ("Qwen2MoeForCausalLM", dict(intermediate_size=2816, moe_intermediate_size=1408, num_experts=8,
                                             num_experts_per_tok=2, shared_expert_intermediate_size=2816)),
    "deepseek": ("DeepseekV3ForCausalLM", dict(intermediate_size=2048, moe_intermediate_size=1024, n_shared_experts=1,
                                               n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                               first_k_dense_replace=1, kv_lora_rank=256, q_lora_rank=512,
                                               qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                                               num_key_value_heads=16, num_mtp_layers=0)),
    "bamba": ("BambaForCausalLM", dict(intermediate_size=2688, attn_layer_indices=[2, 6], mamba_n_heads=32,
                                       mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1, mamba_chunk_size=64)),
}


def checkpoint(name: str, layers: int) -> Path:
    import transformers

    arch, overrides = FAMILIES[name]
    path = OUT / f"bf16-{name}-l{layers}"
    if (path / "config.json").exists():
        return path
    config = getattr(transformers, arch).config_class(**{**COMMON, **overrides, "num_hidden_layers": layers})
    config.architectures = [arch]
    torch.manual_seed(0)
    print(f"building {path.name} ...", file=sys.stderr)
    getattr(transformers, arch)(config).eval().to(torch.bfloat16).save_pretrained(path)
    return path


def per_token(generate, new: int, repeat: int) -> tuple[float, object]:
    """(ms per token of `generate(n)` from n = 1 to `new`, best of `repeat` after a warm-up; the last output)."""
    generate(new)
    one = many = float("inf")
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        generate(1)
        one = min(one, time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = generate(new)
        many = min(many, time.perf_counter() - t0)
    return (many - one) / (new - 1) * 1000, out


def zoo_rows(path: Path, dtype: str, prompt: list[int], ragged: list[list[int]], new: int, repeat: int):
    from zoo import LLM, SamplingParams

    llm = LLM(str(path), dtype=dtype, block_size=16)

    def generate(prompts):
        return lambda n: llm.generate([{"prompt_token_ids": p} for p in prompts],
                                      SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    one, outs = per_token(generate([prompt]), new, repeat)
    step, _ = per_token(generate(ragged), max(new // 2, 2), repeat)
    return one, step, outs[0].token_ids, llm.engine.runner.step_path.split(":")[0].split(" (")[0]


def hf_row(path: Path, prompt: list[int], new: int, repeat: int) -> float:
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt])

    def generate(n):
        with torch.no_grad():
            return ref.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return per_token(generate, new, repeat)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=17)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="leave out transformers' bfloat16 row (slow on MoE)")
    ap.add_argument("--quick", action="store_true", help="2 layers, 5 new tokens, 1 repeat")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.new, args.repeat = 2, 5, 1
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 32000, (args.prompt,), generator=g).tolist()
    ragged = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in range(8, 8 + 8 * 4, 4)]
    print(f"bfloat16 vs float32, batch-1 decode ms/token and an 8-request decode step in ms; {args.threads} threads, "
          f"{args.layers} layers, prompt {args.prompt}, {args.new} new tokens; load {os.getloadavg()[0]:.2f}")
    print(f"{'family':9s} | {'zoo path':24s} | {'f32':>6s} | {'bf16':>6s} | {'bf16/f32':>8s} | {'8x f32':>6s} | "
          f"{'8x bf16':>7s} | {'8x ratio':>8s} | {'hf bf16':>7s} | {'vs hf bf16':>10s} | same")
    for name in args.families:
        path = checkpoint(name, args.layers)
        f32, f32_step, f32_tokens, _ = zoo_rows(path, "float32", prompt, ragged, args.new, args.repeat)
        bf16, bf16_step, bf16_tokens, step_path = zoo_rows(path, "bfloat16", prompt, ragged, args.new, args.repeat)
        hf = float("nan") if args.no_hf else hf_row(path, prompt, args.new, args.repeat)
        same = sum(a == b for a, b in zip(f32_tokens, bf16_tokens))
        print(f"{name:9s} | {step_path[:24]:24s} | {f32:6.1f} | {bf16:6.1f} | {bf16 / f32:7.2f}x | {f32_step:6.1f} | "
              f"{bf16_step:7.1f} | {bf16_step / f32_step:7.2f}x | {hf:7.1f} | {hf / bf16:9.2f}x | "
              f"{same}/{len(f32_tokens)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
