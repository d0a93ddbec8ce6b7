"""Planted-bug plugins for the parity harness's mutation tests (test-only).

Each mutant subclasses the real plugin classes (Llama, Mistral, Mixtral) and breaks exactly one thing in
decoder layer BUG_LAYER
(layer 0 stays right, so the report must name layer 1, not merely "something"). It registers with
override=True for the architecture it breaks:

    with planted("rotary_wrong_half"):          # the global registry serves the mutant inside the block
        run_parity(path)

VARIANTS are not bugs: correct models with another structure (a fused residual, a renamed MLP) that
pass parity once they follow the protocol of parity/taps.py.

Shape legend: T tokens, Hq query heads, KV key/value heads, D head dim, F = D / 2, H hidden.
"""
from __future__ import annotations

import contextlib

import torch

from loader.rules import Rename, Rules
from plugins.llama import LLAMA_RULES, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from plugins.mistral import MistralDecoderLayer, MistralForCausalLM, MistralModel
from plugins.mixtral import MIXTRAL_RULES, MixtralDecoderLayer, MixtralForCausalLM, MixtralModel
from registry import ArchSpec, get_registry, hookimpl
from zoo.layers.linear import Linear, linear
from zoo.layers.mlp import GatedMLP
from zoo.layers.moe import TopKRouter
from zoo.layers.norm import RMSNorm, _rms
from zoo.runtime.batch import ForwardBatch

BUG_LAYER = 1


# -- rotary applied to the wrong half of the head dim (= rotation by -theta; position 0 unaffected) ------
class WrongHalfRope:
    def __init__(self, rope):
        self.rope = rope

    def __call__(self, positions, q, k, batch=None):
        f = self.rope.rotary_dim // 2
        swap = lambda x: torch.cat((x[..., f:2 * f], x[..., :f], x[..., 2 * f:]), dim=-1)  # [T, n, D]
        q, k = self.rope(positions, swap(q), swap(k), batch)
        return swap(q), swap(k)


class RotaryWrongHalfLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx, *, prefix):
        super().__init__(config, layer_idx, prefix=prefix)
        if layer_idx == BUG_LAYER:
            self.self_attn.rotary_emb = WrongHalfRope(self.self_attn.rotary_emb)


# -- RMSNorm eps off (post-attention norm: 0.1, e.g. read from the wrong config field, instead of 1e-6) ----
class NormEpsLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx, *, prefix):
        super().__init__(config, layer_idx, prefix=prefix)
        if layer_idx == BUG_LAYER:
            self.post_attention_layernorm.eps = 0.1


# -- gate and up swapped in the fused gate_up_proj ---------------------------------------------------------
class SwappedGatedMLP(GatedMLP):
    def forward(self, x):
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))  # [T, I], [T, I]
        return self.down_proj(self.act(up) * gate)  # the bug: act on up


class GateUpSwappedLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_idx, prefix):
        if layer_idx != BUG_LAYER:
            return super().make_mlp(config, layer_idx, prefix)
        return SwappedGatedMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                               hidden_act=config.hidden_act, prefix=prefix)


# -- KV heads mapped to query heads by h % KV instead of h // G (repeat vs repeat_interleave) -----------
class WrongGroupAttention(LlamaAttention):
    def forward(self, positions, hidden_states, batch: ForwardBatch):
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k, batch)
        g = self.num_heads // self.num_kv_heads
        # slot s attends with KV head s // g; put query head h in a slot of KV head h % KV (the bug)
        order = sorted(range(self.num_heads), key=lambda h: (h % self.num_kv_heads, h))  # slot -> query head
        o = self.attn(q[:, order], k, v, batch.cache_for(self.prefix), batch)  # [T, Hq*D] in slot order
        o = o.view(-1, self.num_heads, self.head_dim)[:, torch.tensor(order).argsort()]  # back to head order
        assert g > 1, "the wrong-group mutant needs GQA (num_heads > num_kv_heads)"
        return self.o_proj(o.flatten(1))


class WrongGroupLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx, *, prefix):
        if layer_idx == BUG_LAYER:
            self.attention_class = WrongGroupAttention
        super().__init__(config, layer_idx, prefix=prefix)


# -- missing residual adds ---------------------------------------------------------------------------------
class MissingAttnResidualLayer(LlamaDecoderLayer):
    def forward(self, positions, hidden_states, batch):
        if self.layer_idx != BUG_LAYER:
            return super().forward(positions, hidden_states, batch)
        h = self.self_attn(positions, self.input_layernorm(hidden_states), batch)
        hidden_states = h  # the bug: + hidden_states dropped
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MissingMlpResidualLayer(LlamaDecoderLayer):
    def forward(self, positions, hidden_states, batch):
        if self.layer_idx != BUG_LAYER:
            return super().forward(positions, hidden_states, batch)
        h = self.self_attn(positions, self.input_layernorm(hidden_states), batch)
        hidden_states = hidden_states + h
        return self.mlp(self.post_attention_layernorm(hidden_states))  # the bug: + hidden_states dropped


# -- NaN at one position: the layer output row of position NAN_POSITION multiplied by NaN ---------------
NAN_POSITION = 5


class NanAtOnePositionLayer(LlamaDecoderLayer):
    def forward(self, positions, hidden_states, batch):
        out = super().forward(positions, hidden_states, batch)  # [T, H]
        if self.layer_idx != BUG_LAYER:
            return out
        poison = torch.where(positions == NAN_POSITION, float("nan"), 1.0).to(out.dtype)  # [T]
        return out * poison[:, None]  # the bug: NaN rows, which parity once took for "not computed"


# -- a block kernel reading a Q4 block's nibbles the wrong way round (a GGUF kept quantized only) ------------
class NibbleSwappedLinear(Linear):
    """down_proj on Q4_0 / Q4_1 blocks whose two nibbles per byte are read swapped (values 0..15 of a block
    become 16..31); a float32 weight (the GGUF dequantized) is untouched, so only a quantized run sees it."""

    def forward(self, x):
        w = self.weight
        if w.dtype is not torch.uint8 or {t.name for _, _, t in w.quant.segments} - {"Q4_0", "Q4_1"}:
            return super().forward(x)
        if getattr(self, "swapped", None) is None:
            swapped = w.detach().clone()
            for (a, b, t), at in zip(w.quant.segments, w.quant.offsets()):
                blocks = swapped[at:at + (b - a) * t.row_bytes(w.quant.shape[1])].view(-1, t.block_bytes)
                nibbles = blocks[:, t.block_bytes - 16:]  # the 16 bytes of 32 nibbles after the scales
                nibbles.copy_((nibbles << 4) | (nibbles >> 4))
            swapped.quant = w.quant
            self.swapped = swapped
        return linear(x, self.swapped)  # the bug


class QuantNibblesSwappedLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx, *, prefix):
        super().__init__(config, layer_idx, prefix=prefix)
        if layer_idx == BUG_LAYER:
            self.mlp.down_proj.__class__ = NibbleSwappedLinear


# -- below the numerical tolerance: eps 1e-5 instead of the config's 1e-6 (issue 12, class 7) -------------------
class NormEpsSlightLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx, *, prefix):
        super().__init__(config, layer_idx, prefix=prefix)
        if layer_idx == BUG_LAYER:
            self.post_attention_layernorm.eps = 1e-5  # the bug: ~2e-6 on the output, far below rel_l2 1e-4


# -- the attention scale off: 1 / sqrt(head_dim / 2) (position 0 attends only to itself: unaffected) -----------
class AttentionScaleLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx, *, prefix):
        super().__init__(config, layer_idx, prefix=prefix)
        if layer_idx == BUG_LAYER:
            self.self_attn.attn.scale *= 2 ** 0.5  # the bug


# -- a norm whose weight is never applied: invisible while norm weights are transformers' initial ones (class 6) --
class WeightlessRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.eps).to(x.dtype)  # the bug: no `self.weight *`


class NormWeightIgnoredLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx, *, prefix):
        super().__init__(config, layer_idx, prefix=prefix)
        if layer_idx == BUG_LAYER:
            self.post_attention_layernorm.__class__ = WeightlessRMSNorm


