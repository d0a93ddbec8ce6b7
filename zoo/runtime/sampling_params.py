"""SamplingParams: how one request picks its tokens and when it stops."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling options (the names and meanings follow vLLM's SamplingParams).

    Order of the logits processing (transformers' order for the warpers):
    penalties -> greedy if temperature == 0, else temperature -> top-k -> top-p -> min-p -> sample.
    `logprobs=n` returns, for every sampled token, the model's raw log-probabilities (log_softmax of the
    unprocessed logits) of the sampled token and the n most likely ones; `prompt_logprobs=n` the same for every
    prompt token after the first (a request asking for them is not served from the prefix cache: vLLM's rule).
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output tokens: positive logits / p, negative * p
    presence_penalty: float = 0.0  # over output tokens: - p once a token appeared
    frequency_penalty: float = 0.0  # over output tokens: - p * count
    seed: int | None = None  # own torch.Generator: same seed -> same tokens whatever the batch
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the text
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to EOS
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end the output before this many tokens
    logprobs: int | None = None  # top-n logprobs per sampled token (0 = only the sampled token's)
    skip_special_tokens: bool = True
    n: int = 1  # samples per prompt (LLM.generate: n requests sharing the prompt's blocks; a seed: seed + i each)
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays in it
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (before penalties and warpers)
    allowed_token_ids: list[int] | None = None  # only these tokens can be drawn
    prompt_logprobs: int | None = None  # per prompt token (the first: None), its raw logprob and the top-n ones
    bad_words: list[str] | None = None  # words that cannot be generated (each word's last token is banned after
    # the tokens before it; tokenised with and without a leading space, as vLLM does)
    # the output held to a JSON schema, JSON, a regex, a choice or a grammar (zoo/runtime/structured.py); a dict
    # is taken as StructuredOutputsParams(**dict); guided_decoding is vLLM's older name for it
    structured_outputs: "StructuredOutputsParams | dict | None" = None
    guided_decoding: "StructuredOutputsParams | dict | None" = None

    def __post_init__(self):
        self._structured()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop)
        self.stop_token_ids = [_integer("stop_token_ids", t, low=0) for t in _as_list("stop_token_ids",
                                                                                       self.stop_token_ids)]
        self.max_tokens = _integer("max_tokens", self.max_tokens, low=1)
        self.n = _integer("n", self.n, low=1)
        self.min_tokens = _integer("min_tokens", self.min_tokens, low=0)
        self.top_k = 0 if self.top_k is None else _integer("top_k", self.top_k, low=-1, why="(0 or -1 = off)")
        if self.top_k < 0:
            self.top_k = 0
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs, low=0)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _integer("prompt_logprobs", self.prompt_logprobs, low=0)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            self.bad_words = _as_list("bad_words", self.bad_words) or None
            if self.bad_words and not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"SamplingParams.bad_words={self.bad_words!r}: must be non-empty strings")
        if self.seed is not None:  # torch.Generator.manual_seed takes [-2^63, 2^64)
            self.seed = _integer("seed", self.seed, low=-(1 << 63), high=(1 << 64) - 1)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            setattr(self, name, _real(name, getattr(self, name)))
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"SamplingParams.logit_bias={self.logit_bias!r}: must be a dict of token id -> bias")
            self.logit_bias = {_integer("logit_bias", k, low=0): _real("logit_bias", v)
                               for k, v in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            ids = [_integer("allowed_token_ids", t, low=0) for t in _as_list("allowed_token_ids",
                                                                             self.allowed_token_ids)]
            if not ids:
                raise ValueError("SamplingParams.allowed_token_ids=[]: must name at least one token")
            self.allowed_token_ids = ids
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: must be True or False")
        checks = [
            ("min_tokens", self.min_tokens <= self.max_tokens, f"must be in [0, max_tokens={self.max_tokens}]"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

    def _structured(self) -> None:
        from zoo.runtime.structured import StructuredOutputsParams

        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("SamplingParams.guided_decoding: give structured_outputs or guided_decoding, "
                                 "not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        spec = self.structured_outputs
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - set(StructuredOutputsParams.__dataclass_fields__))
            if unknown:
                raise ValueError(f"SamplingParams.structured_outputs={spec!r}: unknown field {unknown[0]!r}")
            self.structured_outputs = StructuredOutputsParams(**spec)
        elif spec is not None and not isinstance(spec, StructuredOutputsParams):
            raise ValueError(f"SamplingParams.structured_outputs={spec!r}: expected a StructuredOutputsParams")

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids and logprob counts a model with `vocab_size` logits cannot serve (at add_request)."""
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            ids = getattr(self, name) or ()
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name}={ids!r}: {bad[0]} is outside the vocabulary of "
                                 f"{vocab_size} tokens")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) > vocab_size:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)}: more than the vocabulary's "
                                 f"{vocab_size} tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def restricts_logits(self) -> bool:
        return self.logit_bias is not None or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _integer(name: str, value, *, low: int, high: int | None = None, why: str = "") -> int:
    """value as an int in [low, high] (an int, or a numpy / torch integer scalar; never a float or a bool)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"SamplingParams.{name}={value!r}: must be an integer") from None
    if out < low or (high is not None and out > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"SamplingParams.{name}={value!r}: must be {bound}{' ' + why if why else ''}")
    return out


def _real(name: str, value) -> float:
    """value as a finite float (an int or float; never a bool, a string, NaN or an infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ValueError(f"SamplingParams.{name}={value!r}: must be a number")
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"SamplingParams.{name}={value!r}: must be a number") from None
    if not math.isfinite(out):
        raise ValueError(f"SamplingParams.{name}={value!r}: must be finite")
    return out


def _as_list(name: str, value) -> list:
    try:
        return list(value)
    except TypeError:
        raise ValueError(f"SamplingParams.{name}={value!r}: must be a list") from None
