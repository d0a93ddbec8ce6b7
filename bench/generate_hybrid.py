"""Hybrid SSM generation benchmark: the zoo runtime against transformers' generate, on one random-weight Bamba.

    python bench/generate.py --hybrid                   # ~116M parameters: hidden 768, 8 layers (attention on 2
                                                        # and 6), Mamba2 mixers of 24 heads x 64, state 64
    python bench/generate.py --hybrid --quick           # a smoke run (2 layers, 4 requests, 8 new tokens)

The checkpoint is built by transformers with random weights and saved once under bench/out/ (both sides read
the same files). Work: `--requests` prompts of ragged lengths (16 .. 128 tokens, random ids), `--new` greedy
tokens each, EOS ignored. Rows:
    zoo                          all requests at once (continuous batching, state pool, paged KV)
    transformers, padded batch   one generate on the left-padded batch (its mask zeroes the padded inputs of the
                                 mixers; their states still drift, so tokens may differ from unpadded runs)
    transformers, one at a time  each prompt alone (exact: the reference the tests hold the zoo to); --serial
ratio = transformers seconds / zoo seconds (above 1: the zoo is faster), best of `--repeat` after a warm-up,
each side on the same work in this one process; `same tokens` counts requests whose greedy tokens equal the zoo's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_moe import best_of  # noqa: E402  (the best of `repeat` runs after a warm-up)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


def checkpoint(args) -> Path:
    import transformers

    path = OUT / f"bamba-h{args.hidden}-l{args.layers}-v{args.vocab}"
    if (path / "config.json").exists():
        return path
    attn = [i for i in (2, 6) if i < args.layers] or [args.layers - 1]
    config = transformers.BambaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 256,
        attn_layer_indices=attn, mamba_n_heads=2 * args.hidden // 64, mamba_d_head=64, mamba_d_state=64,
        mamba_n_groups=1, mamba_chunk_size=64, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.05)
    config.architectures = ["BambaForCausalLM"]
    torch.manual_seed(0)
    print(f"building {path.name} ...", file=sys.stderr)
    transformers.BambaForCausalLM(config).eval().save_pretrained(path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--serial", action="store_true", help="also transformers one prompt at a time (slow)")
    ap.add_argument("--quick", action="store_true", help="2 layers, 4 requests, 8 new tokens, 1 repeat")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.layers, args.requests, args.new, args.repeat = 2, 4, 8, 1

    import transformers

    from zoo import LLM, SamplingParams

    path = checkpoint(args)
    g = torch.Generator().manual_seed(0)
    lengths = [round(16 + (128 - 16) * i / max(args.requests - 1, 1)) for i in range(args.requests)]
    prompts = [torch.randint(3, args.vocab, (n,), generator=g).tolist() for n in lengths]
    llm = LLM(str(path), dtype="float32", block_size=16, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    n_params = sum(p.numel() for p in ref.parameters())

    def zoo_run():
        return [list(o.token_ids) for o in llm.generate(prompts, params)]

    def hf_alone():
        out = []
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p])
                g = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, do_sample=False,
                                 pad_token_id=0)
                out.append(g[0, len(p):].tolist())
        return out

    def hf_padded():
        width = max(lengths)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # [R, width], left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            g = ref.generate(ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False, pad_token_id=0)
        return g[:, width:].tolist()

    print(f"Bamba, random weights ({n_params / 1e6:.0f}M parameters), float32, {torch.get_num_threads()} threads: "
          f"hidden {args.hidden}, {args.layers} layers, {args.requests} requests of {lengths[0]}..{lengths[-1]} "
          f"prompt tokens, {args.new} new tokens each")
    new_tokens = args.requests * args.new
    t_zoo, ours = best_of(zoo_run, args.repeat)
    rows = [("zoo", t_zoo, len(ours))]
    refs = [("transformers, padded batch", hf_padded)] + [("transformers, one at a time", hf_alone)] * args.serial
    for label, fn in refs:
        t, theirs = best_of(fn, args.repeat)
        rows.append((label, t, sum(a == b for a, b in zip(ours, theirs))))
    print(f"{'engine':<30} {'seconds':>8} {'tok/s':>8} {'ratio':>6}  same tokens")
    for label, t, same in rows:
        print(f"{label:<30} {t:8.3f} {new_tokens / t:8.1f} {t / t_zoo:6.2f}  {same}/{len(ours)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
