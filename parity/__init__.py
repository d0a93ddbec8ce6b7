"""parity: does the zoo compute what transformers computes? Taps, alignment, metrics, localisation, reports.

    from parity.harness import run_parity          # the Python API
    zoo parity MODEL | --tiny CONFIG                # the command line (parity/cli.py)

Modules: taps (what is captured, the plugin protocol), reference (transformers side), zoo_side (the
runtime side), align (both into one layout), metrics, compare, localize, tolerances, harness
(scenarios), report (terminal, JSON), html, tiny (config shrinker).
"""

SCENARIOS = ("prefill", "decode", "mixed", "chunked", "prefix", "packing", "served")
