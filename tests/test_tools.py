"""OpenAI tool calling (zoo/runtime/tools.py) in `zoo serve`, driven by the official openai client, on random tiny
byte-level Llamas (any text is some sequence of their tokens) whose chat templates take tools in the three formats
of the served families: Hermes / Qwen2.5's <tool_call> blocks, Llama 3.1's JSON and Mistral v3's [TOOL_CALLS]
(templates written here in their style, so the format is found from the template as it is for a real checkpoint).

A random model calls no tool by itself: a call is held by tool_choice "required" / a named function (structured
outputs), and "auto" parsing is fed the text each format implies, through the parser alone and, held by a
structured-outputs choice, through the server streamed and not. The round trip: a call, the tool's result sent
back (a "tool" message with its tool_call_id, the assistant's tool_calls), a final answer.
"""
from __future__ import annotations

import json

import pytest

from byte_tiny import save_byte_model
from zoo import LLM, SamplingParams
from zoo.runtime.tools import ToolCalls, ToolError, detect_format

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

# -- chat templates in the style of the real ones ------------------------------------------------------------------
HERMES = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

These functions may be called; each one's signature is a JSON object inside <tools></tools>:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>

To call one, reply with an object naming it and its arguments between <tool_call></tool_call> tags:
<tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """{{- bos_token }}
{%- set ns = namespace(tools_shown=false) %}
{%- for m in messages %}
{%- if m.role == 'user' and tools and not ns.tools_shown %}
{%- set ns.tools_shown = true %}<|start_header_id|>user<|end_header_id|>

When one of the functions below helps, answer with only a JSON call of it in the form
{"name": function name, "parameters": dictionary of its arguments}.

{% for t in tools %}{{ t | tojson }}

{% endfor %}{{ m.content }}<|eot_id|>
{%- elif m.role == 'assistant' and m.tool_calls %}
{%- if m.tool_calls | length != 1 %}{{ raise_exception('this format holds one tool call per message') }}{% endif %}
{%- set c = m.tool_calls[0].function %}<|start_header_id|>assistant<|end_header_id|>

{"name": "{{ c.name }}", "parameters": {{ c.arguments | tojson }}}<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """{{- bos_token }}
{%- set ns = namespace(last_user=-1, system='') %}
{%- for m in messages %}
{%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- if m.role == 'system' %}{% set ns.system = m.content %}{% endif %}
{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'user' %}
{%- if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}
[INST]{% if loop.index0 == ns.last_user and ns.system %}{{ ns.system }}

{% endif %}{{ m.content }}[/INST]
{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][
{%- for c in m.tool_calls %}
{%- if c.id is not string or c.id | length != 9 %}
{{- raise_exception('a tool call id is 9 letters or digits') }}{% endif %}
{{- {"name": c.function.name, "arguments": c.function.arguments, "id": c.id} | tojson }}{{ ', ' if not loop.last }}
{%- endfor %}]{{ eos_token }}
{%- elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}
{%- elif m.role == 'tool' %}
{%- if m.tool_call_id is not string or m.tool_call_id | length != 9 %}
{{- raise_exception('a tool result names its call id') }}{% endif -%}
[TOOL_RESULTS]{{ {"content": m.content, "call_id": m.tool_call_id} | tojson }}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""

TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA3, "mistral": MISTRAL}
ADDED = {"mistral": ["[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]}  # special tokens, as Mistral's

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
        "$defs": {"zone": {"enum": ["utc", "cet"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "the time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]


def tool_calls(fmt: str, choice=None) -> ToolCalls:
    return ToolCalls.of({"tools": TOOLS, **({"tool_choice": choice} if choice is not None else {})},
                        TEMPLATES[fmt])


# -- the parser alone, on the text each format implies ---------------------------------------------------------------
# (format, reply, content, [(name, arguments)]): text before a call, several calls, malformed JSON and a call of an
# unknown function staying content ("SAME": the reply itself). BROKEN: replies whose JSON breaks after a call's name
# went out in a stream, and what the stream gives at most (the call stays, as OpenAI's and vLLM's streams leave it)
W, T = '{"city": "Paris", "unit": "c"}', '{"zone": "utc"}'
REPLIES = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', None, [("get_weather", W)]),
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n<tool_call>\n'
               f'{{"name": "get_time", "arguments": {T}}}\n</tool_call>', "Let me look.\n",
     [("get_weather", W), ("get_time", T)]),
    ("hermes", f'<tool_call>{{"arguments": {T}, "name": "get_time"}}', None, [("get_time", T)]),  # unclosed, at the end
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {W}\n</tool_call>', "SAME", []),  # a brace short
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> done', "SAME", []),
    ("hermes", 'No call: <tool_call> is how I would write one, and {"name": "get_time"} too.', "SAME", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {W}}}', None, [("get_weather", W)]),
    ("llama3_json", f' {{"name": "get_weather", "parameters": {W}}}; {{"name": "get_time", "parameters": {T}}}', None,
     [("get_weather", W), ("get_time", T)]),
    ("llama3_json", f'Checking.<|python_tag|>{{"name": "get_time", "arguments": {json.dumps(T)}}}', "Checking.",
     [("get_time", T)]),  # arguments as a JSON string
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris",}}', "SAME", []),
    ("llama3_json", '{"name": "get_wether", "parameters": {}}', "SAME", []),
    ("llama3_json", 'It is {"hot": true} in Paris.', "SAME", []),
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}]', None, [("get_weather", W)]),
    ("mistral", f'On it. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", '
                f'"arguments": {T}}}]', "On it. ", [("get_weather", W), ("get_time", T)]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"]', "SAME", []),
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, {{"name": "nope", "arguments": {{}}}}]',
     "SAME", []),  # one unknown function: the whole group stays content
]
BROKEN = {REPLIES[3][1]: [("get_weather", W)], REPLIES[9][1]: [("get_weather", '{"city": "Paris",}')],
          REPLIES[14][1]: [("get_weather", '{"city": "Paris"')], REPLIES[15][1]: [("get_weather", W)]}


def reassemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    """(content, [(name, arguments)], each call's first chunk) of OpenAI's streamed deltas."""
    content, calls, firsts = "", {}, []
    for d in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls") or []:
            if "id" in c:
                firsts.append(c)
                calls[c["index"]] = [c["function"]["name"], c["function"]["arguments"]]
            else:
                calls[c["index"]][1] += c["function"]["arguments"]
    return content or None, [tuple(calls[k]) for k in sorted(calls)], firsts


@pytest.mark.parametrize("fmt, reply, content, calls", REPLIES)
def test_parse_each_format_whole_and_streamed(fmt, reply, content, calls):
    parser = tool_calls(fmt)
    got_content, got = parser.parse(reply)
    assert got_content == (reply if content == "SAME" else content)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
    for c in got:
        assert c["type"] == "function" and json.loads(c["function"]["arguments"]) is not None
        assert (len(c["id"]) == 9 and c["id"].isalnum()) if fmt == "mistral" else c["id"].startswith("call_")
    for step in (1, 3, 7):  # the reply fed as it grows: the deltas add up to the whole reply's fields
        stream = parser.stream()
        deltas = [d for k in range(step, len(reply) + step, step) for d in stream.feed(reply[:k], False)]
        deltas += stream.feed(reply, True)
        got_stream = reassemble(deltas)
        if reply in BROKEN:  # what went out stands and nothing contradicts it (how far it got: where chunks fell)
            assert got_stream[0] is None and [n for n, _ in got_stream[1]] == [n for n, _ in BROKEN[reply]]
            assert all(want.startswith(a) for (_, a), (_, want) in zip(got_stream[1], BROKEN[reply])), step
        else:
            assert got_stream[:2] == (got_content, calls), step
        for first in got_stream[2]:  # a call's first chunk: index, id, type, name and empty arguments
            assert set(first) == {"index", "id", "type", "function"} and first["function"]["arguments"] == ""


