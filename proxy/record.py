"""Turns a finished exchange into metric observations and one log line.

Runs once per request, after the response is complete, so nothing here is on the
per-event path. The log line is what engines print as "prompt eval rate / eval rate";
it never carries prompt or completion text, nor any header value.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Callable

from .metrics import Metrics, observe_counts, prompt_band
from .timeline import Figures, figures

if TYPE_CHECKING:
    from .relay import Exchange

access_log = logging.getLogger("phasewatch.access")


class Recorder:
    """Observes metrics and writes the per-request line."""

    def __init__(self, metrics: Metrics, log_format: str = "logfmt") -> None:
        self.metrics = metrics
        self.log_format = log_format
        #: Called with (exchange, figures) after each request: the power sampler hooks
        #: in here to attach per-phase watts.
        self.listeners: list[Callable[["Exchange", Figures], dict | None]] = []

    def record(self, ex: "Exchange", precision: str) -> None:
        m = self.metrics
        up = ex.upstream
        base = (up.name, ex.model_label, precision)
        result = ex.result
        streamed = ex.tap is not None
        f = figures(ex.marks, result.usage, result.engine, streamed=streamed)
        band = prompt_band(f.prompt_tokens)

        m.requests_total.labels(*base, ex.prepared.endpoint, ex.outcome).inc()
        if f.request_seconds is not None:
            m.request_seconds.labels(*base, ex.outcome).observe(f.request_seconds)
        if ex.outcome == "rejected":
            self._log(ex, precision, f, {})
            return
        if f.queue_proxy is not None:
            m.queue_seconds.labels(*base, "proxy").observe(f.queue_proxy)
        if ex.error_kind:
            m.errors_total.labels(*base, ex.error_kind).inc()
        if ex.outcome == "aborted":
            m.aborts_total.labels(*base, ex.abort_phase or "unknown").inc()

        if f.ttft is not None:
            m.ttft_seconds.labels(*base, band).observe(f.ttft)
        if ex.tap is not None and ex.marks.output_events > 1:
            observe_counts(m.inter_token_seconds.labels(*base), ex.tap.gap_counts, ex.tap.gap_sum)

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
                m.decode_tokens_per_second.labels(*base, source, band).observe(value)
            if f.load_seconds is not None:
                m.load_seconds.labels(*base).observe(f.load_seconds)
        if f.prompt_tokens is not None:
            m.prompt_tokens.labels(*base).observe(f.prompt_tokens)
            if f.processed_prompt_tokens:
                m.tokens_total.labels(*base, "prefill").inc(f.processed_prompt_tokens)
            if f.cached_tokens:
                m.tokens_total.labels(*base, "cached").inc(f.cached_tokens)
        if f.completion_tokens is not None:
            m.completion_tokens.labels(*base).observe(f.completion_tokens)
            if f.completion_tokens:
                m.tokens_total.labels(*base, "decode").inc(f.completion_tokens)

        extra: dict = {}
        for listener in self.listeners:
            try:
                extra.update(listener(ex, f) or {})
            except Exception:  # a side service must never break the request path
                logging.getLogger("phasewatch").exception("request listener failed")
        self._log(ex, precision, f, extra)

    # --- the per-request line ---------------------------------------------------------

    def _log(self, ex: "Exchange", precision: str, f: Figures, extra: dict) -> None:
        if self.log_format == "none" or not access_log.isEnabledFor(logging.INFO):
            return
        fields = {
            "request_id": ex.request_id,
            "upstream": ex.upstream.name,
            "model": ex.model_label,
            "precision": precision,
            "endpoint": ex.prepared.endpoint,
            "stream": ex.prepared.stream,
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
        fields = {k: v for k, v in fields.items() if v is not None}
        if self.log_format == "json":
            line = json.dumps({"ts": time.time(), "msg": "request", **fields})
        else:
            line = "msg=request " + " ".join(f"{k}={_logfmt(v)}" for k, v in fields.items())
        access_log.info(line)


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _logfmt(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if text and all(c.isalnum() or c in "-_.:/+" for c in text):
        return text
    return json.dumps(text)
