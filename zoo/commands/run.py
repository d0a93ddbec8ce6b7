"""Generate text from a model, streamed to the terminal (no MODEL: the embedded default).

    zoo run                                         interactive chat with SmolLM2-135M-Instruct
    zoo run --prompt "What is the capital of France?"
    zoo run org/name --prompt "Once upon a time" --no-chat --temperature 0.8 --seed 1
    zoo run --system "Answer in French." --stop "\n\n" --max-model-len 2048 --repetition-penalty 1.1
    echo "Hello" | zoo run path/to/model.gguf

Instruct models (a tokenizer with a chat template) get their chat template unless --no-chat.
Generated text goes to stdout; progress and the summary line (tokens, tok/s, time to first token)
go to stderr. Exit status: 0 success, 1 a loader finding, 2 usage or environment error.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="hub id, local Hugging Face directory or .gguf file (default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", "-p", help="generate for this prompt and exit (default: interactive, "
                                               "or the prompt read from stdin when it is not a terminal)")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="apply the model's chat template (default: when the tokenizer has one)")
    parser.add_argument("--system", help="system message for chat models")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off (default)")
    parser.add_argument("--stop", action="append", metavar="TEXT", help="stop the reply at this text (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    parser.add_argument("--json-schema", metavar="FILE", help="the reply is JSON valid against this JSON schema "
                        "(structured outputs, compiled against the tokenizer before any weight is read)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file to use instead of "
                                                                "the tokenizer's")
    add_model_arguments(parser)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]: the GPU path, Triton kernels "
                                                        "(use --dtype bfloat16 there)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                        help="on a GPU, the fraction of its memory the weights and the KV cache may take (default 0.9)")
    parser.add_argument("--image", action="append", metavar="PATH",
                        help="an image for a multimodal model (repeat for several); its image token goes before "
                             "the prompt unless the prompt holds it")
    add_parallel_arguments(parser, "rank 0 prints")


def add_parallel_arguments(parser: argparse.ArgumentParser, rank0: str) -> None:
    """--tensor-parallel-size and --pipeline-parallel-size, shared by zoo run and zoo serve (`rank0`: what rank 0
    does under torchrun)."""
    parser.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                        help=f"split the model over N ranks (spawned here, gloo on the CPU; default 1, or under "
                             f"torchrun its WORLD_SIZE: {rank0}, the other ranks serve its steps)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                        help="split the decoder layers into N contiguous stages, one process each (spawned here, or "
                             "under torchrun its N ranks), each reading only its layers' tensors (default 1); with "
                             "--tensor-parallel-size T, T ranks a stage (N x T processes)")


def parallel_sizes(args, command: str = "zoo run") -> int | None:
    """Check --tensor-parallel-size / --pipeline-parallel-size against the launcher (torchrun's RANK / WORLD_SIZE),
    and default the tensor-parallel size (torchrun's WORLD_SIZE when no pipeline is asked for, else 1). Returns None
    for rank 0 (or one process) to go on, or the exit status: a launched rank > 0 served rank 0's steps until it
    closed, or a size was refused (said)."""
    from zoo.runtime.distributed import TensorParallelError, launched

    try:
        env = launched()  # torchrun: RANK / WORLD_SIZE (and MASTER_ADDR / MASTER_PORT) in the environment
    except TensorParallelError as e:
        return _fail(str(e), 2, command)
    if args.pipeline_parallel_size < 1:
        return _fail(f"--pipeline-parallel-size {args.pipeline_parallel_size}: expected 1 or more", 2, command)
    if env is not None and env[0] > 0:  # this rank serves rank 0's steps; rank 0 says everything
        from zoo.runtime.distributed import run_worker
        from zoo.runtime.model_files import resolve_model
        from zoo.runtime.pipeline import run_stage

        import torch

        path, dtype = resolve_model(args.model).path, getattr(torch, args.dtype or "float32")
        return run_stage(path, dtype=dtype, tp=args.tensor_parallel_size or 1) if args.pipeline_parallel_size > 1 \
            else run_worker(path, dtype=dtype)
    if args.tensor_parallel_size is None:
        args.tensor_parallel_size = env[1] if env is not None and args.pipeline_parallel_size == 1 else 1
    if args.tensor_parallel_size < 1:
        return _fail(f"--tensor-parallel-size {args.tensor_parallel_size}: expected 1 or more", 2, command)
    return None


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of where a model comes from, shared by zoo run and zoo serve (vLLM's names and meanings)."""
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="weights dtype (default: a GGUF file runs with its blocks kept quantized, anything "
                             "else in float32; a dtype given dequantizes a GGUF to it)")
    parser.add_argument("--tokenizer", metavar="PATH_OR_ID", help="a tokenizer directory, .gguf file or hub id to "
                                                                  "use instead of the model's (its chat template too)")
    parser.add_argument("--revision", metavar="REV", help="the hub id's branch, tag or commit (default: main); "
                                                          "resolved through huggingface_hub, offline from its cache")


class Refused(Exception):
    """A check that needs no weights failed (LLM(check=...)): one line, exit status 2, nothing loaded."""


class Progress:
    """An elapsed-time line on stderr while something slow runs (redrawn on a terminal, once otherwise)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.msg, self.t0, self._stop = "", time.perf_counter(), threading.Event()
        self._thread = None

    def __call__(self, msg: str) -> None:
        self.msg = msg
        if not self.tty:
            print(f"zoo: {msg} ...", file=self.stream, flush=True)
        elif self._thread is None:
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()

    def _spin(self) -> None:
        frames = "|/-\\"
        i = 0
        while not self._stop.wait(0.1):
            elapsed = time.perf_counter() - self.t0
            self.stream.write(f"\r\033[K{frames[i % 4]} {self.msg} ({elapsed:.1f}s)")
            self.stream.flush()
            i += 1

    def done(self, msg: str) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.stream.write("\r\033[K")
        print(f"zoo: {msg}", file=self.stream, flush=True)


def run(args) -> int:
    from zoo.runtime.sampling_params import SamplingParams

    done = parallel_sizes(args)
    if done is not None:  # a launched rank > 0 that served its steps, or a size refused
        return done

    structured = None
    if args.json_schema is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                structured = {"json": f.read()}
        except (OSError, UnicodeDecodeError) as e:
            return _fail(f"--json-schema {args.json_schema}: {getattr(e, 'strerror', None) or e}", 2)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty, stop=args.stop or [],
                                ignore_eos=args.ignore_eos, structured_outputs=structured)
    except ValueError as e:
        if structured is not None and "structured_outputs" in str(e):
            return _fail(f"--json-schema {args.json_schema}: {str(e).split(': ', 1)[-1]}", 2)
        return _fail(f"bad option: {e}", 2)
    if args.max_model_len is not None and args.max_model_len < 2:
        return _fail(f"bad option: --max-model-len={args.max_model_len}: must be >= 2", 2)
    template = None
    if args.chat_template is not None:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            return _fail(f"--chat-template {args.chat_template}: {getattr(e, 'strerror', None) or e}", 2)
    from zoo.runtime.llm import check_device

    try:
        check_device(args.device)
    except ValueError as e:
        return _fail(f"--device {args.device}: {str(e).split(': ', 1)[-1]}", 2)
    if not 0 < args.gpu_memory_utilization <= 1:
        return _fail(f"--gpu-memory-utilization {args.gpu_memory_utilization}: expected a fraction in (0, 1]", 2)
    # one prompt (--prompt, or stdin that is not a terminal; None: interactive), read before anything loads
    prompt = args.prompt if args.prompt is not None or sys.stdin.isatty() else sys.stdin.read()
    if prompt is not None and not prompt.strip():
        return _fail("the prompt is empty" + (" (stdin gave nothing)" if args.prompt is None else ""), 2)
    llm = _load(args, max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=args.pipeline_parallel_size,
                check=lambda llm: _before_weights(llm, args, template, prompt, params), device=args.device,
                gpu_memory_utilization=args.gpu_memory_utilization)
    if isinstance(llm, int):
        return llm
    from zoo.runtime.distributed import TensorParallelError

    try:
        return _run_loaded(llm, args, params, prompt)
    except TensorParallelError as e:  # a rank died or a collective failed mid-generation
        sys.stdout.write("\n")
        return _fail(str(e), 1)
    finally:
        llm.close()


def _before_weights(llm, args, template: str | None, prompt: str | None, params=None) -> None:
    """What zoo run needs that no weight decides, checked before the weights are read: a tokenizer, a chat
    template for --chat, a model that takes images for --image, a --json-schema that compiles against the
    tokenizer, a prompt the template renders and the model can embed every token of (another model's --tokenizer
    may give ids past its vocabulary)."""
    tok = llm.tokenizer
    if tok is None:
        raise Refused(f"{llm.files.name} has no tokenizer files; zoo run needs one (or give --tokenizer)")
    if template is not None:
        tok.chat_template = template
    if args.chat and not getattr(tok, "chat_template", None):
        raise Refused(f"--chat: the tokenizer of {llm.files.name} has no chat template (give --chat-template)")
    if args.image and llm.spec.family != "multimodal":
        raise Refused(f"--image: {llm.files.name} ({llm.spec.architectures[0]}) takes no images")
    if args.image and prompt is None:
        raise Refused("--image needs --prompt (or a prompt on stdin)")
    _check_max_model_len(llm, args)
    if params is not None and params.structured_outputs is not None:
        from zoo.runtime.engine import vocab_size
        from zoo.runtime.structured import Grammars

        try:
            Grammars(tok, vocab_size(llm.config)).compile(params.structured_outputs)
        except ValueError as e:
            raise Refused(f"--json-schema {args.json_schema}: {str(e).split(': ', 1)[-1]}") from None
    if prompt is not None and not args.image:  # (the image tokens are the model's: that prompt is encoded after)
        _encode(llm, prompt, *_conversation(llm, args))


def _check_max_model_len(llm, args) -> None:
    """--max-model-len against a model's learned positions, named as the flag (zoo run and zoo serve; the LLM checks
    it too, naming its keyword)."""
    from zoo.runtime.llm import check_max_model_len

    try:
        check_max_model_len(args.max_model_len, llm.spec, llm.config)
    except ValueError as e:
        raise Refused(f"--max-model-len={args.max_model_len}: {str(e).split(': ', 1)[-1]}") from None


def _conversation(llm, args) -> tuple[bool, list[dict]]:
    """(chat mode, the history a conversation starts from: the system message, if any)."""
    chat = bool(getattr(llm.tokenizer, "chat_template", None)) if args.chat is None else args.chat
    return chat, [{"role": "system", "content": args.system}] if (chat and args.system) else []


def _run_loaded(llm, args, params, prompt: str | None) -> int:
    chat, history = _conversation(llm, args)
    if prompt is not None:
        try:
            prompt = _with_images(llm, prompt, args.image)
            ids = _fit(llm, prompt, chat, history)
            request = {"prompt_token_ids": ids, "multi_modal_data": {"image": args.image}} if args.image else ids
            return 1 if _generate(llm, request, params) is None else 0
        except (PromptTooLong, ValueError) as e:  # (ValueError: a token id the model lacks, a broken template,
            return _fail(str(e), 2)                # an image that cannot be decoded)
    if args.image:
        return _fail("--image needs --prompt (or a prompt on stdin)", 2)
    return _interactive(llm, chat, history, params)


HELP = """commands:
  /reset   forget the conversation (the system message stays)
  /help    this list
  /exit    quit (or Ctrl-D, or Ctrl-C twice at an empty prompt)
