"""The real Gemma3-270M GGUF (Q4_K_M; tests/real_gguf.py assembles it from its PyPI packages), dequantised
to float32 (it holds Q5_0 tensors, which have no quantized kernels: `zoo run` dequantises it and says
so): its config names no architecture (model_type gemma3_text) and resolves through model_type; its
tensors carry Gemma3's GGUF names (post_attention_norm, ffn_norm as the MLP's pre-norm, post_ffw_norm,
attn_q_norm / attn_k_norm) and its (1 + w) norms stored as w + 1. zoo's greedy answer (the fused native
step, as `zoo run` takes it) equals transformers' generate from the same file, token for token, with the
logits of every step close.

transformers is handed the config it converted from this file itself (zoo's GGUF start cache holds the
config.json transformers wrote; reading it back skips a second ~30 s parse of the 262k-token vocabulary)."""
import pytest
import torch

from real_gguf import gemma3_270m, missing_reason

pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]
PROMPT = "Question: What is the capital of France?\nAnswer:"
NEW_TOKENS = 6


def test_greedy_answer_equals_transformers_from_the_same_file():
    from transformers import AutoConfig, AutoModelForCausalLM

    from zoo import LLM, SamplingParams
    from zoo.runtime import model_files as mf

    path = gemma3_270m()
    said = []
    llm = LLM(str(path), quantization="auto", progress=said.append)  # as `zoo run` opens it
    # (its Q5_0 tensors have no quantized kernels: the file is dequantised, and zoo says so)
    assert llm.quantization is None and any("Q5_0" in s and "dequantized" in s for s in said), said
    assert type(llm.model).__name__ == "Gemma3ForCausalLM"  # found through model_type
    ids = llm.get_tokenizer()(PROMPT)["input_ids"]
    logits = []
    llm.engine.runner.logits_hook = lambda reqs, rows: logits.append(rows[0].clone())
    (out,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    del llm
    assert out.text.strip().startswith("Paris"), out.text

    entry, manifest = mf._gguf_cache(mf.resolve_model(path))
    assert "architectures" not in manifest["config"] or not manifest["config"]["architectures"]
    config = AutoConfig.from_pretrained(entry)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                               dtype=torch.float32).eval()
    with torch.no_grad():
        g = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert out.token_ids == g.sequences[0, len(ids):].tolist()
    torch.testing.assert_close(torch.stack(logits), torch.cat(g.logits), rtol=1e-3, atol=2e-3)
