"""The Overview dashboard's rows about the engines (their state, the models they serve,
whole-body requests, the vLLM-parity figures, the KV cache), the clients and the fleet of
replicas, appended after the phase rows so every panel keeps its id."""

from __future__ import annotations

from .common import (
    BLUE,
    GREEN,
    RED,
    SEL,
    TOKS,
    UP,
    YELLOW,
    Dash,
    bargauge_panel,
    generation,
    override,
    stat_panel,
    steps,
    table_panel,
    target,
    timeseries_panel,
    value_map,
    whole_body,
)

#: The recorded end-to-end latency buckets of completed requests, by endpoint.
REQUEST_BUCKETS = f"phasewatch:request_seconds_bucket:rate5m{{{SEL}}}"


def engine_rows(d: Dash) -> None:
    """Engine state, upstreams and models, clients."""
    d.row("Engine state")
    d.add(
        timeseries_panel(
            "Engine KV-cache usage",
            "Share of each engine's KV cache in use, scraped from the engine itself (vLLM "
            "kv_cache_usage_perc; llama-server: tokens in busy slots / slot context). Long chats "
            "fill it: near 100 % the engine preempts or queues requests (max over replicas, "
            "which all scrape the same engine).",
            [
                target(
                    f"max by (upstream, model) (phasewatch_engine_kv_cache_usage_ratio{{{SEL}}})",
                    "{{upstream}} {{model}}",
                )
            ],
            "percentunit",
            steps(GREEN, (0.8, YELLOW), (0.95, RED)),
            max_=1,
            fill=10,
        )
    )
    d.add(
        timeseries_panel(
            "Engine requests running and waiting",
            "The engine's own count of requests being generated and waiting in its scheduler "
            "(vLLM num_requests_running / waiting; llama-server busy slots; max over replicas). "
            "Waiting here and not in phasewatch's queue means the engine is the bottleneck.",
            [
                target(
                    f"max by (upstream, model) (phasewatch_engine_requests_running{{{SEL}}})",
                    "running {{upstream}} {{model}}",
                ),
                target(
                    f"max by (upstream, model) (phasewatch_engine_requests_waiting{{{SEL}}})",
                    "waiting {{upstream}} {{model}}",
                ),
            ],
            "short",
            steps(GREEN, (16, YELLOW), (64, RED)),
            decimals=0,
            fill=10,
        )
    )

    d.row("Upstreams and models")
    d.add(
        stat_panel(
            "Upstreams",
            "Whether each engine answers phasewatch's model-list probe (worst over replicas). "
            "UpstreamDown fires after 2 min down.",
            [
                target(
                    f"min by (upstream, engine) (phasewatch_upstream_up{{{UP}}})",
                    "{{upstream}} ({{engine}})",
                    instant=True,
                )
            ],
            "none",
            steps(RED, (1, GREEN)),
            color_mode="background",
            mappings=value_map({"0": ("down", RED), "1": ("up", GREEN)}),
        ),
        w=8,
        h=6,
    )
    d.add(
        table_panel(
            "Models served",
            "Every model each upstream serves, with its normalised precision, raw quantisation "
            "scheme and where the precision came from (config, engine or name).",
            [
                target(
                    f"max by (upstream, model, precision, quant, precision_source) (phasewatch_model_info{{{SEL}}})",
                    instant=True,
                    fmt="table",
                )
            ],
            [override("Value", custom__hidden=True)],
            steps(GREEN),
            organize={
                "excludeByName": {"Time": True, "Value": True},
                "indexByName": {},
                "renameByName": {"precision_source": "precision from"},
            },
        ).unit("string"),  # label values: text, not numbers
        w=16,
        h=6,
    )
    stalled = f"sum by (upstream) (phasewatch_stalled_streams{{{UP}}})"
    d.add(
        timeseries_panel(
            "Stalled streams",
            "Streams in flight to each upstream whose output has not advanced for longer than "
            "the measured rates allow (their prompt at the measured prefill rate before the "
            "first token, many gaps at the measured decode rate after it; never less than "
            "--stall-floor), summed over replicas. Above 0 the upstream is degraded: its pool "
            "sends new requests elsewhere and UpstreamStalled fires after 2 min.",
            [target(stalled, "{{upstream}}")],
            "none",
            steps(GREEN, (1, RED)),
            fill=20,
            legend_calcs=("max", "lastNotNull"),
            decimals=0,
        ),
        w=8,
        h=7,
    )
    d.add(
        timeseries_panel(
            "Longest silence of a stream in flight",
            "The longest any stream in flight to each upstream has gone without output (since "
            "it was sent, before its first token), stalled or not; max over replicas. Compare "
            "it with --stall-floor (60 s by default): a silence that grows toward it without a "
            "stall is a long prefill or a slow decode, not yet a hang.",
            [
                target(
                    f"max by (upstream) (phasewatch_stream_longest_silence_seconds{{{UP}}})",
                    "{{upstream}}",
                )
            ],
            "s",
            steps(GREEN, (30, YELLOW), (60, RED)),
            fill=0,
            legend_calcs=("max", "lastNotNull"),
        ),
        w=8,
        h=7,
    )
    d.add(
        bargauge_panel(
            "Streams that stalled over the time range",
            "Streams that stalled, per upstream and the phase they stalled in (prefill: no "
            "first token; decode), over the dashboard's time range (phasewatch_stalls_total, "
            "each stream counted once and logged once; every upstream's count is there from "
            "the start, so 0 means none stalled).",
            [
                target(
                    f"sum by (upstream, phase) (increase(phasewatch_stalls_total{{{UP}}}[$__range]))",
                    "{{upstream}} {{phase}}",
                    instant=True,
                )
            ],
            "none",
            steps(GREEN, (1, RED)),
            decimals=0,
        ),
        w=8,
        h=7,
    )

    d.row("Clients")
    d.add(
        timeseries_panel(
            "Tokens per second by client",
            "Prompt (prefill + cached) and generated tokens per client: the name of a named key "
            "(--api-key NAME=KEY), else a --client-header value listed in --clients ('other' "
            "for any other value, 'unknown' for none).",
            [
                target(
                    f"sum by (client) (rate(phasewatch_tokens_total{{{SEL}}}[$__rate_interval]))",
                    "{{client}}",
                )
            ],
            TOKS,
            steps(GREEN),
            stack=True,
            fill=40,
        ),
        w=8,
    )
    d.add(
        timeseries_panel(
            "Requests per second by client",
            "Measured requests per client, every outcome.",
            [
                target(
                    f"sum by (client) (rate(phasewatch_requests_total{{{SEL}}}[$__rate_interval]))",
                    "{{client}}",
                )
            ],
            "reqps",
            steps(GREEN),
            stack=True,
            fill=40,
        ),
        w=8,
    )
    d.add(
        timeseries_panel(
            "GPU power attributed by client",
            "Each request's share of its GPUs' energy (split evenly among the requests in "
            "flight), per client, as a rate: watts drawn on the client's behalf. Idle power is "
            "nobody's, so the clients add up to less than the GPUs draw.",
            [
                target(
                    "sum by (client) (rate(phasewatch_request_energy_joules_total"
                    f"{{{SEL}}}[$__rate_interval]))",
                    "{{client}}",
                )
            ],
            "watt",
            steps(GREEN),
            stack=True,
            fill=40,
        ),
        w=8,
    )


