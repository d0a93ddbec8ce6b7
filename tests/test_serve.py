"""`zoo serve`: a real server process on 127.0.0.1 (a free port), driven by the official `openai` client.

Completions and chat, streamed and not, give LLM.generate's greedy text; 64 concurrent streaming clients each
get every token; a client that disconnects has its request aborted and its KV blocks freed (seen on /metrics);
a bad request is a 400 naming the field, a missing API key a 401, and the server keeps serving after both.
"""
import asyncio
import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from test_cli_run import save_chat_model, words  # noqa: E402 - a word-level tokenizer and a chat template
from zoo import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key"
NAME = "tiny-chat"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("serve"), max_position_embeddings=256, initializer_range=0.2)


@contextlib.contextmanager
def serving(model_dir, *args):
    """The base URL of a `zoo serve` process on `model_dir` (port 0: the kernel picks a free one, the server prints
    it), stopped after the block; `args`: more flags."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "zoo.cli", "serve", str(model_dir), "--host", "127.0.0.1",
                             "--port", "0", "--api-key", KEY, "--served-model-name", NAME, "--max-num-seqs", "64",
                             *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url, deadline, seen = None, time.monotonic() + 120, []
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, f"zoo serve did not start:\n{''.join(seen)}"
        for _ in range(100):  # bounded: 10 s
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(model_dir) as url:
        yield url


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), max_num_seqs=64)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=30)


def metrics(server) -> dict[str, float]:
    text = urllib.request.urlopen(server + "/metrics", timeout=5).read().decode()
    return {k: float(v) for k, v in re.findall(r"^(zoo_\S+) (\S+)$", text, re.M)}


GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


def test_completions_and_chat_streamed_or_not_equal_llm_generate(client, offline):
    prompt = words(6)
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    got = client.completions.create(model=NAME, prompt=prompt, **GREEDY)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=NAME, prompt=prompt, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == want.text

    messages = [{"role": "user", "content": words(4, 10)}]
    ids = offline.apply_chat_template(messages)
    want = offline.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    got = client.chat.completions.create(model=NAME, messages=messages, **GREEDY)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8  # the usage chunk comes last
    assert [m.id for m in client.models.list().data] == [NAME]


def test_logit_bias_and_vllm_fields(client):
    got = client.completions.create(model=NAME, prompt=words(3), logit_bias={"20": 100}, **GREEDY)
    assert got.choices[0].text.split() == ["w12"] * 8  # token 20 is "w12"
    got = client.completions.create(model=NAME, prompt=words(3), temperature=1.0, seed=1, max_tokens=10,
                                    extra_body={"allowed_token_ids": [30, 31], "ignore_eos": True})
    assert set(got.choices[0].text.split()) <= {"w22", "w23"}
    got = client.completions.create(model=NAME, prompt=words(3), n=3, temperature=1.0, seed=1, max_tokens=4)
    assert sorted(c.index for c in got.choices) == [0, 1, 2]


def test_prompt_logprobs_bad_words_and_echo(client, offline):
    """vLLM's extras over HTTP: prompt_logprobs (per prompt token, the first None) equal LLM.generate's; bad_words
    bans a word; completions' echo puts the prompt's text and, with logprobs, its tokens' logprobs first."""
    prompt = words(5, 30)
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2,
                                                     logprobs=1))[0]
    got = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=4, logprobs=1,
                                    extra_body={"ignore_eos": True, "prompt_logprobs": 2})
    plp = got.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(want.prompt_token_ids)
    for d, w in zip(plp[1:], want.prompt_logprobs[1:]):
        assert {int(t): v["logprob"] for t, v in d.items()} == pytest.approx(w)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}], temperature=0,
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 5
    first = want.text.split()[0]
    banned = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=4,
                                       extra_body={"ignore_eos": True, "bad_words": [first]})
    assert first not in banned.choices[0].text.split()
    echoed = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=4, logprobs=1, echo=True,
                                       extra_body={"ignore_eos": True})
    c = echoed.choices[0]
    assert c.text == prompt + want.text and c.model_extra.get("prompt_logprobs") is None
    n_prompt = len(want.prompt_token_ids)
    assert len(c.logprobs.tokens) == n_prompt + 4 and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:n_prompt] == pytest.approx([w[t] for w, t in zip(
        want.prompt_logprobs[1:], want.prompt_token_ids[1:])])
    assert c.logprobs.token_logprobs[n_prompt:] == pytest.approx([w[t] for w, t in zip(want.logprobs, want.token_ids)])
    chunks = list(client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=4, echo=True,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == prompt + want.text
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                       extra_body={"echo": True})


