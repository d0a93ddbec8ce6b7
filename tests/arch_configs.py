"""The published config.json of a real checkpoint of each architecture of issue 16 (the fields that matter,
as published), for `zoo parity --tiny` in tests/test_architectures.py; their tiny configs are in
tests/tiny_configs.py. MULTIMODAL_CONFIGS: the multimodal architectures' (issue 15) config.json and
preprocessor_config.json as published, for tests/test_multimodal_parity.py."""
from __future__ import annotations

# Phi-3-mini-128k-instruct's rope_scaling has 48 short and 48 long factors (head_dim 96); these keep the file's
# lengths and its rising shape (short ~1 -> ~2, long ~1 -> ~65), not its exact digits
PHI3_SHORT = [round(1.0 + 0.02 * i ** 1.2, 4) for i in range(48)]
PHI3_LONG = [round(1.0 + 64.0 * (i / 47) ** 3, 4) for i in range(48)]
# architecture -> the published config.json of a real checkpoint of it (the fields that matter, as published)
REAL_CONFIGS = {
    "GemmaForCausalLM": dict(  # google/gemma-2b
        model_type="gemma", head_dim=256, hidden_act="gelu", hidden_size=2048, intermediate_size=16384,
        max_position_embeddings=8192, num_attention_heads=8, num_hidden_layers=18, num_key_value_heads=1,
        rms_norm_eps=1e-06, rope_theta=10000.0, vocab_size=256000, bos_token_id=2, eos_token_id=1, pad_token_id=0),
    "Gemma2ForCausalLM": dict(  # google/gemma-2-2b
        model_type="gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0, head_dim=256,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", hidden_size=2304,
        intermediate_size=9216, max_position_embeddings=8192, num_attention_heads=8, num_hidden_layers=26,
        num_key_value_heads=4, query_pre_attn_scalar=256, rms_norm_eps=1e-06, rope_theta=10000.0,
        sliding_window=4096, vocab_size=256000, bos_token_id=2, eos_token_id=1, pad_token_id=0),
    "Phi3ForCausalLM": dict(  # microsoft/Phi-3-mini-128k-instruct
        model_type="phi3", hidden_act="silu", hidden_size=3072, intermediate_size=8192,
        max_position_embeddings=131072, num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=32,
        original_max_position_embeddings=4096, rms_norm_eps=1e-05, rope_theta=10000.0, sliding_window=262144,
        rope_scaling=dict(type="longrope", short_factor=PHI3_SHORT, long_factor=PHI3_LONG),
        tie_word_embeddings=False, vocab_size=32064, bos_token_id=1, eos_token_id=32000, pad_token_id=32000),
    "Olmo2ForCausalLM": dict(  # allenai/OLMo-2-0425-1B
        model_type="olmo2", hidden_act="silu", hidden_size=2048, intermediate_size=8192, max_position_embeddings=4096,
        num_attention_heads=16, num_hidden_layers=16, num_key_value_heads=16, rms_norm_eps=1e-06, rope_theta=500000,
        tie_word_embeddings=False, vocab_size=100352, eos_token_id=100257, pad_token_id=100277),
    "GraniteForCausalLM": dict(  # ibm-granite/granite-3.0-2b-instruct
        model_type="granite", attention_multiplier=0.015625, embedding_multiplier=12.0, hidden_act="silu",
        hidden_size=2048, intermediate_size=8192, logits_scaling=8.0, max_position_embeddings=4096,
        num_attention_heads=32, num_hidden_layers=40, num_key_value_heads=8, residual_multiplier=0.22,
        rms_norm_eps=1e-05, rope_theta=10000.0, tie_word_embeddings=True, vocab_size=49155, bos_token_id=0,
        eos_token_id=0, pad_token_id=0),
    "SmolLM3ForCausalLM": dict(  # HuggingFaceTB/SmolLM3-3B: every fourth layer NoPE
        model_type="smollm3", hidden_act="silu", hidden_size=2048, intermediate_size=11008,
        max_position_embeddings=65536, num_attention_heads=16, num_hidden_layers=36, num_key_value_heads=4,
        no_rope_layers=[int((i + 1) % 4 != 0) for i in range(36)], rms_norm_eps=1e-06, rope_theta=5000000.0,
        use_sliding_window=False, sliding_window=None, tie_word_embeddings=True, vocab_size=128256,
        eos_token_id=128012, pad_token_id=128004),
    "Starcoder2ForCausalLM": dict(  # bigcode/starcoder2-3b
        model_type="starcoder2", hidden_act="gelu_pytorch_tanh", hidden_size=3072, intermediate_size=12288,
        max_position_embeddings=16384, norm_epsilon=1e-05, num_attention_heads=24, num_hidden_layers=30,
        num_key_value_heads=2, rope_theta=999999.4420358813, sliding_window=4096, use_bias=True, vocab_size=49152,
        bos_token_id=0, eos_token_id=0),
    "StableLmForCausalLM": dict(  # stabilityai/stablelm-2-1_6b
        model_type="stablelm", hidden_act="silu", hidden_size=2048, intermediate_size=5632, layer_norm_eps=1e-05,
        max_position_embeddings=4096, num_attention_heads=32, num_hidden_layers=24, num_key_value_heads=32,
        partial_rotary_factor=0.25, qk_layernorm=False, rope_theta=10000, tie_word_embeddings=False,
        use_parallel_residual=False, use_qkv_bias=True, vocab_size=100352, bos_token_id=100257,
        eos_token_id=100257),
    "CohereForCausalLM": dict(  # CohereForAI/c4ai-command-r-v01
        model_type="cohere", attention_bias=False, hidden_act="silu", hidden_size=8192, intermediate_size=22528,
        layer_norm_eps=1e-05, logit_scale=0.0625, max_position_embeddings=8192, num_attention_heads=64,
        num_hidden_layers=40, num_key_value_heads=64, rope_theta=8000000.0, use_qk_norm=False, vocab_size=256000,
        bos_token_id=5, eos_token_id=255001, pad_token_id=0),
    "PhiForCausalLM": dict(  # microsoft/phi-2
        model_type="phi", hidden_act="gelu_new", hidden_size=2560, intermediate_size=10240, layer_norm_eps=1e-05,
        max_position_embeddings=2048, num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=32,
        partial_rotary_factor=0.4, qk_layernorm=False, rope_theta=10000.0, tie_word_embeddings=False,
        vocab_size=51200, bos_token_id=50256, eos_token_id=50256),
    "GPTNeoXForCausalLM": dict(  # EleutherAI/pythia-70m
        model_type="gpt_neox", hidden_act="gelu", hidden_size=512, intermediate_size=2048, layer_norm_eps=1e-05,
        max_position_embeddings=2048, num_attention_heads=8, num_hidden_layers=6, rotary_emb_base=10000,
        rotary_pct=0.25, tie_word_embeddings=False, use_parallel_residual=True, vocab_size=50304, bos_token_id=0,
        eos_token_id=0),
    "GPT2LMHeadModel": dict(  # openai-community/gpt2
        model_type="gpt2", activation_function="gelu_new", layer_norm_epsilon=1e-05, n_ctx=1024, n_embd=768,
        n_head=12, n_layer=12, n_positions=1024, scale_attn_weights=True, vocab_size=50257, bos_token_id=50256,
        eos_token_id=50256),
    "GraniteMoeForCausalLM": dict(  # ibm-granite/granite-3.0-1b-a400m-instruct
        model_type="granitemoe", attention_multiplier=0.015625, embedding_multiplier=12.0, hidden_act="silu",
        hidden_size=1024, intermediate_size=512, logits_scaling=6.0, max_position_embeddings=4096,
        num_attention_heads=16, num_experts_per_tok=8, num_hidden_layers=24, num_key_value_heads=8,
        num_local_experts=32, residual_multiplier=0.22, rms_norm_eps=1e-06, rope_theta=10000,
        tie_word_embeddings=True, vocab_size=49155, bos_token_id=0, eos_token_id=0, pad_token_id=0),
    "GptOssForCausalLM": dict(  # openai/gpt-oss-20b
        model_type="gpt_oss", attention_bias=True, head_dim=64, hidden_act="silu", hidden_size=2880,
        intermediate_size=2880, layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072, num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=24,
        num_key_value_heads=8, num_local_experts=32, rms_norm_eps=1e-05, rope_theta=150000, sliding_window=128,
        rope_scaling=dict(rope_type="yarn", beta_fast=32.0, beta_slow=1.0, factor=32.0,
                          original_max_position_embeddings=4096, truncate=False),
        swiglu_limit=7.0, tie_word_embeddings=False, vocab_size=201088, eos_token_id=200002, pad_token_id=199999),
}


CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# architecture -> (config.json, preprocessor_config.json) of a real checkpoint, as published
MULTIMODAL_CONFIGS = {
    "LlavaForConditionalGeneration": (  # llava-hf/llava-1.5-7b-hf: Vicuna-7B (Llama) text, CLIP ViT-L/14-336
        dict(architectures=["LlavaForConditionalGeneration"], ignore_index=-100, image_token_index=32000,
             model_type="llava", pad_token_id=32001, projector_hidden_act="gelu", tie_word_embeddings=False,
             torch_dtype="float16", vision_feature_layer=-2, vision_feature_select_strategy="default",
             vocab_size=32064,
             text_config=dict(_name_or_path="lmsys/vicuna-7b-v1.5", architectures=["LlamaForCausalLM"],
                              max_position_embeddings=4096, model_type="llama", rms_norm_eps=1e-05,
                              torch_dtype="float16", vocab_size=32064),
             vision_config=dict(hidden_size=1024, image_size=336, intermediate_size=4096,
                                model_type="clip_vision_model", num_attention_heads=16, num_hidden_layers=24,
                                patch_size=14, projection_dim=768, vocab_size=32000)),
        dict(crop_size=dict(height=336, width=336), do_center_crop=True, do_convert_rgb=True, do_normalize=True,
             do_rescale=True, do_resize=True, image_mean=CLIP_MEAN, image_processor_type="CLIPImageProcessor",
             image_std=CLIP_STD, processor_class="LlavaProcessor", resample=3, rescale_factor=0.00392156862745098,
             size=dict(shortest_edge=336))),
    "Qwen2VLForConditionalGeneration": (  # Qwen/Qwen2-VL-2B-Instruct: the text fields at the top level
        dict(architectures=["Qwen2VLForConditionalGeneration"], attention_dropout=0.0, bos_token_id=151643,
             eos_token_id=151645, vision_start_token_id=151652, vision_end_token_id=151653, vision_token_id=151654,
             image_token_id=151655, video_token_id=151656, hidden_act="silu", hidden_size=1536,
             initializer_range=0.02, intermediate_size=8960, max_position_embeddings=32768, max_window_layers=28,
             model_type="qwen2_vl", num_attention_heads=12, num_hidden_layers=28, num_key_value_heads=2,
             rms_norm_eps=1e-06, rope_theta=1000000.0, sliding_window=32768, tie_word_embeddings=True,
             torch_dtype="bfloat16", use_cache=True, use_sliding_window=False, vocab_size=151936,
             vision_config=dict(depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16, in_chans=3, hidden_size=1536,
                                patch_size=14, spatial_merge_size=2, spatial_patch_size=14, temporal_patch_size=2),
             rope_scaling=dict(type="mrope", mrope_section=[16, 24, 24])),
        dict(min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2, merge_size=2,
             image_mean=CLIP_MEAN, image_std=CLIP_STD, image_processor_type="Qwen2VLImageProcessor",
             processor_class="Qwen2VLProcessor")),
}
