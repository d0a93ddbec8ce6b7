"""Shared layers against transformers' own functions and modules, and paged attention against a dense one."""
from __future__ import annotations

import random

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma3 import modeling_gemma3 as hf_gemma3
from transformers.models.llama import modeling_llama as hf_llama

from zoo import kernels
from zoo.layers.attention import Attention
from zoo.layers.embedding import LMHead, VocabEmbedding
from zoo.layers.linear import QKVLinear
from zoo.layers.mlp import GatedMLP
from zoo.layers.norm import GemmaRMSNorm, RMSNorm
from zoo.layers.rotary import RotaryEmbedding, compute_inv_freq, get_rope, rope_parameters
from zoo.runtime.batch import ForwardBatch
from kernel_paths import ops  # noqa: F401  (fixture: each test taking `ops` runs on kernels and on torch ops)

ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "default-500k": dict(rope_type="default", rope_theta=500000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
    "yarn-mscale-beta-notruncate": dict(rope_type="yarn", rope_theta=50000.0, factor=8.0, mscale=0.9,
                                        mscale_all_dim=0.5, beta_fast=16, beta_slow=2, truncate=False,
                                        original_max_position_embeddings=32),
    "yarn-attention-factor": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, attention_factor=1.3,
                                  original_max_position_embeddings=64),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64),
}


def llama_config(rope: dict, **kw) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=256, rope_parameters=dict(rope), **kw)


@pytest.mark.parametrize("name", list(ROPES))
def test_inv_freq_matches_transformers(name):
    config = llama_config(ROPES[name])
    params = rope_parameters(config)
    ours, scale = compute_inv_freq(params, head_dim=32, max_position_embeddings=256)
    if params["rope_type"] == "default":
        want, want_scale = hf_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    assert torch.equal(ours, want.float()), f"{name}: {ours} != {want}"
    assert scale == pytest.approx(want_scale, rel=1e-12, abs=0), name


@pytest.mark.parametrize("seq_len", [300, 1000])
def test_dynamic_inv_freq_grown_matches_transformers(seq_len):
    config = llama_config(ROPES["dynamic"])
    ours, _ = compute_inv_freq(rope_parameters(config), head_dim=32, max_position_embeddings=256, seq_len=seq_len)
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=torch.tensor(seq_len))
    assert torch.equal(ours, want) and not torch.equal(ours, compute_inv_freq(
        rope_parameters(config), head_dim=32, max_position_embeddings=256)[0])


@pytest.mark.parametrize("name", ["default", "linear", "yarn", "llama3"])
def test_rotation_matches_transformers(name, ops):
    """cos/sin from our lazily built table, applied to q and k, equal transformers' rotary module + apply."""
    config = llama_config(ROPES[name])
    hf_rope = hf_llama.LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(head_dim=32, rope_parameters=rope_parameters(config), max_position_embeddings=256)
    positions = torch.tensor([0, 1, 2, 7, 100, 255, 3, 300])  # ragged, and past the table's first size
    q, k = torch.randn(8, 4, 32), torch.randn(8, 2, 32)
    cos, sin = hf_rope(q, positions[None])  # [1, T, D]
    want_q, want_k = hf_llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = ours(positions, q, k)  # the kernel rounds as torch does: equal bit for bit on both paths
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1)), name


def test_rotary_is_lazy_and_shared():
    params = dict(rope_type="default", rope_theta=10000.0)
    with torch.device("meta"):
        rope = get_rope(head_dim=16, rope_parameters=params, max_position_embeddings=64)
    assert rope is get_rope(head_dim=16, rope_parameters=dict(params), max_position_embeddings=64)
    q = torch.randn(3, 2, 16)
    out, _ = rope(torch.arange(3), q, q)  # first use, on the host, after construction on meta
    assert out.device.type == "cpu" and torch.equal(out[0], q[0])  # position 0 is the identity


