"""Image parity: the vision tower layer by layer, the projector, the merged input embeddings and the logits of a
prompt with images, against transformers (both float32, metrics in float64), plus a scenario that feeds the
zoo's encoder output into transformers' language model, which separates vision errors from language ones.

    result = image_parity("path/to/llava", "user : <image> describe it", [pil_image])
    result.passed, result.first_divergence, [(t.name, t.rel_l2) for t in result.taps]

Shape legend:
    L = prompt tokens (placeholders expanded)    H = language model hidden size    V = vocabulary
    R = rows of a vision tap (images x patches, flattened)    E = its width

Taps, in the order they run (joined by module name: the zoo's modules carry transformers' names):
    vision     each vision layer the zoo builds (model.vision_tower.encoder.layers.{i}, model.visual.blocks.{i})
    projector  the image features [F, H] (model.multi_modal_projector, model.visual.merger)
    merged     the language model's input embeddings, image rows in place [L, H] (layer 0's input)
    logits     every position's logits [L, V]
    lm_only    transformers' logits with the zoo's image features given as mm_encoder_outputs, against
               transformers' own: a divergence here and none in the vision taps is the language model's
The prompt and images go through the zoo's preprocessing (zoo.runtime.multimodal) and the same tensors feed
both sides.

Scenarios through the runtime (LLMEngine, as the text scenarios of parity/harness.py run it: the language
model's taps per layer and the logits, joined per request and position, reported with their first divergence),
each against transformers' one-shot forward with the same images:
    chunked    the prompt prefilled under a token budget that splits an image's placeholders across steps
    prefix     the prompt, then the same text and images up to the last image's end and other text after it,
               with prefix caching: the second request starts from cached blocks, inside the last image when a
               block boundary falls there (the block size is chosen for it), its remaining rows from the
               encoder cache; the positions it computes are compared
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from parity.align import from_padded
from parity.bfloat16 import cache_rounded, reference_checkpoint
from parity.compare import compare, first_divergence, verdict
from parity.harness import ScenarioResult, check_bfloat16
from parity.inputs import special_ids
from parity.metrics import compare_logits, compare_rows
from parity.reference import load_reference
from parity.taps import LOGITS, Capture, reference_taps, short
from parity.tolerances import tolerances
from parity.zoo_side import ZooSide
from zoo.runtime.batch import ForwardBatch
from zoo.runtime.model_files import load_config, load_processor, load_tokenizer, resolve_model
from zoo.runtime.multimodal import MultiModal

VISION_LAYERS = ("model.vision_tower.encoder.layers.", "model.visual.blocks.")
PROJECTORS = ("model.multi_modal_projector", "model.visual.merger")
VISION_MODULES = ("model.vision_tower.", "model.visual.", "model.multi_modal_projector")
IMAGE_SCENARIOS = ("chunked", "prefix")


@dataclass
class ImageTap:
    name: str
    role: str  # vision, projector, merged, logits, lm_only
    rows: int
    rel_l2: float  # max over rows
    cosine: float  # min over rows (logits: 1 - max KL, see kl)
    kl: float | None = None  # logits: max KL(ref || zoo)
    passed: bool = True


@dataclass
class ImageParity:
    architecture: str
    taps: list[ImageTap] = field(default_factory=list)
    scenarios: dict[str, ScenarioResult] = field(default_factory=dict)  # chunked, prefix (through the runtime)

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.taps) and all(s.passed for s in self.scenarios.values())

    @property
    def first_divergence(self) -> str | None:
        """The first failing one-shot tap, else the first failing scenario as 'scenario: tap'."""
        tap = next((t.name for t in self.taps if not t.passed), None)
        if tap is not None:
            return tap
        for name, s in self.scenarios.items():
            if not s.passed:
                return f"{name}: {s.first_divergence['tap'] if s.first_divergence else 'runtime'}"
        return None


def _hook_outputs(model, names) -> tuple[dict[str, torch.Tensor], list]:
    got, handles = {}, []
    modules = dict(model.named_modules())
    for name in names:
        def hook(mod, args, out, name=name):
            got[name] = (out[0] if isinstance(out, tuple) else out).detach().float().clone()
        handles.append(modules[name].register_forward_hook(hook))
    return got, handles


def _layer0_input(model, zoo: bool):
    """A pre-hook on the first decoder layer keeping its input hidden states (zoo: forward(positions, h, ...))."""
    layers = model.model.language_model.layers
    box = {}

    def hook(mod, args, kwargs):
        h = args[1] if zoo else (args[0] if args else kwargs["hidden_states"])
        box["merged"] = h.detach().float().reshape(-1, h.shape[-1]).clone()

    return box, layers[0].register_forward_pre_hook(hook, with_kwargs=True)


def _vision_taps(zoo_model, ref_model) -> list[str]:
    zoo_names = {n for n, _ in zoo_model.named_modules()}
    ref_names = [n for n, _ in ref_model.named_modules()]
    layers = [n for n in ref_names if n.startswith(VISION_LAYERS) and n.rsplit(".", 1)[-1].isdigit() and n in zoo_names]
    return layers + [n for n in PROJECTORS if n in ref_names and n in zoo_names]


def _zoo_batch(num_tokens: int) -> ForwardBatch:
    t = torch.arange(num_tokens)
    return ForwardBatch(query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
                        seq_lens=torch.tensor([num_tokens], dtype=torch.int32), positions=t,
                        slot_mapping=t.clone(), block_tables=torch.zeros(1, 1, dtype=torch.int32), logits_indices=t,
                        query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[num_tokens])


def _text_ids(config, tokenizer, n: int) -> list[int]:
    """n ids of ordinary tokens (no special or placeholder id), for a checkpoint without a tokenizer."""
    exclude = special_ids(config, tokenizer)
    vocab = config.get_text_config().vocab_size
    return [i for i in range(3, vocab) if i not in exclude][:n]


def default_prompt(zoo_model, config, tokenizer, num_images: int) -> str | list[int]:
    """The image token once per image, then "Describe the image."; without a tokenizer (a `--tiny` checkpoint),
    token ids: ordinary tokens around one image token per image."""
    if tokenizer is not None:
        token = tokenizer.convert_ids_to_tokens(zoo_model.image_token_id)
        return " ".join([token] * num_images + ["Describe the image."])
    words = _text_ids(config, None, num_images + 4)
    ids = [words[0]]
    for k in range(num_images):
        ids += [zoo_model.image_token_id, words[1 + k]]
    return ids + words[num_images + 1:]


def _reference_inputs(zoo_model, ids: list[int], items) -> tuple[torch.Tensor, dict]:
    """transformers' inputs for token ids and their images: the same tensors (concatenated over images), and
    Qwen2-VL's mm_token_type_ids (it computes its M-RoPE positions from them)."""
    inputs = {k: torch.cat([it.data[k] for it in items]) for k in items[0].data} if items else {}
    input_ids = torch.tensor([ids])
    if "image_grid_thw" in inputs:
        inputs["mm_token_type_ids"] = (input_ids == zoo_model.image_token_id).int()
    return input_ids, inputs


