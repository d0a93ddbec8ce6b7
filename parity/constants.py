"""Config-level checks: the numbers each module was built with, zoo vs reference, compared by name.

A norm eps of 1e-5 instead of 1e-6 moves a layer's output by ~2e-6, below every numerical tolerance; so the
harness also reads the constants both sides built each module with and names any that differ. Every reference
module joins the zoo module of its name (through `parity_taps`), taps or not: a Mamba2 mixer's gated norm, per-head
q/k norms, the model root. A zoo module states its numbers as attributes (the shared layers do):

    any module  eps                                reference: variance_epsilon / eps / epsilon
                residual_multiplier, embedding_multiplier, time_step_limit   (the same names on both sides)
    attn        attn.scale (or scale), attn.sliding_window, attn.softcap
                                                   reference: scaling, sliding_window, attn_logit_softcapping
    rope        self_attn.rotary_emb.inv_freq() -> (inv_freq [F], attention scaling)
                                                   reference: the model's rotary_emb buffers of the layer's type
    embed       scale (None = 1)                   reference: embed_scale
    lm_head     softcap, divisor, scale            reference: final_logit_softcapping, logits_scaling,
                                                   logit_scale (the config's)
A constant either side does not state is not compared (`checked` lists what was).
"""
from __future__ import annotations

import math

import torch

from parity.taps import role_of, zoo_tap_names

REL = 1e-6  # two builds of one constant agree to float rounding


EPS = ("variance_epsilon", "eps", "epsilon")  # a reference module's eps, under its names
SAME_NAME = ("residual_multiplier", "embedding_multiplier", "time_step_limit")  # stated alike on both sides


def _num(x):
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return float(x)
    if isinstance(x, (list, tuple)):
        return tuple(_num(v) for v in x)
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x


def _differs(a, b) -> bool:
    a, b = _num(a), _num(b)
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return any(_differs(x, y) for x, y in zip(a, b))
    if isinstance(a, (str, tuple)) or isinstance(b, (str, tuple)):
        return a != b
    if a is None or b is None:
        return (a is None) != (b is None)
    return not math.isclose(a, b, rel_tol=REL, abs_tol=1e-12)


def _first(obj, *names):
    for n in names:
        if hasattr(obj, n):
            return True, getattr(obj, n)
    return False, None


def built_constants(ref_model, zoo_model, config, wanted: set[str]) -> dict:
    """{"checked": [what was compared], "mismatches": ["<module> <constant>: zoo X, reference Y"]}."""
    ref_modules = dict(ref_model.named_modules())
    zoo_modules = dict(zoo_model.named_modules())
    joined = {ref: zoo_modules[z] for z, ref in zoo_tap_names(zoo_model, config, set(ref_modules)).items()}
    checked, bad = [], []

    def check(name, what, zoo_value, ref_value):
        checked.append(f"{name} {what}")
        if _differs(zoo_value, ref_value):
            bad.append(f"{name} {what}: zoo {_num(zoo_value)!r}, reference {_num(ref_value)!r}")

    cfg = getattr(config, "text_config", None) or config
    rotary = next((m for n, m in ref_modules.items() if n.endswith("rotary_emb") and "layers." not in n), None)
    for name, zoo in joined.items():
        ref, role = ref_modules.get(name), role_of(name)
        if ref is None:
            continue
        has_ref, eps_ref = _first(ref, *EPS)
        if not has_ref and isinstance(ref, torch.nn.ModuleList) and len(ref) and \
                len({_first(h, *EPS) for h in ref}) == 1:  # a norm per head (StableLM's q/k): the zoo's one module
            has_ref, eps_ref = _first(ref[0], *EPS)
        if has_ref and isinstance(getattr(zoo, "eps", None), (int, float)):
            check(name or "(model)", "eps", zoo.eps, eps_ref)
        for what in SAME_NAME:
            if hasattr(ref, what) and hasattr(zoo, what):
                check(name or "(model)", what, getattr(zoo, what), getattr(ref, what))
        if name not in wanted:  # (the checks below are the taps')
            continue
        if role == "attn":
            core = getattr(zoo, "attn", zoo)
            for what, ref_names, zoo_name in (("scale", ("scaling",), "scale"),
                                              ("sliding_window", ("sliding_window",), "sliding_window"),
                                              ("softcap", ("attn_logit_softcapping",), "softcap")):
                has_ref, want = _first(ref, *ref_names)
                has_zoo, got = _first(core, zoo_name)
                if has_ref and has_zoo:
                    check(name, what, got, want)
            _check_rope(name, ref, zoo, rotary, cfg, check)
        elif role == "embed":
            has_ref, want = _first(ref, "embed_scale")
            if has_ref and hasattr(zoo, "scale"):
                check(name, "scale", 1.0 if zoo.scale is None else zoo.scale, want)
    head = zoo_modules.get("lm_head")
    for what, ref_value in (("softcap", getattr(cfg, "final_logit_softcapping", None)),
                            ("divisor", getattr(cfg, "logits_scaling", None)),  # Granite: logits / logits_scaling
                            ("scale", getattr(cfg, "logit_scale", None))):  # Cohere: logits * logit_scale
        if head is not None and hasattr(head, what) and (what == "softcap" or ref_value is not None):
            value = getattr(head, what)
            check("lm_head", {"softcap": "final_logit_softcapping", "divisor": "logits_scaling",
                              "scale": "logit_scale"}[what], 1.0 if value is None and what != "softcap" else value,
                  ref_value)
    return {"checked": checked, "mismatches": bad}


def _check_rope(name, ref_attn, zoo_attn, rotary, cfg, check) -> None:
    rope = getattr(zoo_attn, "rotary_emb", None)
    if rotary is None or rope is None or not callable(getattr(rope, "inv_freq", None)):
        return
    layer_type = getattr(ref_attn, "layer_type", None)
    prefix = f"{layer_type}_" if layer_type and hasattr(rotary, f"{layer_type}_inv_freq") else ""
    want = getattr(rotary, f"{prefix}inv_freq", None)
    if not isinstance(want, torch.Tensor):
        return
    got, scaling = rope.inv_freq()
    got = got.to(want.device)
    if got.shape != want.shape:
        check(name, "rope inv_freq shape", tuple(got.shape), tuple(want.shape))
        return
    rel = ((got.double() - want.double()).abs() / want.double().abs().clamp_min(1e-30)).max().item()
    check(name, "rope inv_freq", f"differs by up to {rel:.1e} relative (theta, rope scaling, partial rotary)"
          if rel > REL else "equal", "equal")
    has_scaling, ref_scaling = _first(rotary, f"{prefix}attention_scaling", "attention_scaling")
    if has_scaling:
        check(name, "rope attention scaling", scaling, ref_scaling)
