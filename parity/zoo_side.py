"""The zoo side: the zoo's model driven through the real runtime (LLMEngine: scheduler, paged KV cache,
model runner, sampler), with forward hooks on the model's modules capturing the taps.

Shape legend:
    T = tokens of one step (flattened)     H = hidden size     V = vocabulary     N = rows that sample

Nothing here computes the model differently from `zoo run`: each scenario is an LLMEngine with its own
scheduling knobs (token budget, block size, prefix caching) and requests whose tokens we choose.
Per step we record, from the runtime's own objects:
  - which request owns each segment of the flattened batch (the scheduler output the runner prepares,
    observed by wrapping `engine.runner.plan` on the instance and calling through to it),
  - positions and the rows that sample (the step the model receives, as the runner's StepLists),
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
from parity.taps import LOGITS, SAMPLED, Capture, input_taps, zoo_tap_names


@dataclass
class ZooRun:
    trace: Trace
    num_steps: int
    cached_tokens: dict[int, int] = field(default_factory=dict)  # request -> prompt tokens found in the prefix cache
    outputs: dict[int, list[int]] = field(default_factory=dict)  # request -> tokens it generated
    findings: list[str] = field(default_factory=list)  # runtime bookkeeping wrong: positions, sampled rows
    fused_steps: list[bool] = field(default_factory=list)  # served path: per step, did the fused native step run
    segments: list[list[tuple[str, int, int]]] = field(default_factory=list)  # per step: (request, first token, n)
    encoder: dict[str, int] = field(default_factory=dict)  # a multimodal engine's encoder runs and cache hits
    restores: list[tuple[int, int]] = field(default_factory=list)  # (state snapshot, state slot) per prefix hit


def _watch(engine, segments: list, sampled: list) -> dict:
    """Record, from the runtime's own objects, each step's schedule (request, first token index, tokens) and
    the logits it sampled from; calls go straight through (instance attributes on this engine only)."""
    runner, state = engine.runner, {"first_computed": {}, "fused": [], "batches": []}
    plan = runner.plan

    def observed_plan(out, kv):
        segments.append([(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled])
        for s in out.scheduled:
            state["first_computed"].setdefault(int(s.request.request_id), s.num_computed_tokens)
        step = plan(out, kv)  # what the model will see: positions and the rows that sample
        state["batches"].append((torch.tensor(step.positions), torch.tensor(step.logits_indices, dtype=torch.int64)))
        return step

    runner.plan = observed_plan
    state["steps"] = []  # per engine step, the plans made before it: a pipeline plans each micro-batch of a step
    execute = runner.execute

    def observed_execute(out, kv):
        state["steps"].append(len(segments))
        return execute(out, kv)

    runner.execute = observed_execute
    snapshots = engine.scheduler.kv.state_snapshots
    state["restores"] = []  # (snapshot, state slot) of each prefix hit's state restore
    if snapshots is not None:
        restore = snapshots.restore

        def observed_restore(block_hash, slot):
            restore(block_hash, slot)
            state["restores"].append((snapshots.copies[-1][1], slot))

        snapshots.restore = observed_restore
    runner.logits_hook = lambda reqs, logits: sampled.append(
        ([r.request_id for r in reqs], logits.detach().float().cpu().clone()))
    if runner.fused is not None:
        usable = runner.fused.usable

        def observed_usable(*args, **kwargs):
            ok = usable(*args, **kwargs)
            state["fused"].append(bool(ok))
            return ok

        runner.fused.usable = observed_usable
    return state


def _drive(engine, prompts, max_tokens, waves, images=None, stagger: bool = False,
           allowed_token_ids=None) -> dict:
    """Add the prompts (in waves, each run to completion before the next is added), greedy; step to the end.
    `images`: per prompt, its images (token prompts whose placeholders are already expanded) or None.
    `stagger`: one prompt arrives per step instead (request 0, a step, request 1, a step, ...), so the steps
    after the first mix the earlier requests' decode rows with a new prompt's prefill rows.
    `allowed_token_ids`: the only tokens greedy may pick (the sampler masks the rest; the logits compared are the
    model's, before it)."""
    from zoo.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            allowed_token_ids=allowed_token_ids)
    requests = {}
    for wave in waves or [list(range(len(prompts)))]:
        for r in wave:
            rid = engine.add_request(list(prompts[r]), params, request_id=str(r),
                                     images=images[r] if images is not None else None)
            requests[rid] = engine.scheduler.requests[rid]
            if stagger:
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    return requests


