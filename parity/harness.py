"""run_parity: both sides from one checkpoint, every scenario compared, failures localised.

    result = run_parity("path/to/checkpoint")            # or a .gguf file, or a hub id in the local cache
    result.passed, result.scenarios["prefill"].first_divergence, result.scenarios["prefill"].localization

Scenarios (each reported on its own; all run the zoo through its LLMEngine):
    prefill   all prompts (ragged lengths) packed into one flattened step; every position compared
    decode    greedy decode steps through the paged KV cache; the reference runs once on the very tokens
              the zoo produced (teacher forcing): by causality its row p is its full forward over tokens
              0..p, i.e. what a full forward at that decode step gives; the decoded positions compared
    mixed     one prompt arrives per step while the earlier ones decode: steps holding decode rows and
              prefill rows together; every position compared, teacher-forced as decode
    chunked   prefill split into chunks by a small per-step token budget; every position compared
    prefix    a prompt, then the same prompt extended (beside another prompt), with prefix caching on: the
              extended request starts from cached blocks (a recurrent model: a state snapshot restored into
              a slot of another index); the positions it computes are compared
    packing   each prompt alone vs all packed together: zoo vs zoo (packing invariance)
    served    the path users run: the same greedy decode with no hooks on the model (the fused native step
              where it applies); the logits each request sampled from, at its last token, and its greedy
              tokens against the reference run on the served tokens
Rows are placed by the scheduler's accounting (request, token index); positions the runtime gave the model
that disagree with it, and sampled rows that are not a request's last token, are findings of the scenario.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import math
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from parity import SCENARIOS
from parity.align import Trace
from parity.bfloat16 import cache_rounded, reference_checkpoint
from parity.compare import Comparison, compare, first_divergence, verdict
from parity.constants import built_constants
from parity.inputs import (context_limit, degenerate_message, length_dependent, plan_inputs, random_prompt,
                           special_ids, too_long, why_degenerate)
from parity.localize import Localization, localize
from parity.reference import load_reference, run_reference
from parity.taps import EMBEDDED, LOGITS, SAMPLED, TP_REPLICATED_ROLES, first_layer, reference_taps, role_of, short
from parity.tolerances import tolerance_set, tolerances
from parity.zoo_side import ZooSide

DEFAULT_TEXT_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea, the wind and the long grey light of a winter morning on the coast.",
    "Hi",
    "List three prime numbers and explain, in one sentence each, why they are prime.",
)
DEFAULT_LENGTHS = (13, 29, 6, 21)  # token prompts when the checkpoint has no tokenizer

SCENARIO_HINTS = {
    "decode": "decode through the paged cache: slot_mapping / block_tables, K/V written and read back, positions "
              "of decode tokens",
    "mixed": "a step holding decode rows and prefill rows: per-request seq_lens / query_start_loc, decode rows "
             "reading the cache beside prefill rows writing it, the sampled rows of both kinds",
    "chunked": "chunked prefill: attention to the context of earlier chunks (seq_lens vs new tokens, position offsets)",
    "prefix": "prefix-cache hit: the cached blocks a request starts from, positions after the hit",
    "packing": "batch packing: requests see each other in the flattened batch (query_start_loc, seq_lens, "
               "block tables per request)",
    "served": "the served path (no hooks): the fused native step (zoo/kernels/fused.py) or the sampler",
}


TP_TAPS = ("the points every rank holds whole: embeddings (after the vocab-parallel sum), norms, attention, SSM "
           "mixer and MLP / MoE outputs (after their all-reduce), Jamba's x_proj (all-reduced), routers, layer "
           "outputs, final norm, logits (gathered over the vocab); not compared: column-split activations inside a "
           "block (an SSM mixer's in_proj and gated norm) and a shared expert's partial sum")
PIPELINE_SCENARIOS = ("served",)  # what runs over pipeline stages (the others tap modules that other stages hold)
PP_COMPARED = ("the served scenario: the logits the last stage sends back for each sampled row, and the greedy "
               "tokens; not run: the tapped scenarios (stages after the first run their layers in their own "
               "processes, and the head runs on the sampled rows only); the built constants read from the whole model "
               "built on the meta device")


class ParityUsageError(Exception):
    """Bad input from the user or a model that cannot be read at all (exit status 2)."""


class ZooLoadFailure(Exception):
    """The zoo's strict loader refused the checkpoint's content: a finding (exit status 1), not a usage
    error; `error` is the loader.LoadError with every problem."""

    def __init__(self, model, error):
        self.model, self.error = model, error
        super().__init__(f"the zoo does not load {model} strictly: {error}")


@dataclass
class ScenarioResult:
    name: str
    description: str
    passed: bool
    failures: list[str]
    comparison: Comparison | None
    first_divergence: dict | None = None
    localization: Localization | None = None
    info: dict = field(default_factory=dict)
    tol: dict = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)
    skipped: str | None = None


@dataclass
class ParityResult:
    model: str
    architecture: str
    family: str
    tol: dict
    prompts: list[list[int]]
    prompt_texts: list[str] | None
    scenarios: dict[str, ScenarioResult]
    meta: dict
    hints: list[str] = field(default_factory=list)
    inputs: dict = field(default_factory=dict)  # {"notes", "exercised", "not_exercised"}: see parity/inputs.py
    constants: dict = field(default_factory=dict)  # {"checked", "mismatches"}: see parity/constants.py

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.scenarios.values()) and not self.constants.get("mismatches")


# -- inputs ------------------------------------------------------------------------------------------------
def default_prompts(tokenizer, vocab_size: int, seed: int,
                    exclude: set[int] = frozenset()) -> tuple[list[list[int]], list[str] | None]:
    """The default texts tokenised; without a tokenizer, random ids of DEFAULT_LENGTHS, none of `exclude` (the
    config's special and placeholder ids, inputs.special_ids: an image placeholder in a text prompt is refused by
    the runtime, and a bos / eos / pad mid-prompt is no prompt a model is run on)."""
    if tokenizer is not None:
        return [tokenizer.encode(t) for t in DEFAULT_TEXT_PROMPTS], list(DEFAULT_TEXT_PROMPTS)
    g = torch.Generator().manual_seed(seed)
    return [random_prompt(n, vocab_size, g, exclude) for n in DEFAULT_LENGTHS], None


def read_prompts(path, tokenizer) -> tuple[list[list[int]], list[str] | None]:
    """A .json file holding a list of strings or of token-id lists, or a text file with one prompt a line."""
    import json

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ParityUsageError(f"--prompts {path}: {e.strerror}") from None
    if p.suffix == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ParityUsageError(f"--prompts {path}: not valid JSON ({e})") from None
        if not isinstance(items, list) or not items:
            raise ParityUsageError(f"--prompts {path}: expected a non-empty JSON list of strings or token-id lists")
    else:
        items = [line for line in text.splitlines() if line.strip()]
    tokens, texts = [], []
    for i, item in enumerate(items):
        if isinstance(item, list) and item and all(isinstance(t, int) for t in item):
            tokens.append(item)
            texts.append(None)
        elif isinstance(item, str) and item:
            if tokenizer is None:
                raise ParityUsageError(f"--prompts {path}: prompt {i} is text but the checkpoint has no tokenizer; "
                                       f"give token-id lists in a .json file")
            tokens.append(tokenizer.encode(item))
            texts.append(item)
        else:
            raise ParityUsageError(f"--prompts {path}: prompt {i} is neither text nor a list of token ids: {item!r:.60}")
    if not tokens or any(not t for t in tokens):
        raise ParityUsageError(f"--prompts {path}: every prompt needs at least one token")
    return tokens, (texts if any(t is not None for t in texts) else None)


def checkpoint_hash(files) -> str:
    """sha256 over config.json and every weight file (name and content), in name order."""
    h = hashlib.sha256()
    if files.is_gguf:
        paths = [files.path]
    else:
        paths = sorted(p for p in files.directory.iterdir()
                       if p.name == "config.json" or p.suffix in (".safetensors", ".bin", ".gguf"))
    for p in paths:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# -- the run -----------------------------------------------------------------------------------------------
def zoo_quantization(files, quantized: bool | None, device: str, tensor_parallel_size: int,
                     pipeline_parallel_size: int = 1):
    """(the GGUF source opened with its blocks kept, or None: the zoo side dequantizes; the report's
    "quantization" record {"mode": "blocks" | "dequantized" | "none", "file_types", "note"}). `quantized` None:
    blocks kept where `zoo run` keeps them (a GGUF, the CPU, one process, every block type with kernels)."""
    if not files.is_gguf:
        if quantized:
            raise ParityUsageError(f"{files.name}: only a GGUF file's blocks can be kept quantized")
        return None, {"mode": "none", "note": None}
    file_types = gguf_file_types(files.path)
    record = {"mode": "dequantized", "file_types": file_types,
              "note": "the zoo side dequantizes the GGUF to float32 (as the reference does)"}
    if quantized is False:
        return None, record
    why = None if str(device) == "cpu" and tensor_parallel_size == 1 and pipeline_parallel_size == 1 else \
        f"device {device}, tensor parallel size {tensor_parallel_size}" + \
        f", pipeline parallel size {pipeline_parallel_size}" * (pipeline_parallel_size > 1) + \
        ": the block kernels run on the CPU, one process"
    source = None
    if why is None:
        from zoo.runtime.llm import open_quantized

        source, kinds = open_quantized(files.path)
        if kinds:
            source.close()
            source, why = None, f"{files.name} holds {', '.join(kinds)} tensors, which zoo has no quantized kernels for"
    if why is not None:
        if quantized:
            raise ParityUsageError(f"cannot keep {files.name}'s blocks quantized: {why}; drop the flag or give "
                                   f"--dtype float32")
        return None, {**record, "note": f"{why}: {record['note']}"}
    from zoo import kernels

    bits = kernels.activation_bits() if kernels.enabled() else 0
    acts = f"int{bits} activations in the Q4_0 / Q4_1 / Q8_0 decode GEMV" if bits else "float32 math"
    return source, {"mode": "blocks", "file_types": file_types, "activation_bits": bits,
                    "note": f"the zoo side keeps {files.name}'s blocks quantized (block kernels, {acts}); "
                            f"the reference dequantizes them to float32"}


def gguf_file_types(path) -> dict[str, int]:
    """{GGML type name: tensors of that type} of a GGUF file (its own record of what it holds)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out: dict[str, int] = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def _type_counts(kept: dict[str, str]) -> dict[str, int]:
    """{"Q4_1": 120, ...}: the block types of the weights kept quantized (a mixed q/k/v counts each of its types)."""
    out: dict[str, int] = {}
    for layout in kept.values():
        for part in layout.split()[0].split("+"):
            kind = part.split("[")[0]
            out[kind] = out.get(kind, 0) + 1
    return dict(sorted(out.items()))


