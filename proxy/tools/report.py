"""``phasewatch report``: the benchmark table from live traffic.

The table (decode tok/s, prefill ms/token at ~4K and ~16K prompts, TTFT at ~8K, power
under decode load and idle, J/token at decode load and all-in, speed-ups per precision)
is computed by :mod:`proxy.measure.summary` from phasewatch's own metrics, read here
from a ``/metrics`` page or a Prometheus server's HTTP API.
"""

from __future__ import annotations

import json
import sys

from ..measure.advice import AdviceRow, advise
from ..measure.attribution import ClientRow, by_client
from ..measure.metrics import PREFIX, PROMPT_BANDS
from ..measure.sensor import view as sensor_view
from ..measure.summary import (
    BAND_4K,
    BAND_8K,
    BAND_16K,
    BAND_TITLES,
    MIN_FIGURE_REQUESTS,
    Report,
    Row,
    Sample,
    Samples,
    build,
)
from .keys import ENV, NEEDS_KEY, key_of, without_credentials
from .keys import add_arguments as add_key_arguments

# --- reading ---------------------------------------------------------------------------------

#: Every metric the report reads, by type (for the Prometheus API, which needs names).
_HISTOGRAMS = (
    "decode_tokens_per_second",
    "prefill_tokens_per_second",
    "ttft_seconds",
    "prefill_seconds",
    "decode_seconds",
    "gpu_power_watts",
    "gpu_power_sample_watts",
    "time_per_output_token_seconds",
    "kv_cache_bytes",
    # the advice's (proxy.measure.advice)
    "queue_seconds",
    "request_seconds",
    "prompt_tokens",
    "completion_tokens",
    "engine_queue_seconds",
)
_COUNTERS = (
    "requests_total",
    "tokens_total",
    "gpu_energy_joules_total",
    "request_energy_joules_total",
    # the advice's
    "decode_batch_requests_total",
    "decode_batch_seconds_total",
    "decode_batch_tokens_total",
    "engine_preemptions_total",
    # GPU power as the sensor resolves it
    "gpu_power_unresolved_total",
    "request_phase_energy_joules_total",
    "gpu_idle_energy_joules_total",
    "gpu_unattributed_energy_joules_total",
    "request_energy_requests_total",
)
_GAUGES = (
    "in_flight_requests",
    "queued_requests",
    "model_info",
    "gpu_power_current_watts",
    "engine_requests_running",
    "engine_requests_waiting",
    # GPU power as the sensor resolves it
    "power_sampling_up",
    "gpu_power_sensor_info",
    "gpu_power_resolution_seconds",
    "gpu_power_refresh_seconds",
)
#: Gauges every replica reports the same value of (a model's figure, an engine's size).
_SHARED_GAUGES = (
    "model_kv_bytes_per_token",
    "engine_kv_cache_capacity_tokens",
    "engine_slots",
    # energy per token by phase, fitted by each proxy over the GPU's counter
    "gpu_energy_per_token_joules",
    "gpu_power_fitted_watts",
    "gpu_energy_fit_requests",
)


#: Where a client's base URL ends (OpenAI's /v1, Ollama's /api): not phasewatch's own.
_CLIENT_PATHS = ("/v1", "/api")


#: Series every phasewatch exports from its start (an engine's or the simulator's own
#: page may hold other phasewatch_* names, never these).
_OWN = ("endpoint_info", "upstream_up")


class NotPhasewatch(ValueError):
    """What `--from` names answers, but is not a phasewatch (or not its metrics)."""


