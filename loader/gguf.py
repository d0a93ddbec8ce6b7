"""GGUF files (llama.cpp) as a Source under Hugging Face Llama names, dequantised to float32.

Shapes: GGUF lists dims fastest-first, so a GGUF [in, out] is the torch [out, in]; the numpy arrays of
the `gguf` package are already in torch order. llama.cpp's converter permutes the rows of q_proj/k_proj
within each head, (half, 2) -> (2, half) read as rows, so that rotary pairs sit side by side; we undo it
for the Llama architecture, with the head counts from the file's metadata. Gemma2/Gemma3 files name the
norms around both sublayers (`ffn_norm` is the MLP's pre-norm there) and store every (1 + w) norm weight
as w + 1; we subtract the 1 again, tensor for tensor as transformers' GGUF loader does.

A GGUF file is untrusted input: check_header() walks its whole header (magic, version, every metadata
value, every tensor's dims, type and data range) with bounds checks before transformers (which converts the
config from it) parses anything, so a malformed file is one SourceError naming the file and the key, never a
struct.error, a reshape error or a huge allocation. GGUFSource reads its tensor table from that same walk
(one pass over the header; the `gguf` package's reader would parse the whole vocabulary into numpy
arrays, seconds per start) and its tensors straight from a read-only mapping; the `gguf` package only
dequantises.
"""
from __future__ import annotations

import functools
import math
import mmap
import os
import re
import struct
from pathlib import Path

import torch

from loader.problems import Problem, SourceError
from loader.quant import QUANT_TYPES
from loader.rules import Ignore, Rules
from loader.sources import Source, TensorInfo, _open_regular, _say

VERSIONS = (2, 3)  # v1 (32-bit counts) is not read
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 8  # arrays of arrays, at most this deep
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")

