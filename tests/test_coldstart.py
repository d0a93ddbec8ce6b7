"""The GGUF start cache (zoo/runtime/model_files.py): a GGUF's converted config and tokenizer are kept in
zoo's cache dir, used on the next start, and converted again when the file changes or the entry is corrupted;
what a start reads from it (a CachedConfig, the tokenizer by its own class) equals what transformers builds
from the GGUF. (Greedy tokens of the default model against transformers: tests/test_smollm2.py.)"""
import os
import shutil

import pytest

from zoo.default_model import default_model_path
from zoo.runtime import model_files as mf

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
    assert type(tok) is type(ref_tok)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True)
    assert ids == ref_tok.apply_chat_template(chat, add_generation_prompt=True)
    assert tok(QUESTION)["input_ids"] == ref_tok(QUESTION)["input_ids"]
    assert (tok.eos_token_id, tok.bos_token_id, tok.all_special_ids) == \
        (ref_tok.eos_token_id, ref_tok.bos_token_id, ref_tok.all_special_ids)
    assert tok.decode(ids) == ref_tok.decode(ids)


def test_an_unwritable_cache_converts_every_time(gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ZOO_CACHE", str(blocker))
    files = mf.resolve_model(gguf)
    assert mf._gguf_cache(files) is None
    assert not isinstance(mf.load_config(files, light=True), mf.CachedConfig)  # transformers' own, from the GGUF
