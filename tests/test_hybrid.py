"""Hybrid attention / SSM models (Mamba2, Bamba, Jamba) against transformers, read from disk, float32.

The reference is always transformers' one-shot forward (its multi-token continuation through its own cache
is unreliable for these models: Jamba restarts the scan from zero, Bamba restarts rotary without
position_ids) and its greedy `generate` for the tokens. The zoo side runs through the real runtime
(LLMEngine: scheduler, state pool, KV pool), under every schedule a test names, and each of those tests runs
twice (`ops`): on the native kernels (Mamba2's mixer in kernels.mamba2_mix) and on torch ops, the reference path.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from batching import assert_close, random_prompts, run_step
from kernel_paths import ops  # noqa: F401  (fixture: the runtime tests run on the native kernels and on torch ops)
from loader import LoadError
from tiny import load_reference, save_tiny
from zoo.build import build_model
from zoo.runtime.engine import LLMEngine
from zoo.runtime.sampling_params import SamplingParams

CHUNK, CONV = 8, 4  # the tiny mixers' scan chunk and conv width
STEPS = 32
CASES = {  # name -> (architecture, overrides of tests/tiny.py's BASE, the mixer prefix of layer 0)
    "mamba2": ("Mamba2ForCausalLM", dict(num_heads=8, head_dim=16, state_size=16, n_groups=2, chunk_size=CHUNK,
                                         expand=2, conv_kernel=CONV), "backbone.layers.0.mixer"),
    "bamba": ("BambaForCausalLM", dict(num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16,
                                       mamba_n_groups=2, mamba_chunk_size=CHUNK, mamba_d_conv=CONV),
              "model.layers.0.mamba"),
    "jamba": ("JambaForCausalLM", dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                                       expert_layer_period=2, expert_layer_offset=0, num_experts=4,
                                       num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=CONV),
              "model.layers.0.mamba"),
}
PROMPT_LENGTHS = [29, 13, 6, 17]
# max |zoo - transformers| of logits (up to ~6). Jamba's wide random init is ill-conditioned: transformers' own
# cached decode differs from its own one-shot forward by up to 1.2e-4 on these prompts (measured)
ATOL = {"jamba": 2.5e-4}


class Case:
    def __init__(self, name, tmp_path_factory):
        self.name = name
        arch, overrides, self.mixer = CASES[name]
        self.path = save_tiny(arch, tmp_path_factory.mktemp(name), initializer_range=0.2, **overrides)
        self.model, self.config, self.spec, _ = build_model(self.path)
        self.ref = load_reference(self.path)
        self.ref.generation_config.eos_token_id = None  # STEPS tokens on both sides, whatever comes out
        self.prompts = random_prompts(PROMPT_LENGTHS, vocab=128, seed=3)
        self.tokens, self.logits = [], []  # transformers: greedy tokens [STEPS], one-shot logits [STEPS, V]
        with torch.no_grad():
            for p in self.prompts:
                out = self.ref.generate(torch.tensor([p]), max_new_tokens=STEPS, do_sample=False,
                                        pad_token_id=0)[0, len(p):].tolist()
                seq = torch.tensor([p + out[:-1]])
                self.tokens.append(out)
                self.logits.append(self.ref(seq, position_ids=torch.arange(seq.shape[1])[None]).logits[0, len(p) - 1:])


_cases: dict[str, Case] = {}


def get_case(name: str, tmp_path_factory) -> Case:
    if name not in _cases:
        _cases[name] = Case(name, tmp_path_factory)
    return _cases[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory) -> Case:
    return get_case(request.param, tmp_path_factory)


def generate(case: Case, prompts: list[int] | None = None, *, after_step=None, **engine_kw):
    """Greedy STEPS tokens for case.prompts[i] (i in `prompts`), all added at once -> ({i: tokens},
    {i: sampled logits [STEPS, V]}, engine)."""
    engine = LLMEngine(case.model, case.config, None, **engine_kw)
    logits: dict[str, list[torch.Tensor]] = {}

    def hook(reqs, rows):
        for r, row in zip(reqs, rows):
            logits.setdefault(r.request_id, []).append(row.clone())

    engine.runner.logits_hook = hook
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    for i in prompts if prompts is not None else range(len(case.prompts)):
        engine.add_request(case.prompts[i], params, request_id=str(i))
    if after_step is not None:
        after_step(engine)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[int(out.request_id)] = out.token_ids
        if after_step is not None:
            after_step(engine)
    return tokens, {int(k): torch.stack(v) for k, v in logits.items()}, engine


def check(case: Case, tokens, logits, what: str) -> None:
    for i, toks in tokens.items():
        assert_close(logits[i], case.logits[i], f"{case.name} {what}, prompt {i}: sampled logits vs one-shot",
                     ATOL.get(case.name, 1e-4))
        assert toks == case.tokens[i], f"{case.name} {what}, prompt {i}: greedy tokens differ from transformers"


# -- one forward, no runtime -------------------------------------------------------------------------------

@torch.no_grad()
def test_ragged_prefill_matches_one_shot(case, ops):
    """All prompts packed in one flattened step (no state pool: whole prompts from zero state)."""
    got = run_step(case.model, [(p, 0) for p in case.prompts], {})  # [T, V]
    for i, (p, rows) in enumerate(zip(case.prompts, got.split([len(p) for p in case.prompts]))):
        want = case.ref(torch.tensor([p])).logits[0]
        assert_close(rows, want, f"{case.name} prompt {i}")


# -- through the runtime -----------------------------------------------------------------------------------

def test_alone_and_ragged_batch(case, ops):
    for i in range(len(case.prompts)):
        tokens, logits, _ = generate(case, [i])
        check(case, tokens, logits, "alone")
    for caching in (False, True):  # with caching, chunks also stop at block boundaries (for the snapshots)
        tokens, logits, _ = generate(case, enable_prefix_caching=caching)
        check(case, tokens, logits, f"ragged batch, prefix caching {caching}")


@pytest.mark.parametrize("budget", [CHUNK - 1, CHUNK, CHUNK + 1, CONV - 2, 1])
def test_chunked_prefill(case, ops, budget):
    """A per-step token budget cuts the prompts into chunks of `budget` tokens: boundaries at chunk_size - 1,
    chunk_size, chunk_size + 1, chunks shorter than the conv window, one-token chunks."""
    tokens, logits, engine = generate(case, [0, 1], max_num_batched_tokens=budget)
    assert engine.num_steps > STEPS + len(case.prompts[0]) // budget
    check(case, tokens, logits, f"chunks of {budget}")


def test_freed_slots_hold_nan(case, ops):
    """Two state slots for four requests: every slot is reused, and every free slot is filled with NaN
    after every step (and at the start): no output may change."""
    def poison(engine):
        for tensors in engine.runner.ssm_states.values():
            for t in tensors:
                t[engine.kv.state_slots.free_slots()] = float("nan")

    tokens, logits, engine = generate(case, num_state_slots=2, max_num_batched_tokens=16, after_step=poison)
    assert len(tokens) == 4 and engine.kv.state_slots.num_free == 2
    check(case, tokens, logits, "2 slots, NaN in free slots")


def test_preemption_by_recompute(case, ops):
    """A KV pool too small for all four requests at once: requests are preempted, freed and recomputed."""
    tokens, logits, engine = generate(case, num_blocks=14, block_size=8)
    assert engine.scheduler.num_preemptions > 0 and engine.kv.state_slots.num_free == engine.kv.state_slots.num_slots
    for i, toks in tokens.items():
        assert toks == case.tokens[i], f"{case.name} prompt {i}: tokens after preemption differ"


def test_state_spec_and_pool_bytes(case):
    engine = LLMEngine(case.model, case.config, None, num_state_slots=3)
    spec = engine.state_specs[case.mixer]
    shapes = dict((name, shape) for name, shape, _ in spec.tensors)
    assert shapes["conv"][0] == CONV - 1  # vLLM's K - 1 columns, not transformers' K
    assert engine.state_bytes_per_request == sum(s.bytes_per_request() for s in engine.state_specs.values())
    for tensors in engine.runner.ssm_states.values():
        assert all(t.shape[0] == 3 for t in tensors)


def test_prefix_hit_restores_a_boundary_snapshot(case, ops):
    """With prefix caching, the same prompt again starts from the snapshot at its last block boundary (28 of 29
    tokens); a prompt extended by 12 generated tokens starts from the snapshot decode took at 40. Both give
    the cold run's logits and tokens."""
    engine = LLMEngine(case.model, case.config, None, block_size=4)
    logits: dict[str, list[torch.Tensor]] = {}
    engine.runner.logits_hook = lambda reqs, rows: [logits.setdefault(r.request_id, []).append(x.clone())
                                                   for r, x in zip(reqs, rows)]
    prompt, cold = case.prompts[0], case.tokens[0]
    runs = [("cold", prompt, STEPS, 0), ("again", prompt, STEPS, 28), ("extended", prompt + cold[:12], STEPS - 12, 40)]
    for rid, tokens, max_tokens, hit in runs:
        engine.add_request(tokens, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), request_id=rid)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        assert outs[0].num_cached_tokens == hit, f"{case.name} {rid}: hit {outs[0].num_cached_tokens}, not {hit}"
        assert outs[0].token_ids == cold[STEPS - max_tokens:], f"{case.name} {rid}: tokens differ from the cold run"
        assert_close(torch.stack(logits[rid]), case.logits[0][STEPS - max_tokens:], f"{case.name} {rid}: logits",
                     ATOL.get(case.name, 1e-4))


