"""Mamba2: a stack of SSD mixers, no attention: norm -> mixer -> residual, per layer.

Shape legend: T = tokens of the step (flattened)   H = hidden size   V = vocab size   N = rows sampled

Checkpoint layout: `backbone.embeddings.weight` (older conversions: `backbone.embedding.weight`),
`backbone.layers.{i}.norm.weight`, `backbone.layers.{i}.mixer.{in_proj, conv1d, dt_bias, A_log, D, norm,
out_proj}`, `backbone.norm_f.weight`, `lm_head.weight` (or tied to the embedding).
With `residual_in_fp32` (the default) the residual stream stays float32 between layers, as in transformers.
"""
from __future__ import annotations

import torch
from torch import nn

from loader.rules import Rename, Rules, Shard
from plugins.llama import split_config
from registry import ArchSpec, hookimpl
from zoo.layers.embedding import LMHead, VocabEmbedding
from zoo.layers.linear import compute_dtype
from zoo.layers.mamba import Mamba2Mixer
from zoo.layers.norm import RMSNorm
from zoo.runtime.batch import ForwardBatch

MAMBA2_RULES = Rules(renames=(Rename("backbone.embedding.", "backbone.embeddings."),))


def mamba2_mixer(config, *, prefix: str, heads="num_heads", head_dim="head_dim", state="state_size",
                 groups="n_groups", conv="conv_kernel", chunk="chunk_size", eps="layer_norm_epsilon",
                 bias="use_bias", conv_bias="use_conv_bias") -> Mamba2Mixer:
    """A Mamba2Mixer from the config fields named (Mamba2's names by default; Bamba passes its own)."""
    get = lambda name: getattr(config, name)  # noqa: E731
    return Mamba2Mixer(hidden_size=config.hidden_size, num_heads=get(heads), head_dim=get(head_dim),
                       state_size=get(state), n_groups=get(groups), conv_kernel=get(conv), chunk_size=get(chunk),
                       time_step_limit=getattr(config, "time_step_limit", None), norm_eps=get(eps),
                       use_bias=get(bias), use_conv_bias=get(conv_bias),
                       group_ranks=getattr(config, "ssm_group_ranks", 1), prefix=prefix)


class Mamba2Block(nn.Module):
    def __init__(self, config, layer_idx: int, *, prefix: str):
        super().__init__()
        self.prefix, self.layer_idx = prefix, layer_idx
        self.residual_in_fp32 = getattr(config, "residual_in_fp32", True)
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = mamba2_mixer(config, prefix=f"{prefix}.mixer")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        residual = hidden_states.float() if self.residual_in_fp32 else hidden_states
        h = self.mixer(self.norm(hidden_states.to(self.norm.weight.dtype)), batch)  # [T, H]
        return residual + h


class Mamba2Model(nn.Module):
    def __init__(self, config, *, prefix: str = "backbone"):
        super().__init__()
        self.prefix = prefix
        self.embeddings = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(config, i, prefix=f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden_states = self.embeddings(input_ids)  # [T, H]
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, batch)  # [T, H]
        return self.norm_f(hidden_states)  # [T, H]


class Mamba2ForCausalLM(nn.Module):
    def __init__(self, config, *, prefix: str = ""):
        super().__init__()
        self.config = config
        self.backbone = Mamba2Model(config, prefix=f"{prefix}.backbone" if prefix else "backbone")
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.backbone.embeddings.weight  # one Parameter under two names

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.backbone(input_ids, positions, batch)  # [T] -> [T, H]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states.to(compute_dtype(self.lm_head.weight)))  # [N, H] -> [N, V]


def validate_ssd(config, *, heads: str, head_dim: str, groups: str, expand: str, act: str = "hidden_act") -> None:
    """The SSD mixer's shape rules, naming the config fields (raise ValueError)."""
    n, d, g = getattr(config, heads), getattr(config, head_dim), getattr(config, groups)
    inner = int(getattr(config, expand) * config.hidden_size)
    if n * d != inner:
        raise ValueError(f"config.{heads}={n} x {head_dim}={d} must equal {expand} x hidden_size = {inner}")
    if n % g:
        raise ValueError(f"config.{heads}={n} is not a multiple of {groups}={g}")
    if getattr(config, act) != "silu":
        raise ValueError(f"config.{act}={getattr(config, act)!r}: the mixer's conv activation must be 'silu'")


def validate(config) -> None:
    validate_ssd(config, heads="num_heads", head_dim="head_dim", groups="n_groups", expand="expand")


def ssd_tensor_parallel(config, local, size: int, *, heads: str, groups: str, module: str) -> tuple[Shard, ...]:
    """The SSD mixers (`...{module}.*`) split by heads over `size` ranks, as vLLM splits them: sets the rank-local
    config's `heads` and `groups` fields and returns the Shards. in_proj's gate / x / dt rows, conv1d's x channels,
    dt_bias / A_log / D and the gated norm's weight go with the heads; B and C (in in_proj and conv1d) with the
    groups, each rank holding its heads' groups, or, when ranks outnumber the groups, the one group its heads read
    (copied on the size / groups ranks that share it: `ssm_group_ranks` in the rank-local config, whose gated norm
    then sums their squares); out_proj row-parallel (the mixer's output summed once). Each rank's state slots
    hold its heads' conv channels and SSM states (the StateSpec comes from the rank-local model). ValueError naming
    the field that does not split."""
    h, g = getattr(config, heads), getattr(config, groups)
    if h % size:
        raise ValueError(f"config.{heads}={h} does not split over tensor parallel size {size}")
    if g % size and size % g:
        raise ValueError(f"config.{groups}={g} and tensor parallel size {size}: neither divides the other (the B / C "
                         f"groups split over the ranks, or ranks share one)")
    setattr(local, heads, h // size)
    setattr(local, groups, max(g // size, 1))
    local.ssm_group_ranks = max(size // g, 1)  # ranks sharing one group (its B / C copied, its norm summed)
    at = rf"\.{module}\."
    return (Shard(rf"{at}in_proj\.(weight|bias)$", "fused", parts=("column", "column", "kv", "kv", "column"), heads=g),
            Shard(rf"{at}conv1d\.(weight|bias)$", "fused", parts=("column", "kv", "kv"), heads=g),
            Shard(rf"{at}(dt_bias|A_log|D|norm\.weight)$", "column"),
            Shard(rf"{at}out_proj\.weight$", "row"))


def tensor_parallel(config, size: int):
    """(rank-local config, Shard rules): the mixers split by heads (ssd_tensor_parallel), the embedding and head by
    vocab rows, the norms replicated."""
    local = split_config(config, size, ())
    shards = ssd_tensor_parallel(config, local, size, heads="num_heads", groups="n_groups", module="mixer")
    return local, Rules(shards=shards + (Shard(r"^(backbone\.embeddings?|lm_head)\.weight$", "vocab",
                                               size=config.vocab_size),))


@hookimpl
def register_architectures(register):
    register(ArchSpec(("Mamba2ForCausalLM",), "plugins.mamba2:Mamba2ForCausalLM", "hybrid-ssm", rules=MAMBA2_RULES,
                      validate=validate, tensor_parallel=tensor_parallel))
