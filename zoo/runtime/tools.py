"""OpenAI tool calling: the chat template renders `tools`, the model's reply becomes `tool_calls`.

    calls = ToolCalls.of(body, template)        # a request's tools and tool_choice (None without tools)
    calls.structured()  -> StructuredOutputsParams | None    # "required" / a named function: what holds the reply
    calls.parse(text)   -> (content, [tool call, ...])       # a whole reply as OpenAI's message fields
    stream = calls.stream(); stream.feed(text so far, done)  -> [delta, ...]   # the chunks to send now

How a reply holds calls is the format the model was trained on, found in its chat template's text (or named by
`zoo serve --tool-call-parser`):
    hermes       <tool_call>{"name": N, "arguments": {...}}</tool_call>, a block per call, text around them
                 (Qwen2.5 / Qwen3, Hermes 2 Pro / 3, SmolLM3)
    llama3_json  {"name": N, "parameters": {...}} as the reply, or after <|python_tag|>; calls joined by ";"
                 (Llama 3.1 / 3.2 / 3.3's JSON tool calling)
    mistral      [TOOL_CALLS][{"name": N, "arguments": {...}}, ...] (Mistral's v3 tokenizer templates)
"arguments" and "parameters" are both taken. A call is a JSON object naming one of the request's tools with an
object of arguments (or a string holding one); a group of calls that is anything else (malformed JSON, an unknown
function) stays content, whole. A call's `arguments` is its object's text as the model wrote it, so what is
streamed piece by piece and the whole reply agree; whitespace between calls is not content.

tool_choice as vLLM serves it: "none" (tools rendered, the reply is text), "auto" (the default with tools: parsed as
above), "required" (the reply held by structured outputs to a JSON array of {"name", "parameters"} of the given
tools: one call or more) or {"type": "function", "function": {"name": N}} (held to N's parameters schema: the whole
reply is the arguments, and finish_reason stays "stop", as OpenAI's and vLLM's).

Streaming (OpenAI's chunks): content as soon as it cannot be the start of a call; a call's first chunk once its
name is known (index, id, type, name, arguments ""), then its arguments as they are written. A call whose JSON
breaks (or is cut by max_tokens) after its name went out stays a call in the stream, and nothing that contradicts
it follows (what was sent is not taken back), while the whole reply would show it as content.
"""
from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass

FORMATS = ("hermes", "llama3_json", "mistral")
MARKERS = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}  # a group's start
HERMES_END = "</tool_call>"
_SPACE = re.compile(r"\s*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # a whole JSON string (no match while it is still open)
_BRACKET = re.compile(r'["{}\[\]]')
_LITERAL = re.compile(r'[^\s,:{}\[\]"]+')


class ToolError(ValueError):
    """A request's tools, tool_choice or tool messages cannot be served: `param` names the body field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def detect_format(template) -> str | None:
    """The call format a chat template renders tools for, or None (a template that takes no tools)."""
    if isinstance(template, dict):  # named templates (transformers picks "tool_use" when given tools)
        template = template.get("tool_use") or template.get("default") or ""
    if not isinstance(template, str) or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if '"parameters"' in template or "<|python_tag|>" in template:
        return "llama3_json"
    return None


@dataclass
class Call:
    name: str
    arguments: str  # the arguments object's text (so far, while it is being written)


@dataclass
class ToolCalls:
    tools: list[dict]  # OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}]
    choice: str  # "none" | "auto" | "required" | "named"
    format: str  # FORMATS
    schemas: dict[str, dict]  # function name -> its parameters schema
    name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls: False keeps the first call only

    @classmethod
    def of(cls, body: dict, template, parser: str | None = None) -> "ToolCalls | None":
        """The request's tool calling, or None without tools; ToolError naming the field it cannot serve."""
        tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls", True)
        if tools is not None and not isinstance(tools, list):
            raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
        if not isinstance(parallel, bool) and parallel is not None:
            raise ToolError(f"parallel_tool_calls={parallel!r}: must be true or false", "parallel_tool_calls")
        if not tools:
            if choice not in (None, "none"):
                raise ToolError(f"tool_choice={_short(choice)} needs tools", "tool_choice")
            return None
        schemas = {}
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} with "
                                f"a non-empty name", "tools")
            params = fn.get("parameters")
            params = {"type": "object", "properties": {}} if params is None else params
            if not isinstance(params, dict):
                raise ToolError(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
            if fn["name"] in schemas:
                raise ToolError(f"tools[{i}]: a second function named {fn['name']!r}", "tools")
            schemas[fn["name"]] = params
        name = None
        if choice is None:
            choice = "auto"
        elif isinstance(choice, dict):
            fn = choice.get("function") if choice.get("type") == "function" else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str):
                raise ToolError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                                "\"function\": {\"name\": ...}}", "tool_choice")
            if name not in schemas:
                raise ToolError(f"tool_choice names the function {_short(name)}, which is not among the tools "
                                f"({', '.join(schemas)})", "tool_choice")
            choice = "named"
        elif choice not in ("none", "auto", "required"):
            raise ToolError(f"tool_choice={_short(choice)}: must be 'none', 'auto', 'required' or {{\"type\": "
                            f"\"function\", \"function\": {{\"name\": ...}}}}", "tool_choice")
        fmt = parser or detect_format(template)
        if fmt is None:
            raise ToolError("tools: this model's chat template does not render tools (no tool call format in it); "
                            "send no tools, or start zoo serve with --tool-call-parser", "tools")
        return cls(list(tools), choice, fmt, schemas, name, parallel is not False)

    # -- what the reply is held to ---------------------------------------------------------------------------
    def structured(self):
        """StructuredOutputsParams for "required" (an array of calls) and a named function (its arguments), else
        None. Each tool's $defs go to the array schema's top, where the tools' "#/$defs/..." references look."""
        from zoo.runtime.structured import StructuredOutputsParams

        if self.choice == "named":
            return StructuredOutputsParams(json=self.schemas[self.name])
        if self.choice != "required":
            return None
        defs, items = {}, []
        for n, s in self.schemas.items():
            s = dict(s)
            for k, v in (s.pop("$defs", None) or {}).items():
                if k in defs and defs[k] != v:
                    raise ToolError(f"tools: two functions define $defs.{k} differently; tool_choice='required' "
                                    f"holds them in one schema", "tools")
                defs[k] = v
            items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": s},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return StructuredOutputsParams(json=schema)

    def sampling(self) -> dict:
        """SamplingParams fields the parsing needs: special tokens kept in the text when the reply is parsed
        ([TOOL_CALLS], <|python_tag|> and some tokenizers' <tool_call> are special tokens), as vLLM does."""
        return {"skip_special_tokens": False} if self.choice == "auto" else {}

    # -- the reply ------------------------------------------------------------------------------------------
    def view(self, text: str, final: bool) -> tuple[str, list[Call]]:
        """(content, calls) of the reply so far: all of it when `final`, else only what more text cannot change
        (a call's arguments may still grow)."""
        if self.choice == "none":
            return text, []
        if self.choice == "named":
            return "", [Call(self.name, text)]
        if self.choice == "required":
            items, pending = _scan(text, "required", set(self.schemas), final)
        else:
            items, pending = _scan(text, self.format, set(self.schemas), final)
        content = _content(items, pending)
        calls = [c for item in items if isinstance(item, list) for c in item]
        return content, calls if self.parallel else calls[:1]

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole reply, as OpenAI's message fields (content None when empty)."""
        content, calls = self.view(text, final=True)
        return content or None, [self.openai(c.name, c.arguments) for c in calls]

    def openai(self, name: str, arguments: str) -> dict:
        return {"id": self.new_id(), "type": "function", "function": {"name": name, "arguments": arguments}}

    def new_id(self) -> str:
        """A call's id: Mistral's templates take 9 letters and digits only, the others OpenAI's call_..."""
        if self.format == "mistral":
            return "".join(random.choices(string.ascii_letters + string.digits, k=9))
        return f"call_{uuid.uuid4().hex[:24]}"

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when a reply that stopped by itself made calls (a named function's: "stop")."""
        return "tool_calls" if called and reason == "stop" and self.choice != "named" else reason

    def stream(self) -> "ToolStream":
        return ToolStream(self)


class ToolStream:
    """One choice's streamed reply: feed(text so far, done) -> the deltas to send now, as OpenAI streams them."""

    def __init__(self, calls: ToolCalls):
        self.calls = calls
        self.content = ""  # content sent
        self.sent: list[list[str]] = []  # per call: [name, arguments sent]
        self.made = 0  # calls made (for the finish reason)
        self.broken = False  # a call that went out broke (or was cut) later: the stream and the whole reply differ

    def feed(self, text: str, done: bool) -> list[dict]:
        content, calls = self.calls.view(text, final=done)
        if done and not self._agrees(content, calls):  # the end broke what was sent: keep to what was streamed
            content, calls = self.calls.view(text, final=False)
            self.broken = True
        if not self._agrees(content, calls):  # a call that went out broke later: nothing that contradicts it
            self.broken = True
            return []
        out = []
        if content.startswith(self.content) and len(content) > len(self.content):
            out.append({"content": content[len(self.content):]})
            self.content = content
        for k, call in enumerate(calls):
            if k == len(self.sent):
                self.sent.append([call.name, ""])
                out.append({"tool_calls": [{"index": k, "id": self.calls.new_id(), "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            name, args = self.sent[k]
            if call.name == name and call.arguments.startswith(args) and len(call.arguments) > len(args):
                out.append({"tool_calls": [{"index": k, "function": {"arguments": call.arguments[len(args):]}}]})
                self.sent[k][1] = call.arguments
        self.made = len(self.sent)
        return out

    def _agrees(self, content: str, calls: list[Call]) -> bool:
        return content.startswith(self.content) and len(calls) >= len(self.sent) and all(
            c.name == n and c.arguments.startswith(a) for c, (n, a) in zip(calls, self.sent))


# -- scanning a reply ---------------------------------------------------------------------------------------------
# _scan cuts a reply into items: text (str) and groups of valid calls (list[Call]); `pending` is True when the text
# from the end of the last item on is not decided yet (a call being written, a marker's beginning): more text may
# make it a call or not. A group that is not a call becomes text.

def _scan(text: str, fmt: str, names: set[str], final: bool) -> tuple[list, bool]:
    items: list = []
    pos = 0
    while pos < len(text) or not items:
        at, body = _opener(text, pos, fmt, final)
        if at is None:  # no call begins in the rest (body: where a marker's beginning is held from, if any)
            if body > pos:
                items.append(text[pos:body])
            return items, body < len(text) or not final
        if at > pos:
            items.append(text[pos:at])
        status, end, calls = _group(text, body, fmt, names, final)
        if status == "open":
            if calls:
                items.append(calls)
            return items, True
        if status == "bad":
            end = len(text) if end is None else end
            items.append(text[at:end])
        else:
            items.append(calls)
        pos = max(end, pos + 1)
        if pos >= len(text):
            break
    return items, not final


def _opener(text: str, pos: int, fmt: str, final: bool) -> tuple[int | None, int]:
    """(where the next group of calls begins, where its body begins), or (None, where the text that is surely
    not a call ends)."""
    if pos == 0 and fmt in ("required", "llama3_json"):  # a reply that is (or may be) its calls
        k = _SPACE.match(text).end()
        if fmt == "required" or text.startswith("{", k):
            return 0, k
        if k == len(text) and not final:  # only whitespace yet: the reply may still open with "{"
            return None, 0
    if fmt == "required":
        return None, len(text)
    marker = MARKERS[fmt]
    at = text.find(marker, pos)
    if at >= 0:
        return at, at + len(marker)
    if final:
        return None, len(text)
    for n in range(min(len(marker) - 1, len(text) - pos), 0, -1):  # a marker's beginning at the end: wait
        if marker.startswith(text[len(text) - n:]):
            return None, len(text) - n
    return None, len(text)


def _group(text: str, k: int, fmt: str, names: set[str], final: bool) -> tuple[str, int | None, list[Call]]:
    """A group of calls whose body begins at text[k]: ("ok", its end, calls), ("open", None, calls so far: more
    text is needed) or ("bad", where its text ends or None for the text's end, [])."""
    if fmt == "hermes":
        status, end, calls = _objects(text, k, names, final, None, single=True)
        if status != "ok":
            return _bad_to(text, k, HERMES_END, final) if status == "bad" else (status, end, calls)
        j = _SPACE.match(text, end).end()
        if text.startswith(HERMES_END, j):
            return "ok", j + len(HERMES_END), calls
        if j == len(text):  # an unclosed block at the end is taken (vLLM takes it too)
            return ("ok", end, calls) if final else ("open", None, calls)
        if not final and HERMES_END.startswith(text[j:]):
            return "open", None, calls
        return _bad_to(text, k, HERMES_END, final)
    j = _SPACE.match(text, k).end()
    if fmt == "llama3_json":
        return _objects(text, j, names, final, ";")
    if j == len(text):
        return ("bad", None, []) if final else ("open", None, [])
    if text[j] == "[":  # mistral, required
        status, end, calls = _objects(text, j + 1, names, final, ",", close="]")
    else:
        status, end, calls = _objects(text, j, names, final, None, single=True) if fmt == "mistral" else \
            ("bad", None, [])
    if status == "bad":
        end = _value_end(text, j) if text[j] in "[{" else None
        if end is None and not final:
            return "open", None, []
    return status, end, calls


def _bad_to(text: str, k: int, close: str, final: bool):
    """A block that is not a call: its text runs to its closing tag (to the text's end without one)."""
    at = text.find(close, k)
    if at < 0 and not final:
        return "open", None, []
    return "bad", None if at < 0 else at + len(close), []


def _objects(text: str, k: int, names: set[str], final: bool, sep: str | None, close: str | None = None,
             single: bool = False) -> tuple[str, int | None, list[Call]]:
    """Call objects from text[k] on, joined by `sep`, ended by `close` (None: by whatever is not `sep`)."""
    calls: list[Call] = []
    while True:
        k = _SPACE.match(text, k).end()
        if k == len(text):
            return ("bad", None, []) if final else ("open", None, calls)
        if text[k] == close and not calls:
            return "bad", None, []  # "[]": no call
        if text[k] != "{":
            return "bad", None, []
        status, end, call = _call_at(text, k, names, final)
        if status == "bad":
            return "bad", end, []
        if call is not None:
            calls.append(call)
        if status == "open":
            return "open", None, calls
        if single:
            return "ok", end, calls
        j = _SPACE.match(text, end).end()
        if j == len(text):
            if final:
                return ("ok", end, calls) if close is None else ("bad", None, [])
            return "open", None, calls
        if text[j] == sep:
            k = j + 1
        elif close is not None and text[j] == close:
            return "ok", j + 1, calls
        elif close is None:
            return "ok", end, calls
        else:
            return "bad", None, []


def _call_at(text: str, k: int, names: set[str], final: bool) -> tuple[str, int | None, Call | None]:
    """The object at text[k] as a call: ("ok", end, Call) when whole and valid, ("open", None, Call or None while
    its name is not known to be a tool's) while it is being written, ("bad", end or None, None) otherwise."""
    end, members, well_formed = _members(text, k)
    if end is None:
        if final or not well_formed:
            close = _value_end(text, k)
            if close is None and not final:
                return "open", None, None
            return "bad", close, None
        name = _string_member(text, members.get("name"))
        if name not in names:
            return "open", None, None
        key = "arguments" if "arguments" in members else "parameters" if "parameters" in members else None
        start, stop = members[key] if key is not None else (None, None)
        args = text[start:stop or len(text)] if start is not None and text[start] == "{" else ""
        if stop is not None and text[start] == '"':
            args = _arguments(_loads(text[start:stop])) or ""
        return "open", None, Call(name, args)
    try:
        obj = json.loads(text[k:end])
    except ValueError:
        return "bad", end, None
    if not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return "bad", end, None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None:
        return "ok", end, Call(obj["name"], "{}")
    start, stop = members[key]
    args = text[start:stop] if isinstance(obj[key], dict) else _arguments(obj[key])
    return ("ok", end, Call(obj["name"], args)) if args is not None else ("bad", end, None)


def _arguments(value) -> str | None:
    """Arguments written as a JSON string that holds an object: that string; None for anything else."""
    if not isinstance(value, str):
        return None
    try:
        return value if isinstance(json.loads(value), dict) else None
    except ValueError:
        return None


def _string_member(text: str, span) -> str | None:
    """A member's value when it is a whole JSON string, else None."""
    if span is None or span[1] is None or text[span[0]] != '"':
        return None
    value = _loads(text[span[0]:span[1]])
    return value if isinstance(value, str) else None


def _loads(raw: str):
    """json.loads, None for text that is not JSON (a bad escape in a model's string)."""
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _members(text: str, i: int) -> tuple[int | None, dict[str, tuple[int, int | None]], bool]:
    """The JSON object opening at text[i], read as far as the text goes: (its end after the closing brace, or None
    while it is open; {key: (value start, value end or None while it is open)}; False once it is not JSON)."""
    members: dict[str, tuple[int, int | None]] = {}
    k, expect = i + 1, "first"
    while True:
        k = _SPACE.match(text, k).end()
        if k == len(text):
            return None, members, True
        c = text[k]
        if expect == "after":
            if c == "}":
                return k + 1, members, True
            if c != ",":
                return None, members, False
            k, expect = k + 1, "key"
            continue
        if c == "}" and expect == "first":
            return k + 1, members, True
        if c != '"':
            return None, members, False
        m = _STRING.match(text, k)
        if m is None:  # the key is still being written
            return None, members, True
        k = _SPACE.match(text, m.end()).end()
        if k == len(text):
            return None, members, True
        if text[k] != ":":
            return None, members, False
        k = _SPACE.match(text, k + 1).end()
        if k == len(text):
            return None, members, True
        key = _loads(m.group())
        if key is None:
            return None, members, False
        members[key] = (k, _value_end(text, k))
        if members[key][1] is None:
            return None, members, True
        k, expect = members[key][1], "after"


def _value_end(text: str, k: int) -> int | None:
    """Where the JSON value starting at text[k] ends (after its last character), None while the text ends in it."""
    c = text[k]
    if c == '"':
        m = _STRING.match(text, k)
        return m.end() if m else None
    if c in "{[":
        opened = []
        while (m := _BRACKET.search(text, k)) is not None:
            k = m.start()
            if text[k] == '"':
                s = _STRING.match(text, k)
                if s is None:
                    return None
                k = s.end()
                continue
            if text[k] in "{[":
                opened.append("}" if text[k] == "{" else "]")
            elif opened.pop() != text[k]:  # "{...]": not JSON, the value ends there for the caller to refuse
                return k
            k += 1
            if not opened:
                return k
        return None
    m = _LITERAL.match(text, k)
    if m is None:  # no value here: the caller finds the JSON broken
        return k
    return None if m.end() == len(text) else m.end()


def _content(items: list, pending: bool) -> str:
    """The text items as content: whitespace beside a group of calls is not content, and whitespace whose
    neighbour is not decided yet waits."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, list):
            continue
        if not item.strip():
            after = items[i + 1] if i + 1 < len(items) else None
            if (i and isinstance(items[i - 1], list)) or isinstance(after, list):
                continue
            if after is None and pending:
                break
        out.append(item)
    return "".join(out)


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


# -- messages as templates read them ---------------------------------------------------------------------------
def for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant's tool call arguments as objects (OpenAI sends JSON
    strings, templates write them with tojson: vLLM and transformers do the same), checked; ToolError naming the
    message otherwise."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None:
            where = f"messages[{i}].tool_calls"
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise ToolError(f"{where}: a list, on an assistant message only", "messages")
            fixed = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise ToolError(f"{where}[{j}] must be {{\"id\": ..., \"type\": \"function\", \"function\": "
                                    f"{{\"name\": ..., \"arguments\": \"{{...}}\"}}}}", "messages")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise ToolError(f"{where}[{j}].function.arguments is not JSON", "messages") from None
                if not isinstance(args, dict):
                    raise ToolError(f"{where}[{j}].function.arguments must be a JSON object", "messages")
                fixed.append({**c, "function": {**fn, "arguments": args}})
            m = {**m, "tool_calls": fixed}
        if m.get("role") == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise ToolError(f"messages[{i}].tool_call_id must be a string", "messages")
        out.append(m)
    return out
