"""The sampler: structured outputs' grammar masks, allowed tokens, logit bias and bad words, penalties, temperature, top-k, top-p, min-p, then one
token per row; logprobs.

Shape legend:  N = rows sampled this step (one per request that samples)   V = vocabulary
               L = longest token history among the N requests

Everything is batched over the N rows with tensor ops; the only per-request work is building the
small parameter tensors and drawing seeded rows' noise from their own generator. Sampling uses the
exponential race: argmax(probs / q), q ~ Exp(1) per entry, which draws from `probs`. A seeded request
draws its V exponentials from its own torch.Generator, so its tokens do not depend on the batch.
All-greedy steps without penalties (the common case) cost one pass: zoo.kernels.row_max on float32 CPU
logits, the tokens and their values (torch's argmax over [N, V] is several times slower and wakes torch's
thread pool mid-step), then two reads of N numbers. Few torch ops matter here: after a decode step has
streamed the weights through the caches, each op costs ~0.1 ms of misses (measured in the engine; ~10 us warm).
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from zoo import kernels
from zoo.runtime.request import Request
from zoo.runtime.structured import apply_grammars


@dataclass
class SamplerOutput:
    token_ids: list[int | None]  # [N]; None: the row's logits are not finite (NaN / Inf), nothing sampled
    logprobs: list[dict[int, float] | None]  # [N]: token -> raw logprob (sampled token first), or None


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens; presence/frequency penalties over output tokens."""
    n, v = logits.shape
    device = logits.device
    rep = torch.tensor([r.sampling_params.repetition_penalty for r in reqs], device=device)  # [N]
    pres = torch.tensor([r.sampling_params.presence_penalty for r in reqs], device=device)  # [N]
    freq = torch.tensor([r.sampling_params.frequency_penalty for r in reqs], device=device)  # [N]
    if any(r.sampling_params.repetition_penalty != 1.0 for r in reqs):  # (decided on the host: no device read)
        seen = _token_counts([r.all_token_ids for r in reqs], v, device) > 0  # [N, V]
        rep_b = rep[:, None].expand(n, v)
        penalised = torch.where(logits > 0, logits / rep_b, logits * rep_b)
        logits = torch.where(seen, penalised, logits)
    if any(r.sampling_params.presence_penalty != 0 or r.sampling_params.frequency_penalty != 0 for r in reqs):
        counts = _token_counts([r.output_token_ids for r in reqs], v, device)  # [N, V]
        logits = logits - freq[:, None] * counts - pres[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_bias_and_allowed(logits: torch.Tensor, params) -> torch.Tensor:
    """allowed_token_ids: every other token to -inf; logit_bias: added to its tokens' logits (vLLM's order)."""
    logits = logits.clone()
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)  # [V]
            keep[p.allowed_token_ids] = True
            logits[i].masked_fill_(~keep, float("-inf"))
        if p.logit_bias is not None:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)
    return logits


