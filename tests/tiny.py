"""Tiny random-weight reference checkpoints, built and saved by transformers itself.

    path = save_tiny("LlamaForCausalLM", tmp_path, num_hidden_layers=2, tie_word_embeddings=True)

The files on disk (safetensors, hub layout) are the contract the loader faces, never the in-memory
state_dict. Each config is small enough to build and save in well under a second.
"""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

# A small shape every family starts from; each call overrides what its test exercises.
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(architecture: str, **overrides):
    model_cls = getattr(transformers, architecture)
    config = model_cls.config_class(**{**BASE, **overrides})
    config.architectures = [architecture]
    return config


def save_tiny(architecture: str, path: str | Path, *, seed: int = 0, max_shard_size=None, randomize: bool = False,
              **overrides) -> Path:
    """Build `architecture` with random weights from BASE + overrides and save it under `path`.
    `randomize`: also give what transformers' init leaves constant (biases, norm weights, router biases)
    random values (parity.tiny.randomize_constants)."""
    path = Path(path)
    config = tiny_config(architecture, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    if randomize:
        from parity.tiny import randomize_constants

        randomize_constants(model, seed=seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def load_reference(path: str | Path):
    """The transformers model read back from the files, float32, eager attention."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


_built: dict[tuple, tuple] = {}


def built_case(architecture: str, overrides: dict, name: str, tmp_path_factory) -> tuple:
    """(name, checkpoint dir, zoo model, transformers model, zoo ArchSpec) for a tiny checkpoint of
    `architecture`, built once per session and name. A wide init: attention far from uniform, so masking and
    rotation errors show in the logits."""
    from zoo.build import build_model

    key = (name, architecture)
    if key not in _built:
        path = save_tiny(architecture, tmp_path_factory.mktemp(name), initializer_range=0.2, **overrides)
        model, _, spec, _ = build_model(path)
        _built[key] = (name, path, model, load_reference(path), spec)
    return _built[key]
