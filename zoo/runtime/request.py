"""A request: its tokens, how many of them sit in the KV cache, and where it is in its life.

The runtime has one notion of progress: `num_computed_tokens`, the prefix of `all_token_ids` whose
K/V are in the cache. Prefill, a chunk of a prefill, a decode step and a prefix-cache hit all move it
forward; a request samples a token when a step brings it to `num_tokens`.
"""
from __future__ import annotations

import enum
import time

import torch

from zoo.runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed from its prompt + outputs so far
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context length
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the model's logits were NaN or infinite: nothing sensible to sample

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        cache_salt: str | None = None,
        prompt: str | None = None,
        mm_items: list | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)  # prompt + outputs, grows by one per sample
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids) | self.eos_token_ids
        self.cache_salt = cache_salt
        self.mm_items = list(mm_items or ())  # images: zoo.runtime.multimodal.ImageItem, placeholder ranges fixed
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit on first admission
        self.block_hashes: list[bytes] = []  # chained hashes of the complete blocks of all_token_ids
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        # prompt token i's logprobs (None for token 0), filled by the steps that compute the prompt
        self.prompt_logprobs: list[dict[int, float] | None] | None = \
            [None] if sampling_params.prompt_logprobs is not None else None
        self.bad_words_token_ids: list[list[int]] = []  # the engine tokenises SamplingParams.bad_words
        self.grammar = None  # structured outputs: its zoo.runtime.structured.Matcher, fed every output token
        p = sampling_params  # greedy with nothing for the sampler to apply or report: the sampler's fast path
        self._plain_greedy = p.greedy and p.logprobs is None and p.min_tokens == 0 and not p.restricts_logits \
            and not p.uses_penalties
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def plain_greedy(self) -> bool:
        """Greedy without logprobs, min_tokens, logit bias / allowed tokens / bad words, penalties or a grammar: its
        token is the argmax of its raw logits (Sampler.greedy)."""
        return self._plain_greedy and self.grammar is None

    @property
    def wants_prompt_logits(self) -> bool:
        """Its prompt logprobs are not all computed yet: the prompt's every row needs its logits (no cache hit)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def finish(self, status: RequestStatus, reason: int | str | None = None) -> None:
        self.status = status
        self.finish_reason = status.value
        self.stop_reason = reason

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens})")
