"""Pipeline-parallel benchmark: a random-weight Llama (saved by transformers), one process against PP=N stages,
each step as 1, N or 2N micro-batches; greedy.

    python bench/pipeline.py [--size 2] [--hidden 512] [--layers 8] [--requests 8] [--prompt 128] [--new-tokens 32]

Two workloads, each in a fresh process per configuration (one thread per process, so the comparison is per core):
    prefill    `--requests` prompts of `--prompt` tokens, one token each: one step of requests x prompt tokens
    decode     `--requests` prompts of 8 tokens, `--new-tokens` each: steps of `--requests` tokens
The table: tokens per second against one process's; against PP=N as one micro-batch (the stages taking turns,
which is what the overlap gains: at most (M + N - 1) / M stage-steps a step instead of N, so at most N x with many
micro-batches and cores to spare); each stage's bytes read (its loader report) and peak resident memory above its
baseline, against one process's; whether the greedy tokens equal one process's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402


def measure(path: str, size: int, micro: int, least: int, args) -> dict:
    """One configuration in this (fresh) process: load, warm up, time both workloads."""
    torch.set_num_threads(1)
    from zoo import LLM, SamplingParams
    from zoo.runtime.distributed import Peak

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8192, (args.prompt,), generator=g).tolist() for _ in range(args.requests)]
    short = [p[:8] for p in prompts]
    peak = Peak()
    kw = dict(pipeline_parallel_size=size) if size > 1 else {}
    llm = LLM(path, num_blocks=args.requests * (args.prompt + args.new_tokens) // 16 + 64, block_size=16,
              max_num_batched_tokens=args.requests * args.prompt, enable_prefix_caching=False, **kw)
    if size > 1:
        llm.tp_group.micro, llm.tp_group.min_tokens = micro, least
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(short[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    first = llm.generate(prompts, one)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(short, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
    decode = time.perf_counter() - t0
    ranks = llm.tp_group.rank_stats() if size > 1 else \
        [{"rank": 0, "read_bytes": llm.load_report.bytes, "peak_bytes": peak.above_baseline()}]
    llm.close()
    return {"prefill": args.requests * args.prompt / prefill, "decode": args.requests * args.new_tokens / decode,
            "tokens": [o.token_ids for o in first + outs],
            "ranks": [{k: r[k] for k in ("rank", "read_bytes", "peak_bytes")} for r in ranks]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--measure", nargs=4, metavar=("PATH", "SIZE", "MICRO", "LEAST"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        path, size, micro, least = args.measure
        print(json.dumps(measure(path, int(size), int(micro), int(least), args)))
        return 0

    from tiny import save_tiny
    from zoo import kernels
    from zoo.runtime.pipeline import MIN_MICRO_TOKENS

    work = Path(tempfile.mkdtemp(prefix="zoo-bench-pp-"))
    path = save_tiny("LlamaForCausalLM", work / "llama", hidden_size=args.hidden, num_hidden_layers=args.layers,
                     intermediate_size=3 * args.hidden, num_attention_heads=8, num_key_value_heads=2,
                     vocab_size=8192, max_position_embeddings=1024)
    whole = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    n = args.size
    least = MIN_MICRO_TOKENS
    configs = [(1, 1, least), (n, 1, least), (n, n, least), (n, 2 * n, least), (n, n, 1)]
    runs = {}
    for size, micro, fewest in configs:
        child = subprocess.run([sys.executable, __file__, "--measure", str(path), str(size), str(micro), str(fewest),
                                *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "measure"]],
                               capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if child.returncode:
            print(child.stderr[-4000:], file=sys.stderr)
            return 1
        runs[size, micro, fewest] = json.loads(child.stdout.strip().splitlines()[-1])
    base, turns = runs[1, 1, least], runs[n, 1, least]
    print(f"random Llama: hidden {args.hidden}, {args.layers} layers (8 heads / 2 KV heads), vocab 8192, "
          f"{whole / 1e6:.1f} MB float32; prefill {args.requests} x {args.prompt} tokens, decode {args.requests} x "
          f"{args.new_tokens} tokens; one thread per process; load average {os.getloadavg()[0]:.2f}")
    machine = kernels.describe()
    print(f"cpu: {machine['cpu']} ({machine['cpu flags']}), {os.cpu_count()} cores")
    print(f"\nmicro-batches of {least} tokens or more (MIN_MICRO_TOKENS): a decode step of {args.requests} "
          f"requests stays whole unless the last row's minimum says otherwise")
    print(f"\n{'configuration':<38} {'prefill tok/s':>14} {'/ 1 proc':>9} {'/ 1 micro':>10} {'decode tok/s':>13} "
          f"{'/ 1 proc':>9} {'/ 1 micro':>10}  greedy equal")
    ok = True
    for (size, micro, fewest), r in runs.items():
        name = "one process" if size == 1 else f"PP={size}, {micro} micro-batch{'es' if micro > 1 else ''}" + \
            ("" if fewest == least else f" of >= {fewest} tokens")
        same = r["tokens"] == base["tokens"]
        ok &= same
        print(f"{name:<38} {r['prefill']:>14.0f} {r['prefill'] / base['prefill']:>9.2f} "
              f"{r['prefill'] / turns['prefill']:>10.2f} {r['decode']:>13.0f} {r['decode'] / base['decode']:>9.2f} "
              f"{r['decode'] / turns['decode']:>10.2f}  {same}")
    peak1 = base["ranks"][0]["peak_bytes"]
    print(f"\n{'stage':>5} {'bytes read / checkpoint':>24} {'peak memory MB (/ 1 proc)':>26}")
    print(f"{'all':>5} {base['ranks'][0]['read_bytes'] / whole:>24.3f} {peak1 / 1e6:>17.1f} (1.000)")
    for r in runs[n, n, least]["ranks"]:
        print(f"{r['rank']:>5} {r['read_bytes'] / whole:>24.3f} {r['peak_bytes'] / 1e6:>17.1f} "
              f"({r['peak_bytes'] / peak1:.3f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