def test_64_concurrent_streams_get_every_token_and_the_offline_greedy_text(server, offline):
    prompts = [words(3 + i % 7, 5 * i) for i in range(64)]
    want = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=NAME, prompt=prompt, stream=True, temperature=0,
                                                  max_tokens=12, stream_options={"include_usage": True},
                                                  logprobs=0, extra_body={"ignore_eos": True})
        text, tokens, usage = "", [], None
        async for c in stream:
            if c.choices:
                text += c.choices[0].text
                tokens += c.choices[0].logprobs.tokens if c.choices[0].logprobs else []
            usage = c.usage or usage
        return text, tokens, usage

    async def all_of():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    got = asyncio.run(all_of())
    tokenizer = offline.get_tokenizer() if hasattr(offline, "get_tokenizer") else offline.tokenizer
    for (text, tokens, usage), w in zip(got, want):
        assert text == w.text
        assert usage.completion_tokens == len(w.token_ids) == 12
        assert tokens == [tokenizer.decode([t]) for t in w.token_ids]  # every token, each once, in order
    m = metrics(server)
    assert m["zoo_time_to_first_token_seconds_count"] >= 64 and m["zoo_inter_token_latency_seconds_count"] >= 64 * 11
    assert m["zoo_kv_cache_blocks_used"] == 0 and m["zoo_num_requests_running"] == 0


def test_a_client_that_disconnects_frees_its_blocks(client, server):
    aborted = metrics(server).get('zoo_request_finished_total{finished_reason="abort"}', 0)
    stream = client.completions.create(model=NAME, prompt=words(5), stream=True, max_tokens=240,
                                       extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it)
    assert metrics(server)["zoo_kv_cache_blocks_used"] > 0  # it is running (240 tokens take a while)
    stream.close()
    for _ in range(100):  # bounded: 10 s
        m = metrics(server)
        if m["zoo_kv_cache_blocks_used"] == 0 and m["zoo_num_requests_running"] == 0:
            break
        time.sleep(0.1)
    assert m["zoo_kv_cache_blocks_used"] == 0 and m["zoo_num_requests_running"] == 0
    assert m['zoo_request_finished_total{finished_reason="abort"}'] == aborted + 1


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"),
    (dict(extra_body={"stop_token_ids": [10 ** 6]}), "stop_token_ids"),
    (dict(logit_bias={"5": "much"}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(extra_body={"echo": "yes"}), "echo"),
    (dict(extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),
    (dict(extra_body={"bad_words": [""]}), "bad_words"),
    (dict(extra_body={"allowed_token_ids": [10 ** 6]}), "allowed_token_ids"),
])
def test_a_bad_request_is_a_400_naming_the_field(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=words(3), **kwargs)
    assert e.value.status_code == 400 and field in e.value.message
    assert e.value.body["param"] == field


def test_bad_chat_requests_and_a_bad_key(client, server):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[])
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    with pytest.raises(openai.BadRequestError, match="prompt"):  # a token id outside the vocabulary
        client.completions.create(model=NAME, prompt=[1, 2, 10 ** 6])
    with pytest.raises(openai.NotFoundError, match="model"):
        client.completions.create(model="nope", prompt=words(3))
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    req = urllib.request.Request(server + "/v1/completions", data=b"{not json", method="POST",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 400
    still = client.completions.create(model=NAME, prompt=words(3), max_tokens=2, extra_body={"ignore_eos": True})
    assert still.usage.completion_tokens == 2  # the server still answers (ignore_eos: a sampled EOS must not end it)