def load(
    url: str, window: str | None = None, timeout: float = 15.0, key: str | None = None
) -> Samples:
    """Samples from a phasewatch /metrics URL or base URL, or a Prometheus server; `key`
    is presented to a keyed phasewatch (a key in the URL, ``http://any:KEY@host``, is taken
    the same way). Raises ValueError with what to fix: a key needed or refused, a URL
    that is an engine's or a client's ``/v1``, not a phasewatch."""
    import httpx

    base, in_url = without_credentials(url)
    base = base.rstrip("/")
    key = key or in_url
    headers = {"authorization": f"Bearer {key}"} if key else None
    with httpx.Client(timeout=timeout, follow_redirects=True, headers=headers) as client:
        if not base.endswith("/metrics"):
            for suffix in _CLIENT_PATHS:
                if base.endswith(suffix):
                    raise NotPhasewatch(
                        f"{base} is a client's base URL (it ends in {suffix}): give "
                        f"phasewatch's own, {base.removesuffix(suffix)}"
                    )
            if _is_prometheus(client, base):
                samples = from_prometheus(client, base, window)
                if not samples.by_name:
                    raise NotPhasewatch(
                        f"the Prometheus server at {base} has no phasewatch_* series: is it "
                        "scraping phasewatch's /metrics?"
                    )
                return samples
            base += "/metrics"
        if window:
            raise ValueError("--window needs a Prometheus server (a /metrics page is cumulative)")
        resp = client.get(base)
        _answered(resp, base, key)
        try:
            samples = Samples.from_text(resp.text)
        except ValueError:
            samples = Samples(())
        if not any(samples.has(PREFIX + name) for name in _OWN):
            raise NotPhasewatch(_not_phasewatch(base, samples))
        return samples


def _answered(resp, url: str, key: str | None) -> None:
    """Raise ValueError with what to do for an answer that is not the metrics page."""
    status = resp.status_code
    if status == 200:
        return
    if status == 401:
        raise ValueError(
            f"the key given was refused (HTTP 401 from {url}): check --api-key, {ENV} "
            "or the key in the URL"
            if key
            else NEEDS_KEY
        )
    if status == 429:
        wait = resp.headers.get("retry-after", "")
        wait = f" in {wait}s" if wait.isdigit() else " later"
        raise ValueError(
            f"too many wrong keys from this address (HTTP 429 from {url}): retry{wait}"
        )
    raise NotPhasewatch(
        f"this is not a phasewatch, or not its metrics address: GET {url} answered "
        f"HTTP {status} (give phasewatch's base URL, or its --metrics-host address)"
    )


def _not_phasewatch(url: str, samples: Samples) -> str:
    """Why a metrics page is not phasewatch's, naming what it seems to be."""
    names = sorted(samples.by_name)
    engines = {"vllm:": "vLLM", "llamacpp:": "llama-server", "sglang:": "SGLang"}
    seen = next((e for p, e in engines.items() if any(n.startswith(p) for n in names)), None)
    if seen:
        what = f"it is {seen}'s own metrics"
    elif names:
        what = f"{len(names)} series, none of phasewatch's own"
    else:
        what = "no Prometheus metrics at all"
    return (
        f"this is not a phasewatch ({url}: {what}): give phasewatch's URL, its --port (or "
        "--metrics-host address), not the engine's"
    )


def _is_prometheus(client, base: str) -> bool:
    try:
        resp = client.get(base + "/api/v1/status/buildinfo")
        return resp.status_code == 200 and resp.json().get("status") == "success"
    except Exception:  # noqa: BLE001 - anything else is not a Prometheus server
        return False


def from_prometheus(client, base: str, window: str | None = None) -> Samples:
    """Instant queries, summed over the scrape's own labels (instance, job); with a
    window, the increase of counters and histograms over it (live rates, not totals)."""
    items = []

    def query(expr: str, name: str) -> None:
        resp = client.get(base + "/api/v1/query", params={"query": expr})
        try:
            data = resp.json()
        except ValueError:
            data = {}
        if resp.status_code != 200 or data.get("status") != "success":
            why = data.get("error") or f"HTTP {resp.status_code}"
            raise ValueError(f"Prometheus query {expr!r} failed: {why}")
        for r in data["data"]["result"]:
            labels = {k: v for k, v in r["metric"].items() if k != "__name__"}
            items.append(Sample(name, labels, float(r["value"][1])))

    def cumulative(name: str) -> None:
        metric = PREFIX + name
        inner = f"increase({metric}[{window}])" if window else metric
        query(f"sum without (instance, job) ({inner})", metric)

    for h in _HISTOGRAMS:
        for part in ("_bucket", "_sum", "_count"):
            cumulative(h + part)
    for c in _COUNTERS:
        cumulative(c)
    for g in _GAUGES:
        query(f"sum without (instance, job) ({PREFIX + g})", PREFIX + g)
    for g in _SHARED_GAUGES:
        query(f"max without (instance, job) ({PREFIX + g})", PREFIX + g)
    return Samples(items)


