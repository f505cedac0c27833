"""OpenTelemetry for measured requests (``--otel``): one span per request, the phases as
span events, GenAI metrics, all exported over OTLP/HTTP off the request path.

Two hooks, both once per request and never per event:

- :meth:`Tracing.begin` runs before the request goes upstream: it continues the client's
  W3C ``traceparent`` (or starts a trace), opens the request's span at ``t_recv`` and
  hands the relay the ``traceparent`` / ``tracestate`` to send to the engine, so the
  engine's own spans (vLLM's ``--otlp-traces-endpoint``) land under phasewatch's.
- :meth:`Tracing.finish` is a recorder sink: it fills the span from the request's marks
  and figures (GenAI semantic-convention attributes, ``phasewatch.*`` figures, the power
  listener's watts and joules), adds the queue / prefill / decode events and ends it
  at ``t_end``; the SDK's batch processor exports it on its own thread. It also records
  the GenAI server metrics (``gen_ai.server.time_to_first_token`` …).

The OpenTelemetry SDK and its OTLP/HTTP exporter are an optional extra
(``pip install 'phasewatch[otel]'``), imported only here and only with ``--otel``; they
read the standard ``OTEL_*`` variables themselves (endpoint, headers, service name,
sampler, batch sizes, metric export interval).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..core.exchange import Exchange
from ..core.headers import Headers
from ..measure.metrics import Metrics, prompt_band
from ..measure.timeline import Figures

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

#: The SDK logger that says "Queue full, dropping span." once per dropped span.
_SDK_BATCH_LOGGER = "opentelemetry.sdk._shared_internal"
#: Longest raw model name put on a span (what the client sent; the bounded label is
#: on ``phasewatch.model`` and on the metrics).
_MAX_MODEL_CHARS = 256
#: How often at most the "span queue is full" line is repeated while spans are dropped.
_DROP_LOG_EVERY = 60.0
#: Seconds the export of what is queued may take at shutdown (--otel-shutdown-timeout).
SHUTDOWN_TIMEOUT = 5.0

#: Explicit bucket boundaries the GenAI semantic conventions advise.
TTFT_BOUNDS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
TPOT_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BOUNDS = tuple(0.01 * 2**i for i in range(14))  # 0.01 .. 81.92 s
TOKEN_BOUNDS = tuple(float(4**i) for i in range(14))  # 1 .. 67M


def operation(endpoint: str) -> str:
    """``gen_ai.operation.name`` of a measured endpoint."""
    return "chat" if "chat" in endpoint else "text_completion"


def _check_env() -> tuple[bool, bool]:
    """(traces, metrics) wanted by OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER; a setting
    phasewatch cannot honour stops start-up with one line."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False, False
    wanted = []
    for signal in ("TRACES", "METRICS"):
        exporter = os.environ.get(f"OTEL_{signal}_EXPORTER", "otlp").strip().lower() or "otlp"
        if exporter not in ("otlp", "none"):
            raise ValueError(
                f"--otel: OTEL_{signal}_EXPORTER={exporter[:40]!r} is not supported (otlp or none)"
            )
        wanted.append(exporter == "otlp")
        for var in ("OTEL_EXPORTER_OTLP_PROTOCOL", f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL"):
            protocol = os.environ.get(var, "").strip()
            if protocol and protocol != "http/protobuf":
                raise ValueError(
                    f"--otel: {var}={protocol[:40]!r} is not supported: phasewatch exports "
                    "OTLP over HTTP (http/protobuf)"
                )
    return wanted[0], wanted[1]


class _Drops:
    """Spans dropped because the batch processor's queue is full: each one counted, said
    once a minute instead of once per span."""

    def __init__(self, metrics: Metrics) -> None:
        self.counter = metrics.otel_spans_dropped_total.labels("queue_full")
        self.last_drop_log = 0.0
        self._lock = threading.Lock()

    def drop(self) -> None:
        self.counter.inc()
        now = time.monotonic()
        with self._lock:
            if now - self.last_drop_log < _DROP_LOG_EVERY:
                return
            self.last_drop_log = now
        log.warning(
            "OpenTelemetry span queue is full (OTEL_BSP_MAX_QUEUE_SIZE): spans are "
            'dropped (phasewatch_otel_spans_dropped_total{reason="queue_full"})'
        )


class _Dropped(logging.Filter):
    """Keeps the batch processor's "queue full" record (one per dropped span, which the
    SDK's duplicate filter thins to one per 20 s) out of the log; with `drops`, counts it
    (where the processor's queue cannot be read, so spans are not counted there)."""

    def __init__(self, drops: _Drops | None) -> None:
        super().__init__()
        self.drops = drops

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Queue full"):
            return True
        if self.drops is not None:
            self.drops.drop()
        return False


def _queue_of(processor: Any) -> tuple[Any, int] | None:
    """The batch processor's span queue and its capacity, where this SDK version keeps
    them where phasewatch knows to look (else None: counted from the SDK's log record)."""
    inner = getattr(processor, "_batch_processor", processor)
    for queue_name, size_name in (("_queue", "_max_queue_size"), ("queue", "max_queue_size")):
        queue = getattr(inner, queue_name, None)
        size = getattr(inner, size_name, None)
        if queue is not None and isinstance(size, int) and hasattr(queue, "__len__"):
            return queue, size
    return None


def _started(fn: Any) -> threading.Thread:
    """Start `fn` on a daemon thread (the caller joins it as long as it may wait)."""
    thread = threading.Thread(target=fn, name="phasewatch-otel-shutdown", daemon=True)
    thread.start()
    return thread


class _Handle:
    """A request's open span and the offset from the monotonic clock to the wall clock
    (taken once, so every mark of the request converts alike)."""

    __slots__ = ("offset_ns", "span")

    def __init__(self, span: Any, offset_ns: int) -> None:
        self.span = span
        self.offset_ns = offset_ns

    def wall(self, t: float) -> int:
        return int(t * 1e9) + self.offset_ns


class Tracing:
    """OpenTelemetry traces and GenAI metrics of measured requests."""

    def __init__(
        self, metrics: Metrics, version: str, shutdown_timeout: float = SHUTDOWN_TIMEOUT
    ) -> None:
        traces, meters = _check_env()
        try:
            from opentelemetry import trace
            from opentelemetry.context import Context
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise ValueError(
                f"--otel needs the OpenTelemetry SDK ({exc.name} is missing): "
                "pip install 'phasewatch[otel]'"
            ) from None
        self.metrics = metrics
        self._trace = trace
        self._context = Context
        self._propagator = TraceContextTextMapPropagator()
        attributes = {"service.version": version}
        if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        ):
            attributes["service.name"] = "phasewatch"
        resource = Resource.create(attributes)
        self._addresses: dict[str, tuple[str, int]] = {}

        #: The longest the export of what is queued may take at shutdown.
        self.shutdown_timeout = shutdown_timeout
        self.tracer_provider: Any = None
        self.tracer: Any = None
        self._span_exporter: Any = None
        self._metric_exporter: Any = None
        self._processor: Any = None
        if traces:
            # the sampler comes from OTEL_TRACES_SAMPLER(_ARG), parent-based always-on
            # by default; the exporter and the batch processor read their OTEL_* variables
            self.tracer_provider = TracerProvider(resource=resource)
            self._span_exporter = OTLPSpanExporter()
            exporter = _counting_exporter(self._span_exporter, metrics)
            drops = _Drops(metrics)
            self._processor = _counting_processor(BatchSpanProcessor, exporter, drops)
            self.tracer_provider.add_span_processor(self._processor)
            self.tracer = self.tracer_provider.get_tracer("phasewatch", version)
            # first, so that the SDK's duplicate filter cannot hide the repeats from it
            filters = logging.getLogger(_SDK_BATCH_LOGGER).filters
            counted = _queue_of(self._processor) is not None
            filters.insert(0, _Dropped(None if counted else drops))

        self.meter_provider: Any = None
        if meters:
            self._metric_exporter = OTLPMetricExporter()
            reader = PeriodicExportingMetricReader(self._metric_exporter)
            self.meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
            meter = self.meter_provider.get_meter("phasewatch", version)
            self.ttft = meter.create_histogram(
                "gen_ai.server.time_to_first_token",
                unit="s",
                description="Time to generate the first token (as the client feels it).",
                explicit_bucket_boundaries_advisory=TTFT_BOUNDS,
            )
            self.tpot = meter.create_histogram(
                "gen_ai.server.time_per_output_token",
                unit="s",
                description="Time per output token after the first (decode).",
                explicit_bucket_boundaries_advisory=TPOT_BOUNDS,
            )
            self.duration = meter.create_histogram(
                "gen_ai.server.request.duration",
                unit="s",
                description="Generative AI server request duration.",
                explicit_bucket_boundaries_advisory=DURATION_BOUNDS,
            )
            self.tokens = meter.create_histogram(
                "gen_ai.client.token.usage",
                unit="{token}",
                description="Input and output tokens used per request.",
                explicit_bucket_boundaries_advisory=TOKEN_BOUNDS,
            )
        log.info(
            "OpenTelemetry: traces %s, GenAI metrics %s (OTLP/HTTP to %s)",
            "on" if traces else "off",
            "on" if meters else "off",
            os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318"),
        )

    @property
    def traces(self) -> bool:
        return self.tracer is not None

    @property
    def enabled(self) -> bool:
        return self.tracer is not None or self.meter_provider is not None

    def shutdown(self) -> None:
        """Export what is queued and stop, within `shutdown_timeout` seconds (blocking: run
        it off the event loop). Traces and metrics are flushed side by side; what is not
        exported by then (a collector down or silent: the SDK would retry for half a
        minute and more) is given up: its exporter is shut, which ends its retries, the
        spans still queued are counted as dropped, and one line says so."""
        deadline = time.monotonic() + self.shutdown_timeout
        running = []
        for what, provider, exporter in (
            ("spans", self.tracer_provider, self._span_exporter),
            ("metrics", self.meter_provider, self._metric_exporter),
        ):
            if provider is not None:
                running.append((what, _started(self._shut(provider)), exporter))
        for what, thread, exporter in running:
            thread.join(max(0.0, deadline - time.monotonic()))
            if not thread.is_alive():
                continue
            queued = self._queued() if what == "spans" else 0
            if queued:
                self.metrics.otel_spans_dropped_total.labels("shutdown").inc(queued)
            log.warning(
                "OpenTelemetry %s not exported within %gs of shutdown "
                "(--otel-shutdown-timeout; is the collector at OTEL_EXPORTER_OTLP_ENDPOINT "
                "down?): given up%s",
                what,
                self.shutdown_timeout,
                f", {queued} queued span(s) dropped" if queued else "",
            )
            try:
                exporter.shutdown()  # ends the export's retries; the thread is a daemon
            except Exception:
                log.debug("OpenTelemetry exporter shutdown failed", exc_info=True)

    @staticmethod
    def _shut(provider: Any) -> Any:
        def run() -> None:
            try:
                provider.shutdown()
            except Exception:
                log.exception("OpenTelemetry shutdown failed")

        return run

    def _queued(self) -> int:
        """Spans waiting in the batch processor's queue (0 where it cannot be read)."""
        found = _queue_of(self._processor)
        return len(found[0]) if found is not None else 0

    # --- before the request goes upstream ------------------------------------------------

    def begin(self, ex: Exchange, headers: Headers) -> None:
        """Open the request's span (continuing the client's trace context) and set the
        trace context the engine gets."""
        carrier: dict[str, str] = {}
        for k, v in headers:
            if k == b"traceparent" or k == b"tracestate":
                carrier[k.decode()] = v.decode("latin-1")
        parent = self._propagator.extract(carrier) if carrier else self._context()
        op = operation(ex.prepared.endpoint)
        offset = time.time_ns() - time.monotonic_ns()
        span = self.tracer.start_span(
            f"{op} {ex.model_label}",
            context=parent,
            kind=self._trace.SpanKind.SERVER,
            start_time=int(ex.marks.t_recv * 1e9) + offset,
            attributes={
                "gen_ai.operation.name": op,
                "gen_ai.request.model": (ex.prepared.model or "")[:_MAX_MODEL_CHARS],
            },
        )
        ctx = span.get_span_context()
        if ctx.trace_flags.sampled:
            ex.trace_id = format(ctx.trace_id, "032x")
        out: dict[str, str] = {}
        self._propagator.inject(out, context=self._trace.set_span_in_context(span))
        ex.trace_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in out.items()]
        ex.trace = _Handle(span, offset)

    # --- after the response is complete (a recorder sink) ----------------------------------

    def finish(self, ex: Exchange, f: Figures, fields: dict) -> None:
        handle = ex.trace
        if isinstance(handle, _Handle):
            ex.trace = None
            self._end_span(ex, f, fields, handle)
        if self.meter_provider is not None:
            self._record_metrics(ex, f)

    def _address(self, ex: Exchange) -> tuple[str, int]:
        name = ex.upstream_name
        got = self._addresses.get(name)
        if got is None:
            parts = urlsplit(ex.upstream.url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            got = self._addresses[name] = (parts.hostname or "", port)
        return got

    def _common(self, ex: Exchange) -> dict[str, Any]:
        host, port = self._address(ex)
        out: dict[str, Any] = {
            "gen_ai.operation.name": operation(ex.prepared.endpoint),
            "gen_ai.provider.name": ex.upstream.engine,
            "server.address": host,
            "server.port": port,
            "phasewatch.precision": ex.precision,
        }
        if ex.error_kind:
            out["error.type"] = ex.error_kind
        return out

    def _end_span(self, ex: Exchange, f: Figures, fields: dict, h: _Handle) -> None:
        span = h.span
        mk = ex.marks
        end = mk.t_end if mk.t_end is not None else time.monotonic()
        if not span.is_recording():
            span.end(end_time=h.wall(end))
            return
        attrs = self._common(ex)
        result = ex.result
        attrs.update(
            {
                "http.response.status_code": ex.status,
                "phasewatch.request_id": ex.request_id,
                "phasewatch.client": ex.client,
                "phasewatch.upstream": ex.upstream_name,
                "phasewatch.model": ex.model_label,
                "phasewatch.endpoint": ex.prepared.endpoint,
                "phasewatch.stream": ex.prepared.stream,
                "phasewatch.outcome": ex.outcome,
                "phasewatch.prompt_band": prompt_band(f.prompt_tokens),
            }
        )
        optional = {
            "gen_ai.response.model": result.response_model,
            "gen_ai.response.finish_reasons": result.finish_reasons or None,
            "gen_ai.usage.input_tokens": f.prompt_tokens,
            "gen_ai.usage.output_tokens": f.completion_tokens,
            "phasewatch.cached_tokens": f.cached_tokens,
            "phasewatch.abort_phase": ex.abort_phase,
            "phasewatch.error_message": ex.error_message,
            "phasewatch.queue_seconds": f.queue_proxy,
            "phasewatch.upstream_queue_seconds": f.queue_upstream,
            "phasewatch.ttft_seconds": f.ttft,
            "phasewatch.request_seconds": f.request_seconds,
            "phasewatch.load_seconds": f.load_seconds,
        }
        for source, prefix in (("proxy", "phasewatch."), ("engine", "phasewatch.engine.")):
            optional[prefix + "prefill_seconds"] = f.prefill_seconds.get(source)
            optional[prefix + "prefill_tokens_per_second"] = f.prefill_tps.get(source)
            optional[prefix + "decode_seconds"] = f.decode_seconds.get(source)
            optional[prefix + "decode_tokens_per_second"] = f.decode_tps.get(source)
        attrs.update({k: v for k, v in optional.items() if v is not None})
        span.set_attributes(attrs)
        if ex.outcome == "error" or ex.status >= 500:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, ex.error_kind))

        # The phases as span events where the marks say they began, each with its length:
        # three child spans would triple the per-request cost (span creation and export).
        aborted = ex.abort_phase if ex.outcome == "aborted" else None
        phases: list[tuple[str, float | None, float | None, dict]] = [
            ("queue", mk.t_recv, mk.t_admit if mk.t_admit is not None else end, {}),
            (
                "prefill",
                mk.t_sent,
                mk.t_first if mk.t_first is not None else (end if aborted == "prefill" else None),
                _phase_attrs(f.prefill_seconds, f.prefill_tps, "prefill", fields),
            ),
            (
                "decode",
                mk.t_first,
                end if aborted == "decode" else mk.t_last,
                _phase_attrs(f.decode_seconds, f.decode_tps, "decode", fields),
            ),
        ]
        if mk.t_admit is None and ex.outcome != "aborted":  # rejected at the gate
            phases = phases[:1]
        for name, a, b, extra in phases:
            if a is None or b is None or b < a:
                continue
            span.add_event(name, {"phasewatch.phase_seconds": b - a, **extra}, timestamp=h.wall(a))
        span.end(end_time=h.wall(end))

    def _record_metrics(self, ex: Exchange, f: Figures) -> None:
        attrs = self._common(ex)
        attrs["gen_ai.request.model"] = ex.model_label  # bounded: metrics need few series
        if f.request_seconds is not None:
            self.duration.record(f.request_seconds, attrs)
        if f.ttft is not None:
            self.ttft.record(f.ttft, attrs)
        rate = f.decode_tps.get("proxy") or f.decode_tps.get("engine")
        if rate:
            self.tpot.record(1.0 / rate, attrs)
        for kind, count in (("input", f.prompt_tokens), ("output", f.completion_tokens)):
            if count is not None:
                self.tokens.record(count, {**attrs, "gen_ai.token.type": kind})


