"""The Python API in vLLM's shape: its quick-start snippet runs with only the import (and the model) changed;
RequestOutput.outputs[i] (CompletionOutput), SamplingParams.n, LLM.chat, LLM.get_tokenizer, every prompt form."""
import pytest

from test_cli_run import save_chat_model, words
from zoo import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("vllm_api"), max_position_embeddings=64, initializer_range=0.2)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir))


def test_vllm_quick_start_runs_unchanged(model_dir, capsys):
    quick_start = '''
from vllm import LLM, SamplingParams
prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
llm = LLM(model="facebook/opt-125m")
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
'''
    code = quick_start.replace("from vllm import", "from zoo import").replace("facebook/opt-125m", str(model_dir))
    exec(compile(code, "quick_start", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "Prompt: 'Hello", "Prompt: 'The president of the United States is'", "Prompt: 'The capital of France is'",
        "Prompt: 'The future of AI is'"]
    assert all("Generated text: '" in line for line in lines)


def test_outputs_are_completion_outputs_and_keep_the_old_fields(llm):
    out = llm.generate(words(4), sampling_params=SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                                logprobs=1))[0]
    (c,) = out.outputs
    assert (c.index, c.text, c.token_ids, c.finish_reason) == (0, out.text, out.token_ids, "length")
    assert len(c.token_ids) == 5 and len(c.logprobs) == 5
    assert c.cumulative_logprob == pytest.approx(sum(d[t] for d, t in zip(c.logprobs, c.token_ids)))
    assert c.cumulative_logprob < 0
    assert llm.get_tokenizer() is llm.tokenizer


def test_every_prompt_form_gives_the_same_greedy_tokens(llm):
    text = words(5, 3)
    ids = llm.get_tokenizer().encode(text)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([text, ids, {"prompt": text}, {"prompt_token_ids": ids}], greedy)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt_token_ids for o in outs] == [ids] * 4


def test_n_samples_per_prompt(llm):
    outs = llm.generate([words(3), words(3, 50)], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                                                 ignore_eos=True))
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in outs[0].outputs]
    assert len(set(samples)) == 3  # seed, seed + 1, seed + 2: different samples
    # sample i is the request a seed of seed + i gives alone
    alone = llm.generate(words(3), SamplingParams(temperature=1.0, seed=8, max_tokens=8, ignore_eos=True))[0]
    assert tuple(alone.token_ids) == samples[1]
    with pytest.raises(ValueError, match="SamplingParams.n=0"):
        SamplingParams(n=0)


def test_chat_takes_one_conversation_or_several(llm):
    conv = [{"role": "user", "content": words(3)}]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (one,) = llm.chat(conv, greedy)
    assert one.prompt_token_ids == llm.apply_chat_template(conv)
    two = llm.chat([conv, [{"role": "user", "content": words(2)}]], greedy)
    assert len(two) == 2 and two[0].outputs[0].token_ids == one.outputs[0].token_ids


def test_logit_bias_allowed_token_ids_and_include_stop_str(llm):
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate(words(3), SamplingParams(logit_bias={20: 100.0}, **greedy))
    assert out.token_ids == [20] * 6  # the bias outweighs every logit
    allowed = [30, 31, 32]
    (out,) = llm.generate(words(3), SamplingParams(allowed_token_ids=allowed, temperature=1.0, seed=3,
                                                   max_tokens=20, ignore_eos=True))
    assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 20
    free = llm.generate(words(3), SamplingParams(**greedy))[0].text
    stop = free.split()[2]
    cut, kept = llm.generate([words(3)] * 2, [SamplingParams(stop=[stop], **greedy), SamplingParams(
        stop=[stop], include_stop_str_in_output=True, **greedy)])
    assert cut.text == free[:free.index(stop)] and kept.text == free[:free.index(stop) + len(stop)]
    assert cut.finish_reason == kept.finish_reason == "stop"
    for bad, field in [(dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={5: float("nan")}), "logit_bias"),
                       (dict(allowed_token_ids=[]), "allowed_token_ids"),
                       (dict(include_stop_str_in_output=1), "include_stop_str_in_output")]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="allowed_token_ids.*outside the vocabulary"):
        llm.generate(words(3), SamplingParams(allowed_token_ids=[999]))


def test_a_stop_token_ends_the_text_without_its_own(llm, tmp_path):
    """As vLLM's: a stop token (stop_token_ids, EOS) is the last of token_ids but its text is not in the output
    (include_stop_str_in_output keeps it), with skip_special_tokens=False too (EOS's '</s>' was in the text)."""
    from byte_tiny import save_byte_model

    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    free = llm.generate(words(3), SamplingParams(**greedy))[0]
    i = next(i for i, t in enumerate(free.token_ids) if i and t not in free.token_ids[:i])
    stop = free.token_ids[i]
    cut, kept = llm.generate([words(3)] * 2, [SamplingParams(stop_token_ids=[stop], **greedy), SamplingParams(
        stop_token_ids=[stop], include_stop_str_in_output=True, **greedy)])
    assert cut.token_ids == kept.token_ids == free.token_ids[:i + 1] and cut.stop_reason == stop
    assert free.text.startswith(kept.text) and kept.text.startswith(cut.text)
    assert kept.text[len(cut.text):].strip() == llm.tokenizer.decode([stop])  # the stop token's word, kept only
    byte = LLM(str(save_byte_model(tmp_path)))
    eos = byte.generate("hi", SamplingParams(temperature=0, skip_special_tokens=False, logit_bias={1: 100.0}))[0]
    assert (eos.token_ids, eos.text, eos.finish_reason) == ([1], "", "stop")