# -- the attention residual scaled by 1 + RESIDUAL_SLIP: a small error the MLP then amplifies (class 8) -------------
RESIDUAL_SLIP = 1e-4


class ResidualScaledLayer(LlamaDecoderLayer):
    def forward(self, positions, hidden_states, batch):
        if self.layer_idx != BUG_LAYER:
            return super().forward(positions, hidden_states, batch)
        h = self.self_attn(positions, self.input_layernorm(hidden_states), batch)
        hidden_states = hidden_states * (1 + RESIDUAL_SLIP) + h  # the bug: the skip path scaled
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


# -- sliding window one token too wide (Mistral) ------------------------------------------------------------
class WindowOffByOneLayer(MistralDecoderLayer):
    def attention_kwargs(self, config, layer_idx):
        kw = super().attention_kwargs(config, layer_idx)
        if layer_idx == BUG_LAYER:
            kw["sliding_window"] = kw["sliding_window"] + 1  # the bug: W + 1 keys
        return kw


# -- MoE (Mixtral): the kept top-k weights not renormalised; experts indexed off by one ---------------
class NoRenormRouter(TopKRouter):
    def forward(self, x):
        logits, _, ids = super().forward(x)
        weights = logits.float().softmax(-1).gather(-1, ids)  # [T, K] the bug: not divided by their sum
        return logits, weights, ids


class OffByOneRouter(TopKRouter):
    def forward(self, x):
        logits, weights, ids = super().forward(x)
        return logits, weights, (ids + 1) % self.num_experts  # the bug: the neighbour expert


def _router_layer(router_cls):
    class Layer(MixtralDecoderLayer):
        def make_mlp(self, config, layer_idx, prefix):
            block = super().make_mlp(config, layer_idx, prefix)
            if layer_idx == BUG_LAYER:
                g = block.gate
                block.gate = router_cls(config.hidden_size, g.num_experts, g.top_k, renormalize=g.renormalize,
                                        weights_in_input_dtype=g.weights_in_input_dtype, prefix=g.prefix)
            return block

    Layer.__name__ = router_cls.__name__ + "Layer"
    return Layer


# -- not bugs: structures the parity protocol must follow (see parity/taps.py) ------------------------------
class FusedResidualLayer(LlamaDecoderLayer):
    """vLLM style: returns (mlp_out, residual) and leaves the add to the next layer's norm."""

    parity_output = "sum"  # the true layer output is mlp_out + residual

    def forward(self, positions, hidden_states, batch, residual=None):
        residual = hidden_states if residual is None else hidden_states + residual  # [T, H]
        h = self.self_attn(positions, self.input_layernorm(residual), batch)
        residual = residual + h
        return self.mlp(self.post_attention_layernorm(residual)), residual  # ([T, H], [T, H])


class FusedResidualUndeclaredLayer(FusedResidualLayer):
    parity_output = None  # forgot to declare it: the layer tap is the MLP output alone


class FusedResidualModel(LlamaModel):
    layer_class = FusedResidualLayer

    def forward(self, input_ids, positions, batch):
        h, residual = self.embed(input_ids, batch), None
        for layer in self.layers:
            h, residual = layer(positions, h, batch, residual)
        return self.norm(h + residual)


class FeedForwardLayer(LlamaDecoderLayer):
    """The MLP built under another name than the checkpoint's (needs a Rename rule and a tap map)."""

    def __init__(self, config, layer_idx, *, prefix):
        super().__init__(config, layer_idx, prefix=prefix)
        self.feed_forward = self.mlp
        del self.mlp

    def forward(self, positions, hidden_states, batch):
        hidden_states = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states), batch)
        return hidden_states + self.feed_forward(self.post_attention_layernorm(hidden_states))


# -- a crash: decode through the cache not implemented ------------------------------------------------------
class DecodeRaisesAttention(LlamaAttention):
    def forward(self, positions, hidden_states, batch):
        if any(n > batch.query_start_loc_cpu[i + 1] - batch.query_start_loc_cpu[i]
               for i, n in enumerate(batch.seq_lens_cpu)):
            raise NotImplementedError(f"{self.prefix}: attention to cached context")
        return super().forward(positions, hidden_states, batch)


