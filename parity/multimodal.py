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
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parity.metrics import compare_logits, compare_rows
from parity.reference import load_reference
from parity.tolerances import tolerances
from zoo.build import build_model
from zoo.runtime.batch import ForwardBatch
from zoo.runtime.model_files import load_processor, load_tokenizer, resolve_model
from zoo.runtime.multimodal import MultiModal

VISION_LAYERS = ("model.vision_tower.encoder.layers.", "model.visual.blocks.")
PROJECTORS = ("model.multi_modal_projector", "model.visual.merger")


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

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.taps)

    @property
    def first_divergence(self) -> str | None:
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


@torch.no_grad()
def image_parity(model: str, prompt: str | list[int] | None, images: list, *, tol_overrides: dict | None = None
                 ) -> ImageParity:
    """`prompt` None: the model's image token once per image, then "Describe the image."."""
    files = resolve_model(model)
    zoo_model, config, spec, _ = build_model(files.path)
    ref = load_reference(files.path)
    tol = tolerances("multimodal", tol_overrides)
    tokenizer = load_tokenizer(files)
    mm = MultiModal(zoo_model, load_processor(files), tokenizer=tokenizer)
    if prompt is None:
        token = tokenizer.convert_ids_to_tokens(zoo_model.image_token_id)
        prompt = " ".join([token] * len(images) + ["Describe the image."])
    ids, items = mm.process("parity", prompt, images)
    taps = _vision_taps(zoo_model, ref)

    # the reference: the same tensors (concatenated over images) and the same token ids
    inputs = {k: torch.cat([it.data[k] for it in items]) for k in items[0].data} if items else {}
    input_ids = torch.tensor([ids])
    extra = {"mm_token_type_ids": (input_ids == zoo_model.image_token_id).int()} if "image_grid_thw" in inputs else {}
    ref_out, handles = _hook_outputs(ref, taps)
    ref_merged, h0 = _layer0_input(ref, zoo=False)
    try:
        ref_logits = ref(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **inputs, **extra).logits[0]
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
                      **{k: v for k, v in inputs.items() if k == "image_grid_thw"}, **extra).logits[0]
        result.taps.append(_logits("lm_only", ref_logits, lm_only, tol))
    return result


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
    return "\n".join(lines)