# --- rendering ----------------------------------------------------------------------------------


def _f(value: float | None, fmt: str = "{:.1f}", none: str = "—") -> str:
    return none if value is None else fmt.format(value)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f}%"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _n(r: Row, key: str, text: str, extra: str = "") -> str:
    """A derived figure with the requests it rests on (and its band) beside it; "—" with
    the count where too few requests stand behind it (the note says why)."""
    n = r.counts.get(key)
    if n is None:
        return text
    return f"{text} (n={n:.0f}{', ' + extra if extra and text != '—' else ''})"


def _row_name(r: Row) -> str:
    return f"{r.upstream} / {r.model} ({r.precision})"


def _sources(rows: list[Row], attr: str, meaning: dict[str, str]) -> str:
    """Which source each row's figure came from: ``source=proxy (…) for every row``, or
    per source the rows it served."""
    by: dict[str, list[str]] = {}
    for r in rows:
        src = getattr(r, attr)
        if src is not None:
            by.setdefault(src, []).append(_row_name(r))
    if not by:
        return ""
    if len(by) == 1:
        (src,) = by
        return f"source={src} ({meaning[src]}) for every row"
    return "; ".join(
        f"source={src} ({meaning[src]}) for {', '.join(names)}" for src, names in sorted(by.items())
    )


_DECODE_SOURCES = {
    "proxy": "phasewatch's own clock: first to last output event of a streamed answer",
    "engine": "the engine's own decode time, where only unstreamed answers were seen",
}
_PREFILL_SOURCES = {
    "engine": "the engine's own prefill time, which leaves out any wait in its queue",
    "proxy": "phasewatch's own clock: request sent to first output event, so any wait "
    "in the engine's queue is included",
}