class DecodeRaisesLayer(LlamaDecoderLayer):
    attention_class = DecodeRaisesAttention


def _llama(layer_cls):
    model_cls = type(f"{layer_cls.__name__}Model", (LlamaModel,), {"layer_class": layer_cls})
    return type(f"{layer_cls.__name__}ForCausalLM", (LlamaForCausalLM,), {"model_class": model_cls})


def _mistral(layer_cls):
    model_cls = type(f"{layer_cls.__name__}Model", (MistralModel,), {"layer_class": layer_cls})
    return type(f"{layer_cls.__name__}ForCausalLM", (MistralForCausalLM,), {"model_class": model_cls})


FusedResidual = type("FusedResidualForCausalLM", (LlamaForCausalLM,), {"model_class": FusedResidualModel})
FusedResidualUndeclared = type("FusedResidualUndeclaredForCausalLM", (LlamaForCausalLM,), {
    "model_class": type("FusedResidualUndeclaredModel", (FusedResidualModel,),
                        {"layer_class": FusedResidualUndeclaredLayer})})


def _mixtral(layer_cls):
    model_cls = type(f"{layer_cls.__name__}Model", (MixtralModel,), {"layer_class": layer_cls})
    return type(f"{layer_cls.__name__}ForCausalLM", (MixtralForCausalLM,), {"model_class": model_cls})


RotaryWrongHalf = _llama(RotaryWrongHalfLayer)
NormEps = _llama(NormEpsLayer)
GateUpSwapped = _llama(GateUpSwappedLayer)
WrongGroup = _llama(WrongGroupLayer)
MissingAttnResidual = _llama(MissingAttnResidualLayer)
MissingMlpResidual = _llama(MissingMlpResidualLayer)
NanAtOnePosition = _llama(NanAtOnePositionLayer)
WindowOffByOne = _mistral(WindowOffByOneLayer)
DecodeRaises = _llama(DecodeRaisesLayer)
NormEpsSlight = _llama(NormEpsSlightLayer)
AttentionScale = _llama(AttentionScaleLayer)
ResidualScaled = _llama(ResidualScaledLayer)
NormWeightIgnored = _llama(NormWeightIgnoredLayer)
QuantNibblesSwapped = _llama(QuantNibblesSwappedLayer)
FeedForward = _llama(FeedForwardLayer)
FeedForward.parity_taps = {"model.layers.{i}.feed_forward": "model.layers.{i}.mlp"}
MoeNoRenorm = _mixtral(_router_layer(NoRenormRouter))
MoeOffByOneExpert = _mixtral(_router_layer(OffByOneRouter))

# name -> (architecture it replaces, model class name in this module)
MUTANTS = {
    "rotary_wrong_half": ("LlamaForCausalLM", "RotaryWrongHalf"),
    "norm_eps": ("LlamaForCausalLM", "NormEps"),
    "gate_up_swapped": ("LlamaForCausalLM", "GateUpSwapped"),
    "kv_wrong_group": ("LlamaForCausalLM", "WrongGroup"),
    "missing_attn_residual": ("LlamaForCausalLM", "MissingAttnResidual"),
    "missing_mlp_residual": ("LlamaForCausalLM", "MissingMlpResidual"),
    "nan_at_one_position": ("LlamaForCausalLM", "NanAtOnePosition"),
    "window_off_by_one": ("MistralForCausalLM", "WindowOffByOne"),
    "moe_no_renormalize": ("MixtralForCausalLM", "MoeNoRenorm"),
    "moe_off_by_one_expert": ("MixtralForCausalLM", "MoeOffByOneExpert"),
}
# planted in the quantized path only (tests/test_parity_quant.py: a GGUF's blocks kept on the zoo side)
QUANT_MUTANTS = {
    "quant_nibbles_swapped": ("LlamaForCausalLM", "QuantNibblesSwapped"),
}
# correct implementations with another structure: parity must pass once they follow the protocol
VARIANTS = {
    "fused_residual": ("LlamaForCausalLM", "FusedResidual"),
    "fused_residual_undeclared": ("LlamaForCausalLM", "FusedResidualUndeclared"),
    "feed_forward_tap_map": ("LlamaForCausalLM", "FeedForward"),
    "decode_raises": ("LlamaForCausalLM", "DecodeRaises"),  # not a variant: a model that crashes mid-way
}
# the planted bugs of issue 12's classes (tests/test_parity_blind_spots.py has their expectations)
BLIND_SPOT_MUTANTS = {
    "norm_eps_slight": ("LlamaForCausalLM", "NormEpsSlight"),
    "attention_scale": ("LlamaForCausalLM", "AttentionScale"),
    "residual_scaled": ("LlamaForCausalLM", "ResidualScaled"),
    "norm_weight_ignored": ("LlamaForCausalLM", "NormWeightIgnored"),
}
FAMILY = {"MixtralForCausalLM": "moe"}
RULES_OF = {"MixtralForCausalLM": MIXTRAL_RULES}
EXTRA_RULES = {"feed_forward_tap_map": Rules(renames=(Rename(".mlp.", ".feed_forward."),))}


