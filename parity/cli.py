"""Check that the zoo computes what transformers computes, layer by layer in float32.

    zoo parity MODEL [--prompts FILE] [--scenario NAME ...] [--tol key=value ...] [--json PATH] [--html PATH]
    zoo parity x.gguf [--dtype float32]   (default: the zoo side keeps the GGUF's blocks quantized, as `zoo run`;
                                           --dtype float32 dequantizes it, as the reference always does)
    zoo parity MODEL --dtype bfloat16     (the zoo side as `zoo run --dtype bfloat16` runs on the CPU; the reference
                                           transformers float32 on the same values, its cache rounded as the zoo's)
    zoo parity --tiny CONFIG      (a directory with config.json, or the file: shrunk, random weights)
    zoo parity MODEL --tensor-parallel-size N      (the zoo side over N ranks: the taps every rank holds whole)
    zoo parity MODEL --pipeline-parallel-size N    (the zoo side over N stages: the served scenario)

Exit status: 0 every scenario passes, 1 a divergence (or the zoo's strict loader refuses the checkpoint),
2 a usage or loading error (checked before the run: an output path that cannot be written).
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback
from pathlib import Path

from parity import SCENARIOS
from parity.tolerances import BASE, parse_overrides  # light imports only: `zoo` loads this module for every command


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", help="a local checkpoint directory, a .gguf file or a hub id (cached)")
    parser.add_argument("--tiny", metavar="CONFIG",
                        help="build a shrunken random-weight checkpoint from CONFIG (config.json or its directory) "
                             "and run parity on it")
    parser.add_argument("--keep-tiny", metavar="DIR", help="with --tiny: save the tiny checkpoint in DIR (kept)")
    parser.add_argument("--prompts", metavar="FILE",
                        help="prompts: a text file (one a line) or a .json list of strings or token-id lists")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, metavar="NAME",
                        help=f"run only these scenarios (repeatable): {', '.join(SCENARIOS)}")
    parser.add_argument("--tol", action="append", metavar="KEY=VALUE",
                        help=f"override a tolerance (repeatable); keys: {', '.join(BASE)}")
    parser.add_argument("--json", metavar="PATH", help="write the full machine-readable report")
    parser.add_argument("--html", metavar="PATH", help="write a self-contained HTML report (heatmap, KL distribution)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=4, help="decode scenario: tokens generated (default 4)")
    parser.add_argument("--block-size", type=int, default=4, help="KV block size of the runtime (default 4)")
    parser.add_argument("--chunk-tokens", type=int, default=7, help="chunked scenario: token budget per step")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="float32: a GGUF file dequantized to float32 on the zoo side too (default: its blocks "
                             "kept quantized where `zoo run` keeps them, judged with the quantized tolerances; the "
                             "reference is transformers' dequantized float32 model either way). bfloat16 (a "
                             "safetensors checkpoint, CPU): the zoo side stores its matrices, embeddings and KV caches "
                             "in bfloat16 (float32 math); the reference is transformers float32 on the same values "
                             "(a temporary copy with those tensors rounded when the checkpoint holds them wider), its "
                             "cache reads rounded as the zoo's cache rounds them; judged with the bfloat16 tolerances")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="run the zoo side over N tensor-parallel ranks (spawned, gloo) and compare the taps "
                             "every rank holds whole (layers, norms, attention / MLP outputs, logits)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                        help="run the zoo side over N pipeline stages (spawned, gloo) and compare what the served "
                             "path samples: the logits the last stage sends back and the greedy tokens (the served "
                             "scenario only: the other scenarios tap modules that other stages hold); with "
                             "--tensor-parallel-size T, T ranks a stage")
    parser.add_argument("--no-replay", action="store_true", help="skip the per-layer replay (localisation)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--image", action="append", metavar="PATH",
                        help="a multimodal model: also compare the vision layers, projector, merged embeddings and "
                             "logits of a prompt with these images, and run its image scenarios through the runtime "
                             "(an image split across prefill chunks, a prefix hit inside the same image; "
                             "repeatable; parity.multimodal)")
    parser.add_argument("--image-prompt", metavar="TEXT",
                        help="with --image: the prompt, text or a JSON list of token ids holding one image token per "
                             "image (default: each image's tokens, inside the vision start / end tokens where the "
                             "model has them, then 'Describe the image.')")


def unwritable(path: str) -> str | None:
    """Why `path` cannot be written as a new or replaced file, or None when it can."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        return "is a directory"
    if not parent.is_dir():
        return f"its directory {parent} does not exist"
    if p.exists() and not os.access(p, os.W_OK):
        return "is not writable"
    if not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
        return f"its directory {parent} is not writable"
    return None


def image_prompt_arg(text: str | None) -> str | list[int] | None:
    """--image-prompt: a JSON list of token ids (a checkpoint without a tokenizer: `--tiny`) or text."""
    import json

    from parity.harness import ParityUsageError

    if text is None or not text.lstrip().startswith("["):
        return text
    try:
        ids = json.loads(text)
    except json.JSONDecodeError:
        return text
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ParityUsageError(f"--image-prompt {text[:60]}: a JSON list must hold token ids (integers >= 0)")
    return ids


