"""LLMEngine: requests in, one scheduled + executed + sampled + detokenised step at a time.

    engine = LLMEngine(model, config, tokenizer, num_blocks=64)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...   # RequestOutput with the step's delta and the text so far

Not thread-safe: one thread drives an engine (zoo.LLM serialises its callers' generate / stream calls).
Bad input is refused at add_request (ValueError naming the field), never inside step().
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch

from zoo.layers.rotary import long_rope_past
from zoo.runtime.detokenizer import IncrementalDetokenizer
from zoo.runtime.kv_cache import (DEFAULT_KV_MEMORY, KVCacheManager, bytes_per_token, cache_specs, device_kv_budget,
                                  num_blocks_for)
from zoo.runtime.model_runner import ModelRunner
from zoo.runtime.multimodal import MultiModal, placeholder_ranges
from zoo.runtime.request import Request, RequestStatus
from zoo.runtime.sampling_params import SamplingParams
from zoo.runtime.scheduler import Scheduler
from zoo.runtime.state_pool import StateSlots, StateSnapshots, bytes_per_request, state_specs


NON_FINITE = "the model's logits are NaN or infinite (non-finite weights, or a config that overflows)"


@dataclass
class CompletionOutput:
    """One sample of a request, as vLLM's CompletionOutput (logprobs: token id -> raw logprob per token)."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(d[t] for d, t in zip(self.logprobs, self.token_ids))