def markdown(
    rep: Report, advice: list[AdviceRow] | None = None, sensor: list[str] | None = None
) -> str:
    """The table and its notes; `advice`: the advice rows; `sensor`: what the GPU power
    sensor resolves, or why power is not sampled (:mod:`proxy.measure.sensor`)."""
    na = "—" if rep.power else "n/a"
    out = []
    rows = [r for r in rep.rows if r.measured]
    if not rows:
        return "No measured requests yet: send some traffic through phasewatch first.\n"
    head = (
        "| upstream | model | precision | requests | errors / aborted | decode tok/s "
        "| prefill ms/tok ~4K | prefill ms/tok ~16K | TTFT ~8K | decode W | idle W "
        "| J/tok at decode | J/tok all-in "
        "| prefill / decode time | decode speed-up | prefill speed-up | power saving "
        "| TPOT ms | KV B/tok |"
    )
    out.append(head)
    out.append("|" + "---|" * head.count(" | ") + "---|")
    for r in rows:
        prec = r.precision + (f" ({r.quant})" if r.quant and r.quant.lower() != r.precision else "")
        share = (
            f"{r.share_prefill * 100:.0f}% / {r.share_decode * 100:.0f}%"
            if r.share_prefill is not None and r.share_decode is not None
            else "—"
        )
        out.append(
            " | ".join(
                [
                    "",
                    r.upstream,
                    r.model,
                    prec,
                    f"{r.requests:.0f}",
                    f"{r.errors:.0f} / {r.aborted:.0f}",
                    _f(r.decode_tok_s),
                    _f(r.prefill_ms_per_token.get(BAND_4K), "{:.3f}"),
                    _f(r.prefill_ms_per_token.get(BAND_16K), "{:.3f}"),
                    _f(r.ttft_s.get(BAND_8K), "{:.2f} s"),
                    _f(r.decode_watts, "{:.0f}", na),
                    _f(r.idle_watts, "{:.0f}", na),
                    _n(
                        r,
                        "joules_per_token_at_decode",
                        _f(r.joules_per_token_at_decode, "{:.2f}", na),
                    ),
                    _f(r.joules_per_token_all_in, "{:.2f}", na),
                    share,
                    _n(r, "decode_speedup", _x(r.decode_speedup)),
                    _n(
                        r,
                        "prefill_speedup",
                        _x(r.prefill_speedup),
                        BAND_TITLES.get(r.prefill_speedup_band or "", ""),
                    ),
                    _n(
                        r,
                        "power_saving",
                        _pct(r.power_saving) if rep.power else "n/a",
                        f"batch {r.decode_batch}" if r.decode_batch else "",
                    ),
                    _f(r.tpot_ms, "{:.2f}"),
                    _kv(r.kv_bytes_per_token, r.kv_dtype),
                    "",
                ]
            ).strip()
        )
    out.append("")
    # prompt-band detail: every band that has data
    bands = [
        b for b in PROMPT_BANDS if any(b in r.ttft_s or b in r.prefill_ms_per_token for r in rows)
    ]
    if bands:
        out.append("By prompt band (median TTFT s / prefill ms per token / decode tok/s):")
        out.append("")
        bh = "| upstream | model | precision | " + " | ".join(BAND_TITLES[b] for b in bands) + " |"
        out.append(bh)
        out.append("|" + "---|" * (3 + len(bands)))
        for r in rows:
            cells = []
            for b in bands:
                cells.append(
                    f"{_f(r.ttft_s.get(b), '{:.2f}')} / "
                    f"{_f(r.prefill_ms_per_token.get(b), '{:.3f}')} / "
                    f"{_f(r.decode_tok_s_by_band.get(b))}"
                )
            out.append(f"| {r.upstream} | {r.model} | {r.precision} | " + " | ".join(cells) + " |")
        out.append("")
    out.extend(kv_section(rep))
    notes = [
        "Medians from phasewatch's histograms (read from: " + (rep.source or "metrics") + "). "
        "requests: every outcome; errors: failed or refused; aborted: the client hung up."
    ]
    engines = {r.upstream: r.engine for r in rows if r.engine}
    if engines:
        notes.append(
            "engines: " + ", ".join(f"{u} = {e}" for u, e in sorted(engines.items())) + "."
        )
    decode = _sources(rows, "decode_source", _DECODE_SOURCES)
    if decode:
        notes.append(f"decode tok/s: {decode}.")
    prefill = _sources(rows, "prefill_source", _PREFILL_SOURCES)
    if prefill:
        notes.append(f"prefill ms/tok = 1000 / median prefill tok/s: {prefill}.")
    notes.append(
        "TTFT: phasewatch's own clock, request received to first output event forwarded "
        "(what the client waits); prefill / decode time: phasewatch's own clock (source=proxy)."
    )
    if rep.power:
        notes.append(
            "decode W: the GPU's energy over each request's decode window (the sensor's "
            "energy counter, at its resolution) / the window's length, for the phases the "
            "sensor resolves; idle W: GPU samples with "
            "nothing in flight; J/tok at decode = decode W / one stream's median decode "
            "tok/s (at batch 1 the energy per token, at larger batches an upper bound: the "
            "figure that compares precisions); J/tok all-in = the GPUs' "
            "whole energy (idle and prefill included) / generated tokens (the cost of "
            "owning the GPU at this utilisation: a faster precision idles more and reads "
            "higher here); power saving compares the mean decode W over this traffic's "
            "decode windows with the baseline's over its own, at whatever batch each ran "
            "(the batch most decode time was spent at is beside it)."
        )
        notes += sensor or []
    else:
        notes += sensor or ["Power: n/a (phasewatch is not sampling GPU power here)."]
    notes.append(
        "Speed-ups and savings are against the bf16/fp16 row of the same upstream and model "
        f"family, shown once both rows have {MIN_FIGURE_REQUESTS} requests behind them; n: "
        "the fewer of the two, with the prompt band of a prefill speed-up."
    )
    unresolved = [
        f"{_row_name(r)} {k.replace('_', ' ')}: {why}"
        for r in rows
        for k, why in r.unresolved.items()
    ]
    if unresolved:
        notes.append("Not shown: " + "; ".join(unresolved) + ".")
    left = [r for r in rep.rows if not r.measured and r.requests]
    if left:
        notes.append(
            "Left out, nothing measured: "
            + "; ".join(
                f"{_row_name(r)}: {r.requests:.0f} requests, {r.errors:.0f} errors, "
                f"{r.aborted:.0f} aborted"
                for r in left
            )
            + "."
        )
    out.extend("- " + n for n in notes)
    if advice is not None:
        out.append("")
        engines = {r.upstream: r.engine for r in rep.rows if r.engine}
        out.append(advice_markdown(advice, engines).rstrip("\n"))
    return "\n".join(out) + "\n"


