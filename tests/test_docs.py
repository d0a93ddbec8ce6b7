"""The documentation stays current: README's architecture table names every built-in plugin with its line count
and every architecture it registers."""
from __future__ import annotations

import re
from pathlib import Path

from registry import get_registry

ROOT = Path(__file__).resolve().parent.parent


def test_readme_table_lists_every_builtin_plugin_with_its_line_count():
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `plugins/(\w+)\.py` \|[^|]*\|[^|]*\| (\d+) \|", readme, re.M))
    files = {p.stem for p in (ROOT / "plugins").glob("*.py") if p.stem != "__init__"}
    assert set(rows) == files, (f"README's architecture table lacks {sorted(files - set(rows))} or lists "
                                f"{sorted(set(rows) - files)}; a row reads | `plugins/NAME.py` | family | "
                                f"`Architecture` | lines | what it adds |")
    for name, count in rows.items():
        lines = len((ROOT / "plugins" / f"{name}.py").read_text().splitlines())
        assert int(count) == lines, f"README: plugins/{name}.py has {lines} lines, the table says {count}"
    builtin = {a for a, s in get_registry().specs.items() if s.plugin.startswith("plugins.")}
    listed = set(re.findall(r"`(\w+For\w+|GPT2LMHeadModel)`", readme))
    assert builtin <= listed, f"README's table lacks {sorted(builtin - listed)}"


DOCS = ROOT / "docs" / "plugins.md"
# the modules whose public names are the plugin author's extension points (issue 16)
LAYER_MODULES = ("attention", "embedding", "linear", "mlp", "moe", "norm", "rotary")
HOOK_CLASSES = ("NormHooks", "LlamaAttention", "LlamaDecoderLayer", "ParallelDecoderLayer", "LlamaModel",
                "LlamaForCausalLM")


def documented(text: str, name: str) -> bool:
    """`name` appears inside a code span or a code block of the guide."""
    blocks = re.findall(r"```\w*\n(.*?)```", text, re.S)
    spans = re.findall(r"`([^`]+)`", re.sub(r"```\w*\n.*?```", "", text, flags=re.S))
    return any(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", code) for code in blocks + spans)


def test_every_hook_and_extension_point_is_documented():
    """Like datasette's: docs/plugins.md names every registry hook, every hook of the Llama base classes, every
    public name of the shared layers' extension modules, every weight rule, the parity protocol and the fast
    path's methods; adding one without documenting it fails here."""
    import importlib
    import inspect

    import loader.rules
    import plugins.llama
    import registry.hookspecs
    from zoo.kernels import fused

    text = DOCS.read_text()
    names = [n for n, f in vars(registry.hookspecs).items() if callable(f) and hasattr(f, "zoo_spec")]
    assert names == ["register_architectures"]
    for cls_name in HOOK_CLASSES:
        cls = getattr(plugins.llama, cls_name)
        names += [cls_name] + [n for n in vars(cls) if not n.startswith("_") and n not in ("prefix",)]
    for mod in LAYER_MODULES:
        m = importlib.import_module(f"zoo.layers.{mod}")
        names += [n for n, v in vars(m).items() if not n.startswith("_") and getattr(v, "__module__", m.__name__)
                  == m.__name__ and not inspect.ismodule(v) and (inspect.isclass(v) or inspect.isfunction(v) or n.isupper())]
    names += [n for n, v in vars(loader.rules).items() if inspect.isclass(v) and v.__module__ == "loader.rules"]
    names += ["parity_taps", "parity_output", "load_rules", "learned_positions", "ArchSpec", "ZOO_PLUGINS",
              "override=True"]
    names += [q for f in (fused._FORWARDS, fused._LLAVA_FORWARDS) for qs in f.values() for q in qs]
    names += [q for q, _ in fused._LAYERS]
    missing = sorted({n for n in names if not documented(text, n)})
    assert not missing, f"docs/plugins.md does not document {missing}"


def test_the_guide_states_the_import_rules_the_layout_test_enforces():
    from test_layout import ALLOWED

    text = DOCS.read_text()
    missing = [p for p in ALLOWED["plugins"] if p != "plugins" and not documented(text, p)]
    assert not missing, f"docs/plugins.md section 2 does not name {missing}"
