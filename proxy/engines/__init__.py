"""Engines: one module per engine, each holding everything about it.

``openai`` (any OpenAI-compatible server), ``vllm``, ``ollama`` and ``llamacpp``
(llama-server). Adding an engine means adding one module with a dialect class (see
:class:`~proxy.engines.base.Dialect`) and naming it in :data:`ENGINES` and, if it can be
recognised, in :data:`DETECTION_ORDER`. The bench asks the registry, not an engine by
name: :func:`find_tokenizer`, :func:`listed_context`, :func:`served_file`.
"""

from __future__ import annotations

import httpx

from .base import (
    Dialect,
    EngineHistogram,
    EngineReading,
    EngineState,
    ModelList,
    ModelQuery,
    Outcome,
    Prepared,
    Tap,
    Tokenizer,
)
from .llamacpp import LlamaCppDialect
from .ollama import OllamaDialect
from .openai import OpenAIDialect
from .probe import Prober
from .vllm import VLLMDialect

ENGINES: dict[str, type[OpenAIDialect]] = {
    "vllm": VLLMDialect,
    "openai": OpenAIDialect,
    "ollama": OllamaDialect,
    "llamacpp": LlamaCppDialect,
}

#: The order engines are tried in: the most specific signs first, the generic OpenAI
#: server (anything listing /v1/models) last.
DETECTION_ORDER: tuple[type[OpenAIDialect], ...] = (
    OllamaDialect,
    LlamaCppDialect,
    VLLMDialect,
    OpenAIDialect,
)

#: Every engine's model-management paths: a request is checked against all of them, since
#: the engine behind an upstream may not be detected yet.
ADMIN_PATHS: frozenset[str] = frozenset(p for e in ENGINES.values() for p in e.admin_paths)


def is_admin_path(path: str) -> bool:
    """Whether `path` is (or lies under) an engine's model-management path."""
    if path in ADMIN_PATHS:
        return True
    return any(path.startswith(p + "/") for p in ADMIN_PATHS)


def get_dialect(name: str) -> Dialect:
    """A dialect instance by engine name (``vllm``, ``openai`` ...)."""
    try:
        return ENGINES[name]()
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None


async def detect_engine(client: httpx.AsyncClient) -> str | None:
    """The engine behind `client`, or None when the upstream does not answer."""
    probe = Prober(client)
    try:
        for engine in DETECTION_ORDER:
            if await engine.detect(probe):
                return engine.name
    except httpx.HTTPError:
        return None
    return None


async def find_tokenizer(client: httpx.AsyncClient, model: str) -> tuple[str, Tokenizer] | None:
    """The first engine, in :data:`ENGINES` order, whose tokenizer answers behind `client`
    for `model`, with that tokenizer (each engine probes its own endpoint, so a proxy that
    passes the engine's tokenizer through is no obstacle); None when none does."""
    for name, engine in ENGINES.items():
        tokenizer = await engine().tokenizer(client, model)
        if tokenizer is not None:
            return name, tokenizer
    return None


def listed_context(entry: dict) -> int | None:
    """The context length a ``/v1/models`` entry states, as the first engine (in
    :data:`ENGINES` order) that states one there reads it."""
    for engine in ENGINES.values():
        value = engine().listed_context(entry)
        if value is not None:
            return value
    return None


async def served_file(client: httpx.AsyncClient) -> str | None:
    """The file the engine behind `client` serves its one model from, as the first engine
    (in :data:`ENGINES` order) that names one says."""
    for engine in ENGINES.values():
        path = await engine().served_file(client)
        if path is not None:
            return path
    return None


__all__ = [
    "ADMIN_PATHS",
    "DETECTION_ORDER",
    "ENGINES",
    "Dialect",
    "EngineHistogram",
    "EngineReading",
    "EngineState",
    "ModelList",
    "ModelQuery",
    "Outcome",
    "Prepared",
    "Tap",
    "Tokenizer",
    "detect_engine",
    "find_tokenizer",
    "get_dialect",
    "is_admin_path",
    "listed_context",
    "served_file",
]
