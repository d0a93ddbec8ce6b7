"""One native call per step for Llama-structured decoders: `zoo_llama_step` in cpu/fused.h.

On the CPU a decode step of a small model spends as long in Python between kernels (module calls, views,
residual adds, wrappers: ~60 calls per layer) as the weights take to stream; this runs the same kernels in
the same order from C++ and returns the sampled rows' logits, equal bit for bit to
`model.compute_logits(model(ids, positions, batch)[batch.logits_indices])` with the kernels on.

    fused = FusedDecoder.build(model, kv_caches)     # None when the model does not qualify
    if fused is not None and fused.usable(batch):
        logits = fused(input_ids, positions, batch)  # [N, V]; fused.run(step lists) in the runner

Qualifies: a model assembled from the Llama plugin's classes with their own forward methods (Llama, and
Mistral / Qwen2 / Qwen3, which change only what the attention is built with: sliding windows, q/k/v bias,
per-head q/k norms) or Gemma3's decoder layer (norms around both blocks' outputs, (1 + w) norms, a scaled
embedding, GELU-tanh MLPs, a rope base per layer type); one norm kind and eps throughout, SiLU or GELU-tanh
gated MLPs or MoE blocks of softmax top-k routing over stacked experts, with at most a shared expert and its
sigmoid gate (Mixtral, Qwen3-MoE, Qwen2-MoE: the router's logits from the native GEMM where the module path has
torch's F.linear, and the gate's sigmoid from std::exp where it has torch's, so those agree with the module path to
rounding, not bit for bit, and the rest after them too; the experts are cpu.cpp's moe_experts, the module path's
kernels.moe_experts; a MoE last layer is not pruned), no softcaps, rope types whose table does not depend on the
context length, float32 CPU weights and
caches, or bfloat16 ones as zoo stores a bfloat16 model on the CPU (StepArgs.bf16: the matrices, the
embedding, the head, the experts and the KV cache read as bfloat16 and widened; the norms, biases and routers
float32, as the activations and the arithmetic: zoo.build.storage_dtypes), or block-quantised matrices with
float32 caches (a GGUF kept quantised: each linear, the embedding and the head on the block kernels).
LLaVA's language model qualifies the same way, on a step without image rows (the runner's choice).
A step qualifies when no forward hook is registered (parity taps see every module).
Shape legend: T tokens, N sampled rows, V vocabulary, L layers.
"""
from __future__ import annotations

import ctypes
import time

import torch
import torch.nn.modules.module as _module
from torch.utils.hooks import RemovableHandle

from zoo import kernels
from zoo.layers.attention import Attention
from zoo.layers.embedding import LMHead, VocabEmbedding
from zoo.layers.linear import Linear, MergedLinear, QKVLinear
from zoo.layers.mlp import GatedMLP
from zoo.layers.moe import SparseMoeBlock, StackedExperts, TopKRouter
from zoo.layers.norm import GemmaRMSNorm, RMSNorm
from zoo.layers.rotary import RotaryEmbedding
from zoo.runtime.batch import StepLists

# qualified names of the methods the C++ driver reproduces, all defined in _PLUGIN (checked by name: zoo does
# not import plugins)
_FORWARDS = {
    "model": ("LlamaForCausalLM.forward", "LlamaForCausalLM.compute_logits"),
    "model.model": ("LlamaModel.forward", "LlamaModel.embed"),
    "attention": ("LlamaAttention.forward", "LlamaAttention.norm_qk"),
}
_PLUGIN = "plugins.llama"
# LLaVA around such a decoder (defined in _LLAVA): its forwards pass the step on to the language model, its
# compute_logits is the head's, and the language model's embed (MultimodalEmbedding's) is LlamaModel.embed on a
# step without image rows, the only steps the runner gives the driver (ModelRunner.execute)
_LLAVA_FORWARDS = {
    "model": ("LlavaForConditionalGeneration.forward", "LlavaForConditionalGeneration.compute_logits"),
    "model.model": ("LlavaModel.forward",),
    "embed": ("MultimodalEmbedding.embed",),
}
_LLAVA = "plugins.llava"
# the decoder layers' forward methods it knows: (qualified name, module) -> kind
_LAYERS = {("LlamaDecoderLayer.forward", "plugins.llama"): "llama",
           ("Gemma3DecoderLayer.forward", "plugins.gemma3"): "gemma3"}  # norms around both blocks' outputs
