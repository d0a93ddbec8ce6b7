"""`zoo parity --tiny` shrinks both towers of a multimodal config (LLaVA-1.5-7B's and Qwen2-VL-2B's as published,
tests/arch_configs.py), and the harness's image scenarios through the runtime (an image split across prefill
chunks, a prefix hit inside the same image) pass on those tiny checkpoints and fail, at the language model's
first layer and the first wrong position, when the runtime mishandles a chunk that starts inside an image."""
import json

import pytest
import torch
import transformers

from arch_configs import MULTIMODAL_CONFIGS
from multimodal_tiny import drawn_image, random_image
from parity.harness import run_parity
from parity.multimodal import image_parity
from parity.tiny import feature_layers_for, load_config, save_tiny_checkpoint, shrink_config, tiny_image_processor
from zoo.build import build_model
from zoo.runtime.multimodal import MultiModal

ARCHS = list(MULTIMODAL_CONFIGS)
IMAGES = [random_image(0, (60, 80)), drawn_image(1)]


def write_real(arch, directory):
    config, preprocessor = MULTIMODAL_CONFIGS[arch]
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = {}
    for arch in ARCHS:
        root = tmp_path_factory.mktemp(arch)
        out[arch] = save_tiny_checkpoint(write_real(arch, root / "full"), root / "tiny")
    return out


@pytest.fixture(scope="module")
def passing(tiny):
    """image_parity of both tiny checkpoints with two images, every scenario."""
    return {arch: image_parity(str(tiny[arch]), None, IMAGES) for arch in ARCHS}


def test_vision_feature_layer_keeps_its_meaning():
    assert feature_layers_for(-2, 24) == (3, -2)  # 2 layers built, the last one a named ignore
    assert feature_layers_for(-1, 24) == (3, -1)
    assert feature_layers_for(0, 24) == (3, 0)  # the embeddings
    assert feature_layers_for([-2, -5, -8, -11, 6], 24) == (6, [-2, -3, -4, -5, 1])  # order and signs kept
    assert feature_layers_for(1, 24) == (2, 1)  # never deeper than it was
    with pytest.raises(ValueError, match="vision_feature_layer=-30 is outside a tower of 24 layers"):
        feature_layers_for(-30, 24)


def test_both_towers_shrink_consistently(tiny):
    llava = transformers.AutoConfig.from_pretrained(tiny["LlavaForConditionalGeneration"])
    vc, tc = llava.vision_config, llava.text_config
    assert (vc.num_hidden_layers, llava.vision_feature_layer) == (3, -2)
    assert vc.hidden_size // vc.num_attention_heads == 16 and vc.num_attention_heads == 4
    assert vc.intermediate_size == 4 * vc.hidden_size and vc.patch_size == 14 and vc.image_size == 4 * 14
    assert tc.vocab_size == 256 and llava.image_token_id < 256 and llava.pad_token_id < 256
    assert llava.image_token_id not in (tc.bos_token_id, tc.eos_token_id, llava.pad_token_id)

    qwen = transformers.AutoConfig.from_pretrained(tiny["Qwen2VLForConditionalGeneration"])
    vc, tc = qwen.vision_config, qwen.text_config
    head_dim = tc.hidden_size // tc.num_attention_heads
    assert sum(tc.rope_parameters["mrope_section"]) == head_dim // 2 and tc.rope_parameters["mrope_section"] == [2, 3, 3]
    assert vc.embed_dim // vc.num_heads == 16 and vc.depth == 2 and vc.hidden_size == tc.hidden_size
    assert (vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size, vc.in_channels) == (14, 2, 2, 3)
    ids = [qwen.image_token_id, qwen.video_token_id, qwen.vision_start_token_id, qwen.vision_end_token_id,
           tc.bos_token_id, tc.eos_token_id]
    assert len(set(ids)) == len(ids) and max(ids) < tc.vocab_size == 256


def test_the_saved_image_processor_fits_the_tiny_tower(tiny):
    """The published preprocessor_config.json's processor (the PIL one: no torchvision here), resized; an image
    gives at most 4 x 4 merged patches (Qwen2-VL) or the tower's 4 x 4 grid (LLaVA)."""
    from zoo.runtime.model_files import load_processor, resolve_model

    for arch, most in (("LlavaForConditionalGeneration", 16), ("Qwen2VLForConditionalGeneration", 16)):
        files = resolve_model(str(tiny[arch]))
        processor = load_processor(files)
        assert type(processor).__name__.endswith("ImageProcessorPil")
        assert list(processor.image_mean) == MULTIMODAL_CONFIGS[arch][1]["image_mean"]
        model, *_ = build_model(files.path)
        _, items = MultiModal(model, processor).process("r", [model.image_token_id] * 2, IMAGES)
        assert [it.length for it in items] and all(0 < it.length <= most for it in items), [it.length for it in items]


