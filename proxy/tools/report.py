"""``phasewatch report``: the methodology's table from live traffic.

The table (decode tok/s, prefill ms/token at ~4K and ~16K prompts, TTFT at ~8K, power
under decode load and idle, J/token, speed-ups per precision) is computed by
:mod:`proxy.measure.summary` from phasewatch's own metrics, read here from a ``/metrics``
page or a Prometheus server's HTTP API.
"""

from __future__ import annotations

import json
import sys

from ..measure.metrics import PREFIX, PROMPT_BANDS
from ..measure.summary import (
    BAND_4K,
    BAND_8K,
    BAND_16K,
    BAND_TITLES,
    Report,
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
)
_COUNTERS = ("requests_total", "tokens_total", "gpu_energy_joules_total")
_GAUGES = ("in_flight_requests", "queued_requests", "model_info", "gpu_power_current_watts")


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
    return Samples(items)


# --- rendering ----------------------------------------------------------------------------------


def _f(value: float | None, fmt: str = "{:.1f}", none: str = "—") -> str:
    return none if value is None else fmt.format(value)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f}%"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def markdown(rep: Report) -> str:
    na = "—" if rep.power else "n/a"
    out = []
    if not rep.rows:
        return "No measured requests yet: send some traffic through phasewatch first.\n"
    head = (
        "| upstream | model | precision | decode tok/s | prefill ms/tok ~4K | prefill ms/tok ~16K "
        "| TTFT ~8K | decode W | idle W | J/tok | prefill / decode time | decode speed-up "
        "| prefill speed-up | power saving |"
    )
    out.append(head)
    out.append("|" + "---|" * head.count(" | ") + "---|")
    for r in rep.rows:
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
                    _f(r.decode_tok_s),
                    _f(r.prefill_ms_per_token.get(BAND_4K), "{:.3f}"),
                    _f(r.prefill_ms_per_token.get(BAND_16K), "{:.3f}"),
                    _f(r.ttft_s.get(BAND_8K), "{:.2f} s"),
                    _f(r.decode_watts, "{:.0f}", na),
                    _f(r.idle_watts, "{:.0f}", na),
                    _f(r.joules_per_token, "{:.2f}", na),
                    share,
                    _x(r.decode_speedup),
                    _x(r.prefill_speedup),
                    _pct(r.power_saving) if rep.power else "n/a",
                    "",
                ]
            ).strip()
        )
    out.append("")
    # prompt-band detail: every band that has data
    bands = [
        b
        for b in PROMPT_BANDS
        if any(b in r.ttft_s or b in r.prefill_ms_per_token for r in rep.rows)
    ]
    if bands:
        out.append("By prompt band (median TTFT s / prefill ms per token / decode tok/s):")
        out.append("")
        bh = "| upstream | model | precision | " + " | ".join(BAND_TITLES[b] for b in bands) + " |"
        out.append(bh)
        out.append("|" + "---|" * (3 + len(bands)))
        for r in rep.rows:
            cells = []
            for b in bands:
                cells.append(
                    f"{_f(r.ttft_s.get(b), '{:.2f}')} / "
                    f"{_f(r.prefill_ms_per_token.get(b), '{:.3f}')} / "
                    f"{_f(r.decode_tok_s_by_band.get(b))}"
                )
            out.append(f"| {r.upstream} | {r.model} | {r.precision} | " + " | ".join(cells) + " |")
        out.append("")
    notes = ["Medians from phasewatch's histograms (source: " + (rep.source or "metrics") + ")."]
    srcs = {r.prefill_source for r in rep.rows if r.prefill_source}
    if srcs:
        notes.append(
            "Prefill ms/token = 1000 / median prefill tok/s ("
            + ", ".join(f"source={s}" for s in sorted(srcs))
            + "; proxy-side prefill includes any engine-side queueing)."
        )
    if rep.power:
        notes.append(
            "J/tok = decode-window watts / decode tok/s (one stream); power saving compares "
            "decode-window watts."
        )
    else:
        notes.append("Power: n/a (phasewatch is not sampling GPU power here).")
    notes.append(
        "Speed-ups and savings are against the bf16/fp16 row of the same upstream and model family."
    )
    out.extend("- " + n for n in notes)
    return "\n".join(out) + "\n"


def to_json(rep: Report) -> str:
    return json.dumps(rep.as_dict(), indent=2, sort_keys=False)


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
    rep = build(samples, source=args.source)
    sys.stdout.write(to_json(rep) + "\n" if args.format == "json" else markdown(rep))
    if args.plot:
        from .plots import report_charts

        for path in report_charts(rep, args.plot):
            print(f"phasewatch report: wrote {path}", file=sys.stderr)
    return 0


def add_arguments(parser) -> None:
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
    parser.add_argument(
        "--plot",
        metavar="DIR",
        default=None,
        help="Also draw the table as PNG and SVG charts in DIR (needs matplotlib: "
        "pip install 'phasewatch[plot]').",
    )
