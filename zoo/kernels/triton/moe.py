"""Triton grouped GEMM for the MoE experts: tokens sorted by expert, every expert's rows times its weight, in one
launch, with no host read of the experts' loads.

Shape legend:
    A = token->expert assignments, sorted by expert   E = experts   K = in features   N = out features

y[offsets[e]:offsets[e+1]] = x[offsets[e]:offsets[e+1]] @ w[e].T for every e, with offsets [E+1] on the device.
The grid has cdiv(A, BLOCK_M) + E row tiles (an upper bound on sum_e cdiv(n_e, BLOCK_M) that needs no counts)
x cdiv(N, BLOCK_N) column tiles; row tile p finds its expert from the cumulative tile counts (a vector compare
over E), and tiles past the last expert's exit. An expert with no rows owns no tile.
The torch reference is `zoo.kernels.triton.grouped_gemm_ref` (the per-expert loop of zoo/layers/moe.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(x_ptr, x_s0, w_ptr, w_s0, w_s1, w_s2, y_ptr, y_s0, offsets_ptr, tile_cum_ptr, N, K,
                         E: tl.constexpr, EP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    p = tl.program_id(0)
    pn = tl.program_id(1)
    es = tl.arange(0, EP)
    ends = tl.load(tile_cum_ptr + 1 + es, mask=es < E, other=2147483647)  # [EP] cumulative tiles
    e = tl.sum((ends <= p).to(tl.int32), axis=0)  # the expert owning row tile p
    if e >= E:
        return
    local = p - tl.load(tile_cum_ptr + e)
    row_end = tl.load(offsets_ptr + e + 1)
    rows = tl.load(offsets_ptr + e) + local * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    r_ok = rows < row_end
    c_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_s0 + (k0 + ks)[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # [M, BK]
        w = tl.load(w_ptr + e.to(tl.int64) * w_s0 + cols[:, None] * w_s1 + (k0 + ks)[None, :] * w_s2,
                    mask=c_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * y_s0 + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=r_ok[:, None] & c_ok[None, :])


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *, block_m: int = 16,
                 block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """x [A, K] (rows sorted by expert), w [E, N, K] (any strides: a transposed [E, K, N] too), offsets [E+1]
    (device, int) -> y [A, N]."""
    a, k = x.shape
    e, n, k2 = w.shape
    if k2 != k or offsets.shape != (e + 1,) or x.stride(1) != 1:
        raise ValueError(f"grouped_gemm: x {tuple(x.shape)}, w {tuple(w.shape)}, offsets {tuple(offsets.shape)}: "
                         f"expected [A, K], [E, N, K] and [E+1] with x's last stride 1")
    y = torch.empty(a, n, dtype=x.dtype, device=x.device)
    if a == 0:
        return y
    tiles = (offsets[1:] - offsets[:-1] + block_m - 1) // block_m  # [E] row tiles per expert (on the device)
    tile_cum = torch.cat((tiles.new_zeros(1), tiles.cumsum(0))).to(torch.int32)  # [E+1]
    grid = (triton.cdiv(a, block_m) + e, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](x, x.stride(0), w, w.stride(0), w.stride(1), w.stride(2), y, y.stride(0),
                               offsets.to(torch.int32), tile_cum, n, k, E=e, EP=triton.next_power_of_2(e),
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                               PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return y
