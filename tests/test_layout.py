"""docs/design.md's import direction, checked on the source: each package imports only what it may."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = {"loader", "registry", "zoo", "plugins", "parity"}
# package -> module prefixes of ours it may import (a prefix covers its submodules)
ALLOWED = {
    "loader": ("loader",),
    "registry": ("registry", "loader.rules"),
    "zoo": ("zoo", "registry", "loader"),
    "plugins": ("plugins", "zoo.layers", "zoo.runtime.batch", "registry", "loader.rules"),
    "parity": tuple(OURS),
}
# loader is for other engines too: it may need nothing beyond these
LOADER_THIRD_PARTY = {"torch", "safetensors", "huggingface_hub", "numpy", "gguf"}


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from zoo import kernels` imports zoo.kernels
            top = node.module.split(".")[0]
            if node.module == top and top in OURS:
                yield from (f"{top}.{a.name}" for a in node.names)
            else:
                yield node.module


def allowed(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_import_direction():
    bad = []
    for pkg, prefixes in ALLOWED.items():
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for mod in imports(f):
                top = mod.split(".")[0]
                if top in OURS and not allowed(mod, prefixes):
                    bad.append(f"{f.relative_to(ROOT)} imports {mod}")
                if pkg == "loader" and top not in OURS | LOADER_THIRD_PARTY and top not in sys.stdlib_module_names:
                    bad.append(f"{f.relative_to(ROOT)} imports third-party {mod}")
    assert not bad, "\n".join(bad)


def test_packages_exist():
    for pkg in ALLOWED:
        assert (ROOT / pkg / "__init__.py").exists(), pkg
