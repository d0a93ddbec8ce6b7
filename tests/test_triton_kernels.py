"""zoo.kernels.triton against their torch references, under TRITON_INTERPRET=1 on CPU tensors in float32
(1e-5 relative), on the feature grid: GQA ratios 1 / 3 / 4 / 8, sliding windows, softcap, sinks, ragged
requests whose context crosses block boundaries, empty and one-token requests, decode split-K (and split-K
over an extend tile); the MoE grouped GEMM with uneven expert loads and an expert with no tokens. The
reference of the attention kernel is zoo.layers.attention.Attention's torch loop (which also writes this
step's keys and values into the cache the kernel then reads). Small shapes: the interpreter runs each
program instance in Python (~1 ms). Tests that need a GPU skip with a reason when none is present.
"""
from __future__ import annotations

import pytest
import torch

from zoo import kernels
from zoo.kernels import triton as triton_kernels
from zoo.layers.attention import Attention
from zoo.layers.moe import StackedExperts
from zoo.runtime.batch import ForwardBatch

pytestmark = pytest.mark.skipif(triton_kernels.missing() is not None, reason=str(triton_kernels.missing()))


@pytest.fixture(scope="module")
def interpreted():
    """The kernel modules, interpreted: TRITON_INTERPRET=1 is set by tests/conftest.py before anything imports
    triton (it is read at import). With a GPU present the kernels run compiled instead (below)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the kernels run compiled in test_kernels_on_the_gpu")
    import triton.language.standard as standard

    if type(standard.cdiv).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)")
    import zoo.kernels.triton.attention as attention
    import zoo.kernels.triton.moe as moe

    return attention, moe


@pytest.fixture(autouse=True)
def torch_reference():
    """The references run on torch (the native kernels off), without autograd."""
    before = kernels.set_enabled(False)
    with torch.no_grad():
        yield
    kernels.set_enabled(before)


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out - ref).abs().max().item() if out.numel() else 0.0
    assert err <= 1e-5 * max(ref.abs().max().item(), 1e-30), f"max error {err:.3g} vs |ref| {ref.abs().max():.3g}"


def paged_batch(heads, kv_heads, head_dim, block_size, new, cached, seed=0):
    """q/k/v of one step (request i: new[i] tokens after cached[i] cached ones), a cache whose blocks are handed
    out in a shuffled order (filled with noise), and the ForwardBatch the runtime would build."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for n, c in zip(new, cached)]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    cache = torch.randn(num_blocks, block_size, 2, kv_heads, head_dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, qsl = [], [], [0]
    for n, c, length in zip(new, cached, lens):
        table = [free.pop() for _ in range(-(-length // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, length)]
        qsl.append(qsl[-1] + n)
    width = max(1, max(len(t) for t in tables))
    t = qsl[-1]
    batch = ForwardBatch(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        positions=torch.tensor([p for n, c in zip(new, cached) for p in range(c, c + n)], dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([tb + [0] * (width - len(tb)) for tb in tables], dtype=torch.int32),
        logits_indices=torch.zeros(0, dtype=torch.int64), kv_caches={"layer": cache}, block_size=block_size,
        query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    q = torch.randn(t, heads, head_dim, generator=g)
    k, v = torch.randn(2, t, kv_heads, head_dim, generator=g)
    return q, k, v, cache, batch


# (heads, kv_heads, head_dim, block_size, new tokens per request, cached tokens per request, options)
DECODE = {
    "gqa1-one-token-and-crossing": (2, 2, 16, 4, [1, 1, 1], [0, 6, 13], {}),
    "gqa4-split-k": (4, 1, 16, 4, [1, 1], [3, 37], dict(num_splits=3)),
    "gqa8-window-softcap-split": (8, 1, 16, 4, [1, 1], [9, 30], dict(sliding_window=6, softcap=5.0, num_splits=2)),
    "gqa8-window-sinks-split": (8, 1, 16, 4, [1, 1], [0, 25], dict(sliding_window=8, sinks=True, num_splits=2)),
    "gqa4-empty-request": (4, 1, 16, 8, [1, 0, 1], [7, 5, 16], {}),
}
EXTEND = {
    "gqa1-ragged-empty-one-token": (2, 2, 8, 4, [5, 0, 1, 3], [3, 4, 0, 9], {}),
    "gqa4-window-softcap": (4, 1, 16, 4, [6, 2], [0, 7], dict(sliding_window=4, softcap=3.0)),
    "gqa8-long-chunk": (8, 1, 16, 4, [18, 1], [5, 0], {}),
    "gqa4-split-k-sinks": (4, 1, 16, 4, [3, 4], [20, 0], dict(num_splits=2, sinks=True)),
    "gqa3-odd-head-dim": (6, 2, 12, 4, [2, 1], [5, 6], dict(sliding_window=3)),
}


def run_both(kernel_module, heads, kv_heads, head_dim, block_size, new, cached, opts):
    opts = dict(opts)
    splits, use_sinks = opts.pop("num_splits", None), opts.pop("sinks", False)
    q, k, v, cache, batch = paged_batch(heads, kv_heads, head_dim, block_size, new, cached)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(1)) if use_sinks else None
    attn = Attention(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=head_dim ** -0.5, **opts)
    ref = attn(q, k, v, cache, batch, sinks=sinks)  # the torch path: writes k / v into the cache, then attends
    out = kernel_module.paged_attention(q, cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                                        scale=head_dim ** -0.5, max_query_len=max(new), max_seq_len=max(batch.seq_lens_cpu),
                                        sinks=sinks, num_splits=splits, **opts)
    return out, ref


@pytest.mark.parametrize("case", list(DECODE), ids=list(DECODE))
def test_decode_attention(interpreted, case):
    out, ref = run_both(interpreted[0], *DECODE[case])
    assert out.shape == ref.shape
    close(out, ref)


@pytest.mark.parametrize("case", list(EXTEND), ids=list(EXTEND))
def test_extend_attention(interpreted, case):
    out, ref = run_both(interpreted[0], *EXTEND[case])
    close(out, ref)


def test_split_k_changes_nothing_but_the_schedule(interpreted):
    """One context over 1, 2 and 5 splits (some splits past a window read nothing): the same output."""
    case = (4, 1, 16, 4, [1, 1], [40, 2], dict(sliding_window=11))
    outs = [run_both(interpreted[0], *case[:-1], dict(case[-1], num_splits=s))[0] for s in (1, 2, 5)]
    close(outs[1], outs[0])
    close(outs[2], outs[0])


def test_attention_sees_a_wrong_cache_entry(interpreted):
    """The comparison can fail: one cached key of request 1 changed after the reference ran."""
    q, k, v, cache, batch = paged_batch(4, 1, 16, 4, [1, 1], [3, 9])
    attn = Attention(num_heads=4, num_kv_heads=1, head_dim=16, scale=0.25)
    ref = attn(q, k, v, cache, batch)
    cache[batch.block_tables[1, 1], 2, 0] += 1.0  # request 1's position 6
    out = interpreted[0].paged_attention(q, cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                                         scale=0.25, max_query_len=1, max_seq_len=10)
    close(out[0:1], ref[0:1])
    with pytest.raises(AssertionError):
        close(out[1:], ref[1:])


def offsets_of(counts):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist())


@pytest.mark.parametrize("counts", [[5, 0, 17, 1], [0, 0, 9, 0], [1, 1, 1, 1]], ids=["uneven", "one-expert", "ones"])
def test_grouped_gemm(interpreted, counts):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(counts), 40, generator=g)
    w = torch.randn(len(counts), 24, 40, generator=g)
    offsets = offsets_of(counts)
    close(interpreted[1].grouped_gemm(x, w, offsets), triton_kernels.grouped_gemm_ref(x, w, offsets))
    wt = torch.randn(len(counts), 40, 24, generator=g).transpose(1, 2)  # gpt-oss's [E, K, N], as a view
    close(interpreted[1].grouped_gemm(x, wt, offsets), triton_kernels.grouped_gemm_ref(x, wt, offsets))


def test_moe_device_path_equals_the_expert_loop(interpreted, monkeypatch):
    """StackedExperts.grouped (the device path: no host read, counts by scatter_add, the grouped GEMM here in
    Triton) against its per-expert loop, with an expert that gets no token."""
    g = torch.Generator().manual_seed(3)
    experts = StackedExperts(4, 32, 16)
    experts.gate_up_proj.weight.data = torch.randn(4, 32, 32, generator=g) * 0.2
    experts.down_proj.weight.data = torch.randn(4, 32, 16, generator=g) * 0.2
    x = torch.randn(7, 32, generator=g)
    ids = torch.tensor([[0, 2], [2, 3], [0, 3], [2, 0], [3, 2], [0, 2], [2, 3]])  # expert 1: no token
    weights = torch.rand(7, 2, generator=g)
    ref = experts(x, ids, weights)
    monkeypatch.setattr(triton_kernels, "use", lambda t: True)  # the Triton kernel on these CPU tensors
    close(experts.grouped(x, ids, weights), ref)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_on_the_gpu(dtype):
    """Compiled (not interpreted) kernels on a real device, against the references run on the CPU in float32."""
    from zoo.kernels.triton.attention import paged_attention
    from zoo.kernels.triton.moe import grouped_gemm

    tol = 1e-5 if dtype is torch.float32 else 2e-2
    for case in list(DECODE.values()) + list(EXTEND.values()):
        opts = dict(case[-1])
        splits, use_sinks = opts.pop("num_splits", None), opts.pop("sinks", False)
        q, k, v, cache, batch = paged_batch(*case[:-1])
        sinks = torch.randn(case[0]) if use_sinks else None
        ref = Attention(num_heads=case[0], num_kv_heads=case[1], head_dim=case[2], scale=case[2] ** -0.5,
                        **opts)(q, k, v, cache, batch, sinks=sinks)
        dev = {f: getattr(batch, f).cuda() for f in ("query_start_loc", "seq_lens", "block_tables")}
        out = paged_attention(q.to("cuda", dtype), cache.to("cuda", dtype), dev["query_start_loc"], dev["seq_lens"],
                              dev["block_tables"], scale=case[2] ** -0.5, max_query_len=max(case[4]),
                              max_seq_len=max(batch.seq_lens_cpu), num_splits=splits,
                              sinks=None if sinks is None else sinks.cuda(), **opts)
        err = (out.float().cpu() - ref).abs().max().item()
        assert err <= tol * ref.abs().max().item(), case
    x, w, offsets = torch.randn(23, 64), torch.randn(4, 48, 64), offsets_of([5, 0, 17, 1])
    y = grouped_gemm(x.to("cuda", dtype), w.to("cuda", dtype), offsets.cuda()).float().cpu()
    ref = triton_kernels.grouped_gemm_ref(x, w, offsets)
    assert (y - ref).abs().max().item() <= tol * ref.abs().max().item() * 4