Ctrl-C during a reply stops it; up / down arrows recall earlier prompts."""


def _interactive(llm, chat: bool, history: list[dict], params) -> int:
    """The terminal chat: readline line editing and history, Ctrl-C stops a reply, /reset /help /exit."""
    try:
        import readline  # noqa: F401 - input() gets line editing and history
    except ImportError:
        pass
    system = list(history)
    print(f"zoo: chatting with {llm.files.name} ({'chat' if chat else 'completion'} mode); "
          f"/help for commands, Ctrl-D or /exit to quit", file=sys.stderr)
    interrupted = False  # the last thing was a Ctrl-C: another one at an empty prompt quits
    while True:
        try:
            prompt = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            if interrupted:
                print(file=sys.stderr)
                return 0
            interrupted = True
            print("\nzoo: Ctrl-C again, Ctrl-D or /exit to quit", file=sys.stderr)
            continue
        interrupted = False
        command = prompt.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return 0
        if command == "/help":
            print(HELP, file=sys.stderr)
            continue
        if command == "/reset":
            history[:] = system
            print("zoo: conversation reset", file=sys.stderr)
            continue
        if command.startswith("/") and " " not in command:
            print(f"zoo: unknown command {command}; /help lists them", file=sys.stderr)
            continue
        try:
            ids = _fit(llm, prompt, chat, history)
            reply = _generate(llm, ids, params)
        except PromptTooLong as e:
            print(f"zoo run: error: {e}; try a shorter one", file=sys.stderr)
            continue
        except ValueError as e:
            print(f"zoo run: error: {e}", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # the reply stops (its request aborted, blocks freed); the turn is not kept
            print("\nzoo: interrupted", file=sys.stderr, flush=True)
            interrupted = True
            continue
        if reply is None:
            return 1
        if chat:
            history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]


def _with_images(llm, prompt: str, images: list[str] | None) -> str:
    """The prompt with the model's image token for each image in front, unless it holds them already."""
    if not images:
        return prompt
    mm = llm.engine.mm
    if mm is None:
        raise ValueError(f"--image: {llm.files.name} takes no images")
    token = llm.tokenizer.convert_ids_to_tokens(mm.image_token_id)
    return prompt if token in prompt else " ".join([token] * len(images) + [prompt])