def test_nested_rope_parameters_by_layer_type():
    config = transformers.Gemma3TextConfig(head_dim=16, rope_parameters={
        "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        "full_attention": dict(rope_type="linear", rope_theta=1e6, factor=8.0)})
    assert rope_parameters(config, "sliding_attention")["rope_theta"] == 10000.0
    assert rope_parameters(config, "full_attention")["rope_type"] == "linear"
    with pytest.raises(ValueError, match="no entry for layer type 'chunked_attention'"):
        rope_parameters(config, "chunked_attention")


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="rope_type 'wavelet' is not supported; supported: default, linear"):
        RotaryEmbedding(head_dim=8, rope_parameters=dict(rope_type="wavelet", rope_theta=1.0),
                        max_position_embeddings=8)
    with pytest.raises(ValueError, match="rotary layout 'spiral' is not supported"):
        RotaryEmbedding(head_dim=8, rope_parameters=dict(rope_theta=1.0), max_position_embeddings=8, layout="spiral")


LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
                short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.5 * i for i in range(8)])


@pytest.mark.parametrize("seq_len", [None, 64, 65, 500])
def test_longrope_inv_freq_matches_transformers(seq_len):
    """Phi-3's longrope: short factors up to the trained length, long ones past it, the sqrt attention factor."""
    config = transformers.Phi3Config(hidden_size=128, num_attention_heads=4, max_position_embeddings=256,
                                     original_max_position_embeddings=64, rope_parameters=dict(LONGROPE),
                                     partial_rotary_factor=0.5)
    params = rope_parameters(config)
    assert params["partial_rotary_factor"] == 0.5
    ours, scale = compute_inv_freq(params, head_dim=32, max_position_embeddings=256, seq_len=seq_len)
    want, want_scale = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    assert torch.equal(ours, want) and scale == pytest.approx(want_scale, rel=1e-12)
    rope = RotaryEmbedding(head_dim=32, rope_parameters=params, max_position_embeddings=256)
    assert rope.long_past == 64 and rope.grows_past is None and rope.native


@pytest.mark.parametrize("factor", [1.0, 0.25, 0.5])
def test_partial_rotary_matches_transformers(factor, ops):
    """Only the first R = factor * D dims of each head rotate (GPT-NeoX's apply, rotate-half within R)."""
    from transformers.models.gpt_neox import modeling_gpt_neox as hf_neox
    config = transformers.GPTNeoXConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=256,
                                        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                             partial_rotary_factor=factor))
    ours = RotaryEmbedding(head_dim=32, rope_parameters=rope_parameters(config), max_position_embeddings=256)
    assert ours.rotary_dim == int(32 * factor) and ours.native
    positions = torch.tensor([0, 3, 9, 40, 255, 1])
    q, k = torch.randn(6, 4, 32), torch.randn(6, 2, 32)
    cos, sin = hf_neox.GPTNeoXRotaryEmbedding(config)(q, positions[None])  # [1, T, R]
    want_q, want_k = hf_neox.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = ours(positions, q, k)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


def test_interleaved_rotation_matches_cohere():
    """The interleaved layout (dims 2f and 2f + 1 pair up), as Cohere applies it, bit for bit."""
    from transformers.models.cohere import modeling_cohere as hf_cohere
    config = transformers.CohereConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=256)
    ours = get_rope(head_dim=32, rope_parameters=rope_parameters(config), max_position_embeddings=256,
                    layout="interleaved")
    assert not ours.native and ours is not get_rope(head_dim=32, rope_parameters=rope_parameters(config),
                                                    max_position_embeddings=256)
    positions = torch.tensor([0, 5, 17, 200])
    q, k = torch.randn(4, 4, 32), torch.randn(4, 2, 32)
    cos, sin = hf_cohere.CohereRotaryEmbedding(config)(q, positions[None])
    want_q, want_k = hf_cohere.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = ours(positions, q, k)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


def test_a_plugin_extends_the_rope_table():
    """A rope type registered by a plugin is used by every RotaryEmbedding; claiming it twice needs override."""
    from zoo.layers import rotary

    def halved(params, base, dim, max_position_embeddings, seq_len):
        inv_freq, scaling = rotary.ROPE_TYPES["default"].init(params, base, dim, max_position_embeddings, seq_len)
        return inv_freq / 2, scaling

    rotary.register_rope_type("halved-test", halved)
    try:
        with pytest.raises(ValueError, match="'halved-test' is already registered; pass override=True"):
            rotary.register_rope_type("halved-test", halved)
        rope = RotaryEmbedding(head_dim=8, rope_parameters=dict(rope_type="halved-test", rope_theta=100.0),
                               max_position_embeddings=8)
        default, _ = compute_inv_freq(dict(rope_type="default", rope_theta=100.0), head_dim=8,
                                      max_position_embeddings=8)
        assert torch.equal(rope.inv_freq()[0], default / 2)
    finally:
        del rotary.ROPE_TYPES["halved-test"]