_ACTS = {"silu": 0, "gelu_tanh": 1}  # GatedMLP.kind -> the C++ Act
_ERRORS = {1: "query_start_loc", 2: "seq_lens or positions", 3: "slot_mapping", 4: "block_tables",
           5: "input_ids (outside the vocabulary)", 6: "logits_indices (rows outside the step's tokens)"}


_data_ptr = torch.Tensor.data_ptr
_use_count = torch._C._storage_Use_Count  # (a storage's _cdata) -> how many tensors hold the storage


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "ln1", "qkv", "qkv_bias", "o", "o_bias", "ln2", "gate_up", "gate_up_bias", "down", "down_bias", "q_norm",
        "k_norm", "post_attn", "post_ff", "cos", "sin", "cache")] + [
        ("window", ctypes.c_long)] + [(name, ctypes.c_void_p) for name in (
        "qkv_q", "o_q", "gate_up_q", "down_q", "router", "experts_gate_up", "experts_down")] + [
        (name, ctypes.c_long) for name in ("experts", "top_k", "renorm", "moe_inter")] + [
        (name, ctypes.c_void_p) for name in ("shared_gate_up", "shared_down", "shared_gate")] + [
        ("shared_inter", ctypes.c_long)]


def _fields(kind, names: str) -> list:
    return [(n, kind) for n in names.split()]


class _StepArgs(ctypes.Structure):
    """cpu/fused.h's StepArgs: zoo_llama_step's one argument."""
    _fields_ = (_fields(ctypes.c_void_p, "ids pos slots rows tables qsl seq_lens")
                + _fields(ctypes.c_long, "T B N max_blocks") + _fields(ctypes.c_void_p, "cos sin")
                + _fields(ctypes.c_long, "table_len F")
                + _fields(ctypes.c_void_p, "embed head layers embed_q head_q final_norm")
                + _fields(ctypes.c_long, "vocab Hd nl H KV D I nb bs")
                + _fields(ctypes.c_float, "eps scale embed_scale") + _fields(ctypes.c_int, "gemma act nt bf16")
                + _fields(ctypes.c_void_p, "logits argmax argmax_values"))


