"""The OpenAI-compatible HTTP API of `zoo serve` (FastAPI), over one EngineLoop shared by every connection.

    app = create_app(llm, served_model_name="tiny", api_key="secret")   # then uvicorn.run(app, ...)

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (`stream: true`: server-sent events
ending with `data: [DONE]`; `stream_options.include_usage`: a last chunk with the usage), GET /health,
GET /metrics (Prometheus text). With an api_key, /v1/* needs `Authorization: Bearer KEY` (401 without).
A bad request is a 400 whose OpenAI-style body names the field (`param`), with SamplingParams' own message;
a client that goes away has its requests aborted and their KV blocks freed.

Sampling fields beyond OpenAI's, as vLLM takes them: top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output, allowed_token_ids, bad_words and
prompt_logprobs (the response's `prompt_logprobs`: per prompt token None for the first, then {token id:
{"logprob", "decoded_token"}}; on each completion choice, at the top of a chat response). /v1/completions takes
`echo` (the prompt's text before the completion's; with `logprobs`, the prompt tokens' logprobs first, the
first one null). Chat messages may hold images as vLLM serves them: image_url parts with data: URLs, for a
multimodal checkpoint. `n` samples are n engine requests with the same prompt (the prefix cache shares its blocks);
with a seed, sample j gets seed + j. Chat takes OpenAI's tools and tool_choice (zoo/runtime/tools.py: the template
renders the tools, the reply is parsed into tool_calls, streamed as OpenAI streams them), assistant messages with
tool_calls and "tool" messages.
"""

import asyncio
import hmac
import json
import re
import time
import uuid

from zoo.runtime import chat_template
from zoo.runtime.engine_loop import EngineLoop
from zoo.runtime.sampling_params import SamplingParams

# body field -> SamplingParams field (the same name unless listed)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                   "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids", "bad_words",
                   "prompt_logprobs")
UNSUPPORTED = {  # field -> the value that is fine to send (anything else is refused, naming the field)
    "echo": (None, False), "suffix": (None, ""), "functions": (None, []), "best_of": (None, 1),
}
MAX_N = 16
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's message roles
# structured outputs (zoo/runtime/structured.py), as vLLM takes them beside OpenAI's response_format:
# body field -> the StructuredOutputsParams field it sets
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def _param_of(message: str, fields: dict[str, str]) -> str | None:
    """The body field a SamplingParams / engine ValueError is about."""
    m = re.match(r"SamplingParams\.(\w+)=", message)
    if m:
        return fields.get(m.group(1), m.group(1))
    return "prompt" if "prompt" in message else None