class MutantPlugin:
    def __init__(self, name: str):
        self.arch, self.cls = {**MUTANTS, **VARIANTS, **BLIND_SPOT_MUTANTS, **QUANT_MUTANTS}[name]
        self.rules = RULES_OF.get(self.arch, LLAMA_RULES) + EXTRA_RULES.get(name, Rules())

    @hookimpl
    def register_architectures(self, register):
        register(ArchSpec((self.arch,), f"mutants:{self.cls}", FAMILY.get(self.arch, "dense"), rules=self.rules,
                          override=True))


@contextlib.contextmanager
def planted(name: str, registry=None):
    """Serve mutant `name` from `registry` (default: the global one) inside the block; unregister after."""
    reg = registry or get_registry()
    plugin_name = f"mutant-{name}"
    reg.register_plugin(MutantPlugin(name), name=plugin_name)
    try:
        yield reg.get({**MUTANTS, **VARIANTS, **BLIND_SPOT_MUTANTS, **QUANT_MUTANTS}[name][0])
    finally:
        reg.unregister_plugin(plugin_name)


# -- runtime mutants: planted into the runner, the fused step or a shared layer (class attributes, restored on exit)
def _chunk_restarts_at_zero(plan):
    """A prefill chunk after the first gets positions 0.. instead of num_computed_tokens.. (rotary only: the
    slots and the causal mask still come from the right accounting)."""
    def buggy(self, out, kv):
        step = plan(self, out, kv)
        qsl = step.query_start_loc_cpu
        for i, s in enumerate(out.scheduled):
            a, b = qsl[i], qsl[i + 1]
            if s.num_computed_tokens > 0 and b - a > 1:
                step.positions[a:b] = [p - s.num_computed_tokens for p in step.positions[a:b]]  # the bug
        return step
    return buggy


def _samples_second_to_last_row(plan):
    """Request 1 of a step samples from its second-to-last row when it has two or more new tokens."""
    def buggy(self, out, kv):
        step = plan(self, out, kv)
        qsl = step.query_start_loc_cpu
        sampling = [i for i, s in enumerate(out.scheduled) if s.samples]
        if len(sampling) > 1 and qsl[sampling[1] + 1] - qsl[sampling[1]] > 1:
            step.logits_indices[1] -= 1  # the bug
        return step
    return buggy


def _fused_logits_scaled(forward):
    """The fused native step's logits come out 1% too large (a temperature-like slip in that path only)."""
    def buggy(self, *args):
        return forward(self, *args) * 1.01
    return buggy


def _embedding_rows_as_stored(forward):
    """The embedding's rows as stored, not widened to the compute dtype: under a bfloat16 model a bfloat16
    activation (the rows themselves exact; layer 0's norm, and what reads it, then compute on bfloat16 input)."""
    def buggy(self, input_ids):
        x = torch.nn.functional.embedding(input_ids, self.weight)  # [T] -> [T, H]; the bug: no .to(compute_dtype)
        return x if self.scale is None else x * torch.tensor(self.scale, dtype=torch.float32).to(x.dtype)
    return buggy


