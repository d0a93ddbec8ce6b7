"""OpenAI tool calling: the chat template renders `tools`, the reply becomes `tool_calls`.

    calls = ToolCalls.of(body, template)         # the request's tools, tool_choice and the template's call format
    calls.structured()  -> StructuredOutputsParams | None   # "required" / a named function: the reply is held to it
    calls.parse(text)   -> (content, [tool calls])          # the reply as OpenAI's message fields

How a reply holds calls depends on the template the model was trained with (detected from its text, or named):
    hermes      <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call (Qwen2.5 / Qwen3,
                Hermes, SmolLM3); text outside the blocks is the content
    llama3_json {"name": ..., "parameters": {...}} as the whole reply, calls joined by "; " (Llama 3.1 / 3.2's
                JSON tool calling), after an optional <|python_tag|>
    mistral     [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (Mistral's v3 templates)
tool_choice (OpenAI's): "none" (tools rendered, the reply is text), "auto" (the default with tools: parsed as
above), "required" (at least one call: the reply is held to a JSON array of {name, parameters} of the given
tools) or {"type": "function", "function": {"name": N}} (held to N's parameters schema), as vLLM enforces them
with structured outputs; a held reply is JSON whatever the template's own format.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

FORMATS = ("hermes", "llama3_json", "mistral")
HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
STARTS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "{"}  # what begins a call


class ToolError(ValueError):
    """A request's tools or tool_choice cannot be served: `param` names the body field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def detect_format(template: str | None) -> str | None:
    """The call format a chat template renders tools for, or None (a template that takes no tools)."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "parameters" in template or "<|python_tag|>" in template:
        return "llama3_json"
    return None


@dataclass
class ToolCalls:
    tools: list[dict]  # OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}]
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the named function
    format: str | None = None  # FORMATS
    schemas: dict[str, dict] = field(default_factory=dict)  # function name -> its parameters schema

    @classmethod
    def of(cls, body: dict, template: str | None, parser: str | None = None) -> "ToolCalls | None":
        """The request's tool calling, or None without tools (a tool_choice other than "none" then is refused)."""
        tools, choice = body.get("tools"), body.get("tool_choice")
        if not tools:
            if choice not in (None, "none"):
                raise ToolError(f"tool_choice={choice!r} needs tools", "tool_choice")
            return None
        if not isinstance(tools, list):
            raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
        schemas = {}
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                                "tools")
            params = fn.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(params, dict):
                raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
            schemas[fn["name"]] = params
        name = None
        if choice is None:
            choice = "auto"
        elif isinstance(choice, dict):
            fn = choice.get("function") if choice.get("type") == "function" else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if name not in schemas:
                raise ToolError(f"tool_choice names {name!r}, which is not among the tools "
                                f"({', '.join(schemas)})", "tool_choice")
            choice = "named"
        elif choice not in ("none", "auto", "required"):
            raise ToolError(f"tool_choice={choice!r}: 'none', 'auto', 'required' or "
                            f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tool_choice")
        fmt = parser or detect_format(template)
        if fmt is None:
            raise ToolError("the model's chat template does not render tools (no tool call format found; give "
                            "zoo serve --tool-call-parser)", "tools")
        return cls(list(tools), choice, name, fmt, schemas)

    def structured(self):
        """What the reply is held to: a named function's arguments, or for "required" an array of calls."""
        from zoo.runtime.structured import StructuredOutputsParams

        if self.choice == "named":
            return StructuredOutputsParams(json=self.schemas[self.name])
        if self.choice == "required":
            one = [{"type": "object", "properties": {"name": {"const": n}, "parameters": s},
                    "required": ["name", "parameters"], "additionalProperties": False}
                   for n, s in self.schemas.items()]
            return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": one}})
        return None

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a reply: OpenAI's message fields (content None when only calls were made)."""
        if self.choice == "none":
            return text, []
        if self.choice == "named":
            return None, [_call(self.name, text)]
        if self.choice == "required":
            try:
                return None, [_call(c["name"], c["parameters"]) for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):
                return text, []  # (cut at max_tokens: not a whole array)
        return parse_calls(text, self.format, set(self.schemas))

    def start(self, text: str) -> int | None:
        """Where a call may begin in streamed text (held back from then on): None when none can, yet."""
        if self.choice in ("named", "required"):
            return 0
        if self.choice == "none":
            return None
        marker = STARTS[self.format]
        if self.format == "llama3_json":  # a whole-reply format: held while the reply may be one
            stripped = text.lstrip().removeprefix("<|python_tag|>").lstrip()
            return 0 if not stripped or stripped[0] == "{" or "<|python_tag|>".startswith(text.lstrip()) else None
        at = text.find(marker)
        if at >= 0:
            return at
        for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a marker's beginning at the end: wait for more
            if marker.startswith(text[-k:]):
                return len(text) - k
        return None


def parse_calls(text: str, fmt: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(content, calls) of a reply in `fmt`; what does not parse as a call of a known function stays content."""
    calls = []
    if fmt == "hermes":
        rest = []
        last = 0
        for m in HERMES.finditer(text):
            call = _object(m.group(1), "arguments", names)
            if call is None:
                continue
            calls.append(call)
            rest.append(text[last:m.start()])
            last = m.end()
        if not calls:
            return text, []
        content = ("".join(rest) + text[last:]).strip()
        return content or None, calls
    if fmt == "mistral":
        head, sep, tail = text.partition("[TOOL_CALLS]")
        if not sep:
            return text, []
        try:
            items = json.loads(tail.strip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [c for c in (_object(json.dumps(i), "arguments", names) for i in items) if c is not None]
        return (head.strip() or None, calls) if calls else (text, [])
    body = text.strip().removeprefix("<|python_tag|>").strip()  # llama3_json
    for part in re.split(r"\s*;\s*(?=\{)", body):
        call = _object(part, "parameters", names)
        if call is None:
            return text, []
        calls.append(call)
    return (None, calls) if calls else (text, [])


def _object(raw: str, key: str, names: set[str]) -> dict | None:
    """One call from its JSON ({"name", key: {...}}; "arguments" and "parameters" both taken), or None."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    return _call(obj["name"], args)


def _call(name: str, arguments) -> dict:
    """An OpenAI tool call: arguments as a JSON string."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant's tool call arguments as objects (OpenAI sends JSON
    strings; templates write them with tojson), everything else as given."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {}) if isinstance(c, dict) else {}
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