class OpenAIServer:
    def __init__(self, llm, *, served_model_name: str, api_key: str | None = None, tool_call_parser: str | None = None):
        self.llm = llm
        self.tool_call_parser = tool_call_parser  # (None: the chat template's own format, zoo/runtime/tools.py)
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.model_name = served_model_name
        self.api_key = api_key
        self.loop = EngineLoop(self.engine)
        self.created = int(time.time())
        self.num_requests = 0

    # -- checks --------------------------------------------------------------------------------------
    def check_key(self, headers) -> None:
        if self.api_key is None:
            return
        got = headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
                           kind="authentication_error")

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "not_found_error")

    def sampling(self, body: dict, max_tokens, max_tokens_field: str, prompt_len: int, *, logprobs=None,
                 echo: bool = False, tools=None) -> SamplingParams:
        """The request's SamplingParams. echo (completions): the prompt's logprobs too when logprobs are asked."""
        for name, fine in UNSUPPORTED.items():
            if name in body and body[name] not in fine and not (name == "echo" and echo):
                raise bad(f"{name} is not supported by zoo serve" + (" on /v1/chat/completions" if name == "echo"
                                                                      else ""), name)
        if max_tokens is None:  # OpenAI's chat default: as many as the context leaves
            max_tokens = max(1, self.engine.max_model_len - prompt_len)
        kwargs = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
        bias = body.get("logit_bias")
        if bias:  # OpenAI sends the token ids as strings
            if not isinstance(bias, dict) or not all(isinstance(k, str) and k.strip().isdigit() for k in bias):
                raise bad("logit_bias must map token ids (as strings) to biases", "logit_bias")
            kwargs["logit_bias"] = {int(k): v for k, v in bias.items()}
        if "temperature" not in kwargs:
            kwargs["temperature"] = 1.0
        if echo and body.get("echo") and logprobs is not None:
            given = kwargs.get("prompt_logprobs")
            kwargs["prompt_logprobs"] = max(logprobs, given) if isinstance(given, int) and not isinstance(
                given, bool) else logprobs if given is None else given
        if isinstance(kwargs.get("stop"), (list, tuple)) and len(kwargs["stop"]) > 16:
            raise bad("stop: at most 16 stop strings", "stop")
        kwargs["structured_outputs"] = self.structured(body)
        if tools is not None:
            kwargs = {**tools.sampling(), **kwargs}  # (skip_special_tokens given by the client wins)
            held = self.held(tools)
            if held is not None and kwargs["structured_outputs"] is not None:
                raise bad("tool_choice 'required' or a named function holds the reply to the tool calls; it takes "
                          "no other structured output", "tool_choice")
            kwargs["structured_outputs"] = held or kwargs["structured_outputs"]
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)
        except ValueError as e:
            raise bad(str(e), _param_of(str(e), {"max_tokens": max_tokens_field, "logprobs": "logprobs"})) from None
        except TypeError as e:
            raise bad(str(e)) from None

    def structured(self, body: dict):
        """The request's StructuredOutputsParams (compiled here, so a bad schema is a 400 naming its field), from
        OpenAI's response_format (json_object, json_schema), vLLM's guided_json / guided_regex / guided_choice /
        guided_grammar or its structured_outputs object; None without any. Two of them is a 400."""
        from zoo.runtime.structured import StructuredOutputsParams

        given = [f for f in ("response_format", *GUIDED, "structured_outputs") if body.get(f) is not None]
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                                                      "json_schema")):
            raise bad("response_format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}",
                      "response_format")
        if fmt is not None and fmt["type"] == "text":
            given.remove("response_format")
        if len(given) > 1:
            raise bad(f"{given[0]} and {given[1]}: give one way to constrain the output", given[1])
        if not given:
            return None
        field = given[0]
        try:
            if field == "response_format" and fmt["type"] == "json_object":
                spec = StructuredOutputsParams(json_object=True)
            elif field == "response_format":
                inner = fmt.get("json_schema")
                schema = inner.get("schema") if isinstance(inner, dict) else None
                if schema is None:
                    raise ValueError("response_format.json_schema.schema: a JSON schema is required")
                spec = StructuredOutputsParams(json=schema)
            elif field == "structured_outputs":
                so = body[field]
                if not isinstance(so, dict):
                    raise ValueError("structured_outputs must be an object, e.g. {\"json\": SCHEMA}")
                unknown = sorted(set(so) - set(StructuredOutputsParams.__dataclass_fields__))
                if unknown:
                    raise ValueError(f"structured_outputs.{unknown[0]}: unknown field")
                spec = StructuredOutputsParams(**so)
            else:
                spec = StructuredOutputsParams(**{GUIDED[field]: body[field]})
            self.engine.grammars_for(spec)
        except (ValueError, TypeError) as e:
            raise bad(f"{field}: {str(e).removeprefix('SamplingParams.')}", field) from None
        return spec

    def held(self, tools):
        """What tool_choice "required" / a named function holds the reply to (compiled here: a tool's parameters
        schema that does not compile is a 400 naming tools), or None."""
        from zoo.runtime.tools import ToolError

        try:
            spec = tools.structured()
            if spec is not None:
                self.engine.grammars_for(spec)
        except ToolError as e:
            raise bad(str(e), e.param) from None
        except (ValueError, TypeError) as e:
            raise bad(f"tools: a function's parameters schema cannot hold the reply ({tools.choice} tool_choice): "
                      f"{str(e).removeprefix('SamplingParams.structured_outputs.json: ')}", "tools") from None
        return spec

    def n_of(self, body: dict) -> int:
        n = body.get("n", 1)
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise bad(f"n={n!r}: must be an integer in [1, {MAX_N}]", "n")
        return n

    # -- prompts ---------------------------------------------------------------------------------------
    def completion_prompts(self, body: dict) -> list:
        if "prompt" not in body:
            raise bad("prompt is required", "prompt")
        p = body["prompt"]
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return [p]
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return list(p)
        if isinstance(p, list) and p and all(isinstance(x, list) and x and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
            return list(p)
        raise bad("prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                  "prompt")

    def tool_calls(self, body: dict):
        """The request's tool calling (zoo/runtime/tools.py ToolCalls), or None without tools."""
        from zoo.runtime.tools import ToolCalls, ToolError

        try:
            return ToolCalls.of(body, getattr(self.tokenizer, "chat_template", None), self.tool_call_parser)
        except ToolError as e:
            raise bad(str(e), e.param) from None

    def chat_prompt(self, body: dict, tools=None) -> tuple[list[int], list | None]:
        """(prompt token ids, the images or None); `tools` (ToolCalls) rendered by the template, and the messages'
        tool_calls / tool_call_id with them. Content parts: text, and for a model that takes images,
        {"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}} as vLLM serves them (a data: URL
        only: the server neither fetches URLs nor opens paths its clients name)."""
        import base64
        import binascii

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages must be a non-empty list of {role, content} objects", "messages")
        plain, images = [], []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
            if m["role"] not in ROLES:
                raise bad(f"messages[{i}].role={m['role']!r}: must be one of {', '.join(ROLES)}", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text, images
                parts = []
                for j, c in enumerate(content):
                    kind = c.get("type") if isinstance(c, dict) else None
                    if kind == "text" and isinstance(c.get("text"), str):
                        parts.append({"type": "text", "text": c["text"]})
                        continue
                    if kind != "image_url":
                        raise bad(f"messages[{i}].content[{j}]: only text and image_url parts are supported",
                                  "messages")
                    if self.engine.mm is None:
                        raise bad(f"messages[{i}].content[{j}]: {self.model_name} takes no images", "messages")
                    url = c.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
                        raise bad(f"messages[{i}].content[{j}].image_url: give the image as a data: URL "
                                  f"(data:image/png;base64,...); URLs are not fetched", "messages")
                    try:
                        images.append(base64.b64decode(url.partition(",")[2], validate=True))
                    except (binascii.Error, ValueError):
                        raise bad(f"messages[{i}].content[{j}].image_url: the data: URL is not base64",
                                  "messages") from None
                    parts.append({"type": "image"})
                content = parts if any(p["type"] == "image" for p in parts) else "".join(p["text"] for p in parts)
            if content is None:
                content = ""
            if not isinstance(content, (str, list)):
                raise bad(f"messages[{i}].content must be a string or a list of content parts", "messages")
            extra = {k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None}
            plain.append({"role": m["role"], "content": content, **extra})
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise bad(f"{self.model_name} has no chat template: use /v1/completions", "messages")
        from zoo.runtime.tools import ToolError, for_template

        try:
            plain = for_template(plain)
        except ToolError as e:
            raise bad(str(e), e.param) from None
        try:
            return chat_template.apply_chat_template(self.tokenizer, plain, name=self.model_name,
                                                     tools=tools.tools if tools is not None else None), images or None
        except ValueError as e:
            raise bad(str(e).removesuffix("; use --no-chat"), "messages") from None

    # -- requests into the engine loop ------------------------------------------------------------------
    def start(self, prompts_params: list[tuple], rid: str, field: str, queue, aloop) -> list[str]:
        """Add every (prompt, params[, images]), each choice's outputs arriving on `queue` as (index, item); all or
        none."""
        added = []
        try:
            for i, job in enumerate(prompts_params):
                prompt, params, images = job if len(job) == 3 else (*job, None)
                sink = (lambda i: lambda item: aloop.call_soon_threadsafe(queue.put_nowait, (i, item)))(i)
                added.append(self.loop.add(prompt, params, sink, request_id=f"{rid}-{i}", images=images))
        except ValueError as e:
            for a in added:
                self.loop.abort(a)
            msg = str(e)
            raise bad(msg, _param_of(msg, {}) if "SamplingParams" in msg else field) from None
        self.num_requests += 1
        return added

    def prompt_logprobs_of(self, entries) -> list | None:
        """vLLM's JSON of prompt logprobs: per prompt token None (the first) or {token id: {logprob, decoded_token}}."""
        if entries is None:
            return None
        return [None if d is None else {str(t): {"logprob": v, "decoded_token": self.token_text(t)}
                                        for t, v in d.items()} for d in entries]

    def echo_logprobs(self, out, n_top: int):
        """OpenAI's completion logprobs of the prompt (echo): the first token's are null."""
        entries = out.prompt_logprobs
        first = self.token_text(out.prompt_token_ids[0])
        rest = self.logprobs_of(entries[1:], False, n_top, offset=len(first))
        return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}

    def prompt_text(self, out) -> str:
        return out.prompt if out.prompt is not None else (
            self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else "")

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def logprobs_of(self, entries: list[dict[int, float]], chat: bool, n_top: int, offset: int = 0):
        """OpenAI's logprobs for these tokens' entries (sampled token first, then the top ones)."""
        if chat:
            content = []
            for d in entries:
                tok, lp = next(iter(d.items()))
                ranked = sorted(d.items(), key=lambda kv: -kv[1])[:n_top]
                content.append({"token": self.token_text(tok), "logprob": lp,
                                "bytes": list(self.token_text(tok).encode()),
                                "top_logprobs": [{"token": self.token_text(t), "logprob": v,
                                                  "bytes": list(self.token_text(t).encode())} for t, v in ranked]})
            return {"content": content}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for d in entries:
            tok, lp = next(iter(d.items()))
            text = self.token_text(tok)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self.token_text(t): v for t, v in sorted(d.items(), key=lambda kv: -kv[1])
                                        [:n_top]})
            out["text_offset"].append(offset)
            offset += len(text)
        return out


