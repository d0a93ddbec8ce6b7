"""A tiny stand-in for the runtime, for model tests: a KV pool and ForwardBatch objects built by hand.

    kv = allocate_kv(model, num_blocks=64, block_size=4)
    ids, batch = make_batch([(prompt_a, 0), (prompt_b, 0)], kv)      # (tokens so far, already computed)
    logits = model.compute_logits(model(ids, batch.positions, batch)[batch.logits_indices])
    got = run_schedule(model, requests, [[(0, 7), (1, 13)], [(0, 1), (1, 1)]])   # per request, per chunk
    want = reference_chunks(hf_model, requests[0], [7, 8])                       # transformers, same chunks
    assert_close(got[0][0], want[0], "request 0 prefill")

Request i owns the blocks i * blocks_per_seq ... (contiguous), or a shuffled set of blocks with
`shuffle=True`; `req_ids` name the requests of a step, so a request keeps its blocks across steps.
"""
from __future__ import annotations

import random

import torch

from zoo.runtime.batch import ForwardBatch

ATOL = 1e-4  # max |zoo - transformers| of float32 logits


def allocate_kv(model: torch.nn.Module, *, num_blocks: int = 64, block_size: int = 4, device="cpu",
                fill: float = float("nan")) -> dict[str, torch.Tensor]:
    """prefix -> [NB, BS, *per_token] for every module declaring cache_spec(); NaN-filled so a read of a
    slot that was never written shows up in the logits."""
    caches = {}
    for name, module in model.named_modules():
        if callable(getattr(module, "cache_spec", None)):
            spec = module.cache_spec()
            caches[getattr(module, "prefix", name)] = torch.full(
                (num_blocks, block_size, *spec.per_token), fill, dtype=spec.dtype, device=device)
    return caches


def block_ids(i: int, blocks_per_seq: int, num_blocks: int, shuffle: bool) -> list[int]:
    ids = list(range(num_blocks))
    if shuffle:
        random.Random(1234).shuffle(ids)
    return ids[i * blocks_per_seq:(i + 1) * blocks_per_seq]


def make_batch(seqs: list[tuple[list[int], int]], kv_caches: dict[str, torch.Tensor], *,
               req_ids: list[int] | None = None, blocks_per_seq: int = 8, shuffle: bool = False,
               all_logits: bool = True, device="cpu"):
    """(input_ids [T], ForwardBatch) for requests given as (all token ids so far, how many are cached).

    The new tokens of a request are ids[computed:]; `req_ids` (default 0..B-1) say which blocks each
    request owns. Logits rows: every new token (all_logits) or the last new token of each request.
    """
    req_ids = list(req_ids or range(len(seqs)))
    some = next(iter(kv_caches.values()), None)  # without caches: slots in an imaginary pool of BS = 4
    num_blocks, block_size = (some.shape[0], some.shape[1]) if some is not None else \
        (blocks_per_seq * (max(req_ids) + 1), 4)
    ids, positions, slots, tables, starts, lens, last = [], [], [], [], [0], [], []
    for i, (tokens, computed) in zip(req_ids, seqs):
        blocks = block_ids(i, blocks_per_seq, num_blocks, shuffle)
        if len(tokens) > len(blocks) * block_size:
            raise ValueError(f"request {i}: {len(tokens)} tokens exceed its {len(blocks)} blocks of {block_size}")
        new = range(computed, len(tokens))
        ids += tokens[computed:]
        positions += list(new)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in new]
        tables.append(blocks)
        starts.append(starts[-1] + len(new))
        lens.append(len(tokens))
        last.append(starts[-1] - 1)
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    batch = ForwardBatch(
        query_start_loc=t(starts, torch.int32),
        seq_lens=t(lens, torch.int32),
        positions=t(positions, torch.int64),
        slot_mapping=t(slots, torch.int64),
        block_tables=t(tables, torch.int32),
        logits_indices=torch.arange(len(ids), device=device) if all_logits else t(last, torch.int64),
        kv_caches=kv_caches,
        block_size=block_size,
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )
    return t(ids, torch.int64), batch


def run_step(model, seqs, kv_caches, **kw) -> torch.Tensor:
    """One forward over `seqs` (see make_batch); logits [N, V] of the rows make_batch selects."""
    ids, batch = make_batch(seqs, kv_caches, **kw)
    with torch.no_grad():
        hidden = model(ids, batch.positions, batch)  # [T, H]
        return model.compute_logits(hidden[batch.logits_indices])  # [N, V]


def random_prompts(lengths: list[int], *, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token ids in [3, vocab) (past pad / bos / eos), one list per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run_schedule(model, requests: list[list[int]], steps: list[list[tuple[int, int]]], **kw):
    """steps: [(request, new tokens), ...] per step -> per request, the logits of each of its chunks."""
    kv = allocate_kv(model, num_blocks=64, block_size=4)
    done = [0] * len(requests)
    out: list[list[torch.Tensor]] = [[] for _ in requests]
    for step in steps:
        seqs = [(requests[r][:done[r] + n], done[r]) for r, n in step]
        logits = run_step(model, seqs, kv, req_ids=[r for r, _ in step], **kw)  # [T, V]
        for (r, n), rows in zip(step, logits.split([n for _, n in step])):
            out[r].append(rows)
            done[r] += n
    return out


@torch.no_grad()
def reference_chunks(ref, tokens: list[int], cuts: list[int]) -> list[torch.Tensor]:
    """transformers' logits [n, V] for tokens[0:cuts[0]], tokens[cuts[0]:cuts[1]], ... fed through its cache."""
    cache, start, out = None, 0, []
    for cut in cuts:
        o = ref(torch.tensor([tokens[start:cut]]), cache=cache, use_cache=True)
        cache, start = o.cache, cut
        out.append(o.logits[0])
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = ATOL) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err <= atol, f"{what}: max |zoo - transformers| = {err:.3g} > {atol} (logits up to {want.abs().max():.3g})"


def decode_logits(model, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Logits [len(tokens) - prompt_len, V]: tokens[:prompt_len] as one prefill, then the rest fed one token a step
    (batch-1 decode, M = 1: the GEMV paths); row i predicts tokens[prompt_len + i] (teacher forcing; row 0 is the
    prefill's last row)."""
    steps = [[(0, prompt_len)]] + [[(0, 1)]] * (len(tokens) - prompt_len - 1)
    chunks = run_schedule(model, [tokens[:-1]], steps, blocks_per_seq=64)[0]  # (up to 256 tokens)
    return torch.cat([chunks[0][-1:]] + chunks[1:])


def agreement(model, reference, prompts: list[list[int]], continuations: list[list[int]]) -> dict:
    """Top-1 agreement and KL(reference || model) at every position of the continuations (the reference's greedy
    tokens, say), teacher-forced through both models; all but the first position of each are batch-1 decode steps.
    {"top1", "kl_mean", "kl_max", "positions"}."""
    agree, kls = 0, []
    for p, c in zip(prompts, continuations):
        want = decode_logits(reference, list(p) + list(c), len(p)).double().log_softmax(-1)
        got = decode_logits(model, list(p) + list(c), len(p)).double().log_softmax(-1)
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        kls += (want.exp() * (want - got)).sum(-1).tolist()
    return {"top1": agree / len(kls), "kl_mean": sum(kls) / len(kls), "kl_max": max(kls), "positions": len(kls)}
