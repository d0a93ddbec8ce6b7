"""zoo.kernels (the native CPU kernels) against torch: each kernel on the shapes and edge cases that pick its
code paths, on one and on two threads (results must not depend on the thread count), the metadata checks
that keep a bad batch from reading outside its buffers, and weight packing.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kernel_paths import twice
from zoo import kernels
from zoo.layers.attention import Attention
from zoo.layers.linear import Linear
from zoo.runtime.batch import ForwardBatch

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="zoo's native kernels are off or did not build")


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture
def threads():
    """Run the body with 2 threads (the pool's workers join), restoring the suite's count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 200, 257])
@pytest.mark.parametrize("n,k", [(960, 576), (7, 13), (100, 40), (1000, 1)])
def test_linear_matches_torch(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for bias in (None, b):
        got = twice(lambda: kernels.linear(x, w, bias))
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        torch_err = (F.linear(x, w, bias) - exact).abs().max().item()
        # a sequential float32 sum's rounding grows like sqrt(k) eps sum|x w| (torch's blocked sgemm on AVX-512
        # does better than that: 2x its error alone failed there with a correct kernel); a wrong index is O(1)
        walk = k ** 0.5 * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().t()).max().item()
        assert (got - exact).abs().max().item() <= max(2 * torch_err, walk) + 1e-6, "less accurate than a float32 sum"


def test_linear_takes_strided_rows_and_leading_dims():
    x = torch.randn(3, 4, 2 * 24)[..., ::2]  # [3, 4, 24], last stride 2: copied to rows
    w = torch.randn(10, 24)
    torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    rows = torch.randn(6, 30)[:, :24]  # row stride 30, unit last stride: used in place
    torch.testing.assert_close(kernels.linear(rows, w), F.linear(rows, w), rtol=1e-5, atol=1e-5)
    wt = torch.randn(24, 10).t()  # a non-contiguous weight goes to torch
    torch.testing.assert_close(kernels.linear(rows, wt), F.linear(rows, wt))


@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_matches_torch(gemma):
    x, w = torch.randn(70, 3, 576) * 3, torch.randn(576)
    r = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    want = r * (1 + w) if gemma else w * r
    got = twice(lambda: kernels.rms_norm(x, w, 1e-5, gemma=gemma))
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("i", [1536, 37])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_activations_match_torch(i, act):
    gu = torch.randn(40, 2 * i) * 4
    gu[0, :5] = torch.tensor([-100.0, 100.0, 0.0, -1e-4, 3e-5])  # exp's clamps, tanh near 0
    fused, ref = {"silu": (kernels.silu_mul, F.silu),
                  "gelu_tanh": (kernels.gelu_tanh_mul, lambda g: F.gelu(g, approximate="tanh"))}[act]
    got = twice(lambda: fused(gu))
    # torch's gelu_tanh rounds tanh(y) to float32 before adding 1: near tanh = -1 that loses up to 3e-8 of
    # 1 + tanh, ~1e-6 after the products here; the kernel computes 1 + tanh without the cancellation
    atol = 1e-6 if act == "silu" else 4e-6
    torch.testing.assert_close(got, ref(gu[:, :i]) * gu[:, i:], rtol=2e-6, atol=atol)
    exact = (F.gelu(gu[:, :i].double(), approximate="tanh") if act == "gelu_tanh" else F.silu(gu[:, :i].double()))
    torch.testing.assert_close(got.double(), exact * gu[:, i:].double(), rtol=2e-6, atol=1e-6)  # float64 truth


