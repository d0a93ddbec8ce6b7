"""Native CPU kernels for the float32 hot path: linear (GEMV and GEMM), RMS norm, rotary, paged attention, SwiGLU,
the Mamba2 mixer between its projections, Mamba1's conv and selective scan;
`linear`, `attention`, `moe_experts` and `mla_decode` also take bfloat16 weights / caches (read widened, float32
arithmetic: cpu.cpp's bf16).

Why: a CPU decode step reads every weight once per token, and torch's GEMV reaches about half the memory
bandwidth when the weights stream from memory (each is used once per step, so nothing stays in cache);
its sgemm reaches ~185 of this CPU's 233 GFLOP/s on a prefill, the register-tiled GEMM here ~200; a layer
also costs a dozen small torch ops whose dispatch adds up over 30 layers. `cpu.cpp` has one kernel
per layer op (see its comments for the layouts); bench/kernels.py measures them against torch. Also here:
`argmax` (greedy sampling), `pack_weights` (the float32 or bfloat16 weights end to end in reading order, in huge
pages; `packed_allocator` has the loader read them there directly) and
`huge_empty` (KV caches in huge pages); `zoo.kernels.fused` runs a whole Llama-structured step natively;
`describe()` says what the CPU advertises and what the build runs per op family (the benches print it).

Use from a layer:

    if kernels.fast(x, self.weight):       # float32 CPU tensors, no autograd, kernels on and built
        return kernels.linear(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)   # the reference path: autograd, other dtypes and devices

`ZOO_FAST=0` in the environment turns every kernel off (read at import); `set_enabled(False)` does the same
at run time (tests run both paths with it).
Build: the first call compiles cpu.cpp with $CXX (default g++) into ~/.cache/zoo/kernels/<hash>/
(`ZOO_CACHE` replaces ~/.cache/zoo, see zoo/paths.py); the hash covers the source, the flags, the compiler and this
machine's CPU flags (the build uses -march=native). A second or so, once per machine and source version.
A failed build warns once, naming the compiler's error, and the torch path stays on.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from zoo import paths

SOURCE = Path(__file__).with_name("cpu.cpp")  # one unit: it includes the families in cpu/ (each a header)
SOURCES = [SOURCE, *sorted(SOURCE.with_name("cpu").glob("*.h"))]  # what the build's key hashes
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-pthread", "-shared", "-fPIC", "-std=c++17"]

_lib: ctypes.CDLL | None = None
_tried = False
_on = os.environ.get("ZOO_FAST", "1") != "0"
_device_path = os.environ.get("ZOO_DEVICE_PATH", "0") == "1"  # the device code path forced on the CPU
# the activations of the Q4_0 / Q4_1 / Q8_0 decode GEMV (M <= 4): 16 or 8 bits (integers), or 0 (float32 math on the
# dequantised values); ZOO_QUANT_ACT overrides the default, int16 (set_activation_bits)
_ACT_BITS = {"16": 16, "8": 8, "0": 0}
_act_bits = _ACT_BITS.get(os.environ.get("ZOO_QUANT_ACT", "16"))
if _act_bits is None:
    raise ValueError(f"ZOO_QUANT_ACT={os.environ['ZOO_QUANT_ACT']!r}: one of 16, 8, 0 (float32 math)")

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_F32 = torch.float32
_SIGNATURES = {
    "zoo_linear": [_P, _L, _L, _P, _L, _L, _P, _P, _L, _I],
    "zoo_linear_bf16": [_P, _L, _L, _P, _L, _L, _P, _P, _L, _I],
    "zoo_rms_norm": [_P, _L, _L, _L, _P, _F, _I, _P, _I],
    "zoo_rope": [_P, _L, _L, _L, _P, _P, _L, _L, _L, _P, _L, _L, _P, _P, _P, _L, _L, _I],
    "zoo_silu_mul": [_P, _L, _L, _L, _P, _I],
    "zoo_gelu_tanh_mul": [_P, _L, _L, _L, _P, _I],
    "zoo_argmax": [_P, _L, _L, _L, _P, _P, _I],
    "zoo_moe_experts": [_P, _L, _L, _P, _P, _L, _P, _P, _L, _L, _I, _P, _I],
    "zoo_mla_decode": [_P, _L, _L, _P, _L, _L, _L, _L, _L, _P, _L, _L, _P, _L, _L, _P, _L, _P, _P, _P, _L, _F, _P, _I],
    "zoo_qlinear": [_P, _L, _L, _P, _P, _P, _L, _I],
    "zoo_qembed": [_P, _L, _P, _P, _I],
    "zoo_set_act_bits": [_I],
    "zoo_attention": [_P, _L, _L, _P, _L, _L, _P, _L, _L, _P, _L, _L, _L, _L,
                      _P, _L, _L, _P, _P, _L, _P, _P, _L, _F, _L, _F, _I],
    "zoo_mamba2_mix": [_P, _L, _L, _L, _L, _L, _L, _L, _P, _P, _P, _P, _P, _P, _F, _F, _F, _P, _P, _P, _P, _P, _L,
                       _P, _P, _I],
    "zoo_causal_conv": [_P, _L, _L, _L, _L, _P, _P, _P, _P, _P, _P, _L, _P, _I],
    "zoo_selective_scan": [_P, _L, _P, _L, _P, _P, _L, _P, _L, _P, _P, _L, _L, _L, _P, _P, _P, _P, _L, _P, _I],
}
# the bfloat16 variants take the same arguments (bfloat16 weights / cache, float32 activations and arithmetic)
_SIGNATURES["zoo_attention_bf16"] = _SIGNATURES["zoo_attention"]
_SIGNATURES["zoo_moe_experts_bf16"] = _SIGNATURES["zoo_moe_experts"]
_SIGNATURES["zoo_mla_decode_bf16"] = _SIGNATURES["zoo_mla_decode"]
_SIGNATURES["zoo_kernel_paths"] = []
_SIGNATURES["zoo_llama_step"] = [_P]  # (a StepArgs, zoo/kernels/fused.py)
_RESTYPES = {"zoo_kernel_paths": ctypes.c_char_p,
             "zoo_set_act_bits": ctypes.c_int, "zoo_rope": ctypes.c_long, "zoo_attention": ctypes.c_int,
             "zoo_mla_decode": ctypes.c_int, "zoo_attention_bf16": ctypes.c_int,
             "zoo_mla_decode_bf16": ctypes.c_int, "zoo_llama_step": ctypes.c_int}
_BATCH_FIELDS = {1: "query_start_loc", 2: "seq_lens", 3: "slot_mapping", 4: "block_tables"}


class QMat(ctypes.Structure):
    """A block-quantised weight for cpu.cpp (struct QMat): up to 4 row segments, each with its GGML type."""
    _fields_ = [("nseg", ctypes.c_long), ("K", ctypes.c_long), ("rows", ctypes.c_long * 4),
                ("type", ctypes.c_long * 4), ("data", ctypes.c_void_p * 4)]


QUANT_CODES = (2, 3, 8, 12, 13, 14)  # the GGML types cpu.cpp computes with: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K


def qmat(weight: torch.Tensor) -> QMat | None:
    """The QMat of a quantised parameter (uint8 bytes with a loader.quant.QuantLayout as `weight.quant`), kept
    on the tensor while its storage stays; None when a segment's type has no kernel or there are more than 4."""
    held = getattr(weight, "_zoo_qmat", None)
    if held is not None and held[0] == weight.data_ptr():
        return held[1]
    layout = weight.quant
    if len(layout.segments) > 4 or any(t.code not in QUANT_CODES for _, _, t in layout.segments) \
            or not weight.is_contiguous() or weight.numel() != layout.nbytes:
        return None
    q = QMat(len(layout.segments), layout.shape[1])
    for i, ((a, b, t), at) in enumerate(zip(layout.segments, layout.offsets())):
        q.rows[i], q.type[i], q.data[i] = b - a, t.code, weight.data_ptr() + at
    weight._zoo_qmat = (weight.data_ptr(), q)
    return q


