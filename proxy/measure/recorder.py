"""Turns a finished request into metric observations and one log line.

Runs once per request, after the response is complete, so nothing here is on the
per-event path. The log line is what engines print as "prompt eval rate / eval rate";
it never carries prompt or completion text, nor any header value. What the recorder
needs of a request is the :class:`Finished` protocol, so it knows nothing of the relay.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, Protocol

from .kvcache import KVModel
from .metrics import Metrics, batch_band, observe_counts, prompt_band, status_class
from .sanity import FIELDS, bound_figures, checked
from .timeline import EngineTimings, Figures, Marks, Usage, figures

#: The per-request lines (filter or route them by this name).
access_log = logging.getLogger("proxy.access")
log = logging.getLogger(__name__)


class Finished(Protocol):
    """A finished request as the recorder reads it."""

    request_id: str
    client: str
    trace_id: str | None
    model_label: str
    precision: str
    status: int
    outcome: str  # ok | error | aborted | rejected
    error_kind: str | None
    error_message: str | None
    abort_phase: str | None
    marks: Marks
    #: Error kinds that did not fail the request (counted beside error_kind).
    side_errors: list[str]
    #: Requests of its upstream and model in flight when it was admitted (itself included).
    batch: int

    @property
    def upstream_name(self) -> str: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def stream(self) -> bool: ...
    @property
    def streamed(self) -> bool: ...
    @property
    def usage(self) -> Usage: ...
    @property
    def engine_timings(self) -> EngineTimings: ...
    @property
    def dropped(self) -> list[str]: ...  # implausible engine values the dialect dropped
    @property
    def gaps(self) -> tuple[list[int], float] | None: ...
    @property
    def kv(self) -> KVModel | None: ...


#: Called with (request, figures) after each request; returns extra log-line fields.
Listener = Callable[[Any, Figures], "dict | None"]
#: Called last with (request, figures, every field of the log line): exporters that want
#: what the listeners added (the power listener's watts and joules).
Sink = Callable[[Any, Figures, dict], None]
#: Writes one warning per kind at most every so often (proxy.core.limited.LimitedLog's
#: ``warning``): (kind, message, *args).
Warn = Callable[..., object]

#: OpenMetrics caps an exemplar's label names and values at 128 characters in all.
_EXEMPLAR_CHARS = 128


#: What a request id may keep in an exemplar; anything else becomes "_". A client's id
#: is free text, and some OpenMetrics parsers misread a label value holding "} #".
_UNSAFE_ID_RE = re.compile(r"[^A-Za-z0-9._:/+=@-]")


def exemplar(request_id: str, trace_id: str | None) -> dict[str, str]:
    """The exemplar labels of a request's observations: its trace id (when it was traced)
    and its request id, made safe and cut to fit OpenMetrics' limit."""
    rid = _UNSAFE_ID_RE.sub("_", request_id)
    if trace_id:
        room = _EXEMPLAR_CHARS - len("trace_id") - len(trace_id) - len("request_id")
        return {"trace_id": trace_id, "request_id": rid[: max(0, room)]}
    return {"request_id": rid[: _EXEMPLAR_CHARS - len("request_id")]}


