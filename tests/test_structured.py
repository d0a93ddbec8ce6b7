"""Structured outputs (zoo/runtime/structured.py): a random tiny model whose tokenizer has a token per byte, held
to a JSON schema, any JSON object, a regex, a choice and a grammar; through LLM.generate (greedy, sampled, n,
preempted, the fused step and the module path) and `zoo serve` with the official openai client (response_format
json_schema / json_object, vLLM's guided_* fields, 32 concurrent requests each with its own schema)."""
from __future__ import annotations

import asyncio
import json
import re

import pytest

from byte_tiny import save_byte_model
from zoo import LLM, SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                            "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
PROMPTS = ["Describe a person as JSON:", "hello", "{", "x" * 40]


def schema(k: int) -> dict:
    """The k-th of many different schemas: an enum of k + 2 words, an integer range, an array of booleans."""
    return {"type": "object", "properties": {
        f"field{k}": {"enum": [f"v{k}_{j}" for j in range(k % 5 + 2)]},
        "n": {"type": "integer", "minimum": k, "maximum": k + 10},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}},
        "required": [f"field{k}", "n", "flags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_byte_model(tmp_path_factory.mktemp("bytes"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), max_num_seqs=64)


def valid(text: str, want: dict) -> dict:
    doc = json.loads(text)  # strict: no raw control characters in strings
    jsonschema.validate(doc, want)
    return doc


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_through_generate(llm, temperature):
    params = SamplingParams(max_tokens=120, temperature=temperature, seed=7,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    outs = llm.generate(PROMPTS, params)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        valid(c.text, PERSON)
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=temperature, seed=7))
    assert not any(_parses(o.outputs[0].text) for o in free), "the random model writes JSON unconstrained"


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_every_kind_of_constraint(llm):
    """Each kind, sampled, n = 2; any JSON object's strings and objects are closed early by a logit bias on '"' and
    '}' (a bias applies after the grammar's mask: it moves only what the grammar allows)."""
    tok = llm.tokenizer
    close = {tok.convert_tokens_to_ids('"'): 8.0, tok.convert_tokens_to_ids("}"): 8.0}
    cases = [({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
             ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
             ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
             ({"grammar": 'root ::= "(" [a-c]+ ")"'}, lambda t: re.fullmatch(r"\([a-c]+\)", t))]
    for spec, ok in cases:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=60, temperature=1.0, seed=3, n=2, logit_bias=close,
                                                    structured_outputs=spec))
        for c in (c for o in outs for c in o.outputs):
            assert c.finish_reason == "stop" and ok(c.text), (spec, c.text, c.finish_reason)


def test_json_survives_preemption_and_matches_the_unpreempted_run(model_dir):
    """A KV pool too small for every request at once preempts some (recomputed from prompt + outputs): the
    grammar state stays with the outputs, and each text equals the one an ample pool gives."""
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs={"json": PERSON})
    ample = LLM(str(model_dir)).generate(PROMPTS * 2, params)
    tight = LLM(str(model_dir), num_blocks=12, block_size=8)
    outs = tight.generate(PROMPTS * 2, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ample]
    for o in outs:
        valid(o.outputs[0].text, PERSON)


def test_the_fused_step_and_the_torch_path_agree(model_dir, llm):
    """The fused native step (the default for this Llama) and the plain torch modules (kernels off) give the same
    constrained greedy text."""
    from zoo import kernels

    params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs={"json": PERSON})
    fused = llm.generate(PROMPTS, params)
    assert llm.engine.runner.fused is not None, "the tiny Llama should take the fused step"
    previous = kernels.set_enabled(False)
    try:
        plain = LLM(str(model_dir))
        assert plain.engine.runner.fused is None
        torch_path = plain.generate(PROMPTS, params)
    finally:
        kernels.set_enabled(previous)
    assert [o.outputs[0].text for o in fused] == [o.outputs[0].text for o in torch_path]


