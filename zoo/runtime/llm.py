"""LLM: the Python API.

    from zoo import LLM, SamplingParams
    llm = LLM()                                   # the embedded default model (SmolLM2-135M-Instruct)
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)               # vLLM's shape; outs[0].text is the same (the first sample)
    outs = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(n=2, temperature=0.8, seed=1))
    for delta in llm.stream("Once upon a time", SamplingParams(max_tokens=32)):
        print(delta.delta_text, end="", flush=True)
"""
from __future__ import annotations

import contextlib
import dataclasses
import numbers
import threading
import time
from typing import Callable, Iterator, Sequence

import torch

from zoo.runtime import chat_template
from zoo.runtime.engine import LLMEngine, RequestOutput, learned_positions
from zoo.runtime.model_files import (load_config, load_generation_config, load_processor, load_tokenizer,
                                     resolve_model, resolve_tokenizer)
from zoo.runtime.sampling_params import SamplingParams

Prompt = str | list[int] | dict  # a dict as vLLM's: {"prompt" or "prompt_token_ids", "multi_modal_data": {"image"}}


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating-point torch dtype (float32, bfloat16, float16)")
    return value


def check_device(device) -> torch.device:
    """`device` as a torch.device this process can use; a ValueError naming it otherwise (never torch's assert)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a torch device (cpu, cuda, cuda:1): {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: no CUDA device here (torch {torch.__version__}"
                             f"{', a CPU-only build' if torch.version.cuda is None else ''})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r}: the zoo runs on cpu or cuda")
    return dev


def check_max_model_len(max_model_len: int | None, spec, config) -> None:
    """The LLM's check, before any weight is read, of the model class the spec names (engine.learned_positions)."""
    learned_positions(max_model_len, spec.model_class, config, spec.architectures[0])