def apply_bad_words(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """bad_words: a word's last token to -inf when the output so far ends with the tokens before it (a one-token
    word: always). vLLM's rule, on the output tokens only (the prompt may hold the word)."""
    for i, r in enumerate(reqs):
        out = r.output_token_ids
        for word in r.bad_words_token_ids:
            head = len(word) - 1
            if head <= len(out) and (head == 0 or out[-head:] == word[:-1]):
                logits[i, word[-1]] = float("-inf")
    return logits


def _token_counts(histories: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[N, V] float: how often each token occurs in each row's history (one scatter_add, padded)."""
    longest = max((len(h) for h in histories), default=0)
    ids = torch.full((len(histories), longest), vocab, dtype=torch.int64)  # [N, L], pad = an extra column
    for i, h in enumerate(histories):
        if h:
            ids[i, :len(h)] = torch.tensor(h, dtype=torch.int64)
    counts = torch.zeros(len(histories), vocab + 1, device=device)
    counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf what top-k (ties with the k-th kept) and top-p (smallest head with mass >= p) drop."""
    srt, idx = logits.sort(dim=-1)  # [N, V] ascending
    v = logits.shape[-1]
    if top_k is not None:
        kth = srt.gather(1, (v - top_k).clamp(0, v - 1)[:, None])  # [N, 1] the k-th largest value
        srt = srt.masked_fill(srt < kth, float("-inf"))
    if top_p is not None:
        cum = srt.softmax(-1).cumsum(-1)  # [N, V] mass of the tail up to here
        drop = cum <= (1 - top_p)[:, None]
        drop[:, -1] = False  # keep the most likely token
        srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, srt)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(-1)  # [N, V]
    threshold = min_p[:, None] * probs.max(-1, keepdim=True).values  # [N, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator  # for requests without a seed
        # the plain-greedy step (`greedy`): argmax straight into these, reused (grown to the step's rows)
        self.fast = True  # False: every step through the general path (ModelRunner.fast)
        self._indices, self._values = (ctypes.c_int64 * 0)(), (ctypes.c_float * 0)()

    def process(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The logits the draw is made from ([N, V] float32); greedy rows get only the penalties."""
        logits = logits if logits.dtype is torch.float32 else logits.float()
        if any(r.grammar is not None for r in reqs):  # structured outputs: only what the grammar allows, first
            logits = apply_grammars(logits, [r.grammar for r in reqs])
        params = [r.sampling_params for r in reqs]
        early = [i for i, (r, p) in enumerate(zip(reqs, params))
                 if r.num_output_tokens < p.min_tokens and r.stop_token_ids]
        if early:  # min_tokens: the stop tokens cannot be drawn yet
            logits = logits.clone()
            for i in early:
                logits[i, sorted(reqs[i].stop_token_ids)] = float("-inf")
        if any(p.restricts_logits for p in params):
            logits = apply_bias_and_allowed(logits, params)
            logits = apply_bad_words(logits, reqs)
        if any(p.uses_penalties for p in params):
            logits = apply_penalties(logits, reqs)
        if all(p.greedy for p in params):
            return logits
        device = logits.device
        temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)  # [N]
        logits = logits / temp[:, None]
        v = logits.shape[-1]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in params], device=device) \
            if any(0 < p.top_k < v for p in params) else None
        top_p = torch.tensor([p.top_p for p in params], device=device) if any(p.top_p < 1 for p in params) else None
        if top_k is not None or top_p is not None:
            logits = apply_top_k_top_p(logits, top_k, top_p)
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
        return logits

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        if self.fast and logits.dtype is torch.float32 and all(r.plain_greedy for r in reqs) \
                and kernels.fast(logits) and logits.is_contiguous():
            return self.greedy(logits)
        raw = logits if logits.dtype is torch.float32 else logits.float()
        processed = self.process(raw, reqs)  # [N, V]
        greedy = [r.sampling_params.greedy for r in reqs]
        # a NaN anywhere in a row is what argmax picks (and what softmax spreads to the whole row): the value
        # drawn is checked, N numbers per step, and a row that is not finite samples nothing (None)
        if kernels.fast(processed):
            chosen, tokens = kernels.row_max(processed)  # [N], [N]
        else:
            tokens = processed.argmax(-1)  # [N]
            chosen = processed.gather(1, tokens[:, None])[:, 0]  # [N]
        if not all(greedy):
            probs = processed.softmax(-1)  # [N, V]
            q = torch.empty_like(probs).exponential_(generator=self.generator)  # [N, V]
            for i, r in enumerate(reqs):
                if r.generator is not None and not greedy[i]:
                    q[i] = torch.empty(probs.shape[1]).exponential_(generator=r.generator).to(q.device)
            drawn = (probs / q).argmax(-1)  # [N]
            is_greedy = torch.tensor(greedy, device=tokens.device)
            tokens = torch.where(is_greedy, tokens, drawn)
            chosen = torch.where(is_greedy, chosen, probs.gather(1, drawn[:, None])[:, 0])
        if tokens.is_cpu:  # (no device read to save: no stack, no isfinite op)
            token_list, finite = tokens.tolist(), [math.isfinite(v) for v in chosen.tolist()]
        else:  # one read back from the device: the tokens and whether each row's value was finite
            token_list, finite = torch.stack((tokens, torch.isfinite(chosen).to(tokens.dtype))).tolist()
        if not all(finite):
            token_list = [t if ok else None for t, ok in zip(token_list, finite)]
        return SamplerOutput(token_list, self._logprobs(raw, tokens, reqs))

    def greedy(self, logits: torch.Tensor) -> SamplerOutput:
        """Every row greedy with nothing to apply first (Request.plain_greedy) and no logprobs: the general path's
        tokens from one native argmax into reused buffers, and nothing else (~10 us on a warm CPU)."""
        n = logits.shape[0]
        if len(self._indices) < n:
            self._indices, self._values = (ctypes.c_int64 * n)(), (ctypes.c_float * n)()
        tokens, values = kernels.row_max_lists(logits, self._indices, self._values)
        if not all(map(math.isfinite, values)):
            tokens = [t if math.isfinite(v) else None for t, v in zip(tokens, values)]
        return SamplerOutput(tokens, [None] * n)

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, reqs: list[Request]) -> list[dict[int, float] | None]:
        wanted = [r.sampling_params.logprobs for r in reqs]
        if all(w is None for w in wanted):
            return [None] * len(reqs)
        lp = raw.log_softmax(-1)  # [N, V]
        k = max(w or 0 for w in wanted)
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], tokens[:, None][:, :0])  # [N, k]
        chosen = lp.gather(1, tokens[:, None])[:, 0].tolist()  # [N]
        top_vals, top_ids, toks = top_vals.tolist(), top_ids.tolist(), tokens.tolist()
        out = []
        for i, w in enumerate(wanted):
            if w is None:
                out.append(None)
                continue
            d = {toks[i]: chosen[i]}
            for t, val in zip(top_ids[i][:w], top_vals[i][:w]):
                d.setdefault(t, val)
            out.append(d)
        return out