@dataclass
class RequestOutput:
    """A request's state after a step. vLLM's shape (`outputs[i].text`) and, for its first sample, the same
    fields on the output itself (`out.text`, `out.token_ids`)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # all text so far (held-back text excluded)
    token_ids: list[int]  # all output tokens so far (a stop token id included)
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop", "length", "abort", "error" (NaN / Inf logits) or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string (NON_FINITE with "error")
    delta_text: str = ""  # new this step
    delta_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache on admission
    num_preemptions: int = 0
    samples: list[CompletionOutput] | None = None  # SamplingParams.n > 1: every sample (LLM.generate fills it)
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, then {token: raw logprob, top-n ...}
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        if self.samples is not None:
            return self.samples
        return [CompletionOutput(0, self.text, self.token_ids, self.logprobs, self.finish_reason, self.stop_reason)]


def eos_token_ids(config, tokenizer=None, generation_config=None) -> set[int]:
    """EOS ids from the generation config, else the model config, else the tokenizer."""
    for source in (generation_config, config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
    eos = getattr(tokenizer, "eos_token_id", None)
    return {eos} if eos is not None else set()


def vocab_size(config) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def token_ids(prompt, vocab: int | None, what: str) -> list[int]:
    """The prompt as a list of ints in [0, vocab): a ValueError naming the first bad one (a float, a bool, out of
    range), never an error inside a later step."""
    if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):  # a tensor or an array
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple, range)):
        raise ValueError(f"{what} must be a string or a list of token ids, got {type(prompt).__name__}")
    ids = list(prompt)
    if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and (vocab is None or max(ids) < vocab))):
        return ids  # (the common case, without a Python loop body per token)
    for i, t in enumerate(ids):
        if type(t) is not int:
            try:
                if isinstance(t, bool):
                    raise TypeError
                ids[i] = t = operator.index(t)
            except TypeError:
                raise ValueError(f"{what} token {i} is {t!r}: token ids must be integers") from None
        if t < 0 or (vocab is not None and t >= vocab):
            raise ValueError(f"{what} token {i} is {t}, outside the vocabulary of {vocab} tokens")
    return ids


def bad_words_token_ids(tokenizer, words: list[str], vocab: int | None) -> list[list[int]]:
    """The token sequences SamplingParams.bad_words ban, as vLLM tokenises them: each word (its leading spaces
    stripped) alone, and with one leading space when that gives a different first token in as many tokens (the
    word inside a text); no special tokens. A word that encodes to nothing or past the vocabulary: ValueError."""
    out = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ValueError(f"SamplingParams.bad_words: {word!r} encodes to no tokens")
        out.append(list(bare))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(list(spaced))
    for ids in out:
        if vocab is not None and max(ids) >= vocab:
            raise ValueError(f"SamplingParams.bad_words: token {max(ids)} of {tokenizer.decode(ids)!r} is outside the "
                             f"vocabulary of {vocab} tokens")
    return out


def learned_positions(max_model_len: int | None, model_class: Callable[[], type], config, name: str) -> None:
    """A model class with `learned_positions = True` (GPT-2) looks each position up in a table of
    config.max_position_embeddings rows: a longer max_model_len is a ValueError naming it (before any weight is
    read, from the LLM), not an IndexError mid-generation (rotary positions go on past that length: other models
    take any). `model_class()` is called only for a max_model_len past that length (the LLM imports a plugin's
    class there; one that does not import says so where the model is built)."""
    limit = getattr(config, "max_position_embeddings", None)
    if max_model_len is not None and isinstance(limit, int) and max_model_len > limit \
            and getattr(model_class(), "learned_positions", False):
        raise ValueError(f"max_model_len={max_model_len}: {name} learned {limit} positions "
                         f"(max_position_embeddings) and embeds none past them")


class LLMEngine:
    def __init__(self, model: torch.nn.Module, config, tokenizer=None, *, model_id: str = "",
                 generation_config=None, num_blocks: int | None = None, kv_cache_memory: int | None = None,
                 block_size: int = 16, max_num_batched_tokens: int = 2048, max_num_seqs: int = 64,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 device: torch.device | str | None = None, num_state_slots: int | None = None,
                 num_state_snapshots: int | None = None, processor=None, encoder_cache_rows: int | None = None,
                 gpu_memory_utilization: float = 0.9, pool_specs: tuple[dict, dict] | None = None):
        """`pool_specs`: the (KV cache specs, recurrent state specs) that size the pools when other processes hold
        other layers under this engine's block tables and slots (a pipeline's stages: each the costliest stage's, so
        the budget holds on every stage); None: the model's own."""
        sizes = dict(num_blocks=num_blocks, kv_cache_memory=kv_cache_memory, block_size=block_size,
                     max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                     max_model_len=max_model_len)
        for name, value in sizes.items():
            if value is not None and (isinstance(value, bool) or not hasattr(value, "__index__") or value < 1):
                raise ValueError(f"LLMEngine: {name}={value!r} must be a positive integer")
        learned_positions(max_model_len, lambda: type(model), config, type(model).__name__)
        self.model = model.eval()
        self.config = config
        self.tokenizer = tokenizer
        if device is None:
            device = next(model.parameters()).device
        specs, self.state_specs = cache_specs(model), state_specs(model)
        pool_kv, pool_states = pool_specs or (specs, self.state_specs)
        if torch.device(device).type == "cuda" and num_blocks is None and kv_cache_memory is None and pool_kv:
            kv_cache_memory = device_kv_budget(device, gpu_memory_utilization)  # what the fraction leaves
        # hybrid / SSM models: a recurrent state slot per running request (max_num_seqs of them by default)
        num_state_slots = (num_state_slots or max_num_seqs) if pool_states else 0
        # ... and, with prefix caching, as many snapshots of states at block boundaries (by default)
        num_state_snapshots = (num_state_snapshots or num_state_slots) \
            if pool_states and enable_prefix_caching else 0
        model_len = max_model_len or getattr(config, "max_position_embeddings", None) or 4096
        if num_blocks is None:
            wanted = -(-model_len * max_num_seqs // block_size)  # enough for every sequence at full length
            # (a model without attention layers has blocks that cost nothing: they only count tokens)
            num_blocks = min(wanted, num_blocks_for(pool_kv, block_size, kv_cache_memory or DEFAULT_KV_MEMORY)) \
                if pool_kv else wanted
        self.max_model_len = min(model_len, num_blocks * block_size)  # a request always fits the pool alone
        dtypes = sorted({str(s.dtype) for s in specs.values()})
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=enable_prefix_caching,
                                 namespace=f"{model_id}|{','.join(dtypes)}",
                                 state_slots=StateSlots(num_state_slots) if pool_states else None,
                                 state_snapshots=StateSnapshots(num_state_snapshots) if num_state_snapshots else None,
                                 long_rope_past=long_rope_past(model))
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens=max_num_batched_tokens,
                                   max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)
        self.runner = ModelRunner(model, specs, num_blocks, block_size, device=device, state_specs=self.state_specs,
                                  num_state_slots=num_state_slots, num_state_snapshots=num_state_snapshots)
        # images: the checkpoint's processor (AutoProcessor) and an encoder cache of encoder_cache_rows rows
        self.mm = MultiModal(model, processor, tokenizer=tokenizer, encoder_cache_rows=encoder_cache_rows) \
            if MultiModal.supports(model) else None
        self.runner.mm = self.mm
        self.kv_bytes_per_token = bytes_per_token(pool_kv)
        self.state_bytes_per_request = bytes_per_request(pool_states)
        self.eos_token_ids = eos_token_ids(config, tokenizer, generation_config)
        self.vocab_size = vocab_size(config)  # the logits' width: token ids at or past it are refused on arrival
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.grammars = None  # structured outputs' compiler (zoo.runtime.structured.Grammars), built on first use
        self._ids = itertools.count()
        self.num_steps = 0

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, cache_salt: str | None = None, images=None) -> str:
        """`images`: one image or a list (PIL images, paths, bytes, arrays) for a model that takes them; a text
        prompt then goes through the model's processor, which expands each image token into its placeholders."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params={params!r}: expected a SamplingParams")
        text, items = None, None
        request_id = str(next(self._ids)) if request_id is None else request_id
        if images is not None and not (isinstance(images, (list, tuple)) and not images):
            if self.mm is None:
                raise ValueError(f"request {request_id!r}: {type(self.model).__name__} takes no images")
            text = prompt if isinstance(prompt, str) else None
            prompt, items = self.mm.process(request_id, prompt, images)
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or give the engine a tokenizer")
            text, prompt = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        prompt = token_ids(prompt, self.vocab_size, f"request {request_id!r}: prompt")
        if self.vocab_size is not None:
            params.check_vocab(self.vocab_size)
        if self.mm is not None and not items:  # image placeholders without images
            placeholder_ranges(list(prompt), self.mm.image_token_id, [], request_id)
        req = Request(request_id, list(prompt), params, eos_token_ids=self.eos_token_ids, cache_salt=cache_salt,
                      prompt=text, mm_items=items)
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError(f"request {request_id!r}: SamplingParams.bad_words needs a tokenizer")
            req.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words, self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer")
        if params.structured_outputs is not None:
            req.grammar = self.grammar_matcher(params.structured_outputs, request_id)
        self.scheduler.add_request(req)
        if self.tokenizer is not None:
            self.detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, stop=params.stop, skip_special_tokens=params.skip_special_tokens,
                min_tokens=params.min_tokens, include_stop=params.include_stop_str_in_output)
        return request_id

    def grammar_matcher(self, spec, request_id: str):
        """A new matcher of `spec` (StructuredOutputsParams) over this engine's vocabulary (compiled once)."""
        if self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: SamplingParams.structured_outputs needs a tokenizer")
        return self.grammars_for(spec).matcher(spec)

    def grammars_for(self, spec):
        """The engine's compiler with `spec` compiled (a ValueError naming the field when it does not compile)."""
        if self.tokenizer is None:
            raise ValueError("SamplingParams.structured_outputs needs a tokenizer")
        if self.grammars is None:
            from zoo.runtime.structured import Grammars

            self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.grammars.compile(spec)
        return self.grammars

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.detokenizers.pop(request_id, None)
        if self.mm is not None:
            self.mm.release(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ----------------------------------------------------------------------------------
    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Schedule, run and sample one step: each of its sampling requests' RequestOutput. finished_only (LLM.generate):
        only those of the requests that finished; the others' tokens wait to be detokenised until they finish (or
        until a step returns their output), unless they have stop strings to look for."""
        out = self.scheduler.schedule()
        if out.empty:
            if self.scheduler.has_unfinished():
                head = self.scheduler.waiting[0]
                raise RuntimeError(f"nothing could be scheduled: request {head.request_id!r} ({head.num_tokens} "
                                   f"tokens) does not fit the KV pool of {self.kv.pool.num_blocks} blocks of "
                                   f"{self.kv.block_size} tokens; raise num_blocks")
            return []
        self.num_steps += 1
        reqs, sampled = self.runner.execute(out, self.kv)
        tokens, broken = {}, []
        for i, req in enumerate(reqs):
            if sampled.token_ids[i] is None:  # non-finite logits: the request ends, the others go on
                broken.append(req)
                continue
            tokens[req.request_id] = sampled.token_ids[i]
            if req.logprobs is not None:
                req.logprobs.append(sampled.logprobs[i])
        self.scheduler.update_from_output(out, tokens)
        for req in broken:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR, NON_FINITE)
        outputs = [self._output(req, tokens.get(req.request_id), finished_only) for req in reqs]
        if finished_only:
            outputs = [o for o in outputs if o is not None]
        if self.mm is not None:
            for req in reqs:
                if req.finished:
                    self.mm.release(req.request_id)
        return outputs

    def _output(self, req: Request, token: int | None, finished_only: bool = False) -> RequestOutput | None:
        delta, text = "", ""
        detok = self.detokenizers.get(req.request_id)
        if detok is not None:
            if finished_only and not req.finished and not detok.stop and self.runner.fast:
                detok.deferred.append(token)  # (nothing reads the text before the request ends, nor looks for a
                return None  # stop string in it: its tokens are detokenised when it ends, with the same calls)
            for t in detok.deferred:  # (their deltas belong to outputs that were not returned)
                detok.add_tokens([t])
            detok.deferred.clear()
            # a stop token (EOS, stop_token_ids) ends the output without its text, as vLLM's does (with
            # skip_special_tokens=False the text would end in '</s>'), unless include_stop_str_in_output
            stop_token = req.finished and req.finish_reason == "stop" and token is not None and \
                req.stop_reason == token and not req.sampling_params.include_stop_str_in_output
            delta = detok.add_tokens([token] if token is not None and not stop_token else [])
            if detok.stop_string is not None and not req.finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, detok.stop_string)
            if req.finished:
                delta += detok.flush()
                del self.detokenizers[req.request_id]
            text = detok.text[:detok.emitted]
        if finished_only and not req.finished:
            return None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, text, list(req.output_token_ids),
                             req.logprobs, req.finish_reason, req.stop_reason, delta, [token] if token is not None else [],
                             req.num_cached_tokens or 0, req.num_preemptions, prompt_logprobs=req.prompt_logprobs)