# --- advice (phasewatch advise; a section of the report) ---------------------------------------


def _shares(shares: dict | None) -> str:
    if not shares:
        return "—"
    return " / ".join(f"{shares[k] * 100:.0f}%" for k in shares)


def advice_markdown(rows: list[AdviceRow], engines: dict[str, str] | None = None) -> str:
    """The advice rows: per upstream x model x precision, the workload, where time and
    energy go, the formula checked, and the levers by what they would save; `engines`:
    the engine behind each upstream, named beside it."""
    out = ["## Advice: which phase to tune", ""]
    if not rows:
        return "\n".join(
            out + ["No measured requests yet: send some traffic through phasewatch first.", ""]
        )
    for a in rows:
        engine = (engines or {}).get(a.upstream)
        up = f"{a.upstream} ({engine})" if engine else a.upstream
        out.append(f"### {up} / {a.model} ({a.precision})")
        out.append("")
        out.append(
            f"- workload: {a.workload or '—'} ({a.workload_evidence}); "
            f"{a.requests:.0f} requests measured"
        )
        if a.shares:
            s = a.seconds
            out.append(
                f"- wall time queue / prefill / decode: {_shares(a.shares)} "
                f"(mean {s['queue']:.2f} / {s['prefill']:.2f} / {s['decode']:.2f} s per request); "
                f"dominant phase: {a.dominant_phase or '— (too few requests to say)'}"
            )
        f = a.formula
        if f:
            out.append(
                f"- formula: {f['prompt_tokens']:,.0f} prompt tokens / "
                f"{f['prefill_tok_s']:,.0f} tok/s "
                f"+ {f['output_tokens']:,.0f} output tokens / {f['decode_tok_s']:,.1f} tok/s "
                f"= {f['predicted_s']:.2f} s predicted; {f['measured_s']:.2f} s measured "
                f"(prefill + decode, {f['ratio']:.2f}×)"
                + (f"; whole request {f['request_s']:.2f} s" if f.get("request_s") else "")
            )
        e = a.energy
        if e.get("shares"):
            basis = (
                f"from the GPUs' energy counters, over {e.get('requests', 0):.0f} requests"
                if e.get("basis") == "energy counters"
                else f"{e.get('samples', 0):.0f} power samples"
            )
            out.append(f"- energy idle / prefill / decode: {_shares(e['shares'])} ({basis})")
        else:
            out.append(f"- energy: {e.get('note', 'unavailable')}")
        if a.note:
            out.append(f"- {a.note}")
        for i, lv in enumerate(a.levers, 1):
            tag = "measured" if lv.measured else "expected, not measured"
            out.append(
                f"{i}. **{lv.title}** [{lv.phase}; {tag}]: {lv.expected_effect.summary}. "
                f"Evidence: {lv.evidence}." + (f" ({lv.caveat})" if lv.caveat else "")
            )
        out.append("")
    return "\n".join(out) + "\n"


def _kv(per_token: float | None, dtype: str) -> str:
    return "unknown" if per_token is None else f"{per_token:,.0f} ({dtype})"


