"""No false positive on any registered architecture: each passes parity unmutated, twice, identically, on its
tiny checkpoint from tests/tiny_configs.py (every constant randomised), and an architecture registered without
a tiny config fails here."""
from __future__ import annotations

import math

import pytest

from parity import SCENARIOS
from parity.harness import run_parity
from parity.report import to_json
from registry import get_registry
from tiny_configs import TINY_CONFIGS, save_arch

# True findings the harness makes on a registered architecture (a zoo bug to fix, not the harness's): the scenario
# must fail in that tap; when it is fixed this test says so and the entry goes.
KNOWN_FINDINGS: dict[tuple[str, str], tuple[str, str]] = {}

REGISTERED = sorted(a for a, s in get_registry().specs.items() if not s.plugin.startswith("mutant-"))


def test_every_registered_architecture_has_a_tiny_config():
    missing = sorted(set(REGISTERED) - set(TINY_CONFIGS))
    assert not missing, f"add a tiny parity config to tests/tiny_configs.py for {missing}"


def _stable(doc):
    """The report without what differs between two identical runs (timings, the load report's among them)."""
    if isinstance(doc, dict):
        return {k: _stable(v) for k, v in doc.items() if k not in ("seconds", "load_report")}
    if isinstance(doc, list):
        return [_stable(v) for v in doc]
    if isinstance(doc, float) and math.isnan(doc):
        return "nan"  # nan != nan: compare its spelling
    return doc


@pytest.mark.parametrize("arch", [a for a in REGISTERED if a in TINY_CONFIGS])
def test_registered_architecture_passes_twice_identically(arch, tmp_path):
    path = save_arch(arch, tmp_path)
    first, second = run_parity(path), run_parity(path)
    for name, s in first.scenarios.items():
        if (arch, name) in KNOWN_FINDINGS:
            tap, why = KNOWN_FINDINGS[arch, name]
            assert not s.passed, f"{arch} {name} passes now: remove its KNOWN_FINDINGS entry ({why})"
            assert s.first_divergence["tap"] == tap, s.first_divergence
            continue
        assert s.passed, f"{arch} {name}: {s.failures} first divergence {s.first_divergence}"
        assert s.comparison.compared and any(c.any() for c in s.comparison.compared), f"{arch} {name}: nothing compared"
    assert list(first.scenarios) == list(SCENARIOS)
    assert first.scenarios["prefill"].info["steps"] == 1
    assert first.scenarios["chunked"].info["steps"] > 1
    assert first.scenarios["prefix"].info["cached_tokens"] > 0
    prefill = first.scenarios["prefill"].comparison
    assert not prefill.missing, f"{arch}: taps the zoo did not produce: {prefill.missing}"
    if get_registry().specs[arch].family in ("moe", "mla"):
        routers = [t for t in prefill.taps if t.role == "router"]
        assert routers and all(t.experts is not None for t in routers), f"{arch}: router taps without experts"
    assert _stable(to_json(first)) == _stable(to_json(second)), f"{arch}: two runs of parity differ"
