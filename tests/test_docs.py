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