def qlinear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for a block-quantised weight w (weight.quant its layout, [N, K]): [..., K] -> [..., N],
    float32 math on the dequantised values (dequantise() gives them), in another summation order."""
    _float32("qlinear", "x bias", x, bias)
    n, k = weight.quant.shape
    if x.dim() < 1 or x.shape[-1] != k or (bias is not None and bias.shape != (n,)):
        raise _bad("qlinear", "x [..., K] and bias [N] do not fit the weight [N, K]", x=x.shape, weight=(n, k),
                   **({"bias": bias.shape} if bias is not None else {}))
    q = qmat(weight)
    m = x.numel() // k if k else 0
    if q is None or m == 0 or (bias is not None and not bias.is_contiguous()) or not enabled():
        return F.linear(x, dequantize(weight), bias)
    x2 = _rows(x)
    y = torch.empty(m, n)
    _native().zoo_qlinear(x2.data_ptr(), m, x2.stride(0), ctypes.addressof(q), _ptr(bias), y.data_ptr(), n,
                          threads())
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def qembed(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding(ids, dequantise(weight)) for a block-quantised table [V, H]: [T] -> [T, H]."""
    v, h = weight.quant.shape
    q = qmat(weight)
    flat = _int(ids.reshape(-1), torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= v):
        raise IndexError(f"embedding: token ids must lie in [0, {v}), got {int(flat.min())}..{int(flat.max())}")
    if q is None or not enabled() or torch.is_grad_enabled():  # the reference: the rows, dequantised
        return weight.quant.dequantize(weight, flat).view(*ids.shape, h)
    out = torch.empty(flat.numel(), h)
    _native().zoo_qembed(flat.data_ptr(), flat.numel(), ctypes.addressof(q), out.data_ptr(), threads())
    return out.view(*ids.shape, h)


def activation_bits() -> int:
    """The block GEMV's activations now: 16 or 8 (integer bits), 0 (float32 math); see set_activation_bits."""
    return _act_bits


def set_activation_bits(bits: int) -> int:
    """The activations of the block GEMV (M <= 4 rows of x; Q4_0, Q4_1, Q8_0 weights) for this process: 16 (the
    default: cpu.cpp's "int8 / int16 activations", top-1 equal to float32 on the embedded model), 8 (int8, as
    llama.cpp's Q8_1: faster, top-1 97%), 0 (float32 math on the dequantised values, as every other
    type and M > 4 always use); returns the previous setting (pass it back to restore). `ZOO_QUANT_ACT=16|8|0` in
    the environment sets the default."""
    global _act_bits
    if isinstance(bits, bool) or bits not in (0, 8, 16):
        raise ValueError(f"set_activation_bits: bits must be 0, 8 or 16, got {bits!r}")
    previous, _act_bits = _act_bits, int(bits)
    if _lib is not None:
        _lib.zoo_set_act_bits(_act_bits)
    return previous


