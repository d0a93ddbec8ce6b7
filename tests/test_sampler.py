"""The sampler against direct computations (transformers' logits processors as the reference),
seeded reproducibility whatever the batch, and incremental detokenisation with stop strings."""
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                     TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from zoo.runtime.detokenizer import IncrementalDetokenizer
from zoo.runtime.request import Request
from zoo.runtime.sampler import Sampler
from zoo.runtime.sampling_params import SamplingParams

V = 50


def make_req(prompt=(1, 2, 3), outputs=(), rid="r", **kw):
    r = Request(rid, list(prompt), SamplingParams(**kw))
    for t in outputs:
        r.append_output(t)
    return r


@pytest.fixture(scope="module")
def logits():
    torch.manual_seed(0)
    return torch.randn(4, V) * 3


# -- each option against a direct computation ---------------------------------------------------------
def test_greedy_is_argmax(logits):
    reqs = [make_req(temperature=0, rid=str(i)) for i in range(4)]
    assert Sampler()(logits, reqs).token_ids == logits.argmax(-1).tolist()


def _ref(logits, *warpers, ids=None):
    ids = torch.zeros(1, 1, dtype=torch.long) if ids is None else ids
    x = logits.clone()
    for w in warpers:
        x = w(ids, x)
    return x


@pytest.mark.parametrize("kw,warpers", [
    (dict(temperature=0.7), [TemperatureLogitsWarper(0.7)]),
    (dict(temperature=1.3, top_k=5), [TemperatureLogitsWarper(1.3), TopKLogitsWarper(5)]),
    (dict(temperature=0.9, top_p=0.8), [TemperatureLogitsWarper(0.9), TopPLogitsWarper(0.8)]),
    (dict(temperature=1.0, min_p=0.1), [MinPLogitsWarper(0.1)]),
    (dict(temperature=0.5, top_k=10, top_p=0.9, min_p=0.05),
     [TemperatureLogitsWarper(0.5), TopKLogitsWarper(10), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)]),
])
def test_warpers_match_transformers(logits, kw, warpers):
    reqs = [make_req(rid=str(i), **kw) for i in range(4)]
    got = Sampler().process(logits, reqs)
    want = _ref(logits, *warpers)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])


def test_mixed_rows_each_get_their_own_options(logits):
    kws = [dict(temperature=0), dict(temperature=0.5, top_k=3), dict(temperature=2.0, top_p=0.5), dict(min_p=0.2)]
    reqs = [make_req(rid=str(i), **kw) for i, kw in enumerate(kws)]
    got = Sampler().process(logits, reqs)
    torch.testing.assert_close(got[0], logits[0])  # greedy row: untouched
    for i, w in [(1, [TemperatureLogitsWarper(0.5), TopKLogitsWarper(3)]),
                 (2, [TemperatureLogitsWarper(2.0), TopPLogitsWarper(0.5)]), (3, [MinPLogitsWarper(0.2)])]:
        want = _ref(logits[i:i + 1], *w)[0]
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want))
        torch.testing.assert_close(got[i][~torch.isinf(want)], want[~torch.isinf(want)])


def test_repetition_penalty_over_prompt_and_outputs(logits):
    r = make_req(prompt=[1, 2, 3, 3], outputs=[7, 40], temperature=0, repetition_penalty=1.7)
    got = Sampler().process(logits[:1], [r])
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[1, 2, 3, 3, 7, 40]]), logits[:1].clone())
    torch.testing.assert_close(got, want)