@torch.no_grad()
def image_parity(model: str, prompt: str | list[int] | None, images: list, *, tol_overrides: dict | None = None,
                 scenarios=IMAGE_SCENARIOS, block_size: int = 4, chunk_tokens: int = 7,
                 dtype: torch.dtype = torch.float32) -> ImageParity:
    """`prompt` None: `default_prompt`. `scenarios`: which of IMAGE_SCENARIOS run through the runtime.
    `dtype=torch.bfloat16`: the zoo side built in bfloat16 (CPU storage, float32 math), the reference on the same
    weights (parity/bfloat16.py), its language model's cache reads rounded in the runtime scenarios (the one-shot
    forward keeps no cache on either side)."""
    files = resolve_model(model)
    if dtype is not torch.bfloat16:
        return _image_parity(files, prompt, images, tol_overrides, scenarios, block_size, chunk_tokens, dtype)
    check_bfloat16(files, "cpu")
    with reference_checkpoint(files.path, load_config(files)) as (path, _):
        return _image_parity(resolve_model(path), prompt, images, tol_overrides, scenarios, block_size, chunk_tokens,
                             dtype)


def _image_parity(files, prompt, images, tol_overrides, scenarios, block_size, chunk_tokens, dtype) -> ImageParity:
    bfloat16 = dtype is torch.bfloat16
    processor = load_processor(files)
    zoo = ZooSide(files.path, config=load_config(files), processor=processor, dtype=dtype)
    zoo_model, config, spec = zoo.model, zoo.config, zoo.spec
    ref = load_reference(files.path)
    tol = tolerances("multimodal", tol_overrides, bfloat16=bfloat16)
    tokenizer = load_tokenizer(files)
    mm = MultiModal(zoo_model, processor, tokenizer=tokenizer)
    if prompt is None:
        prompt = default_prompt(zoo_model, config, tokenizer, len(images))
    ids, items = mm.process("parity", prompt, images)
    taps = _vision_taps(zoo_model, ref)

    # the reference: the same tensors (concatenated over images) and the same token ids
    input_ids, inputs = _reference_inputs(zoo_model, ids, items)
    ref_out, handles = _hook_outputs(ref, taps)
    ref_merged, h0 = _layer0_input(ref, zoo=False)
    try:
        ref_logits = ref(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **inputs).logits[0]
    finally:
        for h in handles + [h0]:
            h.remove()

    # the zoo: one whole-prompt forward, no cache, features at the placeholders
    zoo_out, handles = _hook_outputs(zoo_model, taps)
    zoo_merged, h0 = _layer0_input(zoo_model, zoo=True)
    try:
        feats = zoo_model.encode_images([it.data for it in items]) if items else []
        batch = _zoo_batch(len(ids))
        if items:
            batch.mm_positions = torch.tensor([p for it in items for p in range(it.offset, it.offset + it.length)])
            batch.mm_embeds = torch.cat(feats)
            if "parity" in mm.mrope:
                batch.mrope_positions = mm.mrope["parity"][0]
        hidden = zoo_model(input_ids[0], batch.positions, batch)
        zoo_logits = zoo_model.compute_logits(hidden)
    finally:
        for h in handles + [h0]:
            h.remove()
        mm.release("parity")

    result = ImageParity(spec.architectures[0])
    width = {}
    for name in taps:
        ref_rows, zoo_rows = ref_out.get(name), zoo_out.get(name)
        if ref_rows is None or zoo_rows is None:  # no image in the prompt: the tower never ran
            continue
        e = ref_rows.shape[-1]
        width[name] = e
        result.taps.append(_rows(name, "vision" if name.startswith(VISION_LAYERS) else "projector",
                                 ref_rows.reshape(-1, e), zoo_rows.reshape(-1, e), tol))
    result.taps.append(_rows("merged", "merged", ref_merged["merged"], zoo_merged["merged"], tol))
    result.taps.append(_logits("logits", ref_logits, zoo_logits, tol))
    if items:  # transformers' language model on the zoo's image features
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        given = {"image": BaseModelOutputWithPooling(pooler_output=list(feats))}
        lm_only = ref(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_encoder_outputs=given,
                      **{k: v for k, v in inputs.items() if k in ("image_grid_thw", "mm_token_type_ids")}).logits[0]
        result.taps.append(_logits("lm_only", ref_logits, lm_only, tol))
    if items:
        run = _Scenarios(ref, zoo, ids, items, images, tol, block_size, chunk_tokens,
                         _text_ids(config, tokenizer, 8))
        with cache_rounded(ref.get_decoder()) if bfloat16 else contextlib.nullcontext():  # (the tower keeps none)
            for name in scenarios:
                result.scenarios[name] = getattr(run, name)()
    return result