class PromptTooLong(ValueError):
    """The prompt (with the system message) does not fit the model's max_model_len on its own."""


def _fit(llm, prompt: str, chat: bool, history: list[dict]) -> list[int]:
    """Token ids for the next turn. In chat mode, the oldest turns of `history` (after any system message)
    are dropped, in place, until the prompt leaves room to generate within max_model_len."""
    limit = llm.engine.max_model_len  # a prompt must be shorter than this (one token at least to generate)
    first = 1 if history and history[0]["role"] == "system" else 0
    dropped = 0
    while True:
        ids = _encode(llm, prompt, chat, history)
        if len(ids) < limit or len(history) <= first:  # (completion mode keeps no history)
            break
        del history[first:first + 2]  # the oldest user / assistant turn
        dropped += 1
    if dropped:
        print(f"zoo: dropped the {dropped} oldest turn{'s' * (dropped != 1)} of the conversation to fit "
              f"max_model_len={limit}", file=sys.stderr)
    if len(ids) >= limit:
        raise PromptTooLong(f"the prompt is {len(ids)} tokens; {llm.files.name} takes at most {limit - 1} "
                            f"(max_model_len={limit})")
    return ids


def _encode(llm, prompt: str, chat: bool, history: list[dict]) -> list[int]:
    """Token ids of the next turn (with `history` in chat mode); a ValueError for none, or for an id past the
    model's vocabulary (a tokenizer larger than the model). Needs no weight: also checked before they load."""
    from zoo.runtime.engine import token_ids, vocab_size

    ids = llm.apply_chat_template(history + [{"role": "user", "content": prompt}]) if chat \
        else llm.tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    return token_ids(ids, vocab_size(llm.config), "the prompt")