def test_argmax_and_row_max_match_torch_on_ties_nan_and_infinities():
    g = torch.Generator().manual_seed(0)
    for v in (1, 5, 16, 17, 33, 49152):
        rows = [torch.randn(v, generator=g), torch.randint(0, 3, (v,), generator=g).float(),  # ties
                torch.full((v,), float("-inf")), torch.full((v,), float("inf"))]
        nan = torch.randn(v, generator=g)
        nan[v // 2] = float("nan")
        x = torch.stack(rows + [nan])
        assert torch.equal(twice(lambda: kernels.argmax(x)), x.argmax(-1)), v
        values, indices = kernels.row_max(x)  # the sampler's: the argmax and the value there, one pass
        assert torch.equal(indices, x.argmax(-1)), v
        torch.testing.assert_close(values, torch.max(x, -1).values, rtol=0, atol=0, equal_nan=True)


def test_rotary_rejects_a_position_outside_the_table():
    cos = sin = torch.ones(8, 4)
    q, k = torch.randn(2, 3, 8), torch.randn(2, 1, 8)
    with pytest.raises(IndexError, match="token 1 has position 8, outside the cos/sin table of 8 positions"):
        kernels.rotary(q, k, torch.tensor([0, 8]), cos, sin)


def paged_step(lengths, done, cache, blocks, bs):
    """A ForwardBatch where request r brings tokens done[r] .. lengths[r] - 1."""
    starts, seq, slots, pos = [0], [], [], []
    for r, n in enumerate(lengths):
        new = range(done[r], n)
        pos += list(new)
        slots += [blocks[r][p // bs] * bs + p % bs for p in new]
        starts.append(starts[-1] + len(new))
        seq.append(n)
    width = max(len(b) for b in blocks)
    tables = [b + [0] * (width - len(b)) for b in blocks]
    return ForwardBatch(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq, dtype=torch.int32),
        positions=torch.tensor(pos), slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32), logits_indices=torch.tensor([0]),
        kv_caches={"attn": cache}, block_size=bs, query_start_loc_cpu=starts, seq_lens_cpu=seq)


@pytest.mark.parametrize("d", [16, 32, 64, 80, 128])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 3.0)])
def test_attention_matches_the_torch_path(d, window, softcap):
    """Prefill of three ragged prompts, then a step mixing decodes and a chunk: the kernel equals the torch
    path (per-request SDPA over the same paged cache) on every head size it specialises, GQA 6 / 2."""
    rng = random.Random(d)
    bs, h, kvh = 4, 6, 2
    attn = Attention(num_heads=h, num_kv_heads=kvh, head_dim=d, scale=d ** -0.5, sliding_window=window,
                     softcap=softcap, prefix="attn")
    order = list(range(40))
    rng.shuffle(order)
    blocks = [order[0:10], order[10:20], order[20:30]]
    caches = {path: torch.full((40, bs, 2, kvh, d), float("nan")) for path in ("kernels", "torch")}
    done = [0, 0, 0]
    for lengths in ([9, 3, 17], [10, 11, 18]):
        t = sum(n - a for n, a in zip(lengths, done))
        q, k, v = torch.randn(t, h, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
        out = {}
        for path, cache in caches.items():
            kernels.set_enabled(path == "kernels")
            try:
                out[path] = attn(q, k, v, cache, paged_step(lengths, done, cache, blocks, bs))
            finally:
                kernels.set_enabled(True)
        torch.testing.assert_close(out["kernels"], out["torch"], rtol=1e-5, atol=1e-5)
        done = lengths
    written = ~caches["torch"].isnan()
    assert torch.equal(written, ~caches["kernels"].isnan()) and torch.equal(
        caches["kernels"][written], caches["torch"][written]), "the kernel wrote other cache slots"


@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("window", [None, 6])
def test_attention_without_a_cache_matches_the_torch_path(d, window):
    """Whole prompts read from k and v themselves (no cache): both schedules, the blocked one (9 and 17 tokens)
    and the per-token one (3), equal the torch path."""
    attn = Attention(num_heads=6, num_kv_heads=2, head_dim=d, scale=d ** -0.5, sliding_window=window, prefix="attn")
    lengths = [9, 3, 17]
    batch = paged_step(lengths, [0, 0, 0], None, [[0] * 5] * 3, 4)
    q, k, v = torch.randn(29, 6, d), torch.randn(29, 2, d), torch.randn(29, 2, d)
    out = {}
    for path in ("kernels", "torch"):
        kernels.set_enabled(path == "kernels")
        try:
            out[path] = attn(q, k, v, None, batch)
        finally:
            kernels.set_enabled(True)
    torch.testing.assert_close(out["kernels"], out["torch"], rtol=1e-5, atol=1e-5)


def test_attention_is_the_same_on_two_threads():
    cache = torch.zeros(40, 4, 2, 3, 64)
    batch = paged_step([30, 7, 21], [0, 0, 0], cache, [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))], 4)
    q, k, v = torch.randn(58, 9, 64), torch.randn(58, 3, 64), torch.randn(58, 3, 64)
    twice(lambda: kernels.attention(q, k, v, cache, batch, scale=0.125, sliding_window=None, softcap=None))