def test_mutated_replies_parse_and_stream_alike():
    """The replies above with pieces cut out, put in and repeated (1000 per format): parsing and streaming never
    raise, a reply without a call is its own content, and a stream that nothing broke equals the whole reply."""
    import random

    rng = random.Random(0)
    pieces = list('{}[]":,; \\n') + ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '"name"',
                                     '"get_time"', '"arguments"', W, T]
    seen = {"calls": 0, "no call": 0, "broken": 0}
    for fmt in TEMPLATES:
        parser, replies = tool_calls(fmt), [r for f, r, *_ in REPLIES if f == fmt]
        for _ in range(1000):
            reply = rng.choice(replies)
            for _ in range(rng.randint(0, 3)):
                a, b = sorted(rng.randrange(len(reply) + 1) for _ in range(2))
                reply = rng.choice([reply[:a] + reply[b:], reply[:a] + rng.choice(pieces) + reply[a:],
                                    reply[:b] + reply[a:b] + reply[b:], reply[:b]])
            content, calls = parser.parse(reply)
            assert calls or content == (reply or None), reply
            stream, step = parser.stream(), rng.choice([1, 2, 5])
            deltas = [d for k in range(step, len(reply) + step, step) for d in stream.feed(reply[:k], False)]
            got = reassemble(deltas + stream.feed(reply, True))
            if not stream.broken:
                assert got[:2] == (content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]), \
                    (fmt, reply, step)
            seen["broken" if stream.broken else "calls" if calls else "no call"] += 1
    assert min(seen.values()) > 100, seen


def test_a_call_streams_its_arguments_as_they_are_written():
    stream = tool_calls("hermes").stream()
    reply = f'<tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>'
    chunks = [stream.feed(reply[:k], False) for k in range(1, len(reply) + 1)]
    name_at = next(k for k, c in enumerate(chunks) if c)
    assert reply[:name_at + 1].endswith('"get_weather"'), reply[:name_at + 1]  # out once the name is whole
    pieces = [c["tool_calls"][0]["function"]["arguments"] for chunk in chunks for c in chunk][1:]
    assert "".join(pieces) == W and len(pieces) == len(W)  # then a chunk per character of the arguments
    assert not any("content" in c for chunk in chunks for c in chunk)


def test_whitespace_and_what_streams_before_a_call():
    parser = tool_calls("hermes")
    assert parser.parse("  \n ") == ("  \n ", [])  # no call: the reply as it is
    stream = parser.stream()
    assert stream.feed("Sure", False) == [{"content": "Sure"}]
    assert stream.feed("Sure <tool_", False) == [{"content": " "}]  # a marker's beginning waits
    assert stream.feed("Sure <tool_x", False) == [{"content": "<tool_x"}]


def test_required_and_named_are_held_json():
    required = tool_calls("hermes", "required")
    spec = required.structured()
    schema = spec.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["$defs"] == TIME["$defs"]
    reply = f'[{{"name": "get_time", "parameters": {T}}}, {{"name": "get_weather", "parameters": {W}}}]'
    jsonschema.validate(json.loads(reply), schema)
    content, calls = required.parse(reply)
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("get_time", T), ("get_weather", W)]
    assert required.finish_reason(True, "stop") == "tool_calls"
    named = tool_calls("llama3_json", {"type": "function", "function": {"name": "get_weather"}})
    assert named.structured().json == WEATHER
    assert named.parse(W)[1][0]["function"] == {"name": "get_weather", "arguments": W}
    assert named.finish_reason(True, "stop") == "stop"  # OpenAI's and vLLM's for a named function
    assert tool_calls("hermes", "none").parse(reply) == (reply, [])
    one = ToolCalls.of({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, HERMES)
    assert one.structured().json["maxItems"] == 1 and len(one.parse(reply)[1]) == 1


def test_the_format_is_found_in_the_template():
    assert {f: detect_format(t) for f, t in TEMPLATES.items()} == {f: f for f in TEMPLATES}
    from byte_tiny import TEMPLATE

    assert detect_format(TEMPLATE) is None and detect_format(None) is None
    assert detect_format({"default": TEMPLATE, "tool_use": HERMES}) == "hermes"
    with pytest.raises(ToolError, match="does not render tools") as e:
        ToolCalls.of({"tools": TOOLS}, TEMPLATE)
    assert e.value.param == "tools"
    assert ToolCalls.of({"tools": TOOLS}, TEMPLATE, "mistral").format == "mistral"


# -- LLM.chat ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A byte-level tiny Llama per format (the same weights), and one whose template takes no tools."""
    root = tmp_path_factory.mktemp("tools")
    out = {f: save_byte_model(root / f, template=t, added=ADDED.get(f, ()), max_position_embeddings=2048)
           for f, t in TEMPLATES.items()}
    out["plain"] = save_byte_model(root / "plain", max_position_embeddings=2048)
    return out


def test_llm_chat_renders_tools(dirs):
    llm = LLM(str(dirs["hermes"]))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    (out,) = llm.chat(ASK, params, tools=TOOLS)
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert out.prompt_token_ids == llm.apply_chat_template(ASK, tools=TOOLS) != llm.apply_chat_template(ASK)
    assert "<tools>" in text and '"name": "get_weather"' in text and "You are terse." in text
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": W}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    text = llm.tokenizer.decode(llm.chat(history, params, tools=TOOLS)[0].prompt_token_ids)
    assert f'{{"name": "get_weather", "arguments": {W}}}' in text and "<tool_response>\n21 C\n" in text
    with pytest.raises(ValueError, match=r"messages\[2\].tool_calls\[0\].function.arguments is not JSON"):
        llm.chat(history[:2] + [{"role": "assistant", "tool_calls": [{**call, "function": {
            "name": "get_weather", "arguments": "{city"}}]}], params, tools=TOOLS)


# -- zoo serve ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(request, dirs):
    """(format, an openai client of a `zoo serve` of that format's model, its base URL)."""
    from test_serve import KEY, serving

    with serving(dirs[request.param]) as url:
        yield request.param, openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120), url


