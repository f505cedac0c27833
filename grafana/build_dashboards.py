"""Builds the bundled Grafana dashboards (grafana/dashboards/*.json).

The JSON files are what Grafana loads (docker compose provisioning, the Kubernetes
sidecar ConfigMap); this script is how they are written, so every panel gets a unit, a
description and thresholds, and every query filters on the same variables.

    python grafana/build_dashboards.py          # rewrite grafana/dashboards/*.json
    python grafana/build_dashboards.py --check  # exit 1 if the files are out of date

Every metric named here is defined in proxy/metrics.py or is a recording rule in
deploy/prometheus/rules/phasewatch-recording.yml; tests/test_observability.py checks
that, and runs every query against a real Prometheus fed by phasewatch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards"

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'upstream=~"$upstream", model=~"$model", precision=~"$precision"'
UP = 'upstream=~"$upstream"'
TOKS = "suffix: tok/s"

GREEN, YELLOW, ORANGE, RED, BLUE = "green", "yellow", "orange", "red", "blue"
PALETTE = "palette-classic"


# --- building blocks --------------------------------------------------------------------


def steps(*pairs):
    """Threshold steps: steps(GREEN, (1, YELLOW), (2, RED))."""
    first, *rest = pairs
    return {
        "mode": "absolute",
        "steps": [{"color": first, "value": None}] + [{"color": c, "value": v} for v, c in rest],
    }


def target(
    expr: str,
    legend: str = "",
    ref: str = "A",
    *,
    instant: bool = False,
    fmt: str = "time_series",
    exemplar: bool = False,
) -> dict:
    """A Prometheus query. `exemplar`: also fetch the exemplars of the raw histogram it
    reads (phasewatch puts the trace id and request id on TTFT, decode-rate and request
    buckets), so a slow bucket links to its trace and log line."""
    t = {
        "datasource": DS,
        "refId": ref,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "range": not instant,
        "instant": instant,
        "format": fmt,
        "editorMode": "code",
    }
    if exemplar:
        t["exemplar"] = True
    return t


def refs(targets):
    return [dict(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)]


class Dash:
    """Lays panels out left to right, top to bottom, and numbers them."""

    def __init__(
        self, uid: str, title: str, description: str, tags: list[str], variables: list[dict]
    ) -> None:
        self.uid, self.title, self.description, self.tags = uid, title, description, tags
        self.variables = variables
        self.panels: list[dict] = []
        self.x = self.y = self.row_h = 0
        self.next_id = 1

    def _place(self, w: int, h: int) -> dict:
        if self.x + w > 24:
            self.x, self.y = 0, self.y + self.row_h
            self.row_h = 0
        pos = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        self.panels.append(
            {
                "type": "row",
                "id": self.next_id,
                "title": title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1},
                "panels": [],
            }
        )
        self.next_id += 1
        self.y += 1

    def add(self, panel: dict, w: int = 12, h: int = 8) -> None:
        panel = {"id": self.next_id, "gridPos": self._place(w, h), "datasource": DS, **panel}
        panel["targets"] = refs(panel["targets"])
        self.next_id += 1
        self.panels.append(panel)

    def json(self) -> dict:
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["phasewatch", *self.tags],
            "timezone": "browser",
            "editable": True,
            "graphTooltip": 1,
            "schemaVersion": 39,
            "version": 1,
            "refresh": "10s",
            "time": {"from": "now-1h", "to": "now"},
            "fiscalYearStartMonth": 0,
            "liveNow": False,
            "weekStart": "",
            "timepicker": {"refresh_intervals": ["5s", "10s", "30s", "1m", "5m", "15m"]},
            "annotations": {
                "list": [
                    {
                        "builtIn": 1,
                        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                        "enable": True,
                        "hide": True,
                        "iconColor": "rgba(0, 211, 255, 1)",
                        "name": "Annotations & Alerts",
                        "type": "dashboard",
                    }
                ]
            },
            "links": [
                {
                    "title": "phasewatch dashboards",
                    "type": "dashboards",
                    "tags": ["phasewatch"],
                    "asDropdown": True,
                    "includeVars": True,
                    "keepTime": True,
                    "icon": "external link",
                    "targetBlank": False,
                    "tooltip": "",
                    "url": "",
                }
            ],
            "templating": {"list": self.variables},
            "panels": self.panels,
        }


def timeseries(
    title,
    description,
    targets,
    unit,
    thresholds,
    *,
    stack=False,
    min_=0,
    max_=None,
    legend_calcs=("mean", "max", "lastNotNull"),
    decimals=None,
    fill=10,
    threshold_style="off",
    log=False,
):
    defaults = {
        "unit": unit,
        "min": min_,
        "thresholds": thresholds,
        "color": {"mode": PALETTE},
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": fill,
            "showPoints": "never",
            "spanNulls": True,
            "axisPlacement": "auto",
            "axisSoftMin": 0,
            "scaleDistribution": {"type": "log", "log": 10} if log else {"type": "linear"},
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": threshold_style},
        },
    }
    if max_ is not None:
        defaults["max"] = max_
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {
                "displayMode": "table",
                "placement": "bottom",
                "showLegend": True,
                "calcs": list(legend_calcs),
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    title,
    description,
    targets,
    unit,
    thresholds,
    *,
    decimals=None,
    mappings=None,
    color_mode="value",
    text_mode="value_and_name",
    orientation="vertical",
):
    defaults = {
        "unit": unit,
        "thresholds": thresholds,
        "color": {"mode": "thresholds"},
        "mappings": mappings or [],
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "orientation": orientation,
            "textMode": text_mode,
            "colorMode": color_mode,
            "graphMode": "none",
            "justifyMode": "center",
            "wideLayout": True,
            "showPercentChange": False,
        },
    }


def bargauge(title, description, targets, unit, thresholds, *, min_=0, max_=None, decimals=None):
    defaults = {
        "unit": unit,
        "min": min_,
        "thresholds": thresholds,
        "color": {"mode": "thresholds"},
    }
    if max_ is not None:
        defaults["max"] = max_
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "bargauge",
        "title": title,
        "description": description,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "orientation": "horizontal",
            "displayMode": "gradient",
            "showUnfilled": True,
            "valueMode": "color",
            "namePlacement": "auto",
            "sizing": "auto",
            "minVizHeight": 16,
            "minVizWidth": 8,
            "maxVizHeight": 300,
        },
    }


def heatmap(title, description, targets, unit):
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "targets": targets,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": {
                    "hideFrom": {"legend": False, "tooltip": False, "viz": False},
                    "scaleDistribution": {"type": "linear"},
                },
            },
            "overrides": [],
        },
        "options": {
            "calculate": False,
            "cellGap": 1,
            "yAxis": {"axisPlacement": "left", "unit": unit},
            "rowsFrame": {"layout": "auto"},
            "color": {
                "mode": "scheme",
                "scheme": "Oranges",
                "fill": "dark-orange",
                "scale": "exponential",
                "exponent": 0.5,
                "steps": 64,
                "reverse": False,
            },
            "filterValues": {"le": 1e-9},
            "legend": {"show": True},
            "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": False},
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "showValue": "never",
        },
    }


def table(title, description, targets, overrides, thresholds, *, organize=None):
    transformations = [{"id": "merge", "options": {}}]
    if organize:
        transformations.append({"id": "organize", "options": organize})
    return {
        "type": "table",
        "title": title,
        "description": description,
        "targets": targets,
        "fieldConfig": {
            "defaults": {
                "thresholds": thresholds,
                "color": {"mode": "thresholds"},
                "custom": {"align": "auto", "cellOptions": {"type": "auto"}, "inspect": False},
            },
            "overrides": overrides,
        },
        "options": {
            "showHeader": True,
            "cellHeight": "sm",
            "footer": {"show": False, "reducer": ["sum"], "fields": ""},
        },
        "transformations": transformations,
    }


def override(name, **props):
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [{"id": k.replace("__", "."), "value": v} for k, v in props.items()],
    }


# --- variables ----------------------------------------------------------------------------


def ds_var():
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
    }


def query_var(name, label, query, description):
    return {
        "name": name,
        "label": label,
        "description": description,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": f"PrometheusVariableQueryEditor-{name}", "qryType": 1},
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "options": [],
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "hide": 0,
        "skipUrlSync": False,
    }


def custom_var(name, label, values, default, description):
    return {
        "name": name,
        "label": label,
        "description": description,
        "type": "custom",
        "query": ",".join(values),
        "current": {"selected": True, "text": default, "value": default},
        "options": [{"selected": v == default, "text": v, "value": v} for v in values],
        "includeAll": False,
        "multi": False,
        "hide": 0,
        "skipUrlSync": False,
    }


def base_vars():
    return [
        ds_var(),
        query_var(
            "upstream",
            "Upstream",
            "label_values(phasewatch_model_info, upstream)",
            "Engine(s) behind phasewatch (--upstream name=URL).",
        ),
        query_var(
            "model",
            "Model",
            'label_values(phasewatch_model_info{upstream=~"$upstream"}, model)',
            "Served model names.",
        ),
        query_var(
            "precision",
            "Precision",
            'label_values(phasewatch_model_info{upstream=~"$upstream", model=~"$model"}, precision)',
            "Normalised weight precision (bf16, fp8, int4 ...).",
        ),
    ]


def source_var():
    return custom_var(
        "source",
        "Measured by",
        ["proxy", "engine"],
        "proxy",
        "proxy: phasewatch's own clock (streaming requests, every engine); engine: "
        "the engine's reported timings (llama-server, Ollama).",
    )


# --- Overview ------------------------------------------------------------------------------


def overview() -> dict:
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
        timeseries(
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
        timeseries(
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
        heatmap(
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
        heatmap(
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
        heatmap(
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
        timeseries(
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
        timeseries(
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
        timeseries(
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
        timeseries(
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
        timeseries(
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
    band_decode = f'sum by (prompt_band) (rate(phasewatch_decode_seconds_sum{{{SEL}, source="proxy"}}[$__range]))'
    band_prefill = f'sum by (prompt_band) (rate(phasewatch_prefill_seconds_sum{{{SEL}, source="proxy"}}[$__range]))'
    d.add(
        bargauge(
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

    d.row("Queue")
    d.add(
        timeseries(
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
        timeseries(
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
        timeseries(
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
        timeseries(
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
        timeseries(
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
        timeseries(
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
        timeseries(
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
        timeseries(
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
        timeseries(
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
        timeseries(
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

    d.row("Engine state")
    d.add(
        timeseries(
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
        timeseries(
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
                    ref="B",
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
        stat(
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
            mappings=[
                {
                    "type": "value",
                    "options": {
                        "0": {"text": "down", "color": RED, "index": 0},
                        "1": {"text": "up", "color": GREEN, "index": 1},
                    },
                }
            ],
        ),
        w=8,
        h=6,
    )
    d.add(
        table(
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
        ),
        w=16,
        h=6,
    )

    d.row("Clients")
    d.add(
        timeseries(
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
        timeseries(
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
        timeseries(
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
    overview_physics(d)
    overview_fleet(d)
    return d.json()


def overview_fleet(d: Dash) -> None:
    """The whole fleet: every phasewatch replica and every engine (appended, so the panels
    above keep their ids). Requests and tokens add up over replicas; each GPU counts once."""
    d.row("Fleet: every replica, every engine")
    d.add(
        timeseries(
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
        timeseries(
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
        timeseries(
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
        timeseries(
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
        timeseries(
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


#: Endpoints that generate (the rest are whole-body requests: embeddings, rerank, ...).
GENERATION = 'endpoint=~"chat|completions|ollama_chat|ollama_generate|llamacpp_completion"'
NOT_GENERATION = 'endpoint!~"chat|completions|ollama_chat|ollama_generate|llamacpp_completion"'


def overview_physics(d: Dash) -> None:
    """Rows of the overview for whole-body requests, the vLLM-parity figures and the KV
    cache (appended, so the panels above keep their ids)."""
    d.row("Embeddings, rerank and other whole-body requests")
    d.add(
        timeseries(
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
        timeseries(
            "Whole-body request latency p50 / p95",
            "End-to-end latency of completed embeddings, rerank and other requests that "
            "generate nothing, by endpoint (recording rule phasewatch:request_seconds_bucket:rate5m).",
            [
                target(
                    "histogram_quantile(0.5, sum by (endpoint, le) "
                    f"(phasewatch:request_seconds_bucket:rate5m{{{SEL}, {NOT_GENERATION}}}))",
                    "p50 {{endpoint}}",
                ),
                target(
                    "histogram_quantile(0.95, sum by (endpoint, le) "
                    f"(phasewatch:request_seconds_bucket:rate5m{{{SEL}, {NOT_GENERATION}}}))",
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
        timeseries(
            "Whole-body requests by outcome",
            "Embeddings and other whole-body requests per second by endpoint and outcome "
            "(error: the engine answered >= 400 or was unreachable).",
            [
                target(
                    "sum by (endpoint, outcome) (rate(phasewatch_requests_total"
                    f"{{{SEL}, {NOT_GENERATION}}}[$__rate_interval]))",
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
        timeseries(
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
        timeseries(
            "End-to-end latency p50 / p95 / p99 (generation)",
            "Completed generation requests, from phasewatch having the request to the last "
            "byte forwarded (vLLM's e2e_request_latency_seconds, as the client feels it).",
            [
                target(
                    f"histogram_quantile({p}, sum by (le) (phasewatch:request_seconds_bucket:rate5m"
                    f"{{{SEL}, {GENERATION}}}))",
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
        timeseries(
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
        timeseries(
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
        timeseries(
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
        timeseries(
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
                    f"(phasewatch:request_seconds_bucket:rate5m{{{SEL}, {GENERATION}}}))",
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
        bargauge(
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
        timeseries(
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
        f"(rate(phasewatch_kv_cache_bytes_bucket{{{SEL}}}[$__range])))"
    )
    d.add(
        bargauge(
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


def _sel(precision_matcher: str) -> str:
    return f'upstream=~"$upstream", model=~"$model", {precision_matcher}'


#: Joins a series keyed by (upstream, model, precision) to its model family
#: (phasewatch_model_info{family}), so precisions are compared within one family and
#: never summed across different models.
FAMILY_JOIN = (
    " * on (upstream, model, precision) group_left (family) "
    "max by (upstream, model, precision, family) (phasewatch_model_info)"
)


def fam(expr: str) -> str:
    """`expr` with the family label of its model."""
    return f"({expr}){FAMILY_JOIN}"


def figures(pm: str, rng: str = "$__range") -> dict[str, str]:
    """The benchmark table's figures, one series per model family and precision, for
    precision matcher pm (the same figures as `phasewatch report`)."""
    s = _sel(pm)
    per_gpu = "upstream, model, precision, gpu"
    by = "family, precision"
    idle_per_model = (
        f'sum by (upstream, model, precision) (sum by ({per_gpu}) (rate(phasewatch_gpu_power_sample_watts_sum{{{s}, state="idle"}}[{rng}]))'
        f' / sum by ({per_gpu}) (rate(phasewatch_gpu_power_sample_watts_count{{{s}, state="idle"}}[{rng}])))'
    )

    def median(metric: str, matchers: str) -> str:
        return (
            f"histogram_quantile(0.5, sum by ({by}, le) "
            f"({fam(f'rate({metric}_bucket{{{s}, {matchers}}}[{rng}])')}))"
        )

    def mean(metric: str, matchers: str) -> str:
        return (
            f"sum by ({by}) ({fam(f'rate({metric}_sum{{{s}, {matchers}}}[{rng}])')})"
            f" / sum by ({by}) ({fam(f'rate({metric}_count{{{s}, {matchers}}}[{rng}])')})"
        )

    out = {
        "decode": median("phasewatch_decode_tokens_per_second", 'source="$source"'),
        "prefill4k": "1000 / "
        + median("phasewatch_prefill_tokens_per_second", 'source="$source", prompt_band="2k-6k"'),
        "prefill16k": "1000 / "
        + median("phasewatch_prefill_tokens_per_second", 'source="$source", prompt_band="12k-24k"'),
        "ttft8k": median("phasewatch_ttft_seconds", 'prompt_band="6k-12k"'),
        "decode_watts": mean("phasewatch_gpu_power_watts", 'phase="decode"'),
        "idle_watts": f"avg by ({by}) ({fam(idle_per_model)})",
    }
    # joules_per_token_at_decode: decode W / decode tok/s of the same family and precision
    out["joules"] = f"({out['decode_watts']}) / ({out['decode']})"
    return out


def precision_comparison() -> dict:
    d = Dash(
        "phasewatch-precision",
        "phasewatch / Precision comparison",
        "The benchmark table, one column per precision: decode tok/s, prefill "
        "ms/token at ~4K and ~16K prompts, TTFT at ~8K, power at decode load, idle power, "
        "J/token, and decode speed-up and power saving relative to a bf16/fp16 baseline.",
        ["precision"],
        base_vars()
        + [
            source_var(),
            custom_var(
                "baseline",
                "Baseline precision",
                ["bf16", "fp16", "fp32", "fp8"],
                "bf16",
                "The precision speed-up and power saving are relative to.",
            ),
        ],
    )
    f = figures('precision=~"$precision"')
    b = figures('precision="$baseline"')
    speedup = f"{f['decode']} / on (family) group_left () {b['decode']}"
    saving = f"1 - ({f['decode_watts']}) / on (family) group_left () ({b['decode_watts']})"

    rows = [
        (
            "decode",
            "Decode tok/s (median)",
            TOKS,
            steps(RED, (10, YELLOW), (25, GREEN)),
            1,
            "Median decode tokens/s over the time range. Memory-bandwidth-bound: ~ effective "
            "bandwidth / weight bytes, so int4 decodes ~2.5-3.5x faster than bf16.",
        ),
        (
            "prefill4k",
            "Prefill ms/token, ~4K prompts",
            "ms",
            steps(GREEN, (1, YELLOW), (5, RED)),
            3,
            "1000 / median prefill tokens/s for prompts of 2K-6K tokens (prompt_band 2k-6k). "
            "Compute-bound: precision changes it only ~1.2-1.5x.",
        ),
        (
            "prefill16k",
            "Prefill ms/token, ~16K prompts",
            "ms",
            steps(GREEN, (1, YELLOW), (5, RED)),
            3,
            "1000 / median prefill tokens/s for prompts of 12K-24K tokens (prompt_band 12k-24k). "
            "Higher than at ~4K: attention grows with the context.",
        ),
        (
            "ttft8k",
            "TTFT, ~8K prompts (median)",
            "s",
            steps(GREEN, (2, YELLOW), (5, RED)),
            2,
            "Median time to first token for prompts of 6K-12K tokens (prompt_band 6k-12k).",
        ),
        (
            "decode_watts",
            "Power at decode load",
            "watt",
            steps(GREEN, (300, YELLOW), (400, RED)),
            0,
            "Mean GPU power over requests' decode windows (the upstream's GPUs summed). Lower "
            "precision reads fewer bytes per token and draws less.",
        ),
        (
            "idle_watts",
            "Idle power",
            "watt",
            steps(GREEN, (50, YELLOW), (100, RED)),
            0,
            "Mean power of a model's GPUs while phasewatch had nothing in flight on them "
            "(GPUs mapped to models with --power-gpu GPU=MODEL; 'all' GPUs show as their upstream's).",
        ),
        (
            "joules",
            "Energy per token at decode load",
            "joule",
            steps(GREEN, (1, YELLOW), (3, RED)),
            3,
            "joules_per_token_at_decode: power at decode load / median decode tok/s, per model "
            "family and precision over the time range (the status page's and phasewatch "
            "report's J/tok at decode). Idle and prefill are not in it, so it compares "
            "precisions like with like; the all-in figure (idle included) is on the Power & "
            "energy dashboard.",
        ),
    ]
    d.row("What to report: one column per precision")
    for key, title, unit, th, dec, desc in rows:
        d.add(
            stat(
                title,
                desc,
                [target(f[key], "{{family}} {{precision}}", instant=True)],
                unit,
                th,
                decimals=dec,
            ),
            w=8,
            h=5,
        )
    d.add(
        stat(
            "Decode speed-up vs baseline",
            "Median decode tok/s of each precision over the "
            "baseline precision's of the same model family (variable 'Baseline precision', "
            "default bf16).",
            [target(speedup, "{{family}} {{precision}}", instant=True)],
            "suffix:x",
            steps(RED, (0.95, YELLOW), (1.2, GREEN)),
            decimals=2,
        ),
        w=8,
        h=5,
    )
    d.add(
        stat(
            "Power saving at decode vs baseline",
            "1 - decode-load power of each precision / "
            "the baseline precision's of the same model family. Positive: draws less than "
            "the baseline.",
            [target(saving, "{{family}} {{precision}}", instant=True)],
            "percentunit",
            steps(RED, (0, YELLOW), (0.1, GREEN)),
            decimals=0,
        ),
        w=8,
        h=5,
    )

    d.row("As a table")
    names = {
        "decode": "decode tok/s",
        "prefill4k": "prefill ms/tok ~4K",
        "prefill16k": "prefill ms/tok ~16K",
        "ttft8k": "TTFT ~8K (s)",
        "decode_watts": "decode W",
        "idle_watts": "idle W",
        "joules": "J/token at decode",
        "speedup": "decode speed-up",
        "saving": "power saving",
    }
    exprs = {
        **{
            k: f[k]
            for k in (
                "decode",
                "prefill4k",
                "prefill16k",
                "ttft8k",
                "decode_watts",
                "idle_watts",
                "joules",
            )
        },
        "speedup": speedup,
        "saving": saving,
    }
    targets = [target(e, k, instant=True, fmt="table") for k, e in exprs.items()]
    rename = {f"Value #{chr(ord('A') + i)}": names[k] for i, k in enumerate(exprs)}
    units = {
        "decode": TOKS,
        "prefill4k": "ms",
        "prefill16k": "ms",
        "ttft8k": "s",
        "decode_watts": "watt",
        "idle_watts": "watt",
        "joules": "joule",
        "speedup": "suffix:x",
        "saving": "percentunit",
    }
    decimals = {
        "decode": 1,
        "prefill4k": 3,
        "prefill16k": 3,
        "ttft8k": 2,
        "decode_watts": 0,
        "idle_watts": 0,
        "joules": 3,
        "speedup": 2,
        "saving": 0,
    }
    overrides = [override(names[k], unit=units[k], decimals=decimals[k]) for k in exprs]
    d.add(
        table(
            "What to report, per precision",
            "The same figures as above, a row per model family and precision (merge of instant "
            "queries over the "
            "dashboard's time range). Empty cells: no requests of that kind in the range (e.g. no "
            "~16K prompts) or no power source.",
            targets,
            overrides,
            steps(GREEN),
            organize={
                "excludeByName": {"Time": True},
                "indexByName": {"family": 0, "precision": 1},
                "renameByName": rename,
            },
        ),
        w=24,
        h=7,
    )

    d.row("Over time")
    d.add(
        timeseries(
            "Median decode rate by precision",
            "5 min median decode tokens/s (recording rule), per model family and precision.",
            [
                target(
                    "histogram_quantile(0.5, sum by (family, precision, le) ("
                    + fam(
                        f'phasewatch:decode_tokens_per_second_bucket:rate5m{{{SEL}, source="$source"}}'
                    )
                    + "))",
                    "{{family}} {{precision}}",
                )
            ],
            TOKS,
            steps(RED, (10, YELLOW), (25, GREEN)),
            fill=0,
        )
    )
    d.add(
        timeseries(
            "Median prefill rate by precision",
            "5 min median prefill tokens/s (recording rule), per model family and precision, "
            "all prompt lengths.",
            [
                target(
                    "histogram_quantile(0.5, sum by (family, precision, le) ("
                    + fam(
                        f'phasewatch:prefill_tokens_per_second_bucket:rate5m{{{SEL}, source="$source"}}'
                    )
                    + "))",
                    "{{family}} {{precision}}",
                )
            ],
            TOKS,
            steps(RED, (100, YELLOW), (1000, GREEN)),
            fill=0,
        )
    )
    d.add(
        timeseries(
            "TTFT p95 by precision",
            "5 min p95 time to first token per model family and precision, all prompt lengths "
            "(recording rule; the slowest upstream of each).",
            [
                target(
                    f"max by (family, precision) ({fam(f'phasewatch:ttft_seconds:p95_5m{{{SEL}}}')})",
                    "{{family}} {{precision}}",
                )
            ],
            "s",
            steps(GREEN, (1, YELLOW), (2, RED)),
            fill=0,
        )
    )
    d.add(
        timeseries(
            "Energy per token at decode load by precision",
            "joules_per_token_at_decode over 5 min (recording rule "
            "phasewatch:joules_per_token_at_decode:rate5m: power at decode load / median decode "
            "tok/s), per model family and precision. Idle and prefill are not in it.",
            [
                target(
                    "avg by (family, precision) ("
                    + fam(f"phasewatch:joules_per_token_at_decode:rate5m{{{SEL}}}")
                    + ")",
                    "{{family}} {{precision}}",
                )
            ],
            "joule",
            steps(GREEN, (1, YELLOW), (3, RED)),
            fill=0,
            decimals=3,
        )
    )

    d.row("Memory: KV cache by precision")
    kv = _sel('precision=~"$precision", kv_dtype!="unknown"')
    precision_sel = _sel('precision=~"$precision"')
    d.add(
        stat(
            "KV-cache bytes per token by precision",
            "Bytes one token adds to the KV cache (2 x layers x kv_heads x head_dim x bytes "
            "per cache element), per weight precision and cache element type. Weight "
            "quantisation leaves it unchanged; an fp8 (or q8_0) cache halves it: the memory "
            "side of the physics. Sliding-window models: the full-attention upper bound.",
            [
                target(
                    f"max by (precision, kv_dtype) (phasewatch_model_kv_bytes_per_token{{{kv}}})",
                    "{{precision}} (cache {{kv_dtype}})",
                    instant=True,
                )
            ],
            "bytes",
            steps(GREEN, (262144, YELLOW), (1048576, RED)),
            decimals=0,
        ),
        w=12,
        h=6,
    )
    d.add(
        stat(
            "Median KV-cache bytes per request by precision",
            "Median bytes a request held in the KV cache at its end, per precision, over the "
            "time range.",
            [
                target(
                    "histogram_quantile(0.5, sum by (precision, le) (rate(phasewatch_kv_cache_bytes_bucket"
                    f"{{{precision_sel}}}[$__range])))",
                    "{{precision}}",
                    instant=True,
                )
            ],
            "bytes",
            steps(GREEN, (1e9, YELLOW), (8e9, RED)),
            decimals=0,
        ),
        w=12,
        h=6,
    )
    return d.json()


# --- Power & energy --------------------------------------------------------------------------


def power() -> dict:
    gpu_var = query_var(
        "gpu",
        "GPU",
        "label_values(phasewatch_gpu_energy_joules_total, gpu)",
        "GPU index (as the power source numbers them).",
    )
    d = Dash(
        "phasewatch-power",
        "phasewatch / Power & energy",
        "GPU power by what phasewatch had in flight (idle, prefill, decode), energy per GPU, "
        "and joules per token by precision. Empty when no power source is configured.",
        ["power"],
        base_vars() + [gpu_var],
    )
    PG = SEL + ', gpu=~"$gpu"'

    d.row("Power")
    d.add(
        stat(
            "Power sampling",
            "Whether each phasewatch replica is sampling GPU power (NVML, DCGM endpoint or the "
            "simulator). PowerSamplingDown fires after 5 min down.",
            [target("min by (source) (phasewatch_power_sampling_up)", "{{source}}", instant=True)],
            "none",
            steps(RED, (1, GREEN)),
            color_mode="background",
            mappings=[
                {
                    "type": "value",
                    "options": {
                        "0": {"text": "down", "color": RED, "index": 0},
                        "1": {"text": "sampling", "color": GREEN, "index": 1},
                    },
                }
            ],
        ),
        w=6,
        h=6,
    )
    d.add(
        bargauge(
            "Mean power by state",
            "Mean of the power samples per state over the time range: idle (nothing in flight on "
            "the GPU's upstream), prefill (a request before its first token), decode.",
            [
                target(
                    f"sum by (state) (rate(phasewatch_gpu_power_sample_watts_sum{{{PG}}}[$__range]))"
                    f" / sum by (state) (rate(phasewatch_gpu_power_sample_watts_count{{{PG}}}[$__range]))",
                    "{{state}}",
                    instant=True,
                )
            ],
            "watt",
            steps(GREEN, (300, YELLOW), (400, RED)),
            decimals=0,
        ),
        w=9,
        h=6,
    )
    d.add(
        bargauge(
            "Share of time by state",
            "Share of power samples in each state: how busy the GPUs were.",
            [
                target(
                    f"sum by (state) (rate(phasewatch_gpu_power_sample_watts_count{{{PG}}}[$__range]))"
                    f" / scalar(sum(rate(phasewatch_gpu_power_sample_watts_count{{{PG}}}[$__range])))",
                    "{{state}}",
                    instant=True,
                )
            ],
            "percentunit",
            steps(BLUE),
            max_=1,
            decimals=0,
        ),
        w=9,
        h=6,
    )
    d.add(
        timeseries(
            "GPU power",
            "Latest power sample per GPU (max over replicas, which sample the same GPUs).",
            [
                target(
                    f"max by (upstream, model, gpu) (phasewatch_gpu_power_current_watts{{{PG}}})",
                    "gpu {{gpu}}: {{model}} on {{upstream}}",
                )
            ],
            "watt",
            steps(GREEN, (300, YELLOW), (400, RED)),
            fill=10,
        )
    )
    d.add(
        timeseries(
            "Power by state",
            "5 min mean of the power samples per GPU and state (recording rule): idle power and "
            "decode-load power side by side.",
            [
                target(
                    f"phasewatch:gpu_power_sample_watts:mean5m{{{PG}}}",
                    "gpu {{gpu}} ({{model}}) {{state}}",
                )
            ],
            "watt",
            steps(GREEN, (300, YELLOW), (400, RED)),
            fill=0,
        )
    )
    d.add(
        timeseries(
            "Per-request power by phase and precision",
            "Mean GPU power over requests' prefill and decode windows (recording rule), by precision: "
            "prefill draws more than decode; lower precision draws less at decode.",
            [
                target(
                    f"avg by (precision, phase) (phasewatch:gpu_power_watts:mean5m{{{SEL}}})",
                    "{{precision}} {{phase}}",
                )
            ],
            "watt",
            steps(GREEN, (300, YELLOW), (400, RED)),
            fill=0,
        )
    )
    d.add(
        heatmap(
            "Power sample distribution",
            "All power samples as a heatmap of histogram buckets (W).",
            [
                target(
                    f"sum by (le) (increase(phasewatch_gpu_power_sample_watts_bucket{{{PG}}}[$__rate_interval]))",
                    "{{le}}",
                    fmt="heatmap",
                )
            ],
            "watt",
        )
    )

    d.row("Energy")
    d.add(
        timeseries(
            "Energy per token at decode load by precision",
            "joules_per_token_at_decode over 5 min (recording rule): mean GPU power over "
            "requests' decode windows / median decode tok/s, per model family and precision. "
            "Idle and prefill are not in it: the figure that compares precisions (int4 below "
            "fp8 below bf16).",
            [
                target(
                    "avg by (family, precision) ("
                    + fam(f"phasewatch:joules_per_token_at_decode:rate5m{{{SEL}}}")
                    + ")",
                    "{{family}} {{precision}}",
                )
            ],
            "joule",
            steps(GREEN, (1, YELLOW), (3, RED)),
            fill=0,
            decimals=3,
        )
    )
    d.add(
        timeseries(
            "All-in energy per generated token (idle and prefill included)",
            "joules_per_token_all_in over 5 min (recording rule): the GPU's whole energy counter, "
            "idle and prefill included, / generated tokens: the cost of owning the GPU at this "
            "utilisation. Not a precision comparison: on the same traffic a faster precision "
            "idles more and can read higher here. Exact per model when GPUs are mapped to "
            "models (--power-gpu GPU=MODEL); a blend where a GPU serves several.",
            [
                target(
                    f"phasewatch:joules_per_token_all_in:rate5m{{{SEL}}}",
                    "{{model}} ({{precision}}) on {{upstream}}",
                )
            ],
            "joule",
            steps(GREEN, (1, YELLOW), (3, RED)),
            fill=0,
            decimals=3,
        )
    )
    d.add(
        timeseries(
            "Energy attributed to requests per generated token",
            "joules_per_token_attributed over 5 min (recording rule): each request's share of its "
            "GPUs' energy while it ran (phasewatch_request_energy_joules_total, split evenly "
            "among the requests in flight; idle energy is nobody's) / generated tokens. Between "
            "the at-decode and the all-in figures.",
            [
                target(
                    f"phasewatch:joules_per_token_attributed:rate5m{{{SEL}}}",
                    "{{model}} ({{precision}}) on {{upstream}}",
                )
            ],
            "joule",
            steps(GREEN, (1, YELLOW), (3, RED)),
            fill=0,
            decimals=3,
        )
    )
    d.add(
        timeseries(
            "Average power per GPU (from energy)",
            "rate of the energy counter per GPU (recording rule, deduplicated over replicas): the "
            "GPU's average draw.",
            [
                target(
                    f"phasewatch:gpu_energy_joules:rate5m{{{PG}}}",
                    "gpu {{gpu}}: {{model}} on {{upstream}}",
                )
            ],
            "watt",
            steps(GREEN, (300, YELLOW), (400, RED)),
            fill=10,
        )
    )
    d.add(
        bargauge(
            "Energy per GPU over the time range",
            "Energy each GPU used over the dashboard's time range (max over replicas, which read "
            "the same counter), in watt-hours.",
            [
                target(
                    f"max by (upstream, model, gpu) (increase(phasewatch_gpu_energy_joules_total{{{PG}}}[$__range])) / 3600",
                    "gpu {{gpu}}: {{model}} on {{upstream}}",
                    instant=True,
                )
            ],
            "watth",
            steps(GREEN, (100, YELLOW), (1000, RED)),
            decimals=2,
        )
    )
    return d.json()


DASHBOARDS = {
    "phasewatch-overview.json": overview,
    "phasewatch-precision.json": precision_comparison,
    "phasewatch-power.json": power,
}


def render() -> dict[str, str]:
    return {
        name: json.dumps(build(), indent=2, ensure_ascii=False) + "\n"
        for name, build in DASHBOARDS.items()
    }


def main(argv: list[str]) -> int:
    files = render()
    if "--check" in argv:
        stale = [
            n
            for n, text in files.items()
            if not (OUT / n).exists() or (OUT / n).read_text() != text
        ]
        if stale:
            print("out of date (run python grafana/build_dashboards.py):", *stale)
            return 1
        return 0
    OUT.mkdir(exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
        print("wrote", OUT / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
