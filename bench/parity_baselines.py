"""What a correct model measures in `zoo parity`: the worst of every tolerance key, per family, against its bound.

    python bench/parity_baselines.py                       # every registered architecture's tiny checkpoint, seed 0
    python bench/parity_baselines.py --seeds 4 --wide --real

The bounds of parity/tolerances.py are set from these figures with a stated margin. Sources (all float32, every
scenario of `zoo parity`, default prompts):
    tiny     tests/tiny_configs.py's checkpoint of every registered architecture (2-4 layers, wide random init, every
             constant randomised), `--seeds` seeds each
    --wide   bench/bf16_families.py's six families at 8 layers, hidden 1024 (~100-250M parameters, bench/out)
    --real   the embedded SmolLM2-135M-Instruct (30 layers), its GGUF blocks dequantised on both sides
    --tp N   the architectures with a tensor-parallel layout over N gloo ranks (tiny, and the wide ones with --wide)
    --device-path   the tiny checkpoints on the device code path forced on the CPU (ZOO_DEVICE_PATH=1's code)
Columns: the worst value measured for each key (which architecture and scenario), the family's bound, and the margin
(bound / measured; for cosine and top-1, the room left: (1 - bound) / (1 - measured)).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

KEYS = ("rel_l2", "cosine", "kl_max", "kl_mean", "top1", "experts", "packing")


def worst_of(result) -> dict[str, tuple[float, str]]:
    """key -> (worst value, scenario) over every scenario of one parity result."""
    out: dict[str, tuple[float, str]] = {}

    def keep(key, value, scenario):
        if value is None or math.isnan(value):
            return
        lower = key in ("cosine", "top1", "experts")
        if key not in out or (value < out[key][0] if lower else value > out[key][0]):
            out[key] = (value, scenario)

    for name, s in result.scenarios.items():
        if s.comparison is None:
            continue
        for tap in s.comparison.taps:
            w = tap.worst()
            keep("packing" if name == "packing" else "rel_l2", w["rel_l2"], name)
            keep("cosine", w["cosine"], name)
            keep("experts", w.get("experts"), name)
        for lr in s.comparison.logit_taps.values():
            summary = lr.summary(s.tol)
            keep("kl_max", summary["kl_max"], name)
            keep("kl_mean", summary["kl_mean"], name)
            keep("top1", summary["top1_decisive"], name)
    return out


def checkpoints(args) -> list[tuple[str, Path]]:
    """(label, checkpoint path) of every source asked for."""
    from tiny_configs import TINY_CONFIGS, save_arch

    out_dir = ROOT / "bench" / "out" / "parity-baselines"
    found = []
    for arch in TINY_CONFIGS:
        if args.only and arch not in args.only:
            continue
        for seed in range(args.seeds):
            path = out_dir / f"{arch}-s{seed}"
            if not (path / "config.json").exists():
                save_arch(arch, path, seed=seed)
            found.append((f"{arch} (tiny, seed {seed})", path))
    if args.wide:
        from bf16_families import FAMILIES, checkpoint

        found += [(f"{FAMILIES[name][0]} (8 layers, hidden 1024)", checkpoint(name, 8)) for name in FAMILIES]
    if args.real:
        from zoo.default_model import default_model_path

        found.append(("SmolLM2-135M (30 layers, dequantised)", Path(default_model_path())))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=1, help="tiny checkpoints per architecture (seeds 0..N-1)")
    parser.add_argument("--wide", action="store_true", help="also the six 8-layer families of bench/bf16_families")
    parser.add_argument("--real", action="store_true", help="also the embedded SmolLM2-135M (dequantised)")
    parser.add_argument("--only", nargs="*", help="these architectures' tiny checkpoints only")
    parser.add_argument("--tp", type=int, default=1, help="also N tensor-parallel ranks where an architecture has them")
    parser.add_argument("--device-path", action="store_true", help="also the tiny checkpoints on the device path")
    args = parser.parse_args()

    import torch

    from parity.harness import run_parity
    from parity.tolerances import FAMILY, tolerances

    torch.manual_seed(0)
    worst: dict[str, dict[str, tuple[float, str]]] = {}  # family -> key -> (value, where)
    failed = []
    base = checkpoints(args)
    runs = [(label, path, {}) for label, path in base]
    if args.tp > 1:
        from registry import get_registry
        from zoo.runtime.model_files import load_config, resolve_model

        runs += [(f"{label}, TP={args.tp}", path, {"tensor_parallel_size": args.tp}) for label, path in base
                 if "SmolLM2" not in label
                 and get_registry().resolve(load_config(resolve_model(path))).tensor_parallel is not None]
    if args.device_path:
        runs += [(f"{label}, device path", path, {"device_path": True}) for label, path in base if "tiny" in label]
    for label, path, how in runs:
        from zoo import kernels

        before = kernels.set_device_path(how.get("device_path", False))
        try:
            result = run_parity(path, dtype=torch.float32, quantized=False if label.startswith("SmolLM2") else None,
                                tensor_parallel_size=how.get("tensor_parallel_size", 1))
        finally:
            kernels.set_device_path(before)
        if not result.passed:
            failed.append(label)
        fam = worst.setdefault(result.family, {})
        for key, (value, scenario) in worst_of(result).items():
            lower = key in ("cosine", "top1", "experts")
            if key not in fam or (value < fam[key][0] if lower else value > fam[key][0]):
                fam[key] = (value, f"{label}, {scenario}")
        print(f"{label}: {'pass' if result.passed else 'FAILS'}", file=sys.stderr, flush=True)

    print(f"\n{'family':<11} {'key':<8} {'measured':>10} {'bound':>10} {'margin':>8}  worst at")
    for family in FAMILY:
        tol = tolerances(family)
        for key in KEYS:
            if key not in worst.get(family, {}):
                continue
            value, where = worst[family][key]
            if key in ("cosine", "top1", "experts"):
                margin = (1 - tol[key]) / (1 - value) if value < 1 else math.inf
                shown = f"1-{1 - value:.1e}" if key == "cosine" else f"{value:.2%}"
                bound = f"1-{1 - tol[key]:.0e}" if key == "cosine" else f"{tol[key]:.0%}"
            else:
                margin = tol[key] / value if value > 0 else math.inf
                shown, bound = f"{value:.1e}", f"{tol[key]:.0e}"
            print(f"{family:<11} {key:<8} {shown:>10} {bound:>10} {margin:>7.0f}x  {where}")
    if failed:
        print(f"\nfailed (correct models: a bound too tight, or a bug): {', '.join(failed)}")


if __name__ == "__main__":
    main()
