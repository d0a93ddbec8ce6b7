"""Block-quantised weights kept as they are stored (GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K).

A quantised matrix [O, I] is stored row by row: each row is I / block blocks of `block_bytes` bytes, so
rows are independent and a row range is a byte range. A parameter filled from quantised tensors holds
those bytes (a uint8 tensor) and its `QuantLayout`: the logical shape and, per row range, the type (a
fused q/k/v may be Q4_K, Q4_K and Q6_K). The loader checks every quantised tensor against its parameter in
the logical shape, as it checks a float one, and accounts for every element the same way.

    layout = QuantLayout((O, I), ((0, O, QUANT_TYPES[Q4_1]),))
    raw = torch.empty(layout.nbytes, dtype=torch.uint8)
    w = layout.dequantize(raw)   # float32 [O, I], with the gguf package's own dequantiser (the reference)

Block formats (ggml's): Q4_0 {f16 d; 16 B of nibbles} x = d (q - 8); Q4_1 {f16 d, m; nibbles} x = d q + m;
Q8_0 {f16 d; 32 int8} x = d q; the K-quants are super-blocks of 256 with 6-bit (Q4_K, Q5_K: scale and min
per 32) or 8-bit (Q6_K: scale per 16) sub-block scales under f16 super-scales.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantType:
    name: str
    code: int  # the GGML type number
    block: int  # elements per block
    block_bytes: int
    scales: tuple[int, ...]  # byte offsets of the block's float16 scales (a NaN/Inf there spoils the block)

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.block_bytes


QUANT_TYPES = {t.code: t for t in (
    QuantType("Q4_0", 2, 32, 18, (0,)),
    QuantType("Q4_1", 3, 32, 20, (0, 2)),
    QuantType("Q8_0", 8, 32, 34, (0,)),
    QuantType("Q4_K", 12, 256, 144, (0, 2)),
    QuantType("Q5_K", 13, 256, 176, (0, 2)),
    QuantType("Q6_K", 14, 256, 210, (208,)),
)}


@dataclass(frozen=True)
class QuantLayout:
    """The bytes of a quantised [rows, cols] parameter: segments (row start, row stop, type) in row order,
    each segment's rows end to end."""

    shape: tuple[int, int]
    segments: tuple[tuple[int, int, QuantType], ...]

    @property
    def nbytes(self) -> int:
        return sum((b - a) * t.row_bytes(self.shape[1]) for a, b, t in self.segments)

    def offsets(self) -> list[int]:
        """The byte offset of each segment."""
        out, at = [], 0
        for a, b, t in self.segments:
            out.append(at)
            at += (b - a) * t.row_bytes(self.shape[1])
        return out

    def rows(self, raw: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The bytes of rows start:stop (inside one segment) as uint8 [stop - start, row bytes]."""
        for (a, b, t), at in zip(self.segments, self.offsets()):
            if a <= start and stop <= b:
                n = t.row_bytes(self.shape[1])
                return raw[at + (start - a) * n: at + (stop - a) * n].view(stop - start, n)
        raise ValueError(f"rows {start}:{stop} do not lie in one segment of {self}")

    def type_of(self, row: int) -> QuantType:
        return next(t for a, b, t in self.segments if a <= row < b)

    def dequantize(self, raw: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [rows, cols] (or, given row indices, just those rows), by the gguf package's dequantiser."""
        if rows is not None:
            parts = [dequantize(self.rows(raw, r, r + 1), self.type_of(r), self.shape[1]) for r in rows.tolist()]
            return torch.cat(parts) if parts else torch.empty(0, self.shape[1])
        return torch.cat([dequantize(self.rows(raw, a, b), t, self.shape[1]) for a, b, t in self.segments])

    def __str__(self) -> str:
        kinds = "+".join(f"{t.name}[{a}:{b}]" for a, b, t in self.segments) if len(self.segments) > 1 \
            else self.segments[0][2].name
        return f"{kinds} {list(self.shape)}"


def dequantize(rows: torch.Tensor, qtype: QuantType, cols: int) -> torch.Tensor:
    """uint8 [R, row bytes] -> float32 [R, cols] by gguf.quants.dequantize (numpy)."""
    import gguf
    import numpy as np

    data = np.ascontiguousarray(rows.numpy())
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qtype.code)),
                                       dtype=np.float32).reshape(rows.shape[0], cols).copy())


def nonfinite_blocks(rows: torch.Tensor, qtype: QuantType) -> int:
    """How many blocks of uint8 [R, row bytes] hold a NaN or Inf scale (every value of such a block is one;
    finite scales times the small integers make finite values)."""
    if rows.numel() == 0:
        return 0
    blocks = rows.reshape(-1, qtype.block_bytes)
    bad = torch.zeros(blocks.shape[0], dtype=torch.bool)
    for at in qtype.scales:
        half = blocks[:, at:at + 2].contiguous().view(torch.float16).view(-1)
        bad |= ~torch.isfinite(half)
    return int(bad.sum())


def layout_for(shape: tuple[int, ...], pieces: list[tuple[int, int, QuantType]]) -> QuantLayout | str:
    """The layout of a parameter of `shape` filled by `pieces` (row start, row stop, type), or why it cannot
    be one (not 2-D, rows not a multiple of the block)."""
    if len(shape) != 2:
        return f"a quantised parameter must be a matrix, not of shape {list(shape)}"
    segments = []
    for a, b, t in sorted(pieces, key=lambda p: p[0]):
        if shape[1] % t.block:
            return f"its {shape[1]} columns are not a multiple of the {t.name} block of {t.block}"
        if segments and segments[-1][2] == t and segments[-1][1] == a:
            segments[-1] = (segments[-1][0], b, t)  # neighbours of one type: one segment
        else:
            segments.append((a, b, t))
    return QuantLayout((int(shape[0]), int(shape[1])), tuple(segments))


def nbytes(shape: tuple[int, ...], qtype: QuantType) -> int:
    return math.prod(shape[:-1]) * qtype.row_bytes(shape[-1]) if shape else 0