def dequantize(weight: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of a block-quantised parameter, by the gguf package's dequantiser (the reference)."""
    return weight.quant.dequantize(weight)


_native_threads = 0  # inside serial_torch(): the thread count the native kernels keep


def threads() -> int:
    """The threads a native kernel runs on: torch's count, or inside serial_torch() the count torch had."""
    return _native_threads or torch.get_num_threads()


@contextmanager
def serial_torch():
    """Torch's ops on one thread, the native kernels on the threads torch had (threads()). A module's small torch
    ops (views, gathers, a softmax over a few experts) are microseconds of work each, but an OpenMP region of 2
    threads waits for both to be scheduled: on a loaded 2-core machine that wait measured ~30-100 ms per op, most
    of a decode step; the native kernels' pool never waits for a thread that has not started (cpu.cpp's Pool)."""
    global _native_threads
    n = torch.get_num_threads()
    if n == 1 or _native_threads:
        yield
        return
    torch.set_num_threads(1)
    _native_threads = n
    try:
        yield
    finally:
        _native_threads = 0
        torch.set_num_threads(n)


def enabled() -> bool:
    """Kernels switched on (ZOO_FAST is not "0", set_enabled, the device path not forced) and built."""
    return _on and not _device_path and _load() is not None


def device_path(t: torch.Tensor) -> bool:
    """Whether a layer takes the device code path for t: t is on an accelerator, or the path is forced on the
    CPU (`ZOO_DEVICE_PATH=1`, `set_device_path(True)`: the same code with the Triton kernels' torch references,
    no native kernels; tests/test_device_path.py runs the models through it). The device path reads nothing
    back to the host inside a step (zoo.runtime.host_sync checks it when forced)."""
    return _device_path or not t.is_cpu


def set_device_path(on: bool) -> bool:
    """Force the device code path on the CPU for this process (or stop); returns the previous setting."""
    global _device_path
    previous, _device_path = _device_path, bool(on)
    return previous


def set_enabled(on: bool) -> bool:
    """Switch the kernels on or off for this process; returns the previous setting."""
    global _on
    previous, _on = _on, bool(on)
    return previous


def fast(*tensors: torch.Tensor) -> bool:
    """Whether a layer should take the native path for these tensors (called on every op: kept cheap)."""
    if not _on or _device_path or torch.is_grad_enabled():
        return False
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return _lib is not None or _load() is not None


def stored(*tensors: torch.Tensor) -> bool:
    """Whether weights or caches are CPU tensors of one dtype the native kernels read: float32, or bfloat16 widened
    (zoo's bfloat16 storage under float32 activations; `fast` checks the activations)."""
    return tensors[0].dtype in PACKED and all(t.dtype is tensors[0].dtype and t.is_cpu for t in tensors)


ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8")  # the /proc/cpuinfo flags the kernels' choices depend on


def describe() -> dict[str, str]:
    """What this machine's CPU advertises (its model, the ISA_FLAGS present) and what the built kernels run: the
    instruction sets the build used (-march=native) and the path of each op family. The benches print it, so a
    figure is read with the kernel that made it."""
    info = {"cpu": platform.processor() or platform.machine(), "cpu flags": ""}
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), info["cpu"])
        flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith(("flags", "Features"))), [])
        info["cpu flags"] = " ".join(f for f in ISA_FLAGS if f in flags) or "(none of " + " ".join(ISA_FLAGS) + ")"
    except OSError:
        pass
    lib = _load() if _on else None
    if lib is None:
        info["kernels"] = "off (torch ops)" if not _on else "did not build (torch ops)"
        return info
    for part in lib.zoo_kernel_paths().decode().split(";"):
        key, _, value = part.partition("=")
        info["built " + key if key == "isa" else key] = value.strip()
    info["quantized activations"] = {16: "int16", 8: "int8", 0: "float32"}[_act_bits]
    return info


