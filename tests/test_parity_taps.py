"""Every registered architecture has parity taps where a bug can sit, and a bug there is named at its block.

Taps (parity/taps.py): the token embedding and EMBEDDED (the first layer's input), every decoder layer with its
attention or mixer and MLP (every weight of a layer lies under a tap inside it), the final norm and the logits,
each joined by a zoo module. Then bugs planted in the zoo's built model (a forward hook scaling one module's
output, or a multiplier the model was built with set 1% off) must be localised at that module by the prefill
scenario's replay: the embedding, the first layer's attention / mixer, the final norm, and the multipliers of
Granite, GraniteMoE and Cohere (embedding, residual, attention, logits).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from parity.harness import run_parity
from parity.reference import load_reference
from parity.taps import EMBEDDED, LOGITS, first_layer, layer_of, reference_taps, role_of, zoo_tap_names
from registry import get_registry
from tiny_configs import TINY_CONFIGS, save_arch

REGISTERED = sorted(a for a, s in get_registry().specs.items() if not s.plugin.startswith("mutant-"))
SLIP = 1.01  # a planted bug: 1% off, 10x over the loosest float32 tolerance (rel_l2 1e-3)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = save_arch(arch, tmp_path_factory.mktemp(arch))
        return made[arch]
    return get


def _covered(name: str, taps) -> bool:
    return any(name == t or name.startswith(t + ".") for t in taps)


@pytest.mark.parametrize("arch", REGISTERED)
def test_every_architecture_has_taps_at_every_block(arch, checkpoints):
    """A tap for the embedding and the first layer's input, each layer's attention or mixer and its MLP (every
    weight of a layer under a tap inside the layer), the final norm, the logits; each joined by a zoo module."""
    from zoo.build import build_model

    if arch not in TINY_CONFIGS:
        pytest.fail(f"{arch}: no tiny config (tests/tiny_configs.py)")
    path = checkpoints(arch)
    ref = load_reference(path)
    taps = reference_taps(ref)
    names = {id(m): n for n, m in ref.named_modules()}
    decoder = names[id(ref.get_decoder())]
    text = {t: r for t, r in taps.items() if t == decoder or t.startswith(decoder + ".")}
    roles = set(text.values())
    assert {"embed", "final_norm"} <= roles, f"{arch}: taps {sorted(roles)} lack the embedding or the final norm"
    assert first_layer(text), f"{arch}: no first decoder layer beside the embedding for {EMBEDDED}"
    layers = sorted({t for t, r in text.items() if r == "layer"}, key=layer_of)
    assert layers, f"{arch}: no decoder layer taps"
    for layer in layers:
        inside = [t for t in text if t.startswith(layer + ".")]
        assert any(role_of(t) in ("attn", "mixer") for t in inside), f"{layer}: no attention or mixer tap"
        untapped = [p for p, _ in ref.named_parameters() if p.startswith(layer + ".") and not _covered(p, inside)]
        assert not untapped, f"{arch}: weights of {layer} under no tap inside it (an MLP, a norm?): {untapped}"
    outside = [p for p, _ in ref.named_parameters() if p.startswith(decoder + ".") and not _covered(p, text)]
    assert not outside, f"{arch}: weights outside the layers under no tap: {outside}"
    model, config, _, _ = build_model(path)
    joined = set(zoo_tap_names(model, config, set(text)).values())
    assert not set(text) - joined, f"{arch}: reference taps no zoo module joins (parity_taps): " \
                                   f"{sorted(set(text) - joined)}"


# -- planted bugs ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def planted(plant):
    """`plant(model, config, zoo_to_ref)` runs on the zoo model the harness builds (zoo.build.build_model)."""
    import zoo.build

    original = zoo.build.build_model

    def build(*args, **kwargs):
        model, config, spec, report = original(*args, **kwargs)
        plant(model, config)
        return model, config, spec, report

    zoo.build.build_model = build
    try:
        yield
    finally:
        zoo.build.build_model = original


def _scale_output(module: torch.nn.Module):
    def hook(mod, args, out):
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{type(mod).__name__} returns {type(out).__name__}: plant the bug elsewhere")
        return out * SLIP
    return module.register_forward_hook(hook)


def _joined(model, config, wanted):
    """{reference tap: zoo module} for the zoo's modules."""
    modules = dict(model.named_modules())
    return {ref: modules[z] for z, ref in zoo_tap_names(model, config, wanted).items()}


def _where(arch, path) -> dict[str, str]:
    """The reference taps a bug is planted at: the token embedding, layer 0's attention or mixer, the final norm."""
    taps = reference_taps(load_reference(path))
    first = first_layer(taps)
    embed = next(t for t, r in taps.items() if r == "embed" and first.startswith(t.rsplit(".", 1)[0])
                 and not t.endswith("wpe"))
    inner = next(t for t, r in taps.items() if r in ("attn", "mixer") and t.startswith(first + "."))
    final = next(t for t, r in taps.items() if r == "final_norm" and t.startswith(first.rsplit(".", 2)[0]))
    return {"embedding": embed, "first layer": inner, "final norm": final, "_first": first, "_wanted": set(taps)}