class Recorder:
    """Observes metrics and writes the per-request line."""

    def __init__(
        self, metrics: Metrics, access_lines: bool = True, warn: Warn | None = None
    ) -> None:
        self.metrics = metrics
        self.access_lines = access_lines
        #: Side services hook in here (the power sampler attaches per-phase watts, the
        #: status page keeps recent points).
        self.listeners: list[Listener] = []
        #: Exporters (the OpenTelemetry spans) see the whole line, listeners' fields included.
        self.sinks: list[Sink] = []
        #: The rate-limited warning (the app passes a LimitedLog's); without one, the
        #: first line of each kind only.
        self.warn: Warn = warn or _FirstOnly(log).warning

    def record(self, ex: Finished) -> None:
        """Observe the request and write its line. Never raises: it runs in the relay's
        ``finally``, and whatever an engine sent, the request is logged, its listeners
        (power share, status page) and sinks (the span) run, with what was measurable."""
        dropped: list[str] = []
        f = Figures()
        listeners = [] if ex.outcome == "rejected" else self.listeners
        try:
            dropped.extend(ex.dropped)
            usage, timings = checked(ex.usage, ex.engine_timings, dropped)
            f = figures(ex.marks, usage, timings, streamed=ex.streamed)
            bound_figures(f, dropped)
            self._observe(ex, f)
        except Exception as exc:  # noqa: BLE001 - a defect must not cost the request its line
            self.warn(
                "recorder",
                "measuring request %s failed (%s); logged with what was measured",
                ex.request_id,
                type(exc).__name__,
            )
        if dropped:
            self._dropped(ex, dropped)
        self._finish(ex, f, listeners)

    def _dropped(self, ex: Finished, dropped: list[str]) -> None:
        """Count the engine's implausible values, and say so (never the values)."""
        try:
            counter = self.metrics.engine_values_dropped_total
            for name in dropped:
                counter.labels(ex.upstream_name, name if name in FIELDS else "other").inc()
        except Exception:  # counting must not cost the request its line
            log.debug("counting dropped engine values failed", exc_info=True)
        self.warn(
            "implausible_engine_value",
            "upstream %s reported implausible %s; dropped, the request is measured without "
            "it (request %s)",
            ex.upstream_name,
            ",".join(sorted({n if n in FIELDS else "other" for n in dropped})),
            ex.request_id,
        )

    def _observe(self, ex: Finished, f: Figures) -> None:
        m = self.metrics
        base = (ex.upstream_name, ex.model_label, ex.precision)
        band = prompt_band(f.prompt_tokens)
        client = ex.client
        # Grafana jumps from a slow bucket to the trace and the log line through these.
        marker = exemplar(ex.request_id, ex.trace_id)

        m.requests_total.labels(*base, ex.endpoint, ex.outcome, client).inc()
        if f.request_seconds is not None:
            m.request_seconds.labels(*base, ex.endpoint, ex.outcome).observe(
                f.request_seconds, marker
            )
        if ex.outcome == "rejected":
            return
        if f.queue_proxy is not None:
            m.queue_seconds.labels(*base, "proxy").observe(f.queue_proxy)
        # every error kind is counted here: the one that failed the request, and those
        # that did not
        klass = status_class(ex.status)
        if ex.error_kind:
            m.errors_total.labels(*base, ex.error_kind, klass).inc()
        for kind in ex.side_errors:
            m.errors_total.labels(*base, kind, klass).inc()
        if ex.outcome == "aborted":
            m.aborts_total.labels(*base, ex.abort_phase or "unknown").inc()

        if f.ttft is not None:
            m.ttft_seconds.labels(*base, band).observe(f.ttft, marker)
        gaps = ex.gaps
        if gaps is not None and ex.marks.output_events > 1:
            observe_counts(m.inter_token_seconds.labels(*base, band), gaps[0], gaps[1])

        # Phase figures need the engine's counts: only complete responses have them.
        if ex.outcome == "ok":
            if f.queue_upstream is not None:
                m.queue_seconds.labels(*base, "upstream").observe(f.queue_upstream)
            for source, value in f.prefill_seconds.items():
                m.prefill_seconds.labels(*base, source, band).observe(value)
            for source, value in f.prefill_tps.items():
                m.prefill_tokens_per_second.labels(*base, source, band).observe(value)
            for source, value in f.decode_seconds.items():
                m.decode_seconds.labels(*base, source, band).observe(value)
            for source, value in f.decode_tps.items():
                m.decode_tokens_per_second.labels(*base, source, band).observe(value, marker)
            for source, value in f.tpot.items():
                m.time_per_output_token_seconds.labels(*base, source).observe(value)
            decode = f.decode_seconds.get("proxy")
            if decode and "proxy" in f.decode_tps and f.completion_tokens:
                batch = batch_band(ex.batch)
                m.decode_batch_requests_total.labels(*base, batch).inc()
                m.decode_batch_seconds_total.labels(*base, batch).inc(decode)
                m.decode_batch_tokens_total.labels(*base, batch).inc(f.completion_tokens - 1)
            kv = ex.kv
            kv_bytes = kv.request_bytes(f.context_tokens) if kv and f.context_tokens else None
            if kv_bytes is not None:
                m.kv_cache_bytes.labels(*base).observe(kv_bytes)
            if f.load_seconds is not None:
                m.load_seconds.labels(*base).observe(f.load_seconds)
        if f.prompt_tokens is not None:
            m.prompt_tokens.labels(*base).observe(f.prompt_tokens)
            if f.processed_prompt_tokens:
                m.tokens_total.labels(*base, "prefill", client).inc(f.processed_prompt_tokens)
            if f.cached_tokens:
                m.tokens_total.labels(*base, "cached", client).inc(f.cached_tokens)
        if f.completion_tokens is not None:
            m.completion_tokens.labels(*base).observe(f.completion_tokens)
            if f.completion_tokens:
                m.tokens_total.labels(*base, "decode", client).inc(f.completion_tokens)

    def _finish(self, ex: Finished, f: Figures, listeners: list[Listener]) -> None:
        """Run the listeners, then the sinks, then write the line."""
        extra: dict = {}
        for listener in listeners:
            try:
                extra.update(listener(ex, f) or {})
            except Exception:  # a side service must never break the request path
                log.exception("request listener %r failed", listener)
        log_line = self.access_lines and access_log.isEnabledFor(logging.INFO)
        if not (log_line or self.sinks):
            return
        fields = self._fields(ex, f, extra)
        for sink in self.sinks:
            try:
                sink(ex, f, fields)
            except Exception:  # a side service must never break the request path
                log.exception("request sink %r failed", sink)
        if log_line:
            # the formatter (proxy.runtime.logs) renders and escapes the fields
            access_log.info(
                "request", extra={"fields": {k: v for k, v in fields.items() if v is not None}}
            )

    # --- the per-request line ---------------------------------------------------------

    def _fields(self, ex: Finished, f: Figures, extra: dict) -> dict:
        fields = {
            "request_id": ex.request_id,
            "trace_id": ex.trace_id,
            "client": ex.client,
            "upstream": ex.upstream_name,
            "model": ex.model_label,
            "precision": ex.precision,
            "endpoint": ex.endpoint,
            "stream": ex.stream,
            "status": ex.status,
            "outcome": ex.outcome,
            "prompt_tokens": f.prompt_tokens,
            "cached_tokens": f.cached_tokens,
            "completion_tokens": f.completion_tokens,
            "queue_s": _r(f.queue_proxy),
            "upstream_queue_s": _r(f.queue_upstream),
            "ttft_s": _r(f.ttft),
            "prefill_tps": _r(f.prefill_tps.get("proxy"), 1),
            "decode_tps": _r(f.decode_tps.get("proxy"), 2),
            "engine_prefill_tps": _r(f.prefill_tps.get("engine"), 1),
            "engine_decode_tps": _r(f.decode_tps.get("engine"), 2),
            "request_s": _r(f.request_seconds),
        }
        if ex.abort_phase:
            fields["abort_phase"] = ex.abort_phase
        if ex.error_kind:
            fields["error"] = ex.error_kind
            fields["error_message"] = ex.error_message
        fields.update(extra)
        return fields


class _FirstOnly:
    """A stand-in for LimitedLog (which lives above this layer): the first line of
    each kind, then none."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.warned_kinds: set[str] = set()

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        if kind in self.warned_kinds:
            return False
        self.warned_kinds.add(kind)
        self.logger.warning(msg, *args)
        return True


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)