class StepBuffers:
    """The fused step's arguments kept from step to step (zoo_llama_step): the model's fields set once, the step's
    metadata in ctypes arrays that `load` fills from a StepLists (grown when it does not fit).

    The runner's fast step (`argmax`) may update the arrays in place (ids, pos, slots, seq_lens: a decode step whose
    requests and blocks did not change); `__call__` returns the argmax tokens and values of the N rows, and the
    logits ([N, V], `logits`), in a buffer reused while it is large enough, are overwritten by the next step. The
    driver's general path (`FusedDecoder.run`, argmax=False) loads every step and has its logits written into a
    tensor of its own (`forward(logits)`)."""

    def __init__(self, fused: "FusedDecoder", *, argmax: bool = True):
        m, self.fused, self.argmax_on = fused.meta, fused, argmax
        a = self.args = _StepArgs()
        a.embed, a.head, a.final_norm = m["embed"].data_ptr(), m["head"].data_ptr(), m["final"].data_ptr()
        a.layers, a.nl = ctypes.addressof(fused.layers), len(fused.layers)
        a.embed_q, a.head_q = m["embed_q"], m["head_q"]
        a.vocab, a.Hd, a.H, a.KV, a.D, a.I = m["vocab"], m["hidden"], m["heads"], m["kv_heads"], m["head_dim"], \
            m["intermediate"]
        a.nb, a.bs = next(iter(fused.kv_caches.values())).shape[:2]
        a.eps, a.scale, a.embed_scale = m["eps"], m["scale"], m["embed_scale"]
        a.gemma, a.act, a.bf16 = m["gemma"], m["act"], int(m["bf16"])
        self.call, self.address = kernels._native().zoo_llama_step, ctypes.addressof(a)
        self.native_s = 0.0  # seconds of the last call
        self.table_len = 0  # positions the rope tables cover
        self.tokens = self.requests = self.rows = self.blocks = 0  # the arrays' capacities (grown by load)
        self.row_ids = (ctypes.c_int64 * 0)()  # (a step may sample no row)

    def load(self, step, positions: list[int] | None = None) -> None:
        """Take the step's metadata (a zoo.runtime.batch.StepLists; `positions` in place of its own: longrope's table
        rows), growing the arrays when it does not fit."""
        t, b, n, a = len(step.input_ids), len(step.seq_lens_cpu), len(step.logits_indices), self.args
        if not (len(step.positions) == len(step.slot_mapping) == t and len(step.query_start_loc_cpu) == b + 1
                and len(step.block_tables) == b * step.max_blocks):
            raise ValueError("fused forward: the step's lists do not agree in length")
        i64, i32 = ctypes.c_int64, ctypes.c_int32
        if t > self.tokens:  # (each capacity at least doubles: few reallocations)
            self.tokens = max(t, 2 * self.tokens)
            self.ids, self.pos, self.slots = ((i64 * self.tokens)() for _ in range(3))
            a.ids, a.pos, a.slots = (ctypes.addressof(x) for x in (self.ids, self.pos, self.slots))
        if b * step.max_blocks > self.blocks:
            self.blocks = max(b * step.max_blocks, 2 * self.blocks)
            self.tables = (i32 * self.blocks)()
            a.tables = ctypes.addressof(self.tables)
        if b > self.requests:
            self.requests = max(b, 2 * self.requests)
            self.qsl, self.seq_lens = (i32 * (self.requests + 1))(), (i32 * self.requests)()
            a.qsl, a.seq_lens = ctypes.addressof(self.qsl), ctypes.addressof(self.seq_lens)
        if n > self.rows:
            self.rows = max(n, 2 * self.rows)
            self.row_ids = (i64 * self.rows)()
            a.rows = ctypes.addressof(self.row_ids)
            if self.argmax_on:
                self.argmax, self.values = (i64 * self.rows)(), (ctypes.c_float * self.rows)()
                self.logits = torch.empty(self.rows, a.vocab)  # [N, V]
                a.argmax, a.argmax_values = ctypes.addressof(self.argmax), ctypes.addressof(self.values)
                a.logits = self.logits.data_ptr()
        self.ids[:t], self.slots[:t] = step.input_ids, step.slot_mapping
        self.pos[:t] = step.positions if positions is None else positions
        self.tables[:b * step.max_blocks] = step.block_tables
        self.qsl[:b + 1], self.seq_lens[:b] = step.query_start_loc_cpu, step.seq_lens_cpu
        self.row_ids[:n] = step.logits_indices
        a.T, a.B, a.N, a.max_blocks = t, b, n, step.max_blocks
        self.cover(max(step.seq_lens_cpu, default=1), again=True)

    def cover(self, length: int, *, again: bool = False) -> None:
        """The rope tables cover `length` positions: grown when they did not, and their pointers taken again then
        or when `again` (another step, e.g. the general path's, may have grown and replaced the tables and set the
        layers' pointers since). The tables pointed at are held, so a pointer never outlives its table."""
        if length <= self.table_len and not again:
            return
        self.rope_tables = rope_tables = self.fused._tables([length])
        if len(rope_tables) > 1:  # each layer's own table (Gemma3: a table per rope base)
            for layer, i in zip(self.fused.layers, self.fused.meta["layer_rope"]):
                layer.cos, layer.sin = rope_tables[i][0].data_ptr(), rope_tables[i][1].data_ptr()
        a = self.args
        a.cos, a.sin = rope_tables[0][0].data_ptr(), rope_tables[0][1].data_ptr()
        a.F = rope_tables[0][0].shape[1]
        a.table_len = self.table_len = min(c.shape[0] for c, _ in rope_tables)

    def forward(self, logits: torch.Tensor | None = None) -> None:
        """The native call on the loaded step, the logits written into `logits` [N, V] when given (the general
        path's), else into self.logits. native_s: its seconds. A ValueError names the field it found inconsistent."""
        a = self.args
        a.nt = kernels.threads()
        if logits is not None:
            a.logits = logits.data_ptr()
        t = time.perf_counter()
        bad = self.call(self.address)
        self.native_s = time.perf_counter() - t
        if bad:
            raise ValueError(f"fused forward: batch.{_ERRORS.get(bad, bad)} is inconsistent with the step's {a.T} "
                             f"tokens and the KV cache")

    def __call__(self) -> tuple[list[int], list[float]]:
        """Run the step (argmax=True): the N rows' argmax tokens and their values (the logits in self.logits[:N])."""
        self.forward()
        n = self.args.N
        return self.argmax[:n], self.values[:n]


