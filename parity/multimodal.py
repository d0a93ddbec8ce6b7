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
    decode     greedy decode steps through the paged cache after the prompt, teacher-forced (the reference runs on
               the tokens the zoo generated, ordinary ones only): M-RoPE gives a generated token at context index
               p the position p + delta (delta = the prompt's largest position + 1 - its length, negative once an
               image holds more tokens than the positions it advances), which transformers' one-shot forward
               gives it too; the decoded positions are compared
    processors two engines on one model, the second with an image processor that differs in one setting (mean
               and std), the same images: the second must encode them itself (encoder-cache keys cover the
               processed pixels and the processor's settings) and match transformers fed its own processed
               tensors; an encoder cache shared across engines under a key that misses the processing would hand
               it the first engine's features
The prompt's images must be ones transformers reads as the zoo does: on an M-RoPE model (Qwen2-VL, positions from
runs of image tokens) two images with no text between them are one run to transformers, so such a prompt is
refused (ImageUsageError, exit status 2); the default prompt wraps each image in the config's vision start / end
tokens, as Qwen2-VL's chat template does.
"""
from __future__ import annotations

import contextlib
import copy
import traceback
from dataclasses import dataclass, field

import torch

from parity.align import from_padded
from parity.bfloat16 import cache_rounded, reference_checkpoint
from parity.compare import compare, first_divergence, verdict
from parity.harness import ScenarioResult, check_bfloat16
from parity.inputs import special_ids
from parity.metrics import compare_logits, compare_rows
from parity.reference import load_reference
from parity.taps import LOGITS, TP_REPLICATED_ROLES, Capture, reference_taps, short
from parity.tolerances import tolerances
from parity.zoo_side import ZooSide
from zoo.runtime.batch import ForwardBatch
from zoo.runtime.model_files import ModelNotFound, load_config, load_processor, load_tokenizer, resolve_model
from zoo.runtime.multimodal import MultiModal

VISION_LAYERS = ("model.vision_tower.encoder.layers.", "model.visual.blocks.")
PROJECTORS = ("model.multi_modal_projector", "model.visual.merger")
VISION_MODULES = ("model.vision_tower.", "model.visual.", "model.multi_modal_projector")
IMAGE_SCENARIOS = ("chunked", "prefix", "decode", "processors")


class ImageUsageError(ValueError):
    """A problem with --image / --image-prompt, found before anything is compared (exit status 2); the message
    starts with the flag."""


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
    tensor_parallel_size: int = 1  # the zoo side's ranks

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.taps) and all(s.passed for s in self.scenarios.values())

    @property
    def first_divergence(self) -> str | None:
        """The first failing vision / projector / merged tap; else the first failing scenario as 'scenario: tap'
        (they tap every layer of the language model, where the one-shot forward has only the logits); else the
        failing logits."""
        tap = next((t.name for t in self.taps if not t.passed and t.role not in ("logits", "lm_only")), None)
        if tap is not None:
            return tap
        for name, s in self.scenarios.items():
            if not s.passed:
                return f"{name}: {s.first_divergence['tap'] if s.first_divergence else 'runtime'}"
        return next((t.name for t in self.taps if not t.passed), None)


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


def _ordinary_ids(config, tokenizer) -> list[int]:
    """The ids of ordinary tokens (no special or placeholder id, none of the usual pad / bos / eos ids 0-2)."""
    exclude = special_ids(config, tokenizer)
    return [i for i in range(3, config.get_text_config().vocab_size) if i not in exclude]


def _text_ids(config, tokenizer, n: int) -> list[int]:
    """n ids of ordinary tokens, for a checkpoint without a tokenizer."""
    return _ordinary_ids(config, tokenizer)[:n]


def _image_span(config, image_token_id: int) -> list[int]:
    """One image's tokens in a prompt: the placeholder, inside the config's vision start / end tokens where it has
    them (Qwen2-VL's chat template writes <|vision_start|><|image_pad|><|vision_end|>)."""
    start, end = (getattr(config, k, None) for k in ("vision_start_token_id", "vision_end_token_id"))
    return [start] * (start is not None) + [image_token_id] + [end] * (end is not None)


def default_prompt(zoo_model, config, tokenizer, num_images: int) -> str | list[int]:
    """Each image's tokens (`_image_span`), then "Describe the image."; without a tokenizer (a `--tiny` checkpoint),
    token ids: ordinary tokens around each image's tokens. No two images touch: transformers' M-RoPE (Qwen2-VL)
    reads a run of image tokens as one image."""
    span = _image_span(config, zoo_model.image_token_id)
    if tokenizer is not None:
        image = "".join(tokenizer.convert_ids_to_tokens(span))
        return " ".join([image] * num_images + ["Describe the image."])
    words = _text_ids(config, None, num_images + 4)
    ids = [words[0]]
    for k in range(num_images):
        ids += span + [words[1 + k]]
    return ids + words[num_images + 1:]


def _unnamed(e: Exception) -> str:
    """The runtime's message without the request it names (parity's one request, 'parity')."""
    return str(e).replace("request 'parity': ", "", 1)


def check_image_args(model: str, images: list, prompt) -> None:
    """What --image / --image-prompt need that no weight does, checked before the text scenarios run: a multimodal
    architecture, images that decode (ImageUsageError naming the flag)."""
    from registry import UnsupportedArchitecture, get_registry
    from zoo.runtime.multimodal import load_image

    if prompt is not None and not images:
        raise ImageUsageError("--image-prompt: needs --image")
    try:
        spec = get_registry().resolve(load_config(resolve_model(model)))
    except (UnsupportedArchitecture, ModelNotFound, OSError, ValueError):
        return  # (the text run says what is wrong with the model)
    if spec.family != "multimodal":
        raise ImageUsageError(f"--image: {spec.architectures[0]} is a text-only ({spec.family}) model; it takes no "
                              f"images")
    for i, image in enumerate(images):
        try:
            load_image(image, "parity", i)
        except ValueError as e:
            raise ImageUsageError(f"--image: {_unnamed(e)}") from None


def _prompt_ids(mm, zoo_model, config, prompt, images, given: bool, arch: str):
    """The zoo's preprocessing of the prompt and images -> (token ids, image items); the prompt's problems are
    ImageUsageErrors naming --image-prompt (a prompt given) or --image."""
    flag = "--image-prompt" if given else "--image"
    vocab = config.get_text_config().vocab_size
    if isinstance(prompt, str) and mm.tokenizer is None:
        raise ImageUsageError(f"{flag}: the checkpoint has no tokenizer; give token ids as a JSON list, one image "
                              f"token ({zoo_model.image_token_id}) per image")
    if not isinstance(prompt, str) and any(t >= vocab for t in prompt):
        raise ImageUsageError(f"{flag}: token id {max(prompt)} is outside the vocabulary of {vocab}")
    try:
        ids, items = mm.process("parity", prompt, images)
    except ValueError as e:
        raise ImageUsageError(f"{flag}: {_unnamed(e)}") from None
    touching = [k for k, (a, b) in enumerate(zip(items, items[1:])) if a.offset + a.length == b.offset]
    if touching and callable(getattr(zoo_model, "mrope_positions", None)):  # positions from runs of image tokens
        k, span = touching[0], _image_span(config, zoo_model.image_token_id)
        written = "".join(mm.tokenizer.convert_ids_to_tokens(span)) if mm.tokenizer is not None else f"ids {span}"
        raise ImageUsageError(f"{flag}: images {k} and {k + 1} have no token between their placeholders (positions "
                              f"{items[k].offset}..{items[k + 1].offset + items[k + 1].length - 1}), which "
                              f"transformers' {arch} reads as one image; write each image as {written}")
    return ids, items


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
                 scenarios=IMAGE_SCENARIOS, block_size: int = 4, chunk_tokens: int = 7, max_new_tokens: int = 4,
                 dtype: torch.dtype = torch.float32, tensor_parallel_size: int = 1) -> ImageParity:
    """`prompt` None: `default_prompt`. `scenarios`: which of IMAGE_SCENARIOS run through the runtime.
    `max_new_tokens`: the decode scenario's generated tokens (the first from the prompt, the rest decode steps).
    `dtype=torch.bfloat16`: the zoo side built in bfloat16 (CPU storage, float32 math), the reference on the same
    weights (parity/bfloat16.py), its language model's cache reads rounded in the runtime scenarios (the one-shot
    forward keeps no cache on either side). `tensor_parallel_size=N`: the zoo side over N ranks (its vision tower
    split by heads, every vision layer's and the projector's output whole after their all-reduces; the scenarios'
    language-model taps those every rank holds whole). Problems with the images or prompt raise ImageUsageError."""
    files = resolve_model(model)
    knobs = dict(block_size=block_size, chunk_tokens=chunk_tokens, max_new_tokens=max_new_tokens)
    if dtype is not torch.bfloat16:
        return _image_parity(files, prompt, images, tol_overrides, scenarios, knobs, dtype, tensor_parallel_size)
    check_bfloat16(files, "cpu")
    with reference_checkpoint(files.path, load_config(files)) as (path, _):
        return _image_parity(resolve_model(path), prompt, images, tol_overrides, scenarios, knobs, dtype,
                             tensor_parallel_size)


