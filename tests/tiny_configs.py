"""One tiny parity configuration per registered architecture: what each exercises beyond Llama.

    path = save_arch("MistralForCausalLM", tmp_path)      # built by transformers, saved, every constant randomised

An entry is either overrides of tests/tiny.py's BASE (a dict: save_tiny builds the architecture's own
transformers class from it) or a function `(path) -> checkpoint dir` for a model BASE cannot describe (a
vision tower, an SSM block): it must build with transformers, randomise the constants
(parity.tiny.randomize_constants) and save_pretrained under `path`.
tests/test_parity_registry.py fails for a registered architecture without an entry here: adding an
architecture means adding one line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from multimodal_tiny import save_tiny_llava, save_tiny_qwen2_vl
from tiny import save_tiny

WIDE = dict(initializer_range=0.2)  # weights large enough that attention is far from uniform
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
MLA = dict(first_k_dense_replace=1, n_routed_experts=8, n_group=4, moe_intermediate_size=32, kv_lora_rank=16,
           qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, num_key_value_heads=4, q_lora_rank=24)

TINY_CONFIGS: dict[str, dict | Callable[[Path], Path]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": dict(sliding_window=8),
    "Qwen2ForCausalLM": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(head_dim=32),
    "Gemma3ForCausalLM": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, final_logit_softcapping=3.0,
                              layer_types=["sliding_attention", "full_attention"]),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "Qwen2MoeForCausalLM": dict(num_experts=4, shared_expert_intermediate_size=48, decoder_sparse_step=2, **MOE),
    "Qwen3MoeForCausalLM": dict(num_experts=4, norm_topk_prob=True, **MOE),
    "OlmoeForCausalLM": dict(num_experts=4, **MOE),
    "DeepseekV2ForCausalLM": dict(topk_method="group_limited_greedy", topk_group=1, num_experts_per_tok=2, **MLA),
    "DeepseekV3ForCausalLM": dict(topk_group=2, num_experts_per_tok=3, norm_topk_prob=True, **MLA),
    "LlavaForConditionalGeneration": save_tiny_llava,  # Llama text, CLIP features from layer -2
    "Qwen2VLForConditionalGeneration": save_tiny_qwen2_vl,  # M-RoPE text (text-only prompts here)
    # hybrid SSM: scan chunks of 8, so the default prompts span several chunks and the chunked scenario's
    # boundaries fall inside them
    "Mamba2ForCausalLM": dict(num_heads=8, head_dim=16, state_size=16, n_groups=2, chunk_size=8, expand=2),
    "BambaForCausalLM": dict(num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16,
                             mamba_n_groups=2, mamba_chunk_size=8),  # rotary on half of each head
    "JambaForCausalLM": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                             expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=8),
    # issue 16's architectures (tests/test_architectures.py: greedy equality, --tiny on their real configs)
    "GemmaForCausalLM": dict(head_dim=16, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
    "Gemma2ForCausalLM": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=5, attn_logit_softcapping=2.0,
                              final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"]),
    # longrope past its trained length depends on the schedule (transformers switches a whole padded batch, and
    # a whole prompt, at once): the parity prompts stay under it; test_longrope_past_the_trained_length crosses it
    "Phi3ForCausalLM": dict(sliding_window=6, partial_rotary_factor=0.5, original_max_position_embeddings=64,
                            rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                 short_factor=[1.0, 1.1, 1.3, 1.6], long_factor=[1.5, 2.0, 3.0, 4.5])),
    "Olmo2ForCausalLM": dict(),
    "GraniteForCausalLM": dict(embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.2,
                               logits_scaling=4.0),
    "SmolLM3ForCausalLM": dict(num_hidden_layers=3, no_rope_layers=[1, 0, 1], use_sliding_window=False),
    "Starcoder2ForCausalLM": dict(sliding_window=6, norm_epsilon=1e-5, use_bias=True,
                                  hidden_act="gelu_pytorch_tanh"),
    "StableLmForCausalLM": dict(partial_rotary_factor=0.25, qk_layernorm=True, use_qkv_bias=True),
    "CohereForCausalLM": dict(use_qk_norm=True, logit_scale=0.5, attention_bias=True, tie_word_embeddings=True),
    "GraniteMoeForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=6.0,
                                  residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=4.0),
    "GptOssForCausalLM": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                              layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.5,
                              rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                                   original_max_position_embeddings=64, beta_fast=32.0,
                                                   beta_slow=1.0, truncate=False)),
    "GPT2LMHeadModel": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=96, tie_word_embeddings=True,
                            scale_attn_by_inverse_layer_idx=True, activation_function="gelu_new"),
    "GPTNeoXForCausalLM": dict(rotary_pct=0.5, hidden_act="gelu", layer_norm_eps=1e-5),
    "PhiForCausalLM": dict(num_key_value_heads=4, partial_rotary_factor=0.5, qk_layernorm=True,
                           hidden_act="gelu_new"),
}


def save_arch(architecture: str, path: str | Path, *, seed: int = 0, randomize: bool = True) -> Path:
    """The tiny checkpoint of `architecture` from its TINY_CONFIGS entry, saved under `path`."""
    entry = TINY_CONFIGS[architecture]
    if callable(entry):
        return Path(entry(Path(path)))
    return save_tiny(architecture, path, seed=seed, randomize=randomize, **{**WIDE, **entry})
