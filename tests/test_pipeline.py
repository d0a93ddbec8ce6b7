"""Pipeline parallelism's layout (zoo/runtime/pipeline.py): every registered architecture's tiny checkpoint splits
into stages that read exactly their tensors (`zoo inspect --pipeline-parallel-size N`'s proof), and a stage's load is
strict."""
from __future__ import annotations

import pytest
import torch

import loader
from tiny import save_tiny
from tiny_configs import save_arch
from registry import get_registry
from zoo.build import build_model, rules_for
from zoo.runtime.model_files import read_config
from zoo.runtime.pipeline import Stage, decoder_layers, plan_stages, stage_ranges


def _llama5(path):  # 5 layers: 3 + 2 over two stages
    return save_tiny("LlamaForCausalLM", path, randomize=True, initializer_range=0.2, num_hidden_layers=5)


REGISTERED = sorted(a for a, s in get_registry().specs.items() if not s.plugin.startswith("mutant-"))


@pytest.mark.parametrize("arch", REGISTERED)
def test_every_architecture_splits_into_stages_that_read_only_their_tensors(arch, tmp_path):
    """plan_stages at 2 stages: no problem, every key read by exactly the stages that hold its parameter, each
    stage's layer keys its own layers', the bytes of all stages those of the checkpoint's read tensors (plus the
    replicated ones again)."""
    path = save_arch(arch, tmp_path / arch)
    spec = get_registry().resolve(read_config(str(path), str(path)))

    def build():
        with torch.device("meta"):
            model = spec.build(read_config(str(path), str(path)))
        return model, rules_for(spec, model)

    model, rules = build()
    whole = loader.plan(model, path, rules)
    sp = plan_stages(build, path, 2)
    assert not sp.problems, "\n".join(map(str, sp.problems[:10]))
    layers = decoder_layers(model)
    for s, p in enumerate(sp.plans):
        for e in p.entries:
            if e.param.startswith(layers + "."):
                assert int(e.param[len(layers) + 1:].split(".")[0]) in sp.ranges[s], (arch, s, e.key)
    replicated = sum(e.nbytes() for e in whole.entries if e.key in sp.replicated)
    assert sum(sp.bytes(s) for s in range(2)) == sum(e.nbytes() for e in whole.entries) + replicated
    assert sp.holds[0] and sp.holds[1], sp.holds  # the embeddings on stage 0; the final norm / head on stage 1


def test_a_stage_load_is_strict(tmp_path):
    """A tensor of stage 1's layers absent from the checkpoint: stage 0 loads, stage 1 is refused naming the key;
    a key of no module at all is refused by both."""
    from safetensors.torch import load_file, save_file

    path = _llama5(tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.4.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    build_model(path, stage=Stage(0, 2))
    with pytest.raises(loader.LoadError, match=r"model\.layers\.4\.mlp\.(up_proj|gate_up_proj)"):
        build_model(path, stage=Stage(1, 2))
    tensors = {**load_file(_llama5(tmp_path / "n") / "model.safetensors"), "model.extra.weight": torch.zeros(2)}
    save_file(tensors, tmp_path / "n" / "model.safetensors", metadata={"format": "pt"})
    for s in range(2):
        with pytest.raises(loader.LoadError, match=r"model\.extra\.weight"):
            build_model(tmp_path / "n", stage=Stage(s, 2))


def test_stage_ranges():
    assert stage_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="pipeline parallel size 3: the model has 2 decoder layers"):
        stage_ranges(2, 3)