# -- the loader --------------------------------------------------------------------------------------------

def _edit(case: Case, tmp_path, change):
    import shutil

    path = shutil.copytree(case.path, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("param", ["A_log", "D", "dt_bias", "conv1d.weight"])
def test_missing_ssm_parameter_is_named(case, tmp_path, param):
    key = f"{case.mixer}.{param}"
    if param == "dt_bias" and case.name == "jamba":
        key = f"{case.mixer}.dt_proj.bias"
    path = _edit(case, tmp_path, lambda t: t.pop(key))
    with pytest.raises(LoadError) as e:
        build_model(path)
    assert key in str(e.value), str(e.value)


def test_every_tensor_is_accounted(case):
    _, _, _, report = build_model(case.path)
    assert report.tensors == len(load_file(case.path / "model.safetensors"))


def test_zoo_run_and_inspect(case, tmp_path, capsys):
    """`zoo run DIR` generates on the tiny hybrid (with a word-level tokenizer added); `zoo inspect` prints the
    recurrent state pool's bytes per request beside the KV pool's bytes per token."""
    import shutil

    from test_cli_run import save_word_tokenizer
    from zoo.cli import main

    path = save_word_tokenizer(shutil.copytree(case.path, tmp_path / "m"))
    assert main(["run", str(path), "--prompt", "w1 w2 w3", "--max-tokens", "3", "--no-chat"]) == 0
    assert "3 tokens" in capsys.readouterr().err
    assert main(["inspect", str(path)]) == 0
    engine = LLMEngine(case.model, case.config, None)
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("cache"))
    assert f"recurrent state pool {engine.state_bytes_per_request:,} bytes per request" in line, line
    assert f"KV pool {engine.kv_bytes_per_token:,} bytes per token" in line, line


