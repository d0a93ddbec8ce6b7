"""Incremental detokenisation and stop strings.

Text is decoded from a small window of tokens: `ids[prefix:]` minus `ids[prefix:read]`, where
`ids[prefix:read]` are tokens already turned into text and give the decoder its context (a word's
leading space, a multi-byte character split over tokens). New text is emitted only when it is stable:
it grows and does not end with U+FFFD, the mark of an incomplete UTF-8 sequence.

Stop strings: text that could still be the start of a stop string is held back; when a stop string
appears, the text ends just before it and the stop string is not part of the output. None is looked for
before the output has more than `min_tokens` tokens (vLLM's rule).
"""
from __future__ import annotations

CONTEXT_TOKENS = 5  # prompt tokens put in front of the first output token as decoding context


def _backend_decode(tokenizer):
    """The Rust `tokenizers` decode behind a transformers fast tokenizer whose own decode only forwards to it
    (two calls per token and request: the wrapper's argument handling was ~2/3 of their time), else None."""
    from zoo.runtime.light_tokenizer import LightTokenizer

    if type(tokenizer) is LightTokenizer:  # (its decode is that one call already)
        return tokenizer.backend_tokenizer.decode
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    return backend.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], *, stop: list[str] = (),
                 skip_special_tokens: bool = True, min_tokens: int = 0, include_stop: bool = False):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.include_stop = include_stop  # the stop string stays at the end of the text
        self.text = ""  # all stable text (cut before a stop string once one is found)
        self.emitted = 0  # characters of self.text released to the caller
        self.stop_string: str | None = None
        self.min_tokens, self.outputs = min_tokens, 0
        self.backend = _backend_decode(tokenizer)
        self.deferred: list[int] = []  # tokens the engine has yet to add, one add_tokens call each (LLMEngine.step)

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Take new output tokens; return the text that became safe to show (may be '')."""
        if self.stop_string is not None:
            return ""
        self.ids.extend(token_ids)
        self.outputs += len(token_ids)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            new = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            start = max(0, len(self.text) - self.max_stop + 1)
            self.text += new
            if self.outputs > self.min_tokens:
                self._find_stop(start)
        return self._release(final=self.stop_string is not None)

    def _find_stop(self, start: int) -> None:
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[:best[0] + (len(best[1]) if self.include_stop else 0)]
            self.stop_string = best[1]

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            end -= self._held_back()
        end = max(end, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is the start of some stop string."""
        for n in range(min(self.max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def flush(self) -> str:
        """The request ended: release what was held back (incomplete characters stay out)."""
        return self._release(final=True)
