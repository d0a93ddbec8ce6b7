"""GGUF files (llama.cpp) as a Source under Hugging Face Llama names, dequantised to float32.

Shapes: GGUF lists dims fastest-first, so a GGUF [in, out] is the torch [out, in]; the numpy arrays of
the `gguf` package are already in torch order. llama.cpp's converter permutes the rows of q_proj/k_proj
within each head, (half, 2) -> (2, half) read as rows, so that rotary pairs sit side by side; we undo it
for the Llama architecture, with the head counts from the file's metadata.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from loader.problems import SourceError
from loader.rules import Ignore, Rules
from loader.sources import Source, TensorInfo

# GGUF name (after `blk.{i}.`) -> Hugging Face name (after `model.layers.{i}.`)
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
PERMUTED_ARCHS = ("llama",)  # architectures whose converter permutes q/k rows
# Tensors llama.cpp adds that a HF model computes itself; plan() and load() add these rules to a model's.
GGUF_RULES = Rules(ignores=(Ignore(r"^rope_freqs\.weight$", "llama.cpp's rope frequency factors; "
                                                              "the model computes them from the config"),))


def hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names stay as they are."""
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name):
        if m[2] in LAYER_NAMES:
            return f"model.layers.{m[1]}.{LAYER_NAMES[m[2]]}.{m[3]}"
    if m := re.fullmatch(r"(\w+)\.(weight|bias)", name):
        if m[1] in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[m[1]]}.{m[2]}"
    return name


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation: rows of each head go from (half, 2) back to (2, half)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFSource(Source):
    kind = "gguf"

    def __init__(self, path: Path):
        import gguf  # only here: the rest of the loader does not need it

        super().__init__(path.parent, [path])
        self._gguf = gguf
        self.rules = GGUF_RULES
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:
            raise SourceError([], f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from e
        self.metadata = {k: f.contents() for k, f in self.reader.fields.items() if not k.startswith("GGUF.")}
        self.architecture = str(self.metadata.get("general.architecture", ""))
        arch = self.architecture
        self.n_heads = self.metadata.get(f"{arch}.attention.head_count")
        self.n_kv_heads = self.metadata.get(f"{arch}.attention.head_count_kv", self.n_heads)
        self._tensors = {}
        float_types = {gguf.GGMLQuantizationType.F16: torch.float16, gguf.GGMLQuantizationType.BF16: torch.bfloat16}
        for t in self.reader.tensors:
            key = hf_name(t.name)
            dtype = float_types.get(t.tensor_type, torch.float32)  # quantised types dequantise to float32
            self._infos[key] = TensorInfo(tuple(int(s) for s in reversed(t.shape)), dtype, path.name)
            self._tensors[key] = t

    def order(self, key: str) -> tuple:
        return ("", int(self._tensors[key].data_offset))

    def get(self, key: str) -> torch.Tensor:
        info = self.info(key)
        t = self._tensors[key]
        q = self._gguf.GGMLQuantizationType
        if t.tensor_type == q.BF16:
            out = torch.from_numpy(t.data.copy()).view(torch.bfloat16)  # stored as raw 16-bit words
        elif t.tensor_type in (q.F32, q.F16):
            out = torch.from_numpy(t.data.copy())
        else:
            out = torch.from_numpy(self._gguf.quants.dequantize(t.data, t.tensor_type))
        out = out.reshape(info.shape)
        if self.architecture in PERMUTED_ARCHS and self.n_heads:
            if key.endswith("self_attn.q_proj.weight") or key.endswith("self_attn.q_proj.bias"):
                out = unpermute(out, int(self.n_heads))
            elif key.endswith("self_attn.k_proj.weight") or key.endswith("self_attn.k_proj.bias"):
                out = unpermute(out, int(self.n_kv_heads))
        return out.to(info.dtype)