def test_mamba2_old_embedding_name(tmp_path, tmp_path_factory):
    """Older Mamba2 conversions spell the embedding `backbone.embedding.weight`: it loads the same."""
    case = get_case("mamba2", tmp_path_factory)
    path = _edit(case, tmp_path, lambda t: t.__setitem__("backbone.embedding.weight", t.pop("backbone.embeddings.weight")))
    model, *_ = build_model(path)
    assert torch.equal(model.backbone.embeddings.weight, case.model.backbone.embeddings.weight)


@pytest.mark.parametrize("period,offset,e_period,e_offset", [(2, 1, 2, 0), (3, 0, 4, 3), (8, 4, 2, 1), (1, 0, 1, 0)])
def test_jamba_layer_pattern(period, offset, e_period, e_offset):
    """Attention / Mamba and MoE / dense per layer as transformers' layers_block_type and layers_num_experts."""
    import transformers

    from plugins.jamba import JambaForCausalLM

    config = transformers.JambaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=9,
                                      attn_layer_period=period, attn_layer_offset=offset,
                                      expert_layer_period=e_period, expert_layer_offset=e_offset, num_experts=4)
    with torch.device("meta"):
        model = JambaForCausalLM(config)
    for i, layer in enumerate(model.model.layers):
        assert hasattr(layer, "self_attn") == (config.layers_block_type[i] == "attention") != hasattr(layer, "mamba")
        assert hasattr(layer.feed_forward, "experts") == (config.layers_num_experts[i] > 1), f"layer {i}"


