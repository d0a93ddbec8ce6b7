"""bfloat16 parity: transformers float32 reading its KV cache as the zoo's bfloat16 cache holds it (`cache_rounded`).

On the CPU, dtype bfloat16 stores the compact weights (matrices, embedding tables, expert stacks: `weight.compact`)
and the KV caches in bfloat16 and computes in float32 (docs/design.md "Precision (CPU)"): from a bfloat16
checkpoint that is transformers float32 with k and v rounded where its attention reads them
(tests/test_bf16_storage.py).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch


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
