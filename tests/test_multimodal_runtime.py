"""Images through the runtime (LLM.generate with vLLM's multi_modal_data): 32 greedy tokens equal transformers'
generate on the same files and images, alone, in a ragged batch with text-only requests, under chunked prefill
that splits an image; the encoder cache and the prefix cache key on the image's content."""
import numpy as np
import pytest
import torch

from multimodal_tiny import IMAGE_TOKEN_ID, drawn_image, load_reference, random_image, save_tiny_llava
from zoo import LLM, SamplingParams

STEPS = 32
IMAGES = [random_image(0), drawn_image(1), drawn_image(2, (30, 70))]
PROMPTS = {  # name -> (text, images)
    "one": ("user : w1 <image> w2 w3 assistant :", [IMAGES[0]]),
    "two": ("user : <image> w4 w5 <image> w6 assistant :", [IMAGES[1], IMAGES[2]]),
    "none": ("user : w7 w8 w9 w10 assistant :", []),
}
TEXT_ONLY = ["user : w11 w12 assistant :", "user : w13 w14 w15 w16 w17 w18 w19 w20 w21 assistant :"]
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoProcessor

    path = save_tiny_llava(tmp_path_factory.mktemp("llava-runtime"))
    ref, processor = load_reference(path), AutoProcessor.from_pretrained(path)
    ref.generation_config.eos_token_id = None  # 32 tokens whatever comes out
    expected = {}
    for name, (text, images) in {**PROMPTS, **{f"text{i}": (t, []) for i, t in enumerate(TEXT_ONLY)}}.items():
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        with torch.no_grad():
            out = ref.generate(**inputs, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
        expected[name] = out[0, inputs["input_ids"].shape[1]:].tolist()
    return path, expected


def request(text, images):
    if isinstance(images, list) and not images:
        return text
    return {"prompt": text, "multi_modal_data": {"image": images}}


def llm(path, **kw):
    return LLM(str(path), block_size=4, **kw)


def test_alone_equals_transformers_generate(tiny):
    path, expected = tiny
    engine = llm(path)
    for name, (text, images) in PROMPTS.items():
        (out,) = engine.generate(request(text, images), GREEDY)
        assert out.token_ids == expected[name], name


def test_ragged_batch_with_text_only_requests(tiny):
    """With the native kernels on, the steps without image rows (here the decodes) run the fused step, the others
    the modules: both equal transformers."""
    from zoo import kernels

    path, expected = tiny
    names = ["text0", "one", "none", "two", "text1"]
    prompts = {**PROMPTS, **{f"text{i}": (t, []) for i, t in enumerate(TEXT_ONLY)}}
    engine = llm(path)
    runner, paths = engine.engine.runner, []
    if kernels.enabled():
        assert runner.fused is not None, runner.step_path
        run, forward = runner.fused.run, runner.model.forward
        runner.fused.run = lambda step: paths.append("fused") or run(step)
        runner.model.forward = lambda *a: paths.append("modules") or forward(*a)
    outs = engine.generate([request(*prompts[n]) for n in names], GREEDY)
    for name, out in zip(names, outs):
        assert out.token_ids == expected[name], name
    assert not kernels.enabled() or (paths.count("fused") >= STEPS - 1 and "modules" in paths), paths


def test_chunked_prefill_splitting_images_equals_one_shot(tiny):
    path, expected = tiny
    engine = llm(path, max_num_batched_tokens=7)  # the 16-row images span 3 chunks
    outs = engine.generate([request(*PROMPTS["one"]), request(*PROMPTS["two"])], GREEDY)
    assert [o.token_ids for o in outs] == [expected["one"], expected["two"]]
    assert engine.engine.mm.encoder_runs == 3  # each image once, though its rows arrive over several steps


def test_same_image_encodes_once_and_shares_blocks(tiny):
    path, expected = tiny
    engine = llm(path)
    mm = engine.engine.mm
    outs = engine.generate([request(*PROMPTS["one"])] * 2, GREEDY)  # one step: one encoder run, one hit
    assert [o.token_ids for o in outs] == [expected["one"]] * 2
    assert (mm.encoder_runs, mm.cache.hits) == (1, 1)
    (again,) = engine.generate(request(*PROMPTS["one"]), GREEDY)  # later: blocks from the prefix cache
    text_len = len(again.prompt_token_ids)
    assert again.token_ids == expected["one"] and again.num_cached_tokens == (text_len - 1) // 4 * 4


def test_other_image_same_text_shares_no_image_block(tiny):
    path, expected = tiny
    engine = llm(path)
    text, _ = PROMPTS["one"]
    (first,) = engine.generate(request(text, [IMAGES[0]]), GREEDY)
    (other,) = engine.generate(request(text, [IMAGES[1]]), GREEDY)
    image_start = first.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.num_cached_tokens == image_start // 4 * 4  # the blocks before the image only
    assert other.token_ids != first.token_ids
    assert engine.engine.mm.encoder_runs == 2


def test_tiny_encoder_budget_evicts_and_recomputes_the_same(tiny):
    path, expected = tiny
    engine = llm(path, encoder_cache_rows=16, enable_prefix_caching=False)  # room for one image
    text, _ = PROMPTS["one"]
    runs = [engine.generate(request(text, [im]), GREEDY)[0].token_ids for im in (IMAGES[0], IMAGES[1], IMAGES[0])]
    mm = engine.engine.mm
    assert runs[0] == runs[2] == expected["one"] and runs[1] != runs[0]
    assert (mm.encoder_runs, mm.cache.evictions, mm.cache.hits) == (3, 2, 0)


def test_paths_arrays_and_pil_images_are_the_same_input(tiny, tmp_path):
    path, expected = tiny
    text, (image,) = PROMPTS["one"]
    image.save(tmp_path / "img.png")
    as_array = np.array(image)  # [H, W, C] uint8
    outs = llm(path).generate([request(text, [str(tmp_path / "img.png")]), request(text, as_array),
                               request(text, [torch.from_numpy(as_array).permute(2, 0, 1)])], GREEDY)
    assert [o.token_ids for o in outs] == [expected["one"]] * 3


def test_placeholder_count_mismatch_names_the_request(tiny):
    path, _ = tiny
    engine = llm(path)
    ids = [4, 6] + [IMAGE_TOKEN_ID] * 15 + [8]  # one image has 16 feature rows
    with pytest.raises(ValueError, match=r"request 'bad': the prompt has 15 image placeholder tokens .* 16 feature"):
        engine.engine.add_request(ids, GREEDY, request_id="bad", images=[IMAGES[0]])
    with pytest.raises(ValueError, match=r"request 'none': the prompt has 16 image placeholder tokens .* 0 image"):
        engine.engine.add_request([4] + [IMAGE_TOKEN_ID] * 16, GREEDY, request_id="none")
    assert not engine.engine.has_unfinished_requests()


def test_an_undecodable_image_names_the_request(tiny, tmp_path):
    path, _ = tiny
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    engine = llm(path)
    with pytest.raises(ValueError, match=r"request 'r7': image 1 \(.*broken.png\) cannot be decoded"):
        engine.engine.add_request(PROMPTS["two"][0], GREEDY, request_id="r7", images=[IMAGES[0], str(bad)])
    with pytest.raises(ValueError, match=r"request 'r8': image 0: int is not an image"):
        engine.engine.add_request(PROMPTS["one"][0], GREEDY, request_id="r8", images=[3])
    (out,) = engine.generate(request(*PROMPTS["one"]), GREEDY)  # the engine goes on
    assert out.token_ids


def test_zoo_run_with_an_image(tiny, tmp_path, capsys):
    from zoo.cli import main

    path, _ = tiny
    PROMPTS["one"][1][0].save(tmp_path / "img.png")
    assert main(["run", str(path), "--image", str(tmp_path / "img.png"), "--prompt", "Describe the image.",
                 "--max-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert "zoo: 5 tokens" in err and "prompt 23 tokens" in err  # user : <16 rows> Describe the image. assistant :
    chat = {"prompt": "user : <image> Describe the image.  assistant : ", "multi_modal_data": {"image": [IMAGES[0]]}}
    (want,) = llm(path).generate(chat, SamplingParams(temperature=0, max_tokens=5))
    assert out.strip() == want.text.strip()
    (tmp_path / "bad.png").write_bytes(b"not an image")
    assert main(["run", str(path), "--image", str(tmp_path / "bad.png"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "image 0" in err and "cannot be decoded" in err and "Traceback" not in err


def test_chat_with_image_parts(tiny, tmp_path):
    import base64

    path, _ = tiny
    engine = llm(path)
    (want,) = engine.generate({"prompt": "user : <image> Describe the image.  assistant : ",
                               "multi_modal_data": {"image": [IMAGES[0]]}}, GREEDY)
    IMAGES[0].save(tmp_path / "img.png")
    data = "data:image/png;base64," + base64.b64encode((tmp_path / "img.png").read_bytes()).decode()
    for part in ({"type": "image", "image": IMAGES[0]}, {"type": "image", "path": str(tmp_path / "img.png")},
                 {"type": "image_url", "image_url": {"url": data}}):
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "Describe the image."}]}]
        (got,) = engine.chat(messages, GREEDY)
        assert got.prompt_token_ids == want.prompt_token_ids and got.token_ids == want.token_ids, part["type"]
    with pytest.raises(ValueError, match="URLs are not fetched"):
        engine.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}])


