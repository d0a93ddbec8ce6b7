"""The template plugin, installed, serves its architecture through the entry point and passes every parity
scenario against transformers on a tiny checkpoint whose every parameter is random, read back from disk."""
import json

import torch
import transformers

from parity.harness import run_parity
from parity.tiny import randomize_constants
from registry import get_registry
from zoo_plugin_template import ARCHITECTURE


def tiny_checkpoint(path):
    """A tiny Llama saved by transformers, its config.json naming the template's architecture (transformers
    builds the reference from model_type, "llama")."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    randomize_constants(model)
    model.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, "architectures": [ARCHITECTURE]}))
    return path


def test_the_entry_point_serves_the_architecture_and_parity_passes(tmp_path):
    spec = get_registry().specs[ARCHITECTURE]
    assert spec.plugin == "template" and spec.model == "zoo_plugin_template:TemplateLlamaForCausalLM"
    result = run_parity(tiny_checkpoint(tmp_path))
    assert result.passed, {n: (s.failures, s.first_divergence) for n, s in result.scenarios.items()}
    assert result.architecture == ARCHITECTURE
