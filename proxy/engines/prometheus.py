"""Reading an engine's own Prometheus ``/metrics`` page (vLLM's, llama-server's)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from .base import EngineState


def parse_prometheus(
    text: str, names: dict[str, str], model_label: str | None = None
) -> EngineState:
    """{model_name: {running|waiting|kv: value}} from an engine's /metrics text; `names`
    maps the engine's metric names to those keys."""
    out: EngineState = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = names.get(s.name)
            if key is None:
                continue
            model = s.labels.get("model_name", model_label or "")
            values = out.setdefault(model, {})
            values[key] = values.get(key, 0.0) + s.value
    return out