class LLM:
    def __init__(self, model: str | None = None, *, dtype=None, device="cpu", num_blocks: int | None = None,
                 kv_cache_memory: int | None = None, block_size: int = 16, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 64, max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 encoder_cache_rows: int | None = None, progress: Callable[[str], None] | None = None,
                 tensor_parallel_size: int = 1, tokenizer: str | None = None, revision: str | None = None,
                 check: Callable[["LLM"], None] | None = None, gpu_memory_utilization: float = 0.9,
                 quantization: str | None = "auto", pipeline_parallel_size: int = 1):
        """`tokenizer`: a tokenizer directory, .gguf or hub id to use instead of the model's (vLLM's); `revision`:
        the hub id's branch, tag or commit. Everything that needs no weight is checked before a weight is read:
        the files, the config, the tokenizer, the architecture and the plugin's own validation of the config; then
        `check(self)` (self.files, self.config, self.spec, self.tokenizer set), which may raise to stop; then
        max_model_len against the positions a model with learned positions has (check_max_model_len).
        `quantization="gguf"` (vLLM's name for it): a GGUF file's block-quantised weights stay quantised and run on
        the block kernels (the CPU, float32 activations); None dequantises them to `dtype`; "auto" (the default, as
        `zoo run` and vLLM detect a GGUF's quantization): "gguf" for a GGUF file given no `dtype`, run on the CPU by
        one process whose block types all have kernels, else None (a llama.cpp Q4_K_M file may hold Q5_0 tensors:
        it is dequantised, and `progress` says so). `dtype` None: float32 (a GGUF kept quantized: float32
        activations); a dtype given dequantizes a GGUF to it, as `zoo run --dtype` does.
        `pipeline_parallel_size=N`: the decoder layers split into N contiguous stages, stages 1.. spawned here (or
        launched by torchrun), each reading only its tensors (zoo/runtime/pipeline.py); with tensor_parallel_size=T
        too, each stage is T ranks that split its layers (N x T processes)."""
        from registry import get_registry
        from zoo.build import build_model  # the model side (layers, plugins, loader) loads with the LLM

        if quantization not in (None, "gguf", "auto"):
            raise ValueError(f"quantization={quantization!r}: expected None, 'gguf' or 'auto'")
        device = check_device(device)
        if not isinstance(pipeline_parallel_size, int) or pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size!r}: expected an int >= 1")
        if tensor_parallel_size != 1 or pipeline_parallel_size != 1:
            from zoo.runtime.distributed import launched, run_worker
            from zoo.runtime.pipeline import run_stage

            env = launched()
            if env is not None and env[0] > 0:  # torchrun: this rank serves rank 0's steps, then the process ends
                path, kind = resolve_model(model, revision=revision).path, _dtype(dtype or "float32")
                raise SystemExit(run_stage(path, dtype=kind, tp=tensor_parallel_size) if pipeline_parallel_size > 1
                                 else run_worker(path, dtype=kind))
        say = progress or (lambda msg: None)
        t0 = time.perf_counter()
        self.files = resolve_model(model, revision=revision)
        source = None  # (auto: the GGUF source opened to see its block types, handed to build_model)
        if quantization == "auto":
            quantization = "gguf" if (self.files.is_gguf and tensor_parallel_size == 1 and pipeline_parallel_size == 1
                                      and device.type == "cpu" and dtype is None) else None
            if quantization == "gguf":
                source, kinds = open_quantized(self.files.path)
                if kinds:
                    say(f"{self.files.name} holds {', '.join(kinds)} tensors, which zoo has no quantized kernels "
                        f"for: dequantized to float32")
                    source.close()
                    source, quantization = None, None
        dtype = "float32" if dtype is None else dtype
        if quantization == "gguf" and not self.files.is_gguf:
            raise ValueError(f"quantization='gguf' keeps a GGUF file's blocks; {self.files.name} is not a GGUF file")
        if quantization == "gguf" and (tensor_parallel_size != 1 or pipeline_parallel_size != 1
                                       or _dtype(dtype) is not torch.float32 or device.type != "cpu"):
            raise ValueError("quantization='gguf' runs on the CPU with dtype float32, tensor_parallel_size 1 and "
                             "pipeline_parallel_size 1")
        self.quantization = quantization
        say(f"reading config and tokenizer of {self.files.name}")
        config = load_config(self.files, light=True)  # (a GGUF's cached config: no transformers config import)
        self.tokenizer = load_tokenizer(resolve_tokenizer(tokenizer) if tokenizer is not None else self.files)
        self.config, self.spec = config, get_registry().resolve(config)  # an unsupported architecture: here
        if self.spec.validate is not None:
            from zoo.build import validate_spec

            validate_spec(self.spec, config)
        if check is not None:
            check(self)
        check_max_model_len(max_model_len, self.spec, config)
        say(f"loading weights of {self.files.name}")
        self.tp_group = None  # the ranks' group: tensor parallel, or a pipeline's (attach, close, rank_stats alike)
        if pipeline_parallel_size != 1:  # stages 1.. spawned here, each loading its layers' tensors
            from zoo.runtime.pipeline import PipelineGroup

            if str(device) != "cpu":
                raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} runs on gloo: device must be 'cpu'")
            self.tp_group = PipelineGroup(self.files.path, pipeline_parallel_size, dtype=_dtype(dtype),
                                          tp=tensor_parallel_size)
            group = self.tp_group
            self.model, self.config, self.spec, self.load_report = group.model, group.config, group.spec, \
                group.load_report
        elif tensor_parallel_size != 1:  # ranks 1.. spawned here, each loading its slices (zoo/runtime/distributed.py)
            from zoo.runtime.distributed import TensorParallelGroup

            if str(device) != "cpu":
                raise ValueError(f"tensor_parallel_size={tensor_parallel_size} runs on gloo: device must be 'cpu'")
            self.tp_group = TensorParallelGroup(self.files.path, tensor_parallel_size, dtype=_dtype(dtype))
            group = self.tp_group
            self.model, self.config, self.spec, self.load_report = group.model, group.config, group.spec, \
                group.load_report
        else:
            self.model, self.config, self.spec, self.load_report = build_model(
                source or self.files.path, dtype=_dtype(dtype), device=device, config=config,
                quantized=quantization == "gguf")
        self.engine = LLMEngine(
            self.model, self.config, self.tokenizer, model_id=self.files.model_id,
            generation_config=load_generation_config(self.files), num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            device=device, processor=load_processor(self.files) if self.spec.family == "multimodal" else None,
            encoder_cache_rows=encoder_cache_rows, gpu_memory_utilization=gpu_memory_utilization,
            pool_specs=getattr(self.tp_group, "pool_specs", None))  # (a pipeline: sized for its costliest stage)
        if self.tp_group is not None:
            self.tp_group.attach(self.engine)
        self.load_seconds = time.perf_counter() - t0

    def close(self) -> None:
        """Stop the tensor-parallel ranks this LLM spawned (nothing to do for one process)."""
        if getattr(self, "tp_group", None) is not None:
            self.tp_group.close()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an engine built by hand (tests, benchmarks)."""
        self = cls.__new__(cls)
        self.engine, self.tokenizer, self.model, self.config = engine, engine.tokenizer, engine.model, engine.config
        return self

    def apply_chat_template(self, messages: list[dict], *, seconds: float = chat_template.SECONDS,
                            tools: list[dict] | None = None) -> list[int]:
        """Token ids of a chat (list of {"role", "content"}) with the generation prompt appended; `tools`: OpenAI's
        tool definitions, rendered by the template (assistant messages' tool_calls arguments may be JSON strings, as
        OpenAI sends them). A template that fails or does not finish within `seconds` is a ValueError
        (zoo.runtime.chat_template)."""
        from zoo.runtime.tools import for_template

        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        if tools is not None and not isinstance(tools, list):
            raise ValueError(f"tools must be a list of tool definitions, not {type(tools).__name__}")
        files = getattr(self, "files", None)
        return chat_template.apply_chat_template(self.tokenizer, for_template(messages), seconds=seconds,
                                                 name=files.name if files is not None else "the model", tools=tools)

    def get_tokenizer(self):
        return self.tokenizer

    def _add(self, prompts, params) -> list[list[str]]:
        """Add every prompt, or none: a prompt refused (too long, a bad token id) aborts those added before it.
        Per prompt, the ids of its SamplingParams.n requests (sample i with seed + i when seeded)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], numbers.Number)):
            prompts = [prompts]
        if not isinstance(params, (list, tuple)):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        added: list[str] = []
        groups: list[list[str]] = []
        try:
            for p, sp in zip(prompts, params):
                samples = [sp] if sp is None or sp.n == 1 else [
                    dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + i) for i in range(sp.n)]
                groups.append([])
                for one in samples:
                    added.append(self._add_one(p, one))
                    groups[-1].append(added[-1])
        except BaseException:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return groups

    def _add_one(self, prompt: Prompt, params: SamplingParams) -> str:
        if not isinstance(prompt, dict):
            return self.engine.add_request(prompt, params)
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(f"a prompt dict holds 'prompt' (text) or 'prompt_token_ids', and optionally "
                             f"'multi_modal_data'; got keys {sorted(prompt)}")
        data = prompt.get("multi_modal_data") or {}
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"multi_modal_data: only {{'image': image or list of images}} is supported; got "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        text = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
        return self.engine.add_request(text, params, images=data.get("image"))

    @contextlib.contextmanager
    def _exclusive(self):
        """One generate / stream at a time: another thread waits for its turn; the same thread calling in again
        (generate inside a stream's loop) would step the stream's requests for it, so it is refused."""
        lock = self.__dict__.setdefault("_lock", threading.Lock())  # (from_engine skips __init__)
        if self.__dict__.get("_owner") == threading.get_ident():
            raise RuntimeError("this thread is already running a generate or stream of this LLM (a stream not yet "
                               "finished?): finish or close it first; one LLM serves one call at a time")
        with lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run all prompts to completion (continuously batched); outputs in the order of the prompts, each
        with `outputs` (SamplingParams.n CompletionOutputs; the first one's fields also on the output itself).

        Thread-safe: calls from several threads run one after another. On an error (a refused prompt, an
        exception in a step, KeyboardInterrupt) every request of this call is aborted, its KV blocks freed."""
        with self._exclusive():
            groups = self._add(prompts, sampling_params)
            ids = [rid for group in groups for rid in group]
            mine, final = set(ids), {}
            try:
                while len(final) < len(ids):
                    for out in self.engine.step(finished_only=True):
                        if out.request_id in mine:  # (requests added to the engine directly
                            final[out.request_id] = out  # are stepped too, but not returned)
            except BaseException:
                for rid in ids:
                    if rid not in final:
                        self.engine.abort_request(rid)
                raise
            return [_merged([final[rid] for rid in group]) for group in groups]

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of {"role", "content"}) or to each of a
        list of them, through the model's chat template. Image parts in a message's content ({"type": "image",
        "image": a path or PIL image}, vLLM's "image_url" with a path or a data: URL) become the model's image
        tokens and go with the prompt (zoo.runtime.multimodal.chat_images). `tools` (OpenAI's definitions) are
        rendered by the template, as vLLM's LLM.chat does; the reply is text (zoo.runtime.tools.ToolCalls parses
        it, as zoo serve does)."""
        from zoo.runtime.multimodal import chat_images

        one = isinstance(messages, (list, tuple)) and (not messages or isinstance(messages[0], dict))
        prompts = []
        for chat in [messages] if one else list(messages):
            rendered, images = chat_images(list(chat))
            ids = self.apply_chat_template(rendered, tools=tools)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids)
        return self.generate(prompts, sampling_params)

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Yield each step's RequestOutput (delta_text / delta_token_ids, and the totals so far) of these prompts.

        Holds the LLM until the stream is exhausted or closed: other threads' calls wait."""
        with self._exclusive():
            left = {rid for group in self._add(prompts, sampling_params) for rid in group}
            try:
                while left:
                    for out in self.engine.step():
                        if out.request_id not in left:
                            continue
                        if out.finished:
                            left.discard(out.request_id)
                        yield out
            finally:
                for rid in left:
                    self.engine.abort_request(rid)


def _merged(samples: list[RequestOutput]) -> RequestOutput:
    """The n samples of one prompt as one RequestOutput (the first sample's, with every sample in `outputs`)."""
    if len(samples) == 1:
        return samples[0]
    return dataclasses.replace(samples[0], samples=[dataclasses.replace(s.outputs[0], index=i)
                                                    for i, s in enumerate(samples)])


def open_quantized(path):
    """(the GGUF source opened with its blocks kept, the block types in it without quantized kernels)."""
    import re

    import loader

    source = loader.open_source(path, strict=False, quantized=True)
    kinds = {m[1] for p in getattr(source, "problems", ()) if p.kind == "dtype"
             and (m := re.search(r" is (\w+), which zoo cannot run quantized", p.detail))}
    return source, sorted(kinds)