@pytest.mark.parametrize("arch", REGISTERED)
@pytest.mark.parametrize("where", ["embedding", "first layer", "final norm"])
def test_a_bug_is_named_at_its_block(arch, where, checkpoints):
    path = checkpoints(arch)
    at = _where(arch, path)
    tap = at[where]
    with planted(lambda model, config: _scale_output(_joined(model, config, at["_wanted"])[tap])):
        result = run_parity(path, scenarios=("prefill",))
    s = result.scenarios["prefill"]
    assert not s.passed, f"{arch}: a {SLIP}x {tap} passes"
    culprit = s.localization.culprit
    block = at["_first"] if where == "first layer" else tap
    assert (culprit["block"], culprit["tap"]) == (block, tap), f"{arch} {where}: {culprit}"


def _set(path_to_attr: str, factor: float):
    """Plant: the built model's attribute (dotted path; every layer's when it holds `{i}`) times `factor`."""
    def plant(model, config):
        owners = [model]
        *parents, attr = path_to_attr.split(".")
        for part in parents:
            owners = [o for owner in owners for o in (list(owner) if part == "{i}" else [getattr(owner, part)])]
        for owner in owners:
            setattr(owner, attr, getattr(owner, attr) * factor)
    return plant


# (architecture, the multiplier planted 1% off, the tap that must be blamed, its block); a residual multiplier
# shows first in the post-attention norm, the first tap reading the residual sum it scales
MULTIPLIERS = [
    ("GraniteForCausalLM", "model.embedding_multiplier", EMBEDDED, EMBEDDED),
    ("GraniteForCausalLM", "model.layers.{i}.residual_multiplier", "model.layers.0.post_attention_layernorm",
     "model.layers.0"),
    ("GraniteForCausalLM", "model.layers.{i}.self_attn.attn.scale", "model.layers.0.self_attn", "model.layers.0"),
    ("GraniteForCausalLM", "lm_head.divisor", LOGITS, LOGITS),
    ("GraniteMoeForCausalLM", "model.embedding_multiplier", EMBEDDED, EMBEDDED),
    ("GraniteMoeForCausalLM", "lm_head.divisor", LOGITS, LOGITS),
    ("CohereForCausalLM", "lm_head.scale", LOGITS, LOGITS),
    ("GemmaForCausalLM", "model.embed_tokens.scale", "model.embed_tokens", "model.embed_tokens"),
]


@pytest.mark.parametrize("arch, attr, tap, block", MULTIPLIERS, ids=[f"{a}-{m}" for a, m, _, _ in MULTIPLIERS])
def test_a_wrong_multiplier_is_named_where_the_model_applies_it(arch, attr, tap, block, checkpoints):
    """The replay applies every multiplier the reference applies: a wrong one is blamed where it acts (the first
    layer's input, the residual adds, the attention scores, the logits), never on a block after it."""
    path = checkpoints(arch)
    with planted(_set(attr, SLIP)):
        result = run_parity(path, scenarios=("prefill",))
    s = result.scenarios["prefill"]
    assert not s.passed, f"{arch}: {attr} x {SLIP} passes"
    culprit = s.localization.culprit
    assert (culprit["block"], culprit["tap"]) == (block, tap), f"{arch} {attr}: {culprit}"


@pytest.mark.parametrize("arch", REGISTERED)
def test_replay_of_the_reference_on_its_own_values_adds_no_error(arch, checkpoints):
    """Localisation's replay run on the reference's own tap values reproduces them: each block (embedding,
    every layer and tap inside it, the final norm, the logits through the reference's own head, multipliers and
    softcaps) adds no error. A replay that skipped a multiplier the model applies (Granite's embedding_multiplier
    and logits_scaling, Cohere's logit_scale) would blame that block on every failing run."""
    from parity.localize import localize
    from parity.reference import run_reference
    from parity.tolerances import tolerances

    ref = load_reference(checkpoints(arch))
    g = torch.Generator().manual_seed(0)
    vocab = ref.config.get_text_config().vocab_size
    tokens = [torch.randint(3, min(vocab, 200), (n,), generator=g).tolist() for n in (9, 5)]
    run = run_reference(ref, tokens)
    loc = localize(ref, run, run.trace, run.trace, run.trace.have, tolerances("dense"), ref.config)
    local = {b.name: b.local for b in loc.blocks} | {t: v for b in loc.blocks for t, v in b.sub.items()}
    assert {"logits", EMBEDDED} <= set(local), f"{arch}: blocks replayed: {sorted(local)}"
    worst = {t: v for t, v in local.items() if not v <= 1e-5}
    assert not worst and loc.culprit is None, f"{arch}: replay adds error to the reference itself: {worst}"
