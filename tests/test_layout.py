"""DESIGN.md's import direction, checked on the source: each package imports only what it may."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = {"loader", "registry", "zoo", "plugins", "parity"}
ALLOWED = {
    "loader": {"loader"},
    "registry": {"registry", "loader"},
    "zoo": {"zoo", "registry", "loader"},
    "plugins": {"plugins", "zoo", "registry", "loader"},
    "parity": OURS,
}
THIRD_PARTY_ALLOWED = {"loader": {"torch", "safetensors", "huggingface_hub", "numpy", "gguf"}}
STDLIB = __import__("sys").stdlib_module_names


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def test_import_direction():
    bad = []
    for pkg, allowed in ALLOWED.items():
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for mod in imports(f):
                if mod in OURS and mod not in allowed:
                    bad.append(f"{f.relative_to(ROOT)} imports {mod}")
                third = THIRD_PARTY_ALLOWED.get(pkg)
                if third is not None and mod not in OURS and mod not in STDLIB and mod not in third:
                    bad.append(f"{f.relative_to(ROOT)} imports third-party {mod}")
    assert not bad, "\n".join(bad)


def test_packages_exist():
    for pkg in ALLOWED:
        assert (ROOT / pkg / "__init__.py").exists(), pkg
