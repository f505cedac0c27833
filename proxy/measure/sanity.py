"""Plausibility of the numbers an engine reports about a request.

An engine (or whatever answers in its place) may put any JSON in its usage and timings:
negative counts, ``1e308``, ``10**400``, strings, booleans, NaN. Such a value must never
reach a metric: prometheus-client refuses a negative increment, an integer too large for
a float overflows, ``1e308`` leaves a counter at +Inf until restart. Every number the
dialects read from an answer passes through :class:`Values`, and the recorder checks
what it is handed once more (:func:`checked`): an implausible value is dropped (None),
its field is named in the dropped list (the recorder counts and logs it), and the
request is measured with the rest.
"""

from __future__ import annotations

from dataclasses import replace

from .timeline import EngineTimings, Figures, Usage

#: Most tokens one request may count in any field (no context window comes near).
MAX_TOKENS = 2**31
#: Longest one phase of one request may last, in seconds (a day).
MAX_SECONDS = 86400.0
#: Fastest rate of any kind (prefill, decode) in tokens per second.
MAX_RATE = 1e9

#: The `field` label of phasewatch_engine_values_dropped_total: the fields read from an
#: engine, and the figures derived from them; anything else is counted as ``other``.
FIELDS = frozenset(
    {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "cached_tokens",
        "prefill_tokens",
        "decode_tokens",
        "prefill_seconds",
        "decode_seconds",
        "decode_rate",
        "load_seconds",
        "total_seconds",
        "queue_seconds",
        "prefill_rate",
        "tpot",
        "other",
    }
)


def _number(value: object) -> int | float | None:
    """`value` when it is a JSON number (a bool is not one), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


class Values:
    """Reads one answer's numbers, appending the name of each one dropped to `dropped`.

    A value that is absent (None) is not a lie and is not counted."""

    __slots__ = ("dropped",)

    def __init__(self, dropped: list[str] | None = None) -> None:
        self.dropped: list[str] = dropped if dropped is not None else []

    def count(self, value: object, name: str) -> int | None:
        """A token count: a whole number in 0..MAX_TOKENS (``12.0`` is 12)."""
        if value is None:
            return None
        x = _number(value)
        # NaN fails every comparison; an int is compared exactly, however large
        if x is not None and 0 <= x <= MAX_TOKENS and (isinstance(x, int) or x.is_integer()):
            return int(x)
        self.dropped.append(name)
        return None

    def seconds(self, value: object, name: str, per_second: float = 1.0) -> float | None:
        """A duration given in units of 1/`per_second` s (1e9: nanoseconds, 1000.0:
        milliseconds), as seconds: finite, non-negative, at most MAX_SECONDS."""
        if value is None:
            return None
        x = _number(value)
        # compared before converting: an int too large for a float cannot be scaled
        if x is not None and 0 <= x <= MAX_SECONDS * per_second:
            return float(x) / per_second
        self.dropped.append(name)
        return None

    def rate(self, value: object, name: str) -> float | None:
        """A rate in tokens per second: finite, non-negative, at most MAX_RATE."""
        if value is None:
            return None
        x = _number(value)
        if x is not None and 0 <= x <= MAX_RATE:
            return float(x)
        self.dropped.append(name)
        return None


def checked(usage: Usage, engine: EngineTimings, dropped: list[str]) -> tuple[Usage, EngineTimings]:
    """The usage and timings with every implausible value dropped (what a dialect missed,
    or an engine's cached count larger than its prompt); the input is not changed."""
    v = Values(dropped)
    u = Usage(
        prompt_tokens=v.count(usage.prompt_tokens, "prompt_tokens"),
        completion_tokens=v.count(usage.completion_tokens, "completion_tokens"),
        cached_tokens=v.count(usage.cached_tokens, "cached_tokens"),
    )
    if u.cached_tokens and u.prompt_tokens is not None and u.cached_tokens > u.prompt_tokens:
        u.cached_tokens = None  # served from the cache are part of the prompt
        dropped.append("cached_tokens")
    e = replace(
        engine,
        prefill_seconds=v.seconds(engine.prefill_seconds, "prefill_seconds"),
        prefill_tokens=v.count(engine.prefill_tokens, "prefill_tokens"),
        decode_seconds=v.seconds(engine.decode_seconds, "decode_seconds"),
        decode_tokens=v.count(engine.decode_tokens, "decode_tokens"),
        decode_tokens_per_second=v.rate(engine.decode_tokens_per_second, "decode_rate"),
        load_seconds=v.seconds(engine.load_seconds, "load_seconds"),
        total_seconds=v.seconds(engine.total_seconds, "total_seconds"),
        queue_seconds=v.seconds(engine.queue_seconds, "queue_seconds"),
    )
    return u, e


def bound_figures(f: Figures, dropped: list[str]) -> None:
    """Drop derived figures no engine can have made true (a plausible count over a
    plausible but tiny duration can still be a billion tokens a second)."""
    for name, table, limit in (
        ("prefill_rate", f.prefill_tps, MAX_RATE),
        ("decode_rate", f.decode_tps, MAX_RATE),
        ("prefill_seconds", f.prefill_seconds, MAX_SECONDS),
        ("decode_seconds", f.decode_seconds, MAX_SECONDS),
        ("tpot", f.tpot, MAX_SECONDS),
    ):
        for source in [s for s, x in table.items() if not (0 <= x <= limit)]:
            del table[source]
            dropped.append(name)