def _load(args, command: str = "zoo run", **engine):
    """The LLM of args.model (args.dtype; `engine`: more LLM keywords), or the exit status after saying why."""
    from loader import LoadError
    from registry import RegistryError, UnsupportedArchitecture
    from zoo.build import exit_status
    from zoo.default_model import DefaultModelMissing
    from zoo.runtime.llm import LLM
    from zoo.runtime.model_files import ConfigError, ModelNotFound

    from zoo.runtime.distributed import TensorParallelError

    progress = Progress()
    try:
        if not _may_download(args.model):  # (huggingface_hub draws its own progress bars: no spinner over them)
            progress("starting")
        llm = LLM(args.model, dtype=args.dtype, progress=progress, tokenizer=args.tokenizer,  # (a GGUF without
                  revision=args.revision, **engine)                                      # --dtype: kept quantized)
    except (DefaultModelMissing, ModelNotFound, ConfigError, UnsupportedArchitecture, RegistryError, OSError,
            TensorParallelError, Refused, ValueError) as e:  # (ValueError: an option refused, e.g. no KV room)
        progress.done("failed")
        return _fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__, 2, command)
    except LoadError as e:  # a SourceError too: with problems, a strictness finding (1); without, nothing to load (2)
        progress.done("failed")
        if exit_status(e) == 1:
            return _fail(f"the checkpoint does not load strictly:\n{e}", 1, command)
        return _fail(str(e), 2, command)
    kv = llm.engine.kv
    quant = getattr(llm.load_report, "quantized", None)
    kept = f" ({len(quant)} weights kept quantized: {', '.join(sorted({q.split()[0] for q in quant.values()}))})" \
        if quant else ""
    progress.done(f"loaded {llm.files.name}{kept} in {llm.load_seconds:.1f}s; KV pool holds "
                  f"{kv.pool.num_blocks * kv.block_size} tokens ({llm.engine.kv_bytes_per_token} B/token)")
    for t in getattr(llm.load_report, "ties", []):
        if not t.tied:  # the config ties them but the checkpoint holds its own: said, not silent
            print(f"zoo: note: {t}: the config ties them, the model uses the checkpoint's own weights", file=sys.stderr)
    print(f"zoo: {llm.engine.runner.step_path}", file=sys.stderr)
    return llm