# GGUF name (after `blk.{i}.`) -> Hugging Face name (after `model.layers.{i}.`)
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# Architectures whose layers are normed on the way in and out of both sublayers (gguf's tensor map)
SANDWICH_NAMES = {**LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                  "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
ARCH_LAYER_NAMES = {"gemma2": SANDWICH_NAMES, "gemma3": SANDWICH_NAMES}
# Architectures whose converter stores (1 + w) norm weights as w + 1: transformers' GGUF loader subtracts 1
# from every tensor whose GGUF name holds "norm.weight" (its Gemma2TensorProcessor, gemma2 and gemma3)
NORM_SHIFTED_ARCHS = ("gemma2", "gemma3")
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16
PERMUTED_ARCHS = ("llama",)  # architectures whose converter permutes q/k rows
# Tensors llama.cpp adds that a HF model computes itself; plan() and load() add these rules to a model's.
GGUF_RULES = Rules(ignores=(Ignore(r"^rope_freqs\.weight$", "llama.cpp's rope frequency factors; "
                                                              "the model computes them from the config"),))


# The types zoo runs (plain floats, the block types with kernels): their sizes without importing the gguf package
# (~0.4 s); any other type is looked up in the gguf package's tables (supported_types).
FLOAT_NAMES = {0: "F32", 1: "F16", 30: "BF16"}
FAST_TYPES = {0: (1, 4), 1: (1, 2), 30: (1, 2), **{code: (t.block, t.block_bytes) for code, t in QUANT_TYPES.items()}}


@functools.lru_cache(maxsize=None)
def supported_types() -> dict[int, tuple[int, int]]:
    """GGML tensor type -> (block elements, block bytes) for the types GGUFSource can read (plain floats and
    the quantisations the gguf package dequantises)."""
    import gguf

    q = gguf.GGMLQuantizationType
    readable = {q.F32, q.F16, q.BF16} | set(gguf.quants._type_traits)
    return {int(t): gguf.GGML_QUANT_SIZES[t] for t in readable if t in gguf.GGML_QUANT_SIZES}


class _Reader:
    """Bounds-checked little-endian reads from a byte buffer; running out is a SourceError, not struct.error."""

    def __init__(self, buf, name: str):
        self.buf, self.pos, self.name = buf, 0, name

    def left(self) -> int:
        return len(self.buf) - self.pos

    def skip(self, n: int, what: str) -> int:
        if n > self.left():
            raise SourceError([], f"{self.name}: truncated GGUF file: it ends inside {what}")
        self.pos += n
        return self.pos - n

    def unpack(self, fmt: str, what: str):
        return struct.unpack_from(fmt, self.buf, self.skip(struct.calcsize(fmt), what))[0]

    def string(self, what: str, text: bool = True) -> str | None:
        n = self.unpack("<Q", what)
        if n > self.left():
            raise SourceError([], f"{self.name}: {what} claims a string of {n} bytes, more than the {self.left()} "
                                  f"left in the file")
        at = self.skip(n, what)
        if not text:
            return None
        try:
            return bytes(self.buf[at:at + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError([], f"{self.name}: {what} is not UTF-8 text") from None

    def unique(self, seen: set, what: str, label: str) -> str:
        """A string that must not repeat one already in `seen` (a metadata key, a tensor name)."""
        s = self.string(what)
        if s in seen:
            raise SourceError([], f"{self.name}: {label} {_say(s)} appears twice")
        seen.add(s)
        return s

    def value(self, kind: int, what: str, depth: int = 0, text: bool = False):
        """Skip one metadata value, returning it when it is a scalar (or, with `text`, a string); arrays are
        skipped (None)."""
        if kind in SCALARS:
            return self.unpack(SCALARS[kind], what)
        if kind == STRING:
            return self.string(what, text=text)
        if kind != ARRAY:
            raise SourceError([], f"{self.name}: {what} has value type {kind}, which GGUF does not define")
        if depth >= MAX_NESTING:
            raise SourceError([], f"{self.name}: {what} nests arrays more than {MAX_NESTING} deep")
        item, count = self.unpack("<I", what), self.unpack("<Q", what)
        least = struct.calcsize(SCALARS[item]) if item in SCALARS else 8 if item == STRING else 12
        if count * least > self.left():
            raise SourceError([], f"{self.name}: {what} claims {count} array items, more than the {self.left()} "
                                  f"bytes left in the file can hold")
        if item in SCALARS:
            self.skip(count * least, what)
        elif item == STRING:  # (a vocabulary: 10^5 strings; one tight loop, the checks of string())
            self._skip_strings(count, what)
        else:
            for _ in range(count):
                self.value(item, what, depth + 1)
        return None

    def _skip_strings(self, count: int, what: str) -> None:
        buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        try:
            for _ in range(count):
                if pos + 8 > end:
                    raise SourceError([], f"{self.name}: truncated GGUF file: it ends inside {what}")
                n = length(buf, pos)[0]
                pos += 8
                if n > end - pos:
                    raise SourceError([], f"{self.name}: {what} claims a string of {n} bytes, more than the "
                                          f"{end - pos} left in the file")
                pos += n
        finally:
            self.pos = pos


def check_header(path: Path, name: str | None = None) -> int:
    """Refuse (SourceError naming the file and the key) a GGUF file whose header is malformed or lies: bad
    magic, an unsupported version, counts, strings or arrays larger than the file, unknown value or tensor
    types, more than 4 dims, duplicate keys or tensor names, tensor data outside the file or overlapping.
    Reads only the header pages; allocates nothing in proportion to what the header claims. Returns the
    header's length in bytes (metadata and tensor table, before the aligned tensor data)."""
    name = name or Path(path).name
    fd = _open_regular(Path(path), name)
    try:
        size = os.fstat(fd).st_size
        if size < 24:
            raise SourceError([], f"{name}: not a GGUF file ({size} bytes, shorter than a GGUF header)")
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as buf:
            r = _Reader(buf, name)
            _check(r, size)
            return r.pos
    finally:
        os.close(fd)


def _check(r: _Reader, size: int, keep: bool = False) -> tuple[dict, list[tuple[str, list[int], int, int]]]:
    """Walk and check the header; returns (metadata: the scalar and, with `keep`, string values by key;
    tensors: (name, GGUF dims fastest-first, GGML type, absolute data offset) in header order)."""
    name = r.name
    if bytes(r.buf[:4]) != b"GGUF":
        raise SourceError([], f"{name}: not a GGUF file (its first bytes are not the GGUF magic)")
    r.pos = 4
    version = r.unpack("<I", "the version")
    if version & 0xFFFF == 0 and version:
        raise SourceError([], f"{name}: a big-endian GGUF file, which is not supported")
    if version not in VERSIONS:
        raise SourceError([], f"{name}: GGUF version {version} is not supported (versions {VERSIONS})")
    n_tensors, n_kv = r.unpack("<Q", "the tensor count"), r.unpack("<Q", "the metadata count")
    if n_kv * 12 > r.left() or n_tensors * 24 > r.left():
        raise SourceError([], f"{name}: the header claims {n_tensors} tensors and {n_kv} metadata entries, more "
                              f"than its {size} bytes can describe")
    keys, alignment, metadata = set(), 32, {}
    for i in range(n_kv):
        key = r.unique(keys, f"metadata key {i}", "metadata key")
        kind = r.unpack("<I", f"metadata {_say(key)}")
        v = metadata[key] = r.value(kind, f"metadata {_say(key)}", text=keep)
        if key == "general.alignment":
            if kind != 4 or not v or v & (v - 1):
                raise SourceError([], f"{name}: metadata general.alignment must be a uint32 power of two")
            alignment = v
    tensors, names = [], set()
    for i in range(n_tensors):
        t = r.unique(names, f"the name of tensor {i}", "tensor")
        n_dims = r.unpack("<I", f"tensor {_say(t)}")
        if n_dims > MAX_DIMS:
            raise SourceError([], f"{name}: tensor {_say(t)} has {n_dims} dims (GGUF allows at most {MAX_DIMS})")
        dims = [r.unpack("<Q", f"tensor {_say(t)}") for _ in range(n_dims)]
        kind, offset = r.unpack("<I", f"tensor {_say(t)}"), r.unpack("<Q", f"tensor {_say(t)}")
        sizes = FAST_TYPES.get(kind) or supported_types().get(kind)
        if sizes is None:
            raise SourceError([], f"{name}: tensor {_say(t)} has GGML type {kind}, which the loader cannot read "
                                  f"(readable: {', '.join(_type_name(k) for k in sorted(supported_types()))})")
        block, block_bytes = sizes
        n = math.prod(dims)
        if dims and dims[0] % block:
            raise SourceError([], f"{name}: tensor {_say(t)} has {dims[0]} elements per row, not a multiple of its "
                                  f"{_type_name(kind)} block of {block}")
        if offset % alignment:
            raise SourceError([], f"{name}: tensor {_say(t)}: its data offset {offset} is not a multiple of the "
                                  f"alignment {alignment}")
        tensors.append((offset, offset + n // block * block_bytes, t, dims, kind))
    data = r.pos + (-r.pos) % alignment
    prev_end, prev = 0, None
    for begin, end, t, _, _ in sorted(tensors):
        if data + end > size:
            raise SourceError([], f"{name}: tensor {_say(t)}: its data (bytes {data + begin}:{data + end}) runs past "
                                  f"the end of the file ({size} bytes): truncated, or a lying header")
        if begin < prev_end:
            raise SourceError([], f"{name}: tensor {_say(t)}: its data overlaps that of {_say(prev)}")
        prev_end, prev = end, t
    return ({k: v for k, v in metadata.items() if v is not None},
            [(t, dims, kind, data + begin) for begin, _, t, dims, kind in tensors])


def _type_name(kind: int) -> str:
    if kind in FLOAT_NAMES or kind in QUANT_TYPES:
        return FLOAT_NAMES.get(kind) or QUANT_TYPES[kind].name
    import gguf

    try:
        return gguf.GGMLQuantizationType(kind).name
    except ValueError:
        return str(kind)


def hf_name(name: str, arch: str = "") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (the names of the file's
    `general.architecture`); unknown names stay as they are."""
    names = ARCH_LAYER_NAMES.get(arch, LAYER_NAMES)
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name):
        if m[2] in names:
            return f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"
    if m := re.fullmatch(r"(\w+)\.(weight|bias)", name):
        if m[1] in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[m[1]]}.{m[2]}"
    return name


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation: rows of each head go from (half, 2) back to (2, half)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFSource(Source):
    kind = "gguf"

    def __init__(self, path: Path, *, quantized: bool = False):
        super().__init__(path.parent, [path])
        self.quantized = quantized  # block-quantised tensors kept as blocks (loader/quant.py)
        self.rules = GGUF_RULES
        fd = _open_regular(Path(path), path.name)
        try:
            size = os.fstat(fd).st_size
            if size < 24:
                raise SourceError([], f"{path.name}: not a GGUF file ({size} bytes, shorter than a GGUF header)")
            self._buf = mmap.mmap(fd, size, access=mmap.ACCESS_READ)  # (kept open by the mapping, not the fd)
        finally:
            os.close(fd)
        # metadata: every scalar and string value (arrays, such as the vocabulary, are skipped, not parsed)
        self.metadata, tensors = _check(_Reader(self._buf, path.name), size, keep=True)
        self.architecture = str(self.metadata.get("general.architecture", ""))
        arch = self.architecture
        self.n_heads = self.metadata.get(f"{arch}.attention.head_count")
        self.n_kv_heads = self.metadata.get(f"{arch}.attention.head_count_kv", self.n_heads)
        self._tensors = {}  # HF key -> (GGUF name, GGML type, absolute offset)
        float_types = {1: torch.float16, 30: torch.bfloat16}  # (GGML F16, BF16)
        for t, dims, kind, offset in tensors:
            key = hf_name(t, self.architecture)
            if key in self._infos:
                raise SourceError([], f"{path.name}: tensors {t} and {self._tensors[key][0]} both map to {key}")
            dtype = float_types.get(kind, torch.float32)  # quantised types dequantise to float32
            shape = tuple(int(s) for s in reversed(dims))
            self._infos[key] = TensorInfo(shape, dtype, path.name, self._keep(t, key, kind, shape))
            self._tensors[key] = (t, kind, offset)
        if self.architecture in PERMUTED_ARCHS:  # the q/k rows must split into the heads the metadata names
            for key, info in self._infos.items():
                for proj, field in (("q_proj", "head_count"), ("k_proj", "head_count_kv")):
                    heads = self.n_heads if field == "head_count" else self.n_kv_heads
                    if re.search(rf"self_attn\.{proj}\.(weight|bias)$", key) and not (
                            isinstance(heads, int) and heads > 0 and info.shape and info.shape[0] % (2 * heads) == 0):
                        raise SourceError([], f"{path.name}: {key} has {info.shape[0] if info.shape else 0} rows, "
                                              f"which {arch}.attention.{field}={_say(heads)} does not split into "
                                              f"heads of rotary pairs")

    def _keep(self, t: str, key: str, kind: int, shape: tuple[int, ...]):
        """The QuantType a tensor is kept as (quantized=True, a block-quantised type), else None; a type zoo
        has no kernels for is a problem naming the tensor (dequantising it is the user's choice)."""
        if not self.quantized or kind in FLOAT_TYPES:
            return None
        if kind not in QUANT_TYPES:
            self.problems.append(Problem("dtype", key, self.files[0].name, None,
                f"{self.files[0].name}: tensor {t} ({key}) is {_type_name(kind)}, which zoo cannot run quantized "
                f"(it runs {', '.join(q.name for q in QUANT_TYPES.values())}); dequantize the file instead "
                f"(zoo run --dtype float32, LLM(path, dtype='float32'))"))
            return None
        return QUANT_TYPES[kind]

    def order(self, key: str) -> tuple:
        return ("", self._tensors[key][2])

    def read_into(self, key: str, out: torch.Tensor, each=None) -> int:
        """A kept-quantised tensor: its blocks, rows unpermuted like the float path's (a block row is a weight
        row), into `out` (uint8 [rows, row bytes]); any other: dequantised as get() reads it. each: as
        Source.read_into (called once, on `out`)."""
        info = self.info(key)
        if info.quant is None:
            return super().read_into(key, out, each)
        row = info.quant.row_bytes(info.shape[-1])
        if len(info.shape) != 2 or tuple(out.shape) != (info.shape[0], row) or out.dtype is not torch.uint8:
            raise ValueError(f"{key}: a {info.quant.name} {list(info.shape)} tensor goes into uint8 "
                             f"[{info.shape[0]}, {row}], not {out.dtype} {list(out.shape)}")
        import numpy as np

        _, _, offset = self._tensors[key]
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.shape[0] * row, offset=offset)
        raw = raw.reshape(info.shape[0], row)
        heads = self._heads(key)
        if heads:  # the rows of each head from (half, 2) back to (2, half), as unpermute()
            raw = raw.reshape(heads, info.shape[0] // heads // 2, 2, row).swapaxes(1, 2).reshape(info.shape[0], row)
        out.numpy()[...] = raw  # (numpy: a read-only mapping is not a torch tensor's storage)
        self._release(offset, info.shape[0] * row)
        if each is not None:
            each(out)
        return info.nbytes

    def _release(self, offset: int, nbytes: int) -> None:
        """Unmap the pages of file bytes [offset, offset + nbytes) from this process once they are copied out
        (MADV_DONTNEED on a read-only file mapping: the page cache keeps them, a later read faults them back).
        Left mapped, every page read counts in the process's RSS beside its copy: the whole file on top of the
        weights at the end of a load (bench/quant.py's peak)."""
        if hasattr(mmap, "MADV_DONTNEED") and nbytes > 0:
            start = offset - offset % mmap.PAGESIZE
            try:
                self._buf.madvise(mmap.MADV_DONTNEED, start, min(offset + nbytes, len(self._buf)) - start)
            except (OSError, ValueError):  # (an advice the platform refuses: the pages stay until close)
                pass

    def _heads(self, key: str) -> int | None:
        """The heads a q/k projection's rows are permuted in (llama.cpp's converter), else None."""
        if self.architecture in PERMUTED_ARCHS and self.n_heads:
            if key.endswith("self_attn.q_proj.weight") or key.endswith("self_attn.q_proj.bias"):
                return int(self.n_heads)
            if key.endswith("self_attn.k_proj.weight") or key.endswith("self_attn.k_proj.bias"):
                return int(self.n_kv_heads)
        return None

    def _unpermute(self, key: str, out: torch.Tensor) -> torch.Tensor:
        heads = self._heads(key)
        return unpermute(out, heads) if heads else out

    def close(self) -> None:
        self._buf.close()

    def get(self, key: str) -> torch.Tensor:
        info = self.info(key)
        t = self._tensors[key]
        try:
            return self._get(key, info, t)
        except (ValueError, RuntimeError, NotImplementedError) as e:
            raise SourceError([], f"{info.file}: tensor {t[0]} ({key}) cannot be read: {type(e).__name__}") from None

    def _get(self, key: str, info: TensorInfo, t) -> torch.Tensor:
        import numpy as np

        gguf_name, kind, offset = t
        shape = info.shape or (1,)
        if kind in FLOAT_NAMES:  # a copy out of the read-only mapping, in the file's dtype
            word = {0: np.float32, 1: np.float16, 30: np.uint16}[kind]
            data = np.frombuffer(self._buf, dtype=word, count=math.prod(shape), offset=offset).copy()
            out = torch.from_numpy(data)
            out = out.view(torch.bfloat16) if kind == 30 else out  # bfloat16: stored as raw 16-bit words
        else:
            import gguf  # (only to dequantise: the rest of the loader does not need it)

            q = gguf.GGMLQuantizationType
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, q(kind))
            data = np.frombuffer(self._buf, dtype=np.uint8, count=math.prod(byte_shape), offset=offset)
            out = torch.from_numpy(gguf.quants.dequantize(data.reshape(byte_shape), q(kind)))
        self._release(offset, data.nbytes)
        out = out.reshape(info.shape)
        if self.architecture in NORM_SHIFTED_ARCHS and "norm.weight" in gguf_name:
            out = out.float() - 1  # the converter's w + 1 back to the checkpoint's w (computed in float32)
        return self._unpermute(key, out).to(info.dtype)