def create(client, **kw):
    from test_serve import NAME

    return client.chat.completions.create(model=NAME, **kw)


def rendered(url: str, messages: list, tools=TOOLS) -> str:
    """The prompt `zoo serve` renders for these messages (its /tokenize), as text."""
    import urllib.request

    from test_serve import KEY

    req = urllib.request.Request(url + "/tokenize", data=json.dumps({"messages": messages, "tools": tools}).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        tokens = json.loads(r.read())["tokens"]
    req = urllib.request.Request(url + "/detokenize", data=json.dumps({"tokens": tokens}).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["prompt"]


def test_a_tool_call_round_trip(served):
    """Call (held to the named function / to "required"), the tool's result sent back, a final answer."""
    fmt, client, url = served
    closing = {str(3 + ord(c)): 6.0 for c in '"]}'}  # (token = 3 specials + byte): strings and JSON close early
    first = create(client, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0, logit_bias=closing,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and first.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert first.choices[0].finish_reason == "stop"  # a named function's, as OpenAI's
    if fmt == "mistral":
        assert len(call.id) == 9 and call.id.isalnum()  # what Mistral's template takes back
    required = create(client, messages=ASK, tools=TOOLS, max_tokens=300, temperature=1.0, seed=4, logit_bias=closing,
                      tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    for c in required.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    history = ASK + [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "21 C and sunny"}]
    prompt = rendered(url, ASK + [first.choices[0].message.model_dump(exclude_none=True), history[-1]])
    assert "21 C and sunny" in prompt and call.function.arguments in prompt  # (tojson writes what xgrammar did)
    if fmt == "mistral":  # the id went back as Mistral's template wants it; an OpenAI-style one it refuses
        assert call.id in prompt
        with pytest.raises(openai.BadRequestError, match="9 letters or digits"):
            create(client, messages=ASK + [{"role": "assistant", "tool_calls": [{**call.model_dump(), "id": "call_1"}]}],
                   tools=TOOLS, max_tokens=2)
    for choice in ("none", "auto"):
        final = create(client, messages=history, tools=TOOLS, tool_choice=choice, max_tokens=6, temperature=0,
                       extra_body={"ignore_eos": True})
        msg = final.choices[0].message
        assert isinstance(msg.content, str) and not msg.tool_calls
        assert final.choices[0].finish_reason == "length" and final.usage.completion_tokens == 6


AUTO_REPLIES = {  # what each format's model would write, held by a structured-outputs choice
    "hermes": f'Checking both.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
              f'<tool_call>\n{{"name": "get_time", "arguments": {T}}}\n</tool_call>',
    "llama3_json": f'{{"name": "get_weather", "parameters": {W}}}; {{"name": "get_time", "parameters": {T}}}',
    "mistral": f'Checking both.[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", '
               f'"arguments": {T}}}]',
}


def test_auto_parses_the_reply_streamed_or_not(served):
    fmt, client, url = served
    kw = dict(messages=ASK, tools=TOOLS, max_tokens=300, temperature=0,
              extra_body={"guided_choice": [AUTO_REPLIES[fmt]]})
    whole = create(client, **kw).choices[0]
    want = [("get_weather", W), ("get_time", T)]
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == want
    assert whole.message.content == (None if fmt == "llama3_json" else "Checking both.\n" if fmt == "hermes" else
                                     "Checking both.")
    assert whole.finish_reason == "tool_calls"
    chunks = list(create(client, stream=True, **kw))
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks]
    content, calls, firsts = reassemble(deltas)
    assert (content or None, calls) == (whole.message.content, want)
    assert [(f["index"], f["type"], f["function"]) for f in firsts] == \
        [(k, "function", {"name": n, "arguments": ""}) for k, (n, _) in enumerate(want)]
    assert len({f["id"] for f in firsts}) == 2
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert sum(bool(c.choices[0].finish_reason) for c in chunks) == 1
    assert sum(1 for d in deltas for t in d.get("tool_calls", []) if "id" not in t) > 4  # arguments in pieces
    free = create(client, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert free.choices[0].message.tool_calls is None and free.choices[0].finish_reason == "length"
    if fmt == "mistral":  # its [TOOL_CALLS] is a special token: kept in the text for the parser, as vLLM does
        kept = create(client, messages=ASK, tools=TOOLS, max_tokens=2, logit_bias={"259": 100},
                      extra_body={"ignore_eos": True})
        assert kept.choices[0].message.content == "[TOOL_CALLS][TOOL_CALLS]"


@pytest.mark.parametrize("served", ["hermes"], indirect=True)
def test_bad_tool_requests_are_a_400_naming_the_field(served):
    fmt, client, url = served
    msgs = [{"role": "user", "content": "x"}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{zone"}}
    cases = [(dict(tools="get_time"), "tools", "tools must be a list"),
             (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools", "tools[0]"),
             (dict(tools=TOOLS + TOOLS[:1]), "tools", "a second function named 'get_weather'"),
             (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "rm"}}), "tool_choice", "'rm'"),
             (dict(tool_choice="required"), "tool_choice", "needs tools"),
             (dict(tools=TOOLS, tool_choice="always"), "tool_choice", "'always'"),
             (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objet"}}}],
                   tool_choice="required"), "tools", "cannot hold the reply"),
             (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
              "no other structured output"),
             (dict(tools=TOOLS, extra_body={"parallel_tool_calls": "yes"}), "parallel_tool_calls", "true or false"),
             (dict(messages=msgs + [{"role": "assistant", "tool_calls": [call]}], tools=TOOLS), "messages",
              "messages[1].tool_calls[0].function.arguments is not JSON")]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            create(client, **{"messages": msgs, "max_tokens": 2, **kwargs})
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kwargs, e.value.body)
        assert words in e.value.body["message"], (words, e.value.body)
    ok = create(client, messages=msgs, tools=TOOLS, max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2  # the server still serves


@pytest.mark.parametrize("parser", [None, "hermes"])
def test_a_template_without_tools(dirs, parser):
    """Tools for a model whose template renders none: a 400 naming tools, unless --tool-call-parser says how to
    read its replies (then a held call works as on any model); given as vLLM takes it, with
    --enable-auto-tool-choice."""
    from test_serve import KEY, serving

    flags = ["--enable-auto-tool-choice", "--tool-call-parser", parser] if parser else []
    with serving(dirs["plain"], *flags) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "x"}]
        if parser is None:
            with pytest.raises(openai.BadRequestError) as e:
                create(client, messages=msgs, tools=TOOLS, max_tokens=2)
            assert e.value.body["param"] == "tools" and "does not render tools" in e.value.body["message"]
            assert create(client, messages=msgs, max_tokens=2).choices[0].message.content is not None
            return
        r = create(client, messages=msgs, tools=TOOLS, max_tokens=120, temperature=0,
                   tool_choice={"type": "function", "function": {"name": "get_time"}})
        jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), TIME)
