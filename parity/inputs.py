"""The harness checks its own inputs: prompts that can show a bug, long enough for what the model must be
tested on, and a plain list of what they do not reach.

Degenerate prompts: a prompt whose tokens are mostly one id (a tokenizer mapping text to <unk>) gives every
position the same input, so rotary and attention bugs cannot show. A default prompt that is degenerate is
replaced by random token ids of the same length; a prompt the user gave is refused (exit status 2).

Length: the features that only act past some length, read from the config the reference uses and from
the zoo's built attention modules:
    sliding window W        a prompt of W + 2 tokens (positions W and W + 1 see a window cut)
    rope "dynamic" / "longrope" (any type whose table grows past a length, zoo.layers.rotary.ROPE_TYPES)
                            a prompt one token past that length
Each is reached by one added prompt of random ids (default prompts only: given prompts run as given), when its cost fits the budget (both `max_tokens` and
`max_work` = parameters x prompt tokens, a proxy for the seconds both sides spend); otherwise it goes to
`not_exercised`, said in every report.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

DISTINCT_MIN = 0.5  # a prompt of 4+ tokens needs at least this fraction of distinct ids
UNKNOWN_MAX = 0.25  # and at most this fraction of unknown-token ids
MAX_TOKENS = 2048  # the longest prompt added to reach a feature
MAX_WORK = 1e11  # parameters x added prompt tokens (SmolLM2-135M: ~700 tokens)


def degenerate_message(bad: dict[int, str]) -> str:
    """Why the user's prompts are refused: {prompt index: why_degenerate}."""
    return ("; ".join(f"prompt {i}: {why}" for i, why in bad.items()) + ": such prompts give every position the "
            "same input, so rotary and attention bugs cannot show; give prompts of distinct tokens (a .json list of "
            "token-id lists works without a tokenizer)")


@dataclass
class Inputs:
    prompts: list[list[int]]
    texts: list[str | None] | None
    notes: list[str] = field(default_factory=list)  # what the harness changed, and why
    exercised: list[str] = field(default_factory=list)  # length-dependent features the prompts reach
    not_exercised: list[str] = field(default_factory=list)  # ... and those they do not, with the reason


def why_degenerate(prompt: list[int], unk_id: int | None) -> str | None:
    """Why `prompt` cannot show a position-dependent bug, or None when it can."""
    n, distinct = len(prompt), len(set(prompt))
    if n >= 2 and distinct == 1:
        return f"one id ({prompt[0]}) repeated {n} times"
    if n >= 4 and distinct < DISTINCT_MIN * n:
        return f"{distinct} distinct ids in {n} tokens"
    unknown = sum(t == unk_id for t in prompt) if unk_id is not None else 0
    if unknown > UNKNOWN_MAX * n:
        return f"{unknown} of {n} tokens are the unknown token {unk_id}"
    return None


def special_ids(config, tokenizer=None) -> set[int]:
    """Ids a random prompt must not hold: the config's *_token_id / *_token_index (image placeholders, pad, bos,
    eos) and the tokenizer's special tokens."""
    out = set(getattr(tokenizer, "all_special_ids", None) or [])
    for cfg in {id(c): c for c in (config, getattr(config, "text_config", None)) if c is not None}.values():
        for key, value in cfg.to_dict().items():
            if key.endswith(("_token_id", "_token_index")):
                out.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return out


def random_prompt(n: int, vocab_size: int, g: torch.Generator, exclude: set[int] = frozenset()) -> list[int]:
    """n random ids past the usual pad / bos / eos ids (0-2), none of `exclude`."""
    allowed = torch.tensor([i for i in range(min(3, vocab_size - 1), vocab_size) if i not in exclude])  # [A]
    return allowed[torch.randint(0, allowed.numel(), (n,), generator=g)].tolist()


def length_features(config, zoo_model=None) -> list[tuple[str, int]]:
    """(feature, prompt tokens needed to exercise it) for what acts only past some length."""
    from zoo.layers.rotary import ROPE_TYPES, rope_parameters

    cfg = getattr(config, "text_config", None) or config
    windows = set()
    w = getattr(cfg, "sliding_window", None)
    if w and getattr(cfg, "use_sliding_window", True) is not False:
        windows.add(int(w))
    for m in (zoo_model.modules() if zoo_model is not None else ()):
        w = getattr(m, "sliding_window", None)
        if isinstance(w, int) and w > 0:
            windows.add(w)
    out = [(f"sliding window {w}", w + 2) for w in sorted(windows)]
    params = getattr(cfg, "rope_parameters", None) or {}
    types = sorted(k for k, v in params.items() if isinstance(v, dict)) or [None]
    max_pos = getattr(cfg, "max_position_embeddings", None)
    for layer_type in types:
        try:
            p = rope_parameters(cfg, layer_type)
        except ValueError:
            continue
        entry = ROPE_TYPES.get(p.get("rope_type"))
        grows = (entry.grows_past or entry.long_past) if entry is not None else None
        if grows is None or max_pos is None:
            continue
        past = int(grows(p, max_pos))
        out.append((f"rope {p['rope_type']} past {past} positions" + (f" ({layer_type})" if layer_type else ""),
                    past + 1))
    return out