def test_the_sources_own_processor_settings_are_kept(tmp_path):
    config = shrink_config(load_config(write_real("Qwen2VLForConditionalGeneration", tmp_path / "full")))
    own = json.loads((tmp_path / "full" / "preprocessor_config.json").read_text())
    (tmp_path / "full" / "preprocessor_config.json").write_text(json.dumps({**own, "image_mean": [0.5, 0.25, 0.125]}))
    ip = tiny_image_processor(config, tmp_path / "full")
    assert list(ip.image_mean) == [0.5, 0.25, 0.125] and ip.size["longest_edge"] == (4 * 28) ** 2
    assert tiny_image_processor(config, None).image_mean != ip.image_mean  # transformers' default otherwise


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_passes_with_images(passing, tiny, arch):
    result = passing[arch]
    assert result.passed, [(t.name, t.passed) for t in result.taps] + \
        [(n, s.failures, s.first_divergence) for n, s in result.scenarios.items()]
    assert [t.role for t in result.taps][-4:] == ["projector", "merged", "logits", "lm_only"]
    chunked, prefix = result.scenarios["chunked"], result.scenarios["prefix"]
    assert chunked.info["split_at"] and chunked.info["steps"] > 1  # chunks start inside an image
    assert prefix.info["hit_inside_image"] and prefix.info["encoder"]["hits"] >= 1  # the same image, from cache
    assert prefix.info["encoder"]["runs"] == len(IMAGES)  # the second request encoded nothing
    compared = prefix.comparison.compared
    assert int(compared[0].sum()) == 0 and int(compared[1].sum()) == prefix.lengths[1] - prefix.info["cached_tokens"]
    text = run_parity(tiny[arch], scenarios=("prefill", "decode"))
    assert text.passed, {n: s.failures for n, s in text.scenarios.items()}


def test_cli_tiny_with_an_image(tmp_path, capsys):
    from zoo.cli import main

    full = write_real("Qwen2VLForConditionalGeneration", tmp_path / "full")
    IMAGES[0].save(tmp_path / "a.png")
    assert main(["parity", "--tiny", str(full), "--image", str(tmp_path / "a.png"), "--scenario", "prefill",
                 "--quiet", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "image parity (Qwen2VLForConditionalGeneration): pass" in out
    assert all(f"image scenario {name:<10} pass" in out for name in ("chunked", "prefix", "decode", "processors"))
    doc = json.loads((tmp_path / "r.json").read_text())["images"]
    assert doc["passed"] and [t["role"] for t in doc["taps"]][-2:] == ["logits", "lm_only"]
    assert set(doc["scenarios"]) == {"chunked", "prefix", "decode", "processors"}
    assert all(s["passed"] for s in doc["scenarios"].values())


# -- planted runtime bugs: the image scenarios fail where the bug is --------------------------------------------------

def chunk_local_gather(self, scheduled, query_start_loc):
    """Planted (kekzl/imp PR #1184's class): a step that starts inside an image takes the image's first rows
    again (chunk-local indexing) instead of the rows from where the step starts."""
    positions, embeds = [], []
    for s, q0 in zip(scheduled, query_start_loc):
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        for item in s.request.mm_items:
            lo, hi = max(start, item.offset), min(end, item.offset + item.length)
            if lo < hi:
                positions += range(q0 + lo - start, q0 + hi - start)
                embeds.append(self.model.encode_images([item.data])[0][: hi - lo])  # right: [lo - offset:hi - offset]
    return (torch.tensor(positions), torch.cat(embeds)) if embeds else (None, None)


def positions_from_the_prompt_start(self, scheduled, device):
    """Planted (Blaizzy/mlx-vlm #1741's class): every prefill chunk takes the M-RoPE positions of the prompt's first
    tokens instead of its own slice."""
    parts = []
    for s in scheduled:
        prompt, delta = self.mrope[s.request.request_id]
        start, n = s.num_computed_tokens, s.num_new_tokens
        parts.append(prompt[:, :n] if start < prompt.shape[1] else torch.arange(start, start + n).expand(3, -1) + delta)
    return torch.cat(parts, dim=1).to(device)


PLANTED = {"LlavaForConditionalGeneration": ("gather", chunk_local_gather, "model.language_model.layers.0."),
           "Qwen2VLForConditionalGeneration": ("positions_3d", positions_from_the_prompt_start,
                                               "model.language_model.layers.0.self_attn")}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_planted_chunk_bug_is_found_at_the_first_layer_and_position(passing, tiny, arch, monkeypatch):
    method, bug, tap = PLANTED[arch]
    monkeypatch.setattr(MultiModal, method, bug)
    result = image_parity(str(tiny[arch]), None, IMAGES, scenarios=("chunked", "prefix"))
    assert all(t.passed for t in result.taps)  # the one-shot forward does not go through the runtime's steps
    assert not result.passed and result.first_divergence.startswith("chunked: model.language_model.layers.0")
    for name, s in result.scenarios.items():
        first = s.first_divergence
        assert not s.passed and first["tap"].startswith(tap) and first["layer"] == 0, (name, first)
        ok = passing[arch].scenarios[name]  # the same scenario, unplanted: where its steps started
        want = ok.info["split_at"][0] if name == "chunked" else ok.info["cached_tokens"]
        assert (first["request"], first["position"]) == (0 if name == "chunked" else 1, want), (name, first)
