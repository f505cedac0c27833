"""Every Prometheus object phasewatch exports, defined in this one module.

Names and labels are a contract: the bundled dashboards, the alert rules and users'
queries depend on them. Label values are bounded by the callers: `model` is
one of the upstream's listed models or ``other``, `precision` a small vocabulary,
`prompt_band` one of :data:`PROMPT_BANDS`.

Histograms are observed once per request (the relay keeps per-request aggregates, e.g.
inter-token gap bucket counts, and hands them over at the end), so the per-event hot
loop never touches a lock in here. Their bucket bounds are in :mod:`proxy.measure.buckets`.
"""

from __future__ import annotations

import bisect
import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.gc_collector import GCCollector

from .buckets import (
    DURATION_BUCKETS,
    GAP_BUCKETS,
    KV_BYTES_BUCKETS,
    LATENCY_BUCKETS,
    RATE_BUCKETS,
    TOKEN_BUCKETS,
    TPOT_BUCKETS,
    WATT_BUCKETS,
)
from .engine_series import EngineSeries
from .labels import LabelBound

# One `_created` series per counter and histogram child doubles the exposition for
# nothing a dashboard uses; Prometheus works out resets itself.
disable_created_metrics()

#: Set by proxy.runtime.workers for --workers N: every worker writes its samples there.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

PREFIX = "phasewatch_"

# --- prompt bands ----------------------------------------------------------------------

#: Upper bounds (exclusive) and names of the prompt-length bands. They are centred on the
#: prompt sizes the benchmark table reports (prefill at ~4K (2k-6k) and ~16K
#: (12k-24k) tokens, TTFT at ~8K (6k-12k)), because decode and prefill both change with
#: context.
_BAND_BOUNDS = (2048, 6144, 12288, 24576, 65536)
_BAND_NAMES = ("0-2k", "2k-6k", "6k-12k", "12k-24k", "24k-64k", "64k+")
PROMPT_BANDS = _BAND_NAMES + ("unknown",)


def status_class(status: int) -> str:
    """The bounded `status_class` label of an HTTP status (``none``: no answer yet)."""
    return f"{status // 100}xx" if 100 <= status <= 599 else "none"


def prompt_band(prompt_tokens: int | None) -> str:
    """The bounded `prompt_band` label for a prompt of this many tokens."""
    if prompt_tokens is None or prompt_tokens < 0:
        return "unknown"
    return _BAND_NAMES[bisect.bisect_right(_BAND_BOUNDS, prompt_tokens)]


# --- batch bands -----------------------------------------------------------------------

#: Upper bounds (inclusive) and names of the `batch` label: requests of one upstream and
#: model in flight when a request was admitted, itself included.
_BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64)
BATCH_BANDS = ("1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", "65+")


def batch_band(in_flight: int) -> str:
    """The bounded `batch` label for a request admitted with this many in flight."""
    return BATCH_BANDS[bisect.bisect_left(_BATCH_BOUNDS, max(1, in_flight))]


# --- label sets ------------------------------------------------------------------------

BASE = ("upstream", "model", "precision")
OUTCOMES = ("ok", "error", "aborted", "rejected")
SOURCES = ("proxy", "engine")


