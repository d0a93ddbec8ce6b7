"""LLM: the Python API.

    from zoo import LLM, SamplingParams
    llm = LLM()                                   # the embedded default model (SmolLM2-135M-Instruct)
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    for delta in llm.stream("Once upon a time", SamplingParams(max_tokens=32)):
        print(delta.delta_text, end="", flush=True)
"""
from __future__ import annotations

import time
from typing import Callable, Iterator, Sequence

import torch

from zoo.runtime.engine import LLMEngine, RequestOutput
from zoo.runtime.model_files import (load_config, load_generation_config, load_tokenizer, resolve_model)
from zoo.runtime.sampling_params import SamplingParams

Prompt = str | list[int]


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating-point torch dtype (float32, bfloat16, float16)")
    return value


class LLM:
    def __init__(self, model: str | None = None, *, dtype="float32", device="cpu", num_blocks: int | None = None,
                 kv_cache_memory: int | None = None, block_size: int = 16, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 64, max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 progress: Callable[[str], None] | None = None):
        from zoo.build import build_model  # the model side (layers, plugins, loader) loads with the LLM

        say = progress or (lambda msg: None)
        t0 = time.perf_counter()
        self.files = resolve_model(model)
        say(f"reading config and tokenizer of {self.files.name}")
        config = load_config(self.files)
        self.tokenizer = load_tokenizer(self.files)
        say(f"loading weights of {self.files.name}")
        self.model, self.config, self.spec, self.load_report = build_model(
            self.files.path, dtype=_dtype(dtype), device=device, config=config)
        self.engine = LLMEngine(
            self.model, self.config, self.tokenizer, model_id=self.files.model_id,
            generation_config=load_generation_config(self.files), num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            device=device)
        self.load_seconds = time.perf_counter() - t0

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an engine built by hand (tests, benchmarks)."""
        self = cls.__new__(cls)
        self.engine, self.tokenizer, self.model, self.config = engine, engine.tokenizer, engine.model, engine.config
        return self

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat (list of {"role", "content"}) with the generation prompt appended."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _add(self, prompts, params) -> list[str]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(params, (list, tuple)):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        return [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run all prompts to completion (continuously batched); outputs in the order of the prompts."""
        ids = self._add(prompts, params)
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in ids:
                if rid not in final:
                    self.engine.abort_request(rid)
            raise
        return [final[i] for i in ids]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Yield each step's RequestOutput (delta_text / delta_token_ids, and the totals so far)."""
        ids = self._add(prompts, params)
        left = set(ids)
        try:
            while left:
                for out in self.engine.step():
                    if out.finished:
                        left.discard(out.request_id)
                    yield out
        finally:
            for rid in left:
                self.engine.abort_request(rid)