def fleet(d: Dash) -> None:
    """The whole fleet: every phasewatch replica and every engine (appended, so the panels
    above keep their ids). Requests and tokens add up over replicas; each GPU counts once."""
    d.row("Fleet: every replica, every engine")
    d.add(
        timeseries_panel(
            "Requests per second per model, all replicas",
            "Measured requests per model, summed over every phasewatch replica and every engine "
            "serving the model (recording rule phasewatch:requests:rate5m, which has no "
            "instance label).",
            [target(f"sum by (model) (phasewatch:requests:rate5m{{{SEL}}})", "{{model}}")],
            "reqps",
            steps(GREEN),
            stack=True,
            fill=40,
        ),
        w=8,
    )
    d.add(
        timeseries_panel(
            "Tokens per second, all replicas",
            "Tokens per phase summed over every replica and engine (recording rule "
            "phasewatch:tokens:rate5m): prefill, cached (from the prefix cache), decode.",
            [target(f"sum by (phase) (phasewatch:tokens:rate5m{{{SEL}}})", "{{phase}}")],
            TOKS,
            steps(GREEN),
            fill=10,
        ),
        w=8,
    )
    d.add(
        timeseries_panel(
            "GPU power per engine, each GPU once",
            "Average GPU draw per engine from the energy counters (recording rule "
            "phasewatch:fleet_gpu_power_watts:rate5m): every replica samples the same GPUs, so "
            "each GPU (engine, index) is taken once, not once per replica.",
            [target(f"phasewatch:fleet_gpu_power_watts:rate5m{{{UP}}}", "{{upstream}}")],
            "watt",
            steps(GREEN),
            stack=True,
            fill=40,
        ),
        w=8,
    )
    share = (
        f"sum by (instance) (phasewatch:replica_requests:rate5m{{{UP}}}) / on () group_left () "
        f"sum(phasewatch:replica_requests:rate5m{{{UP}}})"
    )
    d.add(
        timeseries_panel(
            "Share of requests per replica",
            "Each phasewatch replica's share of the requests (recording rule "
            "phasewatch:replica_requests:rate5m): even shares when the Service balances.",
            [target(share, "{{instance}}")],
            "percentunit",
            steps(GREEN),
            stack=True,
            max_=1,
            fill=40,
        ),
        w=12,
    )
    d.add(
        timeseries_panel(
            "Requests waiting per replica",
            "Requests waiting at each replica's admission gate (--max-concurrency; recording "
            "rule phasewatch:replica_queued_requests:sum): what deploy/k8s/hpa.yaml scales on.",
            [
                target(
                    f"sum by (instance) (phasewatch:replica_queued_requests:sum{{{UP}}})",
                    "{{instance}}",
                )
            ],
            "short",
            steps(GREEN, (4, YELLOW), (16, RED)),
            fill=10,
        ),
        w=12,
    )