def _image_parity(files, prompt, images, tol_overrides, scenarios, knobs, dtype, tensor_parallel_size) -> ImageParity:
    processor = load_processor(files)
    if processor is None:
        raise ImageUsageError(f"--image: {files.name} has no image processor (preprocessor_config.json)")
    zoo = ZooSide(files.path, config=load_config(files), processor=processor, dtype=dtype,
                  tensor_parallel_size=tensor_parallel_size)
    try:
        return _compare_images(zoo, files, prompt, images, tol_overrides, scenarios, knobs, dtype)
    finally:
        zoo.close()  # a tensor-parallel group's workers stop


def _compare_images(zoo, files, prompt, images, tol_overrides, scenarios, knobs, dtype) -> ImageParity:
    bfloat16, processor = dtype is torch.bfloat16, zoo.processor
    zoo_model, config, spec = zoo.model, zoo.config, zoo.spec
    if not MultiModal.supports(zoo_model):
        raise ImageUsageError(f"--image: {spec.architectures[0]} takes no images")
    tokenizer = load_tokenizer(files)
    mm = MultiModal(zoo_model, processor, tokenizer=tokenizer)
    given = prompt is not None
    if not given:
        prompt = default_prompt(zoo_model, config, tokenizer, len(images))
    ids, items = _prompt_ids(mm, zoo_model, config, prompt, images, given, spec.architectures[0])
    ref = load_reference(files.path)
    tol = tolerances("multimodal", tol_overrides, bfloat16=bfloat16)
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

    result = ImageParity(spec.architectures[0], tensor_parallel_size=zoo.tp.size if zoo.tp is not None else 1)
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

        encoded = {"image": BaseModelOutputWithPooling(pooler_output=list(feats))}
        lm_only = ref(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_encoder_outputs=encoded,
                      **{k: v for k, v in inputs.items() if k in ("image_grid_thw", "mm_token_type_ids")}).logits[0]
        result.taps.append(_logits("lm_only", ref_logits, lm_only, tol))
    if items:
        run = _Scenarios(ref, zoo, ids, items, images, tol, knobs, _ordinary_ids(config, tokenizer))
        with cache_rounded(ref.get_decoder()) if bfloat16 else contextlib.nullcontext():  # (the tower keeps none)
            for name in scenarios:
                try:
                    result.scenarios[name] = getattr(run, name)()
                except Exception as e:  # a crash of either side in a scenario is a finding of that scenario
                    where = traceback.extract_tb(e.__traceback__)[-1]
                    result.scenarios[name] = ScenarioResult(name, "crashed", False, [
                        f"{type(e).__name__}: {e} (at {where.filename}:{where.lineno} in {where.name})"], None)
    return result


