"""Engine dialects: one module per engine wire format.

Each dialect knows only its own format: which endpoints generate, how to ask for usage
and strip it again, how to tap its streams, and how to read counts, timings and errors.
"""

from __future__ import annotations

from .base import Outcome, Prepared, Tap
from .llamacpp import LlamaCppDialect
from .ollama import OllamaDialect
from .openai import OpenAIDialect, VLLMDialect

DIALECTS = {
    "vllm": VLLMDialect,
    "openai": OpenAIDialect,
    "ollama": OllamaDialect,
    "llamacpp": LlamaCppDialect,
}


def get_dialect(name: str):
    """A dialect instance by engine name (``vllm``, ``openai`` ...)."""
    try:
        return DIALECTS[name]()
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(DIALECTS))}") from None


__all__ = ["DIALECTS", "Outcome", "Prepared", "Tap", "get_dialect"]
