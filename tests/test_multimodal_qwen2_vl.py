"""Qwen2-VL: the zoo's vision transformer and M-RoPE equal transformers' on tiny checkpoints read from disk; 32
greedy tokens through the runtime equal transformers' generate with one image, two, none, alone, ragged with
text-only requests and under chunked prefill that splits an image."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from multimodal_tiny import (QWEN_IMAGE_TOKEN_ID, drawn_image, load_reference, qwen2_vl_inputs, random_image,
                             save_tiny_qwen2_vl)
from zoo import LLM, SamplingParams
from zoo.build import build_model

STEPS = 32
IMAGE = "<|vision_start|> <|image_pad|> <|vision_end|>"
IMAGES = [random_image(0), drawn_image(1), drawn_image(2, (20, 60))]
PROMPTS = {
    "one": (f"user : w1 {IMAGE} w2 w3 assistant :", [IMAGES[0]]),
    "two": (f"user : {IMAGE} w4 w5 {IMAGE} w6 assistant :", [IMAGES[1], IMAGES[2]]),
    "none": ("user : w7 w8 w9 w10 assistant :", []),
    "text": ("user : w11 w12 w13 w14 w15 w16 w17 w18 assistant :", []),
}
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = save_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl"))
    ref = load_reference(path)
    ref.generation_config.eos_token_id = None
    expected = {}
    for name, (text, images) in PROMPTS.items():
        inputs = qwen2_vl_inputs(path, text, images)
        with torch.no_grad():
            out = ref.generate(**inputs, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
        expected[name] = out[0, inputs["input_ids"].shape[1]:].tolist()
    model, *_ = build_model(path)
    return path, ref, model, expected


def request(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def test_image_features_equal_transformers(qwen):
    path, ref, model, _ = qwen
    inputs = qwen2_vl_inputs(path, f"{IMAGE} {IMAGE}", IMAGES[1:])
    with torch.no_grad():
        want = ref.model.get_image_features(pixel_values=inputs["pixel_values"],
                                            image_grid_thw=inputs["image_grid_thw"]).pooler_output
        got = model.encode_images(model.split_images(inputs))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def test_mrope_positions_equal_get_rope_index(qwen):
    path, ref, model, _ = qwen
    llm = LLM(str(path), block_size=4)
    text, images = PROMPTS["two"]
    rid = llm.engine.add_request(text, GREEDY, images=images)
    inputs = qwen2_vl_inputs(path, text, images)
    want, want_delta = ref.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                image_grid_thw=inputs["image_grid_thw"])
    got, delta = llm.engine.mm.mrope[rid]
    assert torch.equal(got, want[:, 0]) and delta == int(want_delta)
    assert delta < 0  # the images' grids compress positions: later tokens sit before their context index


def test_alone_equals_transformers_generate(qwen):
    path, _, _, expected = qwen
    llm = LLM(str(path), block_size=4)
    for name, (text, images) in PROMPTS.items():
        (out,) = llm.generate(request(text, images), GREEDY)
        assert out.token_ids == expected[name], name


def test_ragged_and_chunked(qwen):
    path, _, _, expected = qwen
    names = ["text", "one", "none", "two"]
    for kw in ({}, {"max_num_batched_tokens": 5}):  # 5-token chunks split the 12- and 16-token images
        outs = LLM(str(path), block_size=4, **kw).generate([request(*PROMPTS[n]) for n in names], GREEDY)
        for name, out in zip(names, outs):
            assert out.token_ids == expected[name], (name, kw)


def test_prefix_hit_inside_an_image_keeps_the_positions(qwen):
    path, _, _, expected = qwen
    llm = LLM(str(path), block_size=4)
    outs = [llm.generate(request(*PROMPTS["two"]), GREEDY)[0] for _ in range(2)]
    assert outs[1].num_cached_tokens > outs[0].prompt_token_ids.index(QWEN_IMAGE_TOKEN_ID)
    assert [o.token_ids for o in outs] == [expected["two"]] * 2


def test_the_in_memory_layout_loads_the_same(qwen, tmp_path):
    path, _, model, _ = qwen
    other = tmp_path / "in-memory-names"
    other.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (other / f.name).write_bytes(f.read_bytes())
    tensors = load_file(path / "model.safetensors")
    renamed = {("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)
                if k.startswith("model.") else k): v for k, v in tensors.items()}
    assert any(k.startswith("model.visual.") for k in renamed)
    save_file(renamed, other / "model.safetensors", metadata={"format": "pt"})
    loaded, *_ = build_model(other)
    saved = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, saved[name]), name


def test_image_parity_taps_pass(qwen):
    from parity.multimodal import image_parity

    path, *_ = qwen
    result = image_parity(str(path), PROMPTS["two"][0], PROMPTS["two"][1])
    assert [t.role for t in result.taps] == ["vision"] * 2 + ["projector", "merged", "logits", "lm_only"]
    assert result.passed, [(t.name, t.rel_l2, t.kl) for t in result.taps]


OTHER = random_image(5)  # IMAGES[0]'s size, other pixels


def test_other_image_shares_no_image_block_and_the_same_image_encodes_once(qwen):
    path, _, _, expected = qwen
    llm = LLM(str(path), block_size=4)
    mm = llm.engine.mm
    text, _ = PROMPTS["one"]
    (first,) = llm.generate(request(text, [IMAGES[0]]), GREEDY)
    (other,) = llm.generate(request(text, [OTHER]), GREEDY)
    assert other.prompt_token_ids == first.prompt_token_ids  # an image of the same size: the same text
    start = first.prompt_token_ids.index(QWEN_IMAGE_TOKEN_ID)
    assert first.token_ids == expected["one"] and other.token_ids != first.token_ids
    assert other.num_cached_tokens == start // 4 * 4  # the blocks before the image only
    assert (mm.encoder_runs, mm.cache.hits) == (2, 0)
    fresh = LLM(str(path), block_size=4)
    same = fresh.generate([request(text, [IMAGES[0]])] * 2, GREEDY)  # one step: one encoder run, one hit
    assert [o.token_ids for o in same] == [expected["one"]] * 2
    assert (fresh.engine.mm.encoder_runs, fresh.engine.mm.cache.hits) == (1, 1)
    (again,) = fresh.generate(request(text, [IMAGES[0]]), GREEDY)  # later: its blocks from the prefix cache
    assert again.token_ids == expected["one"]
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 4 * 4


def test_tiny_encoder_budget_evicts_and_recomputes_the_same(qwen):
    path, _, _, expected = qwen
    rows = max(it.length for it in LLM(str(path)).engine.mm.process("r", PROMPTS["one"][0], [IMAGES[0]])[1])
    llm = LLM(str(path), block_size=4, encoder_cache_rows=rows, enable_prefix_caching=False)  # one image's room
    text, _ = PROMPTS["one"]
    runs = [llm.generate(request(text, [im]), GREEDY)[0].token_ids for im in (IMAGES[0], OTHER, IMAGES[0])]
    mm = llm.engine.mm
    assert runs[0] == runs[2] == expected["one"] and runs[1] != runs[0]
    assert (mm.encoder_runs, mm.cache.evictions, mm.cache.hits) == (3, 2, 0)