def create_app(llm, *, served_model_name: str, api_key: str | None = None, tool_call_parser: str | None = None,
               close_llm: bool = False):
    """The FastAPI app; its engine loop starts with the app (lifespan) and stops with it; `close_llm`: then the LLM
    closes too (the ranks or pipeline stages it spawned stop, told by rank 0, before uvicorn re-raises a SIGTERM)."""
    import contextlib

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    server = OpenAIServer(llm, served_model_name=served_model_name, api_key=api_key,
                          tool_call_parser=tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        yield
        server.loop.close()
        if close_llm:
            llm.close()

    app = FastAPI(title="zoo serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                     kind="internal_server_error").body(), status_code=500)

    async def json_body(request: Request) -> dict:
        server.check_key(request.headers)
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise bad("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        server.check_model(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise bad(f"stream={stream!r}: must be true or false", "stream")
        opts = body.get("stream_options")
        if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False),
                                                                                (bool, type(None)))):
            raise bad("stream_options must be an object like {\"include_usage\": true}", "stream_options")
        return body

    @app.get("/health")
    async def health():
        alive = server.loop._thread.is_alive()
        return Response(status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(server), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_key(request.headers)
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "zoo", "max_model_len": server.engine.max_model_len}]}

    @app.get("/version")
    async def version():
        import importlib.metadata

        return {"version": importlib.metadata.version("zoo")}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: {"prompt": text, "add_special_tokens": true} or {"messages": [...], "add_generation_prompt":
        true} -> {"tokens", "count", "max_model_len"} (the chat rendered by the model's template)."""
        body = await json_body(request)
        if server.tokenizer is None:
            raise bad(f"{server.model_name} has no tokenizer")
        if "messages" in body:
            ids = (await asyncio.to_thread(server.chat_prompt, body, server.tool_calls(body)))[0]
        elif isinstance(body.get("prompt"), str):
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise bad(f"add_special_tokens={special!r}: must be true or false", "add_special_tokens")
            ids = server.tokenizer.encode(body["prompt"], add_special_tokens=special)
        else:
            raise bad("give prompt (a string) or messages", "prompt")
        return {"tokens": list(ids), "count": len(ids), "max_model_len": server.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: {"tokens": [ids]} -> {"prompt": text}; an id outside the vocabulary is a 400."""
        body = await json_body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad("tokens must be a list of token ids", "tokens")
        if server.tokenizer is None:
            raise bad(f"{server.model_name} has no tokenizer")
        out = [t for t in tokens if not 0 <= t < (server.engine.vocab_size or len(server.tokenizer))]
        if out:
            raise bad(f"tokens: {out[0]} is outside the vocabulary of {server.engine.vocab_size} tokens", "tokens")
        return {"prompt": server.tokenizer.decode(tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        prompts, n = server.completion_prompts(body), server.n_of(body)
        lp = body.get("logprobs")
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 20):
            raise bad(f"logprobs={lp!r}: must be an integer in [0, 20]", "logprobs")
        max_tokens = body.get("max_tokens", 16)
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise bad(f"echo={echo!r}: must be true or false", "echo")
        jobs = []
        for p in prompts:
            for j in range(n):
                params = server.sampling(body, max_tokens, "max_tokens", 0, logprobs=lp, echo=True)
                if params.seed is not None:
                    params.seed += j
                jobs.append((p, params))
        return await respond(request, body, jobs, chat=False, n_top=lp or 0, n=n, echo=bool(echo))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        n = server.n_of(body)
        tools = server.tool_calls(body)
        ids, images = await asyncio.to_thread(server.chat_prompt, body, tools)
        want_lp = body.get("logprobs", False)
        if not isinstance(want_lp, (bool, type(None))):
            raise bad(f"logprobs={want_lp!r}: must be true or false (top_logprobs: how many)", "logprobs")
        top = body.get("top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
            raise bad(f"top_logprobs={top!r}: must be an integer in [0, 20]", "top_logprobs")
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        jobs = []
        for j in range(n):
            params = server.sampling(body, body.get(field), field, len(ids),
                                     logprobs=(top or 0) if want_lp else None, tools=tools)
            if params.seed is not None:
                params.seed += j
            jobs.append((ids, params, images))
        return await respond(request, body, jobs, chat=True, n_top=top or 0, n=n, tools=tools)

    async def respond(request: Request, body: dict, jobs, *, chat: bool, n_top: int, n: int, echo: bool = False,
                      tools=None):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        field = "messages" if chat else "prompt"
        ids = await asyncio.to_thread(server.start, jobs, rid, field, queue, aloop)
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": server.model_name}
        want_plp = body.get("prompt_logprobs") is not None  # (echo with logprobs computes them, unasked)
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(stream(ids, queue, head, chat, n_top, usage, n, echo, want_plp, tools),
                                     media_type="text/event-stream")
        finals: dict[int, object] = {}
        try:
            while len(finals) < len(ids):
                try:
                    i, item = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                if isinstance(item, Exception):
                    raise APIError(500, f"the engine failed: {type(item).__name__}: {item}",
                                   kind="internal_server_error")
                if item.finished:
                    finals[i] = item
        finally:
            for i, rid_i in enumerate(ids):
                if i not in finals:
                    server.loop.abort(rid_i)
        choices = []
        for i in range(len(ids)):
            out = finals[i]
            choice = {"index": i, "finish_reason": out.finish_reason,
                      "logprobs": server.logprobs_of(out.logprobs, chat, n_top) if out.logprobs is not None else None}
            if chat:
                content, calls = tools.parse(out.text) if tools is not None else (out.text, [])
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = calls
                    choice["finish_reason"] = tools.finish_reason(bool(calls), out.finish_reason)
            else:
                choice["text"] = (server.prompt_text(out) if echo else "") + out.text
                if echo and choice["logprobs"] is not None:
                    head_lp = server.echo_logprobs(out, n_top)
                    shift = len(server.prompt_text(out))
                    lp = choice["logprobs"]
                    choice["logprobs"] = {k: head_lp[k] + (lp[k] if k != "text_offset" else
                                                           [o + shift for o in lp[k]]) for k in lp}
                if want_plp:
                    choice["prompt_logprobs"] = server.prompt_logprobs_of(out.prompt_logprobs)
            choices.append(choice)
        prompt_tokens = sum(len(finals[i].prompt_token_ids) for i in range(0, len(ids), n))  # each prompt once
        reply = {**head, "choices": choices, "usage": usage_of(prompt_tokens, finals.values())}
        if chat and want_plp:
            reply["prompt_logprobs"] = server.prompt_logprobs_of(finals[0].prompt_logprobs)
        return reply

    async def stream(ids, queue, head, chat, n_top, include_usage, n, echo=False, want_plp=False, tools=None):
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        done: dict[int, object] = {}
        parsers = [tools.stream() for _ in ids] if chat and tools is not None else None  # each choice's ToolStream
        held_lp: list[list] = [[] for _ in ids]  # logprobs of text a ToolStream holds back, sent with its next chunk
        seen = [0] * len(ids)  # logprob entries sent per choice
        started = [False] * len(ids)  # the choice's first chunk (echo's prompt text, prompt_logprobs) is sent
        try:
            if chat:
                for i in range(len(ids)):
                    yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
            while len(done) < len(ids):
                i, item = await queue.get()
                if isinstance(item, Exception):
                    yield sse(APIError(500, f"the engine failed: {type(item).__name__}: {item}",
                                       kind="internal_server_error").body())
                    break
                if not item.delta_text and not item.finished:
                    continue
                lp = None
                if item.logprobs is not None:
                    # (item.logprobs is the request's own list, which later steps extend: cut at this step)
                    lp = server.logprobs_of(item.logprobs[seen[i]:len(item.token_ids)], chat, n_top)
                    seen[i] = len(item.token_ids)
                choice = {"index": i, "logprobs": lp, "finish_reason": item.finish_reason}
                if parsers is not None:  # tool calls: content and calls as the reply makes them certain
                    if item.finished:
                        done[i] = item
                    for chunk in tool_chunks(parsers[i], tools, item, lp, held_lp[i]):
                        extra = {"prompt_logprobs": server.prompt_logprobs_of(item.prompt_logprobs)} \
                            if want_plp and not started[i] else {}
                        started[i] = True
                        yield sse({**head, "choices": [{"index": i, **chunk}], **extra})
                    continue
                if chat:
                    choice["delta"] = {"content": item.delta_text} if item.delta_text else {}
                else:
                    choice["text"] = item.delta_text
                extra = {}
                if not started[i]:
                    started[i] = True
                    if echo and not chat:
                        choice["text"] = server.prompt_text(item) + choice["text"]
                        if lp is not None:
                            lp0 = server.echo_logprobs(item, n_top)
                            shift = len(server.prompt_text(item))
                            choice["logprobs"] = {k: lp0[k] + (lp[k] if k != "text_offset" else
                                                               [o + shift for o in lp[k]]) for k in lp}
                    if want_plp:
                        if chat:
                            extra["prompt_logprobs"] = server.prompt_logprobs_of(item.prompt_logprobs)
                        else:
                            choice["prompt_logprobs"] = server.prompt_logprobs_of(item.prompt_logprobs)
                if item.finished:
                    done[i] = item
                yield sse({**head, "choices": [choice], **extra})
            if include_usage and len(done) == len(ids):
                prompt = sum(len(done[i].prompt_token_ids) for i in range(0, len(ids), n))
                yield sse({**head, "choices": [], "usage": usage_of(prompt, done.values())})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): nothing of this request is left running
            for i, rid_i in enumerate(ids):
                if i not in done:
                    server.loop.abort(rid_i)

    return app


def tool_chunks(parser, tools, item, lp, held: list) -> list[dict]:
    """This step's chunks (delta, logprobs, finish_reason) of a chat choice parsed for tool calls: what its
    ToolStream lets out; the logprobs of text held back go with the next chunk, the finish reason with the last."""
    held += lp["content"] if lp is not None else []
    deltas = parser.feed(item.text, item.finished)
    if item.finished and not deltas:
        deltas = [{}]
    chunks = []
    for k, delta in enumerate(deltas):
        last = item.finished and k == len(deltas) - 1
        chunks.append({"delta": delta, "logprobs": {"content": list(held)} if held else None,
                       "finish_reason": tools.finish_reason(parser.made > 0, item.finish_reason) if last else None})
        held.clear()
    return chunks


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def usage_of(prompt_tokens: int, finals) -> dict:
    completion = sum(len(f.token_ids) for f in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def prometheus(server: OpenAIServer) -> str:
    """The serving metrics in Prometheus' text format (names prefixed zoo_)."""
    loop = server.loop
    s = loop.stats()
    rate = s["prefix_hits"] / s["prefix_queries"] if s["prefix_queries"] else 0.0
    gauges = [
        ("num_requests_running", "requests in the running batch", s["running"]),
        ("num_requests_waiting", "requests waiting to be admitted", s["waiting"]),
        ("kv_cache_blocks_used", "KV blocks referenced by requests", s["kv_blocks_used"]),
        ("kv_cache_blocks_total", "KV blocks in the pool", s["kv_blocks_total"]),
        ("kv_cache_usage_ratio", "fraction of the KV pool in use", s["kv_blocks_used"] / s["kv_blocks_total"]),
        ("prefix_cache_hit_rate", "prompt tokens found in the prefix cache / prompt tokens looked up", rate),
    ]
    counters = [
        ("prefix_cache_queries_total", "prompt tokens looked up in the prefix cache", s["prefix_queries"]),
        ("prefix_cache_hits_total", "prompt tokens found in the prefix cache", s["prefix_hits"]),
        ("prompt_tokens_total", "prompt tokens of admitted requests", loop.prompt_tokens),
        ("generation_tokens_total", "tokens generated", loop.generation_tokens),
        ("num_preemptions_total", "requests preempted (recomputed later)", s["preemptions"]),
        ("step_errors_total", "engine steps that raised (their requests ended)", loop.step_errors),
    ]
    lines = []
    for name, help_, value in gauges:
        lines += [f"# HELP zoo_{name} {help_}", f"# TYPE zoo_{name} gauge", f"zoo_{name} {value}"]
    for name, help_, value in counters:
        lines += [f"# HELP zoo_{name} {help_}", f"# TYPE zoo_{name} counter", f"zoo_{name} {value}"]
    lines += ["# HELP zoo_request_finished_total requests finished, by reason",
              "# TYPE zoo_request_finished_total counter"]
    lines += [f'zoo_request_finished_total{{finished_reason="{r}"}} {c}' for r, c in sorted(loop.finished.items())]
    for name, help_, hist in (("time_to_first_token_seconds", "arrival to first token", loop.ttft),
                              ("inter_token_latency_seconds", "time between a request's tokens", loop.itl)):
        lines += [f"# HELP zoo_{name} {help_}", f"# TYPE zoo_{name} histogram", *hist.lines(f"zoo_{name}")]
    return "\n".join(lines) + "\n"
