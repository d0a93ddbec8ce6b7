"""templates/zoo-plugin is a real plugin package: pip builds and installs it (into a scratch directory, with no
dependencies fetched), the zoo finds it through its entry point, and its own test passes."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "templates" / "zoo-plugin"


def test_the_template_installs_and_its_test_passes(tmp_path):
    target, source = tmp_path / "site", tmp_path / "zoo-plugin"  # built from a copy: the tree stays clean
    shutil.copytree(TEMPLATE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(target), str(source)], capture_output=True, text=True,
                         cwd=tmp_path)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert (target / "zoo_plugin_template" / "__init__.py").exists()
    assert list(target.glob("zoo_plugin_template-*.dist-info/entry_points.txt"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)]), "HF_HUB_OFFLINE": "1",
           "ZOO_PLUGINS": "template"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(source / "tests")],
                         capture_output=True, text=True, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout
