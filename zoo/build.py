"""Build a model from a checkpoint: config -> registry spec -> module on meta -> strict load.

    model, config, spec, report = build_model("path/to/checkpoint", dtype=torch.bfloat16, device="cuda")
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

import loader
from registry import PluginError, get_registry
from zoo import kernels
from zoo.runtime.model_files import ConfigError, config_at, read_config, validate_config

LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def build_model(path_or_source, *, dtype: torch.dtype = torch.float32, device="cpu", config=None,
                tp: loader.Parallel | None = None, quantized: bool = False, stage=None):
    """(model in eval mode, transformers config, ArchSpec, loader.LoadReport).

    `path_or_source` is a local directory in the Hugging Face layout, a hub id, or a `loader.Source`;
    `config` (a transformers PretrainedConfig) replaces the checkpoint's config.json when given.
    `tp=Parallel(rank, size)`: this rank's part of a tensor-parallel model (its slices only, the layers that
    talk to the other ranks swapped in: zoo/layers/parallel.py); its forward needs torch.distributed's group.
    `quantized=True`: a GGUF's block-quantised weights stay quantised (CPU, float32 for the rest; loader/quant.py).
    `stage=Stage(index, size)`: one stage of a pipeline-parallel model (its layers' tensors only, the other stages'
    modules stand-ins that pass the hidden states on: zoo/runtime/pipeline.py); with `tp`, that rank's slices of them.
    """
    if quantized and (torch.device(device).type != "cpu" or dtype is not torch.float32 or tp is not None):
        raise ValueError("a quantized GGUF runs on the CPU, with float32 activations, tensor parallel size 1 "
                         f"(got device={device}, dtype={dtype}, tp={tp}); dequantize it for the others")
    if stage is not None and stage.size > 1 and quantized:
        raise ValueError(f"pipeline parallel size {stage.size} runs unquantized weights (got quantized={quantized})")
    # not strict here: an index that disagrees with its shards is reported by load() with every other problem
    source = loader.open_source(path_or_source, strict=False, quantized=quantized) \
        if isinstance(path_or_source, (str, Path)) else path_or_source
    if config is None and isinstance(path_or_source, (str, Path)) and Path(path_or_source).is_file():
        config = config_at(path_or_source)  # a GGUF file: its metadata
    elif config is None:
        config = read_config(str(source.directory), str(source.directory))
    else:
        validate_config(config, str(source.directory))
    check_layers(config, source)
    spec = get_registry().resolve(config)
    if spec.validate is not None:
        validate_spec(spec, config)
    if tp is not None and tp.size > 1:
        model, rules = tensor_parallel_model(spec, config, tp.size)
    else:
        with torch.device("meta"):
            model = spec.build(config)  # a PluginError naming the plugin, the architecture and the raise
        rules, tp = rules_for(spec, model), None
    if stage is not None and stage.size > 1:
        from zoo.runtime.pipeline import split

        rules = split(model, source, rules, stage, tp)
    # float32 / bfloat16 CPU weights are read straight into the kernels' packed layout (kernels.pack_weights, no copy)
    allocate = kernels.packed_allocator(model) if tp is None and dtype in kernels.PACKED \
        and torch.device(device).type == "cpu" else None
    # NaN/Inf weights would generate token 0 for ever: refused (a sum per tensor, on the reader threads)
    report = loader.load(model, source, rules, dtype=storage_dtypes(model, dtype, device), device=device,
                         check_finite=True, tp=tp, allocate=allocate)
    if allocate is not None:
        kernels.mark_packed(model, allocate)
    if tp is not None:
        from zoo.layers.parallel import parallelize

        parallelize(model, rules, tp.rank, config.get_text_config().vocab_size)
    return model.eval(), config, spec, report


def storage_dtypes(model, dtype: torch.dtype, device) -> torch.dtype | dict[str, torch.dtype]:
    """What each parameter is stored as (loader.load's dtype=). On the CPU the activations are float32 whatever
    `dtype` (zoo.layers.linear.compute_dtype): a narrower dtype there is the storage of the parameters marked
    `compact` (the matrices, embedding tables and expert stacks, which a decode step streams and the kernels read
    widened; the KV caches follow the attention's weights), every other one float32 (norms, biases, convolutions,
    SSM parameters, routers: a few KB each, read at float32's precision). On the device path every floating-point
    parameter takes `dtype`."""
    if dtype is torch.float32 or torch.device(device).type != "cpu" or kernels.device_path(torch.empty(0)):
        return dtype
    return {name: dtype if getattr(p, "compact", False) else torch.float32
            for name, p in model.named_parameters(remove_duplicate=False)}


def validate_spec(spec, config) -> None:
    """The plugin's own check of the config (ArchSpec.validate): a ConfigError naming the architecture, or a
    PluginError when the check itself fails (ArchSpec.check)."""
    try:
        spec.check(config)
    except PluginError:
        raise
    except ValueError as e:
        raise ConfigError(f"{spec.architectures[0]} (plugin {spec.plugin}) does not serve this config: {e}") from e


def rules_for(spec, model) -> loader.Rules:
    """The spec's weight rules plus those the built model adds for its config (`model.load_rules`: e.g. the
    vision layers past the last one a multimodal model reads, named as ignored)."""
    return spec.rules + getattr(model, "load_rules", loader.Rules())


def tensor_parallel_model(spec, config, size: int):
    """(rank-local model on meta, rules with the Shard specs) for a tensor-parallel group of `size`; every
    rank builds the same shapes. ValueError naming the architecture or the config field that cannot split."""
    if spec.tensor_parallel is None:
        why = f" ({spec.no_tensor_parallel})" if spec.no_tensor_parallel else ""
        raise ValueError(f"architecture {spec.architectures[0]} (plugin {spec.plugin}) has no tensor-parallel "
                         f"layout yet{why}; run it with tensor parallel size 1")
    local, shard_rules = spec.tensor_parallel(config, size)
    with torch.device("meta"):
        model = spec.build(local)
    return model, rules_for(spec, model) + shard_rules


def check_layers(config, source: loader.Source) -> None:
    """Refuse, before a model is built, a config that claims more layers than the checkpoint holds (a
    num_hidden_layers of 100000 would take minutes and gigabytes to build, then report a million missing
    tensors): one LoadError naming the field and the layers the checkpoint has; shards the index names that are
    absent (an interrupted download: the likely cause) are named first."""
    n = getattr(config, "num_hidden_layers", None)
    held = {int(m[1]) for k in source.keys() if (m := LAYER_KEY.search(k))}
    if isinstance(n, int) and held and n > max(held) + 1:
        last = max(held)
        layers = loader.Problem("missing", f"model.layers.{last + 1}", None, None,
                                f"the config says num_hidden_layers={n} but {source.directory} holds layers 0-{last} "
                                f"only: layers {last + 1}-{n - 1} have no tensors")
        absent = [p for p in getattr(source, "problems", ()) if p.kind == "file" and p.file
                  and not (source.directory / p.file).exists()]
        if absent:
            raise loader.LoadError(absent + [layers], f"{len(absent)} shard{'s' * (len(absent) > 1)} the index "
                                   f"names {'are' if len(absent) > 1 else 'is'} not in {source.directory} (an "
                                   f"interrupted download?): {', '.join(p.file for p in absent)}")
        raise loader.LoadError([layers], "1 problem: the config does not fit the checkpoint")


def exit_status(error: loader.LoadError) -> int:
    """The command-line status of a loader error: 1 (a finding) when it carries problems with the
    checkpoint's content (missing / unexpected / mis-shaped tensors, an index that disagrees with its
    shards, a malformed header entry), 2 when there is no checkpoint to judge (nothing at the path,
    refused pickles, not a checkpoint at all)."""
    return 1 if error.problems else 2
