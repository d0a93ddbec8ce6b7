"""Taps: which module outputs are compared, how they are named, and how they are captured.

A tap is a module whose output is recorded on both sides and joined by its module name. The
reference (transformers) decides the tap set: every module whose name matches one of ROLES below.
The zoo's modules carry the checkpoint's names, so the same name finds the same module there.

Roles, in the order they usually fire inside one decoder layer:
    embed          ...embed_tokens | embed_in | wte | wpe [tokens, H]   (token / GPT-2 position embeddings)
    embed          EMBEDDED: the first layer's input     [tokens, H]   (the pseudo-tap "embedded", below)
    norm           ...layers.{i}.<something>layernorm    [tokens, H]   (input/post-attention/pre/post-ff, ln_1, norm)
    attn           ...layers.{i}.self_attn | attention   [tokens, H]   (output after o_proj)
    mixer_in       ...layers.{i}.(mixer|mamba).in_proj   [tokens, P]   SSM mixer: the input projection
    mixer_conv     ...layers.{i}.mamba.x_proj            [tokens, r+2N] Mamba1: dt/B/C from the conv's output
    mixer_norm     ...layers.{i}.(mixer|mamba).norm      [tokens, I]   Mamba2: the gated norm of the scan's output
    mixer          ...layers.{i}.(mixer|mamba)           [tokens, H]   the whole SSM mixer (after out_proj)
    router         ...layers.{i}.mlp.gate | .router     [tokens, E]   router logits (MoE only)
    mlp            ...layers.{i}.mlp | block_sparse_moe | feed_forward  [tokens, H]   (MLP or whole MoE block)
    shared_expert  ...layers.{i}.mlp.shared_expert(s)    [tokens, H]
    layer          ...layers.{i}                         [tokens, H]   the decoder layer's output
    final_norm     ...norm | norm_f | ln_f | final_layernorm (outside the layers)  [tokens, H]
    logits         the pseudo-tap LOGITS: the model's logits (not a module; computed by each side)

A decoder layer is `layers.{i}` (GPT-2: `h.{i}`). Every registered architecture has taps for its embedding, each
layer's attention or mixer and MLP, its final norm and the logits (tests/test_parity_taps.py). EMBEDDED is not a
module's output: it is the hidden state the first decoder layer is called with (a pre-hook on both sides), so an
embedding multiplier applied outside the embedding module (Granite) or GPT-2's position embeddings are checked
before layer 0, and localisation replays layer 0 on the zoo's value of it.
Order is the order the hooks fire (recorded per run), never sorted names.

Protocol for zoo plugins (how a model says what its tap outputs are when they differ from the reference):

1. `parity_taps` on the model class: a dict, or a function `(config) -> dict`, mapping zoo module
   names to reference module names, `{i}` standing for a layer index, e.g.
       parity_taps = {"model.layers.{i}.block_sparse_moe": "model.layers.{i}.mlp"}
   A value of None means "this zoo module is not a tap" (its name collides with a reference tap but
   it computes something else). Names not in the map join as they are.

2. `parity_output` on a module (class or instance attribute) says which part of the module's output is
   the tap value:
       "first"  the first tensor of a tuple output (the default for tuples)
       "sum"    the output is (hidden, residual) in fused-residual style: the true output is
                hidden + residual (residual None counts as 0). Decoder layers that return
                (mlp_out, residual) and leave the add to the next layer's norm must declare this.
       a method `def parity_output(self, output) -> Tensor` of the module, for anything else.

3. Router taps: a zoo gate module returns the router logits [T, E], or a tuple whose first tensor is
   the logits and whose last integer tensor holds the chosen experts [T, K]. Chosen experts are only
   compared when both sides expose them.

The model's own forward output is the final hidden state [T, H]; logits are computed by the zoo
model's `compute_logits` on every row of it (the zoo's own head, softcapping included). The pseudo-tap
SAMPLED holds the logits the runtime itself sampled from (its logits_indices rows), compared with the
reference's logits at the same positions.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

LOGITS = "logits"
SAMPLED = "sampled_logits"  # the logits rows the runtime itself sampled from (zoo side); reference: LOGITS
# the hidden state the first decoder layer reads: the embedding with what the model adds before layer 0 (an
# embedding multiplier or scale outside the embedding module, GPT-2's position embeddings), on both sides the
# first decoder layer's input; it is that layer's input in localisation
EMBEDDED = "embedded"

LAYER = r"(?:layers|h)\.\d+"  # a decoder layer: `layers.{i}` (GPT-2: `h.{i}`)
ROLES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (role, re.compile(p))
    for role, p in (
        # the token embedding (GPT-NeoX `embed_in`, GPT-2 `wte`, Mamba's `backbone.embeddings`) and GPT-2's learned
        # position embedding `wpe`; what the first layer reads (their sum, a multiplier) is the pseudo-tap EMBEDDED
        ("embed", r"(^|\.)(embed_tokens|embed_in|wte|wpe)$|^backbone\.embeddings$"),
        ("layer", rf"(^|\.){LAYER}$"),
        ("norm", rf"(^|\.){LAYER}\.(\w*(layernorm|layer_norm|_norm)|norm|ln_\d)$"),
        ("attn", rf"(^|\.){LAYER}\.(self_attn|attention|attn)$"),
        # SSM mixers (Mamba2, Bamba: `mixer` / `mamba`): in_proj's output (gate | xBC | dt), Jamba's x_proj
        # (dt | B | C from the conv's output), the gated norm (its input is the scan's output), the whole mixer
        ("mixer_in", rf"(^|\.){LAYER}\.(mixer|mamba)\.in_proj$"),
        ("mixer_conv", rf"(^|\.){LAYER}\.mamba\.x_proj$"),
        ("mixer_norm", rf"(^|\.){LAYER}\.(mixer|mamba)\.norm$"),
        ("mixer", rf"(^|\.){LAYER}\.(mixer|mamba)$"),
        ("mlp", rf"(^|\.){LAYER}\.(mlp|block_sparse_moe|feed_forward)$"),
        ("router", rf"(^|\.){LAYER}\.(mlp|block_sparse_moe|feed_forward)\.(gate|router)$"),
        ("shared_expert", rf"(^|\.){LAYER}\.(mlp|block_sparse_moe|feed_forward)\.shared_experts?$"),
        # the norm after the last layer (outside every layer): norm, Mamba's norm_f, GPT-2's ln_f, final_layernorm
        ("final_norm", rf"^(?!.*(^|\.){LAYER}(\.|$))(.*\.)?(norm|norm_f|ln_f|final_layernorm|final_layer_norm)$"),
    )
)
# tensor parallelism: the roles whose output every rank holds whole (after a row-parallel all-reduce or the vocab
# gather: an SSM mixer's out_proj, Jamba's x_proj); the rest (a shared expert's partial sum, an SSM mixer's in_proj
# and gated norm, split by heads or channels) are a rank's part only
TP_REPLICATED_ROLES = ("embed", "norm", "attn", "mixer", "mixer_conv", "mlp", "router", "layer", "final_norm")
LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)(?:\.|$)")


def role_of(name: str) -> str | None:
    if name in (LOGITS, SAMPLED):
        return "logits"
    if name == EMBEDDED:
        return "embed"
    for role, pattern in ROLES:
        if pattern.search(name):
            return role
    return None


def layer_of(name: str) -> int | None:
    """The decoder layer index in a tap name, or None (embedding, final norm, logits)."""
    m = LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def short(name: str) -> str:
    """A compact display name: `model.layers.3.self_attn` -> `L3.self_attn`."""
    if name in (LOGITS, SAMPLED, EMBEDDED):
        return name
    m = LAYER_RE.search(name)
    if not m:
        return name.rsplit(".", 1)[-1] if "." in name else name
    rest = name[m.end():]
    return f"L{m.group(1)}" + (f".{rest}" if rest else "")


def reference_taps(model: nn.Module) -> dict[str, str]:
    """module name -> role for every tap of a reference model (dense routers are not taps)."""
    taps = {}
    for name, module in model.named_modules():
        role = role_of(name)
        if role is None:
            continue
        if role == "router" and isinstance(module, nn.Linear) and module.out_features == 1:
            continue  # a scalar gate (Qwen2-MoE's shared_expert_gate spelt differently), not a router
        taps[name] = role
    return taps


def first_layer(names) -> str | None:
    """The first decoder layer beside the token embedding (`model.layers.0`, GPT-2's `transformer.h.0`, not a
    vision tower's): EMBEDDED is its input. `names`: the reference's tap names."""
    names = set(names)
    for embed in sorted(n for n in names if role_of(n) == "embed" and n != EMBEDDED):
        parent = embed.rsplit(".", 1)[0] + "." if "." in embed else ""
        for layer in (f"{parent}layers.0", f"{parent}h.0"):
            if layer in names:
                return layer
    return None


def input_taps(names: dict[str, str], wanted) -> dict[str, str]:
    """{module: EMBEDDED} for the module of `names` (module -> reference tap) that joins the reference's first
    layer, when EMBEDDED is wanted; else {}."""
    if EMBEDDED not in wanted:
        return {}
    first = first_layer(wanted)
    return {module: EMBEDDED for module, tap in names.items() if tap == first and first is not None}


def _compile_map(mapping: dict[str, str | None]) -> list[tuple[re.Pattern, str | None]]:
    out = []
    for src, dst in mapping.items():
        pattern = re.escape(src).replace(re.escape("{i}"), r"(?P<i>\d+)")
        out.append((re.compile(f"^{pattern}$"), dst))
    return out


def zoo_tap_names(model: nn.Module, config, wanted: set[str]) -> dict[str, str]:
    """zoo module name -> reference tap name, for the zoo modules that join a wanted reference tap."""
    declared = getattr(type(model), "parity_taps", None) or getattr(model, "parity_taps", None) or {}
    if callable(declared):
        declared = declared(config)
    rules = _compile_map(dict(declared))
    joined: dict[str, str] = {}
    for name, _ in model.named_modules():
        target: str | None = name
        for pattern, dst in rules:
            m = pattern.match(name)
            if m:
                target = None if dst is None else dst.replace("{i}", m.groupdict().get("i") or "")
                break
        if target is not None and target in wanted:
            if target in joined.values():
                other = next(k for k, v in joined.items() if v == target)
                raise ValueError(f"parity_taps: zoo modules {other!r} and {name!r} both map to tap {target!r}")
            joined[name] = target
    return joined


def layer_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The hidden states a decoder layer is called with: its first floating-point tensor argument (the zoo's
    forward(positions, hidden_states, batch), transformers' forward(hidden_states, ...)), or `hidden_states=`."""
    for x in args:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x
    return kwargs.get("hidden_states")


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for x in out:
            if isinstance(x, torch.Tensor):
                return x
    return None


def tap_value(module: nn.Module, out: Any, name: str) -> torch.Tensor:
    """The tensor a module's output contributes as a tap, following the `parity_output` protocol."""
    how = getattr(module, "parity_output", None)
    if callable(how):
        value = how(out)
    elif how == "sum":
        hidden, residual = out[0], out[1]
        value = hidden if residual is None else hidden + residual
    elif how in (None, "first"):
        value = _first_tensor(out)
    else:
        raise ValueError(f"{name}: parity_output={how!r} is not 'first', 'sum' or a callable")
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"tap {name}: output of {type(module).__name__} holds no tensor ({type(out).__name__})")
    return value


