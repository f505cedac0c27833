"""The timeline of one request and the figures derived from it.

Pure data and pure functions: marks in, figures out. No I/O, no clocks, so every rule
here is tested without a server.

The marks, on the proxy's monotonic clock: ``t_recv`` the whole request is in, ``t_admit``
it passed the admission gate, ``t_sent`` it was written upstream, ``t_first`` / ``t_last``
the first / last event carrying generated output was forwarded, ``t_end`` the response is
complete (or aborted). TTFT is ``t_first - t_recv`` (what the client feels); decode rate is
``(completion_tokens - 1) / (t_last - t_first)``; prefill is the engine's own figure where
it reports one, else ``t_first - t_sent``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeGuard


@dataclass(slots=True)
class Marks:
    """Proxy-clock (``time.monotonic``) marks; None where the moment never came."""

    t_recv: float
    t_admit: float | None = None
    t_sent: float | None = None
    t_headers: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    t_end: float | None = None
    output_events: int = 0


@dataclass(slots=True)
class Usage:
    """Token counts as the engine reported them (never guessed)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens served from a prefix cache


@dataclass(slots=True)
class EngineTimings:
    """Phase figures the engine reports about itself, in seconds."""

    prefill_seconds: float | None = None
    prefill_tokens: int | None = None  # prompt tokens the engine actually processed
    decode_seconds: float | None = None
    decode_tokens: int | None = None
    decode_tokens_per_second: float | None = None
    load_seconds: float | None = None  # cold start / scheduling (Ollama load_duration)
    total_seconds: float | None = None  # engine's whole-request figure (Ollama)
    queue_seconds: float | None = None  # engine-side wait, where the engine's figures give it


@dataclass(slots=True)
class Figures:
    """Everything exported about one request. None means 'not measurable'."""

    queue_proxy: float | None = None
    queue_upstream: float | None = None
    ttft: float | None = None
    prefill_seconds: dict[str, float] = field(default_factory=dict)  # by source
    prefill_tps: dict[str, float] = field(default_factory=dict)
    decode_seconds: dict[str, float] = field(default_factory=dict)
    decode_tps: dict[str, float] = field(default_factory=dict)
    #: time per output token, by source: decode_seconds / (completion_tokens - 1)
    tpot: dict[str, float] = field(default_factory=dict)
    request_seconds: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    processed_prompt_tokens: int | None = None
    cached_tokens: int | None = None
    load_seconds: float | None = None
    #: tokens a generation holds in the KV cache at its end (prompt + completion); None
    #: for answers that generate nothing (embeddings) or carry no counts
    context_tokens: int | None = None


def _positive(x: float | None) -> TypeGuard[float]:
    return x is not None and x > 0


def figures(
    marks: Marks, usage: Usage, engine: EngineTimings | None = None, streamed: bool = True
) -> Figures:
    """Derive the per-request figures from the marks, usage and engine timings.

    A non-streaming response has no first-token mark: it gets request time, token counts
    and only the engine's own phase figures; a whole-request average is never passed off
    as a decode rate.
    """
    f = Figures()
    engine = engine or EngineTimings()
    if marks.t_admit is not None:
        f.queue_proxy = max(0.0, marks.t_admit - marks.t_recv)
    if marks.t_end is not None:
        f.request_seconds = max(0.0, marks.t_end - marks.t_recv)
    f.load_seconds = engine.load_seconds
    if engine.queue_seconds is not None:
        f.queue_upstream = max(0.0, engine.queue_seconds)

    f.prompt_tokens = usage.prompt_tokens
    f.completion_tokens = usage.completion_tokens
    f.cached_tokens = usage.cached_tokens
    processed = usage.prompt_tokens
    if engine.prefill_tokens is not None:
        processed = engine.prefill_tokens
    elif processed is not None and usage.cached_tokens:
        processed = max(0, processed - usage.cached_tokens)
    f.processed_prompt_tokens = processed
    if usage.prompt_tokens is not None and usage.completion_tokens is not None:
        f.context_tokens = usage.prompt_tokens + usage.completion_tokens

    # Engine-reported phases (source="engine").
    if _positive(engine.prefill_seconds):
        f.prefill_seconds["engine"] = engine.prefill_seconds
        if processed:
            f.prefill_tps["engine"] = processed / engine.prefill_seconds
    if _positive(engine.decode_seconds):
        f.decode_seconds["engine"] = engine.decode_seconds
    if _positive(engine.decode_tokens_per_second):
        f.decode_tps["engine"] = engine.decode_tokens_per_second
    elif _positive(engine.decode_seconds) and engine.decode_tokens and engine.decode_tokens >= 2:
        f.decode_tps["engine"] = engine.decode_tokens / engine.decode_seconds
    if _positive(engine.decode_seconds) and engine.decode_tokens and engine.decode_tokens >= 2:
        f.tpot["engine"] = engine.decode_seconds / (engine.decode_tokens - 1)

    if not streamed or marks.t_first is None:
        return f

    # Proxy-measured phases (source="proxy").
    f.ttft = max(0.0, marks.t_first - marks.t_recv)
    if marks.t_sent is not None:
        prefill = max(0.0, marks.t_first - marks.t_sent)
        f.prefill_seconds["proxy"] = prefill
        if processed and prefill > 0:
            f.prefill_tps["proxy"] = processed / prefill
        if f.queue_upstream is None and _positive(engine.prefill_seconds):
            f.queue_upstream = max(
                0.0, prefill - engine.prefill_seconds - (engine.load_seconds or 0.0)
            )
    if marks.t_last is not None and usage.completion_tokens and usage.completion_tokens >= 2:
        decode = marks.t_last - marks.t_first
        if decode > 0:
            f.decode_seconds["proxy"] = decode
            f.decode_tps["proxy"] = (usage.completion_tokens - 1) / decode
            f.tpot["proxy"] = decode / (usage.completion_tokens - 1)
    return f