def test_images_over_the_openai_server(tiny, tmp_path):
    """zoo serve's chat takes images as vLLM serves them (image_url parts, data: URLs): the official openai client
    against the app (in process: FastAPI's TestClient as its HTTP client) gets the text of transformers' greedy
    tokens for that image; a URL, a path-like string, bad base64 and undecodable bytes are 400s naming messages."""
    import base64
    import io

    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient

    from zoo.runtime.server import create_app

    path, expected = tiny
    engine = llm(path)
    (offline,) = engine.generate(request(*PROMPTS["one"]), GREEDY)
    assert offline.token_ids == expected["one"]  # (the runtime's tokens are transformers')
    buf = io.BytesIO()
    IMAGES[0].save(buf, format="PNG")
    data = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    def chat(client, image_url):
        return client.chat.completions.create(model="llava", temperature=0, max_tokens=STEPS,
                                              extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": [
                                                  {"type": "text", "text": "w1"},
                                                  {"type": "image_url", "image_url": {"url": image_url}},
                                                  {"type": "text", "text": "w2 w3"}]}])

    with TestClient(create_app(engine, served_model_name="llava")) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        got = chat(client, data)
        assert got.choices[0].message.content == offline.text and got.usage.prompt_tokens == len(
            offline.prompt_token_ids)
        bad = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
        for url, why in [("https://x/y.png", "data: URL"), (str(tmp_path / "img.png"), "data: URL"),
                         ("data:image/png;base64,%%%", "not base64"), (bad, "cannot be decoded")]:
            with pytest.raises(openai.BadRequestError, match=why) as e:
                chat(client, url)
            assert e.value.body["param"] == "messages"
        assert chat(client, data).choices[0].message.content == offline.text  # still serving