def test_presence_and_frequency_penalties_over_outputs_only(logits):
    r = make_req(prompt=[1, 2], outputs=[5, 5, 9], temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    got = Sampler().process(logits[:1], [r])[0]
    want = logits[0].clone()
    want[5] -= 2 * 0.25 + 0.5
    want[9] -= 0.25 + 0.5
    torch.testing.assert_close(got, want)  # the prompt tokens 1, 2 are not penalised


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    probs = logits.softmax(-1)[0]
    r = make_req(temperature=1.0, seed=123)
    draws = torch.tensor([Sampler()(logits, [r]).token_ids[0] for _ in range(3000)])
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    assert (freq - probs).abs().max() < 0.03
    topk = make_req(temperature=1.0, top_k=2, seed=1)
    assert set(Sampler()(logits, [topk]).token_ids[0] for _ in range(200)) == {0, 1}


def test_seeded_requests_do_not_depend_on_the_batch(logits):
    def run(layout):
        reqs = {name: make_req(rid=name, temperature=1.0, top_p=0.95, seed=seed) for name, seed in layout}
        sampler, seen = Sampler(), {name: [] for name, _ in layout}
        for _ in range(20):
            rows = torch.stack([logits[hash(n) % 4] for n in reqs])
            toks = sampler(rows, list(reqs.values())).token_ids
            for n, t in zip(reqs, toks):
                seen[n].append(t)
        return seen

    alone = run([("a", 7)])["a"]
    packed = run([("x", None), ("b", 8), ("a", 7), ("y", None)])
    assert packed["a"] == alone
    assert packed["b"] != alone  # another seed, another stream
    assert len(set(alone)) > 1  # actually random


def test_logprobs_are_raw_top_n(logits):
    r = make_req(temperature=0, logprobs=3, repetition_penalty=2.0)
    out = Sampler()(logits[:1], [r])
    lp = logits[0].log_softmax(-1)
    d = out.logprobs[0]
    tok = out.token_ids[0]
    assert next(iter(d)) == tok and abs(d[tok] - lp[tok].item()) < 1e-6
    top = lp.topk(3)
    for t, v in zip(top.indices.tolist(), top.values.tolist()):
        assert abs(d[t] - v) < 1e-6


# -- detokenisation -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE: every byte is a token (so a multi-byte character spans tokens), plus 'EN', 'END'."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("E", "N"), ("EN", "D"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t)


def stream(tok, text, stop=(), min_tokens=0):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode("prompt: "), stop=list(stop), min_tokens=min_tokens)
    deltas = []
    for i in ids:
        deltas.append(d.add_tokens([i]))
        if d.stop_string:
            break
    deltas.append(d.flush())
    return deltas, d


def test_multibyte_characters_are_never_split(tok):
    text = "héllo 日本語 wEND ✓"
    deltas, d = stream(tok, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)
    assert "日" in deltas  # emitted whole once its third byte arrived
    assert deltas.count("") >= 6  # the first bytes of each multi-byte character emit nothing


def test_stop_string_split_across_tokens_is_cut_and_never_shown(tok):
    deltas, d = stream(tok, "abc STOP here", stop=["STOP"])
    assert "".join(deltas) == "abc " and d.stop_string == "STOP"
    assert not any("S" in x for x in deltas)  # 'S', 'ST', 'STO' were held back, never emitted
    deltas, d = stream(tok, "go wEND more", stop=["D m"])  # starts inside the token 'END'
    assert "".join(deltas) == "go wEN" and d.stop_string == "D m"


def test_held_back_text_is_released_when_it_cannot_be_a_stop(tok):
    deltas, d = stream(tok, "STAR STOP", stop=["STOP"])
    assert "".join(deltas) == "STAR "
    assert deltas[:4] == ["", "", "STA", "R"]  # 'S', 'ST' held; 'STA' cannot start 'STOP': released
    deltas, d = stream(tok, "no stop ST", stop=["STOP"])
    assert "".join(deltas) == "no stop ST"  # the end of the request flushes what was held


def test_stop_strings_wait_for_min_tokens(tok):
    """vLLM's rule: no stop string ends the output before it has more than min_tokens tokens."""
    deltas, d = stream(tok, "ab STOP cd STOP ef", stop=["STOP"], min_tokens=8)  # one token per byte here
    assert "".join(deltas) == "ab STOP cd " and d.stop_string == "STOP"  # the first STOP ends at token 7
    deltas, d = stream(tok, "ab STOP cd STOP ef", stop=["STOP"], min_tokens=6)
    assert "".join(deltas) == "ab " and d.stop_string == "STOP"


def test_min_tokens_masks_the_stop_tokens_until_reached(logits):
    stop = int(logits[0].argmax())
    early = make_req(outputs=(1,), min_tokens=3, stop_token_ids=[stop], temperature=0)
    done = make_req(outputs=(1, 2, 3), min_tokens=3, stop_token_ids=[stop], temperature=0)
    out = Sampler()(logits[:1].repeat(2, 1), [early, done]).token_ids
    assert out[0] == int(logits[0].topk(2).indices[1]) and out[1] == stop
