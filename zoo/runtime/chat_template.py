"""A model's chat template, rendered with a time bound: a template is code from the checkpoint (untrusted).

transformers renders it in jinja2's ImmutableSandboxedEnvironment (no attribute tricks, ranges capped at 100,000),
but a sandboxed template can still loop for ever (nested loops, recursive macros). While it renders, a trace
function watches the template's own frames (jinja2 compiles a template to Python code whose file is "<template>")
and every Python call, and stops the render once `seconds` have passed. Costs nothing measurable on a real
template (SmolLM2's renders in well under a millisecond either way).
Not bounded: a single C-level operation the sandbox lets through (`"x" * 10**9` folded at compile time).
"""
from __future__ import annotations

import sys
import time

SECONDS = 2.0  # a real template renders in milliseconds


class TemplateTimeout(Exception):
    pass


def apply_chat_template(tokenizer, messages: list[dict], *, seconds: float = SECONDS, name: str = "the model",
                        tools: list[dict] | None = None) -> list[int]:
    """Token ids of a chat with the generation prompt appended (`tools`: OpenAI's, rendered by the template);
    ValueError naming the template's fault."""
    deadline = time.monotonic() + seconds

    def check(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTimeout
        return check if frame.f_code.co_filename == "<template>" else None  # line events of template code only

    previous = sys.gettrace()
    sys.settrace(check)
    try:
        kw = {"tools": tools} if tools else {}
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    except TemplateTimeout:
        raise ValueError(f"the chat template of {name} did not finish rendering within {seconds:g} s "
                         f"(a template that loops?); use --no-chat") from None
    except RecursionError:
        raise ValueError(f"the chat template of {name} recurses without end; use --no-chat") from None
    except Exception as e:  # jinja2's TemplateError (syntax, raise_exception), or a TypeError inside the template
        if not type(e).__module__.startswith("jinja2") and "<template>" not in _files(e):
            raise
        line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"the chat template of {name} fails: {type(e).__name__}: {line}; use --no-chat") from None
    finally:
        sys.settrace(previous)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _files(e: BaseException) -> set[str]:
    tb, out = e.__traceback__, set()
    while tb is not None:
        out.add(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return out