def test_bamba_rotates_half_of_each_head(tmp_path_factory):
    case = get_case("bamba", tmp_path_factory)
    rope = case.model.model.layers[1].self_attn.rotary_emb
    head_dim = case.config.hidden_size // case.config.num_attention_heads
    assert rope.rotary_dim == head_dim // 2


# -- `zoo parity --tiny` on the published config.json of each family (hub values, written here: no download) ------

REAL_CONFIGS = {
    "Mamba2ForCausalLM": dict(  # mistralai/Mamba-Codestral-7B-v0.1 (its extra norm_before_gate / rms_norm included)
        model_type="mamba2", bos_token_id=0, chunk_size=256, conv_kernel=4, eos_token_id=0, expand=2, head_dim=64,
        hidden_act="silu", hidden_size=4096, initializer_range=0.1, layer_norm_epsilon=1e-05, n_groups=8,
        norm_before_gate=True, num_heads=128, num_hidden_layers=64, pad_token_id=0, rescale_prenorm_residual=False,
        residual_in_fp32=True, rms_norm=True, state_size=128, tie_word_embeddings=False, time_step_floor=0.0001,
        time_step_max=0.1, time_step_min=0.001, time_step_rank=256, use_bias=False, use_cache=True,
        use_conv_bias=True, vocab_size=32768),
    "BambaForCausalLM": dict(  # ibm-ai-platform/Bamba-9B
        model_type="bamba", attention_dropout=0.0, attn_layer_indices=[9, 18, 27], bos_token_id=0, eos_token_id=0,
        hidden_act="silu", hidden_size=4096, initializer_range=0.02, intermediate_size=14336, mamba_chunk_size=256,
        mamba_conv_bias=True, mamba_d_conv=4, mamba_d_head=64, mamba_d_state=128, mamba_expand=2, mamba_n_groups=1,
        mamba_n_heads=128, mamba_proj_bias=False, max_position_embeddings=262144, num_attention_heads=32,
        num_hidden_layers=32, num_key_value_heads=8, num_logits_to_keep=1, pad_token_id=0, rms_norm_eps=1e-05,
        rope_theta=10000.0, tie_word_embeddings=False, use_cache=True, vocab_size=128256),
    "JambaForCausalLM": dict(  # ai21labs/Jamba-v0.1
        model_type="jamba", attention_dropout=0.0, attn_layer_offset=4, attn_layer_period=8, bos_token_id=1,
        eos_token_id=2, expert_layer_offset=1, expert_layer_period=2, hidden_act="silu", hidden_size=4096,
        initializer_range=0.02, intermediate_size=14336, mamba_conv_bias=True, mamba_d_conv=4, mamba_d_state=16,
        mamba_dt_rank=256, mamba_expand=2, mamba_proj_bias=False, max_position_embeddings=262144,
        num_attention_heads=32, num_experts=16, num_experts_per_tok=2, num_hidden_layers=32, num_key_value_heads=8,
        num_logits_to_keep=1, output_router_logits=False, pad_token_id=0, rms_norm_eps=1e-06,
        router_aux_loss_coef=0.001, tie_word_embeddings=False, use_cache=True, use_mamba_kernels=True,
        vocab_size=65536),
}


@pytest.mark.parametrize("arch", sorted(REAL_CONFIGS))
def test_parity_tiny_from_the_real_config(arch, tmp_path):
    import json

    from parity.harness import run_parity
    from parity.tiny import save_tiny_checkpoint

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text(json.dumps({"architectures": [arch], **REAL_CONFIGS[arch]}))
    path = save_tiny_checkpoint(tmp_path / "full", tmp_path / "tiny")
    config = json.loads((path / "config.json").read_text())
    if arch == "BambaForCausalLM":  # layer 0 (Mamba) and layer 9 (attention) kept
        assert config["num_hidden_layers"] == 2 and config["attn_layer_indices"] == [1]
    if arch == "JambaForCausalLM":  # one whole period: attention at 4, MoE on odd layers
        assert config["num_hidden_layers"] == 8 and config["attn_layer_offset"] == 4
    result = run_parity(path)
    assert result.passed, {n: (s.failures, s.first_divergence) for n, s in result.scenarios.items()}


# -- parity taps localise a planted bug inside the mixer ------------------------------------------------------------

