"""Reading an engine's own Prometheus ``/metrics`` page (vLLM's, llama-server's)."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from .base import EngineHistogram, EngineReading, EngineState


def parse_prometheus(
    text: str, names: dict[str, str], model_label: str | None = None
) -> EngineState:
    """{model_name: {running|waiting|kv: value}} from an engine's /metrics text; `names`
    maps the engine's metric names to those keys."""
    return read_metrics(text, names, model_label=model_label)[0].gauges


def read_metrics(
    text: str,
    gauges: dict[str, str],
    counters: dict[str, str] | None = None,
    histograms: dict[str, str] | None = None,
    model_label: str | None = None,
    infos: frozenset[str] = frozenset(),
) -> tuple[EngineReading, dict[str, list[dict[str, str]]]]:
    """An engine's gauges, counters and histograms from its /metrics text, per
    ``model_name`` (`model_label` where a sample has none); each dict maps the engine's
    name to phasewatch's key (gauges by sample name, counters and histograms by family).
    Series of one model are summed (several engine cores: vLLM's ``engine`` label).
    Also the label sets of the info families named in `infos`."""
    counters = counters or {}
    histograms = histograms or {}
    out = EngineReading()
    labels: dict[str, list[dict[str, str]]] = {}
    hist_parts: dict[tuple[str, str], dict] = {}
    for family in text_string_to_metric_families(text):
        if family.name in infos:
            labels.setdefault(family.name, []).extend(dict(s.labels) for s in family.samples)
            continue
        c, h = counters.get(family.name), histograms.get(family.name)
        for s in family.samples:
            model = s.labels.get("model_name", model_label or "")
            key = gauges.get(s.name)
            if key is not None and c is None and h is None:
                values = out.gauges.setdefault(model, {})
                values[key] = values.get(key, 0.0) + s.value
            elif c is not None and s.name == family.name + "_total":
                values = out.counters.setdefault(model, {})
                values[c] = values.get(c, 0.0) + s.value
            elif h is not None:
                parts = hist_parts.setdefault((model, h), {"buckets": {}, "sum": 0.0, "count": 0.0})
                if s.name.endswith("_bucket"):
                    le = float(s.labels.get("le", "inf"))
                    parts["buckets"][le] = parts["buckets"].get(le, 0.0) + s.value
                elif s.name.endswith("_sum"):
                    parts["sum"] += s.value
                elif s.name.endswith("_count"):
                    parts["count"] += s.value
    for (model, key), parts in hist_parts.items():
        buckets = sorted(parts["buckets"].items())
        if not buckets or not math.isinf(buckets[-1][0]):
            continue  # not a whole histogram: nothing faithful to re-export
        out.histograms.setdefault(model, {})[key] = EngineHistogram(
            buckets, parts["sum"], parts["count"]
        )
    return out, labels


def finite_gauges(reading: EngineReading) -> None:
    """Drop the gauges an engine exported as NaN or infinite (nothing to show or sum)."""
    for values in reading.gauges.values():
        for key in [k for k, v in values.items() if not math.isfinite(v)]:
            del values[key]