def _splits(items, starts: list[int]) -> list[int]:
    """The step starts that fall strictly inside an image's placeholders."""
    return [s for s in starts if any(it.offset < s < it.offset + it.length for it in items)]


class _Scenarios:
    """The image scenarios through the runtime; the language model's taps (not the embedding: its image rows
    are the placeholders' before the merge, which the first layer's input replaces) and the logits."""

    def __init__(self, ref, zoo: ZooSide, ids, items, images, tol, knobs: dict, ordinary: list[int]):
        self.ref, self.zoo, self.ids, self.items, self.images, self.tol = ref, zoo, ids, items, images, tol
        self.block_size, self.chunk_tokens = knobs["block_size"], knobs["chunk_tokens"]
        self.max_new_tokens = knobs["max_new_tokens"]
        self.ordinary, self.words = ordinary, ordinary[:8]  # ordinary token ids: what decode may generate
        self.taps = {n for n, role in reference_taps(ref).items() if not n.startswith(VISION_MODULES)
                     and role != "embed" and (zoo.tp is None or role in TP_REPLICATED_ROLES)}

    def reference(self, prompts: list[list[int]], items=None):
        """transformers' one-shot forward of each prompt with the images (all of them: every prompt here holds
        the same images; `items`: processed otherwise than self.items), taps captured -> one Trace."""
        raw, order = [], []
        for r, ids in enumerate(prompts):
            input_ids, inputs = _reference_inputs(self.zoo.model, ids, items or self.items)
            with Capture(self.ref, {n: n for n in self.taps}, root_output=False) as cap:
                out = self.ref(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False,
                               **inputs)
            step = cap.steps[-1]
            step.taps[LOGITS] = out.logits.detach().float().cpu()  # [1, L, V]
            raw.append(([r], len(ids), step.taps, step.experts))
            order = order or cap.order + [LOGITS]
        return from_padded(raw, order, prompts)

    def judge(self, name, description, prompts, run, *, only=None, extra_failures=(), info=None,
              items=None) -> ScenarioResult:
        cmp = compare(self.reference(prompts, items), run.trace, only=only)
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

    def decode(self) -> ScenarioResult:
        """Greedy decode after the image prompt (ordinary tokens only: a generated placeholder would be an image
        to transformers), the reference on the tokens generated; the decoded positions compared."""
        n, prompt = self.max_new_tokens, len(self.ids)
        run = self.zoo.run([self.ids], self.taps, max_tokens=n, block_size=self.block_size, images=[self.images],
                           allowed_token_ids=self.ordinary)
        tokens = run.trace.tokens[0]
        delta, rope_index = None, getattr(getattr(self.ref, "model", None), "get_rope_index", None)
        if callable(rope_index):  # transformers' M-RoPE: what its positions of generated tokens add to p
            input_ids, inputs = _reference_inputs(self.zoo.model, self.ids, self.items)
            delta = int(rope_index(input_ids, mm_token_type_ids=inputs["mm_token_type_ids"],
                                   image_grid_thw=inputs["image_grid_thw"])[1].flatten()[0])
        where = "" if delta is None else f"; transformers' M-RoPE puts a generated token at index p at position p " \
                                         f"+ ({delta})"
        fails = [] if len(tokens) > prompt else \
            [f"no decode step ran (--max-new-tokens {n}: the first token comes from the prompt's forward)"]
        return self.judge("decode", f"{n - 1} greedy decode steps after the {prompt}-token prompt with "
                          f"{len(self.items)} image(s), through the paged cache (block size {self.block_size}), the "
                          f"reference run on the same tokens{where}", [tokens], run,
                          only=[torch.arange(len(tokens)) >= prompt], extra_failures=fails,
                          info={"generated": run.outputs, "mrope_delta": delta})

    def processors(self) -> ScenarioResult:
        """Engine A with the checkpoint's image processor, then engine B with one whose mean and std differ, the
        same images: B against transformers fed B's processed tensors; B must run its encoder for each image."""
        image_processor = getattr(self.zoo.processor, "image_processor", self.zoo.processor)
        other_ip = copy.deepcopy(image_processor)
        other_ip.image_mean = [round(1.0 - m, 4) for m in image_processor.image_mean]  # a setting that moves pixels
        other_ip.image_std = [round(2.0 * s, 4) for s in image_processor.image_std]
        other = other_ip
        if image_processor is not self.zoo.processor:  # a processor with its tokenizer: the same, its images' other
            other = copy.copy(self.zoo.processor)
            other.image_processor = other_ip
        ids, items = MultiModal(self.zoo.model, other).process("parity", self.ids, self.images)
        if ids != self.ids:
            raise RuntimeError("the other mean / std changed the prompt's placeholders")
        self.zoo.run([self.ids], self.taps, block_size=self.block_size, images=[self.images])  # engine A
        run = self.zoo.run([self.ids], self.taps, block_size=self.block_size, images=[self.images], processor=other)
        distinct = len({it.hash for it in items})
        fails = [] if run.encoder.get("runs", 0) >= distinct else \
            [f"encoder cache: engine B ran its encoder {run.encoder.get('runs', 0)} times for {distinct} image(s) "
             f"its processor (mean {other_ip.image_mean}, std {other_ip.image_std}) made: it reused features "
             f"encoded under another processor"]
        return self.judge("processors", f"engine A (the checkpoint's image processor) then engine B (mean "
                          f"{other_ip.image_mean}, std {other_ip.image_std}) on the same {len(self.items)} image(s): "
                          f"B against transformers fed B's tensors", [self.ids], run, extra_failures=fails,
                          items=items, info={"encoder_runs": run.encoder.get("runs", 0), "distinct_images": distinct})


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
    tp = f", tensor parallel size {result.tensor_parallel_size}" if result.tensor_parallel_size > 1 else ""
    lines = [f"image parity ({result.architecture}{tp}): {'pass' if result.passed else 'DIVERGES'}"
             + (f", first at {result.first_divergence}" if result.first_divergence else ""),
             f"  {'tap':<44} {'role':<9} {'rows':>5} {'rel_l2':>10} {'cosine':>12} {'kl_max':>10}"]
    for t in result.taps:
        kl = "" if t.kl is None else f"{t.kl:10.2e}"
        lines.append(f"  {t.name:<44} {t.role:<9} {t.rows:5d} {t.rel_l2:10.2e} {t.cosine:12.9f} {kl:>10}"
                     + ("" if t.passed else "  <-"))
    for name, s in result.scenarios.items():
        lines.append(f"  image scenario {name:<10} {'pass' if s.passed else 'DIVERGES'}: {s.description}")
        first = s.first_divergence
        if first:
            lines.append(f"    first divergence: {first['tap']} ({short(first['tap'])}; request {first['request']}, "
                         f"position {first['position']}): rel_l2 {first['rel_l2']:.2e}, cosine {first['cosine']:.6f}")
        lines += [f"    {f}" for f in s.failures[:4]]
    return "\n".join(lines)