def _own_forwards(obj, names, plugin: str = _PLUGIN) -> bool:
    for name in names:
        fn = getattr(type(obj), name.split(".")[-1], None)
        if fn is None or fn.__qualname__ != name or fn.__module__ != plugin:
            return False
    return True


def _decoder(model):
    """The Llama-structured decoder whose embedding, layers and norm the driver runs (a Llama's own, or the
    language model inside LLaVA), or None."""
    if _own_forwards(model, _FORWARDS["model"]):
        return model.model if _own_forwards(model.model, _FORWARDS["model.model"]) else None
    if not (_own_forwards(model, _LLAVA_FORWARDS["model"], _LLAVA)
            and _own_forwards(model.model, _LLAVA_FORWARDS["model.model"], _LLAVA)):
        return None
    inner = model.model.language_model
    return inner if _own_forwards(inner, ("LlamaModel.forward",)) and _own_forwards(
        inner, _LLAVA_FORWARDS["embed"], _LLAVA) else None


def _plain_mlp(mlp, kind: str | None = None) -> bool:
    """A GatedMLP of the shared kinds (of activation `kind`, when given): gate_up a MergedLinear, down a Linear."""
    return (type(mlp) is GatedMLP and type(mlp.gate_up_proj) is MergedLinear and type(mlp.down_proj) is Linear
            and (kind is None or mlp.kind == kind))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _float_or_blocks(w: torch.Tensor, held: list) -> tuple[int | None, int | None]:
    """(float pointer, QMat pointer) of a weight: float rows, or block-quantised bytes (`w.quant`)."""
    if w.dtype is not torch.uint8:
        return w.data_ptr(), None
    q = kernels.qmat(w)
    if q is None:
        raise TypeError(f"a quantized weight ({w.quant}) of a type or layout without a fused kernel")
    held.append(q)
    return None, ctypes.addressof(q)