def run_parity(model: str | Path, *, prompts: list[list[int]] | None = None, prompt_texts: list[str] | None = None,
               prompts_file=None, scenarios=None, tol_overrides: dict[str, float] | None = None,
               seed: int = 0, max_new_tokens: int = 4, block_size: int = 4, chunk_tokens: int = 7,
               device: str = "cpu", replay: bool = True, tensor_parallel_size: int = 1,
               quantized: bool | None = None, dtype: torch.dtype = torch.float32,
               progress: Callable[[str], None] | None = None, pipeline_parallel_size: int = 1) -> ParityResult:
    """`quantized`: run the zoo side on a GGUF's blocks kept quantized (True), dequantized to float32 (False), or
    (None, `zoo run`'s default) quantized for a GGUF on the CPU in one process whose block types all have
    kernels. The reference is transformers' dequantized float32 model either way; quantized runs are judged
    with their own tolerances (parity/tolerances.py QUANTIZED).
    `dtype=torch.bfloat16`: the zoo side built in bfloat16 (the CPU's storage: compact weights and KV caches
    bfloat16, float32 math), the reference transformers float32 on the same weights with its cache reads rounded
    the same way (parity/bfloat16.py), judged with BFLOAT16 (parity/tolerances.py).
    `pipeline_parallel_size=N`: the zoo side over N pipeline stages (spawned, gloo; with `tensor_parallel_size=T`,
    N x T ranks); the served scenario only
    (PIPELINE_SCENARIOS, the default then), compared at the sampled logits and greedy tokens (PP_COMPARED).
    `scenarios` None: every one (SCENARIOS)."""
    from zoo.runtime.model_files import ModelNotFound, load_config, load_tokenizer, resolve_model

    say = progress or (lambda msg: None)
    unknown = [s for s in scenarios or () if s not in SCENARIOS]
    if unknown:
        raise ParityUsageError(f"--scenario {', '.join(unknown)}: unknown; known: {', '.join(SCENARIOS)}")
    check_parallel(tensor_parallel_size, pipeline_parallel_size, scenarios)
    if scenarios is None:
        scenarios = SCENARIOS if pipeline_parallel_size == 1 else PIPELINE_SCENARIOS
    try:
        tolerances("dense", tol_overrides)  # unknown keys fail here, before anything loads
    except ValueError as e:
        raise ParityUsageError(str(e)) from None
    from loader import LoadError, open_source
    from zoo.build import check_layers, exit_status

    torch.manual_seed(seed)
    try:
        files = resolve_model(model)
        config = load_config(files)
        tokenizer = load_tokenizer(files)
    except (ModelNotFound, OSError, ValueError, LoadError) as e:
        raise ParityUsageError(f"{model}: {type(e).__name__}: {e}") from None
    if not files.is_gguf:  # untrusted files: the loader's checks run before transformers reads any of them
        try:
            check_layers(config, open_source(files.path))
        except LoadError as e:
            if exit_status(e) == 1:
                raise ZooLoadFailure(model, e) from None
            raise ParityUsageError(f"{model}: {e}") from None
    user_given = prompts is not None or prompts_file is not None
    if prompts is None and prompts_file is not None:
        prompts, prompt_texts = read_prompts(prompts_file, tokenizer)
    elif prompts is None:
        prompts, prompt_texts = default_prompts(tokenizer, config.get_text_config().vocab_size, seed,
                                                special_ids(config, tokenizer))
    if user_given:  # refused before anything loads
        unk = getattr(tokenizer, "unk_token_id", None) if tokenizer is not None else None
        bad = {i: why for i, p in enumerate(prompts) if (why := why_degenerate(p, unk))}
        placeholders = {getattr(config, k, None) for k in ("image_token_id", "video_token_id")} - {None}
        held = next(((i, t) for i, p in enumerate(prompts) for t in p if t in placeholders), None)
        if held:  # the runtime would refuse every scenario's request: a usage error, said once
            raise ParityUsageError(f"--prompts: prompt {held[0]} holds the image placeholder id {held[1]}; these "
                                   f"scenarios run text alone (images go with --image)")
        if bad:
            raise ParityUsageError(degenerate_message(bad))
        if why := too_long(prompts, context_limit(config), reserve(max_new_tokens)):
            raise ParityUsageError(why)
    if len(prompts) < 2 and any(s in scenarios for s in ("prefill", "packing")):
        raise ParityUsageError("ragged prefill and packing need at least 2 prompts")
    bfloat16 = dtype is torch.bfloat16
    if bfloat16:
        check_bfloat16(files, device)
    elif dtype is not torch.float32:
        raise ParityUsageError(f"--dtype {_name(dtype)}: expected float32 or bfloat16")
    source, quantization = zoo_quantization(files, quantized, device, tensor_parallel_size, pipeline_parallel_size)
    if quantization["note"]:
        say(quantization["note"])

    t0 = time.perf_counter()
    with contextlib.ExitStack() as loading:
        ref_model, zoo, reference = _load_sides(model, files, config, source, dtype, device, tensor_parallel_size,
                                                loading, say, pipeline_parallel_size)
        cleanup = loading.pop_all()  # kept to the end: the zoo's tensor-parallel workers, a rounded copy
    try:
        family = zoo.spec.family
        # bfloat16's bounds are for what a rounded KV cache compounds: a model without one (Mamba2) keeps float32's
        whole = zoo.whole_model()  # (over a pipeline: every stage's modules, on meta)
        rounded = bfloat16 and has_kv_cache(whole)
        tol = tolerances(family, tol_overrides, quantized=source is not None, bfloat16=rounded)
        kept = getattr(zoo.load_report, "quantized", None) or {}
        quantization.update(weights=kept, types=_type_counts(kept))
        num_params = sum(math.prod(p.quant.shape) if getattr(p, "quant", None) is not None else p.numel()
                         for p in whole.parameters())
        inputs = plan_inputs(prompts, prompt_texts, user_given=user_given, config=config, tokenizer=tokenizer,
                             num_params=num_params, seed=seed, zoo_model=whole, reserve=reserve(max_new_tokens))
        prompts, prompt_texts = inputs.prompts, inputs.texts
        for note in inputs.notes + [f"not exercised: {n}" for n in inputs.not_exercised]:
            say(note)
        arch = (getattr(config, "architectures", None) or zoo.spec.architectures)[0]  # GGUF configs may lack it

        constants = built_constants(ref_model, whole, config, set(reference_taps(ref_model)))
        for m in constants["mismatches"]:
            say(f"built with another constant: {m}")
        ctx = _Run(ref_model, zoo, config, prompts, tol, replay, say, dict(max_new_tokens=max_new_tokens,
                   block_size=block_size, chunk_tokens=chunk_tokens, context=context_limit(config)))
        ctx.constants = constants["mismatches"]
        results: dict[str, ScenarioResult] = {}
        if bfloat16:  # (a multimodal model's language model: its vision tower keeps no cache)
            cleanup.enter_context(cache_rounded(ref_model.get_decoder()))
        for name in scenarios:
            t = time.perf_counter()
            say(f"scenario {name}")
            try:
                res = getattr(ctx, name)()
            except Exception as e:  # a crash of either side in a scenario is a finding of that scenario
                where = traceback.extract_tb(e.__traceback__)[-1]
                res = ScenarioResult(name, "crashed", False, [f"{type(e).__name__}: {e} (at {where.filename}:"
                                                              f"{where.lineno} in {where.name})"], None)
            res.info["seconds"] = round(time.perf_counter() - t, 3)
            results[name] = res
            say(f"  {name}: {'pass' if res.passed else 'DIVERGES'}")

        hints = [f"{n} diverges while prefill passes: {SCENARIO_HINTS[n]}" for n, r in results.items()
                 if not r.passed and n in SCENARIO_HINTS and results.get("prefill") is not None
                 and results["prefill"].passed]
        meta = {
            "versions": {"transformers": _version("transformers"), "torch": torch.__version__, "zoo": _version("zoo")},
            "checkpoint": str(files.path),
            "checkpoint_sha256": checkpoint_hash(files),
            "dtype": _name(dtype),
            "reference": reference,
            "tolerance_set": tolerance_set(family, quantized=source is not None, bfloat16=rounded),
            "quantization": quantization,
            "metrics_dtype": "float64",
            "device": device,
            "seed": seed,
            "block_size": block_size,
            "chunk_tokens": chunk_tokens,
            "max_new_tokens": max_new_tokens,
            "seconds": round(time.perf_counter() - t0, 3),
            "load_report": str(zoo.load_report),
            "untied": [str(t) for t in getattr(zoo.load_report, "ties", []) if not t.tied],
        }
        if zoo.tp is not None:  # (not under a pipeline: its stages' ranks are said with it)
            meta["tensor_parallel"] = {"size": tensor_parallel_size, "taps": TP_TAPS}
        if zoo.pp is not None:
            meta["pipeline_parallel"] = {"size": pipeline_parallel_size, "tensor_parallel_size": tensor_parallel_size,
                                         "compared": PP_COMPARED}
        return ParityResult(str(model), arch, family, tol, prompts, prompt_texts, results, meta, hints,
                            {"notes": inputs.notes, "exercised": inputs.exercised, "not_exercised": inputs.not_exercised},
                            constants)
    finally:
        cleanup.close()


