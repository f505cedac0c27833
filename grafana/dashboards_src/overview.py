"""The Overview dashboard: where the wait goes per request phase (queue, prefill,
decode), per model and precision, from phasewatch's per-request histograms. The rows about
the engines, the clients and the fleet are in overview_engines.py."""

from __future__ import annotations

from . import overview_engines
from .common import (
    BLUE,
    GREEN,
    ORANGE,
    RED,
    SEL,
    TOKS,
    YELLOW,
    Dash,
    bargauge_panel,
    base_vars,
    heatmap_panel,
    override,
    source_var,
    steps,
    table_panel,
    target,
    timeseries_panel,
)


def build() -> dict:
    d = Dash(
        "phasewatch-overview",
        "phasewatch / Overview",
        "Where the wait goes per request phase (queue, prefill, decode), per model and "
        "precision, from phasewatch's per-request histograms.",
        ["overview"],
        base_vars() + [source_var()],
    )

    d.row("Time to first token and decode")

    def q(p: float) -> str:
        return (
            f"histogram_quantile({p}, sum by (le) (phasewatch:ttft_seconds_bucket:rate5m{{{SEL}}}))"
        )

    d.add(
        timeseries_panel(
            "Time to first token p50 / p95 / p99",
            "Time from phasewatch having the whole request to the first generated output reaching "
            "the client (proxy queue + engine queue + prefill), over 5 min windows (recording rule). "
            "The red line is the TTFTSLOBreach bound (2 s, for prompts under 6K tokens).",
            [target(q(0.5), "p50"), target(q(0.95), "p95"), target(q(0.99), "p99")],
            "s",
            steps(GREEN, (1, YELLOW), (2, RED)),
            threshold_style="line",
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "TTFT p95 by prompt length",
            "p95 time to first token per prompt band: prefill grows with the prompt, so ~8K and "
            "~16K prompts (6k-12k, 12k-24k) wait seconds where short chats wait milliseconds.",
            [
                target(
                    "histogram_quantile(0.95, sum by (prompt_band, le) "
                    f"(phasewatch:ttft_seconds_bucket:rate5m{{{SEL}}}))",
                    "{{prompt_band}}",
                )
            ],
            "s",
            steps(GREEN, (2, YELLOW), (10, RED)),
            fill=0,
        )
    )
    d.add(
        heatmap_panel(
            "Time to first token distribution (s)",
            "Per-request TTFT as a heatmap of histogram buckets. The dots are exemplars: one "
            "request per bucket with its trace id and request id, to jump from a slow bucket to "
            "the trace (--otel) and the log line.",
            [
                target(
                    "sum by (le) (increase(phasewatch_ttft_seconds_bucket"
                    f"{{{SEL}}}[$__rate_interval]))",
                    "{{le}}",
                    fmt="heatmap",
                    exemplar=True,
                )
            ],
            "s",
        )
    )
    d.add(
        heatmap_panel(
            "Decode rate distribution (tok/s)",
            "Per-request decode rate, (completion tokens - 1) / (last - first output event), as a "
            "heatmap of histogram buckets. Decode is memory-bandwidth-bound: lower precision moves "
            "this up ~2.5-3.5x from bf16 to int4. The dots are exemplars (trace id, request id).",
            [
                target(
                    "sum by (le) (increase(phasewatch_decode_tokens_per_second_bucket"
                    f'{{{SEL}, source="$source"}}[$__rate_interval]))',
                    "{{le}}",
                    fmt="heatmap",
                    exemplar=True,
                )
            ],
            TOKS,
        )
    )
    d.add(
        heatmap_panel(
            "Prefill rate distribution (tok/s)",
            "Per-request prefill rate: prompt tokens actually processed (prefix-cache hits excluded) "
            "per second of prefill. Compute-bound: precision moves it only ~1.2-1.5x.",
            [
                target(
                    "sum by (le) (increase(phasewatch_prefill_tokens_per_second_bucket"
                    f'{{{SEL}, source="$source"}}[$__rate_interval]))',
                    "{{le}}",
                    fmt="heatmap",
                )
            ],
            TOKS,
        )
    )
    d.add(
        timeseries_panel(
            "Median decode rate by model",
            "Median decode tokens/s per upstream, model and precision over 5 min, all prompt "
            "lengths (recording rule). It moves with the mix of prompt lengths (decode slows as "
            "the context grows): DecodeRateRegression watches each prompt band on its own (next "
            "panel).",
            [
                target(
                    f'phasewatch:decode_tokens_per_second:p50_5m{{{SEL}, source="$source"}}',
                    "{{model}} ({{precision}}) on {{upstream}}",
                )
            ],
            TOKS,
            steps(RED, (10, YELLOW), (25, GREEN)),
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "Decode rate by prompt length",
            "Median decode tokens/s per prompt band, model and precision over 5 min (recording "
            "rule phasewatch:decode_tokens_per_second_by_band:p50_5m). Every decode step reads "
            "the whole KV cache, so longer prompts decode slower: compare a band with itself. "
            "DecodeRateRegression fires when a band's 30 min median falls below 80 % of the same "
            "band 1 d / 7 d earlier.",
            [
                target(
                    f'phasewatch:decode_tokens_per_second_by_band:p50_5m{{{SEL}, source="$source"}}',
                    "{{model}} ({{precision}}) {{prompt_band}}",
                )
            ],
            TOKS,
            steps(RED, (10, YELLOW), (25, GREEN)),
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "Median prefill rate by model",
            "Median prefill tokens/s per upstream, model and precision over 5 min, all prompt "
            "lengths (recording rule).",
            [
                target(
                    f'phasewatch:prefill_tokens_per_second:p50_5m{{{SEL}, source="$source"}}',
                    "{{model}} ({{precision}}) on {{upstream}}",
                )
            ],
            TOKS,
            steps(RED, (100, YELLOW), (1000, GREEN)),
            fill=0,
        )
    )

    d.row("Where the wait goes")

    def per_upstream_mean(metric: str, matchers: str) -> str:
        return (
            f"sum by (upstream) (rate({metric}_sum{{{SEL}{matchers}}}[$__rate_interval])) / "
            f"sum by (upstream) (rate({metric}_count{{{SEL}{matchers}}}[$__rate_interval]))"
        )

    proxy_q = per_upstream_mean("phasewatch_queue_seconds", ', where="proxy"')
    # the engine's queue: from its per-request prefill time (Ollama, llama-server), or
    # from its own queue histogram (vLLM request_queue_time_seconds, re-exported: every
    # replica serves the same engine's numbers, so max over replicas)
    vllm_q = (
        "sum by (upstream) (max by (upstream, model, precision) "
        f"(rate(phasewatch_engine_queue_seconds_sum{{{SEL}}}[$__rate_interval]))) / "
        "sum by (upstream) (max by (upstream, model, precision) "
        f"(rate(phasewatch_engine_queue_seconds_count{{{SEL}}}[$__rate_interval])))"
    )
    own_q = per_upstream_mean("phasewatch_queue_seconds", ', where="upstream"')
    engine_q = f"({own_q}) or ({vllm_q})"
    ttft_mean = per_upstream_mean("phasewatch_ttft_seconds", "")
    d.add(
        timeseries_panel(
            "Where does TTFT go: proxy queue, engine queue, prefill",
            "Mean time to first token per upstream, split into the wait at phasewatch's own gate "
            "(--max-concurrency), the wait in the engine's queue, and prefill (the rest). The "
            "engine's queue comes from the engine's own figures: vLLM's request_queue_time_seconds "
            "(re-exported as phasewatch_engine_queue_seconds), Ollama's and llama-server's "
            "prefill time (queue = TTFT window - prefill). Where an engine reports neither (an "
            "OpenAI server of unknown make, vLLM with --engine-scrape 0), its queue is unknown "
            "and stays inside the series named 'prefill + engine queue (not reported)'.",
            [
                target(f"({proxy_q}) and on (upstream) ({ttft_mean})", "proxy queue {{upstream}}"),
                target(
                    f"({engine_q}) and on (upstream) ({ttft_mean})", "engine queue {{upstream}}"
                ),
                target(
                    f"clamp_min(({ttft_mean}) - on (upstream) ({proxy_q}) - on (upstream) ({engine_q}), 0)",
                    "prefill {{upstream}}",
                ),
                target(
                    f"clamp_min(({ttft_mean}) - on (upstream) ({proxy_q}), 0) unless on (upstream) ({engine_q})",
                    "prefill + engine queue (not reported) {{upstream}}",
                ),
            ],
            "s",
            steps(GREEN, (1, YELLOW), (2, RED)),
            stack=True,
            fill=40,
            legend_calcs=("mean", "lastNotNull"),
        )
    )
    sums = {
        "queue": f'sum(rate(phasewatch_queue_seconds_sum{{{SEL}, where="proxy"}}[$__rate_interval]))',
        "prefill": f'sum(rate(phasewatch_prefill_seconds_sum{{{SEL}, source="proxy"}}[$__rate_interval]))',
        "decode": f'sum(rate(phasewatch_decode_seconds_sum{{{SEL}, source="proxy"}}[$__rate_interval]))',
    }
    total = "(" + " + ".join(sums.values()) + ")"
    d.add(
        timeseries_panel(
            "Share of wall time: queue, prefill, decode",
            "Of all the time requests spent (not only until the first token), the share in the "
            "proxy's queue, in prefill (first output minus request sent: includes the engine's "
            "own queue; the TTFT panel beside splits it) and in decode. For chat "
            "with short prompts decode takes most of the wait; "
            "long RAG prompts shift it to prefill.",
            [target(f"{expr} / {total}", name) for name, expr in sums.items()],
            "percentunit",
            steps(GREEN),
            stack=True,
            max_=1,
            fill=60,
            legend_calcs=("mean", "lastNotNull"),
        )
    )
    band_decode = f'sum by (prompt_band) (increase(phasewatch_decode_seconds_sum{{{SEL}, source="proxy"}}[$__range]))'
    band_prefill = f'sum by (prompt_band) (increase(phasewatch_prefill_seconds_sum{{{SEL}, source="proxy"}}[$__range]))'
    d.add(
        bargauge_panel(
            "Decode share of the wait by prompt length",
            "Per prompt band, decode time over prefill + decode time across the dashboard's time "
            "range. Short prompts: almost all decode. ~16K-token RAG prompts: prefill takes a large "
            "share, so prefill speed (compute, not bandwidth) starts to matter.",
            [
                target(
                    f"{band_decode} / ({band_decode} + {band_prefill})",
                    "{{prompt_band}}",
                    instant=True,
                )
            ],
            "percentunit",
            steps(BLUE, (0.5, GREEN), (0.9, ORANGE)),
            max_=1,
        )
    )
    d.add(advice_shares(), w=12, h=8)

    d.row("Queue")
    d.add(
        timeseries_panel(
            "Queue time p95",
            "where=proxy: waiting at phasewatch's own admission gate (--max-concurrency); "
            "where=upstream: waiting inside the engine (only where the engine reports its prefill "
            "time). ProxyQueueSaturation fires above 1 s for 10 min.",
            [
                target(
                    "histogram_quantile(0.95, sum by (where, le) "
                    f"(phasewatch:queue_seconds_bucket:rate5m{{{SEL}}}))",
                    "{{where}}",
                )
            ],
            "s",
            steps(GREEN, (0.5, YELLOW), (1, RED)),
            threshold_style="line",
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "Queue depth and requests in flight",
            "Requests waiting at the proxy's admission gate and requests admitted and not finished, "
            "summed over replicas.",
            [
                target(f"sum(phasewatch_queued_requests{{{SEL}}})", "queued"),
                target(f"sum(phasewatch_in_flight_requests{{{SEL}}})", "in flight"),
            ],
            "short",
            steps(GREEN, (16, YELLOW), (64, RED)),
            decimals=0,
            fill=20,
        )
    )

    d.row("Traffic")
    d.add(
        timeseries_panel(
            "Tokens per second in and out",
            "prefill: prompt tokens processed; cached: prompt tokens served from the engine's "
            "prefix cache; decode: generated tokens. Summed over models and replicas.",
            [
                target(
                    f"sum by (phase) (rate(phasewatch_tokens_total{{{SEL}}}[$__rate_interval]))",
                    "{{phase}}",
                )
            ],
            TOKS,
            steps(GREEN),
            stack=False,
        )
    )
    d.add(
        timeseries_panel(
            "Requests per second by outcome",
            "ok, error (upstream failed: see errors by kind), aborted (client hung up), rejected "
            "(proxy queue full or queue timeout).",
            [
                target(
                    f"sum by (outcome) (rate(phasewatch_requests_total{{{SEL}}}[$__rate_interval]))",
                    "{{outcome}}",
                )
            ],
            "reqps",
            steps(GREEN),
            stack=True,
            fill=40,
        )
    )
    d.add(
        timeseries_panel(
            "Errors per second by kind",
            "connect / timeout: engine unreachable; upstream_status: the engine answered >= 400; "
            "midstream / truncated: a stream broke. UpstreamErrorRatioHigh fires above 5 %.",
            [
                target(
                    f"sum by (upstream, kind) (rate(phasewatch_errors_total{{{SEL}}}[$__rate_interval]))",
                    "{{upstream}} {{kind}}",
                )
            ],
            "reqps",
            steps(GREEN, (0.01, YELLOW), (0.1, RED)),
            stack=True,
            fill=40,
        )
    )
    d.add(
        timeseries_panel(
            "Client aborts per second by phase",
            "Requests the client hung up on, by the phase they were in (queue, prefill, decode). "
            "phasewatch cancels the upstream request at once, so the GPU stops working for it.",
            [
                target(
                    f"sum by (phase) (rate(phasewatch_aborts_total{{{SEL}}}[$__rate_interval]))",
                    "{{phase}}",
                )
            ],
            "reqps",
            steps(GREEN, (0.1, YELLOW)),
            stack=True,
            fill=40,
        )
    )
    d.add(
        timeseries_panel(
            "In flight by model and precision",
            "Requests being served now per model, summed over replicas.",
            [
                target(
                    f"sum by (model, precision) (phasewatch_in_flight_requests{{{SEL}}})",
                    "{{model}} ({{precision}})",
                )
            ],
            "short",
            steps(GREEN, (16, YELLOW), (64, RED)),
            decimals=0,
            fill=20,
            stack=True,
        )
    )
    d.add(
        timeseries_panel(
            "Request duration p95 by outcome",
            "Whole request, from phasewatch having it to the response complete or aborted. The "
            "dots are exemplars: single requests with their trace id and request id.",
            [
                target(
                    "histogram_quantile(0.95, sum by (outcome, le) "
                    f"(rate(phasewatch_request_seconds_bucket{{{SEL}}}[$__rate_interval])))",
                    "{{outcome}}",
                    exemplar=True,
                )
            ],
            "s",
            steps(GREEN, (30, YELLOW), (120, RED)),
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "Gap between output events p50 / p99",
            "Inter-token latency as the client sees it (an event may carry more than one token). "
            "Spikes at p99 with a flat p50 point to prefills of other requests stalling decode.",
            [
                target(
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(phasewatch_inter_token_seconds_bucket{{{SEL}}}[$__rate_interval])))",
                    "p50",
                ),
                target(
                    "histogram_quantile(0.99, sum by (le) "
                    f"(rate(phasewatch_inter_token_seconds_bucket{{{SEL}}}[$__rate_interval])))",
                    "p99",
                ),
            ],
            "s",
            steps(GREEN, (0.1, YELLOW), (0.5, RED)),
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "Tokens per request p50",
            "Median prompt and completion length in tokens, as the engine counted them.",
            [
                target(
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(phasewatch_prompt_tokens_bucket{{{SEL}}}[$__rate_interval])))",
                    "prompt",
                ),
                target(
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(phasewatch_completion_tokens_bucket{{{SEL}}}[$__rate_interval])))",
                    "completion",
                ),
            ],
            "short",
            steps(GREEN, (8192, YELLOW), (32768, RED)),
            fill=0,
            log=True,
            min_=None,
        )
    )

    overview_engines.engine_rows(d)
    overview_engines.physics(d)
    overview_engines.fleet(d)
    return d.json()