@pytest.mark.parametrize("field,value,match", [
    ("slot_mapping", torch.tensor([0, 1, 4000]), "slot_mapping"),
    ("block_tables", torch.tensor([[0, 99]], dtype=torch.int32), "block_tables"),
    ("seq_lens", torch.tensor([2], dtype=torch.int32), "seq_lens"),
    ("query_start_loc", torch.tensor([0, 2], dtype=torch.int32), "query_start_loc"),
])
def test_attention_refuses_metadata_outside_its_buffers(field, value, match):
    cache = torch.zeros(4, 4, 2, 1, 16)
    fields = dict(query_start_loc=torch.tensor([0, 3], dtype=torch.int32), seq_lens=torch.tensor([6], dtype=torch.int32),
                  positions=torch.arange(3, 6), slot_mapping=torch.tensor([3, 4, 5]),
                  block_tables=torch.tensor([[0, 1]], dtype=torch.int32), logits_indices=torch.tensor([2]))
    fields[field] = value
    batch = ForwardBatch(**fields, kv_caches={"a": cache}, block_size=4, query_start_loc_cpu=[0, 3], seq_lens_cpu=[6])
    q = k = v = torch.randn(3, 1, 16)
    with pytest.raises(ValueError, match=match):
        kernels.attention(q, k, v, cache, batch, scale=0.25, sliding_window=None, softcap=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_weights_keeps_values_ties_and_outputs(dtype):
    from safetensors.torch import load_file
    from tiny import save_tiny
    from zoo.build import build_model
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny("LlamaForCausalLM", tmp, tie_word_embeddings=True)
        model, *_ = build_model(path, dtype=dtype)
        held = {k: v.to(dtype) for k, v in load_file(f"{path}/model.safetensors").items()}  # the reference
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert {p.dtype for p in model.parameters() if getattr(p, "compact", False)} == {dtype}  # (norms: float32)
    # the fused destinations hold the checkpoint's tensors, as torch.cat lays them out
    assert torch.equal(attn.qkv_proj.weight, torch.cat([held[f"model.layers.1.self_attn.{n}_proj.weight"]
                                                        for n in "qkv"]))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([held[f"model.layers.1.mlp.{n}_proj.weight"]
                                                           for n in ("gate", "up")]))
    assert torch.equal(model.model.embed_tokens.weight, held["model.embed_tokens.weight"])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.tensor([3, 5, 7, 11])
    batch = ForwardBatch(query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
                         seq_lens=torch.tensor([4], dtype=torch.int32), positions=torch.arange(4),
                         slot_mapping=torch.arange(4), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                         logits_indices=torch.tensor([3]), query_start_loc_cpu=[0, 4], seq_lens_cpu=[4])
    want = model.compute_logits(model(ids, batch.positions, batch))
    loaded_at = {name: p.data_ptr() for name, p in model.named_parameters()}
    packed = kernels.pack_weights(model)
    assert packed == sum((p.numel() * p.element_size() + 63) // 64 * 64 for p in model.parameters())
    assert kernels.pack_weights(model) == packed  # a second call changes nothing
    # build_model read the weights straight into the packed layout: packing moved nothing (no second copy)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == loaded_at
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    last = max(p.data_ptr() for p in model.parameters())
    assert model.model.embed_tokens.weight.data_ptr() == last, "the table read by the tied head is packed last"
    # the rest in module order (the order a step reads them), end to end in one buffer
    starts = [p.data_ptr() for n, p in model.named_parameters() if "embed" not in n]
    assert starts == sorted(starts) and last - starts[0] < packed, "one buffer, in reading order"
    assert torch.equal(model.compute_logits(model(ids, batch.positions, batch)), want)


def test_huge_pages_asked_for_only_as_far_as_free_2mb_blocks_go():
    import mmap

    if mmap.PAGESIZE != 4096:
        pytest.skip("the buddyinfo orders below assume 4 KB pages")
    info = ("Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3\n"
            "Node 0, zone    DMA32      5      3      5      4      4      4      4      5      6      5    719\n"
            "Node 0, zone   Normal   5268    409   1656     45     55     36   1902    323    347    648    103\n")
    # Normal's order-9 (2 MB) and order-10 (4 MB) blocks; DMA / DMA32 are kept for allocations that need them
    assert kernels.free_huge_bytes(info) == 648 * (2 << 20) + 103 * (4 << 20)
    assert kernels.free_huge_bytes("no zones here\n") is None
    got = kernels.free_huge_bytes()
    assert got is None or got >= 0
    buf, raw = kernels._huge_buffer(5 << 20)  # rounded up to 2 MB pages, usable whatever was granted
    assert raw.numel() == 6 << 20 and raw.dtype is torch.uint8
    raw[::4096] = 7
    assert int(raw[4096 * 1000]) == 7


def test_switched_off_layers_compute_with_torch():
    lin = Linear(24, 10)
    lin.weight.data = torch.randn(10, 24)
    x = torch.randn(3, 24)
    previous = kernels.set_enabled(False)
    try:
        assert not kernels.fast(x) and torch.equal(lin(x), F.linear(x, lin.weight))
    finally:
        kernels.set_enabled(previous)
    assert kernels.fast(x)
    with torch.enable_grad():
        assert not kernels.fast(x)  # autograd always takes torch's ops


# -- the fused decoder (one native call per step) ------------------------------------------------------

def vary(model, chosen, *, std: float, add: bool) -> None:
    """Give the chosen parameters values that a misplaced, swapped or skipped weight shows in the logits
    (transformers starts biases at zero and norms at one): noise of `std`, added or in their place, seeded by
    the parameter's name (so q and k of a layer differ)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if chosen(name):
                noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(sum(name.encode()))) * std
                p.copy_(p + noise if add else noise)


FUSED_ARCHS = {  # arch -> (config overrides, whether the driver takes it)
    "LlamaForCausalLM": (dict(tie_word_embeddings=True), True),
    "MistralForCausalLM": (dict(sliding_window=5), True),
    "Qwen2ForCausalLM": (dict(), True),  # q/k/v bias
    "Qwen3ForCausalLM": (dict(head_dim=16), True),  # q/k norms
    "Gemma3ForCausalLM": (dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
                               layer_types=["sliding_attention", "full_attention"]), True),
    "LlavaForConditionalGeneration": (dict(), True),  # its Llama on steps without image rows
}


@pytest.mark.parametrize("arch", list(FUSED_ARCHS))
def test_fused_decoder_equals_the_modules_bit_for_bit(arch, tmp_path):
    """Prefill through the modules, then ragged decode and chunk steps both ways on copies of the cache:
    equal logits and equal caches, to the bit; models the driver does not know are left to the modules."""
    from batching import allocate_kv, make_batch
    from tiny import save_tiny
    from zoo.build import build_model
    from zoo.kernels.fused import FusedDecoder
    from zoo.runtime.batch import StepLists

    from multimodal_tiny import save_tiny_llava

    overrides, qualifies = FUSED_ARCHS[arch]
    model, *_ = build_model(save_tiny_llava(tmp_path) if arch.startswith("Llava") else
                            save_tiny(arch, tmp_path, initializer_range=0.2, **overrides))
    vary(model, lambda name: "norm" in name, std=0.3, add=True)  # norms start at ones (zeros for Gemma)
    kernels.pack_weights(model)
    kv = allocate_kv(model, num_blocks=32, block_size=4, fill=0.0)
    assert (FusedDecoder.build(model, kv) is not None) == qualifies
    if not qualifies:
        return
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (9, 14, 6)]
    ids, batch = make_batch([(p[:6], 0) for p in prompts], kv, all_logits=False)
    model(ids, batch.positions, batch)  # a prefill of 6 tokens each, through the modules
    mine = {k: v.clone() for k, v in kv.items()}
    fused = FusedDecoder.build(model, mine)  # bound to its own copy of the caches
    for step, (cut, done) in enumerate([(7, 6), (8, 7), (12, 8)]):  # decodes, then chunks of up to 4
        seqs = [(p[:min(cut, len(p))], min(done, len(p) - 1)) for p in prompts]
        ids, batch = make_batch(seqs, kv, all_logits=False)
        want = model.compute_logits(model(ids, batch.positions, batch)[batch.logits_indices])
        ids, batch = make_batch(seqs, mine, all_logits=False)
        assert fused.usable(batch)
        assert torch.equal(fused(ids, batch.positions, batch), want), f"step {step}"
        assert all(torch.equal(kv[k], mine[k]) for k in kv), f"step {step}: the caches differ"
        lists = StepLists(ids.tolist(), batch.positions.tolist(), batch.slot_mapping.tolist(),
                          batch.query_start_loc.tolist(), batch.seq_lens.tolist(), [],
                          batch.block_tables.flatten().tolist(), batch.block_tables.shape[1],
                          batch.logits_indices.tolist())
        assert torch.equal(fused.run(lists), want), f"step {step}: the runner's entry (host lists)"
        assert all(torch.equal(kv[k], mine[k]) for k in kv), f"step {step}: the caches differ after run()"


@pytest.mark.parametrize("lengths", [[3], [6], [11], [9, 2, 17]])
def test_fused_prefill_equals_the_modules_bit_for_bit(lengths, tmp_path):
    """Prefill steps (the driver carries only the sampled rows past the last layer's attention, and keeps the
    MLP's activations in panels): the logits and every cache slot equal the modules', also when the step is
    short enough for the GEMV path (3 tokens), with panels of 8 rows (6) or 16 (11, 28), every linear biased."""
    from batching import allocate_kv, make_batch
    from tiny import save_tiny
    from zoo.build import build_model
    from zoo.kernels.fused import FusedDecoder

    model, *_ = build_model(save_tiny("LlamaForCausalLM", tmp_path, initializer_range=0.2, attention_bias=True,
                                      mlp_bias=True))
    vary(model, lambda name: name.endswith("bias"), std=1.0, add=False)  # transformers starts biases at zero
    kernels.pack_weights(model)
    kv = allocate_kv(model, num_blocks=32, block_size=4, fill=0.0)
    mine = {k: v.clone() for k, v in kv.items()}
    fused = FusedDecoder.build(model, mine)
    g = torch.Generator().manual_seed(1)
    seqs = [(torch.randint(3, 100, (n,), generator=g).tolist(), 0) for n in lengths]
    ids, batch = make_batch(seqs, kv, all_logits=False)
    want = model.compute_logits(model(ids, batch.positions, batch)[batch.logits_indices])
    ids, batch = make_batch(seqs, mine, all_logits=False)
    assert torch.equal(fused(ids, batch.positions, batch), want)
    assert all(torch.equal(kv[k], mine[k]) for k in kv)


def test_fused_decoder_steps_aside_for_hooks(tmp_path):
    from batching import allocate_kv, make_batch
    from tiny import save_tiny
    from zoo.build import build_model
    from zoo.kernels.fused import FusedDecoder

    model, *_ = build_model(save_tiny("LlamaForCausalLM", tmp_path))
    kv = allocate_kv(model, num_blocks=4, block_size=4, fill=0.0)
    fused = FusedDecoder.build(model, kv)
    ids, batch = make_batch([([5] * 8, 7)], kv, all_logits=False)
    assert fused.usable(batch)
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)  # a parity tap
    assert not fused.usable(batch)
    handle.remove()
    previous = kernels.set_enabled(False)
    try:
        assert not fused.usable(batch)
    finally:
        kernels.set_enabled(previous)


def test_fused_decoder_names_the_batch_field_at_fault(tmp_path):
    """The driver checks the step's metadata in C before it reads anything: a ValueError naming the field."""
    from batching import allocate_kv, make_batch
    from tiny import save_tiny
    from zoo.build import build_model
    from zoo.kernels.fused import FusedDecoder

    model, *_ = build_model(save_tiny("LlamaForCausalLM", tmp_path))
    kv = allocate_kv(model, num_blocks=4, block_size=4, fill=0.0)
    fused = FusedDecoder.build(model, kv)
    ids, batch = make_batch([([5] * 8, 6)], kv, all_logits=False)  # two new tokens: rows 0 and 1
    assert fused(ids, batch.positions, batch).shape == (1, model.config.vocab_size)
    for rows in ([2], [-1], [0, 2]):
        batch.logits_indices = torch.tensor(rows)
        with pytest.raises(ValueError, match=r"batch\.logits_indices \(rows outside the step's tokens\).* 2 tokens"):
            fused(ids, batch.positions, batch)
    batch.logits_indices = torch.tensor([1])
    with pytest.raises(ValueError, match=r"batch\.input_ids \(outside the vocabulary\)"):
        fused(torch.tensor([5, model.config.vocab_size]), batch.positions, batch)


def _mixer_step(mixer, lens, computed, slots, num_slots, *, on: bool, states: bool = True):
    """One Mamba mixer forward (hidden size 24) over requests of `lens` new tokens after `computed` ones, in state
    `slots`: the kernels (on) or the torch reference -> (y [T, H], conv state [S, K-1, C], ssm state [S, ...]).
    Slots of requests without an initial state hold NaN: the result must not read them."""
    t, qsl = sum(lens), [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, 24, generator=g)
    conv, ssm = (torch.randn(num_slots, *shape, generator=g) for _, shape, _ in mixer.cache_spec().tensors)
    for c, s in zip(computed, slots):
        if not c:
            conv[s], ssm[s] = float("nan"), float("nan")
    batch = ForwardBatch(query_start_loc=torch.tensor(qsl), seq_lens=torch.tensor(lens), positions=torch.zeros(t),
                         slot_mapping=torch.zeros(t), block_tables=torch.zeros(len(lens), 1),
                         logits_indices=torch.zeros(0))
    if states:
        batch.query_start_loc_cpu, batch.seq_lens_cpu = qsl, [c + n for c, n in zip(computed, lens)]
        batch.ssm_states, batch.state_indices_cpu = {"m": (conv, ssm)}, slots
        batch.has_initial_state_cpu = [c > 0 for c in computed]
    previous = kernels.set_enabled(on)
    try:
        return mixer(x, batch), conv, ssm
    finally:
        kernels.set_enabled(previous)


@pytest.mark.parametrize("heads,head_dim,state,groups,limit", [(8, 16, 16, 2, None), (6, 5, 12, 3, (0.05, 0.5)),
                                                                (4, 16, 40, 1, None)])
def test_mamba2_mix_matches_the_torch_mixer(heads, head_dim, state, groups, limit):
    """kernels.mamba2_mix (through Mamba2Mixer) against the mixer's torch path on one ragged step: decode rows
    and prefill rows, with an initial state (a continued prefill) and without (slots holding NaN), channels and
    state sizes that are not multiples of 16, n_groups > 1, a time-step clamp; and whole prompts without states.
    The same on one thread and on two."""
    from zoo.layers.mamba import Mamba2Mixer

    torch.manual_seed(0)
    mixer = Mamba2Mixer(hidden_size=24, num_heads=heads, head_dim=head_dim, state_size=state, n_groups=groups,
                        conv_kernel=4, chunk_size=8, time_step_limit=limit, norm_eps=1e-5, prefix="m")
    for p in mixer.parameters():
        p.copy_(torch.randn(p.shape) * 0.3)
    mixer.A_log.copy_(torch.rand(heads) * 2)
    lens, computed, slots = [1, 13, 20, 1, 2, 3], [7, 5, 0, 30, 0, 9], [3, 0, 5, 1, 2, 6]
    want = _mixer_step(mixer, lens, computed, slots, 7, on=False)
    got = _mixer_step(mixer, lens, computed, slots, 7, on=True)
    twice(lambda: torch.cat([v.flatten() for v in _mixer_step(mixer, lens, computed, slots, 7, on=True)]))
    for a, b, what in zip(got, want, ("output", "conv state", "ssm state")):
        torch.testing.assert_close(a[slots] if what != "output" else a, b[slots] if what != "output" else b,
                                   rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    whole = [_mixer_step(mixer, [9, 3, 17], [0, 0, 0], [0, 1, 2], 3, on=on, states=False)[0] for on in (True, False)]
    torch.testing.assert_close(*whole, rtol=1e-5, atol=1e-5)


def test_mamba1_conv_and_scan_match_the_torch_mixer():
    """kernels.causal_conv and kernels.selective_scan (through Jamba's MambaMixer) against its torch path on the
    same ragged step (a state size that is not a multiple of 16), and whole prompts without states."""
    from zoo.layers.mamba import MambaMixer

    torch.manual_seed(0)
    mixer = MambaMixer(hidden_size=24, intermediate_size=40, state_size=20, conv_kernel=4, dt_rank=3, norm_eps=1e-6,
                       prefix="m")
    for p in mixer.parameters():
        p.copy_(torch.randn(p.shape) * 0.3)
    lens, computed, slots = [1, 13, 20, 1, 2, 3], [7, 5, 0, 30, 0, 9], [3, 0, 5, 1, 2, 6]
    want = _mixer_step(mixer, lens, computed, slots, 7, on=False)
    got = twice(lambda: torch.cat([v.flatten() for v in _mixer_step(mixer, lens, computed, slots, 7, on=True)]))
    got = got.split([v.numel() for v in want])
    for a, b, what in zip(got, want, ("output", "conv state", "ssm state")):
        a = a.view(b.shape)
        torch.testing.assert_close(a[slots] if what != "output" else a, b[slots] if what != "output" else b,
                                   rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    whole = [_mixer_step(mixer, [9, 3, 17], [0, 0, 0], [0, 1, 2], 3, on=on, states=False)[0] for on in (True, False)]
    torch.testing.assert_close(*whole, rtol=1e-5, atol=1e-5)


def test_mamba2_mix_refuses_bad_slots():
    zx = torch.zeros(3, 2 * 8 + 2 * 4 + 1)
    args = dict(heads=1, head_dim=8, state_size=4, n_groups=1, conv_weight=torch.zeros(16, 1, 4), conv_bias=None,
                dt_bias=torch.zeros(1), A_log=torch.zeros(1), D=torch.zeros(1), norm_weight=torch.ones(8), eps=1e-5,
                time_step_limit=(0.0, float("inf")), states=(torch.zeros(2, 3, 16), torch.zeros(2, 1, 8, 4)),
                starts=[0, 1, 3], has_state=[True, False])
    for slots in ([0, 2], [1, 1]):
        with pytest.raises(ValueError, match="state slots"):
            kernels.mamba2_mix(zx, slots=slots, **args)
    with pytest.raises(ValueError, match="starts"):
        kernels.mamba2_mix(zx, slots=[0, 1], **{**args, "starts": [0, 2, 1]})


def test_describe_names_what_the_build_runs():
    """The benches print describe(): the build's instruction sets come from the compiler's macros, and every one is
    a flag this CPU advertises (a build that claimed more would SIGILL); each op family names its path."""
    info = kernels.describe()
    assert info["cpu"] and "kernels" not in info, info
    cpu_flags = set(info["cpu flags"].split())
    spelled = {"avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avxvnni": "avx_vnni", "amx-tile": "amx_tile"}
    built = {spelled.get(f, f) for f in info["built isa"].split()}
    assert built <= cpu_flags, (built, cpu_flags)
    assert ("avx2" in built) == ("avx2" in cpu_flags)
    assert "ymm" in info["linear float32"] or "zmm" in info["linear float32"] or "generic" in info["linear float32"]
    assert ("zmm" in info["linear float32"]) == ("avx512f" in built)
    assert info["quantized activations"] == {16: "int16", 8: "int8", 0: "float32"}[kernels.activation_bits()]