def _whole_steps(segments: list, batches: list, starts: list[int]) -> list:
    """Per engine step, (its schedule, (positions [T], sampled rows [N])) as one process plans it: a pipeline's rank 0
    plans each micro-batch of a step on its own (zoo/runtime/pipeline.py), a request cut between two as two spans;
    they are joined back here (the spans merged, the rows offset). One plan a step: the plans as they are."""
    out = []
    for a, b in zip(starts, starts[1:] + [len(segments)]):
        if a == b:  # (a step that planned nothing)
            continue
        segs, positions, rows, offset = [], [], [], 0
        for k in range(a, b):
            for r, start, n in segments[k]:
                if segs and segs[-1][0] == r and segs[-1][1] + segs[-1][2] == start:
                    segs[-1] = (r, segs[-1][1], segs[-1][2] + n)  # the second span of a request cut in two
                else:
                    segs.append((r, start, n))
            pos, idx = batches[k]
            positions.append(pos)
            rows.append(idx + offset)
            offset += len(pos)
        out.append((segs, (torch.cat(positions), torch.cat(rows))))
    return out


def _token_index(segs, qsl) -> torch.Tensor:
    """[T] the token index (within its request) of every row of a step, by the scheduler's accounting."""
    sizes = [qsl[i + 1] - qsl[i] for i in range(len(segs))]
    if sizes != [n for _, _, n in segs]:
        raise RuntimeError(f"the batch's query_start_loc gives segments of {sizes} rows, the scheduler scheduled "
                           f"{[n for _, _, n in segs]} tokens (requests {[r for r, _, _ in segs]})")
    return torch.cat([torch.arange(start, start + n) for _, start, n in segs]) if segs else torch.zeros(0, dtype=torch.long)


def _sampled_at_last_rows(segs, qsl, reqs, logits, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled logits [N, V] placed at each sampling request's last row ([T, V], present [T]): where the
    runtime should have sampled, so a runtime sampling from another row differs from the reference there."""
    last = {r: qsl[i + 1] - 1 for i, (r, _, _) in enumerate(segs)}
    full = torch.zeros(shape)
    present = torch.zeros(shape[0], dtype=torch.bool)
    for k, r in enumerate(reqs):
        full[last[r]] = logits[k]
        present[last[r]] = True
    return full, present


def _computed_tokens(requests, segments, n: int) -> list[list[int]]:
    """Each request's tokens up to the last one a step computed (the scheduler's accounting)."""
    reached = {}
    for segs in segments:
        for r, start, count in segs:
            reached[r] = max(reached.get(r, 0), start + count)
    return [requests[str(r)].all_token_ids[:reached.get(str(r), 0)] for r in range(n)]


def runtime_findings(steps: list[dict]) -> list[str]:
    """Where the runtime's own bookkeeping disagrees with the scheduler: positions and sampled rows."""
    out, wrong_positions = [], []
    for k, step in enumerate(steps):
        qsl, pos, index = step["query_start_loc"], step["positions"].long(), step["token_index"]
        if pos.shape != index.shape:
            out.append(f"step {k}: {pos.shape[0]} positions for {index.shape[0]} scheduled tokens")
            continue
        for i, r in enumerate(step["requests"]):
            a, b = qsl[i], qsl[i + 1]
            wrong = torch.nonzero(pos[a:b] != index[a:b]).flatten()
            if wrong.numel():
                j = int(wrong[0])
                wrong_positions.append(((int(index[a + j]), r), f"positions: request {r} token {int(index[a + j])} "
                                       f"ran at position {int(pos[a + j])} (step {k}; {wrong.numel()} of its {b - a} "
                                       f"rows wrong): the runtime's positions"))
        idx = step.get("logits_indices")
        if idx is not None and idx.numel():
            want = set(int(qsl[i + 1]) - 1 for i in range(len(step["requests"])))
            for row in idx.tolist():
                if row not in want:
                    seg = next((i for i in range(len(step["requests"])) if qsl[i] <= row < qsl[i + 1]), None)
                    who = f"request {step['requests'][seg]}'s token {int(index[row])}" if seg is not None else \
                        "no request's row"
                    out.append(f"sampled row: step {k} sampled from row {row} ({who}), not a request's last token: "
                               f"the runtime's logits_indices")
    return [f for _, f in sorted(wrong_positions)] + out  # the lowest wrong token first, as first_divergence