def chosen_experts(out: Any) -> torch.Tensor | None:
    """The last integer tensor of a router's tuple output (its chosen experts), if it has one."""
    if isinstance(out, (tuple, list)):
        ints = [x for x in out if isinstance(x, torch.Tensor) and not x.is_floating_point()]
        return ints[-1] if ints else None
    return None


@dataclass
class Step:
    """What one forward call of the root module produced."""

    taps: dict[str, torch.Tensor] = field(default_factory=dict)  # tap -> value (float32, cpu)
    experts: dict[str, torch.Tensor] = field(default_factory=dict)  # router tap -> [tokens, K]
    meta: dict[str, Any] = field(default_factory=dict)  # whatever the root's pre-hook recorded
    output: Any = None  # the root's output
    layer_calls: dict[str, tuple[tuple, dict]] = field(default_factory=dict)  # layer tap -> (args, kwargs)


class Capture:
    """Forward hooks on the taps of `root`; one Step per forward call of `root`, in execution order.

        with Capture(model, {"model.layers.0": "model.layers.0", ...}) as cap:
            model(...)
        cap.steps[0].taps["model.layers.0"]

    `names` maps module name -> tap name; `inputs` module name -> tap name for taps that are a module's input
    (EMBEDDED: the first layer's hidden states). `meta(args, kwargs) -> dict` runs before each root forward;
    `keep_layer_calls` keeps the (args, kwargs) of each "layer" tap (for replaying a reference layer).
    `root_output`: keep the root's output (True), not (False), or keep `root_output(output)`, computed
    inside the forward call (before a runtime may reuse the output's memory).
    """

    def __init__(self, root: nn.Module, names: dict[str, str], *, inputs: dict[str, str] | None = None,
                 meta: Callable[[tuple, dict], dict] | None = None, keep_layer_calls: bool = False,
                 root_output: bool | Callable[[Any], Any] = True):
        self.root, self.names, self.inputs = root, names, inputs or {}
        self.steps: list[Step] = []
        self.order: list[str] = []
        self._meta, self._keep_calls, self._root_output = meta, keep_layer_calls, root_output
        self._handles: list = []

    def __enter__(self) -> "Capture":
        modules = dict(self.root.named_modules())
        missing = [m for m in [*self.names, *self.inputs] if m not in modules]
        if missing:
            raise KeyError(f"taps not found among the modules of {type(self.root).__name__}: {missing}")
        self._handles.append(self.root.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        if self._root_output:
            self._handles.append(self.root.register_forward_hook(self._root_post))
        for module_name, tap in self.inputs.items():  # (before the module's own pre-hooks: its input, as called)
            self._handles.append(modules[module_name].register_forward_pre_hook(self._input_hook(tap),
                                                                                with_kwargs=True))
        for module_name, tap in self.names.items():
            module = modules[module_name]
            self._handles.append(module.register_forward_hook(self._hook(tap, module)))
            if self._keep_calls and role_of(tap) == "layer":
                self._handles.append(module.register_forward_pre_hook(self._call_hook(tap), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- hooks -------------------------------------------------------------------------------------
    def _root_pre(self, module, args, kwargs):
        self.steps.append(Step(meta=self._meta(args, kwargs) if self._meta else {}))
        return None

    def _root_post(self, module, args, out):
        if self.steps:  # kept as is, or what root_output(out) makes of it right now
            self.steps[-1].output = self._root_output(out) if callable(self._root_output) else out
        return None

    def _record(self, tap: str, value: torch.Tensor):
        if not self.steps:  # a tap ran outside a root forward (e.g. a replayed layer)
            self.steps.append(Step())
        step = self.steps[-1]
        if tap in step.taps:
            raise RuntimeError(f"tap {tap} fired twice in one forward: is the module shared?")
        step.taps[tap] = value.detach().float().cpu().clone()
        if tap not in self.order:
            self.order.append(tap)
        return step

    def _input_hook(self, tap: str):
        def hook(mod, args, kwargs):
            value = layer_input(args, kwargs)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"tap {tap}: {type(mod).__name__} was called without a floating-point tensor")
            self._record(tap, value)
            return None

        return hook

    def _hook(self, tap: str, module: nn.Module):
        role = role_of(tap)

        def hook(mod, args, out):
            step = self._record(tap, tap_value(module, out, tap))
            if role == "router":
                experts = chosen_experts(out)
                if experts is not None:
                    step.experts[tap] = experts.detach().cpu().long().clone()
            return None

        return hook

    def _call_hook(self, tap: str):
        def hook(mod, args, kwargs):
            if self.steps:
                self.steps[-1].layer_calls[tap] = (args, kwargs)
            return None

        return hook
