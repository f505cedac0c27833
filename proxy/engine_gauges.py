"""The engines' own gauges, scraped off the request path and re-exported under phasewatch
names with phasewatch's `upstream` / `model` / `precision` labels (issue 3, point 8).

What each engine exposes about state the proxy cannot see per request:

- vLLM ``/metrics``: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (v0 engine: ``vllm:gpu_cache_usage_perc``), per
  ``model_name``;
- llama-server ``/slots``: slots processing, and tokens held over the slots' context; only
  where ``/slots`` is off (``--no-slots``), ``/metrics`` (``--metrics``):
  ``llamacpp:requests_processing``, ``llamacpp:requests_deferred`` and, on builds that have
  it, ``llamacpp:kv_cache_usage_ratio`` (each scrape of it resets the server's throughput
  gauges for other scrapers, so it is the fallback);
- Ollama ``/api/ps``: the loaded models, their size in VRAM and when they unload.

A scrape that fails leaves the gauges as they were and sets
``phasewatch_engine_scrape_up`` to 0; series of models that went away are removed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .detect import read_bounded

if TYPE_CHECKING:
    from .metrics import Metrics
    from .upstreams import Upstream

log = logging.getLogger("phasewatch")

_VLLM = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv",
}
_LLAMA = {
    "llamacpp:requests_processing": "running",
    "llamacpp:requests_deferred": "waiting",
    "llamacpp:kv_cache_usage_ratio": "kv",
}


def parse_prometheus(text: str, names: dict[str, str], model_label: str | None = None) -> dict:
    """{model_name: {running|waiting|kv: value}} from an engine's /metrics text."""
    out: dict[str, dict[str, float]] = {}
    wanted = set(names)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = names.get(s.name) if s.name in wanted else None
            if key is None:
                continue
            model = s.labels.get("model_name", model_label or "")
            out.setdefault(model, {})
            out[model][key] = out[model].get(key, 0.0) + s.value
    return out


def slots_state(slots) -> dict[str, float]:
    """Running requests and KV-cache use from llama-server's /slots."""
    if not isinstance(slots, list):
        return {}
    running = 0
    ctx = held = 0
    for slot in slots:
        if not isinstance(slot, dict):
            continue
        ctx += slot.get("n_ctx") or 0
        if slot.get("is_processing"):
            running += 1
            held += slot.get("n_prompt_tokens") or 0
            nxt = slot.get("next_token")
            if isinstance(nxt, list) and nxt and isinstance(nxt[0], dict):
                held += nxt[0].get("n_decoded") or 0
    state = {"running": float(running)}
    if ctx:
        state["kv"] = min(1.0, held / ctx)
    return state


def ollama_ps(obj, now: datetime | None = None) -> dict[str, dict[str, float]]:
    """{model: {vram, size, expiry}} from Ollama's /api/ps."""
    now = now or datetime.now(timezone.utc)
    out = {}
    items = obj.get("models") if isinstance(obj, dict) else None
    for item in items or []:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            continue
        state = {"loaded": 1.0, "vram": float(item.get("size_vram") or 0),
                 "size": float(item.get("size") or 0)}
        expires = _parse_time(item.get("expires_at"))
        if expires is not None:
            state["expiry"] = max(0.0, (expires - now).total_seconds())
        out[item["name"]] = state
    return out


def _parse_time(text) -> datetime | None:
    """Go's RFC3339Nano (any number of fraction digits) as an aware datetime."""
    if not isinstance(text, str) or "T" not in text:
        return None
    t = text.replace("Z", "+00:00")
    main, _, rest = t.partition(".")
    if rest:
        n = 0
        while n < len(rest) and rest[n].isdigit():
            n += 1
        digits, tz = rest[:n], rest[n:]
        t = f"{main}.{(digits + '000000')[:6]}{tz}"
    try:
        parsed = datetime.fromisoformat(t)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


class EngineGauges:
    """Scrapes one upstream's state and sets the phasewatch_engine_* gauges."""

    def __init__(self, upstream: "Upstream", metrics: "Metrics") -> None:
        self.u = upstream
        self.m = metrics
        self._series: set[tuple[str, tuple]] = set()

    async def read(self) -> dict[str, dict[str, float]] | None:
        u = self.u
        client = u.client
        if u.engine == "ollama":
            status, body = await read_bounded(client, "GET", "/api/ps")
            return ollama_ps(json.loads(body)) if status == 200 else None
        if u.engine == "llamacpp":
            # /slots first: every /metrics scrape resets llama-server's throughput gauges
            # for whoever else scrapes it; /metrics only where /slots is off (--no-slots)
            only = next(iter(u.models)) if len(u.models) == 1 else ""
            status, body = await read_bounded(client, "GET", "/slots")
            if status == 200:
                state = slots_state(json.loads(body))
                return {only: state} if state else None
            status, body = await read_bounded(client, "GET", "/metrics")
            state = parse_prometheus(body.decode("utf-8", "replace"), _LLAMA, only) if status == 200 else {}
            return state or None
        status, body = await read_bounded(client, "GET", "/metrics")
        return parse_prometheus(body.decode("utf-8", "replace"), _VLLM) if status == 200 else None

    async def scrape(self) -> bool:
        try:
            state = await self.read()
        except (httpx.HTTPError, ValueError, RecursionError):  # TooLarge is a ValueError
            state = None
        self.m.engine_scrape_up.labels(self.u.name, self.u.engine).set(1 if state is not None else 0)
        if state is None:
            return False
        seen = set()
        gauges = {"running": self.m.engine_requests_running,
                  "waiting": self.m.engine_requests_waiting,
                  "kv": self.m.engine_kv_cache_usage_ratio,
                  "loaded": self.m.engine_model_loaded,
                  "vram": self.m.engine_model_vram_bytes,
                  "size": self.m.engine_model_size_bytes,
                  "expiry": self.m.engine_model_expiry_seconds}
        for model, values in state.items():
            label = self.u.model_label(model or None)
            base = (self.u.name, label, self.u.precision_of(label).precision)
            for key, value in values.items():
                gauge = gauges[key]
                gauge.labels(*base).set(value)
                seen.add((key, base))
        for key, base in self._series - seen:  # models that went away (unloaded)
            try:
                gauges[key].remove(*base)
            except KeyError:
                pass
        self._series = seen
        return True

    async def run_forever(self, interval: float) -> None:
        while True:
            if self.u.up:
                await self.scrape()
            await asyncio.sleep(interval)
