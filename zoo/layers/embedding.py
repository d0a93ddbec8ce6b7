"""Token embedding and LM head.

Shape legend:
    T = tokens    N = rows whose logits are wanted    V = vocab size    H = hidden size

A tied head holds the embedding's Parameter itself (`lm_head.weight is embed_tokens.weight`), so
`named_parameters(remove_duplicate=False)` lists both names and the loader's Tie rule decides from the
checkpoint whether they stay one tensor.

Both take block-quantised tables (a GGUF kept quantised, `weight.quant`; see zoo/layers/linear.py): rows
are gathered and dequantised, the head runs the block GEMV. Both take compact tables too (bfloat16 under
float32 activations, zoo/layers/linear.py): rows are widened, the head runs the bfloat16 GEMV.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo import kernels
from zoo.layers.linear import compute_dtype, linear


class VocabEmbedding(nn.Module):
    """weight [V, H]; `scale` multiplies the rows (Gemma: sqrt(H), rounded to the weight's dtype first)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, scale: float | None = None):
        super().__init__()
        self.vocab_size, self.hidden_size, self.scale = vocab_size, hidden_size, scale
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))  # [V, H]
        self.weight.quantizable = self.weight.compact = True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype is torch.uint8:  # block-quantised rows
            x = kernels.qembed(input_ids, self.weight)  # [T] -> [T, H]
        else:
            x = F.embedding(input_ids, self.weight).to(compute_dtype(self.weight))  # [T] -> [T, H], widened
        if self.scale is not None:
            # as transformers: a float32 normaliser cast to the weight's dtype (sqrt(3072) is 55.5 in bf16, not 55.43)
            x = x * torch.tensor(self.scale, dtype=torch.float32, device=x.device).to(x.dtype)
        return x

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}, scale={self.scale}"


class LMHead(nn.Module):
    """logits = hidden W^T (+ b), weight [V, H]; `scale` multiplies the logits (Cohere's logit_scale), `divisor`
    divides them (Granite's logits_scaling), `softcap` applies tanh capping (Gemma's final_logit_softcapping)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, softcap: float | None = None, bias: bool = False,
                 scale: float | None = None, divisor: float | None = None):
        super().__init__()
        self.vocab_size, self.hidden_size, self.softcap = vocab_size, hidden_size, softcap
        self.scale, self.divisor = scale, divisor
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))  # [V, H]
        self.weight.quantizable = self.weight.compact = True
        self.bias = nn.Parameter(torch.empty(vocab_size)) if bias else None  # [V] (Phi's head)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, self.bias)  # [N, H] -> [N, V]
        if self.scale is not None:
            logits = logits * self.scale
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def extra_repr(self) -> str:
        return (f"{self.vocab_size}, {self.hidden_size}, softcap={self.softcap}, bias={self.bias is not None}, "
                f"scale={self.scale}, divisor={self.divisor}")
