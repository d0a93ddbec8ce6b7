"""A GGUF start's tokenizer without importing transformers (its import is ~1-2 s of a cold start).

A GGUF's converted tokenizer sits in the start cache (zoo/runtime/model_files.py). When the cache entry is written,
transformers is loaded anyway (it converts the GGUF), and `proof()` checks that what a start needs can be had
without it: the tokenizer transformers loads back from the entry is a plain TokenizersBackend whose Rust tokenizer
serialises exactly as tokenizer.json does (so encode and decode are that tokenizer's), no decode clean-up, and the
chat template renders to the same ids both ways on a probe chat. Only then the manifest gets a `light` section
(special tokens, their ids, the chat template), and a start builds a LightTokenizer from it.

LightTokenizer answers the calls the runtime makes (encode, decode, __call__, convert_ids_to_tokens, the special
token ids, apply_chat_template for a chat of plain messages, rendered as transformers does by default: the same
sandboxed jinja2 environment, filters and globals, messages normalised the same way). Anything else, or the same
calls with other options, goes to transformers' own tokenizer of the entry, built on first use.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

# the special-token attributes a start reads (transformers' names); their ids are kept alongside
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' assistant-mask extension: not here
PROBE_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2? Say it twice."},
              {"role": "assistant", "content": "4, 4."}, {"role": "user", "content": "Thanks! ¿Y en español?"}]
PROBE_TEXTS = ("What is the capital of France?", "  spaces\tand\nnewlines  ", "naïve café, 東京 🙂", "")
PROBE_SECONDS = 1.0  # the probe chat renders in milliseconds; a template that loops is not proved
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as transformers aliases them


class _NotPlain(Exception):
    """A value transformers' template code would convert (an object, a numpy scalar): its path is used."""


class LightTokenizer:
    def __init__(self, directory: Path, light: dict):
        from tokenizers import Tokenizer

        self._directory, self._class, self._full = Path(directory), light["class"], None
        self._tokenizer = Tokenizer.from_file(str(self._directory / "tokenizer.json"))
        self._chat_template = light["chat_template"]
        self.special_tokens_map = dict(light["special_tokens_map"])
        for name in SPECIAL:
            setattr(self, name, self.special_tokens_map.get(name))
            setattr(self, f"{name}_id", light["ids"].get(f"{name}_id"))
        self.all_special_ids, self.all_special_tokens = list(light["all_special_ids"]), list(light["all_special_tokens"])

    @classmethod
    def from_manifest(cls, directory: Path, light) -> "LightTokenizer | None":
        """The light tokenizer of a cache entry whose manifest holds a well-formed `light` section, else None."""
        try:
            ok = (isinstance(light, dict) and isinstance(light.get("class"), str)
                  and isinstance(light.get("chat_template"), (str, type(None)))
                  and all(isinstance(light.get(k), dict) for k in ("special_tokens_map", "ids"))
                  and all(isinstance(v, str) for v in light["special_tokens_map"].values())
                  and all(isinstance(v, (int, type(None))) for v in light["ids"].values())
                  and all(isinstance(light.get(k), list) for k in ("all_special_ids", "all_special_tokens")))
            return cls(directory, light) if ok else None
        except Exception:  # noqa: BLE001 - (a tokenizer.json the tokenizers library refuses: transformers' path)
            return None

    # -- what transformers' own tokenizer does, for the calls it is not needed for -----------------------
    def _transformers(self):
        if self._full is None:
            import transformers

            self._full = getattr(transformers, self._class).from_pretrained(self._directory)
            self._full.chat_template = self._chat_template
        return self._full

    def transformers_tokenizer(self):
        """transformers' own tokenizer of the entry (built on first use): for code that reads its vocabulary."""
        return self._transformers()

    def __getattr__(self, name: str):  # (only for what this class does not define)
        if name.startswith("__") or name in ("_full", "_directory", "_class", "_tokenizer", "_chat_template"):
            raise AttributeError(name)
        return getattr(self._transformers(), name)

    def __repr__(self) -> str:
        return f"LightTokenizer({str(self._directory)!r}, {self._class} without transformers)"

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, value) -> None:
        self._chat_template = value
        if self._full is not None:
            self._full.chat_template = value

    @property
    def backend_tokenizer(self):
        return self._tokenizer

    def encode(self, text, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self._transformers().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text=None, *args, add_special_tokens: bool = True, **kwargs):
        if args or kwargs or not isinstance(text, str):
            return self._transformers()(text, *args, add_special_tokens=add_special_tokens, **kwargs)
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs) -> str:
        if kwargs or clean_up_tokenization_spaces:
            return self._transformers().decode(token_ids, skip_special_tokens=skip_special_tokens,
                                               clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if skip_special_tokens:
            return self._transformers().convert_ids_to_tokens(ids, skip_special_tokens=True)
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        return [self._tokenizer.id_to_token(i) for i in ids]

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt: bool = False, continue_final_message=False, tokenize: bool = True,
                            return_dict: bool = True, **kwargs):
        """transformers' default rendering of one chat of plain messages (dicts of str, numbers, lists, dicts);
        anything else (tools, documents, another template, options, a batch, objects) through transformers."""
        try:
            if (tools is not None or documents is not None or chat_template is not None or continue_final_message
                    or kwargs or not isinstance(self._chat_template, str) or GENERATION_TAG.search(self._chat_template)
                    or not isinstance(conversation, (list, tuple)) or not conversation
                    or not all(type(m) is dict for m in conversation)):
                raise _NotPlain
            chat = _aliased([{k: _plain(v) for k, v in m.items() if v is not None} for m in conversation])
            names = {_plain(k): _plain(v) for k, v in self.special_tokens_map.items()}
        except _NotPlain:
            return self._transformers().apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=tokenize, return_dict=return_dict, **kwargs)
        text = _compiled(self._chat_template).render(messages=chat, tools=None, documents=None,
                                                     add_generation_prompt=add_generation_prompt, **names)
        if not tokenize:
            return text
        out = self(text, add_special_tokens=False)
        return out if return_dict else out["input_ids"]


