"""Where a model's files are, and its config, generation config and tokenizer.

MODEL is None (the embedded default), a local directory in the Hugging Face layout, a .gguf file, or a
hub id resolved through the huggingface_hub cache (HF_HUB_OFFLINE honoured).

A GGUF file carries its config and tokenizer as metadata; transformers converts them in a few seconds
(it parses the whole vocabulary), so the converted files are kept in zoo.paths.cache_dir('gguf')/<key>/
(key: the file's path, size, mtime and a hash of its header, and the transformers version) with a manifest
(zoo-cache.json: the key, the full config, each file's sha256). The cache is local state that anything may
have written: an entry is used only when its manifest parses, names this key and every file's hash
matches; otherwise it is converted again (never trusted, never unpickled). A start with a valid entry reads
the config from the manifest without transformers' config classes (load_config(light=True): their import
pulls in torch.distributed, seconds) and the tokenizer without transformers when the conversion proved that
equal (the manifest's `light` section, zoo/runtime/light_tokenizer.py), else with its own class (not AutoTokenizer's
config walk).

The files are untrusted: the ones transformers reads from a directory (config, tokenizer) must be regular files
inside it, a GGUF header is checked by the loader before transformers parses it, and a config is validated
(validate_config) before a model is built from it; each failure is one line naming the file and the field.
"""
from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from zoo import paths

# Files of a model directory that transformers reads (config, generation config, tokenizer)
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
              "chat_template.jinja", "chat_template.json", "preprocessor_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# what a hub snapshot is fetched with before its weights (config, tokenizer, index, chat template, processor)
HUB_SMALL_FILES = ("*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja")
# Config fields that, when set, must be integers > 0 (or >= 0): a model cannot be built from anything else
POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "moe_intermediate_size", "num_experts",
            "num_local_experts", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank", "q_lora_rank",
            "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group",
            "decoder_sparse_step", "routed_scaling_factor")
NON_NEGATIVE = ("sliding_window", "first_k_dense_replace", "n_shared_experts", "shared_expert_intermediate_size")
FLOATS = (("rms_norm_eps", 0.0), ("layer_norm_eps", 0.0), ("rope_theta", None))  # (field, least value allowed)


class ModelNotFound(RuntimeError):
    """MODEL names nothing that can be found locally (a usage or environment error)."""


class ConfigError(ValueError):
    """The model's config cannot be read (unknown model_type), or names a model the zoo's plugin for its
    architecture does not serve (its `validate` refused it): a usage error, one line."""


@dataclass(frozen=True)
class ModelFiles:
    path: Path  # what the loader opens: a directory or a .gguf file
    directory: Path  # config.json / tokenizer files (for GGUF: the converted cache, or the file's folder)
    gguf_file: str | None  # the .gguf file name, when the model is one
    model_id: str  # a name to show, and the prefix-cache namespace
    header_bytes: int = 0  # a GGUF's header length (checked by the loader; hashed into the cache key)

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def name(self) -> str:
        """Short name to show: the hub id, or the file / directory name."""
        return self.model_id if not Path(self.model_id).is_absolute() else Path(self.model_id).name


def resolve_model(model: str | os.PathLike | None, *, revision: str | None = None) -> ModelFiles:
    """The files of MODEL. `revision` (a hub id's branch, tag or commit, as vLLM's --revision) is for hub ids:
    with a local path it is a ModelNotFound saying so."""
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ModelNotFound(f"revision={revision!r}: expected a branch, tag or commit of a hub repository")
    if model is None or Path(os.path.expanduser(str(model))).exists():
        if revision is not None:
            raise ModelNotFound(f"--revision {revision}: {model or 'the embedded default model'} is a local file or "
                                f"directory; a revision applies to hub ids (org/name) only")
    if model is None:
        from zoo.default_model import default_model_path

        return _gguf(default_model_path())
    path = Path(os.path.expanduser(str(model)))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFound(f"{path}: a model file must be a .gguf; for safetensors give the directory")
        return _gguf(path)
    if path.is_dir():
        _check_side_files(path)  # (first: a dangling config.json is named as one, not as absent)
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            from loader.sources import check_file

            check_file(ggufs[0], path)  # (found in the directory, not named: a regular file, links followed)
            return _gguf(ggufs[0])
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path}: no config.json (not a Hugging Face model directory)")
        return ModelFiles(path, path, None, str(path.resolve()))
    name = str(model)
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise ModelNotFound(f"{name}: no such file or directory, and not a hub id of the form org/name")
    snapshot = _from_hub(name, revision)
    _check_side_files(snapshot)
    return ModelFiles(snapshot, snapshot, None, name)