class Metrics:
    """All metric objects, registered on one registry (one per proxy instance, so tests
    can run several proxies in one process; multiprocess mode reads files instead)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        #: What /metrics exposes: this registry, or every worker's under --workers N.
        self.exposition = exposition_registry(self.registry)
        if self.exposition is r:  # process_* and python_* describe one process only
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)

        def hist(name: str, doc: str, extra: tuple[str, ...], buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, BASE + extra, buckets=buckets, registry=r)

        # Request phases (see proxy.measure.timeline).
        self.queue_seconds = hist(
            "queue_seconds",
            "Time a request waited before work on it began: where=proxy is the proxy's "
            "admission queue; where=upstream is the engine-side wait (TTFT window minus "
            "the engine's own prefill time), only where the engine reports prefill time.",
            ("where",),
            LATENCY_BUCKETS,
        )
        self.ttft_seconds = hist(
            "ttft_seconds",
            "Time to first token as the client feels it: from the proxy having the whole "
            "request to forwarding the first event that carries generated output.",
            ("prompt_band",),
            LATENCY_BUCKETS,
        )
        self.prefill_seconds = hist(
            "prefill_seconds",
            "Prompt processing time: source=engine is the engine's own figure "
            "(llama-server prompt_ms, Ollama prompt_eval_duration); source=proxy is "
            "first output event minus request written upstream (includes engine queue).",
            ("source", "prompt_band"),
            LATENCY_BUCKETS,
        )
        self.prefill_tokens_per_second = hist(
            "prefill_tokens_per_second",
            "Prompt tokens actually processed (prefix-cache hits excluded) per second of prefill.",
            ("source", "prompt_band"),
            RATE_BUCKETS,
        )
        self.decode_seconds = hist(
            "decode_seconds",
            "Decode time: first to last output event (source=proxy) or the engine's own "
            "figure (source=engine).",
            ("source", "prompt_band"),
            DURATION_BUCKETS,
        )
        self.decode_tokens_per_second = hist(
            "decode_tokens_per_second",
            "Decode rate: (completion_tokens - 1) / decode_seconds for requests with at "
            "least 2 generated tokens (source=proxy), or the engine's own rate "
            "(source=engine).",
            ("source", "prompt_band"),
            RATE_BUCKETS,
        )
        self.inter_token_seconds = hist(
            "inter_token_seconds",
            "Gaps between successive output events of a stream (an event may carry more "
            "than one token when the engine merges them), by prompt band (each step reads "
            "the whole context, so gaps grow with it).",
            ("prompt_band",),
            GAP_BUCKETS,
        )
        self.request_seconds = hist(
            "request_seconds",
            "Whole request, from the proxy having it to the response complete or aborted "
            "(end-to-end latency, as vLLM's e2e_request_latency_seconds), by endpoint "
            "(chat, completions, embeddings, ...).",
            ("endpoint", "outcome"),
            DURATION_BUCKETS,
        )
        self.time_per_output_token_seconds = hist(
            "time_per_output_token_seconds",
            "Time per output token of one request: decode_seconds / (completion_tokens - 1), "
            "for requests with at least 2 generated tokens (as vLLM's "
            "request_time_per_output_token_seconds); source=proxy from the stream's events, "
            "source=engine from the engine's own decode time. (By prompt length: "
            "decode_tokens_per_second's prompt_band.)",
            ("source",),
            TPOT_BUCKETS,
        )
        self.kv_cache_bytes = hist(
            "kv_cache_bytes",
            "KV-cache bytes one request held at its end: 2 x layers x kv_heads x head_dim x "
            "bytes per element x (prompt + completion tokens), layers with a sliding window "
            "counting at most the window's tokens. Only for models whose shape and cache "
            "element type are known (see model_kv_bytes_per_token).",
            (),
            KV_BYTES_BUCKETS,
        )
        self.prompt_tokens = hist(
            "prompt_tokens",
            "Prompt tokens per request, as the engine counted them.",
            (),
            TOKEN_BUCKETS,
        )
        self.completion_tokens = hist(
            "completion_tokens",
            "Generated tokens per request, as the engine counted them.",
            (),
            TOKEN_BUCKETS,
        )
        self.load_seconds = hist(
            "load_seconds",
            "Engine-reported model load / scheduling time (Ollama load_duration), kept out "
            "of the prefill figures.",
            (),
            LATENCY_BUCKETS,
        )

        # Counters.
        # `client` (a named key's client, a listed --client-header value, `other` or
        # `unknown`) is on the counters people charge back by, never on the histograms.
        self.requests_total = Counter(
            PREFIX + "requests",
            "Measured generation requests by outcome (ok, error, aborted, rejected), "
            "endpoint and client.",
            BASE + ("endpoint", "outcome", "client"),
            registry=r,
        )
        self.tokens_total = Counter(
            PREFIX + "tokens",
            "Tokens by phase and client: prefill = prompt tokens processed, "
            "cached = prompt tokens served from the engine's prefix cache, decode = "
            "generated tokens.",
            BASE + ("phase", "client"),
            registry=r,
        )
        # Decode by batch: what batching does to the rate, per stream and in all.
        self.decode_batch_requests_total = Counter(
            PREFIX + "decode_batch_requests",
            "Streamed requests with a decode rate (proxy clock), by batch: the requests of "
            "their upstream and model in flight when they were admitted, themselves "
            "included (1, 2, 3-4, 5-8, 9-16, 17-32, 33-64, 65+).",
            BASE + ("batch",),
            registry=r,
        )
        self.decode_batch_seconds_total = Counter(
            PREFIX + "decode_batch_seconds",
            "Decode seconds (first to last output event) of those requests, by batch.",
            BASE + ("batch",),
            registry=r,
        )
        self.decode_batch_tokens_total = Counter(
            PREFIX + "decode_batch_tokens",
            "Tokens generated after the first by those requests, by batch: over "
            "decode_batch_seconds, the decode rate of one stream at that batch.",
            BASE + ("batch",),
            registry=r,
        )
        self.errors_total = Counter(
            PREFIX + "errors",
            "Failed requests by kind: connect, timeout, pool (no free upstream connection), "
            "upstream_status (engine answered >= 400), midstream (error event in a "
            "stream), truncated (stream ended without its terminator), protocol; and "
            "oversized (a stream event over --max-event-bytes passed through unmeasured), "
            "undecodable (an answer in a coding not decoded, passed through unmeasured), "
            "decode_limit (an answer decoded to its cap, or in stacked codings: refused); "
            "status_class is the class of the status the client got (2xx, 4xx, 5xx; none "
            "before any): a 4xx the engine answered is most often the client's own error.",
            BASE + ("kind", "status_class"),
            registry=r,
        )
        self.rejected_total = Counter(
            PREFIX + "rejected",
            "Requests refused on the wire before they reached an upstream, by reason: "
            "head_too_large (431), header_timeout (408 or closed), body_too_large (413), "
            "body_memory (503, --max-body-memory), body_timeout (408), bad_path (400), "
            "upgrade (501), pipeline_full (429), trailers_too_large (431), admin_api (403), "
            "pool_down (503), bad_chunked (400, a malformed chunked body), loop (508, a "
            "request that came back to the proxy that sent it), too_many_headers (431, "
            "--max-header-fields), bad_version (505); and "
            "stalled_stream (an answer closed past --max-stalled-streams).",
            ("reason",),
            registry=r,
        )
        self.aborts_total = Counter(
            PREFIX + "aborts",
            "Requests the client hung up on, by the phase they were "
            "in: queue, prefill, decode, usage (after the last token, before the end).",
            BASE + ("phase",),
            registry=r,
        )

        # Gauges.
        self.in_flight_requests = Gauge(
            PREFIX + "in_flight_requests",
            "Measured requests admitted and not finished.",
            BASE,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queued_requests = Gauge(
            PREFIX + "queued_requests",
            "Measured requests waiting at the proxy's admission gate.",
            BASE,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.upstream_up = Gauge(
            PREFIX + "upstream_up",
            "1 while the upstream is up (its last model-list or health probe answered, and no "
            "request since was refused or cut), else 0.",
            ("upstream", "engine"),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.model_kv_bytes_per_token = Gauge(
            PREFIX + "model_kv_bytes_per_token",
            "KV-cache bytes per token of a served model: 2 x layers x kv_heads x head_dim x "
            "bytes per element of the engine's cache (kv_dtype). For models with "
            "sliding-window layers (Gemma 2/3) it is the full-attention upper bound: beyond "
            "the window only the global layers grow. NaN with kv_dtype=unknown where the "
            "model's shape or the cache's element type is unknown.",
            ("upstream", "model", "precision", "kv_dtype"),
            registry=r,
            multiprocess_mode="max",
        )
        self.model_info = Gauge(
            PREFIX + "model_info",
            "1 for each model an upstream serves, with its "
            "normalised precision, raw quantisation scheme (quant) and model family (the "
            "name without publisher and quantisation markers: what precisions are compared "
            "within).",
            ("upstream", "model", "precision", "quant", "precision_source", "family"),
            registry=r,
            multiprocess_mode="max",
        )

        self.endpoint_info = Gauge(
            PREFIX + "endpoint_info",
            "1 for each measured endpoint label, with its kind: generation (tapped as it is "
            "generated: TTFT, decode) or whole_body (one answer: embeddings, rerank ...). "
            "Dashboards and rules select by kind (and on (endpoint)), never by listing "
            "endpoints, so a new engine's endpoints join them unchanged.",
            ("endpoint", "kind"),
            registry=r,
            multiprocess_mode="max",
        )

        # GPU power, fed by proxy.services.power.
        self.gpu_power_watts = hist(
            "gpu_power_watts",
            "Per-request mean GPU power over its prefill or decode "
            "window (the GPUs of the request's upstream, summed).",
            ("phase",),
            WATT_BUCKETS,
        )
        # GPU-keyed series carry the model and precision the GPU serves (from
        # --power-gpu; "all" and the common precision or "mixed" when it serves several),
        # so rate(energy) / rate(tokens) by precision is joules per token.
        self.gpu_energy_joules_total = Counter(
            PREFIX + "gpu_energy_joules",
            "GPU energy (the device's energy counter where supported, else integrated power).",
            BASE + ("gpu",),
            registry=r,
        )
        self.request_energy_joules_total = Counter(
            PREFIX + "request_energy_joules",
            "GPU energy attributed to requests, by client: each request's share of its "
            "GPUs' energy from sending it upstream to its last token (split evenly among "
            "the requests in flight). Idle energy is nobody's: the sum over clients stays "
            "below gpu_energy_joules_total.",
            BASE + ("client",),
            registry=r,
        )
        self.gpu_power_sample_watts = Histogram(
            PREFIX + "gpu_power_sample_watts",
            "Power samples, classified by what the "
            "proxy had in flight on the GPU's upstream: idle, prefill, decode. A sample "
            "read before the state had held as long as the reading may describe (the "
            "sensor's refresh, an exporter's lag, a 1 s mean), or while it changed, is "
            "in no state.",
            BASE + ("gpu", "state"),
            buckets=WATT_BUCKETS,
            registry=r,
        )
        self.gpu_power_current_watts = Gauge(
            PREFIX + "gpu_power_current_watts",
            "Latest power sample per GPU (absent while power is not being sampled).",
            BASE + ("gpu",),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.gpu_sensor_rejected_total = Counter(
            PREFIX + "gpu_sensor_rejected",
            "GPU power sensor readings refused, by reason: not_finite, negative, too_high "
            "(above twice the power limit or --power-max-watts), counter_backwards, "
            "counter_jump (a step implying more), page_too_large (gpu 'all').",
            ("gpu", "reason"),
            registry=r,
        )
        self.power_sampling_up = Gauge(
            PREFIX + "power_sampling_up",
            "1 while GPU power is being sampled, 0 when "
            "the power source failed or none is configured.",
            ("source",),
            registry=r,
            multiprocess_mode="livemostrecent",
        )

        # --- GPU power as the sensor resolves it ---------------------------
        self.request_phase_energy_joules_total = Counter(
            PREFIX + "request_phase_energy_joules",
            "GPU energy attributed to requests by phase: energy-counter deltas at the "
            "sensor's resolution, each moment's split evenly among the requests running "
            "(the engine's count, or phasewatch's in flight when more). With "
            "gpu_unattributed_energy_joules_total and gpu_idle_energy_joules_total it adds "
            "up to gpu_energy_joules_total.",
            BASE + ("phase",),
            registry=r,
        )
        self.gpu_idle_energy_joules_total = Counter(
            PREFIX + "gpu_idle_energy_joules",
            "GPU energy while no request was in flight on the GPU.",
            BASE + ("gpu",),
            registry=r,
        )
        self.request_energy_requests_total = Counter(
            PREFIX + "request_energy_requests",
            "Requests whose GPU energy was settled (result settled: their share is in "
            "request_energy_joules_total) or could not be (unresolved: shorter than the "
            "sampling, or the sensor never covered them), by client.",
            BASE + ("client", "result"),
            registry=r,
        )
        self.gpu_unattributed_energy_joules_total = Counter(
            PREFIX + "gpu_unattributed_energy_joules",
            "GPU energy owed to requests phasewatch did not relay (reason not_relayed: "
            "the engine's own count of requests running exceeded phasewatch's in flight: "
            "other replicas' or direct clients' requests). Attributed + unattributed + idle "
            "add up to gpu_energy_joules_total.",
            BASE + ("gpu", "reason"),
            registry=r,
        )
        self.power_engine_count_up = Gauge(
            PREFIX + "power_engine_count_up",
            "1 while the engine's own count of running requests is read for dividing GPU "
            "energy; 0 where the engine gives none (Ollama, a generic OpenAI server: "
            "attribution then assumes phasewatch relays every request the GPU runs). A "
            "count not read for 2 s is not used.",
            ("upstream",),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.gpu_power_unresolved_total = Counter(
            PREFIX + "gpu_power_unresolved",
            "Request phases too short for the GPU power sensor's resolution (or sampled "
            "too coarsely): no gpu_power_watts observation was made for them.",
            BASE + ("phase",),
            registry=r,
        )
        self.gpu_power_sensor_info = Gauge(
            PREFIX + "gpu_power_sensor_info",
            "1 for the field phase energy is taken from on each GPU: energy_counter, "
            "power_instant, power_usage or power_average.",
            ("gpu", "source", "field"),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.gpu_power_resolution_seconds = Gauge(
            PREFIX + "gpu_power_resolution_seconds",
            "The shortest request phase whose power is measured on this GPU, from the "
            "sensor's measured refresh period.",
            ("gpu",),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.gpu_power_refresh_seconds = Gauge(
            PREFIX + "gpu_power_refresh_seconds",
            "Measured refresh period of each power field the source has (how often its "
            "value really changes).",
            ("gpu", "field"),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        # energy per token by phase, fitted from many requests (proxy.measure.energy_fit)
        self.gpu_energy_per_token_joules = Gauge(
            PREFIX + "gpu_energy_per_token_joules",
            "GPU energy per prompt token (phase=prefill) or per output token (phase=decode) "
            "fitted over the energy counter's steps from many requests, the board's whole "
            "draw while the phase runs; bound=estimate, or low / high of its 95 % interval. "
            "Absent until the interval is within 10 %.",
            BASE + ("phase", "bound"),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.gpu_power_fitted_watts = Gauge(
            PREFIX + "gpu_power_fitted_watts",
            "GPU power while the phase runs, from the fit: gpu_energy_per_token_joules times "
            "the phase's tokens per second. Absent until the fit is tight.",
            BASE + ("phase",),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.gpu_energy_fit_requests = Gauge(
            PREFIX + "gpu_energy_fit_requests",
            "Requests the energy-per-token fit of this phase rests on (its window).",
            BASE + ("phase",),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        # phasewatch demo's own traffic generator, so a benchmark of the demo can tell
        self.demo_traffic_requests_per_second = Gauge(
            PREFIX + "demo_traffic_requests_per_second",
            "phasewatch demo only: the mean rate of its own traffic generator (requests/s; "
            "0: off, or not the demo).",
            registry=r,
            multiprocess_mode="max",
        )
        # --- end GPU power as the sensor resolves it ----------------------------------

        # The engines' own state, scraped by proxy.services.engine_state off the request
        # path: what phasewatch cannot see per request.
        def engine_gauge(name: str, doc: str) -> Gauge:
            return Gauge(
                PREFIX + "engine_" + name, doc, BASE, registry=r, multiprocess_mode="livemostrecent"
            )

        self.engine_requests_running = engine_gauge(
            "requests_running",
            "Requests the engine says it is running (vLLM "
            "num_requests_running, llama-server requests_processing or busy slots).",
        )
        self.engine_requests_waiting = engine_gauge(
            "requests_waiting",
            "Requests waiting inside the engine (vLLM "
            "num_requests_waiting, llama-server requests_deferred).",
        )
        self.engine_kv_cache_usage_ratio = engine_gauge(
            "kv_cache_usage_ratio",
            "Share of the engine's KV cache in use, 0..1 (vLLM "
            "kv_cache_usage_perc; llama-server kv_cache_usage_ratio or tokens held in busy "
            "slots over the slots' context).",
        )
        self.engine_kv_cache_capacity_tokens = engine_gauge(
            "kv_cache_capacity_tokens",
            "Tokens the engine's KV cache holds in all (vLLM num_gpu_blocks x block_size from "
            "cache_config_info; llama-server: the slots' contexts together).",
        )
        self.engine_slots = engine_gauge(
            "slots",
            "Requests the engine runs at once at most, where it has a fixed number of "
            "sequences: llama-server's slots (-np); more wait in its queue however much KV "
            "cache is free.",
        )
        self.engine_model_loaded = engine_gauge(
            "model_loaded", "1 for each model the engine has loaded (Ollama /api/ps)."
        )
        self.engine_model_vram_bytes = engine_gauge(
            "model_vram_bytes", "Bytes of a loaded model in GPU memory (Ollama size_vram)."
        )
        self.engine_model_size_bytes = engine_gauge(
            "model_size_bytes", "Bytes of a loaded model in all (Ollama size)."
        )
        self.engine_model_expiry_seconds = engine_gauge(
            "model_expiry_seconds",
            "Seconds until the engine unloads an idle model (Ollama expires_at).",
        )
        # OpenTelemetry export (--otel), fed by proxy.services.tracing.
        self.otel_spans_dropped_total = Counter(
            PREFIX + "otel_spans_dropped",
            "Spans not delivered: reason=queue_full (the batch queue, OTEL_BSP_MAX_QUEUE_SIZE, "
            "was full) or export_failed (the OTLP endpoint refused or could not be reached) "
            "or shutdown (still queued when --otel-shutdown-timeout ran out).",
            ("reason",),
            registry=r,
        )
        # What the proxy refused of what engines said (proxy.measure.sanity, .labels).
        self.engine_values_dropped_total = Counter(
            PREFIX + "engine_values_dropped",
            "Values in an engine's usage or timings that cannot be true (negative, not a "
            "number, not finite, beyond proxy.measure.sanity's bounds), dropped by field; "
            "the request is measured without them.",
            ("upstream", "field"),
            registry=r,
        )
        self.label_values_folded_total = Counter(
            PREFIX + "label_values_folded",
            "Names from the wire refused as label values (longer than --max-label-length "
            "or not printable), by label, counted at each model-list read: requests for "
            "them are labelled other.",
            ("upstream", "label"),
            registry=r,
        )
        #: Bounds every label value taken from the wire.
        self.labels = LabelBound(self.label_values_folded_total)
        #: The engines' own counters and histograms, re-exported as they were scraped.
        self.engine_series = EngineSeries(PREFIX, BASE, ENGINE_COUNTERS, ENGINE_HISTOGRAMS)
        self.exposition.register(self.engine_series)
        self.engine_scrape_up = Gauge(
            PREFIX + "engine_scrape_up",
            "1 when the last scrape of the engine's own state worked, else 0.",
            ("upstream", "engine"),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        # Fleets: health ejections and pools of upstreams serving one model.
        self.upstream_ejections_total = Counter(
            PREFIX + "upstream_ejections",
            "Times an upstream was marked down at once, by kind: connect (refused or "
            "unreachable), timeout (no connection in time), protocol (closed without an "
            "answer), midstream (a response cut), http_5xx (--eject-after-5xx answers in a "
            "row), probe (the idle health probe failed).",
            ("upstream", "kind"),
            registry=r,
        )
        self.pool_members = Gauge(
            PREFIX + "pool_members",
            "Upstreams listing the pool's model (a pool: two or more upstreams serving one model).",
            ("pool",),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.pool_members_up = Gauge(
            PREFIX + "pool_members_up",
            "Members of the pool that are up (not ejected).",
            ("pool",),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.pool_share = Gauge(
            PREFIX + "pool_share",
            "Each member's share of the pool's recent requests (an average over about "
            "the last 64 picks; 0..1).",
            ("pool", "upstream"),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.pool_retries_total = Counter(
            PREFIX + "pool_retries",
            "Requests that could not be sent to one member (no byte reached it) and were "
            "sent to another member of the pool.",
            ("pool",),
            registry=r,
        )
        # Stalled streams (proxy.services.stall): output that stopped advancing.
        self.stalled_streams = Gauge(
            PREFIX + "stalled_streams",
            "Streams in flight to the upstream whose output has not advanced for longer "
            "than it should (their prompt at the measured prefill rate before the first "
            "token, many gaps at the measured decode rate after it; never less than "
            "--stall-floor).",
            ("upstream",),
            registry=r,
            multiprocess_mode="livesum",
        )
        self.stream_longest_silence_seconds = Gauge(
            PREFIX + "stream_longest_silence_seconds",
            "Longest time any stream in flight to the upstream has gone without output "
            "(since it was sent, before its first token), stalled or not.",
            ("upstream",),
            registry=r,
            multiprocess_mode="livemax",
        )
        self.client_held_streams = Gauge(
            PREFIX + "client_held_streams",
            "Streams in flight to the upstream held back by their own client (it stopped "
            "reading, so the proxy paused reading the engine): never counted as stalled.",
            ("upstream",),
            registry=r,
            multiprocess_mode="livesum",
        )
        self.stalls_total = Counter(
            PREFIX + "stalls",
            "Streams that stalled, by the phase they stalled in: prefill (no first "
            "token) or decode.",
            ("upstream", "phase"),
            registry=r,
        )


#: The engine series re-exported: key -> (phasewatch name, help). Counters, then histograms.
ENGINE_COUNTERS = {
    "preemptions": (
        "engine_preemptions",
        "Requests the engine preempted (its KV cache was full) and recomputed later, as "
        "the engine counts them (vLLM num_preemptions).",
    ),
    "prefix_cache_queries": (
        "engine_prefix_cache_queries",
        "Prompt tokens the engine looked up in its prefix cache (vLLM prefix_cache_queries).",
    ),
    "prefix_cache_hits": (
        "engine_prefix_cache_hits",
        "Prompt tokens the engine found in its prefix cache (vLLM prefix_cache_hits).",
    ),
    "energy_joules": (
        "engine_energy_joules",
        "GPU energy as the engine itself reports it (TensorRT-LLM /energy_metrics: NVML, "
        "every GPU of the server together): a cross-check for phasewatch's own GPU energy, "
        "not a substitute (it cannot be split by phase or request).",
    ),
}
ENGINE_HISTOGRAMS = {
    "ttft": (
        "engine_ttft_seconds",
        "Time to first token as the engine measures it (vLLM time_to_first_token_seconds, "
        "its own buckets): compare with phasewatch_ttft_seconds, what the client feels.",
    ),
    "e2e": (
        "engine_e2e_request_seconds",
        "End-to-end request latency as the engine measures it (vLLM "
        "e2e_request_latency_seconds, its own buckets).",
    ),
    "tpot": (
        "engine_time_per_output_token_seconds",
        "Time per output token as the engine measures it (vLLM "
        "request_time_per_output_token_seconds, its own buckets).",
    ),
    "queue": (
        "engine_queue_seconds",
        "Time requests waited in the engine's own queue before it scheduled them, as the "
        "engine measures it (vLLM request_queue_time_seconds, its own buckets): the "
        "engine-side part of TTFT.",
    ),
}


def exposition_registry(registry: CollectorRegistry) -> CollectorRegistry:
    """The registry to expose: `registry` itself, or, in prometheus-client multiprocess
    mode (``PROMETHEUS_MULTIPROC_DIR`` set, as proxy.runtime.workers does), one
    that reads every worker's files: counters and histograms summed, gauges combined per
    their ``multiprocess_mode``."""
    path = os.environ.get(MULTIPROC_ENV)
    if not path:
        return registry
    from prometheus_client import multiprocess

    combined = CollectorRegistry()
    multiprocess.MultiProcessCollector(combined, path=path)
    return combined


def observe_counts(child, counts: list[int], total: float) -> None:
    """Add pre-bucketed observations to a histogram child in one go.

    The relay buckets inter-token gaps itself (a list index increment per event) and
    hands the counts over once per request: observing each gap would take a lock per
    token. prometheus-client has no public bulk API, so this touches its bucket values,
    which have the same ``inc`` interface in single- and multi-process mode. That private
    API is why pyproject.toml caps prometheus-client below the next minor release, and
    tests/e2e/observability/test_own_api.py checks it is still there.
    """
    n = 0
    buckets = child._buckets
    for i, c in enumerate(counts):
        if c:
            buckets[i].inc(c)
            n += c
    if n:
        child._sum.inc(total)
