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
    Report,
    Row,
    Sample,
    Samples,
    build,
)

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
_SHARED_GAUGES = ("model_kv_bytes_per_token", "engine_kv_cache_capacity_tokens", "engine_slots")


def load(url: str, window: str | None = None, timeout: float = 15.0) -> Samples:
    """Samples from a phasewatch /metrics URL or base URL, or a Prometheus server."""
    import httpx

    base = url.rstrip("/")
    with httpx.Client(timeout=timeout, follow_redirects=True) as client:
        if not base.endswith("/metrics"):
            if _is_prometheus(client, base):
                return from_prometheus(client, base, window)
            base += "/metrics"
        if window:
            raise ValueError("--window needs a Prometheus server (a /metrics page is cumulative)")
        resp = client.get(base)
        resp.raise_for_status()
        return Samples.from_text(resp.text)


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
        resp.raise_for_status()
        data = resp.json()
        if data.get("status") != "success":
            raise ValueError(f"Prometheus query {expr!r} failed: {data.get('error')}")
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
                    _f(r.joules_per_token_at_decode, "{:.2f}", na),
                    _f(r.joules_per_token_all_in, "{:.2f}", na),
                    share,
                    _x(r.decode_speedup),
                    _x(r.prefill_speedup),
                    _pct(r.power_saving) if rep.power else "n/a",
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
            "nothing in flight; J/tok at decode = decode W / decode tok/s (one stream at "
            "decode load: the figure that compares precisions); J/tok all-in = the GPUs' "
            "whole energy (idle and prefill included) / generated tokens (the cost of "
            "owning the GPU at this utilisation: a faster precision idles more and reads "
            "higher here); power saving compares decode W."
        )
        notes += sensor or []
    else:
        notes += sensor or ["Power: n/a (phasewatch is not sampling GPU power here)."]
    notes.append(
        "Speed-ups and savings are against the bf16/fp16 row of the same upstream and model family."
    )
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
        out.append(advice_markdown(advice).rstrip("\n"))
    return "\n".join(out) + "\n"


# --- advice (phasewatch advise; a section of the report) ---------------------------------------


def _shares(shares: dict | None) -> str:
    if not shares:
        return "—"
    return " / ".join(f"{shares[k] * 100:.0f}%" for k in shares)


def advice_markdown(rows: list[AdviceRow]) -> str:
    """The advice rows: per upstream x model x precision, the workload, where time and
    energy go, the formula checked, and the levers by what they would save."""
    out = ["## Advice: which phase to tune", ""]
    if not rows:
        return "\n".join(
            out + ["No measured requests yet: send some traffic through phasewatch first.", ""]
        )
    for a in rows:
        out.append(f"### {a.upstream} / {a.model} ({a.precision})")
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
                f"dominant phase: {a.dominant_phase}"
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
            out.append(
                f"- energy idle / prefill / decode: {_shares(e['shares'])} "
                f"({e.get('samples', 0):.0f} power samples)"
            )
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


def to_json(rep: Report, advice: list[AdviceRow] | None = None) -> str:
    out = rep.as_dict()
    if advice is not None:
        out["advice"] = [a.as_dict() for a in advice]
    return json.dumps(out, indent=2, sort_keys=False)


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
        samples = load(args.source, args.window)
    except (httpx.HTTPError, ValueError) as exc:
        print(f"phasewatch report: cannot read {args.source}: {exc}", file=sys.stderr)
        return 1
    if getattr(args, "by", "model") == "client":
        rows = by_client(samples)
        if args.format == "json":
            sys.stdout.write(json.dumps([r.as_dict() for r in rows], indent=2) + "\n")
        else:
            sys.stdout.write(clients_markdown(rows, args.source))
        return 0
    rep = build(samples, source=args.source)
    advice = advise(samples, rep)
    sensor = sensor_view(samples).lines()
    sys.stdout.write(
        to_json(rep, advice) + "\n" if args.format == "json" else markdown(rep, advice, sensor)
    )
    if args.plot:
        from .plots import report_charts

        for path in report_charts(rep, args.plot):
            print(f"phasewatch report: wrote {path}", file=sys.stderr)
    return 0


def add_reading_arguments(parser) -> None:
    """Where the figures are read from, and how they are written: `report`'s and
    `advise`'s common flags."""
    parser.add_argument(
        "--from",
        dest="source",
        default="http://127.0.0.1:8090",
        help="phasewatch base or /metrics URL, or a Prometheus server URL "
        "[default http://127.0.0.1:8090].",
    )
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
