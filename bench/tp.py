"""Tensor-parallel benchmark: random-weight models (saved by transformers), TP=1 vs TP=N on gloo, greedy.

    python bench/tp.py [--models dense,moe,hybrid] [--size 2] [--requests 4] [--new-tokens 32] [--hidden 512]
                       [--layers 8]

The models, each of `--hidden` and `--layers`: dense, a Llama (8 heads / 2 KV heads); moe, a Mixtral (8 experts of
intermediate size `--hidden`, top-2); hybrid, a Bamba (Mamba2 mixers of 16 heads, 2H wide, d_state 64, and one B / C
group as Bamba-9B's, so two ranks share it and its gated norm; attention on every fourth layer).

On a 2-core machine TP=2 cannot be faster (the two ranks share the cores that one process already uses), so
the table shows what matters there, and the speed-up only where there are cores (or GPUs) to spare:
    bytes read per rank      each rank's own loader report (LoadReport.bytes, its slices), as a fraction of the
                             checkpoint; the tensors split along dim 0 alone (q/k/v, gate/up, the experts' gate/up,
                             in_proj, conv1d: about 1/N, less a shared B / C group) from the plan
    peak memory per rank     each rank process's peak resident memory (VmHWM, reset before loading) above its
                             resident size before loading (the interpreter, torch): weights, KV cache, activations;
                             against the same measure of TP=1's process
    parameters per rank      bytes of rank 0's parameters (its slices) as a fraction of TP=1's
    state per request        a hybrid's recurrent state slot (conv and SSM states of every mixer) on rank 0, as a
                             fraction of TP=1's
    communication            rank 0's seconds inside collectives (all-reduce, all-gather, the per-step
                             control broadcasts) per step, as a fraction of the step; the collectives per step and
                             the bytes each all-reduce / all-gather sends from rank 0
    output tok/s             TP=N against TP=1 on the same prompts; greedy tokens compared
Each configuration runs in a fresh process (so peaks are its own); one thread per rank, TP=1 too, so the
comparison is per core.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
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
        self.real, self.seconds, self.calls, self.bytes = real, 0.0, 0, 0

    def __getattr__(self, name):
        fn = getattr(self.real, name)
        if name not in ("all_reduce", "all_gather", "broadcast_object_list"):
            return fn

        def timed(*args, **kwargs):
            sent = {"all_reduce": 0, "all_gather": 1}.get(name)  # the tensor argument rank 0 sends
            if sent is not None:
                self.bytes += args[sent].numel() * args[sent].element_size()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed


def measure(size: int, path: str, requests: int, new_tokens: int) -> dict:
    """One configuration in this (fresh) process: load, warm up, generate; what it measured."""
    torch.set_num_threads(1)
    from zoo import LLM
    from zoo.layers import parallel
    from zoo.runtime import distributed
    from zoo.runtime.distributed import Peak
    from zoo.runtime.sampling_params import SamplingParams
    from zoo.runtime.state_pool import bytes_per_request, state_specs

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8192, (int(n),), generator=g).tolist()
               for n in torch.randint(32, 128, (requests,), generator=g)]
    peak = Peak()
    llm = LLM(path, tensor_parallel_size=size, num_blocks=256, block_size=16)
    timers = []
    if size > 1:
        parallel.dist = Timed(parallel.dist)
        distributed.dist = Timed(distributed.dist)
        timers = [parallel.dist, distributed.dist]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    steps = [0]
    execute = llm.engine.runner.execute

    def counted(*args, **kwargs):
        steps[0] += 1
        return execute(*args, **kwargs)

    llm.engine.runner.execute = counted
    for t in timers:
        t.seconds = t.calls = t.bytes = 0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - t0
    comm, calls, sent = (sum(getattr(t, k) for t in timers) for k in ("seconds", "calls", "bytes"))
    for t in timers:  # the stats exchange is not part of the run
        t.seconds = 0
    ranks = llm.tp_group.rank_stats() if size > 1 else \
        [{"rank": 0, "read_bytes": llm.load_report.bytes, "peak_bytes": peak.above_baseline()}]
    param_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in llm.model.parameters()}.values())
    state_bytes = bytes_per_request(state_specs(llm.model))
    llm.close()
    return {"size": size, "tok_s": requests * new_tokens / seconds, "seconds": seconds, "steps": steps[0],
            "comm": comm, "calls": calls, "sent": sent, "tokens": [o.token_ids for o in outs],
            "param_bytes": param_bytes, "state_bytes": state_bytes,
            "ranks": [{k: r[k] for k in ("rank", "read_bytes", "peak_bytes")} for r in ranks]}


MODELS = {  # name -> (architecture, what it is, its config over tests/tiny.BASE given hidden H and L layers)
    "dense": ("LlamaForCausalLM", "Llama, 8 heads / 2 KV heads", lambda h, n: dict(
        intermediate_size=3 * h, num_attention_heads=8, num_key_value_heads=2)),
    "moe": ("MixtralForCausalLM", "Mixtral, 8 heads / 2 KV heads, 8 experts of intermediate H, top-2",
            lambda h, n: dict(intermediate_size=h, num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                              num_experts_per_tok=2)),
    "hybrid": ("BambaForCausalLM", "Bamba, Mamba2 mixers of 16 heads (2H wide) and 1 B / C group, attention (8 heads / "
               "2 KV heads) every fourth layer", lambda h, n: dict(
                   intermediate_size=3 * h, num_attention_heads=8, num_key_value_heads=2, mamba_n_heads=16,
                   mamba_d_head=2 * h // 16, mamba_expand=2, mamba_n_groups=1, mamba_d_state=64,
                   attn_layer_indices=list(range(3, n, 4)))),
}


def bench(name: str, args, work: Path) -> bool:
    """One model: TP=1 and TP=N each in a fresh process, the table printed; whether the greedy tokens agree."""
    from loader import plan_ranks
    from loader.shard import shard_dim
    from registry import get_registry
    from tiny import save_tiny
    from zoo.build import tensor_parallel_model
    from zoo.runtime.model_files import read_config

    arch, what, config_of = MODELS[name]
    path = save_tiny(arch, work / name, hidden_size=args.hidden, num_hidden_layers=args.layers, vocab_size=8192,
                     max_position_embeddings=1024, **config_of(args.hidden, args.layers))
    config = read_config(str(path), str(path))
    model, rules = tensor_parallel_model(get_registry().resolve(config), config, args.size)
    rp = plan_ranks(model, path, rules, args.size)
    assert rp.ok, rp.problems
    source = rp.plans[0].source
    whole = sum(source.info(k).nbytes for k in source.keys())
    shards = [(re.compile(s.pattern), s) for s in rules.shards]

    def dim0(key: str) -> bool:  # split along dim 0 by heads or width (not the vocabulary)
        shard = next((s for p, s in shards if p.search(key)), None)
        return shard is not None and shard.kind in ("column", "kv", "fused") and shard_dim(shard) == 0
    column = [k for k in source.keys() if dim0(k)]
    whole_column = sum(source.info(k).nbytes for k in column)

    runs = {}
    for size in (1, args.size):
        child = subprocess.run([sys.executable, __file__, "--measure", str(size), str(path), "--requests",
                                str(args.requests), "--new-tokens", str(args.new_tokens)],
                               capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if child.returncode:
            print(child.stderr[-4000:], file=sys.stderr)
            return False
        runs[size] = json.loads(child.stdout.strip().splitlines()[-1])
    one, tp = runs[1], runs[args.size]
    print(f"\n{name}: random {what}: hidden {args.hidden}, {args.layers} layers, vocab 8192, {whole / 1e6:.1f} MB "
          f"float32; {args.requests} requests x {args.new_tokens} new tokens, greedy; load average "
          f"{os.getloadavg()[0]:.2f}")
    peak1 = one["ranks"][0]["peak_bytes"]
    print(f"{'rank':>4}  {'bytes read / checkpoint':>24}  {'dim-0-split read / theirs':>26}  "
          f"{'peak memory MB (/ TP=1)':>24}")
    print(f"{'TP=1':>4}  {one['ranks'][0]['read_bytes'] / whole:>24.3f}  {1.0:>26.3f}  "
          f"{peak1 / 1e6:>15.1f} (1.000)")
    for r in tp["ranks"]:
        col = sum(e.nbytes() for e in rp.plans[r["rank"]].entries if e.key in column)
        print(f"{r['rank']:>4}  {r['read_bytes'] / whole:>24.3f}  {col / whole_column:>26.3f}  "
              f"{r['peak_bytes'] / 1e6:>15.1f} ({r['peak_bytes'] / peak1:.3f})")
        assert r["read_bytes"] == rp.bytes(r["rank"]), "a rank's loader report differs from its plan"
    print(f"parameters of rank 0 / TP=1's: {tp['param_bytes'] / one['param_bytes']:.3f}")
    if one["state_bytes"]:
        print(f"recurrent state per request on rank 0 / TP=1's: {tp['state_bytes'] / one['state_bytes']:.3f} "
              f"({tp['state_bytes'] / 1e3:.1f} of {one['state_bytes'] / 1e3:.1f} kB)")
    step_ms, comm_ms = 1e3 * tp["seconds"] / tp["steps"], 1e3 * tp["comm"] / tp["steps"]
    print(f"communication on rank 0 per step: {comm_ms:.2f} of {step_ms:.2f} ms ({comm_ms / step_ms:.1%}; "
          f"{tp['calls'] / tp['steps']:.0f} collectives, {tp['sent'] / tp['steps'] / 1e3:.1f} kB all-reduced / "
          f"gathered per step, {tp['steps']} steps)")
    print(f"output tok/s TP={args.size} / TP=1: {tp['tok_s'] / one['tok_s']:.2f}  ({tp['tok_s']:.1f} vs "
          f"{one['tok_s']:.1f})")
    same = sum(a == b for a, b in zip(one["tokens"], tp["tokens"]))
    print(f"greedy tokens equal: {same}/{args.requests}")
    return same == args.requests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"some of {', '.join(MODELS)}")
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--measure", nargs=2, metavar=("SIZE", "PATH"), help=argparse.SUPPRESS)  # a child's run
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(int(args.measure[0]), args.measure[1], args.requests, args.new_tokens)))
        return 0
    names = args.models.split(",")
    if unknown := [n for n in names if n not in MODELS]:
        ap.error(f"--models: {', '.join(unknown)}: expected some of {', '.join(MODELS)}")
    work = Path(tempfile.mkdtemp(prefix="zoo-bench-tp-"))
    print(f"TP={args.size} against TP=1 on gloo; one thread per rank, each configuration in a fresh process")
    agree = [bench(name, args, work) for name in names]
    return 0 if all(agree) else 1


if __name__ == "__main__":
    sys.exit(main())
