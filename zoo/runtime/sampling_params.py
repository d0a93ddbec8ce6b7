"""SamplingParams: how one request picks its tokens and when it stops."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling options (the names and meanings follow vLLM's SamplingParams).

    Order of the logits processing (transformers' order for the warpers):
    penalties -> greedy if temperature == 0, else temperature -> top-k -> top-p -> min-p -> sample.
    `logprobs=n` returns, for every sampled token, the model's raw log-probabilities (log_softmax of the
    unprocessed logits) of the sampled token and the n most likely ones.
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

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, f"must be in [0, max_tokens={self.max_tokens}]"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be >= 0"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
