"""Build a model from a checkpoint: config -> registry spec -> module on meta -> strict load.

    model, config, spec, report = build_model("path/to/checkpoint", dtype=torch.bfloat16, device="cuda")
"""
from __future__ import annotations

from pathlib import Path

import torch

import loader
from registry import get_registry
from zoo.runtime.model_files import ConfigError


def build_model(path_or_source, *, dtype: torch.dtype = torch.float32, device="cpu", config=None):
    """(model in eval mode, transformers config, ArchSpec, loader.LoadReport).

    `path_or_source` is a local directory in the Hugging Face layout, a hub id, or a `loader.Source`;
    `config` (a transformers PretrainedConfig) replaces the checkpoint's config.json when given.
    """
    # not strict here: an index that disagrees with its shards is reported by load() with every other problem
    source = loader.open_source(path_or_source, strict=False) if isinstance(path_or_source, (str, Path)) \
        else path_or_source
    if config is None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(source.directory))
        except ValueError as e:
            raise ConfigError(f"{source.directory}: the config cannot be read: {str(e).strip().splitlines()[0]}") from e
    spec = get_registry().resolve(config)
    if spec.validate is not None:
        try:
            spec.validate(config)
        except ValueError as e:
            raise ConfigError(f"{spec.architectures[0]} (plugin {spec.plugin}) does not serve this config: {e}") from e
    with torch.device("meta"):
        model = spec.model_class()(config)
    report = loader.load(model, source, rules_for(spec, model), dtype=dtype, device=device)
    return model.eval(), config, spec, report


def rules_for(spec, model) -> loader.Rules:
    """The spec's weight rules plus those the built model adds for its config (`model.load_rules`: e.g. the
    vision layers past the last one a multimodal model reads, named as ignored)."""
    return spec.rules + getattr(model, "load_rules", loader.Rules())


def exit_status(error: loader.LoadError) -> int:
    """The command-line status of a loader error: 1 (a finding) when it carries problems with the
    checkpoint's content (missing / unexpected / mis-shaped tensors, an index that disagrees with its
    shards, a malformed header entry), 2 when there is no checkpoint to judge (nothing at the path,
    refused pickles, not a checkpoint at all)."""
    return 1 if error.problems else 2