def _no_long_recompute(recompute):
    """A request whose decode crosses longrope's switch goes on from its cache (keys rotated short) instead of being
    recomputed whole with the long factors (what transformers' Phi-3 generate does)."""
    def buggy(self, req):
        return None
    return buggy


def _mixed_decode_slot_off(plan):
    """In a step that holds prefill rows too, each decode row's k/v goes one slot past its own (the slot of a
    decode row computed another way when the two kinds meet in one step)."""
    def buggy(self, out, kv):
        step = plan(self, out, kv)
        decode = [s.num_computed_tokens >= s.request.num_prompt_tokens for s in out.scheduled]
        if any(decode) and not all(decode):
            for i, d in enumerate(decode):
                if d:
                    step.slot_mapping[step.query_start_loc_cpu[i]] += 1  # the bug
        return step
    return buggy


def _restore_at_the_slot_index(restore):
    """A prefix hit restores the state snapshot whose index is the request's state slot, not the hit's own
    snapshot (the two indices mixed up)."""
    def buggy(self, block_hash, slot):
        restore(self, block_hash, slot)
        kind, _, dst = self.copies.pop()
        self.copies.append((kind, slot, dst))  # the bug
    return buggy


def _mixer_input_as_bfloat16(forward):
    """A recurrent mixer reads its input rounded to bfloat16 (a bfloat16 activation where the storage contract
    keeps float32 math)."""
    def buggy(self, hidden_states, batch):
        return forward(self, hidden_states.to(torch.bfloat16).to(hidden_states.dtype), batch)  # the bug
    return buggy


RUNTIME_MUTANTS = {  # name -> (class, method, wrapper)
    "chunk_positions_restart": ("zoo.runtime.model_runner:ModelRunner", "plan", _chunk_restarts_at_zero),
    "sampled_wrong_row": ("zoo.runtime.model_runner:ModelRunner", "plan", _samples_second_to_last_row),
    "fused_logits_scaled": ("zoo.kernels.fused:FusedDecoder", "run", _fused_logits_scaled),
    "embedding_rows_as_stored": ("zoo.layers.embedding:VocabEmbedding", "forward", _embedding_rows_as_stored),
    "no_long_recompute": ("zoo.runtime.scheduler:Scheduler", "_recompute_long", _no_long_recompute),
    "mixed_decode_slot_off": ("zoo.runtime.model_runner:ModelRunner", "plan", _mixed_decode_slot_off),
    "restore_at_the_slot_index": ("zoo.runtime.state_pool:StateSnapshots", "restore", _restore_at_the_slot_index),
    "mamba2_input_as_bfloat16": ("zoo.layers.mamba:Mamba2Mixer", "forward", _mixer_input_as_bfloat16),
    "mamba_input_as_bfloat16": ("zoo.layers.mamba:MambaMixer", "forward", _mixer_input_as_bfloat16),
}


@contextlib.contextmanager
def planted_runtime(name: str):
    """Plant runtime mutant `name` for the block: the class method is wrapped, and restored after."""
    import importlib

    where, method, wrap = RUNTIME_MUTANTS[name]
    module, cls_name = where.split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    original = cls.__dict__[method]
    setattr(cls, method, wrap(original))
    try:
        yield
    finally:
        setattr(cls, method, original)


@contextlib.contextmanager
def planted_constant(module: str, attr: str, value):
    """The zoo's models built inside the block have `module`.`attr` = value (a constant read from the wrong config
    field, or a default kept): zoo.build.build_model wrapped, restored after."""
    import zoo.build

    build = zoo.build.build_model

    def buggy(*args, **kwargs):
        out = build(*args, **kwargs)
        setattr(out[0].get_submodule(module), attr, value)  # the bug
        return out

    zoo.build.build_model = buggy
    try:
        yield
    finally:
        zoo.build.build_model = build