def _images(args, model, image_prompt, overrides, dtype, say, result):
    """Image parity (--image) beside the text scenarios' `result`: an ImageParity, or the exit status 1 when it
    crashed outside its scenarios (said in one line after the text summary)."""
    from parity.harness import ParityUsageError
    from parity.multimodal import ImageUsageError, image_parity
    from parity.report import format_summary

    say(f"image parity: {len(args.image)} image(s)")
    try:
        return image_parity(model, image_prompt, args.image, tol_overrides=overrides, block_size=args.block_size,
                            chunk_tokens=args.chunk_tokens, max_new_tokens=args.max_new_tokens, dtype=dtype,
                            tensor_parallel_size=args.tensor_parallel_size)
    except ImageUsageError as e:  # the prompt and images, found before anything is compared
        raise ParityUsageError(str(e)) from None
    except Exception as e:  # a crash of either side outside the scenarios: a finding, in one line
        where = traceback.extract_tb(e.__traceback__)[-1]
        print(format_summary(result))
        print(f"image parity crashed: {type(e).__name__}: {e} (at {where.filename}:{where.lineno} in "
              f"{where.name})\n\nDIVERGES: image parity")
        return 1


def run(args) -> int:
    from parity.harness import ParityUsageError, ZooLoadFailure, check_parallel, run_parity
    from parity.html import write_html
    from parity.report import format_summary, write_json

    if bool(args.model) == bool(args.tiny):
        print("zoo parity: give MODEL or --tiny CONFIG (one of them)", file=sys.stderr)
        return 2
    try:
        overrides = parse_overrides(args.tol)
    except ValueError as e:
        print(f"zoo parity: {e}", file=sys.stderr)
        return 2
    for flag, path in (("--json", args.json), ("--html", args.html)):
        why = unwritable(path) if path else None
        if why:
            print(f"zoo parity: {flag} {path}: {why}", file=sys.stderr)
            return 2
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "block_size", "max_new_tokens", "chunk_tokens"):
        value = getattr(args, name)
        if value < 1:  # (each scenario would crash on it and read as a divergence)
            print(f"zoo parity: --{name.replace('_', '-')} {value}: expected 1 or more", file=sys.stderr)
            return 2
    try:
        check_parallel(args.tensor_parallel_size, args.pipeline_parallel_size, args.scenario)
    except ParityUsageError as e:
        print(f"zoo parity: {e}", file=sys.stderr)
        return 2
    if args.image and args.pipeline_parallel_size > 1:
        print(f"zoo parity: --image with --pipeline-parallel-size {args.pipeline_parallel_size}: image parity taps "
              f"the vision tower and the text layers, which stages after the first hold in their own processes; "
              f"not done over a pipeline (drop one of them)", file=sys.stderr)
        return 2
    import torch

    dtype = getattr(torch, args.dtype or "float32")
    say = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    tmp, notes = None, []
    try:
        model = args.model
        if args.tiny:
            from parity.tiny import save_tiny_checkpoint

            if args.keep_tiny:
                out = args.keep_tiny
            else:
                tmp = tempfile.TemporaryDirectory(prefix="zoo-parity-tiny-")
                out = tmp.name
            say(f"building a tiny random-weight checkpoint from {args.tiny} in {out}")
            try:
                model = str(save_tiny_checkpoint(args.tiny, out, seed=args.seed, notes=notes))
            except (OSError, ValueError, TypeError) as e:
                raise ParityUsageError(f"--tiny {args.tiny}: {type(e).__name__}: {e}") from e
            for note in notes:
                say(note)
        image_prompt = None
        if args.image or args.image_prompt is not None:  # checked before any weight is read
            from parity.multimodal import ImageUsageError, check_image_args

            image_prompt = image_prompt_arg(args.image_prompt)
            try:
                check_image_args(model, args.image or [], image_prompt)
            except ImageUsageError as e:
                raise ParityUsageError(str(e)) from None
        from zoo.runtime.distributed import shared_workers

        workers = shared_workers() if args.tensor_parallel_size > 1 == args.pipeline_parallel_size \
            else contextlib.nullcontext()
        with workers:  # (tensor parallel: the text and image parity share one spawn of the workers)
            result = run_parity(model, prompts_file=args.prompts, scenarios=tuple(args.scenario or ()) or None,
                                tol_overrides=overrides, seed=args.seed, max_new_tokens=args.max_new_tokens,
                                block_size=args.block_size, chunk_tokens=args.chunk_tokens, device=args.device,
                                replay=not args.no_replay, tensor_parallel_size=args.tensor_parallel_size,
                                quantized=False if args.dtype == "float32" else None, dtype=dtype, progress=say,
                                pipeline_parallel_size=args.pipeline_parallel_size)
            result.inputs["notes"] = notes + result.inputs.get("notes", [])  # (--tiny's: what it inferred)
            images = None
            if args.image:
                images = _images(args, model, image_prompt, overrides, dtype, say, result)
                if isinstance(images, int):
                    return images
    except ParityUsageError as e:
        print(f"zoo parity: {e}", file=sys.stderr)
        return 2
    except ZooLoadFailure as e:  # a finding: the checkpoint's content fails the strict loader
        print(f"zoo parity: {e.model}: the zoo's strict loader refuses the checkpoint:\n{e.error}\n\n"
              f"DIVERGES: the zoo model does not load (no scenario ran)")
        return 1
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(format_summary(result))
    if images is not None:
        from parity.multimodal import format_image_parity

        print(format_image_parity(images))
    if args.json:
        write_json(result, args.json, images=images)
        say(f"wrote {args.json}")
    if args.html:
        write_html(result, args.html)
        say(f"wrote {args.html}")
    return 0 if result.passed and (images is None or images.passed) else 1