# -- norms, embedding, MLP, fused linear ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_transformers(dtype, ops):
    x = torch.randn(5, 3, 32, dtype=dtype) * 3
    w = torch.randn(32) * 0.5
    for ours, theirs in [(RMSNorm(32, eps=1e-6), hf_llama.LlamaRMSNorm(32, eps=1e-6)),
                         (GemmaRMSNorm(32, eps=1e-6), hf_gemma3.Gemma3RMSNorm(32, eps=1e-6))]:
        ours.weight.data, theirs.weight.data = w.to(dtype), w.to(dtype)
        if ops == "kernels" and dtype == torch.float32:  # the mean of squares is summed in another order
            torch.testing.assert_close(ours(x), theirs(x), rtol=2e-6, atol=2e-6, msg=type(ours).__name__)
        else:
            assert torch.equal(ours(x), theirs(x)), type(ours).__name__


def test_scaled_embedding_rounds_the_normaliser_like_transformers():
    """On the device path a bfloat16 table gives bfloat16 rows and the normaliser is rounded as transformers rounds
    it; on the CPU the rows are widened to float32 and scaled in float32, as transformers float32 on the table."""
    w = torch.randn(50, 3072).bfloat16()
    ours, theirs = VocabEmbedding(50, 3072, scale=3072 ** 0.5), hf_gemma3.Gemma3TextScaledWordEmbedding(
        50, 3072, 0, embed_scale=3072 ** 0.5)
    ours.weight.data, theirs.weight.data = w, w.clone()
    ids = torch.tensor([0, 3, 49])
    before = kernels.set_device_path(True)
    try:
        assert torch.equal(ours(ids), theirs(ids))  # sqrt(3072) becomes 55.5 in bfloat16, on both sides
    finally:
        kernels.set_device_path(before)
    theirs.weight.data = w.float()
    got = ours(ids)
    assert got.dtype is torch.float32 and torch.equal(got, theirs(ids))


def test_lm_head_softcap(ops):
    head = LMHead(10, 4, softcap=2.0)
    head.weight.data = torch.randn(10, 4)
    x = torch.randn(3, 4)
    raw = x @ head.weight.T  # [3, 10]
    torch.testing.assert_close(head(x), 2.0 * torch.tanh(raw / 2.0))
    assert head(x * 100).abs().max() <= 2.0


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_mlp_matches_transformers(act, ops):
    config = transformers.LlamaConfig(hidden_size=16, num_attention_heads=2, intermediate_size=24, hidden_act=act,
                                      mlp_bias=True)
    theirs = hf_llama.LlamaMLP(config)
    ours = GatedMLP(hidden_size=16, intermediate_size=24, hidden_act=act, bias=True)
    ours.gate_up_proj.weight.data = torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight]).detach()
    ours.gate_up_proj.bias.data = torch.cat([theirs.gate_proj.bias, theirs.up_proj.bias]).detach()
    ours.down_proj.weight.data = theirs.down_proj.weight.detach()
    ours.down_proj.bias.data = theirs.down_proj.bias.detach()
    x = torch.randn(7, 16)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-6)


def test_fused_qkv_declares_its_shards():
    qkv = QKVLinear(64, head_dim=16, num_heads=4, num_kv_heads=2, bias=True)
    assert qkv.weight.shape == (128, 64) and qkv.weight.shard_sizes == (64, 32, 32)
    assert qkv.bias.shard_sizes == (64, 32, 32)
    q, k, v = qkv.split(torch.zeros(3, 128))
    assert (q.shape, k.shape, v.shape) == ((3, 64), (3, 32), (3, 32))


# -- paged attention ---------------------------------------------------------------------------------