def resolve_tokenizer(tokenizer: str | os.PathLike) -> ModelFiles:
    """The files of a tokenizer given apart from the model (vLLM's --tokenizer): a directory holding tokenizer
    files (no config.json needed), a .gguf file, or a hub id (its tokenizer files only are fetched)."""
    path = Path(os.path.expanduser(str(tokenizer)))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFound(f"--tokenizer {path}: a file must be a .gguf; otherwise give the tokenizer's directory")
        return _gguf(path)
    if path.is_dir():
        _check_side_files(path)
        if not any((path / f).exists() for f in TOKENIZER_FILES):
            raise ModelNotFound(f"--tokenizer {path}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})")
        return ModelFiles(path, path, None, str(path.resolve()))
    name = str(tokenizer)
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise ModelNotFound(f"--tokenizer {name}: no such file or directory, and not a hub id of the form org/name")
    snapshot = _from_hub(name, None, weights=False)
    _check_side_files(snapshot)
    return ModelFiles(snapshot, snapshot, None, name)


def _check_side_files(directory: Path) -> None:
    """The config and tokenizer files transformers will read are regular files (symlinks followed, as transformers
    follows them): a FIFO would hang it, a dangling link would be an obscure error. Raises loader.SourceError."""
    from loader.sources import check_file

    for name in SIDE_FILES:
        if os.path.lexists(directory / name):
            check_file(directory / name, directory)


def _gguf(path: Path) -> ModelFiles:
    from loader.gguf import check_header

    header = check_header(path)  # before transformers parses its metadata into a config and a tokenizer
    path = path.resolve()
    return ModelFiles(path, path.parent, path.name, str(path), header)


def _from_hub(repo_id: str, revision: str | None = None, *, weights: bool = True) -> Path:
    """The local snapshot of a hub repository, through huggingface_hub's snapshot_download (its progress bars,
    its cache; HF_HUB_OFFLINE: the cache only): the config, tokenizer and other small files first, then only the
    weight files the index names (else every *.safetensors). ModelNotFound, one line, when it cannot."""
    from huggingface_hub import snapshot_download

    from loader.problems import SourceError

    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    kw = dict(revision=revision, local_files_only=offline)
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=list(HUB_SMALL_FILES), **kw))
        if weights:
            patterns = ["*.safetensors"]
            if (path / "model.safetensors.index.json").is_file():
                from loader.sources import _weight_map

                patterns = sorted(set(_weight_map(path / "model.safetensors.index.json").values()))
            path = Path(snapshot_download(repo_id, allow_patterns=patterns, **kw))
        return path
    except SourceError:  # (the index is malformed: said as the loader says it)
        raise
    except Exception as e:
        at = f" at revision {revision!r}" if revision else ""
        get = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
        if offline:  # the usual case here: say how to get it, in one line
            raise ModelNotFound(f"hub model {repo_id!r}{at} is not in the local Hugging Face cache and HF_HUB_OFFLINE "
                                f"is set: get it with `{get}`, or unset HF_HUB_OFFLINE") from None
        if type(e).__name__ == "RevisionNotFoundError":
            raise ModelNotFound(f"hub model {repo_id!r} has no revision {revision!r} (a branch, tag or commit)") from None
        raise ModelNotFound(f"hub model {repo_id!r}{at} is not available: {type(e).__name__}: {first_line(e)} "
                            f"(check the id and the network; a gated model needs `hf auth login`)") from None


# -- config, generation config, tokenizer --------------------------------------------------------------
CACHE_FORMAT = 2  # bump when what a cache entry holds changes (2: the manifest's `light` tokenizer section)
MANIFEST = "zoo-cache.json"
FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")  # classes loadable without AutoTokenizer


def _gguf_key(files: ModelFiles) -> str:
    """The cache key of a GGUF file: its path, size, mtime, a hash of its header, and the transformers version
    that converts it (read from the package metadata: importing transformers costs a second)."""
    import importlib.metadata

    st = files.path.stat()
    key = hashlib.sha256(f"{CACHE_FORMAT}|{files.path}|{st.st_size}|{st.st_mtime_ns}|"
                         f"{importlib.metadata.version('transformers')}|".encode())
    with open(files.path, "rb") as f:
        key.update(f.read(files.header_bytes or 1 << 20))
    return key.hexdigest()


