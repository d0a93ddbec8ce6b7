"""`zoo parity --tiny` on transformers' own default multimodal configs (LlavaConfig() and Qwen2VLConfig() save no
architectures, and Qwen2-VL's no mrope_section) passes with and without --image, and fails, naming the block, with a
bug planted in the zoo; the image scenarios of issue 33 fail under their plants (generated tokens' M-RoPE positions
from the token index; one encoder cache for every engine keyed by the image as given); --image / --image-prompt
misuse is one line and exit status 2."""
import contextlib
import dataclasses
import io
import json

import pytest
import torch
import transformers

import plugins.qwen2_vl
import zoo.layers.qwen2_vision
import zoo.layers.vision
import zoo.runtime.multimodal as runtime_mm
from multimodal_tiny import drawn_image, random_image, save_tiny_qwen2_vl
from parity.inputs import special_ids
from parity.multimodal import image_parity
from tiny import save_tiny
from zoo.cli import main

DEFAULTS = {"LlavaForConditionalGeneration": transformers.LlavaConfig,
            "Qwen2VLForConditionalGeneration": transformers.Qwen2VLConfig}
ARCHS = list(DEFAULTS)


def zoo_parity(*argv) -> tuple[int, str, str]:
    """`zoo parity ...` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["parity", "--quiet", *map(str, argv)])
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """transformers' default configs as save_pretrained writes them, and two images (PNG)."""
    root = tmp_path_factory.mktemp("defaults")
    for arch, config in DEFAULTS.items():
        config().save_pretrained(root / arch)
    random_image(0, (60, 80)).save(root / "a.png")
    drawn_image(1).save(root / "b.png")
    return root


@pytest.fixture(scope="module")
def runs(root):
    """Per architecture: `zoo parity --tiny DEFAULT` (every text scenario; the tiny checkpoint kept), then with both
    images (the text prefill and the image parity)."""
    out = {}
    for arch in ARCHS:
        text = zoo_parity("--tiny", root / arch, "--keep-tiny", root / f"{arch}-tiny", "--json", root / f"{arch}.json")
        image = zoo_parity("--tiny", root / arch, "--image", root / "a.png", "--image", root / "b.png",
                           "--scenario", "prefill")
        out[arch] = (text, image)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_default_configs_pass_with_and_without_images(root, runs, arch):
    (status, out, err), (image_status, image_out, image_err) = runs[arch]
    assert status == 0, out + err
    assert f"inputs: the config names no architectures: built {arch}" in out
    assert "PASS" in out.splitlines()[-1] and "crashed" not in out
    config = transformers.AutoConfig.from_pretrained(root / f"{arch}-tiny")
    specials = special_ids(config) | {config.image_token_id}
    prompts = json.loads((root / f"{arch}.json").read_text())["prompts"]
    assert len(prompts) >= 4 and not specials & {t for p in prompts for t in p}, specials  # none drawn
    assert image_status == 0, image_out + image_err
    assert f"image parity ({arch}): pass" in image_out
    assert all(f"image scenario {name:<10} pass" in image_out for name in ("chunked", "prefix", "decode", "processors"))


def test_qwen2_vl_takes_transformers_default_mrope_section(root):
    config = transformers.AutoConfig.from_pretrained(root / "Qwen2VLForConditionalGeneration-tiny")
    assert config.text_config.rope_parameters["mrope_section"] == [2, 3, 3]  # [16, 24, 24] for head_dim 16
    assert config.architectures == ["Qwen2VLForConditionalGeneration"]


def quick_gelu_as_exact_gelu(name, *, field):
    """Planted: the vision tower's quick_gelu built as the exact GELU."""
    return torch.nn.GELU()


def mrope_section_reversed(config, layer_type=None):
    """Planted: the M-RoPE sections in the wrong order ([3, 3, 2] for [2, 3, 3])."""
    params = plugins.qwen2_vl.rope_parameters(config, layer_type)
    params["mrope_section"] = list(reversed(params["mrope_section"]))
    return params


