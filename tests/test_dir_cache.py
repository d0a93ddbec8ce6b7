"""The directory start cache (zoo/runtime/model_files.py _dir_cache): a safetensors folder's config and proved-light
tokenizer are kept in zoo's cache dir keyed by the content of its config and tokenizer files; a start with a valid
entry imports no transformers for them, an edit of any of those files makes a fresh entry, a corrupted entry is
written again, and what a cached start runs equals the uncached start (same config, same tokens)."""
import json
import os

from test_cli_run import WORDS, save_chat_model
from transformers import AutoConfig, AutoTokenizer

from zoo import LLM, SamplingParams
from zoo.runtime import model_files as mf
from zoo.runtime.light_tokenizer import LightTokenizer

PROMPT = " ".join(WORDS[8:20])


def _entries():
    d = mf.paths.cache_dir("dir")
    return sorted(d.glob("*.json")) if d.is_dir() else []


def _greedy(path) -> tuple[list[int], object, object]:
    llm = LLM(str(path), max_model_len=64, num_blocks=16)
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return list(out.outputs[0].token_ids), llm.config, llm.tokenizer


def _cache(root, *, writable: bool = True):
    """A zoo cache dir at `root` sharing this machine's compiled kernels; not writable: `dir` is a file."""
    kernels = mf.paths.cache_dir("kernels")
    root.mkdir()
    if kernels.is_dir():
        (root / "kernels").symlink_to(kernels, target_is_directory=True)
    if not writable:
        (root / "dir").write_text("not a directory")
    return str(root)


def test_cached_start_equals_the_uncached_one(tmp_path, monkeypatch):
    model = save_chat_model(tmp_path / "m", randomize=True)
    caches = _cache(tmp_path / "blocked", writable=False), _cache(tmp_path / "cache")
    monkeypatch.setenv("ZOO_CACHE", caches[0])  # the directory cache unwritable: the uncached start
    ref_ids, ref_config, ref_tok = _greedy(model)
    assert not isinstance(ref_config, mf.CachedConfig) and not isinstance(ref_tok, LightTokenizer)

    monkeypatch.setenv("ZOO_CACHE", caches[1])
    first = _greedy(model)  # (writes the entry)
    (entry,) = _entries()
    inode = entry.stat().st_ino
    ids, config, tok = _greedy(model)  # a second start: from the entry, not written again
    assert _entries() == [entry] and entry.stat().st_ino == inode
    assert isinstance(config, mf.CachedConfig) and isinstance(tok, LightTokenizer) and tok._full is None
    assert ids == first[0] == ref_ids and len(ids) == 12

    ref = AutoConfig.from_pretrained(model)
    missing = object()
    fields = [n for n in ref.to_dict() if n != "transformers_version"]  # (None on a CachedConfig, as on a GGUF's)
    for name in fields + ["head_dim", "num_key_value_heads", "rope_parameters", "rope_scaling", "layer_types",
                          "sliding_window", "tie_word_embeddings"]:
        assert getattr(config, name, missing) == getattr(ref, name, missing), name
    assert config.to_dict() == ref.to_dict()  # (transformers_version there, as to_dict writes it)
    ref_tok = AutoTokenizer.from_pretrained(model)
    chat = [{"role": "user", "content": PROMPT}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == \
        ref_tok.apply_chat_template(chat, add_generation_prompt=True)
    for text in (PROMPT, "w1  w2\nnot-a-word", ""):
        assert tok.encode(text) == ref_tok.encode(text)
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == ref_tok.decode(ref_tok.encode(text),
                                                                                         skip_special_tokens=True)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids", "chat_template"):
        assert getattr(tok, name) == getattr(ref_tok, name), name


def test_an_edit_of_config_or_tokenizer_makes_a_fresh_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    model = save_chat_model(tmp_path / "m")
    files = mf.resolve_model(model)
    assert mf.load_config(files, light=True).max_position_embeddings == 256
    assert mf.load_tokenizer(files).encode("w5") == [WORDS.index("w5")]

    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": 128}))
    config = mf.load_config(mf.resolve_model(model), light=True)
    assert isinstance(config, mf.CachedConfig) and config.max_position_embeddings == 128 and len(_entries()) == 2

    tj = model / "tokenizer.json"
    st = tj.stat()
    tj.write_text(tj.read_text().replace('"w5"', '"zz"'))
    os.utime(tj, ns=(st.st_atime_ns, st.st_mtime_ns))  # (same mtime: the content is the key)
    tok = mf.load_tokenizer(mf.resolve_model(model))
    assert isinstance(tok, LightTokenizer) and tok.encode("zz") == [WORDS.index("w5")] and len(_entries()) == 3
    assert tok.encode("w5") == [WORDS.index("<unk>")]

    (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")  # a file added: another key
    tok = mf.load_tokenizer(mf.resolve_model(model))
    assert tok.apply_chat_template([{"role": "user", "content": "w1"}], tokenize=False) == "w1!"
    assert tok.chat_template == AutoTokenizer.from_pretrained(model).chat_template and len(_entries()) == 4

    (model / "config.json").write_text(json.dumps({**raw, "num_attention_heads": 0}))  # refused, never cached
    try:
        mf.load_config(mf.resolve_model(model), light=True)
        raise AssertionError("a config with zero heads was accepted")
    except mf.ConfigError as e:
        assert "num_attention_heads=0" in str(e)


def test_a_corrupted_or_foreign_entry_is_written_again(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    model = save_chat_model(tmp_path / "m")
    files = mf.resolve_model(model)
    mf.load_config(files, light=True)
    (entry,) = _entries()
    good = json.loads(entry.read_text())
    for bad in ("{not json", json.dumps({**good, "key": "0" * 64}), json.dumps({**good, "format": 0}),
                json.dumps({**good, "config": {"model_type": 3}}), "[]"):
        entry.write_text(bad)
        assert mf._dir_entry(entry, good["key"]) is None
        config = mf.load_config(files, light=True)
        assert config.to_dict() == mf.CachedConfig(good["config"]).to_dict()
        assert json.loads(entry.read_text()) == good, "written again from the directory's files"
    entry.write_text(json.dumps({**good, "light": {**good["light"], "ids": []}}))  # a light section not usable
    tok = mf.load_tokenizer(files)
    assert not isinstance(tok, LightTokenizer) and tok.encode("w5") == [WORDS.index("w5")]


def test_a_tokenizer_that_cleans_up_spaces_is_not_light(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    model = save_chat_model(tmp_path / "m")
    tc = model / "tokenizer_config.json"
    tc.write_text(json.dumps({**json.loads(tc.read_text()), "clean_up_tokenization_spaces": True}))
    files = mf.resolve_model(model)
    assert isinstance(mf.load_config(files, light=True), mf.CachedConfig)
    (entry,) = _entries()
    assert json.loads(entry.read_text())["light"] is None
    tok = mf.load_tokenizer(files)
    assert not isinstance(tok, LightTokenizer) and tok.clean_up_tokenization_spaces
