"""The GGUF start cache (zoo/runtime/model_files.py): a GGUF's converted config and tokenizer are kept in
zoo's cache dir, used on the next start, and converted again when the file changes or the entry is corrupted;
what a start reads from it (a CachedConfig, the tokenizer by its own class) equals what transformers builds
from the GGUF. (Greedy tokens of the default model against transformers: tests/test_smollm2.py.)"""
import os
import shutil

import pytest

from zoo.default_model import default_model_path
from zoo.runtime import model_files as mf
from zoo.runtime.light_tokenizer import LightTokenizer

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """A copy of the default GGUF (its mtime is changed below) and an empty zoo cache."""
    root = tmp_path_factory.mktemp("coldstart")
    copy = root / "model" / default_model_path().name
    copy.parent.mkdir()
    shutil.copyfile(default_model_path(), copy)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZOO_CACHE", str(root / "cache"))
        yield copy


def _manifest_inode(entry):
    return os.stat(entry / mf.MANIFEST).st_ino


def test_cache_is_used_then_rebuilt_when_corrupted_or_the_file_changes(gguf):
    files = mf.resolve_model(gguf)
    entry, manifest = mf._gguf_cache(files)
    assert entry.parent == mf.paths.cache_dir("gguf") and set(manifest["files"]) >= {"config.json", "tokenizer.json"}
    tokenizer_bytes, inode = (entry / "tokenizer.json").read_bytes(), _manifest_inode(entry)

    again, _ = mf._gguf_cache(mf.resolve_model(gguf))  # a second start: the entry as written, not converted again
    assert again == entry and _manifest_inode(entry) == inode

    corruptions = [  # (each rebuilt; two more, below, only checked to be refused)
        lambda: (entry / "tokenizer.json").write_bytes(tokenizer_bytes.replace(b"Paris", b"Lyons")),  # valid, altered
        lambda: (entry / mf.MANIFEST).write_text("{not json"),
        lambda: (entry / "vocab.json").write_text("{}"),  # a file transformers would read that the entry lacks
    ]
    for corrupt in [lambda: (entry / "tokenizer.json").write_bytes(tokenizer_bytes[:1000]),  # truncated
                    lambda: os.remove(entry / "config.json")]:
        saved = {f.name: f.read_bytes() for f in entry.iterdir()}
        corrupt()
        assert mf._cached_entry(entry, manifest["key"]) is None
        for name, data in saved.items():
            (entry / name).write_bytes(data)
        assert mf._cached_entry(entry, manifest["key"]) is not None
    for corrupt in corruptions:
        corrupt()
        assert mf._cached_entry(entry, manifest["key"]) is None
        rebuilt, _ = mf._gguf_cache(files)
        assert rebuilt == entry and _manifest_inode(entry) != inode, "a corrupted entry is converted again"
        assert (entry / "tokenizer.json").read_bytes() == tokenizer_bytes and not (entry / "vocab.json").exists()
        inode = _manifest_inode(entry)

    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: another key, a new entry
    changed, new = mf._gguf_cache(mf.resolve_model(gguf))
    assert changed != entry and new["key"] != manifest["key"] and mf._cached_entry(changed, new["key"]) is not None


def test_cached_config_and_tokenizer_equal_what_transformers_builds_from_the_gguf(gguf):
    from transformers import AutoConfig, AutoTokenizer

    files = mf.resolve_model(gguf)
    config = mf.load_config(files, light=True)
    assert isinstance(config, mf.CachedConfig)
    ref = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    missing = object()
    # every field, and those the plugins and runtime read with getattr defaults
    for name in list(ref.to_dict()) + ["head_dim", "num_key_value_heads", "rope_parameters", "rope_scaling",
                                       "rope_theta", "layer_types", "sliding_window", "attention_bias", "mlp_bias",
                                       "tie_word_embeddings", "partial_rotary_factor", "max_position_embeddings"]:
        assert getattr(config, name, missing) == getattr(ref, name, missing), name
    assert config.get_text_config() is config and config.to_dict() == ref.to_dict()

    tok = mf.load_tokenizer(files)
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert isinstance(tok, LightTokenizer) and tok._full is None, "the conversion proved it: no transformers tokenizer"
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
             [{"role": "user", "content": QUESTION}],  # (SmolLM2's template adds its default system message)
             [{"role": "user", "content": "Hi", "name": None}, {"role": "assistant", "content": "Hello! 🙂"},
              {"role": "user", "content": "a <|im_end|> inside\n\tand  spaces"}]]
    for chat in chats:
        for gen in (True, False):
            assert tok.apply_chat_template(chat, add_generation_prompt=gen) == \
                ref_tok.apply_chat_template(chat, add_generation_prompt=gen)
            assert tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == \
                ref_tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
    ids = tok.apply_chat_template(chats[0], add_generation_prompt=True)["input_ids"]
    for text in (QUESTION, " leading space", "naïve café 東京\n\n", "<|im_start|>user", ""):
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"] == tok.encode(text) == ref_tok.encode(text)
        assert tok.encode(text, add_special_tokens=False) == ref_tok.encode(text, add_special_tokens=False)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "eos_token", "bos_token",
                 "all_special_ids", "all_special_tokens", "special_tokens_map", "chat_template"):
        assert getattr(tok, name) == getattr(ref_tok, name), name
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == ref_tok.decode(ids, skip_special_tokens=skip)
    assert tok.convert_ids_to_tokens(ids) == ref_tok.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens(ids[0]) == ref_tok.convert_ids_to_tokens(ids[0])
    assert tok._full is None
    # anything else is transformers' own tokenizer of the entry, built on first use
    assert tok.vocab_size == ref_tok.vocab_size and tok.get_vocab() == ref_tok.get_vocab() and tok._full is not None
    tok.chat_template = "{{ messages[0]['content'] }}!"
    assert tok._full.chat_template == tok.chat_template  # (--chat-template sets it: both see it)
    assert tok.apply_chat_template(chats[0], tokenize=False) == "Be brief.!" == \
        tok._full.apply_chat_template(chats[0], tokenize=False)


def test_a_manifest_without_a_usable_light_section_loads_transformers_tokenizer(gguf):
    files = mf.resolve_model(gguf)
    entry, manifest = mf._gguf_cache(files)
    assert LightTokenizer.from_manifest(entry, manifest["light"]) is not None
    for light in (None, {**manifest["light"], "ids": []}, {**manifest["light"], "class": 3}, "x"):
        assert LightTokenizer.from_manifest(entry, light) is None
    from transformers import TokenizersBackend

    broken = {**manifest, "light": {**manifest["light"], "all_special_ids": "0"}}
    (entry / mf.MANIFEST).write_text(__import__("json").dumps(broken))
    try:
        tok = mf.load_tokenizer(files)
        assert type(tok) is TokenizersBackend and tok.encode(QUESTION) == mf.load_tokenizer(files).encode(QUESTION)
    finally:
        (entry / mf.MANIFEST).write_text(__import__("json").dumps(manifest))
    assert isinstance(mf.load_tokenizer(files), LightTokenizer)


def test_an_unwritable_cache_converts_every_time(gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ZOO_CACHE", str(blocker))
    files = mf.resolve_model(gguf)
    assert mf._gguf_cache(files) is None
    assert not isinstance(mf.load_config(files, light=True), mf.CachedConfig)  # transformers' own, from the GGUF