def _phase_attrs(
    seconds: dict[str, float], rates: dict[str, float], phase: str, fields: dict
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for source, prefix in (("proxy", "phasewatch."), ("engine", "phasewatch.engine.")):
        if source in seconds:
            out[f"{prefix}{phase}_seconds"] = seconds[source]
        if source in rates:
            out[f"{prefix}{phase}_tokens_per_second"] = rates[source]
    return out


def _counting_processor(batch: Any, exporter: SpanExporter, drops: _Drops) -> Any:
    """The SDK's batch span processor, counting each span it drops because its queue is
    full (the SDK only logs that, and its duplicate filter shows one line in 20 s)."""

    class Counting(batch):
        def __init__(self) -> None:
            super().__init__(exporter)
            self._queue_state = _queue_of(self)

        def on_end(self, span: Any) -> None:
            state = self._queue_state
            if (
                state is not None
                and span.context is not None
                and span.context.trace_flags.sampled
                and len(state[0]) >= state[1]
            ):
                drops.drop()  # the queue takes it and drops its oldest span
            super().on_end(span)

    return Counting()


def _counting_exporter(inner: SpanExporter, metrics: Metrics) -> SpanExporter:
    """The OTLP exporter, counting the spans it could not deliver (and saying once when
    the endpoint starts and stops refusing them)."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    failed = metrics.otel_spans_dropped_total.labels("export_failed")

    class Counting(SpanExporter):
        def __init__(self) -> None:
            self.failing = False

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            try:
                result = inner.export(spans)
            except Exception as exc:  # noqa: BLE001 - counted and said, never raised
                log.debug("span export raised: %s", exc)
                result = SpanExportResult.FAILURE
            if result is SpanExportResult.SUCCESS:
                if self.failing:
                    self.failing = False
                    log.info("OpenTelemetry span export works again")
            else:
                failed.inc(len(spans))
                if not self.failing:
                    self.failing = True
                    log.warning(
                        "OpenTelemetry span export failed: spans are dropped "
                        '(phasewatch_otel_spans_dropped_total{reason="export_failed"}); '
                        "check OTEL_EXPORTER_OTLP_ENDPOINT"
                    )
            return result

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return inner.force_flush(timeout_millis)

    return Counting()
