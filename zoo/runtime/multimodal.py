"""Images through the runtime: inputs -> the checkpoint's own processor -> placeholder ranges fixed at
admission -> encoder outputs cached by content -> the rows each step needs, merged at their placeholders.

    mm = MultiModal(model, processor)                       # a model with the multimodal contract below
    token_ids, items = mm.process("req-1", "user : <image> what is it", [pil_image])
    positions, embeds = mm.gather(scheduled, query_start_loc)   # in the model runner, once per step

Shape legend:
    T = tokens of the step    H = language model hidden size    F = feature rows of one image
    M = placeholder rows of the step (all its requests)

The model's side of the contract (plugins/llava.py): `image_token_id`; `split_images(processed)` (the image
processor's output for N images -> one input dict per image); `num_image_tokens(item)` (its placeholder
tokens, which equal its feature rows); `encode_images(items)` (one [F, H] tensor per image); and a forward
that puts `batch.mm_embeds` [M, H] at the step's rows `batch.mm_positions` [M].

An image's placeholder range (offset, length) in the prompt is fixed when the request is admitted. Its
encoder runs in the first step whose scheduled span of the request overlaps the range; each step takes
the rows of the overlap, so a prefill chunk may split an image (and a prefix-cache hit may start inside
one). Encoder outputs live in an EncoderCache keyed by a content hash of the processed pixels and the
processor's settings: the same image in two requests is encoded once, and the prefix cache folds
(hash, offset) of every image overlapping a block into the block's hash (`block_extra_keys`), so the same
text with another image never shares a block.
"""
from __future__ import annotations

import hashlib
import io
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageItem:
    data: dict[str, torch.Tensor]  # the model's inputs for this image (e.g. pixel_values [1, 3, Hp, Wp])
    hash: str  # content hash of `data` and the processor's settings
    offset: int  # first placeholder position in the prompt
    length: int  # placeholder tokens = feature rows


def load_image(image, request_id: str, index: int):
    """A PIL image, a path (str / PathLike), encoded bytes, or a tensor / array as the processor takes it.
    Anything that cannot be decoded is a ValueError naming the request and the image."""
    from PIL import Image, UnidentifiedImageError

    where = f"request {request_id!r}: image {index}"
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, (str, os.PathLike, bytes)):
        name = "bytes" if isinstance(image, bytes) else str(image)
        try:
            with Image.open(io.BytesIO(image) if isinstance(image, bytes) else image) as im:
                im.load()
                return im.copy()
        except (OSError, UnidentifiedImageError, ValueError) as e:
            raise ValueError(f"{where} ({name[:80]}) cannot be decoded: {e}") from None
    if isinstance(image, torch.Tensor) or type(image).__module__ == "numpy":
        if image.ndim != 3:
            raise ValueError(f"{where}: a {image.ndim}-d array; an image array is [C, H, W] or [H, W, C]")
        return image
    raise ValueError(f"{where}: {type(image).__name__} is not an image (a PIL image, a path, bytes or an array)")


def chat_images(messages: list[dict]) -> tuple[list[dict], list]:
    """Chat messages with image parts (vLLM's and transformers' spellings: {"type": "image", "image" | "path" |
    "url": ...}, {"type": "image_url", "image_url": {"url": ...}}, {"type": "image_pil", "image_pil": ...})
    -> the messages with each image part as {"type": "image"} (what chat templates render as the image token)
    and the images in order (a data: URL decoded to bytes; other URLs are refused: nothing is downloaded)."""
    import base64

    out, images = [], []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("image", "image_url", "image_pil"):
                parts.append(part)
                continue
            value = part.get("image_url") if kind == "image_url" else part.get(kind if kind == "image_pil" else "image")
            if kind == "image_url" and isinstance(value, dict):
                value = value.get("url")
            if kind == "image" and value is None:
                value = part.get("path", part.get("url"))
            if isinstance(value, str) and value.startswith("data:"):
                value = base64.b64decode(value.partition(",")[2])
            elif isinstance(value, str) and value.startswith(("http://", "https://")):
                raise ValueError(f"chat image {len(images)}: {value[:60]}: URLs are not fetched; give a path or "
                                 f"a data: URL")
            if value is None:
                raise ValueError(f"chat image {len(images)}: a {kind!r} part without an image")
            images.append(value)
            parts.append({"type": "image"})
        out.append({**m, "content": parts})
    return out, images


