"""Checkpoint sources: where tensors come from, read one at a time without loading a whole file.

    source = open_source("dir/" | "org/name" | "model.gguf" | "model.safetensors")
    source.keys() -> sorted keys;  source.info(key) -> TensorInfo(shape, dtype, file)
    source.get(key) -> tensor (memory-mapped, copy-on-write);  source.read_into(key, out) -> bytes read

Safetensors headers are parsed here (8-byte length + JSON), so a plan needs no tensor data, and a read
maps at most a 64 MiB window of one tensor's bytes and unmaps it after the copy into the destination (no
mapped pages stay resident): that keeps a load's peak memory at about the weight bytes.

A checkpoint is untrusted input. Before a file is opened: an index's shard names are plain file names (no
directory part, no '..'), each file is named directly in the checkpoint directory and is, symlinks followed
wherever they point, a regular file (no FIFO, no device, no directory; a dangling link is named as one).
Headers are checked as safetensors checks them (size capped, no duplicate keys, data contiguous and inside the
file, each tensor's bytes = shape x dtype size); every check runs once, from the headers, so a plan finds what
a load would. No message quotes a file's bytes.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import numpy
import torch

from loader.problems import Problem, SourceError
from loader.rules import Rules

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
SHARD_NAME = re.compile(r"-\d+-of-\d+\.(safetensors|bin)$")
WINDOW = 64 << 20  # bytes of a file mapped at once by read_into
PIECE = 1 << 20  # bytes read_into preads before handing them to each(), which finds them in the cache
HEADER_LIMIT = 100_000_000  # bytes of a safetensors header at most (safetensors' own limit)
INDEX_LIMIT = 64 << 20  # bytes of an index file at most
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str  # file name, relative to the source directory
    quant: object = None  # a loader.quant.QuantType: kept block-quantised (dtype: what it dequantises to)

    @property
    def nbytes(self) -> int:
        if self.quant is not None:
            from loader.quant import nbytes

            return nbytes(self.shape, self.quant)
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


class Source:
    """A set of named tensors on disk. Subclasses fill `_infos` and implement `get`."""

    kind = "source"

    def __init__(self, directory: Path, files: list[Path]):
        self.directory = Path(directory)  # where config.json and the tokenizer files live
        self.files = list(files)
        self.problems: list[Problem] = []  # source-level inconsistencies found when opening
        self.rules = Rules()  # rules this kind of file needs whatever the model (added by plan/load)
        self._infos: dict[str, TensorInfo] = {}

    def keys(self) -> list[str]:
        return sorted(self._infos)

    def info(self, key: str) -> TensorInfo:
        try:
            return self._infos[key]
        except KeyError:
            raise KeyError(f"checkpoint {self.directory} has no tensor {key!r}") from None

    def __contains__(self, key: str) -> bool:
        return key in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def get(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def read_into(self, key: str, out: torch.Tensor, each: Callable[[torch.Tensor], None] | None = None) -> int:
        """Copy tensor `key` into `out` (same shape, any dtype/device); returns the bytes read. each(part) is
        called on the parts of `out` as they are filled (here: once, on `out`; a source that reads in pieces
        calls it per piece, while the piece is still in the cache: the loader's NaN/Inf check)."""
        out.copy_(self.get(key))
        if each is not None:
            each(out)
        return self.info(key).nbytes

    def read_slice_into(self, key: str, out: torch.Tensor, dim: int, start: int, stop: int) -> int:
        """Copy `key`.narrow(dim, start, stop - start) into `out`; returns the bytes of the slice."""
        out.copy_(self.get(key).narrow(dim, start, stop - start))
        return _slice_bytes(self.info(key), dim, start, stop)

    def order(self, key: str) -> tuple:
        """A sort key that makes a stream read each file front to back."""
        return (self.info(key).file, 0)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.directory} ({len(self.files)} files, {len(self)} tensors)>"