def advice_shares():
    """The advice's first figures (proxy.measure.advice, ``phasewatch advise``) over the
    time range: per model, the shares of wall time in queue, prefill and decode, read as
    the advice reads them: the engine's own prefill time where it reports one (and the
    engine-side wait it tells, in the queue), else the proxy's, with the engine's own
    queue time (vLLM's queue histogram) moved to the queue."""
    by = "upstream, model, precision"

    def s(metric: str, matchers: str = "") -> str:
        return f"sum by ({by}) (increase(phasewatch_{metric}{{{SEL}{matchers}}}[$__range]))"

    pre_engine = s("prefill_seconds_sum", ', source="engine"')
    pre_proxy = s("prefill_seconds_sum", ', source="proxy"')
    engine_q = s("engine_queue_seconds_sum")
    # min(the engine's queue, the proxy's prefill), where only the proxy timed prefill
    moved = f"((({engine_q}) < ({pre_proxy})) or (({pre_proxy}) and ({engine_q}))) unless ({pre_engine})"
    engine_side = s("queue_seconds_sum", ', where="upstream"')
    proxy_q = s("queue_seconds_sum", ', where="proxy"')
    queue = f"({proxy_q} + ({engine_side} or {moved} or 0 * {proxy_q}))"
    prefill = f"({pre_engine} or ({pre_proxy} - ({moved} or 0 * {pre_proxy})))"
    by_proxy, by_engine = ', source="proxy"', ', source="engine"'
    decode = f"({s('decode_seconds_sum', by_proxy)} or {s('decode_seconds_sum', by_engine)})"
    phases = " or ".join(
        f'label_replace({e}, "phase", "{name}", "", "")'
        for name, e in (("queue", queue), ("prefill", prefill), ("decode", decode))
    )
    requests = s("requests_total", ', outcome="ok"')
    return table_panel(
        "Which phase to tune: shares of wall time per model (advice)",
        "The figures phasewatch advise starts from, per upstream, model and precision over "
        "the time range: the share of wall time spent in queue, prefill and decode (the "
        "largest is the phase to tune first), and the requests they rest on (answered "
        "in full). Read as the advice reads them: prefill is the "
        "engine's own prefill time where it reports one, else phasewatch's clock with the "
        "engine's own queue time moved to the queue. The levers and their evidence are "
        "text, not metrics: see the status page's advice panel, GET /phasewatch/api/advice "
        "or phasewatch advise --from PROMETHEUS --window RANGE; advice names no lever "
        "before 30 measured requests.",
        [
            target(
                f"({phases}) / on ({by}) group_left () sum by ({by}) ({phases})",
                "share",
                instant=True,
                fmt="table",
            ),
            target(requests, "requests", instant=True, fmt="table"),
        ],
        [
            override("share of wall time", unit="percentunit", decimals=0),
            override("requests", unit="none", decimals=0),
        ],
        steps(GREEN),
        organize={
            "excludeByName": {"Time": True},
            "indexByName": {"upstream": 0, "model": 1, "precision": 2, "phase": 3},
            "renameByName": {"Value #A": "share of wall time", "Value #B": "requests"},
        },
    )
