"""Serve a model over an OpenAI-compatible HTTP API (no MODEL: the embedded default).

    zoo serve                                        SmolLM2-135M-Instruct on http://127.0.0.1:8000/v1
    zoo serve org/name --port 9000 --api-key secret --served-model-name mine
    zoo serve DIR --pipeline-parallel-size 2         (or --tensor-parallel-size 2: ranks spawned here, gloo; under
                                                      torchrun rank 0 serves HTTP, the other ranks its steps)
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

Routes: /v1/models, /v1/completions, /v1/chat/completions (stream: true for server-sent events; tools and
tool_choice: zoo/runtime/tools.py), /health, /metrics (Prometheus). One engine loop batches every connection's
requests (zoo.runtime.engine_loop). --port 0 takes a free port; the line "zoo serve: serving ... (..., tool calls:
FORMAT); listening on http://HOST:PORT" on stderr says which, and how replies are read for tool calls.
Exit status: 0 after Ctrl-C, 1 a loader finding, 2 usage or environment error.
"""
from __future__ import annotations

import argparse
import socket
import sys

from zoo.runtime.tools import FORMATS, detect_format


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="hub id, local Hugging Face directory or .gguf file (default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free one)")
    parser.add_argument("--api-key", default=None, help="requests to /v1 must send 'Authorization: Bearer KEY'")
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the "
                                                                    "checkpoint's name)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests batched at once (default 64)")
    parser.add_argument("--tool-call-parser", choices=FORMATS, default=None,
                        help="how the model's replies hold tool calls (default: the format its chat template renders "
                             "tools for; a template that renders none takes no tools without it)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's flag, accepted: tool_choice 'auto' is on whenever tools can be parsed")
    from zoo.commands.run import add_model_arguments, add_parallel_arguments

    add_model_arguments(parser)  # --dtype, --tokenizer, --revision
    add_parallel_arguments(parser, "rank 0 serves HTTP")


def run(args) -> int:
    from zoo.commands.run import _check_max_model_len, _fail, _load, parallel_sizes

    done = parallel_sizes(args, "zoo serve")
    if done is not None:  # a launched rank > 0 that served rank 0's steps, or a size refused
        return done
    for name in ("max_model_len", "max_num_seqs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return _fail(f"--{name.replace('_', '-')}={value}: must be >= 1", 2, "zoo serve")
    if not 0 <= args.port <= 65535:
        return _fail(f"--port={args.port}: must be in [0, 65535]", 2, "zoo serve")
    try:
        import uvicorn

        from zoo.runtime.server import create_app
    except ImportError as e:
        return _fail(f"{e.name} is not installed: pip install fastapi uvicorn", 2, "zoo serve")
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        return _fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}", 2, "zoo serve")
    llm = _load(args, "zoo serve", max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                check=lambda llm: _check_max_model_len(llm, args))
    if isinstance(llm, int):
        sock.close()
        return llm
    name = args.served_model_name or llm.files.name
    app = create_app(llm, served_model_name=name, api_key=args.api_key, tool_call_parser=args.tool_call_parser,
                     close_llm=True)
    host, port = sock.getsockname()[:2]
    tools = args.tool_call_parser or detect_format(getattr(llm.tokenizer, "chat_template", None)) or "none"
    print(f"zoo serve: serving {name!r} (max_model_len={llm.engine.max_model_len}, tool calls: {tools}); "
          f"listening on http://{host}:{port}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    try:
        server.run(sockets=[sock])
    finally:
        llm.close()  # (closed already by the app's shutdown, unless the server failed to start)
    return 0
