"""Built constants (parity/constants.py): every eps and multiplier a model builds is compared with the reference's
module of the same name, taps or not. Each case plants one constant off (the zoo's model built with it) and must be
named, whether or not the numbers move past the tolerance (a mixer norm's eps 1e-6 for 1e-5 moves Mamba2's output
~1e-6, far below any bound)."""
from __future__ import annotations

import pytest

from mutants import planted_constant
from parity.harness import run_parity
from tiny_configs import save_arch

CASES = [  # architecture, zoo module, attribute, the planted value, the constant's name in the report
    ("Mamba2ForCausalLM", "backbone.layers.0.mixer.norm", "eps", 1e-6, "eps"),
    ("Mamba2ForCausalLM", "backbone.layers.1.mixer", "time_step_limit", (0.0, 100.0), "time_step_limit"),
    ("JambaForCausalLM", "model.layers.0.mamba.dt_layernorm", "eps", 1e-5, "eps"),
    ("StableLmForCausalLM", "model.layers.1.self_attn.k_layernorm.norms", "eps", 1e-6, "eps"),
    ("GraniteForCausalLM", "model", "embedding_multiplier", 1.0, "embedding_multiplier"),
    ("GraniteForCausalLM", "model.layers.1", "residual_multiplier", 1.0, "residual_multiplier"),
    ("GraniteForCausalLM", "lm_head", "divisor", None, "logits_scaling"),
    ("CohereForCausalLM", "lm_head", "scale", None, "logit_scale"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("constants")
    return {arch: save_arch(arch, root / arch) for arch in {case[0] for case in CASES}}


@pytest.mark.parametrize("arch,module,attr,value,what", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_a_planted_constant_is_named(checkpoints, arch, module, attr, value, what):
    result = run_parity(checkpoints[arch], scenarios=("prefill",))
    assert result.passed and not result.constants["mismatches"], result.constants["mismatches"]
    assert f"{module} {what}" in result.constants["checked"]
    with planted_constant(module, attr, value):
        result = run_parity(checkpoints[arch], scenarios=("prefill",))
    assert not result.passed
    shown = 1.0 if value is None else tuple(value) if isinstance(value, tuple) else value
    bad = result.constants["mismatches"]
    assert bad and all(m.startswith(f"{module} {what}: zoo {shown!r}, reference ") for m in bad), bad
