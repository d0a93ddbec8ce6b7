"""Cold start: the README's first command (`zoo run --prompt ...`, an 8-token answer) beside `python -c "import
torch"`, each in a fresh process, rounds interleaved (warm page cache and zoo cache: the first round warms both and
is not counted); wall time and peak RSS of each, and the ratio per round.

    python bench/coldstart.py [--rounds 5] [--max-tokens 8]

Peak RSS is compared with what the run must hold: the weights as `zoo run` loads them (a GGUF kept quantized), the KV
pool the engine allocated (address space: only the pages a run writes become resident) and the interpreter with
torch imported (the anchor's own peak RSS). Both run with the same
interpreter and 2 threads; the load average is printed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

PROMPT = "What is the capital of France?"


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of one child process."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return wall, usage.ru_maxrss / 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")  # this checkout's zoo
    zoo = [sys.executable, "-m", "zoo.cli", "run", "--prompt", PROMPT, "--max-tokens", str(args.max_tokens)]
    torch_only = [sys.executable, "-c", "import torch"]
    load_start = os.getloadavg()
    timed(zoo, env), timed(torch_only, env)  # warm-up round: page cache, kernels and GGUF caches
    rounds = [(timed(zoo, env), timed(torch_only, env)) for _ in range(args.rounds)]
    load_end = os.getloadavg()

    import torch

    from zoo import LLM
    from zoo.table import print_table

    llm = LLM(quantization="auto")  # what the run holds (as zoo run loads it: a GGUF kept quantized): weights, KV pool
    held = {t.data_ptr(): t for t in (*llm.model.parameters(), *llm.model.buffers())}
    weights = sum(t.numel() * t.element_size() for t in held.values()) / 1e6
    pool = sum(t.numel() * t.element_size() for t in llm.engine.runner.kv_caches.values()) / 1e6
    med = statistics.median
    zoo_wall, torch_wall = med(z[0] for z, _ in rounds), med(t[0] for _, t in rounds)
    zoo_rss, torch_rss = med(z[1] for z, _ in rounds), med(t[1] for _, t in rounds)
    ratios = [z[0] / t[0] for z, t in rounds]
    print(f"\n`zoo run --prompt {PROMPT!r} --max-tokens {args.max_tokens}` (embedded SmolLM2-135M, warm caches) vs "
          f"`python -c 'import torch'`, {args.rounds} interleaved rounds; torch {torch.__version__}; load average "
          f"{load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end ({os.cpu_count()} cores)\n")
    print_table(["", "zoo run", "import torch", "ratio (median of rounds)", "rounds", "target"], [
        ("wall s", f"{zoo_wall:.2f}", f"{torch_wall:.2f}", f"{med(ratios):.2f}x",
         f"{min(ratios):.2f}-{max(ratios):.2f}x", "<= 2x"),
        ("peak RSS MB", f"{zoo_rss:.0f}", f"{torch_rss:.0f}", f"{zoo_rss / torch_rss:.2f}x", "", ""),
    ])
    budget = weights + pool + torch_rss
    print(f"\npeak RSS {zoo_rss:.0f} MB vs weights {weights:.0f} MB + KV pool {pool:.0f} MB + interpreter with torch "
          f"{torch_rss:.0f} MB = {budget:.0f} MB: {zoo_rss / budget:.2f}x (target <= 1x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
