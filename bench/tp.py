"""Tensor-parallel benchmark: a random-weight Llama (saved by transformers), TP=1 vs TP=N on gloo, greedy.

    python bench/tp.py [--size 2] [--requests 4] [--new-tokens 32] [--hidden 512] [--layers 8]

On a 2-core machine TP=2 cannot be faster (the two ranks share the cores that one process already uses), so
the table shows what matters there, and the speed-up only where there are cores (or GPUs) to spare:
    bytes read per rank      from the loader's plan (plan_ranks), as a fraction of the checkpoint, for all
                             tensors and for the column-parallel ones alone (q/k/v, gate/up: about 1/N)
    parameters per rank      bytes of rank 0's parameters (its slices) as a fraction of TP=1's
    communication            rank 0's seconds inside collectives (all-reduce, all-gather, the per-step
                             metadata broadcast) as a fraction of its generation time
    output tok/s             TP=N against TP=1 on the same prompts; greedy tokens compared
One thread per rank (torch.set_num_threads(1)), TP=1 too, so the comparison is per core.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402


class Timed:
    """A stand-in for torch.distributed in one module that adds up the seconds its collectives take."""

    def __init__(self, real):
        self.real, self.seconds, self.calls = real, 0.0, 0

    def __getattr__(self, name):
        fn = getattr(self.real, name)
        if name not in ("all_reduce", "all_gather", "broadcast_object_list"):
            return fn

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from loader import plan_ranks
    from registry import get_registry
    from tiny import save_tiny
    from zoo import LLM
    from zoo.build import tensor_parallel_model
    from zoo.layers import parallel
    from zoo.runtime import distributed
    from zoo.runtime.model_files import read_config
    from zoo.runtime.sampling_params import SamplingParams

    work = Path(tempfile.mkdtemp(prefix="zoo-bench-tp-"))
    path = save_tiny("LlamaForCausalLM", work / "m", hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                     num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2, vocab_size=8192,
                     max_position_embeddings=1024)
    config = read_config(str(path), str(path))
    model, rules = tensor_parallel_model(get_registry().resolve(config), config, args.size)
    rp = plan_ranks(model, path, rules, args.size)
    assert rp.ok, rp.problems
    source = rp.plans[0].source
    whole = sum(source.info(k).nbytes for k in source.keys())
    column = [k for k in source.keys() if any(s in k for s in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))]
    whole_column = sum(source.info(k).nbytes for k in column)

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8192, (int(n),), generator=g).tolist()
               for n in torch.randint(32, 128, (args.requests,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rows, tokens = [], {}
    for size in (1, args.size):
        llm = LLM(str(path), tensor_parallel_size=size, num_blocks=256, block_size=16)
        timers = []
        if size > 1:
            parallel.dist = Timed(parallel.dist)
            distributed.dist = Timed(distributed.dist)
            timers = [parallel.dist, distributed.dist]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
        for t in timers:
            t.seconds = t.calls = 0
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        tokens[size] = [o.token_ids for o in outs]
        param_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in llm.model.parameters()}.values())
        comm = sum(t.seconds for t in timers)
        rows.append((size, args.requests * args.new_tokens / seconds, param_bytes, comm / seconds,
                     sum(t.calls for t in timers)))
        llm.close()
        parallel.dist = getattr(parallel.dist, "real", parallel.dist)
        distributed.dist = getattr(distributed.dist, "real", distributed.dist)

    print(f"random Llama: hidden {args.hidden}, {args.layers} layers, 8 heads / 2 KV heads, vocab 8192, "
          f"{whole / 1e6:.1f} MB float32; {args.requests} requests x {args.new_tokens} new tokens, greedy; "
          f"one thread per rank; load average {os.getloadavg()[0]:.2f}")
    print(f"{'rank':>4}  {'bytes read / checkpoint':>24}  {'column-parallel read / theirs':>30}")
    for r in range(args.size):
        col = sum(e.nbytes() for e in rp.plans[r].entries if e.key in column)
        print(f"{r:>4}  {rp.bytes(r) / whole:>24.3f}  {col / whole_column:>30.3f}")
    (_, tps1, pb1, _, _), (_, tpsn, pbn, frac, calls) = rows
    print(f"parameters of rank 0 / TP=1's: {pbn / pb1:.3f}")
    print(f"communication on rank 0: {frac:.1%} of generation time ({calls} collectives)")
    print(f"output tok/s TP={args.size} / TP=1: {tpsn / tps1:.2f}  ({tpsn:.1f} vs {tps1:.1f})")
    same = sum(a == b for a, b in zip(tokens[1], tokens[args.size]))
    print(f"greedy tokens equal: {same}/{args.requests}")
    return 0 if same == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
