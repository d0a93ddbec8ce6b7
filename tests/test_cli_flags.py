"""`zoo run`'s sampling and context flags, the note on a cut reply, `zoo --version`, and a hub id that is not
cached (one line saying how to get it)."""
import re

import pytest

from test_cli_run import save_chat_model, save_word_tokenizer, words
from tiny import save_tiny
from zoo.cli import main


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("flags"), max_position_embeddings=64)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("zoo ")


def test_a_reply_cut_by_max_tokens_or_the_context_says_so(chat_model, capsys):
    assert main(["run", str(chat_model), "--prompt", words(3), "--max-tokens", "4", "--ignore-eos",
                 "--min-p", "0.01", "--repetition-penalty", "1.2"]) == 0
    err = capsys.readouterr().err
    assert "zoo: 4 tokens" in err and "the reply was cut at --max-tokens=4" in err
    assert main(["run", str(chat_model), "--prompt", words(3), "--max-tokens", "100", "--ignore-eos",
                 "--max-model-len", "16", "--no-chat"]) == 0
    err = capsys.readouterr().err
    assert "the reply was cut at the context length (max_model_len=16)" in err


def test_stop_strings_end_the_reply(chat_model, capsys):
    assert main(["run", str(chat_model), "--prompt", words(3), "--max-tokens", "8", "--ignore-eos", "--no-chat"]) == 0
    reply = capsys.readouterr().out
    stop = reply.split()[2]  # the third word of the greedy reply: the reply stops before its first appearance
    assert main(["run", str(chat_model), "--prompt", words(3), "--max-tokens", "8", "--ignore-eos", "--no-chat",
                 "--stop", stop]) == 0
    assert capsys.readouterr().out.strip() == reply[:reply.index(stop)].strip()


@pytest.mark.parametrize("argv, words_in_err", [
    (["--min-p", "2"], ["min_p"]),
    (["--repetition-penalty", "0"], ["repetition_penalty"]),
    (["--max-model-len", "1"], ["--max-model-len"]),
    (["--chat-template", "/nonexistent/t.jinja"], ["--chat-template", "/nonexistent/t.jinja"]),
])
def test_bad_flags_exit_2_naming_them(chat_model, capsys, argv, words_in_err):
    assert main(["run", str(chat_model), "--prompt", "w1", *argv]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words_in_err) and "Traceback" not in err


def test_max_model_len_past_learned_positions_is_refused_before_the_weights(tmp_path, capsys):
    """GPT-2 embeds positions from a table of max_position_embeddings rows (was an IndexError mid-generation)."""
    from zoo import LLM

    gpt2 = save_word_tokenizer(save_tiny("GPT2LMHeadModel", tmp_path / "gpt2", max_position_embeddings=16))
    why = "GPT2LMHeadModel learned 16 positions (max_position_embeddings) and embeds none past them"
    for command, extra in (("run", ["--prompt", words(3), "--max-tokens", "30", "--ignore-eos"]),
                           ("serve", ["--port", "0"])):
        assert main([command, str(gpt2), "--max-model-len", "32", *extra]) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1] == f"zoo {command}: error: --max-model-len=32: {why}", err
        assert "loading weights" not in err
    with pytest.raises(ValueError, match=f"^max_model_len=17: {re.escape(why)}$"):
        LLM(str(gpt2), max_model_len=17)
    from zoo.build import build_model
    from zoo.runtime.engine import LLMEngine

    model, config, *_ = build_model(gpt2)  # an engine built on a model (another engine's use of zoo)
    with pytest.raises(ValueError, match=f"^max_model_len=17: {re.escape(why)}$"):
        LLMEngine(model, config, max_model_len=17)
    # the default context is the learned positions: a long reply is cut there
    assert main(["run", str(gpt2), "--prompt", words(3), "--max-tokens", "40", "--ignore-eos", "--no-chat"]) == 0
    assert "the reply was cut at the context length (max_model_len=16)" in capsys.readouterr().err


def test_a_hub_id_not_cached_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["run", "no-such-org/no-such-model", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if "error" in x]
    assert len(line) == 1 and "hf download no-such-org/no-such-model" in line[0] and "HF_HUB_OFFLINE" in line[0]