def dense_attention(q, k, v, *, scale, window=None, softcap=None):
    """The textbook computation for one whole sequence: q [S, H, D], k/v [S, KV, D] -> [S, H, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [S, H, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, S, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    i, j = torch.arange(q.shape[0])[:, None], torch.arange(q.shape[0])[None, :]
    allowed = (j <= i) & ((j > i - window) if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [S, H, D]


def paged_batch(step, done, cache, blocks, block_size):
    """ForwardBatch for step = [(request, new tokens)], request r owning `blocks[r]`."""
    starts, lens, slots, positions, tables = [0], [], [], [], []
    for r, n in step:
        new = range(done[r], done[r] + n)
        positions += list(new)
        slots += [blocks[r][p // block_size] * block_size + p % block_size for p in new]
        starts.append(starts[-1] + n)
        lens.append(done[r] + n)
        tables.append(blocks[r])
    return ForwardBatch(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32), logits_indices=torch.tensor([0]),
        kv_caches={"attn": cache}, block_size=block_size, query_start_loc_cpu=starts, seq_lens_cpu=lens)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_paged_attention_over_steps_equals_whole_sequence(heads, kv_heads, window, softcap, ops):
    """Two requests fed in chunks (prefill, decode, chunked prefill, interleaved) through a shuffled paged
    cache give, token for token, the attention of each whole sequence computed at once."""
    torch.manual_seed(0)
    d, bs, scale = 8, 4, 0.3
    attn = Attention(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, scale=scale, sliding_window=window,
                     softcap=softcap, prefix="attn")
    lengths = [19, 14]
    qkv = [(torch.randn(n, heads, d) * 2, torch.randn(n, kv_heads, d) * 2, torch.randn(n, kv_heads, d))
           for n in lengths]
    cache = torch.full((16, bs, 2, kv_heads, d), float("nan"))  # an unwritten slot read would show as NaN
    order = list(range(16))
    random.Random(0).shuffle(order)
    blocks = [order[:5], order[5:10]]
    steps = [[(0, 7), (1, 1)], [(1, 9), (0, 1)], [(0, 5)], [(0, 1), (1, 1)], [(1, 3), (0, 5)]]
    done, got = [0, 0], [[], []]
    for step in steps:
        batch = paged_batch(step, done, cache, blocks, bs)
        q, k, v = (torch.cat([qkv[r][x][done[r]:done[r] + n] for r, n in step]) for x in range(3))
        out = attn(q, k, v, cache, batch).view(-1, heads, d)  # [T, H, D]
        for (r, n), rows in zip(step, out.split([n for _, n in step])):
            got[r].append(rows)
            done[r] += n
    assert done == lengths
    for r in range(2):
        want = dense_attention(*qkv[r], scale=scale, window=window, softcap=softcap)
        torch.testing.assert_close(torch.cat(got[r]), want, atol=1e-5, rtol=1e-5, msg=f"request {r}")


def test_sliding_window_never_reads_blocks_outside_it(ops):
    """With a window, blocks holding only positions before the window may be recycled (here: poisoned)."""
    torch.manual_seed(1)
    attn = Attention(num_heads=2, num_kv_heads=1, head_dim=4, scale=0.5, sliding_window=4, prefix="attn")
    q, k, v = torch.randn(13, 2, 4), torch.randn(13, 1, 4), torch.randn(13, 1, 4)
    cache = torch.zeros(8, 4, 2, 1, 4)
    blocks = [[5, 2, 7, 0]]
    attn(q[:12], k[:12], v[:12], cache, paged_batch([(0, 12)], [0], cache, blocks, 4))
    cache[5] = float("nan")  # positions 0..3; the query at 12 sees 9..12 only
    cache[2] = float("nan")  # positions 4..7
    out = attn(q[12:], k[12:], v[12:], cache, paged_batch([(0, 1)], [12], cache, blocks, 4))
    want = dense_attention(q, k, v, scale=0.5, window=4)[12:]
    torch.testing.assert_close(out.view(1, 2, 4), want, atol=1e-6, rtol=1e-6)


def test_attention_without_cache_needs_whole_prompts(ops):
    attn = Attention(num_heads=2, num_kv_heads=2, head_dim=4, scale=0.5, prefix="model.layers.0.self_attn.attn")
    q = k = v = torch.randn(3, 2, 4)
    batch = ForwardBatch(query_start_loc=torch.tensor([0, 3]), seq_lens=torch.tensor([5]), positions=torch.arange(2, 5),
                         slot_mapping=torch.arange(3), block_tables=torch.zeros(1, 2, dtype=torch.int32),
                         logits_indices=torch.tensor([2]), query_start_loc_cpu=[0, 3], seq_lens_cpu=[5])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.attn: request 0 has 2 cached tokens"):
        attn(q, k, v, None, batch)