PLANTS = {"LlavaForConditionalGeneration": (zoo.layers.vision, "vision_activation", quick_gelu_as_exact_gelu,
                                            "first at model.vision_tower.encoder.layers.0"),
          "Qwen2VLForConditionalGeneration": (plugins.qwen2_vl, "mrope_parameters", mrope_section_reversed,
                                              "first at chunked: model.language_model.layers.0.self_attn")}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_planted_bug_fails_named_at_its_block(root, runs, arch, monkeypatch):
    module, name, bug, named = PLANTS[arch]
    monkeypatch.setattr(module, name, bug)
    status, out, err = zoo_parity(root / f"{arch}-tiny", "--image", root / "a.png", "--scenario", "prefill")
    assert status == 1, out + err
    assert f"image parity ({arch}): DIVERGES, {named}" in out, out
    assert "Traceback" not in out + err


def rows_and_columns_swapped(grid_thw, merge):
    """Planted: Qwen2-VL's vision rotary takes (column, row) for (row, column)."""
    return PATCH_POSITIONS(grid_thw, merge).flip(-1)


PATCH_POSITIONS = zoo.layers.qwen2_vision.patch_positions


def test_a_planted_qwen2_vision_bug_is_named_at_the_first_block(root, runs, monkeypatch):
    monkeypatch.setattr(zoo.layers.qwen2_vision, "patch_positions", rows_and_columns_swapped)
    result = image_parity(str(root / "Qwen2VLForConditionalGeneration-tiny"), None, [random_image(0, (60, 80))],
                          scenarios=())
    assert result.first_divergence == "model.visual.blocks.0", [(t.name, t.passed) for t in result.taps]


def delta_dropped(self, num_tokens, items):
    """Planted: generated tokens' M-RoPE positions continue from the token index (delta 0), the prompt's right."""
    return PLAIN_MROPE(self, num_tokens, items)[0], 0


PLAIN_MROPE = plugins.qwen2_vl.Qwen2VLForConditionalGeneration.mrope_positions


def test_decode_after_an_image_catches_generated_tokens_at_the_token_index(root, runs, monkeypatch):
    path, images = str(root / "Qwen2VLForConditionalGeneration-tiny"), [random_image(0, (60, 80))]
    ok = image_parity(path, None, images, scenarios=("decode",)).scenarios["decode"]
    assert ok.passed and ok.info["mrope_delta"] < 0 and len(ok.info["generated"][0]) == 4, ok.failures
    monkeypatch.setattr(plugins.qwen2_vl.Qwen2VLForConditionalGeneration, "mrope_positions", delta_dropped)
    result = image_parity(path, None, images, scenarios=("chunked", "decode"))
    assert result.scenarios["chunked"].passed  # the prompt's positions are right
    first = result.scenarios["decode"].first_divergence
    assert not result.passed and result.first_divergence == "decode: model.language_model.layers.0.self_attn"
    assert (first["request"], first["position"]) == (0, ok.lengths[0] - 3)  # the first decode step's token


class SharedCache:
    """Planted (an engine-level reuse bug): one encoder cache for every engine of the process, keyed by the image's
    place in the request as given, not by its processed pixels and the processor's settings."""

    def __init__(self):
        self.cache, self.init, self.process = runtime_mm.EncoderCache(8192), runtime_mm.MultiModal.__init__, \
            runtime_mm.MultiModal.process

    def plant(self, monkeypatch):
        shared = self

        def init(mm, *args, **kw):
            shared.init(mm, *args, **kw)
            mm.cache = shared.cache

        def process(mm, request_id, prompt, images):
            ids, items = shared.process(mm, request_id, prompt, images)
            return ids, [dataclasses.replace(it, hash=f"image {k}") for k, it in enumerate(items)]

        monkeypatch.setattr(runtime_mm.MultiModal, "__init__", init)
        monkeypatch.setattr(runtime_mm.MultiModal, "process", process)


