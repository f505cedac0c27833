"""One bench: the endpoint's models, whether it is a phasewatch proxy (precision from
its ``phasewatch_model_info``, power sampled or not), each model benched, the speed-ups
against the bf16/fp16 model of the same family, and the result."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

import httpx

from ... import __version__
from ...engines import listed_context, served_file
from ...measure.sensor import phase_counts
from ...measure.sensor import view as sensor_view
from ...measure.summary import BASELINES, Samples, model_family
from .client import BenchError, Client
from .power import phasewatch_samples
from .progress import Progress
from .render import warnings
from .scenarios import ModelResult, bench_model


async def _model_list(client: Client) -> list[dict]:
    try:
        resp = await client.http.get("/v1/models")
        data = resp.json().get("data", []) if resp.status_code == 200 else []
    except httpx.TransportError as exc:
        raise BenchError(f"cannot reach {client.base}: {exc}") from exc
    except (httpx.HTTPError, ValueError, AttributeError):
        data = []
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def compare(results: list[ModelResult]) -> None:
    """Speed-ups and power saving against the bf16/fp16 model of the same family."""
    for r in results:
        fam = model_family(r.model)
        base = None
        for p in BASELINES:
            base = next(
                (b for b in results if b.precision == p and model_family(b.model) == fam), None
            )
            if base:
                break
        if base is None:
            continue
        r.baseline = f"{base.model} ({base.precision})"
        if r.decode.get("tok_s") and base.decode.get("tok_s"):
            r.decode_speedup = r.decode["tok_s"] / base.decode["tok_s"]
        mine = {p["target_tokens"]: p["ms_per_token"] for p in r.prefill}
        theirs = {p["target_tokens"]: p["ms_per_token"] for p in base.prefill}
        ratios = [theirs[k] / mine[k] for k in mine if mine[k] and theirs.get(k)]
        if ratios:
            r.prefill_speedup = statistics.median(ratios)
        if r.power.get("decode_watts") and base.power.get("decode_watts"):
            r.power_saving = 1.0 - r.power["decode_watts"] / base.power["decode_watts"]


def _bench_sensor(start: Samples, end: Samples | None, results: list[ModelResult]) -> list[str]:
    """What the sensor resolves, with the phases unresolved and observed counted over the
    bench (the page after its runs less the page before, for the models benched)."""
    view = sensor_view(end or start)
    if not view.sampled or end is None:
        return view.lines()
    models = {r.model for r in results}
    (u0, o0), (u1, o1) = phase_counts(start, models), phase_counts(end, models)
    view.unresolved = {ph: u1.get(ph, 0.0) - u0.get(ph, 0.0) for ph in u1}
    view.unresolved = {ph: n for ph, n in view.unresolved.items() if n > 0}
    view.observed = {ph: o1.get(ph, 0.0) - o0.get(ph, 0.0) for ph in o1}
    view.scope = "in this bench's runs"
    return view.lines()


async def run_bench(opts, progress_stream=sys.stderr) -> dict:
    client = Client(opts.url, opts.api_key, opts.timeout, not opts.no_ignore_eos)
    try:
        listed = await _model_list(client)
        models = opts.model or [m["id"] for m in listed]
        if not models:
            raise BenchError(f"no model given and {client.base}/v1/models lists none; pass --model")
        meta: dict[str, Any] = {
            "roots": {m["id"]: m.get("root") for m in listed if isinstance(m.get("root"), str)},
            "max_len": {m["id"]: listed_context(m) for m in listed if listed_context(m)},
            "phasewatch": {},
            "is_phasewatch": False,
        }
        if len(models) == 1 and models[0] not in meta["roots"]:
            path = await served_file(client.http)  # llama-server's GGUF file (its precision)
            if path is not None:
                meta["roots"][models[0]] = path
        pw = await phasewatch_samples(client)
        meta["power"] = False
        if pw is not None:
            meta["is_phasewatch"] = True
            # GPU power sampled: idle, prefill and decode watts are measured
            meta["power"] = pw.has("phasewatch_gpu_power_sample_watts_count") or pw.has(
                "phasewatch_gpu_power_watts_count"
            )
            # what the sensor resolves (or why power is not sampled), for the table's notes;
            # the demo's own traffic generator, said in one line
            meta["sensor"] = sensor_view(pw).lines()
            shortest = [s.value for s in pw.get("phasewatch_gpu_power_resolution_seconds")]
            meta["min_phase"] = max(shortest) if shortest else None
            meta["demo_rate"] = pw.total("phasewatch_demo_traffic_requests_per_second")
            for s in pw.get("phasewatch_model_info"):
                meta["phasewatch"][s.labels.get("model")] = (
                    s.labels.get("precision", "unknown"),
                    s.labels.get("quant", ""),
                    "phasewatch",
                )
        per_model = max(1, opts.warmup) + opts.repeat * (
            1 + len(opts.prompt_tokens) + len(opts.concurrency)
        )
        progress = Progress(per_model * len(models), opts.quiet, progress_stream)
        if opts.repeat < 3:
            progress.note(
                "note: --repeat 1: one run per figure, no median or spread"
                if opts.repeat == 1
                else f"note: {opts.repeat} runs per figure; medians need at least 3 to mean much"
            )
        started = time.time()
        results = []
        for i, model in enumerate(models):
            results.append(await bench_model(client, model, meta, opts, progress, opts.seed + i))
        compare(results)
        if pw is not None:  # the unresolved phases of the bench's own runs, not the proxy's life
            meta["sensor"] = _bench_sensor(pw, await phasewatch_samples(client), results)
        result = {
            "tool": f"phasewatch bench {__version__}",
            "url": client.base,
            "through_phasewatch": meta["is_phasewatch"],
            "started": started,
            "seconds": round(time.time() - started, 2),
            "repetitions": opts.repeat,
            "max_spread": opts.max_spread,
            "method": (
                "one run per figure"
                if opts.repeat == 1
                else "median of repetitions (min–max in brackets)"
            )
            + "; client-side timing (httpx "
            "streaming); TTFT at the first event carrying content; prefill ms/token = TTFT / "
            "prompt tokens",
            "models": [asdict(r) for r in results],
            "power_sensor": meta.get("sensor") or [],
            "demo_traffic_rate": meta.get("demo_rate") or 0.0,
        }
        result["warnings"] = warnings(result, opts.max_spread)
        return result
    finally:
        await client.aclose()
