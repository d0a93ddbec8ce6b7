"""Serving benchmark: `zoo serve` (a real process, the default model) driven by the `openai` client at 1, 8 and
32 concurrent streaming clients, beside the same work through LLM.stream in this process.

    python bench/serve.py [--levels 1,8,32] [--requests-per-client 2] [--new-tokens 64] [--quick]

Each level: C clients, each sending R requests one after another (prompts of 32..128 tokens from plain English,
sent as token ids, N new tokens, greedy, EOS ignored). Offline, the same requests run as waves of C through
LLM.stream (C at a time, as C clients keep C requests in flight). Reported per level, server beside offline:
output tok/s, time to first token and inter-token latency percentiles (p50 / p90 / p99; client-side for the
server: the arrival of the SSE chunk), and the server's overhead as a ratio of throughputs (offline / server).
The client runs on the same machine as the server (its JSON parsing shares the cores). Greedy texts are
compared; every mismatch is reported. --quick: levels 1,2, 8 new tokens, a smoke test of the script.
Structured outputs: at each level the server's requests again held to a JSON schema (vLLM's guided_json: an
array of 12 strings of 16 to 60 characters, longer than N tokens, so every request runs its N tokens constrained;
without minLength the model closed it in ~45 tokens, and a shorter request's prefill weighs more per token), and
the cost per token of the constraint as a ratio of throughputs (unconstrained / structured; goal <= 1.1x) and of
the median inter-token latencies. The warm-up sends a structured request first: the engine's grammar compiler
(xgrammar's tokenizer info for SmolLM2's 49k tokens: 3-4 s on 2 busy cores) and a schema's grammar are built once
per server and spec, not per token.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from generate import corpus_ids  # noqa: E402 - bench/generate.py, beside this file
from zoo import LLM, SamplingParams  # noqa: E402
from zoo.table import print_table  # noqa: E402


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    ids = corpus_ids(tokenizer)
    out = []
    for i in range(n):
        length = 32 + (96 * i) // max(n - 1, 1)
        start = (i * 53) % (len(ids) - length)  # distinct windows
        out.append(ids[start:start + length])
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def start_server(max_num_seqs: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "zoo.cli", "serve", "--port", "0", "--max-num-seqs",
                             str(max_num_seqs)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = None
    for line in proc.stderr:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        raise SystemExit("zoo serve did not start")
    threading.Thread(target=lambda: [sys.stderr.write(x) for x in proc.stderr], daemon=True).start()
    return proc, url


SCHEMA = {"type": "object", "properties": {"facts": {"type": "array", "items": {"type": "string", "minLength": 16,
                                                                                "maxLength": 60},
                                                      "minItems": 12, "maxItems": 12}}, "required": ["facts"]}


async def serve_level(url: str, model: str, prompts: list[list[int]], clients: int, new_tokens: int,
                      schema: dict | None = None):
    import openai

    per_client = [prompts[i::clients] for i in range(clients)]
    ttft, itl, texts, tokens = [], [], {}, 0

    async def client(aclient, mine):
        nonlocal tokens
        for p in mine:
            t0 = time.perf_counter()
            last, text = None, ""
            stream = await aclient.completions.create(
                model=model, prompt=p, max_tokens=new_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, **({"guided_json": schema} if schema else {})})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    (itl.append(now - last) if last is not None else ttft.append(now - t0))
                    last = now
                    text += chunk.choices[0].text
                if chunk.usage:
                    tokens += chunk.usage.completion_tokens
            texts[tuple(p)] = text

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as aclient:
        t = time.perf_counter()
        await asyncio.gather(*(client(aclient, mine) for mine in per_client))
        wall = time.perf_counter() - t
    return tokens / wall, ttft, itl, texts


def offline_level(llm: LLM, prompts: list[list[int]], clients: int, new_tokens: int):
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    ttft, itl, texts, tokens = [], [], {}, 0
    t = time.perf_counter()
    for w in range(0, len(prompts), clients):
        wave = prompts[w:w + clients]
        t0, last = time.perf_counter(), {}
        for out in llm.stream(wave, params):
            now = time.perf_counter()
            if out.delta_text:
                (itl.append(now - last[out.request_id]) if out.request_id in last else ttft.append(now - t0))
                last[out.request_id] = now
            if out.finished:
                tokens += len(out.token_ids)
                texts[tuple(out.prompt_token_ids)] = out.text
    return tokens / (time.perf_counter() - t), ttft, itl, texts


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    levels = [1, 2] if args.quick else [int(x) for x in args.levels.split(",")]
    new_tokens = 8 if args.quick else args.new_tokens
    proc, url = start_server(max(levels))
    try:
        llm = LLM(max_num_seqs=max(levels))
        model = llm.files.name
        warm = prompts_for(llm.tokenizer, 2)
        offline_level(llm, warm, 2, 4)
        asyncio.run(serve_level(url, model, warm, 2, 4))
        asyncio.run(serve_level(url, model, warm, 2, 4, SCHEMA))  # (the engine's grammar compiler and this schema,
        # built once per server and spec: not a per-token cost)
        rows, structured, mismatches = [], [], 0
        for c in levels:
            prompts = prompts_for(llm.tokenizer, c * args.requests_per_client)
            s_rate, s_ttft, s_itl, s_texts = asyncio.run(serve_level(url, model, prompts, c, new_tokens))
            o_rate, o_ttft, o_itl, o_texts = offline_level(llm, prompts, c, new_tokens)
            mismatches += sum(s_texts[k] != o_texts[k] for k in o_texts)
            ms = lambda v: "/".join(f"{pct(v, q) * 1000:.0f}" for q in (0.5, 0.9, 0.99))  # noqa: E731
            rows.append([c, len(prompts), f"{s_rate:.1f}", f"{o_rate:.1f}", f"{o_rate / s_rate:.2f}x",
                         ms(s_ttft), ms(o_ttft), ms(s_itl), ms(o_itl)])
            j_rate, j_ttft, j_itl, j_texts = asyncio.run(serve_level(url, model, prompts, c, new_tokens, SCHEMA))
            if not all(t.startswith('{"facts"') for t in j_texts.values()):
                raise SystemExit(f"a structured reply is not the schema's JSON: {list(j_texts.values())!r}")
            structured.append([c, f"{s_rate:.1f}", f"{j_rate:.1f}", f"{s_rate / j_rate:.2f}x",
                               f"{pct(j_itl, 0.5) / pct(s_itl, 0.5):.2f}x", ms(s_ttft), ms(j_ttft), ms(s_itl),
                               ms(j_itl)])
        print(f"zoo serve vs LLM.stream, {model}, {new_tokens} new tokens per request, greedy; "
              f"load average {os.getloadavg()[0]:.1f}")
        print_table(["clients", "requests", "server tok/s", "offline tok/s", "overhead (offline/server)",
                     "server TTFT ms p50/90/99", "offline TTFT ms", "server ITL ms p50/90/99", "offline ITL ms"],
                    rows)
        print(f"greedy texts: {mismatches} mismatches between the server and LLM.stream")
        print("structured outputs (guided_json, xgrammar), the same requests through the server:")
        print_table(["clients", "unconstrained tok/s", "structured tok/s", "cost per token (goal <= 1.1x)",
                     "ITL p50 ratio", "unconstrained TTFT ms p50/90/99", "structured TTFT ms",
                     "unconstrained ITL ms p50/90/99", "structured ITL ms"], structured)
        return 1 if mismatches else 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
