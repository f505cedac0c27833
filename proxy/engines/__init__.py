"""Engines: one module per engine, each holding everything about it.

``openai`` (any OpenAI-compatible server), ``vllm``, ``ollama``, ``llamacpp``
(llama-server), ``sglang`` and ``trtllm`` (TensorRT-LLM's ``trtllm-serve``). The core (and
everything above it) reaches an engine only through the
:class:`~proxy.engines.base.Dialect` protocol and this registry, never by its name: what
is particular to an engine (its measured endpoints and how their answers read, its own
API's path prefix and error shape, how its model lists merge, its health and
model-management paths, how it is recognised, its own gauges) is a member of its dialect.

Adding an engine is one module here plus one line in :data:`ENGINES` (and one in
:data:`DETECTION_ORDER` if it can be recognised). :mod:`.sglang` is one to read: a
subclass of ``OpenAIDialect`` whose ``endpoints`` add ``"/generate": "sglang_generate"``, with a
``prepare`` / ``tap`` / ``outcome`` for that native stream (the counts in ``meta_info``),
``detect`` on ``GET /model_info``, and ``read_state`` reading its ``/metrics`` gauges
through the shared Prometheus parser in :mod:`proxy.engines.prometheus`. The ``--engine``
flag, admin paths, model listings and routing pick it up from here. The bench asks the
registry, not an engine by name: :func:`find_tokenizer`, :func:`listed_context`,
:func:`served_file`.
"""

from __future__ import annotations

import httpx

from .base import (
    Dialect,
    EngineHistogram,
    EngineReading,
    EngineState,
    Listing,
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
from .sglang import SGLangDialect
from .trtllm import TRTLLMDialect
from .vllm import VLLMDialect

ENGINES: dict[str, type[Dialect]] = {
    "vllm": VLLMDialect,
    "openai": OpenAIDialect,
    "ollama": OllamaDialect,
    "llamacpp": LlamaCppDialect,
    "sglang": SGLangDialect,
    "trtllm": TRTLLMDialect,
}

#: The engine an upstream is read as until its engine is known (detected or named).
GENERIC: str = OpenAIDialect.name

#: The order engines are tried in: the most specific signs first, the generic OpenAI
#: server (anything listing /v1/models) last.
DETECTION_ORDER: tuple[type[Dialect], ...] = (
    OllamaDialect,
    LlamaCppDialect,
    SGLangDialect,
    TRTLLMDialect,  # before vLLM: it answers GET /version too
    VLLMDialect,
    OpenAIDialect,
)

#: Every engine's model-management paths: a request is checked against all of them, since
#: the engine behind an upstream may not be detected yet.
ADMIN_PATHS: frozenset[str] = frozenset(p for e in ENGINES.values() for p in e.admin_paths)

#: Every engine's model-list endpoints (path -> how answers merge across upstreams).
LISTINGS: dict[str, Listing] = {p: li for e in ENGINES.values() for p, li in e.model_lists.items()}

#: The request fields any engine names the model in, in the order they count.
MODEL_FIELDS: tuple[str, ...] = tuple(
    dict.fromkeys(f for e in ENGINES.values() for f in e.model_fields)
)


#: Every engine's endpoint labels and their kind: ``generation`` (tapped as it is
#: generated) or ``whole_body`` (one answer: embeddings, rerank ...). Exported as
#: ``phasewatch_endpoint_info``, so dashboards and rules select generations by kind and a
#: new engine's endpoints join them with no query naming its labels.
ENDPOINT_KINDS: dict[str, str] = {
    label: "whole_body" if label in e.whole_endpoints else "generation"
    for e in ENGINES.values()
    for label in e.endpoints.values()
}


def _native_apis() -> tuple[tuple[str, Dialect], ...]:
    """The engines' own APIs: (path prefix, a dialect that speaks it), the first
    registered engine of each prefix."""
    apis: dict[str, Dialect] = {}
    for engine in ENGINES.values():
        if engine.native_prefix and engine.native_prefix not in apis:
            apis[engine.native_prefix] = engine()
    return tuple(apis.items())


_NATIVE = _native_apis()


def engine_names(sep: str = "|") -> str:
    """The registered engines' names, in registry order (the --engine help text)."""
    return sep.join(ENGINES)


def native_api(path: str) -> tuple[str, Dialect] | None:
    """The engine API `path` lies in, other than OpenAI's: (its prefix, a dialect that
    speaks it), or None."""
    for prefix, dialect in _NATIVE:
        if path.startswith(prefix):
            return prefix, dialect
    return None


def is_admin_path(path: str) -> bool:
    """Whether `path` is (or lies under) an engine's model-management path."""
    if path in ADMIN_PATHS:
        return True
    return any(path.startswith(p + "/") for p in ADMIN_PATHS)


#: Admin paths whose GET and HEAD manage too, over every engine.
ADMIN_READS: frozenset[str] = frozenset(p for e in ENGINES.values() for p in e.admin_reads)
#: Generation paths -> the field whose zero unloads the model, over every engine.
UNLOAD_FIELDS: dict[str, str] = {p: f for e in ENGINES.values() for p, f in e.unload_fields.items()}


def is_admin(method: str, path: str) -> bool:
    """Whether a request of `method` to `path` manages an engine: an admin path's
    non-reading methods, and every method of the paths whose reads act too."""
    if method in ("GET", "HEAD"):
        return path in ADMIN_READS or any(path.startswith(p + "/") for p in ADMIN_READS)
    return is_admin_path(path)


def unload_field(path: str, obj: object) -> str | None:
    """The field of request body `obj` (parsed JSON) to `path` that asks the engine to
    unload its model (zero, as a number or a duration: ``0``, ``"0"``, ``"0s"``), or
    None."""
    name = UNLOAD_FIELDS.get(path)
    if name is None or not isinstance(obj, dict) or name not in obj:
        return None
    value = obj[name]
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return name if value == 0 else None
    if isinstance(value, str):
        text = value.strip().lower().rstrip("hmsun")  # 0, 0s, 0m, 0h, 0ms, 0us, 0ns
        try:
            return name if text and float(text) == 0 else None
        except ValueError:
            return None
    return None


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
    "ENDPOINT_KINDS",
    "ENGINES",
    "GENERIC",
    "LISTINGS",
    "MODEL_FIELDS",
    "Dialect",
    "EngineHistogram",
    "EngineReading",
    "EngineState",
    "Listing",
    "ModelList",
    "ModelQuery",
    "Outcome",
    "Prepared",
    "Tap",
    "Tokenizer",
    "detect_engine",
    "engine_names",
    "find_tokenizer",
    "get_dialect",
    "is_admin",
    "is_admin_path",
    "listed_context",
    "native_api",
    "served_file",
    "unload_field",
]