def length_dependent(config) -> bool:
    """Whether a row of the reference depends on how many tokens its forward holds, not only on the tokens up to
    it: a rope type whose frequencies change with the length (longrope's two sets, dynamic NTK)."""
    return any(feature.startswith("rope ") for feature, _ in length_features(config))


def context_limit(config) -> int | None:
    """The longest request the runtime takes by default: max_position_embeddings (the text config's, the model's
    own where both state one, the smaller), or None when neither does."""
    values = [getattr(c, "max_position_embeddings", None) for c in (config, getattr(config, "text_config", None))]
    values = [v for v in values if isinstance(v, int) and v > 0]
    return min(values) if values else None


def too_long(prompts: list[list[int]], limit: int | None, reserve: int) -> str | None:
    """Why given prompts cannot run (a prompt and the `reserve` tokens a scenario generates past the context), or
    None."""
    over = [i for i, p in enumerate(prompts) if limit is not None and len(p) + reserve > limit]
    if not over:
        return None
    return (f"prompt {over[0]} has {len(prompts[over[0]])} tokens, and the scenarios generate {reserve} more: past "
            f"the {limit} positions the model holds (max_position_embeddings); give shorter prompts")


def plan_inputs(prompts: list[list[int]], texts: list[str | None] | None, *, user_given: bool, config, tokenizer,
                num_params: int, seed: int, zoo_model=None, max_tokens: int = MAX_TOKENS,
                max_work: float = MAX_WORK, reserve: int = 0) -> Inputs:
    """Check the prompts; replace degenerate default ones; cut default ones to the model's context less `reserve`
    (the tokens a scenario generates past a prompt); add prompts that reach the length features."""
    vocab = (getattr(config, "text_config", None) or config).vocab_size
    unk = getattr(tokenizer, "unk_token_id", None) if tokenizer is not None else None
    g = torch.Generator().manual_seed(seed + 1)
    inputs = Inputs([list(p) for p in prompts], list(texts) if texts else None)
    exclude = special_ids(config, tokenizer)
    bad = {i: why for i, p in enumerate(prompts) if (why := why_degenerate(p, unk))}
    if bad and user_given:
        raise ValueError(degenerate_message(bad))  # run_parity refuses these before loading anything
    for i, why in bad.items():
        inputs.prompts[i] = random_prompt(max(len(prompts[i]), 6), vocab, g, exclude)
        if inputs.texts:
            inputs.texts[i] = None
        inputs.notes.append(f"default prompt {i} tokenises to {why}: replaced by {len(inputs.prompts[i])} random "
                            f"token ids")
    max_len = context_limit(config)
    for i, p in enumerate(inputs.prompts):
        if not user_given and max_len is not None and len(p) + reserve > max_len:  # a model of few positions
            inputs.prompts[i] = p[: max(1, max_len - reserve)]
            if inputs.texts:
                inputs.texts[i] = None
            inputs.notes.append(f"default prompt {i} cut from {len(p)} to {len(inputs.prompts[i])} tokens: the model "
                                f"holds {max_len} positions (max_position_embeddings) and the scenarios generate "
                                f"{reserve} tokens past a prompt")
    longest = max(len(p) for p in inputs.prompts)
    for feature, need in length_features(config, zoo_model):
        if max_len is not None and need + reserve > max_len:  # the runtime refuses longer requests
            inputs.not_exercised.append(f"{feature}: needs a prompt of {need} tokens"
                                        + (f" and {reserve} generated past it" if reserve else "")
                                        + f", past the model's max_position_embeddings {max_len} (the runtime's "
                                          f"longest request)")
            continue
        if need <= longest:
            inputs.exercised.append(f"{feature} (prompts of up to {longest} tokens)")
            continue
        if user_given:  # the user's prompts are run as given
            inputs.not_exercised.append(f"{feature}: needs a prompt of {need} tokens, the prompts given have at most "
                                        f"{longest}")
            continue
        if need > max_tokens or num_params * need > max_work:
            inputs.not_exercised.append(f"{feature}: needs a prompt of {need} tokens, over the budget "
                                        f"({max_tokens} tokens, parameters x tokens <= {max_work:.0e})")
            continue
        inputs.prompts.append(random_prompt(need, vocab, g, exclude))
        if inputs.texts:
            inputs.texts.append(None)
        longest = need
        inputs.notes.append(f"added a prompt of {need} random token ids to reach the {feature}")
        inputs.exercised.append(f"{feature} (prompts of up to {longest} tokens)")
    return inputs
