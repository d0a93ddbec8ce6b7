"""Show the loader's plan for a checkpoint, from headers only: what maps where, and every problem.

    zoo inspect DIR | HUB_ID | FILE.gguf [--transformers] [--all]
                [--tensor-parallel-size N] [--pipeline-parallel-size N]

With --tensor-parallel-size N, every rank's plan is computed here (no rank is spawned): the bytes each rank
reads, and the proof that the ranks' slices cover every element of every tensor exactly once. With
--pipeline-parallel-size N, every stage's: its decoder layers, the modules besides them it reads, its bytes, and the
proof that each tensor is read by exactly one stage (or by the stages sharing a tied parameter); with both, also
every stage's ranks' bytes and the proof that their slices cover the stage's tensors exactly once.

Exit status: 0 the checkpoint fits the model, 1 problems found, 2 the checkpoint or model cannot be read.
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch

from loader import LoadError, Rules, open_source, plan
from loader.plan import plan_ranks
from loader.problems import SHOWN
from zoo.table import print_table


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a local directory in the Hugging Face layout, a hub id, or a .gguf file")
    parser.add_argument("--transformers", action="store_true",
                        help="plan against transformers' own model class with identity rules, not the zoo's")
    parser.add_argument("--all", action="store_true", help="one row per tensor (default: layers folded)")
    parser.add_argument("--allow-bin", action="store_true", help="accept PyTorch pickle (.bin) weights")
    parser.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="plan every rank of an N-way tensor-parallel group and prove their slices' union")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                        help="plan every stage of an N-stage pipeline (contiguous decoder layers) and prove that each "
                             "checkpoint tensor is read by exactly one stage, or by the stages sharing it")


def run(args) -> int:
    from zoo.build import exit_status

    try:
        source = open_source(args.model, allow_bin=args.allow_bin, revision=args.revision, strict=False)
        if args.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: expected 1 or more")
        if args.tensor_parallel_size > 1 and args.transformers:
            raise ValueError("--tensor-parallel-size plans the zoo's model; it cannot go with --transformers")
        if args.pipeline_parallel_size < 1:
            raise ValueError(f"--pipeline-parallel-size {args.pipeline_parallel_size}: expected 1 or more")
        if args.pipeline_parallel_size > 1 and args.transformers:
            raise ValueError("--pipeline-parallel-size plans the zoo's model; it cannot go with --transformers")
        model, rules, what = _build(source, args.transformers, args.tensor_parallel_size)
    except LoadError as e:  # with problems (a malformed header entry): a finding; else nothing to inspect
        print(f"zoo inspect: {e}")
        return exit_status(e)
    except (OSError, ValueError, LookupError, ImportError) as e:
        print(f"zoo inspect: {e}")
        return 2
    except Exception as e:  # the model class refuses the config while it is built on meta
        print(f"zoo inspect: {args.model}: the model cannot be built from its config: {type(e).__name__}: {e}")
        return 2
    if args.pipeline_parallel_size > 1:
        try:
            status = _run_stages(source, lambda: _build(source, False)[:2], what, args.pipeline_parallel_size)
            if status or args.tensor_parallel_size == 1:
                return status
            return _run_stage_ranks(source, args.pipeline_parallel_size, args.tensor_parallel_size)
        except ValueError as e:  # no layout, fewer layers than stages
            print(f"zoo inspect: {e}")
            return 2
    if args.tensor_parallel_size > 1:
        return _run_ranks(model, source, rules, what, args.tensor_parallel_size)
    p = plan(model, source, rules)
    print(f"{source.directory} ({source.kind}, {len(source.files)} files, {len(source.keys())} tensors) "
          f"-> {what}")
    rows = [(e.key, e.file, "x".join(map(str, e.shape)), str(e.dtype).removeprefix("torch."), f"{e.param}{e.region}")
            for e in sorted(p.entries, key=lambda e: source.order(e.key))]
    print_table(["checkpoint key", "file", "shape", "dtype", "parameter"], rows if args.all else _fold(rows))
    for key, file, reason in p.ignored:
        print(f"ignored: {key} in {file}: {reason}")
    for t in p.ties:
        print(f"tie: {t}")
    if not args.transformers:
        print(_cache_line(model))
    if p.problems:
        return _print_problems(p.problems)
    print(f"ok: every checkpoint tensor and every element of every parameter is accounted for")
    for t in p.ties:
        if not t.tied:  # the config ties them: say it in the summary, not only in the tie lines
            print(f"note: {t}: the config ties them, the model will use the checkpoint's own weights")
    if not args.transformers:
        print(f"step: {_step_path(model)}")
    return 0


def _step_path(model) -> str:
    """Which path `zoo run` takes with this model on the CPU in float32 (docs/plugins.md: the fast path's rules)."""
    from zoo.kernels.fused import FusedDecoder

    why = FusedDecoder.qualify(model, None)
    if why == "qualifies":
        return "the fused native step (one call per step) in float32 on the CPU"
    return f"the module path: the fused step does not apply: {why}"


def _print_problems(problems) -> int:
    print(f"{len(problems)} problems:")
    for problem in problems[:SHOWN]:
        print(f"  {problem}")
    if len(problems) > SHOWN:
        print(f"  ... and {len(problems) - SHOWN} more problems")
    return 1


def _run_ranks(model, source, rules, what: str, size: int) -> int:
    rp = plan_ranks(model, source, rules, size)
    print(f"{source.directory} ({source.kind}, {len(source.files)} files, {len(source.keys())} tensors) -> {what}, "
          f"tensor parallel size {size}")
    full = sum(source.info(k).nbytes for k in source.keys())
    rows = []
    for r, p in enumerate(rp.plans):
        keys = {e.key for e in p.entries}
        sliced = {e.key for e in p.entries
                  if e.slice is not None and e.slice.stop - e.slice.start < e.shape[e.slice.dim]}
        rows.append((str(r), str(len(keys)), str(len(sliced)), f"{rp.bytes(r) / 1e6:.3f}",
                     f"{rp.bytes(r) / max(full, 1):.2f}"))
    print_table(["rank", "tensors", "sliced", "MB read", "of checkpoint"], rows)
    if rp.problems:
        return _print_problems(rp.problems)
    print(f"ok: the {size} ranks' slices cover every element of every checkpoint tensor exactly once "
          f"(replicated tensors and KV heads by exactly the ranks that share them)")
    return 0


def _run_stages(source, build, what: str, size: int) -> int:
    from zoo.runtime.pipeline import plan_stages

    sp = plan_stages(build, source, size)
    print(f"{source.directory} ({source.kind}, {len(source.files)} files, {len(source.keys())} tensors) -> {what}, "
          f"pipeline parallel size {size}")
    full = sum(source.info(k).nbytes for k in source.keys())
    rows = []
    for s, p in enumerate(sp.plans):
        r = sp.ranges[s]
        rows.append((str(s), f"{r.start}-{r.stop - 1}", ", ".join(sp.holds[s]) or "-",
                     str(len({e.key for e in p.entries})),
                     f"{sp.bytes(s) / 1e6:.3f}", f"{sp.bytes(s) / max(full, 1):.2f}"))
    print_table(["stage", "layers", "besides the layers", "tensors", "MB read", "of checkpoint"], rows)
    for key, stages in sp.replicated.items():
        print(f"replicated: {key} is read by stages {', '.join(map(str, stages))} (a parameter they share)")
    if sp.problems:
        return _print_problems(sp.problems)
    print(f"ok: each checkpoint tensor is read by exactly one of the {size} stages, or by the stages that share it; "
          f"each stage reads only its own")
    return 0


def _run_stage_ranks(source, stages: int, tp: int) -> int:
    """Pipeline x tensor parallelism: within each stage, its tp ranks' slices of the tensors it reads cover every
    element exactly once (the stages' split of the tensors, proven by _run_stages, is the same at any tp)."""
    from loader import Parallel
    from zoo.runtime.pipeline import Stage, split

    rows, problems = [], []
    full = sum(source.info(k).nbytes for k in source.keys())
    for s in range(stages):
        model, rules, _ = _build(source, False, tp)
        rules = split(model, source, rules, Stage(s, stages, 0, tp), Parallel(0, tp))
        rp = plan_ranks(model, source, rules, tp)
        problems += rp.problems
        rows += [(str(s), str(r), str(len({e.key for e in p.entries})), f"{rp.bytes(r) / 1e6:.3f}",
                  f"{rp.bytes(r) / max(full, 1):.2f}") for r, p in enumerate(rp.plans)]
    print(f"tensor parallel size {tp} within each stage ({stages * tp} processes):")
    print_table(["stage", "rank", "tensors", "MB read", "of checkpoint"], rows)
    if problems:
        return _print_problems(problems)
    print(f"ok: within each stage, its {tp} ranks' slices cover every element of the tensors it reads exactly once")
    return 0


def _build(source, use_transformers: bool, tp_size: int = 1):
    import transformers

    from zoo.build import check_layers
    from zoo.runtime.model_files import read_config

    gguf = {"gguf_file": source.files[0].name} if source.kind == "gguf" else {}
    config = read_config(source.directory, source.files[0].name if gguf else str(source.directory), **gguf)
    check_layers(config, source)
    if use_transformers:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        return model, Rules(), f"transformers {type(model).__name__} (identity rules)"
    from registry import get_registry
    from zoo.build import rules_for, tensor_parallel_model, validate_spec

    spec = get_registry().resolve(config)
    validate_spec(spec, config)  # (a PluginError for a check that fails itself, as for a constructor)
    if tp_size > 1:
        model, rules = tensor_parallel_model(spec, config, tp_size)
    else:
        with torch.device("meta"):
            model = spec.build(config)  # (a PluginError is a ValueError: one line, exit 2)
        rules = rules_for(spec, model)
    cls = type(model)
    return model, rules, f"zoo {cls.__module__}.{cls.__name__} (plugin {spec.plugin})"


def _cache_line(model) -> str:
    """What the runtime's pools cost, from the modules' cache specs (at the dtype the model was built in)."""
    from zoo.runtime.kv_cache import bytes_per_token, cache_specs
    from zoo.runtime.state_pool import bytes_per_request, state_specs

    kv, states = cache_specs(model), state_specs(model)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    line = f"cache ({dtype}): KV pool {bytes_per_token(kv):,} bytes per token ({len(kv)} layers)"
    if states:
        line += f"; recurrent state pool {bytes_per_request(states):,} bytes per request ({len(states)} layers)"
    return line


def _fold(rows):
    """Rows that differ only by layer (or expert) index, or by shard file, become one row with a count."""
    groups = defaultdict(list)
    for key, file, shape, dtype, param in rows:
        fold = lambda name: re.sub(r"\.(\d+)\.", ".{i}.", name)
        groups[(fold(key), shape, dtype, fold(param))].append(file)
    out = []
    for (key, shape, dtype, param), files in groups.items():
        where = files[0] if len(set(files)) == 1 else f"{len(set(files))} files"
        out.append((key, where, shape, dtype, param if len(files) == 1 else f"{param}  (x{len(files)})"))
    return out