class FusedDecoder:
    def __init__(self, model, kv_caches: dict[str, torch.Tensor], params: list[torch.Tensor], layers, meta: dict):
        self.model, self.kv_caches, self.params, self.meta = model, kv_caches, params, meta
        self.layers = layers  # ctypes array of _Layer
        self.ptrs = [p.data_ptr() for p in params]
        self.long_rope = meta["ropes"][0] if meta["ropes"][0].long_past is not None else None  # (Phi-3)
        mods = list(model.modules())  # hook registries, checked every step (registering mutates them in place)
        self.hooks = [m._forward_hooks for m in mods] + [m._forward_pre_hooks for m in mods]
        self.native_s = 0.0  # seconds of the last step's native call
        self.clean_at = None  # (RemovableHandle.next_id, the weights' storage use counts) at the last check passed
        self.hooks_clean_at = None  # RemovableHandle.next_id when self.hooks were last found empty
        # the storages the weights are views of (one buffer once kernels.pack_weights packed them): a parameter
        # whose .data is replaced drops its reference, and the count moves
        self.storages = list({p.untyped_storage().data_ptr(): p.untyped_storage() for p in params}.values())
        self.storage_ids = [st._cdata for st in self.storages]  # (kept alive by self.storages)
        self.general = StepBuffers(self, argmax=False)  # the general path's (run): every step loaded afresh

    @classmethod
    def build(cls, model, kv_caches: dict[str, torch.Tensor]) -> "FusedDecoder | None":
        """The driver for this model and these caches, or None when either does not qualify."""
        built = cls.qualify(model, kv_caches)
        return built if isinstance(built, FusedDecoder) else None

    @classmethod
    def qualify(cls, model, kv_caches: dict[str, torch.Tensor] | None) -> "FusedDecoder | str":
        """The driver, or the reason the model does not qualify (one line). Without caches (`zoo inspect`, on
        a model built on the meta device) only the structure is checked, and a model that passes gets the
        string "qualifies" (weights and caches must then be float32 on the CPU)."""
        if not kernels.enabled():
            return "native kernels are off (ZOO_FAST=0, or not built for this machine)"
        try:
            return cls._build(model, kv_caches)
        except (AttributeError, TypeError, KeyError) as e:  # another structure than the one the driver knows
            return f"its structure is not the one the driver knows ({type(e).__name__}: {e})"

    @classmethod
    def _build(cls, model, kv_caches):
        inner = _decoder(model)
        if inner is None:
            return (f"{type(model).__name__} or {type(model.model).__name__} overrides forward, compute_logits or "
                    f"embed (the driver reproduces {_PLUGIN}'s)")
        embed, head, final = inner.embed_tokens, model.lm_head, inner.norm
        if not (type(embed) is VocabEmbedding and type(head) is LMHead
                and (head.softcap, head.bias, head.scale, head.divisor) == (None, None, None, None)):
            return "the embedding or the head is not a plain VocabEmbedding / LMHead (softcap, bias, scale)"
        # the matrices (`matrices`: float32, bfloat16 with bfloat16 caches, or block-quantised, uint8 bytes, with
        # float32 caches) and the rest (`params`: norms, biases, routers), float32
        matrices, params, norms, ropes, shape = [embed.weight, head.weight], [final.weight], [final], [], set()
        layers, inters, moe_inters = [], set(), set()  # the dense MLPs' intermediate sizes, the experts'
        dtype = torch.float32 if embed.weight.dtype is torch.uint8 else embed.weight.dtype
        held = []  # the QMats of quantised weights (cpu.cpp reads them through pointers)
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            core = attn.attn
            fn = getattr(type(layer), "forward", None)
            kind = _LAYERS.get((getattr(fn, "__qualname__", None), getattr(fn, "__module__", None)))
            if not kind:
                return (f"{layer.prefix}: {type(layer).__name__}.forward is not one the driver knows "
                        f"({', '.join(q for q, _ in _LAYERS)})")
            if not _own_forwards(attn, _FORWARDS["attention"]):
                return f"{attn.prefix}: {type(attn).__name__} overrides {' or '.join(_FORWARDS['attention'])}"
            moe = type(mlp) is SparseMoeBlock
            if not (type(attn.qkv_proj) is QKVLinear and type(attn.o_proj) is Linear and type(core) is Attention
                    and (moe or _plain_mlp(mlp))):
                return f"{layer.prefix}: a projection, the attention core or the MLP is not of the shared kinds"
            shared = getattr(mlp, "shared_expert", None) if moe else None
            if moe and not (type(mlp.gate) is TopKRouter and type(mlp.experts) is StackedExperts
                            and mlp.gate.scoring == "softmax" and mlp.gate.num_experts <= 256 and mlp.gate.top_k <= 64
                            and (shared is None or _plain_mlp(shared, mlp.experts.kind)
                                 and type(mlp.shared_expert_gate) is Linear and mlp.shared_expert_gate.bias is None)):
                return (f"{layer.prefix}.mlp: a MoE block other than softmax top-k routing over at most 256 stacked "
                        f"experts, with at most a shared expert of their activation without biases and its sigmoid "
                        f"gate")
            if moe:
                mlp = mlp.experts  # (its kind, its weights; the router's and a shared expert's below)
            if core.softcap is not None or hasattr(attn, "sinks"):
                return f"{attn.prefix}: softcapped attention scores or attention sinks"
            rope = attn.rotary_emb
            if not (type(rope) is RotaryEmbedding and rope.native):
                return (f"{attn.prefix}: rotary {'none (NoPE)' if rope is None else getattr(rope, 'rope_type', rope)} "
                        f"(needs rotate-half, one table for every context length)")
            if mlp.kind not in _ACTS:
                return f"{layer.prefix}.mlp: activation without a fused kernel"
            if kind == "gemma3":  # the attention's and the MLP's outputs are normed before the residual adds
                ln1, post_attn, ln2, post_ff = (layer.input_layernorm, layer.post_attention_layernorm,
                                                layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
            else:
                ln1, post_attn, ln2, post_ff = layer.input_layernorm, None, layer.post_attention_layernorm, None
            names = type(attn).qk_norm_names
            qk = tuple(getattr(attn, n) for n in names) if hasattr(attn, names[0]) else (None, None)
            if any(n is not None and n.weight.shape != (core.head_dim,) for n in qk):
                return f"{attn.prefix}: q/k norms that are not one norm on the head dim"
            extra = [n for n in (*qk, post_attn, post_ff) if n is not None]
            norms += [ln1, ln2, *extra]
            ropes.append(rope)
            shape.add((core.num_heads, core.num_kv_heads, core.head_dim, core.scale, mlp.kind))
            (moe_inters if moe else inters).add(mlp.intermediate_size if moe else mlp.down_proj.input_size)
            mods = (ln1, attn.qkv_proj, attn.o_proj, ln2, mlp.gate_up_proj, mlp.down_proj)
            w = [m.weight for m in mods]
            b = [getattr(m, "bias", None) for m in mods]
            matrices += [w[i] for i in (1, 2, 4, 5)]
            params += [w[0], w[3]] + [x for x in b if x is not None] + [n.weight for n in extra]
            router = layer.mlp.gate if moe else None
            if moe:
                params.append(router.weight)
            if shared is not None:
                sw = [shared.gate_up_proj.weight, shared.down_proj.weight, layer.mlp.shared_expert_gate.weight]
                matrices += sw
                if any(t.dtype is torch.uint8 for t in sw):
                    return f"{layer.prefix}.mlp.shared_expert: block-quantised (the driver's shared expert is float)"
            if kv_caches is None:
                continue
            cache = kv_caches[attn.prefix]
            if cache.dtype is not dtype or not cache.is_contiguous() or not cache.is_cpu:
                return f"{attn.prefix}: the KV cache is not {dtype} (the weights' dtype), contiguous, on the CPU"
            (qkv, qkv_q), (o, o_q) = (_float_or_blocks(x, held) for x in (w[1], w[2]))
            (gu, gu_q), (down, down_q) = ((None, None), (None, None)) if moe else (
                _float_or_blocks(x, held) for x in (w[4], w[5]))
            routed = ((router.weight.data_ptr(), w[4].data_ptr(), w[5].data_ptr(), router.num_experts, router.top_k,
                       int(router.renormalize), mlp.intermediate_size) if moe else (None, None, None, 0, 0, 0, 0))
            routed += ((*(t.data_ptr() for t in sw), shared.down_proj.input_size) if shared is not None
                       else (None, None, None, 0))
            layers.append(_Layer(_ptr(w[0]), qkv, _ptr(b[1]), o, _ptr(b[2]), _ptr(w[3]), gu,
                                 _ptr(b[4]), down, _ptr(b[5]),
                                 *(_ptr(n.weight) if n is not None else None for n in (*qk, post_attn, post_ff)),
                                 None, None, cache.data_ptr(), core.sliding_window or 0, qkv_q, o_q, gu_q, down_q,
                                 *routed))
        kinds, eps = {type(n) for n in norms}, {n.eps for n in norms}
        if kinds not in ({RMSNorm}, {GemmaRMSNorm}):
            return f"norms of kinds {sorted(k.__name__ for k in kinds)} (needs RMSNorm or GemmaRMSNorm throughout)"
        if len(eps) != 1 or len(shape) != 1 or len(inters) > 1 or not inner.layers:
            return "layers differ in norm eps, heads, head dim, scale, MLP size or activation"
        if kv_caches is None:
            return "qualifies"
        blocks = dtype is torch.float32 and any(p.dtype is torch.uint8 for p in matrices)
        if blocks and any(p.dtype is torch.uint8 and not hasattr(p, "quant") for p in matrices):
            return "uint8 weights that are not a GGUF's blocks"
        if dtype not in (torch.float32, torch.bfloat16) or any(
                (p.dtype is not dtype and not (blocks and p.dtype is torch.uint8)) or not p.is_cpu
                or not p.is_contiguous() for p in matrices):
            return "matrices are not all float32 (or block-quantised) or all bfloat16, contiguous, on the CPU"
        if any(p.dtype is not torch.float32 or not p.is_cpu or not p.is_contiguous() for p in params):
            return "norms, biases or routers are not float32, contiguous, on the CPU (as zoo stores them)"
        distinct = list(dict.fromkeys(ropes))  # Gemma3: a table per rope base, each layer pointing at its own
        if len(distinct) > 1 and any(r.long_past is not None for r in distinct):
            return "a rope with two frequency sets (longrope) beside another rope"
        if len({r.table(torch.device("cpu"), torch.float32, 1)[0].shape[1] for r in distinct}) != 1:
            return "layers rotate different numbers of dims"
        (heads, kv_heads, head_dim, scale, act), = shape
        inter = next(iter(inters or moe_inters))  # the dense MLPs' (the buffers' size), else the experts'
        meta = dict(eps=eps.pop(), ropes=distinct, layer_rope=[distinct.index(r) for r in ropes], heads=heads,
                    kv_heads=kv_heads, head_dim=head_dim, scale=scale, intermediate=inter, hidden=embed.hidden_size,
                    vocab=embed.vocab_size, embed=embed.weight, head=head.weight, final=final.weight,
                    gemma=int(kinds == {GemmaRMSNorm}), embed_scale=float(embed.scale or 0.0), act=_ACTS[act],
                    bf16=dtype is torch.bfloat16, embed_q=_float_or_blocks(embed.weight, held)[1],
                    head_q=_float_or_blocks(head.weight, held)[1], held=held)
        return cls(model, kv_caches, matrices + params, (_Layer * len(layers))(*layers), meta)

    def usable(self, batch=None, *, quick: bool = False) -> bool:
        """Steps can take the driver: the same caches (batch's, when given) and weights, no hooks, kernels on.

        The modules' ~2 x modules hook registries are read only when torch's RemovableHandle.next_id moved since
        they were last found empty (every hook registration takes the next id). The weights' pointers are read
        every call (~0.15 ms of cache misses after a decode step has streamed the weights through the caches),
        unless `quick` (the runner's steady decode steps) and the use counts of the storages the weights are
        views of did not move since the last check passed: a parameter whose .data is replaced drops its
        reference. Not seen by a quick check: a replacement while another reference to the old storage is taken
        (the count moves back), or a hook put into a registry by hand."""
        if (batch is not None and batch.kv_caches is not self.kv_caches) or not kernels.enabled():
            return False
        if _module._global_forward_hooks or _module._global_forward_pre_hooks:
            return False
        hook_id = RemovableHandle.next_id
        key = (hook_id, *map(_use_count, self.storage_ids)) if len(self.storage_ids) <= 4 else None
        if quick and key is not None and key == self.clean_at:
            return True
        if list(map(_data_ptr, self.params)) != self.ptrs:  # weights replaced since the build
            return False
        if hook_id != self.hooks_clean_at:
            if any(self.hooks):
                return False
            self.hooks_clean_at = hook_id
        self.clean_at = key
        return True

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        """logits [N, V] of the rows batch.logits_indices, writing the step's K/V into the caches: `run` on the
        batch's tensors as host lists."""
        if self.long_rope is not None:
            positions = self._table_rows(positions, batch)
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"fused forward: input_ids {tuple(input_ids.shape)} and positions "
                             f"{tuple(positions.shape)} must both be [T]")
        qsl, seq_lens, slots, tables = kernels._metadata(batch, input_ids.shape[0], True)
        b = seq_lens.shape[0]
        step = StepLists(input_ids.tolist(), positions.tolist(), slots.tolist(), qsl.tolist(), seq_lens.tolist(),
                         batch.num_tokens_cpu, tables[:b].flatten().tolist(), tables.shape[1],
                         batch.logits_indices.tolist())
        return self.run(step, step.positions)  # (the table rows already)

    def run(self, step, positions: list[int] | None = None) -> torch.Tensor:
        """The same from a zoo.runtime.batch.StepLists (the runner's step as host lists): no tensor ops but the
        logits'. `positions`: the rows of the rope tables its tokens read, in place of its positions (longrope:
        mapped here when not given)."""
        if positions is None and self.long_rope is not None:
            positions = self._table_rows(torch.tensor(step.positions), step).tolist()
        self.general.load(step, positions)
        logits = torch.empty(len(step.logits_indices), self.meta["vocab"])  # [N, V]
        self.general.forward(logits)
        self.native_s = self.general.native_s  # (bench/generate.py: the step's time outside it is Python)
        return logits

    def _table_rows(self, positions: torch.Tensor, step) -> torch.Tensor:
        """longrope: each token's row in the short/long halves of the table (one rope: checked at the build)."""
        return self.long_rope.table_rows(positions, step, self._tables(step.seq_lens_cpu)[0][0].shape[0] // 2)

    def _tables(self, seq_lens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each rope's cos, sin tables [L, F], grown to cover the step's longest sequence."""
        num_positions = max(seq_lens) if seq_lens else 1
        return [r.table(torch.device("cpu"), torch.float32, num_positions) for r in self.meta["ropes"]]