def check_parallel(tensor_parallel_size: int, pipeline_parallel_size: int, scenarios) -> None:
    """The parallel sizes, and the scenarios a pipeline runs, refused (ParityUsageError naming the flags) before
    anything loads."""
    for flag, size in (("--tensor-parallel-size", tensor_parallel_size),
                       ("--pipeline-parallel-size", pipeline_parallel_size)):
        if not isinstance(size, int) or size < 1:
            raise ParityUsageError(f"{flag} {size}: expected 1 or more")
    tapped = [s for s in scenarios or () if s not in PIPELINE_SCENARIOS]
    if pipeline_parallel_size > 1 and tapped:
        raise ParityUsageError(f"--scenario {', '.join(tapped)} with --pipeline-parallel-size "
                               f"{pipeline_parallel_size}: these scenarios tap every module and take the head of every "
                               f"row, and stages after the first hold their layers in their own processes; over a "
                               f"pipeline parity runs {', '.join(PIPELINE_SCENARIOS)} (the default with the flag)")


def reserve(max_new_tokens: int) -> int:
    """The tokens a scenario generates past a prompt (decode and served: max_new_tokens; mixed: at least 2)."""
    return max(2, max_new_tokens)


def has_kv_cache(model) -> bool:
    """Whether a zoo model keeps a KV (or latent) cache: what its bfloat16 storage rounds and compounds."""
    from zoo.runtime.batch import CacheSpec
    from zoo.runtime.kv_cache import declared_specs

    return any(isinstance(spec, CacheSpec) for spec in declared_specs(model).values())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_bfloat16(files, device) -> None:
    """A bfloat16 run checks the CPU's bfloat16 storage (float32 activations) of a safetensors checkpoint."""
    from zoo import kernels

    if files.is_gguf:
        raise ParityUsageError(f"--dtype bfloat16: {files.name} is a GGUF file, whose blocks run quantized (the "
                               f"default) or dequantized to float32 (--dtype float32); bfloat16 parity takes a "
                               f"safetensors checkpoint")
    if str(device) != "cpu" or kernels.device_path(torch.empty(0)):
        raise ParityUsageError(f"--dtype bfloat16 checks the CPU's bfloat16 storage (float32 activations); on the "
                               f"device path (device {device}) every activation is bfloat16 too, which no float32 "
                               f"reference computes")


def _load_sides(model, files, config, source, dtype, device, tensor_parallel_size, cleanup, say,
                pipeline_parallel_size=1):
    """(transformers' model, the ZooSide, the report's reference record {"route", "rounded_tensors", "cache", "note"});
    the zoo's close and a rounded copy's removal go on `cleanup`. A failure to load either side is an environment /
    usage error, named; but a strictness failure of the zoo's loader on the checkpoint's content is a finding."""
    from loader import LoadError
    from zoo.build import exit_status

    side = "the zoo model"  # (a bfloat16 run plans the zoo model's load first)
    try:
        path, reference = files.path, {"route": "checkpoint as is", "rounded_tensors": 0, "cache": "float32",
                                       "note": "the checkpoint as it is"}
        if dtype is torch.bfloat16:
            path, reference = cleanup.enter_context(reference_checkpoint(files.path, config, say))
            reference["cache"] = "k and v rounded to bfloat16 where its attention reads them, as the zoo's cache " \
                                 "holds them"
        side = "the transformers reference"
        say(f"loading the reference (transformers, float32, eager) from {path}")
        kw = {"gguf_file": files.gguf_file} if files.is_gguf else {}
        ref_model = load_reference(files.directory if files.is_gguf else path, device=device, **kw)
        side = "the zoo model"
        if pipeline_parallel_size > 1:
            ranks = f" of {tensor_parallel_size} tensor-parallel ranks each" * (tensor_parallel_size > 1)
            say(f"building the zoo model over {pipeline_parallel_size} pipeline stages{ranks} (gloo, {_name(dtype)})")
        elif tensor_parallel_size > 1:
            say(f"building the zoo model over {tensor_parallel_size} tensor-parallel ranks (gloo, {_name(dtype)})")
        else:
            say(f"building the zoo model (build_model, {_name(dtype)}"
                f"{', GGUF blocks kept quantized' * (source is not None)})")
        zoo = ZooSide(source or path, device=device, config=config, tensor_parallel_size=tensor_parallel_size,
                      quantized=source is not None, dtype=dtype, pipeline_parallel_size=pipeline_parallel_size)
        cleanup.callback(zoo.close)  # a tensor-parallel group's workers, a pipeline's stages stop
    except LoadError as e:
        if side == "the zoo model" and exit_status(e) == 1:
            raise ZooLoadFailure(model, e) from e
        raise ParityUsageError(f"cannot load {side} from {model}: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise ParityUsageError(f"cannot load {side} from {model}: {type(e).__name__}: {e}") from e
    return ref_model, zoo, reference


def rotary_off_matches(ref_model, zoo: ZooSide, prompts, wanted, tap: str, tol, block_size) -> bool | None:
    """Prefill both sides with the rotary embedding switched off; does `tap` match then? None: cannot switch."""
    zoo_attn = [m for m in zoo.model.modules() if callable(getattr(m, "rotary_emb", None))]
    ref_rope = [m for n, m in ref_model.named_modules() if n.endswith("rotary_emb")]
    if not zoo_attn or not ref_rope:
        return None

    def identity(positions, q, k, batch=None):
        return q, k

    def no_rotation(module, args, out):  # (cos, sin) -> (1, 0): the rotation is the identity
        return (torch.ones_like(out[0]), torch.zeros_like(out[1])) if isinstance(out, tuple) else out

    saved = [(m, m.__dict__.get("rotary_emb")) for m in zoo_attn]
    handles = [m.register_forward_hook(no_rotation) for m in ref_rope]
    try:
        for m in zoo_attn:
            m.rotary_emb = identity
        zoo_run = zoo.run(prompts, wanted, block_size=block_size)
        ref_run = run_reference(ref_model, prompts, keep_layer_calls=False)
    finally:
        for h in handles:
            h.remove()
        for m, r in saved:
            if r is None:
                del m.rotary_emb
            else:
                m.rotary_emb = r
    result = next((t for t in compare(ref_run.trace, zoo_run.trace).taps if t.name == tap), None)
    return None if result is None else bool(result.worst()["rel_l2"] <= tol["rel_l2"])


class _Run:
    """One method per scenario; the reference run on the prompts and the packed zoo run are shared."""

    def __init__(self, ref_model, zoo: ZooSide, config, prompts, tol, replay, say, knobs):
        self.ref_model, self.zoo, self.config, self.prompts, self.tol = ref_model, zoo, config, prompts, tol
        self.replay, self.say, self.k = replay, say, knobs
        self.wanted = set(reference_taps(ref_model)) | {LOGITS}
        self.wanted |= {EMBEDDED} if first_layer(self.wanted) else set()
        if zoo.tp is not None:  # rank 0 holds only its part of a column-split activation: replicated points only
            self.wanted = {t for t in self.wanted if t == LOGITS or role_of(t) in TP_REPLICATED_ROLES}
        self._ref, self._packed, self._refs = None, None, {}
        self.length_dependent = length_dependent(config)

    def at_sampled_lengths(self, ref: Trace, got: Trace) -> Trace:
        """`ref` with SAMPLED rows of its own where a row depends on the length of the forward (a rope whose
        frequencies change with it: longrope, dynamic NTK): the row the zoo sampled from at position p is then
        the reference's forward over tokens 0..p, what transformers' generate computed at that step (Phi-3's
        short factors for a prompt whose decode later passes the switch), not its row of one forward over every
        token. Elsewhere causality makes the two equal and `ref` is returned as it is."""
        if not self.length_dependent or SAMPLED not in got.rows:
            return ref
        device = next(self.ref_model.parameters()).device
        rows = [x.clone() for x in ref.rows[LOGITS]]
        for r, sampled in enumerate(got.mask(SAMPLED)):
            for p in torch.nonzero(sampled).flatten().tolist():
                if p + 1 < ref.lengths[r]:
                    with torch.no_grad():
                        ids = torch.tensor([ref.tokens[r][: p + 1]], device=device)
                        rows[r][p] = self.ref_model(input_ids=ids, use_cache=False).logits[0, -1].float().cpu()
        return dataclasses.replace(ref, rows={**ref.rows, SAMPLED: rows})

    def ref_for(self, tokens):
        key = tuple(map(tuple, tokens))
        if key not in self._refs:  # decode and served usually run the reference on the same tokens
            self._refs[key] = run_reference(self.ref_model, tokens, keep_layer_calls=self.replay)
        return self._refs[key]

    def base_ref(self):
        self._ref = self._ref or self.ref_for(self.prompts)
        return self._ref

    def zoo_run(self, prompts=None, **kw):
        return self.zoo.run(self.prompts if prompts is None else prompts, self.wanted,
                            block_size=self.k["block_size"], **kw)

    def packed(self):
        self._packed = self._packed or self.zoo_run()
        return self._packed

    def judge(self, name, description, ref_run, zoo_run, *, only=None, info=None) -> ScenarioResult:
        cmp = compare(ref_run.trace, zoo_run.trace, only=only)
        fails = zoo_run.findings + verdict(cmp, self.tol)
        res = ScenarioResult(name, description, not fails, fails, cmp, info={"steps": zoo_run.num_steps, **(info or {})},
                             tol=self.tol, lengths=list(ref_run.trace.lengths))
        if cmp.missing:
            res.info["missing_taps"] = cmp.missing
        if fails:
            res.first_divergence = first_divergence(cmp, self.tol)
            self.say(f"  {name}: localising")
            res.localization = localize(self.ref_model, ref_run, ref_run.trace, zoo_run.trace, cmp.compared,
                                        self.tol, self.config, replay=self.replay)
            culprit = res.localization.culprit or {}
            built = [f"built with another constant than the reference: {m}" for m in self.constants
                     if culprit.get("block") and (m.startswith(culprit["block"] + " ") or
                                                  m.startswith(culprit["block"] + "."))]
            if name == "prefill":
                self.rank_rotary_hint(res.localization)
            res.localization.hints[:0] = [f"runtime bookkeeping, not the model: {f}" for f in zoo_run.findings[:3]] + built
        return res

    def rank_rotary_hint(self, loc: Localization) -> None:
        """'Position 0 matches, later ones do not' fits every query/key-side bug (position 0 attends only to
        itself). Test it: run the prefill again with the rotary embedding off on both sides (identity on the
        zoo's attention modules, cos = 1 and sin = 0 from the reference's rotary modules); the culprit tap
        matching then confirms the rotary embedding, still differing rules it out."""
        guess = next((h for h in loc.hints if "position 0 matches and later positions do not" in h), None)
        if guess is None or self.zoo.tp is not None:  # (the workers would rotate: the test runs on one process)
            return
        tap = loc.culprit["tap"]
        matches = rotary_off_matches(self.ref_model, self.zoo, self.prompts, self.wanted, tap, self.tol,
                                     self.k["block_size"])
        if matches is None:  # no rotary to switch off on one side: the guess stays, unconfirmed
            return
        i = loc.hints.index(guess)
        if matches:
            loc.hints.insert(0, loc.hints.pop(i) + "; confirmed: with the rotary embedding off on both sides "
                                                   f"{short(tap)} matches")
        else:
            loc.hints[i] = (f"{short(tap)}: with the rotary embedding off on both sides it still differs, so not the "
                            f"rotary embedding: the attention scale (query_pre_attn_scalar, head_dim), q/k norm, "
                            f"softcapping or the q/k projections")

    @staticmethod
    def require(res: ScenarioResult, ok: bool, failure: str) -> ScenarioResult:
        if not ok:
            res.failures.append(failure)
            res.passed = False
        return res

    # -- the scenarios -----------------------------------------------------------------------------------
    def prefill(self) -> ScenarioResult:
        run = self.packed()
        res = self.judge("prefill", f"{len(self.prompts)} prompts of {', '.join(str(len(p)) for p in self.prompts)} "
                                    f"tokens in one flattened step", self.base_ref(), run)
        return self.require(res, run.num_steps == 1, f"expected one step for the ragged batch, the scheduler ran "
                                                     f"{run.num_steps}")

    def decode(self) -> ScenarioResult:
        n = self.k["max_new_tokens"]
        run = self.zoo_run(max_tokens=n)
        decoded = [torch.arange(length) >= len(p) for length, p in zip(run.trace.lengths, self.prompts)]
        ref = self.ref_for(run.trace.tokens)
        ref = dataclasses.replace(ref, trace=self.at_sampled_lengths(ref.trace, run.trace))
        return self.judge("decode", f"{n - 1} greedy decode steps after prefill through the paged cache (block size "
                                    f"{self.k['block_size']}), reference run on the same tokens",
                          ref, run, only=decoded, info={"generated": run.outputs})

    def mixed(self) -> ScenarioResult:
        n = reserve(self.k["max_new_tokens"])  # each prompt arrives while the one before it still decodes
        run = self.zoo_run(max_tokens=n, stagger=True)
        ref = self.ref_for(run.trace.tokens)
        ref = dataclasses.replace(ref, trace=self.at_sampled_lengths(ref.trace, run.trace))
        kinds = [{"decode" if start >= len(self.prompts[int(r)]) else "prefill" for r, start, _ in segs}
                 for segs in run.segments]
        both = sum(k == {"decode", "prefill"} for k in kinds)
        res = self.judge("mixed", f"one prompt arriving per step while the earlier ones decode ({both} steps hold "
                                  f"decode and prefill rows), every position, reference run on the same tokens",
                         ref, run, info={"mixed_steps": both, "generated": run.outputs})
        return self.require(res, both > 0, "no step held both decode rows and prefill rows")

    def chunked(self) -> ScenarioResult:
        budget = self.k["chunk_tokens"]
        run = self.zoo_run(max_num_batched_tokens=budget)
        res = self.judge("chunked", f"prefill in chunks of at most {budget} tokens per step", self.base_ref(), run)
        return self.require(res, run.num_steps > 1, f"a budget of {budget} tokens did not split the prefill")

    def prefix(self) -> ScenarioResult:
        """The longest prompt, then another prompt and the longest extended by it, together: the extended one
        starts from cached blocks, and a recurrent model's state snapshot restores into a state slot of another
        index (the other prompt, added first, takes slot 0), so a restore that mixes the two indices shows."""
        first = max(self.prompts, key=len)
        other = next((p for p in self.prompts if p is not first), None)
        room = self.k["context"] - 1 if self.k["context"] else None  # the extended prompt and its token fit
        if room is not None and len(first) + len(other or first) > room:  # a model of few positions
            first = first[: max(1, room - min(len(other or first), room // 2))]
            other = other[: max(1, room - len(first))] if other is not None else None
        extended = [first, other, first + other] if other is not None else [first, first + first]
        waves = [[0], list(range(1, len(extended)))]
        run = self.zoo_run(extended, enable_prefix_caching=True, waves=waves)
        last_only = [torch.full((len(p),), k == len(extended) - 1) for k, p in enumerate(extended)]
        hit = run.cached_tokens.get(len(extended) - 1, 0)
        res = self.judge("prefix", f"a {len(first)}-token prompt, then the same extended to {len(extended[-1])} tokens "
                                   f"with prefix caching (block size {self.k['block_size']})"
                                   + (", beside another prompt" if len(extended) == 3 else ""),
                         self.ref_for(extended), run, only=last_only,
                         info={"cached_tokens": hit, **({"state_restores": run.restores} if run.restores else {})})
        self.require(res, not run.restores or any(snap != slot for snap, slot in run.restores),
                     f"the state snapshot restored and the state slot it went to have the same index "
                     f"({run.restores}): a restore that mixes them up would not show")
        return self.require(res, hit > 0, f"no prefix-cache hit: the second request computed all "
                                          f"{len(extended[-1])} tokens")

    def served(self) -> ScenarioResult:
        n = self.k["max_new_tokens"]
        run = self.zoo.serve(self.prompts, max_tokens=n, block_size=self.k["block_size"])
        ref = self.at_sampled_lengths(self.ref_for(run.trace.tokens).trace, run.trace)
        logits_only = Trace(order=[], lengths=ref.lengths, have=ref.have, tokens=ref.tokens,
                            rows={k: ref.rows[k] for k in (LOGITS, SAMPLED) if k in ref.rows})
        cmp = compare(logits_only, run.trace)
        fails = run.findings + verdict(cmp, self.tol)
        sampled = ref.rows.get(SAMPLED, ref.rows[LOGITS])
        for r, p in enumerate(self.prompts):  # each greedy token = the reference's argmax where it is decisive
            for j, token in enumerate(run.outputs.get(r, [])):
                want = sampled[r][len(p) + j - 1] if len(p) + j - 1 < ref.lengths[r] else None
                if want is None:
                    continue
                top2 = want.double().topk(2).values
                if int(want.argmax()) != token and top2[0] - top2[1] > self.tol["top1_margin"]:
                    fails.append(f"greedy token: request {r} output {j} (position {len(p) + j}) is {token}, the "
                                 f"reference's argmax {int(want.argmax())}")
        fused = run.fused_steps
        how = (f"the fused native step ran {sum(fused)} of {run.num_steps} steps" if fused
               else "the module path (no fused step for this model or device)")
        res = ScenarioResult("served", f"{n} greedy tokens per prompt with no hooks on the model: {how}", not fails,
                             fails, cmp, first_divergence(cmp, self.tol) if fails else None,
                             info={"steps": run.num_steps, "fused_steps": sum(fused), "generated": run.outputs},
                             tol=self.tol, lengths=list(ref.lengths))
        return res

    def packing(self) -> ScenarioResult:
        alone = self.zoo_run(waves=[[r] for r in range(len(self.prompts))])
        cmp = compare(alone.trace, self.packed().trace)
        tol = {**self.tol, "rel_l2": self.tol["packing"]}
        fails = verdict(cmp, tol)
        return ScenarioResult("packing", "each prompt alone vs all packed together (zoo vs zoo)", not fails, fails, cmp,
                              first_divergence(cmp, tol) if fails else None, info={"steps": alone.num_steps},
                              tol=tol, lengths=list(alone.trace.lengths))