def _splits(items, starts: list[int]) -> list[int]:
    """The step starts that fall strictly inside an image's placeholders."""
    return [s for s in starts if any(it.offset < s < it.offset + it.length for it in items)]


class _Scenarios:
    """The image scenarios through the runtime; the language model's taps (not the embedding: its image rows
    are the placeholders' before the merge, which the first layer's input replaces) and the logits."""

    def __init__(self, ref, zoo: ZooSide, ids, items, images, tol, block_size, chunk_tokens, words):
        self.ref, self.zoo, self.ids, self.items, self.images, self.tol = ref, zoo, ids, items, images, tol
        self.block_size, self.chunk_tokens, self.words = block_size, chunk_tokens, words
        self.taps = {n for n, role in reference_taps(ref).items() if not n.startswith(VISION_MODULES)
                     and role != "embed"}

    def reference(self, prompts: list[list[int]]):
        """transformers' one-shot forward of each prompt with the images (all of them: every prompt here holds
        the same images), taps captured -> one Trace."""
        raw, order = [], []
        for r, ids in enumerate(prompts):
            input_ids, inputs = _reference_inputs(self.zoo.model, ids, self.items)
            with Capture(self.ref, {n: n for n in self.taps}, root_output=False) as cap:
                out = self.ref(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False,
                               **inputs)
            step = cap.steps[-1]
            step.taps[LOGITS] = out.logits.detach().float().cpu()  # [1, L, V]
            raw.append(([r], len(ids), step.taps, step.experts))
            order = order or cap.order + [LOGITS]
        return from_padded(raw, order, prompts)

    def judge(self, name, description, prompts, run, *, only=None, extra_failures=(), info=None) -> ScenarioResult:
        cmp = compare(self.reference(prompts), run.trace, only=only)
        fails = list(extra_failures) + run.findings + verdict(cmp, self.tol)
        return ScenarioResult(name, description, not fails, fails, cmp, first_divergence(cmp, self.tol) if fails
                              else None, info={"steps": run.num_steps, "encoder": run.encoder, **(info or {})},
                              tol=self.tol, lengths=list(run.trace.lengths))

    def chunked(self) -> ScenarioResult:
        """A budget that splits an image (the given one if it does, else the largest smaller one that does)."""
        n = len(self.ids)
        budget = next((b for b in range(self.chunk_tokens, 0, -1) if _splits(self.items, list(range(b, n, b)))),
                      self.chunk_tokens)
        run = self.zoo.run([self.ids], self.taps, block_size=self.block_size, max_num_batched_tokens=budget,
                           images=[self.images])
        starts = [start for segs in run.segments for _, start, count in segs if 0 < start < n]
        split = _splits(self.items, starts)
        return self.judge("chunked", f"one {n}-token prompt with {len(self.items)} image(s) in chunks of at most "
                          f"{budget} tokens: steps start inside an image at {split or 'no position'}",
                          [self.ids], run, info={"budget": budget, "split_at": split},
                          extra_failures=[] if split else [f"a budget of {budget} tokens split no image"])

    def prefix(self) -> ScenarioResult:
        """Request 1: the prompt up to its last image's end, then other text; request 0 cached first."""
        last = self.items[-1]
        end = last.offset + last.length
        after = self.ids[end] if end < len(self.ids) else None
        tail = [w for w in self.words if w != after][:3]
        second = self.ids[:end] + tail
        candidates = [self.block_size] + list(range(self.block_size - 1, 1, -1)) + \
            list(range(self.block_size + 1, 2 * self.block_size + 1))
        block = next((b for b in candidates if last.offset < end // b * b < end), self.block_size)
        run = self.zoo.run([self.ids, second], self.taps, block_size=block, enable_prefix_caching=True,
                           waves=[[0], [1]], images=[self.images, self.images])
        hit = run.cached_tokens.get(1, 0)
        only = [torch.zeros(len(self.ids), dtype=torch.bool), torch.ones(len(second), dtype=torch.bool)]
        inside = last.offset < hit < end
        fails = [] if hit > 0 else [f"no prefix-cache hit: the second request computed all {len(second)} tokens"]
        return self.judge("prefix", f"the prompt, then its first {end} tokens (through the last image, rows "
                          f"{last.offset}..{end - 1}) with other text, prefix caching with blocks of {block}: "
                          f"{hit} tokens from the cache" + (", the hit ends inside the image" if inside else ""),
                          [self.ids, second], run, only=only, extra_failures=fails,
                          info={"cached_tokens": hit, "block_size": block, "hit_inside_image": inside})


def _rows(name, role, ref, got, tol) -> ImageTap:
    m = compare_rows(ref, got, name=name)
    rel, cos = float(m.rel_l2.max()), float(m.cosine.min())
    return ImageTap(name, role, ref.shape[0], rel, cos, passed=rel <= tol["rel_l2"] and cos >= tol["cosine"])


def _logits(name, ref, got, tol) -> ImageTap:
    m, rows = compare_logits(ref, got, name=name), compare_rows(ref, got, name=name)
    kl = float(m.kl.max())
    return ImageTap(name, "logits" if name == "logits" else "lm_only", ref.shape[0], float(rows.rel_l2.max()),
                    float(rows.cosine.min()), kl, passed=kl <= tol["kl_max"] and float(m.kl.mean()) <= tol["kl_mean"])


def format_image_parity(result: ImageParity) -> str:
    lines = [f"image parity ({result.architecture}): {'pass' if result.passed else 'DIVERGES'}"
             + (f", first at {result.first_divergence}" if result.first_divergence else ""),
             f"  {'tap':<44} {'role':<9} {'rows':>5} {'rel_l2':>10} {'cosine':>12} {'kl_max':>10}"]
    for t in result.taps:
        kl = "" if t.kl is None else f"{t.kl:10.2e}"
        lines.append(f"  {t.name:<44} {t.role:<9} {t.rows:5d} {t.rel_l2:10.2e} {t.cosine:12.9f} {kl:>10}"
                     + ("" if t.passed else "  <-"))
    for name, s in result.scenarios.items():
        lines.append(f"  image scenario {name:<8} {'pass' if s.passed else 'DIVERGES'}: {s.description}")
        first = s.first_divergence
        if first:
            lines.append(f"    first divergence: {first['tap']} ({short(first['tap'])}; request {first['request']}, "
                         f"position {first['position']}): rel_l2 {first['rel_l2']:.2e}, cosine {first['cosine']:.6f}")
        lines += [f"    {f}" for f in s.failures[:4]]
    return "\n".join(lines)
