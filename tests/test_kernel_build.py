"""Without a C++ compiler the native kernels do not build: zoo says so once (a RuntimeWarning naming the compiler),
runs on torch ops, and a kernel entry point called anyway raises a clear RuntimeError, not an attribute of None."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import warnings, torch
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    from zoo import kernels
    print("enabled", kernels.enabled())
print("warned", [str(w.message) for w in seen if w.category is RuntimeWarning])
try:
    kernels.linear(torch.randn(2, 4), torch.randn(3, 4))
except RuntimeError as e:
    print("refused", e)
"""


def test_no_compiler_falls_back_and_entry_points_refuse_by_name(tmp_path):
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "ZOO_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT)}
    env.pop("ZOO_FAST", None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "enabled False" in out.stdout, out.stdout
    assert "no C++ compiler" in out.stdout and "no-such-c++" in out.stdout, out.stdout
    assert "refused zoo native kernels did not build" in out.stdout, out.stdout
