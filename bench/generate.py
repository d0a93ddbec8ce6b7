"""Generation benchmark: zoo's runtime vs transformers on SmolLM2-135M-Instruct (the embedded GGUF, dequantised),
float32, greedy, 2 torch threads. Both run in this one process, on the same prompts, one after the other.

    python bench/generate.py [--requests 16] [--new-tokens 64] [--repeat 5] [--decode-repeat 5] [--quick]
    python bench/generate.py --python-step [--dtype float32|bfloat16|auto] [--decode-repeat 5]   # (6) alone
    python bench/generate.py --multimodal [options]   # a random-weight LLaVA, 8 requests with one image each,
                                    # vs transformers, see bench/generate_multimodal.py
    python bench/generate.py --moe [bench/generate_moe.py's options]   # the MoE case: a random-weight
                                    # Mixtral (8 experts, top-2) vs transformers, see bench/generate_moe.py
    python bench/generate.py --mla [bench/generate_mla.py's options]   # the MLA case: a random-weight
                                    # DeepSeek-V3 (latent attention, MoE) vs transformers, see bench/generate_mla.py
    python bench/generate.py --hybrid [bench/generate_hybrid.py's options]   # a random-weight Bamba (~116M)

(1) ragged batch: R requests, prompts of 16..256 tokens, N new tokens each (EOS ignored): zoo (continuous
    batching, paged KV, prefix caching off) vs transformers' generate on the left-padded batch; output tok/s.
(2) batch-1 decode, ms per token: zoo vs transformers vs the floor, the time to read every weight once at
    the read bandwidth measured here (torch.sum over 1 GiB). The three are sampled in turn, --decode-repeat times;
    each zoo sample is compared with the floor measured just before it (the machine's load moves the
    bandwidth by 2x), and the median of those ratios is the verdict (the ratio of the medians is shown too).
(3) the R prompts one at a time (each alone, N new tokens): total output tok/s, zoo vs transformers.
(4) prefill: the R prompts with one new token, in one batch; real prompt tokens per second (transformers
    computes the padded batch: that is what a ragged batch costs it).
(5) zoo's per-step CPU overhead at batch R (decode steps of (1)): the step's wall time minus the model's
    forward and logits, i.e. scheduling, metadata, sampling, bookkeeping and detokenisation.
(6) Python per decode step at batch 1: LLM.generate of one prompt, each decode step's wall time (engine.step)
    minus the seconds of the one native call that runs the model (runner.last_timings["native"]: forward and
    head, and on the fast step the argmax), i.e. every line of Python the step runs (scheduler, metadata, the
    call's marshalling, sampling, bookkeeping, detokenisation). The fast step (runner.fast, the default) and the
    general path (runner.fast = False: plan, fused.run, the Sampler) alternate, --decode-repeat rounds each,
    after one round each to warm up; medians of every decode step. Each is also shown as a share of its step:
    absolute times move with the machine's load (a 2-core box shared with other jobs), the shares less.
The zoo side runs as `zoo run` would: native kernels on unless ZOO_FAST=0 (then the torch reference path).
(1) and (4) run --repeat rounds, each round zoo then transformers on the same work; the verdict is the median of
the rounds' ratios (the two runs of a round see the same machine: its memory bandwidth and neighbours change
by 1.5x within minutes here), and the ratio of the median throughputs is shown too. A warm-up round of (1)
on both sides comes first (first use of the KV pool's memory, allocator growth). (3) runs once.
--quick: no warm-up round, one run of each and (3) on 4 prompts, a smoke test of the script (its ratios mean
little).
Greedy outputs are compared with transformers' and every mismatch is reported. The machine may be
shared: the load average is printed with the results.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

from zoo import LLM, SamplingParams, kernels  # noqa: E402
from zoo.default_model import default_model_path  # noqa: E402
from zoo.table import print_table  # noqa: E402

GOALS = {"batch": 3.0, "floor": 0.70, "serial": 2.5, "prefill": 0.9, "overhead": 0.10, "python_ms": 0.3}


def corpus_ids(tokenizer) -> list[int]:
    """Plain English from the standard library's module docstrings (offline, deterministic)."""
    import argparse as a, collections, doctest, email, logging, unittest  # noqa: E401

    text = "\n\n".join(m.__doc__ for m in (a, doctest, logging, unittest, email, collections))
    return tokenizer.encode(text)


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    ids = corpus_ids(tokenizer)
    lengths = [round(16 + (256 - 16) * i / max(n - 1, 1)) for i in range(n)]
    out = []
    for i, length in enumerate(lengths):
        start = (i * 37) % (len(ids) - length)  # distinct windows: no shared prefixes
        out.append(ids[start:start + length])
    return out


def bandwidth_gbs() -> float:
    x = torch.ones(1 << 28)  # 1 GiB of float32
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    del x
    return (1 << 30) / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class StepTimer:
    """Wraps engine.step to record (wall seconds, the runner's last_timings) of every step."""

    def __init__(self, llm: LLM):
        self.engine, self.records = llm.engine, []
        self._step = llm.engine.step
        llm.engine.step = self

    def __call__(self, **kwargs):
        t = time.perf_counter()
        outs = self._step(**kwargs)
        self.records.append((time.perf_counter() - t, dict(self.engine.runner.last_timings)))
        return outs


def zoo_batch(llm: LLM, prompts, new_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t, [o.token_ids for o in outs]


def hf_batch(ref, tokenizer, prompts, new_tokens: int):
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])  # [R, S] left-padded
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.no_grad():
        g = ref.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=pad)
    return time.perf_counter() - t, g[:, longest:].tolist()


def zoo_decode_ms(llm: LLM, prompt, n: int):
    stamps, tokens = [], []
    for out in llm.stream([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
        stamps.append(time.perf_counter())
        tokens = out.token_ids
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000, tokens


def hf_decode_ms(ref, prompt, n: int):
    ids = torch.tensor([prompt])
    times = {}
    for k in (1, n):
        t = time.perf_counter()
        with torch.no_grad():
            g = ref.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
        times[k] = time.perf_counter() - t
    return (times[n] - times[1]) / (n - 1) * 1000, g[0, len(prompt):].tolist()


def python_per_step(llm: LLM, timer: StepTimer, prompt, n: int, rounds: int) -> dict[bool, list[tuple[float, float]]]:
    """(6): {fast: [(step seconds, Python seconds)] of every batch-1 decode step}, fast and general rounds in turn."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    runner, out = llm.engine.runner, {True: [], False: []}
    try:
        for i in range(2 * (rounds + 1)):
            runner.fast = i % 2 == 0
            timer.records.clear()
            llm.generate([prompt], params)
            if i >= 2:  # (a round of each first: warm-up)
                out[runner.fast] += [(w, w - t["native"]) for w, t in timer.records
                                     if t.get("requests") == t.get("tokens") == 1 and "native" in t]
    finally:
        runner.fast = True
    return out


def python_step_only(args) -> int:
    """--python-step: (6) alone, on the embedded model in --dtype, with the machine's load."""
    load_start = os.getloadavg()
    llm = LLM(dtype=None if args.dtype == "auto" else args.dtype, enable_prefix_caching=False)
    timer = StepTimer(llm)
    prompt = make_prompts(llm.tokenizer, args.requests)[0]
    steps = python_per_step(llm, timer, prompt, args.decode_tokens, args.decode_repeat)
    if not steps[True] or not steps[False]:
        print("(6) not measured: the steps did not run the fused native step (ZOO_FAST=0?)")
        return 1
    print(f"SmolLM2-135M-Instruct ({args.dtype}), batch 1, {len(prompt)}-token prompt, {args.decode_tokens} tokens, "
          f"x{args.decode_repeat} rounds per path, torch threads = {args.threads}; load average "
          f"{load_start[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    for fast in (False, True):
        v = steps[fast]
        step, py = median([w for w, _ in v]) * 1000, median([p for _, p in v]) * 1000
        print(f"(6) {'fast step   ' if fast else 'general path'}: step {step:.2f} ms, Python {py:.3f} ms = "
              f"{median([p / w for w, p in v]):.2%} of the step (mean {statistics.mean(p for _, p in v) * 1000:.3f} "
              f"ms; {len(v)} decode steps)")
    ratio = median([p for _, p in steps[True]]) / median([p for _, p in steps[False]])
    print(f"(6) Python fast / general {ratio:.2f}x; goal < {GOALS['python_ms']} ms: "
          f"{verdict(median([p for _, p in steps[True]]) * 1000 < GOALS['python_ms'])}")
    return 0


def median(xs):
    return statistics.median(xs)


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--multimodal" in argv:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import generate_multimodal

        return generate_multimodal.main([a for a in argv if a != "--multimodal"])
    if "--moe" in argv:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import generate_moe

        return generate_moe.main([a for a in argv if a != "--moe"])
    if "--mla" in argv:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import generate_mla

        return generate_mla.main([a for a in argv if a != "--mla"])
    if "--hybrid" in argv:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import generate_hybrid

        return generate_hybrid.main([a for a in argv if a != "--hybrid"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5, help="rounds of (1) and (4); medians are reported")
    ap.add_argument("--decode-repeat", type=int, default=5, help="samples of (2), each with its own floor")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one run each, (3) on 4 prompts: a smoke test")
    ap.add_argument("--python-step", action="store_true", help="only (6), zoo alone (no transformers)")
    ap.add_argument("--dtype", default="float32", help="zoo's model dtype for --python-step (auto: zoo run's, the "
                    "GGUF kept quantized)")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeat = args.decode_repeat = 1
    torch.set_num_threads(args.threads)
    if args.python_step:
        return python_step_only(args)
    say = lambda m: print(f"[bench] {m}", file=sys.stderr, flush=True)  # noqa: E731
    load_start = os.getloadavg()

    say("loading zoo (embedded GGUF, float32)")
    llm = LLM(dtype="float32", enable_prefix_caching=False)
    tok = llm.tokenizer
    say("loading transformers from the same GGUF")
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None

    prompts = make_prompts(tok, args.requests)
    n_prompt = sum(len(p) for p in prompts)
    say("warm-up" + ("" if args.quick else f": a round of (1)"))
    warm = prompts[:2] if args.quick else prompts
    zoo_batch(llm, warm, 2 if args.quick else args.new_tokens)
    hf_batch(ref, tok, warm, 2 if args.quick else args.new_tokens)
    timer = StepTimer(llm)

    say(f"(1) {args.requests} requests, prompts {len(prompts[0])}..{len(prompts[-1])} tokens, "
        f"{args.new_tokens} new tokens each, x{args.repeat}")
    zoo_s, hf_s = [], []
    for _ in range(args.repeat):
        timer.records.clear()
        s, zoo_out = zoo_batch(llm, prompts, args.new_tokens)
        zoo_s.append(s)
        s, hf_out = hf_batch(ref, tok, prompts, args.new_tokens)
        hf_s.append(s)
    steps = [t for t in timer.records if t[1].get("requests") == t[1].get("tokens") == args.requests]  # decode
    mismatches = [(i, first_mismatch(a, b)) for i, (a, b) in enumerate(zip(zoo_out, hf_out))
                  if first_mismatch(a, b) is not None]
    n_out = args.requests * args.new_tokens

    say(f"(2) batch-1 decode, {args.decode_tokens} tokens, x{args.decode_repeat}, bandwidth sampled in between")
    short = prompts[0]
    zoo_ms, hf_ms, gbs = [], [], []
    for _ in range(args.decode_repeat):
        gbs.append(bandwidth_gbs())
        ms, zoo_b1 = zoo_decode_ms(llm, short, args.decode_tokens)
        zoo_ms.append(ms)
        ms, hf_b1 = hf_decode_ms(ref, short, args.decode_tokens)
        hf_ms.append(ms)
    wbytes = weight_bytes(llm.model)
    floor_ms = wbytes / (median(gbs) * 1e9) * 1000
    floor_ratios = [wbytes / (g * 1e9) * 1000 / ms for g, ms in zip(gbs, zoo_ms)]  # per sample: floor / zoo

    serial = prompts if not args.quick else prompts[:: max(1, len(prompts) // 4)]
    say(f"(3) {len(serial)} prompts one at a time, {args.new_tokens} new tokens each")
    zoo_serial = hf_serial = 0.0
    serial_mismatch = []
    for i, p in enumerate(serial):
        s, (a,) = zoo_batch(llm, [p], args.new_tokens)
        zoo_serial += s
        s, (b,) = hf_batch(ref, tok, [p], args.new_tokens)
        hf_serial += s
        if first_mismatch(a, b) is not None:
            serial_mismatch.append((i, first_mismatch(a, b)))

    say(f"(4) prefill of the {args.requests} prompts ({n_prompt} tokens), one new token, x{args.repeat}")
    zoo_pf, hf_pf, pf_mismatch = [], [], 0
    for _ in range(args.repeat):
        s, a = zoo_batch(llm, prompts, 1)
        zoo_pf.append(s)
        s, b = hf_batch(ref, tok, prompts, 1)
        hf_pf.append(s)
        pf_mismatch = sum(x != y for x, y in zip(a, b))

    say(f"(6) Python per batch-1 decode step: fast step and general path in turn, {args.decode_tokens} tokens, "
        f"x{args.decode_repeat}")
    py_steps = python_per_step(llm, timer, short, args.decode_tokens, args.decode_repeat)
    py = {fast: (median([w for w, _ in v]) * 1000, median([p for _, p in v]) * 1000, median([p / w for w, p in v]))
          if v else None for fast, v in py_steps.items()}  # (step ms, Python ms, Python / step)

    load_end = os.getloadavg()
    step_ms = median([w for w, _ in steps]) * 1000 if steps else float("nan")
    model_ms = median([t["forward"] + t["logits"] for _, t in steps]) * 1000 if steps else float("nan")
    parts = {k: median([t[k] for _, t in steps]) * 1000 for k in ("prepare", "sample")} if steps else {}
    overhead_ms = step_ms - model_ms

    zoo_tps, hf_tps = n_out / median(zoo_s), n_out / median(hf_s)
    batch_rounds = [h / z for z, h in zip(zoo_s, hf_s)]  # per round: transformers time / zoo time
    prefill_rounds = [h / z for z, h in zip(zoo_pf, hf_pf)]
    n_serial = len(serial) * args.new_tokens
    zoo_pf_tps, hf_pf_tps = n_prompt / median(zoo_pf), n_prompt / median(hf_pf)
    zb1, hb1 = median(zoo_ms), median(hf_ms)
    ratios = {
        "batch": median(batch_rounds),
        "floor": median(floor_ratios),
        "serial": hf_serial / zoo_serial,
        "prefill": median(prefill_rounds),
        "overhead": overhead_ms / step_ms,
    }

    print(f"\nSmolLM2-135M-Instruct (GGUF Q4_1 dequantised), float32, greedy, torch threads = {args.threads}, "
          f"torch {torch.__version__}, zoo kernels {'on' if kernels.enabled() else 'off'}")
    print(f"weights {wbytes / 1e6:.0f} MB; read bandwidth (torch.sum over 1 GiB) median {median(gbs):.1f} GB/s "
          f"(samples {', '.join(f'{g:.1f}' for g in gbs)}); load average {load_start[0]:.2f} at the start, "
          f"{load_end[0]:.2f} at the end (2 cores)\n")
    print_table(["goal", "zoo", "transformers", "anchor", "ratio", "target", "verdict"], [
        (f"(1) output tok/s, {args.requests} ragged requests x {args.new_tokens}", f"{zoo_tps:.1f}",
         f"{hf_tps:.1f}", "transformers", f"{ratios['batch']:.2f}x", f">= {GOALS['batch']}x",
         verdict(ratios["batch"] >= GOALS["batch"] and not mismatches)),
        ("(2) batch-1 decode ms/token", f"{zb1:.1f}", f"{hb1:.1f}", f"floor {floor_ms:.1f} ms",
         f"{ratios['floor']:.0%} of floor speed", f">= {GOALS['floor']:.0%}",
         verdict(ratios["floor"] >= GOALS["floor"])),
        (f"(3) output tok/s, {len(serial)} prompts one at a time", f"{n_serial / zoo_serial:.1f}",
         f"{n_serial / hf_serial:.1f}", "transformers", f"{ratios['serial']:.2f}x", f">= {GOALS['serial']}x",
         verdict(ratios["serial"] >= GOALS["serial"])),
        (f"(4) prefill prompt tok/s, {args.requests} prompts", f"{zoo_pf_tps:.0f}", f"{hf_pf_tps:.0f}", "transformers",
         f"{ratios['prefill']:.2f}x", f">= {GOALS['prefill']}x", verdict(ratios["prefill"] >= GOALS["prefill"])),
        (f"(5) runtime CPU overhead per decode step, batch {args.requests}", f"{overhead_ms:.2f} ms", "",
         f"step {step_ms:.1f} ms", f"{ratios['overhead']:.1%} of the step", f"< {GOALS['overhead']:.0%}",
         verdict(ratios["overhead"] < GOALS["overhead"])),
        *([("(6) Python per decode step, batch 1", f"{py[True][1]:.3f} ms", "",
            f"general path {py[False][1]:.3f} ms", f"{py[True][2]:.2%} of the step (general {py[False][2]:.2%})",
            f"< {GOALS['python_ms']} ms", verdict(py[True][1] < GOALS["python_ms"]))]
          if py[True] and py[False] else []),
    ])
    print(f"\n(1) rounds: zoo {', '.join(f'{n_out / s:.1f}' for s in zoo_s)} tok/s; transformers "
          f"{', '.join(f'{n_out / s:.1f}' for s in hf_s)} tok/s; ratio per round "
          f"{', '.join(f'{r:.2f}x' for r in batch_rounds)} (ratio of the medians {zoo_tps / hf_tps:.2f}x)")
    print(f"(4) rounds: zoo {', '.join(f'{n_prompt / s:.0f}' for s in zoo_pf)} tok/s; transformers "
          f"{', '.join(f'{n_prompt / s:.0f}' for s in hf_pf)} tok/s; ratio per round "
          f"{', '.join(f'{r:.2f}x' for r in prefill_rounds)} (ratio of the medians {zoo_pf_tps / hf_pf_tps:.2f}x)")
    print(f"(2) runs: zoo {', '.join(f'{m:.1f}' for m in zoo_ms)} ms; transformers "
          f"{', '.join(f'{m:.1f}' for m in hf_ms)} ms; transformers / zoo {hb1 / zb1:.2f}x; floor / zoo per run "
          f"{', '.join(f'{r:.0%}' for r in floor_ratios)} (ratio of the medians {floor_ms / zb1:.0%})")
    if parts:
        print(f"(5) median decode step at batch {args.requests} ({len(steps)} steps): {step_ms:.1f} ms = model "
              f"{model_ms:.1f} ms (forward + logits) + overhead {overhead_ms:.2f} ms, of which metadata "
              f"{parts['prepare']:.2f} ms, sampling {parts['sample']:.2f} ms, scheduler/bookkeeping/detokenizer "
              f"{overhead_ms - parts['prepare'] - parts['sample']:.2f} ms")
    if py[True] and py[False]:
        print(f"(6) batch-1 decode steps (median of {len(py_steps[True])} / {len(py_steps[False])}): fast step "
              f"{py[True][0]:.1f} ms of which Python {py[True][1]:.3f} ms; general path {py[False][0]:.1f} ms of "
              f"which Python {py[False][1]:.3f} ms; Python fast / general {py[True][1] / py[False][1]:.2f}x")
    else:
        print("(6) not measured: the steps did not run the fused native step (ZOO_FAST=0?)")
    print(f"\n(1) greedy outputs equal to transformers': {args.requests - len(mismatches)}/{args.requests}")
    for i, pos in mismatches:
        print(f"    request {i} (prompt {len(prompts[i])} tokens): first difference at output token {pos}: "
              f"zoo {zoo_out[i][pos:pos + 3]} vs transformers {hf_out[i][pos:pos + 3]}")
    b1 = first_mismatch(zoo_b1, hf_b1)
    print(f"(2) batch-1 greedy output equal to transformers': {'yes' if b1 is None else f'no, from token {b1}'}")
    print(f"(3) one-at-a-time greedy outputs equal: {len(serial) - len(serial_mismatch)}/{len(serial)}"
          + "".join(f"; prompt {i} differs from token {p}" for i, p in serial_mismatch))
    print(f"(4) first tokens equal: {args.requests - pf_mismatch}/{args.requests}")
    return 0 if not mismatches and b1 is None and not serial_mismatch and not pf_mismatch else 1


if __name__ == "__main__":
    sys.exit(main())