def _planted_mixer_bug(arch: str, bug: str):
    """A plugin serving `arch` (override=True) whose recurrent mixers carry `bug`: "no_D" drops the D skip of the
    Mamba2 scan, "conv_no_bias" drops the conv bias of Jamba's Mamba1 mixer."""
    import plugins.jamba as jamba
    import plugins.mamba2 as mamba2
    from registry import ArchSpec, hookimpl
    from zoo.layers.mamba import Mamba2Mixer, MambaMixer

    if bug == "no_D":
        class Mixer(Mamba2Mixer):
            def forward(self, hidden_states, batch):
                with torch.no_grad():
                    saved = self.D.detach().clone()
                    self.D.zero_()
                try:
                    return super().forward(hidden_states, batch)
                finally:
                    with torch.no_grad():
                        self.D.copy_(saved)

        class LM(mamba2.Mamba2ForCausalLM):
            def __init__(self, config, *, prefix=""):
                super().__init__(config, prefix=prefix)
                for layer in self.backbone.layers:
                    layer.mixer.__class__ = Mixer
        rules = mamba2.MAMBA2_RULES
    else:
        class Mixer(MambaMixer):
            def conv(self, x, segments, conv_state):
                bias, self.conv1d.bias = self.conv1d.bias, None
                try:
                    return super().conv(x, segments, conv_state)
                finally:
                    self.conv1d.bias = bias

        class LM(jamba.JambaForCausalLM):
            def __init__(self, config, *, prefix=""):
                super().__init__(config, prefix=prefix)
                for layer in self.model.layers:
                    if hasattr(layer, "mamba"):
                        layer.mamba.__class__ = Mixer
        rules = jamba.JAMBA_RULES

    class Plugin:
        @hookimpl
        def register_architectures(self, register):
            register(ArchSpec((arch,), "builtins:object", "hybrid-ssm", rules=rules, override=True))

    return Plugin(), LM


@pytest.mark.parametrize("arch,bug,tap", [("Mamba2ForCausalLM", "no_D", "backbone.layers.0.mixer.norm"),
                                          ("JambaForCausalLM", "conv_no_bias", "model.layers.0.mamba.x_proj")])
def test_planted_mixer_bug_is_localised(arch, bug, tap, tmp_path):
    from parity.harness import run_parity
    from registry import get_registry
    from tiny_configs import save_arch

    path = save_arch(arch, tmp_path)
    plugin, lm = _planted_mixer_bug(arch, bug)
    reg = get_registry()
    reg.register_plugin(plugin, name=f"mutant-{bug}")
    try:
        spec = reg.get(arch)
        object.__setattr__(spec, "model", f"{__name__}:_MUTANT")  # the spec imports the class by name
        globals()["_MUTANT"] = lm
        result = run_parity(path, scenarios=("prefill",))
    finally:
        reg.unregister_plugin(f"mutant-{bug}")
    s = result.scenarios["prefill"]
    assert not s.passed
    assert s.first_divergence["tap"] == tap, s.first_divergence  # the first tap past the bug, in layer 0
    assert s.first_divergence["role"] in ("mixer_norm", "mixer_conv")


def test_parity_prefix_restores_a_snapshot_into_a_slot_of_another_index(tmp_path):
    """The prefix scenario's hit restores state snapshot 0 into state slot 1 (another prompt, added first, holds
    slot 0), so a restore that takes the snapshot at the slot's index instead of the hit's own is caught; with the
    hit's snapshot and slot both 0 (the scenario before) it passed."""
    from mutants import planted_runtime
    from parity.harness import run_parity
    from tiny_configs import save_arch

    path = save_arch("BambaForCausalLM", tmp_path)
    result = run_parity(path, scenarios=("prefix",))
    prefix = result.scenarios["prefix"]
    assert prefix.passed, prefix.failures
    assert prefix.info["state_restores"] == [(0, 1)] and prefix.info["cached_tokens"] > 0, prefix.info
    with planted_runtime("restore_at_the_slot_index"):
        result = run_parity(path, scenarios=("prefix",))
    prefix = result.scenarios["prefix"]
    assert not prefix.passed and prefix.first_divergence["request"] == 2, prefix.first_divergence
    assert prefix.first_divergence["tap"].startswith("model.layers.0.mamba"), prefix.first_divergence