def _may_download(model: str | None) -> bool:
    """MODEL is a hub id that huggingface_hub may fetch now (not a local path, HF_HUB_OFFLINE unset)."""
    import os
    from pathlib import Path

    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    return model is not None and not offline and model.count("/") == 1 and not Path(model).expanduser().exists()


def _generate(llm, request: list[int] | dict, params) -> str | None:
    """The reply (streamed to stdout), or None when the model's logits went NaN / infinite (said on stderr)."""
    t0 = time.perf_counter()
    first = None
    text, n, ids, reason = "", 0, request, None
    with contextlib.closing(llm.stream([request], params)) as outs:  # (closed on Ctrl-C: the request aborted)
        for out in outs:
            ids = out.prompt_token_ids
            if first is None:
                first = time.perf_counter()
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            text, n, reason = out.text, len(out.token_ids), out.finish_reason
            if out.finish_reason == "error":
                sys.stdout.write("\n")
                _fail(f"{llm.files.name}: {out.stop_reason}; stopped after {n} tokens", 1)
                return None
    end = time.perf_counter()
    sys.stdout.write("\n")
    sys.stdout.flush()
    ttft = (first or end) - t0
    rate = (n - 1) / (end - first) if first and n > 1 and end > first else 0.0
    print(f"zoo: {n} tokens, {rate:.1f} tok/s, time to first token {ttft * 1000:.0f} ms, prompt {len(ids)} tokens",
          file=sys.stderr, flush=True)
    if reason == "length":
        why = f"--max-tokens={params.max_tokens}" if n >= params.max_tokens else \
            f"the context length (max_model_len={llm.engine.max_model_len})"
        print(f"zoo: note: the reply was cut at {why}", file=sys.stderr, flush=True)
    return text


def _fail(msg: str, code: int, command: str = "zoo run") -> int:
    print(f"{command}: error: {msg}", file=sys.stderr)
    return code