def physics(d: Dash) -> None:
    """Rows of the overview for whole-body requests, the vLLM-parity figures and the KV
    cache (appended, so the panels above keep their ids)."""
    d.row("Embeddings, rerank and other whole-body requests")
    d.add(
        timeseries_panel(
            "Requests per second by endpoint",
            "Every measured request by endpoint: chat / completions (OpenAI), ollama_chat / "
            "ollama_generate, llamacpp_completion, and the whole-body ones: embeddings (/v1), "
            "ollama_embed (/api/embed), ollama_embeddings (/api/embeddings), "
            "llamacpp_embedding (/embedding), rerank, score, classify, pooling.",
            [
                target(
                    f"sum by (endpoint) (rate(phasewatch_requests_total{{{SEL}}}[$__rate_interval]))",
                    "{{endpoint}}",
                )
            ],
            "reqps",
            steps(GREEN),
            stack=True,
            fill=40,
        ),
        w=8,
    )
    d.add(
        timeseries_panel(
            "Whole-body request latency p50 / p95",
            "End-to-end latency of completed embeddings, rerank and other requests that "
            "generate nothing, by endpoint (recording rule phasewatch:request_seconds_bucket:rate5m).",
            [
                target(
                    f"histogram_quantile(0.5, sum by (endpoint, le) {whole_body(REQUEST_BUCKETS)})",
                    "p50 {{endpoint}}",
                ),
                target(
                    "histogram_quantile(0.95, sum by (endpoint, le) "
                    f"{whole_body(REQUEST_BUCKETS)})",
                    "p95 {{endpoint}}",
                ),
            ],
            "s",
            steps(GREEN, (1, YELLOW), (5, RED)),
            fill=0,
        ),
        w=8,
    )
    d.add(
        timeseries_panel(
            "Whole-body requests by outcome",
            "Embeddings and other whole-body requests per second by endpoint and outcome "
            "(error: the engine answered >= 400 or was unreachable).",
            [
                target(
                    "sum by (endpoint, outcome) "
                    + whole_body(f"rate(phasewatch_requests_total{{{SEL}}}[$__rate_interval])"),
                    "{{endpoint}} {{outcome}}",
                )
            ],
            "reqps",
            steps(GREEN),
            stack=True,
            fill=40,
        ),
        w=8,
    )

    d.row("vLLM parity: time per output token, latency, prefix cache, preemptions")
    d.add(
        timeseries_panel(
            "Time per output token p50 / p95 / p99",
            "Per request, decode time / (completion tokens - 1): vLLM's "
            "request_time_per_output_token_seconds, with buckets of 1 ms to 100 ms fine enough "
            "for fast decoders (recording rule). The inverse of the decode rate.",
            [
                target(
                    f"histogram_quantile({p}, sum by (le) (phasewatch:time_per_output_token_seconds_bucket:rate5m"
                    f'{{{SEL}, source="$source"}}))',
                    f"p{int(p * 100)}",
                )
                for p in (0.5, 0.95, 0.99)
            ],
            "s",
            steps(GREEN, (0.05, YELLOW), (0.1, RED)),
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "End-to-end latency p50 / p95 / p99 (generation)",
            "Completed generation requests, from phasewatch having the request to the last "
            "byte forwarded (vLLM's e2e_request_latency_seconds, as the client feels it).",
            [
                target(
                    f"histogram_quantile({p}, sum by (le) {generation(REQUEST_BUCKETS)})",
                    f"p{int(p * 100)}",
                )
                for p in (0.5, 0.95, 0.99)
            ],
            "s",
            steps(GREEN, (30, YELLOW), (120, RED)),
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "TTFT p50: client-felt vs engine-reported",
            "phasewatch's TTFT (request received -> first token forwarded: what the client "
            "feels) beside the engine's own (vLLM time_to_first_token_seconds, re-exported), "
            "and their gap: the time outside the engine's clock (HTTP, the API server's "
            "tokenising and queueing, the proxy). Each is interpolated in its own buckets, so "
            "the gap is clamped at 0: a 0 means smaller than the buckets can tell, never that "
            "the engine's clock ran longer than the client's.",
            [
                target(
                    "histogram_quantile(0.5, sum by (upstream, model, le) "
                    f"(phasewatch:ttft_seconds_bucket:rate5m{{{SEL}}}) and on (upstream, model) "
                    f"sum by (upstream, model, le) (phasewatch:engine_ttft_seconds_bucket:rate5m{{{SEL}}}))",
                    "client {{model}}",
                ),
                target(
                    "histogram_quantile(0.5, sum by (upstream, model, le) "
                    f"(phasewatch:engine_ttft_seconds_bucket:rate5m{{{SEL}}}))",
                    "engine {{model}}",
                ),
                target(
                    f"max by (upstream, model) (phasewatch:ttft_gap_seconds:p50_5m{{{SEL}}})",
                    "gap {{model}}",
                ),
            ],
            "s",
            steps(GREEN, (0.5, YELLOW), (2, RED)),
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "Prefix-cache hit ratio",
            "Share of prompt tokens served from the engine's prefix cache. phasewatch: from "
            "each request's cached-token count (OpenAI cached_tokens, llama-server cache_n; "
            "vLLM only with --enable-prompt-tokens-details, Ollama never). engine: vLLM's own "
            "prefix_cache_hits / prefix_cache_queries (recording rules).",
            [
                target(
                    f"max by (upstream, model) (phasewatch:prefix_cache_hit_ratio:rate5m{{{SEL}}})",
                    "phasewatch {{model}}",
                ),
                target(
                    f"max by (upstream, model) (phasewatch:engine_prefix_cache_hit_ratio:rate5m{{{SEL}}})",
                    "engine {{model}}",
                ),
            ],
            "percentunit",
            steps(BLUE),
            max_=1,
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "Engine preemptions per second",
            "Requests the engine preempted because its KV cache was full, to recompute later "
            "(vLLM num_preemptions, re-exported; max over replicas, which re-export the same "
            "engine). Sustained preemptions: fewer concurrent requests or a smaller context fit.",
            [
                target(
                    "max by (upstream, model) (rate(phasewatch_engine_preemptions_total"
                    f"{{{SEL}}}[$__rate_interval]))",
                    "{{upstream}} {{model}}",
                )
            ],
            "reqps",
            steps(GREEN, (0.01, YELLOW), (0.1, RED)),
            fill=10,
        )
    )
    d.add(
        timeseries_panel(
            "Engine end-to-end latency p95",
            "The engine's own end-to-end latency (vLLM e2e_request_latency_seconds, "
            "re-exported in its own buckets) beside phasewatch's p95 for generation requests.",
            [
                target(
                    "histogram_quantile(0.95, max by (upstream, model, le) "
                    f"(rate(phasewatch_engine_e2e_request_seconds_bucket{{{SEL}}}[$__rate_interval])))",
                    "engine {{model}}",
                ),
                target(
                    "histogram_quantile(0.95, sum by (upstream, model, le) "
                    f"{generation(REQUEST_BUCKETS)})",
                    "phasewatch {{model}}",
                ),
            ],
            "s",
            steps(GREEN, (30, YELLOW), (120, RED)),
            fill=0,
        )
    )

    d.row("KV cache: the memory side of the physics")
    d.add(
        bargauge_panel(
            "KV-cache bytes per token by model",
            "2 x layers x kv_heads x head_dim x bytes per element of the engine's cache "
            "(kv_dtype), from the model's config.json (vLLM, --model-dir), GGUF metadata "
            "(llama-server) or /api/show (Ollama). Sliding-window models (Gemma 2/3): the "
            "full-attention upper bound. Models whose shape is unknown are left out.",
            [
                target(
                    "max by (upstream, model, kv_dtype) (phasewatch_model_kv_bytes_per_token"
                    f'{{{SEL}, kv_dtype!="unknown"}})',
                    "{{model}} ({{kv_dtype}})",
                    instant=True,
                )
            ],
            "bytes",
            steps(GREEN, (262144, YELLOW), (1048576, RED)),
        ),
        w=8,
    )
    d.add(
        timeseries_panel(
            "KV-cache bytes per request p50 / p95",
            "What one request holds in the KV cache at its end: bytes per token x (prompt + "
            "completion tokens), sliding-window layers capped at their window.",
            [
                target(
                    f"histogram_quantile({p}, sum by (le) (rate(phasewatch_kv_cache_bytes_bucket"
                    f"{{{SEL}}}[$__rate_interval])))",
                    f"p{int(p * 100)}",
                )
                for p in (0.5, 0.95)
            ],
            "bytes",
            steps(GREEN, (1e9, YELLOW), (8e9, RED)),
            fill=0,
            log=True,
            min_=None,
        ),
        w=8,
    )
    fits = (
        "max by (upstream, model) (phasewatch_engine_kv_cache_capacity_tokens"
        f"{{{SEL}}}) * on (upstream, model) max by (upstream, model) "
        f'(phasewatch_model_kv_bytes_per_token{{{SEL}, kv_dtype!="unknown"}}) / on (upstream, model) '
        "histogram_quantile(0.5, sum by (upstream, model, le) "
        f"(increase(phasewatch_kv_cache_bytes_bucket{{{SEL}}}[$__range])))"
    )
    d.add(
        bargauge_panel(
            "Requests of median length the KV cache holds at once",
            "The engine's KV-cache capacity (vLLM num_gpu_blocks x block_size; llama-server "
            "the slots' contexts) in bytes, over the median KV bytes of one request in the "
            "time range. The engine's own limit on sequences (max_num_seqs, llama-server "
            "slots) may bind first.",
            [target(fits, "{{upstream}} {{model}}", instant=True)],
            "short",
            steps(RED, (4, YELLOW), (16, GREEN)),
            decimals=0,
        ),
        w=8,
    )


# --- Precision comparison -------------------------------------------------------------------