def _bytes(value: float | None) -> str:
    if value is None:
        return "—"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def kv_section(rep: Report) -> list[str]:
    """The KV-cache table: per token, per median request, the engine's capacity and how
    many median requests it holds at once."""
    out = [
        "KV cache (2 × layers × kv_heads × head_dim × bytes per element; sliding-window "
        "models: the full-attention upper bound per token):",
        "",
        "| upstream | model | precision | KV B/tok (cache type) | median KV per request "
        "| capacity tokens | median requests that fit |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rep.rows:
        fit = _f(r.kv_fit_requests, "{:,.0f}")
        if r.engine_slots and r.kv_fit_requests == r.engine_slots:
            fit += f" (the engine's {r.engine_slots:.0f} slots)"
        out.append(
            f"| {r.upstream} | {r.model} | {r.precision} | {_kv(r.kv_bytes_per_token, r.kv_dtype)} "
            f"| {_bytes(r.kv_request_bytes)} | {_f(r.kv_capacity_tokens, '{:,.0f}')} "
            f"| {fit} |"
        )
    out.append("")
    return out


def to_json(
    rep: Report, advice: list[AdviceRow] | None = None, energy: list[dict] | None = None
) -> str:
    out = rep.as_dict()
    if advice is not None:
        out["advice"] = [a.as_dict() for a in advice]
    if energy is not None:
        out["energy"] = energy
    return json.dumps(out, indent=2, sort_keys=False)


def energy_rows(source: str, samples: Samples, timeout: float = 15.0) -> list[dict]:
    """Energy per token by phase, the rows of ``GET /phasewatch/api/energy``: asked of
    a phasewatch URL (with the reasons of what is unresolved), else (a Prometheus
    server, or a proxy that does not answer it) read back from the ``energy_*`` gauges."""
    import httpx

    base = source.rstrip("/").removesuffix("/metrics")
    try:
        resp = httpx.get(base + "/phasewatch/api/energy", timeout=timeout)
        if resp.status_code == 200 and isinstance(resp.json(), list):
            return resp.json()
    except (httpx.HTTPError, ValueError):
        pass
    return energy_from_gauges(samples)


def energy_from_gauges(samples: Samples) -> list[dict]:
    """The energy rows from the ``gpu_energy_*`` gauges: the figures that are resolved;
    the others say only that they are not (the reason is the proxy's to give)."""
    rows: dict[tuple[str, str, str], dict] = {}
    for s in samples.get(PREFIX + "gpu_energy_fit_requests"):
        key = (
            s.labels.get("upstream", ""),
            s.labels.get("model", ""),
            s.labels.get("precision", ""),
        )
        row = rows.setdefault(
            key,
            {"upstream": key[0], "model": key[1], "precision": key[2], "unattributed_joules": 0.0},
        )
        phase = s.labels.get("phase", "")
        lab = dict(zip(("upstream", "model", "precision"), key), phase=phase)
        got = {
            b.labels.get("bound"): b.value
            for b in samples.get(PREFIX + "gpu_energy_per_token_joules", **lab)
        }
        watts = samples.get(PREFIX + "gpu_power_fitted_watts", **lab)
        if "estimate" in got:
            row[phase] = {
                "joules_per_token": got["estimate"],
                "watts": watts[0].value if watts else None,
                "low": got.get("low"),
                "high": got.get("high"),
                "requests": int(s.value),
            }
        else:
            row[phase] = {"unresolved": "not within ±10 % yet", "requests": int(s.value)}
    return [rows[k] for k in sorted(rows)]


def clients_markdown(rows: list[ClientRow], source: str) -> str:
    """``--by client``: requests, tokens and energy per client."""
    if not rows:
        return "No measured requests yet: send some traffic through phasewatch first.\n"
    power = any(r.energy_joules is not None for r in rows)
    na = "—" if power else "n/a"
    out = [
        "| client | requests | ok | errors | aborted | prompt tokens | cached | "
        "completion tokens | energy J | Wh | J/tok attributed | energy settled / unresolved |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        energy = r.energy_joules
        wh = None if energy is None else energy / 3600
        out.append(
            f"| {r.client} | {r.requests:.0f} | {r.ok:.0f} | {r.errors:.0f} | {r.aborted:.0f} "
            f"| {r.prompt_tokens:.0f} | {r.cached_tokens:.0f} | {r.completion_tokens:.0f} "
            f"| {_f(energy, '{:.1f}', na)} | {_f(wh, '{:.3f}', na)} "
            f"| {_f(r.joules_per_token, '{:.3f}', na)} "
            f"| {r.energy_settled:.0f} / {r.energy_unresolved:.0f} |"
        )
    out.append("")
    out.append(f"- From phasewatch's counters (source: {source}).")
    out.append(
        "- client: the name of a named key (--api-key NAME=KEY), else a --client-header "
        "value listed in --clients ('other' for any other value, 'unknown' for none)."
    )
    if power:
        out.append(
            "- Energy: each request's share of its GPUs' energy from sending it upstream to "
            "its last token (split evenly among the requests running on the GPU, the "
            "engine's count when it gives one); idle energy is nobody's, and other "
            "clients' of the engine is unattributed. energy settled / unresolved: the "
            "requests it rests on, and those too short for the sampling or never "
            "covered by the sensor; each request's own is its `msg=energy` log line."
        )
    else:
        out.append("- Energy: n/a (phasewatch is not sampling GPU power here).")
    return "\n".join(out) + "\n"


def run(args) -> int:
    import httpx

    if args.plot:
        from .plots import PlotError, require

        try:
            require()
        except PlotError as exc:
            print(f"phasewatch report: {exc}", file=sys.stderr)
            return 2
    try:
        source, samples = read(args)
    except (httpx.HTTPError, ValueError) as exc:
        print(f"phasewatch report: {exc}", file=sys.stderr)
        return 1
    if getattr(args, "by", "model") == "client":
        rows = by_client(samples)
        if args.format == "json":
            sys.stdout.write(json.dumps([r.as_dict() for r in rows], indent=2) + "\n")
        else:
            sys.stdout.write(clients_markdown(rows, source))
        return 0
    rep = build(samples, source=source)
    advice = advise(samples, rep)
    sensor = sensor_view(samples).lines()
    sys.stdout.write(
        to_json(rep, advice, energy_rows(args.source, samples)) + "\n"
        if args.format == "json"
        else markdown(rep, advice, sensor)
    )
    if args.plot:
        from .plots import report_charts

        for path in report_charts(rep, args.plot):
            print(f"phasewatch report: wrote {path}", file=sys.stderr)
    return 0


def read(args) -> tuple[str, Samples]:
    """`report`'s and `advise`'s reading: the source as it may be shown (without a key in
    its URL) and its samples. Raises ValueError (or httpx's error for a connection that
    failed), its message saying what was read and what to fix."""
    import httpx

    source = without_credentials(args.source)[0]
    key = key_of(args)
    try:
        return source, load(args.source, args.window, key=key)
    except NotPhasewatch:
        raise
    except ValueError as exc:
        raise ValueError(f"cannot read {source}: {exc}") from None
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot read {source}: {exc or type(exc).__name__}") from None


def add_reading_arguments(parser) -> None:
    """Where the figures are read from, and how they are written: `report`'s and
    `advise`'s common flags."""
    parser.add_argument(
        "--from",
        dest="source",
        default="http://127.0.0.1:8090",
        help="phasewatch base or /metrics URL, or a Prometheus server URL "
        "[default http://127.0.0.1:8090]; a keyed phasewatch takes --api-key (a key in "
        "the URL, http://any:KEY@host:port, is read the same way and never printed).",
    )
    add_key_arguments(parser)
    parser.add_argument(
        "--format",
        choices=("markdown", "json"),
        default="markdown",
        help="Output format [default markdown].",
    )
    parser.add_argument(
        "--window",
        default=None,
        help="With a Prometheus server: only traffic of the last WINDOW "
        "(a PromQL duration such as 15m or 1h); default: everything since start.",
    )


def add_arguments(parser) -> None:
    add_reading_arguments(parser)
    parser.add_argument(
        "--by",
        choices=("model", "client"),
        default="model",
        help="model: the per-precision table [default]; client: requests, tokens and "
        "energy per client (chargeback).",
    )
    parser.add_argument(
        "--plot",
        metavar="DIR",
        default=None,
        help="Also draw the table as PNG and SVG charts in DIR (needs matplotlib: "
        "pip install 'phasewatch[plot]').",
    )
