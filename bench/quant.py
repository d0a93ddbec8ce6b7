"""GGUF kept quantized vs dequantized to float32: the embedded default (SmolLM2-135M-Instruct, Q4_1 + Q8_0),
batch-1 greedy decode and peak memory, both in this one run.

    python bench/quant.py [--decode-tokens 64] [--decode-repeat 7] [--threads 2] [--quick]

(1) batch-1 decode, ms per token: zoo with the file's blocks kept (`zoo run`'s default: block kernels, fused
    step) vs zoo with the file dequantized to float32 (`--dtype float32`), sampled in turn --decode-repeat
    times; the verdict is the median of the per-pair ratios (each pair sees the same machine). Goal <= 0.5.
    Also the floor of each, the time to read its weights once at the bandwidth measured in between
    (torch.sum over 1 GiB): the blocks are 4.6x fewer bytes, so the quantized path is bound by its kernels'
    arithmetic before the memory (dequantizing in registers, float32 accumulation).
(2) peak RSS (ru_maxrss) of a process that loads the model and generates 16 tokens, above a bare process that
    imports torch and transformers, against the GGUF file's size; quantized and float32, each in its own
    child process. Goal (quantized) <= 3x the file.
(3) greedy tokens of the two on the decode prompt: equal (the blocks compute float32 math on the dequantized
    values, in another summation order).
When bench/llamacpp.py (issue 18) provides `decode_ms(path)`, llama.cpp's batch-1 decode of the same file is a
row of (1), sampled in turn with the other two (goal: quantized within 1.2x of it).
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from generate import bandwidth_gbs, median, weight_bytes, zoo_decode_ms  # noqa: E402
from zoo import LLM  # noqa: E402
from zoo.default_model import default_model_path  # noqa: E402
from zoo.table import print_table  # noqa: E402

GOALS = {"decode": 0.5, "rss": 3.0, "llamacpp": 1.2}
CHILD = """
import os, resource, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch, transformers  # the bare process's imports, then the model
torch.set_num_threads(int(sys.argv[2]))
if sys.argv[1] != "bare":
    from zoo import LLM, SamplingParams
    llm = LLM(quantization="gguf" if sys.argv[1] == "quantized" else None, dtype="float32")
    llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def peak_rss(kind: str, threads: int) -> int:
    """Bytes of peak RSS of a child process: "bare" (torch + transformers imported), "quantized", "float32"."""
    done = subprocess.run([sys.executable, "-c", CHILD, kind, str(threads)], capture_output=True, text=True,
                          cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    if done.returncode:
        raise RuntimeError(f"the {kind} child failed:\n{done.stderr[-2000:]}")
    return int(done.stdout.strip().splitlines()[-1])


def llamacpp_decode():
    """bench/llamacpp.py's decode_ms(path) -> ms/token, when that module (issue 18) is present; else None."""
    try:
        import llamacpp  # noqa: F401
    except ImportError:
        return None
    return getattr(llamacpp, "decode_ms", None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="two samples, 16 tokens, no RSS: a smoke test")
    args = ap.parse_args(argv)
    if args.quick:
        args.decode_repeat, args.decode_tokens = 2, 16
    torch.set_num_threads(args.threads)
    say = lambda m: print(f"[bench] {m}", file=sys.stderr, flush=True)  # noqa: E731
    load_start = os.getloadavg()
    path = default_model_path()

    say("loading zoo twice: the GGUF kept quantized, and dequantized to float32")
    q = LLM(quantization="gguf", enable_prefix_caching=False)
    f = LLM(dtype="float32", enable_prefix_caching=False)
    prompt = q.apply_chat_template([{"role": "user", "content": "Tell me about the history of Paris."}])
    zoo_decode_ms(q, prompt, 4), zoo_decode_ms(f, prompt, 4)  # warm-up: KV pool pages, kernels' scratch
    cpp = llamacpp_decode()

    say(f"(1) batch-1 decode, {args.decode_tokens} tokens, x{args.decode_repeat}, in turn")
    q_ms, f_ms, c_ms, gbs = [], [], [], []
    for _ in range(args.decode_repeat):
        gbs.append(bandwidth_gbs())
        ms, q_tokens = zoo_decode_ms(q, prompt, args.decode_tokens)
        q_ms.append(ms)
        ms, f_tokens = zoo_decode_ms(f, prompt, args.decode_tokens)
        f_ms.append(ms)
        if cpp is not None:
            c_ms.append(cpp(path))
    ratios = [a / b for a, b in zip(q_ms, f_ms)]
    qb, fb = weight_bytes(q.model), weight_bytes(f.model)
    floor = lambda b: b / (median(gbs) * 1e9) * 1000  # noqa: E731
    decode_ok = median(ratios) <= GOALS["decode"]

    rows = [("decode ms/token, quantized", f"{median(q_ms):.2f}", f"{median(ratios):.2f}x float32 "
             f"(pairs: {', '.join(f'{r:.2f}' for r in ratios)})", f"<= {GOALS['decode']}x",
             "met" if decode_ok else "NOT met"),
            ("decode ms/token, float32", f"{median(f_ms):.2f}", "1.00x", "", ""),
            ("weights read per token, quantized", f"{qb / 1e6:.1f} MB", f"floor {floor(qb):.2f} ms", "", ""),
            ("weights read per token, float32", f"{fb / 1e6:.1f} MB", f"floor {floor(fb):.2f} ms", "", "")]
    if c_ms:
        c_ratio = median(q_ms) / median(c_ms)
        rows.insert(2, ("decode ms/token, llama.cpp (same file)", f"{median(c_ms):.2f}",
                        f"quantized {c_ratio:.2f}x llama.cpp", f"<= {GOALS['llamacpp']}x",
                        "met" if c_ratio <= GOALS["llamacpp"] else "NOT met"))
    else:
        rows.insert(2, ("decode ms/token, llama.cpp (same file)", "-", "bench/llamacpp.py not present", "", ""))
    same = q_tokens == f_tokens
    rows.append(("greedy tokens quantized == float32", str(same), "", "equal", "met" if same else "NOT met"))
    if not args.quick:
        say("(2) peak RSS: bare, quantized, float32 (a child process each)")
        bare, qr, fr = peak_rss("bare", args.threads), peak_rss("quantized", args.threads), \
            peak_rss("float32", args.threads)
        size = path.stat().st_size
        rows += [(f"peak RSS above bare torch+transformers ({bare / 1e6:.0f} MB), quantized", f"{(qr - bare) / 1e6:.0f} MB",
                  f"{(qr - bare) / size:.2f}x the GGUF ({size / 1e6:.0f} MB)", f"<= {GOALS['rss']}x",
                  "met" if (qr - bare) / size <= GOALS["rss"] else "NOT met"),
                 ("peak RSS above bare, float32", f"{(fr - bare) / 1e6:.0f} MB", f"{(fr - bare) / size:.2f}x the GGUF",
                  "", "")]
    print(f"SmolLM2-135M-Instruct {path.name}, {args.threads} threads; load average {load_start[0]:.1f} at the "
          f"start, {os.getloadavg()[0]:.1f} at the end")
    print_table(("measure", "value", "ratio", "goal", "verdict"), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
