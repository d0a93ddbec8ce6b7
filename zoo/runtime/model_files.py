"""Where a model's files are, and its config, generation config and tokenizer.

MODEL is None (the embedded default), a local directory in the Hugging Face layout, a .gguf file, or a
hub id resolved through the huggingface_hub cache (HF_HUB_OFFLINE honoured).

A GGUF file carries its config and tokenizer as metadata; transformers converts them in a few seconds
(it parses the whole vocabulary), so the converted files are kept in zoo.paths.cache_dir('gguf')/<key>/
(key: the file's path, size and mtime, and the transformers version) and read back from there.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from zoo import paths


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

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def name(self) -> str:
        """Short name to show: the hub id, or the file / directory name."""
        return self.model_id if not Path(self.model_id).is_absolute() else Path(self.model_id).name


def resolve_model(model: str | os.PathLike | None) -> ModelFiles:
    if model is None:
        from zoo.default_model import default_model_path

        return _gguf(default_model_path())
    path = Path(os.path.expanduser(str(model)))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFound(f"{path}: a model file must be a .gguf; for safetensors give the directory")
        return _gguf(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return _gguf(ggufs[0])
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path}: no config.json (not a Hugging Face model directory)")
        return ModelFiles(path, path, None, str(path.resolve()))
    name = str(model)
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise ModelNotFound(f"{name}: no such file or directory, and not a hub id of the form org/name")
    return ModelFiles(*(2 * [_from_hub(name)]), None, name)


def _gguf(path: Path) -> ModelFiles:
    path = path.resolve()
    return ModelFiles(path, path.parent, path.name, str(path))


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline))
    except Exception as e:
        where = "in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "on the hub"
        raise ModelNotFound(f"hub model {repo_id!r} is not available {where}: {type(e).__name__}: {e}") from None


# -- config, generation config, tokenizer --------------------------------------------------------------
def _gguf_cache(files: ModelFiles) -> Path | None:
    """The directory with this GGUF's converted config + tokenizer, converting on first use."""
    import transformers

    st = files.path.stat()
    key = hashlib.sha256(f"{files.path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode())
    out = paths.cache_dir("gguf") / key.hexdigest()[:24]
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    except OSError:
        return None  # read-only cache: convert every time
    try:
        kw = dict(gguf_file=files.gguf_file)
        transformers.AutoConfig.from_pretrained(files.directory, **kw).save_pretrained(tmp)
        transformers.AutoTokenizer.from_pretrained(files.directory, **kw).save_pretrained(tmp)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, out)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _source_dir(files: ModelFiles) -> tuple[Path, dict]:
    if files.is_gguf:
        cached = _gguf_cache(files)
        if cached is not None:
            return cached, {}
        return files.directory, {"gguf_file": files.gguf_file}
    return files.directory, {}


def load_config(files: ModelFiles):
    from transformers import AutoConfig

    directory, kw = _source_dir(files)
    try:
        return AutoConfig.from_pretrained(directory, **kw)
    except ValueError as e:  # e.g. a model_type transformers does not know
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(f"{files.name}: the config cannot be read: {first}") from e


def load_tokenizer(files: ModelFiles):
    """The transformers tokenizer of the model, or None when the directory has none."""
    from transformers import AutoTokenizer

    directory, kw = _source_dir(files)
    if not kw and not any((directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                              "tokenizer.model", "vocab.json")):
        return None
    return AutoTokenizer.from_pretrained(directory, **kw)


def load_generation_config(files: ModelFiles):
    if files.is_gguf or not (files.directory / "generation_config.json").exists():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(files.directory)
