"""LLaVA: the zoo's vision tower, projector and merge equal transformers' on tiny checkpoints read from disk
(both checkpoint layouts), images generated with PIL and run through the checkpoint's own processor."""
import pytest
import torch
from safetensors.torch import load_file, save_file

import loader
from batching import make_batch
from multimodal_tiny import IMAGE_TOKEN_ID, drawn_image, load_reference, random_image, save_tiny_llava
from zoo.build import build_model

CASES = {
    "llama": dict(text="LlamaForCausalLM"),  # features from layer -2, class token dropped
    "qwen2-full": dict(text="Qwen2ForCausalLM", vision_feature_layer=[-4, 1, -1],  # 3 layers concatenated
                       vision_feature_select_strategy="full"),
    "mistral-tied": dict(text="MistralForCausalLM", text_overrides=dict(sliding_window=8, tie_word_embeddings=True)),
}
ATOL = 1e-4


@pytest.fixture(scope="module", params=list(CASES))
def llava(request, tmp_path_factory):
    from transformers import AutoProcessor

    path = save_tiny_llava(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    model, config, _, report = build_model(path)
    return dict(name=request.param, path=path, model=model, config=config, report=report,
                ref=load_reference(path), processor=AutoProcessor.from_pretrained(path))


def zoo_logits(model, requests):
    """requests: (token ids, pixel_values [n, 3, Hp, Wp] or None), all prefilled in one flattened step; the
    image features go to the placeholder rows as the runtime puts them -> logits of every row, per request."""
    ids, batch = make_batch([(r[0], 0) for r in requests], {}, blocks_per_seq=32)
    rows, feats, start = [], [], 0
    for tokens, pixels in requests:
        if pixels is not None:
            rows += [start + j for j, t in enumerate(tokens) if t == IMAGE_TOKEN_ID]
            feats += model.encode_images([{"pixel_values": p[None]} for p in pixels])
        start += len(tokens)
    if feats:
        batch.mm_positions, batch.mm_embeds = torch.tensor(rows), torch.cat(feats)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, batch.positions, batch))
    return logits.split([len(r[0]) for r in requests])


def processed(llava, text, images):
    out = llava["processor"](text=[text], images=images or None, return_tensors="pt")
    return out["input_ids"][0].tolist(), out.get("pixel_values")


def test_image_features_equal_transformers(llava):
    pixels = processed(llava, "<image> <image>", [random_image(0), drawn_image(1)])[1]
    with torch.no_grad():
        want = llava["ref"].model.get_image_features(pixel_values=pixels).pooler_output  # N x [F, H]
        got = llava["model"].encode_images([{"pixel_values": p[None]} for p in pixels])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=ATOL)


def test_logits_equal_transformers_in_a_ragged_batch(llava):
    requests = [
        processed(llava, "user : w1 <image> w2 w3 <image> w4 assistant :", [random_image(2), drawn_image(3)]),
        processed(llava, "user : <image> w5 w6 w7", [drawn_image(4, (30, 70))]),
        processed(llava, "user : w8 w9 w10 w11 assistant :", []),
    ]
    got = zoo_logits(llava["model"], requests)
    for i, ((tokens, pixels), g) in enumerate(zip(requests, got)):
        with torch.no_grad():
            want = llava["ref"](input_ids=torch.tensor([tokens]), pixel_values=pixels).logits[0]
        torch.testing.assert_close(g, want, rtol=0, atol=ATOL, msg=lambda m: f"{llava['name']} request {i}: {m}")


def test_unread_vision_layers_are_named_ignores(llava):
    vc, built = llava["config"].vision_config, llava["model"].model.vision_tower.num_layers
    ignored = {key: reason for key, _, reason in llava["report"].ignored}
    assert "vision_tower.post_layernorm.weight" in ignored
    skipped = [k for k in ignored if ".encoder.layers." in k]
    assert {int(k.split(".")[3]) for k in skipped} == set(range(built, vc.num_hidden_layers))
    assert all("past the deepest vision_feature_layer" in ignored[k] for k in skipped)


