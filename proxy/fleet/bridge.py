"""The router bridge: one upstream's load under the gauge names vLLM exports.

Routers that balance on vLLM's own gauges (llm-d's endpoint picker, the Gateway API
Inference Extension) cannot read llama-server or Ollama, which export other names or
none. phasewatch knows each upstream's load either way, so it writes it in vLLM's names
on ``/phasewatch/upstreams/<name>/metrics``: the engine's own figures where it has them
(vLLM's gauges, llama-server's slots), else phasewatch's own in-flight and queued
counts; a KV-cache use the engine does not report is written as 0 and said so in a
comment.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .upstream import Upstream

NAMES = (
    ("vllm:num_requests_running", "Requests running on the engine."),
    ("vllm:num_requests_waiting", "Requests waiting for the engine (its queue and the proxy's)."),
    ("vllm:kv_cache_usage_perc", "KV-cache use, 0..1."),
)


def _known(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def bridge_metrics(u: Upstream) -> str:
    """The exposition text for one upstream."""
    running, waiting, kv = (_known(v) for v in u.engine_load)
    own_running = float(len(u.active))
    own_waiting = float(u.gate.queued)
    values = (
        running if running is not None else own_running,
        # the proxy's own queue is waiting for this engine as much as the engine's
        (waiting if waiting is not None else 0.0) + own_waiting,
        kv if kv is not None else 0.0,
    )
    model = next(iter(u.models)) if len(u.models) == 1 else ""
    labels = f'{{model_name="{_escape(model)}"}}' if model else ""
    lines = []
    if kv is None:
        lines.append(f"# phasewatch: upstream {u.name} reports no KV-cache use; written as 0")
    for (name, help_text), value in zip(NAMES, values, strict=True):
        lines += [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} gauge",
            f"{name}{labels} {value}",
        ]
    return "\n".join(lines) + "\n"
