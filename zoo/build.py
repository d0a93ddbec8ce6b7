"""Build a model from a checkpoint: config -> registry spec -> module on meta -> strict load.

    model, config, spec, report = build_model("path/to/checkpoint", dtype=torch.bfloat16, device="cuda")
"""
from __future__ import annotations

from pathlib import Path

import torch

import loader
from registry import get_registry


def build_model(path_or_source, *, dtype: torch.dtype = torch.float32, device="cpu", config=None):
    """(model in eval mode, transformers config, ArchSpec, loader.LoadReport).

    `path_or_source` is a local directory in the Hugging Face layout, a hub id, or a `loader.Source`;
    `config` (a transformers PretrainedConfig) replaces the checkpoint's config.json when given.
    """
    source = loader.open_source(path_or_source) if isinstance(path_or_source, (str, Path)) else path_or_source
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(source.directory))
    spec = get_registry().resolve(config)
    if spec.validate is not None:
        spec.validate(config)
    with torch.device("meta"):
        model = spec.model_class()(config)
    report = loader.load(model, source, spec.rules, dtype=dtype, device=device)
    return model.eval(), config, spec, report
