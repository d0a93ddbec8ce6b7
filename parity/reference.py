"""The reference side: transformers' own model, float32, eager attention, taps captured with hooks.

Shape legend:
    B = prompts in one reference batch     S = longest prompt of the batch     H = hidden size
    V = vocabulary                         L_r = tokens of request r

Prompts run one at a time, unpadded (the default: nothing to mask), or right-padded together with an
attention mask (`padded=True`); either way only each prompt's real rows leave this module.
Each decoder layer's call (its hidden input and the mask / rotary / position kwargs transformers gave
it) is kept so that `replay_layer` can run that very layer again on the zoo's input.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers

from parity.align import Trace, from_padded
from parity.taps import EMBEDDED, LOGITS, Capture, first_layer, reference_taps


def load_reference(path, *, device: str = "cpu", **kwargs):
    """transformers' AutoModelForCausalLM (AutoModelForImageTextToText for a multimodal config) from a
    checkpoint directory, float32, eager attention. `kwargs` go to from_pretrained (e.g. gguf_file=...)."""
    config = transformers.AutoConfig.from_pretrained(str(path), **kwargs)
    auto = transformers.AutoModelForImageTextToText if hasattr(config, "vision_config") \
        else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", **kwargs
    )
    return model.to(device).eval()


@dataclass
class RefBatch:
    requests: list[int]  # request indices of the batch's rows
    seq_len: int  # S
    layer_calls: dict[str, tuple[tuple, dict]] = field(default_factory=dict)  # layer tap -> (args, kwargs)


@dataclass
class RefRun:
    trace: Trace
    batches: list[RefBatch]
    taps: dict[str, str]  # tap -> role


@torch.no_grad()
def run_reference(model, tokens: list[list[int]], *, padded: bool = False, pad_id: int = 0,
                  keep_layer_calls: bool = True) -> RefRun:
    taps = reference_taps(model)
    device = next(model.parameters()).device
    groups = [list(range(len(tokens)))] if padded else [[r] for r in range(len(tokens))]
    raw, batches, order = [], [], []
    for reqs in groups:
        s = max(len(tokens[r]) for r in reqs)
        ids = torch.full((len(reqs), s), pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), s), dtype=torch.long)
        for k, r in enumerate(reqs):
            ids[k, : len(tokens[r])] = torch.tensor(tokens[r])
            mask[k, : len(tokens[r])] = 1
        first = first_layer(taps)
        with Capture(model, {n: n for n in taps}, inputs={first: EMBEDDED} if first else None,
                     keep_layer_calls=keep_layer_calls, root_output=False) as cap:
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        step = cap.steps[-1]
        step.taps[LOGITS] = out.logits.detach().float().cpu()  # [B, S, V], final softcapping included
        raw.append((reqs, s, step.taps, step.experts))
        batches.append(RefBatch(reqs, s, step.layer_calls))
        order = order or cap.order + [LOGITS]
    return RefRun(from_padded(raw, order, tokens), batches,
                  {**taps, **({EMBEDDED: "embed"} if first_layer(taps) else {}), LOGITS: "logits"})


@torch.no_grad()
def replay_layer(model, run: RefRun, layer: str, inputs: list[torch.Tensor],
                 substitute: dict[str, list[torch.Tensor]] | None = None
                 ) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[torch.Tensor]]]:
    """Run reference layer `layer` again, on `inputs` ([L_r, H] per request) instead of its own input.

    Returns (rows, experts): for the layer's own tap and every tap inside it, the rows per request
    [L_r, *D] the reference computes from the zoo's input to that layer, and its routers' chosen experts
    [L_r, K]. Mask, rotary tables and positions are the ones transformers built for the original call.
    `substitute` {tap inside the layer: rows per request}: that sub-module's output is replaced by these rows
    (the zoo's), so what follows it computes from the zoo's value: each tap's own added error.
    """
    modules = dict(model.named_modules())
    module = modules[layer]
    inside = {n: n for n, role in run.taps.items() if n == layer or n.startswith(layer + ".")}
    out: dict[str, list] = {n: [None] * len(run.trace.lengths) for n in inside}
    experts: dict[str, list] = {}
    for batch in run.batches:
        if layer not in batch.layer_calls:
            raise RuntimeError(f"reference layer {layer} was not recorded: run_reference(keep_layer_calls=True)")
        args, kwargs = batch.layer_calls[layer]
        hidden = args[0] if args else kwargs["hidden_states"]  # [B, S, H]
        new = hidden.clone()
        for k, r in enumerate(batch.requests):
            new[k, : run.trace.lengths[r]] = inputs[r].to(new.dtype).to(new.device)
        call_args, call_kwargs = ((new, *args[1:]), kwargs) if args else ((), {**kwargs, "hidden_states": new})
        handles = [modules[t].register_forward_hook(_replace_rows(rows, batch.requests, run.trace.lengths))
                   for t, rows in (substitute or {}).items()]
        try:
            with Capture(model, inside, root_output=False) as cap:
                module(*call_args, **call_kwargs)
        finally:
            for h in handles:
                h.remove()
        b, s = len(batch.requests), batch.seq_len
        for dest, values in ((out, cap.steps[-1].taps), (experts, cap.steps[-1].experts)):
            for tap, x in values.items():
                x = x if tuple(x.shape[:2]) == (b, s) else x.reshape(b, s, *x.shape[1:])
                per = dest.setdefault(tap, [None] * len(run.trace.lengths))
                for k, r in enumerate(batch.requests):
                    per[r] = x[k, : run.trace.lengths[r]]
    return out, experts


@torch.no_grad()
def replay_head(model, run: RefRun, final_norm: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The reference's logits [L_r, V] per request with its final norm's output replaced by `inputs` ([L_r, H] per
    request, the zoo's): the model's own forward, so whatever it applies after that norm (the head, a logit scale
    or divisor, softcapping) applies as it does."""
    norm = dict(model.named_modules())[final_norm]
    device = next(model.parameters()).device
    out: list = [None] * len(run.trace.lengths)
    for batch in run.batches:
        ids = torch.zeros((len(batch.requests), batch.seq_len), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for k, r in enumerate(batch.requests):
            ids[k, : run.trace.lengths[r]] = torch.tensor(run.trace.tokens[r])
            mask[k, : run.trace.lengths[r]] = 1
        handle = norm.register_forward_hook(_replace_rows(inputs, batch.requests, run.trace.lengths))
        try:
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
        finally:
            handle.remove()
        for k, r in enumerate(batch.requests):
            out[r] = logits[k, : run.trace.lengths[r]].float().cpu()
    return out


def _replace_rows(rows: list[torch.Tensor], requests: list[int], lengths: list[int]):
    """A forward hook putting rows [L_r, D] per request into a module's [B, S, D] (or [B*S, D]) output."""
    def hook(module, args, out):
        x = out[0] if isinstance(out, tuple) else out
        new = x.clone().reshape(len(requests), -1, x.shape[-1])  # [B, S, D]
        for k, r in enumerate(requests):
            new[k, : lengths[r]] = rows[r].to(new.dtype).to(new.device)
        new = new.reshape(x.shape)
        return (new, *out[1:]) if isinstance(out, tuple) else new
    return hook