def content_hash(data: dict[str, torch.Tensor], settings: str) -> str:
    """blake2b over the processed tensors (name, dtype, shape, bytes) and the processor's settings."""
    h = hashlib.blake2b(digest_size=16)
    h.update(settings.encode())
    for name in sorted(data):
        t = data[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def placeholder_ranges(token_ids: list[int], image_token_id: int, lengths: list[int],
                       request_id: str) -> list[tuple[int, int]]:
    """(offset, length) of each image's placeholder tokens, in order; a count that disagrees with the
    images' feature rows, or a split run, is a ValueError naming the request."""
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(positions) != sum(lengths):
        raise ValueError(f"request {request_id!r}: the prompt has {len(positions)} image placeholder tokens "
                         f"(id {image_token_id}) but its {len(lengths)} image(s) give {sum(lengths)} feature rows "
                         f"({', '.join(map(str, lengths))})")
    out, k = [], 0
    for n in lengths:
        span = positions[k:k + n]
        if span and span[-1] - span[0] != n - 1:
            raise ValueError(f"request {request_id!r}: the {n} placeholder tokens of image {len(out)} are not "
                             f"contiguous (positions {span[0]}..{span[-1]})")
        out.append((span[0] if span else 0, n))
        k += n
    return out


def expand_placeholders(token_ids: list[int], image_token_id: int, lengths: list[int]) -> list[int]:
    """Token ids holding one image token per image (a chat template's output, say) with each one repeated
    to its image's length, as the processor expands text; ids already expanded (or not one per image) as
    they are."""
    if sum(lengths) == len(lengths) or sum(t == image_token_id for t in token_ids) != len(lengths):
        return token_ids
    out, k = [], 0
    for t in token_ids:
        if t == image_token_id:
            out += [t] * lengths[k]
            k += 1
        else:
            out.append(t)
    return out


def block_extra_keys(items: list[ImageItem], start: int, end: int) -> tuple:
    """(hash, offset) of every image whose placeholders overlap the token range [start, end)."""
    return tuple((it.hash, it.offset) for it in items if it.offset < end and start < it.offset + it.length)


class EncoderCache:
    """Encoder outputs [F, H] by content hash, sized in feature rows (`budget`). A request whose computed
    tokens stop inside an image holds its entry (`hold`) until a later step takes the rest (`release`);
    entries nobody holds are evicted least recently used first when a new one needs room. An entry larger
    than what eviction can free is not kept (a later chunk that needs it recomputes it)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # LRU first
        self.refs: dict[str, set[str]] = {}  # hash -> ids of the requests holding it
        self.rows = 0
        self.hits = self.misses = self.evictions = 0

    def get(self, key: str) -> torch.Tensor | None:
        feats = self.entries.get(key)
        if feats is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return feats

    def put(self, key: str, feats: torch.Tensor) -> None:
        need = feats.shape[0]
        for old in [k for k in self.entries if not self.refs.get(k)]:  # unreferenced, LRU first
            if self.rows + need <= self.budget:
                break
            self.rows -= self.entries.pop(old).shape[0]
            self.evictions += 1
        if self.rows + need <= self.budget:
            self.entries[key] = feats
            self.rows += need

    def hold(self, key: str, request_id: str) -> None:
        if key in self.entries:
            self.refs.setdefault(key, set()).add(request_id)

    def release(self, key: str, request_id: str) -> None:
        users = self.refs.get(key)
        if users is not None:
            users.discard(request_id)
            if not users:
                del self.refs[key]

    def release_request(self, request_id: str) -> None:
        for key in [k for k, users in self.refs.items() if request_id in users]:
            self.release(key, request_id)


def _overlap(s, item: ImageItem) -> tuple[int, int]:
    """The prompt positions [lo, hi) of the item's placeholders that the scheduled span s computes (none: lo >= hi)."""
    start = s.num_computed_tokens
    return max(start, item.offset), min(start + s.num_new_tokens, item.offset + item.length)


class MultiModal:
    """The runtime's multimodal side for one model: processing at admission, encoding and gathering per step."""

    DEFAULT_BUDGET = 8192  # feature rows kept (e.g. 14 LLaVA-1.5 images of 576 rows)

    def __init__(self, model, processor=None, *, tokenizer=None, encoder_cache_rows: int | None = None):
        self.model, self.processor = model, processor
        self.tokenizer = getattr(processor, "tokenizer", None) or tokenizer  # for an image processor alone
        self.image_token_id = model.image_token_id
        image_processor = getattr(processor, "image_processor", processor)
        self.settings = image_processor.to_json_string() if image_processor is not None else ""
        self.cache = EncoderCache(encoder_cache_rows or self.DEFAULT_BUDGET)
        self.encoder_runs = 0  # images encoded (cache misses that ran the encoder)
        self.mrope: dict[str, tuple[torch.Tensor, int]] = {}  # request id -> (prompt positions [3, L], delta)

    @staticmethod
    def supports(model) -> bool:
        return all(callable(getattr(model, f, None)) for f in ("encode_images", "split_images", "num_image_tokens"))

    # -- admission --------------------------------------------------------------------------------------
    def process(self, request_id: str, prompt: str | list[int], images) -> tuple[list[int], list[ImageItem]]:
        """Token ids (a text prompt's placeholders expanded by the processor; token ids taken as they are,
        placeholders already expanded) and the request's images with their placeholder ranges."""
        if self.processor is None:
            raise ValueError(f"request {request_id!r}: images need the model's processor (preprocessor_config.json)")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        loaded = [load_image(im, request_id, i) for i, im in enumerate(images)]
        image_processor = getattr(self.processor, "image_processor", self.processor)
        try:
            if isinstance(prompt, str) and image_processor is not self.processor:  # a processor with its tokenizer
                out = self.processor(text=[prompt], images=loaded, return_tensors="pt")
                token_ids = out["input_ids"][0].tolist()
            elif isinstance(prompt, str):  # an image processor alone: one image token per image, expanded below
                if self.tokenizer is None:
                    raise ValueError("a text prompt needs a tokenizer")
                out = image_processor(images=loaded, return_tensors="pt")
                token_ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
            else:
                out, token_ids = image_processor(images=loaded, return_tensors="pt"), list(prompt)
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"request {request_id!r}: the processor refused its images or prompt: {e}") from e
        per_image = self.model.split_images(out)
        lengths = [int(self.model.num_image_tokens(d)) for d in per_image]
        token_ids = expand_placeholders(token_ids, self.image_token_id, lengths)
        ranges = placeholder_ranges(token_ids, self.image_token_id, lengths, request_id)
        items = [ImageItem(d, content_hash(d, self.settings), off, n) for d, (off, n) in zip(per_image, ranges)]
        if callable(getattr(self.model, "mrope_positions", None)):
            self.mrope[request_id] = self.model.mrope_positions(len(token_ids), items)
        return token_ids, items

    def release(self, request_id: str) -> None:
        """A request ended: its encoder-cache holds and positions go."""
        self.cache.release_request(request_id)
        self.mrope.pop(request_id, None)

    def positions_3d(self, scheduled, device) -> torch.Tensor | None:
        """M-RoPE positions [3, T] of the step (None for a model without them): a prompt's are sliced from
        those computed at admission, a generated token's at context position p are p + delta on each axis."""
        if not callable(getattr(self.model, "mrope_positions", None)):
            return None
        parts = []
        for s in scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            prompt, delta = self.mrope.get(s.request.request_id, (None, 0))
            n = 0 if prompt is None else prompt.shape[1]
            if start < n:
                parts.append(prompt[:, start:min(end, n)])  # [3, <= end - start]
            if end > max(start, n):
                parts.append(torch.arange(max(start, n), end).expand(3, -1) + delta)
        return torch.cat(parts, dim=1).to(device)  # [3, T]

    # -- one step ---------------------------------------------------------------------------------------
    def covers(self, scheduled) -> bool:
        """Whether a scheduled span overlaps an image's placeholder rows (a step without: text alone)."""
        return any(lo < hi for s in scheduled for lo, hi in (_overlap(s, item) for item in s.request.mm_items))

    def gather(self, scheduled, query_start_loc: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(rows of the step [M], their features [M, H]) for the images the scheduled spans overlap, running
        the encoder (once per distinct image) for those not cached; (None, None) when no span overlaps one."""
        wanted = []  # (request id, item, first row of the overlap in the step, slice of the item's rows)
        for s, q0 in zip(scheduled, query_start_loc):
            for item in s.request.mm_items:
                lo, hi = _overlap(s, item)
                if lo < hi:
                    wanted.append((s.request.request_id, item, q0 + lo - s.num_computed_tokens, lo - item.offset,
                                   hi - item.offset))
        if not wanted:
            return None, None
        feats, todo = {}, {}  # hash -> [F, H] found; hash -> item to encode
        for _, item, *_ in wanted:
            if item.hash in feats or item.hash in todo:
                self.cache.hits += 1  # the same image again in this step: found, or encoded once for all
                continue
            found = self.cache.get(item.hash)
            if found is None:
                todo[item.hash] = item
            else:
                feats[item.hash] = found
        todo = list(todo.values())
        if todo:
            for item, out in zip(todo, self.model.encode_images([it.data for it in todo]), strict=True):
                feats[item.hash] = out  # [F, H]
                self.encoder_runs += 1
                self.cache.put(item.hash, out)
        positions, embeds = [], []
        for rid, item, row, a, b in wanted:
            f = feats[item.hash]
            if f.shape[0] != item.length:
                raise ValueError(f"request {rid!r}: image at prompt position {item.offset} has {item.length} "
                                 f"placeholder tokens but the encoder gave {f.shape[0]} feature rows")
            positions.extend(range(row, row + b - a))
            embeds.append(f[a:b])  # [b - a, H]
            if b < item.length:  # a later step takes the rest of this image
                self.cache.hold(item.hash, rid)
            else:
                self.cache.release(item.hash, rid)
        dev = embeds[0].device
        return torch.tensor(positions, dtype=torch.int64, device=dev), torch.cat(embeds)  # [M], [M, H]
