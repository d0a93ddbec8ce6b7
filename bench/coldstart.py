"""Cold start: the README's first command (`zoo run --prompt ...`, an 8-token answer) beside `python -c "import
torch"`, each in a fresh process, rounds interleaved (warm page cache and zoo cache: the first round warms both and
is not counted); wall time and peak RSS of each, and the ratio per round.

    python bench/coldstart.py [--rounds 5] [--max-tokens 8]
    python bench/coldstart.py --safetensors [--rounds 3] [--max-tokens 128]

--safetensors: `zoo run DIR --no-chat --prompt P --max-tokens 128 --ignore-eos` on the embedded model written once
as a float32 safetensors folder (bench/out/smollm2-135m-st: dequantised by zoo's loader, with transformers' config
and tokenizer of the GGUF) beside the transformers script a user writes (AutoTokenizer + AutoModelForCausalLM
.from_pretrained + greedy generate of 128 new tokens, EOS not stopping it, decode, print; TRANSFORMERS_SCRIPT
below), each in a fresh process, rounds interleaved; wall time per process, the ratio, and whether the texts are
equal (goal: transformers' wall >= 2x zoo's).

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
COMPLETION = "The history of the city of Paris begins"  # (--safetensors: a completion, no chat template)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
TRANSFORMERS_SCRIPT = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
path, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
model.generation_config.eos_token_id = None  # (as zoo run --ignore-eos: all n tokens)
ids = tok(prompt, return_tensors="pt")
out = model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id or 0)
print(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
"""


def timed(cmd: list[str], env: dict, out: list | None = None) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of one child process; its stdout appended to `out` when given."""
    import tempfile

    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=stdout if out is not None else subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        if os.waitstatus_to_exitcode(status) != 0:
            stderr.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed:\n{stderr.read().decode(errors='replace')[-2000:]}")
        if out is not None:
            stdout.seek(0)
            out.append(stdout.read().decode(errors="replace"))
    return wall, usage.ru_maxrss / 1024


def safetensors_dir() -> str:
    """The embedded model as a float32 safetensors folder with its config and tokenizer (written once)."""
    out = os.path.join(OUT, "smollm2-135m-st")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    import torch
    import transformers
    from safetensors.torch import save_file

    import loader
    from zoo.default_model import default_model_path

    gguf = default_model_path()
    source = loader.open_source(gguf)  # (dequantised to float32, Hugging Face names)
    os.makedirs(out, exist_ok=True)
    config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.dtype = torch.float32
    config.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    save_file({k: source.get(k).contiguous() for k in source.keys()}, os.path.join(out, "model.safetensors.tmp"),
              metadata={"format": "pt"})
    os.replace(os.path.join(out, "model.safetensors.tmp"), os.path.join(out, "model.safetensors"))
    return out


def safetensors_main(args, env: dict) -> int:
    from zoo.table import print_table

    path = safetensors_dir()
    n = str(args.max_tokens)
    zoo = [sys.executable, "-m", "zoo.cli", "run", path, "--no-chat", "--prompt", COMPLETION, "--max-tokens", n,
           "--ignore-eos"]
    hf = [sys.executable, "-c", TRANSFORMERS_SCRIPT, path, COMPLETION, n]
    env = dict(env, TRANSFORMERS_VERBOSITY="error")
    load_start = os.getloadavg()
    texts: dict[str, list[str]] = {"zoo": [], "hf": []}
    timed(zoo, env, texts["zoo"]), timed(hf, env, texts["hf"])  # warm-up round (page cache, kernels)
    rounds = [(timed(zoo, env, texts["zoo"]), timed(hf, env, texts["hf"])) for _ in range(args.rounds)]
    load_end = os.getloadavg()
    med = statistics.median
    zoo_wall, hf_wall = med(z[0] for z, _ in rounds), med(h[0] for _, h in rounds)
    ratios = [h[0] / z[0] for z, h in rounds]
    same = all(z.strip() == texts["hf"][0].strip() for z in texts["zoo"] + texts["hf"])
    print(f"\n`zoo run {os.path.relpath(path)} --no-chat --prompt {COMPLETION!r} --max-tokens {n} --ignore-eos` vs the "
          f"transformers script (from_pretrained + greedy generate {n} tokens), float32 safetensors, fresh processes, "
          f"{args.rounds} interleaved rounds; load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the "
          f"end ({os.cpu_count()} cores)\n")
    print_table(["", "zoo run", "transformers script", "transformers / zoo (median)", "rounds", "target"], [
        ("wall s", f"{zoo_wall:.2f}", f"{hf_wall:.2f}", f"{med(ratios):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}x",
         ">= 2x"),
        ("peak RSS MB", f"{med(z[1] for z, _ in rounds):.0f}", f"{med(h[1] for _, h in rounds):.0f}", "", "", ""),
    ])
    print(f"\ntexts equal: {same}" + ("" if same else f"\nzoo: {texts['zoo'][0].strip()!r}\n"
                                                    f"transformers: {texts['hf'][0].strip()!r}"))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=None, help="default 8 (128 with --safetensors)")
    ap.add_argument("--safetensors", action="store_true", help="zoo run on a safetensors folder vs the transformers "
                                                                   "script (128 greedy tokens)")
    args = ap.parse_args(argv)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")  # this checkout's zoo
    args.max_tokens = args.max_tokens or (128 if args.safetensors else 8)
    if args.safetensors:
        return safetensors_main(args, env)
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
