"""Localisation: which block adds the error, at which position, and why it likely did.

Method: layer replay. A decoder layer's output error has two parts, the error it inherited in its
input and the error it adds itself. Comparing growth of relative error from input to output cannot
separate them (a layer can amplify or damp an inherited error), so instead we measure the added part
directly: the reference's own layer i is run again on the zoo's input to layer i (the zoo's output of
layer i-1, or its embedding output for layer 0), with the very mask, rotary tables and positions
transformers built for that call. Then

    inherited_i = rel_l2(zoo_in_i,  ref_in_i)
    total_i     = rel_l2(zoo_out_i, ref_out_i)
    local_i     = rel_l2(zoo_out_i, ref_layer_i(zoo_in_i))      <- error the zoo's layer i adds itself

and the same for every tap inside layer i (norms, attention, router, MLP/MoE): each is compared with
what the reference's sub-block computes inside the replayed layer. A correct zoo layer has local_i at
rounding level whatever it inherited; the culprit is the first layer whose local error exceeds the
tolerance, and inside it the first tap, in execution order, that does (the ones after it inherit).
Embedding taps have no input to replay: their local error is their error (EMBEDDED, the first layer's input, is
layer 0's input here, so an embedding multiplier or position embedding is the embedding's error, not layer 0's).
The final norm is replayed on the zoo's last-layer output, the logits on the zoo's final-norm output through the
reference's own forward (its head and every multiplier or softcap it applies after the norm).

Hints come from the pattern of the culprit's per-position local error and from cheap hypothesis tests
that run reference modules on the zoo's tensors (e.g. the post-attention norm of the attention output
alone = a missing residual add).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parity import metrics
from parity.align import Trace
from parity.compare import first_bad
from parity.reference import RefRun, replay_head, replay_layer
from parity.taps import EMBEDDED, LOGITS, layer_of, role_of, short

EXPERTS = "experts:"  # key prefix of the replayed routers' chosen experts
SSM_ROLES = ("mixer_in", "mixer_conv", "mixer_norm", "mixer")


def limit(tol: dict[str, float], tap: str) -> float:
    """The bound of a tap's own added error: `ssm_local` for a recurrent mixer's taps where the set has one (a
    bfloat16 run: nothing in a mixer is rounded, so its own error is float32's however much it inherits),
    else rel_l2."""
    return tol.get("ssm_local", tol["rel_l2"]) if role_of(tap) in SSM_ROLES else tol["rel_l2"]

HINTS = {
    "embed": "embedding: vocabulary rows, padding row, or an embedding scale (Gemma multiplies by sqrt(hidden_size))",
    "norm": "RMSNorm: eps, weight offset (Gemma stores w - 1 and computes x * (1 + w)), or the dtype the product is taken in",
    "attn": "attention: q/k/v projection split, head_dim, scaling, q/k norm, KV-head grouping or the rotary embedding",
    "router": "router gate: its weight, or which input it sees",
    "mixer_in": "SSM mixer input: in_proj's split order (gate | xBC | dt) or its bias",
    "mixer_conv": "SSM mixer conv: the causal window (zeros before the sequence, K - 1 carried inputs), conv bias, SiLU",
    "mixer_norm": "SSM scan or gated norm: dt softplus / bias / clamp, A = -exp(A_log), D skip, chunk alignment, "
                  "state carried across steps, or the gate applied before the group RMS",
    "mixer": "SSM mixer: out_proj, or (Mamba1) the D skip and the silu(z) gate",
    "mlp": "MLP / MoE: gate/up order in the fused gate_up_proj, the activation (silu vs gelu), expert stacking or combine weights",
    "shared_expert": "shared expert: its MLP or its sigmoid gate",
    "layer": "the decoder layer's residual adds (every sub-block inside it matches)",
    "final_norm": "final norm: eps or weight offset",
    "logits": "LM head: tied vs untied weights, a logit scale or divisor (Cohere's logit_scale, Granite's "
              "logits_scaling), final logit softcapping, vocabulary padding",
}
EMBEDDED_HINT = ("the first layer's input: what the model does between the embedding and layer 0, an embedding "
                 "multiplier or scale (Granite's embedding_multiplier), position embeddings added (GPT-2's wpe), "
                 "image features merged at the placeholders")


@dataclass
class Block:
    """Replay result for one decoder layer (or embed / final norm / logits)."""

    name: str
    layer: int | None
    inherited: float  # max relative error of the block input (zoo vs reference)
    total: float  # max relative error of the block output
    local: float  # max relative error the block adds itself
    sub: dict[str, float] = field(default_factory=dict)  # tap inside the layer -> local max rel error
    local_rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # tap -> per request [L_r]


@dataclass
class Localization:
    blocks: list[Block]
    culprit: dict | None  # {"block", "layer", "tap", "role", "request", "position", "local"}
    hints: list[str]


def _rel(ref_rows: list[torch.Tensor], got_rows: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per request [L_r] relative L2 at the positions of `masks` (NaN elsewhere, inf where a row is non-finite)."""
    out = []
    for a, b, m in zip(ref_rows, got_rows, masks):
        rel = torch.full((m.shape[0],), float("nan"), dtype=torch.float64)
        if m.any():
            rel[m] = metrics.compare_rows(a[m], b[m]).rel_l2
        out.append(rel)
    return out


def _max(rows: list[torch.Tensor]) -> float:
    """The largest value over the positions compared (the NaN of the positions outside the masks left out)."""
    vals = [r[~r.isnan()] for r in rows]
    vals = [v for v in vals if v.numel()]
    return torch.cat(vals).max().item() if vals else float("nan")


def _masks(masks: list[torch.Tensor], *traces_and_taps) -> list[torch.Tensor]:
    """`masks` narrowed to the positions where each (trace, tap) given has a row."""
    out = list(masks)
    for trace, tap in traces_and_taps:
        out = [m & p for m, p in zip(out, trace.mask(tap))]
    return out


def _block_inputs(order: list[str]) -> dict[str, str]:
    """layer tap -> the tap whose output is its input (previous layer, or the embedding)."""
    out, prev = {}, None
    for name in order:
        role = role_of(name)
        if role == "embed":
            prev = name
        elif role == "layer":
            if prev is not None:
                out[name] = prev
            prev = name
    return out


def localize(ref_model, ref_run: RefRun, ref: Trace, zoo: Trace, masks: list[torch.Tensor],
             tol: dict[str, float], config=None, *, replay: bool = True) -> Localization:
    """Replay each decoder layer on the zoo's input; name the culprit block, tap and position."""
    inputs = _block_inputs(ref.order)
    modules = dict(ref_model.named_modules())
    blocks: list[Block] = []
    culprit, replayed_culprit = None, None
    prev = None  # the last block output tap: the input of the final norm, then of the logits
    for name in ref.order:
        role = role_of(name)
        if name not in zoo.rows or role not in ("embed", "layer", "final_norm", "logits"):
            continue
        src = inputs.get(name, prev)
        here = _masks(masks, (ref, name), (zoo, name))  # where both sides have this tap
        total_rows = _rel(ref.rows[name], zoo.rows[name], here)
        inherited = _max(_rel(ref.rows[src], zoo.rows[src], _masks(masks, (ref, src), (zoo, src)))) \
            if src in zoo.rows else 0.0
        replayed = None
        if role == "layer" and replay and src in zoo.rows:
            replayed, chosen = replay_layer(ref_model, ref_run, name, _zoo_input(zoo, ref, src))
            replayed = {**replayed, **{EXPERTS + t: v for t, v in chosen.items()}}
            inner = [t for t in ref.order if t.startswith(name + ".") and t in zoo.rows and t in replayed]  # ordered
            local_rows = {t: _rel(replayed[t], zoo.rows[t], _masks(here, (zoo, t))) for t in inner + [name]}
        elif role in ("final_norm", "logits") and replay and src in zoo.rows:
            replayed = {name: replay_head(ref_model, ref_run, src, _zoo_input(zoo, ref, src))
                        if role == "logits" and role_of(src) == "final_norm"
                        else _head(ref_model, modules, name, _zoo_input(zoo, ref, src), config)}
            local_rows = {name: _rel(replayed[name], zoo.rows[name], here)}
        elif role == "embed":
            local_rows = {name: total_rows}  # nothing feeds it: all its error is its own
        else:  # no replay: only the totals
            blocks.append(Block(name, layer_of(name), inherited, _max(total_rows), float("nan")))
            prev = name
            continue
        blocks.append(Block(name, layer_of(name), inherited, _max(total_rows), _max(local_rows[name]),
                            {t: _max(v) for t, v in local_rows.items() if t != name}, local_rows))
        if culprit is None:
            culprit = _first_local(name, local_rows, replayed, zoo, masks, tol)
            replayed_culprit = replayed
            if culprit is not None and role == "layer" and culprit["role"] not in ("router", "layer"):
                culprit = _own_error_culprit(ref_model, ref_run, name, inner, culprit, local_rows,
                                             _zoo_input(zoo, ref, src), zoo, ref, here, tol) or culprit
        prev = name
    hints = _hints(ref_model, culprit, blocks, ref, zoo, masks, tol, config, replayed_culprit) if culprit else []
    return Localization(blocks, culprit, hints)


def _own_error_culprit(ref_model, ref_run, block, inner, culprit, local_rows, layer_input, zoo, ref, here,
                       tol) -> dict | None:
    """Blame by each tap's own added error: replay the layer with the zoo's outputs of every sub-block before
    tap t in place of the reference's, so t's error no longer holds what an upstream sub-block added (an MLP
    amplifying a small residual slip is not to blame). Returns the first tap whose own error exceeds the
    tolerance, the layer's own tap last (its residual adds, every sub-block fed the zoo's values), or None
    when that is the first-local culprit already."""
    taps, own_max = inner + [block], {}
    for i, t in enumerate(taps):
        upstream = {u: _zoo_input(zoo, ref, u) for u in taps[:i] if role_of(u) != "router"}
        if upstream:
            rows, _ = replay_layer(ref_model, ref_run, block, layer_input, substitute=upstream)
            own = _rel(rows[t], zoo.rows[t], _masks(here, (zoo, t)))
        else:
            own = local_rows[t]
        own_max[t] = (_max(own), own)
        hit = first_bad([r > limit(tol, t) for r in own])
        if hit is None:
            continue
        if t == culprit["tap"]:
            return None
        r, p = hit
        return {"block": block, "layer": layer_of(block), "tap": t, "role": role_of(t), "request": r, "position": p,
                "local": own[r][p].item(), "inherits": culprit["tap"]}
    # no sub-block is over tolerance on its own: the largest own error, amplified downstream, is to blame
    t = max(own_max, key=lambda k: own_max[k][0])
    if t == culprit["tap"]:
        return None
    rows = own_max[t][1]
    r, p = first_bad([x >= 0.1 * own_max[t][0] for x in rows])  # where it starts, not where it peaks
    return {"block": block, "layer": layer_of(block), "tap": t, "role": role_of(t), "request": r, "position": p,
            "local": rows[r][p].item(), "inherits": culprit["tap"], "amplified": True}


def _first_local(block: str, local_rows, replayed, zoo: Trace, masks, tol) -> dict | None:
    """The first tap of a block (execution order, the block's own tap last) with a local error out of
    tolerance, and its first position; a router also fails when it chose other experts."""
    for t, rows in local_rows.items():
        bad, agree = [r > limit(tol, t) for r in rows], None
        if replayed is not None and EXPERTS + t in replayed and t in zoo.experts:
            agree = [_agreement(w, z, m) for w, z, m in zip(replayed[EXPERTS + t], zoo.experts[t], masks)]
            bad = [b | (a < tol["experts"]) for b, a in zip(bad, agree)]
        hit = first_bad(bad)
        if hit is not None:
            r, p = hit
            out = {"block": block, "layer": layer_of(block), "tap": t, "role": role_of(t), "request": r,
                   "position": p, "local": rows[r][p].item()}
            if agree is not None:
                out["experts"] = agree[r][p].item()
            return out
    return None


def _agreement(want: torch.Tensor, got: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[L] fraction of the reference's chosen experts the zoo chose too (NaN outside `mask`)."""
    out = torch.full((mask.shape[0],), float("nan"), dtype=torch.float64)
    if mask.any():
        out[mask] = metrics.compare_experts(want[mask], got[mask])
    return out


def _zoo_input(zoo: Trace, ref: Trace, src: str) -> list[torch.Tensor]:
    """The zoo's rows of tap `src` where it computed them, the reference's elsewhere (outside the scenario)."""
    return [torch.where(h.unsqueeze(-1), z.nan_to_num(), r) for h, z, r in zip(zoo.have, zoo.rows[src], ref.rows[src])]


@torch.no_grad()
def _head(ref_model, modules, name: str, inputs: list[torch.Tensor], config) -> list[torch.Tensor]:
    """Position-wise reference modules on the zoo's rows: the final norm, or LM head + final softcapping."""
    dev = next(ref_model.parameters()).device
    if name != LOGITS:
        return [modules[name](x.float().to(dev)).float().cpu() for x in inputs]
    head = ref_model.get_output_embeddings()
    cap = getattr(getattr(config, "text_config", None) or config, "final_logit_softcapping", None)
    out = [head(x.float().to(dev)).float().cpu() for x in inputs]
    return [torch.tanh(o / cap) * cap for o in out] if cap else out


# -- hints ---------------------------------------------------------------------------------------------
def _sliding_window(config, layer: int | None) -> int | None:
    if config is None:
        return None
    cfg = getattr(config, "text_config", None) or config
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if window and types and layer is not None and layer < len(types):
        return window if "sliding" in str(types[layer]) else None
    if window and getattr(cfg, "use_sliding_window", True) is not False:
        return window
    return None


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return bool(metrics.compare_rows(a, b).rel_l2.max() <= tol) if a.numel() else False


def _hints(ref_model, culprit, blocks, ref: Trace, zoo: Trace, masks, tol, config, replayed) -> list[str]:
    tap, role, layer, pos = culprit["tap"], culprit["role"], culprit["layer"], culprit["position"]
    block = next(b for b in blocks if b.name == culprit["block"])
    rows = block.local_rows.get(tap, [])
    bad = [r > limit(tol, tap) for r in rows]
    at_0 = [not b[0] for b, m in zip(bad, masks) if m.shape[0] and m[0]]  # requests whose position 0 was compared
    ok_at_0 = bool(at_0) and all(at_0)
    first_pos = min((int(torch.nonzero(b).flatten()[0]) for b in bad if b.any()), default=pos)
    where = f"{short(tap)} at position {first_pos}"
    hints = [f"{where}: {EMBEDDED_HINT if tap == EMBEDDED else HINTS.get(role, 'this block')}"]
    window = _sliding_window(config, layer)
    if role == "attn":
        if window is not None and window - 1 <= first_pos <= window + 1 and first_pos > 0:
            hints.insert(0, f"{where}: divergence starts at the sliding window ({window} tokens); check the window "
                            f"bounds (a token sees itself and the {window - 1} before it)")
        elif ok_at_0 and first_pos > 0:
            hints.insert(0, f"{where}: position 0 matches and later positions do not: rotary embedding "
                            f"(rotate-half vs interleaved pairs, which half of head_dim, theta, scaling, partial rotary)")
        elif at_0 and not ok_at_0:
            hints.insert(0, f"{where}: wrong from position 0 on, where rotary is the identity: projections / head "
                            f"mapping (q/k/v split, KV head -> query group, head_dim, o_proj layout)")
    if role in ("norm", "final_norm", "layer") and replayed is not None:
        hints[:0] = _norm_and_residual_hints(ref_model, tap, role, layer, block, ref, zoo, masks, tol, replayed)
    if role in ("mlp", "router") and replayed is not None:
        hints[:0] = _routing_hints(tap if role == "mlp" else tap.rsplit(".", 1)[0], block, zoo, masks, replayed)
    if culprit.get("inherits"):
        hints.insert(1, f"{short(culprit['inherits'])} is the first tap over tolerance but only by what it inherits: "
                        f"with every sub-block before it fed the zoo's values its own error is within tolerance; "
                        f"{short(tap)} adds {culprit['local']:.1e} itself"
                        + (" (below tolerance, amplified downstream)" if culprit.get("amplified") else ""))
    nonfinite = [int(torch.nonzero(r == float("inf")).flatten()[0]) for r in rows if (r == float("inf")).any()]
    if nonfinite:
        hints.insert(0, f"{short(tap)} at position {min(nonfinite)}: non-finite values (NaN/Inf) first appear here, "
                        f"on a finite input: a read of a cache slot never written (slot_mapping / block_tables), "
                        f"uninitialised memory (torch.empty), a division by zero or an overflow")
    return hints


def _routing_hints(tap, block, zoo: Trace, masks, replayed) -> list[str]:
    """A MoE block wrong on the right input: did the router pick other experts from the same logits?"""
    out = []
    for router in [t for t in zoo.experts if t.startswith(tap + ".") and EXPERTS + t in replayed]:
        rel = block.local_rows.get(router)
        logits_ok = rel is not None and all((r[m] <= 1e-4).all() for r, m in zip(rel, masks))
        agree = torch.cat([a[m] for a, m in zip(map(_agreement, replayed[EXPERTS + router], zoo.experts[router],
                                                    masks), masks)])
        if agree.numel() and agree.min() < 1:
            first = f"{agree.lt(1).double().mean().item():.0%} of positions"
            out.append(f"{short(router)}: {'same router logits but ' if logits_ok else ''}other experts chosen at "
                       f"{first}: top-k selection, softmax before/after top-k, group-limited routing, score bias")
        elif logits_ok:
            out.append(f"{short(tap)}: same router logits and experts: the expert weights (w1/w3 order, stacking) "
                       f"or the combine (routing weights, renormalisation, shared expert)")
    return out


def _norm_and_residual_hints(ref_model, tap, role, layer, block, ref, zoo, masks, tol, replayed) -> list[str]:
    """Hypothesis tests with the reference's own modules on the zoo's tensors."""
    modules = dict(ref_model.named_modules())
    prefix = block.name
    mk = lambda rows: torch.cat([r[m] for r, m in zip(rows, masks)])  # [P, D] over compared positions
    out = []
    if role == "layer":
        for sub in [t for t in zoo.order if t.startswith(prefix + ".") and role_of(t) == "mlp"]:
            if _close(mk(zoo.rows[sub]), mk(zoo.rows[tap]), 1e-3):
                out.append(f"{short(tap)}: the layer output equals its MLP output alone: the residual add after "
                           f"the MLP is missing (or a fused-residual layer returns (hidden, residual) without "
                           f"declaring parity_output = \"sum\", see parity/taps.py)")
        return out
    norm = modules.get(tap)
    zoo_out = mk(zoo.rows[tap])
    want = mk(replayed[tap])  # what the reference norm gives in the replayed layer
    # which tap feeds this norm inside the layer: the attention output (post-attention norm)?
    inner = [t for t in ref.order if t.startswith(prefix + ".")]
    before = inner[: inner.index(tap)] if tap in inner else []
    attn = next((t for t in reversed(before) if role_of(t) == "attn"), None)
    if norm is not None and attn is not None and attn in zoo.rows:
        with torch.no_grad():
            alone = norm(mk(zoo.rows[attn]).float().to(norm.weight.device)).float().cpu()
        if _close(alone, zoo_out, 1e-4):
            out.append(f"{short(tap)}: equals the norm of the attention output alone: the residual add after "
                       f"attention is missing")
            return out
    ratio = zoo_out.double() / want.double().where(want.abs() > 1e-6, torch.nan)  # [P, D]
    row_spread = (ratio.nanquantile(0.9, dim=1) - ratio.nanquantile(0.1, dim=1)).abs().nanmedian().item()
    col_spread = (ratio.nanquantile(0.9, dim=0) - ratio.nanquantile(0.1, dim=0)).abs().nanmedian().item()
    if row_spread < 1e-3:
        out.append(f"{short(tap)}: zoo / reference is one scale per token: the eps (or the mean) of the norm differs")
    elif col_spread < 1e-3:
        out.append(f"{short(tap)}: zoo / reference is one scale per channel: a weight offset (w vs 1 + w)")
    return out