class ZooSide:
    """The zoo model built once (build_model, float32 or `dtype`) and run through a fresh engine per scenario.

    quantized=True (a GGUF file, or its opened loader source): its block-quantised weights stay as blocks and
    run on the block kernels (`zoo run`'s default for a GGUF: int16 activations in the decode GEMV of Q4_0 / Q4_1 /
    Q8_0 blocks, kernels.set_activation_bits); the reference dequantises.

    tensor_parallel_size=N: rank 0 of a tensor-parallel group (zoo/runtime/distributed.py) whose workers mirror
    every forward and head of every scenario's engine. Its taps are the points where every rank holds the whole
    tensor (taps.TP_REPLICATED_ROLES: after the row-parallel all-reduces and the vocab gather); column-split
    activations inside a block, and a shared expert's partial sum, are not compared.

    pipeline_parallel_size=N: stage 0 of a pipeline (zoo/runtime/pipeline.py) whose stages 1.. run their layers in
    their own processes (with tensor_parallel_size=T too: N stages of T ranks): only `serve` runs (the logits the last
    stage sends back for the sampled rows); `run`, which taps the modules and takes the head of every row, is refused.

    dtype=torch.bfloat16 (on the CPU): the compact weights and the KV caches stored in bfloat16, float32 math
    (zoo.build.storage_dtypes), as `zoo run --dtype bfloat16` runs it."""

    def __init__(self, path, *, device: str = "cpu", config=None, processor=None, tensor_parallel_size: int = 1,
                 quantized: bool = False, dtype: torch.dtype = torch.float32, pipeline_parallel_size: int = 1):
        from zoo.build import build_model

        self.tp = self.pp = None
        for what, size in (("tensor", tensor_parallel_size), ("pipeline", pipeline_parallel_size)):
            if size > 1 and str(device) != "cpu":
                raise ValueError(f"{what} parallel size {size} runs on gloo: device must be 'cpu'")
        if pipeline_parallel_size > 1:  # (its stages split by tensor parallelism within themselves: not self.tp)
            from zoo.runtime.pipeline import PipelineGroup

            self.pp = PipelineGroup(path, pipeline_parallel_size, dtype=dtype, tp=tensor_parallel_size)
        elif tensor_parallel_size > 1:
            from zoo.runtime.distributed import TensorParallelGroup

            self.tp = TensorParallelGroup(path, tensor_parallel_size, dtype=dtype)
        group = self.tp or self.pp
        if group is not None:
            self.model, self.config, self.spec, self.load_report = \
                group.model, group.config, group.spec, group.load_report
        else:
            self.model, self.config, self.spec, self.load_report = build_model(
                path, dtype=dtype, device=device, config=config, quantized=quantized)
        self.device = device
        self.processor = processor  # a multimodal model's: its engines take images

    def close(self) -> None:
        for group in (self.tp, self.pp):
            if group is not None:
                group.close()

    def whole_model(self) -> torch.nn.Module:
        """The model whose structure and built constants the harness reads: this process's, or over a pipeline (stage
        0 holds stand-ins for the other stages' modules) the whole model built again on the meta device (no
        weights; its constants are the ones each stage built its part with)."""
        if self.pp is None:
            return self.model
        with torch.device("meta"):
            return self.spec.build(self.config)

    def tap_names(self, wanted: set[str]) -> dict[str, str]:
        return zoo_tap_names(self.model, self.config, wanted)

    def _engine(self, prompts, *, max_tokens, block_size, max_num_batched_tokens=None, max_num_seqs=64,
                enable_prefix_caching=False, processor=None):
        from zoo.runtime.engine import LLMEngine

        total = sum(len(p) + max_tokens for p in prompts)
        budget = max_num_batched_tokens or max(2048, total)
        engine = LLMEngine(self.model, self.config, None, num_blocks=2 * (total // block_size + len(prompts)) + 4,
                           block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                           enable_prefix_caching=enable_prefix_caching, device=self.device,
                           processor=processor or self.processor,
                           pool_specs=getattr(self.pp, "pool_specs", None))  # (a pipeline: its costliest stage's)
        if self.tp is not None or self.pp is not None:  # the other processes' caches take this engine's shape, and
            (self.tp or self.pp).attach(engine)        # its steps go to them
        return engine

    def run(self, prompts: list[list[int]], wanted: set[str], *, max_tokens: int = 1, block_size: int = 16,
            max_num_batched_tokens: int | None = None, max_num_seqs: int = 64, enable_prefix_caching: bool = False,
            waves: list[list[int]] | None = None, images: list | None = None, stagger: bool = False,
            processor=None, allowed_token_ids: list[int] | None = None) -> ZooRun:
        """Run `prompts` (token ids) through a new engine, greedy, `max_tokens` each; `images[r]`: prompt r's
        images (its placeholders expanded in the token ids), for a multimodal model built with its processor
        (`processor`: this engine's instead); `allowed_token_ids`: the only tokens greedy may generate.

        `waves` runs groups of requests one after another (each wave to completion before the next is
        added): [[0], [1, 2]] runs request 0 alone, then 1 and 2 together. Default: all at once. `stagger`: one
        request added per step (`_drive`).
        """
        if self.pp is not None:  # (its layers past stage 0 run elsewhere, and the head returns sampled rows only)
            raise RuntimeError(f"pipeline parallel size {self.pp.stage.size}: the tapped run needs every module and "
                               f"the logits of every row in this process; only the served path runs over a pipeline")
        engine = self._engine(prompts, max_tokens=max_tokens, block_size=block_size,
                              max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                              enable_prefix_caching=enable_prefix_caching, processor=processor)
        names = self.tap_names(wanted)
        segments: list[list[tuple[str, int, int]]] = []  # per step: (request id, first token index, tokens)
        sampled: list[tuple[list[str], torch.Tensor]] = []
        watch = _watch(engine, segments, sampled)

        def meta(args, kwargs):
            positions = args[1] if len(args) > 1 else kwargs["positions"]
            batch = args[2] if len(args) > 2 else kwargs["batch"]
            return {"positions": positions.detach().cpu().clone(), "qsl": list(batch.query_start_loc_cpu),
                    "logits_indices": batch.logits_indices.detach().cpu().clone()}

        def logits_of_every_row(hidden):  # [T, H] -> [T, V], the zoo's own head on every row
            return self.model.compute_logits(hidden).detach().float().cpu()

        with Capture(self.model, names, inputs=input_taps(names, wanted), meta=meta,
                     root_output=logits_of_every_row) as cap:
            requests = _drive(engine, prompts, max_tokens, waves, images, stagger, allowed_token_ids)
        if len(cap.steps) != len(segments):
            raise RuntimeError(f"the model ran {len(cap.steps)} forwards for {len(segments)} prepared steps")

        steps, sampled_iter = [], iter(sampled)
        for step, segs in zip(cap.steps, segments):
            step.taps[LOGITS] = step.output  # [T, V]
            index = _token_index(segs, step.meta["qsl"])  # [T] the scheduler's token index of each row
            present = {}
            if step.meta["logits_indices"].numel():
                reqs, logits = next(sampled_iter)
                step.taps[SAMPLED], present[SAMPLED] = _sampled_at_last_rows(segs, step.meta["qsl"], reqs, logits,
                                                                             step.output.shape)
            steps.append({"requests": [int(r) for r, _, _ in segs], "query_start_loc": step.meta["qsl"],
                          "positions": step.meta["positions"], "token_index": index, "taps": step.taps,
                          "experts": step.experts, "present": present,
                          "logits_indices": step.meta["logits_indices"]})
        tokens = _computed_tokens(requests, segments, len(prompts))
        trace = from_steps(steps, cap.order + [LOGITS, SAMPLED], tokens)
        cached = dict(watch["first_computed"])
        outs = {int(rid): list(req.output_token_ids) for rid, req in requests.items()}
        findings = runtime_findings(steps)
        mm = engine.mm
        encoder = {} if mm is None else {"runs": mm.encoder_runs, "hits": mm.cache.hits}
        return ZooRun(trace, len(steps), cached, outs, findings, segments=segments, encoder=encoder,
                      restores=watch["restores"])

    def serve(self, prompts: list[list[int]], *, max_tokens: int, block_size: int = 16) -> ZooRun:
        """The path users run: the same engine with no hooks on the model (the fused native step where it
        applies); only the runner's logits_hook records what each request sampled from. Its trace holds
        SAMPLED alone, each row at its request's last token by the scheduler's accounting."""
        engine = self._engine(prompts, max_tokens=max_tokens, block_size=block_size)
        segments, sampled = [], []
        watch = _watch(engine, segments, sampled)
        requests = _drive(engine, prompts, max_tokens, None)
        steps, sampled_iter = [], iter(sampled)
        for segs, (positions, idx) in _whole_steps(segments, watch["batches"], watch["steps"]):
            qsl = [0]
            for _, _, n in segs:
                qsl.append(qsl[-1] + n)
            if not idx.numel():  # nobody sampled in this step: the logits hook did not run
                continue
            reqs, logits = next(sampled_iter)
            rows, present = _sampled_at_last_rows(segs, qsl, reqs, logits, (qsl[-1], logits.shape[-1]))
            steps.append({"requests": [int(r) for r, _, _ in segs], "query_start_loc": qsl,
                          "positions": positions, "token_index": _token_index(segs, qsl), "logits_indices": idx,
                          "taps": {SAMPLED: rows}, "present": {SAMPLED: present}})
        tokens = _computed_tokens(requests, segments, len(prompts))
        trace = from_steps(steps, [SAMPLED], tokens)
        outs = {int(rid): list(req.output_token_ids) for rid, req in requests.items()}
        return ZooRun(trace, len(watch["steps"]), {}, outs, runtime_findings(steps), fused_steps=watch["fused"])