def hub_layout(src, dst):
    """The same weights under the hub's older names: the CLIP tower under vision_tower.vision_model."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    renamed = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
    renamed["vision_tower.vision_model.embeddings.position_ids"] = torch.arange(17)[None]
    save_file(renamed, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_hub_layout_loads_the_same_weights(llava, tmp_path):
    if llava["name"] != "llama":
        pytest.skip("one layout check is enough")
    hub = hub_layout(llava["path"], tmp_path / "hub")
    model, *_ = build_model(hub)
    saved = dict(llava["model"].named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name]), name
    # and transformers reads it as the same model
    pixels = processed(llava, "<image>", [random_image(5)])[1]
    with torch.no_grad():
        want = load_reference(hub).model.get_image_features(pixel_values=pixels).pooler_output[0]
    torch.testing.assert_close(model.encode_images([{"pixel_values": pixels}])[0], want, rtol=0, atol=ATOL)


def test_a_missing_vision_tensor_is_named(llava, tmp_path):
    if llava["name"] != "llama":
        pytest.skip("one strictness check is enough")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in llava["path"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    del tensors["vision_tower.encoder.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(loader.LoadError) as e:
        build_model(broken)
    assert "vision_tower.encoder.layers.1.self_attn.k_proj.weight -> " \
           "model.vision_tower.encoder.layers.1.self_attn.qkv_proj.weight[rows 32:64]" in str(e.value)


def test_zoo_inspect_shows_the_vision_tower_plan(llava, capsys):
    from zoo.cli import main

    if llava["name"] != "llama":
        pytest.skip("one plan is enough")
    assert main(["inspect", str(llava["path"])]) == 0
    out = capsys.readouterr().out
    assert "vision_tower.encoder.layers.{i}.self_attn.q_proj.weight" in out  # folded over the 2 built layers
    assert "model.vision_tower.encoder.layers.{i}.self_attn.qkv_proj.weight[rows 0:32]  (x2)" in out
    assert "ignored: vision_tower.encoder.layers.2.mlp.fc1.weight" in out and "past the deepest" in out


def test_image_parity_taps_pass(llava):
    from parity.multimodal import image_parity

    result = image_parity(str(llava["path"]), "user : <image> w1 <image> w2", [random_image(6), drawn_image(7)])
    roles = [t.role for t in result.taps]
    built = llava["model"].model.vision_tower.num_layers
    assert roles == ["vision"] * built + ["projector", "merged", "logits", "lm_only"]
    assert result.passed, [(t.name, t.rel_l2, t.kl) for t in result.taps]


def test_image_parity_names_a_planted_vision_bug(llava, monkeypatch):
    import torch.nn.functional as F

    from parity.multimodal import image_parity
    from zoo.layers import vision

    if llava["name"] != "llama":
        pytest.skip("one planted bug is enough")
    monkeypatch.setitem(vision.VISION_ACTIVATIONS, "quick_gelu", F.gelu)  # exact GELU in the zoo's CLIP MLPs
    result = image_parity(str(llava["path"]), "user : <image> w1", [random_image(6)])
    assert result.first_divergence == "model.vision_tower.encoder.layers.0"
    failed = {t.role for t in result.taps if not t.passed}
    assert {"vision", "projector", "merged", "logits", "lm_only"} <= failed


def test_zoo_parity_with_images(llava, tmp_path, capsys):
    from zoo.cli import main

    if llava["name"] != "llama":
        pytest.skip("one command line is enough")
    random_image(8).save(tmp_path / "a.png")
    args = ["parity", str(llava["path"]), "--scenario", "prefill", "--quiet", "--image", str(tmp_path / "a.png")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "image parity (LlavaForConditionalGeneration): pass" in out and "model.multi_modal_projector" in out
    (tmp_path / "b.png").write_bytes(b"no image")
    assert main(args[:-1] + [str(tmp_path / "b.png")]) == 2
    assert "cannot be decoded" in capsys.readouterr().err
