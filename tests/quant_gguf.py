"""Tiny GGUF files with block-quantised weights, written by the `gguf` package from a transformers model.

    path = write_gguf(model, config, tmp_path / "m.gguf", {"": "Q8_0"})         # every matrix Q8_0
    path = write_gguf(model, config, path, {"": "Q4_K", "attn_v": "Q6_K"})     # v in Q6_K (a mixed q/k/v)
    path = write_gguf(model, config, path, types, tokenizer=True)  # with a llama tokenizer: a file `zoo parity`
                                                                   # and transformers' gguf_file= read whole

Q4_0, Q4_1 and Q8_0 blocks come from gguf.quants.quantize; the package cannot quantise the K-quants, so
quantize_k() here packs Q4_K / Q6_K blocks itself (simple absmax scales, not llama.cpp's search). What the
blocks mean is read back only through gguf.quants.dequantize (the package's reference): zoo's kernels are
compared with that, never with these packers. q/k rows are permuted per head as llama.cpp's converter does.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_name(key: str) -> str:
    if key.startswith("model.layers."):
        _, _, i, *rest = key.split(".")
        return f"blk.{i}.{NAMES['.'.join(rest[:-1])]}.{rest[-1]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[key]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (rows of each head (2, half) -> (half, 2))."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float16).view(np.uint8).reshape(*np.shape(x), 2)


def quantize_k(x: np.ndarray, kind: str) -> np.ndarray:
    """float32 [R, C] (C a multiple of 256) -> Q4_K or Q6_K blocks, uint8 [R, C / 256 * block bytes]."""
    rows = x.reshape(-1, 256).astype(np.float32)
    n = rows.shape[0]
    if kind == "Q4_K":
        sub = rows.reshape(n, 8, 32)
        lo = np.minimum(sub.min(-1), 0)
        scale = (sub.max(-1) - lo) / 15
        d = np.maximum(scale.max(-1), 1e-8) / 63
        dmin = np.maximum((-lo).max(-1), 1e-8) / 63
        d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
        sc = np.clip(np.round(scale / d[:, None]), 1, 63).astype(np.uint8)
        m = np.clip(np.round(-lo / dmin[:, None]), 0, 63).astype(np.uint8)
        q = np.clip(np.round((sub + (dmin[:, None] * m)[..., None]) / (d[:, None] * sc)[..., None]), 0, 15)
        q = q.astype(np.uint8).reshape(n, 4, 2, 32)
        scales = np.zeros((n, 12), np.uint8)
        scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
        scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
        scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
        out = np.concatenate([_f16(d), _f16(dmin), scales, qs], axis=1)
    elif kind == "Q6_K":
        sub = rows.reshape(n, 16, 16)
        amax = np.abs(sub).max(-1)
        scale = np.maximum(amax / 31, 1e-8)  # per 16
        d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
        d = np.maximum(d, np.float32(6e-5))
        sc = np.clip(np.round(scale / d[:, None]), 1, 127).astype(np.int8)
        q = np.clip(np.round(sub / (d[:, None] * sc.astype(np.float32))[..., None]), -32, 31).astype(np.int16) + 32
        q = q.astype(np.uint8).reshape(n, 2, 4, 32)  # [half, quarter, l]
        ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                             (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2).reshape(n, 128)
        qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
              | ((q[:, :, 3] >> 4) << 6)).reshape(n, 64)
        out = np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=1)
    else:
        raise ValueError(kind)
    return out.reshape(x.shape[0], -1)


def add_tokenizer(w, vocab: int) -> None:
    """A SentencePiece-style ("llama") vocabulary of `vocab` pieces: <unk> <s> </s>, the 256 byte pieces, then
    letters and two-letter words (scores falling with the index), padded with <extra_N> pieces."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ["\u2581"] + ["\u2581" + c for c in letters] + list(letters) + \
        ["\u2581" + a + b for a in "aeiost" for b in letters]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces
    if len(tokens) > vocab:
        raise ValueError(f"a tokenizer needs a vocabulary of at least {len(tokens)} (the config has {vocab})")
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(vocab - 259)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))  # unknown, control, byte, normal
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_gguf(model: torch.nn.Module, config, path: Path, types: dict[str, str], *, tokenizer: bool = False) -> Path:
    """The model's weights as a llama GGUF at `path`: each matrix in types[its GGUF short name] (or types[""]),
    vectors in F32. Metadata: what GGUFSource reads (architecture, head counts) and the shapes; `tokenizer`: also
    a vocabulary (add_tokenizer), so the config and tokenizer read from the file alone."""
    import gguf

    q = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), "llama")
    if tokenizer:
        add_tokenizer(w, config.vocab_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_context_length(config.max_position_embeddings)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = gguf_name(key)
        a = t.detach().float().numpy()
        if name.endswith("attn_q.weight"):
            a = permute(a, config.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            a = permute(a, config.num_key_value_heads)
        if a.ndim == 1:
            w.add_tensor(name, a)
            continue
        short = name.split(".")[-2]
        kind = types.get(short, types[""])
        if kind in ("Q4_K", "Q6_K"):
            w.add_tensor(name, quantize_k(a, kind), raw_dtype=q[kind])
        else:
            w.add_tensor(name, gguf.quants.quantize(a, q[kind]), raw_dtype=q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