def _sha256(f: Path) -> str:
    return hashlib.sha256(f.read_bytes()).hexdigest()


def _cached_entry(out: Path, key: str) -> dict | None:
    """The manifest of the cache entry `out` when it is whole and written for `key`, else None (anything
    malformed, missing, or a file whose hash differs: the entry is converted again)."""
    import json

    from loader.problems import SourceError
    from loader.sources import check_file

    try:
        if not (out / MANIFEST).is_file():
            return None
        check_file(out / MANIFEST, out)
        manifest = json.loads((out / MANIFEST).read_bytes())
        files = manifest["files"]
        if not (manifest.get("format") == CACHE_FORMAT and manifest.get("key") == key and isinstance(files, dict)
                and isinstance(manifest.get("config"), dict) and "config.json" in files
                and set(os.listdir(out)) == set(files) | {MANIFEST}):  # (nothing else that transformers might read)
            return None
        for name, digest in files.items():
            if not plain_cache_name(name):
                return None
            check_file(out / name, out)  # a regular file inside the entry (a FIFO would hang the hash)
            if _sha256(out / name) != digest:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, SourceError):
        return None
    return manifest


def plain_cache_name(name) -> bool:
    return isinstance(name, str) and name in SIDE_FILES


def _gguf_cache(files: ModelFiles) -> tuple[Path, dict] | None:
    """(directory, manifest) of this GGUF's converted config + tokenizer, converting on first use (and when
    the entry is invalid); None when the cache cannot be written."""
    import json

    key = _gguf_key(files)
    out = paths.cache_dir("gguf") / key[:24]
    manifest = _cached_entry(out, key)
    if manifest is not None:
        return out, manifest
    import transformers

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    except OSError:
        return None  # read-only cache: convert every time
    try:
        kw = dict(gguf_file=files.gguf_file)
        config = transformers.AutoConfig.from_pretrained(files.directory, **kw)
        config.save_pretrained(tmp)
        transformers.AutoTokenizer.from_pretrained(files.directory, **kw).save_pretrained(tmp)
        manifest = {"format": CACHE_FORMAT, "key": key, "source": str(files.path), "config": config.to_dict(),
                    "files": {f.name: _sha256(f) for f in sorted(tmp.iterdir()) if plain_cache_name(f.name)},
                    "light": _light_proof(tmp)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():  # an invalid entry (stale, corrupted, half-written by an old version): replaced
        shutil.rmtree(out, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
        manifest = _cached_entry(out, key)
        if manifest is None:
            return None
    return out, manifest


def _light_proof(entry: Path) -> dict | None:
    """The manifest's `light` section: what a start needs to read the entry's tokenizer without transformers,
    when its conversion proved that equal (zoo.runtime.light_tokenizer.proof), else None."""
    from zoo.runtime.light_tokenizer import proof

    ref = _cached_tokenizer(entry)  # (what a start without the section loads)
    return proof(entry, ref) if ref is not None else None


DIR_FORMAT = 1  # bump when what a directory's start-cache manifest holds changes


def _dir_key(files: ModelFiles) -> str | None:
    """The start-cache key of a model directory: the cache format, the transformers version, the directory's
    resolved path, and the name and sha256 of every config / tokenizer file in it (SIDE_FILES: any edit, added or
    removed file makes another key); None when one cannot be read (the start then reads them as usual)."""
    import importlib.metadata

    key = hashlib.sha256(f"{DIR_FORMAT}|{importlib.metadata.version('transformers')}|"
                         f"{files.directory.resolve()}|".encode())
    try:
        for name in SIDE_FILES:
            f = files.directory / name
            if os.path.lexists(f):  # (regular files inside the directory: resolve_model checked them)
                key.update(f"{name}|{_sha256(f)}|".encode())
    except OSError:
        return None
    return key.hexdigest()


def _dir_cache(files: ModelFiles) -> dict | None:
    """The start-cache manifest of a Hugging Face model directory (zoo.paths.cache_dir('dir')/<key>.json): its
    config as transformers reads it (to_dict(), None when a CachedConfig would not answer as the transformers
    config does) and the `light` tokenizer section (None unless proved equal, light_tokenizer.proof), written on
    the first start (with transformers) and used while every file hashes to the key. Anything malformed is
    written again; None when the cache cannot be written (or the directory is a hub snapshot: its files are
    immutable blobs, but the same holds: keyed by content)."""
    import json

    key = _dir_key(files)
    if key is None:
        return None
    out = paths.cache_dir("dir") / f"{key[:32]}.json"
    manifest = _dir_entry(out, key)
    if manifest is not None:
        return manifest
    config = None
    if (files.directory / "config.json").exists():  # (a --tokenizer directory may have none)
        try:
            config = _plain_config(read_config(files.directory, files.name))  # (what the uncached start reads)
        except ConfigError:
            return None  # (load_config, uncached, says what is wrong)
    from zoo.runtime.light_tokenizer import proof

    light = None
    if any((files.directory / f).exists() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        try:
            light = proof(files.directory, AutoTokenizer.from_pretrained(files.directory))
        except Exception:  # noqa: BLE001 - (load_tokenizer, next, says what is wrong with it)
            light = None
    manifest = {"format": DIR_FORMAT, "key": key, "source": str(files.directory.resolve()),
                "config": config, "light": light}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=out.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, sort_keys=True)
        os.replace(tmp, out)
    except OSError:
        return None  # read-only cache: read every time
    return json.loads(json.dumps(manifest))  # (as a later start reads it back)


def _dir_entry(out: Path, key: str) -> dict | None:
    """The manifest at `out` when it parses and names this key and format, else None."""
    import json

    from loader.problems import SourceError
    from loader.sources import check_file

    try:
        if not out.is_file():
            return None
        check_file(out, out.parent)
        manifest = json.loads(out.read_bytes())
        if not (isinstance(manifest, dict) and manifest.get("format") == DIR_FORMAT and manifest.get("key") == key
                and (manifest.get("config") is None or isinstance(manifest["config"], dict)
                     and isinstance(manifest["config"].get("model_type"), str))):
            return None
        return {"config": manifest.get("config"), "light": manifest.get("light")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, SourceError):
        return None


def _plain_config(config) -> dict | None:
    """config.to_dict() with the class's attribute aliases (attribute_map) written out, when a CachedConfig of it
    answers as `config` does: a text config (no text_config) whose class adds no properties; else None."""
    import json

    from transformers import PretrainedConfig

    cls = type(config)
    props = [n for k in cls.__mro__ if issubclass(k, PretrainedConfig) and k is not PretrainedConfig
             for n, v in vars(k).items() if isinstance(v, property)]
    values = config.to_dict()
    if props or "text_config" in values or not isinstance(values.get("model_type"), str):
        return None
    for alias in getattr(cls, "attribute_map", {}) or {}:
        values.setdefault(alias, getattr(config, alias, None))
    try:
        return json.loads(json.dumps(values))
    except (TypeError, ValueError):
        return None


class CachedConfig:
    """A GGUF's config read back from the cache manifest: the attributes of the transformers config it was
    converted to (its full to_dict()), without importing transformers' config classes. Read-only use:
    attribute access, to_dict(), get_text_config() (a text model: itself)."""

    def __init__(self, values: dict):
        self.__dict__.update(values)
        if isinstance(values.get("id2label"), dict):  # JSON made its int keys strings; transformers' are ints
            self.id2label = {int(k) if str(k).lstrip("-").isdigit() else k: v for k, v in values["id2label"].items()}
        self._version = self.__dict__.pop("transformers_version", None)  # to_dict's; the attribute is None there
        self.transformers_version = None
        if isinstance(values.get("dtype"), str):  # to_dict's name of transformers' torch.dtype
            import torch

            self.dtype = getattr(torch, values["dtype"]) if isinstance(getattr(torch, values["dtype"], None),
                                                                       torch.dtype) else values["dtype"]

    @property
    def rope_scaling(self):  # transformers' alias of rope_parameters
        return self.__dict__.get("rope_parameters")

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("_version", "transformers_version")}
        if out.get("dtype") is not None and not isinstance(out["dtype"], str):
            out["dtype"] = str(out["dtype"]).removeprefix("torch.")
        return out if self._version is None else {**out, "transformers_version": self._version}

    def get_text_config(self, *args, **kwargs):
        return self

    def __repr__(self) -> str:
        return f"CachedConfig({self.__dict__.get('model_type')!r}, {len(self.__dict__)} fields)"


def _source_dir(files: ModelFiles) -> tuple[Path, dict]:
    if files.is_gguf:
        cached = _gguf_cache(files)
        if cached is not None:
            return cached[0], {}
        return files.directory, {"gguf_file": files.gguf_file}
    return files.directory, {}


def load_config(files: ModelFiles, *, light: bool = False):
    """The model's config (validated). light=True: for a GGUF whose cache entry is valid, or a directory whose
    start-cache entry holds its config (_dir_cache), a CachedConfig from the manifest (no transformers import);
    otherwise, and by default, the transformers config."""
    try:
        if light and not files.is_gguf:
            manifest = _dir_cache(files)
            if manifest is not None and manifest["config"] is not None:
                validate_config(manifest["config"], files.name)
                return CachedConfig(manifest["config"])
        if light and files.is_gguf:
            cached = _gguf_cache(files)
            config = cached[1]["config"] if cached is not None else None
            if isinstance(config, dict) and isinstance(config.get("model_type"), str) and "text_config" not in config:
                validate_config(config, files.name)
                return CachedConfig(config)
        directory, kw = _source_dir(files)
    except ConfigError:
        raise
    except Exception as e:  # transformers converting a GGUF's metadata
        raise ConfigError(f"{files.name}: the config cannot be read from the GGUF metadata: {first_line(e)}") from None
    return read_config(directory, files.name, **kw)


def config_at(path) -> object:
    """The transformers config of a local model: a directory with config.json, or a GGUF file (its metadata)."""
    return load_config(resolve_model(path))


def read_config(directory, name: str, **kw):
    """transformers' config from `directory` (kw: gguf_file=), validated; ConfigError (one line, naming `name`
    and the field) for whatever transformers raises on it (its strict-dataclass validation errors, a
    KeyError for a rope type without its factor) and for what it accepts but no model can be built from.
    config.json itself is validated first, so a field transformers would crash on (zero heads: a
    ZeroDivisionError) is named."""
    from transformers import AutoConfig

    if not kw and Path(directory).is_dir():
        _check_side_files(Path(directory))
        raw = _raw_config(Path(directory) / "config.json", name)
        if raw is not None:
            validate_config(raw, name)
    try:
        config = AutoConfig.from_pretrained(directory, **kw)
    except Exception as e:
        raise ConfigError(f"{name}: the config cannot be read: {first_line(e)}") from None
    validate_config(config, name)
    return config


def _raw_config(f: Path, name: str) -> dict | None:
    import json

    if not f.is_file():
        return None  # (transformers names what is missing)
    if f.stat().st_size > 16 << 20:
        raise ConfigError(f"{name}: config.json is {f.stat().st_size} bytes, not a config")
    try:
        raw = json.loads(f.read_bytes())
    except RecursionError:
        raise ConfigError(f"{name}: config.json nests JSON too deeply to be read") from None
    except ValueError as e:
        raise ConfigError(f"{name}: config.json is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: config.json is a JSON {type(raw).__name__}, not an object")
    return raw


def first_line(e: BaseException) -> str:
    """An exception as one line: its first non-empty line (with the next one when that ends in ':', as
    transformers' validation errors do), without a KeyError's quotes."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    text = lines[0] + (" " + lines[1] if lines[0].endswith(":") and len(lines) > 1 else "")
    if isinstance(e, KeyError) and text[:1] in "'\"" and text[-1:] == text[:1]:
        text = text[1:-1]
    return text if len(text) <= 300 else text[:297] + "..."


def validate_config(config, name: str, prefix: str = "") -> None:
    """Refuse (ConfigError naming the field) what no model can be built from: sizes and counts that are not
    integers > 0, non-finite or negative eps and rope theta, a rope scaling without a usable factor,
    `architectures` that is not a list of strings, heads that do not divide. `config` is a transformers
    config or the raw config.json dict; a composite config's text_config is checked too."""
    def bad(field, value, why):
        raise ConfigError(f"{name}: config {prefix}{field}={_short(value)} {why}")

    def get(obj, field):  # a dict's key or a config's attribute
        return obj.get(field) if isinstance(obj, dict) else getattr(obj, field, None)

    archs = get(config, "architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        bad("architectures", archs, "is not a list of strings (e.g. [\"LlamaForCausalLM\"])")
    for field in POSITIVE + NON_NEGATIVE:
        v = get(config, field)
        if v is None:
            continue
        least = 1 if field in POSITIVE else 0
        if field == "routed_scaling_factor":
            if not _number(v) or not v > 0:
                bad(field, v, "is not a finite number > 0")
        elif isinstance(v, bool) or not isinstance(v, int) or v < least:
            bad(field, v, f"is not an integer >= {least}")
    for field, least in FLOATS:
        v = get(config, field)
        if v is not None and (not _number(v) or (v <= 0 if least is None else v < least)):
            bad(field, v, "is not a finite number " + ("> 0" if least is None else f">= {least}"))
    heads, kv = get(config, "num_attention_heads"), get(config, "num_key_value_heads")
    if heads and kv and heads % kv:
        bad("num_attention_heads", heads, f"is not a multiple of num_key_value_heads={kv}")
    text = get(config, "text_config")
    if text is not None and text is not config and not prefix:
        validate_config(text, name, "text_config.")
    rope = get(config, "rope_parameters") or get(config, "rope_scaling")
    per_type = rope.values() if isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for r in per_type:
        if r is None:
            continue
        if not isinstance(r, dict):
            bad("rope_parameters", r, "is not an object")
        kind = r.get("rope_type", r.get("type", "default"))
        if kind not in (None, "default") and "factor" in r or kind in ("linear", "dynamic", "yarn", "llama3"):
            if not _number(r.get("factor")) or not r["factor"] > 0:
                bad(f"rope_parameters.factor (rope_type {kind!r})", r.get("factor"), "is not a finite number > 0")
        theta = r.get("rope_theta")
        if theta is not None and (not _number(theta) or theta <= 0):
            bad("rope_parameters.rope_theta", theta, "is not a finite number > 0")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def load_tokenizer(files: ModelFiles):
    """The transformers tokenizer of the model, or None when the directory has none."""
    if files.is_gguf:
        cached = _gguf_cache(files)
        if cached is not None:  # the converted cache (valid: its hashes matched)
            from zoo.runtime.light_tokenizer import LightTokenizer

            tok = LightTokenizer.from_manifest(cached[0], cached[1].get("light"))  # (proved equal: no transformers)
            tok = tok if tok is not None else _cached_tokenizer(cached[0])  # else its own class, directly
            if tok is not None:
                return tok
    else:
        manifest = _dir_cache(files)
        if manifest is not None:
            from zoo.runtime.light_tokenizer import LightTokenizer

            tok = LightTokenizer.from_manifest(files.directory, manifest["light"])  # (None: not proved equal)
            if tok is not None:
                return tok
    directory, kw = _source_dir(files)
    from transformers import AutoTokenizer

    if not kw and not any((directory / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(directory, **kw)
    except Exception as e:  # a malformed tokenizer file is a usage error, one line
        raise ConfigError(f"{files.name}: the tokenizer cannot be read: {first_line(e)}") from None


def _cached_tokenizer(directory: Path):
    """The tokenizer of a GGUF cache entry by the class its tokenizer_config.json names, when that is the
    tokenizers-backed class (what AutoTokenizer would pick, without its config lookup); else None."""
    import json

    try:
        name = json.loads((directory / "tokenizer_config.json").read_bytes()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    if name not in FAST_TOKENIZERS or not (directory / "tokenizer.json").is_file():
        return None
    import transformers

    try:
        return getattr(transformers, name).from_pretrained(directory)
    except Exception:  # (AutoTokenizer, next, names what is wrong)
        return None


def load_generation_config(files: ModelFiles):
    if files.is_gguf or not (files.directory / "generation_config.json").exists():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(files.directory)


def load_processor(files: ModelFiles):
    """The checkpoint's own processor (AutoProcessor: image processor + tokenizer), or None without one."""
    if files.is_gguf or not any((files.directory / f).exists()
                                for f in ("preprocessor_config.json", "processor_config.json")):
        return None
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        return AutoProcessor.from_pretrained(files.directory)
    except (ImportError, ValueError, OSError, AttributeError):  # e.g. a video processor that wants torchvision:
        return AutoImageProcessor.from_pretrained(files.directory)  # the images' own, text expanded by the runtime
