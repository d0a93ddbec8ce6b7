"""zoo: a plugin-based LLM model zoo. `from zoo import LLM, SamplingParams` (imported lazily)."""

_LAZY = {
    "LLM": "zoo.runtime.llm",
    "LLMEngine": "zoo.runtime.engine",
    "RequestOutput": "zoo.runtime.engine",
    "SamplingParams": "zoo.runtime.sampling_params",
    "StructuredOutputsParams": "zoo.runtime.structured",
    "GuidedDecodingParams": "zoo.runtime.structured",
}
__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")