@pytest.mark.parametrize("arch", ARCHS)
def test_engines_with_other_image_processors_share_no_encoder_output(root, runs, arch, monkeypatch):
    path, images = str(root / f"{arch}-tiny"), [random_image(0, (60, 80))]
    ok = image_parity(path, None, images, scenarios=("processors",)).scenarios["processors"]
    assert ok.passed and ok.info["encoder_runs"] == ok.info["distinct_images"] == 1, ok.failures
    SharedCache().plant(monkeypatch)
    bad = image_parity(path, None, images, scenarios=("processors",)).scenarios["processors"]
    assert not bad.passed and bad.first_divergence["tap"].startswith("model.language_model.layers.0.")
    assert any("engine B ran its encoder 0 times" in f for f in bad.failures), bad.failures


def test_the_encoder_cache_key_covers_the_processors_settings(root, runs):
    """Two processors that give the same pixels but differ in a setting key the same image apart."""
    from zoo.build import build_model
    from zoo.runtime.model_files import load_processor, resolve_model

    files = resolve_model(str(root / "LlavaForConditionalGeneration-tiny"))
    model, *_ = build_model(files.path)
    processor = load_processor(files)
    other = type(processor).from_dict({**processor.to_dict(), "do_convert_rgb": not processor.do_convert_rgb})
    ids = [5, model.image_token_id, 6]
    (_, [a]), (_, [b]) = (runtime_mm.MultiModal(model, p).process("r", ids, [random_image(0)])
                          for p in (processor, other))
    assert all(torch.equal(a.data[k], b.data[k]) for k in a.data) and a.hash != b.hash


@pytest.fixture(scope="module")
def qwen_with_tokenizer(tmp_path_factory):
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen") / "model")


def test_two_images_without_a_prompt_pass_on_qwen2_vl(qwen_with_tokenizer, root):
    """The default prompt writes each image inside its vision start / end tokens (the placeholders side by side
    were one image to transformers: a shape mismatch inside its M-RoPE, a traceback, exit status 1)."""
    result = image_parity(str(qwen_with_tokenizer), None, [random_image(0, (60, 80)), drawn_image(1)], scenarios=())
    assert result.passed, [(t.name, t.rel_l2) for t in result.taps]


def one_line_usage_error(status, out, err, *wanted):
    lines = [line for line in err.splitlines() if line.startswith("zoo parity: ")]
    assert status == 2 and len(lines) == 1 and "Traceback" not in out + err, (status, out, err)
    assert all(w in lines[0] for w in wanted), lines[0]


def test_image_misuse_is_one_line_exit_2(qwen_with_tokenizer, root, tmp_path):
    model, a, b = qwen_with_tokenizer, root / "a.png", root / "b.png"
    side_by_side = "<|image_pad|> <|image_pad|> w1 w2"
    one_line_usage_error(*zoo_parity(model, "--image", a, "--image", b, "--image-prompt", side_by_side,
                                     "--scenario", "prefill"),
                         "--image-prompt: images 0 and 1 have no token between their placeholders",
                         "<|vision_start|><|image_pad|><|vision_end|>")
    one_line_usage_error(*zoo_parity(model, "--image", a, "--image", b, "--image-prompt",
                                     "<|vision_start|><|image_pad|><|vision_end|> w1", "--scenario", "prefill"),
                         "--image-prompt: the prompt has 1 image placeholder tokens", "2 image(s)")
    (tmp_path / "bad.png").write_text("not an image")
    one_line_usage_error(*zoo_parity(model, "--image", tmp_path / "bad.png"), "--image: ", "bad.png",
                         "cannot be decoded")
    one_line_usage_error(*zoo_parity(save_tiny("LlamaForCausalLM", tmp_path / "llama"), "--image", a),
                         "--image: LlamaForCausalLM is a text-only")
    one_line_usage_error(*zoo_parity(model, "--image-prompt", "w1"), "--image-prompt: needs --image")


def test_given_text_prompts_holding_an_image_placeholder_are_refused(root, runs):
    from parity.harness import ParityUsageError, run_parity

    path = root / "LlavaForConditionalGeneration-tiny"
    image = transformers.AutoConfig.from_pretrained(path).image_token_id
    with pytest.raises(ParityUsageError, match=f"--prompts: prompt 1 holds the image placeholder id {image}"):
        run_parity(path, prompts=[[5, 6, 7, 8], [9, image, 10, 11]])