# -- prompt_logprobs: against transformers' logits of the prompt ------------------------------------------

def reference_prompt_logprobs(model_dir, ids: list[int]):
    import torch

    from tiny import load_reference

    with torch.no_grad():
        logits = load_reference(model_dir)(torch.tensor([ids])).logits[0].double()  # [L, V]
    return logits.log_softmax(-1)


@pytest.mark.parametrize("path", ["fused", "modules", "chunked"])
def test_prompt_logprobs_match_transformers(model_dir, path):
    """Per prompt token: None for the first, then {that token: its logprob, the 3 most likely tokens'}, equal to
    transformers' log_softmax of the prompt's logits; on the fused step, the module path and a prefill cut in
    chunks of 5; a second run of the same prompt is not served from the prefix cache (it would skip those rows)."""
    llm = LLM(str(model_dir), max_num_batched_tokens=5 if path == "chunked" else 2048)
    if path == "modules":
        llm.engine.runner.fused = None
    ids = llm.get_tokenizer().encode(words(40, 7))  # (two whole blocks of 16 the prefix cache could serve)
    ref = reference_prompt_logprobs(model_dir, ids)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3, logprobs=0)
    first, again = llm.generate([ids], params)[0], llm.generate([ids], params)[0]
    for out in (first, again):
        lp = out.prompt_logprobs
        assert len(lp) == len(ids) and lp[0] is None
        for i in range(1, len(ids)):
            d, row = lp[i], ref[i - 1]
            assert next(iter(d)) == ids[i]  # the prompt's own token first
            top = row.topk(3).indices.tolist()
            assert set(d) == {ids[i], *top}
            for t, v in d.items():
                assert v == pytest.approx(row[t].item(), abs=2e-5)
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # without them, the cache serves it


def test_prompt_logprobs_zero_and_bad_values(llm):
    ids = llm.get_tokenizer().encode(words(4))
    (out,) = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert [None if d is None else list(d) for d in out.prompt_logprobs] == [None] + [[t] for t in ids[1:]]
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs=-1"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs=999: more than the vocabulary"):
        llm.generate([ids], SamplingParams(prompt_logprobs=999))


# -- bad_words -----------------------------------------------------------------------------------------------

def test_bad_words_ban_a_word_and_a_word_pair(llm):
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = words(3, 11)
    free = llm.generate(prompt, SamplingParams(**greedy))[0]
    toks = free.token_ids
    tok = llm.get_tokenizer()
    one = tok.decode([toks[1]])
    (banned,) = llm.generate(prompt, SamplingParams(bad_words=[one], **greedy))
    assert toks[1] not in banned.token_ids  # never drawn, anywhere
    assert banned.token_ids[:1] == toks[:1] and banned.token_ids[1] != toks[1]
    # a two-token word: its second token is banned only right after its first
    pair = tok.decode(toks[2:4])
    (out,) = llm.generate(prompt, SamplingParams(bad_words=[pair], **greedy))
    assert out.token_ids[:3] == toks[:3] and out.token_ids[3] != toks[3]
    assert all(out.token_ids[i:i + 2] != toks[2:4] for i in range(len(out.token_ids) - 1))
    with pytest.raises(ValueError, match="SamplingParams.bad_words="):
        SamplingParams(bad_words=[""])


def test_bad_words_tokenised_with_and_without_a_leading_space():
    """vLLM's rule: the word alone and, when that gives another first token in as many tokens, with a space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from zoo.runtime.engine import bad_words_token_ids

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["hello world, hello there; say hello to the world"] * 20,
                          trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=t)
    bare, spaced = tok.encode("hello", add_special_tokens=False), tok.encode(" hello", add_special_tokens=False)
    assert len(bare) == len(spaced) == 1 and bare != spaced  # "hello" and "Ġhello"
    assert bad_words_token_ids(tok, ["hello", "  hello"], None) == [bare, spaced, bare, spaced]
    with pytest.raises(ValueError, match="outside the vocabulary of 10 tokens"):
        bad_words_token_ids(tok, ["hello"], 10)


def test_llm_keeps_a_gguf_quantized_by_default_as_zoo_run_does():
    """LLM("x.gguf") runs the file's blocks quantized, as zoo run (and vLLM) do; a dtype given dequantizes it."""
    from zoo.default_model import default_model_path

    path = str(default_model_path())
    assert LLM(path, num_blocks=8).quantization == "gguf"
    assert LLM(path, dtype="float32", num_blocks=8).quantization is None
    assert LLM(path, quantization=None, num_blocks=8).quantization is None