def test_bad_specs_are_refused_naming_the_field(llm):
    with pytest.raises(ValueError, match="give exactly one of"):
        SamplingParams(structured_outputs={"json": PERSON, "regex": "a"})
    with pytest.raises(ValueError, match="unknown field 'jsn'"):
        SamplingParams(structured_outputs={"jsn": PERSON})
    with pytest.raises(ValueError, match=r"structured_outputs\.json: the schema is not JSON"):
        SamplingParams(structured_outputs={"json": "{not json"})
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: cannot be compiled"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "(unclosed"}))
    assert not llm.engine.has_unfinished_requests()


# -- zoo serve -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model_dir):
    from test_serve import serving

    with serving(model_dir) as url:
        yield url


@pytest.fixture
def client(server):
    import openai

    from test_serve import KEY
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_serve_response_format_json_schema(client, llm, temperature):
    from test_serve import NAME

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a person"}],
                                       response_format=fmt, max_tokens=120, temperature=temperature, seed=5)
    valid(r.choices[0].message.content, PERSON)
    assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=NAME, prompt="{", max_tokens=120, temperature=temperature,
                                  extra_body={"guided_json": PERSON})
    valid(r.choices[0].text, PERSON)
    close = {str(llm.tokenizer.convert_tokens_to_ids(c)): 8.0 for c in '"}'}  # (strings and objects close early)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "json"}], max_tokens=120,
                                       response_format={"type": "json_object"}, temperature=temperature, seed=5,
                                       logit_bias=close)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "pick"}], max_tokens=20,
                                       extra_body={"guided_choice": ["red", "green"]}, temperature=temperature)
    assert r.choices[0].message.content in ("red", "green")


def test_serve_streams_structured_output(client):
    from test_serve import NAME

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chunks = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a"}], stream=True,
                                            response_format=fmt, max_tokens=120, temperature=1.0, seed=1)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    valid(text, PERSON)


def test_serve_32_concurrent_structured_requests_each_valid(server):
    import openai

    from test_serve import KEY, NAME

    async def one(aclient, k):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": schema(k)}}
        r = await aclient.chat.completions.create(model=NAME, messages=[{"role": "user", "content": f"item {k}"}],
                                                  response_format=fmt, max_tokens=150, temperature=1.0, seed=k)
        return k, r.choices[0].message.content

    async def main():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, k) for k in range(32)))

    for k, text in asyncio.run(main()):
        doc = valid(text, schema(k))
        assert f"field{k}" in doc


def test_serve_refuses_bad_structured_requests(client):
    import openai

    from test_serve import NAME

    msgs = [{"role": "user", "content": "x"}]
    cases = [(dict(response_format={"type": "xml"}), "response_format"),
             (dict(response_format={"type": "json_schema", "json_schema": {"name": "a"}}), "response_format"),
             (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
             (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}), "guided_regex"),
             (dict(extra_body={"structured_outputs": {"jsn": {}}}), "structured_outputs")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, **kwargs)
        assert e.value.body["param"] == param, (kwargs, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "wizard", "content": "x"}], max_tokens=4)
    assert "messages[0].role='wizard'" in e.value.body["message"]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"


def test_zoo_run_json_schema(model_dir, tmp_path, capsys):
    from zoo.cli import main

    (tmp_path / "person.json").write_text(json.dumps(PERSON))
    assert main(["run", str(model_dir), "--prompt", "a person", "--no-chat", "--max-tokens", "120",
                 "--json-schema", str(tmp_path / "person.json")]) == 0
    valid(capsys.readouterr().out.strip(), PERSON)
    (tmp_path / "bad.json").write_text('{"type": "objet"}')
    assert main(["run", str(model_dir), "--prompt", "x", "--json-schema", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert f"--json-schema {tmp_path / 'bad.json'}: cannot be compiled: Unsupported type" in err, err
    assert "loading weights" not in err, err  # refused before any weight is read
    assert main(["run", str(model_dir), "--prompt", "x", "--json-schema", str(tmp_path / "none.json")]) == 2
    assert "none.json: No such file or directory" in capsys.readouterr().err


def test_serve_tokenize_detokenize_version(server, llm):
    """vLLM's /tokenize (a prompt, or a chat through the template), /detokenize and /version."""
    import urllib.request

    from test_serve import KEY

    def post(route, body):
        req = urllib.request.Request(server + route, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, got = post("/tokenize", {"prompt": "hi {x}"})
    assert status == 200 and got["tokens"] == llm.tokenizer.encode("hi {x}") and got["count"] == len(got["tokens"])
    status, chat = post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and llm.tokenizer.decode(chat["tokens"]) == "<|user|>hi\n<|assistant|>", chat
    assert post("/detokenize", {"tokens": got["tokens"]}) == (200, {"prompt": "hi {x}"})
    status, err = post("/detokenize", {"tokens": [5, 100000]})
    assert status == 400 and err["error"]["param"] == "tokens" and "100000" in err["error"]["message"]
    with urllib.request.urlopen(server + "/version", timeout=10) as r:
        assert json.loads(r.read())["version"]