def _plain(value):
    """A copy of a JSON-typed value (dicts and lists rebuilt, as transformers rebuilds what a template sees)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value) is dict:
        return {_plain(k): _plain(v) for k, v in value.items()}
    if type(value) is list:
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    raise _NotPlain


def _aliased(chat: list[dict]) -> list[dict]:
    """A message's reasoning under every name templates read it by, as transformers fills them."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template in the environment transformers renders chat templates in (utils/chat_template_utils.py):
    jinja2's ImmutableSandboxedEnvironment, trim_blocks and lstrip_blocks, loop controls, its tojson filter and
    raise_exception / strftime_now / dict / namespace globals."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    class TemplateDict:  # dict() without attribute access to the dict type
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore-prefixed attributes
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"Chat templates cannot store underscore-prefixed attributes "
                                                      f"on a namespace, but got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(template)


def proof(directory: Path, ref) -> dict | None:
    """The `light` manifest section for the cache entry `directory`, when `ref` (transformers' tokenizer loaded
    back from it) can be answered for without transformers; else None (a start then loads transformers')."""
    from tokenizers import Tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(ref)
    backend = getattr(ref, "_tokenizer", None)
    if not (isinstance(ref, TokenizersBackend) and cls.__module__.startswith("transformers.")
            and all(getattr(cls, f) is getattr(TokenizersBackend, f)
                    for f in ("_decode", "_encode_plus", "apply_chat_template", "__call__", "encode", "decode",
                              "convert_ids_to_tokens"))
            and backend is not None and not getattr(ref, "clean_up_tokenization_spaces", False)):
        return None
    template = ref.chat_template
    names = ref.special_tokens_map
    if not (template is None or isinstance(template, str) and not GENERATION_TAG.search(template)) or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
        return None
    own = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    if own.to_str() != backend.to_str() or own.encode_special_tokens != backend.encode_special_tokens \
            or backend.truncation is not None or backend.padding is not None:
        return None
    light = {"class": cls.__name__, "chat_template": template, "special_tokens_map": dict(names),
             "ids": {f"{n}_id": getattr(ref, f"{n}_id", None) for n in SPECIAL},
             "all_special_ids": list(ref.all_special_ids), "all_special_tokens": list(ref.all_special_tokens)}
    tok = LightTokenizer(directory, json.loads(json.dumps(light)))
    for text in PROBE_TEXTS:
        ids = ref.encode(text)
        if tok.encode(text) != ids or tok.decode(ids) != ref.decode(ids) or \
                tok.decode(ids, skip_special_tokens=True) != ref.decode(ids, skip_special_tokens=True):
            return None
    if template is not None:  # (untrusted code: rendered with zoo's time bound, chat_template.py)
        from zoo.runtime.chat_template import apply_chat_template

        try:
            if apply_chat_template(tok, PROBE_CHAT, seconds=PROBE_SECONDS) != \
                    apply_chat_template(ref, PROBE_CHAT, seconds=PROBE_SECONDS):
                return None
        except Exception:  # noqa: BLE001 - a template that fails or loops on a plain chat: transformers' path
            return None  # (the start then says why, with its own bound)
    return light