def cache_dir() -> Path:
    return paths.cache_dir("kernels")


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build() -> Path:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler {cxx!r} on PATH (set CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256("\n".join([*(f.read_text() for f in SOURCES), " ".join(FLAGS), *version, _cpu_signature(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    target = cache_dir() / key / "zoo_kernels.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # build aside, then rename: concurrent builds are safe
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed to build {SOURCE}:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    try:
        lib = ctypes.CDLL(str(_build()))
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, _RESTYPES.get(name)
        lib.zoo_set_act_bits(_act_bits)
        _lib = lib
    except Exception as e:  # noqa: BLE001 - any failure leaves the torch path on
        warnings.warn(f"zoo native kernels unavailable, using torch ops instead: {e}", RuntimeWarning, stacklevel=3)
    return _lib


def _native() -> ctypes.CDLL:
    """The built library, built on first use (an entry point called without enabled() / fast() first): where the
    build failed, a clear error rather than an attribute of None."""
    lib = _load()  # (the library once tried: no second build)
    if lib is None:
        raise RuntimeError("zoo native kernels did not build (the RuntimeWarning when they were first loaded says "
                           "why): check zoo.kernels.enabled() before calling them, and use torch ops")
    return lib


def _huge_buffer(nbytes: int):
    """(an anonymous mapping of nbytes rounded up to 2 MB that asks for transparent huge pages, a uint8 tensor
    over it); (None, a torch.empty tensor) where mmap or madvise is unavailable.

    Huge pages are asked for only as far as the kernel holds free 2 MB blocks (`free_huge_bytes`; the rest of the
    buffer gets ordinary pages): a fault in a MADV_HUGEPAGE region that finds none compacts memory first, which on
    a fragmented machine made faulting a 2.5 GB buffer 6x slower than with 4 KB pages (3 s -> 18 s) and the load
    into it with it."""
    huge = 2 << 20
    nbytes = max(1, (nbytes + huge - 1) // huge * huge)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        free = free_huge_bytes()
        grant = nbytes if free is None else min(nbytes, free * 3 // 4 // huge * huge)  # (others allocate too)
        if hasattr(mmap, "MADV_HUGEPAGE") and grant:
            buf.madvise(mmap.MADV_HUGEPAGE, 0, grant)
        return buf, torch.frombuffer(buf, dtype=torch.uint8)
    except (OSError, ValueError, AttributeError):
        return None, torch.empty(nbytes, dtype=torch.uint8)


def free_huge_bytes(buddyinfo: str | None = None) -> int | None:
    """Bytes in free blocks of 2 MB or more in the zones ordinary allocations take from (Normal, Movable), from
    /proc/buddyinfo (or the text given; Linux; None where it cannot be read: huge pages are then asked for
    throughout)."""
    if buddyinfo is None:
        try:
            with open("/proc/buddyinfo") as f:
                buddyinfo = f.read()
        except OSError:
            return None
    lines = buddyinfo.splitlines()
    page, order = mmap.PAGESIZE, (2 << 20) // mmap.PAGESIZE
    total, seen = 0, False
    for line in lines:
        parts = line.split()
        if len(parts) < 5 or parts[2] != "zone" or parts[3] not in ("Normal", "Movable"):
            continue
        seen = True
        counts = parts[4:]
        total += sum(int(c) * page << o for o, c in enumerate(counts) if (1 << o) >= order and c.isdigit())
    return total if seen else None


def huge_empty(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """name -> an uninitialised CPU tensor of that (shape, dtype), all in one buffer of transparent huge pages
    (KV caches: fewer TLB misses and page faults when attention walks a block table; each starts on 2 MB)."""
    sizes = {n: (torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() + (2 << 20) - 1)
             // (2 << 20) * (2 << 20) for n, (shape, dt) in shapes.items()}
    _, raw = _huge_buffer(sum(sizes.values()))
    out, offset = {}, 0
    for n, (shape, dtype) in shapes.items():
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out[n] = raw[offset:offset + nbytes].view(dtype).view(shape)
        offset += sizes[n]
    return out


def pack_weights(model: torch.nn.Module) -> int:
    """Move the model's float32 and bfloat16 CPU parameters into one buffer, in the order a forward pass reads them.

    A decode step streams every weight once: matrices laid end to end in reading order stream faster
    than scattered ones (bench/kernels.py compares both), and the buffer asks for transparent huge pages
    (fewer TLB misses). Parameters keep their
    objects, names, shapes and ties; only their storage moves (`param.data`). Order: module order, which
    for the decoder models here is execution order, except that embedding tables go last (a tied table
    is read in full only by the LM head, at the end; an embedding lookup reads a few rows).
    Returns the bytes packed (0 when nothing qualifies); packing a packed model again does nothing.
    A model loaded with loader.load(allocate=packed_allocator(model)) is packed already (no copy).
    """
    if getattr(model, "_zoo_packed_bytes", None) is not None:
        return model._zoo_packed_bytes
    seen, first, last = set(), [], []
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen or p.dtype not in PACKED or not p.is_cpu:
                continue
            seen.add(id(p))
            (last if "embed" in name.rsplit(".", 1)[-1] else first).append(p)
    params = first + last
    views, buf, nbytes = _arena([p.shape for p in params], [p.dtype for p in params])
    with torch.no_grad():
        for p, view in zip(params, views):
            view.copy_(p.data)
            p.data = view
    model._zoo_weight_buffer = buf  # (the tensors keep the mapping alive too)
    model._zoo_packed_bytes = nbytes
    return nbytes


# the dtypes whose weights are packed: float32, bfloat16 (fused.py's bfloat16 step streams them as they are) and a
# quantised weight's bytes (uint8; packed_allocator only: pack_weights leaves other uint8 tensors alone)
PACKED = (torch.float32, torch.bfloat16)


def _arena(shapes: list, dtypes: list | None = None) -> tuple[list[torch.Tensor], object, int]:
    """Uninitialised views of `shapes` (float32, or `dtypes`: float32, bfloat16 or uint8, a quantised weight's
    bytes), end to end (each on a 64-byte line) in one huge-page buffer: (views, the buffer, its bytes)."""
    dtypes = dtypes or [torch.float32] * len(shapes)
    sizes = [(math.prod(s) * d.itemsize + 63) // 64 * 64 for s, d in zip(shapes, dtypes)]  # bytes
    if not sizes:
        return [], None, 0
    buf, raw = _huge_buffer(sum(sizes))
    views, offset = [], 0
    for shape, dtype, size in zip(shapes, dtypes, sizes):
        views.append(raw[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
        offset += size
    return views, buf, sum(sizes)


def packed_allocator(model: torch.nn.Module):
    """An `allocate` for loader.load(model, ...) that lays the float32 or bfloat16 parameters out as pack_weights would
    (module order of each parameter's owner, embedding tables last), so the loader reads every weight straight
    into the packed buffer and no second copy is made; the model is marked packed (pack_weights then does
    nothing). Call mark_packed(model, allocate) after a successful load."""
    order = {}
    for name, module in model.named_modules():
        for leaf in module._parameters:
            order.setdefault(f"{name}.{leaf}" if name else leaf, ("embed" in name.rsplit(".", 1)[-1], len(order)))
    held = {}

    def allocate(shapes: dict) -> dict[str, torch.Tensor]:
        # float32 or bfloat16 weights, and quantised ones (uint8 bytes): all stream once per decode step
        names = [n for n, (_, dtype) in shapes.items() if dtype in (*PACKED, torch.uint8) and n in order]
        names.sort(key=order.__getitem__)  # module order, embeddings last
        views, held["buf"], held["bytes"] = _arena([shapes[n][0] for n in names], [shapes[n][1] for n in names])
        return dict(zip(names, views))

    allocate.held = held
    return allocate


def mark_packed(model: torch.nn.Module, allocate) -> None:
    """After loader.load(model, ..., allocate=packed_allocator(model)): the model's weights are packed."""
    model._zoo_weight_buffer = allocate.held.get("buf")
    model._zoo_packed_bytes = allocate.held.get("bytes", 0)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


# The wrappers check what the C++ cannot (dtypes, devices, shapes, contiguity where a pointer is read with an
# assumed stride), once per call, so that no call through them reads out of bounds: a ValueError naming the
# argument instead. (The batch metadata's values are checked in cpu.cpp: check_batch.)
def _float32(fn: str, names: str, *tensors: torch.Tensor | None) -> None:
    for i, t in enumerate(tensors):
        if t is not None and (t.dtype is not _F32 or not t.is_cpu):
            raise ValueError(f"kernels.{fn}: {names.split()[i]} is {t.dtype} on {t.device}; the native kernels "
                             f"take float32 CPU tensors (zoo.kernels.fast says when to call them)")


def _bad(fn: str, what: str, **shapes) -> ValueError:
    got = ", ".join(f"{n} {tuple(s)}" for n, s in shapes.items())
    return ValueError(f"kernels.{fn}: {what} (got {got})")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x viewed as [rows, last dim] with a unit last stride (a copy only when the view cannot exist)."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    return x if x.stride(1) == 1 else x.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): [..., K] -> [..., N]. A bfloat16 weight is read widened: float32 x, bias, result
    and arithmetic (F.linear(x, weight.float(), bias) up to the order of the sums)."""
    bf16 = weight.dtype is torch.bfloat16 and weight.is_cpu
    _float32("linear", "x weight bias", x, None if bf16 else weight, bias)
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or (
            bias is not None and bias.shape != weight.shape[:1]):
        raise _bad("linear", "x [..., K], weight [N, K] and bias [N] do not fit", x=x.shape, weight=weight.shape,
                   **({"bias": bias.shape} if bias is not None else {}))
    n, k = weight.shape
    m = x.numel() // k if k else 0
    if m == 0 or not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return F.linear(x, weight, bias)
    x2 = _rows(x)
    y = torch.empty(m, n)
    lib = _native()
    (lib.zoo_linear_bf16 if bf16 else lib.zoo_linear)(x2.data_ptr(), m, x2.stride(0), weight.data_ptr(), n, k,
                                                      _ptr(bias), y.data_ptr(), n, threads())
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool = False) -> torch.Tensor:
    """Llama's `w * (x * r)` or, with gemma, `(x * r) * (1 + w)`; r = rsqrt(mean(x^2) + eps); any leading dims."""
    _float32("rms_norm", "x weight", x, weight)
    if x.dim() < 1 or weight.shape != x.shape[-1:]:
        raise _bad("rms_norm", "weight must be [D] for x [..., D]", x=x.shape, weight=weight.shape)
    x2 = _rows(x)
    rows, d = x2.shape
    out = torch.empty(rows, d)
    _native().zoo_rms_norm(x2.data_ptr(), rows, d, x2.stride(0), weight.contiguous().data_ptr(), eps, int(gemma),
                           out.data_ptr(), threads())
    return out if x.dim() == 2 else out.view(x.shape)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, n, D] and k [T, m, D] (unit last strides) rotated by the table rows cos/sin [L, F] at positions."""
    _float32("rotary", "q k cos sin", q, k, cos, sin)
    if (q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]
            or positions.shape != q.shape[:1] or positions.is_floating_point() or positions.is_complex()
            or cos.dim() != 2 or sin.shape != cos.shape or 2 * cos.shape[1] > q.shape[2]):
        raise _bad("rotary", "expected q [T, n, D], k [T, m, D], integer positions [T], cos = sin [L, F], 2F <= D",
                   q=q.shape, k=k.shape, positions=positions.shape, cos=cos.shape, sin=sin.shape)
    if not (cos.is_contiguous() and sin.is_contiguous()):
        cos, sin = cos.contiguous(), sin.contiguous()
    t, n, d = q.shape
    m = k.shape[1]
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    if positions.dtype is not torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    q_out, k_out = torch.empty(t, n, d), torch.empty(t, m, d)
    bad = _native().zoo_rope(q.data_ptr(), q.stride(0), q.stride(1), n, q_out.data_ptr(),
                             k.data_ptr(), k.stride(0), k.stride(1), m, k_out.data_ptr(), t, d, positions.data_ptr(),
                             cos.data_ptr(), sin.data_ptr(), cos.shape[0], cos.shape[1], threads())
    if bad >= 0:
        raise IndexError(f"rotary: token {bad} has position {int(positions[bad])}, outside the cos/sin table "
                         f"of {cos.shape[0]} positions")
    return q_out, k_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = cat(gate, up) [T, 2I] -> [T, I]."""
    return _act_mul(_native().zoo_silu_mul, gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for gate_up = cat(gate, up) [T, 2I] -> [T, I] (Gemma's MLP)."""
    return _act_mul(_native().zoo_gelu_tanh_mul, gate_up)


def _act_mul(fn, gate_up: torch.Tensor) -> torch.Tensor:
    _float32("silu_mul / gelu_tanh_mul", "gate_up", gate_up)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise _bad("silu_mul / gelu_tanh_mul", "gate_up must be [..., 2I]", gate_up=gate_up.shape)
    g = _rows(gate_up)
    rows, i = g.shape[0], g.shape[1] // 2
    out = torch.empty(rows, i)
    fn(g.data_ptr(), rows, i, g.stride(0), out.data_ptr(), threads())
    return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], i)


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, kind: str) -> torch.Tensor:
    """The routed experts of a MoE block in one call: x [T, H], topk_ids / topk_weights [T, K], gate_up [E, 2I, H]
    (gate rows, then up rows), down [E, H, I], kind "silu" or "gelu_tanh" -> [T, H] = per token the sum over its
    experts e (ascending id) of weight * down_e(act(gate_e x) * up_e x), as zoo.layers.moe.StackedExperts.
    gate_up and down may both be bfloat16 (read widened: float32 x, weights, result and arithmetic)."""
    bf16 = gate_up.dtype is down.dtype is torch.bfloat16 and gate_up.is_cpu and down.is_cpu
    _float32("moe_experts", "x topk_weights gate_up down", x, topk_weights, *((None, None) if bf16 else (gate_up, down)))
    if (x.dim() != 2 or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]
            or gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[2] != x.shape[1]
            or down.shape != (gate_up.shape[0], x.shape[1], gate_up.shape[1] // 2) or gate_up.shape[1] % 2
            or not 0 < topk_ids.shape[1] <= 64 or topk_ids.is_floating_point()):
        raise _bad("moe_experts", "expected x [T, H], integer topk_ids = topk_weights [T, K] (K <= 64), gate_up "
                   "[E, 2I, H], down [E, H, I]", x=x.shape, topk_ids=topk_ids.shape, topk_weights=topk_weights.shape,
                   gate_up=gate_up.shape, down=down.shape)
    e, t = gate_up.shape[0], x.shape[0]
    ids = _int(topk_ids, torch.int64)
    if t and (int(ids.min()) < 0 or int(ids.max()) >= e):
        raise IndexError(f"moe_experts: expert ids must lie in [0, {e}), got {int(ids.min())}..{int(ids.max())}")
    x, wts = x.contiguous(), topk_weights.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    out = torch.empty(t, x.shape[1])
    if t:
        lib = _native()
        (lib.zoo_moe_experts_bf16 if bf16 else lib.zoo_moe_experts)(
            x.data_ptr(), t, x.shape[1], ids.data_ptr(), wts.data_ptr(), ids.shape[1], gate_up.data_ptr(),
            down.data_ptr(), e, down.shape[2], 1 if kind == "gelu_tanh" else 0, out.data_ptr(), threads())
    return out


def mla_decode(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, kv_b: torch.Tensor,
               block_tables: torch.Tensor, toks: list[int], reqs: list[int], lens: list[int], *, v_dim: int,
               scale: float, out: torch.Tensor) -> None:
    """MLA's absorbed decode (zoo.layers.mla) for one-token requests: q_nope [T, NH, DN], rotated q_rope [T, NH,
    DR] (unit last strides), the latent cache [NB, BS, R + DR] (the new rows written), kv_b = kv_b_proj.weight
    [NH (DN + DV), R], block_tables [B, M]; request i's token toks[i], row reqs[i] of the tables, lens[i] context
    tokens. Writes out[toks[i]] ([T, NH, DV], contiguous): softmax(scale (W_UK^T q_nope . c + q_rope . k_rope))
    times the latents c, through W_UV. The cache and kv_b may both be bfloat16 (read widened, float32 arithmetic)."""
    bf16 = cache.dtype is kv_b.dtype is torch.bfloat16 and cache.is_cpu and kv_b.is_cpu
    _float32("mla_decode", "q_nope q_rope cache kv_b out", q_nope, q_rope, *((None, None) if bf16 else (cache, kv_b)),
             out)
    t, nh, dn = q_nope.shape
    dr, r = q_rope.shape[-1], kv_b.shape[-1]
    if (q_rope.shape[:2] != (t, nh) or cache.dim() != 3 or cache.shape[2] != r + dr or not cache.is_contiguous()
            or kv_b.shape != (nh * (dn + v_dim), r) or out.shape != (t, nh, v_dim) or not out.is_contiguous()
            or q_nope.stride(2) != 1 or q_rope.stride(2) != 1 or not len(toks) == len(reqs) == len(lens)):
        raise _bad("mla_decode", "expected q_nope [T, NH, DN], q_rope [T, NH, DR], cache [NB, BS, R + DR], "
                   "kv_b [NH (DN + DV), R], out [T, NH, DV]", q_nope=q_nope.shape, q_rope=q_rope.shape,
                   cache=cache.shape, kv_b=kv_b.shape, out=out.shape)
    if any(not 0 <= i < t for i in toks) or any(not 0 <= i < block_tables.shape[0] for i in reqs):
        raise ValueError(f"mla_decode: token rows {toks} / table rows {reqs} outside the step's {t} tokens / "
                         f"{block_tables.shape[0]} requests")
    kv_b, tables = kv_b.contiguous(), _int(block_tables, torch.int32)
    toks_t, reqs_t, lens_t = (torch.tensor(v, dtype=torch.int64) for v in (toks, reqs, lens))
    fn = _native().zoo_mla_decode_bf16 if bf16 else _native().zoo_mla_decode
    bad = fn(q_nope.data_ptr(), q_nope.stride(0), q_nope.stride(1), q_rope.data_ptr(), q_rope.stride(0),
             q_rope.stride(1), nh, dn, dr, kv_b.data_ptr(), r, v_dim, cache.data_ptr(), cache.shape[0], cache.shape[1],
             tables.data_ptr(), tables.shape[1], toks_t.data_ptr(), reqs_t.data_ptr(), lens_t.data_ptr(), len(toks),
             scale, out.data_ptr(), threads())
    if bad:
        raise ValueError(f"mla_decode: batch.{_BATCH_FIELDS[bad]} is inconsistent with the cache of shape "
                         f"{tuple(cache.shape)} (context lengths {lens})")


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for x [N, V] (unit last stride): the first largest index per row, NaN first as torch."""
    return _argmax(x, values=False)[1]


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.max(x, -1) for x [N, V]: (values [N], indices [N]) in one pass, the indices those of argmax."""
    return _argmax(x, values=True)


def row_max_lists(x: torch.Tensor, indices, values) -> tuple[list[int], list[float]]:
    """row_max for a contiguous float32 CPU x [N, V] into the caller's ctypes buffers (c_int64 and c_float arrays
    of at least N), returned as lists: no tensor is made (the sampler's all-greedy step reuses its buffers)."""
    n, v = x.shape
    if not (x.dtype is _F32 and x.is_cpu and x.is_contiguous() and v >= 1 and len(indices) >= n and len(values) >= n):
        raise _bad("row_max_lists", "x must be a contiguous float32 CPU [N, V], V >= 1, the buffers of N or more",
                   x=x.shape)
    _native().zoo_argmax(x.data_ptr(), n, v, v, indices, values, threads())
    return indices[:n], values[:n]


def _argmax(x: torch.Tensor, *, values: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    _float32("argmax", "x", x)
    if x.dim() != 2 or x.shape[1] == 0:
        raise _bad("argmax", "x must be [N, V] with V >= 1", x=x.shape)
    x = _rows(x)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    vals = torch.empty(x.shape[0]) if values else None
    _native().zoo_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                         None if vals is None else vals.data_ptr(), threads())
    return vals, out


def _int(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype is dtype and t.is_contiguous() else t.to(dtype).contiguous()


# (a weak reference to the last batch seen, its metadata tensors and with_cache, the metadata): every layer
# of a step shares one batch
_batch_meta: list = [lambda: None, None, None]


def _metadata(batch, t: int, with_cache: bool) -> tuple:
    """(qsl, seq_lens, slots, tables) as int32 / int32 / int64 / int32 contiguous, checked once per batch."""
    key = (batch.query_start_loc, batch.seq_lens, batch.slot_mapping, batch.block_tables, with_cache)
    if _batch_meta[0]() is batch and all(a is b for a, b in zip(_batch_meta[1], key)):
        return _batch_meta[2]
    qsl, seq_lens = _int(batch.query_start_loc, torch.int32), _int(batch.seq_lens, torch.int32)
    b = seq_lens.shape[0]
    if qsl.shape != (b + 1,):
        raise ValueError(f"attention: batch.query_start_loc has shape {tuple(qsl.shape)}, expected ({b + 1},) "
                         f"for {b} requests")
    slots = tables = None
    if with_cache:
        slots, tables = _int(batch.slot_mapping, torch.int64), _int(batch.block_tables, torch.int32)
        if slots.shape != (t,) or tables.dim() != 2 or tables.shape[0] < b:
            raise ValueError(f"attention: batch.slot_mapping {tuple(slots.shape)} / block_tables "
                             f"{tuple(tables.shape)} do not fit {t} tokens of {b} requests")
    meta = (qsl, seq_lens, slots, tables)
    _batch_meta[:] = [weakref.ref(batch), key, meta]  # weak: the batch holds the caches
    return meta


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None, batch, *,
              scale: float, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KV, D] (unit last strides) -> [T, H * D]: writes k/v to their slots of kv_cache
    [NB, BS, 2, KV, D], then causal attention of each token over its request's context (see cpu.cpp). A bfloat16
    kv_cache stores k and v rounded to bfloat16 (as kv_cache[slots] = k would) and is read widened: float32 math."""
    bf16 = kv_cache is not None and kv_cache.dtype is torch.bfloat16 and kv_cache.is_cpu
    _float32("attention", "q k v kv_cache", q, k, v, None if bf16 else kv_cache)
    if (q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]
            or k.shape[1] == 0 or q.shape[1] % k.shape[1]):
        raise _bad("attention", "expected q [T, H, D], k = v [T, KV, D] with H a multiple of KV", q=q.shape,
                   k=k.shape, v=v.shape)
    if kv_cache is not None and (kv_cache.dim() != 5 or kv_cache.shape[2:] != (2, k.shape[1], k.shape[2])):
        raise _bad("attention", "kv_cache must be [NB, BS, 2, KV, D]", kv_cache=kv_cache.shape, k=k.shape)
    t, h, d = q.shape
    kvh = k.shape[1]
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    qsl, seq_lens, slots, tables = _metadata(batch, t, kv_cache is not None)
    out = torch.empty(t, h * d)
    if kv_cache is not None:
        if not kv_cache.is_contiguous():
            raise ValueError(f"the KV cache must be contiguous, got strides {kv_cache.stride()}")
        cache_args = (kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.shape[1], slots.data_ptr(), tables.data_ptr(),
                      tables.shape[1])
    else:
        cache_args = (None, 0, 1, None, None, 0)
    lib = _native()
    fn = lib.zoo_attention_bf16 if bf16 else lib.zoo_attention
    bad = fn(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
             v.data_ptr(), v.stride(0), v.stride(1), out.data_ptr(), t, h, kvh, d, *cache_args,
             qsl.data_ptr(), seq_lens.data_ptr(), seq_lens.shape[0], scale,
             sliding_window or 0, softcap or 0.0, threads())
    if bad:
        shape = tuple(kv_cache.shape) if kv_cache is not None else None
        raise ValueError(f"attention: batch.{_BATCH_FIELDS[bad]} is inconsistent with the step's {t} tokens, "
                         f"{seq_lens.shape[0]} requests and the cache of shape {shape}")
    return out


def mamba2_mix(zx: torch.Tensor, *, heads: int, head_dim: int, state_size: int, n_groups: int,
               conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, dt_bias: torch.Tensor, A_log: torch.Tensor,
               D: torch.Tensor, norm_weight: torch.Tensor, eps: float, time_step_limit: tuple[float, float],
               states: tuple[torch.Tensor, torch.Tensor] | None, starts: list[int], slots: list[int],
               has_state: list[bool]) -> torch.Tensor:
    """Mamba2's mixer between in_proj and out_proj (zoo/layers/mamba.py's torch path, see cpu.cpp):
    zx [T, I + C + h] (gate | xBC | dt) -> the gated-normed scan output y [T, I]. Request r owns the rows
    starts[r]:starts[r + 1] and the state slot slots[r] of states = (conv [S, K-1, C], ssm [S, h, p, N]), read
    when has_state[r] and written in place; states None: whole prompts from zero state, nothing kept."""
    conv_state, ssm_state = states if states is not None else (None, None)
    _float32("mamba2_mix", "zx conv_weight conv_bias dt_bias A_log D norm_weight conv_state ssm_state", zx,
             conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, conv_state, ssm_state)
    h, p, n, g = heads, head_dim, state_size, n_groups
    inter, channels, k = h * p, h * p + 2 * g * n, conv_weight.shape[-1]
    t, b = zx.shape[0], len(slots)
    if (zx.dim() != 2 or zx.shape[1] != inter + channels + h or zx.stride(1) != 1 or h % g
            or conv_weight.shape != (channels, 1, k) or not 1 <= k <= 17
            or (conv_bias is not None and conv_bias.shape != (channels,))
            or not dt_bias.shape == A_log.shape == D.shape == (h,) or norm_weight.shape != (inter,)):
        raise _bad("mamba2_mix", f"expected zx [T, {inter + channels + h}] (unit last stride), conv_weight "
                   f"[{channels}, 1, K <= 17], conv_bias [{channels}], dt_bias / A_log / D [{h}], norm_weight "
                   f"[{inter}] and heads a multiple of n_groups", zx=zx.shape, conv_weight=conv_weight.shape,
                   dt_bias=dt_bias.shape, A_log=A_log.shape, D=D.shape, norm_weight=norm_weight.shape)
    if states is not None and (conv_state.shape != (conv_state.shape[0], k - 1, channels)
                               or ssm_state.shape != (conv_state.shape[0], h, p, n)
                               or not conv_state.is_contiguous() or not ssm_state.is_contiguous()):
        raise _bad("mamba2_mix", f"states must be contiguous conv [S, {k - 1}, {channels}] and ssm "
                   f"[S, {h}, {p}, {n}]", conv=conv_state.shape, ssm=ssm_state.shape)
    starts_t, slots_t, flags = _requests("mamba2_mix", t, starts, slots, has_state, conv_state)
    xbc, y = torch.empty(t, channels), torch.empty(t, inter)
    lo, hi = time_step_limit
    params = [None if v is None else v.contiguous() for v in (conv_weight, conv_bias, dt_bias, A_log, D, norm_weight)]
    _native().zoo_mamba2_mix(zx.data_ptr(), t, zx.stride(0), h, p, n, g, k, *map(_ptr, params), eps, lo, hi,
                             _ptr(conv_state), _ptr(ssm_state), starts_t.data_ptr(), slots_t.data_ptr(),
                             flags.data_ptr(), b, xbc.data_ptr(), y.data_ptr(), threads())
    return y


def _requests(fn: str, t: int, starts: list[int], slots: list[int], has_state: list[bool], state) -> tuple:
    """The recurrent kernels' per-request metadata as tensors (int64 starts [B+1] and slots [B], int32 flags [B]),
    checked: starts rise from 0 to the t rows, slots distinct and inside state [S, ...] (or no initial states)."""
    b = len(slots)
    if state is not None:
        if any(not 0 <= v < state.shape[0] for v in slots) or len(set(slots)) != b:
            raise ValueError(f"kernels.{fn}: state slots {slots} must be distinct and in [0, {state.shape[0]})")
    elif any(has_state):
        raise ValueError(f"kernels.{fn}: a request has an initial state but no states were given")
    if len(starts) != b + 1 or len(has_state) != b or starts[0] != 0 or starts[-1] != t or any(
            a > c for a, c in zip(starts, starts[1:])):
        raise ValueError(f"kernels.{fn}: starts {starts} must rise from 0 to the {t} rows, one more than "
                         f"the {b} slots and has_state flags")
    return (torch.tensor(starts, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64),
            torch.tensor(has_state, dtype=torch.int32))


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor | None, *,
                starts: list[int], slots: list[int], has_state: list[bool]) -> torch.Tensor:
    """silu(causal depthwise conv + bias) of x [T, C] (unit last stride), weight [C, 1, K] -> [T, C]; request r's rows
    starts[r]:starts[r + 1] continue the window in its slot slots[r] of conv_state [S, K-1, C] (read when
    has_state[r]) and leave their last K - 1 inputs there; conv_state None: whole prompts from zeros."""
    _float32("causal_conv", "x weight bias conv_state", x, weight, bias, conv_state)
    t, c = x.shape if x.dim() == 2 else (0, 0)
    k = weight.shape[-1]
    if (x.dim() != 2 or x.stride(1) != 1 or weight.shape != (c, 1, k) or not 1 <= k <= 17
            or (bias is not None and bias.shape != (c,))
            or (conv_state is not None and (conv_state.shape[1:] != (k - 1, c) or not conv_state.is_contiguous()))):
        raise _bad("causal_conv", "expected x [T, C] (unit last stride), weight [C, 1, K <= 17], bias [C] and a "
                   "contiguous conv_state [S, K-1, C]", x=x.shape, weight=weight.shape,
                   **({"conv_state": conv_state.shape} if conv_state is not None else {}))
    starts_t, slots_t, flags = _requests("causal_conv", t, starts, slots, has_state, conv_state)
    w, b = weight.contiguous(), None if bias is None else bias.contiguous()
    out = torch.empty(t, c)
    _native().zoo_causal_conv(x.data_ptr(), x.stride(0), t, c, k, w.data_ptr(), _ptr(b), _ptr(conv_state),
                              starts_t.data_ptr(), slots_t.data_ptr(), flags.data_ptr(), len(slots), out.data_ptr(),
                              threads())
    return out


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, z: torch.Tensor, ssm_state: torch.Tensor | None, *, starts: list[int],
                   slots: list[int], has_state: list[bool]) -> torch.Tensor:
    """Mamba1's scan with its D skip and gate: x, dt (after softplus), z [T, I], A [I, N], B and C [T, N], D [I]
    (rows with unit last strides) -> (y + D x) silu(z) [T, I], where h = exp(dt A) h + dt B x and y = h C per
    channel, token by token. Request r's rows starts[r]:starts[r + 1] continue the state in its slot slots[r] of
    ssm_state [S, I, N] (read when has_state[r], written in place); ssm_state None: from zero, nothing kept."""
    _float32("selective_scan", "x dt A B C D z ssm_state", x, dt, A, B, C, D, z, ssm_state)
    t, i = x.shape if x.dim() == 2 else (0, 0)
    n = A.shape[-1]
    if (x.dim() != 2 or dt.shape != x.shape or z.shape != x.shape or A.shape != (i, n) or B.shape != (t, n)
            or C.shape != (t, n) or B.stride() != C.stride() or D.shape != (i,)
            or any(v.stride(-1) != 1 for v in (x, dt, z, B, C))
            or (ssm_state is not None and (ssm_state.shape[1:] != (i, n) or not ssm_state.is_contiguous()))):
        raise _bad("selective_scan", "expected x = dt = z [T, I], A [I, N], B = C [T, N] with one row stride, D [I] "
                   "(unit last strides) and a contiguous ssm_state [S, I, N]", x=x.shape, dt=dt.shape, z=z.shape,
                   A=A.shape, B=B.shape, C=C.shape, D=D.shape)
    starts_t, slots_t, flags = _requests("selective_scan", t, starts, slots, has_state, ssm_state)
    a, d = A.contiguous(), D.contiguous()
    out = torch.empty(t, i)
    _native().zoo_selective_scan(x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), B.data_ptr(), C.data_ptr(),
                                 B.stride(0), z.data_ptr(), z.stride(0), a.data_ptr(), d.data_ptr(), t, i, n,
                                 _ptr(ssm_state), starts_t.data_ptr(), slots_t.data_ptr(), flags.data_ptr(), len(slots),
                                 out.data_ptr(), threads())
    return out
