"""StarCoder2: Mistral (one sliding window for every layer) with biased LayerNorms (eps from norm_epsilon),
biases on every projection and a plain GELU-tanh MLP (c_fc, c_proj).

Shape legend: as plugins/llama.py.
"""
from __future__ import annotations

from functools import partial

from loader.rules import Shard
from plugins.llama import LLAMA_RULES, LlamaModel, tensor_parallel, validate
from plugins.mistral import MistralDecoderLayer, MistralForCausalLM
from registry import ArchSpec, hookimpl
from zoo.layers.mlp import MLP
from zoo.layers.norm import LayerNorm


class Starcoder2Norms:
    norm_class = LayerNorm  # diff with Llama: LayerNorm with a bias

    def norm_eps(self, config) -> float:
        return config.norm_epsilon


class Starcoder2DecoderLayer(Starcoder2Norms, MistralDecoderLayer):
    def attention_kwargs(self, config, layer_idx: int) -> dict:
        # diff with Mistral: q/k/v/o biases (use_bias)
        return {**super().attention_kwargs(config, layer_idx), "qkv_bias": config.use_bias, "o_bias": config.use_bias}

    def make_mlp(self, config, layer_idx: int, prefix: str):
        # diff with Llama: not gated
        return MLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   hidden_act=config.hidden_act, bias=config.use_bias, names=("c_fc", "c_proj"), prefix=prefix)


class Starcoder2Model(Starcoder2Norms, LlamaModel):
    layer_class = Starcoder2DecoderLayer


class Starcoder2ForCausalLM(MistralForCausalLM):
    model_class = Starcoder2Model


# tensor parallelism: Llama's, the plain MLP's c_fc (and its bias) column-parallel, c_proj row-parallel (its bias
# added once, after the sum)
MLP_SHARDS = (Shard(r"\.c_fc\.(weight|bias)$", "column"), Shard(r"\.c_proj\.weight$", "row"))


@hookimpl
def register_architectures(register):
    register(ArchSpec(("Starcoder2ForCausalLM",), "plugins.starcoder2:Starcoder2ForCausalLM", "dense",
                      rules=LLAMA_RULES, validate=validate,
                      tensor_parallel=partial(tensor_parallel, shards=MLP_SHARDS)))
