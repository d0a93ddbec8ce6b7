"""bfloat16 parity (`zoo parity MODEL --dtype bfloat16`): the zoo's CPU bfloat16 path against transformers float32 on
the very values the zoo holds.

On the CPU, dtype bfloat16 stores the compact weights (matrices, embedding tables, expert stacks: `weight.compact`)
and the KV caches in bfloat16 and computes in float32 (docs/design.md "Precision (CPU)"). The reference is
transformers float32 on
  - the same weights: the checkpoint as it is when every tensor the zoo's loader maps into a compact parameter is
    bfloat16 in its files already (the hub's usual form: float32 holds it exactly); else a temporary copy with
    exactly those tensors rounded to bfloat16 (`reference_checkpoint`), from which both sides run;
  - the same cache: k (rotated) and v rounded to bfloat16 where its attention reads them (`cache_rounded`; a latent
    cache's latent and rope key), as zoo's bfloat16 cache holds them.
What is left between the two is the order of float32 sums, which now and then flips a k or v value's bfloat16
rounding (parity/tolerances.py BFLOAT16).
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

# weight files a checkpoint directory may hold beside its safetensors (transformers reads the safetensors): not copied
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")


def bf16(t: torch.Tensor) -> torch.Tensor:
    """t rounded to bfloat16 (nearest even), in its own dtype"""
    return t.to(torch.bfloat16).to(t.dtype)


def on_bf16_kv(attend):
    """An attention function like `attend` (module, query, key, value, ...) that reads key and value rounded."""
    return lambda module, query, key, value, *args, **kwargs: attend(module, query, bf16(key), bf16(value), *args,
                                                                     **kwargs)


@contextmanager
def cache_rounded(model):
    """Within: `model` (transformers, eager attention; or a part of one: a multimodal model's language model, whose
    vision tower keeps no cache) reads its KV cache as zoo's bfloat16 cache holds it, for any architecture: k
    (rotated) and v rounded to bfloat16 where its own eager attention function receives them (the function of each
    attention module's file, patched for the duration, rounding for `model`'s attention modules only: Gemma2's
    softcaps, gpt-oss's sinks stay), and for multi-head latent attention (DeepSeek, which caches the latent) the
    normalised latent and the rotated rope key rounded where `expand_kv` receives them, as zoo's latent cache rows
    hold them. Rounding at every read is rounding once at the write, the current token's included, as zoo's
    attention reads them back from its cache."""
    attns = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    ours = {id(m) for m in attns}
    files = {sys.modules[type(m).__module__] for m in attns if not hasattr(m, "expand_kv")}
    saved = [(f, f.eager_attention_forward) for f in files if hasattr(f, "eager_attention_forward")]
    for f, attend in saved:
        f.eager_attention_forward = (lambda attend, rounded: lambda module, *args, **kwargs: (
            rounded if id(module) in ours else attend)(module, *args, **kwargs))(attend, on_bf16_kv(attend))
    for m in attns:
        if hasattr(m, "expand_kv"):
            m.expand_kv = (lambda expand: lambda latent, k_rot: expand(bf16(latent), bf16(k_rot)))(m.expand_kv)
    try:
        yield
    finally:
        for f, attend in saved:
            f.eager_attention_forward = attend
        for m in attns:
            m.__dict__.pop("expand_kv", None)


def compact_keys(source, config) -> dict[str, torch.dtype] | None:
    """{checkpoint key: its dtype in the files} of every tensor the zoo's loader maps into a compact parameter: the
    loader's plan (from headers) for the zoo's model of `config` built on meta. None: the plan has problems (the
    zoo's load will refuse the checkpoint and say why)."""
    import loader
    from registry import get_registry
    from zoo.build import rules_for, validate_spec

    spec = get_registry().resolve(config)
    validate_spec(spec, config)  # (its refusal, as build_model says it)
    with torch.device("meta"):
        model = spec.build(config)
    compact = {n for n, p in model.named_parameters(remove_duplicate=False) if getattr(p, "compact", False)}
    plan = loader.plan(model, source, rules_for(spec, model))
    return None if plan.problems else {e.key: e.dtype for e in plan.entries if e.param in compact}


@contextmanager
def reference_checkpoint(path, config, say=lambda msg: None):
    """Within: (the checkpoint directory both sides load, the report's record {"route": "checkpoint as is" | "rounded
    copy", "rounded_tensors", "note"}) for a bfloat16 run of the safetensors checkpoint at `path`: `path` itself, or
    a temporary rounded copy (removed on exit)."""
    import loader

    source = loader.open_source(path, strict=False)
    keys = compact_keys(source, config)
    wider = {k for k, dtype in (keys or {}).items() if dtype is not torch.bfloat16}
    if not wider:
        held = "the zoo's loader refuses it" if keys is None else \
            f"the {len(keys)} tensors the zoo stores in bfloat16 are bfloat16 there"
        yield Path(path), {"route": "checkpoint as is", "rounded_tensors": 0,
                           "note": f"the checkpoint as it is ({held})"}
        return
    with tempfile.TemporaryDirectory(prefix="zoo-parity-bf16-") as tmp:
        say(f"writing a copy of the checkpoint with the {len(wider)} tensors the zoo stores in bfloat16 rounded to "
            f"bfloat16, in {tmp}")
        write_rounded_copy(source, wider, Path(tmp))
        yield Path(tmp), {"route": "rounded copy", "rounded_tensors": len(wider),
                          "note": f"a rounded copy ({len(wider)} of the {len(keys)} tensors the zoo stores in bfloat16 "
                                  f"are wider in the checkpoint: rounded in a temporary copy both sides read)"}


def write_rounded_copy(source, keys: set[str], out: Path) -> None:
    """`source` (a safetensors loader.Source) again in `out`: its other files (config, tokenizer, index) copied, each
    safetensors file with the same tensors under the same names, those in `keys` rounded to bfloat16."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if source.kind != "safetensors":
        raise ValueError(f"{source.directory}: a {source.kind} checkpoint; a rounded copy is written from safetensors")
    weights = {Path(f).name for f in source.files}
    for f in Path(source.directory).iterdir():
        if f.is_file() and f.name not in weights and f.suffix not in OTHER_WEIGHTS:
            shutil.copyfile(f, out / f.name)
    for f in source.files:
        with safe_open(str(f), "pt") as r:
            tensors = {k: r.get_tensor(k).to(torch.bfloat16) if k in keys else r.get_tensor(k) for k in r.keys()}
            metadata = r.metadata()
        save_file(tensors, str(out / Path(f).name), metadata=metadata)
