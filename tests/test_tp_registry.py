"""Tensor parallelism for every registered architecture: each one either has a layout whose dry run proves that 2
ranks (and 4: KV heads then replicated, 2 KV heads for 4 ranks; Mamba2's and Bamba's 2 B / C groups each shared by
2 ranks) cover every element of its tiny checkpoint (tests/tiny_configs.py) exactly once, or is listed in NO_LAYOUT
with the reason it has none yet, which the refusal (`zoo inspect --tensor-parallel-size 2`, exit 2) says. An
architecture registered without either fails here. Since issue 36's part 2 every registered architecture has one
(the hybrids' mixers and state pools, the multimodal models' vision towers); NO_LAYOUT is empty.
"""
from __future__ import annotations

import pytest

from loader.plan import plan_ranks
from plugins.llama import LLAMA_RULES
from registry import ArchSpec, get_registry
from tiny_configs import TINY_CONFIGS, save_arch
from zoo.build import tensor_parallel_model
from zoo.runtime.model_files import read_config

# architectures without a layout, each with (a few words of) the reason its refusal gives: none since issue 36's
# part 2
NO_LAYOUT: dict[str, str] = {}
SIZES = (2, 4)
REGISTERED = sorted(a for a, s in get_registry().specs.items() if not s.plugin.startswith("mutant-"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-registry")
    return lambda arch: save_arch(arch, root / arch)


def layout_finding(arch: str, spec: ArchSpec, tiny) -> str | None:
    """What is wrong with `spec`'s tensor parallelism (None: nothing): no layout and no reason, a listed one that has
    a layout now, a layout whose ranks do not cover its tiny checkpoint exactly once."""
    if arch in NO_LAYOUT:
        if spec.tensor_parallel is not None:
            return f"{arch} has a tensor-parallel layout now: remove it from NO_LAYOUT"
        if NO_LAYOUT[arch] not in spec.no_tensor_parallel:
            return f"{arch}: its refusal does not say {NO_LAYOUT[arch]!r} ({spec.no_tensor_parallel!r})"
        return None
    if spec.tensor_parallel is None:
        return (f"{arch} has no tensor-parallel layout and is not in NO_LAYOUT: give its ArchSpec a tensor_parallel "
                f"(docs/plugins.md) or list it here with the reason it has none (and say it in no_tensor_parallel)")
    if arch not in TINY_CONFIGS:
        return f"{arch}: add a tiny config to tests/tiny_configs.py (its layout is proven on it)"
    path = tiny(arch)
    config = read_config(str(path), str(path))
    for size in SIZES:
        model, rules = tensor_parallel_model(spec, config, size)
        ranks = plan_ranks(model, path, rules, size)
        if not ranks.ok:
            return f"{arch} over {size} ranks:\n" + "\n".join(map(str, ranks.problems[:10]))
    return None


@pytest.mark.parametrize("arch", REGISTERED)
def test_every_architecture_has_a_layout_or_says_why_not(arch, tiny):
    assert (finding := layout_finding(arch, get_registry().specs[arch], tiny)) is None, finding


def test_no_layout_lists_registered_architectures_only():
    assert set(NO_LAYOUT) <= set(REGISTERED), f"NO_LAYOUT names unregistered {sorted(set(NO_LAYOUT) - set(REGISTERED))}"


def test_a_new_architecture_without_a_layout_or_a_reason_is_caught(tiny):
    spec = ArchSpec(("NewForCausalLM",), "plugins.llama:LlamaForCausalLM", "dense", rules=LLAMA_RULES)
    assert "NewForCausalLM has no tensor-parallel layout and is not in NO_LAYOUT" in layout_finding(
        "NewForCausalLM", spec, tiny)


def test_an_architecture_without_a_layout_is_refused_with_its_reason(tiny):
    """The refusal itself, on a spec that gives a reason instead of a layout."""
    spec = ArchSpec(("NewForCausalLM",), "plugins.llama:LlamaForCausalLM", "dense", rules=LLAMA_RULES,
                    no_tensor_parallel="its widgets are not split yet")
    path = tiny("LlamaForCausalLM")
    with pytest.raises(ValueError, match=r"architecture NewForCausalLM \(plugin \) has no tensor-parallel layout "
                                         r"yet \(its widgets are not split yet\)"):
        tensor_parallel_model(spec, read_config(str(path), str(path)), 2)


def test_a_config_the_plugin_refuses_is_refused_as_one_process_refuses_it(tiny, tmp_path):
    """transformers' DeepseekV2Config() leaves num_experts_per_tok None: over 2 ranks the plugin's own refusal,
    naming the field, comes before anything spawns (it was a TypeError from deep in the router's constructor)."""
    import json
    import shutil

    from zoo.runtime.distributed import TensorParallelError, TensorParallelGroup

    path = shutil.copytree(tiny("DeepseekV2ForCausalLM"), tmp_path / "v2")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": None}))
    with pytest.raises(TensorParallelError, match=r"DeepseekV2ForCausalLM \(plugin plugins.deepseek\) does not serve "
                                                  r"this config: config.num_experts_per_tok=None must be an integer"):
        TensorParallelGroup(path, 2)
