"""transformers in float32, rounded as a bfloat16 engine rounds (tests/test_bf16.py, bench/bf16_rounding.py): its
parameters rounded to bfloat16, and k (after the rotation) and v rounded as a bfloat16 KV cache holds them, by an
attention function registered with transformers (its sdpa, or eager, on the rounded k and v: rounding at every read is
rounding once at the write, the current token's included, as zoo's attention reads them back from its cache). The
arithmetic stays float32. And the measure both use: teacher-forced log-probabilities compared over the reference's top tokens.
The cache's rounding alone, for any architecture (`cache_rounded`), is parity's (parity/bfloat16.py: `zoo parity
--dtype bfloat16` runs its reference under it).
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from parity.bfloat16 import bf16, cache_rounded, on_bf16_kv  # noqa: F401 (cache_rounded: the tests import it from here)

for _name, _attend, _mask in (("sdpa", sdpa_attention_forward, sdpa_mask),
                              ("eager", eager_attention_forward, eager_mask)):
    AttentionInterface.register(f"bf16_kv_{_name}", on_bf16_kv(_attend))
    AttentionMaskInterface.register(f"bf16_kv_{_name}", _mask)  # (each takes its own form of mask)


def round_to_bf16(model, params=lambda name: True, kv: bool = True, attention: str = "sdpa"):
    """model, in place: the parameters `params(name)` picks rounded to bfloat16; k and v rounded too with kv; the
    attention transformers' "sdpa" or "eager"."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if params(name):
                p.copy_(bf16(p))
    model.set_attn_implementation(f"bf16_kv_{attention}" if kv else attention)
    return model


def logprobs(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """[len(seq), V] log-probabilities of the token after each position, one forward per sequence"""
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1) for s in seqs]


def top_error(want: list[torch.Tensor], got, top: int = 20) -> tuple[float, int]:
    """(rms difference, count) of the log-probabilities over want's `top` tokens at every position where got has
    them. got: per sequence [T, V] log-probabilities, or zoo's prompt_logprobs (dicts, None first: entry t + 1 is
    the prediction at t)."""
    diffs = []
    for w, g in zip(want, got):
        for t in range(w.shape[0] - (0 if isinstance(g, torch.Tensor) else 1)):
            row = g[t] if isinstance(g, torch.Tensor) else g[t + 1]
            for tok in w[t].topk(top).indices.tolist():
                if isinstance(g, torch.Tensor) or tok in row:
                    diffs.append(float(row[tok]) - w[t, tok].item())
    return torch.tensor(diffs).pow(2).mean().sqrt().item(), len(diffs)
