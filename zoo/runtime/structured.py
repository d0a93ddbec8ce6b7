"""Structured outputs: a request's tokens held to a JSON schema, any JSON, a regex, a choice or a grammar.

Shape legend:  N = rows sampled this step   V = the logits' width (the model's vocabulary)   W = ceil(V / 32)

    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))    # vLLM's shape
    LLM(...).generate(prompt, params)   ->  text that parses as JSON and validates against `schema`

xgrammar (what vLLM and SGLang use) compiles the spec against the tokenizer's vocabulary once per engine and
spec (its compiler caches), and each request holds its own matcher: the grammar state after its output tokens.
A step's sampler asks each constrained row's matcher for the tokens allowed next (a bitmask [N, W]) and masks the
others to -inf before anything else it does (bias, penalties, temperature, top-k/p), so greedy, sampled, seeded,
`n`, the fused step and every other path draw only grammatical tokens; the scheduler feeds each sampled token to
the matcher (Request.append_output) and stops the request when the grammar is complete (its end token drawn, or
no token could follow). A preempted request keeps its output tokens, so its matcher stays in step with them;
a request whose output could not be fed (a token the grammar refuses) ends with finish_reason "error".

JSON is generated compact (no whitespace between items, ", " and ": " as separators) unless `whitespace="any"`:
a model that wandered into whitespace could otherwise spend every token on it and never close the JSON. Compact
JSON also holds no token with a control byte (U+0000-U+001F): xgrammar's JSON strings admit them raw, which
RFC 8259 and strict parsers (Python's json.loads) refuse.
"""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """What a request's output must match: exactly one of the fields (vLLM's StructuredOutputsParams)."""

    json: dict | str | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # an EBNF grammar (GBNF, as llama.cpp and xgrammar write it; root rule `root`)
    json_object: bool = False  # any JSON object
    whitespace: str = "compact"  # "compact" or "any" (JSON only)

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"SamplingParams.structured_outputs: give exactly one of {', '.join(KINDS)}"
                             + (f" (got {', '.join(given)})" if given else ""))
        if self.whitespace not in ("compact", "any"):
            raise ValueError(f"SamplingParams.structured_outputs.whitespace={self.whitespace!r}: 'compact' or 'any'")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"SamplingParams.structured_outputs.json: the schema is not JSON ({e})") from None
            if not isinstance(self.json, (dict, bool)):
                raise ValueError("SamplingParams.structured_outputs.json: a JSON schema is an object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"SamplingParams.structured_outputs.{name}: must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("SamplingParams.structured_outputs.choice: must be a non-empty list of "
                                 "non-empty strings")
            self.choice = list(self.choice)
        if not isinstance(self.json_object, bool):
            raise ValueError("SamplingParams.structured_outputs.json_object: must be True or False")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The compiled grammar's cache key (the spec, canonical)."""
        return json.dumps([self.kind, getattr(self, self.kind), self.whitespace], sort_keys=True)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


def _hf_tokenizer(tokenizer):
    """The transformers tokenizer xgrammar reads the vocabulary of (a LightTokenizer hands over its own)."""
    full = getattr(type(tokenizer), "transformers_tokenizer", None)
    return tokenizer.transformers_tokenizer() if full is not None else tokenizer


class Grammars:
    """One engine's compiler (the tokenizer's vocabulary, the logits' width) and its compiled specs."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=None):
        import xgrammar as xgr

        self.xgr, self.vocab_size = xgr, vocab_size
        info = xgr.TokenizerInfo.from_huggingface(_hf_tokenizer(tokenizer), vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) if stop_token_ids else None)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        control = [any(b < 0x20 for b in token) for token in info.decoded_vocab[:vocab_size]]
        self.control = torch.tensor([i for i, c in enumerate(control) if c], dtype=torch.long)  # [K] ids: a control byte
        self._compiled: dict[str, object] = {}
        self._lock = threading.Lock()  # (the server compiles on its request threads)

    def compile(self, spec: StructuredOutputsParams):
        key = spec.key()
        with self._lock:
            if key not in self._compiled:
                self._compiled[key] = self._compile(spec)
            return self._compiled[key]

    def _compile(self, spec: StructuredOutputsParams):
        c, kind = self.compiler, spec.kind
        try:
            if kind == "json":
                return c.compile_json_schema(json.dumps(spec.json), any_whitespace=spec.whitespace == "any",
                                             strict_mode=True)
            if kind == "json_object":
                return c.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=spec.whitespace == "any")
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
            return c.compile_grammar(spec.grammar)
        except Exception as e:  # xgrammar's errors (RuntimeError, ValueError, its own) on a bad spec
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)  # (xgrammar's log prefix: time, source file)
            raise ValueError(f"SamplingParams.structured_outputs.{kind}: cannot be compiled: {first}") from None

    def matcher(self, spec: StructuredOutputsParams) -> "Matcher":
        compact_json = spec.kind in ("json", "json_object") and spec.whitespace == "compact"
        return Matcher(self.xgr.GrammarMatcher(self.compile(spec)), self, self.control if compact_json else None)


class Matcher:
    """One request's grammar state: which tokens may come next, fed each token the request outputs."""

    def __init__(self, matcher, grammars: Grammars, banned: torch.Tensor | None = None):
        self._m, self._grammars = matcher, grammars
        self.banned = banned  # [K] ids of tokens refused besides what the grammar refuses (compact JSON's controls)
        self.failed = False  # a token was refused (the output went past what the grammar allows)

    def accept(self, token: int) -> None:
        if not self.failed and not self._m.is_terminated() and not self._m.accept_token(token):
            self.failed = True

    @property
    def done(self) -> bool:
        """The grammar is complete (its end drawn): nothing may follow."""
        return self._m.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)


def apply_grammars(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """logits [N, V] with every token the row's matcher does not allow next at -inf (rows without one as they
    are); a copy when any row is constrained."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    from zoo import kernels

    with kernels.serial_torch():  # microseconds of work per op: a 2-thread OpenMP region waited ~12 ms a step here
        return _masked(logits, matchers, rows)


def _masked(logits: torch.Tensor, matchers: list, rows: list[int]) -> torch.Tensor:
    grammars = matchers[rows[0]]._grammars
    xgr = grammars.xgr
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # [N, W] int32, all allowed
    for i in rows:
        matchers[i].fill(bitmask, i)
    out = logits.float().contiguous().clone()
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), indices=rows)
    for i in rows:
        if matchers[i].banned is not None:
            out[i].index_fill_(0, matchers[i].banned.to(out.device), float("-inf"))
    return out
