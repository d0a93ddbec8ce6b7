"""The zoo side: the zoo's model driven through the real runtime (LLMEngine: scheduler, paged KV cache,
model runner, sampler), with forward hooks on the model's modules capturing the taps.

Shape legend:
    T = tokens of one step (flattened)     H = hidden size     V = vocabulary     N = rows that sample

Nothing here computes the model differently from `zoo run`: each scenario is an LLMEngine with its own
scheduling knobs (token budget, block size, prefix caching) and requests whose tokens we choose.
Per step we record, from the runtime's own objects:
  - which request owns each segment of the flattened batch (the scheduler output the runner prepares,
    observed by wrapping `engine.runner.prepare` on the instance and calling through to it),
  - positions and query_start_loc (the ForwardBatch the model receives),
  - every tap (module forward hooks), the model's final hidden state [T, H], and the logits
    `model.compute_logits` gives for every row of it (to compare all positions, not only sampled ones),
  - the logits the runner actually sampled from (`runner.logits_hook`), checked separately.
Decode steps are teacher-forced by greedy sampling: the reference is then run on the very tokens the
zoo produced, so both sides see the same sequence at every step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parity.align import Trace, from_steps
from parity.taps import LOGITS, SAMPLED, Capture, zoo_tap_names


@dataclass
class ZooRun:
    trace: Trace
    num_steps: int
    cached_tokens: dict[int, int] = field(default_factory=dict)  # request -> prompt tokens found in the prefix cache
    outputs: dict[int, list[int]] = field(default_factory=dict)  # request -> tokens it generated


class ZooSide:
    """The zoo model built once (build_model, float32) and run through a fresh engine per scenario."""

    def __init__(self, path, *, device: str = "cpu", config=None):
        from zoo.build import build_model

        self.model, self.config, self.spec, self.load_report = build_model(
            path, dtype=torch.float32, device=device, config=config)
        self.device = device

    def tap_names(self, wanted: set[str]) -> dict[str, str]:
        return zoo_tap_names(self.model, self.config, wanted)

    def run(self, prompts: list[list[int]], wanted: set[str], *, max_tokens: int = 1, block_size: int = 16,
            max_num_batched_tokens: int | None = None, max_num_seqs: int = 64, enable_prefix_caching: bool = False,
            waves: list[list[int]] | None = None) -> ZooRun:
        """Run `prompts` (token ids) through a new engine, greedy, `max_tokens` each.

        `waves` runs groups of requests one after another (each wave to completion before the next is
        added): [[0], [1, 2]] runs request 0 alone, then 1 and 2 together. Default: all at once.
        """
        from zoo.runtime.engine import LLMEngine
        from zoo.runtime.sampling_params import SamplingParams

        total = sum(len(p) + max_tokens for p in prompts)
        budget = max_num_batched_tokens or max(2048, total)
        engine = LLMEngine(self.model, self.config, None, num_blocks=2 * (total // block_size + len(prompts)) + 4,
                           block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                           enable_prefix_caching=enable_prefix_caching, device=self.device)
        names = self.tap_names(wanted)
        order_of_steps: list[list[str]] = []  # per step: request id of each segment
        sampled: list[tuple[list[str], torch.Tensor]] = []
        prepare = engine.runner.prepare

        first_computed: dict[str, int] = {}  # request -> tokens already in the cache when first scheduled

        def observed_prepare(out, kv):
            order_of_steps.append([s.request.request_id for s in out.scheduled])
            for s in out.scheduled:
                first_computed.setdefault(s.request.request_id, s.num_computed_tokens)
            return prepare(out, kv)

        engine.runner.prepare = observed_prepare  # instance attribute: calls straight through
        engine.runner.logits_hook = lambda reqs, logits: sampled.append(
            ([r.request_id for r in reqs], logits.detach().float().cpu().clone()))

        def meta(args, kwargs):
            positions = args[1] if len(args) > 1 else kwargs["positions"]
            batch = args[2] if len(args) > 2 else kwargs["batch"]
            return {"positions": positions.detach().cpu().clone(), "qsl": list(batch.query_start_loc_cpu),
                    "logits_indices": batch.logits_indices.detach().cpu().clone()}

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        requests: dict[str, object] = {}
        waves = waves or [list(range(len(prompts)))]
        def logits_of_every_row(hidden):  # [T, H] -> [T, V], the zoo's own head on every row
            return self.model.compute_logits(hidden).detach().float().cpu()

        with Capture(self.model, names, meta=meta, root_output=logits_of_every_row) as cap:
            for wave in waves:
                for r in wave:
                    rid = engine.add_request(list(prompts[r]), params, request_id=str(r))
                    requests[rid] = engine.scheduler.requests[rid]
                while engine.has_unfinished_requests():
                    engine.step()
        if len(cap.steps) != len(order_of_steps):
            raise RuntimeError(f"the model ran {len(cap.steps)} forwards for {len(order_of_steps)} prepared steps")

        steps, sampled_iter = [], iter(sampled)
        for step, ids in zip(cap.steps, order_of_steps):
            step.taps[LOGITS] = step.output  # [T, V]
            idx = step.meta["logits_indices"]
            present = {}
            if idx.numel():
                reqs, logits = next(sampled_iter)
                full = torch.zeros_like(step.output)
                full[idx] = logits  # [T, V]; the other rows are absent (present[SAMPLED] False)
                step.taps[SAMPLED] = full
                present[SAMPLED] = torch.zeros(full.shape[0], dtype=torch.bool)
                present[SAMPLED][idx] = True  # [T]
            steps.append({"requests": [int(i) for i in ids], "query_start_loc": step.meta["qsl"],
                          "positions": step.meta["positions"], "taps": step.taps, "experts": step.experts,
                          "present": present})
        # the tokens each request had computed: prompt + outputs, but the last sampled token never ran (and a
        # request whose logits went NaN sampled none: finish_reason "error")
        tokens = [requests[str(r)].all_token_ids[:requests[str(r)].num_computed_tokens] for r in range(len(prompts))]
        trace = from_steps(steps, cap.order + [LOGITS, SAMPLED], tokens)
        cached = {int(rid): n for rid, n in first_computed.items()}
        outs = {int(rid): list(req.output_token_ids) for rid, req in requests.items()}
        return ZooRun(trace, len(steps), cached, outs)