class SafetensorsSource(Source):
    kind = "safetensors"

    def __init__(self, directory: Path, files: list[Path], index: Path | None = None, named: Path | None = None):
        super().__init__(directory, files)
        self._where: dict[str, tuple[Path, int, int]] = {}  # key -> (file, begin, end) in bytes
        weight_map = _weight_map(index) if index else None
        holdings, bad = {}, {}
        for f in files:
            if os.path.lexists(f):  # (a dangling link too: named as one when opened)
                holdings[f], bad[f] = _read_header(f, self.directory, trusted=f == named)
        key_file = _cross_check(self.directory, index, weight_map, {f: list(h) for f, h in holdings.items()},
                                files, self.problems)
        self.problems += [p for f in holdings for p in bad[f].values() if p.key is None]
        for key, f in key_file.items():
            if key in bad[f]:  # a lying header entry: reported, never read
                self.problems.append(bad[f][key])
                continue
            dtype, shape, begin, end = holdings[f][key]
            self._infos[key] = TensorInfo(shape, dtype, _rel(f, self.directory))
            self._where[key] = (f, begin, end)

    def order(self, key: str) -> tuple:
        f, begin, _ = self._where[key]
        return (str(f), begin)

    def get(self, key: str) -> torch.Tensor:
        """The tensor, backed by a private (copy-on-write) mapping of just its bytes in the file."""
        info = self.info(key)
        _, begin, end = self._where[key]
        if end == begin:
            return torch.empty(info.shape, dtype=info.dtype)
        return _typed(self._map(key), info)

    def read_into(self, key: str, out: torch.Tensor, each: Callable[[torch.Tensor], None] | None = None) -> int:
        """Copy (and cast) the tensor into `out` through mappings of at most WINDOW bytes each, unmapped
        at once: a load never holds more than a window of mapped file pages on top of its weights.
        each(part): called on each block of rows of `out` once it is filled (Source.read_into)."""
        info = self.info(key)
        _, begin, end = self._where[key]
        if end == begin:
            return 0
        if out.device.type == "cpu" and out.dtype == info.dtype and out.is_contiguous():
            # pread straight into the destination: one kernel copy from the page cache, no mapping of the
            # source and no user-space page faults (the reader threads overlap the destination's faults);
            # in blocks of rows of about PIECE bytes, each handed to each() while it is still in the cache
            path, _, _ = self._where[key]
            dst = memoryview(out.view(-1).view(torch.uint8).numpy())
            fd = self._fd(path)
            rows = out.shape[0] if out.dim() > 1 else 1
            row_bytes = (end - begin) // rows
            step = max(1, PIECE // row_bytes) * row_bytes
            for start in range(0, end - begin, step):
                stop, done = min(start + step, end - begin), start
                while done < stop:
                    n = os.preadv(fd, [dst[done:stop]], begin + done)
                    if n == 0:
                        raise SourceError([Problem("file", key, info.file, None,
                                                   f"{info.file} ends inside {key} (truncated file)")])
                    done += n
                if each is not None:
                    each(out[start // row_bytes: stop // row_bytes] if out.dim() > 1 else out)
            return end - begin
        rows = info.shape[0] if info.shape else 1
        row_bytes = (end - begin) // max(rows, 1)
        step = max(1, WINDOW // max(row_bytes, 1))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            with self._window(key, begin + r * row_bytes, begin + (r + n) * row_bytes) as src:
                part = _typed(src, TensorInfo((n, *info.shape[1:]) if info.shape else (), info.dtype, info.file))
                (out[r: r + n] if info.shape else out).copy_(part)
        if each is not None:
            each(out)
        return end - begin

    def read_slice_into(self, key: str, out: torch.Tensor, dim: int, start: int, stop: int) -> int:
        """Tensor parallelism: only the slice is copied, through safetensors' get_slice (a strided view over the
        mapped file). A dim-0 slice reads its own rows; a dim-1 slice still pages in the whole tensor."""
        from safetensors import safe_open

        path, _, _ = self._where[key]
        info = self.info(key)
        index = tuple(slice(None) for _ in range(dim)) + (slice(start, stop),)
        try:
            with safe_open(str(path), framework="pt") as f:
                out.copy_(f.get_slice(key)[index])
        except Exception as e:  # noqa: BLE001 - OSError, or safetensors' SafetensorError
            raise SourceError([Problem("file", key, info.file, None, f"{key} in {info.file}: its slice "
                                       f"{dim}:{start}:{stop} cannot be read ({type(e).__name__}: {e})")]) from None
        return _slice_bytes(info, dim, start, stop)

    def _fd(self, path: Path) -> int:
        fds = self.__dict__.setdefault("_fds", {})
        if path not in fds:
            fds[path] = _open_regular(path, _rel(path, self.directory))
        return fds[path]

    def close(self) -> None:
        for fd in self.__dict__.pop("_fds", {}).values():
            os.close(fd)

    def __del__(self):
        self.close()

    @contextlib.contextmanager
    def _window(self, key: str, begin: int, end: int):
        src = self._map(key, begin, end)
        m = src._zoo_mapping
        try:
            yield src
        finally:
            del src
            try:
                m.close()
            except BufferError:  # still viewed somewhere: unmapped when that goes
                pass

    def _map(self, key: str, begin: int | None = None, end: int | None = None) -> torch.Tensor:
        f, b, e = self._where[key]
        begin, end = (b, e) if begin is None else (begin, end)
        try:
            return _map(f, begin, end)
        except (ValueError, OSError) as e:
            file = self.info(key).file
            raise SourceError([Problem("file", key, file, None, f"{key}: bytes {begin}:{end} of {file} "
                                       f"cannot be read ({type(e).__name__}: {e}); is the file truncated?")]) from e


def _slice_bytes(info: TensorInfo, dim: int, start: int, stop: int) -> int:
    return info.nbytes // max(info.shape[dim], 1) * (stop - start) if info.shape else info.nbytes


def _map(f: Path, begin: int, end: int) -> torch.Tensor:
    """Bytes [begin, end) of file f as a uint8 tensor over a private mapping (kept alive by the tensor)."""
    start = begin - begin % mmap.ALLOCATIONGRANULARITY
    with open(f, "rb") as fh:
        m = mmap.mmap(fh.fileno(), end - start, offset=start, access=mmap.ACCESS_COPY)
    if hasattr(mmap, "MADV_SEQUENTIAL"):
        m.madvise(mmap.MADV_SEQUENTIAL)
    t = torch.frombuffer(m, dtype=torch.uint8, count=end - begin, offset=begin - start)
    t._zoo_mapping = m  # (frombuffer keeps `m` alive; read_into finds it here to unmap it at once)
    return t


def _typed(raw: torch.Tensor, info: TensorInfo) -> torch.Tensor:
    """uint8 bytes -> the tensor they hold (copied first when the bytes are not aligned to the dtype)."""
    if raw.data_ptr() % info.dtype.itemsize:
        raw = raw.clone()
    return raw.view(info.dtype).view(info.shape)


class BinSource(Source):
    """PyTorch pickles, read with torch.load(weights_only=True, mmap=True); only with allow_bin=True."""

    kind = "bin"

    def __init__(self, directory: Path, files: list[Path], index: Path | None = None):
        super().__init__(directory, files)
        self._dicts: dict[Path, dict] = {}
        for f in files:
            if os.path.lexists(f):
                os.close(_open_regular(f, _rel(f, self.directory), self.directory))
                sd = _torch_load(f, _rel(f, self.directory))
                self._dicts[f] = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
        weight_map = _weight_map(index) if index else None
        key_file = _cross_check(self.directory, index, weight_map, {f: list(d) for f, d in self._dicts.items()},
                                files, self.problems)
        self._file_of = key_file
        for key, f in key_file.items():
            t = self._dicts[f][key]
            self._infos[key] = TensorInfo(tuple(t.shape), t.dtype, _rel(f, self.directory))

    def get(self, key: str) -> torch.Tensor:
        self.info(key)
        return self._dicts[self._file_of[key]][key]


def _torch_load(f: Path, name: str) -> dict:
    """torch.load(weights_only=True): a pickle that would build anything but tensors (run code) is refused."""
    try:
        try:
            sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (pre-zip) format cannot be mapped
            sd = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # (UnpicklingError for a payload; the message would quote the file: not shown)
        raise SourceError([], f"{name}: torch.load(weights_only=True) refuses it ({type(e).__name__}): it holds "
                              f"more than tensors, or is not a PyTorch checkpoint") from None
    if not isinstance(sd, dict):
        raise SourceError([], f"{name}: holds a {type(sd).__name__}, not a dict of tensors")
    return sd


def open_source(path_or_hub_id, *, allow_bin: bool = False, cache_dir=None, revision: str | None = None,
                strict: bool = True, quantized: bool = False) -> Source:
    """A Source for a local directory or file (safetensors, sharded safetensors, .gguf, .bin with
    allow_bin=True) or a hub id resolved through the huggingface_hub cache (HF_HUB_OFFLINE honoured).

    strict=True raises SourceError when the files disagree with each other (index vs shards); with
    strict=False those problems stay in `source.problems` (plan() and load() report them with the rest).
    quantized=True: a GGUF's block-quantised tensors stay quantised (loader/quant.py); a type without
    kernels is a problem naming the tensor. Only for a GGUF file (a SourceError otherwise).
    """
    if isinstance(path_or_hub_id, Source):
        return path_or_hub_id
    path = Path(os.path.expanduser(str(path_or_hub_id)))
    if not path.exists():
        if not _looks_like_hub_id(str(path_or_hub_id)):
            raise SourceError([], f"{path_or_hub_id}: no such file or directory (and not a hub id 'org/name')")
        path = _from_hub(str(path_or_hub_id), allow_bin=allow_bin, cache_dir=cache_dir, revision=revision)
    source = _open_local(path, allow_bin, quantized)
    if quantized and source.kind != "gguf":
        raise SourceError([], f"{path}: quantized=True keeps a GGUF file's blocks; this is a {source.kind} "
                              f"checkpoint")
    if strict and source.problems:
        raise SourceError(source.problems, f"checkpoint {path} is inconsistent")
    return source


def _open_local(path: Path, allow_bin: bool, quantized: bool = False) -> Source:
    if path.is_file():
        if path.suffix == ".gguf":
            from loader.gguf import GGUFSource  # the gguf package is imported only for GGUF files

            return GGUFSource(path, quantized=quantized)
        if path.suffix == ".safetensors":
            return SafetensorsSource(path.parent, [path], named=path)
        if path.name.endswith(".safetensors.index.json"):
            return SafetensorsSource(path.parent, _index_files(path), index=path)
        if path.suffix in (".bin", ".pt", ".pth") or path.name.endswith(".bin.index.json"):
            return _open_bin(path.parent, allow_bin, path)
        raise SourceError([], f"{path}: not a checkpoint file (.safetensors, .gguf, .bin)")
    index = path / "model.safetensors.index.json"
    if index.exists():
        return SafetensorsSource(path, _index_files(index, also=sorted(path.glob("*.safetensors"))), index=index)
    if (path / "model.safetensors").exists():
        return SafetensorsSource(path, [path / "model.safetensors"])
    if st := sorted(path.glob("*.safetensors")):
        return SafetensorsSource(path, st)
    if (path / "pytorch_model.bin.index.json").exists() or sorted(path.glob("*.bin")):
        return _open_bin(path, allow_bin, None)
    if len(ggufs := sorted(path.glob("*.gguf"))) == 1:
        check_file(ggufs[0], path)  # (found in the directory, not named: a regular file, links followed)
        return _open_local(ggufs[0], allow_bin, quantized)
    raise SourceError([], f"no weights in {path}: looked for model.safetensors, model.safetensors.index.json, "
                          f"*.safetensors, one *.gguf (and pytorch_model*.bin with allow_bin=True)")


def _open_bin(directory: Path, allow_bin: bool, file: Path | None) -> BinSource:
    index = directory / "pytorch_model.bin.index.json"
    if file is not None and file.name.endswith(".index.json"):
        index, file = file, None
    if file is not None:
        files, index = [file], None
    elif index.exists():
        files = _index_files(index, also=sorted(directory.glob("*.bin")))
    else:
        files, index = sorted(directory.glob("*.bin")), None
    names = ", ".join(_rel(f, directory) for f in files) or _rel(index, directory)
    if not allow_bin:
        raise SourceError([], f"{directory} holds PyTorch pickle weights ({names}), which can run code when "
                              f"loaded; refused. Pass allow_bin=True to read them with "
                              f"torch.load(weights_only=True), or convert them to safetensors")
    return BinSource(directory, files, index=index)


# -- untrusted files: where they are, what they are ----------------------------------------------------
def check_file(f: Path, directory: Path, name: str | None = None) -> None:
    """Refuse (SourceError) a file of the checkpoint in `directory` that is not named directly in it (a '..' or a
    subdirectory in the name), or that is not a regular file; nothing is opened. A symlink is followed wherever it
    points, as transformers and vLLM follow it (weights kept on shared storage, linked from a cache, a hub
    snapshot's links into its blobs/): only its target's kind is checked, and a dangling link is named as one."""
    name = name or _rel(f, directory)
    if os.path.dirname(os.path.abspath(f)) != os.path.abspath(directory):
        raise SourceError([], f"{name} is not a file directly in {directory}: refused, nothing was opened")
    try:
        mode = os.stat(f).st_mode
    except FileNotFoundError:
        if os.path.islink(f):
            raise SourceError([], f"{name} in {directory} is a symbolic link to nothing (its target does not "
                                  f"exist): refused") from None
        raise SourceError([], f"{name} is not in {directory}") from None
    except OSError as e:  # a link loop, a permission
        raise SourceError([], f"{name} in {directory} cannot be read ({e.strerror or type(e).__name__})") from None
    _check_regular(mode, name)


def _check_regular(mode: int, name: str) -> None:
    if not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "special"
        raise SourceError([], f"{name} is {what}, not a regular file: refused")


def _open_regular(f: Path, name: str, directory: Path | None = None) -> int:
    """A read-only descriptor of f, refused (SourceError) unless it is a regular file (inside `directory` when
    given). Opened non-blocking, so a FIFO cannot hang the open, and checked with fstat before any read."""
    if directory is not None:
        check_file(f, directory, name)
    try:
        fd = os.open(f, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise SourceError([], f"{name}: cannot be opened ({e.strerror or type(e).__name__})") from None
    try:
        _check_regular(os.fstat(fd).st_mode, name)
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def plain_name(v) -> bool:
    """Whether an index value is a plain file name (no directory part, no '..', no absolute path)."""
    return (isinstance(v, str) and v not in ("", ".", "..") and "/" not in v and "\\" not in v and "\0" not in v
            and not re.match(r"^[A-Za-z]:", v))


def _say(v, n: int = 60) -> str:
    """repr of a value from an untrusted file, cut to n characters."""
    r = repr(v)
    return r if len(r) <= n else r[: n - 5] + "...'" if r[:1] in "'\"" else r[: n - 3] + "..."


def _json_type(v) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


class _DuplicateKey(ValueError):
    def __init__(self, key):
        super().__init__(key)
        self.key = key


def _object(pairs: list) -> dict:
    """json object_pairs_hook: a JSON object whose key appears twice is refused (json would keep the last)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return d


def _parse_json(raw: bytes, name: str, what: str):
    try:
        return json.loads(raw, object_pairs_hook=_object)
    except _DuplicateKey as e:
        raise SourceError([Problem("duplicate", e.key, name, None, f"{_say(e.key)} appears twice in {what} of {name}")],
                          f"{name}: {what} with a duplicate key") from None
    except RecursionError:
        raise SourceError([], f"{name}: {what} nests JSON too deeply to be read") from None
    except ValueError as e:  # (UnicodeDecodeError too); json's message names a position, never the text
        raise SourceError([], f"{name}: {what} is not JSON: {e}") from None


def _read_json_file(f: Path, name: str, limit: int, what: str, directory: Path | None = None):
    fd = _open_regular(f, name, directory)
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise SourceError([], f"{name}: {size} bytes, more than the {limit >> 20} MiB an index may hold")
        return _parse_json(fh.read(limit + 1), name, what)


def _read_header(f: Path, directory: Path, trusted: bool = False) -> tuple[dict[str, tuple], dict[str, Problem]]:
    """(key -> (dtype, shape, begin, end) with byte offsets absolute in the file, key -> the problem of a lying
    entry), checked as safetensors checks a file; a header that cannot be read at all is a SourceError naming
    the file (and the key). `trusted`: the file the caller named, which may live anywhere."""
    name = _rel(f, directory)
    fd = _open_regular(f, name, None if trusted else directory)
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        raw = fh.read(8)
        if len(raw) < 8:
            raise SourceError([], f"{name}: not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", raw)
        if n > HEADER_LIMIT:
            raise SourceError([], f"{name}: the header length field says {n} bytes, more than safetensors' limit "
                                  f"of {HEADER_LIMIT // 1_000_000} MB: not a safetensors file, or corrupt")
        if 8 + n > size:
            raise SourceError([], f"{name}: the header claims {n} bytes but the file holds {size}: not a "
                                  f"safetensors file, or truncated")
        header = _parse_json(fh.read(n), name, "the safetensors header")
    if not isinstance(header, dict):
        raise SourceError([], f"{name}: the safetensors header is a JSON {type(header).__name__}, not an object")
    out = {}
    for key, h in header.items():
        if key == "__metadata__":
            continue
        bad = lambda why: SourceError([Problem("file", key, name, None, f"{key} in {name}: {why}")],  # noqa: E731
                                      f"{name}: malformed safetensors header")
        if not isinstance(h, dict):
            raise bad(f"the header entry is a JSON {type(h).__name__}, not an object")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in h:
                raise bad(f"the header entry has no {field!r}")
        if not isinstance(h["dtype"], str) or h["dtype"] not in SAFETENSORS_DTYPES:
            raise bad(f"dtype {_say(h['dtype'])}, which torch cannot hold")
        shape, offsets = h["shape"], h["data_offsets"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"shape {_say(shape)} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"data_offsets {_say(offsets)} are not [begin, end] with 0 <= begin <= end")
        out[key] = (SAFETENSORS_DTYPES[h["dtype"]], tuple(shape), *offsets)
    problems = _check_offsets(name, out, size - 8 - n)
    return {k: (dt, sh, 8 + n + b, 8 + n + e) for k, (dt, sh, b, e) in out.items()}, problems


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_offsets(name: str, entries: dict[str, tuple], data_size: int) -> dict[str, Problem]:
    """key -> problem for each entry whose data lies, as safetensors validates a file: sorted by offset, each
    tensor starts where the previous one ends and holds exactly shape x dtype-size bytes, and the last one
    ends where the file does (key None: a file-level problem, such as bytes no tensor holds)."""
    bad: dict[str, Problem] = {}

    def flag(key, why):
        bad.setdefault(key, Problem("file", key, name, None, f"{key} in {name}: {why}"))

    expected, prev = 0, None
    for key, (dtype, shape, begin, end) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        nbytes = TensorInfo(shape, dtype, name).nbytes
        if end - begin != nbytes:
            flag(key, f"the header says {end - begin} bytes for {list(shape)} {_dt(dtype)}, which is {nbytes} bytes")
        if end > data_size:
            flag(key, f"data_offsets [{begin}, {end}] run past the end of the file's {data_size} data bytes "
                      f"(truncated, or a lying header)")
        elif begin < expected:
            flag(key, f"data_offsets [{begin}, {end}] overlap those of {prev}, which end at {expected}")
        elif begin > expected:
            flag(key, f"data_offsets [{begin}, {end}] leave {begin - expected} bytes after "
                      f"{prev if prev else 'the header'} that no tensor holds")
        if end > expected:
            expected, prev = end, key
    if expected < data_size and not bad:
        bad[None] = Problem("file", None, name, None, f"{name}: {data_size - expected} bytes after the last "
                                                      f"tensor's data that no tensor holds (a lying header?)")
    return bad


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _weight_map(index: Path) -> dict[str, str]:
    """The index's key -> shard file map; refused (SourceError, nothing else opened) unless it is a JSON object
    with a weight_map of plain file names."""
    name = index.name
    data = _read_json_file(index, name, INDEX_LIMIT, "the index", index.parent)
    if not isinstance(data, dict):
        raise SourceError([], f"{name}: the index is a JSON {_json_type(data)}, not an object with a weight_map")
    if "weight_map" not in data:
        raise SourceError([], f"{name}: the index has no weight_map")
    wm = data["weight_map"]
    if not isinstance(wm, dict):
        raise SourceError([], f"{name}: weight_map is a JSON {_json_type(wm)}, not an object (key -> shard file)")
    for k, v in wm.items():
        if not isinstance(v, str):
            raise SourceError([], f"{name}: weight_map[{_say(k)}] is a JSON {_json_type(v)}, not a shard file name")
        if not plain_name(v):
            raise SourceError([], f"{name}: weight_map[{_say(k)}] names the shard {_say(v)}, which is not a plain "
                                  f"file name in {index.parent}: refused, nothing was opened")
    return wm


def _index_files(index: Path, also: list[Path] = ()) -> list[Path]:
    """The shards an index names, plus other files of the same kind in the directory (checked too)."""
    named = {index.parent / f for f in _weight_map(index).values()}
    return sorted(named | {f for f in also if SHARD_NAME.search(f.name)})


def _cross_check(directory: Path, index: Path | None, weight_map: dict[str, str] | None,
                 holdings: dict[Path, list[str]], files: list[Path], problems: list[Problem]) -> dict[str, Path]:
    """key -> the file that holds it; every disagreement between the index and the files is a problem."""
    where: dict[str, list[Path]] = {}
    for f, keys in holdings.items():
        for k in keys:
            where.setdefault(k, []).append(f)
    iname = _rel(index, directory) if index else None
    if weight_map is not None:
        listed = {directory / f for f in weight_map.values()}
        for f in sorted(listed):
            if not f.exists():
                ks = sorted(k for k, v in weight_map.items() if directory / v == f)
                problems.append(Problem("file", ks[0], _rel(f, directory), None,
                    f"{_rel(f, directory)} is listed in {iname} (for {len(ks)} keys: {_some(ks)}) "
                    f"but is not in {directory}"))
        for f in files:  # (other safetensors files, e.g. a consolidated.safetensors, are not shards)
            if f.exists() and f not in listed and SHARD_NAME.search(f.name):
                ks = holdings.get(f, [])
                problems.append(Problem("file", None, _rel(f, directory), None,
                    f"{_rel(f, directory)} is in {directory} but not listed in {iname}; "
                    f"its {len(ks)} tensors ({_some(ks)}) would be ignored"))
        for k, v in weight_map.items():
            f = directory / v
            if f.exists() and f not in where.get(k, []):
                problems.append(Problem("file", k, v, None, f"{k}: {iname} says {v} holds it, but {v} does not"))
    key_file = {}
    for k, fs in where.items():
        if len(fs) > 1:
            names = [_rel(f, directory) for f in fs]
            problems.append(Problem("duplicate", k, ", ".join(names), None,
                f"{k} is in {len(fs)} files: {' and '.join(names)}"))
        chosen = fs[0]
        if weight_map is not None:
            if k not in weight_map:
                if fs[0] in listed:  # (a file the index does not list is reported once, above)
                    problems.append(Problem("file", k, _rel(fs[0], directory), None,
                        f"{k} is in {_rel(fs[0], directory)} but not in {iname}"))
            elif directory / weight_map[k] in fs:
                chosen = directory / weight_map[k]
        key_file[k] = chosen
    return key_file


def _from_hub(repo_id: str, *, allow_bin: bool, cache_dir, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub import constants

    try:
        # the small files first; then, when an index names the shards, only those (a repo may also hold
        # the same weights in another layout, such as a consolidated.safetensors)
        kw = dict(revision=revision, cache_dir=cache_dir)
        path = Path(snapshot_download(repo_id, allow_patterns=[p for p in HUB_PATTERNS if "safetensors" not in p], **kw))
        for index_name, kind in (("model.safetensors.index.json", "*.safetensors"), ("pytorch_model.bin.index.json", "*.bin")):
            if (path / index_name).exists() and (kind != "*.bin" or allow_bin):
                shards = sorted(set(_weight_map(path / index_name).values()))
                return Path(snapshot_download(repo_id, allow_patterns=shards, **kw))
        patterns = ["*.safetensors"] + (["*.bin"] if allow_bin else [])
        return Path(snapshot_download(repo_id, allow_patterns=patterns, **kw))
    except Exception as e:
        where = cache_dir or constants.HF_HUB_CACHE
        offline = " (HF_HUB_OFFLINE is set: only the local cache is searched)" if constants.HF_HUB_OFFLINE else ""
        raise SourceError([], f"hub model {repo_id!r} (revision {revision or 'main'}) is not available in the "
                              f"cache {where}{offline}: {type(e).__name__}: {e}") from e


def _looks_like_hub_id(s: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", s) is not None


def _rel(f: Path, directory: Path) -> str:
    try:
        return str(Path(f).relative_to(directory))
    except ValueError:
        return str(f)


def _some(keys: list[str], n: int = 3) -> str:
    return ", ".join(keys[:n]) + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")
